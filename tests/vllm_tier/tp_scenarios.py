"""The tier's tensor-parallel engine scenarios, shared by the V1 runner's test (test_engine_tp.py) and the V2
runner's run (v2_engine_run.py, a child process): ``TPHarness`` over two TP ranks, rank 0 the writer and rank 1 a
reader of one cache, and two scenarios, each checking every request's full-prompt rows on both ranks."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omnishm.integrations.vllm import decode_results, decode_tensor, external_req_id
from vllm_harness import BLOCK, HIDDEN, Harness, compare_rows, rand_tokens, report_rows

TP = 2
NUM_BLOCKS = 24
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def omp_bind_per_rank(tp: int = TP) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each TP rank its share of the allowed CPUs ("0|1" on 2 CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    parts = [cpus[i::tp] or cpus[:1] for i in range(tp)]  # fewer CPUs than ranks: ranks share the first
    return "|".join(",".join(map(str, p)) for p in parts)


@dataclass
class TPHarness(Harness):
    """``Harness`` over TP ranks: rank 0's (the writer's) answers feed the shared checks; rank 1's are kept.

    ``collective_rpc`` answers in rank order. Rank 1's completed requests
    (``reader_results``) and no-hit raw rows (``reader_gt`` per prompt) are
    checked by ``check_reader``.
    """

    per_rank: dict[str, list[Any]] = field(default_factory=dict)
    reader_results: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    reader_raw: dict[str, torch.Tensor] = field(default_factory=dict)
    reader_gt: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    ranks_agree: bool = True

    def rpc(self, method: str, *args: Any) -> Any:
        out = self.llm.collective_rpc(method, args=args)
        assert len(out) == TP, out
        self.per_rank[method] = out
        if method == "omnishm_take_results":
            for rid, val in decode_results(out[1]).items():
                ext = external_req_id(rid)
                assert ext not in self.reader_results, f"reader: request {ext} completed twice"
                self.reader_results[ext] = val
        elif method == "omnishm_take_raw_prompt_hidden":
            self.reader_raw.update({external_req_id(k): decode_tensor(v) for k, v in out[1].items()})
        return out[0]

    def begin(self, tag: str, *, keep_current: bool = False) -> None:
        self.reader_results.clear()
        self.reader_raw.clear()
        super().begin(tag, keep_current=keep_current)
        if keep_current:
            assert all(s["cache"] == self.cache and s["steps"] == 0 for s in self.per_rank["omnishm_stats"])
        else:
            assert self.per_rank["omnishm_install"] == [True] * TP

    def ground_truth(self, prompt: Sequence[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key in self.gt:
            return self.gt[key]
        self.collect()  # the scenario's results, before the ground-truth run's
        reader_done = set(self.reader_results)
        truth = super().ground_truth(prompt)
        (rid,) = set(self.reader_results) - reader_done  # the ground-truth run's request
        mine = self.reader_results.pop(rid)
        reader_truth = self.reader_raw.pop(rid)  # rank 1's rows read straight from its runner
        # Rank 1's no-hit run through the cache equals its own rows too.
        assert torch.equal(mine[0], reader_truth) and mine[1] == 0
        self.reader_gt[key] = reader_truth
        self.ranks_agree &= torch.equal(truth, reader_truth)
        return truth

    def status(self) -> dict[str, Any]:
        """The committer's status of this cache, asked as an admin client from the test process."""
        from omnishm import paths, protocol
        from omnishm.cli import admin_request

        reply = admin_request(self.cache, paths.ipc_endpoint(None, self.cache),
                              lambda rid: protocol.StatusRequest(rid=rid), 10.0)
        assert isinstance(reply, protocol.StatusReply), reply
        return reply.status

    def check_attached(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Rank 0 the writer, rank 1 a reader, in two worker processes, both clients of this cache's committer."""
        stats = self.llm.collective_rpc("omnishm_stats")
        assert [s.get("role") for s in stats] == ["writer", "reader"], stats
        assert all(s["cache"] == self.cache for s in stats), stats
        pids = [s["pid"] for s in stats]
        assert len(set(pids)) == TP and os.getpid() not in pids, pids
        st = self.status()
        clients = sorted((c for c in st["clients"] if c["role"] != "admin"), key=lambda c: c["role"] != "writer")
        assert [(c["role"], c["client_id"], c["pid"]) for c in clients] == \
            [(s["role"], s["client_id"], s["pid"]) for s in stats], (st["clients"], stats)
        assert st["name"] == self.cache and st["pid"] not in pids + [os.getpid()], st  # an embedded committer
        assert st["layout"]["num_slots"] == NUM_BLOCKS * BLOCK == stats[1]["num_slots"], st["layout"]
        return stats, st

    def check_reader(self, *, expect_missing: Sequence[str] = ()) -> dict[str, int]:
        """Rank 1's full-prompt rows: hit rows (read from shared memory) = the writer's ground truth, rows it
        computed = its own ground truth; its hit lengths = the writer's = vLLM's ``num_cached_tokens``."""
        self.collect()
        counts = {"requests": 0, "rows": 0, "mismatches": 0, "hit_requests": 0, "hit_rows": 0}
        bad: list[str] = []
        for rid in expect_missing:
            assert rid not in self.reader_results, f"reader: {rid} should not have completed its prompt"
        for rid, prompt in self.prompts.items():
            if rid in expect_missing:
                continue
            assert rid in self.reader_results, f"reader: {rid} missing (got {sorted(self.reader_results)})"
            hidden, hit = self.reader_results[rid]
            assert tuple(hidden.shape) == (len(prompt), HIDDEN), (rid, hidden.shape)
            assert hit == self.results[rid][1], f"reader: {rid} hit {hit} != writer's {self.results[rid][1]}"
            if rid in self.cached:
                assert hit == self.cached[rid], f"reader: {rid} hit {hit} != num_cached_tokens {self.cached[rid]}"
            self.ground_truth(prompt)
            key = tuple(prompt)
            truth = torch.cat([self.gt[key][:hit], self.reader_gt[key][hit:]])
            compare_rows(counts, bad, rid, hidden, truth, hit, who="reader: ")
        return report_rows(counts, bad, f"{self.cache}, reader rank", f"; ranks' no-hit rows "
                           f"{'bit-identical' if self.ranks_agree else 'differ'}")


def one_committer_prefix_hits(h: TPHarness) -> dict:
    """Full, partial and batched hits on both ranks; a hit on a block computed on top of a hit."""
    rng = random.Random(31)
    donor = rand_tokens(rng, 100)
    h.generate([donor], max_tokens=2)
    a = donor[:96] + rand_tokens(rng, 40)  # hit ends on a block boundary
    b = donor + rand_tokens(rng, 40)  # shared 100, hit 96
    c = donor[:70] + rand_tokens(rng, 30)  # hit 64
    e = rand_tokens(rng, 50)  # no hit, same step
    outs = h.generate([a, b, c, e], max_tokens=3)
    ids = [o.request_id for o in outs]
    (of,) = h.generate([b[:128] + rand_tokens(rng, 10)], max_tokens=1)  # hits a block b computed
    stats, st = h.check_attached()
    writer, reader = (s["manager"] for s in stats)
    assert reader["hit_rows_served"] == writer["hit_rows_served"] == 96 + 96 + 64 + 128, (writer, reader)
    assert stats[1]["max_hit_requests_per_step"] >= 2, stats[1]
    assert 0 < st["rows_written"] <= stats[0]["rows_saved"] and st["steps_failed"] == 0, st
    out = h.check(expect_hit=[*ids[:3], of.request_id],
            expect_cached={ids[0]: 96, ids[1]: 96, ids[2]: 64, ids[3]: 0, of.request_id: 128})
    h.check_reader()
    return out


def abort_chunked_and_reused_blocks(h: TPHarness) -> dict:
    """An abort while decoding, a chunked prefill, and more rows than slots (vLLM hands freed blocks to new
    tenants), on both ranks."""
    rng = random.Random(32)
    x = rand_tokens(rng, 200)
    h.add("x", x, max_tokens=30)
    h.step()
    h.llm.llm_engine.abort_request(["x"])  # aborted while decoding
    h.drain()
    hit_ids: list[str] = []
    (oy,) = h.generate([x[:192] + rand_tokens(rng, 20)], max_tokens=1)  # hits the aborted request's blocks
    hit_ids.append(oy.request_id)
    base = rand_tokens(rng, 200)
    h.generate([base], max_tokens=1)
    # 108 + 300 + 186 tokens > max_num_batched_tokens (512): the last prompt is prefilled in two chunks.
    outs = h.generate([base[:192] + rand_tokens(rng, 100), rand_tokens(rng, 300), base[:64] + rand_tokens(rng, 250)],
                      max_tokens=2)
    hit_ids += [outs[0].request_id, outs[2].request_id]
    for _ in range(4):  # more rows than slots: vLLM hands freed blocks to new tenants
        base = rand_tokens(rng, 160)
        h.generate([base], max_tokens=2)
        outs = h.generate([base[:150] + rand_tokens(rng, 20), base[:100] + rand_tokens(rng, 60)], max_tokens=2)
        hit_ids += [o.request_id for o in outs]
    stats, _st = h.check_attached()
    assert stats[0]["rows_saved"] > stats[0]["num_slots"], stats[0]
    assert stats[1]["manager"]["unmatch_errors"] == 0, stats[1]
    out = h.check(expect_hit=hit_ids, expect_cached={oy.request_id: 192})
    h.check_reader()
    return out
