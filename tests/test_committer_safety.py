"""One client's bad input, or a refused restart, must not damage another client's cache.

Each test starts real committers and speaks the wire protocol by hand
(``helpers.RawClient``, ``helpers.Writer``): an admin reusing the writer's
client_id, key names too long for the metadata, a writer without staging rows,
a restart that refuses to start after adopting a live cache, and a restart
that finds a generation it cannot adopt.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import posix_ipc
import pytest
import torch

from omnishm import protocol, shm
from omnishm.committer import meta
from omnishm.committer.pool import MAX_KEY_NAME, MAX_KEYS, CachePool

from conftest import RUNTIME_DIR, START_TIMEOUT_S, assert_clean_stop
from helpers import RawClient, Writer, catches_signal, ignores_signal, unpack

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
FAST = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5.0")
SLOW = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "60")


def _hello(raw: RawClient, role: str, client_id: str, layout: protocol.Layout | None = None,
           staging_rows: int = 0) -> object:
    return raw.call(protocol.Hello(rid=raw.next_rid(), protocol=protocol.PROTOCOL_VERSION, client_id=client_id,
                                   pid=os.getpid(), uid=os.geteuid(), role=role, cache=raw.cache, layout=layout,
                                   staging_rows=staging_rows))


def _hold_attached(control: str) -> int:
    """A shared flock on the control segment: a client is attached, so a restart must adopt, not sweep."""
    seg = posix_ipc.SharedMemory(control, 0)
    fcntl.flock(seg.fd, fcntl.LOCK_SH)
    return seg.fd


def test_admin_cannot_take_the_writers_client_id(committer_factory):
    """An admin Hello with the writer's client_id is refused, and an admin leaving never touches staging."""
    handle = committer_factory(*FAST)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    view = writer.open_key("k", "float32", 4)
    admin = RawClient(handle.endpoint, handle.name)
    try:
        reply = _hello(admin, protocol.ROLE_ADMIN, writer.raw.client_id)
        assert isinstance(reply, protocol.Refused) and "already attached" in reply.reason, reply
        assert isinstance(_hello(admin, protocol.ROLE_ADMIN, admin.client_id), protocol.Welcome)
        assert isinstance(admin.goodbye(), protocol.Bye)
        assert view.segments.staging in shm.list_segments(handle.name)
        view.staging[0:2] = torch.arange(8, dtype=torch.float32).view(2, 4)
        done = writer.step_write(1, [("k", 1, writer.new_cv(1), 0, [0, 1])])
        assert isinstance(done, protocol.StepDone) and unpack(done.done_tids) == [1] and not done.failed_tids, done
        assert torch.equal(view.pool[0:2], torch.arange(8, dtype=torch.float32).view(2, 4))
    finally:
        admin.close()
        writer.goodbye()


def test_key_names_are_bounded_so_the_metadata_always_fits(committer_factory):
    """A key name past MAX_KEY_NAME, or more than MAX_KEYS names, is refused with the reason."""
    handle = committer_factory(*SLOW)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    reader = RawClient(handle.endpoint, handle.name)
    try:
        big = protocol.Layout(8, 4, {"x" * 70_000: protocol.KeySpec("float32", 4)})
        reply = _hello(reader, protocol.ROLE_READER, reader.client_id, big)
        assert isinstance(reply, protocol.Refused) and f"1..{MAX_KEY_NAME} characters" in reply.reason, reply
        many = protocol.Layout(8, 4, {f"key{i}": protocol.KeySpec("float32", 4) for i in range(MAX_KEYS + 1)})
        reply = _hello(reader, protocol.ROLE_READER, reader.client_id, many)
        assert isinstance(reply, protocol.Refused) and f"limit of {MAX_KEYS}" in reply.reason, reply
        opened = writer.raw.call(protocol.OpenKey(rid=writer.raw.next_rid(), key="y" * (MAX_KEY_NAME + 1),
                                                  dtype="float32", width=4))
        assert isinstance(opened, protocol.Error) and opened.code == "bad_key", opened
        # The cache is unharmed: a normal key still opens and its metadata still saves.
        writer.open_key("k", "float32", 4)
        assert "does not fit" not in handle.log()
    finally:
        reader.close()
        writer.goodbye()


