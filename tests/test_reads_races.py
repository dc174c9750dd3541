"""Read-side races and edge cases of the writer and reader managers (real committer, real shm).

Two tests choose one interleaving with a hook: the step's write is held back
(``Gate``) and lands right after materialize's pool copy, before its checks.
The hook only delays our own messages or waits at one point, so it produces an
order the real threads can produce too; one test shows the same race with no
hook at all.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

import omnishm.client.reads as reads_mod
import omnishm.client.writes as writes_mod
from helpers import loud
from manager_helpers import Part, aborted, expect, extended, finished, quick_config, rows, save, small_config, started
from omnishm.client import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager,
                            OmniPrefixCacheUnmatchError)
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout

BS = 4



class Gate:
    """Hold sends to the committer until released (so rows are IN_TRANSIT at a chosen moment)."""

    def __init__(self):
        self.open = threading.Event()
        self.held = 0

    def wrap(self, submit):
        def gated(make, **kw):
            self.held += 1
            outer: Future = Future()

            def later():
                self.open.wait(10)
                inner = submit(loud(make))  # answered: the chain below completes the step's future

                def chain(f):
                    try:
                        outer.set_result(f.result())
                    except BaseException as exc:  # noqa: BLE001
                        outer.set_exception(exc)
                inner.add_done_callback(chain)
            threading.Thread(target=later, daemon=True).start()
            return outer
        return gated


def same_step_hit_in_transit(m) -> tuple[Gate, int]:
    """Block 0 holds an earlier tenant's rows (tag 5), committed. Then a writes blocks 0-1 and b hits
    block 0 in the same step, whose write the returned gate holds (in transit). Returns (gate, step id)."""
    m.new_step_starts([started("z", [0])])
    m.discard_step(save(m, [Part("z", 5, [0], 0, 4)], BS))
    m.new_step_starts([finished("z")])
    m.wait_idle()
    gate = Gate()
    real = m._link.submit
    m._link.submit = gate.wrap(real)
    m.new_step_starts([started("a", [0, 1]), started("b", [0, 2], hit=4)])
    sid = save(m, [Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)], BS)
    m._link.submit = real  # later sends go straight out
    return gate, sid


def land_right_after_copy(monkeypatch, m, gate):
    """After materialize's pool copy (gather_rows in reads.py), let the held write land,
    and wait until the committer marked it committed, before the code checks the commit table.
    This only chooses an interleaving the real threads can produce."""
    real = reads_mod.gather_rows
    calls = []

    def gather_rows(pool, index, out):
        real(pool, index, out)
        kv = next(k for k in m._keys.values() if k.pool is pool)
        if bool((kv.commit[index] == kv.claim[index]).all()):
            return  # nothing in transit: not the interleaving we want
        calls.append((kv.key, index.clone()))  # copied while IN_TRANSIT
        gate.open.set()
        deadline = time.monotonic() + 5
        while not bool((kv.commit[index] == kv.claim[index]).all()):
            assert time.monotonic() < deadline, "write never landed"
            time.sleep(0.001)

    monkeypatch.setattr(reads_mod, "gather_rows", gather_rows)
    return calls


def test_writer_never_serves_a_row_that_landed_during_its_copy(mgr, monkeypatch):
    """Immediate key, same-step hit (supported: test_same_step_hit_reads_rows_written_in_that_step)."""
    m = mgr()
    gate, sid = same_step_hit_in_transit(m)
    calls = land_right_after_copy(monkeypatch, m, gate)
    out = m.materialize(sid, ["b"])
    assert calls, "no copy of in-transit rows"
    got = out.hidden_states["b"]
    want = expect(1, 4, 1, 4, 3)
    stale = torch.cat([rows(5, range(4)), rows(1, range(4, 7))])
    assert torch.equal(got, want), (
        f"wrong hit rows served: equal to old tenant's rows? {torch.equal(got, stale)}\n{got[:4]}")


def test_writer_never_serves_a_deferred_row_that_landed_during_its_copy(mgr, monkeypatch):
    """Deferred key: the hit closes the open write; its flush lands during materialize's copy."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("z", [0])])
    m.discard_step(save(m, [Part("z", 5, [0], 0, 4)], BS))
    m.new_step_starts([finished("z")])
    m.wait_idle()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    gate = Gate()
    m._flusher._send = gate.wrap(m._flusher._send)
    m.new_step_starts([extended("a", 8, [2]), started("b", [0, 3], hit=4)])
    sid = save(m, [Part("a", 1, [0, 1, 2], 8, 1), Part("b", 1, [0, 3], 4, 2)], BS)
    calls = land_right_after_copy(monkeypatch, m, gate)
    out = m.materialize(sid, ["b"])
    assert calls, "no copy of in-transit rows"
    got = out.mm_outputs["b"]["feat"]
    want = expect(1, 4, 1, 4, 2, mm=True)
    stale = torch.cat([rows(505, range(4), 3), rows(501, range(4, 6), 3)])
    assert torch.equal(got, want), f"wrong hit rows: old tenant's? {torch.equal(got, stale)}\n{got[:4]}"


