"""The vLLM hooks (``omnishm.integrations.vllm``) under schedules that resume or replace requests.

Driven by V1-shaped scheduler outputs (checked against vLLM 0.32's real ``Scheduler``) on a fake runner,
against a real committer. The hooks' own bookkeeping must never raise into vLLM's ``execute_model``.

The fake runner mirrors vLLM 0.32 GPUModelRunner._update_states for what the hooks read (input_batch
req_ids / num_computed_tokens_cpu / CPU block table) and sets execute_model_state.hidden_states
[num_tokens, H] in batch order. Row content is rows(1, position): every request shares one prompt
"family", so any two requests with the same prefix have the same rows (like a shared system prompt).
"""
from __future__ import annotations

import gc

from types import SimpleNamespace

import pytest
import torch

from helpers import interrupt_once
from manager_helpers import rows
from omnishm.client.group_view import PrefixCacheConfigError
from omnishm.integrations.vllm import EXTENSION_CLS, OmniPrefixCacheRunnerHooks, OmniPrefixCacheWorkerExtension

BS = 4
NUM_BLOCKS = 16
MAX_REQS = 4
MAX_BLOCKS = 8


class FullAttentionSpec:  # classified by name by the gate
    def __init__(self, block_size):
        self.block_size = block_size


def so(new=(), cached=(), resumed=(), finished=(), preempted=(), counts=None):
    """new: (req, prompt_len, computed, blocks); cached: (req, computed, new_blocks_or_None)."""
    counts = dict(counts or {})
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=list(range(p)), prompt_embeds=None,
                                            num_computed_tokens=c, block_ids=(list(b),)) for r, p, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(list(b),) if b is not None else None for _, _, b in cached],
            num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))


class FakeV1Runner:
    def __init__(self):
        self.vllm_config = SimpleNamespace(
            kv_transfer_config=None,
            scheduler_config=SimpleNamespace(max_num_batched_tokens=32, max_num_seqs=MAX_REQS),
            model_config=SimpleNamespace(max_model_len=MAX_BLOCKS * BS),
            speculative_config=None,
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
        self.cache_config = SimpleNamespace(enable_prefix_caching=True, block_size=BS, mamba_cache_mode="none")
        self.kv_cache_config = SimpleNamespace(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[SimpleNamespace(layer_names=["l0"], kv_cache_spec=FullAttentionSpec(BS))])
        self.is_pooling_model = False
        self.execute_model_state = None
        table = SimpleNamespace(block_size=BS,
                                block_table=SimpleNamespace(cpu=torch.zeros((MAX_REQS, MAX_BLOCKS), dtype=torch.int32)),
                                num_blocks_per_row=torch.zeros(MAX_REQS, dtype=torch.int32))
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32),
                                           block_table=SimpleNamespace(block_tables=[table]))
        self.state = {}  # req -> [blocks, computed]
        self.model = SimpleNamespace()

    def get_model(self):
        return self.model

    def _update_states(self, s):
        for r in s.finished_req_ids:
            self.state.pop(r, None)
        for n in s.scheduled_new_reqs:
            self.state[n.req_id] = [list(n.block_ids[0]), n.num_computed_tokens]
        c = s.scheduled_cached_reqs
        for r, b, comp in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.state[r]
            if r in c.resumed_req_ids:
                st[0] = list(b[0])
            elif b is not None:
                st[0].extend(b[0])
            st[1] = comp
        ids = [r for r in s.num_scheduled_tokens]
        self.input_batch.req_ids = ids
        t = self.input_batch.block_table.block_tables[0]
        t.block_table.cpu.zero_()
        t.num_blocks_per_row.zero_()
        for row, r in enumerate(ids):
            blocks, comp = self.state[r]
            t.block_table.cpu[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            t.num_blocks_per_row[row] = len(blocks)
            self.input_batch.num_computed_tokens_cpu[row] = comp

    def execute_model(self, s, intermediate_tensors=None):
        self._update_states(s)
        if not s.total_num_scheduled_tokens:
            return None
        parts = []
        for r in self.input_batch.req_ids:
            comp = self.state[r][1]
            parts.append(rows(1, range(comp, comp + s.num_scheduled_tokens[r])))
        self.execute_model_state = SimpleNamespace(hidden_states=torch.cat(parts))
        return None


@pytest.fixture
def hooks(committer, monkeypatch):
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    runner = FakeV1Runner()
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name, capture_raw=True)
    h.install()
    assert h.stats()["runner"] == "v1"
    yield h, runner
    h.uninstall()


