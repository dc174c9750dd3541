"""The committer's stop signals, and one that arrives while it is still starting.

Standard library only, so ``omnishm.committer.main`` installs it before it
imports anything heavy (torch takes about a second to import): from then on
a stop signal is remembered instead of killing the process with the default
action (exit 143, or a stale lock file and segments once they exist).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Each stops the committer cleanly (answer what came in, unlink every segment, exit 0).

SIGHUP and SIGQUIT too: their default actions end the process without its cleanup, which leaves
the segments in ``/dev/shm`` until the next start of that name sweeps them. A closed terminal sends
SIGHUP, Ctrl-\\ sends SIGQUIT, and a shell that starts a job in the background (``&``, non-interactive)
starts it with SIGINT and SIGQUIT ignored: a handler of our own also makes those work again.
"""


class EarlyStop:
    """A stop signal (``STOP_SIGNALS``) that arrives before the loop runs (imports, lock taken, segments being made).

    The signal is only remembered; ``Committer.run`` reads it once its own
    handlers are in place and stops at once, through the same cleanup as any
    stop, and a start that has not reached the loop returns 0 at its next
    check. ``restore`` puts the previous handlers back. Main thread only.
    """

    def __init__(self) -> None:
        self.reason = ""
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, _frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


__all__ = ["EarlyStop", "STOP_SIGNALS"]
