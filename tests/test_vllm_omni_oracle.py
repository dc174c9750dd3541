"""vllm-omni's own in-process prefix cache as an oracle: the same steps into both, the same rows out.

vllm-omni 0.30.0 is the cache omnishm replaces. ``scripts/install.sh`` installs it without its
dependencies: only its prefix-cache package is loaded (``omnishm.bench.vllm_omni_arm``), which imports
no vllm. A simulated engine (shared system prompts, conversation turns, hits on blocks another request
computes in the same step, chunked prefill, aborts, LRU reuse of freed blocks) drives omnishm's manager,
served by a real committer process, and vllm-omni's manager, step by step. Every materialize of the two
must return the same tensors, and both the simulation's ground truth.

Preemption is left out: vllm-omni does not restore the prefix of a resumed request (its
``new_step_starts`` skips ids it still has live), where omnishm does (docs/CLIENT.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from omnishm.bench.vllm_omni_arm import VllmOmniOwnCache, same_results
from omnishm.client import ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.sim import SimEngine

STEPS = 300


@pytest.mark.parametrize("deferred", [False, True], ids=["join-next-step", "mm-deferred"])
def test_every_step_serves_the_rows_vllm_omni_serves(committer_factory, deferred):
    """``deferred``: the multimodal key is written when its request ends (JOIN_ON_FINISH), as talkers do."""
    bs, cap, blocks = 16, 96, 400  # live requests need at most 8 x 19 blocks: nothing is preempted
    cfg = PrefixCacheConfig(num_blocks=blocks, block_size=bs, staging_capacity_tokens=cap, staging_depth=2,
                            staging_claim_timeout_s=10.0, commit_timeout_s=10.0)
    eng = SimEngine(num_blocks=blocks, block_size=bs, max_batched_tokens=cap, width=32, mm_width=4, seed=24,
                    abort_rate=0.1)
    theirs = VllmOmniOwnCache(num_blocks=blocks, block_size=bs, staging_capacity_tokens=cap, staging_depth=2)
    committer = committer_factory()
    stats: Counter = Counter()
    try:
        with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as ours:
            if deferred:
                ours.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feat"})))
                theirs.m.register_policy(type(theirs.m._policy)(deferred_keys=frozenset({"mm_feat"})))
            for _ in range(STEPS):
                eng.top_up(3)
                st = eng.schedule()
                kinds = Counter(ev.kind for ev in st.step.events)
                assert kinds[K.RESUMED] == 0, "the workload preempted a request: give it more blocks"
                stats["aborts"] += kinds[K.ABORTED]
                sid = st.run(ours)
                theirs.new_step_starts(st.step)
                their_sid = theirs.save_outputs(st.hidden, st.mm, num_tokens_unpadded=st.num_tokens,
                                                num_tokens_padded=st.num_tokens, write_layout=st.layout)
                reqs = list(st.layout.req_ids)
                got, want = ours.materialize(sid, reqs), theirs.materialize(their_sid, reqs)
                same_results(got, want, reqs, f"step {sid}")
                for r in reqs:
                    hit = st.positions[r][0]
                    assert got.num_hit_tokens[r] == hit
                    assert torch.equal(got.hidden_states[r], eng.expected(st, r)), (sid, r, st.positions[r])
                    assert torch.equal(got.mm_outputs[r]["mm_feat"], eng.expected(st, r, salt=0x5A5A, width=4))
                    stats["rows"] += got.hidden_states[r].shape[0]
                    stats["hit_tokens"] += hit
                eng.advance(st)
    finally:
        theirs.shutdown()
    print(f"\nvllm-omni oracle: {stats['rows']} rows per key equal, {stats['hit_tokens']} of them hits, "
          f"{eng.same_step_hits} same-step hits, {stats['aborts']} aborts, {eng.alloc.reuses} block reuses")
    # Seeds 1-40 all agree (2026-12-02: 2.1 M rows per key); this one has the most same-step hits.
    assert stats["rows"] > 10_000 and stats["hit_tokens"] > 2_000
    assert eng.same_step_hits > 0 and stats["aborts"] > 0 and eng.alloc.reuses > 100
