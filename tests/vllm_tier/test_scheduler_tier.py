"""Middle tier: a real vLLM ``Scheduler`` + ``KVCacheManager`` with no model, driving omnishm.

Real ``SchedulerOutput`` objects from many steps (shared prefixes, chunked
prefill, decode, finished and aborted requests, preemption, freed blocks
reused) go through ``PrefixCacheSchedulerAdapter.translate_scheduler_output``
and an ``OmniPrefixCacheManager`` on a real (autostarted) committer. A fake
runner mirrors vLLM's ``_update_states`` (block tables, num_computed_tokens)
and produces a deterministic "hidden state" per position that depends on the
whole token prefix up to it, so the ground truth of every row is known and a
row served from the wrong tenant cannot pass. Every materialized row is checked.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

import torch  # noqa: E402

from omnishm.bench.vllm_omni_arm import BlockTables  # noqa: E402
from vllm_tier import TIER_COUNTS, unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

BLOCK = 32
HIDDEN = 16
NUM_BLOCKS = 12
MAX_SEQS = 4
BUDGET = 64
_AR = torch.arange(HIDDEN, dtype=torch.int64)


def prefix_rows(tokens: list[int]) -> torch.Tensor:
    """Fake hidden states [len(tokens), HIDDEN]: row p is a function of tokens[:p+1] only."""
    out = torch.empty((len(tokens), HIDDEN), dtype=torch.float32)
    h = 0
    for p, tok in enumerate(tokens):
        h = (h * 1_000_003 + tok + 1) % ((1 << 61) - 1)
        a = ((h & 0xFFFFFFFF) ^ (_AR * 40503)) & 0x7FFFFFFF
        out[p] = ((a * 1103515245 + 12345) & 0x7FFFFFFF).to(torch.float32) / float(1 << 31)
    return out


class FakeBatch:
    """Duck-typed InputBatch for the group views (omnishm's and vllm-omni's): req_ids and their index,
    computed counts, CPU block table, and the CPU token ids and prompt lengths that omnishm's view tags prompt
    rows from (the writer's token check)."""

    def __init__(self, max_reqs: int, max_blocks: int) -> None:
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int32)
        self.token_ids_cpu = np.zeros((max_reqs, max_blocks * BLOCK), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int32)
        table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32)
        self.block_table = BlockTables([SimpleNamespace(block_table=SimpleNamespace(cpu=table), block_size=BLOCK)])
        self.table = table


