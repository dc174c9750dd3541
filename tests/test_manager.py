"""The seed's manager contracts, each against a real committer subprocess."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from helpers import until
from manager_helpers import (MM_WIDTH, Part, aborted, build, expect, extended, finished, quick_config, rows, save,
                             started)
from omnishm.client import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager,
                            OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError)
from omnishm.client.adapter import PrefixCacheEventKind as K, PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout

BS = 4




def test_no_hit_returns_exactly_this_steps_rows(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])], num_scheduled_tokens={"a": 6})
    sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS)
    out = m.materialize(sid, ["a"])
    assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
    assert torch.equal(out.mm_outputs["a"]["feat"], expect(0, 0, 1, 0, 6, mm=True))
    assert out.num_hit_tokens == {"a": 0}


def test_materialize_of_a_later_request_alone_returns_its_own_rows(mgr):
    """``materialize(step_id, ids)`` may name a subset of the step's requests. Asked for the second request
    alone, one run of rows that starts past row 0, it returns that request's rows, never the step's first rows:
    a step is copied in one piece only when its rows start at row 0 (mutation review, stop 47: with that check
    gone only a slow TP test caught the wrong rows)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1]), started("b", [2, 3])], num_scheduled_tokens={"a": 6, "b": 6})
    sid = save(m, [Part("a", 1, [0, 1], 0, 6), Part("b", 2, [2, 3], 0, 6)], BS)
    out = m.materialize(sid, ["b"])
    assert list(out.hidden_states) == ["b"] and torch.equal(out.hidden_states["b"], rows(2, range(6)))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(0, 0, 2, 0, 6, mm=True))


def test_hit_merges_prefix_rows_for_hidden_and_every_mm_key(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    sid = save(m, [Part("a", 1, [0, 1, 2], 0, 10)], BS)
    m.discard_step(sid)
    # b shares a's first two blocks (8 tokens), then its own block 5.
    m.new_step_starts([started("b", [0, 1, 5], hit=8)])
    sid = save(m, [Part("b", 1, [0, 1, 5], 8, 3)], BS, padded=16)
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 1, 8, 3))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 8, 1, 8, 3, mm=True))
    assert out.num_hit_tokens["b"] == 8


def test_partial_match_shared_blocks_divergent_last_block(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save(m, [Part("a", 1, [0, 1, 2], 0, 12)], BS))
    m.new_step_starts([started("b", [0, 6, 7], hit=4)])  # shares block 0 only
    sid = save(m, [Part("b", 2, [0, 6, 7], 4, 7)], BS)
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 2, 4, 7))


def test_tenant_succession_serves_newest_tenant(mgr):
    m = mgr()
    m.new_step_starts([started("a", [3])])
    m.discard_step(save(m, [Part("a", 1, [3], 0, 4)], BS))
    m.new_step_starts([finished("a"), started("c", [3])])  # block 3 recycled to c
    m.discard_step(save(m, [Part("c", 7, [3], 0, 4)], BS))
    m.new_step_starts([started("d", [3, 4], hit=4)])
    sid = save(m, [Part("d", 7, [3, 4], 4, 2)], BS)
    assert torch.equal(m.materialize(sid, ["d"]).hidden_states["d"], expect(7, 4, 7, 4, 2))


def test_same_step_hit_reads_rows_written_in_that_step(mgr):
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0, 1]), started("b", [0, 2], hit=4)])
    sid = save(m, [Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)], BS)
    out = m.materialize(sid, ["b", "a"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 3))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 3, mm=True))
    assert torch.equal(out.hidden_states["a"], rows(1, range(8)))


def test_live_request_reentering_as_new_is_not_a_hit(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS))
    m.new_step_starts([started("a", [0, 1], hit=4)])  # async chunk continuation: same live id
    sid = save(m, [Part("a", 1, [0, 1], 4, 4)], BS)
    out = m.materialize(sid, ["a"])
    assert out.num_hit_tokens["a"] == 0
    assert torch.equal(out.hidden_states["a"], rows(1, range(4, 8)))
    m.new_step_starts([E(K.REPLACED, "a", num_computed_tokens=8, block_ids=(0, 1))])
    sid = save(m, [Part("a", 1, [0, 1, 2], 8, 1)], BS)
    assert m.materialize(sid, ["a"]).num_hit_tokens["a"] == 0


def test_hits_must_be_block_aligned_and_carry_block_ids(mgr):
    m = mgr()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="not a multiple of block_size.*'x'"):
        m.new_step_starts([started("x", [0, 1], hit=6)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="carries 1 block ids, needs 2"):
        m.new_step_starts([started("y", [0], hit=8)])


def test_a_refused_hit_loses_no_other_event_of_its_step(mgr):
    """REVIEW (2026-12-05): one malformed hit raised before any event of the step was applied. A request
    that finished in that step kept its deferred write open for good (its rows never landed), and another
    request's valid hit in the same step was dropped: its materialize served its own rows only, with no
    error. Every other event now applies, then the error names each refused request."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    assert ("a", "feat") in m._open  # a's deferred write waits for a's end
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=r"not a multiple of block_size.*request 'y': prefix hit of 8 tokens carries 1 "
                             r"block ids.*request='x'"):
        m.new_step_starts([finished("a"), started("b", [0, 5], hit=4), started("x", [1, 2], hit=6),
                           started("y", [3], hit=8)])
    assert ("a", "feat") not in m._open and "a" not in m._live
    sid = save(m, [Part("b", 2, [0, 5], 4, 2)], BS)
    out = m.materialize(sid, ["b"])
    assert out.num_hit_tokens["b"] == 4 and torch.equal(out.hidden_states["b"], expect(1, 4, 2, 4, 2))
    m.wait_idle()  # a's rows landed
    feat = m._keys["feat"]
    assert bool((feat.commit[0:4] == feat.claim[0:4]).all())


def test_an_interrupt_after_a_save_registered_its_step_abandons_it_and_hands_over_its_closed_writes(mgr):
    """REVIEW (2026-12-05): an interrupt (SIGINT) after ``save_outputs`` registered its step and before it
    sent the step (here in the hand-off of the deferred write the step's rows pushed over the byte budget)
    left the step behind: its context, page and pins held for good, its claims never landing, the write it
    closed never handed to the flusher, and the cache not failed. The step is abandoned (the writer turns
    sticky-fatal, as on every failure after an id was issued) and the write it closed is handed over."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})), gpu_staging_bytes=1)
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))  # over the budget at once: flushed
    m.wait_idle()
    real_put = m._flusher.put
    handed: list = []

    def put(task) -> bool:
        handed.append(task)
        if len(handed) == 1:
            raise KeyboardInterrupt  # SIGINT in the hand-off
        return real_put(task)

    m._flusher.put = put
    m.new_step_starts([extended("a", 4, [1])])
    with pytest.raises(KeyboardInterrupt):
        save(m, [Part("a", 1, [0, 1], 4, 4)], BS)
    assert m.unconsumed_step_ids() == [] and m._pages.in_use() == 0 and not m._pinned
    assert len(handed) == 2 and handed[0] is handed[1] and handed[1].req_id == "a"  # handed over after all
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"save_outputs of step 1 failed after the step id"):
        m.new_step_starts([])


