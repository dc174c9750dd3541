"""omnishm's own threads and an autostarted committer do not inherit an engine rank's pinned core.

vLLM's CPU worker pins a rank's threads to its cores and busy-waits there (omnishm/cpus.py); a real TP=2
engine starved our threads that inherited the pin (a Hello ~10 s in the accept backlog, a reader reaped).
Here the constructing thread is pinned to one CPU the way vLLM pins a rank's main thread.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from conftest import RUNTIME_DIR, unique_cache_name
from manager_helpers import small_config

from omnishm import shm
from omnishm.client import OmniPrefixCacheManager
from omnishm.shm import proc_identity


def test_the_clients_threads_and_its_autostarted_committer_run_on_every_cpu(monkeypatch):
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one CPU: nothing to pin away from")
    name = unique_cache_name("cpus")
    seen: dict = {}
    errors: list[BaseException] = []

    def rank() -> None:  # a rank's main thread, pinned like vLLM pins it
        os.sched_setaffinity(0, {min(every)})
        try:
            with OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR,
                                        connect_timeout_s=60.0) as m:
                seen["rank"] = os.sched_getaffinity(0)
                seen["link"] = os.sched_getaffinity(m._link._thread.native_id)
                seen["flusher"] = os.sched_getaffinity(m._flusher._thread._thread.native_id)
                seen["committer"] = os.sched_getaffinity(m._link.welcome.committer_pid)
                seen["pid"] = m._link.welcome.committer_pid
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    t = threading.Thread(target=rank)
    t.start()
    t.join(120)
    assert not errors, errors
    assert seen["rank"] == {min(every)}  # the engine's own pinning is left as it was
    assert seen["link"] == seen["flusher"] == seen["committer"] == every, seen
    deadline = time.monotonic() + 30
    while proc_identity(seen["pid"]) is not None and time.monotonic() < deadline:  # it exits when idle
        time.sleep(0.05)
    assert proc_identity(seen["pid"]) is None  # gone, its log removed after its lock
    assert not shm.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []


def test_unpinned_never_narrows_the_callers_cpu_set(monkeypatch):
    """``os.cpu_count()`` counts online CPUs, not ids (``nosmt`` leaves 0, 2, 4, ...; ``PYTHON_CPU_COUNT`` from
    3.13): a CPU set built from it could move a thread off its own CPU. Simulated: ids {0, 1}, one counted."""
    from omnishm import cpus

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
