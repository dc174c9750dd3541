"""Chaos: a writer and two readers run the demo workload while the committer is SIGKILLed and restarted
several times and a reader is SIGKILLed and restarted.

Every row a rank serves is checked against ground truth (``omnishm.demo.rank``); the writer finally checks
that every claimed pool row landed and holds its ground truth (no acknowledged write lost). The run must end
with zero mismatches, zero lost acknowledged writes and zero leaked segments, and prints its counts.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from omnishm import shm
from omnishm.demo.launch import _rank_main
from omnishm.demo.rank import RankOptions, RankResult

from conftest import RUNTIME_DIR, unique_cache_name

COMMITTER_ARGS = ("--heartbeat-s", "0.2", "--heartbeat-timeout-s", "3")
COMMITTER_KILLS = 3
DURATION_S = 24.0
CAUGHT_UP_STEPS = 10  # a restarted reader this close to the writer has caught up (progress comes every 5 steps)


class Ranks:
    """Rank processes (spawned) with a shared progress queue; ranks can be killed and started again."""

    def __init__(self, opts: RankOptions):
        self.opts = opts
        self.ctx = mp.get_context("spawn")
        self.progress = self.ctx.Queue()
        self.results = self.ctx.Queue()
        self.procs: dict[int, list] = {}
        self.steps: dict[int, int] = Counter()
        self.refused: dict[int, int] = Counter()
        """Reads each rank refused so far, as its last progress message said."""

    def start(self, rank: int, opts: RankOptions | None = None) -> None:
        p = self.ctx.Process(target=_rank_main, args=(rank, opts or self.opts, self.progress, self.results, None),
                             name=f"chaos-rank{rank}", daemon=True)
        p.start()
        self.procs.setdefault(rank, []).append(p)
        self.steps[rank] = self.refused[rank] = 0

    def _take(self, item: tuple[int, int, int, int]) -> None:
        rank, steps, _, refused = item
        self.steps[rank] = max(self.steps[rank], steps)
        self.refused[rank] = max(self.refused[rank], refused)

    def pump(self, timeout_s: float = 0.1) -> None:
        try:
            self._take(self.progress.get(timeout=timeout_s))
        except queue.Empty:
            pass

    def wait_steps(self, rank: int, target: int, timeout_s: float) -> None:
        self.wait_until(rank, lambda: self.steps[rank] >= target, f"step {target}", timeout_s)

    def wait_until(self, rank: int, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Pump progress until ``done()``; fails when ``rank`` died, ended first, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"rank {rank} stuck at step {self.steps[rank]} (wanted {what})"
            exitcode = self.procs[rank][-1].exitcode
            assert exitcode in (None, 0), f"rank {rank} died: {exitcode}"
            if exitcode == 0:  # its run is over: what it reported last is queued already
                self._drain()
                assert done(), f"rank {rank} ended at step {self.steps[rank]} before {what}"
            self.pump()

    def _drain(self, skip: int | None = None) -> None:
        """Take every progress message queued now (the other ranks report every 5 steps, so it ends)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                item = self.progress.get_nowait()
            except queue.Empty:
                return
            if item[0] != skip:
                self._take(item)

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s process and read the progress it had queued, so a new one starts from 0.

        Joined, it sends nothing more, and what it sent is in the pipe ahead of anything sent since: a
        read until the queue is empty (the other ranks report every 5 steps) takes all of it."""
        p = self.procs[rank][-1]
        p.kill()
        p.join()
        self._drain(skip=rank)

    def collect(self, timeout_s: float) -> list[RankResult]:
        live = [p for ps in self.procs.values() for p in ps if p.exitcode != -signal.SIGKILL]
        out: list[RankResult] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < len(live) and time.monotonic() < deadline:
            self.pump(0.01)
            try:
                out.append(RankResult(**self.results.get(timeout=0.1)))
            except queue.Empty:
                pass
        for p in live:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
            if p.is_alive():
                p.kill()
                p.join()
        assert len(out) == len(live), f"only {len(out)} of {len(live)} ranks reported"
        return out


def test_chaos_committer_and_reader_kills(committer_factory, monkeypatch):
    monkeypatch.setenv("OMNISHM_RECONNECT_TIMEOUT_S", "25")  # inherited by the spawned ranks
    name = unique_cache_name("chaos")
    handle = committer_factory(*COMMITTER_ARGS, name=name)
    opts = RankOptions(cache=name, tp=3, seed=11, steps=10**9, duration_s=DURATION_S, num_blocks=64, block_size=8,
                       max_batched_tokens=64, width=32, mm_width=8, lag=1, autostart=False,
                       endpoint=handle.endpoint, runtime_dir=str(RUNTIME_DIR), commit_timeout_s=30.0,
                       lockstep=False, step_delay_s=0.01, verify_pool=True)
    ranks = Ranks(opts)
    t0 = time.monotonic()
    for r in range(3):
        ranks.start(r)
    kills = restarts = reader_kills = lead = caught_up_refused = 0
    try:
        ranks.wait_steps(0, 20, 60)
        for i in range(COMMITTER_KILLS):
            handle.stop(signal.SIGKILL)
            kills += 1
            handle = committer_factory(*COMMITTER_ARGS, name=name)
            restarts += 1
            assert "adopted live generation" in handle.log(), handle.log()
            if i == 0:  # a reader dies too, and a new one joins (it replays the engine from step 0)
                ranks.kill(2)
                reader_kills += 1
                # Until the new reader has caught up with the writer, the rows it reads may have been reused
                # since (refused, never served). Without the step delay it catches up; with it, it caught up
                # only while the committer was down (3-4 s a restart while the committer imported torch, 0.7 s
                # since), and 180 of its ~600 steps were refused.
                ranks.start(2, replace(opts, duration_s=max(DURATION_S - (time.monotonic() - t0), 4.0),
                                       step_delay_s=0.0))
                ranks.wait_steps(2, 5, 60)  # it has attached (its start, torch's import, can take seconds)
                lead = ranks.steps[0]  # the writer's steps it has to catch up with
                ranks.wait_until(2, lambda: ranks.steps[2] >= ranks.steps[0] - CAUGHT_UP_STEPS, "the writer's step", 60)
                caught_up_refused = ranks.refused[2]
            ranks.wait_steps(0, ranks.steps[0] + 20, 60)
        results = ranks.collect(DURATION_S + 60)
    finally:
        for ps in ranks.procs.values():
            for p in ps:
                if p.is_alive():
                    p.kill()
                    p.join()
    status_log = handle.log()
    assert handle.stop(signal.SIGTERM) == 0, status_log
    leaked = shm.list_segments(name)
    writer = next(r for r in results if r.rank == 0)
    errors: Counter = Counter()
    for r in results:
        errors.update(r.errors)
        if r.failure:
            errors[f"failure: {r.failure[:80]}"] += 1
    link: Counter = Counter()
    for r in results:
        link.update(r.link)
    rows_checked = sum(r.rows_checked for r in results)
    mismatches = sum(r.mismatches for r in results)
    print(f"\n[omnishm chaos] {time.monotonic() - t0:.1f}s: committer kills {kills}, restarts {restarts} (each "
          f"adopted the live cache), reader kills {reader_kills} (+{reader_kills} restarts); writer steps "
          f"{writer.steps}; rows checked {rows_checked}, mismatches {mismatches}; pool rows verified "
          f"{writer.pool_rows_verified}, lost acknowledged writes {writer.lost_writes}; committer losses seen "
          f"{link['committer_lost']}, resumes {link['reconnects']}, re-sent requests {link['resent']}; "
          f"errors raised by kind {dict(errors) or '{}'}, by rank {[(r.rank, r.steps, r.errors) for r in results]}; "
          f"leaked segments {len(leaked)}; the new reader started {lead} steps behind the writer and refused "
          f"{caught_up_refused} reads until it caught up")
    assert all(r.failure is None for r in results), [r.failure for r in results]
    assert mismatches == 0
    # Refusals are legitimate only for reads a kill made late (a few per kill) and for the new reader's reads
    # until it caught up with the writer: it replays from step 0, and the rows of steps far behind were
    # reused since. A cache that refused reads it should serve would show hundreds (a review measured 18
    # normally, 1263 with such a bug; a soak of 28 seeds on 2026-12-02 5 to 33). A bound on the sum, 5 % of
    # the readers' steps, failed on a 16-core H200 machine (2026-12-04): 165 refusals, all the new reader's,
    # whose catch-up depends on how far behind it starts. So the catch-up is left out: what either reader
    # refuses apart from it gets the kills' allowance (here, in 5 runs, the new reader refused 16-48 reads
    # while it caught up from 75-115 steps behind, and 1 after it in the 3 runs where that was counted).
    refused = {r.rank: sum(r.errors.values()) for r in results}
    assert refused[1] <= 20 * kills, (refused, dict(errors))
    assert refused[2] - caught_up_refused <= 20 * kills, (refused, caught_up_refused, lead, dict(errors))
    assert writer.lost_writes == 0 and writer.pool_rows_verified > 0
    assert rows_checked > 0 and all(r.rows_checked > 0 for r in results)
    assert link["reconnects"] >= kills  # the writer alone resumes after every kill
    assert leaked == []