def test_absent_hit_raises_and_releases_staging(mgr):
    m = mgr()
    m.new_step_starts([started("b", [9, 10], hit=4)])  # block 9 was never written
    sid = save(m, [Part("b", 3, [9, 10], 4, 2)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"absent rows.*'b'.*__hidden_states__.*step_id=0"):
        m.materialize(sid, ["b"])
    assert m.unconsumed_step_ids() == []
    for i in range(3):  # all staging pages are free again
        m.new_step_starts([extended("b", 6 + i)])
        m.discard_step(save(m, [Part("b", 3, [9, 10, 11], 6 + i, 1)], BS))


def test_step_ids_are_consumed_exactly_once_in_any_order(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    s0 = save(m, [Part("a", 1, [0, 1], 0, 4)], BS)
    m.new_step_starts([extended("a", 4)])
    s1 = save(m, [Part("a", 1, [0, 1], 4, 1)], BS)
    assert torch.equal(m.materialize(s1, ["a"]).hidden_states["a"], rows(1, [4]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="outside|not in the save-time"):
        m.materialize(s0, ["a", "zzz"])
    m.discard_step(s0)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        m.materialize(s0, ["a"])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        m.discard_step(s1)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="never saved"):
        m.discard_step(99)


def test_staging_depth_bounds_unconsumed_step_ids(mgr):
    m = mgr()
    ids = []
    m.new_step_starts([started("a", [0, 1, 2, 3])])
    ids.append(save(m, [Part("a", 1, [0, 1, 2, 3], 0, 1)], BS))
    # A leftover-only save (no per-token output) still takes a page.
    m.new_step_starts([extended("a", 1)])
    h, layout_parts = None, [Part("a", 1, [0, 1, 2, 3], 1, 1)]
    from manager_helpers import build
    _, _, layout, n, _ = build(layout_parts, BS)
    ids.append(m.save_outputs(h, {"codes": [1, 2, 3]}, num_tokens_unpadded=n, num_tokens_padded=n,
                              write_layout=layout))
    m.new_step_starts([extended("a", 2)])
    ids.append(save(m, [Part("a", 1, [0, 1, 2, 3], 2, 1)], BS))
    m.new_step_starts([extended("a", 3)])
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=r"unconsumed step ids \[0, 1, 2\]") as timed_out:
        save(m, [Part("a", 1, [0, 1, 2, 3], 3, 1)], BS)
    # Its attributes name what its message names (seed audit, 2026-12-06: step_id was None).
    assert (timed_out.value.req_id, timed_out.value.key, timed_out.value.step_id) == (None, None, 3)
    assert str(timed_out.value).endswith("(request=None, tensor=None, step_id=3)"), timed_out.value
    m.discard_step(ids[1])
    sid = save(m, [Part("a", 1, [0, 1, 2, 3], 3, 1)], BS)
    for s in (ids[0], ids[2], sid):
        m.discard_step(s)


def test_a_shutdown_from_another_thread_wakes_a_save_waiting_for_a_staging_page(mgr):
    """A save waiting for a page (every page held by an unconsumed step) waited out its whole
    ``staging_claim_timeout_s`` after another thread shut the manager down, then took its step id and
    cleared its slots in claim tables it had said goodbye to. Now the shutdown wakes it at once, and it
    raises without taking a step id."""
    m = mgr(staging_depth=1, staging_claim_timeout_s=60.0)
    m.new_step_starts([started("a", [0, 1, 2, 3])])
    held = save(m, [Part("a", 1, [0, 1, 2, 3], 0, 1)], BS)
    m.new_step_starts([extended("a", 1)])
    out: dict[str, BaseException] = {}

    def engine() -> None:
        try:
            save(m, [Part("a", 1, [0, 1, 2, 3], 1, 1)], BS)
        except BaseException as exc:  # the assertion below says what it must be
            out["raised"] = exc

    thread = threading.Thread(target=engine)
    thread.start()
    deadline = time.monotonic() + 30
    while m._pages.waits < 1 and thread.is_alive():  # the save is inside its wait for a page
        assert time.monotonic() < deadline, "the save never waited for a page"
        time.sleep(0.005)
    m.shutdown()
    thread.join(timeout=30)  # the save's own bound is 60 s
    assert not thread.is_alive(), "the save still waits for a page after the shutdown"
    assert isinstance(out.get("raised"), RuntimeError) and "shut down" in str(out["raised"]), out
    assert m._next_step == held + 1 and held + 1 not in m._consumed  # the woken save took no step id (no burn)


def test_a_shutdown_while_a_save_gets_its_page_claims_and_sends_nothing(mgr):
    """A review of the wake above: a shutdown landing right after the save got its page let the save
    store its claims in tables it had said goodbye to, then fail its send as a sticky fatal error, and
    keep the step's page and context. Now it raises at once, as a shut-down manager does."""
    m = mgr(staging_depth=2)
    m.new_step_starts([started("a", [0, 1, 2, 3])])
    m.discard_step(save(m, [Part("a", 1, [0, 1, 2, 3], 0, 1)], BS))
    m.wait_idle()
    before = int(m._keys[HIDDEN_KEY].claim[1])
    real = m._pages.claim

    def claim_then_shut_down(*args, **kw):
        page = real(*args, **kw)
        other = threading.Thread(target=m.shutdown)
        other.start()
        other.join(timeout=30)
        assert not other.is_alive()
        return page

    m._pages.claim = claim_then_shut_down
    m.new_step_starts([extended("a", 1)])
    with pytest.raises(RuntimeError, match="shut down"):
        save(m, [Part("a", 1, [0, 1, 2, 3], 1, 1)], BS)
    assert m._fatal is None and not m._ctxs and m._pages.used == 0 and m._next_step == 1
    assert int(m._keys[HIDDEN_KEY].claim[1]) == before  # nothing claimed after the goodbye


def test_a_discard_after_shutdown_raises_and_touches_nothing(mgr):
    """Once ``shutdown`` began no call takes effect (mutation review, 2026-12-06): ``discard_step`` of a
    step id issued before the shutdown raises ``RuntimeError`` (shut down), as ``materialize`` of it does,
    instead of releasing a staging page of a detached manager, and the id stays listed unconsumed."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    sid = save(m, [Part("a", 1, [0], 0, 4)], BS)
    m.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        m.materialize(sid, ["a"])
    with pytest.raises(RuntimeError, match="shut down"):
        m.discard_step(sid)
    assert sid in m.unconsumed_step_ids()


def test_step_larger_than_staging_page_raises(mgr):
    m = mgr()
    m.new_step_starts([started("a", list(range(10)))])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="exceeds staging_capacity_tokens=32"):
        save(m, [Part("a", 1, list(range(10)), 0, 33)], BS)


def test_save_waits_for_previous_steps_immediate_writes(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 5)], BS))
    m.new_step_starts([extended("a", 5)])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 5, 1)], BS))
    kv = m._keys[HIDDEN_KEY]
    slots = torch.arange(0, 5)
    # The second save returned only after the first step's rows were committed.
    assert torch.equal(kv.commit[slots], kv.claim[slots])
    assert torch.equal(kv.pool[slots], rows(1, range(5)))


def test_deferred_rows_land_only_when_the_request_ends_and_aborts_still_land(mgr):
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0, 1]), started("b", [4, 5])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4), Part("b", 2, [4, 5], 0, 4)], BS))
    m.new_step_starts([extended("a", 4), extended("b", 4)])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 2), Part("b", 2, [4, 5], 4, 2)], BS))
    m.wait_idle()
    feat = m._keys["feat"]
    a_slots, b_slots = torch.arange(0, 6), torch.arange(16, 22)
    assert not bool((feat.commit[a_slots] == feat.claim[a_slots]).any())  # JOIN_ON_FINISH: still with the client
    hid = m._keys[HIDDEN_KEY]
    assert torch.equal(hid.commit[a_slots], hid.claim[a_slots])  # JOIN_NEXT_STEP: landed
    m.new_step_starts([finished("a"), aborted("b")])
    m.wait_idle()
    assert torch.equal(feat.commit[a_slots], feat.claim[a_slots])
    assert torch.equal(feat.pool[a_slots], rows(501, range(6), 3))
    assert torch.equal(feat.commit[b_slots], feat.claim[b_slots])
    assert torch.equal(feat.pool[b_slots], rows(502, range(6), 3))


def test_eager_mode_lands_an_ended_requests_deferred_rows_before_new_step_starts_returns(mgr):
    """REVIEW (2026-12-05, seed conformance): the seed's eager escalate writes a finished or aborted request's
    still-open writes to the pool inside ``new_step_starts``; omnishm's eager mode waited only in
    ``save_outputs``, and the rows landed later on the flusher thread."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})), eager=True)
    m.new_step_starts([started("a", [0, 1]), started("b", [4, 5])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 6), Part("b", 2, [4, 5], 0, 6)], BS))
    feat = m._keys["feat"]
    a_slots, b_slots = torch.arange(0, 6), torch.arange(16, 22)
    assert not bool((feat.commit[a_slots] == feat.claim[a_slots]).any())  # JOIN_ON_FINISH: still open
    m.new_step_starts([finished("a"), aborted("b")])
    assert torch.equal(feat.commit[a_slots], feat.claim[a_slots])  # no wait_idle: landed on return
    assert torch.equal(feat.pool[a_slots], rows(501, range(6), 3))
    assert torch.equal(feat.commit[b_slots], feat.claim[b_slots])
    assert torch.equal(feat.pool[b_slots], rows(502, range(6), 3))