def test_writer_same_step_hits_without_hooks_are_exact(committer_factory):
    """No hooks: same-step hits with wide rows, materialize right after save. Counts wrong rows served."""
    W = 1 << 18  # 1 MiB per row
    c = committer_factory()
    m = OmniPrefixCacheManager(quick_config(num_blocks=8, staging_capacity_tokens=16, staging_depth=2,
                                      commit_timeout_s=10.0), cache=c.name, autostart=False)
    try:
        _race_body(m, W)
    finally:
        m.shutdown()


def _race_body(m, W):
    wrong = raised = ok = 0
    for it in range(60):
        tag_old, tag_new = 2 * it + 10, 2 * it + 11
        for events, tag in (([started(f"z{it}", [0])], tag_old),):
            m.new_step_starts(events)
            h = torch.full((4, W), float(tag))
            lay = PrefixCacheWriteLayout((PrefixCacheWrite(f"z{it}", 0, 4),), torch.arange(0, 4))
            m.discard_step(m.save_outputs(h, {}, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=lay))
        m.new_step_starts([finished(f"z{it}"), started(f"a{it}", [0, 1]), started(f"b{it}", [0, 2], hit=4)])
        h = torch.full((8 + 2, W), float(tag_new))
        lay = PrefixCacheWriteLayout((PrefixCacheWrite(f"a{it}", 0, 8), PrefixCacheWrite(f"b{it}", 8, 2)),
                                     torch.cat([torch.arange(0, 8), torch.arange(8, 10)]))
        sid = m.save_outputs(h, {}, num_tokens_unpadded=10, num_tokens_padded=10, write_layout=lay)
        try:
            out = m.materialize(sid, [f"b{it}"])
        except OmniPrefixCacheUnmatchError:
            raised += 1
            continue
        got = out.hidden_states[f"b{it}"][:4]
        if bool((got != tag_new).any()):
            wrong += 1
        else:
            ok += 1
        m.new_step_starts([finished(f"a{it}"), finished(f"b{it}")])
    print(f"ok={ok} wrong={wrong} raised={raised}")
    assert wrong == 0, f"{wrong} of {ok + wrong + raised} materialize calls served stale hit rows"
    # The writer waits its own in-flight rows (up to commit_timeout_s), so a refusal here is a regression
    # too (review, 2026-12-06: a writer refusing every in-flight hit passed with 57 of 60 refused).
    assert raised == 0, f"{raised} of {ok + wrong + raised} materialize calls refused a hit in flight"


