"""The committer's ``apply_step`` at its edges, on a ``CachePool`` in real shared memory.

Each test kills a mutant that survived the rest of the suite (mutation review of the committer, 2026-12-06):
a tid at the top of int64 on the fast path, done tids of a two-key step whose keys carry other tids, rows
larger than one gather piece, a gather larger than the first, and a layout with a dimension of 0 or less; and
(stop 60) a two-key step whose first key has no rows, and one bounded by the smaller of its keys' stagings.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from omnishm import protocol, shm
from omnishm.committer.pool import CachePool, PoolError
from omnishm.versions import MAX_STEP, make_cv

from helpers import pack

CLIENT = "c" * 32
EPOCH = 1  # the writer CLIENT's epoch
MAX_I8 = (1 << 63) - 1


@pytest.fixture
def pool():
    p = CachePool(f"tedge{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8])
    try:
        yield p
    finally:
        p.close()
        assert shm.list_segments(p.name) == []


def _key(pool: CachePool, width: int, num_blocks: int, block_size: int, staging_rows: int, key: str = "h"):
    """Lay the pool out (once) and open ``key`` with float32 rows of ``width``, its staging filled at random."""
    if pool.layout is None:
        pool.set_layout(protocol.Layout(num_blocks=num_blocks, block_size=block_size))
    state = pool.open_key(key, protocol.KeySpec("float32", width, (width,)))
    staging = pool.ensure_staging(CLIENT, state, staging_rows)
    gen = torch.Generator().manual_seed(11)
    torch.from_numpy(staging.data).copy_(torch.randint(0, 256, tuple(staging.data.shape), generator=gen,
                                                       dtype=torch.uint8))
    return state, staging


def _gathered_step(pool: CachePool, state, staging, slots: list[int], src: list[int], step: int) -> None:
    """One row per tid, on the general path (the fast path declined); every row lands in its slot."""
    pool._apply_repeated = lambda *_a, **_k: None
    n = len(slots)
    cvs = [make_cv(EPOCH, step, j + 1) for j in range(n)]
    state.claim[np.asarray(slots)] = cvs
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=step, step=step, keys=[state.name], key_idx=pack([0] * n), tids=pack(range(n)), cvs=pack(cvs),
        src_rows=pack(src), counts=pack([1] * n), slots=pack(slots)), EPOCH)
    assert (done.rows_written, done.rows_skipped, done.reason) == (n, 0, ""), done
    for s, r in zip(slots, src):
        assert np.array_equal(state.data[s], staging.data[r]), (slots, src, s, r)


def test_a_fast_path_step_whose_first_tid_is_the_largest_int64_is_applied(pool):
    """MUTATION (2026-12-06): without the ``first <= MAX - n`` bound, the fast path's "tids are one run"
    shortcut built ``arange(MAX, MAX + 3)`` for tids [MAX, 0, 1], and its OverflowError escaped
    ``apply_step``, which never raises, on a valid step."""
    state, staging = _key(pool, 4, num_blocks=2, block_size=4, staging_rows=8)
    taken = []
    fast = pool._apply_repeated
    pool._apply_repeated = lambda *a, **k: taken.append(fast(*a, **k)) or taken[-1]
    tids = [MAX_I8, 0, 1]
    cvs = [make_cv(EPOCH, 1, j + 1) for j in range(3)]
    state.claim[[0, 1, 2]] = cvs
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h"], key_idx=pack([0] * 3), tids=pack(tids), cvs=pack(cvs), src_rows=pack([0, 1, 2]),
        counts=pack([1, 1, 1]), slots=pack([0, 1, 2])), EPOCH)
    assert taken and taken[0] is not None  # the fast path took it
    assert (done.rows_written, done.reason, done.done_tids) == (3, "", pack(sorted(tids))), done
    assert np.array_equal(state.data[:3], staging.data[:3])


def test_done_tids_of_a_two_key_step_name_every_tid_of_every_key(pool):
    """MUTATION (2026-12-06): with the fast path's per-key tid check dropped, a two-key step whose keys carry
    different tids ([5] and [3]) came back with done tids [5]: tid 3 landed and was never reported done."""
    for key in ("h", "m"):
        _key(pool, 4, num_blocks=2, block_size=4, staging_rows=8, key=key)
    cv1, cv2 = make_cv(EPOCH, 1, 1), make_cv(EPOCH, 1, 2)
    pool.keys["h"].claim[0] = cv1
    pool.keys["m"].claim[1] = cv2
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h", "m"], key_idx=pack([0, 1]), tids=pack([5, 3]), cvs=pack([cv1, cv2]),
        src_rows=pack([0, 0]), counts=pack([1, 1]), slots=pack([0, 1])), EPOCH)
    assert (done.rows_written, done.reason, done.done_tids) == (2, "", pack([3, 5])), done


def test_rows_larger_than_a_gather_piece_are_gathered_one_at_a_time(pool):
    """MUTATION (2026-12-06): rows of 8 MiB (over ``GATHER_BYTES``) with a gather piece of 0 rows
    (``max(0, ...)`` for ``max(1, ...)``) raised on ``range(..., step=0)``: rows staged out of order never
    landed. Reversed staging rows make every run one row, gathered in pieces of one."""
    state, staging = _key(pool, 1 << 21, num_blocks=1, block_size=4, staging_rows=4)
    assert state.gather_rows == 1
    _gathered_step(pool, state, staging, [0, 1, 2], [3, 1, 0], step=1)


def test_the_gather_buffer_grows_for_a_later_larger_gather(pool):
    """MUTATION (2026-12-06): a gather buffer kept at the size of the first gather (64 rows here) made a later
    gather of 100 rows fail on its shape."""
    state, staging = _key(pool, 8, num_blocks=32, block_size=4, staging_rows=128)
    _gathered_step(pool, state, staging, [0, 1], [1, 0], step=1)
    _gathered_step(pool, state, staging, list(range(100)), np.random.default_rng(3).permutation(100).tolist(),
                   step=2)


@pytest.mark.parametrize("num_blocks,block_size", [(4, 0), (4, -2), (0, 4), (-1, -4)])
def test_a_layout_with_a_dimension_of_zero_or_less_is_refused(pool, num_blocks, block_size):
    """MUTATION (2026-12-06): without the ``block_size <= 0`` check a layout of 0 or negative slots was taken."""
    with pytest.raises(PoolError) as err:
        pool.set_layout(protocol.Layout(num_blocks=num_blocks, block_size=block_size))
    assert err.value.code == "bad_layout"
    assert pool.layout is None


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_one_entry_step_with_a_negative_staging_row_is_refused_on_the_fast_path(pool, count):
    """Mutation review (2026-12-06): a StepWrite naming a staging row below 0 is refused whole (``failed_tids`` names its tid,
    ``reason`` names the offending staging rows) and leaves the pool's rows and commit words untouched,
    whichever path takes it; ``apply_step`` never raises. A manager-shaped one-entry step (one key,
    key_idx 0, counts summing to the slots sent) passes every other fast-path check with ``src_rows=[-1]``
    (r1 - r0 == total, r1 <= rows), so only the fast path's ``0 <= r0`` bound stands between it and a
    slice ``staging[-1:count-1]`` (the last staging row, or an empty slice that fails to broadcast)."""
    pool.set_layout(protocol.Layout(num_blocks=2, block_size=4))
    state = pool.open_key("h", protocol.KeySpec("float32", 4, (4,)))
    staging = pool.ensure_staging(CLIENT, state, 8)
    torch.from_numpy(staging.data).copy_(torch.arange(staging.data.size, dtype=torch.uint8).view(staging.data.shape))
    before = state.data.copy()
    slots = list(range(count))
    cv = make_cv(EPOCH, 1, 1)
    state.claim[slots] = cv
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h"], key_idx=pack([0]), tids=pack([7]), cvs=pack([cv]), src_rows=pack([-1]),
        counts=pack([count]), slots=pack(slots)), EPOCH)
    assert (done.done_tids, done.failed_tids, done.rows_written) == (b"", pack([7]), 0), done
    assert "staging rows -1" in done.reason, done.reason
    assert np.array_equal(state.data, before)
    assert not state.commit[slots].any()


@pytest.mark.parametrize("counts, slots", [([1 << 62] * 4, []), ([MAX_I8, 1], []), ([1 << 62] * 4 + [2], [0, 1])])
def test_counts_whose_sum_wraps_int64_are_refused_naming_the_count(pool, counts, slots):
    """Bad-input review (2026-12-06): counts whose int64 sum wraps around (to the number of slots sent, or
    to a negative number) are refused whole, naming the first entry whose count is above the slots sent,
    and the pool is left untouched. Before, the reason read "counts sum to -9223372036854775808 rows", and
    a sum wrapped to exactly the slots' number was caught only by the staging bound further on."""
    state, _staging = _key(pool, 4, 2, 4, 8)
    before = state.data.copy()
    n = len(counts)
    cv = make_cv(EPOCH, 1, 1)
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h"], key_idx=pack([0] * n), tids=pack(range(10, 10 + n)), cvs=pack([cv] * n),
        src_rows=pack([0] * n), counts=pack(counts), slots=pack(slots)), EPOCH)
    assert (done.done_tids, done.failed_tids, done.rows_written) == (b"", pack(range(10, 10 + n)), 0), done
    want = f"step 1: entry 0 (tid 10) has count above the {len(slots)} slots sent: {counts[0]}"
    assert done.reason == want, done.reason
    assert np.array_equal(state.data, before)


