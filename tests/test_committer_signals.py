"""Stop signals at every stage of a committer's life: importing, starting, serving, under nohup.

The start-up catcher (``omnishm.committer.early_stop``) goes in before torch is imported, so SIGTERM,
SIGINT, SIGHUP and SIGQUIT always stop a committer cleanly (exit 0, nothing left), and a committer
started with SIGHUP ignored keeps running through a hangup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from omnishm import liveness, protocol, shm
from omnishm.committer import early_stop, stores

from conftest import RUNTIME_DIR, START_TIMEOUT_S, assert_clean_stop
from helpers import RawClient, Writer, catches_signal, ignores_signal, wait_queued_at, wait_stopped

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
SLOW = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "60")


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
    assert proc.returncode == 2 and "must be >= 0.01" in proc.stderr, proc.stderr


def test_sigterm_while_the_committer_imports_stops_cleanly(committer_factory):
    """A SIGTERM as soon as the committer catches it (it then still imports torch, about a second) exits 0 and
    makes nothing: no lock, no segment, no socket."""
    handle = committer_factory(wait=False)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not catches_signal(handle.proc.pid, signal.SIGTERM):  # busy poll: the handler is the first thing it installs
        assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
    assert not liveness.lock_path(RUNTIME_DIR, handle.name).exists()
    assert_clean_stop(handle)
    assert "stopped (SIGTERM) before it started" in handle.log(), handle.log()


def test_sigterm_during_start_up_stops_cleanly(committer_factory):
    """A SIGTERM sent as soon as the cache lock exists (start-up, before the loop serves) exits 0 and leaves nothing.

    Without ``early_stop.EarlyStop`` the default action killed the process there: exit -15 and a stale lock file.
    """
    for _ in range(3):
        handle = committer_factory(wait=False)
        lock = liveness.lock_path(RUNTIME_DIR, handle.name)
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


def test_a_hello_queued_when_the_stop_signal_came_is_refused_for_now_and_the_next_committer_welcomes_it(
        committer_factory):
    """REVIEW (2026-12-05): a writer's Hello waiting at a committer when SIGTERM came was answered on the
    way out: a Welcome naming segments it unlinked next, and the manager failed with a raw
    FileNotFoundError mapping them. A stopping committer refuses a new client for now (retryable); the
    client's Hello then reaches the next committer of the cache (here a supervisor's restart)."""
    first = committer_factory(*SLOW)
    raw = RawClient(first.endpoint, first.name)
    try:
        raw.send_raw(b"not a message")  # connected before the freeze: the Hello below waits in its queue
        assert isinstance(raw.recv(), protocol.Error)
        hello = protocol.Hello(rid=raw.next_rid(), protocol=protocol.PROTOCOL_VERSION, client_id=raw.client_id,
                               pid=os.getpid(), uid=os.geteuid(), role=protocol.ROLE_WRITER, cache=first.name,
                               layout=LAYOUT, staging_rows=4)
        os.kill(first.proc.pid, signal.SIGSTOP)
        try:
            wait_stopped(first.proc.pid)
            raw.send(hello)
            wait_queued_at(first.endpoint[len("ipc://"):])  # in the stopped committer's queue
            os.kill(first.proc.pid, signal.SIGTERM)
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
        reply = raw.recv()
        assert isinstance(reply, protocol.Refused) and reply.retry_after_s > 0, reply
        assert f"committer {first.name} is stopping (SIGTERM)" in reply.reason, reply
        assert first.proc.wait(timeout=30) == 0
        assert "1 segment(s) unlinked" in first.log(), first.log()  # its owner segment: no layout was set, no staging made
        second = committer_factory(*SLOW, name=first.name)
        hello.rid = raw.next_rid()
        welcome = raw.call(hello)  # the client's retry
        assert isinstance(welcome, protocol.Welcome) and welcome.committer_pid == second.proc.pid, welcome
        assert isinstance(raw.goodbye(), protocol.Bye)
    finally:
        raw.close()


_FLOOD = """
import sys, time, zmq
from omnishm import protocol
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 0); sock.setsockopt(zmq.RCVHWM, 0); sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
msg = protocol.encode(protocol.Heartbeat(rid=1))  # from a socket without a session: answered no_session
answered, told = 0, False
end = time.monotonic() + 60
while time.monotonic() < end:
    for _ in range(200):
        try:
            sock.send(msg, zmq.NOBLOCK)
        except zmq.Again:
            break
    while sock.poll(0):
        sock.recv()
        answered += 1
    if answered > 2000 and not told:
        print("flooding", flush=True)
        told = True
