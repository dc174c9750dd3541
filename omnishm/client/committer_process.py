"""The committer as a process seen from a client: start one (autostart), and tell whether it still lives.

``start_committer`` starts an embedded committer in its own session with its
log in the runtime dir; the committer removes the log when it stops cleanly,
so a failed start keeps it with the reason. ``proc_identity`` is how a link
notices its committer died between two heartbeats (a zombie, or another
process under the same pid, counts as gone).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from omnishm import cpus
from omnishm.paths import ipc_endpoint
from omnishm.shm import proc_identity

logger = logging.getLogger(__name__)


def start_committer(cache: str, runtime_dir: Path, *, endpoint: str | None = None,
                    exit_when_idle: bool = True) -> subprocess.Popen:
    """Start an embedded committer for ``cache`` in its own session (it outlives no client).

    ``endpoint``: where the client will connect (default ``ipc://RUNTIME_DIR/NAME.sock``), always passed
    on as a flag: the committer inherits this process's environment, and an ``OMNISHM_ENDPOINT`` (or an
    ``endpoint`` in ``$OMNISHM_CONFIG``) there would otherwise win over the default it was meant to bind.
    """
    cmd = [sys.executable, "-m", "omnishm.committer", "--name", cache, "--runtime-dir", str(runtime_dir),
           "--endpoint", endpoint if endpoint is not None else ipc_endpoint(Path(runtime_dir), cache)]
    if exit_when_idle:
        # This process by pid and start time: the committer tells whether it still runs even when it is
        # gone before the committer looked (then the committer's parent is no longer this pid).
        me = proc_identity(os.getpid())
        cmd += ["--exit-when-idle", "--spawned-by", f"{os.getpid()}:{me}" if me else str(os.getpid())]
    log_path = Path(runtime_dir) / f"{cache}.autostart.log"
    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    env = {**os.environ, "OMNISHM_AUTOSTART_LOG": str(log_path)}
    # Started unpinned: not on the starting rank's core, which its busy-waiting main thread keeps
    # (omnishm/cpus.py); a child inherits its parent's CPU set at fork, every thread of it included.
    with cpus.unpinned():
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                    env=env)
        finally:
            log.close()
        # Reap it when it exits so it never lingers as a zombie of the runner.
        threading.Thread(target=proc.wait, name=f"omnishm-reap-{cache}", daemon=True).start()
    logger.info("cache %s: autostarted committer pid %d", cache, proc.pid)
    return proc
