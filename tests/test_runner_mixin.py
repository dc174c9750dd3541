"""``PrefixCacheRunnerMixin`` on a GPUModelRunner-shaped fake, against a real committer.

``FakeRunner`` carries what the mixin reads from a vLLM 0.32 runner
(``vllm_config``, ``kv_cache_config``, ``input_batch`` with a real CPU block
table, ``get_model``) and a minimal ``_update_states``/forward. The forward's
rows are a pure function of a request's content tag and token position
(``manager_helpers.rows``), so a merged hit is checked bit for bit.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch

from helpers import interrupt_once
from manager_helpers import MM_WIDTH, WIDTH, rows
from omnishm import shm
from omnishm.client import HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheUnmatchError
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.group_view import PrefixCacheConfigError
from omnishm.client.runner_mixin import PrefixCacheRunnerMixin, replica_cache_name
from omnishm.config import ConfigError

BS = 4
NUM_BLOCKS = 16
MAX_REQS = 4
MAX_BLOCKS = 4
OVERRIDES = {"staging_depth": 3, "staging_claim_timeout_s": 0.5, "commit_timeout_s": 5.0}


class FullAttentionSpec:  # named like vLLM's; the gate classifies fakes by class name
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size


def sched(new=(), cached=(), finished=(), counts=None):
    """A vLLM 0.32-shaped ``SchedulerOutput``.

    ``new``: (req, num_computed_tokens, block_ids); ``cached``: (req, num_computed_tokens, new_block_ids).
    """
    counts = dict(counts or {})
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(list(b),))
                            for r, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[(list(b),) if b else None for _, _, b in cached],
            num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        finished_req_ids=set(finished), preempted_req_ids=set())


class FakeRunner(PrefixCacheRunnerMixin):
    """The attributes of vLLM 0.32's GPUModelRunner the mixin reads, plus a toy ``execute_model``."""

    prefix_cache_autostart = False

    def __init__(self, cache: str, model=None, *, prefix_caching: bool = True, speculative=None) -> None:
        self.prefix_cache_name = cache
        self.prefix_cache_config_overrides = OVERRIDES
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=BS,
                                         mamba_cache_mode="none"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=32, max_num_seqs=MAX_REQS),
            model_config=SimpleNamespace(max_model_len=64),
            speculative_config=speculative, kv_transfer_config=None,
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
        self.kv_cache_config = SimpleNamespace(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[SimpleNamespace(layer_names=["layers.0.attn"], kv_cache_spec=FullAttentionSpec(BS))])
        self.is_pooling_model = False
        table = SimpleNamespace(block_size=BS,
                                block_table=SimpleNamespace(cpu=torch.zeros((MAX_REQS, MAX_BLOCKS), dtype=torch.int32)),
                                num_blocks_per_row=torch.zeros(MAX_REQS, dtype=torch.int32))
        self.input_batch = SimpleNamespace(req_ids=[None] * MAX_REQS,
                                           num_computed_tokens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32),
                                           block_table=SimpleNamespace(block_tables=[table]))
        self.model = model
        self.tags: dict[str, int] = {}
        self.batch_at_begin: list = []

    def get_model(self):
        if self.model is None:
            raise ValueError("model not loaded")  # what vLLM raises before load
        return self.model

    # -- a toy runner ---------------------------------------------------------------

    @property
    def _table(self):
        return self.input_batch.block_table.block_tables[0]

    def _row(self, req: str) -> int:
        return self.input_batch.req_ids.index(req)

    def _set_blocks(self, row: int, blocks, append: bool) -> None:
        start = int(self._table.num_blocks_per_row[row]) if append else 0
        for i, b in enumerate(blocks):
            self._table.block_table.cpu[row, start + i] = b
        self._table.num_blocks_per_row[row] = start + len(blocks)

    def _update_states(self, so) -> None:
        ids = self.input_batch.req_ids
        for r in so.finished_req_ids:
            if r in ids:
                row = self._row(r)
                ids[row] = None
                self._table.num_blocks_per_row[row] = 0
        for new in so.scheduled_new_reqs:
            row = ids.index(None)
            ids[row] = new.req_id
            self.input_batch.num_computed_tokens_cpu[row] = new.num_computed_tokens
            self._set_blocks(row, new.block_ids[0], append=False)
        c = so.scheduled_cached_reqs
        for r, blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = self._row(r)
            self.input_batch.num_computed_tokens_cpu[row] = computed
            if blocks:
                self._set_blocks(row, blocks[0], append=True)

    def _forward(self, so, padded: int):
        hidden, feat = [], []
        for r in self.input_batch.req_ids:
            if r is None or not so.num_scheduled_tokens.get(r):
                continue
            first = int(self.input_batch.num_computed_tokens_cpu[self._row(r)])
            pos = range(first, first + so.num_scheduled_tokens[r])
            hidden.append(rows(self.tags[r], pos))
            feat.append(rows(self.tags[r] + 500, pos, MM_WIDTH))
        n = so.total_num_scheduled_tokens
        pad = max(padded, n)
        h = torch.cat(hidden + [torch.full((pad - n, WIDTH), -1.0)])
        f = torch.cat(feat + [torch.full((pad - n, MM_WIDTH), -1.0)])
        return h, {"feat": f}, n, pad

    def execute_model(self, so, padded: int = 0):
        self.batch_at_begin = list(self.input_batch.req_ids)
        step = self.prefix_cache_step_begin(so)  # BEFORE _update_states
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return step, None
        h, mm, n, pad = self._forward(so, padded)
        return step, self.prefix_cache_save(h, mm, n, pad, so)


