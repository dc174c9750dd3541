"""The suite's own hang watchdog (conftest.py, ``HANG_LIMIT_S``), run on a suite of two tiny tests.

pytest-timeout fails a test whose call hangs, but once it has fired it does not bound that test's teardown, and a
wait in C code that never returns to Python outlives it. Stop 57's CI sat at 1,309 of 1,320 results for 90
minutes with nothing to say where. The watchdog ends such a test's process and the xdist controller prints every
thread's stack; the run goes on, red.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

_STUCK_SUITE = '''
import threading
import time

import pytest


@pytest.fixture
def stuck_in_teardown():
    yield
    held = threading.Lock()
    held.acquire()
    held.acquire(timeout=600)  # past the watchdog's limit, as a wait no signal ends would be


def test_before():
    pass


def test_stuck(stuck_in_teardown):
    time.sleep(60)  # pytest-timeout (1 s here) fails the call, then no longer watches the teardown
'''


def _sub_run(tmp_path, name: str, suite: str, *args: str) -> subprocess.CompletedProcess:
    """pytest run on ``suite`` (as ``name``) with the suite's own conftest and a watchdog limit of 3 s. Its
    temporary dirs live under ``tmp_path`` (``TMPDIR``): a process the watchdog ended cannot remove its own."""
    (tmp_path / "conftest.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                                          f"sys.path.insert(0, {str(TESTS)!r}); "
                                          f"exec(open({str(TESTS / 'conftest.py')!r}).read())\n")
    (tmp_path / name).write_text(suite)
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OMNISHM_TEST_HANG_DIR", "OMNISHM_RUNTIME_DIR",
                                                             "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env.update(OMNISHM_TEST_HANG_LIMIT_S="3", TMPDIR=str(tmp_path / "tmp"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, name],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_stuck_in_its_teardown_ends_its_worker_and_its_stacks_are_printed(tmp_path):
    """A real sub-run of pytest (two xdist workers, the suite's conftest) whose one test outlives pytest-timeout
    (1 s) in its call and then sticks in its teardown past the watchdog's limit (3 s): that worker exits, the
    summary names the test and shows the stuck frame, and the run exits 1 within seconds."""
    proc = _sub_run(tmp_path, "test_stuck.py", _STUCK_SUITE, "-n", "2", "--dist", "loadfile",
                    "--max-worker-restart", "0", "-o", "timeout=1")
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "test_stuck.py::test_stuck was still running after 3 s; every thread's stack:" in out, out[-3000:]
    assert "in stuck_in_teardown" in out, out[-3000:]
    assert "Timeout (>1.0s) from pytest-timeout" in out, out[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck'" in out and "1 passed" in out, out[-3000:]
    assert not list((tmp_path / "tmp").glob("omnishm-hangs-*")), "the controller removes the dump dir once printed"


_PATIENT_SUITE = '''
import faulthandler
import os
import signal
import time

import pytest


@pytest.mark.timeout(10)
def test_slow_but_within_its_own_timeout():
    time.sleep(4)


def test_a_forked_child_may_touch_the_timer():
    pid = os.fork()
    if pid == 0:
        faulthandler.cancel_dump_traceback_later()  # as a normal interpreter exit does
        os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung on the parent's watchdog")
'''


def test_the_watchdog_spares_a_test_within_its_own_timeout_and_a_forked_child(tmp_path):
    """A serial sub-run, the watchdog's limit 3 s: a test marked ``timeout(10)`` runs its 4 s (the limit is twice
    its own timeout: the vLLM tier's engine tests allow themselves 300 and 420 s), and a forked child that cancels
    faulthandler's timer, as a normal interpreter exit does, exits (the watchdog is off across a fork; armed, the
    child waited for good on the parent's watchdog thread). REVIEW (stop 58)."""
    proc = _sub_run(tmp_path, "test_patient.py", _PATIENT_SUITE)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_dirs_of_sessions_killed_outright_are_swept_at_the_next_start():
    """A suite run killed outright (SIGKILL: no session end) left its runtime dir, holding its anchor lock, and its
    hang dir in the temp dir for good (review, stop 59: three runtime dirs after a mutation review's killed runs;
    stop 60: two hang dirs). The next session removes a dir whose anchors nobody holds and are older than a
    minute, when its other files are none (a runtime dir) or the watchdog's per-process files with their header
    only (a hang dir); a live session's (its anchor held), one just made (a session starting), one holding anything
    else and a hang dir holding stacks (a serial run the watchdog ended: a person reads them there) stay."""
    import tempfile
    import time

    from conftest import _sweep_dead_sessions
    from omnishm.liveness import CacheLock

    old = time.time() - 3600
    kinds = [("test", k) for k in ("dead", "live", "young", "other")]
    kinds += [("hangs", k) for k in ("dead", "live", "young", "other", "hung")]
    made = {(prefix, k): Path(tempfile.mkdtemp(prefix=f"omnishm-{prefix}-")) for prefix, k in kinds}
    held = [CacheLock.acquire(d, "tlive00-anchor", "session") for (_, k), d in made.items() if k == "live"]
    try:
        for (prefix, kind), d in made.items():
            if kind != "live":
                (d / f"t{kind[:4]}00-anchor.lock").write_text("1 session\n")
            if kind != "young":
                os.utime(next(d.glob("*-anchor.lock")), (old, old))
            if prefix == "hangs":
                header = "tests/test_x.py::test_y was still running after 300 s; every thread's stack:\n"
                (d / "4242.txt").write_text(header)
        (made["test", "other"] / "tother00-c0.sock").write_text("")
        (made["hangs", "other"] / "core").write_text("")
        with open(made["hangs", "hung"] / "4242.txt", "a") as f:
            f.write('Thread 0x00007f (most recent call first):\n  File "x.py", line 1 in stuck\n')
        removed = _sweep_dead_sessions()
        for prefix in ("test", "hangs"):
            assert made[prefix, "dead"] in removed and not made[prefix, "dead"].exists(), prefix
            assert all(made[prefix, k].exists() and made[prefix, k] not in removed
                       for k in ("live", "young", "other", "hung") if (prefix, k) in made), prefix
    finally:
        for lock in held:
            lock.release()
        for d in made.values():
            shutil.rmtree(d, ignore_errors=True)
