"""The vLLM hooks on a runner of vLLM's V2 family (``omnishm/client/v2_view.py``), against a real committer.

The fake runner has what the hooks read of vLLM's V2 ``GPUModelRunner`` (vllm/v1/worker/gpu/model_runner.py):
``req_states``, ``add_requests``, no ``input_batch`` nor ``_update_states``; its ``execute_model`` builds the
step's ``InputBatch`` in V2's order (decodes first, then by token count) and sets
``execute_model_state.hidden_states`` in that order, padded. Its block table is its own, from the scheduler
outputs, as V2's device table: the hooks must get every slot from their mirror. The real engine is
tests/vllm_tier/test_engine_v2.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from manager_helpers import rows
from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView, is_v2_runner
from omnishm.interface import OmniPrefixCacheUnmatchError
from omnishm.integrations.vllm import EXTENSION_CLS, OmniPrefixCacheRunnerHooks, OmniPrefixCacheWorkerExtension
from test_vllm_hooks import BS, NUM_BLOCKS, FakeV1Runner, so


class FakeV2Runner:
    """vLLM's V2 runner as the hooks see it. ``execute_model(so, dummy_run=True)`` is its ``_dummy_run``'s call."""

    def __init__(self) -> None:
        v1 = FakeV1Runner()  # the same configs
        self.vllm_config, self.cache_config, self.kv_cache_config = v1.vllm_config, v1.cache_config, v1.kv_cache_config
        self.is_pooling_model = False
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.execute_model_state = None
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.dummy_runs = 0
        self.model = SimpleNamespace()

    def get_model(self):
        return self.model

    def add_requests(self, s) -> None:
        for n in s.scheduled_new_reqs:
            self.blocks[n.req_id] = list(n.block_ids[0])
            self.computed[n.req_id] = n.num_computed_tokens
        self.req_states.req_id_to_index = {r: i for i, r in enumerate(self.blocks)}

    @property
    def block_tables(self):
        """V2's device block table (group 0) and its per-row block counts, as the runner holds them now."""
        rows_ = list(self.req_states.req_id_to_index.items())
        table = torch.zeros((max(len(rows_), 1), NUM_BLOCKS), dtype=torch.int32)
        counts = np.zeros((1, max(len(rows_), 1)), dtype=np.int32)
        for rid, i in rows_:
            table[i, :len(self.blocks[rid])] = torch.tensor(self.blocks[rid], dtype=torch.int32)
            counts[0, i] = len(self.blocks[rid])
        return SimpleNamespace(block_tables=[SimpleNamespace(gpu=table)], num_blocks=SimpleNamespace(np=counts))

    def execute_model(self, s, intermediate_tensors=None, dummy_run: bool = False, **kw):
        if dummy_run:
            self.dummy_runs += 1
            return None
        for r in set(s.finished_req_ids) | set(s.preempted_req_ids):
            self.blocks.pop(r, None)
            self.computed.pop(r, None)
        self.add_requests(s)
        c = s.scheduled_cached_reqs
        for r, b, comp in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            if b is not None:
                self.blocks[r].extend(b[0])
            self.computed[r] = comp
        # V2's order: decodes (1 token) first, then by token count.
        ids = sorted(s.num_scheduled_tokens, key=lambda r: (s.num_scheduled_tokens[r] != 1, s.num_scheduled_tokens[r]))
        counts = np.array([s.num_scheduled_tokens[r] for r in ids], dtype=np.int32)
        if not counts.sum():
            return None
        parts = [rows(1, range(self.computed[r], self.computed[r] + int(n))) for r, n in zip(ids, counts)]
        hidden = torch.cat([*parts, torch.full((3, parts[0].shape[1]), float("nan"))])  # padded
        ib = SimpleNamespace(req_ids=ids, num_scheduled_tokens=counts, num_tokens=int(counts.sum()),
                             query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                             num_computed_tokens_np=np.array([self.computed[r] for r in ids], dtype=np.int32))
        self.execute_model_state = SimpleNamespace(hidden_states=hidden, input_batch=ib)
        return None


@pytest.fixture
def v2(committer, monkeypatch):
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    runner = FakeV2Runner()
    assert is_v2_runner(runner) and not is_v2_runner(FakeV1Runner())
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name, capture_raw=True)
    h.install()
    assert h.stats()["runner"] == "v2"  # what omnishm_stats tells a user about the runner family
    yield h, runner
    h.uninstall()