@pytest.fixture
def runner(committer):
    made: list[FakeRunner] = []

    def make(model=None, **kw) -> FakeRunner:
        r = FakeRunner(committer.name, model if model is not None else SimpleNamespace(), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.prefix_cache_shutdown()


def merged(prefix_tag: int, hit: int, tag: int, first: int, count: int, mm: bool = False) -> torch.Tensor:
    off, width = (500, MM_WIDTH) if mm else (0, WIDTH)
    parts = [rows(prefix_tag + off, range(hit), width)] if hit else []
    return torch.cat(parts + [rows(tag + off, range(first, first + count), width)])


# ---------------------------------------------------------------------------------------------


def test_dummy_step_builds_nothing_and_the_first_real_step_builds_once(runner):
    r = runner()
    dummy = sched()
    assert r.execute_model(dummy) == (None, None)
    assert r.prefix_cache_save(torch.zeros((4, WIDTH)), None, 0, 4, dummy) is None  # a padded profile run
    assert r.prefix_cache_manager is None and not r._prefix_cache_initialized
    r.tags["a"] = 1
    step, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))
    m = r.prefix_cache_manager
    assert m is not None and [e.kind for e in step.events] == [K.STARTED]
    assert (m.config.num_blocks, m.config.block_size, m.config.staging_capacity_tokens) == (NUM_BLOCKS, BS, 32)
    assert m.config.staging_depth == 3  # prefix_cache_config_overrides
    assert m.role == "writer"
    r.prefix_cache_discard(sid)
    _, sid = r.execute_model(sched(cached=[("a", 5, [])], counts={"a": 1}))
    assert r.prefix_cache_manager is m
    r.prefix_cache_discard(sid)


def test_gate_refusal_is_not_remembered_and_prefix_caching_off_is_decided_once(runner):
    spec = runner(speculative=SimpleNamespace(method="eagle"))
    spec.tags["a"] = 1
    for _ in range(2):
        with pytest.raises(PrefixCacheConfigError, match="speculative"):
            spec.prefix_cache_step_begin(sched(new=[("a", 0, [0])], counts={"a": 1}))
    assert spec.prefix_cache_manager is None
    off = runner(prefix_caching=False)
    off.tags["a"] = 1
    assert off.execute_model(sched(new=[("a", 0, [0])], counts={"a": 1})) == (None, None)
    assert off._prefix_cache_initialized and off.prefix_cache_manager is None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no omni prefix cache on this runner"):
        off.prefix_cache_materialize(0)


def test_policy_is_snapshotted_at_load_from_legacy_attributes(runner):
    model = SimpleNamespace(cache_hidden_states=True, prefix_cache_deferred_mm_keys=["feat"])
    r = runner(model)
    snap = r._prefix_cache_load_policy()  # defaults to get_model()
    assert snap == ModelCachePolicy(cache_hidden=True, deferred_keys=frozenset({"feat"}))
    model.prefix_cache_deferred_mm_keys = []  # later changes are not seen
    model.cache_hidden_states = False
    r.tags["a"] = 1
    _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 6}))
    m = r.prefix_cache_manager
    assert m.policy == snap
    out = r.prefix_cache_materialize(sid)
    assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
    m.wait_idle()
    feat, slots = m._keys["feat"], torch.arange(0, 6)
    assert not bool((feat.commit[slots] == feat.claim[slots]).any())  # deferred: still with the client
    with pytest.raises(RuntimeError, match="before the first save"):
        r._prefix_cache_load_policy(model)


def test_policy_opting_out_of_hidden_and_the_no_model_fallback(runner):
    r = runner(SimpleNamespace(omni_prefix_cache_policy=ModelCachePolicy(cache_hidden=False)))
    r.tags["a"] = 1
    _, sid = r.execute_model(sched(new=[("a", 0, [0])], counts={"a": 2}))  # no load call: snapshot at build
    out = r.prefix_cache_materialize(sid)
    assert out.hidden_states["a"] is None
    assert torch.equal(out.mm_outputs["a"]["feat"], rows(501, range(2), MM_WIDTH))
    r.prefix_cache_shutdown()  # one writer per cache at a time
    bare = runner()
    bare.model = None  # get_model raises like vLLM before load
    bare.tags["b"] = 2
    _, sid = bare.execute_model(sched(new=[("b", 0, [3])], counts={"b": 1}))
    assert bare.prefix_cache_manager.policy == ModelCachePolicy()
    bare.prefix_cache_discard(sid)


