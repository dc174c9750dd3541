"""Autostarted committers are detached from the engine's process tree.

vLLM 0.32 stops ``vllm serve`` by SIGTERMing its engine processes and, once its shutdown timeout
(0 s by default) has passed, SIGKILLing every descendant of each one still running
(``vllm.utils.system_utils.kill_process_tree``). A committer that a rank autostarted was such a
descendant: a real ``--data-parallel-size 2`` server stopped with Ctrl-C left both caches'
segments in /dev/shm and their lock, socket and log in the runtime dir. Here a rank process
(real manager, real committer, real shm) is killed the way vLLM does it, by walking /proc; the
committer outlives it, reaps it and leaves nothing, and an engine started again at once attaches
(the old committer refuses its writer as retryable until the killed one is reaped). A committer
that cannot be launched fails the client with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnishm import liveness, paths, shm
from omnishm.liveness import proc_identity
from test_autostart_lifecycle import assert_idle_committer_exits

_RANK = """
import sys, time
from omnishm.client import OmniPrefixCacheManager
sys.path.insert(0, sys.argv[3])
from manager_helpers import Part, save, small_config, started
name, rt = sys.argv[1], sys.argv[2]
m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=rt, connect_timeout_s=60.0)
m.new_step_starts([started("a", [0, 1])])
m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], 4), ["a"])
print(m._link.welcome.committer_pid, flush=True)
time.sleep(600)
"""


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children by ppid, recursively), as psutil's ``children(recursive=True)``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _writer_silence(name: str, runtime: Path) -> float:
    """Seconds since the committer of ``name`` last heard from its writer (its status, asked as admin)."""
    from omnishm import protocol
    from omnishm.cli import admin_request

    reply = admin_request(name, paths.ipc_endpoint(runtime, name), lambda rid: protocol.StatusRequest(rid=rid), 5.0,
                          runtime)
    return max(c["last_seen_s_ago"] for c in reply.status["clients"] if c["role"] == "writer")


def _kill_process_tree(pid: int) -> None:
    """What vLLM's ``kill_process_tree`` does: SIGKILL every descendant, then the process."""
    for child in _descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(pid, signal.SIGKILL)