def test_an_eager_hit_on_rows_of_an_open_deferred_write_lands_them_before_new_step_starts_returns(mgr):
    """MUTATION (2026-12-06): in eager mode a hit on rows whose deferred write is still open (a, the request
    that wrote block 0's feat rows, is live) closes that write, and ``new_step_starts`` returns only once the
    rows are committed in the shared pool, as the seed's eager escalate writes them before the forward and
    before another rank reads them. With the hit no longer closing the open write, the rows stayed out of
    the pool until a finished."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})), eager=True)
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 37, [0], 0, 4)], BS))  # a tag no other test of the module writes
    m.wait_idle()
    feat = m._keys["feat"]
    a_rows = rows(537, range(4), MM_WIDTH)
    assert not torch.equal(feat.pool[:4], a_rows)  # a's deferred write is open: its rows are not in the pool
    m.new_step_starts([started("b", [0, 1], hit=4)])
    assert torch.equal(feat.pool[:4], a_rows), "the hit's rows were not in the pool when new_step_starts returned"
    assert bool((feat.claim[:4] != 0).all()) and torch.equal(feat.commit[:4], feat.claim[:4])

def test_budget_forces_the_oldest_pending_write_out(mgr):
    row_bytes = 3 * 4
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})), gpu_staging_bytes=6 * row_bytes)
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS))
    m.new_step_starts([started("b", [4, 5]), extended("a", 4)])
    m.discard_step(save(m, [Part("b", 2, [4, 5], 0, 4)], BS))  # 8 rows pending > 6: a (oldest) goes out
    m.wait_idle()
    feat = m._keys["feat"]
    assert torch.equal(feat.commit[torch.arange(0, 4)], feat.claim[torch.arange(0, 4)])
    assert not bool((feat.commit[torch.arange(16, 20)] == feat.claim[torch.arange(16, 20)]).any())
    assert m.counters["budget_flushes"] == 1
    # The budget-closed write is never reopened: a's next rows open a new write, which lands on finish.
    m.new_step_starts([extended("a", 4)])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 2)], BS))
    m.new_step_starts([finished("a")])
    m.wait_idle()
    assert torch.equal(feat.pool[torch.arange(0, 6)], rows(501, range(6), 3))


def test_hits_on_deferred_keys_read_in_flight_rows(mgr):
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([extended("a", 8, [2]), started("b", [0, 3], hit=4)])
    sid = save(m, [Part("a", 1, [0, 1, 2], 8, 1), Part("b", 1, [0, 3], 4, 2)], BS)
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 2, mm=True))


def test_last_chunk_wins_for_a_slot_written_twice_by_one_write(mgr):
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 2)], BS))
    m.new_step_starts([extended("a", 0)])  # recompute of positions 0..1 into the same slots
    m.discard_step(save(m, [Part("a", 9, [0], 0, 2)], BS))
    m.new_step_starts([finished("a")])
    m.wait_idle()
    feat = m._keys["feat"]
    assert torch.equal(feat.pool[torch.arange(0, 2)], rows(509, range(2), 3))


def test_leftover_mm_is_copied_at_save_and_keeps_its_shape(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    live = torch.arange(6.0).reshape(2, 3)  # not token-major: dim 0 != 5
    codes = [[1, 2], [3]]
    sid = save(m, [Part("a", 1, [0, 1], 0, 5)], BS, extra_mm={"pooled": live, "codes": codes})
    live.fill_(-7)
    codes[0].append(99)
    out = m.materialize(sid, ["a"])
    assert torch.equal(out.mm_outputs["a"]["pooled"], torch.arange(6.0).reshape(2, 3))
    assert out.mm_outputs["a"]["codes"] == [[1, 2], [3]]
    assert out.mm_outputs["a"]["feat"].shape == (5, 3)


def test_token_major_mm_with_padded_first_dim_is_cut_to_the_step(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    sid = save(m, [Part("a", 4, [0, 1], 0, 5)], BS, padded=8)
    out = m.materialize(sid, ["a"])
    assert torch.equal(out.mm_outputs["a"]["feat"], rows(504, range(5), 3))


def test_delayed_read_gets_rescued_rows_not_the_new_tenants(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([finished("a"), started("b", [0, 2], hit=4)])
    late = save(m, [Part("b", 1, [0, 2], 4, 2)], BS)  # not consumed yet
    # b aborts, block 0 goes to c, which overwrites its rows before the late read.
    m.new_step_starts([aborted("b"), started("c", [0])])
    m.discard_step(save(m, [Part("c", 8, [0], 0, 4)], BS))
    m.new_step_starts([extended("c", 4, [1])])
    m.discard_step(save(m, [Part("c", 8, [0, 1], 4, 1)], BS))
    assert torch.equal(m._keys[HIDDEN_KEY].pool[torch.arange(0, 4)], rows(8, range(4)))
    out = m.materialize(late, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 2))
    assert m.counters["cow_rescues"] > 0


def test_a_slot_taken_twice_before_a_late_read_does_not_cost_the_other_slots_their_rescue(mgr):
    """Slot 0 of the late read's block changes tenant twice, slot 1 once (at slot 0's second change): the
    second rescue must keep slot 1 although slot 0, rescued at the first change, has moved on (found by
    the randomized test with seeds 113 and 139: the whole key's rescue was dropped)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([finished("a"), started("b", [0, 2], hit=4)])
    late = save(m, [Part("b", 1, [0, 2], 4, 2)], BS)  # plans to read block 0; not consumed yet
    m.new_step_starts([aborted("b"), started("c", [0])])
    m.discard_step(save(m, [Part("c", 8, [0], 0, 1)], BS))  # c takes slot 0
    m.new_step_starts([aborted("c"), started("d", [0])])
    m.discard_step(save(m, [Part("d", 9, [0], 0, 2)], BS))  # d takes slots 0 and 1
    m.wait_idle()  # d's rows are in the pool: the read must come from the rescue
    assert torch.equal(m._keys[HIDDEN_KEY].pool[torch.arange(0, 2)], rows(9, range(2)))
    out = m.materialize(late, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 2))
    assert torch.equal(out.mm_outputs["b"]["feat"][:4], rows(501, range(4), 3))