def test_save_builds_the_layout_from_the_cpu_block_table(runner):
    r = runner()
    r.input_batch.req_ids[0] = "hole"  # row 0 taken, so "a" sits in row 1 ...
    r.tags.update(a=1)
    so = sched(new=[("a", 0, [5, 2])], counts={"a": 6})
    r.prefix_cache_step_begin(so)
    r._update_states(so)
    r.input_batch.req_ids[0] = None  # ... and row 0 is a hole in the batch
    h, mm, n, pad = r._forward(so, padded=8)
    sid = r.prefix_cache_save(h, mm, n, pad, so)
    _, sid2 = r.execute_model(sched(cached=[("a", 6, [])], counts={"a": 1}))
    m = r.prefix_cache_manager
    m.wait_idle()
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10])  # blocks 5, 2: positions 0..6, padding never written
    pool = m._keys[HIDDEN_KEY]
    assert torch.equal(pool.commit[slots], pool.claim[slots])
    assert torch.equal(pool.pool[slots], rows(1, range(7)))
    assert torch.equal(m._keys["feat"].pool[slots], rows(501, range(7), MM_WIDTH))
    assert not bool((pool.claim[torch.tensor([11, 24])] != 0).any())
    r.prefix_cache_discard(sid)
    r.prefix_cache_discard(sid2)


@pytest.mark.parametrize("cut, says", [
    (KeyboardInterrupt, r"interrupted \(sticky; .*prefix_cache_save was cut short by KeyboardInterrupt"),
    (RuntimeError, r"step not saved \(sticky; .*prefix_cache_save ended in RuntimeError"),
], ids=["interrupt", "exception"])
def test_an_exception_while_the_save_builds_its_layout_turns_the_cache_sticky(runner, monkeypatch, cut, says):
    """REVIEW (stop 58): an exception raised in ``prefix_cache_save`` before the manager's own save (its layout,
    its token tags), a signal handler's or any other, left the step's slots under their previous tenant's claims
    and the cache usable. Now the next step's call raises the sticky error."""
    from omnishm.client.adapter import PrefixCacheSchedulerAdapter

    def broken(*_args, **_kwargs):
        raise cut("no layout")

    r = runner()
    r.tags.update(a=1)
    so = sched(new=[("a", 0, [5, 2])], counts={"a": 6})
    r.prefix_cache_step_begin(so)
    r._update_states(so)
    h, mm, n, pad = r._forward(so, padded=8)
    monkeypatch.setattr(PrefixCacheSchedulerAdapter, "build_write_layout", broken)
    with pytest.raises(cut, match="no layout"):
        r.prefix_cache_save(h, mm, n, pad, so)
    monkeypatch.undo()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=says):
        r.prefix_cache_step_begin(sched(cached=[("a", 6, [])], counts={"a": 1}))


def test_finish_is_seen_before_update_states_and_a_same_step_hit_reads_its_rows(runner):
    r = runner(SimpleNamespace(prefix_cache_deferred_mm_keys=("feat",)))
    r.tags.update(a=1, b=1)
    _, s0 = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 8}))
    r.prefix_cache_discard(s0)
    # a finished; b shares its two blocks (a hit of 8) and gets block 3 for its own tokens.
    step, s1 = r.execute_model(sched(new=[("b", 8, [0, 1, 3])], finished=["a"], counts={"b": 3}))
    assert "a" in r.batch_at_begin and "a" not in r.input_batch.req_ids
    assert [(e.kind, e.req_id) for e in step.events] == [(K.FINISHED, "a"), (K.STARTED, "b")]
    out = r.prefix_cache_materialize(s1)
    assert out.num_hit_tokens == {"b": 8}
    assert torch.equal(out.hidden_states["b"], merged(1, 8, 1, 8, 3))
    assert torch.equal(out.mm_outputs["b"]["feat"], merged(1, 8, 1, 8, 3, mm=True))
    m = r.prefix_cache_manager
    m.wait_idle()
    feat, a_slots = m._keys["feat"], torch.arange(0, 8)
    assert torch.equal(feat.commit[a_slots], feat.claim[a_slots])  # a's deferred rows landed on its finish
    # A zero-token finish-only step is still forwarded (vLLM runs _update_states for it).
    step, sid = r.execute_model(sched(finished=["b"]))
    assert sid is None and [(e.kind, e.req_id) for e in step.events] == [(K.FINISHED, "b")]
    m.wait_idle()
    b_slots = torch.tensor([12, 13, 14])
    assert torch.equal(feat.commit[b_slots], feat.claim[b_slots])
    assert r.execute_model(sched()) == (None, None)  # nothing to tell the manager