def step(runner, s) -> None:
    runner.execute_model(s)
    runner.execute_model_state = None  # what sample_tokens does


def test_v2_rows_follow_its_batch_order_and_hits_read_the_mirrored_blocks(v2):
    """A (prefill, 8 tokens) and B (decode) in one step come back in V2's order (B first); each request's
    prompt rows are its own, and C's hit on A's blocks reads A's rows. A dummy run passes straight through, before
    the first real step and after it."""
    h, runner = v2
    runner.execute_model(so(), dummy_run=True)  # V2's _dummy_run (warm-up, profiling)
    assert runner.dummy_runs == 1 and h.stats()["steps"] == 0
    step(runner, so(new=[("B", 4, 0, [7])], counts={"B": 4}))
    # A dummy batch once serving (vLLM's execute_dummy_batch, as a data-parallel rank with no work runs): its
    # made-up request is no request of the cache's, and the mirror and the manager never see it.
    runner.execute_model(so(new=[("dummy", 4, 0, [9])], counts={"dummy": 4}), dummy_run=True)
    assert runner.dummy_runs == 2 and h.stats()["steps"] == 1 and len(h._mirror) == 1
    step(runner, so(new=[("A", 10, 0, [0, 1, 2])], cached=[("B", 4, [8])], counts={"A": 10, "B": 1}))
    res = h.take_results()
    assert torch.equal(res["A"][0], rows(1, range(10))) and torch.equal(res["B"][0], rows(1, range(4)))
    step(runner, so(new=[("C", 12, 8, [0, 1, 3])], finished=["A"], counts={"C": 4}))
    c, hit = h.take_results()["C"]
    assert hit == 8 and torch.equal(c, rows(1, range(12)))


def test_v2_resume_as_new_is_held_once_and_a_partial_prompt_resumes(v2):
    """V2 re-sends a preempted request as new with all its blocks. A, preempted mid-prompt, resumes from a hit on
    its own first block and completes its prompt once; B, preempted after its prompt completed, is not held again."""
    h, runner = v2
    step(runner, so(new=[("A", 12, 0, [0, 1]), ("B", 4, 0, [5])], counts={"A": 8, "B": 4}))
    assert list(h.take_results()) == ["B"]
    step(runner, so(preempted=["A", "B"], counts={}))
    step(runner, so(new=[("A", 12, 4, [0, 3, 4]), ("B", 4, 4, [5, 6])], counts={"A": 8, "B": 1}))
    res = h.take_results()
    assert list(res) == ["A"] and torch.equal(res["A"][0], rows(1, range(12)))
    assert h.stats()["requests"] == 2


def test_the_mirror_follows_the_runners_block_table():
    """New requests overwrite, cached ones append, a V1-style resumed one replaces, finished and preempted go."""
    m = BlockIdMirror()
    m.update(so(new=[("A", 8, 0, [1, 2]), ("B", 4, 0, [3])], counts={"A": 8, "B": 4}))
    m.update(so(cached=[("A", 8, [4]), ("B", 4, None)], counts={"A": 1, "B": 1}))
    assert m.blocks("A") == [1, 2, 4] and m.blocks("B") == [3]
    m.update(so(cached=[("A", 4, [1, 6, 7])], resumed=["A"], finished=["B"], counts={"A": 5}))
    assert m.blocks("A") == [1, 6, 7] and len(m) == 1
    m.update(so(preempted=["A"], counts={}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no block ids were seen"):
        m.blocks("A")


def _batch(ids, counts, computed, starts=None):
    counts = np.array(counts, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(counts)]) if starts is None else np.array(starts)
    return SimpleNamespace(req_ids=ids, num_scheduled_tokens=counts, query_start_loc_np=qsl,
                           num_computed_tokens_np=np.array(computed, dtype=np.int32))


def test_the_v2_view_gives_each_tokens_slot_and_refuses_what_it_cannot_place():
    """Slots from the mirror's blocks at each request's positions; counts, row offsets or positions that
    disagree with the batch raise ``OmniPrefixCacheUnmatchError`` (a guessed slot would be a wrong row)."""
    m = BlockIdMirror()
    m.update(so(new=[("A", 8, 0, [5, 2]), ("B", 8, 0, [9])], counts={"A": 6, "B": 1}))
    view = V2StepGroupView(_batch(["B", "A"], [1, 6], [3, 2]), m, BS)
    assert view.batch_req_ids == ["B", "A"]
    assert view.step_slots_cpu([1, 6]).tolist() == [9 * BS + 3, 5 * BS + 2, 5 * BS + 3, 2 * BS, 2 * BS + 1,
                                                   2 * BS + 2, 2 * BS + 3]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="differ from the runner's batch"):
        view.step_slots_cpu([6, 1])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="batch rows start at 2, not 1"):
        V2StepGroupView(_batch(["B", "A"], [1, 6], [3, 2], starts=[0, 2, 8]), m, BS).step_slots_cpu([1, 6])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="position 8 .* past the request's 2 blocks"):
        V2StepGroupView(_batch(["A"], [7], [2]), m, BS).step_slots_cpu([7])
    assert NUM_BLOCKS * BS > 9 * BS + 3


