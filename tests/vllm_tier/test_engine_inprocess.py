"""A real vLLM v1 engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the omnishm hooks.

Every request's full-prompt hidden states from omnishm (cached prefix rows +
computed rows) must equal, bit for bit, the same prompt run with the prefix
cache reset. One engine per module; each test gets fresh hooks on a fresh cache.
"""

from __future__ import annotations

import random

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_harness import BLOCK, Harness, close_llm, make_llm, rand_tokens  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = make_llm(tiny_model_dir, multiprocess=False, cache=unique_cache_name("auto"),
                   num_gpu_blocks_override=NUM_BLOCKS)
    state = {"harness": Harness(llm), "first": True}
    try:
        yield state
    finally:
        close_llm(llm)



def test_prefix_hits_full_partial_and_batched(h):
    rng = random.Random(1)
    donor = rand_tokens(rng, 100)  # 3 full blocks + 4 tokens
    h.generate([donor], max_tokens=2)
    a = donor[:96] + rand_tokens(rng, 40)  # shared prefix ends on a block boundary
    b = donor + rand_tokens(rng, 40)  # shared prefix (100) ends inside block 3: only 96 hit
    c = donor[:70] + rand_tokens(rng, 30)  # shared prefix ends inside block 2: 64 hit
    e = rand_tokens(rng, 50)  # no hit, same step
    outs = h.generate([a, b, c, e], max_tokens=4)  # scheduled together: three hits in one step
    ids = [o.request_id for o in outs]
    f = b[:128] + rand_tokens(rng, 10)  # hits a block b computed on top of its own hit
    (of,) = h.generate([f], max_tokens=1)
    stats = h.rpc("omnishm_stats")
    assert stats["max_hit_requests_per_step"] >= 2, stats
    h.check(expect_hit=[*ids[:3], of.request_id],
            expect_cached={ids[0]: 96, ids[1]: 96, ids[2]: 64, ids[3]: 0, of.request_id: 128})


def test_aborts_and_early_finish(h):
    rng = random.Random(2)
    x = rand_tokens(rng, 200)
    h.add("x", x, max_tokens=50)
    h.step()  # prefill (200 tokens fit the 512 budget) + first token
    h.add("w", rand_tokens(rng, 64), max_tokens=5)
    h.llm.llm_engine.abort_request(["x", "w"])  # x aborted while decoding, w before it was ever scheduled
    h.drain()
    y = x[:192] + rand_tokens(rng, 20)  # hits the aborted request's blocks
    z = x[:40] + rand_tokens(rng, 5)  # one block, finished after one token
    outs = h.generate([y, z], max_tokens=1)
    h.check(expect_hit=[o.request_id for o in outs], expect_missing=["w"],
            expect_cached={outs[0].request_id: 192, outs[1].request_id: BLOCK})


def test_freed_blocks_are_reused(h):
    rng = random.Random(3)
    bases: list[list[int]] = []
    hit_ids: list[str] = []
    for rnd in range(9):
        base = rand_tokens(rng, 150)
        bases.append(base)
        h.generate([base], max_tokens=2)
        outs = h.generate([base[:128] + rand_tokens(rng, 30), base + rand_tokens(rng, 40)], max_tokens=2)
        hit_ids += [o.request_id for o in outs]
        if rnd % 3 == 2:  # an older family whose blocks may have been evicted and re-tenanted by now
            h.generate([bases[rnd - 2] + rand_tokens(rng, 10)], max_tokens=1)
    stats = h.rpc("omnishm_stats")
    # More rows written than the pool has slots: vLLM handed freed blocks to new tenants.
    assert stats["rows_saved"] > stats["num_slots"] == NUM_BLOCKS * BLOCK, stats
    h.check(expect_hit=hit_ids)
