"""The writer's token check (``omnishm/client/tokens.py``) in a real in-process vLLM engine.

vLLM 0.32's priority scheduler may preempt a request it already scheduled in the same step, after
``allocate_slots`` put the request's new full blocks in the prefix cache; nothing is ever computed for them.
When the request resumes it hits them, and before the token check omnishm served the rows an earlier,
unrelated request left in those slots, with no error (review, stop 54). The gate refuses the policy since; this
test turns the scheduler to priority behind the gate's back (the policy is read once, at the scheduler's
start) to show that the check catches the same fault: the step raises ``OmniPrefixCacheUnmatchError``, no row
is served. Every other tier test runs with the check on, so a wrong tag would fail them as a false refusal.
"""

from __future__ import annotations

import random

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_harness import Harness, close_llm, make_llm, rand_tokens  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 9 blocks of 32: the first prompt fills the pool, so every later block is a recycled one.
    llm = make_llm(tiny_model_dir, multiprocess=False, cache=unique_cache_name("tokchk"), max_model_len=256,
                   num_gpu_blocks_override=9, max_num_seqs=4, max_num_batched_tokens=160,
                   enable_chunked_prefill=True, long_prefill_token_threshold=64)
    try:
        yield {"harness": Harness(llm)}
    finally:
        close_llm(llm)


def _add(h: Harness, rid: str, prompt: list[int], max_tokens: int, priority: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    h.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)),
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                 priority=priority)
    h.prompts[rid] = list(prompt)


def test_ordinary_hits_are_checked_token_by_token_and_served(h):
    """The check is on in a real engine: a hit's prompt rows are compared (the writer's counter), none
    differs, and every row is the no-hit run's, bit for bit."""
    rng = random.Random(665)
    donor = rand_tokens(rng, 100)
    h.generate([donor], max_tokens=2)
    (out,) = h.generate([donor[:96] + rand_tokens(rng, 5)], max_tokens=2)
    manager = h.rpc("omnishm_stats")["manager"]
    assert manager["token_checked_rows"] == 96 and manager["token_mismatches"] == 0, manager
    h.check(expect_hit=[out.request_id], expect_cached={out.request_id: 96})


def test_a_resume_on_blocks_vllm_never_computed_raises_instead_of_serving_rows(h, monkeypatch):
    """Last in this module: the error is fatal to the engine by contract (vLLM's runner is left between its
    forward and its sampling), so no test may follow it on this engine."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

    from omnishm.client import OmniPrefixCacheUnmatchError

    sched = h.llm.llm_engine.engine_core.engine_core.scheduler
    assert not sched.waiting and not sched.running
    monkeypatch.setattr(sched, "policy", SchedulingPolicy.PRIORITY)
    monkeypatch.setattr(sched, "waiting", create_request_queue(SchedulingPolicy.PRIORITY))
    monkeypatch.setattr(sched, "adaptive_long_prefill_threshold", False, raising=False)
    preempted = []
    orig = sched._preempt_request
    monkeypatch.setattr(sched, "_preempt_request", lambda *a, **kw: (preempted.append(1), orig(*a, **kw))[1])
    rng = random.Random(664)
    h.generate([rand_tokens(rng, 250)], max_tokens=1)  # fills every slot of the pool with this request's rows
    victim = rand_tokens(rng, 224)
    _add(h, "D", rand_tokens(rng, 10), 1, priority=0)  # a second request: the 64-token prefill cap applies
    _add(h, "V", victim, 5, priority=10)
    h.step()
    _add(h, "H", rand_tokens(rng, 64), 10, priority=0)  # more urgent: V, scheduled in this step, is preempted
    with pytest.raises(OmniPrefixCacheUnmatchError) as err:
        for _ in range(200):
            if not h.llm.llm_engine.has_unfinished_requests():
                break
            h.step()
    text = str(err.value)
    assert "computed for other tokens" in text and "request='V-" in text and "step_id=" in text, text
    assert preempted, "vLLM preempted nothing: the scenario did not run"
    stats = h.rpc("omnishm_stats")
    assert "V" not in {rid.split("-")[0] for rid in h.collect()}, "V's rows were served"
    assert stats["cache"] == h.cache

