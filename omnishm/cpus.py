"""The CPUs omnishm's own threads run on, and the CPUs and memory policy of a committer a client autostarts.

vLLM's CPU worker pins each TP rank's threads to that rank's cores (``VLLM_CPU_OMP_THREADS_BIND``), and a
thread inherits the CPU set of the thread that starts it, a process that of its parent. The rank's main
thread then busy-waits on those cores: on its input queue between steps and in the TP all-reduce. Our
threads there (the link's I/O thread, libzmq's I/O thread, the flusher, the sender, the prefetcher) and an
autostarted committer would share that core with the spin. Measured with a real TP=2 engine on a 2-vCPU
machine, they then got so little of it that a reader's Hello waited about 10 s in the committer's accept
backlog (``ss``: the connection queued, 3.9 KB unread on the writer's), a step stalled for 10 s, and once
in 96 cache starts a rank's heartbeats stopped until the committer reaped it and the engine died. These threads mostly sleep, so they run on every CPU the process may use; the engine's own threads
keep their pinning.

With the knob ``helper_sched = batch`` they also run under ``SCHED_BATCH`` (``as_helper``). A thread the
engine thread wakes, above all libzmq's I/O thread, which every step's descriptor wakes, otherwise
preempts the engine thread on its own core when the other cores are busy: the kernel favours a thread
that slept. On a 2-vCPU machine right after a forward (torch's OpenMP worker still spinning on the other
core) a step's ``zmq_send`` took 190-690 us (median of 130 steps; eight runs), and 45-54 us with that I/O
thread under ``SCHED_BATCH``, which never preempts on wakeup and gets its fair share at the next tick.
It is not the default (``inherit``): where every core busy-waits, as in vLLM's CPU backend with a rank
per core, preempting a spinning thread costs nothing and waiting for a tick does: a real TP=2 engine on
that machine took 18.6-20.0 s for the tier's TP test with it against 18.0-19.3 s without (four runs
each), and figure 6's step ratio did not move (docs/DESIGN-NOTES.md). Only the normal policy is changed:
an engine thread under a real-time policy or ``SCHED_IDLE`` passes its own on. The committer is left
alone (its threads made no difference): an autostarted one starts under the policy of the thread that
built the manager, whichever thread starts it (the link's I/O thread does on a resume), and a launched
one under the operator's (``chrt --batch 0``).

A CPU set is not all a process inherits from a rank: vLLM also sets OpenMP's binding variables there
(``GOMP_CPU_AFFINITY`` to the rank's cores, torch's libgomp in ``LD_PRELOAD``), and libgomp binds the thread
that loads it, at ``import torch`` or at exec when preloaded. An autostarted committer started with them ran
pinned to its rank's first core however wide its CPU set was at fork: on a 2-vCPU machine its loop stood
still for 25.8 s beside the rank's spin, and the other rank's Hello went unanswered until the engine died
(the TP=2 tier's intermittent failure). So it starts without them (``unbound_env``). The rank's NUMA
memory binding (``MPOL_BIND`` to the rank's node, set by vLLM's CPU worker) is inherited the same way, and
an autostarted committer drops it first thing (``default_memory_policy``): else the whole pool it first
touches lands on one rank's node, and cannot grow once that node is full while others are free.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import sys
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

_EVERY_CPU = frozenset(range(max(1024, 4 * (os.cpu_count() or 1))))
"""CPU ids enough for any machine: the kernel keeps of them the online CPUs the process's cpuset allows.
Not ``range(os.cpu_count())``: that counts online CPUs, not ids (``nosmt`` leaves ids 0, 2, 4, ...), and
from Python 3.13 ``PYTHON_CPU_COUNT`` may set it to anything. A ``taskset`` on the engine is widened too;
a cgroup cpuset is not."""

OPENMP_BINDING = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")
"""OpenMP's thread-binding variables (``KMP_AFFINITY`` is Intel's libiomp5). Each binds the thread that loads
the runtime, at exec when it is preloaded or at ``import torch``: ``GOMP_CPU_AFFINITY`` and ``KMP_AFFINITY``
to the first CPU they name, ``OMP_PROC_BIND`` with ``OMP_PLACES`` to the first place; whatever CPU set the
process started with. libgomp 13 and newer also read ``OMP_PROC_BIND`` and ``OMP_PLACES`` with a device
suffix (``_ALL``, ``_DEV``, ``_DEV_<n>``): those go too."""


def unbound_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without OpenMP's binding variables (``OPENMP_BINDING`` and their device-suffixed forms): for a
    process a rank starts that must run on every CPU (an autostarted committer). ``LD_PRELOAD`` stays: a
    preloaded libgomp binds nothing without them, and the engine may preload other libraries there."""
    return {k: v for k, v in env.items() if not _binds(k)}


def _binds(name: str) -> bool:
    return name in OPENMP_BINDING or name.startswith(("OMP_PROC_BIND_", "OMP_PLACES_"))


SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "riscv64": 237, "ppc64le": 261, "ppc64": 261, "s390x": 270}
"""``set_mempolicy``'s system call number by machine (glibc has no wrapper; libnuma may not be installed)."""
MPOL_DEFAULT = 0


