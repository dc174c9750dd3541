"""Start ``tp`` rank processes that share one committer, and collect their results."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

from omnishm.committer.early_stop import InterruptOnce
from omnishm.demo.rank import RankOptions, RankResult, run_rank
from omnishm.liveness import die_with_parent

STOP_TIMEOUT_S = 10.0
ABORT_WAIT_S = 2.0
"""How long ``RankGroup.wait`` waits for the lockstep meeting's abort (see ``_abort_meeting``)."""
STACK_DUMP_WAIT_S = 2.0
"""How long ``RankGroup.wait`` gives a rank that outlived its deadline to write its threads' stacks (SIGUSR1)
before it kills it."""


def _die_with_parent(parent: int) -> None:
    """The kernel sends this rank SIGTERM when the demo dies, even by SIGKILL (Linux only), so no rank
    outlives it holding the cache; a parent already gone means stopping now."""
    if not die_with_parent(parent):
        raise KeyboardInterrupt("the demo is gone")


def _rank_main(rank: int, opts: RankOptions, progress: Any, results: Any, barrier: Any,
               parent: int | None = None) -> None:
    """A rank process's entry point. Interrupted (Ctrl-C, SIGTERM, its parent gone), it leaves without a
    traceback and without a result, exit code 128 + the signal (the manager's ``with`` block has shut the
    client down by then), so ``RankGroup.wait`` reports it at once."""
    interrupts = InterruptOnce()
    # A rank that outlives RankGroup.wait's deadline writes every thread's stack to stderr before it is killed:
    # faulthandler's, run in C, so it works with the main thread stuck in a wait.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        if parent is not None:
            _die_with_parent(parent)
        results.put(run_rank(rank, opts, progress, barrier).to_dict())
    except KeyboardInterrupt:
        # Progress nobody will read must not hold the exit: with the demo gone its pipe may never drain.
        for q in (progress, results):
            if q is not None:
                q.cancel_join_thread()
        sys.exit(128 + (interrupts.fired or int(signal.SIGTERM)))


class RankGroup:
    """The rank processes of one simulated engine (spawned: no fork of a torch process)."""

    def __init__(self, opts: RankOptions, *, with_progress: bool = True):
        self.opts = opts
        self.ctx = mp.get_context("spawn")
        self.progress = self.ctx.Queue() if with_progress else None
        self.results = self.ctx.Queue()
        self.barrier = self.ctx.Barrier(opts.tp)  # every rank attaches before any step (``run_rank``)
        self._meeting_dead = False
        """The meeting's lock died with a rank (``_abort_meeting``): the others were stopped."""
        self.procs = [self.ctx.Process(target=_rank_main, name=f"omnishm-rank{r}", daemon=True,
                                       args=(r, opts, self.progress, self.results, self.barrier, os.getpid()))
                      for r in range(opts.tp)]

    def start(self) -> "RankGroup":
        for p in self.procs:
            p.start()
        return self

    def wait(self, timeout_s: float,
             on_progress: Callable[[int, int, int, int], None] | None = None) -> list[RankResult]:
        """Results of every rank that finished; a killed rank gets a result with ``failure`` set.

        A rank still running at the deadline first writes its threads' stacks to stderr (SIGUSR1, at most
        ``STACK_DUMP_WAIT_S``), then is killed, and its result says "timed out"."""
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
                    # Killed without a word (SIGKILL, say): its peers may wait for it at a meeting that will
                    # never be (run_rank breaks it itself whenever it can). A rank gone after the start is
                    # waited for by nobody without lockstep, so the abort then changes nothing.
                    self._abort_meeting()
        self._pump(on_progress)
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
        hung = [p for p in self.procs if p.is_alive()]
        for p in hung:
            print(f"omnishm demo: {p.name} (pid {p.pid}) still runs after {timeout_s:.0f} s; its stacks:",
                  file=sys.stderr, flush=True)
            os.kill(p.pid, signal.SIGUSR1)
            p.join(STACK_DUMP_WAIT_S)  # a rank that finishes meanwhile has exited: nothing to kill
        for p in hung:
            if p.is_alive():
                p.kill()
                p.join()
        for r in range(len(self.procs)):
            got.setdefault(r, RankResult(rank=r, role="writer" if r == 0 else "reader", failure="timed out"))
        return [got[r] for r in range(len(self.procs))]

    def _abort_meeting(self) -> None:
        """Break the ranks' meeting for the peers of a rank that died. ``mp.Barrier.abort`` takes the
        barrier's lock with no timeout, and a rank killed while it held it (every ``wait`` takes it for a
        moment) leaves it held for good: the abort, and every peer at its next meeting, would block forever
        (review, 2026-12-05). So the abort gets ``ABORT_WAIT_S`` on a thread of its own; past that the
        meeting is dead and the ranks still running are stopped."""
        if self._meeting_dead:
            return
        done = threading.Event()

        def abort() -> None:
            self.barrier.abort()
            done.set()

        threading.Thread(target=abort, name="omnishm-demo-abort", daemon=True).start()
        if not done.wait(ABORT_WAIT_S):
            self._meeting_dead = True
            print("omnishm demo: a rank died holding the ranks' meeting lock; stopping the others",
                  file=sys.stderr, flush=True)
            self.stop()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Interrupt every rank still running (SIGTERM: each shuts its manager down) and reap them;
        one that does not stop within ``timeout_s`` is killed."""
        started = [p for p in self.procs if p.pid is not None]  # an interrupt may come in the middle of start()
        for p in started:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in started:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()

    def _pump(self, on_progress: Callable[[int, int, int, int], None] | None) -> None:
        if self.progress is None:
            return
        while True:
            try:
                item = self.progress.get_nowait()
            except queue.Empty:
                return
            if on_progress is not None:
                on_progress(*item)