def test_hooks_installed_while_a_request_runs_take_its_blocks_from_the_runner(committer, monkeypatch):
    """``omnishm_install`` after ``omnishm_shutdown`` while A decodes: the new hooks' mirror takes the block ids
    of the requests the runner holds (``BlockIdMirror.seed``), so A's next step is placed, not refused with an
    ``OmniPrefixCacheUnmatchError`` raised into vLLM's ``execute_model`` (review, stop 47; V1 ran clean: its
    view reads the runner's own CPU table). A's rows of that step land in the new cache."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    runner = FakeV2Runner()
    first = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    first.install()
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    first.uninstall()
    again = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    again.install()
    try:
        assert again._mirror.blocks("A") == [0, 1]
        step(runner, so(cached=[("A", 8, [2])], counts={"A": 1}))
        assert again._mirror.blocks("A") == [0, 1, 2] and again.stats()["saves"] == 1
    finally:
        again.uninstall()


def test_a_warm_up_inside_passing_through_is_never_seen(v2):
    """vLLM's V2 warm-up (``warmup_kernels``, from the worker's ``compile_or_warm_up_model``, which the worker
    extension wraps in ``passing_through``) runs made-up requests on made-up blocks through ``execute_model``:
    nothing of them is tracked, saved or held, and a live request's rows and hits stay exact after it."""
    h, runner = v2
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    with h.passing_through():
        step(runner, so(new=[("_warmup_0_", 8, 0, [1, 2])], counts={"_warmup_0_": 8}))
        step(runner, so(finished=["_warmup_0_"], counts={}))
    assert h.stats()["steps"] == 1 and len(h._mirror) == 1
    assert list(h.take_results()) == ["A"] and h.take_raw().keys() <= {"A"}
    step(runner, so(new=[("B", 10, 8, [0, 1, 3])], counts={"B": 2}))
    b, hit = h.take_results()["B"]
    assert hit == 8 and torch.equal(b, rows(1, range(10)))


def test_a_kv_cache_grown_past_the_pool_is_refused_by_name_before_the_step_runs(v2):
    """The pool is sized once, from ``kv_cache_config.num_blocks`` at the first real step. vLLM 0.34's
    extensible KV cache settles its size before serving (``extend_kv_cache`` in the engine core's start); should
    a runner's KV cache grow later anyway, the hooks refuse the step with a ``PrefixCacheConfigError`` naming both
    counts and the remedy, before the runner runs it, instead of a "slots outside the pool" error from
    ``save_outputs`` after the forward. A cache that shrank is no danger and runs on. MUTATION (stop 48): the
    check one block off (``> num_blocks + 1``) survived a test that grew the cache by four."""
    from omnishm.client.group_view import PrefixCacheConfigError
    from test_vllm_hooks import NUM_BLOCKS
    h, runner = v2
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    runner.kv_cache_config.num_blocks = NUM_BLOCKS - 2
    step(runner, so(new=[("B", 10, 8, [0, 1, 3])], counts={"B": 2}))
    assert h.take_results()["B"][1] == 8
    runner.kv_cache_config.num_blocks = NUM_BLOCKS + 1  # one block more is already one the pool cannot mirror
    with pytest.raises(PrefixCacheConfigError, match=f"grew to {NUM_BLOCKS + 1} blocks .* sized for {NUM_BLOCKS} "
                       r".*--no-enable-extensible-kv-cache"):
        step(runner, so(new=[("C", 4, 0, [NUM_BLOCKS])], counts={"C": 4}))
    assert "C" not in runner.computed and h.stats()["steps"] == 2