# Stop 52's mutation review of apply.py (29 mutants, 25 killed by the suite): four gaps. A broken message takes the
# general path in both pools of the fast path's differential test, so its validation went untested there.
STAGING = 8


def _write(pool, keys, key_idx, tids, cvs, src, counts, slots, step=1):
    return pool.apply_step(CLIENT, protocol.StepWrite(
        rid=step, step=step, keys=keys, key_idx=pack(key_idx), tids=pack(tids), cvs=pack(cvs), src_rows=pack(src),
        counts=pack(counts), slots=pack(slots)), EPOCH)


def _untouched(state, before):
    assert np.array_equal(state.data, before) and not state.commit.any()


def test_an_out_of_range_slot_is_named_with_the_entry_it_belongs_to(pool):
    """A refusal names the offending entry: a slot out of range that is the FIRST row of entry 1 is reported as
    entry 1 (tid 11), not entry 0. Kills M07 (``side="left"`` in the row-to-entry search named entry 0)."""
    state, _ = _key(pool, 4, 4, 4, STAGING)
    cvs = [make_cv(EPOCH, 1, 1), make_cv(EPOCH, 1, 2)]
    before = state.data.copy()
    done = _write(pool, ["h"], [0, 0], [10, 11], cvs, [0, 2], [2, 1], [0, 1, 99])
    assert "entry 1 (tid 11) slot 99 out of range 0..15" in done.reason, done.reason
    _untouched(state, before)


