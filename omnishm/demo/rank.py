"""One simulated TP rank: the engine loop of ``omnishm demo`` and of the TP tests.

Every rank runs the same deterministic ``SimEngine`` (same seed), so all ranks
count the same real steps, as TP ranks of one engine do. Rank 0 is the writer;
the others attach as readers. Each rank checks every row it materializes
against ground truth and counts mismatches (it never raises on one: the demo
must report them).
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from omnishm.config import load_prefix_cache_config
from omnishm.interface import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig

DEFERRED_MM_KEY = "mm_feat"
"""The demo's multimodal key that a model policy defers (``RankOptions.deferred_mm``; else immediate)."""
IMMEDIATE_MM_KEY = "mm_code"
"""The demo's other multimodal key, always written with its step, as wide as the deferred one."""

START_BARRIER_S = 120.0
"""How long the ranks wait for one another to attach (``run_rank``; ``commit_timeout_s`` when longer)."""


@dataclass
class RankOptions:
    cache: str = "default"
    tp: int = 2
    seed: int = 0
    steps: int = 200
    duration_s: float | None = None
    num_blocks: int = 256
    block_size: int = 16
    max_batched_tokens: int = 256
    width: int = 256
    mm_width: int = 16
    lag: int = 0
    deferred_mm: bool = True
    autostart: bool = True
    endpoint: str | None = None
    runtime_dir: str | None = None
    commit_timeout_s: float = 30.0
    gpu_staging_bytes: int = 1 << 20
    lockstep: bool = True
    """Ranks meet at a barrier every step, as TP ranks meet at their collectives."""
    step_delay_s: float = 0.0
    """Sleep this long after each step (stretches a run so faults land mid-run; the chaos test)."""
    device: str = "cpu"
    """Where the rank's outputs live when saved (``cuda``: the CUDA path; the buffers are clobbered after
    each save, as a graph replay does)."""
    preempt_rate: float = 0.02
    """Chance per step that the sim preempts a running request although blocks are left (``SimEngine``):
    resumed requests, and their hits on their own cached blocks, in every run."""
    verify_pool: bool = False
    """Writer only: at the end, after every write was acknowledged, check each claimed pool row of the
    immediate key against ground truth (``lost_writes``: rows claimed, acknowledged and not there)."""

    def prefix_cache_config(self) -> PrefixCacheConfig:
        """Each rank's config: the demo's own sizing wins; the other client knobs (``reconnect_timeout_s``,
        ``result_pool_bytes``, ...) come from ``OMNISHM_*`` and the config file, as for any client.
        Raises ``ConfigError`` for a bad one (the launcher checks this before it starts anything)."""
        return load_prefix_cache_config(self.num_blocks, self.block_size,
                                        staging_capacity_tokens=self.max_batched_tokens, staging_depth=self.lag + 2,
                                        commit_timeout_s=self.commit_timeout_s,
                                        staging_claim_timeout_s=self.commit_timeout_s,
                                        gpu_staging_bytes=self.gpu_staging_bytes)