"""


def test_a_committer_stopped_by_a_signal_under_a_flood_of_messages_stops_within_its_drain_bound(committer_factory):
    """REVIEW (2026-12-05): answering what reaches a stopping committer went on while messages kept coming
    (each receive round took the next), so clients that never stop sending held a SIGTERM for as long as
    they sent (7.5 s of an 8 s flood in the review). Rounds stop once STOP_DRAIN_S passed."""
    from omnishm.committer.server import STOP_DRAIN_S

    handle = committer_factory()
    floods = [subprocess.Popen([sys.executable, "-c", _FLOOD, handle.endpoint], stdout=subprocess.PIPE, text=True)
              for _ in range(3)]
    try:
        for flood in floods:
            assert flood.stdout.readline().strip() == "flooding"
        t0 = time.monotonic()
        handle.proc.send_signal(signal.SIGTERM)
        assert handle.proc.wait(30) == 0
        took = time.monotonic() - t0
        assert took < STOP_DRAIN_S + 2.0, f"the stop took {took:.1f}s under the flood"
    finally:
        for flood in floods:
            flood.kill()
            flood.wait()


# MUTATION review (2026-12-07, stop 53): a failed re-exec, and a handler set outside Python.

APPLIES = stores._applies()  # glibc on x86-64: only there does the committer try to re-execute itself

# Both images import it; the exec fails, as it does when the interpreter was replaced or removed under a
# running deployment (ENOENT), or the exec is refused (EACCES, E2BIG for a huge environment).
_SITECUSTOMIZE = """
import errno, os
def execve(path, args, env):
    raise OSError(errno.EACCES, "refused by this test")
os.execve = execve
"""


def test_a_committer_whose_re_exec_failed_still_stops_cleanly_on_sigterm(committer_factory, monkeypatch, tmp_path):
    """MUTATION (2026-12-07, stop 53). Contract (``stores.reexec_with_threshold``): "an exec that fails leaves this process as it was". The stop
    signals blocked across the exec attempt are unblocked again, so the committer that runs on (with glibc's
    threshold) still stops on SIGTERM: answers, unlinks its segments, exits 0. With them left blocked, SIGTERM
    stayed pending for good; only SIGKILL ended it, and its segments stayed in /dev/shm. Real committer process,
    started as users start it (``-m omnishm.committer``). Kills the mutant that drops the ``finally`` unblock."""
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    handle = committer_factory()  # waits until it serves
    if APPLIES:
        assert "could not re-execute" in handle.log(), handle.log()
    assert handle.status()["pid"] == handle.proc.pid
    assert_clean_stop(handle)


def test_restore_leaves_a_handler_python_cannot_put_back_as_it_is():
    """MUTATION (2026-12-07, stop 53). Contract (``early_stop.restore``): a previous handler that was not set from Python (``getsignal`` gives
    None: one an embedding host installed in C) is left as it is, not passed to ``signal.signal`` (which raises
    TypeError for None, and would mask the committer's own return code from ``start.main``'s ``finally``).
    Kills the mutant that drops the ``is not None`` guard."""
    before = signal.getsignal(signal.SIGUSR1)
    old = early_stop.install((signal.SIGUSR1,), lambda *_: None)
    try:
        early_stop.restore({signal.SIGUSR1: None})
        assert signal.getsignal(signal.SIGUSR1) is not before  # left as it is now
    finally:
        early_stop.restore(old)
    assert signal.getsignal(signal.SIGUSR1) is before


_SUPERVISOR = """
import os, subprocess, sys
pid_file, args = sys.argv[1], sys.argv[2:]
args[args.index("--parent-pid") + 1] = str(os.getpid())  # this process is the committer's parent
child = subprocess.Popen([sys.executable, "-m", "omnishm.committer", *args])
with open(pid_file + ".tmp", "w") as f:
    f.write(str(child.pid))
os.rename(pid_file + ".tmp", pid_file)
"""


def _state(pid: int) -> str:
    """Process ``pid``'s state letter ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.rfind(b")") + 2:][:1].decode()


@pytest.mark.parametrize("when", ["running", "starting"])
def test_a_committer_whose_parent_is_killed_stops_cleanly_with_exit_with_parent(committer_factory, tmp_path, when):
    """A supervisor or a test run killed outright (SIGKILL: no teardown) left the committers it started running,
    their segments in /dev/shm for good. ``--exit-with-parent`` stops the committer as SIGTERM does once its
    parent is gone: the segments of a writer's key unlinked, its socket and lock removed, exit 0 (its new parent
    reaps it). Also a parent gone while the committer was still starting, before it read its options (its
    parent was init's by then: review, stop 59): ``--parent-pid`` names the parent it must have. The suite's own
    committers run with both (tests/conftest.py)."""
    pid_file = tmp_path / "committer.pid"
    script = _SUPERVISOR + ("child.wait()\n" if when == "running" else "os._exit(0)\n")
    handle = committer_factory(python_args=("-c", script, str(pid_file)), wait=when == "running")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not pid_file.exists():
        assert time.monotonic() < deadline and handle.proc.poll() in (None, 0), handle.log()
        time.sleep(0.01)
    pid = int(pid_file.read_text())
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8) if when == "running" else None
    try:
        if writer is not None:
            writer.open_key("k", "float32", 4)
            assert shm.list_segments(handle.name)
            handle.proc.kill()
        handle.proc.wait()
        while _state(pid) not in ("", "Z") and time.monotonic() < deadline + START_TIMEOUT_S:
            time.sleep(0.01)
        left = _state(pid) not in ("", "Z")
        if left:  # the committer_factory no longer knows it: stopped here, so that it leaves nothing either
            os.kill(pid, signal.SIGTERM)
            while _state(pid) not in ("", "Z"):
                time.sleep(0.01)
        assert not left, f"committer {pid} still ran long after its parent was gone:\n{handle.log()}"
    finally:
        if writer is not None:
            writer.raw.close()
    assert shm.list_segments(handle.name) == [], handle.log()
    assert [f for f in os.listdir(RUNTIME_DIR) if f.startswith(f"{handle.name}.")] == []
    assert "parent gone" in handle.log(), handle.log()