def default_memory_policy() -> bool:
    """The calling thread, and every thread and process it starts after, allocates by the system's default
    NUMA policy (the node of the CPU that first touches a page), whatever policy it inherited. An
    autostarted committer calls it on its main thread before it starts any other. Returns False where it
    cannot be set: logged at debug where there is nothing to drop (not Linux, a kernel without NUMA, an
    unknown machine), at info where the kernel refused it (a container's seccomp profile)."""
    nr = SET_MEMPOLICY.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        logger.debug("memory policy left as inherited: no set_mempolicy number for %s", platform.machine())
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(nr), MPOL_DEFAULT, None, ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        # ENOSYS: a kernel without NUMA, where there is nothing to drop. Anything else (EPERM from a
        # container's seccomp profile) may leave the pool bound to one rank's node: worth a line in the log.
        logger.log(logging.DEBUG if err == errno.ENOSYS else logging.INFO,
                   "memory policy left as inherited: set_mempolicy: %s", os.strerror(err))
        return False
    return True


HELPER_SCHED = ("inherit", "batch")
"""The values of the ``helper_sched`` knob."""


def check_helper_sched(value: str) -> str:
    """``value`` if it is one of ``HELPER_SCHED``; ValueError otherwise (the ``helper_sched`` knob's check)."""
    if value not in HELPER_SCHED:
        raise ValueError(f"use one of {', '.join(HELPER_SCHED)}")
    return value


_HELPERS_BATCHED: bool | None = None
"""``helper_sched == "batch"``, read once per process (``helpers_batched``)."""


def helpers_batched() -> bool:
    """Whether omnishm's helper threads run under ``SCHED_BATCH`` (knob ``helper_sched``); any thread.

    Read once per process, at the first call (a manager's link calls it before it builds anything), so a
    later change of the environment or the config file cannot fail a thread's start halfway through a
    resume. Raises ``ConfigError`` for a bad value (and stays unread, so every later call raises too)."""
    global _HELPERS_BATCHED
    if _HELPERS_BATCHED is None:
        from omnishm.config import resolve  # here, not at the top: config imports this module

        _HELPERS_BATCHED = resolve("client", names=("helper_sched",))["helper_sched"] == "batch"
    return _HELPERS_BATCHED


def thread_policy() -> int | None:
    """The calling thread's scheduling policy (``os.SCHED_*``), or None where it cannot be read."""
    try:
        return os.sched_getscheduler(0)  # the calling thread's (Linux: pid 0)
    except (AttributeError, OSError):
        return None


@contextlib.contextmanager
def as_helper() -> Iterator[None]:
    """The calling thread is set up the way omnishm's helper threads run inside the block, so the threads
    (and libzmq I/O threads) it starts there inherit it: on every allowed CPU (``unpinned``) and, with the
    ``helper_sched`` knob at ``batch`` (not the default), under ``SCHED_BATCH`` when it runs under the
    normal policy. It gets its CPU set and policy back after. Raises ``ConfigError`` for a bad ``helper_sched``
    (``helpers_batched``); a policy the kernel refuses (a container's seccomp profile) is logged and left
    as it was."""
    batch = helpers_batched()
    with unpinned(), (scheduled(getattr(os, "SCHED_BATCH", None)) if batch else contextlib.nullcontext()):
        yield


_NORMAL = frozenset((os.SCHED_OTHER, os.SCHED_BATCH)) if hasattr(os, "SCHED_BATCH") else frozenset()
"""The two policies ``scheduled`` switches between (none where the platform has no ``SCHED_BATCH``)."""
_RESET_ON_FORK = getattr(os, "SCHED_RESET_ON_FORK", 0)


@contextlib.contextmanager
def scheduled(policy: int | None) -> Iterator[None]:
    """The calling thread runs under ``policy`` inside the block, if that and its own are ``SCHED_OTHER``
    and ``SCHED_BATCH``; it gets its own back after. Anything else is left as it is: a real-time policy
    could not be taken back without a privilege, and leaving ``SCHED_IDLE`` needs one too. Nor is a thread
    with ``SCHED_RESET_ON_FORK`` (logged): the threads and processes it starts get ``SCHED_OTHER`` whatever
    its policy is."""
    own = thread_policy()
    changed = policy in _NORMAL and own in _NORMAL and own != policy
    if policy in _NORMAL and own is not None and own & _RESET_ON_FORK:
        logger.info("this thread keeps its scheduling policy %#x: it resets its children's (SCHED_RESET_ON_FORK)",
                    own)
    if changed:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except OSError as exc:  # a seccomp profile refusing sched_setscheduler
            logger.info("this thread keeps its scheduling policy %s: %s", own, exc)
            changed = False
    try:
        yield
    finally:
        if changed:
            try:
                os.sched_setscheduler(0, own, os.sched_param(0))
            except OSError as exc:  # between the two normal policies this needs no privilege: said if it fails
                logger.warning("cannot give this thread its scheduling policy %s back: %s", own, exc)


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
