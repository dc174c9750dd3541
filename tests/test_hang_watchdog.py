"""The suite's own hang watchdog (conftest.py, ``HANG_LIMIT_S``), run on a suite of two tiny tests.

pytest-timeout fails a test whose call hangs, but once it has fired it does not bound that test's teardown, and a
wait in C code that never returns to Python outlives it. Stop 57's CI sat at 1,309 of 1,320 results for 90
minutes with nothing to say where. The watchdog ends such a test's process and the xdist controller prints every
thread's stack; the run goes on, red.
"""

from __future__ import annotations

import os
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


def test_a_test_stuck_in_its_teardown_ends_its_worker_and_its_stacks_are_printed(tmp_path):
    """A real sub-run of pytest (two xdist workers, the suite's conftest) whose one test outlives pytest-timeout
    (1 s) in its call and then sticks in its teardown past the watchdog's limit (3 s): that worker exits, the
    summary names the test and shows the stuck frame, and the run exits 1 within seconds. The sub-run's
    temporary dirs live under ``tmp_path`` (``TMPDIR``): a worker the watchdog ended cannot remove its own."""
    (tmp_path / "conftest.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                                          f"sys.path.insert(0, {str(TESTS)!r}); "
                                          f"exec(open({str(TESTS / 'conftest.py')!r}).read())\n")
    (tmp_path / "test_stuck.py").write_text(_STUCK_SUITE)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OMNISHM_TEST_HANG_DIR", "OMNISHM_RUNTIME_DIR",
                                                             "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env.update(OMNISHM_TEST_HANG_LIMIT_S="3", TMPDIR=str(scratch))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "--max-worker-restart", "0", "-o", "timeout=1", "test_stuck.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "test_stuck.py::test_stuck was still running after 3 s; every thread's stack:" in out, out[-3000:]
    assert "in stuck_in_teardown" in out, out[-3000:]
    assert "Timeout (>1.0s) from pytest-timeout" in out, out[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck'" in out and "1 passed" in out, out[-3000:]
    assert not list(scratch.glob("omnishm-hangs-*")), "the controller removes the dump dir once printed"
