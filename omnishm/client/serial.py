"""One daemon thread that handles queued items in order (the client's helper threads).

Used by the flusher (deferred writes), the sender (wait a copy event, then
send) and the reader's prefetcher. ``stop`` lets the items already queued
finish, bounded by its timeout. The thread runs as a helper (``cpus.as_helper``):
on every allowed CPU, not the starting engine rank's pinned core, and under
``SCHED_BATCH`` with ``helper_sched = batch``.

Items go through a ``queue.SimpleQueue``, whose ``put`` is one C call: the engine
thread puts, and an exception a signal handler raises there (Ctrl-C, vLLM's
SIGTERM handler raising ``SystemExit``) lands before or after it, never inside.
``queue.Queue.put`` runs Python code under its mutex: interrupted there it left
the mutex held, and the next ``put`` (``stop``'s, at shutdown) waited for good,
or it lost the wakeup of the waiting thread, and ``stop`` waited out its
timeout (a demo killed during a step: a reader lived 30 s on). ``put`` and
``stop`` hold a reentrant lock around that call and the stopped flag
(``with`` releases it whatever is raised inside), so no other thread's item
is queued behind the stop, where it would never be handled: ``put`` says
False instead (the flusher fails the write, the sender raises and the save
fails its send, the prefetcher leaves the read to ``materialize``). A
handler that stops the thread from inside this thread's ``put`` gets the
lock again: it lands after the C put (the item is handled
before the stop) or, a few bytecodes earlier, before it (the item is then
queued behind the stop, and the shutdown reports it among the writes that
did not land).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

from omnishm import cpus

T = TypeVar("T")
_STOP = object()


class SerialThread(Generic[T]):
    def __init__(self, name: str, handle: Callable[[T], None]):
        self._handle = handle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        # Taken around the flag and the one C call of each put and stop: an item put after stop's _STOP was
        # never handled, and nobody knew (review, 2026-12-07: a deferred write another thread's shutdown raced
        # was lost without a word). Reentrant: a signal handler that shuts the manager down (vLLM's SIGTERM)
        # may run on this thread right after the C put, still inside ``put``; with a plain lock its ``stop``
        # waited for good on the lock its own thread held (review, the same day).
        self._put_lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        with cpus.as_helper():
            self._thread.start()

    def put(self, item: T) -> bool:
        """Queue ``item``; False (and nothing queued) once ``stop`` was called: it would never be handled."""
        with self._put_lock:
            if self._stopped:
                return False
            self._queue.put(item)
            return True

    def pending(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout_s: float) -> None:
        """Let the items queued so far be handled (bounded by ``timeout_s``); later ``put``s are refused.
        Called again (a shutdown an interrupt cut short, run again), it only waits."""
        with self._put_lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(_STOP)
        self._thread.join(timeout=timeout_s)

    def running(self) -> bool:
        """Whether the thread still runs (after ``stop``: what it was handed did not finish within the bound)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._handle(item)
            # Not kept until the next item comes: a landed write's row clones (device memory on CUDA, no
            # longer counted against gpu_staging_bytes) stayed held on an idle engine (review, stop 47).
            del item
