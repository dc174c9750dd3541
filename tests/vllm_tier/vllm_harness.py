"""Real-engine helpers for the vLLM tier: engines, prompts, ground truth, exact comparison.

Ground truth for a prompt is the same engine run with its prefix cache reset
(``llm.reset_prefix_cache()``): the hidden states the runner produced for the
whole prompt with no hit, read straight from ``execute_model_state`` by the
hooks (``omnishm_take_raw_prompt_hidden``), not through the cache.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from vllm_tier import TIER_COUNTS, unique_cache_name
from omnishm.integrations.vllm import EXTENSION_CLS, decode_results, decode_tensor, external_req_id

BLOCK = 32
HIDDEN = 128
ENGINE_KW: dict[str, Any] = dict(enable_prefix_caching=True, block_size=BLOCK, max_model_len=512, dtype="float32",
                                 enforce_eager=True, seed=0, max_num_seqs=8, max_num_batched_tokens=512,
                                 num_gpu_blocks_override=64, kv_cache_memory_bytes=64 << 20)


def make_llm(model_dir: Any, *, multiprocess: bool, cache: str, **overrides: Any) -> Any:
    """A real vLLM engine with the omnishm worker extension (cache ``cache`` via $OMNISHM_CACHE)."""
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ["OMNISHM_CACHE"] = cache
    kw = dict(ENGINE_KW)
    kw.update(overrides)
    llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION_CLS, **kw)
    # vLLM's LLM.__repr__ asks every worker for its model (collective_rpc) and, with the engine dead,
    # waits forever: pytest's failure report reprs the locals of a failed test and then hung CI.
    llm._cached_repr = f"<vllm.LLM {Path(model_dir).name}, omnishm cache {cache}>"
    return llm


# How long the engine-core process gets to stop before vLLM SIGKILLs it and its workers (vLLM's default: 5 s).
# A graceful stop takes 3-4 s on the 2-vCPU build machine (as long without omnishm's extension) and 6.4 s with
# both cores busy; the killed processes leave their broadcast rings and a semaphore in /dev/shm, which fails
# host_dirs_untouched. A stop that needs longer than this is a hang.
ENGINE_SHUTDOWN_TIMEOUT_S = 60.0
PARKED_TIMEOUT_S = 30.0


def close_llm(llm: Any) -> dict[str, Any]:
    """omnishm shutdown first (the engine must not take the manager down with it), then the engine."""
    stats = llm.collective_rpc("omnishm_shutdown")[0]
    for proc in _engine_core_processes(llm):
        _wait_parked(proc.pid)
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    return stats


def _engine_core_processes(llm: Any) -> list[Any]:
    """The engine-core processes of a multiprocess engine (none for an in-process one)."""
    manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
    return [p for p in getattr(manager, "processes", ()) if p.pid is not None and p.is_alive()]


def _wait_parked(pid: int) -> None:
    """Return once the main thread of ``pid`` sleeps in a futex and used no CPU for 50 ms (or after
    PARKED_TIMEOUT_S: the stop then goes ahead, and a lost signal shows as vLLM's force-kill).

    vLLM stops an engine-core process with SIGTERM, whose Python handler runs on the main thread. That
    thread, idle, blocks in ``input_queue.get()``. CPython runs pending handlers when a lock wait is
    interrupted, but not before it starts one: a SIGTERM that lands after the thread left the eval loop
    and before it entered the futex (it had just answered a request, and dropping the GIL let another
    thread take the core) only marks the handler pending, and the thread sleeps until the next request,
    which never comes. strace showed it: the signal hit the thread in user space (``rt_sigreturn = 1``,
    not ``EINTR``), and vLLM force-killed the process 60 s later with its rings still in /dev/shm (5 of 11
    runs with the 60 s timeout alone on 2026-12-04, each right after ``omnishm_shutdown`` answered). Once the
    thread is parked, the signal interrupts its wait and the handler runs.
    """
    task = Path(f"/proc/{pid}/task/{pid}")
    deadline = time.monotonic() + PARKED_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        try:
            wchan = (task / "wchan").read_text()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process is gone: nothing to wait for
            return
        now = (fields[0], fields[11], fields[12], "futex" in wchan)  # state, utime, stime, in a futex wait
        if now == last and now[0] == "S" and now[3]:
            return
        last = now
        time.sleep(0.05)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 1000) for _ in range(n)]


def compare_rows(counts: dict[str, int], bad: list[str], rid: str, hidden: torch.Tensor, truth: torch.Tensor,
                 hit: int, who: str = "") -> None:
    """Count one request's full-prompt rows against ``truth`` (bit for bit); a differing row goes to ``bad``."""
    counts["requests"] += 1
    counts["rows"] += len(hidden)
    counts["hit_requests"] += bool(hit)
    counts["hit_rows"] += hit
    if not torch.equal(hidden, truth):
        diff = (hidden - truth).abs().amax(dim=1)
        counts["mismatches"] += int((diff != 0).sum())
        bad.append(f"{who}{rid}: {int((diff != 0).sum())} rows differ (first {int(torch.nonzero(diff)[0, 0])}, "
                   f"hit {hit}, max |diff| {float(diff.max())})")


def report_rows(counts: dict[str, int], bad: list[str], label: str, extra: str = "") -> dict[str, int]:
    """Add one check's counts to the tier's totals, print them, and fail on any differing row."""
    for k, v in counts.items():
        TIER_COUNTS[k] += v
    print(f"[{label}] requests compared={counts['requests']} rows compared={counts['rows']} "
          f"hit requests={counts['hit_requests']} hit rows={counts['hit_rows']} "
          f"mismatches={counts['mismatches']}{extra}")
    assert not bad, "\n".join(bad)
    return counts


@dataclass
class Harness:
    """One engine plus its omnishm hooks, one test at a time (``begin``/``end``)."""

    llm: Any
    gt: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    results: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    cache: str = ""

    def rpc(self, method: str, *args: Any) -> Any:
        out = self.llm.collective_rpc(method, args=args)
        assert len(out) == 1, out
        return out[0]

    def begin(self, tag: str, *, keep_current: bool = False) -> None:
        """Fresh vLLM prefix cache and fresh hooks on a new cache (or keep the auto-installed ones)."""
        self.prompts.clear()
        self.results.clear()
        self.cached.clear()
        if keep_current:
            stats = self.rpc("omnishm_stats")
            assert stats and stats["cache"] == os.environ["OMNISHM_CACHE"], stats
            assert stats["steps"] == 0, f"auto-installed hooks already ran: {stats}"
            self.cache = stats["cache"]
            return
        self.rpc("omnishm_shutdown")
        assert self.llm.reset_prefix_cache()
        self.cache = unique_cache_name(tag)
        assert self.rpc("omnishm_install", self.cache) is True

    def end(self) -> dict[str, Any]:
        return self.rpc("omnishm_shutdown")

    # ------------------------------------------------------------------ running

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 1) -> list[Any]:
        """One ``generate`` call (the prompts are scheduled together); records outputs by request id."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        for p, o in zip(prompts, outs):
            self.prompts[o.request_id] = list(p)
            self.cached[o.request_id] = int(o.num_cached_tokens or 0)
        return outs

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 1) -> None:
        """Add a request through the engine API (for aborts); drive it with ``step``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm.llm_engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(prompt)), sp)
        self.prompts[req_id] = list(prompt)

    def step(self) -> list[Any]:
        outs = self.llm.llm_engine.step()
        for o in outs:
            if getattr(o, "num_cached_tokens", None) is not None:
                self.cached[o.request_id] = int(o.num_cached_tokens)
        return outs

    def drain(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.llm.llm_engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("engine did not drain")

    def collect(self) -> dict[str, tuple[torch.Tensor, int]]:
        got = decode_results(self.rpc("omnishm_take_results"))
        for rid, val in got.items():
            ext = external_req_id(rid)
            assert ext not in self.results, f"request {ext} completed twice"
            self.results[ext] = val
        return self.results

    # ------------------------------------------------------------------ ground truth + check

    def ground_truth(self, prompt: Sequence[int]) -> torch.Tensor:
        """Hidden states of ``prompt`` with the prefix cache reset (no hit), memoised per prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        key = tuple(prompt)
        if key in self.gt:
            return self.gt[key]
        self.collect()  # keep the scenario's results apart from the ground-truth run's
        assert self.llm.reset_prefix_cache()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))],
                                SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, "ground truth run had a prefix hit"
        raw = {external_req_id(k): decode_tensor(v) for k, v in self.rpc("omnishm_take_raw_prompt_hidden").items()}
        mine = {external_req_id(k): v for k, v in decode_results(self.rpc("omnishm_take_results")).items()}
        assert out.request_id in raw, (out.request_id, list(raw))
        truth = raw[out.request_id]
        # The no-hit run through the cache must equal the runner's own rows too.
        assert torch.equal(mine[out.request_id][0], truth)
        assert mine[out.request_id][1] == 0
        self.gt[key] = truth
        return truth

    def check(self, *, expect_hit: Sequence[str] = (), expect_missing: Sequence[str] = (),
              expect_cached: dict[str, int] | None = None) -> dict[str, int]:
        """Compare every completed request with its ground truth, bit for bit; count rows.

        ``expect_hit``: requests that must show a vLLM prefix hit
        (``num_cached_tokens > 0``). ``expect_missing``: requests that must not
        complete (aborted before their prompt was computed). Each completed
        request's omnishm hit length must equal vLLM's ``num_cached_tokens``.
        """
        self.collect()
        results = dict(self.results)
        prompts = dict(self.prompts)
        cached = dict(self.cached)
        counts = {"requests": 0, "rows": 0, "mismatches": 0, "hit_requests": 0, "hit_rows": 0}
        for rid in expect_missing:
            assert rid not in results, f"{rid} should not have completed its prompt"
        for rid in expect_hit:
            assert cached.get(rid, 0) > 0, f"{rid}: vLLM reported no prefix hit ({cached.get(rid)})"
        for rid, exp in (expect_cached or {}).items():
            assert cached.get(rid) == exp, f"{rid}: num_cached_tokens {cached.get(rid)} != {exp}"
        bad: list[str] = []
        for rid, prompt in prompts.items():
            if rid in expect_missing:
                continue
            assert rid in results, f"{rid}: omnishm has no full-prompt hidden states (got {sorted(results)})"
            hidden, hit = results[rid]
            assert tuple(hidden.shape) == (len(prompt), HIDDEN), (rid, hidden.shape, len(prompt))
            if rid in cached:
                assert hit == cached[rid], f"{rid}: omnishm hit {hit} != vLLM num_cached_tokens {cached[rid]}"
            compare_rows(counts, bad, rid, hidden, self.ground_truth(prompt), hit)
        return report_rows(counts, bad, self.cache)
