"""Committer start-up and stop (``omnishm/committer/start.py``): what it takes over, refuses and leaves behind.

Mutation review (2026-12-06, stop 49): each test pins a rule no other test held.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from conftest import REPO, RUNTIME_DIR, START_TIMEOUT_S, assert_clean_stop, unique_cache_name
from helpers import catches_signal, dead_socket
from omnishm import paths, shm
from test_autostart_lifecycle import _serving, _stop


def test_a_committer_leaves_an_autostart_log_that_is_not_its_names_alone(tmp_path):
    """``start._autostart_log``: a committer's own autostart log is ``RUNTIME_DIR/NAME.autostart.log`` of its
    own name and runtime dir; an ``OMNISHM_AUTOSTART_LOG`` naming another file (inherited from a shell or a
    process tree where another cache's committer was autostarted) is not its own. A committer of another name
    started with it neither writes into that file nor removes it at its clean stop: that log belongs to the
    other cache (it says why that committer did not come up), and its own output stays where it was sent."""
    name = unique_cache_name("notmylog")
    other = unique_cache_name("othercache")
    runtime = tmp_path / "rt"
    paths.ensure_runtime_dir(runtime)
    other_log = runtime / f"{other}.autostart.log"
    other_log.write_text("the other cache's committer: why it stopped\n")
    own_out = tmp_path / "launched.log"
    env = {**os.environ, "OMNISHM_AUTOSTART_LOG": str(other_log)}
    with open(own_out, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                 str(runtime)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _serving(runtime, name, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, own_out.read_text()
    finally:
        _stop(proc)
    assert other_log.read_text() == "the other cache's committer: why it stopped\n"
    assert f"committer {name} stopped" in own_out.read_text()
    other_log.unlink()
    assert sorted(os.listdir(runtime)) == [] and shm.list_segments(name) == []


def test_a_committer_refuses_an_explicit_endpoint_whose_socket_another_process_serves(committer_factory, tmp_path):
    """``start._remove_stale_socket``: before it binds, a committer unlinks a socket file at its ipc endpoint only
    when nothing listens on it. A live process of another kind serving that path (it holds no omnishm socket
    lock, so ``_lock_socket`` lets the start through) keeps its socket: the committer refuses to start (exit 2,
    "served by a live process"), leaves /dev/shm and the runtime dir clean, and the other process's listener
    still accepts connections at the same file (ZeroMQ's bind would have unlinked it and taken the path)."""
    import socket as pysocket

    path = tmp_path / "busy.sock"
    listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(4)
        inode = path.stat().st_ino
        handle = committer_factory("--endpoint", f"ipc://{path}", name=unique_cache_name("busyep"), wait=False)
        assert handle.proc.wait(30) == 2, handle.log()
        assert "is served by a live process" in handle.log()
        assert path.stat().st_ino == inode
        probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        finally:
            probe.close()
        assert shm.list_segments(handle.name) == []
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def test_a_generation_another_committer_is_adopting_does_not_stop_the_adoption_of_the_next(monkeypatch, caplog):
    """``start.adopt_live_cache``: of several generations with clients attached, one whose owner lock another
    committer holds (it is adopting that one, from another runtime dir) is skipped, and the next one whose
    owner lock this committer gets is adopted: its clients resume instead of being refused while the new
    committer serves a fresh generation. The other committer's claim is left alone (still held)."""
    from conftest import RUNTIME_DIR

    from omnishm import liveness
    from omnishm.committer import pool as pool_mod
    from omnishm.committer import start

    name = unique_cache_name("twolive")
    taken, free = "0000aaaa", "0000bbbb"
    adopted_stub = types.SimpleNamespace(generation=free, keys={}, writers={}, max_epoch=3)

    def adopt(cls, cache, generation, *, prefault=False):
        assert (cache, generation) == (name, free), generation
        return adopted_stub

    monkeypatch.setattr(start.meta, "live_generations", lambda cache: [taken, free])
    monkeypatch.setattr(pool_mod.CachePool, "adopt", classmethod(adopt))
    other = liveness.GenerationOwner.acquire(name, taken)  # another committer adopting ``taken``
    owner = None
    try:
        with caplog.at_level("INFO", logger="omnishm.committer"):
            cfg = types.SimpleNamespace(name=name, prefault=False, runtime_dir=RUNTIME_DIR)
            pool, owner = start.adopt_live_cache(cfg)
        assert pool is adopted_stub and owner is not None
        assert liveness.generation_owned(name, free) and liveness.generation_owned(name, taken)
        assert f"generation {taken} is being adopted by another committer" in caplog.text
    finally:
        if owner is not None:
            owner.release(unlink=True)
        other.release(unlink=True)
    assert shm.list_segments(name) == []


# Stop 52's mutation review of omnishm/committer/start.py.
def test_a_committer_stopped_while_it_imports_removes_a_killed_committers_socket(committer_factory):
    """``start._start``, stopped before it started: a committer of a name whose previous committer was SIGKILLed
    (its socket file left in the runtime dir, nobody listening) and which is itself stopped by SIGTERM while it
    still imports removes that stale socket under the cache lock, and exits 0. Left there, the socket outlives
    the lock file that sweeps go by, so no ``omnishm cleanup`` and no later sweep of other names would see it:
    the runtime dir is not left as found."""
    name = unique_cache_name("stalesock")
    sock = RUNTIME_DIR / f"{name}.sock"
    dead_socket(sock)
    try:
        handle = committer_factory(name=name, wait=False)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not catches_signal(handle.proc.pid, signal.SIGTERM):  # busy poll: its first act
            assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
        assert_clean_stop(handle)  # exit 0, no segment, nothing of the name in the runtime dir
        assert "before it started" in handle.log(), handle.log()
        assert not sock.exists()
    finally:
        sock.unlink(missing_ok=True)


def test_an_autostarted_committer_that_refuses_to_start_keeps_the_log_that_says_why():
    """``start._drop_autostart_log``: the autostart log goes only at a clean stop (exit 0). A committer a client
    autostarted that refuses to start (exit 2; here its ipc endpoint's directory does not exist, so it can be
    neither locked nor bound) keeps ``NAME.autostart.log``: it is the one place that says why the cache did not
    come up, which the client's error points the operator to. Nothing else of the cache is left behind."""
    name = unique_cache_name("refusedlog")
    log_path = RUNTIME_DIR / f"{name}.autostart.log"
    missing = Path(tempfile.mkdtemp(prefix="omnishm-gone-"))  # short: under xdist, tmp_path leaves a socket path
    missing.rmdir()  # too few of its 107 bytes
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                   str(RUNTIME_DIR), "--endpoint", f"ipc://{missing}/c.sock"], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=REPO, timeout=60,
                                  env={**os.environ, "OMNISHM_AUTOSTART_LOG": str(log_path)})
        assert proc.returncode == 2
        assert log_path.exists(), "the refused committer removed the log that says why"
        assert f"cannot bind ipc://{missing}/c.sock" in log_path.read_text(), log_path.read_text()
        assert shm.list_segments(name) == []
        assert sorted(f for f in os.listdir(RUNTIME_DIR) if f.split(".", 1)[0] == name) == [log_path.name]
    finally:
        log_path.unlink(missing_ok=True)
