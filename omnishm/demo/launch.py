"""Start ``tp`` rank processes that share one committer, and collect their results."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any, Callable

from omnishm.demo.rank import RankOptions, RankResult, run_rank


def _rank_main(rank: int, opts: RankOptions, progress: Any, results: Any, barrier: Any) -> None:
    results.put(run_rank(rank, opts, progress, barrier).to_dict())


class RankGroup:
    """The rank processes of one simulated engine (spawned: no fork of a torch process)."""

    def __init__(self, opts: RankOptions, *, with_progress: bool = True):
        self.opts = opts
        self.ctx = mp.get_context("spawn")
        self.progress = self.ctx.Queue() if with_progress else None
        self.results = self.ctx.Queue()
        self.barrier = self.ctx.Barrier(opts.tp) if opts.lockstep else None
        self.procs = [self.ctx.Process(target=_rank_main, args=(r, opts, self.progress, self.results, self.barrier),
                                       name=f"omnishm-rank{r}", daemon=True) for r in range(opts.tp)]

    def start(self) -> "RankGroup":
        for p in self.procs:
            p.start()
        return self

    def wait(self, timeout_s: float, on_progress: Callable[[int, int, int], None] | None = None) -> list[RankResult]:
        """Results of every rank that finished; a killed rank gets a result with ``failure`` set."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, RankResult] = {}
        while len(got) < len(self.procs) and time.monotonic() < deadline:
            self._pump(on_progress)
            try:
                d = self.results.get(timeout=0.1)
                got[d["rank"]] = RankResult(**d)
            except queue.Empty:
                pass
            for r, p in enumerate(self.procs):
                if r not in got and p.exitcode is not None and p.exitcode != 0:
                    got[r] = RankResult(rank=r, role="writer" if r == 0 else "reader",
                                        failure=f"process exited with {p.exitcode}")
        self._pump(on_progress)
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
            if p.is_alive():
                p.kill()
                p.join()
        for r in range(len(self.procs)):
            got.setdefault(r, RankResult(rank=r, role="writer" if r == 0 else "reader", failure="timed out"))
        return [got[r] for r in range(len(self.procs))]

    def _pump(self, on_progress: Callable[[int, int, int], None] | None) -> None:
        if self.progress is None:
            return
        while True:
            try:
                item = self.progress.get_nowait()
            except queue.Empty:
                return
            if on_progress is not None:
                on_progress(*item)
