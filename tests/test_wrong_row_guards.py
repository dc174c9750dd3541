"""Guards against a wrong row, each with a test that fails when the guard is taken out.

REVIEW (2026-12-05, stop 42, mutation testing): 25 small plausible bugs were put, one at a time, into the
code that decides which rows are served, and the fast tests run against each. Ten survived, every one of
which would serve a wrong row: the epoch checks of a writer's and a reader's hit read, the claim re-check
after a hit's copy (writer and reader), the writer's fallback pool read without its commit word, the
claims a step clears for the keys it does not save, and the committer's order of a row and its commit
word in each of its three copy paths. These tests kill them; the comment on each names its guard.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import pack
from manager_helpers import MM_WIDTH, WIDTH, Part, build, expect, finished, rows, save, small_config, started
from omnishm import protocol
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.client import reads as reads_module
from omnishm.committer import apply as apply_module
from omnishm.committer.pool import CachePool
from omnishm.interface import HIDDEN_KEY
from omnishm.versions import make_cv

BS = 4


def cfg(**kw):
    return small_config(**{"commit_timeout_s": 3.0, **kw})


def test_new_writer_never_serves_a_previous_writers_rows_for_a_hit_it_never_wrote(committer_factory):
    """w1 commits block 0 (tag 1) and leaves; w2, a new engine (new epoch) on the same cache, gets a vLLM
    prefix hit on block 0 that it never wrote: the rows in the pool are w1's, not w2's, so materialize
    must refuse (never serve tag 1)."""
    handle = committer_factory()
    config = cfg()
    w1 = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    w2 = None
    try:
        w1.new_step_starts([started("a", [0])])
        w1.discard_step(save(w1, [Part("a", 1, [0], 0, 4)], BS))
        w1.wait_idle()
        w1.shutdown()
        w2 = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
        w2.new_step_starts([started("b", [0, 1], hit=4)])
        sid = save(w2, [Part("b", 2, [0, 1], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError):
            out = w2.materialize(sid, ["b"])
            pytest.fail(f"served {out.num_hit_tokens} hit rows written by another writer epoch")
    finally:
        for m in (w1, w2):
            if m is not None:
                m.shutdown()


def test_reader_refuses_rows_of_a_replacing_writer_claimed_after_its_publication_wait(committer_factory):
    """The reader's step 1 hits block 0 (its writer w1 wrote tag 1 there, and published step 1). Right after
    the reader's publication wait returns, w1 leaves and a new writer w2 (new epoch, step ids from 0 again)
    re-claims block 0 with tag 9 and commits it. The claim's step field (0) is not later than the reader's
    step (1): only the epoch check tells the reader the row is another writer's. It must refuse, never
    serve tag 9 (nor tag 1 from a reused slot)."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg()
    w1 = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    box = {}
    try:
        for m in (w1, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        for m in (w1, r):
            m.new_step_starts([started("b", [0, 1], hit=4)])
        w1.discard_step(save(w1, [Part("b", 1, [0, 1], 4, 2)], BS))
        w1.wait_idle()
        real_wait = r._wait_published

        def wait_then_replace(step_id, deadline, **named):
            real_wait(step_id, deadline, **named)
            if "w2" not in box:
                w1.shutdown()
                w2 = box["w2"] = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
                w2.new_step_starts([started("x", [0])])
                w2.discard_step(save(w2, [Part("x", 9, [0], 0, 4)], BS))
                w2.wait_idle()

        r._wait_published = wait_then_replace  # before the save: the prefetch thread waits through it too
        sid = save(r, [Part("b", 1, [0, 1], 4, 2)], BS)
        try:
            out = r.materialize(sid, ["b"])
        except OmniPrefixCacheUnmatchError:
            return
        got = out.hidden_states["b"]
        if got.equal(expect(1, 4, 1, 4, 2)):
            return  # its own writer's rows (read before the replacement landed): right
        pytest.fail(f"reader served hit rows after its writer was replaced: hit={out.num_hit_tokens}, "
                    f"first row {got[0][:4].tolist()}")
    finally:
        for m in (w1, r, box.get("w2")):
            if m is not None:
                m.shutdown()


@pytest.mark.parametrize("role", ["writer", "reader"])
def test_hit_on_a_key_the_slots_new_tenant_did_not_save_refuses_the_old_tenants_row(committer_factory, role):
    """Step 0: a saves block 0 with hidden + feat (tag 1). Step 1: a finished, c reuses block 0 and saves
    hidden only (tag 3). Step 2: b hits block 0. Its hidden rows are c's (tag 3); its feat rows at block 0
    belong to a, a previous tenant: the hit must refuse, never serve a's feat rows (tag 501)."""
    handle = committer_factory()
    config = small_config(commit_timeout_s=3.0)
    w = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        sid = {}
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
            m.new_step_starts([finished("a"), started("c", [0])])
            m.discard_step(save(m, [Part("c", 3, [0], 0, 4)], BS, mm_key=None))
            m.new_step_starts([started("b", [0, 1], hit=4)])
            sid[m] = save(m, [Part("b", 5, [0, 1], 4, 2)], BS)
        w.wait_idle()
        m = w if role == "writer" else r
        other = r if role == "writer" else w
        other.discard_step(sid[other])
        try:
            out = m.materialize(sid[m], ["b"])
        except OmniPrefixCacheUnmatchError:
            return
        feat = out.mm_outputs["b"]["feat"]
        pytest.fail(f"served a previous tenant's feat rows for the hit: {feat[0][:3].tolist()}")
    finally:
        for m in (w, r):
            m.shutdown()


def test_a_refused_save_covering_slot_0_makes_slot_0_absent(mgr):
    """MUTATION (2026-12-06): a save the writer refuses makes every slot it covers absent, slot 0 included.
    z commits block 0 (tag 5) and finishes; a reuses block 0 and its first save (token 0, slot 0 only) is
    refused; a's next step saves tokens 1-3; c then hits a's full block 0. Slot 0 was never written by a:
    the hit must refuse. With ``_forget_refused`` keeping only slots ``> 0`` (not ``>= 0``), the refused save
    left slot 0's previous tenant's claim in place and the hit served z's row 0 as a's."""
    m = mgr()
    m.new_step_starts([started("z", [0])])
    m.discard_step(save(m, [Part("z", 5, [0], 0, 4)], BS))
    m.wait_idle()
    m.new_step_starts([finished("z"), started("a", [0, 1])])
    h, mm, layout, n, _ = build([Part("a", 1, [0, 1], 0, 1)], BS)  # a's token 0, slot 0
    with pytest.raises(OmniPrefixCacheUnmatchError):  # float64 rows for a float32 key: refused
        m.save_outputs(h.double(), mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
    m.new_step_starts([])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 1, 3)], BS))  # a's tokens 1-3: slots 1-3
    m.wait_idle()
    m.new_step_starts([started("c", [0, 3], hit=4)])
    sid = save(m, [Part("c", 1, [0, 3], 4, 2)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        out = m.materialize(sid, ["c"])
        pytest.fail(f"served slot 0's previous tenant's row for the hit: {out.hidden_states['c'][0].tolist()}")


def test_writer_hit_read_that_races_a_reclaim_serves_the_rescued_rows(committer_factory, monkeypatch):
    """b's hit on block 0 (tag 1) passes the commit/claim check; while its pool copy runs, the engine thread
    saves a step that re-claims block 0 (tag 7; copy-on-write rescues tag 1 first) and the committer lands
    it, so the copy reads tag 7. The claim re-check after the copy must see the move and serve the rescue."""
    handle = committer_factory()
    w = OmniPrefixCacheManager(small_config(commit_timeout_s=5.0), cache=handle.name, autostart=False)
    try:
        w.new_step_starts([started("a", [0])])
        w.discard_step(save(w, [Part("a", 1, [0], 0, 4)], BS))
        w.wait_idle()
        w.new_step_starts([started("b", [0, 1], hit=4)])
        sid = save(w, [Part("b", 2, [0, 1], 4, 2)], BS)
        real = reads_module.gather_rows
        fired = []

        def gather_during_reclaim(pool, slots, out):
            if not fired:
                fired.append(1)

                def engine_step():
                    w.new_step_starts([started("c", [0])])
                    w.discard_step(save(w, [Part("c", 7, [0], 0, 4)], BS))
                    w.wait_idle()
                t = threading.Thread(target=engine_step)
                t.start()
                t.join(10)
                assert not t.is_alive(), "engine step blocked by the read"
            real(pool, slots, out)

        monkeypatch.setattr(reads_module, "gather_rows", gather_during_reclaim)
        out = w.materialize(sid, ["b"])
        assert fired
        assert out.num_hit_tokens["b"] == 4
        assert out.hidden_states["b"].equal(expect(1, 4, 2, 4, 2)), out.hidden_states["b"][:, 0]
    finally:
        w.shutdown()


def test_reader_copy_that_races_a_reclaim_refuses(committer_factory, monkeypatch):
    """One key only (with two, the second key's pre-copy check would refuse anyway). The reader's hit on
    block 0 (tag 1) passes its commit check; while it copies, its writer re-claims block 0 (tag 7) and the
    committer lands it. The reader has no rescue: it must refuse, never serve tag 7."""
    handle = committer_factory()
    config = small_config(commit_timeout_s=5.0)
    w = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS, mm_key=None))
            m.new_step_starts([started("b", [0, 1], hit=4)])
        w.discard_step(save(w, [Part("b", 2, [0, 1], 4, 2)], BS, mm_key=None))
        w.wait_idle()
        real = reads_module.gather_rows
        fired = []

        def gather_during_reclaim(pool, slots, out):
            if not fired:
                fired.append(1)
                w.new_step_starts([started("c", [0])])
                w.discard_step(save(w, [Part("c", 7, [0], 0, 4)], BS, mm_key=None))
                w.wait_idle()
            real(pool, slots, out)

        monkeypatch.setattr(reads_module, "gather_rows", gather_during_reclaim)
        sid = {r: save(r, [Part("b", 2, [0, 1], 4, 2)], BS, mm_key=None)}
        try:
            out = r.materialize(sid[r], ["b"])
        except OmniPrefixCacheUnmatchError:
            assert fired
            return
        assert fired
        assert out.hidden_states["b"].equal(expect(1, 4, 2, 4, 2)), out.hidden_states["b"][:, 0]
    finally:
        for m in (w, r):
            m.shutdown()


