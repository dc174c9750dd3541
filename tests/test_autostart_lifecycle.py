"""Autostarted committers: where they bind, when they exit, what they leave behind.

Each test starts real committers the way a client autostarts them (``OMNISHM_AUTOSTART_LOG``,
``--spawned-by``), in a private runtime dir: the endpoint a client asked for, socket directories others
can write, a starter that is gone before or after the lock, a lost race for the lock, and the
autostart log kept or removed at the stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnishm import liveness, paths, protocol, shm

from conftest import START_TIMEOUT_S, assert_clean_stop
from helpers import Writer, catches_signal

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def assert_idle_committer_exits(runtime, name: str, timeout_s: float = 30.0) -> None:
    """An ``--exit-when-idle`` committer whose last client left exits (bounded wait) and leaves no segment."""
    deadline = time.monotonic() + timeout_s
    while liveness.cache_is_live(runtime, name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not liveness.cache_is_live(runtime, name), "the autostarted committer did not exit when its client left"
    assert shm.list_segments(name) == []


def test_autostart_serves_the_endpoint_the_client_asked_for(tmp_path):
    """An autostarted committer binds the client's own ipc endpoint, and exits (cleanly) when it leaves."""
    from conftest import unique_cache_name
    from manager_helpers import Part, save, small_config, started
    from omnishm.client import OmniPrefixCacheManager

    name = unique_cache_name("auto")
    runtime = tmp_path / "rt"
    socks = tmp_path / "socks"
    socks.mkdir(mode=0o700)
    endpoint = f"ipc://{socks}/custom-{name}.sock"
    m = OmniPrefixCacheManager(small_config(), cache=name, endpoint=endpoint, autostart=True, runtime_dir=runtime,
                               connect_timeout_s=60.0)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], 4))
        m.wait_idle()
    finally:
        m.shutdown()
    assert_idle_committer_exits(runtime, name)


def test_a_client_refuses_a_socket_directory_others_can_write(tmp_path):
    """Another user could have put their own socket there and read our Hello and descriptors."""
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by nobody else"):
        OmniPrefixCacheManager(small_config(), cache="tsafe", endpoint=f"ipc://{shared}/tsafe.sock", autostart=False)


def test_a_client_accepts_a_sticky_shared_directory_like_tmp_once_its_committers_socket_is_there(
        tmp_path, committer_factory):
    """In a sticky directory (/tmp) nobody else can remove or replace our socket once it is there: no
    PermissionError. Before it is there anyone may bind one at the name (REVIEW 2026-12-05, permissions: the
    client connected, and another user's socket got its Hello): the client refuses to connect then."""
    from conftest import unique_cache_name, wait_ready
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    name = unique_cache_name("tsafe")
    endpoint = f"ipc://{shared}/{name}.sock"
    with pytest.raises(PermissionError, match=f"socket {shared}/{name}.sock does not exist yet in the shared "
                                              f"directory {shared}: anyone may bind a socket there first"):
        OmniPrefixCacheManager(small_config(), cache=name, endpoint=endpoint, autostart=False, connect_timeout_s=5)
    handle = committer_factory("--endpoint", endpoint, name=name, wait=False)
    handle.endpoint = endpoint
    wait_ready(handle)
    with OmniPrefixCacheManager(small_config(), cache=name, endpoint=endpoint, autostart=False) as m:
        assert m._link.welcome.committer_pid == handle.proc.pid


_SPAWN_AND_LEAVE = """
import sys, time
from pathlib import Path
from omnishm import liveness, paths, shm
from omnishm.client.committer_process import start_committer
name, rt = sys.argv[1], Path(sys.argv[2])
paths.ensure_runtime_dir(rt)
proc = start_committer(name, rt)
deadline = time.monotonic() + 60
while not liveness.cache_is_live(rt, name) and time.monotonic() < deadline:
    time.sleep(0.05)
print(proc.pid, liveness.cache_is_live(rt, name), flush=True)
"""