def test_an_id_finished_and_added_again_in_one_step_keeps_its_hit(mgr):
    """adapter.py: 'A finish therefore always precedes a re-add of the same id in the same step.'
    The re-added request's prefix hit must be served (or raise), never silently dropped."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.wait_idle()
    # 'a' finishes and a new request with the same id starts in the same step, hitting block 0.
    m.new_step_starts([finished("a"), started("a", [0, 2], hit=4)])
    sid = save(m, [Part("a", 1, [0, 2], 4, 3)], BS)
    out = m.materialize(sid, ["a"])
    print("num_hit_tokens", out.num_hit_tokens, "hidden shape", tuple(out.hidden_states["a"].shape))
    assert out.num_hit_tokens["a"] == 4
    assert torch.equal(out.hidden_states["a"], expect(1, 4, 1, 4, 3))


def test_reader_prefetch_may_map_keys_while_save_iterates_them(committer_factory):
    """Reader: the prefetch thread inserts into self._keys (_reader_key) without the state lock,
    while save_outputs iterates self._keys.items() (hit span cvs) on the engine thread."""
    c = committer_factory()
    cfgr = small_config(commit_timeout_s=3.0, staging_claim_timeout_s=0.5)
    with OmniPrefixCacheManager(cfgr, cache=c.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfgr, cache=c.name, role="reader", autostart=False) as r:
        assert r._keys == {}  # attached before the writer opened any key
        feat_opened = threading.Event()
        feat_requested = threading.Event()
        engine_iterating = threading.Event()
        real_request = r._link.request

        def request(make, *a, **kw):
            msg = make(0)
            if getattr(msg, "key", None) == "feat":  # prefetch thread: hold the 2nd key's mapping
                feat_requested.set()
                engine_iterating.wait(5)
                try:
                    return real_request(make, *a, **kw)
                finally:
                    feat_opened.set()
            return real_request(make, *a, **kw)
        r._link.request = request

        steps = [
            ([started("a", [0, 1])], [Part("a", 1, [0, 1], 0, 8)]),
            ([started("b", [0, 2], hit=4)], [Part("b", 1, [0, 2], 4, 2)]),
            ([started("c", [1, 3], hit=4)], [Part("c", 1, [1, 3], 4, 2)]),
        ]
        ids_w, ids_r = [], []
        for i, (events, parts) in enumerate(steps):
            w.new_step_starts(events)
            ids_w.append(save(w, parts, BS))
            r.new_step_starts(events)
            if i == 2:
                # The prefetch of step 1 mapped the hidden key and waits on 'feat'. Make the engine's
                # iteration over r._keys slow at its first item (a GIL switch can land anywhere).
                assert feat_requested.wait(5)  # prefetch of step 1 is done with the hidden key
                kv = r._keys[HIDDEN_KEY]
                real_claim = kv.claim

                class SlowClaim:
                    def __getitem__(self, idx):
                        engine_iterating.set()
                        end = time.monotonic() + 5
                        while "feat" not in r._keys and time.monotonic() < end:  # the prefetch maps it now
                            time.sleep(0.001)
                        return real_claim[idx]
                kv.claim = SlowClaim()
                try:
                    ids_r.append(save(r, parts, BS))
                except RuntimeError as exc:
                    kv.claim = real_claim
                    for sid in ids_r:
                        r.discard_step(sid)
                    pytest.fail(f"reader save_outputs raised {exc!r}; next step id {r._next_step}, "
                                f"unconsumed {r.unconsumed_step_ids()}, staging pages still held: "
                                f"{r._pages.in_use()} of {r._pages.depth}")
                finally:
                    kv.claim = real_claim
            else:
                ids_r.append(save(r, parts, BS))


def test_a_hit_naming_a_block_outside_the_pool_is_refused_before_the_save(mgr):
    """A hit block id >= num_blocks raises a clear unmatch error naming the request at new_step_starts,
    before any step id, page or claim is taken."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.wait_idle()
    next_step = m._next_step
    with pytest.raises(OmniPrefixCacheUnmatchError, match="block id 99 outside") as err:
        m.new_step_starts([started("b", [99, 2], hit=4)])  # num_blocks is 16
    assert "request='b'" in str(err.value)
    assert m._next_step == next_step and m._pages.in_use() == 0 and m.unconsumed_step_ids() == []