def test_dtype_or_width_mismatch_raises_clearly(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 2)], BS))
    m.new_step_starts([extended("a", 2)])
    _, _, layout, n, _ = __import__("manager_helpers").build([Part("a", 1, [0, 1], 2, 1)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="__hidden_states__.*float64"):
        m.save_outputs(torch.zeros((1, 8), dtype=torch.float64), {}, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=layout)


def test_hidden_states_that_are_not_a_tensor_are_refused_up_front(mgr):
    """REVIEW (2026-12-04): a pipeline stage's forward returns IntermediateTensors; handed to save_outputs
    they failed deep inside with an AttributeError. Refused up front with the type named; the step id is
    taken all the same, as every refused save's is (so a TP rank refusing alone keeps counting alike)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    _, mm, layout, n, _ = __import__("manager_helpers").build([Part("a", 1, [0, 1], 0, 2)], BS)

    class IntermediateTensors:  # what vLLM's non-last stages return
        tensors = {"hidden_states": torch.zeros((2, 8))}

    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, got IntermediateTensors"):
        m.save_outputs(IntermediateTensors(), mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
    assert save(m, [Part("a", 1, [0, 1], 0, 2)], BS) == 1


def test_failed_write_is_fatal_and_sticky(committer_factory):
    handle = committer_factory("--heartbeat-s", "0.2", "--heartbeat-timeout-s", "1")
    m = OmniPrefixCacheManager(quick_config(commit_timeout_s=3.0), cache=handle.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS))
        m.wait_idle()
        handle.stop(signal.SIGKILL)
        m.new_step_starts([extended("a", 4)])
        with pytest.raises(OmniPrefixCacheUnmatchError):
            m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 1)], BS))
            m.new_step_starts([extended("a", 5)])
            save(m, [Part("a", 1, [0, 1], 5, 1)], BS)
        for _ in range(2):
            with pytest.raises(OmniPrefixCacheUnmatchError):
                m.new_step_starts([extended("a", 6)])
    finally:
        m.shutdown()
        # The killed committer's segments are ours to sweep.
        from omnishm import orphans
        orphans.sweep(handle.runtime_dir, handle.name)


def test_materialize_fills_preallocated_outputs(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save(m, [Part("a", 1, [0, 1, 2], 0, 10)], BS))
    m.new_step_starts([started("b", [0, 1, 5], hit=8)])
    sid = save(m, [Part("b", 1, [0, 1, 5], 8, 3)], BS)
    bufs = {"b": {HIDDEN_KEY: torch.empty((11, 8)), "feat": torch.empty((11, 3))}}
    out = m.materialize(sid, ["b"], out=bufs)
    assert out.hidden_states["b"].data_ptr() == bufs["b"][HIDDEN_KEY].data_ptr()
    assert torch.equal(bufs["b"][HIDDEN_KEY], expect(1, 8, 1, 8, 3))
    assert torch.equal(bufs["b"]["feat"], expect(1, 8, 1, 8, 3, mm=True))
    m.new_step_starts([extended("b", 11)])
    sid = save(m, [Part("b", 1, [0, 1, 5], 11, 1)], BS)
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor"):
        m.materialize(sid, ["b"], out={"b": {HIDDEN_KEY: torch.empty((2, 8))}})
    m.discard_step(sid)


@pytest.mark.parametrize("bad", ["non-contiguous", "float64"])
def test_materialize_refuses_an_out_buffer_of_another_layout_or_dtype_before_consuming_the_step(mgr, bad):
    """MUTATION (2026-12-06): dropping the contiguity check, or the dtype check, of ``out=`` survived the suite.
    Either buffer is refused with ``ValueError`` and the step stays unconsumed."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    sid = save(m, [Part("a", 1, [0], 0, 4)], BS)
    buf = torch.zeros(MM_WIDTH, 4).t() if bad == "non-contiguous" else torch.zeros(4, MM_WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"materialize\(step \d+\) out"):
        m.materialize(sid, ["a"], out={"a": {"feat": buf}})
    assert torch.equal(m.materialize(sid, ["a"]).hidden_states["a"], rows(1, range(4)))
    m.new_step_starts([finished("a")])


def test_mm_outputs_hold_no_hidden_key_and_each_request_gets_its_own_leftover_copy(mgr):
    """MUTATION (2026-12-06): ``HIDDEN_KEY`` left in each request's ``mm_outputs``, and one leftover tensor
    shared by every request of the step (not cloned per request), both survived the suite."""
    m = mgr()
    m.new_step_starts([started("a", [0]), started("b", [1])])
    meta = torch.tensor([1.0, 2.0, 3.0])
    sid = save(m, [Part("a", 1, [0], 0, 4), Part("b", 2, [1], 0, 4)], BS, extra_mm={"meta": meta})
    out = m.materialize(sid, ["a", "b"])
    assert set(out.mm_outputs["a"]) == set(out.mm_outputs["b"]) == {"feat", "meta"}
    out.mm_outputs["a"]["meta"].add_(100)
    assert torch.equal(out.mm_outputs["b"]["meta"], meta)  # b's copy, and the caller's tensor, unchanged
    assert torch.equal(meta, torch.tensor([1.0, 2.0, 3.0]))
    m.new_step_starts([finished("a"), finished("b")])


def test_materialize_fills_preallocated_outputs_of_a_request_with_no_rows_this_step(mgr):
    # A write of 0 tokens is a valid layout entry; its buffers are (0, width). Viewing one as (0, -1)
    # raised a torch error after the step id was consumed, and every request's results were lost.
    m = mgr()
    m.new_step_starts([started("a", [0]), started("z", [1])])
    h, mm, _, _, _ = build([Part("a", 1, [0], 0, 4)], BS)
    layout = PrefixCacheWriteLayout((PrefixCacheWrite("a", 0, 4), PrefixCacheWrite("z", 4, 0)),
                                    torch.arange(4, dtype=torch.int64))
    sid = m.save_outputs(h, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    bufs = {"z": {HIDDEN_KEY: torch.empty((0, 8)), "feat": torch.empty((0, 3))}}
    out = m.materialize(sid, ["a", "z"], out=bufs)
    assert out.hidden_states["z"].shape == (0, 8) and out.mm_outputs["z"]["feat"].shape == (0, 3)
    assert torch.equal(out.hidden_states["a"], expect(1, 0, 1, 0, 4))
    assert m.unconsumed_step_ids() == []


def test_a_policy_registered_after_the_first_save_is_refused_naming_the_cache(mgr):
    """Rows already saved went by the policy in force: a new one now would split later steps' keys otherwise
    than theirs. The error names the cache, as every error does."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    with pytest.raises(RuntimeError, match=rf"^cache {m.cache}: register_policy must be called before the first"):
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([finished("a")])


def test_an_empty_tensor_of_a_0_token_step_is_a_leftover_and_fixes_no_keys_row_shape(mgr):
    """MUTATION (stop 59, W02; closed stop 60): ``_split_outputs`` taking an mm tensor of a 0-token step as rows
    survived. Its first dim matching 0 tokens says nothing of being per-token (a model's placeholder of that
    step, ``torch.empty(0)`` here), and as rows it opened the key as rows of shape (): the key's first real
    step, rows of width 16, was then refused and the cache turned unusable. A leftover, it goes back to each
    request as it came."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    sid = save(m, [Part("a", 1, [0], 0, 0)], BS, extra_mm={"codes": torch.empty(0)})
    out = m.materialize(sid, ["a"])
    assert out.mm_outputs["a"]["codes"].shape == (0,)
    codes = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    sid = save(m, [Part("a", 1, [0], 0, 4)], BS, extra_mm={"codes": codes})
    out = m.materialize(sid, ["a"])
    assert torch.equal(out.mm_outputs["a"]["codes"], codes)
    m.new_step_starts([finished("a")])


def test_an_interrupt_right_after_materialize_took_its_step_still_frees_the_page_and_pins(mgr, monkeypatch):
    # materialize consumed the id, then computed its deadline outside its try: a KeyboardInterrupt there
    # (SIGINT) kept the step's staging page and hit pins for good, and with all pages held every later
    # save timed out telling the caller to consume ids that were already consumed. Since 2026-12-06 an
    # interrupt also turns the cache sticky-fatal (test_interrupt_safety.py); the page and pins go all the same.
    m = mgr(staging_depth=2)
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([started("b", [0, 2], hit=4)])
    sid = save(m, [Part("b", 2, [0, 2], 4, 2)], BS)

    def interrupted() -> float:
        raise KeyboardInterrupt
    monkeypatch.setattr(m, "_deadline", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.materialize(sid, ["b"])
    monkeypatch.undo()
    # The step's own hold on its page is gone (its write's hold goes with the write's acknowledgement).
    assert all("ctx" not in held for held in m._pages._holds) and m.unconsumed_step_ids() == []
    assert not m._pinned and int(m._pin_count.sum()) == 0
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"interrupted \(sticky.*materialize was cut short by "
                                                          r"KeyboardInterrupt.*step_id=1"):
        m.new_step_starts([started("c", [5])])


def test_a_forked_childs_copy_of_a_manager_shuts_down_at_once_and_leaves_the_parents_alone(mgr):
    """REVIEW (2026-12-05): a process forked from one with a live manager (a vLLM worker's helper, say) ran
    the hooks' exit handler, ``shutdown`` of its copy, on the parent's socket with no I/O thread: it hung in
    libzmq for good. A copy in another process returns at once and touches nothing of the parent's."""
    import os
    import signal

    from manager_helpers import one_applied_step

    m = mgr()
    one_applied_step(m)
    pid = os.fork()
    if pid == 0:  # the child: SIGALRM's default action ends it if the shutdown hangs
        # Not faulthandler's watchdog: the suite's (conftest.py) is armed in the parent, and in a forked child
        # arming another waits for good on the parent's watchdog thread, which the child does not have.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(20)
        try:
            m.shutdown()
        except BaseException:  # noqa: BLE001 - the exit code tells the parent
            os._exit(3)
        os._exit(0)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # pytest-timeout's signal, say: the child must not outlive the test
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    assert os.waitstatus_to_exitcode(status) == 0
    m.new_step_starts([started("b", [1])])  # the parent's manager is untouched
    out = m.materialize(save(m, [Part("b", 2, [1], 0, 4)], BS), ["b"])
    assert torch.equal(out.hidden_states["b"], rows(2, range(4)))
    m.wait_idle()


class _InterruptingTids:
    """The writer's tid counter, raising KeyboardInterrupt (a SIGINT) once when armed: inside ``_send_step``,
    while it builds the step's message."""

    def __init__(self) -> None:
        import itertools

        self._it = itertools.count(1000)
        self.armed = False

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return next(self._it)


@pytest.mark.parametrize("where", ["building the message", "the eager join"])
def test_an_interrupt_anywhere_after_a_save_registered_its_step_abandons_it(committer, where):
    """REVIEW (2026-12-05, of the fix above): an interrupt inside ``_send_step`` outside its own try (while it
    builds the message), or in the eager join after the step was sent, was cleaned up by nobody: the step's
    context and page held for good, the writer not failed, the step's claims never landing."""
    m = OmniPrefixCacheManager(quick_config(), cache=committer.name, autostart=False,
                               eager=where == "the eager join")
    try:
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
        m.wait_idle()
        if where == "the eager join":
            real = m._await_step_write
            armed = [True]

            def await_step_write(fut, timeout_s):
                if armed.pop() if armed else False:
                    raise KeyboardInterrupt
                return real(fut, timeout_s)

            m._await_step_write = await_step_write
        else:
            m._tids = _InterruptingTids()
            m._tids.armed = True
        m.new_step_starts([started("b", [2])])
        with pytest.raises(KeyboardInterrupt):
            save(m, [Part("b", 2, [2], 0, 4)], BS)
        assert m.unconsumed_step_ids() == [] and m._pages.in_use() == 0
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"save_outputs of step 1 failed after the step id"):
            m.new_step_starts([])
    finally:
        m.shutdown()


@pytest.mark.parametrize("first", ["landed", "failed"])
def test_a_deferred_write_handed_over_twice_keeps_the_flusher_alive(mgr, monkeypatch, first):
    """REVIEW (2026-12-05): an interrupt right after the flusher took a write, before ``_flush`` noted it,
    hands the write over again (never lose one). Its second outcome completed its future again:
    InvalidStateError ended the flusher thread, and every write after it never ran. The first outcome, landed
    or failed, is the write's; the second is dropped, and the budget's books end at 0. MUTATION (stop 57):
    with only DONE checked, a first copy that failed was done twice."""
    from omnishm.client import writes as writes_module
    from omnishm.client.writes import WriteTask

    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})), gpu_staging_bytes=1)
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    real_put = m._flusher.put
    handed: list = []
    flushed: list = []
    real_flush = writes_module.Flusher._flush

    def flush(self, task):  # the flusher thread; with first == "failed", the first copy fails
        flushed.append(task)
        if first == "failed" and handed and task is handed[0] and flushed.count(task) == 1:
            raise RuntimeError("injected: the first copy failed")
        return real_flush(self, task)

    monkeypatch.setattr(writes_module.Flusher, "_flush", flush)

    def put(task) -> bool:
        taken = real_put(task)
        handed.append(task)
        if len(handed) == 1:
            raise KeyboardInterrupt  # after the put, before _flush took the write off its list
        return taken

    m._flusher.put = put
    m.new_step_starts([extended("a", 4, [1])])
    with pytest.raises(KeyboardInterrupt):
        save(m, [Part("a", 1, [0, 1], 4, 4)], BS)
    assert len(handed) == 2 and handed[0] is handed[1]
    if first == "failed":
        with pytest.raises(OmniPrefixCacheUnmatchError, match="injected: the first copy failed"):
            handed[0].done.result(timeout=30)
    else:
        handed[0].done.result(timeout=30)
    # A write queued behind the second hand-over is still handled: the flusher thread lived through it.
    probe = WriteTask(tid=-1, req_id="probe", key="no such key", opened_step=0)
    real_put(probe)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="deferred write -1 of request 'probe'"):
        probe.done.result(timeout=30)
    assert flushed.count(handed[0]) == 2  # both hand-overs went through the flusher, answered once
    with m._lock:
        assert (m._held_bytes, m._pending_bytes, len(m._closing)) == (0, 0, 0)