def step(runner, s):
    runner.execute_model(s)
    runner.execute_model_state = None  # what sample_tokens does


def test_a_request_resumed_with_a_longer_hit_than_its_own_progress_gets_its_prompt(hooks):
    """A (no hit) computes 4 prompt tokens, is preempted; B (same prefix) computes 12; A resumes with hit 12.

    vLLM: priority scheduling preempts the low-priority A for B; on resume A's get_computed_blocks hits
    the blocks B computed (12 tokens, 3 blocks), so num_computed_tokens=12 in the resumed cached row.
    """
    h, runner = hooks
    # step 1: A new, no hit, 4 of its 16 prompt tokens.
    step(runner, so(new=[("A", 16, 0, [0])], counts={"A": 4}))
    # step 2: B (high priority) hits A's block 0; A preempted to make room.
    step(runner, so(new=[("B", 16, 4, [0, 5, 6])], preempted=["A"], counts={"B": 8}))
    # step 3: A resumes with a hit on B's blocks 0,5,6 (12 tokens); schedules its last 4 prompt tokens.
    step(runner, so(cached=[("A", 12, [0, 5, 6, 7]), ("B", 12, [8])], resumed=["A"], counts={"A": 4, "B": 4}))
    res = h.take_results()
    assert "A" in res and torch.equal(res["A"][0], rows(1, range(16)))
    assert h.stats()["raw_abandoned"] == 1  # vLLM never computed A's rows 4..11 itself


def test_a_live_id_sent_again_as_new_is_not_collected_and_does_not_raise(hooks):
    """A live id re-sent as new (vLLM _update_streaming_request / the omni async-chunk continuation).

    The adapter emits REPLACED (no hit); num_computed_tokens is the tokens the session already has.
    """
    h, runner = hooks
    step(runner, so(new=[("S", 8, 0, [0, 1])], counts={"S": 8}))
    step(runner, so(cached=[("S", 8, [2])], counts={"S": 1}))  # decode 1 token
    # streaming update: the prompt grows to 8 + 1 kept output + 3 new = 12; 9 tokens already computed
    step(runner, so(new=[("S", 12, 9, [0, 1, 2])], counts={"S": 3}))
    stats = h.stats()
    assert stats["steps"] == 3 and stats["prompts_abandoned"] == 1


def test_the_hooks_attach_to_the_cache_named_by_omnishm_name(committer, monkeypatch):
    """No explicit cache: the name comes from OMNISHM_NAME, by the same rules as the committer's."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.delenv("OMNISHM_CACHE", raising=False)
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    runner = FakeV1Runner()
    h = OmniPrefixCacheRunnerHooks(runner)
    h.install()
    try:
        step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
        assert h.stats()["cache"] == committer.name and h.stats()["saves"] == 1
    finally:
        h.uninstall()


def test_completed_rows_are_held_within_the_bound_and_raw_rows_only_when_asked(committer, monkeypatch):
    """Nobody calls omnishm_take_*: the hooks keep at most OMNISHM_VLLM_HELD_BYTES of completed rows, the oldest
    dropped first and counted; raw rows are kept only with OMNISHM_VLLM_CAPTURE_RAW."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    one = rows(1, range(8)).numel() * 4  # one completed 8-token prompt (float32 rows)
    monkeypatch.setenv("OMNISHM_VLLM_HELD_BYTES", str(2 * one))
    runner = FakeV1Runner()
    h = OmniPrefixCacheRunnerHooks(runner)
    assert h.capture_raw is False and h.held_bytes == 2 * one
    h.install()
    try:
        for i, r in enumerate(("A", "B", "C")):
            step(runner, so(new=[(r, 8, 0, [2 * i, 2 * i + 1])], finished=["A", "B"][:i][-1:], counts={r: 8}))
        stats = h.stats()
        assert stats["results_dropped"] == 1 and stats["held_bytes"] == 2 * one and stats["raw_requests"] == 0
        res = h.take_results()
        assert sorted(res) == ["B", "C"] and torch.equal(res["C"][0], rows(1, range(8)))
        assert h.stats()["held_bytes"] == 0 and h.take_raw() == {}
    finally:
        h.uninstall()
    monkeypatch.setenv("OMNISHM_VLLM_CAPTURE_RAW", "1")
    runner = FakeV1Runner()
    h = OmniPrefixCacheRunnerHooks(runner)
    h.install()
    try:
        step(runner, so(new=[("D", 8, 0, [8, 9])], counts={"D": 8}))
        assert torch.equal(h.take_raw()["D"], rows(1, range(8))) and "D" in h.take_results()
    finally:
        h.uninstall()