class FakeRunner:
    """Mirrors vLLM's ``_update_states`` for what omnishm reads, and makes the fake hidden rows."""

    def __init__(self, max_blocks: int) -> None:
        self.batch = FakeBatch(MAX_SEQS, max_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}  # prompt + generated, what the engine knows
        self.prompt_len: dict[str, int] = {}

    def update_states(self, so) -> None:
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
            self.computed[new.req_id] = new.num_computed_tokens
            self.prompt_len[new.req_id] = len(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.blocks[rid] = list(new_blocks[0])
            elif new_blocks is not None:
                self.blocks[rid].extend(new_blocks[0])
            self.computed[rid] = cached.num_computed_tokens[i]
        # Batch order: vLLM's is its own; any order is valid as long as rows follow it.
        order = sorted(so.num_scheduled_tokens, key=lambda r: (hash(r) & 0xFF, r))
        self.batch.req_ids = list(order)
        self.batch.req_id_to_index = {r: i for i, r in enumerate(order)}
        self.batch.table.zero_()
        for row, rid in enumerate(order):
            blocks = self.blocks[rid]
            self.batch.table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self.batch.num_computed_tokens_cpu[row] = self.computed[rid]
            known = self.tokens[rid]
            self.batch.token_ids_cpu[row, :len(known)] = known
            self.batch.num_prompt_tokens[row] = self.prompt_len[rid]

    def forward(self, so) -> torch.Tensor:
        parts = []
        for rid in self.batch.req_ids:
            start = self.computed[rid]
            n = so.num_scheduled_tokens[rid]
            parts.append(prefix_rows(self.tokens[rid][:start + n])[start:])
        return torch.cat(parts) if parts else torch.empty((0, HIDDEN))


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    return engine_config(tiny_model_dir)


def engine_config(tiny_model_dir):
    """The engine config every scheduler-driven test of this tier uses (the scheduler reads it)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_model_dir), block_size=BLOCK, enable_prefix_caching=True, max_model_len=512,
                      max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True,
                      enforce_eager=True, dtype="float32", seed=0)
    return args.create_engine_config()


def _kv_cache_config(num_blocks: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


@pytest.mark.parametrize("seed", [0, 1])
def test_real_scheduler_outputs_drive_the_cache(vllm_config, seed):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from omnishm.client import OmniPrefixCacheManager
    from omnishm.client.adapter import PrefixCacheSchedulerAdapter
    from omnishm.client.group_view import FullAttentionGroupView, stage_prefix_cache_config

    kv_cfg = _kv_cache_config(NUM_BLOCKS)
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after KV-cache sizing
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    scheduler = Scheduler(vllm_config, kv_cfg, StructuredOutputManager(vllm_config), block_size=BLOCK)
    cfg = stage_prefix_cache_config(kv_cache_config=kv_cfg, cache_config=vllm_config.cache_config,
                                    kv_transfer_config=vllm_config.kv_transfer_config,
                                    scheduler_config=vllm_config.scheduler_config,
                                    model_config=vllm_config.model_config, is_pooling_model=False,
                                    speculative_config=vllm_config.speculative_config,
                                    parallel_config=vllm_config.parallel_config)
    assert cfg is not None and cfg.num_slots == NUM_BLOCKS * BLOCK and cfg.staging_capacity_tokens == BUDGET

    rng = random.Random(seed)
    families = [[rng.randrange(4, 1000) for _ in range(rng.randrange(70, 200))] for _ in range(5)]
    runner = FakeRunner(max_blocks=512 // BLOCK)
    adapter = PrefixCacheSchedulerAdapter()
    counts = {"steps": 0, "rows": 0, "hit_rows": 0, "hits": 0, "aborted": 0, "preempted": 0, "rows_saved": 0}
    next_id = 0
    with OmniPrefixCacheManager(cfg, cache=unique_cache_name("sched"), autostart=True) as manager:
        for step_no in range(260):
            if step_no < 200 and (rng.random() < 0.35 or not scheduler.requests):
                fam = rng.choice(families)
                cut = rng.randrange(1, len(fam) + 1)
                prompt = fam[:cut] + [rng.randrange(4, 1000) for _ in range(rng.randrange(1, 40))]
                rid = f"r{next_id}-{seed}"
                next_id += 1
                req = Request(rid, prompt, SamplingParams(max_tokens=rng.choice([1, 2, 5, 40]), ignore_eos=True),
                              None, block_hasher=hasher)
                runner.tokens[rid] = list(prompt)
                scheduler.add_request(req)
            if scheduler.requests and rng.random() < 0.05:
                victim = rng.choice(sorted(scheduler.requests))
                scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                counts["aborted"] += 1
            so = scheduler.schedule()
            counts["preempted"] += len(so.preempted_req_ids or ())
            n = so.total_num_scheduled_tokens
            if n == 0 and not so.finished_req_ids:
                scheduler.update_from_output(so, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
                continue
            step = adapter.translate_scheduler_output(so)
            manager.new_step_starts(step)  # before the runner drops finished requests
            runner.update_states(so)
            sampled: dict[str, list[int]] = {}
            if n:
                hidden = runner.forward(so)
                layout = adapter.build_write_layout(FullAttentionGroupView(runner.batch, BLOCK),
                                                    so.num_scheduled_tokens)
                step_id = manager.save_outputs(hidden, None, num_tokens_unpadded=n, num_tokens_padded=n,
                                               write_layout=layout)
                counts["rows_saved"] += n
                # Alternate: materialize right away, or consume by discard on some steps.
                if step_no % 7 == 3:
                    manager.discard_step(step_id)
                else:
                    out = manager.materialize(step_id, layout.req_ids)
                    for w in layout.writes:
                        hit = out.num_hit_tokens[w.req_id]
                        start = runner.computed[w.req_id] - hit
                        end = runner.computed[w.req_id] + w.num_tokens
                        truth = prefix_rows(runner.tokens[w.req_id][:end])[start:]
                        got = out.hidden_states[w.req_id]
                        assert got.shape == truth.shape, (w.req_id, got.shape, truth.shape)
                        bad = (got != truth).any(dim=1)
                        assert not bool(bad.any()), (
                            f"step {step_no} {w.req_id}: rows {torch.nonzero(bad).flatten().tolist()[:8]} wrong "
                            f"(hit {hit}, computed {runner.computed[w.req_id]})")
                        counts["rows"] += int(got.shape[0])
                        counts["hit_rows"] += hit
                        counts["hits"] += bool(hit)
                for rid in runner.batch.req_ids:
                    total = runner.computed[rid] + so.num_scheduled_tokens[rid]
                    if total >= len(runner.tokens[rid]):  # prompt (and all known tokens) computed: sample
                        tok = (sum(runner.tokens[rid][-3:]) * 7 + len(runner.tokens[rid])) % 996 + 4
                        sampled[rid] = [tok]
            ids = list(runner.batch.req_ids) if n else []
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[sampled.get(r, []) for r in ids])
            scheduler.update_from_output(so, mro)
            for rid, toks in sampled.items():
                if rid in scheduler.requests:
                    runner.tokens[rid].extend(toks)
            counts["steps"] += 1
        assert manager.unconsumed_step_ids() == []
        # The writer compared the hits' prompt rows with what it saved (no prompt row left unchecked).
        counts["token_checked_rows"] = int(manager.counters["token_checked_rows"])
        assert manager.counters["token_mismatches"] == 0
    TIER_COUNTS["scheduler_rows"] += counts["rows"]
    TIER_COUNTS["scheduler_steps"] += counts["steps"]
    print(f"scheduler tier seed {seed}: {counts}")
    assert counts["hits"] > 10 and counts["hit_rows"] > 300 and counts["token_checked_rows"] > 300, counts
    assert counts["rows_saved"] > NUM_BLOCKS * BLOCK, counts  # freed blocks were handed out again
    assert counts["aborted"] > 0 and counts["preempted"] > 0, counts
