"""vllm-omni's own runner glue on omnishm: real vLLM scheduler outputs, vllm-omni's ``PrefixCacheRunnerMixin``.

Two runners built on vllm-omni 0.30.0's ``PrefixCacheRunnerMixin`` run the same steps of a real vLLM
``Scheduler`` (shared prefixes, chunked prefill, aborts, preemption and V1 resumes, freed blocks
reused): one builds vllm-omni's in-process cache, the other, after ``omnishm.integrations.vllm_omni.install()``
(what ``OMNISHM_VLLM_OMNI=1`` does), the drop-in over an autostarted committer; that runner is replica 1 of a
dense model under vLLM data parallelism, so its cache is ``<name>-dp1``. Each step's
``_prefix_cache_materialize`` must return the same hidden states and the same multimodal payload,
leftover values included (a 1-D per-token tensor, a per-request list, a tensor of another length,
a nested dict), which vllm-omni cuts per request with its ``to_payload_element`` (it imports vllm).
vllm-omni is installed without its dependencies (``run_tier.sh``).
"""

from __future__ import annotations

import importlib
import os
import random
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

import torch  # noqa: E402

from test_scheduler_tier import BLOCK, HIDDEN, NUM_BLOCKS, FakeRunner, _kv_cache_config, engine_config  # noqa: E402
from vllm_tier import TIER_COUNTS, unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