def test_a_prompt_completed_beside_others_is_held_as_its_own_rows(hooks):
    """A prompt that completes in one step is a view of that step's result buffer (every request's rows): the
    hooks hold a copy of its own rows, so the bound counts what is really kept alive."""
    h, runner = hooks
    step(runner, so(new=[("A", 4, 0, [0]), ("B", 16, 0, [1, 2, 3, 4])], counts={"A": 4, "B": 12}))
    held = h.stats()["held_bytes"]
    a, hit = h.take_results()["A"]
    assert hit == 0 and torch.equal(a, rows(1, range(4)))
    own = a.numel() * a.element_size()
    assert a.untyped_storage().nbytes() == own and held == 2 * own  # and A's raw rows (the fixture keeps them)


def test_the_hooks_pass_through_on_a_pipeline_stage_before_the_last(committer, monkeypatch):
    """REVIEW (2026-12-04): under external_launcher with PP > 1, vLLM records a non-last stage's
    IntermediateTensors as the step's hidden states (broadcast_pp_output), and the hooks handed them to
    save_outputs, which raised inside execute_model. Such a stage has no hidden states to give: the hooks
    pass through there, and attach to no cache."""
    import omnishm.integrations.vllm_hooks as hooks_module

    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setattr(hooks_module, "vllm_last_pp_stage", lambda: False)
    runner = FakeV1Runner()
    inner = runner.execute_model

    def earlier_stage(s, intermediate_tensors=None):
        inner(s, intermediate_tensors)
        runner.execute_model_state = SimpleNamespace(hidden_states=SimpleNamespace(tensors={}))
        return "intermediate"

    runner.execute_model = earlier_stage
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    try:
        assert runner.execute_model(so(new=[("a", 6, 0, [0, 1])], counts={"a": 6})) == "intermediate"
        assert h.disabled and h.manager is None
        assert h.counters["saves"] == 0
    finally:
        h.uninstall()


def test_a_preemption_reported_in_a_step_that_schedules_nothing_still_makes_the_re_add_a_resume(hooks):
    """vLLM does not admit waiting requests in a step that preempted, so a preemption can come in a step of
    zero tokens. The hooks passed such a step through untranslated: the adapter never learned of the
    preemption, labelled the re-added request REPLACED (no hit), and its prompt was abandoned. A re-add
    as new after ``preempted_req_ids`` is how vLLM's V2 runner resumes (the adapter's own test)."""
    h, runner = hooks
    step(runner, so(new=[("A", 16, 0, [0])], counts={"A": 4}))
    step(runner, so(preempted=["A"], counts={}))  # nothing scheduled: only the preemption
    step(runner, so(new=[("B", 16, 4, [0, 5, 6])], counts={"B": 8}))  # B hits A's block 0
    # A comes back as new with a hit on B's blocks 0, 5, 6 (12 tokens) and computes its last 4 prompt tokens.
    step(runner, so(new=[("A", 16, 12, [0, 5, 6, 7])], cached=[("B", 12, [8])], counts={"A": 4, "B": 4}))
    res = h.take_results()
    assert "A" in res and torch.equal(res["A"][0], rows(1, range(16)))
    assert h.stats()["prompts_abandoned"] == 0


