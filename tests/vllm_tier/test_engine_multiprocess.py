"""The worker in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1): vLLM's engine-core process.

The extension module is imported there, the hooks install themselves when the
worker assigns its model runner, and results cross vLLM's msgpack RPC as plain
types (``omnishm_take_results``).
"""

from __future__ import annotations

import os
import random

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_harness import Harness, close_llm, make_llm, rand_tokens  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = make_llm(tiny_model_dir, multiprocess=True, cache=unique_cache_name("mp"), num_gpu_blocks_override=24)
    try:
        core = type(llm.llm_engine.engine_core).__name__
        assert "MP" in core or "Sync" in core, core  # really a separate engine-core process
        yield {"harness": Harness(llm), "first": True}
    finally:
        close_llm(llm)



def test_worker_process_hits_and_abort(h):
    rng = random.Random(21)
    donor = rand_tokens(rng, 130)
    h.generate([donor], max_tokens=3)
    outs = h.generate([donor[:96] + rand_tokens(rng, 30), donor + rand_tokens(rng, 12),
                       rand_tokens(rng, 40)], max_tokens=3)
    h.add("x", donor[:64] + rand_tokens(rng, 100), max_tokens=20)
    h.step()
    h.llm.llm_engine.abort_request(["x"])
    h.drain()
    stats = h.rpc("omnishm_stats")
    # (No same-step assertion here: the engine-core process may start a step before all requests arrive.)
    assert stats["cache"] == os.environ["OMNISHM_CACHE"]  # auto-installed from the env in the worker process
    h.check(expect_hit=[outs[0].request_id, outs[1].request_id, "x"],
            expect_cached={outs[0].request_id: 96, outs[1].request_id: 128, outs[2].request_id: 0, "x": 64})


def test_worker_process_reinstall_and_block_reuse(h):
    rng = random.Random(22)
    hit_ids = []
    for _ in range(6):
        base = rand_tokens(rng, 160)
        h.generate([base], max_tokens=2)
        outs = h.generate([base[:150] + rand_tokens(rng, 20), base[:100] + rand_tokens(rng, 60)], max_tokens=2)
        hit_ids += [o.request_id for o in outs]
    stats = h.rpc("omnishm_stats")
    assert stats["rows_saved"] > stats["num_slots"], stats
    h.check(expect_hit=hit_ids)