def test_a_two_key_step_bounds_a_keys_rows_not_its_entries_by_its_staging(pool):
    """A staged row goes to one slot: in a step of two keys, key 'm' writing 2 entries of a full staging each
    (16 rows of 8 staging rows, every entry within the staging) is refused whole, naming its rows. Kills M17
    (the per-key bound counted entries, not rows: 2 <= 8 passed, and each staging row was copied twice)."""
    h, _ = _key(pool, 4, 4, 4, STAGING)
    m, _ = _key(pool, 4, 4, 4, STAGING, key="m")
    cv = make_cv(EPOCH, 1, 1)
    h.claim[0] = cv
    m.claim[:] = cv
    before_h, before_m = h.data.copy(), m.data.copy()
    done = _write(pool, ["h", "m"], [0, 1, 1], [5, 6, 7], [cv] * 3, [0, 0, 0], [1, STAGING, STAGING],
                  [0] + list(range(16)))
    assert done.rows_written == 0 and done.failed_tids == pack([5, 6, 7]), done
    assert f"key 'm' writes {2 * STAGING} rows, more than its {STAGING} staging rows" in done.reason, done.reason
    _untouched(h, before_h)
    _untouched(m, before_m)


def test_a_step_for_a_key_this_writer_has_no_staging_of_is_refused_by_name(pool):
    """``apply_step`` never raises on bad input: a step naming a key that is open in the cache but has no
    staging segment of this writer (another writer's key, or one opened before this writer's OpenKey) is
    refused whole, naming the key, and nothing lands. Kills M02 (that guard dropped: a KeyError on the
    writer's staging escaped ``apply_step``)."""
    pool.set_layout(protocol.Layout(num_blocks=4, block_size=4))
    state = pool.open_key("h", protocol.KeySpec("float32", 4, (4,)))
    pool.ensure_staging("d" * 32, state, STAGING)  # another writer's staging only
    cv = make_cv(EPOCH, 1, 1)
    state.claim[0] = cv
    before = state.data.copy()
    done = _write(pool, ["h"], [0], [7], [cv], [0], [1], [0])
    assert (done.failed_tids, done.rows_written) == (pack([7]), 0), done
    assert "key 'h' has no staging segment for this writer" in done.reason, done.reason
    _untouched(state, before)