def _runner_class() -> type:
    from omnishm.integrations.vllm_omni import load_prefix_cache

    load_prefix_cache(standin=True)
    mixin = importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")

    class Runner(mixin.PrefixCacheRunnerMixin):
        is_pooling_model = False

        def __init__(self, cfg: Any, kv_cache_config: Any, input_batch: Any) -> None:
            self.input_batch = input_batch
            self.kv_cache_config = kv_cache_config
            self._omni_prefix_cache_cfg = cfg

    return Runner


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a.shape} vs {b.shape}"
    elif isinstance(a, (dict, list, tuple)) or isinstance(b, (dict, list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.120} vs {b!r:.120}"
        for k in (a if isinstance(a, dict) else range(len(a))):
            _same(a[k], b[k], f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    return engine_config(tiny_model_dir)


def test_vllm_omni_runner_on_omnishm_matches_its_own_cache(vllm_config, monkeypatch):
    from vllm import SamplingParams
    from vllm.distributed import parallel_state
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from omnishm.integrations.vllm_omni import SUPPORTED, VllmOmniPrefixCacheManager, install, load_prefix_cache

    vo, version = load_prefix_cache(standin=True)
    assert version == SUPPORTED, f"this test compares against vllm-omni {SUPPORTED}, found {version}"
    mixin = importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")
    original = mixin.OmniPrefixCacheManager
    monkeypatch.setattr(mixin, "OmniPrefixCacheManager", original)  # restored after the test
    monkeypatch.setattr(mixin.PrefixCacheRunnerMixin, "_ensure_omni_prefix_cache",
                        mixin.PrefixCacheRunnerMixin._ensure_omni_prefix_cache)  # install() wraps it
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    monkeypatch.setenv("OMNISHM_NAME", unique_cache_name("vo"))

    kv_cfg = _kv_cache_config(NUM_BLOCKS)
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    scheduler = Scheduler(vllm_config, kv_cfg, StructuredOutputManager(vllm_config), block_size=BLOCK)
    cfg = vo.PrefixCacheConfig.from_vllm_config(num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                                scheduler_config=vllm_config.scheduler_config,
                                                model_config=vllm_config.model_config)
    Runner = _runner_class()
    fake = FakeRunner(max_blocks=512 // BLOCK)  # one batch, as vLLM's _update_states keeps it, read by both
    theirs = Runner(cfg, kv_cfg, fake.batch)
    ours = Runner(cfg, kv_cfg, fake.batch)
    # The drop-in's runner is replica 1 of a dense model under vLLM DP: an independent engine of DP size 1
    # (vLLM's own reconfiguration), whose cache must be <name>-dp1, not its replica 0's.
    from vllm.config import ParallelConfig

    ours.parallel_config = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    ours.parallel_config.reconfigure_for_independent_dp_rank()
    assert ours.parallel_config.data_parallel_size == 1 and ours.parallel_config.data_parallel_index == 1
    # The engine's real configs, which the drop-in runs omnishm's gate on (stage_prefix_cache_config).
    for name in ("cache_config", "scheduler_config", "model_config", "kv_transfer_config", "speculative_config"):
        setattr(ours, name, getattr(vllm_config, name))
    from omnishm.integrations import vllm_omni as dropin

    gated = []
    gate = dropin.stage_prefix_cache_config
    monkeypatch.setattr(dropin, "stage_prefix_cache_config", lambda **kw: gated.append(gate(**kw)) or gated[-1])

    rng = random.Random(3)
    families = [[rng.randrange(4, 1000) for _ in range(rng.randrange(70, 200))] for _ in range(5)]
    tokens = fake.tokens
    counts = {"steps": 0, "rows": 0, "hit_rows": 0, "aborted": 0, "preempted": 0, "resumed": 0}
    next_id = 0
    try:
        for step_no in range(220):
            if step_no < 170 and (rng.random() < 0.35 or not scheduler.requests):
                fam = rng.choice(families)
                prompt = fam[:rng.randrange(1, len(fam) + 1)] + [rng.randrange(4, 1000) for _ in range(rng.randrange(1, 40))]
                rid = f"r{next_id}"
                next_id += 1
                scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=rng.choice([1, 2, 5, 40]),
                                                                          ignore_eos=True), None, block_hasher=hasher))
                tokens[rid] = list(prompt)
            if scheduler.requests and rng.random() < 0.05:
                scheduler.finish_requests(rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED)
                counts["aborted"] += 1
            so = scheduler.schedule()
            counts["preempted"] += len(so.preempted_req_ids or ())
            counts["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
            n = so.total_num_scheduled_tokens
            if step_no == 0:
                install()  # the second runner builds its cache now: the drop-in
                ours._prefix_cache_step_begin(so)
                mixin.OmniPrefixCacheManager = original
                theirs._prefix_cache_step_begin(so)
                assert isinstance(ours.omni_prefix_cache, VllmOmniPrefixCacheManager)
                assert ours.omni_prefix_cache._ours is not None  # slots from omnishm's view of the same batch
                assert ours.omni_prefix_cache._m.cache == os.environ["OMNISHM_NAME"] + "-dp1"
                assert isinstance(theirs.omni_prefix_cache, original)
            else:
                ours._prefix_cache_step_begin(so)
                theirs._prefix_cache_step_begin(so)
            fake.update_states(so)
            sampled: dict[str, list[int]] = {}
            if n:
                padded = n + 3  # as a CUDA-graph batch is padded
                hidden = torch.cat([fake.forward(so), torch.zeros(3, HIDDEN)])
                pos = torch.cat([torch.arange(fake.computed[r], fake.computed[r] + so.num_scheduled_tokens[r])
                                 for r in fake.batch.req_ids])
                mm = {"codes": {"audio": pos.to(torch.float32)},  # 1-D per-token: leftover, cut per request
                      "feat": hidden[:, :4] * 2,  # 2-D per-token (padded): cached, merged with hits
                      "speaker": [torch.full((2,), float(i)) for i in range(len(fake.batch.req_ids))],
                      "meta": {"scale": torch.tensor([float(step_no)])}}
                sids = [r._prefix_cache_save_step(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded)
                        for r in (ours, theirs)]
                req_ids = list(fake.batch.req_ids)
                if step_no % 7 == 3:
                    ours.omni_prefix_cache.discard_step(sids[0])
                    theirs.omni_prefix_cache.discard_step(sids[1])
                else:
                    got = ours._prefix_cache_materialize(sids[0], req_ids)
                    want = theirs._prefix_cache_materialize(sids[1], req_ids)
                    _same(got, want, f"step {step_no}")
                    for r in req_ids:
                        counts["rows"] += int(got[0][r].shape[0])
                        counts["hit_rows"] += int(got[0][r].shape[0]) - so.num_scheduled_tokens[r]
                for r in fake.batch.req_ids:
                    if fake.computed[r] + so.num_scheduled_tokens[r] >= len(tokens[r]):
                        sampled[r] = [(sum(tokens[r][-3:]) * 7 + len(tokens[r])) % 996 + 4]
            ids = list(fake.batch.req_ids) if n else []
            scheduler.update_from_output(so, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled.get(r, []) for r in ids]))
            for rid, toks in sampled.items():
                if rid in scheduler.requests:
                    tokens[rid].extend(toks)
            counts["steps"] += 1
        # The drop-in's writer compared the hits' prompt rows too (omnishm's view of the same batch tags them).
        counts["token_checked_rows"] = int(ours.omni_prefix_cache._m.counters["token_checked_rows"])
        assert ours.omni_prefix_cache._m.counters["token_mismatches"] == 0
    finally:
        for r in (ours, theirs):
            if r.omni_prefix_cache is not None:
                r.omni_prefix_cache.shutdown()
    TIER_COUNTS["scheduler_rows"] += counts["rows"]
    TIER_COUNTS["scheduler_steps"] += counts["steps"]
    print(f"vllm-omni runner on omnishm: {counts}")
    assert counts["hit_rows"] > 300 and counts["aborted"] > 0 and counts["preempted"] > 0, counts
    assert counts["token_checked_rows"] > 300, counts
    assert counts["resumed"] > 0, counts  # V1 resumes reached both caches (neither counts them as hits)
    assert len(gated) == 1 and gated[0] is not None  # the drop-in passed omnishm's gate on the real configs