def test_an_epoch_the_metadata_cannot_record_is_never_handed_out(tmp_path, monkeypatch):
    """set_writer_epoch saves before it publishes; a failed save publishes nothing and says so."""
    name = f"tsafe{uuid.uuid4().hex[:6]}"
    pool = CachePool(name, uuid.uuid4().hex[:8])
    try:
        pool.set_layout(LAYOUT)
        assert pool.set_writer_epoch(1, "w1")
        assert int(pool.ctl[protocol.CTL_WRITER_EPOCH]) == 1

        def fail(*_args, **_kw):
            raise meta.MetaError("metadata does not fit")

        monkeypatch.setattr(meta, "write", fail)
        assert not pool.set_writer_epoch(2, "w2")
        assert int(pool.ctl[protocol.CTL_WRITER_EPOCH]) == 1
        assert pool.max_epoch == 1 and "w2" not in pool.writer_epochs
    finally:
        pool.close()
    assert shm.list_segments(name) == []


def test_a_writer_needs_staging_rows(committer_factory):
    """staging_rows=0 for a writer is refused at Hello; nothing is created, nothing leaks."""
    handle = committer_factory(*SLOW)
    raw = RawClient(handle.endpoint, handle.name)
    try:
        reply = _hello(raw, protocol.ROLE_WRITER, raw.client_id, LAYOUT, staging_rows=0)
        assert isinstance(reply, protocol.Refused) and "staging_rows must be >= 1" in reply.reason, reply
    finally:
        raw.close()
    handle.stop(signal.SIGTERM)
    assert shm.list_segments(handle.name) == []


def test_a_refused_restart_leaves_the_adopted_cache_for_the_next_one(committer_factory):
    """A restart that adopts a live cache and then cannot serve (metrics port taken) exits 2 and unlinks
    nothing; the next restart adopts the same generation and the writer resumes its staging."""
    first = committer_factory(*SLOW)
    name = first.name
    writer = Writer(first.endpoint, name, LAYOUT, 8)
    writer.open_key("k", "float32", 4)
    fd = _hold_attached(writer.welcome.control)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        first.stop(signal.SIGKILL)
        before = sorted(shm.list_segments(name))
        failed = committer_factory(*SLOW, "--metrics-port", str(busy.getsockname()[1]), name=name, wait=False)
        assert failed.proc.wait(60) == 2
        assert sorted(shm.list_segments(name)) == before, failed.log()
        assert "left for the next committer to adopt" in failed.log()
        second = committer_factory(*SLOW, name=name)
        assert f"adopted live generation {writer.welcome.generation}" in second.log()
        assert sorted(shm.list_segments(name)) == before
    finally:
        busy.close()
        os.close(fd)
        writer.raw.close()


def test_a_generation_that_fails_to_adopt_in_any_way_is_logged_and_left_to_the_sweep(monkeypatch, caplog):
    """adopt_live_cache never lets an adoption error stop the committer from starting."""
    from omnishm.committer import pool as pool_mod
    from omnishm.committer import start

    def broken(cls, name, generation, *, prefault=False):
        raise RuntimeError("cannot reshape tensor of 0 elements")

    monkeypatch.setattr(start.meta, "live_generations", lambda name: ["0badc0de"])
    monkeypatch.setattr(pool_mod.CachePool, "adopt", classmethod(broken))
    name = f"tsafe{uuid.uuid4().hex[:6]}"
    try:
        with caplog.at_level("ERROR", logger="omnishm.committer.start"):
            assert start.adopt_live_cache(types.SimpleNamespace(name=name, prefault=False)) == (None, None)
        assert "0badc0de" in caplog.text and "cannot be adopted" in caplog.text and "0 elements" in caplog.text
        assert not shm.generation_owned(name, "0badc0de")  # the owner lock was let go for the sweep
    finally:
        for seg in shm.list_segments(name):
            shm.unlink_segment(seg)