def test_a_refused_step_of_very_many_tids_is_refused_by_its_reason_alone(pool):
    """Review (stop 56): a refused step listed every distinct tid in its reply, so a request near the message
    limit got a reply over it, which the client's socket drops: the refusal never reached the writer. Past
    ``FAILED_TIDS_LISTED`` the reason alone says every tid failed (``StepDone.failure`` takes it), and the
    reply stays small; below it the distinct tids are listed as before."""
    from omnishm.committer.apply import FAILED_TIDS_LISTED

    _key(pool, 4, 4, 4, STAGING)
    n = FAILED_TIDS_LISTED + 1
    msg = protocol.StepWrite(rid=7, step=3, keys=["h"], key_idx=b"", tids=np.arange(n, dtype="<i8").tobytes(),
                             cvs=b"", src_rows=b"", counts=b"", slots=b"")  # buffers that disagree: refused
    done = pool.apply_step(CLIENT, msg, EPOCH)
    assert done.failed_tids == b"" and done.reason.startswith(f"all {n} tids of step 3 failed: ") and done.failure()
    assert len(protocol.encode(done)) < 4096 and (pool.steps_failed, pool.tids_failed) == (1, n)


def test_a_refused_step_counts_its_distinct_tids_as_failed(pool):
    """The committer's status (``tids_failed``) and its metric of failed writes count every distinct tid of a
    refused step: a step of tids [9, 3, 9] refused for a slot out of range adds one failed step and two failed
    tids, and nothing applied. Kills M27 (the tid count dropped: status said no write ever failed)."""
    _key(pool, 4, 4, 4, STAGING)
    cv = make_cv(EPOCH, 1, 1)
    done = _write(pool, ["h"], [0, 0, 0], [9, 3, 9], [cv] * 3, [0, 1, 2], [1, 1, 1], [0, 1, 99])
    assert done.failed_tids == pack([3, 9]) and done.rows_written == 0, done
    assert (pool.steps_failed, pool.tids_failed, pool.steps_applied) == (1, 2, 0)