class _Worker(OmniPrefixCacheWorkerExtension):
    """vLLM's worker as far as the extension reads it: its config names the extension."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=EXTENSION_CLS))


def test_results_completed_before_a_shutdown_are_still_taken_after_it(committer, monkeypatch):
    """REVIEW (2026-12-05): ``omnishm_shutdown`` (the README asks for it before the engine goes away) dropped
    the hooks and every result they held, uncounted, though results are held until taken. Retired hooks
    keep theirs for the takes, through a new install and a runner swapped too."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    worker = _Worker()
    runner = FakeV1Runner()
    worker.model_runner = runner  # installs the hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert worker.omnishm_shutdown()["requests"] == 1
    assert worker.omnishm_install()  # fresh hooks on the same runner
    step(runner, so(new=[("B", 8, 0, [2, 3])], counts={"B": 8}))
    worker.model_runner = FakeV1Runner()  # a swapped runner retires the hooks too
    got = worker.omnishm_take_prompt_hidden()
    assert sorted(got) == ["A", "B"] and all(torch.equal(t, rows(1, range(8))) for t in got.values()), got
    assert worker.omnishm_take_prompt_hidden() == {} and worker.omnishm_take_results() == {}
    assert worker.omnishm_stats()["held_bytes"] == 0
    worker.omnishm_shutdown()


def test_results_kept_past_shutdowns_stay_within_the_bound_and_keep_no_runner_alive(committer, monkeypatch):
    """REVIEW (2026-12-05, of the fix above): the retired hooks were kept whole, each with up to
    ``held_bytes`` of results, and each with its runner (in vLLM: the model and its KV cache), until a take.
    A server that never takes grew by one bound per shutdown. Only the results are kept now, within the
    bound (the oldest dropped first, counted)."""
    import gc
    import weakref

    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    one = rows(1, range(8)).numel() * 4  # one completed 8-token prompt
    monkeypatch.setenv("OMNISHM_VLLM_HELD_BYTES", str(2 * one))
    worker = _Worker()
    runner = FakeV1Runner()
    worker.model_runner = runner
    for i in range(4):
        if i:
            assert worker.omnishm_install()
        step(runner, so(new=[(f"R{i}", 8, 0, [2 * i, 2 * i + 1])], counts={f"R{i}": 8}))
        worker.omnishm_shutdown()
    stats = worker.omnishm_stats()
    assert stats == {"held_bytes": 2 * one, "results_dropped": 2}, stats
    assert sorted(worker.omnishm_take_prompt_hidden()) == ["R2", "R3"]
    assert worker.omnishm_install()
    step(runner, so(new=[("S", 8, 0, [8, 9])], counts={"S": 8}))
    ref = weakref.ref(runner)
    worker.model_runner = FakeV1Runner()  # the old runner is swapped out; its result stays
    del runner
    gc.collect()
    assert ref() is None, "the retired results kept the swapped-out runner alive"
    assert sorted(worker.omnishm_take_prompt_hidden()) == ["S"]
    worker.omnishm_shutdown()


def _links() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("omnishm-link"))


