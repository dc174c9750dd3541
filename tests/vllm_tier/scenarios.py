"""Engine scenarios shared by the tier's V1 runner tests (test_engine_inprocess.py) and its V2 runner run
(v2_engine_run.py, a child process): each drives a ``Harness`` and ends in ``Harness.check`` (every completed
request's full-prompt rows equal to a no-hit run's, bit for bit), whose counts it returns."""

from __future__ import annotations

import random

from vllm_harness import BLOCK, Harness, rand_tokens


def prefix_hits_full_partial_and_batched(h: Harness) -> dict:
    """Full, partial and batched hits, three in one step; a hit on a block computed on top of a hit. The
    module's first scenario: its hooks are the ones the extension installed, which ran vLLM's KV-cache init."""
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
    return h.check(expect_hit=[*ids[:3], of.request_id],
                   expect_cached={ids[0]: 96, ids[1]: 96, ids[2]: 64, ids[3]: 0, of.request_id: 128})


def aborts_and_early_finish(h: Harness) -> dict:
    """A request aborted while decoding and one before it was ever scheduled; hits on the aborted one's blocks."""
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
    return h.check(expect_hit=[o.request_id for o in outs], expect_missing=["w"],
                   expect_cached={outs[0].request_id: 192, outs[1].request_id: BLOCK})


def preempted_requests_resume_and_hit_again(h: Harness) -> dict:
    """REVIEW (2026-12-04): six long decodes that share a prefix outgrow the 24 blocks, so vLLM preempts
    some and schedules them again later (V1: ``resumed_req_ids``, with a prefix hit on what is still
    cached; V2: re-sent as new). Every request's prompt rows must still be its own, bit for bit, and held
    once (stop 47: a V2 resume as new held a completed prompt again)."""
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
    assert stats["requests"] == len(prompts), stats
    return h.check(expect_hit=[o.request_id for o in outs[1:]])