# The mutation review of the committer's server and apply paths (stop 60): two gaps of multi-key steps.
def test_a_two_key_step_whose_first_key_has_no_rows_lands_the_second_keys_rows(pool):
    """MUTATION A15 (stop 60): the general path's per-key loop skips a key with no rows in the step; with that
    ``continue`` turned into ``break``, a step naming keys ["h", "m"] whose every entry is m's (key_idx 1)
    landed nothing, yet replied its tids done with 0 rows written and 0 skipped: a lost write reported done."""
    h, _ = _key(pool, 4, 4, 4, 8, key="h")
    m, m_staging = _key(pool, 4, 4, 4, 8, key="m")
    cvs = [make_cv(EPOCH, 1, 1), make_cv(EPOCH, 1, 2)]
    m.claim[[2, 3]] = cvs
    h_before = h.data.copy()
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h", "m"], key_idx=pack([1, 1]), tids=pack([4, 5]), cvs=pack(cvs),
        src_rows=pack([0, 1]), counts=pack([1, 1]), slots=pack([2, 3])), EPOCH)
    assert (done.reason, done.rows_written, done.rows_skipped, done.done_tids) == ("", 2, 0, pack([4, 5])), done
    assert np.array_equal(m.data[2:4], m_staging.data[0:2])
    assert list(m.commit[[2, 3]]) == cvs
    assert np.array_equal(h.data, h_before)


def test_a_two_key_step_is_bounded_by_the_smaller_staging_on_the_fast_path(pool):
    """MUTATION A25 (stop 60): the fast path bounds a repeated multi-key step by the smallest of the keys'
    stagings; with ``max`` for ``min``, keys with stagings of 8 and 4 rows took a 6-row step (rows 0..6 of
    each): h's rows landed, then m's copy read past its staging (a shape error out of ``apply_step``, which
    never raises on bad input, the step half-applied). It must be refused whole, naming m, nothing landed.
    Today every staging of a writer has its session's ``staging_rows``; the bound holds whatever they are."""
    h, _ = _key(pool, 4, 4, 4, 8, key="h")
    m, _ = _key(pool, 4, 4, 4, 4, key="m")
    cvs = [make_cv(EPOCH, 1, j + 1) for j in range(6)]
    h.claim[:6] = cvs
    m.claim[:6] = cvs
    h_before, m_before = h.data.copy(), m.data.copy()
    done = pool.apply_step(CLIENT, protocol.StepWrite(
        rid=1, step=1, keys=["h", "m"], key_idx=pack([0] * 6 + [1] * 6), tids=pack(list(range(6)) * 2),
        cvs=pack(cvs * 2), src_rows=pack(list(range(6)) * 2), counts=pack([1] * 12), slots=pack(list(range(6)) * 2)),
        EPOCH)
    assert done.rows_written == 0 and done.failed_tids == pack(range(6)), done
    assert "key 'm' writes 6 rows, more than its 4 staging rows" in done.reason, done.reason
    assert np.array_equal(h.data, h_before) and np.array_equal(m.data, m_before)
    assert not h.commit[:6].any() and not m.commit[:6].any()


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1])
@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_step_id_outside_what_a_writer_issues_is_refused_whole(pool, step, path):
    """MUTATION (stop 60, S04): a quiet step of id -1 was applied and then not acknowledged (its marker cannot be
    made), so its writer waited out its timeout for rows that had landed. No writer issues such an id: it is
    refused whole, naming it, nothing landed, on the fast path (the previous step repeated) and the general."""
    state, _ = _key(pool, 4, 4, 4, 8)
    cvs = [make_cv(EPOCH, 1, 1), make_cv(EPOCH, 1, 2)]

    def write(step_id: int) -> protocol.StepDone:
        return pool.apply_step(CLIENT, protocol.StepWrite(
            rid=1, step=step_id, keys=["h"], key_idx=pack([0, 0]), tids=pack([1, 2]), cvs=pack(cvs),
            src_rows=pack([0, 1]), counts=pack([1, 1]), slots=pack([2, 3]), quiet=True), EPOCH)

    if path == "fast":
        state.claim[[2, 3]] = cvs
        assert write(1).rows_written == 2  # the shape the fast path repeats
        state.commit[[2, 3]] = 0
    before = state.data.copy()
    done = write(step)
    assert done.rows_written == 0 and done.failed_tids == pack([1, 2]), done
    assert f"step id {step} is outside 0..{MAX_STEP}" in done.reason, done.reason
    assert np.array_equal(state.data, before) and not state.commit[[2, 3]].any()