def test_writer_never_serves_a_claimed_but_uncommitted_pool_row(committer_factory):
    """Unit level (_resolve_rows): slot 0 is claimed at the planned version, its commit word is not (the row
    has not landed) and no live source or rescue holds it. The pool row there is the previous tenant's:
    the writer must wait and refuse at the deadline, never serve it."""
    handle = committer_factory()
    w = OmniPrefixCacheManager(small_config(commit_timeout_s=0.5), cache=handle.name, autostart=False)
    try:
        cv = make_cv(w._epoch, 1, 1)
        old = make_cv(w._epoch, 0, 1)
        kv = SimpleNamespace(pool=torch.full((4, 8), 666.0), claim=torch.tensor([cv, 0, 0, 0]),
                             commit=torch.tensor([old, 0, 0, 0]))
        out = torch.zeros((1, 8))
        with pytest.raises(OmniPrefixCacheUnmatchError):
            w._resolve_rows(kv, torch.tensor([0]), torch.tensor([cv]), out, None, "nokey", "b", 1,
                            time.monotonic() + 0.5)
            pytest.fail(f"served an uncommitted pool row {out[0].tolist()}")
    finally:
        w.shutdown()


def test_writer_refuses_a_hit_slot_reclaimed_without_a_rescue_at_once(committer_factory):
    """MUTATION (2026-12-06): unit level (_resolve_rows): slot 0 was claimed again (and committed) at a newer
    version since the hit was planned, and no rescue holds the planned rows: the writer must refuse at once,
    saying the slot was reused. With the claim check of ``_fix_rows`` taken out, it polled for rows that can
    never land and held the engine thread until the deadline (commit_timeout_s) before refusing."""
    handle = committer_factory()
    w = OmniPrefixCacheManager(small_config(commit_timeout_s=5.0), cache=handle.name, autostart=False)
    try:
        cv = make_cv(w._epoch, 1, 1)
        new = make_cv(w._epoch, 2, 1)
        kv = SimpleNamespace(pool=torch.full((4, 8), 666.0), claim=torch.tensor([new, 0, 0, 0]),
                             commit=torch.tensor([new, 0, 0, 0]))
        out = torch.zeros((1, 8))
        t0 = time.monotonic()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="slot reused before the read"):
            w._resolve_rows(kv, torch.tensor([0]), torch.tensor([cv]), out, None, "nokey", "b", 1,
                            time.monotonic() + 5.0)
        took = time.monotonic() - t0
        assert took < 2.5, f"refused after {took:.1f}s: it waited for the deadline"
    finally:
        w.shutdown()


