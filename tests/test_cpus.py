"""omnishm's own threads and an autostarted committer do not inherit an engine rank's pinned core.

vLLM's CPU worker pins a rank's threads to its cores and busy-waits there (omnishm/cpus.py); a real TP=2
engine starved our threads that inherited the pin (a Hello ~10 s in the accept backlog, a reader reaped).
Here the constructing thread is pinned to one CPU the way vLLM pins a rank's main thread.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import RUNTIME_DIR, unique_cache_name
from manager_helpers import small_config

from omnishm import cpus, shm
from omnishm.client import OmniPrefixCacheManager
from omnishm.shm import proc_identity


def _bind_memory_to(node: int) -> bool:
    """The calling thread allocates on NUMA node ``node`` only (``MPOL_BIND``), as vLLM's CPU worker binds a
    rank's memory; False where the kernel or machine cannot."""
    nr = cpus.SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return False
    mask = ctypes.c_ulong(1 << node)
    return ctypes.CDLL(None, use_errno=True).syscall(ctypes.c_long(nr), 2, ctypes.byref(mask), ctypes.c_ulong(64)) == 0


def _memory_policies(pid: int) -> set[str]:
    """The NUMA policies ``/proc/PID/numa_maps`` shows (a mapping without its own: the process's)."""
    with open(f"/proc/{pid}/numa_maps") as f:
        return {line.split()[1] for line in f if len(line.split()) > 1}


@pytest.mark.parametrize("vllm_cpu_env", [False, True], ids=["cpu_set", "cpu_set_openmp_env_and_numa_binding"])
def test_the_clients_threads_and_its_autostarted_committer_run_on_every_cpu(monkeypatch, vllm_cpu_env):
    """``vllm_cpu_env``: the rank also has what vLLM's CPU worker sets up for it: torch's libgomp preloaded and
    ``GOMP_CPU_AFFINITY`` naming the rank's core, which pinned the committer at ``import torch`` whatever CPU
    set it started with (its loop then stood still for 25 s beside a real rank's spin), and its memory bound
    to its NUMA node, which the committer inherited for its whole pool."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one CPU: nothing to pin away from")
    if vllm_cpu_env:
        monkeypatch.setenv("GOMP_CPU_AFFINITY", str(min(every)))
        libgomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
        if libgomp.exists():  # as vLLM's CPU platform preloads it; the variable alone pins at import torch
            monkeypatch.setenv("LD_PRELOAD", str(libgomp))
    name = unique_cache_name("cpus")
    seen: dict = {}
    errors: list[BaseException] = []

    def rank() -> None:  # a rank's main thread, pinned like vLLM pins it
        os.sched_setaffinity(0, {min(every)})
        seen["bound"] = vllm_cpu_env and _bind_memory_to(0)
        try:
            with OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR,
                                        connect_timeout_s=60.0) as m:
                seen["rank"] = os.sched_getaffinity(0)
                seen["link"] = os.sched_getaffinity(m._link._thread.native_id)
                seen["flusher"] = os.sched_getaffinity(m._flusher._thread._thread.native_id)
                seen["committer"] = os.sched_getaffinity(m._link.welcome.committer_pid)
                seen["pid"] = m._link.welcome.committer_pid
                seen["policies"] = _memory_policies(seen["pid"]) if seen["bound"] else set()
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    t = threading.Thread(target=rank)
    t.start()
    t.join(120)
    assert not errors, errors
    assert seen["rank"] == {min(every)}  # the engine's own pinning is left as it was
    assert seen["link"] == seen["flusher"] == seen["committer"] == every, seen
    # The rank's binding took wherever the kernel has NUMA policies, and the committer dropped it.
    numa = Path("/proc/self/numa_maps").exists() and platform.machine() in cpus.SET_MEMPOLICY
    assert seen["bound"] == (vllm_cpu_env and numa)
    assert not any(p.startswith("bind") for p in seen["policies"]), seen  # not on the rank's node
    deadline = time.monotonic() + 30
    while proc_identity(seen["pid"]) is not None and time.monotonic() < deadline:  # it exits when idle
        time.sleep(0.05)
    assert proc_identity(seen["pid"]) is None  # gone, its log removed after its lock
    assert not shm.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []


def test_unpinned_never_narrows_the_callers_cpu_set(monkeypatch):
    """``os.cpu_count()`` counts online CPUs, not ids (``nosmt`` leaves 0, 2, 4, ...; ``PYTHON_CPU_COUNT`` from
    3.13): a CPU set built from it could move a thread off its own CPU. Simulated: ids {0, 1}, one counted."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one CPU: nothing to pin away from")
    monkeypatch.setattr(cpus, "_EVERY_CPU", frozenset({min(every)}))
    pinned = {max(every)}
    os.sched_setaffinity(0, pinned)
    try:
        with cpus.unpinned():
            inside = os.sched_getaffinity(0)
        after = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, every)
    assert inside >= pinned and after == pinned
