"""``stage_prefix_cache_config`` against real vLLM config objects (no engine, no model load)."""

from __future__ import annotations

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

import torch  # noqa: E402

from omnishm.client.group_view import PrefixCacheConfigError, stage_prefix_cache_config  # noqa: E402

pytestmark = [pytest.mark.vllm]

BLOCK = 32


def _spec(kind: str, block_size: int = BLOCK):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if kind == "full":
        return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=64)


def _kv(*kinds: str, num_blocks: int = 16, block_size: int = BLOCK):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], _spec(k, block_size)) for i, k in enumerate(kinds)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _gate(*, kv=None, cache=None, transfer=None, sched=None, pooling=False):
    from vllm.config import CacheConfig, SchedulerConfig

    cache = cache if cache is not None else CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    sched = sched if sched is not None else SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4,
                                                            max_model_len=512, is_encoder_decoder=False)
    return stage_prefix_cache_config(kv_cache_config=kv if kv is not None else _kv("full"), cache_config=cache,
                                     kv_transfer_config=transfer, scheduler_config=sched, model_config=None,
                                     is_pooling_model=pooling)


def test_full_attention_passes_and_sizes_from_the_scheduler():
    cfg = _gate()
    assert cfg is not None
    assert (cfg.num_blocks, cfg.block_size, cfg.staging_capacity_tokens) == (16, BLOCK, 256)


def test_prefix_caching_off_or_pooling_gives_none():
    from vllm.config import CacheConfig

    assert _gate(cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=False)) is None
    assert _gate(pooling=True) is None


def test_sliding_window_group_refused():
    with pytest.raises(PrefixCacheConfigError, match="full attention"):
        _gate(kv=_kv("sliding"))


def test_hybrid_two_groups_refused():
    with pytest.raises(PrefixCacheConfigError, match="exactly one KV-cache group"):
        _gate(kv=_kv("full", "sliding"))


def test_block_size_mismatch_refused():
    with pytest.raises(PrefixCacheConfigError, match="block size"):
        _gate(kv=_kv("full", block_size=2 * BLOCK))


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_kv_consumer_refused(role):
    from vllm.config import KVTransferConfig

    with pytest.raises(PrefixCacheConfigError, match="kv_role"):
        _gate(transfer=KVTransferConfig(kv_connector="ExampleConnector", kv_role=role))


def test_kv_producer_allowed():
    from vllm.config import KVTransferConfig

    assert _gate(transfer=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer")) is not None


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_scheduling_refused_fcfs_passes(policy):
    """REVIEW (2026-12-07, stop 54): vLLM's priority scheduler may preempt a request it already scheduled in the
    step, leaving its new blocks in the prefix cache with nothing computed for them; the request's resume hit
    them and omnishm served an earlier request's rows. The gate reads the policy off vLLM's own config."""
    from vllm.config import SchedulerConfig

    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512,
                            is_encoder_decoder=False, policy=policy)
    if policy == "fcfs":
        assert _gate(sched=sched) is not None
    else:
        with pytest.raises(PrefixCacheConfigError, match="--scheduling-policy fcfs"):
            _gate(sched=sched)
