"""``scripts/launch_committer.sh``, the script a supervisor (systemd, supervisord, k8s) runs and signals beside the
engines (stop 52's mutation review: only its refusal of a non-loopback tcp endpoint was tested): it ``exec``s the
committer, so a SIGTERM to the pid the supervisor holds stops the committer cleanly, and it hands every argument
on unchanged."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, RUNTIME_DIR, START_TIMEOUT_S, CommitterHandle, unique_cache_name, wait_ready
from helpers import until
from omnishm import liveness, shm

SCRIPT = REPO / "scripts" / "launch_committer.sh"


@pytest.mark.parametrize("spaced", [False, True], ids=["session-dir", "dir-with-a-space"])
def test_sigterm_to_the_launch_script_stops_the_committer_it_runs_cleanly(tmp_path, spaced):
    """``scripts/launch_committer.sh`` is what a supervisor (systemd, supervisord, k8s) runs and signals: its
    header promises that SIGTERM stops the committer cleanly (every segment unlinked, exit 0). That holds only
    when the script ``exec``s the interpreter, so the pid the supervisor holds is the committer's. A shell
    left in between dies of the SIGTERM (exit 143) while the committer runs on, orphaned, holding the cache's
    lock, socket and segments: the supervisor's restart is then refused as a second committer.

    It hands its arguments on unchanged (``"$@"``): a runtime dir whose path holds a space (a home directory's
    "My Caches", a supervisor's quoted ExecStart argument) is one option value. Split into words, the start was
    refused as a usage error (exit 2)."""
    name = unique_cache_name("script")
    # Not under tmp_path: under xdist its path leaves too few of a socket path's 107 bytes.
    spaced_dir = Path(tempfile.mkdtemp(prefix="my caches-")) if spaced else None
    runtime = spaced_dir / "rt" if spaced_dir is not None else RUNTIME_DIR
    log_path = tmp_path / "script.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(SCRIPT), "--name", name, "--runtime-dir", str(runtime)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHON": sys.executable})
    handle = CommitterHandle(name, f"ipc://{runtime}/{name}.sock", runtime, proc, log_path)
    try:
        wait_ready(handle, START_TIMEOUT_S)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, handle.log()
        assert not liveness.cache_is_live(runtime, name), "the committer outlived its launch script"
        assert shm.list_segments(name) == [], handle.log()
        assert [f for f in os.listdir(runtime) if f.split(".", 1)[0] == name] == []
    finally:
        # A committer orphaned by its script (the bug this pins) is stopped by its pid in the lock file.
        held = liveness.CacheLock.holder(liveness.lock_path(runtime, name))
        if held is not None and held[1] != proc.pid and liveness.cache_is_live(runtime, name):
            os.kill(held[1], signal.SIGTERM)
            until(lambda: not liveness.cache_is_live(runtime, name), 15.0, "the orphaned committer to stop")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if spaced_dir is not None:
            shutil.rmtree(spaced_dir, ignore_errors=True)