def test_hit_across_two_requests_in_one_batch_returns_exact_merged_rows(runner):
    r = runner()
    r.tags.update(a=1, b=1, c=2)
    _, s0 = r.execute_model(sched(new=[("a", 0, [0, 1, 2])], counts={"a": 9}))
    r.prefix_cache_discard(s0)
    # a decodes one token; b hits a's first two blocks; c misses. Batch order: a, b, c.
    so = sched(new=[("b", 8, [0, 1, 4]), ("c", 0, [6])], cached=[("a", 9, [])], counts={"a": 1, "b": 2, "c": 3})
    _, s1 = r.execute_model(so, padded=8)
    assert r.prefix_cache_save_time_req_ids(s1) == ("a", "b", "c")
    out = r.prefix_cache_materialize(s1)
    assert out.num_hit_tokens == {"a": 0, "b": 8, "c": 0}
    assert torch.equal(out.hidden_states["a"], rows(1, [9]))
    assert torch.equal(out.hidden_states["b"], merged(1, 8, 1, 8, 2))
    assert torch.equal(out.mm_outputs["b"]["feat"], merged(1, 8, 1, 8, 2, mm=True))
    assert torch.equal(out.hidden_states["c"], rows(2, range(3)))


def test_materialize_uses_save_time_ids_not_the_live_batch(runner):
    r = runner()
    r.tags.update(a=1, b=2, c=3)
    _, s0 = r.execute_model(sched(new=[("a", 0, [0]), ("b", 0, [1])], counts={"a": 2, "b": 3}))
    # Next step before s0 is read: b finished and left the batch, c took its row.
    _, s1 = r.execute_model(sched(new=[("c", 0, [2])], cached=[("a", 2, [])], finished=["b"],
                                  counts={"a": 1, "c": 1}))
    assert r.input_batch.req_ids[:2] == ["a", "c"]
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\['c'\].*not in the save-time batch"):
        r.prefix_cache_materialize(s0, ["a", "c"])  # the live batch: refused, s0 stays valid
    assert r.prefix_cache_save_time_req_ids(s0) == ("a", "b")
    # Read s0 on another thread (any thread may materialize).
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(out=r.prefix_cache_materialize(s0)))
    t.start()
    t.join(10)
    out = got["out"]
    assert set(out.hidden_states) == {"a", "b"}
    assert torch.equal(out.hidden_states["b"], rows(2, range(3)))
    sub = r.prefix_cache_materialize(s1, ["c"])
    assert list(sub.hidden_states) == ["c"] and torch.equal(sub.hidden_states["c"], rows(3, [0]))


def test_discard_and_exactly_once_errors_propagate(runner):
    r = runner()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no omni prefix cache on this runner"):
        r.prefix_cache_discard(0)
    r.tags["a"] = 1
    _, s0 = r.execute_model(sched(new=[("a", 0, [0])], counts={"a": 2}))
    _, s1 = r.execute_model(sched(cached=[("a", 2, [])], counts={"a": 1}))
    r.prefix_cache_discard(s0)
    with pytest.raises(KeyError):
        r.prefix_cache_save_time_req_ids(s0)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        r.prefix_cache_materialize(s0)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        r.prefix_cache_discard(s0)
    assert torch.equal(r.prefix_cache_materialize(s1).hidden_states["a"], rows(1, [2]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        r.prefix_cache_materialize(s1)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="never saved"):
        r.prefix_cache_materialize(42)
    # A contract break in save propagates too (the schedule and the forward disagree).
    so = sched(cached=[("a", 3, [])], counts={"a": 1})
    r.prefix_cache_step_begin(so)
    r._update_states(so)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="token accounting: unpadded=2"):
        r.prefix_cache_save(torch.zeros((2, WIDTH)), None, 2, 2, so)
    assert r.prefix_cache_manager.unconsumed_step_ids() == []


def _links() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("omnishm-link", "omnishm-flusher"))]


def test_shutdown_leaves_nothing_behind(committer_factory):
    handle = committer_factory()
    threads = _links()
    r = FakeRunner(handle.name, SimpleNamespace(prefix_cache_deferred_mm_keys=("feat",)))
    r._prefix_cache_load_policy()
    r.tags["a"] = 1
    _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))
    def staging() -> list[str]:
        return [w for w in (shm.parse_segment_name(s)[2] for s in shm.list_segments(handle.name))
                if w.startswith("stage.")]

    assert staging()  # the writer's staging pages exist while it is attached
    assert _links() != threads
    # Shut down with an unconsumed step id and an open deferred write.
    r.prefix_cache_shutdown()
    r.prefix_cache_shutdown()  # idempotent
    assert r.prefix_cache_manager is None
    assert _links() == threads
    assert staging() == []  # ... and went with it
    with pytest.raises(OmniPrefixCacheUnmatchError, match="not started, off, or shut down"):
        r.prefix_cache_materialize(sid)


def _runner_after_one_step(handle) -> FakeRunner:
    """A runner on ``handle``'s cache that ran one step of request a (its manager made, its step discarded)."""
    r = FakeRunner(handle.name, SimpleNamespace())
    r._prefix_cache_load_policy()
    r.tags["a"] = 1
    r.prefix_cache_discard(r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))[1])
    return r