@dataclass
class RankResult:
    rank: int
    role: str
    pid: int = 0
    steps: int = 0
    requests: int = 0
    hit_tokens: int = 0
    rows_served: int = 0
    rows_checked: int = 0
    mismatches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    mirror_bytes: int = 0
    rss_bytes: int = 0
    shared_bytes: int = 0
    seconds: float = 0.0
    failure: str | None = None
    lost_writes: int = 0
    pool_rows_verified: int = 0
    link: dict[str, int] = field(default_factory=dict)
    """The client link's fault counters: committer_lost, reconnects, resent, resume_attempts."""
    preemptions: int = 0
    resumed_hits: int = 0
    """Of the rank's simulated scheduler: preempted requests, and those scheduled again with a hit."""
    token_checked_rows: int = 0
    """Writer: hit rows whose token and position it compared with what their slot holds (``client/tokens.py``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _statm() -> tuple[int, int]:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            parts = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        return int(parts[1]) * page, int(parts[2]) * page
    except OSError:
        return 0, 0


def run_rank(rank: int, opts: RankOptions, progress: Any = None, barrier: Any = None) -> RankResult:
    """Run one rank to completion; ``progress`` (a queue) gets ``(rank, steps, mismatches, refused)``
    every 5 steps and at the end, ``refused`` being the reads it refused so far (every error kind).

    With a ``barrier`` the ranks meet there once all are attached, before any
    step (a TP engine's ranks meet at the collectives of its start), and, with
    ``opts.lockstep``, before every step (the collective of a real TP forward);
    after the start they drift apart freely without ``lockstep``. A rank that
    fails or is interrupted while its peers still have a meeting to come (before
    the start, or at all in lockstep) breaks the barrier before its manager shuts
    down, and ``BrokenBarrierError`` is then the failure of every rank that waits
    there; a rank that dies without a word is ``RankGroup.wait``'s to report.
    ``duration_s`` counts from the start meeting.
    """
    # torch only here: a rank process unpickles its arguments (this module) before it can take its death
    # signal (launch._die_with_parent), and a demo killed while a rank imported torch on a loaded host left
    # that rank running for over 30 s.
    import torch

    from omnishm.client import OmniPrefixCacheManager
    from omnishm.sim import SimEngine

    torch.set_num_threads(1)
    role = "writer" if rank == 0 else "reader"
    result = RankResult(rank=rank, role=role, pid=os.getpid())
    met = False  # this rank passed the start meeting

    def break_meeting() -> None:
        # The peers stop at once, as a TP engine whose rank died does, not at the barrier's timeout. Not once
        # past the start without lockstep: nobody meets again, and an abort right after a meeting can fail a
        # peer that the meeting released but that has not woken yet (threading.Barrier re-checks its state).
        if barrier is not None and (not met or opts.lockstep):
            barrier.abort()

    try:
        cfg = opts.prefix_cache_config()
        eng = SimEngine(num_blocks=opts.num_blocks, block_size=opts.block_size,
                        max_batched_tokens=opts.max_batched_tokens, width=opts.width, mm_width=opts.mm_width,
                        seed=opts.seed, preempt_rate=opts.preempt_rate, mm_key=DEFERRED_MM_KEY,
                        extra_mm_keys=(IMMEDIATE_MM_KEY,))
    except BaseException:
        break_meeting()
        raise
    errors: Counter = Counter()
    pending: deque = deque()
    last_hash: dict[int, int] = {}  # slot -> prefix hash of the row last written there (verify_pool)
    t0 = time.perf_counter()

    def consume(m: Any, sid: int, st: Any) -> None:
        reqs = st.layout.req_ids
        try:
            out = m.materialize(sid, reqs)
        except OmniPrefixCacheUnmatchError as exc:
            kind = _error_kind(exc)
            # In lockstep the steps saved since this one are the ones still pending: a "reused" refusal
            # that none of them explains refused rows that were there (review, 2026-12-05: a reader that
            # refused every hit passed a lagging run). Drifting ranks have no such bound.
            if kind == "reused" and opts.lockstep and not _rewritten_since(st, exc.req_id, pending, opts.block_size):
                kind = UNEXPLAINED_REUSE
            errors[kind] += 1
            if os.environ.get("OMNISHM_DEMO_DEBUG"):
                print(f"rank {rank}: {exc}", flush=True)
            return
        for r in reqs:
            # The hidden states and each multimodal key, against their own ground truth: the mm keys are
            # as wide as each other, so rows served under the wrong key are a mismatch, not a shape error.
            pairs = [(out.hidden_states[r], eng.expected(st, r))]
            pairs += [(out.mm_outputs[r][key], eng.expected(st, r, salt=eng.mm_salt(key), width=opts.mm_width))
                      for key in eng.mm_keys]
            result.rows_served += sum(g.shape[0] for g, _ in pairs)
            result.hit_tokens += out.num_hit_tokens[r]
            # The count itself is checked too: an integration places the rows by it (the vLLM hooks start a
            # request's step rows at computed - hit), and a wrong count with right rows passed (review).
            if out.num_hit_tokens[r] != st.positions[r][0]:
                result.mismatches += 1
            for g, w in pairs:
                result.rows_checked += w.shape[0]  # rows the request should get, whatever was served
                if g.shape != w.shape:  # (!= would broadcast: 0 rows against 1 would compare equal)
                    result.mismatches += max(g.shape[0], w.shape[0])
                elif not torch.equal(g, w):
                    result.mismatches += int((g != w).any(dim=1).sum())

    def run(m: Any) -> None:
        """Attached: meet the peers, run the steps, consume what is left, measure."""
        nonlocal met
        if opts.deferred_mm:
            m.register_policy(ModelCachePolicy(deferred_keys=frozenset({DEFERRED_MM_KEY})))
        if barrier is not None:
            # A reader that attached after its writer's last publication would never bind to that writer
            # (``ReadSide._follow_writer``) and would wait out commit_timeout_s at each step: in a real
            # engine every rank has attached before the first forward. Spawning a rank (torch's import)
            # may take longer than a step's timeout on a loaded host.
            barrier.wait(timeout=max(opts.commit_timeout_s, START_BARRIER_S))
        met = True
        t_run = time.perf_counter()  # a slow peer's start does not use up duration_s
        while True:
            if opts.duration_s is not None:
                if time.perf_counter() - t_run >= opts.duration_s:
                    break
            elif result.steps >= opts.steps:
                break
            eng.top_up(4)
            if barrier is not None and opts.lockstep:
                barrier.wait(timeout=opts.commit_timeout_s)
            st = eng.schedule()
            sid = st.run(m, device=opts.device)
            pending.append((sid, st))
            if opts.verify_pool and role == "writer":
                for w in st.layout.writes:
                    _, first, count = st.positions[w.req_id]
                    hs = st.hashes[w.req_id][first:first + count]
                    for slot, h in zip(st.layout.slots[w.token_start:w.token_start + count].tolist(), hs):
                        last_hash[slot] = h
            eng.advance(st)
            while len(pending) > opts.lag:
                consume(m, *pending.popleft())
            result.steps += 1
            if progress is not None and result.steps % 5 == 0:
                progress.put((rank, result.steps, result.mismatches, sum(errors.values())))
            if opts.step_delay_s:
                time.sleep(opts.step_delay_s)
        while pending:
            consume(m, *pending.popleft())
        if opts.verify_pool and role == "writer":
            m.wait_idle()
            result.lost_writes, result.pool_rows_verified = _verify_pool(m, last_hash, opts.width)
        result.mirror_bytes = sum(int(kv.pool.numel() * kv.pool.element_size()) for kv in m._keys.values())
        result.token_checked_rows = int(m.counters["token_checked_rows"])
        result.rss_bytes, result.shared_bytes = _statm()

    try:
        with OmniPrefixCacheManager(cfg, cache=opts.cache, role=role, endpoint=opts.endpoint,
                                    autostart=opts.autostart, runtime_dir=opts.runtime_dir) as m:
            try:
                run(m)
            except BaseException:
                break_meeting()  # before the manager's shutdown, which may wait
                raise
    except BaseException as exc:
        break_meeting()  # also when the attach itself failed or was interrupted
        if not isinstance(exc, Exception):
            raise  # an interrupt: _rank_main exits without a result
        result.failure = f"{type(exc).__name__}: {exc}"  # reported, so the demo can print it and exit non-zero
    link = getattr(locals().get("m"), "_link", None)
    if link is not None:
        result.link = {k: int(v) for k, v in link.stats.items()}
    result.requests = eng.requests_done
    result.preemptions, result.resumed_hits = eng.preemptions, eng.resumed_hits
    result.errors = dict(errors)
    result.seconds = time.perf_counter() - t0
    if progress is not None:
        progress.put((rank, result.steps, result.mismatches, sum(errors.values())))
    return result


def _verify_pool(m: Any, last_hash: dict[int, int], width: int) -> tuple[int, int]:
    """(rows lost or wrong, rows verified) of the immediate (hidden) key, once every write was acknowledged.

    A claimed slot must hold commit == claim (its write was acknowledged, so it landed) and the
    ground-truth row of the last token written there.
    """
    import torch

    from omnishm.interface import HIDDEN_KEY
    from omnishm.sim import truth_rows

    kv = m._keys.get(HIDDEN_KEY)
    if kv is None or not last_hash:
        return 0, 0
    slots = torch.tensor(sorted(last_hash), dtype=torch.int64)
    claim, commit = kv.claim[slots], kv.commit[slots]
    landed = (claim != 0) & (commit == claim)
    want = truth_rows([last_hash[s] for s in slots.tolist()], width).to(kv.dtype)
    wrong = ~(kv.pool.index_select(0, slots) == want).all(dim=1)
    return int((~landed | wrong).sum()), len(slots)


UNEXPLAINED_REUSE = "reused, but no later step wrote its slots"
"""The error kind of a "reused" refusal in lockstep that no step saved after the read's own explains:
a refused read of rows that were there, which fails the demo (``main.passed``)."""


def _rewritten_since(st: Any, req_id: str | None, later: Iterable[tuple[int, Any]], bs: int) -> bool:
    """Whether a step in ``later`` (``(step id, SimStep)`` pairs, the steps saved after ``st``) wrote a
    slot of ``req_id``'s hit in ``st``, or of any hit of ``st`` when the error named no hit request."""
    reqs = [req_id] if req_id in st.hit_blocks else list(st.hit_blocks)
    hit = {b * bs + o for r in reqs for b in st.hit_blocks[r] for o in range(bs)}
    return any(not hit.isdisjoint(s.layout.slots.tolist()) for _, s in later)


def _error_kind(exc: Exception) -> str:
    text = str(exc)
    for kind in ("reused", "absent", "not committed", "did not publish", "writer left", "did not land"):
        if kind in text:
            return kind
    return type(exc).__name__