class _ReclaimedDuringCopy:
    """A pool whose row copy races a re-claim of the slot: the new tenant's claim is stored and its row
    lands half way through the copy (the copy is torn: half old row, half new)."""

    def __init__(self, kv, new: int):
        self.kv, self.new, self.rows = kv, new, torch.full((4, 8), 1.0)

    def index_select(self, dim, idx):
        got = self.rows.index_select(dim, idx)
        self.kv.claim[idx] = self.new
        self.rows[idx] = 777.0
        got[:, 4:] = 777.0
        return got


def test_writer_fallback_pool_read_refuses_a_row_reclaimed_during_its_copy(committer_factory):
    """MUTATION (2026-12-06): unit level (_fix_rows): the writer's fallback read of a committed pool row is
    checked again after the copy (seqlock); a slot claimed again while it copied may hold the new tenant's
    row, torn: refuse, never serve it. With the claim re-check after that copy taken out, the writer served
    the torn row (half the previous tenant's, half the new one's)."""
    handle = committer_factory()
    w = OmniPrefixCacheManager(small_config(commit_timeout_s=1.0), cache=handle.name, autostart=False)
    try:
        cv = make_cv(w._epoch, 1, 1)
        new = make_cv(w._epoch, 2, 1)
        kv = SimpleNamespace(claim=torch.tensor([cv, 0, 0, 0]), commit=torch.tensor([cv, 0, 0, 0]))
        kv.pool = _ReclaimedDuringCopy(kv, new)
        out = torch.zeros((1, 8))
        with pytest.raises(OmniPrefixCacheUnmatchError, match="slot reused before the read"):
            w._fix_rows(kv, torch.tensor([0]), torch.tensor([cv]), out, torch.tensor([True]), None, "nokey",
                        "b", 1, time.monotonic() + 1.0)
            pytest.fail(f"served a row re-claimed during its copy: {out[0].tolist()}")
    finally:
        w.shutdown()