def test_a_shutdown_an_interrupt_cut_short_is_finished_by_the_next_call(committer_factory, monkeypatch):
    """REVIEW (2026-12-06): ``prefix_cache_shutdown`` let its manager go before shutting it down. Cut short
    by Ctrl-C in the goodbye's wait, a second call found no manager: the link went on heartbeating, and the
    writer's seat stayed taken for the rest of the process. The runner keeps it until its shutdown returned."""
    threads = _links()
    r = _runner_after_one_step(committer_factory())
    interrupt_once(monkeypatch, r.prefix_cache_manager._link, "request")
    with pytest.raises(KeyboardInterrupt):
        r.prefix_cache_shutdown()
    assert _links() != threads  # still attached
    r.prefix_cache_shutdown()
    assert r.prefix_cache_manager is None and _links() == threads


def test_a_shutdown_a_sigterm_handler_made_inside_the_runners_own_is_finished_by_the_next_call(
        committer_factory, monkeypatch):
    """REVIEW (2026-12-06, of the reentrant shutdown lock): as in test_vllm_hooks.py, an engine's SIGTERM
    handler shut the runner's cache down during the runner's own shutdown, then raised ``SystemExit``; the
    runner let its manager go on the handler's early return, and the cut-short shutdown was never finished."""
    from helpers import shutdown_cut_by_sigterm

    threads = _links()
    r = _runner_after_one_step(committer_factory())
    m = r.prefix_cache_manager
    shutdown_cut_by_sigterm(monkeypatch, m._link, r.prefix_cache_shutdown)
    assert r.prefix_cache_manager is m and not m.shut_down
    r.prefix_cache_shutdown()
    assert r.prefix_cache_manager is None and m.shut_down and _links() == threads


def test_a_forked_childs_runner_lets_its_copy_of_the_manager_go(committer_factory):
    """REVIEW (2026-12-06, of the fix above): in a forked child, ``shutdown`` returns at once (the link is the
    parent's), and never ran to its end there, so the child's runner kept its copy of the manager for good.
    ``shut_down`` holds at once in a forked child."""
    import os

    r = _runner_after_one_step(committer_factory())
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its answer through the pipe, whatever happens
        ok = b"0"
        try:
            r.prefix_cache_shutdown()
            ok = b"1" if r.prefix_cache_manager is None else b"0"
        finally:
            os.write(wfd, ok)
            os._exit(0)
    os.close(wfd)
    try:
        answer = os.read(rfd, 1)
        os.waitpid(pid, 0)
        assert answer == b"1", "the child's runner kept its manager"
        assert r.prefix_cache_manager is not None and not r.prefix_cache_manager.shut_down  # the parent's is untouched
    finally:
        os.close(rfd)
        r.prefix_cache_shutdown()