def _b_hits_beside_c(m):
    """a's block 0 committed, then a step planning b's 4-token hit on it beside c's plain rows, and the save's
    (hidden, mm, layout, n) giving b no tokens: b's hit stays planned for its next save."""
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    m.new_step_starts([started("b", [0, 2], hit=4), started("c", [3])])
    h, mm, lay, n, _ = build([Part("c", 5, [3], 0, 2)], BS)
    return h, mm, PrefixCacheWriteLayout((PrefixCacheWrite("b", 0, 0), *lay.writes), lay.slots), n


def test_a_refused_save_keeps_the_pending_hit_of_a_request_it_gave_no_tokens(mgr):
    """Mutation review (2026-12-06): a refused save takes (and drops) the planned hits of the requests it
    wrote rows for, exactly as a taken save would; a request the save gave 0 tokens keeps its hit for its
    next save, as it does after a save that is taken. With the guard widened to 0-token writes
    (``num_tokens >= 0``) the refusal silently dropped b's 4-token hit, and b's next materialize returned its
    2 new rows with no prefix (``num_hit_tokens`` 0): rows lost, no error."""
    m = mgr()
    h, mm, lay0, n = _b_hits_beside_c(m)
    with pytest.raises(OmniPrefixCacheUnmatchError):  # refused: rows in another dtype than the key's
        m.save_outputs(h.double(), mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay0)
    m.new_step_starts([finished("c")])
    sid = save(m, [Part("b", 4, [0, 2], 4, 2)], BS)
    out = m.materialize(sid, ["b"])
    assert out.num_hit_tokens == {"b": 4}
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 4, 4, 2))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 4, 4, 2, mm=True))