def test_rows_saved_in_one_shape_are_never_read_back_in_another(mgr):
    """A tensor whose per-token shape changes at the same width is refused (never silently reshaped)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS, extra_mm={"grid": torch.zeros(4, 2, 3)}))
    m.new_step_starts([extended("a", 4)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"tensor 'grid' has rows of shape \(3, 2\)"):
        save(m, [Part("a", 1, [0, 1], 4, 4)], BS, extra_mm={"grid": torch.zeros(4, 3, 2)})
    m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 4)], BS, extra_mm={"grid": torch.ones(4, 2, 3)}))


def test_requests_materialized_out_of_batch_order_get_their_own_rows(mgr):
    """MUTATION (2026-12-06): ``materialize`` with its requests in another order than the step's batch (b
    before a; a's step rows come before b's) gives each request its own rows. With the result layout merging
    a request into the previous one's copy whenever its rows start at or BEFORE that copy's end (not only
    right at it), a was merged into b's copy, which ran on into c's rows: a got c's rows."""
    m = mgr()
    m.new_step_starts([started("a", [0]), started("b", [1]), started("c", [2])])
    sid = save(m, [Part("a", 1, [0], 0, 3), Part("b", 2, [1], 0, 3), Part("c", 3, [2], 0, 3)], BS)
    out = m.materialize(sid, ["b", "a"])
    assert torch.equal(out.hidden_states["b"], expect(0, 0, 2, 0, 3))
    assert torch.equal(out.hidden_states["a"], expect(0, 0, 1, 0, 3)), out.hidden_states["a"][:, 0]
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(0, 0, 2, 0, 3, mm=True))
    assert torch.equal(out.mm_outputs["a"]["feat"], expect(0, 0, 1, 0, 3, mm=True))


