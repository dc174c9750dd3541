"""The stock-vLLM hooks at their edges: prompt rows, hit lengths, held results, request ids, the worker's runner
and the runner mixin's cache naming.

Each test kills a mutant of ``omnishm/integrations/vllm.py`` or ``omnishm/client/runner_mixin.py`` that survived
the rest of the suite (mutation review, 2026-12-06: 49 mutants, 25 killed before). vLLM is not installed here:
the fakes of ``test_vllm_hooks`` stand in for its objects; the committer is real.
"""
from __future__ import annotations

import pytest
import torch

from manager_helpers import rows
from omnishm.integrations.vllm import OmniPrefixCacheRunnerHooks, external_req_id

from test_vllm_hooks import FakeV1Runner, hooks, so, step  # noqa: F401  (the fixture and fakes of vLLM objects)


def test_external_req_id_strips_only_an_8_char_suffix():
    """MUTATION (2026-12-06): stripping any dash-part of 8 characters or more survived: a caller's id ending in a UUID
    group lost it."""
    assert external_req_id("chat-0123abcd") == "chat"
    # a caller id whose own last dash-part is longer than 8 (a UUID's last group: 12) stays whole
    assert external_req_id("550e8400-e29b-41d4-a716-446655440000") == "550e8400-e29b-41d4-a716-446655440000"
    assert external_req_id("req-123456789") == "req-123456789"
    assert external_req_id("req-1234567") == "req-1234567"


def test_a_request_resumed_as_new_after_its_prompt_completed_is_not_held_twice(hooks):
    """vLLM's V2 runner resumes a preempted request by re-sending it as new (the adapter's RESUMED). Its prompt
    rows, completed and held before the preemption, are not completed and held a second time: V1, which resumes
    it as a cached request, holds them once (review, stop 47: a V2 engine held one request twice)."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert torch.equal(h.take_results()["A"][0], rows(1, range(8)))
    step(runner, so(cached=[("A", 8, [2])], counts={"A": 1}))
    step(runner, so(preempted=["A"], counts={}))
    step(runner, so(new=[("A", 8, 0, [3, 4, 5])], counts={"A": 9}))
    assert h.take_results() == {} and h.stats()["requests"] == 1


def test_a_request_re_added_as_new_that_recomputes_prompt_and_outputs_holds_only_its_prompt_rows(hooks):
    """MUTATION (2026-12-06): one row too many in the held prompt (``prompt_len - start + 1``) survived: an output
    token's row became part of the prompt. A request that decoded 2 tokens, was preempted and is re-added as new
    recomputes its 8 prompt tokens and its 2 output tokens in one step; when its earlier prompt rows are no
    longer tracked (here taken out by hand), the held prompt rows are exactly the 8 prompt rows, never an
    output-token row."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert torch.equal(h.take_results()["A"][0], rows(1, range(8)))
    step(runner, so(cached=[("A", 8, [2])], counts={"A": 1}))
    step(runner, so(cached=[("A", 9, None)], counts={"A": 1}))
    step(runner, so(preempted=["A"], counts={}))
    del h._prompts["A"]
    step(runner, so(finished=[], new=[("A", 8, 0, [3, 4, 5])], counts={"A": 10}))
    res = h.take_results()
    assert "A" in res
    assert res["A"][0].shape[0] == 8 and torch.equal(res["A"][0], rows(1, range(8))), res["A"][0].shape


def test_a_request_finished_mid_prompt_in_a_step_that_schedules_nothing_is_let_go(hooks):
    """MUTATION (2026-12-06), beside the next test: a request aborted while its prompt is half computed, reported
    in a zero-token step: its partial rows are dropped (and counted), not kept for ever."""
    h, runner = hooks
    step(runner, so(new=[("A", 16, 0, [0, 1, 2, 3])], counts={"A": 4}))
    step(runner, so(finished=["A"], counts={}))
    assert h.stats()["incomplete_dropped"] == 1
    assert "A" not in h._prompts and "A" not in h._raw


def test_an_aborted_request_mid_prompt_is_let_go(hooks):
    """MUTATION (2026-12-06): dropping ABORTED from the kinds that let a request's rows go survived: an aborted
    request's partial rows stayed for ever. vLLM reports an abort in finished_req_ids and aborted_req_ids: the hooks
    drop its partial rows."""
    h, runner = hooks
    step(runner, so(new=[("A", 16, 0, [0, 1, 2, 3]), ("B", 8, 0, [4, 5])], counts={"A": 4, "B": 4}))
    s = so(cached=[("B", 4, None)], finished=["A"], counts={"B": 4})
    s.aborted_req_ids = {"A"}
    step(runner, s)
    assert h.stats()["incomplete_dropped"] == 1
    assert "A" not in h._prompts and "A" not in h._raw
    assert torch.equal(h.take_results()["B"][0], rows(1, range(8)))