def test_a_committer_of_the_same_name_in_another_runtime_dir_leaves_a_live_cache_alone(committer_factory,
                                                                                       tmp_path):
    """Segment names are host-wide, lock files per runtime dir: a second committer of the same name started
    with another runtime dir (another XDG_RUNTIME_DIR, another config) neither adopts nor sweeps a generation
    a live committer owns, and stopping it leaves that generation alone."""
    a = committer_factory(*SLOW)
    writer = Writer(a.endpoint, a.name, LAYOUT, 8)
    view = writer.open_key("k", "float32", 4)
    fd = _hold_attached(writer.welcome.control)  # a client attached: what made a restart adopt
    before = set(shm.list_segments(a.name))
    log = tmp_path / "second.log"
    with open(log, "wb") as out:
        second = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", a.name, "--runtime-dir",
                                   str(tmp_path / "other-runtime"), *SLOW], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "started" not in log.read_text() and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "started" in text, text
        assert "adopted" not in text and "removed" not in text, text
        assert before <= set(shm.list_segments(a.name))
    finally:
        second.send_signal(signal.SIGTERM)
        rc = second.wait(60)
        os.close(fd)
    assert rc == 0, log.read_text()
    assert before <= set(shm.list_segments(a.name)), "stopping the second committer removed the live cache"
    view.staging[0:2] = torch.ones(2, 4)
    done = writer.step_write(1, [("k", 1, writer.new_cv(1), 0, [0, 1])])
    assert isinstance(done, protocol.StepDone) and not done.failed_tids, done
    writer.goodbye()


