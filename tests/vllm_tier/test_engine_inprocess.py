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
    assert stats["kv_init_gated"] == 1, stats  # the gate ran at vLLM's KV-cache init (the seed's rule)
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


def test_preempted_requests_resume_and_hit_again(h):
    """REVIEW (2026-12-04): six long decodes that share a prefix outgrow the 24 blocks, so vLLM preempts
    some and schedules them again later (V1: ``resumed_req_ids``, with a prefix hit on what is still
    cached). Every request's prompt rows must still be its own, bit for bit."""
    rng = random.Random(7)
    base = rand_tokens(rng, 64)
    prompts = [base + rand_tokens(rng, 40 + 5 * i) for i in range(6)]
    outs = h.generate(prompts, max_tokens=120)
    stats = h.rpc("omnishm_stats")
    # Rows computed twice (a preempted request recomputes what it lost) and more hit rows served than
    # the five first-time hits on the shared prefix: resumed requests hit again.
    computed_once = sum(len(p) for p in prompts) - 5 * 64 + 6 * 119
    assert stats["rows_saved"] > computed_once, stats
    assert stats["manager"]["hit_tokens"] > 5 * 64, stats
    h.check(expect_hit=[o.request_id for o in outs[1:]])


def test_batch_reordering_keeps_every_row_with_its_request(h, monkeypatch):
    """REVIEW (2026-12-04): vLLM moves decodes ahead of prefills in the batch (``swap_states``) where the
    attention backend asks for it (``reorder_batch_threshold``: MLA and FlashInfer on GPU); the CPU backend
    never does, so nothing here ran it. Forced on, with long prefills chunked at 32 tokens: a request that
    turned to decoding behind a chunked prefill is swapped ahead of it, and the hooks must follow the
    batch's new order (the write layout and the hidden rows both come from it)."""
    core = h.llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    monkeypatch.setattr(runner, "reorder_batch_threshold", 1)
    monkeypatch.setattr(core.scheduler, "adaptive_long_prefill_threshold", False)
    monkeypatch.setattr(core.scheduler.scheduler_config, "long_prefill_token_threshold", 32)
    batch_type = type(runner.input_batch)
    swaps = []
    swap_states = batch_type.swap_states

    def counted(batch, i1, i2):
        swaps.append((i1, i2))
        return swap_states(batch, i1, i2)

    monkeypatch.setattr(batch_type, "swap_states", counted)
    rng = random.Random(21)
    base = rand_tokens(rng, 64)
    h.add("d0", rand_tokens(rng, 40), max_tokens=30)
    h.step()
    h.step()  # d0 decodes
    h.add("p1", base + rand_tokens(rng, 200), max_tokens=3)  # chunked, 32 tokens a step
    h.step()
    h.add("d1", rand_tokens(rng, 20), max_tokens=30)  # prefilled in one step, then decodes behind p1
    for _ in range(3):
        h.step()
    h.add("p2", base + rand_tokens(rng, 70), max_tokens=3)  # hits p1's first two blocks
    h.drain()
    assert swaps, "vLLM never reordered the batch"
    h.check(expect_hit=["p2"], expect_cached={"p2": 2 * BLOCK})
