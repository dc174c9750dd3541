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

from omnishm.committer import stores

from conftest import RUNTIME_DIR, START_TIMEOUT_S, assert_clean_stop

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
    assert stores.check_threshold(0) == 0 and stores.check_threshold(stores.MIN_BYTES) == stores.MIN_BYTES


@pytest.mark.parametrize("env, extra, want, want_env", [
    ({}, (), 65536, f"{TUNABLE}=65536"),
    ({"OMNISHM_NONTEMPORAL_THRESHOLD": "0"}, (), None, None),
    ({}, ("--nontemporal-threshold", "131072"), 131072, f"{TUNABLE}=131072"),
    ({"GLIBC_TUNABLES": "glibc.malloc.check=0"}, (), 65536, f"glibc.malloc.check=0:{TUNABLE}=65536"),
    ({"GLIBC_TUNABLES": f"{TUNABLE}=1048576"}, (), 1048576, f"{TUNABLE}=1048576"),
], ids=["default", "off", "flag", "other-tunables-kept", "operators-value-kept"])
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
# image never learned of it: the committer ran on after a SIGTERM.
_SIGNAL_IN_THE_EXEC = """
import os, signal, sys
print("image", os.environ.get("OMNISHM_COMMITTER_REEXECED", "first"), flush=True)
real = os.execve
def execve(path, args, env):
    os.kill(os.getpid(), signal.SIGTERM)
    real(path, args, env)
os.execve = execve
from omnishm.committer import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stop_signal_sent_during_the_re_exec_stops_the_new_image_cleanly(committer_factory):
    handle = committer_factory(wait=False, python_args=("-c", _SIGNAL_IN_THE_EXEC))
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


def test_a_threshold_glibc_would_ignore_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "nt-refused", "--runtime-dir",
                           str(tmp_path), "--nontemporal-threshold", "100"], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert "glibc ignores a threshold under 16448 bytes" in proc.stderr