def fake_parallel_state(monkeypatch, **functions) -> None:
    """A ``vllm.distributed.parallel_state`` with these functions in ``sys.modules`` for one test (vllm is not
    installed in the main suite)."""
    ps = ModuleType("vllm.distributed.parallel_state")
    for name, fn in functions.items():
        setattr(ps, name, fn)
    dist = ModuleType("vllm.distributed")
    dist.parallel_state = ps
    vllm = ModuleType("vllm")
    vllm.distributed = dist
    for name, mod in (("vllm", vllm), ("vllm.distributed", dist), ("vllm.distributed.parallel_state", ps)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_role_is_writer_without_vllm_and_follows_tp_pp_rank_with_it(monkeypatch):
    r = FakeRunner("unused")
    monkeypatch.setitem(sys.modules, "vllm", None)  # vllm absent
    assert r._prefix_cache_role() == "writer"

    def fake_vllm(initialized: bool, tp_rank: int, last_pp: bool) -> None:
        fake_parallel_state(monkeypatch, model_parallel_is_initialized=lambda: initialized,
                            get_tensor_model_parallel_rank=lambda: tp_rank,
                            get_pp_group=lambda: SimpleNamespace(is_last_rank=last_pp))

    fake_vllm(False, 1, True)
    assert r._prefix_cache_role() == "writer"  # groups not initialised: single-process tools
    fake_vllm(True, 0, True)
    assert r._prefix_cache_role() == "writer"
    fake_vllm(True, 1, True)
    assert r._prefix_cache_role() == "reader"
    fake_vllm(True, 0, False)
    assert r._prefix_cache_role() == "reader"
    r.prefix_cache_role = "writer"  # explicit knob wins
    assert r._prefix_cache_role() == "writer"


def test_each_data_parallel_replica_gets_its_own_cache_name(monkeypatch):
    """DP replicas have separate KV caches: one name for all would make their TP rank 0s two writers."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # vllm absent
    assert replica_cache_name("thinker") == "thinker" and replica_cache_name(None) is None

    def fake_vllm(initialized: bool, dp_rank: int, dp_size: int) -> None:
        fake_parallel_state(monkeypatch, model_parallel_is_initialized=lambda: initialized,
                            get_dp_group=lambda: SimpleNamespace(rank_in_group=dp_rank, world_size=dp_size))

    fake_vllm(True, 0, 1)
    assert replica_cache_name("thinker") == "thinker" and replica_cache_name(None) is None
    fake_vllm(False, 1, 2)  # groups not initialised: single-process tools
    assert replica_cache_name("thinker") == "thinker"
    # A MoE model: the replicas form a DP group. Replica 0 keeps the name, the others get -dp<index>.
    fake_vllm(True, 1, 2)
    assert replica_cache_name("thinker") == "thinker-dp1"
    monkeypatch.setenv("OMNISHM_NAME", "talker")
    assert replica_cache_name(None) == "talker-dp1"
    monkeypatch.delenv("OMNISHM_NAME")
    assert replica_cache_name(None) == "default-dp1"
    with pytest.raises(ConfigError, match="data-parallel replicas"):  # one endpoint cannot serve every replica
        replica_cache_name("thinker", "ipc:///tmp/thinker.sock")
    fake_vllm(True, 0, 2)
    assert replica_cache_name("thinker") == "thinker" and replica_cache_name(None) is None
    with pytest.raises(ConfigError, match="data-parallel replicas"):
        replica_cache_name("thinker", "ipc:///tmp/thinker.sock")
    # A dense model: vLLM runs each replica as an independent engine of DP size 1 (its DP group has one
    # rank); only the runner's ParallelConfig.data_parallel_index still tells the replica.
    fake_vllm(True, 0, 1)
    assert replica_cache_name("thinker", parallel_config=SimpleNamespace(data_parallel_index=2)) == "thinker-dp2"
    assert replica_cache_name(None, parallel_config=SimpleNamespace(data_parallel_index=1)) == "default-dp1"
    assert replica_cache_name("thinker", parallel_config=SimpleNamespace(data_parallel_index=0)) == "thinker"
    assert replica_cache_name("thinker", parallel_config=SimpleNamespace()) == "thinker"
    with pytest.raises(ConfigError, match="data-parallel replicas"):
        replica_cache_name("thinker", "ipc:///tmp/thinker.sock", parallel_config=SimpleNamespace(data_parallel_index=1))
    monkeypatch.setitem(sys.modules, "vllm", None)  # the runner's config is enough without vllm's groups
    assert replica_cache_name("t", parallel_config=SimpleNamespace(data_parallel_index=3)) == "t-dp3"


def test_a_dense_model_dp_replica_writes_its_own_cache(committer_factory):
    """vLLM runs replica k of a dense model as an independent engine of DP size 1: only its runner's
    ``parallel_config.data_parallel_index`` says k, and the mixin's manager attaches to ``<name>-dp<k>``
    (autostart off: no other cache would answer)."""
    from conftest import unique_cache_name

    base = unique_cache_name()
    committer_factory(name=f"{base}-dp1")
    r = FakeRunner(base, SimpleNamespace())
    r.vllm_config.parallel_config.data_parallel_index = 1
    try:
        r.tags["a"] = 1
        _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 2}))
        assert r.prefix_cache_manager.cache == f"{base}-dp1"
        out = r.prefix_cache_materialize(sid)
        assert torch.equal(out.hidden_states["a"], rows(1, range(2)))
    finally:
        r.prefix_cache_shutdown()


def test_a_timed_out_save_takes_its_step_id_all_the_same(runner):
    """A reader replaying the same saves times out too (its unconsumed s0 holds its bound) and takes the id
    as well; a writer-only timeout (pages held by unacknowledged writes) must not put a reader ahead."""
    r = runner()
    r.prefix_cache_config_overrides = {**OVERRIDES, "staging_depth": 1, "staging_claim_timeout_s": 0.1}
    r.tags["a"] = 1
    _, s0 = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 2}))
    so = sched(cached=[("a", 2, [])], counts={"a": 1})
    r.prefix_cache_step_begin(so)
    r._update_states(so)
    h, mm, n, pad = r._forward(so, 0)
    from omnishm.client import OmniPrefixCacheStagingTimeoutError
    with pytest.raises(OmniPrefixCacheStagingTimeoutError):
        r.prefix_cache_save(h, mm, n, pad, so)  # s0 holds the only page
    r.prefix_cache_discard(s0)
    s1 = r.prefix_cache_save(h, mm, n, pad, so)
    r.prefix_cache_discard(s1)
    assert s1 == s0 + 2


def test_knobs_left_unset_come_from_the_environment(committer, monkeypatch):
    """prefix_cache_name / _autostart left at None: OMNISHM_NAME and OMNISHM_AUTOSTART decide (README order)."""
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    monkeypatch.setenv("OMNISHM_AUTOSTART", "false")
    monkeypatch.setattr(FakeRunner, "prefix_cache_autostart", None)
    r = FakeRunner(committer.name, SimpleNamespace())
    r.prefix_cache_name = None
    r.tags["a"] = 1
    try:
        _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))
        m = r.prefix_cache_manager
        assert m is not None and m.cache == committer.name
        r.prefix_cache_discard(sid)
    finally:
        r.prefix_cache_shutdown()


def test_a_name_set_without_an_endpoint_is_that_cache_own_socket_whatever_omnishm_endpoint_says(committer,
                                                                                                 monkeypatch):
    """The manager's rule (docs/CLIENT.md): an explicit cache name without an endpoint means that cache's own
    socket. ``OMNISHM_ENDPOINT`` names another cache's committer here; the mixin used to connect there (and
    be refused for the cache mismatch) because it resolved the endpoint itself."""
    from omnishm import paths

    monkeypatch.setenv("OMNISHM_ENDPOINT", paths.ipc_endpoint(None, "some-other-cache"))
    r = FakeRunner(committer.name, SimpleNamespace())
    r.tags["a"] = 1
    try:
        _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))
        m = r.prefix_cache_manager
        assert m is not None and m.cache == committer.name
        assert m._link.endpoint == paths.ipc_endpoint(None, committer.name)
        r.prefix_cache_discard(sid)
    finally:
        r.prefix_cache_shutdown()


def test_a_save_the_token_accounting_refuses_leaves_its_slots_absent(runner):
    """The mixin checked the token accounting before it built the layout, so omnishm's save never saw the
    refused step's slots: a's block 0 kept z's claim, and c's hit on it served z's rows (a review)."""
    r = runner()
    r.tags.update(z=5, a=1, c=1)
    _, s0 = r.execute_model(sched(new=[("z", 0, [0])], counts={"z": 4}))
    r.prefix_cache_discard(s0)
    r.prefix_cache_manager.wait_idle()
    so = sched(new=[("a", 0, [0, 1])], finished=["z"], counts={"a": 4})
    r.prefix_cache_step_begin(so)
    r._update_states(so)
    h, mm, n, pad = r._forward(so, 0)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="token accounting"):
        r.prefix_cache_save(h[:3], {"feat": mm["feat"][:3]}, 3, 3, so)  # the runner's count is off by one
    _, sid = r.execute_model(sched(new=[("c", 4, [0, 2])], finished=["a"], counts={"c": 1}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
        r.prefix_cache_materialize(sid)


class _VllmRunnerBase:
    """Stands in for vLLM's GPUModelRunner.initialize_kv_cache: sets ``kv_cache_config`` (a hybrid model's
    two groups when asked), as vLLM's does before the attention backends."""

    hybrid = False

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
        self.kv_cache_config = kv_cache_config
        if self.hybrid:
            kv_cache_config.kv_cache_groups.append(
                SimpleNamespace(layer_names=["layers.1.attn"], kv_cache_spec=type("SlidingWindowSpec", (), {
                    "block_size": BS})()))
        self.kv_init_calls = getattr(self, "kv_init_calls", 0) + 1


class _InitRunner(FakeRunner, _VllmRunnerBase):
    pass


def test_an_unsupported_stage_is_refused_at_kv_cache_init_not_at_its_first_request():
    """REVIEW (2026-12-05, stop 42, KV groups): the seed refuses hybrid or multi-group models "at kv-cache
    init, not first step". The gate ran only when the manager was built, at the first real step: a hybrid
    model's engine came up healthy and its first request failed (vLLM then fails every request in flight).
    The mixin's ``initialize_kv_cache`` runs vLLM's and then the gate; a supported stage builds nothing."""
    runner = _InitRunner("no-such-cache")
    cfg = runner.kv_cache_config
    runner.initialize_kv_cache(cfg)  # a supported stage: no manager yet, nothing to connect to
    assert runner.kv_init_calls == 1 and runner.prefix_cache_manager is None
    hybrid = _InitRunner("no-such-cache")
    hybrid.hybrid = True
    hybrid.initialize_kv_cache(SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        SimpleNamespace(layer_names=["layers.0.attn"], kv_cache_spec=FullAttentionSpec(BS))]), is_profiling=True)
    assert hybrid.kv_init_calls == 1  # a GPU runner's profiling config is not the engine's: not gated
    with pytest.raises(PrefixCacheConfigError, match="omni prefix cache: cache no-such-cache: needs exactly one "
                                                     "KV-cache group"):  # named (review, 2026-12-07)
        hybrid.initialize_kv_cache(SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            SimpleNamespace(layer_names=["layers.0.attn"], kv_cache_spec=FullAttentionSpec(BS))]))
    assert hybrid.kv_init_calls == 2 and hybrid.prefix_cache_manager is None