def test_cleanup_never_removes_a_live_committers_segments_whatever_runtime_dir_it_looks_in(committer_factory,
                                                                                          tmp_path):
    """`omnishm cleanup` pointed at the wrong runtime dir finds no lock file, but the live committer's owner
    lock still keeps its generation; with the right dir (here via OMNISHM_CONFIG) the lock file does."""
    handle = committer_factory(*SLOW)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    writer.open_key("k", "float32", 4)
    before = set(shm.list_segments(handle.name))
    empty = tmp_path / "empty-runtime"
    empty.mkdir(mode=0o700)
    config = tmp_path / "omnishm.toml"
    config.write_text(f'runtime_dir = "{handle.runtime_dir}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNISHM_")}
    for extra_env, args in (({}, ["--runtime-dir", str(empty)]), ({"OMNISHM_CONFIG": str(config)}, [])):
        proc = subprocess.run([sys.executable, "-m", "omnishm", "cleanup", "--name", handle.name, *args],
                              capture_output=True, text=True, timeout=60, env={**env, **extra_env})
        assert proc.returncode == 0 and "0 orphaned object(s) removed" in proc.stdout, proc.stdout + proc.stderr
        assert set(shm.list_segments(handle.name)) == before
    assert (handle.runtime_dir / f"{handle.name}.lock").exists()
    writer.goodbye()


def assert_idle_committer_exits(runtime, name: str, timeout_s: float = 30.0) -> None:
    """An ``--exit-when-idle`` committer whose last client left exits (bounded wait) and leaves no segment."""
    deadline = time.monotonic() + timeout_s
    while shm.cache_is_live(runtime, name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm.cache_is_live(runtime, name), "the autostarted committer did not exit when its client left"
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


def test_a_client_accepts_a_sticky_shared_directory_like_tmp(tmp_path):
    """In a sticky directory (/tmp) nobody else can remove or replace our socket: no PermissionError (here
    nothing answers, so the client times out instead)."""
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import OmniPrefixCacheCommitterError

    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    # The hint names the command a pip install has (not only the repository's script).
    with pytest.raises(OmniPrefixCacheCommitterError, match="answered.*`omnishm committer --name tsafe`.*autostart=True"):
        OmniPrefixCacheManager(small_config(), cache="tsafe", endpoint=f"ipc://{shared}/tsafe.sock", autostart=False,
                               connect_timeout_s=0.5)


_SPAWN_AND_LEAVE = """
import sys, time
from pathlib import Path
from omnishm import shm
from omnishm.client.committer_process import start_committer
name, rt = sys.argv[1], Path(sys.argv[2])
shm.ensure_runtime_dir(rt)
proc = start_committer(name, rt)
deadline = time.monotonic() + 60
while not shm.cache_is_live(rt, name) and time.monotonic() < deadline:
    time.sleep(0.05)
print(proc.pid, shm.cache_is_live(rt, name), flush=True)
"""


def test_an_autostarted_committer_nobody_attached_to_exits_when_its_starter_is_gone(tmp_path):
    """Two ranks that both autostart start two committers; the slower may get the cache lock after the
    other served the whole run and exited. Nobody attaches to it: once the process that started it is
    gone it exits cleanly (lock, socket, segments and log removed), well before the 60 s unused limit."""
    from conftest import unique_cache_name
    from omnishm.shm import proc_identity
    from omnishm.committer.server import UNUSED_EXIT_S

    name = unique_cache_name("spawn")
    runtime = tmp_path / "rt"
    out = subprocess.run([sys.executable, "-c", _SPAWN_AND_LEAVE, name, str(runtime)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid, live = out.stdout.split()
    assert live == "True", "the autostarted committer never came up"
    gone_by = time.monotonic() + UNUSED_EXIT_S / 3
    while shm.cache_is_live(runtime, name) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not shm.cache_is_live(runtime, name), "an unused committer outlived the client that started it"
    deadline = time.monotonic() + 10
    while proc_identity(int(pid)) is not None and time.monotonic() < deadline:  # exited (a zombie counts)
        time.sleep(0.05)
    assert proc_identity(int(pid)) is None
    assert shm.list_segments(name) == []
    assert not (runtime / f"{name}.autostart.log").exists(), "it did not stop cleanly (its log was kept)"


_SPAWN_AND_DIE = """
import os, sys
from pathlib import Path
from omnishm import shm
from omnishm.client.committer_process import start_committer
name, rt = sys.argv[1], Path(sys.argv[2])
shm.ensure_runtime_dir(rt)
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
    from omnishm.shm import proc_identity
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
        while not shm.cache_is_live(runtime, name) and proc_identity(pid) is not None \
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
    assert not shm.cache_is_live(runtime, name)
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
        other = shm.CacheLock.acquire(runtime_dir, cache, "other")  # another rank's committer, say
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
    assert not shm.cache_is_live(RUNTIME_DIR, name) and shm.list_segments(name) == []


_CATCHER_FIRST = """
import sys
from omnishm.committer import early_stop
installed = early_stop.EarlyStop.__init__
def init(self, *args):
    print("torch" in sys.modules, "omnishm.committer.server" in sys.modules, flush=True)
    installed(self, *args)
early_stop.EarlyStop.__init__ = init
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_start_up_signal_catcher_goes_in_before_torch_is_imported():
    """``omnishm.committer.main`` installs ``EarlyStop`` first: importing torch (and the server) takes a second,
    and a SIGTERM then used to kill the committer with exit 143. A bad option is refused without torch."""
    proc = subprocess.run([sys.executable, "-c", _CATCHER_FIRST, "--name", "x", "--heartbeat-s", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
    assert proc.returncode == 2 and "must be > 0" in proc.stderr, proc.stderr


def test_sigterm_while_the_committer_imports_stops_cleanly(committer_factory):
    """A SIGTERM as soon as the committer catches it (it then still imports torch, about a second) exits 0 and
    makes nothing: no lock, no segment, no socket."""
    handle = committer_factory(wait=False)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not catches_signal(handle.proc.pid, signal.SIGTERM):  # busy poll: the handler is the first thing it installs
        assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
    assert not shm.lock_path(RUNTIME_DIR, handle.name).exists()
    assert_clean_stop(handle)
    assert "stopped (SIGTERM) before it started" in handle.log(), handle.log()


def _start_as_autostarted(name: str, tmp_path: Path) -> tuple[Path, Path, subprocess.Popen]:
    """A committer of ``name`` in its own runtime dir, its output in ``NAME.autostart.log`` there, told so as an
    autostarting client tells it (``OMNISHM_AUTOSTART_LOG``). Returns the runtime dir, the log and the process."""
    runtime = tmp_path / "rt"
    shm.ensure_runtime_dir(runtime)
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


def test_sigterm_during_start_up_stops_cleanly(committer_factory):
    """A SIGTERM sent as soon as the cache lock exists (start-up, before the loop serves) exits 0 and leaves nothing.

    Without ``early_stop.EarlyStop`` the default action killed the process there: exit -15 and a stale lock file.
    """
    for _ in range(3):
        handle = committer_factory(wait=False)
        lock = shm.lock_path(RUNTIME_DIR, handle.name)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not lock.exists():  # busy poll: the window after the lock is a few milliseconds
            assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
        assert_clean_stop(handle)
        assert "stopped (SIGTERM)" in handle.log(), handle.log()


# A terminal's hangup reaches what it started: these committers start with SIGHUP at its default, also when
# this test run itself was started under nohup (its children would inherit the ignored SIGHUP, which the
# committer keeps, as test_a_committer_started_under_nohup_keeps_running_through_a_hangup shows).
_HANGUP_REACHES = """
import signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""

_BACKGROUND_JOB = """
import signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)
for sig in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(sig, signal.SIG_IGN)  # as a non-interactive shell starts a job in the background (&)
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""

_NOHUP = """
import signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT, signal.SIGINT], ids=lambda s: s.name)
def test_a_hangup_or_quit_stops_the_committer_cleanly_also_as_a_background_job(committer_factory, sig):
    """SIGHUP (a closed terminal) and SIGQUIT (Ctrl-\\) used to end the committer by their default action, like a
    crash, with every segment left in /dev/shm for the next start of that name; a committer started with SIGINT and
    SIGQUIT ignored (a shell's background job) could not be stopped by them at all. Each now stops it like SIGTERM:
    the segments it made for a writer's key unlinked, exit 0."""
    handle = committer_factory(*SLOW, python_args=("-c", _BACKGROUND_JOB))
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    try:
        writer.open_key("k", "float32", 4)
        assert shm.list_segments(handle.name)
        assert_clean_stop(handle, sig)
    finally:
        writer.raw.close()
    assert f"stopped ({sig.name})" in handle.log(), handle.log()


def test_a_committer_started_under_nohup_keeps_running_through_a_hangup(committer_factory):
    """An ignored SIGHUP is a choice (nohup): the committer keeps it, outlives the hangup with its cache, and still
    stops cleanly on SIGTERM."""
    handle = committer_factory(*SLOW, python_args=("-c", _NOHUP))
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    try:
        writer.open_key("k", "float32", 4)
        assert ignores_signal(handle.proc.pid, signal.SIGHUP) and not catches_signal(handle.proc.pid, signal.SIGHUP)
        assert catches_signal(handle.proc.pid, signal.SIGTERM)
        handle.proc.send_signal(signal.SIGHUP)
        assert writer.raw.status()["keys"][0]["name"] == "k"  # still serving, its cache still there
        assert handle.proc.poll() is None and shm.list_segments(handle.name)
        assert_clean_stop(handle)
    finally:
        writer.raw.close()
    assert "stopped (SIGTERM)" in handle.log(), handle.log()


def test_a_hangup_while_the_committer_imports_stops_it_cleanly(committer_factory):
    """The start-up catcher (``early_stop.EarlyStop``) takes every stop signal, SIGHUP too: one sent as soon as the
    committer catches it (it then still imports torch, about a second) exits 0 and makes nothing."""
    handle = committer_factory(wait=False, python_args=("-c", _HANGUP_REACHES))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not catches_signal(handle.proc.pid, signal.SIGHUP):  # busy poll: the catcher is the first thing it installs
        assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
    assert_clean_stop(handle, signal.SIGHUP)
    assert "stopped (SIGHUP) before it started" in handle.log(), handle.log()


def test_a_socket_that_keeps_saying_hello_as_another_client_cannot_fill_the_log(committer_factory):
    """SOAK (2026-12-02): each Hello of a new client id on one socket ends the socket's session ("re-hello") and
    starts another, and both were logged at INFO without a limit: a client doing it in a loop filled the log
    (the fuzz test's 1,000,000 messages logged 4,849 lines). Each one is still served."""
    handle = committer_factory(*SLOW)
    raw = RawClient(handle.endpoint, handle.name)
    try:
        for _ in range(300):
            last = uuid.uuid4().hex
            assert isinstance(_hello(raw, protocol.ROLE_READER, last, LAYOUT), protocol.Welcome)
        status = raw.status()
        # One session, the socket's latest: every earlier one was detached.
        assert [(c["role"], c["client_id"]) for c in status["clients"]] == [("reader", last)], status["clients"]
        assert status["log_lines_suppressed"] >= 500, status["log_lines_suppressed"]
        log = handle.log()
        assert log.count("(re-hello)") <= 10 and log.count(" attached (pid") <= 12, log
    finally:
        raw.close()


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
        assert m._link.endpoint == shm.ipc_endpoint(runtime, name)
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
            writer = Writer(shm.ipc_endpoint(runtime, name), name, LAYOUT, 4)
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