def test_padded_hidden_states_rows_are_never_saved_or_returned(committer, monkeypatch):
    """MUTATION (2026-12-06): saving the padded row count (``hidden.shape[0]``) survived: CUDA-graph padding rows were
    saved and returned. CUDA-graph padding: execute_model_state.hidden_states has more rows than the step's tokens.
    Only the first total_num_scheduled_tokens rows are the step's; the held prompt rows are exact."""
    from types import SimpleNamespace

    from omnishm.integrations.vllm import OmniPrefixCacheRunnerHooks
    from test_vllm_hooks import FakeV1Runner

    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")

    class Padded(FakeV1Runner):
        def execute_model(self, s, intermediate_tensors=None):
            super().execute_model(s, intermediate_tensors)
            if s.total_num_scheduled_tokens:
                h = self.execute_model_state.hidden_states
                pad = torch.full((8 - h.shape[0] % 8, h.shape[1]), -7.0, dtype=h.dtype)
                self.execute_model_state = SimpleNamespace(hidden_states=torch.cat([h, pad]))

    runner = Padded()
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    try:
        step(runner, so(new=[("A", 6, 0, [0, 1]), ("B", 3, 0, [2])], counts={"A": 6, "B": 3}))
        res = h.take_results()
        assert torch.equal(res["A"][0], rows(1, range(6))) and torch.equal(res["B"][0], rows(1, range(3)))
        assert h.stats()["rows_saved"] == 9
    finally:
        h.uninstall()


def test_a_completed_prompt_is_handed_out_once_not_again_at_each_decode_step(hooks):
    """MUTATION (2026-12-06): dropping the ``length < prompt_len`` check survived: a finished prompt's raw rows were
    held again at every decode step."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert sorted(h.take_results()) == ["A"] and sorted(h.take_raw()) == ["A"]
    step(runner, so(cached=[("A", 8, [2])], counts={"A": 1}))
    step(runner, so(cached=[("A", 9, None)], counts={"A": 1}))
    assert h.take_results() == {} and h.take_raw() == {}
    assert h.stats()["raw_requests"] == 1 and h.stats()["requests"] == 1


def test_a_request_resumed_with_a_hit_after_its_prompt_completed_is_not_handed_out_again(hooks):
    """MUTATION (2026-12-06): ``length > prompt_len`` for ``>=`` survived: a request resumed after its prompt completed
    was handed out a second time. A completes its prompt, decodes, is preempted and resumed (V1: cached +
    resumed_req_ids) with a hit on its own prompt blocks: its prompt was handed out already; no second result, no
    second count."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    step(runner, so(cached=[("A", 8, [2])], counts={"A": 1}))
    assert sorted(h.take_results()) == ["A"]
    step(runner, so(preempted=["A"], counts={}))
    step(runner, so(cached=[("A", 8, [0, 1, 3])], resumed=["A"], counts={"A": 2}))
    assert h.take_results() == {} and h.stats()["requests"] == 1


def test_the_hit_tokens_of_a_prompt_computed_in_chunks_after_its_hit_are_the_hit(hooks):
    """MUTATION (2026-12-06): keeping the last scheduling's hit instead of the longest survived: a prompt computed in
    chunks after its hit reported 0 hit tokens."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    step(runner, so(new=[("B", 16, 8, [0, 1, 2])], counts={"B": 4}))  # hit 8, first chunk 8..11
    step(runner, so(cached=[("B", 12, [3])], counts={"B": 4}))  # second chunk 12..15
    res = h.take_results()
    assert torch.equal(res["B"][0], rows(1, range(16))) and res["B"][1] == 8, res["B"][1]
    assert h.stats()["hit_tokens"] == 8 and h.stats()["hit_requests"] == 1


def test_a_completed_prompt_is_not_kept_twice(hooks):
    """MUTATION (2026-12-06): not clearing the accumulator's parts survived: a completed prompt's rows were kept twice,
    outside the held-bytes bound. Once held for the takers, the accumulator lets its rows go (they are counted in
    the bound once)."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    assert h._prompts["A"].parts == []