# ---------------------------------------------------------------- mutation review of the hooks (stop 48)
# Each test below kills a mutant of omnishm/integrations/vllm.py or omnishm/client/v2_view.py that survived the
# rest of the suite (34 mutants, 21 killed before).


class _WarmWorker(OmniPrefixCacheWorkerExtension):
    """vLLM's worker as the extension reads it, with a ``compile_or_warm_up_model`` that, as V2's
    ``warmup_kernels`` does, runs a made-up request on made-up blocks through the runner's ``execute_model``."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=EXTENSION_CLS))
        self.warm_ups = 0

    def compile_or_warm_up_model(self) -> str:
        self.warm_ups += 1
        step(self.model_runner, so(new=[("_warmup_", 8, 0, [2, 3])], counts={"_warmup_": 8}))
        step(self.model_runner, so(finished=["_warmup_"], counts={}))
        return "warmed"


@pytest.fixture
def worker(committer, monkeypatch):
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_NAME", committer.name)
    w = _WarmWorker()
    w.model_runner = FakeV2Runner()  # installs the hooks and wraps compile_or_warm_up_model
    yield w
    w.omnishm_shutdown()


def _assert_warm_up_unseen(worker: _WarmWorker) -> list:
    hooks = worker._omnishm_hooks_or_none()
    steps = hooks.stats()["steps"]
    assert worker.compile_or_warm_up_model() == "warmed"
    assert hooks.stats()["steps"] == steps, "the warm-up's made-up steps were tracked by the hooks"
    assert "_warmup_" not in hooks._mirror._blocks
    taken = sorted(worker.omnishm_take_prompt_hidden())
    assert "_warmup_" not in taken
    return taken


def test_the_worker_warm_up_passes_through_the_hooks(worker):
    """The worker extension wraps ``compile_or_warm_up_model`` in ``passing_through``: a warm-up's made-up
    requests are not tracked, mirrored, saved or held (review, stop 47: they overwrote live pool rows and were
    held as results), and a real step after it is saved and exact. MUTATION: the wrapper not entering
    ``passing_through`` survived (no CPU test ran the worker's wrapper)."""
    runner = worker.model_runner
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert _assert_warm_up_unseen(worker) == ["A"] and worker.warm_ups == 1
    step(runner, so(new=[("B", 10, 8, [0, 1, 3])], counts={"B": 2}))
    got = worker.omnishm_take_results()
    assert sorted(got) == ["B"] and got["B"]["hit_tokens"] == 8


def test_a_warm_up_after_a_reinstall_passes_through_the_new_hooks(worker):
    """The wrapper is put on once, but finds the hooks installed when it runs: after ``omnishm_shutdown`` and
    ``omnishm_install`` (fresh hooks), a warm-up during serving (elastic EP's ``warm_and_capture``) passes
    through the new hooks, not the retired ones. MUTATION: a wrapper bound to the hooks of its making."""
    runner = worker.model_runner
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    worker.omnishm_shutdown()
    assert worker.omnishm_install()
    _assert_warm_up_unseen(worker)
    step(runner, so(cached=[("A", 8, [4])], counts={"A": 1}))
    assert worker._omnishm_hooks_or_none().stats()["saves"] == 1


def test_passing_through_ends_when_its_body_raises(v2):
    """``passing_through`` is left on the way out of an exception too (a warm-up that fails and is caught): the
    next real steps are tracked and saved, not passed through unseen for the rest of the engine's life.
    MUTATION: the count taken back outside a ``finally``."""
    h, runner = v2
    with pytest.raises(RuntimeError, match="warm-up failed"):
        with h.passing_through():
            raise RuntimeError("warm-up failed")
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert h.stats()["saves"] == 1
    a, hit = h.take_results()["A"]
    assert hit == 0 and torch.equal(a, rows(1, range(8)))


class _KwRunner(FakeV2Runner):
    def __init__(self) -> None:
        super().__init__()
        self.kwargs: list[dict] = []

    def execute_model(self, s, intermediate_tensors=None, dummy_run: bool = False, **kw):
        self.kwargs.append(dict(kw, dummy_run=dummy_run))
        return super().execute_model(s, intermediate_tensors, dummy_run=dummy_run, **kw)


def test_a_real_steps_keyword_arguments_reach_the_runner(committer, monkeypatch):
    """The wrapper passes the runner's own keyword arguments of a real step through unchanged (the V2 runner's
    ``execute_model`` takes more than the scheduler output), and still saves the step. MUTATION: a real
    step's keyword arguments dropped."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    runner = _KwRunner()
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    try:
        runner.execute_model(so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}), None, skip_attn_for_dummy_run=True)
        assert runner.kwargs == [{"skip_attn_for_dummy_run": True, "dummy_run": False}]
        assert h.stats()["saves"] == 1
    finally:
        h.uninstall()


def test_a_live_id_sent_again_as_new_takes_only_its_new_blocks(v2):
    """vLLM's REPLACED on the V2 runner: a live request id re-sent as new (streaming input) gets the new
    request's block list, which replaces the old one in the runner's table (``add_requests``); the mirror
    replaces it too. Its rows land in the new blocks, so a later request hitting those blocks reads them exactly.
    MUTATION: the new block ids appended to the old ones (rows placed by blocks the request gave up)."""
    h, runner = v2
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    step(runner, so(new=[("A", 8, 0, [4, 5])], counts={"A": 8}))  # same live id, new blocks
    step(runner, so(new=[("C", 10, 8, [4, 5, 6])], counts={"C": 2}))
    c, hit = h.take_results()["C"]
    assert hit == 8 and torch.equal(c, rows(1, range(10)))


def test_an_id_finished_and_sent_as_new_in_one_step_keeps_its_new_blocks(v2):
    """Within one scheduler output a finish precedes a re-add of the same id (the adapter's order, and the V2
    runner's: ``finish_requests`` before ``add_requests``): the mirror drops the old ids first and keeps the new
    request's, so its rows are placed and held. MUTATION: new requests applied before the finishes."""
    h, runner = v2
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert torch.equal(h.take_results()["A"][0], rows(1, range(8)))
    step(runner, so(new=[("A", 4, 0, [6])], finished=["A"], counts={"A": 4}))
    assert torch.equal(h.take_results()["A"][0], rows(1, range(4))) and h.stats()["requests"] == 2


def test_the_mirror_appends_after_a_cached_request_without_new_blocks():
    """A cached request with no new blocks (``new_block_ids`` entry None) keeps its ids, and the requests after
    it in ``scheduled_cached_reqs`` still get their new blocks appended. MUTATION: the loop left at such a
    request (``break`` for ``continue``): the later requests' next positions had no block."""
    m = BlockIdMirror()
    m.update(so(new=[("A", 8, 0, [1, 2]), ("B", 4, 0, [3])], counts={"A": 8, "B": 4}))
    m.update(so(cached=[("B", 4, None), ("A", 8, [4])], counts={"A": 1, "B": 1}))
    assert m.blocks("A") == [1, 2, 4] and m.blocks("B") == [3]


def _mirror_ab() -> BlockIdMirror:
    m = BlockIdMirror()
    m.update(so(new=[("A", 8, 0, [5, 2]), ("B", 8, 0, [9])], counts={"A": 6, "B": 1}))
    return m


def test_the_v2_view_refuses_rows_that_start_before_the_previous_requests_end():
    """Row offsets (``query_start_loc_np``) must be exactly the running sum of the counts in batch order: rows
    that start inside the previous request's are refused, as rows that start past them are (either way rows
    would go to another request). MUTATION: only a start past the running sum refused."""
    batch = _batch(["B", "A"], [1, 6], [3, 2], starts=[0, 0, 7])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="batch rows start at 0, not 1"):
        V2StepGroupView(batch, _mirror_ab(), 4).step_slots_cpu([1, 6])


def test_the_v2_view_reads_only_the_batchs_own_counts():
    """The batch's ``num_scheduled_tokens`` is compared over its requests only: an array longer than the
    batch (padding entries) is no count mismatch, and the slots are exact. MUTATION: the whole array compared."""
    batch = _batch(["B", "A"], [1, 6], [3, 2], starts=[0, 1, 7, 7])
    batch.num_scheduled_tokens = np.array([1, 6, 0], dtype=np.int32)
    assert V2StepGroupView(batch, _mirror_ab(), 4).step_slots_cpu([1, 6]).tolist() == [39, 22, 23, 8, 9, 10, 11]
