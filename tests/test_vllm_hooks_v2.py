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
from omnishm.integrations.vllm import OmniPrefixCacheRunnerHooks
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
    ``save_outputs`` after the forward. A cache that shrank is no danger and runs on."""
    from omnishm.client.group_view import PrefixCacheConfigError
    from test_vllm_hooks import NUM_BLOCKS
    h, runner = v2
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    runner.kv_cache_config.num_blocks = NUM_BLOCKS - 2
    step(runner, so(new=[("B", 10, 8, [0, 1, 3])], counts={"B": 2}))
    assert h.take_results()["B"][1] == 8
    runner.kv_cache_config.num_blocks = NUM_BLOCKS + 4
    with pytest.raises(PrefixCacheConfigError, match=f"grew to {NUM_BLOCKS + 4} blocks .* sized for {NUM_BLOCKS} "
                       r".*--no-enable-extensible-kv-cache"):
        step(runner, so(new=[("C", 8, 0, [NUM_BLOCKS, NUM_BLOCKS + 1])], counts={"C": 8}))
    assert "C" not in runner.computed and h.stats()["steps"] == 2