def test_an_autostarted_committer_nobody_attached_to_exits_when_its_starter_is_gone(tmp_path):
    """Two ranks that both autostart start two committers; the slower may get the cache lock after the
    other served the whole run and exited. Nobody attaches to it: once the process that started it is
    gone it exits cleanly (lock, socket, segments and log removed), well before the 60 s unused limit."""
    from conftest import unique_cache_name
    from omnishm.liveness import proc_identity
    from omnishm.committer.server import UNUSED_EXIT_S

    name = unique_cache_name("spawn")
    runtime = tmp_path / "rt"
    out = subprocess.run([sys.executable, "-c", _SPAWN_AND_LEAVE, name, str(runtime)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid, live = out.stdout.split()
    assert live == "True", "the autostarted committer never came up"
    gone_by = time.monotonic() + UNUSED_EXIT_S / 3
    while liveness.cache_is_live(runtime, name) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not liveness.cache_is_live(runtime, name), "an unused committer outlived the client that started it"
    deadline = time.monotonic() + 10
    while proc_identity(int(pid)) is not None and time.monotonic() < deadline:  # exited (a zombie counts)
        time.sleep(0.05)
    assert proc_identity(int(pid)) is None
    assert shm.list_segments(name) == []
    assert not (runtime / f"{name}.autostart.log").exists(), "it did not stop cleanly (its log was kept)"


_SPAWN_AND_DIE = """
import os, sys
from pathlib import Path
from omnishm import liveness, paths, shm
from omnishm.client.committer_process import start_committer
name, rt = sys.argv[1], Path(sys.argv[2])
paths.ensure_runtime_dir(rt)
print(start_committer(name, rt).pid, flush=True)
os._exit(0)  # gone before its committer imported torch and took the cache lock
"""


def test_an_autostarted_committer_exits_when_its_starter_is_gone_before_it_took_the_lock(tmp_path):
    """The rank that autostarted a committer is killed before that committer even took the cache lock (the
    demo killed right after its ranks attached: the slower of two autostarted committers gets the lock only
    after the other exited). Nobody attaches; it must not hold the lock, socket and owner segment for the
    60 s unused limit (the starter is not its parent any more when it looks: it is known by pid and start
    time instead)."""
    from conftest import unique_cache_name
    from omnishm.liveness import proc_identity
    from omnishm.committer.server import UNUSED_EXIT_S

    name = unique_cache_name("orphan")
    runtime = tmp_path / "rt"
    out = subprocess.run([sys.executable, "-c", _SPAWN_AND_DIE, name, str(runtime)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    ident = proc_identity(pid)
    try:
        # Up (lock held) or already gone; a start under load takes seconds (import torch).
        deadline = time.monotonic() + 60
        while not liveness.cache_is_live(runtime, name) and proc_identity(pid) is not None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        gone_by = time.monotonic() + UNUSED_EXIT_S / 3
        while proc_identity(pid) is not None and time.monotonic() < gone_by:
            time.sleep(0.05)
        log = runtime / f"{name}.autostart.log"
        assert proc_identity(pid) is None, ("an unused committer outlived the client that started it:\n"
                                            + (log.read_text() if log.exists() else ""))
    finally:
        if ident is not None and proc_identity(pid) == ident:  # failed: stop it (it unlinks what it made)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while proc_identity(pid) == ident and time.monotonic() < deadline:
                time.sleep(0.05)
    assert not liveness.cache_is_live(runtime, name)
    assert shm.list_segments(name) == []
    assert sorted(p.name for p in runtime.iterdir()) == [], "it did not stop cleanly (lock, socket or log kept)"


def test_spawned_by_takes_a_pid_and_optionally_its_start_time():
    from omnishm.committer.config import build_parser

    assert build_parser().parse_args(["--spawned-by", "12:345"]).spawned_by == (12, "345")
    assert build_parser().parse_args(["--spawned-by", "12"]).spawned_by == (12, "")
    assert build_parser().parse_args([]).spawned_by == (0, "")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--spawned-by", "12:x"])


def test_a_client_whose_autostarted_committer_lost_the_lock_autostarts_again(tmp_path, monkeypatch):
    """The committer this client started is refused (another committer holds the cache lock), and that
    other one is gone before this client's Hello reached it: the client starts one again once nothing
    holds the lock, instead of waiting out connect_timeout_s on a dead endpoint."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager, attach as attach_mod

    name = unique_cache_name("relock")
    runtime = tmp_path / "rt"
    real_start = attach_mod.start_committer  # looked up there at call time (_autostart_if_down)
    started: list[int] = []

    def start_while_another_holds_the_lock(cache, runtime_dir, **kw):
        if started:
            proc = real_start(cache, runtime_dir, **kw)
            started.append(proc.pid)
            return proc
        other = liveness.CacheLock.acquire(runtime_dir, cache, "other")  # another rank's committer, say
        assert other is not None
        try:
            proc = real_start(cache, runtime_dir, **kw)
            deadline = time.monotonic() + 60
            while proc.alive() and time.monotonic() < deadline:  # not its child: no exit status to wait for
                time.sleep(0.05)
            log = (runtime_dir / f"{cache}.autostart.log").read_text()
            assert not proc.alive() and "refusing to start a second one" in log, log
        finally:
            other.release(remove=True)  # ... which exits before this client's Hello reached it
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(attach_mod, "start_committer", start_while_another_holds_the_lock)
    m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=runtime,
                               connect_timeout_s=60.0)
    try:
        assert len(started) == 2 and m._link.welcome.committer_pid == started[1]
    finally:
        m.shutdown()
    assert_idle_committer_exits(runtime, name)


def test_an_autostarted_committer_that_lost_the_race_is_stopped_by_its_client(tmp_path, monkeypatch, committer_factory):
    """Two ranks autostart at once and the other rank's committer welcomes this client while this client's
    own committer is still starting (slowed here by SIGSTOP; in a real TP=2 vLLM engine by ``import torch``
    on a core the busy rank shares). The client stops it on the Welcome. Without that, a cache shorter-lived
    than that start-up (the winner served it and exited) was taken over by the slow committer, which then
    held the cache's lock, socket and owner segment with nobody to serve until its spawner exited."""
    from conftest import RUNTIME_DIR, unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager, attach as attach_mod

    name = unique_cache_name("loser")
    real_start = attach_mod.start_committer  # looked up there at call time (_autostart_if_down)
    mine: list = []
    winner: list = []

    def slow_start_and_another_rank_wins(cache, runtime_dir, **kw):
        proc = real_start(cache, runtime_dir, **kw)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not catches_signal(proc.pid, signal.SIGTERM):  # its first act; then it imports torch for seconds
            assert proc.alive() and time.monotonic() < deadline
        os.kill(proc.pid, signal.SIGSTOP)  # long before it could reach the cache lock
        mine.append(proc)
        if not winner:
            winner.append(committer_factory(name=cache))  # the other rank's committer, up and serving
        return proc

    monkeypatch.setattr(attach_mod, "start_committer", slow_start_and_another_rank_wins)
    try:
        m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=RUNTIME_DIR,
                                   connect_timeout_s=60.0)
        try:
            assert len(mine) == 1 and m._link.welcome.committer_pid == winner[0].proc.pid
        finally:
            m.shutdown()
        assert_clean_stop(winner[0])  # the winner is gone, and the cache lock is free ...
    finally:
        for proc in mine:
            os.kill(proc.pid, signal.SIGCONT)  # ... when the slow one goes on
    (loser,) = mine
    deadline = time.monotonic() + 60
    while loser.alive() and time.monotonic() < deadline:  # not this process's child: no exit status
        time.sleep(0.05)
    assert not loser.alive()
    log = RUNTIME_DIR / f"{name}.autostart.log"
    assert not log.exists(), log.read_text()  # stopped cleanly before it started: nothing made, log removed
    assert not liveness.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []


def _start_as_autostarted(name: str, tmp_path: Path) -> tuple[Path, Path, subprocess.Popen]:
    """A committer of ``name`` in its own runtime dir, its output in ``NAME.autostart.log`` there, told so as an
    autostarting client tells it (``OMNISHM_AUTOSTART_LOG``). Returns the runtime dir, the log and the process."""
    runtime = tmp_path / "rt"
    paths.ensure_runtime_dir(runtime)
    log_path = runtime / f"{name}.autostart.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                 str(runtime)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMNISHM_AUTOSTART_LOG": str(log_path)})
    return runtime, log_path, proc


def test_an_autostarted_committer_stopped_while_starting_removes_its_log(tmp_path):
    """Stopped before it started (exit 0), an autostarted committer removes its autostart log like any clean stop."""
    from conftest import unique_cache_name

    name = unique_cache_name("early")
    runtime, log_path, proc = _start_as_autostarted(name, tmp_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not catches_signal(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not log_path.exists() and sorted(os.listdir(runtime)) == [] and shm.list_segments(name) == []


def test_autostart_serves_the_cache_own_socket_whatever_omnishm_endpoint_says(tmp_path, monkeypatch):
    """README/CLIENT.md: with ``cache`` given and no ``endpoint``, the endpoint is that cache's own socket,
    whatever OMNISHM_ENDPOINT says. The autostarted committer inherits the runner's environment, so it
    must be told that endpoint too, or it binds OMNISHM_ENDPOINT and the client never gets a Welcome."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    name = unique_cache_name("autoenv")
    runtime = tmp_path / "rt"
    socks = tmp_path / "socks"
    socks.mkdir(mode=0o700)
    monkeypatch.setenv("OMNISHM_ENDPOINT", f"ipc://{socks}/someone-else.sock")  # e.g. another stage's
    m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=runtime,
                               connect_timeout_s=20.0)
    try:
        assert m._link.endpoint == paths.ipc_endpoint(runtime, name)
    finally:
        m.shutdown()
    assert_idle_committer_exits(runtime, name)


@pytest.mark.parametrize("attached", [False, True], ids=["unused", "writer-attached"])
def test_an_autostarted_committer_stopped_with_a_writer_attached_warns_and_keeps_its_log(tmp_path, attached):
    """A stop signal takes the cache from the clients attached: the committer says so as a warning, and an
    autostarted one then keeps its log after its clean stop (exit 0, every segment unlinked), where whoever
    looks for why a rank lost its committer finds it. Stopped with nobody attached it removes its log."""
    from conftest import unique_cache_name

    name = unique_cache_name("warned")
    runtime, log_path, proc = _start_as_autostarted(name, tmp_path)
    writer = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (runtime / f"{name}.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        if attached:
            writer = Writer(paths.ipc_endpoint(runtime, name), name, LAYOUT, 4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if writer is not None:
            writer.raw.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert shm.list_segments(name) == []
    if attached:
        text = log_path.read_text()
        assert "WARNING" in text and "stopped (SIGTERM) with 1 client(s) attached, which lose the cache" in text, text
        assert sorted(os.listdir(runtime)) == [log_path.name]
    else:
        assert sorted(os.listdir(runtime)) == []


def _another_autostart(name: str, runtime: Path) -> subprocess.Popen:
    """One more committer of ``name`` autostarted into ``runtime``: its output appended to the same log."""
    log_path = runtime / f"{name}.autostart.log"
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                 str(runtime)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMNISHM_AUTOSTART_LOG": str(log_path)})


def _serving(runtime: Path, name: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (liveness.cache_is_live(runtime, name) and (runtime / f"{name}.sock").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, "the committer did not come up"
        time.sleep(0.05)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_loser_stopped_while_starting_leaves_the_running_committers_log(tmp_path):
    """Autostarts of one name share ``NAME.autostart.log``. A losing committer its client stops while it is
    still starting (exit 0) must not remove the log the running one writes to (review: it did)."""
    from conftest import unique_cache_name

    name = unique_cache_name("sharedlog")
    runtime, log_path, winner = _start_as_autostarted(name, tmp_path)
    loser = None
    try:
        _serving(runtime, name, winner)
        loser = _another_autostart(name, runtime)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not catches_signal(loser.pid, signal.SIGTERM):
            assert loser.poll() is None and time.monotonic() < deadline
        loser.send_signal(signal.SIGTERM)
        assert loser.wait(30) == 0
        assert winner.poll() is None and log_path.exists()
        assert "before it started" in log_path.read_text()
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(30) == 0
    finally:
        _stop(winner, *([loser] if loser is not None else []))
    assert not log_path.exists() and sorted(os.listdir(runtime)) == [] and shm.list_segments(name) == []


@pytest.mark.parametrize("how", ["refused at the lock", "stopped while starting", "refused, the launched one warned"])
def test_a_launched_committer_removes_the_log_of_an_autostarted_one_that_lost_to_it(tmp_path, how):
    """A client found the lock free and autostarted a committer, but one launched beside it
    (scripts/launch_committer.sh: no autostart log of its own) took the lock first. The loser ends (refused,
    exit 2, or stopped by its client while starting, exit 0) and its log stays, since only a lock holder may
    remove it. The launched committer's clean stop removes it: nothing else of this name ever would have
    (review, 2026-12-06: the runtime dir was left with ``NAME.autostart.log``). Also when the launched one
    logged a warning (a mutation review, 2026-12-06): that warning is in its own output, not in the loser's
    file (here the one a bare ``--spawned-by PID`` that is not its parent logs)."""
    from conftest import unique_cache_name

    name = unique_cache_name("launchedwins")
    runtime = tmp_path / "rt"
    paths.ensure_runtime_dir(runtime)
    log_path = runtime / f"{name}.autostart.log"
    launched_log = tmp_path / "launched.log"
    with open(launched_log, "wb") as out:
        warns = ["--spawned-by", "1"] if how == "refused, the launched one warned" else []
        launched = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                     str(runtime), *warns], stdout=out, stderr=subprocess.STDOUT)
    loser = None
    try:
        _serving(runtime, name, launched)
        loser = _another_autostart(name, runtime)
        if how != "stopped while starting":
            assert loser.wait(60) == 2
            assert "refusing to start a second one" in log_path.read_text()
        else:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not catches_signal(loser.pid, signal.SIGTERM):
                assert loser.poll() is None and time.monotonic() < deadline
            loser.send_signal(signal.SIGTERM)
            assert loser.wait(30) == 0
            assert "before it started" in log_path.read_text()
        assert launched.poll() is None and log_path.exists()
        launched.send_signal(signal.SIGTERM)
        assert launched.wait(30) == 0, launched_log.read_text()
        assert ("WARNING" in launched_log.read_text()) == bool(warns)
    finally:
        _stop(launched, *([loser] if loser is not None else []))
    assert sorted(os.listdir(runtime)) == [] and shm.list_segments(name) == []


def test_a_client_that_started_no_committer_is_not_sent_to_an_autostart_log(committer_factory):
    """Autostart on, and a committer holds the cache lock but does not answer (stopped here): the client starts
    none, and its timeout must not say "why the committer it started did not answer is in NAME.autostart.log"
    (no such file; review, 2026-12-06). It names the lock's holder and how to look at it."""
    from conftest import RUNTIME_DIR
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheCommitterError, OmniPrefixCacheManager

    h = committer_factory()
    os.kill(h.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(OmniPrefixCacheCommitterError) as err:
            OmniPrefixCacheManager(small_config(), cache=h.name, autostart=True, runtime_dir=RUNTIME_DIR,
                                   connect_timeout_s=2.0)
    finally:
        os.kill(h.proc.pid, signal.SIGCONT)
    msg = str(err.value)
    assert "the committer it started" not in msg and not (RUNTIME_DIR / f"{h.name}.autostart.log").exists()
    assert f"pid {h.proc.pid} holds the cache's committer lock" in msg and "omnishm ping" in msg, msg


def test_a_client_at_another_endpoint_than_its_live_committers_is_told_where_it_serves(committer_factory):
    """Autostart on, the cache's committer alive at its own socket, and the client asking at another endpoint
    in the same runtime dir (a stale ``OMNISHM_ENDPOINT``): the client starts none (the cache lock is held) and
    its timeout says where that committer serves, not that it is frozen. REVIEW (stop 48): it blamed a committer
    "that does not answer (frozen, stopped, starved of CPU or stuck)", which answered at once at its socket."""
    from conftest import RUNTIME_DIR
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheCommitterError, OmniPrefixCacheManager

    h = committer_factory()
    with pytest.raises(OmniPrefixCacheCommitterError) as err:
        OmniPrefixCacheManager(small_config(), cache=h.name, endpoint=f"ipc://{RUNTIME_DIR}/elsewhere-{h.name}.sock",
                               autostart=True, runtime_dir=RUNTIME_DIR, connect_timeout_s=1.0)
    msg = str(err.value)
    assert f"that committer serves {h.endpoint}, not this client's endpoint" in msg and "frozen" not in msg, msg
    assert not (RUNTIME_DIR / f"{h.name}.autostart.log").exists()

def test_a_committer_whose_log_was_removed_while_it_started_writes_a_new_one(tmp_path):
    """The committer before it stopped cleanly and removed the shared log while the next one was starting with
    that file as its output: once the next one holds the cache lock, it writes to a log at the path again."""
    from conftest import unique_cache_name

    name = unique_cache_name("relog")
    runtime, log_path, first = _start_as_autostarted(name, tmp_path)
    second = None
    try:
        _serving(runtime, name, first)
        second = _another_autostart(name, runtime)
        os.kill(second.pid, signal.SIGSTOP)  # long before it could reach the cache lock
        try:
            first.send_signal(signal.SIGTERM)
            assert first.wait(30) == 0 and not log_path.exists()  # a clean stop removes its log
        finally:
            os.kill(second.pid, signal.SIGCONT)
        _serving(runtime, name, second)
        assert log_path.exists()
        os.kill(second.pid, signal.SIGUSR1)  # writes its threads' stacks to its log
        deadline = time.monotonic() + 30
        while "most recent call first" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        _stop(first, *([second] if second is not None else []))
    assert not log_path.exists() and sorted(os.listdir(runtime)) == [] and shm.list_segments(name) == []


def test_a_client_whose_autostarted_committers_are_refused_fails_at_once_saying_why(tmp_path, monkeypatch):
    """REVIEW (2026-12-05, newcomer): a committer that refuses to start (here a bad OMNISHM_LOG_LEVEL it
    inherits) was started again every 5 s until connect_timeout_s (30 s by default), and the error named
    the log only. After AUTOSTART_TRIES starts that ended with nothing holding the cache lock, the first
    Hello fails at once with the end of the autostart log."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager, attach as attach_mod
    from omnishm.interface import OmniPrefixCacheCommitterError

    name = unique_cache_name("refused")
    runtime = tmp_path / "rt"
    monkeypatch.setenv("OMNISHM_LOG_LEVEL", "bogus")
    real_start = attach_mod.start_committer
    started = []
    monkeypatch.setattr(attach_mod, "start_committer", lambda *a, **kw: started.append(real_start(*a, **kw))
                        or started[-1])
    t0 = time.monotonic()
    with pytest.raises(OmniPrefixCacheCommitterError) as err:
        OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=runtime,
                               connect_timeout_s=60.0)
    assert time.monotonic() - t0 < 30  # not connect_timeout_s: each start ends within a second or so
    assert len(started) == attach_mod.AUTOSTART_TRIES and not any(p.alive() for p in started)
    assert f"the {attach_mod.AUTOSTART_TRIES} committers autostart started ended without serving" in str(err.value)
    assert "bad log_level = 'bogus' (from env OMNISHM_LOG_LEVEL)" in str(err.value), err.value
    assert shm.list_segments(name) == []
    (runtime / f"{name}.autostart.log").unlink()  # kept for the post-mortem, as a refused start's is


def test_a_client_at_a_tcp_endpoint_nobody_serves_is_told_how_to_start_one_there(tmp_path):
    """REVIEW (2026-12-05, newcomer): with autostart on (the default) and a tcp endpoint, the error said
    `omnishm committer --name NAME` (which binds the cache's own ipc socket, not the endpoint waited on) or
    "pass autostart=True" (it was on; it covers ipc endpoints only)."""
    from conftest import unique_cache_name
    from helpers import free_port
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import OmniPrefixCacheCommitterError

    name = unique_cache_name("tcp")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(OmniPrefixCacheCommitterError) as err:
        OmniPrefixCacheManager(small_config(), cache=name, endpoint=endpoint, runtime_dir=tmp_path / "rt",
                               connect_timeout_s=1.0)
    assert f"`omnishm committer --name {name} --endpoint {endpoint}`" in str(err.value), err.value
    assert "autostart covers ipc endpoints only" in str(err.value) and "pass autostart=True" not in str(err.value)


def test_a_client_refuses_a_socket_directory_that_does_not_exist_yet_and_makes_its_runtime_dir(tmp_path):
    """REVIEW (2026-12-05, permissions): a client whose socket directory did not exist yet connected all the
    same; another user made the directory (0777, theirs), bound the socket and got the Hello. An explicit
    endpoint's directory must exist now, and the runtime dir the client makes itself (0700) before it
    connects."""
    import stat as stat_mod

    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import OmniPrefixCacheCommitterError

    name = unique_cache_name("nodir")
    missing = tmp_path / "missing"
    with pytest.raises(PermissionError, match=f"socket directory {missing} does not exist"):
        OmniPrefixCacheManager(small_config(), cache=name, endpoint=f"ipc://{missing}/{name}.sock", autostart=False,
                               connect_timeout_s=1.0)
    runtime = tmp_path / "rt"
    with pytest.raises(OmniPrefixCacheCommitterError, match="no committer answered"):
        OmniPrefixCacheManager(small_config(), cache=name, runtime_dir=runtime, autostart=False, connect_timeout_s=0.5)
    assert stat_mod.S_IMODE(runtime.stat().st_mode) == 0o700 and runtime.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("spelling", ["symlinked-parent", "relative-runtime-dir"])
def test_a_client_makes_its_runtime_dir_however_its_endpoint_spells_it(tmp_path, monkeypatch, spelling):
    """REVIEW (2026-12-05, of fc66364): the client makes its runtime dir before it connects, but compared the
    endpoint's directory with it as spelled: a runtime dir under a symlinked parent (/var/run -> /run), or
    given relative, with the endpoint spelled otherwise, was not made, and the first start of an
    autostarting client was refused ("socket directory ... does not exist")."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    name = unique_cache_name("spell")
    if spelling == "symlinked-parent":
        real = tmp_path / "run"
        real.mkdir(mode=0o700)
        (tmp_path / "varrun").symlink_to(real)
        runtime, check = tmp_path / "varrun" / "omnishm", real / "omnishm"
        endpoint = f"ipc://{real}/omnishm/{name}.sock"
    else:
        monkeypatch.chdir(tmp_path)
        runtime, check = Path("rt"), tmp_path / "rt"
        endpoint = f"ipc://{tmp_path}/rt/{name}.sock"
    with OmniPrefixCacheManager(small_config(), cache=name, endpoint=endpoint, autostart=True, runtime_dir=runtime,
                                connect_timeout_s=60.0) as m:
        assert m._link.welcome.committer_pid > 0
    assert_idle_committer_exits(check, name)


def test_a_client_of_another_runtime_dir_autostarts_nothing_where_a_committer_serves_its_endpoint(
        tmp_path, committer_factory):
    """A client whose runtime dir is not its committer's, pointed at that committer's socket: the socket's lock
    is held, so the client starts no committer (one would be refused that socket) and makes nothing in its own
    runtime dir. REVIEW (stop 48): it checked only its own dir's cache lock, so each client launched a committer
    that the Welcome's ``_stop_autostart_losers`` killed before it set its handlers, and the client's dir kept
    an empty ``NAME.autostart.log`` for good."""
    from manager_helpers import Part, save, small_config, started
    from omnishm.client import OmniPrefixCacheManager

    h = committer_factory()
    other = tmp_path / "other-rt"
    for _ in range(2):  # a restarted client too
        m = OmniPrefixCacheManager(small_config(), cache=h.name, endpoint=h.endpoint, autostart=True,
                                   runtime_dir=other, connect_timeout_s=30.0)
        try:
            assert m._link._autostarted == []
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], 4))
            m.wait_idle()
        finally:
            m.shutdown()
    assert not other.exists()


def test_an_autostarted_committer_takes_the_config_file_its_client_read(tmp_path, monkeypatch):
    """``client_settings(config_file=F)`` (or a manager given ``config_file=F``): a committer the client
    autostarts reads F too (``--config F``), so F's committer knobs (heartbeats, metrics, log level, stores)
    hold. REVIEW (stop 48): it read only the environment and ``$OMNISHM_CONFIG``, and ran with the default
    heartbeats (1 s / 10 s) where F said 0.5 s / 37 s, without a word."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.config import client_settings

    monkeypatch.delenv("OMNISHM_CONFIG", raising=False)
    name = unique_cache_name("cfg")
    f = tmp_path / "omnishm.toml"
    f.write_text(f'name = "{name}"\nautostart = true\nruntime_dir = "{tmp_path / "rt"}"\n'
                 'heartbeat_s = 0.5\nheartbeat_timeout_s = 37\n')
    settings = client_settings(config_file=f)
    m = OmniPrefixCacheManager(small_config(), **settings.manager_kwargs())
    try:
        welcome = m._link.welcome
        assert (welcome.heartbeat_s, welcome.heartbeat_timeout_s) == (0.5, 37.0)
    finally:
        m.shutdown()
    assert_idle_committer_exits(settings.runtime_dir, name)


def test_a_relative_config_file_still_names_the_file_for_a_committer_a_resume_starts_after_a_chdir(
        tmp_path, monkeypatch):
    """A ``config_file`` given as a relative path is made absolute when it is taken: the committer that a
    resume autostarts later (its committer SIGKILLed) reads the same file after the process changed directory,
    adopts the cache, and the resume holds. REVIEW (stop 48): the path was passed on as given, so that committer
    read it against the new directory, could not, exited twice, and the resume failed (the cache lost)."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm import orphans
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.config import client_settings

    monkeypatch.delenv("OMNISHM_CONFIG", raising=False)
    name = unique_cache_name("relcfg")
    rt = paths.default_runtime_dir()  # conftest's OMNISHM_RUNTIME_DIR (wins over the file)
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "omnishm.toml").write_text(f'name = "{name}"\nautostart = true\nruntime_dir = "{rt}"\n')
    monkeypatch.chdir(work)
    settings = client_settings(config_file="omnishm.toml")  # as a user types it
    m = OmniPrefixCacheManager(small_config(reconnect_timeout_s=20.0), **settings.manager_kwargs())
    try:
        first = m._link.welcome.committer_pid
        os.chdir(elsewhere)  # monkeypatch gives the test's directory back
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 25
        while m._link.dead is None and m._link.welcome.committer_pid == first:
            assert time.monotonic() < deadline, "no resume"
            time.sleep(0.05)
        assert m._link.dead is None, m._link.dead
    finally:
        m.shutdown()
        assert_idle_committer_exits(rt, name)
        orphans.sweep(rt, name)
