"""The committer's per-step fast path (``_apply_repeated``) against its general path (``validate_step``).

Two pools in real shared memory get the same randomized ``StepWrite``s: the
manager's layout (each key's writes repeated once per key), and that layout
with one thing broken. One pool may take the fast path, the other never does.
Replies, pool rows, commit words and counters must be identical: the fast path
accepts nothing the general path rejects, and applies exactly what it applies.
"""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import torch

from omnishm import protocol, shm
from omnishm.committer import apply as apply_module
from omnishm.committer.apply import _increasing
from omnishm.committer.pool import CachePool
from omnishm.versions import make_cv

from helpers import pack

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)  # 32 slots
NUM_SLOTS = 32
STAGING_ROWS = 24
KEYS = [("h", "float32", 8), ("m", "bfloat16", 4), ("i", "int64", 3)]
CLIENT = "c" * 32
EPOCH = 1  # the writer CLIENT's epoch: its claim versions are make_cv(EPOCH, ...)


def _pool(tag: str) -> CachePool:
    pool = CachePool(f"tfast{tag}{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8])
    pool.set_layout(LAYOUT)
    gen = torch.Generator().manual_seed(5)
    for key, dtype, width in KEYS:
        state = pool.open_key(key, protocol.KeySpec(dtype, width, (width,)))
        staging = pool.ensure_staging(CLIENT, state, STAGING_ROWS)
        torch.from_numpy(staging.data).copy_(
            torch.randint(0, 256, tuple(staging.data.shape), generator=gen, dtype=torch.uint8))
    return pool


def _message(rng: random.Random, step: int, tid0: int) -> tuple[protocol.StepWrite, dict[str, list[tuple[int, int]]]]:
    """A manager-style step, and per key the (slot, cv) claims to write before it is applied."""
    keys = rng.sample([k for k, _, _ in KEYS], rng.randint(1, len(KEYS)))
    nw = rng.randint(1, 5)
    counts = [rng.randint(0 if rng.random() < 0.1 else 1, 4) for _ in range(nw)]
    r0 = rng.randint(0, STAGING_ROWS - sum(counts))
    starts = list(np.cumsum([r0] + counts[:-1]))
    slots = rng.sample(range(NUM_SLOTS), sum(counts))
    cvs = [make_cv(EPOCH, step, j + 1) for j in range(nw)]
    tids = list(range(tid0, tid0 + nw))  # the manager's: consecutive, from one counter
    shape = rng.random()
    if shape < 0.15:  # increasing with gaps
        tids = sorted(rng.sample(range(tid0, tid0 + 8 * nw), nw))
    elif shape < 0.25:  # any order, repeats allowed (the reply's done_tids must still be the sorted set)
        tids = [rng.randrange(tid0, tid0 + nw) for _ in range(nw)]
    elif shape < 0.3:  # consecutive up to the largest int64: a run that would pass it must not wrap
        top = (1 << 63) - 1 - rng.randrange(2)
        tids = list(range(top - nw + 1, top + 1))
    elif shape < 0.33:  # negative, from the smallest int64 (the general path takes any int64)
        tids = list(range(-(1 << 63), -(1 << 63) + nw))
    nk = len(keys)
    msg = protocol.StepWrite(
        rid=step, step=step, keys=keys, key_idx=b"".join(pack([k] * nw) for k in range(nk)),
        tids=pack(tids) * nk, cvs=pack(cvs) * nk, src_rows=pack(starts) * nk, counts=pack(counts) * nk,
        slots=pack(slots) * nk, quiet=True)
    row_cv = [cv for cv, c in zip(cvs, counts) for _ in range(c)]
    claims = {k: list(zip(slots, row_cv)) for k in keys}
    return msg, claims


def _break(rng: random.Random, msg: protocol.StepWrite) -> str:
    """Break one thing the general path checks (or only the fast path's assumptions)."""
    what = rng.choice(["tids", "cvs", "src_rows", "counts", "slots", "key_idx", "truncate", "keys", "order"])
    if what == "keys":
        msg.keys = msg.keys + ["nope"]
    elif what == "truncate":
        field = rng.choice(["tids", "cvs", "src_rows", "counts", "slots", "key_idx"])
        setattr(msg, field, getattr(msg, field)[:-rng.choice([1, 8])])
    elif what == "order":  # non-contiguous staging rows: valid for the general path, not the fast one
        src = np.frombuffer(msg.src_rows, dtype="<i8").copy()
        src[rng.randrange(len(src))] += rng.choice([-1, 1])
        msg.src_rows = src.astype("<i8").tobytes()
    else:
        buf = np.frombuffer(getattr(msg, what), dtype="<i8").copy()
        if len(buf) == 0:
            return "noop"
        nk = len(msg.keys)
        # Half the time the same change in every key's part, so the parts still repeat and the fast
        # path's own checks (not only its repetition check) must catch it.
        same = what != "key_idx" and len(buf) % nk == 0 and rng.random() < 0.5
        per = len(buf) // nk if same else len(buf)
        i = rng.randrange(per)
        value = rng.choice([-1, 0, NUM_SLOTS, STAGING_ROWS, 1 << 62, -(1 << 62), int(buf[i]) + 1, 3])
        for j in range(i, len(buf), per) if same else (i,):
            buf[j] = value
        setattr(msg, what, buf.astype("<i8").tobytes())
    return what


def _same_pools(fast: CachePool, slow: CachePool, step: int, broken: str) -> None:
    for key, _, _ in KEYS:
        fa, sb = fast.keys[key], slow.keys[key]
        assert np.array_equal(fa.commit, sb.commit), (key, step, broken)
        assert np.array_equal(fa.data, sb.data), (key, step, broken)
        assert fa.rows_written == sb.rows_written and fa.rows_skipped == sb.rows_skipped, (key, step, broken)


def test_the_fast_path_applies_exactly_what_the_general_path_applies():
    rng = random.Random(20261201)
    fast, slow = _pool("a"), _pool("b")
    slow._apply_repeated = lambda *_a, **_k: None  # this pool always takes the general path
    taken = [0, 0]  # fast path used, clean messages
    real = fast._apply_repeated

    def counting(*a, **k):
        done = real(*a, **k)
        taken[0] += done is not None
        return done

    fast._apply_repeated = counting
    try:
        tid = 1
        for step in range(1, 1500):
            msg, claims = _message(rng, step, tid)
            tid += 8
            broken = _break(rng, msg) if rng.random() < 0.4 else ""
            taken[1] += not broken
            for pool in (fast, slow):
                for key, pairs in claims.items():
                    claim = pool.keys[key].claim
                    for slot, cv in pairs:
                        claim[slot] = cv
            if claims and rng.random() < 0.2:  # a newer write took one slot before the committer got here
                key = rng.choice(list(claims))
                if claims[key]:
                    slot = claims[key][0][0]
                    for pool in (fast, slow):
                        pool.keys[key].claim[slot] = make_cv(EPOCH, step + 1, 1)
            a = fast.apply_step(CLIENT, msg, EPOCH)
            b = slow.apply_step(CLIENT, msg, EPOCH)
            assert (a.done_tids, a.failed_tids, a.rows_written, a.rows_skipped, bool(a.reason)) == \
                   (b.done_tids, b.failed_tids, b.rows_written, b.rows_skipped, bool(b.reason)), (step, broken, a, b)
            assert a.reason == b.reason, (step, broken)
            _same_pools(fast, slow, step, broken)  # after every step: a later write could hide a wrong one
        assert (fast.steps_applied, fast.steps_failed, fast.rows_skipped) == \
               (slow.steps_applied, slow.steps_failed, slow.rows_skipped)
        assert fast.steps_failed > 50 and fast.rows_skipped > 20
        assert taken[0] >= 0.9 * taken[1], taken  # clean manager-style steps take the fast path
    finally:
        for pool in (fast, slow):
            pool.close()
            assert shm.list_segments(pool.name) == []


def test_increasing_takes_the_consecutive_run_by_bytes_and_decides_like_the_elementwise_check(monkeypatch):
    """``_increasing`` (the fast path's tid check): a consecutive run is recognised by one bytes comparison, and
    every answer equals the elementwise ``tids[1:] > tids[:-1]`` check it replaced."""
    top, bottom = (1 << 63) - 1, -(1 << 63)
    cases = [[1, 2, 3], [7, 8], [top - 1, top], [top - 2, top - 1], [-2, -1], [bottom, bottom + 1], [5, 5],
             [3, 2], [1, 3, 2], [1, 5, 9], [0, 1, 1], [2, 1, 0], [bottom, top]]
    rng = random.Random(7)
    cases += [sorted(rng.sample(range(-50, 50), rng.randint(2, 9))) for _ in range(200)]
    cases += [[rng.randrange(-5, 5) for _ in range(rng.randint(2, 6))] for _ in range(200)]
    for tids in cases:
        arr = np.array(tids, dtype="<i8")
        assert _increasing(arr, arr.tobytes()) == bool((arr[1:] > arr[:-1]).all()), tids
    # The manager's case (consecutive tids) never reaches the elementwise check.
    def elementwise(*_a):
        raise AssertionError("the elementwise check ran for a consecutive run")

    monkeypatch.setattr(apply_module, "_and", elementwise)
    run = np.arange(40, 48, dtype="<i8")
    assert _increasing(run, run.tobytes())


def test_rows_staged_out_of_order_land_in_their_slots_bit_for_bit():
    """The general path's gather: staging rows in any order go through ``np.take`` into the pool's scratch
    rows, then one scatter. Its ``mode="clip"`` (no hidden copies of the scratch rows) must not change
    a single byte: every slot holds the staging row its entry named."""
    pool = _pool("g")
    rng = np.random.default_rng(20261205)
    try:
        for step in range(1, 60):
            key = KEYS[step % len(KEYS)][0]
            state, staging = pool.keys[key], pool.keys[key].staging[CLIENT]
            n = int(rng.integers(2, STAGING_ROWS + 1))
            src = rng.choice(STAGING_ROWS, size=n, replace=False)  # staged out of order
            slots = rng.choice(NUM_SLOTS, size=n, replace=False)
            cvs = [make_cv(EPOCH, step, j + 1) for j in range(n)]
            state.claim[slots] = cvs
            msg = protocol.StepWrite(rid=step, step=step, keys=[key], key_idx=pack([0] * n),
                                     tids=pack(range(10 * step, 10 * step + n)), cvs=pack(cvs),
                                     src_rows=pack(src.tolist()), counts=pack([1] * n), slots=pack(slots.tolist()))
            done = pool.apply_step(CLIENT, msg, EPOCH)
            assert (done.rows_written, done.rows_skipped, done.reason) == (n, 0, ""), done
            assert np.array_equal(state.data[slots], staging.data[src]), step
            assert np.array_equal(state.commit[slots], cvs), step
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_step_naming_another_epochs_claim_versions_is_refused_on_either_path(path):
    """A review found a writer's step applied with claim versions of an earlier writer's epoch: the row
    changed under a version that commit and claim still agreed on, so a reader that had planned on it
    would take the new bytes as the old write's. Claim versions must be the sending writer's epoch."""
    pool = _pool("e" + path[0])
    try:
        if path == "general":
            pool._apply_repeated = lambda *_a, **_k: None
        state, staging = pool.keys["h"], pool.keys["h"].staging[CLIENT]
        staging.data[:2] = 7
        old = make_cv(EPOCH + 1, 3, 1)  # another writer's claim, its row committed
        state.claim[5] = state.commit[5] = old
        state.data[5] = 1
        before = state.data[5].copy()
        msg = protocol.StepWrite(rid=1, step=4, keys=["h"], key_idx=pack([0]), tids=pack([9]), cvs=pack([old]),
                                 src_rows=pack([0]), counts=pack([1]), slots=pack([5]))
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert done.rows_written == 0 and done.failed_tids == pack([9])
        assert f"another epoch than this writer's {EPOCH}" in done.reason, done.reason
        assert np.array_equal(state.data[5], before) and state.commit[5] == old
        mine = make_cv(EPOCH, 4, 1)  # the same step with this writer's own claim lands
        state.claim[5] = mine
        msg.cvs = pack([mine])
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert (done.rows_written, done.reason) == (1, ""), done
        assert np.array_equal(state.data[5], staging.data[0]) and state.commit[5] == mine
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


def test_a_step_writing_more_rows_of_a_key_than_it_staged_is_refused_whole():
    """REVIEW (2026-12-05): entries repeating one staging row multiplied a step's copy and its gather buffer
    without bound; a 10,000-entry step of 4 MiB rows asked for 39 GiB, failed with an ``internal`` error
    and left its first key applied. A staged row goes to one slot, so a key's rows never outnumber its
    staging rows: such a step is refused before anything is copied, naming the key."""
    pool = _pool("r")
    try:
        h, m = pool.keys["h"], pool.keys["m"]
        cv = make_cv(EPOCH, 1, 1)
        h.claim[0] = cv
        m.claim[1] = cv
        n = STAGING_ROWS + 1  # one more row of "m" than it has staging rows, all staging row 0 to slot 1
        msg = protocol.StepWrite(rid=1, step=1, keys=["h", "m"], key_idx=pack([0] + [1] * n),
                                 tids=pack([7] * (n + 1)), cvs=pack([cv] * (n + 1)), src_rows=pack([0] * (n + 1)),
                                 counts=pack([1] * (n + 1)), slots=pack([0] + [1] * n))
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert done.failed_tids == pack([7]) and done.rows_written == 0, done
        assert f"key 'm' writes {n} rows, more than its {STAGING_ROWS} staging rows" in done.reason, done.reason
        assert h.commit[0] == 0 and m.commit[1] == 0  # nothing of the step was applied, "h" included
        one = protocol.StepWrite(rid=2, step=1, keys=["h", "m"], key_idx=pack([0, 1]), tids=pack([7, 7]),
                                 cvs=pack([cv, cv]), src_rows=pack([0, 0]), counts=pack([1, 1]), slots=pack([0, 1]))
        assert (pool.apply_step(CLIENT, one, EPOCH).rows_written, h.commit[0], m.commit[1]) == (2, cv, cv)
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_step_listing_a_key_twice_is_refused_whole_on_either_path(path):
    """REVIEW (2026-12-06): the staging-rows bound counted rows per position in ``keys``, not per key, so
    a key listed 4096 times in one 8 MiB StepWrite, each time with a full staging of rows, was applied:
    256 GiB copied in one apply, 28 s of a committer answering no other client. A key is listed once."""
    pool = _pool("d" + path[0])
    try:
        if path == "general":
            pool._apply_repeated = lambda *_a, **_k: None
        h = pool.keys["h"]
        cv = make_cv(EPOCH, 1, 1)
        h.claim[:STAGING_ROWS] = cv
        part = dict(tids=pack([7]), cvs=pack([cv]), src_rows=pack([0]), counts=pack([STAGING_ROWS]),
                    slots=pack(range(STAGING_ROWS)))
        # What the manager sends for one key, repeated per key name: the fast path's own shape.
        msg = protocol.StepWrite(rid=1, step=1, keys=["h", "h"], key_idx=pack([0, 1]),
                                 **{k: v * 2 for k, v in part.items()})
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert done.failed_tids == pack([7]) and done.rows_written == 0, done
        assert "key 'h' is listed twice" in done.reason, done.reason
        assert not h.commit[:STAGING_ROWS].any() and h.rows_written == 0
        once = protocol.StepWrite(rid=2, step=1, keys=["h"], key_idx=pack([0]), **part)
        assert pool.apply_step(CLIENT, once, EPOCH).rows_written == STAGING_ROWS
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


def test_staging_rows_past_the_end_are_refused_not_broadcast():
    """MUTATION REVIEW (2026-12-06): the fast path's staging bound off by one (``r1 > rows + 1``) survived
    the suite, and served a wrong row: an entry of two rows from the last staging row names a row that
    does not exist, numpy's slice gave one row, copied into both slots, both committed. Refused whole."""
    pool = _pool("b")
    try:
        h = pool.keys["h"]
        cv = make_cv(EPOCH, 3, 1)
        h.claim[[0, 1]] = cv
        msg = protocol.StepWrite(rid=1, step=3, keys=["h"], key_idx=pack([0]), tids=pack([10]), cvs=pack([cv]),
                                 src_rows=pack([STAGING_ROWS - 1]), counts=pack([2]), slots=pack([0, 1]))
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert "staging rows" in done.reason and done.failed_tids == pack([10]) and not done.done_tids, done
        assert list(h.commit[[0, 1]]) == [0, 0] and not h.data[[0, 1]].any()
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


def test_claim_versions_of_another_epoch_are_refused_even_beside_the_writers_own():
    """MUTATION REVIEW (2026-12-06): an epoch check of the smallest claim version alone survived the suite,
    whose steps had every version of the other epoch: a step mixing the writer's own versions with one of
    another epoch committed that other writer's row. Refused whole, on either path."""
    pool = _pool("m")
    try:
        h = pool.keys["h"]
        own, other = make_cv(EPOCH, 3, 1), make_cv(EPOCH + 1, 3, 1)
        h.claim[0], h.claim[1] = own, other
        for src in ([0, 1], [1, 0]):  # staged in entry order (the fast path), and not (the general path)
            msg = protocol.StepWrite(rid=1, step=3, keys=["h"], key_idx=pack([0, 0]), tids=pack([10, 11]),
                                     cvs=pack([own, other]), src_rows=pack(src), counts=pack([1, 1]),
                                     slots=pack([0, 1]))
            done = pool.apply_step(CLIENT, msg, EPOCH)
            assert f"another epoch than this writer's {EPOCH}" in done.reason, done
            assert list(h.commit[[0, 1]]) == [0, 0] and done.rows_written == 0
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []


def test_the_gather_buffer_stays_within_its_bound_whatever_the_step():
    """A step staged out of order goes through a key's gather buffer, the committer's private memory, kept
    for the next gather: it used to grow to the largest step ever gathered (at least 64 rows, 16 MiB of
    256 KiB rows). It is filled in pieces of ``GATHER_BYTES``, bit for bit as before."""
    pool = CachePool(f"tgath{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8])
    try:
        pool.set_layout(LAYOUT)
        width = 1 << 16  # float32: 256 KiB rows, 16 to a piece
        state = pool.open_key("h", protocol.KeySpec("float32", width, (width,)))
        staging = pool.ensure_staging(CLIENT, state, STAGING_ROWS)
        torch.from_numpy(staging.data).copy_(torch.randint(0, 256, tuple(staging.data.shape), dtype=torch.uint8))
        src = np.arange(STAGING_ROWS)[::-1].copy()  # out of order: the gather path
        slots = np.arange(STAGING_ROWS)
        cvs = [make_cv(EPOCH, 1, j + 1) for j in range(STAGING_ROWS)]
        state.claim[slots] = cvs
        msg = protocol.StepWrite(rid=1, step=1, keys=["h"], key_idx=pack([0] * STAGING_ROWS),
                                 tids=pack(range(STAGING_ROWS)), cvs=pack(cvs), src_rows=pack(src.tolist()),
                                 counts=pack([1] * STAGING_ROWS), slots=pack(slots.tolist()))
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert (done.rows_written, done.reason) == (STAGING_ROWS, ""), done
        assert np.array_equal(state.data[slots], staging.data[src])
        assert state.scratch is not None and state.scratch.nbytes <= 4 << 20, state.scratch.shape  # GATHER_BYTES
    finally:
        pool.close()
        assert shm.list_segments(pool.name) == []
