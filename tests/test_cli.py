"""``omnishm status`` (human and --json) and ``omnishm ping`` exit codes against a real committer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import RUNTIME_DIR, unique_cache_name
from manager_helpers import Part, save, started

from omnishm import cli, paths, shm
from omnishm.client import HIDDEN_KEY, OmniPrefixCacheManager, PrefixCacheConfig

BS = 4
NUM_BLOCKS = 16


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_human_and_json_show_clients_memory_keys_and_throughput(committer_factory, capsys):
    handle = committer_factory("--heartbeat-s", "0.1")
    cfg = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_capacity_tokens=32, staging_depth=3,
                            staging_claim_timeout_s=2.0, commit_timeout_s=5.0)
    writer = OmniPrefixCacheManager(cfg, cache=handle.name, autostart=False)
    reader = OmniPrefixCacheManager(cfg, cache=handle.name, role="reader", autostart=False)
    try:
        writer.new_step_starts([started("a", [0, 1, 2])])
        writer.discard_step(save(writer, [Part("a", 1, [0, 1, 2], 0, 10)], BS))
        writer.wait_idle()
        code, out, err = run(capsys, "status", "--name", handle.name, "--json")
        assert code == 0, err
        st = json.loads(out)
        roles = {c["client_id"]: c for c in st["clients"]}
        w, r = roles[writer._link.client_id], roles[reader._link.client_id]
        assert (w["role"], r["role"]) == ("writer", "reader")
        for c in (w, r):  # per-process resident and shared bytes from /proc/PID/statm
            assert c["rss_bytes"] > 0 and 0 < c["shared_bytes"] <= c["rss_bytes"]
        assert st["committer_memory"]["rss_bytes"] > 0
        keys = {k["name"]: k for k in st["keys"]}
        assert keys[HIDDEN_KEY]["pool_bytes"] == NUM_BLOCKS * BS * 8 * 4  # float32[8] mirror
        assert keys[HIDDEN_KEY]["committed_rows"] == 10
        assert keys["feat"]["committed_share"] == pytest.approx(10 / (NUM_BLOCKS * BS))
        assert st["rows_written"] == 20 and st["throughput"]["rows_per_s"] > 0
        assert st["throughput"]["window_s"] > 0 and st["metrics_endpoint"] is None

        code, out, err = run(capsys, "status", "--name", handle.name)
        assert code == 0, err
        assert f"cache {handle.name}" in out and "rows/s" in out and "MB/s" in out
        assert re.search(r"committer rss \d+\.\d\d MiB", out)
        assert re.search(rf"{HIDDEN_KEY}\s+float32\s+8\s+0\.00 MiB\s+10\s+15\.6%", out)
        writer_line = next(line for line in out.splitlines() if line.startswith(writer._link.client_id))
        assert re.search(r"writer\s+\d+\s+[\d.]+s\s+[\d.]+ MiB\s+[\d.]+ MiB$", writer_line), writer_line
    finally:
        reader.shutdown()
        writer.shutdown()


def test_format_status_uses_gib_for_large_sizes():
    assert cli._mib(3 * 2**30) == "3.00 GiB" and cli._mib(5 * 2**20) == "5.00 MiB"


def test_ping_exit_codes(committer_factory, capsys, monkeypatch):
    handle = committer_factory()
    code, out, _ = run(capsys, "ping", "--name", handle.name, "--timeout-s", "5")
    assert code == 0 and f"cache {handle.name}: committer pid {handle.proc.pid}" in out
    monkeypatch.setenv("OMNISHM_NAME", handle.name)  # the target resolves through the knobs: env works too
    assert run(capsys, "ping")[0] == 0
    monkeypatch.delenv("OMNISHM_NAME")

    absent = unique_cache_name("absent")
    code, _, err = run(capsys, "ping", "--name", absent)
    assert code == 1 and f"no committer for cache {absent!r}" in err
    t0 = time.monotonic()  # something that accepts nothing: bounded by --timeout-s
    code, _, err = run(capsys, "ping", "--name", absent, "--endpoint", "tcp://127.0.0.1:9", "--timeout-s", "0.3")
    assert code == 1 and "within 0.3s" in err and time.monotonic() - t0 < 10

    code, _, err = run(capsys, "ping", "--name", absent, "--endpoint", "tcp://10.1.2.3:5555")
    assert code == 2 and "only on loopback" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["ping", "--timeout-s", "-1"])
    assert exc.value.code == 2 and "must be > 0" in capsys.readouterr().err


def test_status_into_a_closed_pipe_exits_without_a_traceback(committer_factory):
    """``omnishm status | head``: the reader left before the output was written."""
    handle = committer_factory()
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "omnishm", "status", "--name", handle.name, "--json"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(w)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_an_explicit_name_pings_that_caches_socket_whatever_omnishm_endpoint_says(committer_factory, capsys,
                                                                                      monkeypatch):
    """Review (stop 56): with OMNISHM_ENDPOINT set to cache A's socket, ``omnishm ping --name B`` asked A and failed
    ("this committer serves cache A, not B"). As for a manager, a name given without an endpoint means that
    cache's own socket; an endpoint given as a flag still wins."""
    a, b = committer_factory(), committer_factory()
    monkeypatch.setenv("OMNISHM_ENDPOINT", a.endpoint)
    code, out, err = run(capsys, "ping", "--name", b.name, "--runtime-dir", str(b.runtime_dir))
    assert code == 0, out + err
    code, out, err = run(capsys, "ping", "--name", b.name, "--endpoint", a.endpoint)
    assert code == 1 and f"serves cache '{a.name}'" in out + err, out + err