def test_a_runner_without_vllms_v1_input_batch_is_refused_at_kv_cache_init():
    """The mixin reads the runner's persistent ``input_batch`` at every save (vLLM's V1 runner family). A runner
    without one (vLLM's V2 runner, the only one in vLLM 0.34) is refused at KV-cache init, at the engine's
    start, with the V1 runner named (``check_v1_runner``), not by an AttributeError at the first request
    (review, stop 47)."""
    runner = _InitRunner("no-such-cache")
    del runner.input_batch
    with pytest.raises(RuntimeError, match="_InitRunner has no 'input_batch'; the vLLM integration needs the V1"):
        runner.initialize_kv_cache(runner.kv_cache_config)
    assert runner.kv_init_calls == 1 and runner.prefix_cache_manager is None


def test_a_padded_zero_token_save_after_the_manager_exists_gives_no_step_id(runner):
    """MUTATION (2026-12-06): the mixin's save no longer checking for 0 tokens survived: a padded dummy run (0
    tokens, 4 padded rows) once the manager existed took a step id nobody consumes."""
    r = runner()
    r.tags["a"] = 1
    _, sid = r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 5}))
    r.prefix_cache_discard(sid)
    assert r.prefix_cache_save(torch.zeros((4, WIDTH)), None, 0, 4, sched()) is None
    _, sid = r.execute_model(sched(cached=[("a", 5, [])], counts={"a": 1}))
    r.prefix_cache_discard(sid)