def _worker_after_one_step(committer, monkeypatch) -> "_Worker":
    """A worker whose hooks (installed on a fake runner, on ``committer``'s cache) ran one step of request A."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    worker = _Worker()
    runner = FakeV1Runner()
    worker.model_runner = runner
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    return worker


def test_uninstall_lets_go_of_its_shut_down_manager_and_keeps_its_stats(committer, monkeypatch):
    """Review (stop 56): hooks kept their shut-down manager, and with it its views of the cache's segments, whose
    pages a stopped committer's unlink cannot free until their last unmap (LIMITS.md, trap 11). ``uninstall``
    lets it go; ``stats`` still reports its last counters."""
    import weakref

    worker = _worker_after_one_step(committer, monkeypatch)
    hooks = worker._omnishm_hooks_or_none()
    gone = weakref.ref(hooks.manager)
    stats = hooks.uninstall()
    assert hooks.manager is None and stats["manager"]["steps_saved"] == 1 and stats["role"] == "writer"
    assert hooks.stats()["manager"] == stats["manager"] and hooks.stats()["client_id"] == stats["client_id"]
    worker.omnishm_shutdown()
    del worker, hooks
    gc.collect()
    assert gone() is None


def test_a_shutdown_an_interrupt_cut_short_is_finished_by_the_next_one(committer, monkeypatch):
    """REVIEW (2026-12-06): ``omnishm_shutdown`` let the hooks go before their manager's shutdown. Cut short
    by Ctrl-C in the goodbye's wait, the next call found no hooks: the link went on heartbeating, and the
    writer's seat stayed taken for the rest of the process."""
    before = _links()
    worker = _worker_after_one_step(committer, monkeypatch)
    interrupt_once(monkeypatch, worker._omnishm_hooks_or_none().manager._link, "request")
    with pytest.raises(KeyboardInterrupt):
        worker.omnishm_shutdown()
    assert _links() != before  # still attached
    worker.omnishm_shutdown()
    assert worker._omnishm_hooks_or_none() is None and _links() == before


@pytest.mark.parametrize("cut", [KeyboardInterrupt, RuntimeError])
def test_an_install_after_a_shutdown_cut_short_gives_working_hooks(committer, monkeypatch, cut):
    """REVIEW (2026-12-06, of the fix above): the worker kept the hooks of a shutdown cut short (an interrupt,
    or an error out of the manager's shutdown), and ``omnishm_install`` installed those same hooks again,
    over a closed manager: the next step raised into vLLM. It finishes their retire and makes fresh ones."""
    worker = _worker_after_one_step(committer, monkeypatch)
    runner = worker.model_runner
    old = worker._omnishm_hooks_or_none()
    manager = old.manager
    real = type(old.manager)._join_previous_write

    def cut_short(self, *args):
        monkeypatch.setattr(type(old.manager), "_join_previous_write", real)
        raise cut("injected")

    monkeypatch.setattr(type(old.manager), "_join_previous_write", cut_short)
    with pytest.raises(cut):
        worker.omnishm_shutdown()
    try:
        assert worker.omnishm_install() and worker._omnishm_hooks_or_none() is not old
        step(runner, so(new=[("B", 8, 0, [2, 3])], counts={"B": 8}))
        assert manager._shut_down and old.manager is None  # the retire was finished; the manager let go
    finally:
        worker.omnishm_shutdown()


def test_a_shutdown_a_sigterm_handler_made_inside_the_workers_own_keeps_the_hooks_until_it_is_finished(
        committer, monkeypatch):
    """REVIEW (2026-12-06, of the reentrant shutdown lock): an engine's SIGTERM handler that shuts the cache
    down, then raises ``SystemExit``, came during the worker's own shutdown. The handler's shutdown returns at
    once (its own thread is mid-shutdown), and the worker let the hooks go on that return; the outer shutdown,
    cut short by the ``SystemExit``, could then never be finished. The hooks stay until it ran to its end."""
    from helpers import shutdown_cut_by_sigterm

    before = _links()
    worker = _worker_after_one_step(committer, monkeypatch)
    m = worker._omnishm_hooks_or_none().manager
    shutdown_cut_by_sigterm(monkeypatch, m._link, worker.omnishm_shutdown)
    assert worker._omnishm_hooks_or_none() is not None and not m.shut_down
    worker.omnishm_shutdown()
    assert m.shut_down and worker._omnishm_hooks_or_none() is None and _links() == before


def test_a_negative_bound_on_held_rows_is_refused_when_the_hooks_are_made(committer):
    """REVIEW (2026-12-05): ``held_bytes=-1`` was taken, and the first completed prompt raised StopIteration
    on the engine thread (evicting from empty tables). The knob refuses it; the argument now does too."""
    with pytest.raises(ValueError, match="held_bytes must be >= 0, got -1"):
        OmniPrefixCacheRunnerHooks(FakeV1Runner(), cache=committer.name, held_bytes=-1)


