"""A real vLLM v1 engine in-process with **async scheduling** (vLLM 0.32's default on GPU) and the omnishm hooks.

vLLM's CPU platform forces ``async_scheduling`` off (``CpuPlatform.check_and_update_config``), so the rest of the
tier never runs it. Here the override is lifted for this module's engine: its scheduler is the
``AsyncScheduler``, the engine core keeps two batches in flight (``step_with_batch_queue``), and a request that
finishes on a stop token (a finish the scheduler cannot foresee) is scheduled one step more, its placeholder
decode computed and its output dropped. Every request's full-prompt hidden states from omnishm must still equal,
bit for bit, the same prompt run with the prefix cache reset (review, stop 47: 0 wrong rows over 14 scenarios).
"""

from __future__ import annotations

import random

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_harness import Harness, close_llm, make_llm, rand_tokens  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

NUM_BLOCKS = 24


def _async_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the CPU platform's ``async_scheduling = False`` for the engines built while the patch holds."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(check_and_update_config))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        _async_on_cpu(mp)
        llm = make_llm(tiny_model_dir, multiprocess=False, cache=unique_cache_name("async"),
                       num_gpu_blocks_override=NUM_BLOCKS)
    try:
        core = llm.llm_engine.engine_core.engine_core
        assert core.batch_queue is not None and type(core.scheduler).__name__ == "AsyncScheduler"
        log = _record_late_scheduling(core)
        yield {"harness": Harness(llm), "first": False, "log": log, "core": core}
    finally:
        close_llm(llm)


def _record_late_scheduling(core) -> dict:
    """Wraps the scheduler: ``extra`` collects the requests scheduled in a batch built after the batch whose
    output finished them (the step more that async scheduling gives a request finished by a stop token)."""
    sched = core.scheduler
    log: dict = {"batches": [], "extra": set()}
    schedule, update = sched.schedule, sched.update_from_output

    def scheduled(*args, **kwargs):
        out = schedule(*args, **kwargs)
        log["batches"].append(out)
        return out

    def updated(so, model_output):
        res = update(so, model_output)
        finished = {o.request_id for eco in res.values() for o in eco.outputs if o.finish_reason is not None}
        at = next(i for i, b in enumerate(log["batches"]) if b is so)
        for later in log["batches"][at + 1:]:
            log["extra"] |= finished & set(later.num_scheduled_tokens)
        del log["batches"][:at]
        return res

    sched.schedule, sched.update_from_output = scheduled, updated
    return log


def _generate(h: Harness, prompts: list[list[int]], stop_token_ids: list[list[int] | None] | None = None,
              max_tokens: int = 30) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop)
              for stop in (stop_token_ids or [None] * len(prompts))]
    outs = h.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        h.prompts[o.request_id] = list(p)
        h.cached[o.request_id] = int(o.num_cached_tokens or 0)
    return outs


def test_stop_token_finishes_scheduled_one_step_more_then_hit(h, engine):
    """A request finished by a stop token is scheduled one step more (its extra decode lands in a fresh block
    for prompts at a block boundary); new requests right after hit its blocks, generated tokens included."""
    rng = random.Random(31)
    hit_ids: list[str] = []
    for rnd in range(6):
        base = rand_tokens(rng, 95 + rnd)
        prompt = base + rand_tokens(rng, 3)
        (probe,) = _generate(h, [prompt], max_tokens=8)
        toks = list(probe.outputs[0].token_ids)
        firsts = [k for k in range(len(toks)) if toks[k] not in toks[:k]]
        k = firsts[rnd % len(firsts)]  # stop on the k-th generated token
        others = [rand_tokens(rng, 40) for _ in range(2)]
        outs = _generate(h, [prompt, *others], stop_token_ids=[[toks[k]], None, None], max_tokens=20)
        assert len(outs[0].outputs[0].token_ids) == k + 1
        done = outs[0].prompt_token_ids + list(outs[0].outputs[0].token_ids)
        hit_ids += [o.request_id for o in _generate(h, [base[:64] + rand_tokens(rng, 50),
                                                         done + rand_tokens(rng, 5)], max_tokens=3)]
    assert len(engine["log"]["extra"]) >= 6, "no request was scheduled past its finish: async scheduling is off"
    h.check(expect_hit=hit_ids)


def test_aborts_with_two_batches_in_flight_then_hits(h, engine):
    """Aborts while the next batch is already scheduled; the freed blocks reused and hit at once."""
    rng = random.Random(32)
    base = rand_tokens(rng, 100)
    h.add("a", base + rand_tokens(rng, 60), max_tokens=40)
    h.add("b", rand_tokens(rng, 70), max_tokens=40)
    in_flight = 0
    for _ in range(6):
        h.step()
        in_flight = max(in_flight, len(engine["core"].batch_queue))
    h.llm.llm_engine.abort_request(["a"])  # a's next decode is in flight
    h.add("c", base + rand_tokens(rng, 33), max_tokens=4)  # hits a's prompt blocks
    h.add("d", rand_tokens(rng, 90), max_tokens=4)  # may reuse a's freed blocks
    for _ in range(3):
        h.step()
    h.llm.llm_engine.abort_request(["b"])
    h.add("e", base[:96] + rand_tokens(rng, 9), max_tokens=2)
    h.drain()
    assert in_flight >= 1
    h.check(expect_hit=["c", "e"], expect_cached={"c": 96, "e": 96})


def test_reset_prefix_cache_preempts_running_requests_with_output_in_flight(h, engine):
    """``reset_prefix_cache(reset_running_requests=True)``: every running request is preempted with its
    in-flight output dropped and recomputed from token 0; a later request hits the recomputed blocks."""
    rng = random.Random(33)
    base = rand_tokens(rng, 100)
    h.add("r1", base + rand_tokens(rng, 50), max_tokens=30)
    h.add("r2", base[:64] + rand_tokens(rng, 20), max_tokens=30)
    h.add("r3", rand_tokens(rng, 300), max_tokens=30)
    for _ in range(4):
        h.step()
    assert h.llm.llm_engine.reset_prefix_cache(True)
    for _ in range(3):
        h.step()
    h.add("r4", base[:96] + rand_tokens(rng, 10), max_tokens=2)
    h.drain()
    h.check(expect_hit=["r4"], expect_cached={"r4": 96})