class _Rank:
    """A rank process with a writer manager on an autostarted committer (``_RANK``); killed as vLLM kills."""

    def __init__(self, name: str, runtime: Path, heartbeat_timeout_s: float) -> None:
        # The committer inherits the rank's environment: it reaps the killed rank after that much silence.
        env = {**os.environ, "OMNISHM_HEARTBEAT_S": "0.2", "OMNISHM_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s)}
        self.proc = subprocess.Popen([sys.executable, "-c", _RANK, name, str(runtime), str(Path(__file__).parent)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        self.committer = 0
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), self.proc.stderr.read() if self.proc.poll() is not None else line
        self.committer = int(line)
        self.ident = proc_identity(self.committer)
        assert self.ident is not None and shm.list_segments(name), "the rank's committer is not up"

    def kill_tree(self) -> None:
        _kill_process_tree(self.proc.pid)
        self.proc.wait(10)

    def committer_alive(self) -> bool:
        return proc_identity(self.committer) == self.ident

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill_tree()
        if self.committer and self.committer_alive():
            os.kill(self.committer, signal.SIGTERM)  # failed: stop it (it unlinks what it made)


def test_an_autostarted_committer_survives_vllms_tree_kill_and_cleans_up(tmp_path):
    from conftest import unique_cache_name

    name = unique_cache_name("tree")
    runtime = tmp_path / "rt"
    rank = None
    try:
        rank = _Rank(name, runtime, heartbeat_timeout_s=1.0)
        assert rank.committer not in _descendants(rank.proc.pid), "the autostarted committer is in the rank's tree"
        committer, ident = rank.committer, rank.ident
        rank.kill_tree()
        deadline = time.monotonic() + 30
        while proc_identity(committer) == ident and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_identity(committer) != ident, "the committer outlived its only client by 30 s"
        assert shm.list_segments(name) == [], "the committer left its segments"
        assert sorted(os.listdir(runtime)) == [], "the committer left its lock, socket or log"
    finally:
        if rank is not None:
            rank.close()


@pytest.mark.parametrize(("role", "num_blocks"), [("writer", 16), ("reader", 32)],
                         ids=["writer-same-model", "reader-other-layout"])
def test_an_engine_started_again_at_once_attaches_once_the_killed_writer_is_reaped(tmp_path, role, num_blocks):
    """The killed rank's committer still holds its writer's session until 3 s of silence. A writer that says
    Hello before that is refused as retryable (a second writer), and so is a reader of a new model (another
    layout); each attaches once the committer reaped the killed writer (and, idle, exited)."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    name = unique_cache_name("again")
    runtime = tmp_path / "rt"
    rank = None
    try:
        rank = _Rank(name, runtime, heartbeat_timeout_s=3.0)
        rank.kill_tree()
        # Until the committer has heard nothing from the killed writer for over two heartbeat periods (0.4 s);
        # it reaps it only after 3 s.
        deadline = time.monotonic() + 10
        while _writer_silence(name, runtime) <= 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank.committer_alive()
        t0 = time.monotonic()
        m = OmniPrefixCacheManager(small_config(num_blocks=num_blocks), cache=name, role=role, autostart=True,
                                   runtime_dir=runtime, connect_timeout_s=30.0)
        try:
            waited = time.monotonic() - t0
            assert not rank.committer_alive(), "attached while the killed writer's session was still there"
        finally:
            m.shutdown()
        assert 1.0 < waited < 30.0, waited
        deadline = time.monotonic() + 30
        while (liveness.cache_is_live(runtime, name) or shm.list_segments(name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shm.list_segments(name) == []
    finally:
        if rank is not None:
            rank.close()


def test_a_committer_that_cannot_be_launched_fails_the_client_with_the_reason(tmp_path, monkeypatch):
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheCommitterError, OmniPrefixCacheManager, committer_process

    monkeypatch.setattr(committer_process, "SHELL", str(tmp_path / "no-such-shell"))
    with pytest.raises(OmniPrefixCacheCommitterError, match="could not be launched.*no-such-shell"):
        OmniPrefixCacheManager(small_config(), cache=unique_cache_name("nosh"), autostart=True,
                               runtime_dir=tmp_path / "rt", connect_timeout_s=1.0)


_SUBREAPER = """
import ctypes, os, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back here
sys.path.insert(0, sys.argv[3])
from manager_helpers import small_config
from omnishm.client import OmniPrefixCacheManager
from omnishm.liveness import proc_parent
m = OmniPrefixCacheManager(small_config(), cache=sys.argv[1], autostart=True, runtime_dir=sys.argv[2],
                           connect_timeout_s=60.0)
pid = m._link.welcome.committer_pid
assert proc_parent(pid) == os.getpid(), "not re-parented to this subreaper"
m.shutdown()
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # a zombie keeps its /proc entry
    time.sleep(0.05)
print(os.path.exists(f"/proc/{pid}"), flush=True)
"""


def test_a_subreaper_client_reaps_the_committer_it_autostarted(tmp_path):
    """A client process that is a subreaper gets its detached committer back as a child: it must reap it, or
    the committer stays a zombie for the life of the engine."""
    from conftest import unique_cache_name

    name = unique_cache_name("reaper")
    out = subprocess.run([sys.executable, "-c", _SUBREAPER, name, str(tmp_path / "rt"), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the exited committer was left a zombie"


def test_an_autostarted_committers_pid_taken_by_another_process_is_not_alive_and_gets_no_signal():
    """An autostarted committer is known by pid AND start time (``proc_identity``), as it is no child of
    its client: once it exited, its pid may belong to another process, which must count as gone, and
    ``terminate`` must send that process no SIGTERM. A check of the pid alone ("some process runs under
    it") called the stranger alive (the client then never autostarted a replacement) and ``terminate``
    killed it. A committer whose start time could not be read (``ident`` None) is never alive either.
    MUTATIONS (stop 47): ``alive`` checking the pid only, ``terminate`` skipping ``alive``."""
    from omnishm.client.committer_process import AutostartedCommitter

    stranger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ident = proc_identity(stranger.pid)
        assert ident is not None
        gone = AutostartedCommitter("c", stranger.pid, str(int(ident) + 1))  # the exited committer's start time
        assert not gone.alive()
        gone.terminate()
        assert not AutostartedCommitter("c", stranger.pid, None).alive()
        AutostartedCommitter("c", stranger.pid, None).terminate()
        assert AutostartedCommitter("c", stranger.pid, ident).alive()  # the same process: alive
        stranger.stdin.close()  # the stranger exits by itself only if no SIGTERM reached it
        assert stranger.wait(timeout=30) == 0, "terminate signalled a process that only reused the pid"
    finally:
        if stranger.poll() is None:
            stranger.send_signal(signal.SIGKILL)
            stranger.wait()


def test_an_autostarted_committer_knows_its_starter_by_pid_and_start_time_and_keeps_a_private_log(tmp_path):
    """An autostarted committer is told its starter by pid AND start time (``--spawned-by PID:START``), so a
    starter that died and whose pid was reused does not keep it up; and its autostart log (which holds the
    committer's own output, the reason of a failed start among it) is private to the user (0600) whatever
    the client's umask, also in a shared sticky runtime dir; and it runs in a session of its own. MUTATIONS
    (stop 47): passing the pid alone, creating the log under the umask (0644), or launching it in the
    client's session went unnoticed by the suite."""
    from conftest import unique_cache_name
    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    name = unique_cache_name("autoid")
    runtime = tmp_path / "rt"
    old = os.umask(0o022)
    try:
        m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=runtime,
                                   connect_timeout_s=60.0)
    finally:
        os.umask(old)
    try:
        pid = m._link.welcome.committer_pid
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        spawned_by = argv[argv.index(b"--spawned-by") + 1].decode()
        assert spawned_by == f"{os.getpid()}:{proc_identity(os.getpid())}"
        log = runtime / f"{name}.autostart.log"
        assert (os.stat(log).st_mode & 0o777) == 0o600, oct(os.stat(log).st_mode)
        # Detached: in a session and process group of its own, so a signal to the client's group (Ctrl-C at a
        # terminal, a supervisor's killpg) does not stop the committer other clients still use.
        assert os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgrp()
    finally:
        m.shutdown()
    assert_idle_committer_exits(runtime, name)  # not our child: its lock says when it is gone