def test_writer_serves_a_hit_whose_rows_are_part_rescued_and_part_landed_during_its_copy(mgr, monkeypatch):
    """SOAK (2026-12-02; ``omnishm demo --tp 2 --duration-s 120 --seed 203 --lag 1 --num-blocks 32
    --block-size 8 --max-batched-tokens 64`` once refused one of the writer's own reads as "reused").

    b's hit on block 0 reads deferred rows of one claim version (a's open write, closed and flushed by the
    hit; the flush is held). Before b's step is consumed, c takes over slots 0-1 of block 0: copy-on-write
    keeps those two rows. materialize's pool copy finds none of the four committed; the flush lands during
    that copy and its row source is dropped. Slots 2-3 are now committed in the pool and slots 0-1 are in
    the rescue, so the writer has every row; it must serve them, not raise "slot reused"."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS))
    m.wait_idle()
    kv = m._keys["feat"]
    cv1 = int(kv.claim[2])
    gate = Gate()
    m._flusher._send = gate.wrap(m._flusher._send)
    m.new_step_starts([started("b", [0, 3], hit=4)])  # closes a's open write; its flush is held
    sid = save(m, [Part("b", 1, [0, 3], 4, 2)], BS)
    m.new_step_starts([aborted("b"), finished("a"), started("c", [0])])
    m.discard_step(save(m, [Part("c", 9, [0], 0, 2)], BS))  # slots 0-1 change tenant: rescued
    assert int(kv.claim[0]) != cv1 and int(kv.claim[2]) == cv1 and int(kv.commit[2]) != cv1

    real = reads_mod.gather_rows
    landed = []

    def gather_rows(pool, index, out):
        real(pool, index, out)
        if pool is kv.pool and not landed and 2 in index.tolist():
            gate.open.set()  # the held flush lands right after the copy, and its source is dropped
            deadline = time.monotonic() + 5
            while int(kv.commit[2]) != cv1 or int(kv.commit[3]) != cv1 or ("feat", cv1) in m._sources:
                assert time.monotonic() < deadline, "the flush never landed"
                time.sleep(0.001)
            landed.append(True)

    monkeypatch.setattr(reads_mod, "gather_rows", gather_rows)
    out = m.materialize(sid, ["b"])
    assert landed, "the interleaving did not happen"
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 2, mm=True))
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 2))


def test_writer_serves_a_hit_rescued_while_its_reading_thread_was_inside_the_step_source(mgr, monkeypatch):
    """A review (2026-12-04) found the writer refusing a hit it had rescued: "slot reused ... and no
    copy-on-write rescue", every time with this interleaving.

    b hits block 0 in the step that writes it (a's rows, held in transit). A pool thread materializes b:
    under the state lock it finds the step's row source alive and no rescue, then copies from the source.
    Meanwhile the write lands (the source dies) and the engine thread's next save hands block 0 to c: it
    rescues b's planned rows first, then claims the slot again. Back from the copy, the thread sees a dead
    source and a moved claim; the rows are in the rescue and must be served from it."""
    m = mgr()
    gate, sid1 = same_step_hit_in_transit(m)
    kv = m._keys[HIDDEN_KEY]
    planned = int(kv.claim[0])
    inside = threading.Event()
    real_take = writes_mod.RowSource.take

    def take(self, want, read):
        rows = real_take(self, want, read)
        if threading.current_thread().name == "mat" and not inside.is_set():
            inside.set()
            gate.open.set()  # the step's write lands now
            deadline = time.monotonic() + 10
            while int(kv.claim[0]) == planned:  # until the engine thread rescued and claimed block 0 again
                assert time.monotonic() < deadline, "the engine thread never claimed block 0 again"
                time.sleep(0.001)
        return rows

    monkeypatch.setattr(writes_mod.RowSource, "take", take)
    result: dict = {}

    def mat():
        try:
            result["out"] = m.materialize(sid1, ["b"])
        except Exception as exc:  # noqa: BLE001 - handed to the assertion below
            result["exc"] = exc

    t = threading.Thread(target=mat, name="mat")
    t.start()
    assert inside.wait(10)
    m.new_step_starts([finished("a"), aborted("b"), started("c", [0])])
    sid2 = save(m, [Part("c", 9, [0], 0, 4)], BS)
    t.join(20)
    assert not t.is_alive()
    m.discard_step(sid2)
    assert m.counters["cow_rescues"] >= 4
    assert "exc" not in result, f"the writer refused a read it had rescued: {result.get('exc')}"
    assert torch.equal(result["out"].hidden_states["b"], expect(1, 4, 1, 4, 3))


def test_a_readers_materialize_of_a_landed_hit_never_waits_for_another_requests_rows(committer):
    """REVIEW (2026-12-06): the reader's prefetch read a step's hit requests one after another and signalled the
    step done after the last, and ``materialize(["x"])`` waited for that: with b's hit rows held in transit for
    3 s, x's call (its rows committed long before) took 2.8 s. Each hit request is claimed by whoever comes to
    it first; materialize waits for the prefetch of the requests it asked for only, and reads the others
    itself."""
    cfg = quick_config(commit_timeout_s=10.0)
    w = OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False)
    r = OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False, role="reader")
    gate = Gate()
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        w.wait_idle()
        real = w._link.submit
        w._link.submit = gate.wrap(real)
        sids = []
        for m in (w, r):  # c writes blocks 1-2; b hits block 1 in the same step (held); x hits block 0 (landed)
            m.new_step_starts([started("c", [1, 2]), started("b", [1, 3], hit=4), started("x", [0, 4], hit=4)])
            sids.append(save(m, [Part("c", 3, [1, 2], 0, 8), Part("b", 3, [1, 3], 4, 2),
                                 Part("x", 1, [0, 4], 4, 2)], BS))
        w._link.submit = real
        w.discard_step(sids[0])
        threading.Timer(3.0, gate.open.set).start()
        deadline = time.monotonic() + 5
        while not r._ctxs[sids[1]].prefetch_taken.locked():  # the prefetch thread took the step (b is first)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        out = r.materialize(sids[1], ["x"])
        took = time.monotonic() - t0
        assert torch.equal(out.hidden_states["x"], expect(1, 4, 1, 4, 2))
        assert took < 1.5, f"materialize of x waited {took:.2f}s for b's rows"
    finally:
        gate.open.set()
        r.shutdown()
        w.shutdown()