CLIENT = "c" * 32
EPOCH = 1


class _CommitSpy(np.ndarray):
    """A commit table view that checks, at each store, that the pool rows of those slots are the staged ones."""

    def __setitem__(self, idx, value):
        slots = np.atleast_1d(np.arange(len(self))[idx])
        for s in slots.tolist():
            self.seen.append((s, bool((self.pool_data[s] == self.expect[s]).all())))
        super().__setitem__(idx, value)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("rows", [3, 24])
@pytest.mark.parametrize("width", [64, 16384])
def test_commit_word_is_stored_after_the_row(monkeypatch, fast, rows, width):
    if not fast:
        monkeypatch.setattr(apply_module, "_LITTLE_ENDIAN", False)  # forces the general path
    pool = CachePool(f"tmut{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8])
    try:
        pool.set_layout(protocol.Layout(num_blocks=8, block_size=4))
        state = pool.open_key("h", protocol.KeySpec("float32", width, (width,)))
        staging = pool.ensure_staging(CLIENT, state, 32)
        torch.from_numpy(staging.data).copy_(torch.randint(1, 256, tuple(staging.data.shape), dtype=torch.uint8))
        assert pool.set_writer_epoch(EPOCH, CLIENT, 32) is not False
        slots = list(range(4, 4 + rows))
        cv = make_cv(EPOCH, 1, 1)
        state.claim[slots] = cv
        spy = state.commit.view(_CommitSpy)
        spy.seen, spy.pool_data = [], state.data
        spy.expect = {s: staging.data[i].copy() for i, s in enumerate(slots)}
        state.commit = spy
        msg = protocol.StepWrite(rid=1, step=1, keys=["h"], key_idx=pack([0]), tids=pack([1]), cvs=pack([cv]),
                                 src_rows=pack([0]), counts=pack([rows]), slots=pack(slots), quiet=True)
        done = pool.apply_step(CLIENT, msg, EPOCH)
        assert getattr(done, "error", None) in (None, ""), done
        assert sorted(s for s, _ in spy.seen) == slots
        early = [s for s, ok in spy.seen if not ok]
        assert not early, f"commit word stored before the row landed for slots {early}"
    finally:
        pool.close()


def test_hidden_states_of_another_row_count_than_the_step_are_refused_and_the_cache_stays_usable(mgr):
    """``save_outputs`` takes hidden states of ``num_tokens_unpadded`` or ``num_tokens_padded`` rows only:
    any other row count (one row too many, one too few) is refused with ``OmniPrefixCacheUnmatchError``
    naming the hidden key before the step's rows are staged, so no row of another token is ever saved under
    a slot, and the cache stays usable: the next step saves and its rows land. Mutation review (2026-12-06): with only the
    dimension checked, one row too many was silently cut to the step's rows, and one too few failed the
    staging copy after the step id was issued, turning the cache sticky-fatal."""
    from omnishm.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError

    m = mgr()
    m.new_step_starts([started("a", [0])])
    h, mm, layout, n, pad = build([Part("a", 1, [0], 0, 3)], BS)
    for bad in (torch.cat([h, h[:1]]), h[:2]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="hidden_states has shape") as info:
            m.save_outputs(bad, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
        assert info.value.key == HIDDEN_KEY
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    hidden = m._keys[HIDDEN_KEY]
    assert bool((hidden.commit[torch.arange(0, 4)] == hidden.claim[torch.arange(0, 4)]).all())


# Stop 52's mutation review of the read path (30 mutants, 22 killed by the suite): gaps (a fourth is in
# test_tp's reader-given-other-block-ids test, for out= buffers).


def test_writer_never_serves_a_live_source_that_died_during_its_copy(committer_factory):
    """Unit level (``_fix_rows``): a hit row not yet committed is read from its step's live row source; the
    source's write lands while the copy runs (``alive`` drops, its staging page may be reused by the next
    step, so the copy may hold another step's rows). The writer must re-check ``alive`` after the copy and
    then serve the committed pool row, never the rows the dead source's copy returned (a wrong row)."""
    handle = committer_factory()
    w = OmniPrefixCacheManager(small_config(commit_timeout_s=2.0), cache=handle.name, autostart=False)
    try:
        cv = make_cv(w._epoch, 1, 1)
        good = torch.full((4, 8), 1.0)
        kv = SimpleNamespace(pool=good.clone(), claim=torch.tensor([cv, 0, 0, 0]),
                             commit=torch.tensor([0, 0, 0, 0]))

        class DiesDuringCopy:
            alive = True

            def take(self, want, read):
                # The write landed meanwhile (commit word stored) and the page went to a later step.
                kv.commit[0] = cv
                self.alive = False
                return torch.full((len(want), 8), 666.0)

        with w._lock:
            w._step_sources[("k", 1)] = DiesDuringCopy()
        out = torch.zeros((1, 8))
        slots, cvs = torch.tensor([0]), torch.tensor([cv])
        w._fix_rows(kv, slots, cvs, out, torch.tensor([True]), None, "k", "b", 1, time.monotonic() + 2.0)
        assert out.equal(good[:1]), f"served the dead source's copy {out[0].tolist()}"
    finally:
        with w._lock:
            w._step_sources.pop(("k", 1), None)
        w.shutdown()


def test_a_subset_asked_in_reverse_step_order_gets_each_requests_own_rows(committer):
    """``materialize`` of a step without hits may ask for its requests in any order and any subset: each
    gets exactly its own step rows. ``_arena`` joins only requests adjacent IN THE STEP into one copy; a
    request that merely follows in the result (c then b of a, b, c, d) must not be joined with the one
    before it, or b would be served d's rows (wrong rows)."""
    w = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        w.new_step_starts([started("a", [0]), started("b", [1]), started("c", [2]), started("d", [3])])
        sid = save(w, [Part("a", 1, [0], 0, 2), Part("b", 2, [1], 0, 2), Part("c", 3, [2], 0, 2),
                       Part("d", 4, [3], 0, 2)], 4)
        out = w.materialize(sid, ["c", "b"])
        assert set(out.hidden_states) == {"c", "b"}
        for req, tag in (("c", 3), ("b", 2)):
            assert out.num_hit_tokens[req] == 0
            assert out.hidden_states[req].equal(rows(tag, range(2), WIDTH)), (req, out.hidden_states[req][:, 0])
            assert out.mm_outputs[req]["feat"].equal(rows(tag + 500, range(2), MM_WIDTH)), req
            assert HIDDEN_KEY not in out.mm_outputs[req]
    finally:
        w.shutdown()


def test_reader_serves_rows_that_landed_as_their_writer_left(committer_factory, monkeypatch):
    """Unit level (``_read_committed``): a reader waits for a hit row still landing; its writer says goodbye
    just as the row's commit word is stored (seen together on the same pass). Rows committed before the
    writer left are whole and this reader's: it must read them on the next pass and serve them, not raise
    ``OmniPrefixCacheUnmatchError`` ("not committed before their writer left") and lose the request."""
    handle = committer_factory()
    r = OmniPrefixCacheManager(small_config(commit_timeout_s=2.0), cache=handle.name, role="reader",
                               autostart=False)
    try:
        r._follows = 1  # the writer of epoch 1 is the one this reader follows
        cv = make_cv(1, 1, 1)
        good = torch.full((4, 8), 1.0)
        kv = SimpleNamespace(pool=good.clone(), claim=torch.tensor([cv, 0, 0, 0]),
                             commit=torch.tensor([0, 0, 0, 0]))

        def left_as_the_row_landed(since):
            kv.commit[0] = cv
            return True

        monkeypatch.setattr(r, "_writer_left", left_as_the_row_landed)
        out = torch.zeros((1, 8))
        r._read_committed(kv, torch.tensor([0]), out, "k", "b", 1, time.monotonic() + 2.0)
        assert out.equal(good[:1])
    finally:
        r.shutdown()


def test_a_reader_whose_writer_published_the_step_then_left_serves_it(committer_factory, monkeypatch):
    """Unit level (``_wait_published``): the writer this reader follows publishes the step and says goodbye
    between two of the reader's polls (seen together on the same pass). The step was published by its own
    writer, so its claims are in the table: the wait returns instead of raising ``OmniPrefixCacheUnmatchError``
    ("writer left the cache before publishing") and losing every hit of the step (mutation review, stop 59:
    dropping the re-check of the publication once the writer is seen gone passed every test)."""
    handle = committer_factory()
    r = OmniPrefixCacheManager(small_config(commit_timeout_s=2.0), cache=handle.name, role="reader",
                               autostart=False)
    try:
        r._follows = 1  # the writer of epoch 1 is the one this reader follows
        state = {"published": False, "polls": 0}

        def published(step_id):
            state["polls"] += 1
            return state["published"]

        def published_as_it_left(since):
            state["published"] = True  # its publication landed just before its goodbye was seen
            return True

        monkeypatch.setattr(r, "_published", published)
        monkeypatch.setattr(r, "_writer_left", published_as_it_left)
        r._wait_published(7, time.monotonic() + 2.0, req="b", key="k")  # returns: the step counts
        assert state["polls"] >= 2
    finally:
        r.shutdown()


def test_reader_never_copies_a_claimed_row_before_its_commit_word_matches(committer_factory, monkeypatch):
    """Unit level (``_read_committed``, the reader's seqlock): a hit row whose claim is this step's but whose
    commit word is not yet stored is still being written by the committer; the reader waits for the commit
    and copies only then, and when it never comes, raises ``OmniPrefixCacheUnmatchError`` by the deadline with
    ``out`` untouched. Only the randomised multi-process test of test_tp caught a reader that copied without
    the commit check (stop 52's mutation review)."""
    handle = committer_factory()
    r = OmniPrefixCacheManager(small_config(commit_timeout_s=2.0), cache=handle.name, role="reader",
                               autostart=False)
    try:
        r._follows = 1
        cv = make_cv(1, 1, 1)
        kv = SimpleNamespace(pool=torch.full((4, 8), 5.0), claim=torch.tensor([cv, 0, 0, 0]),
                             commit=torch.tensor([0, 0, 0, 0]))
        polls = []

        def landing_on_the_third_poll(since):
            polls.append(kv.pool[0, 0].item())
            if len(polls) == 3:
                kv.pool[0] = 1.0  # the committer's copy ends, then its commit word
                kv.commit[0] = cv
            return False

        monkeypatch.setattr(r, "_writer_left", landing_on_the_third_poll)
        out = torch.zeros((1, 8))
        r._read_committed(kv, torch.tensor([0]), out, "k", "b", 1, time.monotonic() + 2.0)
        assert len(polls) == 3 and out.equal(torch.ones((1, 8))), (polls, out[0].tolist())
        kv.commit[0] = 0  # a row whose commit never comes
        out.zero_()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="not committed within") as err:
            r._read_committed(kv, torch.tensor([0]), out, "k", "b", 1, time.monotonic() + 0.1)
        assert "request='b'" in str(err.value) and "step_id=1" in str(err.value)
        assert out.equal(torch.zeros((1, 8)))
    finally:
        r.shutdown()


@pytest.mark.parametrize("how", ["writer left", "writer replaced"])
def test_a_readers_refusal_for_its_writer_names_the_request_and_tensor(committer_factory, how):
    """REVIEW (2026-12-07, stop 53): a reader's hit refused because its writer left or was replaced said
    ``request=None, tensor=None``, though it was asked for one request. It names the first hit request asked
    for and a tensor of the step now, as every refusal must. A real committer; the writer leaves by goodbye."""
    from manager_helpers import BS, one_applied_step

    h = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "2.0")
    config = small_config(commit_timeout_s=10.0)
    writer = OmniPrefixCacheManager(config, cache=h.name, autostart=False)
    reader = OmniPrefixCacheManager(config, cache=h.name, role="reader", autostart=False)
    other = None
    try:
        for m in (writer, reader):
            one_applied_step(m)
        writer.shutdown()
        if how == "writer replaced":
            other = OmniPrefixCacheManager(config, cache=h.name, autostart=False)
        reader.new_step_starts([started("b", [0, 1], hit=4), started("c", [2])])
        sid = save(reader, [Part("c", 3, [2], 0, 4), Part("b", 2, [0, 1], 4, 2)], BS)
        why = "was replaced by writer epoch" if how == "writer replaced" else "writer left the cache"
        with pytest.raises(OmniPrefixCacheUnmatchError, match=why) as err:
            reader.materialize(sid, ["c", "b"])
        assert (err.value.req_id, err.value.key, err.value.step_id) == ("b", HIDDEN_KEY, sid), str(err.value)
        assert f"request='b', tensor='{HIDDEN_KEY}', step_id={sid}" in str(err.value)
    finally:
        for m in (reader, writer, other):
            if m is not None:
                m.shutdown()


