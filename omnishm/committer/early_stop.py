"""The committer's stop signals, and one that arrives while it is still starting.

Standard library only, so ``omnishm.committer.main`` installs it before it
imports anything heavy (numpy and zmq, and the pool's segments): from then on
a stop signal is remembered instead of killing the process with the default
action (exit 143, or a stale lock file and segments once they exist).
"""

from __future__ import annotations

import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Each stops the committer cleanly (answer what came in, unlink every segment, exit 0), like SIGTERM.

Their default actions end the process like a crash: the segments stay in ``/dev/shm`` for the next
start of that name (adopted while clients are still attached, else swept), and nothing stops them if
no committer is started again. A closed terminal sends SIGHUP, Ctrl-\\ sends SIGQUIT, and a shell
that starts a job in the background (``&``, non-interactive) starts it with SIGINT and SIGQUIT
ignored: a handler of our own makes those stop it again. SIGHUP is not a reload: a supervisor that
sends it to reopen logs stops the committer and its cache (``stop_signals`` spares ``nohup``).
"""


def stop_signals() -> tuple[signal.Signals, ...]:
    """``STOP_SIGNALS`` less SIGHUP when this process was started with SIGHUP ignored.

    An ignored SIGHUP is a choice someone made (``nohup``, ``trap '' HUP``): the committer keeps it and
    outlives the terminal. An ignored SIGINT or SIGQUIT is what every background job of a shell gets,
    so those are taken over. Read it before any handler of ours is installed. Main thread.
    """
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return tuple(sig for sig in STOP_SIGNALS if sig != signal.SIGHUP)
    return STOP_SIGNALS


def install(signals: tuple[signal.Signals, ...], handler: Any) -> dict[signal.Signals, Any]:
    """Set ``handler`` for each of ``signals``; returns the previous handlers for ``restore``. Main thread."""
    return {sig: signal.signal(sig, handler) for sig in signals}


def restore(old: dict[signal.Signals, Any]) -> None:
    """Put back the handlers ``install`` returned. One that was not set from Python (``None``) is left
    as it is now: ``signal.signal`` cannot take it back."""
    for sig, handler in old.items():
        if handler is not None:
            signal.signal(sig, handler)


class EarlyStop:
    """A stop signal (``signals``) that arrives before the loop runs (imports, lock taken, segments being made).

    The signal is only remembered; ``Committer.run`` reads it once its own
    handlers (for the same ``signals``) are in place and stops at once,
    through the same cleanup as any stop, and a start that has not reached
    the loop returns 0 at its next check. ``restore`` puts the previous
    handlers back. ``signals`` defaults to ``stop_signals()``. Main thread only.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] | None = None) -> None:
        self.reason = ""
        self.signals = stop_signals() if signals is None else signals
        self._old = install(self.signals, self._on_signal)
        # Blocked when this image was exec'd by a committer that re-executed itself (``stores``): one
        # that arrived across the exec is pending, and comes in now, to the handler above.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)

    def _on_signal(self, signum: int, _frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name

    def restore(self) -> None:
        restore(self._old)


class InterruptOnce:
    """The first SIGINT or SIGTERM raises ``KeyboardInterrupt`` in the main thread; later ones are ignored.

    The handler of ``omnishm demo`` (and its ranks) and ``omnishm bench`` once they run. So the bounded cleanup
    the first one started runs to its end instead of the process dying where it stands: a rank's manager
    shutdown (the last acknowledgement, the Goodbye), the demo's stop of its ranks and its report of what was
    left, the bench's stop of its committers and children. Ctrl-C reaches the ranks and the demo together, and
    ``RankGroup.stop`` then sends SIGTERM. ``fired`` is the signal once one came (0 before); ``restore`` puts
    the previous handlers back. Main thread only.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.fired = 0
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self.fired:
            self.fired = signum
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def raise_pending(self, early: EarlyStop | None) -> None:
        """Raise, as if it came now, a stop signal ``early`` remembered before this handler was installed
        (``omnishm.cli.run_external`` keeps one in place while the command imports torch and checks its
        options). Such a signal killed the demo with the default action (143, no message) or, as Ctrl-C in an
        import, ended in a traceback or was lost and the run went on to exit 0 (review, stop 54)."""
        if early is not None and early.reason and not self.fired:
            self.fired = int(signal.Signals[early.reason])
            raise KeyboardInterrupt(early.reason)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


__all__ = ["EarlyStop", "InterruptOnce", "STOP_SIGNALS", "install", "restore", "stop_signals"]
