"""The committer as a process seen from a client: start one (autostart), and tell whether it still lives.

``start_committer`` starts an embedded committer, detached from the client's
process tree, with its log in the runtime dir; the committer removes the log
when it stops cleanly, so a failed start keeps it with the reason.
``proc_identity`` is how a link notices its committer died between two
heartbeats (a zombie, or another process under the same pid, counts as gone).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from omnishm import cpus
from omnishm.paths import ipc_endpoint
from omnishm.liveness import proc_identity, proc_parent

logger = logging.getLogger(__name__)

SHELL = "/bin/sh"
_DETACH = '"$@" </dev/null >>"$0" 2>&1 & echo $!'
"""``sh -c`` script: run the command in the background with its output appended to the log (``$0``), print
its pid, exit. The command's parent is then gone at once, so it is re-parented to init (or the nearest
subreaper). As a background job of a non-interactive shell it starts with SIGINT and SIGQUIT ignored;
the committer installs its own handlers for them first thing (``omnishm.committer.main``,
``committer/early_stop.py``)."""
_LAUNCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class AutostartedCommitter:
    """A committer this process started: not its child (see ``start_committer``), so known by pid and
    start time (``ident``, ``proc_identity``) rather than by a ``Popen``. Any thread."""

    cache: str
    pid: int
    ident: str | None

    def alive(self) -> bool:
        """The process of that pid and start time still runs (not a zombie)."""
        return self.ident is not None and proc_identity(self.pid) == self.ident

    def terminate(self) -> None:
        """SIGTERM, unless the process is gone (its pid may belong to another process by now)."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def start_committer(cache: str, runtime_dir: Path, *, endpoint: str | None = None,
                    exit_when_idle: bool = True, policy: int | None = None,
                    config_file: str | os.PathLike | None = None) -> AutostartedCommitter:
    """Start an embedded committer for ``cache``, detached from this process's tree (``--exit-when-idle``:
    it exits once its clients left or were reaped).

    Detached: started by a shell that exits at once, in a session of its own, so the committer is no
    descendant of this process. vLLM 0.32 stops ``vllm serve`` by SIGKILLing every descendant of its
    engine processes once its shutdown timeout (0 s by default) passes
    (``vllm.utils.system_utils.kill_process_tree``); a committer among them died with the cache's
    segments, socket and lock still there (found with a real ``--data-parallel-size 2`` server). Detached,
    it outlives the kill, reaps its silent clients after its heartbeat timeout and, being
    ``--exit-when-idle``, exits and unlinks everything.

    ``endpoint``: where the client will connect (default ``ipc://RUNTIME_DIR/NAME.sock``), always passed
    on as a flag: the committer inherits this process's environment, and an ``OMNISHM_ENDPOINT`` (or an
    ``endpoint`` in ``$OMNISHM_CONFIG``) there would otherwise win over the default it was meant to bind.
    ``policy``: the scheduling policy it starts under (``cpus.scheduled``; None: the calling thread's).
    A link passes the policy of the thread that built it, so a committer the link's I/O thread starts on
    a resume does not inherit that helper thread's ``SCHED_BATCH``.

    Raises ``OSError`` when the committer cannot be launched, ``ConfigError`` for a bad ``helper_sched``
    (before anything starts).
    """
    cpus.helpers_batched()  # the reaper thread below starts as a helper: a bad knob must fail before the spawn
    cmd = [sys.executable, "-m", "omnishm.committer", "--name", cache, "--runtime-dir", str(runtime_dir),
           "--endpoint", endpoint if endpoint is not None else ipc_endpoint(Path(runtime_dir), cache)]
    if config_file is not None:  # the file the client read its knobs from, not only $OMNISHM_CONFIG
        cmd += ["--config", str(config_file)]
    if exit_when_idle:
        # This process by pid and start time: the committer is never its child, and tells whether it
        # still runs by both (a pid alone may be reused).
        me = proc_identity(os.getpid())
        cmd += ["--exit-when-idle", "--spawned-by", f"{os.getpid()}:{me}" if me else str(os.getpid())]
    log_path = Path(runtime_dir) / f"{cache}.autostart.log"
    os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # private before sh appends
    env = {**cpus.unbound_env(os.environ), "OMNISHM_AUTOSTART_LOG": str(log_path)}
    # Started unpinned: not on the starting rank's core, which its busy-waiting main thread keeps
    # (omnishm/cpus.py); a child inherits its parent's CPU set at fork, every thread of it included, and
    # the rank's OpenMP binding variables (left out of ``env``) would pin it again at exec (libgomp preloaded).
    # Its scheduling policy is also inherited: ``policy`` keeps a helper thread's out of it.
    with cpus.unpinned(), cpus.scheduled(policy):
        launcher = subprocess.Popen([SHELL, "-c", _DETACH, str(log_path), *cmd], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env=env)
    try:
        out, err = launcher.communicate(timeout=_LAUNCH_TIMEOUT_S)  # the shell exits once it forked
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.communicate()
        raise OSError(f"cache {cache}: the committer's launcher ({SHELL}) did not return within "
                      f"{_LAUNCH_TIMEOUT_S:.0f}s") from None
    try:
        pid = int(out)
    except ValueError:
        raise OSError(f"cache {cache}: the committer could not be launched ({SHELL} exited {launcher.returncode}): "
                      f"{err.decode(errors='replace').strip() or out!r}") from None
    if err.strip():
        logger.warning("cache %s: the committer's launcher said: %s", cache, err.decode(errors="replace").strip())
    if proc_parent(pid) == os.getpid():
        # This process is a subreaper (prctl PR_SET_CHILD_SUBREAPER): the orphan came back to it, and only
        # it can reap the committer when it exits.
        with cpus.as_helper():
            threading.Thread(target=_reap, args=(pid,), name=f"omnishm-reap-{cache}", daemon=True).start()
    logger.info("cache %s: autostarted committer pid %d", cache, pid)
    return AutostartedCommitter(cache, pid, proc_identity(pid))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