def test_a_reader_that_follows_no_writer_yet_says_so_when_its_wait_ends(committer_factory):
    """REVIEW (2026-12-07, stop 53): a reader that attached while its writer sat idle follows no writer until
    that writer attaches again or publishes (an earlier engine's writer, killed and not yet reaped, holds the
    seat the same way and never publishes). Its hit waits ``commit_timeout_s`` and is refused; the refusal
    said the publication was "not this reader's", blaming the writer, where this reader follows none yet."""
    from manager_helpers import BS

    h = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "2.0")
    writer = OmniPrefixCacheManager(small_config(), cache=h.name, autostart=False)
    reader = None
    try:
        writer.new_step_starts([started("a", [0])])
        writer.discard_step(save(writer, [Part("a", 1, [0], 0, 4)], BS))
        writer.wait_idle()
        reader = OmniPrefixCacheManager(small_config(commit_timeout_s=0.5), cache=h.name, role="reader",
                                        autostart=False)
        reader.new_step_starts([started("b", [0, 1], hit=4), started("c", [2])])
        sid = save(reader, [Part("b", 2, [0, 1], 4, 2), Part("c", 3, [2], 0, 4)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="this reader follows no writer yet: none attached or "
                                                              "published since it attached") as err:
            reader.materialize(sid, ["b"])
        assert err.value.req_id == "b" and err.value.step_id == sid
        # Asked for e alone (no hit of its own): its rows are this rank's own, served with no wait on the writer
        # (review, stop 56: it waited for the publication and was refused like d's hit).
        reader.new_step_starts([finished("b"), finished("c"), started("d", [0, 5], hit=4), started("e", [6])])
        sid = save(reader, [Part("d", 4, [0, 5], 4, 1), Part("e", 5, [6], 0, 4)], BS)
        assert torch.equal(reader.materialize(sid, ["e"]).hidden_states["e"], expect(5, 0, 5, 0, 4))
    finally:
        if reader is not None:
            reader.shutdown()
        writer.shutdown()


def test_a_ranks_disagree_refusal_names_request_tensor_and_step(committer):
    """MUTATION (2026-12-07, stop 53): the plan refusal names a tensor of the step too; nothing pinned it."""
    from manager_helpers import BS

    cfg = small_config(commit_timeout_s=3.0)
    w = OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False)
    r = OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False)
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0]), started("x", [1])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4), Part("x", 7, [1], 0, 4)], BS))
        w.new_step_starts([started("b", [0, 2], hit=4)])
        r.new_step_starts([started("b", [1, 2], hit=4)])  # another block than the writer's for b's hit
        ids = [save(m, [Part("b", 1, [0, 2], 4, 2)], BS) for m in (w, r)]
        w.discard_step(ids[0])
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"ranks disagree") as err:
            r.materialize(ids[1], ["b"])
        assert (err.value.req_id, err.value.key, err.value.step_id) == ("b", HIDDEN_KEY, ids[1]), str(err.value)
        assert f"request='b', tensor='{HIDDEN_KEY}', step_id={ids[1]}" in str(err.value)
    finally:
        w.shutdown()
        r.shutdown()