def test_ping_entry_point_exit_status(committer_factory):
    handle = committer_factory()
    proc = subprocess.run([sys.executable, "-m", "omnishm", "ping", "--name", handle.name], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    handle.stop()
    proc = subprocess.run([sys.executable, "-m", "omnishm", "ping", "--name", handle.name, "--timeout-s", "1"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "no committer" in proc.stderr


def test_ping_and_a_manager_reach_a_committer_on_ipv6_loopback(committer_factory, capsys):
    """README/OPERATIONS: tcp is allowed on loopback, 127.0.0.1, ::1 or localhost. The committer binds
    tcp://[::1]:PORT (its socket sets ZMQ_IPV6); its clients must be able to connect there too."""
    import socket

    from manager_helpers import small_config

    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://[::1]:{port}"
    handle = committer_factory("--endpoint", endpoint, wait=False)
    deadline = time.monotonic() + 60
    while "started" not in handle.log():
        assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
        time.sleep(0.1)
    code, out, err = run(capsys, "ping", "--name", handle.name, "--endpoint", endpoint, "--timeout-s", "10")
    assert code == 0, err
    with OmniPrefixCacheManager(small_config(), cache=handle.name, endpoint=endpoint, autostart=False,
                                connect_timeout_s=10.0) as m:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], 4))
        m.wait_idle()


def test_ping_names_a_crashed_committers_socket_and_the_command_that_removes_it(committer_factory, capsys):
    """A SIGKILLed committer leaves its socket file (trap 4); nothing holds the cache lock beside it. ping
    says so at once, naming ``omnishm cleanup``, instead of waiting its timeout for an answer that cannot
    come; cleanup then removes what was left."""
    import signal

    from omnishm import paths, shm

    handle = committer_factory()
    assert handle.stop(signal.SIGKILL) == -signal.SIGKILL
    assert paths.socket_path(handle.runtime_dir, handle.name).exists()
    t0 = time.monotonic()
    code, _out, err = run(capsys, "ping", "--name", handle.name, "--timeout-s", "30")
    assert code == 1 and time.monotonic() - t0 < 10, err
    assert "left over" in err and f"omnishm cleanup --name {handle.name}" in err, err
    code, _out, err = run(capsys, "cleanup", "--name", handle.name)
    assert code == 0, err
    assert not paths.socket_path(handle.runtime_dir, handle.name).exists()
    assert shm.list_segments(handle.name) == []


def test_pings_cleanup_advice_for_a_committer_of_another_runtime_dir_names_the_dir_and_works_as_printed(
        committer_factory, capsys, monkeypatch):
    """REVIEW (2026-12-07, stop 54): for a crashed committer of a runtime dir other than the default, ping's
    advice said ``omnishm cleanup --name N``: run as printed, it looked in the default dir, left the socket and
    the lock files, and the next ping gave the same advice again. The advice now names the dir, and the command
    it prints, run as printed, removes what was left."""
    import shlex
    import signal
    import tempfile

    handle = committer_factory()
    assert handle.stop(signal.SIGKILL) == -signal.SIGKILL
    elsewhere = tempfile.mkdtemp(prefix="omnishm-other-")
    try:
        monkeypatch.setenv("OMNISHM_RUNTIME_DIR", elsewhere)  # the default dir is now another one
        code, _out, err = run(capsys, "ping", "--name", handle.name, "--runtime-dir", str(handle.runtime_dir))
        assert code == 1 and "left over" in err, err
        advised = re.search(r"`(omnishm cleanup [^`]*)`", err)
        assert advised is not None and "--runtime-dir" in advised.group(1), err
        argv = shlex.split(advised.group(1))
        code, _out, err = run(capsys, *argv[1:])
        assert code == 0, err
        assert not paths.socket_path(handle.runtime_dir, handle.name).exists()
        left = [f for f in os.listdir(handle.runtime_dir) if f.startswith(handle.name + ".")]
        assert left == [], left
        assert shm.list_segments(handle.name) == []
        assert os.listdir(elsewhere) == []
    finally:
        os.rmdir(elsewhere)


def test_cleanup_of_a_runtime_dir_that_is_a_file_is_an_error_as_for_ping(capsys, tmp_path):
    """REVIEW (2026-12-07, stop 54): ``cleanup --runtime-dir FILE`` said "0 orphaned object(s) removed" with exit 0,
    where ping and the committer refuse the same value."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    code, out, err = run(capsys, "cleanup", "--runtime-dir", str(a_file))
    assert code == 1 and f"runtime dir {a_file} is not a directory" in err, (out, err)
    code, _out, err = run(capsys, "ping", "--runtime-dir", str(a_file), "--timeout-s", "1")
    assert code == 1 and "Not a directory" in err, err


def test_ping_of_a_stopped_committer_names_its_pid_and_how_to_see_where_it_stands(committer_factory, capsys):
    """REVIEW (2026-12-06, a newcomer's walkthrough): ping and status of a committer frozen by SIGSTOP said
    "no committer ... answered", though the cache lock shows a live one: the operator went looking for a
    committer that runs. They now name its pid, and how to see where it stands."""
    import signal

    from helpers import wait_stopped

    handle = committer_factory()
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(handle.proc.pid)
        code, _out, err = run(capsys, "ping", "--name", handle.name, "--timeout-s", "0.5")
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
    assert code == 1, err
    assert f"(pid {handle.proc.pid}) holds its lock but did not answer" in err and "kill -USR1" in err, err
    assert run(capsys, "ping", "--name", handle.name, "--timeout-s", "10")[0] == 0


def test_ping_of_a_stopped_committer_started_with_an_endpoint_names_its_pid_too(committer_factory, capsys):
    """A frozen committer started with ``--endpoint`` (the endpoint's socket lock held by it), pinged at that
    endpoint: the same answer as on the cache's own socket, its pid and how to see where it stands. DOCS AUDIT
    (stop 48): it said "no committer for cache ... answered", which README's error table does not list for it."""
    import signal

    from helpers import wait_stopped

    name = unique_cache_name("epstop")
    endpoint = f"ipc://{RUNTIME_DIR}/other-{name}.sock"
    handle = _started_at(committer_factory, endpoint, name)
    assert run(capsys, "ping", "--name", name, "--endpoint", endpoint, "--timeout-s", "10")[0] == 0  # it serves
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(handle.proc.pid)
        code, _out, err = run(capsys, "ping", "--name", name, "--endpoint", endpoint, "--timeout-s", "0.5")
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
    assert code == 1, err
    assert f"(pid {handle.proc.pid}) holds its lock but did not answer" in err and "kill -USR1" in err, err


def _started_at(committer_factory, endpoint: str, name: str):
    """A committer of ``name`` started with ``--endpoint endpoint``, once its log says it started (the fixture's
    own readiness check asks the cache's own socket)."""
    handle = committer_factory("--endpoint", endpoint, name=name, wait=False)
    deadline = time.monotonic() + 60
    while "started" not in handle.log():
        assert handle.proc.poll() is None and time.monotonic() < deadline, handle.log()
        time.sleep(0.1)
    return handle


def test_ping_reaches_a_live_committer_whose_ipc_socket_lives_outside_the_runtime_dir(committer_factory, capsys,
                                                                                       tmp_path):
    """The crashed-socket check applies only to the cache's own socket in the runtime dir, where its lock
    lives: a live committer on ``ipc://OTHER/NAME.sock`` must be pinged, not called left over (review)."""
    name = unique_cache_name("elsewhere")
    other = tmp_path / "socks"
    other.mkdir(mode=0o700)
    endpoint = f"ipc://{other}/{name}.sock"
    handle = _started_at(committer_factory, endpoint, name)
    code, out, err = run(capsys, "ping", "--name", name, "--endpoint", endpoint, "--timeout-s", "10")
    assert code == 0, err
    # Without its --endpoint, ping looked at the cache's own socket and said no committer ran (review).
    code, out, err = run(capsys, "ping", "--name", name, "--timeout-s", "10")
    assert code == 1 and f"the committer of cache {name!r} (pid {handle.proc.pid}) does not serve" in err, err
    assert "pass the --endpoint it was started with" in err, err


def test_cleanup_refuses_a_name_that_is_no_cache_name_and_touches_nothing(tmp_path, capsys, monkeypatch):
    """REVIEW (2026-12-05): ``cleanup --name`` was the one command that did not check the name, and it names
    files in the runtime dir: ``--name ../outside/important`` removed important.sock and .lock elsewhere."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    for suffix in ("sock", "lock"):
        (outside / f"important.{suffix}").write_text("data")
    code, out, err = run(capsys, "cleanup", "--runtime-dir", str(runtime), "--name", "../outside/important")
    assert code == 2 and "invalid cache name '../outside/important'" in err and out == "", (out, err)
    assert sorted(p.name for p in outside.iterdir()) == ["important.lock", "important.sock"]


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0"])
def test_a_wait_no_poll_can_take_is_refused_as_an_option(committer_factory, capsys, value):
    """REVIEW (2026-12-05): ``ping --timeout-s inf`` (or 1e300) against a live committer ended in an
    OverflowError traceback from ZeroMQ's poll. It is refused as the option it is (exit 2)."""
    handle = committer_factory()
    with pytest.raises(SystemExit) as exc:
        cli.main(["ping", "--name", handle.name, "--timeout-s", value])
    assert exc.value.code == 2
    assert "--timeout-s: must be > 0 and <= 1e+06" in capsys.readouterr().err


def test_ping_status_and_cleanup_of_a_directory_we_cannot_read_say_so_without_a_traceback(committer_factory, capsys,
                                                                                         monkeypatch):
    """REVIEW (2026-12-05, permissions): run as another user against a 0700 runtime dir, ping, status and
    cleanup ended in a PermissionError traceback. The kernel's refusal is stood in for here (the tests run as
    root, whom it does not refuse)."""
    import pathlib

    from omnishm import orphans

    handle = committer_factory()
    sock = pathlib.Path(handle.endpoint[len("ipc://"):])
    real_lstat = pathlib.Path.lstat

    def refused(self, *a, **kw):
        if self == sock:
            raise PermissionError(13, "Permission denied", str(self))
        return real_lstat(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "lstat", refused)
    for cmd in ("ping", "status"):
        code, out, err = run(capsys, cmd, "--name", handle.name, "--runtime-dir", str(RUNTIME_DIR))
        assert code == 1 and f"cannot reach the socket of cache {handle.name!r} at {sock}: Permission denied" in err
    monkeypatch.undo()

    def sweep_refused(*a, **kw):
        raise PermissionError(13, "Permission denied", str(RUNTIME_DIR / f"{handle.name}.lock"))

    monkeypatch.setattr(orphans, "sweep", sweep_refused)
    code, out, err = run(capsys, "cleanup", "--name", handle.name, "--runtime-dir", str(RUNTIME_DIR))
    assert code == 1 and "Permission denied (a directory of another user?" in err, err


def test_ping_refuses_a_socket_of_another_user_in_a_shared_directory(capsys, tmp_path):
    """REVIEW (2026-12-05, stop 42): ``ping`` and ``status`` sent their Hello to whatever socket sat at the
    endpoint. In a shared sticky directory another user could bind the name, answer with a Welcome, and a
    readiness check by ``ping`` said our committer ran when none did. They make a client's check now."""
    import threading

    import zmq

    from omnishm import protocol

    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    name = unique_cache_name("foreign")
    sock_path = shared / f"{name}.sock"
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(f"ipc://{sock_path}")
    os.chown(sock_path, 65534, 65534)  # as if another user had bound it (the tests run as root)
    stop = threading.Event()

    def answer() -> None:  # the other user's committer: welcomes every Hello
        while not stop.is_set():
            if not fake.poll(50):
                continue
            ident, payload = fake.recv_multipart()
            hello = protocol.request_decoder.decode(payload)
            fake.send_multipart([ident, protocol.encode(protocol.Welcome(
                rid=hello.rid, client_id=getattr(hello, "client_id", ""), generation="forged", epoch=0,
                control="", layout=protocol.Layout(num_blocks=1, block_size=1), keys=[], heartbeat_s=1.0,
                heartbeat_timeout_s=5.0, committer_pid=1))])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        code, out, err = run(capsys, "ping", "--name", name, "--endpoint", f"ipc://{sock_path}", "--timeout-s", "5")
        assert code == 1 and out == "", (out, err)
        assert f"not asking the socket of cache {name!r}: socket {sock_path} belongs to uid 65534" in err, err
    finally:
        stop.set()
        thread.join()
        fake.close()


@pytest.mark.parametrize("kind", ["file", "loop", "long"])
def test_ping_status_and_cleanup_of_a_runtime_dir_that_cannot_be_one_say_so_without_a_traceback(capsys, tmp_path,
                                                                                                kind):
    """REVIEW (2026-12-05, stop 42, CLI): a runtime dir that is a file, a symlink loop or a name too long ended
    ``ping``, ``status`` and ``cleanup`` in a NotADirectoryError or OSError traceback."""
    if kind == "file":
        bad = tmp_path / "a-file"
        bad.write_text("x")
    elif kind == "loop":
        bad = tmp_path / "loop"
        os.symlink(bad, bad)
    else:
        bad = tmp_path / ("a" * 300)
    for cmd in ("ping", "status", "cleanup"):
        wait = ("--timeout-s", "1") if cmd != "cleanup" else ()
        code, out, err = run(capsys, cmd, "--runtime-dir", str(bad), *wait)
        if cmd == "cleanup" and kind != "long":  # no runtime dir there to sweep: the segments are swept still
            # and the dir is named as not one (it said success: review, stop 54)
            assert code == 1 and "0 orphaned object(s) removed" in out, (out, err)
            assert f"omnishm cleanup: runtime dir {bad} is not a directory" in err, err
        else:
            assert code == 1 and f"omnishm {cmd}: " in err and "Traceback" not in err, (cmd, err)


def test_ping_says_what_answered_is_not_an_omnishm_committer(capsys, tmp_path):
    """REVIEW (2026-12-05, stop 42, CLI): a reply that is not an omnishm message (another ZeroMQ service at the
    endpoint, or a committer of another protocol) ended ping and status in a msgspec ValidationError traceback."""
    import threading

    import zmq

    sock_dir = tmp_path / "socks"
    sock_dir.mkdir(mode=0o700)
    endpoint = f"ipc://{sock_dir}/other.sock"
    ctx = zmq.Context.instance()
    other = ctx.socket(zmq.ROUTER)
    other.setsockopt(zmq.LINGER, 0)
    other.bind(endpoint)

    def answer() -> None:
        if other.poll(10_000):
            ident, _ = other.recv_multipart()
            other.send_multipart([ident, b"\x93\x01\x02\x03"])  # msgpack, but no omnishm reply

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        code, out, err = run(capsys, "ping", "--name", "other", "--endpoint", endpoint, "--timeout-s", "10")
        assert code == 1 and "is not an omnishm committer of protocol" in err and "Traceback" not in err, err
    finally:
        thread.join()
        other.close()


# Mutation review (2026-12-06): every subcommand reads --config FILE; cleanup --force.


def test_ping_and_status_find_the_committer_their_config_file_names(committer_factory, capsys, tmp_path,
                                                                     monkeypatch):
    """README, Configuration: ``ping`` and ``status`` resolve their target (name, runtime dir, endpoint) from
    flags > ``OMNISHM_*`` > the ``--config`` TOML file > defaults. A running committer named only in the file
    (no ``--name``, no ``OMNISHM_NAME``, no ``OMNISHM_RUNTIME_DIR``) is the one asked: both exit 0 and name
    its pid. An ignored ``--config`` asked the ``default`` cache in the default runtime dir and exited 1."""
    handle = committer_factory()
    cfg = tmp_path / "omnishm.toml"
    cfg.write_text(f'name = "{handle.name}"\nruntime_dir = "{RUNTIME_DIR}"\n')
    monkeypatch.delenv("OMNISHM_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("OMNISHM_NAME", raising=False)
    monkeypatch.delenv("OMNISHM_CONFIG", raising=False)
    code, out, err = run(capsys, "ping", "--config", str(cfg), "--timeout-s", "10")
    assert code == 0 and f"cache {handle.name}: committer pid {handle.proc.pid}" in out, err
    code, out, err = run(capsys, "status", "--config", str(cfg), "--timeout-s", "10")
    assert code == 0 and f"cache {handle.name}" in out and f"pid {handle.proc.pid}" in out, err


def test_cleanup_sweeps_the_runtime_dir_its_config_file_names(committer_factory, capsys, tmp_path, monkeypatch):
    """README, Configuration / ``omnishm cleanup``: its runtime dir comes from ``--runtime-dir`` >
    ``OMNISHM_RUNTIME_DIR`` > the ``--config`` file > default. A SIGKILLed committer's socket and lock file in
    the runtime dir that only the config file names are removed, with its segments; an ignored ``--config``
    swept the default runtime dir and left that socket behind."""
    handle = committer_factory()
    assert handle.stop(signal.SIGKILL) == -signal.SIGKILL
    assert paths.socket_path(handle.runtime_dir, handle.name).exists()
    cfg = tmp_path / "omnishm.toml"
    cfg.write_text(f'runtime_dir = "{RUNTIME_DIR}"\n')
    monkeypatch.delenv("OMNISHM_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("OMNISHM_CONFIG", raising=False)
    code, out, err = run(capsys, "cleanup", "--config", str(cfg), "--name", handle.name)
    assert code == 0, err
    assert not paths.socket_path(handle.runtime_dir, handle.name).exists(), out
    assert shm.list_segments(handle.name) == []


def test_cleanup_force_removes_a_dead_committers_generation_that_a_client_still_maps(committer_factory, capsys):
    """``omnishm cleanup --name N`` keeps the segments of a dead committer's generation while a client still
    holds them (its resume needs them: the next start adopts them); ``--force`` removes them all the same
    (README / ``omnishm cleanup --help``: "also remove segments that clients of a dead committer still map").
    Without ``--force`` honoured, an operator who decided the clients are lost could not free that memory."""
    from helpers import Writer
    from test_committer_safety import LAYOUT, SLOW, _hold_attached

    handle = committer_factory(*SLOW)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    writer.open_key("k", "float32", 4)
    fd = _hold_attached(writer.welcome.control)
    try:
        assert handle.stop(signal.SIGKILL) == -signal.SIGKILL
        code, out, err = run(capsys, "cleanup", "--name", handle.name)
        assert code == 0 and shm.list_segments(handle.name) != [], out + err  # kept for the client's resume
        # and it says so (review, stop 56: it printed only what it removed)
        assert f"kept {len(shm.list_segments(handle.name))} segment(s) of cache {handle.name}" in out and \
            "--force removes those" in out, out
        code, out, err = run(capsys, "cleanup", "--name", handle.name, "--force")
        assert code == 0, err
        assert shm.list_segments(handle.name) == [], out
        assert not paths.socket_path(handle.runtime_dir, handle.name).exists()
    finally:
        os.close(fd)
        writer.raw.close()


def test_cleanup_of_a_symlink_loop_runtime_dir_still_sweeps_a_dead_cache(capsys, tmp_path):
    """REVIEW (stop 51): ``cleanup --runtime-dir`` naming a symlink loop swept the dead caches' segments only while
    there were none: with one, asking whether its committer's lock was held raised ELOOP, and cleanup failed
    ("Too many levels of symbolic links") with the dead generation left. A dir that is a loop holds no lock, as
    one that is a file holds none."""
    from omnishm import liveness

    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    cache = unique_cache_name("loopdead")
    made = [shm.segment_name(cache, "g0", w) for w in ("ctl", "pool.k0")]
    for name in made:
        shm.Segment.create(name, 64).close()
    liveness.GenerationOwner.acquire(cache, "g0", runtime_dir=RUNTIME_DIR).release(unlink=False)
    made.append(shm.segment_name(cache, "g0", liveness.OWNER))
    try:
        code, out, err = run(capsys, "cleanup", "--runtime-dir", str(loop))
        # swept, and the dir named as not one (stop 54)
        assert code == 1 and "3 orphaned object(s) removed" in out and "is not a directory" in err, (out, err)
        assert shm.list_segments(cache) == []
    finally:
        for name in made:
            shm.unlink_segment(name)


def test_ping_of_a_cache_whose_socket_path_holds_a_file_says_so_and_not_to_clean_up(capsys):
    """REVIEW (stop 51): since a committer and the sweeps leave whatever is not a socket at a socket's path, ping's
    advice for a leftover ("``omnishm cleanup --name`` removes what it left") did nothing for a file there, and the
    committer kept refusing to start. Ping and status now say the path is not a socket and that omnishm leaves it."""
    name = unique_cache_name("nsping")
    sock = paths.socket_path(RUNTIME_DIR, name)
    sock.write_text("leftover")
    try:
        for cmd in ("ping", "status"):
            code, out, err = run(capsys, cmd, "--name", name, "--timeout-s", "1")
            assert code == 1 and out == "", (cmd, out, err)
            assert f"{sock} is not a socket, and omnishm never replaces or removes it" in err and "cleanup" not in err
        code, out, err = run(capsys, "cleanup", "--name", name)
        assert code == 0 and "0 orphaned object(s) removed" in out and sock.read_text() == "leftover", (out, err)
    finally:
        sock.unlink()


def test_ping_through_a_symlink_to_a_live_committers_socket_reaches_it(committer_factory, capsys, tmp_path):
    """REVIEW (stop 51): a link to a socket is judged by its target, as a client connecting through it is served:
    ping said such an endpoint "is not a socket" while clients used it. A committer still never binds at a link."""
    handle = committer_factory()
    links = tmp_path / "links"
    links.mkdir(mode=0o700)
    link = links / "alias.sock"
    link.symlink_to(paths.socket_path(RUNTIME_DIR, handle.name))
    code, out, err = run(capsys, "ping", "--name", handle.name, "--endpoint", f"ipc://{link}", "--timeout-s", "5")
    assert code == 0 and "not a socket" not in err, (out, err)


# Stop 52's mutation review of omnishm/cli.py.
def test_ping_and_status_of_a_committer_that_refuses_the_admin_session_exit_1_naming_its_reason(
        committer_factory, capsys):
    """``cli.admin_request``: a committer that answers the admin Hello with a refusal (here: it serves another
    cache than the one ``--name`` asks for, reached by its ``--endpoint``) is no committer for that cache:
    ``omnishm ping`` and ``status`` exit 1 with "refused the admin session" and the committer's reason, not
    exit 0 and not a traceback (an ``Error`` reply read as a ``Welcome``). The committer serves on."""
    handle = committer_factory()
    other = unique_cache_name("notserved")
    for cmd in ("ping", "status"):
        code, out, err = run(capsys, cmd, "--name", other, "--endpoint", handle.endpoint, "--timeout-s", "10")
        assert code == 1, (cmd, out, err)
        assert f"committer for cache {other!r} refused the admin session" in err, err
        assert f"this committer serves cache {handle.name!r}, not {other!r}" in err, err
        assert "Traceback" not in err
    code, out, err = run(capsys, "ping", "--name", handle.name, "--timeout-s", "10")
    assert code == 0, err


def test_cleanup_name_removes_that_dead_cache_alone(committer_factory, capsys):
    """``omnishm cleanup --name A`` sweeps cache A only: of two caches whose committers were SIGKILLed, the
    other's segments and runtime-dir files are left for its own restart (which adopts or sweeps them) or its
    own cleanup, and the command names only A's objects in its output. A second ``cleanup --name B`` then
    removes B's, and nothing of either is left."""
    a = committer_factory(name=unique_cache_name("cleana"))
    b = committer_factory(name=unique_cache_name("cleanb"))
    for h in (a, b):
        h.proc.kill()
        h.proc.wait()
    b_segments = shm.list_segments(b.name)
    b_files = sorted(f for f in os.listdir(RUNTIME_DIR) if f.split(".", 1)[0] == b.name)
    assert b_segments and b_files
    code, out, err = run(capsys, "cleanup", "--name", a.name, "--runtime-dir", str(RUNTIME_DIR))
    assert code == 0, err
    assert shm.list_segments(a.name) == []
    assert shm.list_segments(b.name) == b_segments, out
    assert sorted(f for f in os.listdir(RUNTIME_DIR) if f.split(".", 1)[0] == b.name) == b_files, out
    assert b.name not in out and f"for cache {a.name}" in out, out
    code, out, err = run(capsys, "cleanup", "--name", b.name, "--runtime-dir", str(RUNTIME_DIR))
    assert code == 0 and shm.list_segments(b.name) == [], out + err
    assert [f for f in os.listdir(RUNTIME_DIR) if f.split(".", 1)[0] in (a.name, b.name)] == []


_STATUS_FAILS = """
import sys
from omnishm import protocol
from omnishm.committer.server import Committer
dispatch = Committer.dispatch
def failing(self, identity, msg):
    if isinstance(msg, protocol.StatusRequest):
        raise RuntimeError("no status here")
    return dispatch(self, identity, msg)
Committer.dispatch = failing
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_status_given_an_error_instead_of_its_report_exits_1_and_says_so(committer_factory, capsys):
    """``omnishm status`` exits 0 only when it printed the committer's report. A committer that welcomes the admin
    session and then answers the StatusRequest with something else (an ``Error`` here: its status failed) is
    reported as "unexpected reply" with exit 1, and nothing on stdout, so a script's ``omnishm status || alert``
    does not take an empty answer for a healthy cache. A real committer, its status made to fail."""
    handle = committer_factory(python_args=("-c", _STATUS_FAILS))
    code, out, err = run(capsys, "status", "--name", handle.name, "--timeout-s", "10")
    assert code == 1, (out, err)
    assert "unexpected reply" in err and "RuntimeError: no status here" in err and out == "", (out, err)
    code, out, err = run(capsys, "ping", "--name", handle.name, "--timeout-s", "10")
    assert code == 0, err  # the committer serves on
