"""The CPUs omnishm's own threads run on, and those of a committer a client autostarts.

vLLM's CPU worker pins each TP rank's threads to that rank's cores (``VLLM_CPU_OMP_THREADS_BIND``), and a
thread inherits the CPU set of the thread that starts it, a process that of its parent. The rank's main
thread then busy-waits on those cores: on its input queue between steps and in the TP all-reduce. Our
threads there (the link's I/O thread, libzmq's I/O thread, the flusher, the sender, the prefetcher) and an
autostarted committer would share that core with the spin. Measured with a real TP=2 engine on a 2-vCPU
machine, they then got so little of it that a reader's Hello waited about 10 s in the committer's accept
backlog (``ss``: the connection queued, 3.9 KB unread on the writer's), a step stalled for 10 s, and once
in 96 cache starts a rank's heartbeats stopped until the committer reaped it and the engine died. These threads mostly sleep, so they run on every CPU the process may use; the engine's own threads
keep their pinning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_EVERY_CPU = frozenset(range(max(1024, 4 * (os.cpu_count() or 1))))
"""CPU ids enough for any machine: the kernel keeps of them the online CPUs the process's cpuset allows.
Not ``range(os.cpu_count())``: that counts online CPUs, not ids (``nosmt`` leaves ids 0, 2, 4, ...), and
from Python 3.13 ``PYTHON_CPU_COUNT`` may set it to anything. A ``taskset`` on the engine is widened too;
a cgroup cpuset is not."""


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread runs on every allowed CPU inside the block, so threads and processes it starts
    there inherit that; it gets its own CPU set back after (never a smaller one). A no-op where affinity
    cannot be read or set."""
    try:
        own = os.sched_getaffinity(0)  # the calling thread's set (Linux: pid 0 is the calling thread)
        os.sched_setaffinity(0, _EVERY_CPU | own)
    except (AttributeError, OSError) as exc:  # no affinity on this platform, or a cpuset refusing it
        logger.debug("omnishm threads keep the caller's CPU set: %s", exc)
        own = None
    try:
        yield
    finally:
        if own is not None:
            try:
                os.sched_setaffinity(0, own)
            except OSError as exc:  # a cpuset shrank meanwhile: keep what the kernel allows
                logger.warning("cannot give this thread its CPU set %s back: %s", sorted(own), exc)
