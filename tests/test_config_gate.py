"""Config gate: which stages may run an omni prefix cache, and how it is sized.

Every refusal is a ``PrefixCacheConfigError`` (a ``ValueError``) whose message
says what to disable. Spec classes are fakes named like vLLM 0.32's
(``vllm.v1.kv_cache_interface``); real-config tests live in the vLLM tier.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnishm.client.group_view import (
    PrefixCacheConfigError,
    check_prefix_cache_block_layout,
    check_prefix_cache_kv_groups,
    check_prefix_cache_kv_transfer,
    stage_prefix_cache_config,
)
from omnishm.interface import PrefixCacheConfig

DISABLE = "disable the omni prefix cache"


# fakes named like vLLM's spec classes (the duck-typed path classifies by class name / MRO)
class KVCacheSpec:
    def __init__(self, block_size=32, **kw):
        self.block_size = block_size
        self.__dict__.update(kw)


class AttentionSpec(KVCacheSpec):
    pass


class FullAttentionSpec(AttentionSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class RSWASpec(FullAttentionSpec):
    pass


class SinkFullAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    pass


class ChunkedLocalAttentionSpec(AttentionSpec):
    pass


class MambaSpec(KVCacheSpec):
    pass


class CrossAttentionSpec(AttentionSpec):
    pass


class UniformTypeKVCacheSpecs(KVCacheSpec):
    pass


def group(spec, **kw):
    return SimpleNamespace(layer_names=["model.layers.0.attn"], kv_cache_spec=spec, **kw)


def kv_config(*specs, num_blocks=64, **kw):
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group(s) for s in specs], kv_cache_tensors=[],
                           hash_block_size=kw.pop("hash_block_size", None),
                           cache_hit_alignment_tokens=kw.pop("cache_hit_alignment_tokens", None), **kw)


def gate_kwargs(**over):
    kw = dict(
        kv_cache_config=kv_config(FullAttentionSpec(32)),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=32, prefix_match_unit=None,
                                     mamba_cache_mode="none", hash_block_size=None,
                                     cache_hit_alignment_tokens=None),
        kv_transfer_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=8),
        model_config=SimpleNamespace(max_model_len=512),
        is_pooling_model=False,
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                        tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    kw.update(over)
    return kw


def with_cache(**attrs):
    cc = gate_kwargs()["cache_config"]
    cc.__dict__.update(attrs)
    return cc


def test_enabled_full_attention_stage_is_sized_from_the_scheduler():
    cfg = stage_prefix_cache_config(**gate_kwargs())
    assert isinstance(cfg, PrefixCacheConfig)
    assert (cfg.num_blocks, cfg.block_size, cfg.staging_capacity_tokens) == (64, 32, 2048)
    assert cfg.num_slots == 64 * 32


def test_sizing_falls_back_to_max_model_len_and_num_blocks_override():
    cfg = stage_prefix_cache_config(**gate_kwargs(scheduler_config=SimpleNamespace(max_num_batched_tokens=None)))
    assert cfg.staging_capacity_tokens == 512
    cfg = stage_prefix_cache_config(**gate_kwargs(scheduler_config=None), num_blocks=10)
    assert (cfg.num_blocks, cfg.staging_capacity_tokens) == (10, 512)
    cfg = stage_prefix_cache_config(**gate_kwargs(parallel_config=None, speculative_config=None))
    assert cfg.num_blocks == 64
    fcfs = SimpleNamespace(max_num_batched_tokens=2048, policy="fcfs")  # vLLM's default policy passes
    assert stage_prefix_cache_config(**gate_kwargs(scheduler_config=fcfs)).staging_capacity_tokens == 2048


def test_off_or_pooling_gives_none_before_any_refusal():
    off = SimpleNamespace(enable_prefix_caching=False, block_size=32)
    broken = dict(kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
                  speculative_config=SimpleNamespace(method="eagle"),
                  kv_cache_config=kv_config(FullAttentionSpec(32), SlidingWindowSpec(32)))
    assert stage_prefix_cache_config(**gate_kwargs(cache_config=off, **broken)) is None
    assert stage_prefix_cache_config(**gate_kwargs(is_pooling_model=True, **broken)) is None
    assert stage_prefix_cache_config(**gate_kwargs(cache_config=None)) is None


REFUSALS = [
    ("kv_consumer", dict(kv_transfer_config=SimpleNamespace(kv_role="kv_consumer", kv_connector="X")),
     "kv_producer"),
    ("kv_both", dict(kv_transfer_config=SimpleNamespace(kv_role="kv_both", kv_connector="X")), "kv_producer"),
    ("is_kv_consumer", dict(kv_transfer_config=SimpleNamespace(kv_role=None, is_kv_consumer=True)),
     "--kv-transfer-config"),
    ("speculative", dict(speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=3)),
     "--speculative-config"),
    # REVIEW (2026-12-07, stop 54): a request preempted in the step that scheduled it left blocks vLLM cached
    # with nothing computed for them; its resume hit them and was served an earlier request's rows.
    ("priority", dict(scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, policy="priority")),
     "--scheduling-policy fcfs"),
    ("priority_enum", dict(scheduler_config=SimpleNamespace(policy=SimpleNamespace(value="priority"))),
     "scheduling_policy='priority'"),
    ("kv_sharing_fast_prefill", dict(cache_config=with_cache(kv_sharing_fast_prefill=True)),
     "--kv-sharing-fast-prefill"),
    ("dcp", dict(parallel_config=SimpleNamespace(decode_context_parallel_size=2)),
     "--decode-context-parallel-size 1"),
    ("pcp", dict(parallel_config=SimpleNamespace(prefill_context_parallel_size=2)),
     "--prefill-context-parallel-size 1"),
    ("prefix_match_unit", dict(cache_config=with_cache(prefix_match_unit=16)), "--prefix-match-unit"),
    ("hash_block_size", dict(kv_cache_config=kv_config(FullAttentionSpec(32), hash_block_size=16)),
     "--prefix-match-unit"),
    ("hit_alignment", dict(kv_cache_config=kv_config(FullAttentionSpec(32), cache_hit_alignment_tokens=8)),
     "--prefix-match-unit"),
    ("mamba_align", dict(cache_config=with_cache(mamba_cache_mode="align")), "--mamba-cache-mode none"),
    ("two_groups", dict(kv_cache_config=kv_config(FullAttentionSpec(32), FullAttentionSpec(32))),
     "--disable-hybrid-kv-cache-manager"),
    ("hybrid", dict(kv_cache_config=kv_config(FullAttentionSpec(32), MambaSpec(32))),
     "--disable-hybrid-kv-cache-manager"),
    ("no_group", dict(kv_cache_config=kv_config()), "exactly one KV-cache group"),
    ("sliding_window", dict(kv_cache_config=kv_config(SlidingWindowSpec(32, sliding_window=128))),
     "full attention"),
    ("chunked_local", dict(kv_cache_config=kv_config(ChunkedLocalAttentionSpec(32))), "full attention"),
    ("mamba", dict(kv_cache_config=kv_config(MambaSpec(32))), "full attention"),
    ("cross", dict(kv_cache_config=kv_config(CrossAttentionSpec(32))), "full attention"),
    ("rswa", dict(kv_cache_config=kv_config(RSWASpec(32))), "full attention"),
    ("sink", dict(kv_cache_config=kv_config(SinkFullAttentionSpec(32))), "full attention"),
    ("non_causal", dict(kv_cache_config=kv_config(FullAttentionSpec(32, non_causal=True))), "non-causal"),
    ("unknown_spec", dict(kv_cache_config=kv_config(KVCacheSpec(32))), "full attention"),
    ("uniform_with_swa", dict(kv_cache_config=kv_config(UniformTypeKVCacheSpecs(32, kv_cache_specs={
        "a": FullAttentionSpec(32), "b": SlidingWindowSpec(32)}))), "full attention"),
    ("block_mismatch", dict(kv_cache_config=kv_config(FullAttentionSpec(64))), "--block-size"),
    ("no_block_size", dict(cache_config=with_cache(block_size=None)), "block size"),
    ("no_num_blocks", dict(kv_cache_config=kv_config(FullAttentionSpec(32), num_blocks=None)), "num_blocks"),
]


@pytest.mark.parametrize("name, over, hint", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_says_what_to_disable(name, over, hint):
    with pytest.raises(PrefixCacheConfigError) as info:
        stage_prefix_cache_config(**gate_kwargs(**over))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert hint in msg, msg
    assert DISABLE in msg, msg


def test_accepted_full_attention_variants():
    for spec in (FullAttentionSpec(32), MLAAttentionSpec(32), FullAttentionSpec(32, sliding_window=None),
                 UniformTypeKVCacheSpecs(32, kv_cache_specs={"a": FullAttentionSpec(32),
                                                             "b": MLAAttentionSpec(32)})):
        assert stage_prefix_cache_config(**gate_kwargs(kv_cache_config=kv_config(spec))) is not None
    # a coarser-than-block alignment is not sub-block
    assert stage_prefix_cache_config(**gate_kwargs(kv_cache_config=kv_config(
        FullAttentionSpec(32), hash_block_size=32, cache_hit_alignment_tokens=32))) is not None


def test_kv_transfer_producer_and_none_pass():
    check_prefix_cache_kv_transfer(None)
    check_prefix_cache_kv_transfer(SimpleNamespace(kv_role="kv_producer", kv_connector="X", is_kv_consumer=False))
    cfg = stage_prefix_cache_config(**gate_kwargs(kv_transfer_config=SimpleNamespace(kv_role="kv_producer")))
    assert cfg is not None


def test_individual_checks_accept_groups_or_config():
    cfg = kv_config(FullAttentionSpec(32))
    check_prefix_cache_kv_groups(cfg)
    check_prefix_cache_kv_groups(cfg.kv_cache_groups)
    check_prefix_cache_block_layout(32, cfg)
    check_prefix_cache_block_layout(32, cfg.kv_cache_groups)
    with pytest.raises(PrefixCacheConfigError, match="--block-size"):
        check_prefix_cache_block_layout(64, cfg)
    with pytest.raises(PrefixCacheConfigError, match="HiSparse"):
        check_prefix_cache_kv_groups([group(FullAttentionSpec(32), role=SimpleNamespace(value="hisparse_source"))])
    check_prefix_cache_kv_groups([group(FullAttentionSpec(32), role=SimpleNamespace(value="default"))])
    with pytest.raises(PrefixCacheConfigError, match="kv_cache_groups"):
        check_prefix_cache_kv_groups(None)


def test_the_staging_bound_is_judged_on_the_final_config_not_on_the_derived_capacity_alone(monkeypatch):
    """REVIEW (2026-12-07, stop 54): the gate built a config from the engine's capacity with the default depth
    first, so a capacity that ``OMNISHM_STAGING_DEPTH=1`` makes legal was refused with a bare ValueError; and a
    refusal said a value derived from the engine came "from default"."""
    from omnishm.config import ConfigError
    from omnishm.interface import MAX_STAGING_ROWS

    big = SimpleNamespace(max_num_batched_tokens=MAX_STAGING_ROWS // 4, max_num_seqs=8)  # 5 pages: over
    monkeypatch.setenv("OMNISHM_STAGING_DEPTH", "1")
    cfg = stage_prefix_cache_config(**gate_kwargs(scheduler_config=big))
    assert (cfg.staging_depth, cfg.staging_capacity_tokens) == (1, MAX_STAGING_ROWS // 4)
    monkeypatch.delenv("OMNISHM_STAGING_DEPTH")
    with pytest.raises(ConfigError) as exc:
        stage_prefix_cache_config(**gate_kwargs(scheduler_config=big))
    assert "staging_capacity_tokens from derived from the engine" in str(exc.value), exc.value
