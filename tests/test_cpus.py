"""omnishm's own threads and an autostarted committer do not inherit an engine rank's pinned core.

vLLM's CPU worker pins a rank's threads to its cores and busy-waits there (omnishm/cpus.py); a real TP=2
engine starved our threads that inherited the pin (a Hello ~10 s in the accept backlog, a reader reaped).
Here the constructing thread is pinned to one CPU the way vLLM pins a rank's main thread.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, RUNTIME_DIR, unique_cache_name
from manager_helpers import small_config

from omnishm import cpus, liveness, shm
from omnishm.config import ConfigError
from omnishm.client import OmniPrefixCacheManager
from omnishm.liveness import proc_identity


def _bind_memory_to(node: int) -> bool:
    """The calling thread allocates on NUMA node ``node`` only (``MPOL_BIND``), as vLLM's CPU worker binds a
    rank's memory; False where the kernel or machine cannot (no NUMA, a container's seccomp profile)."""
    nr = cpus.SET_MEMPOLICY.get(platform.machine())
    if nr is None or node >= 64:
        return False
    mask = ctypes.c_ulong(1 << node)
    return ctypes.CDLL(None, use_errno=True).syscall(ctypes.c_long(nr), 2, ctypes.byref(mask), ctypes.c_ulong(64)) == 0


def _first_allowed_node() -> int:
    """The lowest NUMA node this process may allocate on (``Mems_allowed_list``: ``0``, ``0-3,5``, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Mems_allowed_list:"):
            return int(line.split()[1].split(",")[0].split("-")[0])
    return 0


def _memory_policies(pid: int) -> set[str]:
    """The NUMA policies the ``numa_maps`` of every thread of ``pid`` show (a mapping without its own policy
    shows that thread's: a thread started before the reset would keep the rank's binding)."""
    seen: set[str] = set()
    for maps in Path(f"/proc/{pid}/task").glob("*/numa_maps"):
        try:
            seen |= {line.split()[1] for line in maps.read_text().splitlines() if len(line.split()) > 1}
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended while we read
            continue
    return seen


def _libgomp() -> Path | None:
    """The libgomp torch loads: ``torch/lib`` (the CPU wheels) or ``torch.libs`` (auditwheel-vendored)."""
    root = Path(torch.__file__).parent
    found = sorted(root.glob("lib/libgomp*.so*")) + sorted(root.parent.glob("torch.libs/libgomp*.so*"))
    return found[0] if found else None


def _openmp_pins(env: dict[str, str], cpu: int) -> bool:
    """Whether a fresh Python started with ``env`` on every CPU runs on ``cpu`` alone after ``import torch``:
    whether the binding this test sets up really binds with this torch."""
    code = "import os, torch; print(sorted(os.sched_getaffinity(0)))"
    with cpus.unpinned():
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and out.stdout.strip() == str([cpu])


@pytest.mark.parametrize("rank_setup", ["cpu_set", "openmp_env", "numa_binding"])
def test_the_clients_threads_and_its_autostarted_committer_run_on_every_cpu(monkeypatch, rank_setup):
    """The rank's main thread is pinned to one CPU the way vLLM pins it, and has besides what vLLM's CPU
    worker sets up for it. ``openmp_env``: torch's libgomp preloaded and ``GOMP_CPU_AFFINITY`` naming the
    rank's core, which pinned the committer at exec whatever CPU set it started with (its loop then stood
    still for 25 s beside a real rank's spin). ``numa_binding``: its memory bound to its NUMA node, which the
    committer inherited for its whole pool."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one CPU: nothing to pin away from")
    cpu, node = min(every), _first_allowed_node()
    if rank_setup == "openmp_env":
        libgomp = _libgomp()
        if libgomp is None:
            pytest.skip("this torch ships no libgomp: vLLM's CPU worker preloads none")
        preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD", ""), str(libgomp)]))
        monkeypatch.setenv("GOMP_CPU_AFFINITY", str(cpu))
        monkeypatch.setenv("LD_PRELOAD", preload)
        if not _openmp_pins(dict(os.environ), cpu):
            pytest.skip(f"GOMP_CPU_AFFINITY with {libgomp} preloaded pins nothing here: nothing to undo")
    name = unique_cache_name("cpus")
    seen: dict = {}
    errors: list[BaseException] = []

    def rank() -> None:  # a rank's main thread
        os.sched_setaffinity(0, {cpu})
        if rank_setup == "numa_binding" and not _bind_memory_to(node):
            seen["unbindable"] = True
            return
        try:
            with OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR,
                                        connect_timeout_s=60.0) as m:
                seen["rank"] = os.sched_getaffinity(0)
                seen["link"] = os.sched_getaffinity(m._link._thread.native_id)
                seen["flusher"] = os.sched_getaffinity(m._flusher._thread._thread.native_id)
                seen["committer"] = os.sched_getaffinity(m._link.welcome.committer_pid)
                seen["pid"] = m._link.welcome.committer_pid
                seen["policies"] = _memory_policies(seen["pid"])
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    t = threading.Thread(target=rank)
    t.start()
    t.join(120)
    if seen.get("unbindable"):
        pytest.skip(f"the kernel refuses MPOL_BIND to node {node} here: nothing to undo")
    assert not errors, errors
    assert seen["rank"] == {cpu}  # the engine's own pinning is left as it was
    assert seen["link"] == seen["flusher"] == seen["committer"] == every, seen
    assert seen["policies"] or rank_setup != "numa_binding", "no numa_maps read"
    assert not any(p.startswith("bind") for p in seen["policies"]), seen  # no thread on the rank's node
    deadline = time.monotonic() + 30
    while proc_identity(seen["pid"]) is not None and time.monotonic() < deadline:  # it exits when idle
        time.sleep(0.05)
    assert proc_identity(seen["pid"]) is None  # gone, its log removed after its lock
    assert not liveness.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []


@pytest.mark.parametrize("name, dropped", [
    ("GOMP_CPU_AFFINITY", True), ("OMP_PROC_BIND", True), ("OMP_PLACES", True), ("KMP_AFFINITY", True),
    ("OMP_PROC_BIND_ALL", True), ("OMP_PLACES_DEV_0", True),
    ("OMP_NUM_THREADS", False), ("LD_PRELOAD", False), ("OMP_PROC_BINDING", False), ("PATH", False)])
def test_unbound_env_drops_openmps_binding_and_nothing_else(name, dropped):
    """Thread counts and preloads stay (the committer's torch keeps the engine's thread count); only what
    binds a thread to CPUs goes."""
    assert (name in cpus.unbound_env({name: "1", "HOME": "/root"})) is not dropped


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


_POLICIES = r"""
import json, os, sys, time, zmq
from omnishm.client import OmniPrefixCacheManager
from omnishm.interface import PrefixCacheConfig

def threads():
    return {int(t): open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}

engine_sock = zmq.Context.instance().socket(zmq.DEALER)  # the engine's own context, made first
deadline = time.monotonic() + 30
while sum(name.startswith("ZMQbg/") for name in threads().values()) < 2:  # libzmq names them once they run
    assert time.monotonic() < deadline, threads()
    time.sleep(0.01)
before = threads()
config = PrefixCacheConfig(num_blocks=16, block_size=4, staging_capacity_tokens=32, staging_depth=3)
m = OmniPrefixCacheManager(config, cache=sys.argv[1], endpoint=sys.argv[2], autostart=False)
try:
    while not {"ZMQbg/IO/0", "ZMQbg/Reaper"} <= {n for t, n in threads().items() if t not in before}:
        assert time.monotonic() < deadline + 30, threads()  # named by libzmq once they run, as above
        time.sleep(0.01)
    policy = lambda tid: os.sched_getscheduler(tid)
    ours = {name: policy(tid) for tid, name in threads().items() if tid not in before}
    ours["omnishm-link"] = policy(m._link._thread.native_id)  # Python's thread names are not the kernel's
    ours["omnishm-flusher"] = policy(m._flusher._thread._thread.native_id)
    engines = sorted(policy(tid) for tid, name in before.items() if name.startswith("ZMQbg/"))
    print(json.dumps({"ours": ours, "engine_zmq": engines, "caller": policy(0)}))
finally:
    m.shutdown()
    engine_sock.close(linger=0)
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this platform")
@pytest.mark.parametrize("knob", ["batch", "inherit"])
def test_the_clients_threads_run_under_sched_batch_and_the_engines_keep_theirs(committer, knob):
    """With ``helper_sched = batch``, every thread a manager starts (libzmq's I/O thread and reaper of omnishm's own ZeroMQ context, the
    link's I/O thread, the flusher) runs under SCHED_BATCH, so a step's descriptor that wakes one never
    preempts the engine thread (omnishm/cpus.py: 190-690 us a send otherwise). The thread that built the
    manager gets SCHED_OTHER back, and the engine's own ZeroMQ context (``zmq.Context.instance()``, made
    first) keeps its threads as they were. ``helper_sched = inherit`` (the default) leaves every policy as it
    was."""
    env = {**os.environ, "OMNISHM_HELPER_SCHED": knob, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _POLICIES, committer.name, committer.endpoint], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    want = os.SCHED_BATCH if knob == "batch" else os.SCHED_OTHER
    assert {"ZMQbg/IO/0", "ZMQbg/Reaper", "omnishm-link", "omnishm-flusher"} <= set(seen["ours"]), seen
    assert set(seen["ours"].values()) == {want}, seen
    assert seen["engine_zmq"] == [os.SCHED_OTHER, os.SCHED_OTHER], seen
    assert seen["caller"] == os.SCHED_OTHER, seen


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
@pytest.mark.parametrize("policy", ["SCHED_IDLE", "SCHED_BATCH"])
def test_as_helper_changes_only_the_normal_policy(policy, monkeypatch):
    """A caller under another policy than SCHED_OTHER passes its own on and keeps it: one under SCHED_IDLE
    could not get it back unprivileged, one under a real-time policy not without a privilege either."""
    monkeypatch.setattr(cpus, "_HELPERS_BATCHED", True)  # helper_sched = batch
    want = getattr(os, policy)
    seen: dict = {}

    def caller() -> None:  # a thread of its own: its policy dies with it
        os.sched_setscheduler(0, want, os.sched_param(0))
        with cpus.as_helper():
            child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getscheduler(0)))
            child.start()
            child.join()
            seen["inside"] = os.sched_getscheduler(0)
        seen["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=caller)
    t.start()
    t.join(30)
    assert seen == {"child": want, "inside": want, "after": want}


def test_a_bad_helper_sched_is_refused_by_name_before_a_manager_builds_anything(monkeypatch):
    """The knob is read once per process, by the first link, before it makes a socket or a thread."""
    monkeypatch.setattr(cpus, "_HELPERS_BATCHED", None)  # as in a process that has read it not yet
    monkeypatch.setenv("OMNISHM_HELPER_SCHED", "fifo")
    made: list = []
    real_socketpair = socket.socketpair
    monkeypatch.setattr(socket, "socketpair", lambda *a: made.append(a) or real_socketpair(*a))
    threads = threading.active_count()
    name = unique_cache_name("cpus")
    with pytest.raises(ConfigError, match=r"helper_sched = 'fifo' \(from env OMNISHM_HELPER_SCHED\): use one of "
                                          r"inherit, batch"):
        OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR)
    assert threading.active_count() == threads and cpus._HELPERS_BATCHED is None
    assert made == []  # not even the link's wake socketpair (left to the garbage collector otherwise)
    assert list(RUNTIME_DIR.glob(f"{name}*")) == []  # nothing was started


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this platform")
def test_a_committer_autostarted_on_a_resume_gets_the_engines_policy_not_the_io_threads(monkeypatch):
    """The first committer is autostarted by the thread that builds the manager; after the committer is
    killed, the link's I/O thread (a helper, under SCHED_BATCH) autostarts the next one while it resumes.
    Both start under the engine thread's policy (review of the change: the second one inherited BATCH)."""
    monkeypatch.setattr(cpus, "_HELPERS_BATCHED", True)  # helper_sched = batch
    name = unique_cache_name("cpus")
    with OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR,
                                connect_timeout_s=60.0) as m:
        first = m._link.welcome.committer_pid
        assert os.sched_getscheduler(m._link._thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(first) == os.SCHED_OTHER == os.sched_getscheduler(0)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while m._link.welcome.committer_pid == first:  # the I/O thread resumes with the one it started
            assert time.monotonic() < deadline, "the link did not resume with a new committer"
            time.sleep(0.05)
        second = m._link.welcome.committer_pid
        assert os.sched_getscheduler(second) == os.SCHED_OTHER
    deadline = time.monotonic() + 30
    while proc_identity(second) is not None and time.monotonic() < deadline:  # it exits when idle
        time.sleep(0.05)
    assert proc_identity(second) is None
    assert not liveness.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []
