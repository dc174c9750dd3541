"""The committer re-executes itself for non-temporal pool writes (``omnishm.committer.stores``).

Real committer processes started as users start them (``python -m omnishm.committer``): the new image has
the tunable in its environment, under the same pid, ``status`` reports it and glibc reads it; an operator's own setting is kept;
a stop signal that arrives while the process re-executes itself still stops it cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omnishm import paths, protocol
from omnishm.committer import stores

from conftest import REPO, RUNTIME_DIR, START_TIMEOUT_S, CommitterHandle, assert_clean_stop, wait_ready

TUNABLE = stores.TUNABLE
APPLIES = stores._applies()  # glibc on x86-64 (every build machine); elsewhere nothing may change
LOADER = "/lib64/ld-linux-x86-64.so.2"


def _glibc_reads(tunables: str) -> int:
    """The threshold glibc's loader takes from ``GLIBC_TUNABLES=tunables`` (``ld.so --list-tunables``)."""
    out = subprocess.run([LOADER, "--list-tunables"], env={"GLIBC_TUNABLES": tunables}, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    line = next(line for line in out.splitlines() if line.startswith(TUNABLE + ":"))
    return int(line.split()[1], 16)


def test_the_tunable_is_added_to_what_the_operator_set_and_never_replaces_it():
    assert stores.with_threshold("", 65536) == f"{TUNABLE}=65536"
    assert stores.with_threshold("glibc.malloc.check=0", 65536) == f"glibc.malloc.check=0:{TUNABLE}=65536"
    assert stores.with_threshold(f"glibc.malloc.check=0:{TUNABLE}=1048576", 65536) is None
    assert stores.with_threshold(f"{TUNABLE}=", 65536) is None  # named, even empty: the operator's
    with pytest.raises(ValueError, match="glibc ignores a threshold under 16448 bytes"):
        stores.check_threshold(100)
    with pytest.raises(ValueError, match="glibc ignores a threshold over 0xfffffffffffffff bytes"):
        stores.check_threshold(1 << 60)
    assert stores.check_threshold(0) == 0 and stores.check_threshold(stores.MIN_BYTES) == stores.MIN_BYTES


@pytest.mark.parametrize("argv, runs_again", [
    (["-m", "omnishm.committer", "--name", "x"], True),
    (["-momnishm.committer"], True),
    (["-IEm", "omnishm.committer"], True),
    (["-X", "dev", "-W", "error", "-u", "-m", "omnishm.committer"], True),
    (["-Xfrozen_modules=off", "-Wd", "--check-hash-based-pycs", "always", "-m", "omnishm.committer"], True),
    (["-m", "omnishm", "committer", "--name", "x"], True),
    (["/usr/local/bin/omnishm", "committer"], True),
    (["-m", "omnishm", "bench"], False),
    (["/usr/local/bin/omnishm", "status"], False),
    (["-c", "from omnishm.committer import main; main()"], False),
    (["-c", "pass", "-m", "omnishm.committer"], False),
    (["-"], False),
    (["launch.py", "-m", "omnishm.committer"], False),
    (["app.pyz"], False),
    (["-m"], False),
    ([], False),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_only_a_command_line_that_starts_the_committer_alone_is_run_again(argv, runs_again):
    """Running any other again may repeat what it did before the committer (a ``-c`` wrapper), find
    nothing to run (a program read from stdin) or lack what it was handed (a multiprocessing child)."""
    assert stores.is_entry_point([sys.executable, *argv]) is runs_again


@pytest.mark.parametrize("env, extra, want, want_env", [
    ({}, (), 65536, f"{TUNABLE}=65536"),
    ({"OMNISHM_NONTEMPORAL_THRESHOLD": "0"}, (), None, None),
    ({}, ("--nontemporal-threshold", "131072"), 131072, f"{TUNABLE}=131072"),
    ({"GLIBC_TUNABLES": "glibc.malloc.check=0"}, (), 65536, f"glibc.malloc.check=0:{TUNABLE}=65536"),
    ({"GLIBC_TUNABLES": f"{TUNABLE}=1048576"}, (), 1048576, f"{TUNABLE}=1048576"),
    ({"GLIBC_TUNABLES": f"{TUNABLE}=100"}, (), None, None),  # kept, and glibc ignores it: not reported
], ids=["default", "off", "flag", "other-tunables-kept", "operators-value-kept", "operators-ignored-value"])
def test_a_committer_runs_with_non_temporal_pool_writes_under_its_own_pid(committer_factory, monkeypatch, env,
                                                                          extra, want, want_env):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handle = committer_factory(*extra)
    st = handle.status()
    assert st["pid"] == handle.proc.pid  # re-executed in place: the pid the launcher knows
    if not APPLIES:  # not glibc on x86-64: the committer leaves its environment alone
        want, want_env = None, env.get("GLIBC_TUNABLES")
    assert st["nontemporal_threshold"] == want  # read from the new image's GLIBC_TUNABLES
    if want is not None:  # which glibc reads as that threshold (/proc/PID/environ shows what it rewrote)
        assert _glibc_reads(want_env) == want
    assert_clean_stop(handle)


# A stop signal sent while the committer re-executes itself: between its last look at the start-up catcher
# and the exec. Without the signals blocked across the exec, the first image's catcher took it and the new
# image never learned of it: the committer ran on after a SIGTERM. The committer is started as users start
# it (-m omnishm.committer); a sitecustomize on PYTHONPATH, which both images import, sends the signal.
_SITECUSTOMIZE = """
import os, signal
print("image", os.environ.get("OMNISHM_COMMITTER_REEXECED", "first"), flush=True)
real = os.execve
def execve(path, args, env):
    os.kill(os.getpid(), signal.SIGTERM)
    real(path, args, env)
os.execve = execve
"""


def test_a_stop_signal_sent_during_the_re_exec_stops_the_new_image_cleanly(committer_factory, monkeypatch,
                                                                          tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    handle = committer_factory(wait=False)
    try:
        rc = handle.proc.wait(START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the committer ran on after a SIGTERM:\n{handle.log()}") from None
    log = handle.log()
    assert rc == 0, log
    images = [line.split()[1] for line in log.splitlines() if line.startswith("image ")]
    assert images == (["first", "1"] if APPLIES else ["first"]), log
    assert "stopped (SIGTERM) before it started" in log, log
    assert not [f for f in os.listdir(RUNTIME_DIR) if f.startswith(handle.name)]


_WRAPPER = """
import sys
print("wrapper ran", flush=True)
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_committer_started_by_code_of_ones_own_is_not_run_again(committer_factory):
    """A ``-c`` wrapper ran twice (what it did before ``main`` too), and one that ignored SIGINT before
    ``main`` dropped a SIGINT held across the exec. It runs once, with glibc's own threshold."""
    handle = committer_factory(python_args=("-c", _WRAPPER))
    assert handle.status()["nontemporal_threshold"] is None
    assert_clean_stop(handle)
    assert handle.log().count("wrapper ran") == 1, handle.log()


def test_a_config_file_that_is_a_pipe_is_read_once_and_kept(tmp_path):
    """``--config <(...)``: the options were parsed twice, and once more by a new image, and every read
    after the first found the pipe empty: the committer ran on the defaults. Now they are parsed once,
    and a committer whose config is not a regular file is not run again."""
    name = f"ntpipe{os.getpid()}"
    log_path = tmp_path / "committer.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir",
                                 str(RUNTIME_DIR), "--config", "/dev/stdin"], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    proc.stdin.write(b"heartbeat_s = 0.25\nheartbeat_timeout_s = 30.0\n")
    proc.stdin.close()
    handle = CommitterHandle(name, paths.ipc_endpoint(RUNTIME_DIR, name), RUNTIME_DIR, proc, log_path)
    try:
        wait_ready(handle)
        client = handle.client()
        try:
            welcome = client.hello(protocol.ROLE_ADMIN)
            assert (welcome.heartbeat_s, welcome.heartbeat_timeout_s) == (0.25, 30.0), handle.log()
            assert client.status()["nontemporal_threshold"] is None
            client.goodbye()
        finally:
            client.close()
    finally:
        assert_clean_stop(handle)


def test_a_threshold_glibc_would_ignore_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "nt-refused", "--runtime-dir",
                           str(tmp_path), "--nontemporal-threshold", "100"], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert "glibc ignores a threshold under 16448 bytes" in proc.stderr