def test_the_hooks_refuse_an_unsupported_stage_at_kv_cache_init(committer, monkeypatch):
    """REVIEW (2026-12-05, stop 42, KV groups): the seed refuses hybrid or multi-group models "at kv-cache
    init, not first step". The hooks (installed when the worker assigns its runner, before vLLM initialises
    the KV cache) ran the gate only at the first real step: a hybrid model's engine came up healthy and its
    first request failed. They wrap the runner's ``initialize_kv_cache`` now, and an install on a runner
    whose KV cache is already initialised gates at once; a supported stage still builds its manager at the
    first real step, and uninstall removes both wrappers."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")

    def sliding_window_group():
        return SimpleNamespace(layer_names=["l1"], kv_cache_spec=type("SlidingWindowSpec", (), {"block_size": BS})())

    class Runner(FakeV1Runner):
        def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
            self.kv_cache_config = kv_cache_config

    hybrid = Runner()
    hybrid_cfg = hybrid.kv_cache_config
    hybrid_cfg.kv_cache_groups.append(sliding_window_group())
    del hybrid.kv_cache_config  # what the worker's runner has before initialize_kv_cache
    h = OmniPrefixCacheRunnerHooks(hybrid, cache=committer.name)
    h.install()
    hybrid.initialize_kv_cache(hybrid_cfg, is_profiling=True)  # a GPU runner's profiling run: not gated
    # The refusal names the cache (review, 2026-12-07: a pipeline's stages each have one, and it named none).
    with pytest.raises(PrefixCacheConfigError, match=f"omni prefix cache: cache {committer.name}: needs exactly one "
                                                     "KV-cache group"):
        hybrid.initialize_kv_cache(hybrid_cfg)
    assert h.manager is None
    h.uninstall()
    assert "initialize_kv_cache" not in vars(hybrid) and "execute_model" not in vars(hybrid)
    with pytest.raises(PrefixCacheConfigError, match="needs exactly one KV-cache group"):
        OmniPrefixCacheRunnerHooks(hybrid, cache=committer.name).install()  # KV cache already initialised
    assert "execute_model" not in vars(hybrid)  # nothing was wrapped
    # Through the worker extension (review of the real engine): a refused install kept its hooks, which then
    # reported stats as installed and took the place of a later install's.
    worker = _Worker()
    worker.__dict__["_omnishm_model_runner"] = hybrid
    with pytest.raises(PrefixCacheConfigError):
        worker.omnishm_install()
    assert worker.omnishm_stats() == {"held_bytes": 0, "results_dropped": 0}  # what a worker without hooks says

    runner = Runner()
    cfg = runner.kv_cache_config
    del runner.kv_cache_config
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    runner.initialize_kv_cache(cfg)
    assert h.manager is None and runner.kv_cache_config is cfg and h.stats()["kv_init_gated"] == 1
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert h.manager is not None and h.stats()["saves"] == 1
    h.uninstall()


def test_a_bad_knob_the_gate_reads_at_kv_cache_init_names_the_cache(committer, monkeypatch):
    """REVIEW (2026-12-07, stop 54): a rule across the gate's ``OMNISHM_*`` knobs (the staging bound) refused with
    a ``ConfigError`` that named no cache, where every gate refusal names it."""
    from omnishm.config import ConfigError
    from omnishm.interface import MAX_STAGING_ROWS

    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    # Each knob alone is good (read when the hooks are made); the two together pass the staging bound.
    monkeypatch.setenv("OMNISHM_STAGING_CAPACITY_TOKENS", str(MAX_STAGING_ROWS))

    class Runner(FakeV1Runner):
        def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
            self.kv_cache_config = kv_cache_config

    runner = Runner()
    cfg = runner.kv_cache_config
    del runner.kv_cache_config  # what the worker's runner has before initialize_kv_cache
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    try:
        with pytest.raises(ConfigError, match=f"^cache {committer.name}: PrefixCacheConfig.\\(staging_depth "
                                              r"\+ 1\) \* staging_capacity_tokens .* \(staging_capacity_tokens "
                                              r"from env OMNISHM_STAGING_CAPACITY_TOKENS\)"):
            runner.initialize_kv_cache(cfg)
        assert h.manager is None
    finally:
        h.uninstall()
