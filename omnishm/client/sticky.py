"""The manager's sticky-fatal state: the one place a cache turns unusable, and every call's check of it.

A failed write, an interrupted call or a step no save took leaves what the cache holds unknown; the first such
error is kept (``_fatal``) and every later call but ``shutdown`` raises it (``_check_usable``), so a caller that
goes on is never served a row its claims no longer describe. ``StickyErrors`` is a mixin of the manager with
no state of its own: ``_fatal`` and ``_closed`` are the manager's (``client/manager.py``), set on any thread
without the state lock (of two threads failing at once one wins; either error is sticky).
"""

from __future__ import annotations

import logging

from omnishm.interface import (
    OmniPrefixCacheCommitterError,
    OmniPrefixCacheUnmatchError,
    ReqId,
    StepId,
    TensorName,
    unmatch,
)

logger = logging.getLogger("omnishm.client.manager")  # the manager's one logger, as writer.py's


class StickyErrors:
    """The manager's errors: ``OmniPrefixCacheUnmatchError`` naming this cache, the sticky one, and the checks
    of every call (``client/manager.py`` composes it)."""

    def _unmatch(self, reason: str, *, req_id: ReqId | None = None, key: TensorName | None = None,
                 step_id: StepId | None = None) -> OmniPrefixCacheUnmatchError:
        return unmatch(f"cache {self.cache}: {reason}", req_id=req_id, key=key, step_id=step_id)

    def _set_fatal(self, reason: str, *, step_id: StepId | None = None, req_id: ReqId | None = None,
                   key: TensorName | None = None, what: str = "failed write") -> OmniPrefixCacheUnmatchError:
        """Record a failed write (``what``) as the sticky error unless one is already recorded (later ones are
        only returned; of two threads failing at once, one wins, unlocked, as either error is sticky); any thread."""
        err = self._unmatch(f"{what} (sticky; shut this manager down and make a new one): {reason}",
                            step_id=step_id, req_id=req_id, key=key)
        if self._fatal is None:
            self._fatal = err
            logger.error("%s", err)
        return err

    def note_interrupt(self, call: str, exc: BaseException) -> None:
        """An integration's own code around this manager's calls (``call``: the runner's ``execute_model``, a
        save's layout) ended in ``exc``: a signal handler's exception (not an ``Exception``) turns the cache
        sticky-fatal, as one inside the manager's own calls does. Cut between ``new_step_starts`` and
        ``save_outputs``, the step's slots still hold their previous tenants' claims while the engine counts
        them written: a caller that went on was served those rows by a later hit (review, stop 58). Engine
        thread; an ``Exception`` changes nothing (each call refuses its own bad input)."""
        self._note_interrupt(call, exc, count=False)

    def note_unsaved_step(self, call: str, exc: BaseException) -> None:
        """An integration's code after ``new_step_starts`` ended in ``exc`` (any exception: a forward that
        raised, a view or a copy of its own) before ``save_outputs`` took the step: the step's slots keep their
        previous tenants' claims while the engine counts them written, and no save will make them absent, so the
        cache turns sticky-fatal. A caller that went on was served the previous tenant's rows by a later hit
        (review, stop 58). Engine thread; on a shut-down manager it changes nothing."""
        if not self._closed:
            self._set_fatal(f"{call} ended in {type(exc).__name__} after new_step_starts and before save_outputs "
                            f"took the step: its slots are unknown ({exc})", step_id=self._next_step,
                            what="step not saved")

    def _note_interrupt(self, call: str, exc: BaseException, step_id: StepId | None = None, *,
                        count: bool = True) -> None:
        """``call`` ended in ``exc`` on this thread: an ``OmniPrefixCacheUnmatchError`` is counted
        (``unmatch_errors``, what every public call raises to the engine: only materialize's were, review
        2026-12-07; not with ``count=False``: a save counts its refusal once no interrupt in its burn took
        its place), and when ``exc`` is a signal handler's exception (not an ``Exception``:
        KeyboardInterrupt, vLLM's SIGTERM ``SystemExit``), the cache turns sticky-fatal.

        Such an exception may cut a call at any line: a staging page claimed and not yet recorded, a
        settled step whose future was never completed, pins counted and not dropped, a save neither issued
        nor taken. The state is then unknown, and a caller that catches the interrupt and goes on would
        stall on a lost page or acknowledgement, or read a hit against claims its save never made (reviews,
        2026-12-06), so every later call raises instead. Shutting down still works.
        """
        if count and isinstance(exc, OmniPrefixCacheUnmatchError):
            self.counters["unmatch_errors"] += 1
        if not isinstance(exc, Exception) and not self._closed:
            self._set_fatal(f"{call} was cut short by {type(exc).__name__}: what it had changed is unknown",
                            step_id=step_id, what="interrupted")

    def _check_usable(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise RuntimeError(f"cache {self.cache}: manager is shut down")
        if self._link.dead is not None:
            raise OmniPrefixCacheCommitterError(self._link.dead)