def test_a_hit_naming_a_block_past_the_pool_is_refused_and_names_the_request(mgr):
    """Mutation review (2026-12-06): a prefix hit whose block ids name a block outside ``0..num_blocks-1`` is
    refused at ``new_step_starts`` with an ``OmniPrefixCacheUnmatchError`` naming the block and the request,
    and the manager stays usable. With the bound off by one (``b <= num_blocks``) block ``num_blocks`` was
    accepted as a planned hit on slots past the pool (slot ids ``num_slots..``), with no error at all."""
    m = mgr()
    nb = m.config.num_blocks
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"block id {nb} outside 0\.\.{nb - 1}.*request='x'"):
        m.new_step_starts([started("x", [0, nb], hit=8)])
    m.new_step_starts([finished("x"), started("b", [0, 5], hit=4)])
    out = m.materialize(save(m, [Part("b", 2, [0, 5], 4, 2)], BS), ["b"])
    assert out.num_hit_tokens == {"b": 4} and torch.equal(out.hidden_states["b"], expect(1, 4, 2, 4, 2))


def test_the_id_of_a_refused_save_reads_as_consumed_not_as_never_saved(mgr):
    """Mutation review (2026-12-06): a refused save still takes its step id (``_burn_step``), and the id is
    then consumed: a later ``materialize`` or ``discard_step`` of it raises ``OmniPrefixCacheUnmatchError``
    naming the step id and saying it "was already consumed", like any consumed id, not that it "was never
    saved" (which points a user at the wrong bug). With the ``_consumed`` bookkeeping of the burn gone, only
    the reason changed, and no test noticed."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    first = save(m, [Part("a", 1, [0], 0, 4)], BS)
    m.discard_step(first)
    h, mm, lay, n, _ = build([Part("a", 1, [0], 4, 0), Part("c", 5, [3], 0, 2)], BS)
    m.new_step_starts([started("c", [3])])
    with pytest.raises(OmniPrefixCacheUnmatchError):
        m.save_outputs(h.double(), mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay)
    refused = first + 1
    for call in (lambda: m.materialize(refused, ["c"]), lambda: m.discard_step(refused)):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"step id {refused} was already consumed"):
            call()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"step id {refused + 1} was never saved"):
        m.discard_step(refused + 1)
    sid = save(m, [Part("c", 5, [3], 0, 2)], BS)
    assert sid == refused + 1
    assert torch.equal(m.materialize(sid, ["c"]).hidden_states["c"], expect(0, 0, 5, 0, 2))


def test_an_mm_output_named_hidden_key_is_skipped_as_the_seed_says(mgr):
    """The seed's ``skip_immediate_mm``: hidden rows never come from ``mm``. An ``mm_outputs`` entry named
    ``HIDDEN_KEY`` is skipped: neither cached (a hit on its rows serves ``hidden_states``' rows) nor returned
    in any request's ``mm_outputs``; the step's other keys go on as usual. vllm-omni and the drop-in ignore
    it too; the native API raised ``ValueError`` and burned the step id (seed audit, 2026-12-06)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8)], BS)
    mm[HIDDEN_KEY] = torch.full_like(h, -5.0)
    sid = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
    out = m.materialize(sid, ["a"])
    assert set(out.mm_outputs["a"]) == {"feat"} and torch.equal(out.hidden_states["a"], rows(1, range(8)))
    m.new_step_starts([started("b", [0, 5], hit=4)])
    out = m.materialize(save(m, [Part("b", 2, [0, 5], 4, 2)], BS), ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 2, 4, 2))
    assert set(out.mm_outputs["b"]) == {"feat"}
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 2, 4, 2, mm=True))


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("hit", [False, True], ids=["no-hit", "with-a-hit"])
def test_materialize_names_requests_in_any_order_and_twice_alike_with_and_without_hits(mgr, hit, twice):
    """``materialize`` of a step without hits takes a shorter way (``_plain_results``: each result is the arena's
    view already; perf review, 2026-12-06). Both ways give the same result: requests in the order asked,
    one named twice served once, hidden and per-token rows exact, leftovers cloned to each, every
    ``num_hit_tokens`` 0 for a request without a hit."""
    m = mgr()
    m.new_step_starts([started("p", [0])])
    m.discard_step(save(m, [Part("p", 9, [0], 0, 4)], BS))
    m.new_step_starts([started("a", [2, 3]), started("b", [4]), *([started("c", [0, 5], hit=4)] if hit else [])])
    parts = [Part("a", 1, [2, 3], 0, 6), Part("b", 2, [4], 0, 2), *([Part("c", 3, [0, 5], 4, 1)] if hit else [])]
    codes = [1, 2, 3]
    sid = save(m, parts, BS, extra_mm={"codes": codes})
    asked = ["b", "a", *(["b"] if twice else []), *(["c"] if hit else [])]
    out = m.materialize(sid, asked)
    assert list(out.hidden_states) == list(out.mm_outputs) == list(out.num_hit_tokens) == list(dict.fromkeys(asked))
    for req, tag, count in (("a", 1, 6), ("b", 2, 2)):
        assert torch.equal(out.hidden_states[req], rows(tag, range(count)))
        assert torch.equal(out.mm_outputs[req]["feat"], expect(0, 0, tag, 0, count, mm=True))
        assert out.mm_outputs[req]["codes"] == codes and out.mm_outputs[req]["codes"] is not codes
        assert out.num_hit_tokens[req] == 0
    assert out.mm_outputs["a"]["codes"] is not out.mm_outputs["b"]["codes"]
    if hit:
        assert out.num_hit_tokens["c"] == 4 and torch.equal(out.hidden_states["c"], expect(9, 4, 3, 4, 1))