def test_a_materialized_step_id_forgets_its_save_time_ids_and_the_table_stays_bounded(runner):
    """``prefix_cache_save_time_req_ids`` raises KeyError for an unknown or consumed id, and the mixin holds
    "the save-time request ids of each unconsumed step id" (mutation review, 2026-12-06): once a step id is
    materialized its save-time ids are gone, as after a discard, so a long-running engine that materializes
    every step keeps no entry per step."""
    r = runner()
    r.tags["a"] = 1
    _, sid = r.execute_model(sched(new=[("a", 0, [0, 1, 2])], counts={"a": 2}))
    assert r.prefix_cache_save_time_req_ids(sid) == ("a",)
    assert torch.equal(r.prefix_cache_materialize(sid).hidden_states["a"], rows(1, range(2)))
    with pytest.raises(KeyError):
        r.prefix_cache_save_time_req_ids(sid)
    computed = 2
    for _ in range(6):
        _, sid = r.execute_model(sched(cached=[("a", computed, [])], counts={"a": 1}))
        assert torch.equal(r.prefix_cache_materialize(sid, ["a"]).hidden_states["a"], rows(1, [computed]))
        computed += 1
    assert len(r._prefix_cache_step_req_ids) == 0


def test_a_build_cut_short_after_the_manager_attached_leaves_no_session_and_the_next_step_builds_it(runner,
                                                                                                      monkeypatch):
    """``_prefix_cache_init_once`` leaks no session (mutation review, 2026-12-06): a signal handler's exception
    (Ctrl-C) raised after the manager attached but before the runner kept it (in ``register_policy``) shuts that
    manager down: no link or flusher thread of it stays behind heartbeating the writer's seat, and the next real
    step builds a manager that takes the writer's seat and serves rows."""
    from omnishm.client.manager import OmniPrefixCacheManager

    threads = _links()
    r = runner()
    r.tags["a"] = 1
    fired = interrupt_once(monkeypatch, OmniPrefixCacheManager, "register_policy")
    with pytest.raises(KeyboardInterrupt):
        r.execute_model(sched(new=[("a", 0, [0, 1])], counts={"a": 2}))
    assert fired and r.prefix_cache_manager is None
    assert _links() == threads
    r2 = runner()
    r2.tags["b"] = 2
    _, sid = r2.execute_model(sched(new=[("b", 0, [2])], counts={"b": 3}))
    assert r2.prefix_cache_manager.is_writer
    assert torch.equal(r2.prefix_cache_materialize(sid).hidden_states["b"], rows(2, range(3)))


def test_save_time_req_ids_are_in_batch_order_not_the_schedule_dict_order(committer):
    """The save-time request ids (what materialize defaults to, and what a caller pairs with the forward's rows)
    follow the batch's rows, also when vLLM's ``num_scheduled_tokens`` lists the requests otherwise.
    MUTATION (stop 57): taken in the dict's order, they survived: every fixture built the dict in batch order."""
    r = FakeRunner(committer.name, object())
    try:
        r.tags.update(a=1, b=2)
        _, sid = r.execute_model(sched(new=[("a", 0, [0, 1]), ("b", 0, [2, 3])], counts={"b": 3, "a": 5}))
        assert r.input_batch.req_ids[:2] == ["a", "b"]
        assert tuple(r.prefix_cache_save_time_req_ids(sid)) == ("a", "b")
        out = r.prefix_cache_materialize(sid)
        assert list(out.hidden_states) == ["a", "b"]
        assert torch.equal(out.hidden_states["a"], merged(0, 0, 1, 0, 5))
        assert torch.equal(out.hidden_states["b"], merged(0, 0, 2, 0, 3))
    finally:
        r.prefix_cache_shutdown()