def test_a_refused_saves_slots_keep_the_rows_an_earlier_pending_read_planned(mgr):
    """A refused save's slots become absent (``_forget_refused``), copy-on-write first: b's step, saved before it
    with a hit on block 0 and not materialized yet, still reads the rows it planned (mutation review, stop 59:
    the rescue dropped passed every test, and b's read lost its planned rows)."""
    from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout

    m = mgr()
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    m.new_step_starts([started("b", [0, 2], hit=4)])
    sid = save(m, [Part("b", 2, [0, 2], 4, 2)], BS)  # b's hit on block 0: a planned read, not made yet
    m.new_step_starts([started("c", [3])])
    h, mm, _, n, pad = build([Part("c", 3, [3], 0, 4)], BS)
    bad = PrefixCacheWriteLayout((PrefixCacheWrite("c", 0, 4),), torch.tensor([0, 1, 0, 3]))  # slot 0 twice
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot twice"):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=bad)
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 2, 4, 2)) and out.num_hit_tokens["b"] == 4


def test_a_refused_save_whose_slots_could_not_be_made_absent_is_not_published(mgr, monkeypatch):
    """A writer publishes a refused save's step id only once its slots are absent (``_burn_step``): its readers'
    waits for it then end at once. When they could not be cleared, the step stays unpublished, and a reader
    with a hit in that step waits out its bound and raises instead of reading the slots' previous tenant
    (mutation review, stop 59: publishing it anyway passed every test)."""
    from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout

    m = mgr()
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    published = int(m._ctl_mv[protocol.CTL_PUBLISHED_STEP])

    def cannot_clear(slots):
        raise RuntimeError("the claim table could not be written")

    monkeypatch.setattr(m, "_make_absent", cannot_clear)
    m.new_step_starts([started("c", [3])])
    h, mm, _, n, pad = build([Part("c", 3, [3], 0, 4)], BS)
    bad = PrefixCacheWriteLayout((PrefixCacheWrite("c", 0, 4),), torch.tensor([12, 13, 12, 15]))  # a slot twice
    with pytest.raises(RuntimeError, match="could not be written"):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=bad)
    assert int(m._ctl_mv[protocol.CTL_PUBLISHED_STEP]) == published
    assert m.unconsumed_step_ids() == []  # the id was taken all the same
    with pytest.raises(OmniPrefixCacheUnmatchError, match="could not be made absent"):  # and the cache is sticky
        m.new_step_starts([])