def test_a_readers_unconsumed_step_ids_are_bounded_by_staging_depth(committer):
    """Mutation review (2026-12-06): a reader stages nothing, yet ``staging_depth`` bounds its unconsumed step ids (and
    the step rows it keeps for them) exactly as it bounds the writer's: with depth 1, a second save while the first
    step id is neither materialized nor discarded raises ``OmniPrefixCacheStagingTimeoutError`` naming the holder;
    once it is consumed the next save gets the following id. A reader with a looser bound would run ahead of its
    writer (the same saves replayed in lockstep) and keep unbounded step rows."""
    cfg = quick_config(staging_depth=1, staging_claim_timeout_s=0.05)  # a bound on the expected refusal, not a sync
    with OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        r.new_step_starts([started("a", [0])])
        s0 = save(r, [Part("a", 1, [0], 0, 2)], BS)
        with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=rf"unconsumed step ids \[{s0}\]"):
            save(r, [Part("a", 1, [0], 2, 1)], BS)
        r.discard_step(s0)
        s1 = save(r, [Part("a", 1, [0], 2, 1)], BS)
        assert r._pages.in_use() == 1
        r.discard_step(s1)


def test_an_aborted_requests_untaken_hit_goes_with_it(mgr):
    """A request aborted while its planned hit is still pending (its save gave it no tokens) drops that hit
    (mutation review, stop 59: without the drop at FINISHED/ABORTED the plan stayed for good, one per such
    request, and a later save naming the id again was handed a hit the engine no longer planned)."""
    m = mgr()
    h, mm, lay0, n = _b_hits_beside_c(m)
    m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay0))
    assert "b" in m._pending_hits  # kept for b's next save (a 0-token write keeps its hit)
    m.new_step_starts([aborted("b")])
    assert "b" not in m._pending_hits


def test_every_call_on_a_manager_whose_committer_is_gone_raises_the_committer_error(committer_factory):
    """Once the link gave up on a committer that died (``reconnect_timeout_s``), every call raises
    ``OmniPrefixCacheCommitterError`` at once (mutation review, stop 59: with the ``link.dead`` check gone from
    ``_check_usable``, ``new_step_starts`` went on silently over a cache no committer serves; only the link's own
    fault tests looked at ``dead``)."""
    from omnishm.interface import OmniPrefixCacheCommitterError

    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
    m = OmniPrefixCacheManager(quick_config(reconnect_timeout_s=1.0), cache=handle.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        m.wait_idle()
        handle.stop(signal.SIGKILL)
        until(lambda: m._link.dead is not None, 10.0, "the link giving up on its killed committer")
        for call in (lambda: m.new_step_starts([started("b", [1])]), lambda: save(m, [Part("b", 2, [1], 0, 4)], BS),
                     lambda: m.discard_step(0)):
            with pytest.raises(OmniPrefixCacheCommitterError):
                call()
    finally:
        m.shutdown()