def test_a_finished_complete_prompt_is_not_counted_as_incomplete(hooks):
    """MUTATION (2026-12-06): ``<=`` for ``<`` survived: a finished complete prompt was counted as dropped
    incomplete."""
    h, runner = hooks
    step(runner, so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
    step(runner, so(finished=["A"], counts={}))
    assert h.stats()["incomplete_dropped"] == 0


def test_a_worker_whose_runner_is_set_to_none_retires_its_hooks(committer, monkeypatch):
    """MUTATION (2026-12-06): retiring the hooks only when the same runner is set again (``is`` for ``is not``)
    survived: after ``model_runner = None`` the link kept heartbeating. Assigning no runner (a worker tearing down)
    detaches the hooks' manager: no link left heartbeating."""
    from test_vllm_hooks import _links, _worker_after_one_step

    before = _links()
    worker = _worker_after_one_step(committer, monkeypatch)
    m = worker._omnishm_hooks_or_none().manager
    worker.model_runner = None
    assert m.shut_down and worker._omnishm_hooks_or_none() is None and _links() == before
    assert sorted(worker.omnishm_take_prompt_hidden()) == ["A"]


def test_reassigning_the_same_runner_keeps_the_hooks(committer, monkeypatch):
    """MUTATION (2026-12-06): the same mutant's other side: the same runner set again keeps its hooks."""
    from test_vllm_hooks import _worker_after_one_step

    worker = _worker_after_one_step(committer, monkeypatch)
    hooks = worker._omnishm_hooks_or_none()
    worker.model_runner = worker.model_runner
    try:
        assert worker._omnishm_hooks_or_none() is hooks and not hooks.manager.closed
    finally:
        worker.omnishm_shutdown()


def test_decode_results_keeps_hit_tokens():
    """MUTATION (2026-12-06): ``decode_results`` returning hit 0 survived."""
    from omnishm.integrations.vllm import decode_results, encode_tensor

    t = rows(1, range(3))
    out = decode_results({"A": {"hidden": encode_tensor(t), "hit_tokens": 2}})
    assert torch.equal(out["A"][0], t) and out["A"][1] == 2


def test_held_rows_over_the_bound_drop_raw_rows_before_results():
    """MUTATION (2026-12-06): evicting finished results before raw rows over the bound survived."""
    from omnishm.integrations.held_results import HeldResults

    t = rows(1, range(4))
    one = t.numel() * t.element_size()
    held = HeldResults(2 * one)
    held.hold("done", "A", (t.clone(), 0))
    held.hold("raw", "A", t.clone())
    held.hold("done", "B", (t.clone(), 0))
    assert sorted(held.take("done")) == ["A", "B"] and held.take("raw") == {}


def test_a_held_result_larger_than_the_bound_is_dropped_alone():
    """Review (stop 56): one result over the whole bound evicted every held result first, then itself. It is
    dropped alone now (counted, warned), and the results that fit stay."""
    from omnishm.integrations.held_results import HeldResults

    t = rows(1, range(4))
    one = t.numel() * t.element_size()
    held = HeldResults(3 * one)
    held.hold("done", "A", (t.clone(), 0))
    held.hold("raw", "A", t.clone())
    held.hold("done", "big", (rows(1, range(16)), 0))
    assert held.stats() == {"held_bytes": 2 * one, "results_dropped": 1}
    assert sorted(held.take("done")) == ["A"] and sorted(held.take("raw")) == ["A"]


def test_a_held_result_larger_than_the_bound_is_logged_with_its_request_after_earlier_drops_too(caplog):
    """Fresh-eyes review (stop 56): an oversized result dropped after earlier drops logged nothing, and the one
    warning said "dropping the oldest" when the newest was dropped. The first oversized drop is logged on its
    own, naming the request and its size."""
    import logging

    from omnishm.integrations.held_results import HeldResults

    held = HeldResults(bound=4096)
    caplog.set_level(logging.WARNING, logger="omnishm.integrations.held_results")
    for i in range(3):  # three 2 KiB results: the first is dropped (the oldest-first warning)
        held.hold("done", f"a{i}", (torch.zeros(512), 0))
    assert held.stats()["results_dropped"] == 1 and len(caplog.records) == 1
    held.hold("done", "huge", (torch.zeros(1 << 20), 0))
    assert held.stats()["results_dropped"] == 2 and len(caplog.records) == 2
    said = caplog.records[1].getMessage()
    assert "'huge'" in said and "4194304 bytes" in said and "oldest" not in said
    assert sorted(held.take("done")) == ["a1", "a2"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_held_rows_cross_the_rpc_wire_with_their_dtype_and_shape(dtype):
    """``omnishm_take_results`` ships each prompt's rows [P, H] as plain types (``encode_tensor``) and the caller
    decodes them (``decode_results``): the rows come back with the dtype, shape and values the runner produced (bf16
    stays bf16), and a sliced or transposed view is sent as its logical rows. MUTATION (stop 47): a decode that took
    every payload for float32 survived (the other tests used float32 rows only)."""
    from omnishm.integrations.held_results import decode_results, encode_tensor

    base = (torch.arange(5 * 12) - 7).reshape(5, 12).to(dtype)
    for t in (base, base[:, :3], base.t()):
        wire = encode_tensor(t)
        assert wire["dtype"] == str(dtype).removeprefix("torch.") and wire["shape"] == list(t.shape)
        out, hit = decode_results({"R": {"hidden": wire, "hit_tokens": 4}})["R"]
        assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t) and hit == 4
    empty = decode_results({"E": {"hidden": encode_tensor(base[:0]), "hit_tokens": 0}})["E"][0]
    assert empty.dtype == dtype and empty.shape == (0, 12)


def test_holding_a_request_again_replaces_its_rows_and_their_count():
    """A request held again (its prompt completed again after a preemption) replaces its old rows: ``held_bytes``
    counts the new rows only, so rows no longer held never fill the bound and drop another request's. MUTATION
    (stop 47): not subtracting the replaced rows' bytes survived."""
    from omnishm.integrations.held_results import HeldResults

    one = torch.ones(2, 8)
    held = HeldResults(2 * one.numel() * 4)
    for _ in range(5):
        held.hold("done", "A", (one.clone(), 0))
    held.hold("done", "B", (one.clone(), 1))
    assert held.stats() == {"held_bytes": 2 * one.numel() * 4, "results_dropped": 0}
    assert sorted(held.take("done")) == ["A", "B"]


def test_a_held_pooled_result_counts_the_pool_block_it_keeps():
    """A ``materialize`` result from the result pool (32 MiB and up) is a view of a pool block up to 25% plus
    one grain larger; held whole (not cloned: its storage is its own bytes), it keeps the whole block, so
    ``held_bytes`` counts the block and the bound holds (review, 2026-12-06: the view's bytes were counted).
    Once taken and dropped, the block goes back to its pool and the count to 0."""
    import gc

    from omnishm.client.result_pool import GRAIN, ResultPool, kept_bytes
    from omnishm.integrations.held_results import HeldResults

    pool = ResultPool(64 << 20, min_bytes=0)
    del_me = pool.empty((2 * GRAIN // 4,), torch.float32)  # a block of 2 grains, then free
    del del_me
    gc.collect()
    result = pool.empty((3 * GRAIN // 8,), torch.float32)  # 1.5 grains, served from that block
    assert pool.stats["reused"] == 1 and kept_bytes(result) == 2 * GRAIN
    assert kept_bytes(result[:4]) == 2 * GRAIN and kept_bytes(torch.ones(4)) == 16
    held = HeldResults(3 * GRAIN)
    held.hold("done", "A", (result, 0))
    assert held.stats() == {"held_bytes": 2 * GRAIN, "results_dropped": 0}
    held.hold("done", "B", (torch.ones(GRAIN // 4 + 1), 0))  # 1 grain + 4 bytes: over the bound, A goes
    assert held.stats() == {"held_bytes": GRAIN + 4, "results_dropped": 1}
    del result
    gc.collect()
    assert pool.free_bytes == 2 * GRAIN  # no view of the block is left: it came back


def _fake_vllm(monkeypatch, version: str, *, v1_runner: bool) -> None:
    """A stand-in ``vllm`` package of ``version``, with or without ``vllm.v1.worker.gpu_model_runner``."""
    import sys
    import types

    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package with nothing on disk: find_spec of a child not in sys.modules is None
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["vllm"].__version__ = version
    if v1_runner:
        import importlib.machinery

        runner = types.ModuleType("vllm.v1.worker.gpu_model_runner")
        runner.__spec__ = importlib.machinery.ModuleSpec(runner.__name__, None)
        monkeypatch.setitem(sys.modules, runner.__name__, runner)
    else:
        monkeypatch.delitem(sys.modules, "vllm.v1.worker.gpu_model_runner", raising=False)


class _OtherRunner:
    """A runner of neither of vLLM's families: ``execute_model_state`` and ``execute_model``, but neither V1's
    ``input_batch`` / ``_update_states`` nor V2's ``req_states`` / ``add_requests``."""

    execute_model_state = None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return None


def test_a_runner_of_neither_family_is_refused_with_the_remedy_the_installed_vllm_allows(monkeypatch):
    """The hooks run on vLLM's V1 and V2 model runners and refuse any other. Where the installed vLLM has the V1
    runner (0.32/0.33) the refusal says to select it with ``VLLM_USE_V2_MODEL_RUNNER=0``; on 0.34, which removed
    V1 and rejects that variable, it says so and names what works. REVIEW (stop 47): on 0.34 the only advice
    was the variable vLLM refuses."""
    from omnishm.integrations.vllm import OmniPrefixCacheRunnerHooks

    _fake_vllm(monkeypatch, "0.33.0", v1_runner=True)
    with pytest.raises(RuntimeError, match=r"_OtherRunner has no '_update_states', 'input_batch'; .* "
                                           r"\(set VLLM_USE_V2_MODEL_RUNNER=0\)"):
        OmniPrefixCacheRunnerHooks(_OtherRunner())
    _fake_vllm(monkeypatch, "0.34.0", v1_runner=False)
    with pytest.raises(RuntimeError) as exc:
        OmniPrefixCacheRunnerHooks(_OtherRunner())
    assert "vLLM 0.34.0 has no V1 model runner (vLLM 0.34 removed it)" in str(exc.value)
    assert "omnishm's worker extension (omnishm.integrations.vllm), which runs on V2" in str(exc.value)


def test_a_lone_engine_with_dp_index_0_keeps_its_name_and_endpoint():
    """MUTATION (2026-12-06): ``index >= 0`` for ``> 0`` survived: a lone engine with data-parallel index 0 got a
    replica name and a ConfigError."""
    from types import SimpleNamespace

    from omnishm.client.runner_mixin import replica_cache_name

    pc = SimpleNamespace(data_parallel_index=0)
    assert replica_cache_name("x", "ipc:///tmp/x.sock", parallel_config=pc) == "x"



def test_raw_rows_of_a_request_resumed_with_a_shorter_hit_than_its_progress_are_its_prompt_once(hooks):
    """Contract: ``omnishm_take_raw_prompt_hidden`` holds each no-hit prompt's rows exactly once, position by
    position. A request preempted mid-prompt (8 of 12 tokens computed) and resumed with a hit shorter than its
    progress (vLLM evicted its second block: hit 4) recomputes positions 4..11; the raw tracker must drop its
    own rows from position 4 on before appending the recomputed ones, so the raw prompt is 12 rows, equal to
    what the cache served (killed mutant: ``_PromptRows.add`` keeping every accumulated row on a restart
    before its end, which held 16 rows with positions 4..7 twice)."""
    h, runner = hooks
    step(runner, so(new=[("A", 12, 0, [0, 1])], counts={"A": 8}))
    step(runner, so(preempted=["A"], counts={}))
    step(runner, so(cached=[("A", 4, [0, 2, 3])], resumed=["A"], counts={"A": 8}))
    res = h.take_results()
    assert "A" in res and torch.equal(res["A"][0], rows(1, range(12)))
    raw = h.take_raw()
    assert "A" in raw, h.stats()
    assert tuple(raw["A"].shape) == (12, rows(1, range(1)).shape[1])
    assert torch.equal(raw["A"], rows(1, range(12)))


def _attached(committer) -> set[str]:
    """The committer's attached sessions other than admin ones (``status`` itself opens one)."""
    return {c["client_id"] for c in committer.status()["clients"] if c["role"] != "admin"}


class _ModelFails(FakeV1Runner):
    def get_model(self):
        raise RuntimeError("model not loaded")


def test_a_manager_whose_policy_cannot_be_registered_is_shut_down_not_left_attached(committer, monkeypatch):
    """Contract: when the first real step builds the manager but the model's cache policy cannot be registered
    (``get_model`` / ``ModelCachePolicy.from_model`` raises), the error reaches vLLM and the half-built manager
    is shut down: no session of this process stays attached to the committer (it would hold a writer's seat
    and its staging until the process exits). Killed mutant: the ``manager.shutdown()`` in
    ``_ensure_manager``'s error path dropped."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    before = _attached(committer)
    h = OmniPrefixCacheRunnerHooks(_ModelFails(), cache=committer.name)
    h.install()
    try:
        with pytest.raises(RuntimeError, match="model not loaded"):
            h.runner.execute_model(so(new=[("A", 8, 0, [0, 1])], counts={"A": 8}))
        assert h.manager is None
        after = _attached(committer)
        assert after == before, after - before
    finally:
        h.uninstall()


# MUTATION review (2026-12-07, stop 53): HeldResults' order, its one warning, decoded rows owned.


def test_a_request_held_again_is_the_newest_and_the_oldest_other_goes_first():
    """MUTATION (2026-12-07, stop 53). Contract (``HeldResults``: past the bound "the oldest go"): a request held again (its prompt completed again
    after a preemption) replaces its rows and becomes the newest held. With room for two, holding A, B, A again,
    then C drops B (held before A's new rows), never A's fresh rows. Kills the mutant that replaces the value in
    place (``table.get`` for ``table.pop``), which keeps A at its first position and drops the rows just held."""
    from omnishm.integrations.held_results import HeldResults

    old, new = torch.zeros(2, 8), torch.ones(2, 8)
    held = HeldResults(2 * new.numel() * 4)
    held.hold("done", "A", (old.clone(), 0))
    held.hold("done", "B", (old.clone(), 0))
    held.hold("done", "A", (new.clone(), 3))
    held.hold("done", "C", (new.clone(), 1))
    assert held.stats() == {"held_bytes": 2 * new.numel() * 4, "results_dropped": 1}
    out = held.take("done")
    assert sorted(out) == ["A", "C"], sorted(out)
    assert torch.equal(out["A"][0], new) and out["A"][1] == 3


def test_the_drop_warning_is_logged_once_not_at_every_drop(caplog):
    """MUTATION (2026-12-07, stop 53). Contract (``HeldResults``): dropped rows are counted in ``results_dropped``, "with a warning on the first
    drop": a server that never calls ``omnishm_take_*`` drops rows at every step with a completed prompt, and a
    warning each time would flood its log from the engine thread. Kills the mutant ``first = dropped``."""
    import logging

    from omnishm.integrations.held_results import HeldResults

    one = torch.ones(2, 8)
    held = HeldResults(one.numel() * 4)
    with caplog.at_level(logging.WARNING, logger="omnishm.integrations.held_results"):
        for i in range(5):
            held.hold("done", f"R{i}", (one.clone(), 0))
    assert held.stats()["results_dropped"] == 4
    assert sum("exceed vllm_held_bytes" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_decoded_tensor_owns_its_bytes_and_never_writes_into_the_wire_payload():
    """MUTATION (2026-12-07, stop 53). Contract: ``decode_tensor`` returns rows the caller owns (writable, as ``encode_tensor``'s input was); an
    in-place op on them never writes into the received msgpack payload (a read-only ``bytes``, which CPython may
    share). Kills the mutant that builds the tensor over ``payload["data"]`` itself instead of a copy."""
    import warnings

    from omnishm.integrations.held_results import decode_tensor, encode_tensor

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    wire = encode_tensor(t)
    before = bytes(wire["data"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a buffer that is not writable
        out = decode_tensor(wire)
    out.add_(1)
    assert wire["data"] == before and torch.equal(out, t + 1)


def test_one_result_that_needs_two_older_ones_dropped_drops_both_and_the_bound_holds():
    """``HeldResults`` keeps at most its bound however results come: one new result that needs two older ones
    dropped drops both. MUTATION (stop 57): dropping one victim a ``hold`` left the held bytes over the bound,
    growing with every larger result a server never takes."""
    from omnishm.integrations.held_results import HeldResults

    small = torch.ones(2, 8)
    one = small.numel() * small.element_size()
    held = HeldResults(3 * one)
    for rid in ("A", "B", "C"):
        held.hold("done", rid, (small.clone(), 0))
    held.hold("done", "D", (torch.ones(4, 8), 0))  # two units: A and B must both go
    assert held.stats() == {"held_bytes": 3 * one, "results_dropped": 2}
    assert sorted(held.take("done")) == ["C", "D"]
    # and it never creeps up: a server that never takes holds at most the bound after every hold
    for i in range(6):
        held.hold("done", f"R{i}", (torch.ones(2 + 2 * (i % 2), 8), 0))
        assert held.stats()["held_bytes"] <= held.bound
