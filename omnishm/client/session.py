"""The manager's session with its committer: attaching after the Welcome and detaching at shutdown.

``SessionSide`` is a mixin of ``OmniPrefixCacheManager`` and works on its state. ``_attach`` maps the
control segment (and a reader's keys), makes the staging pages and starts the helper threads;
``_detach`` is ``shutdown``'s work: flush the open deferred writes, join the last step's write, stop
the threads, unpin the staging and close the link, each step safe to run again after a pass that a
signal handler's exception cut short.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref

import torch

from omnishm import protocol as P
from omnishm.client.device import StepSender, unregister_after_drain
from omnishm.client.segments import KeyViews, StagingPages
from omnishm.client.serial import SerialThread
from omnishm.client.writes import Flusher
from omnishm.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omnishm.shm import Segment

logger = logging.getLogger("omnishm.client.manager")  # one logger for the whole manager, as before the split

_ATTACHED: "weakref.WeakSet[SessionSide]" = weakref.WeakSet()
"""Managers of this process that attached; ``_shutdown_at_exit`` shuts down those still open at exit."""


def _shutdown_at_exit() -> None:
    """atexit: ``shutdown`` every manager its owner left open, so a script that ends without calling it still
    lands its open deferred writes and says goodbye. Without it the writes were lost, and the committer kept
    the writer's seat until its heartbeat timeout (10 s by default: a writer started again at once was
    refused until then). A forked child's copy returns at once (``shutdown``); a shut-down manager too. The
    vLLM worker extension's hooks rely on it for an engine torn down without ``omnishm_shutdown`` (they had an
    exit handler of their own, registered once per install)."""
    for manager in list(_ATTACHED):
        try:
            manager.shutdown()
        except Exception as exc:  # exiting anyway; the committer reaps a silent session
            logger.warning("cache %s: shutdown at exit failed: %s", manager.cache, exc)


atexit.register(_shutdown_at_exit)


class SessionSide:
    """Attach and detach (mixin; all state lives in the manager)."""

    def _attach(self, config: PrefixCacheConfig, cache: str, cap: int) -> None:
        """``__init__`` after the Welcome: map the control segment (and a reader's keys), start the threads."""
        self._link.counters = self.counters
        welcome = self._link.welcome
        self._epoch = welcome.epoch
        self._ctl_seg = Segment.attach(welcome.control, readonly=not self.is_writer)
        self._ctl = self._ctl_seg.tensor(torch.int64, (P.CTL_WORDS,))
        # The writer's planned hits per step (P.CTL_HITS_RING), as plain ints: the writer stores an entry, a
        # reader loads one, per step with hits.
        self._hits_ring = memoryview(self._ctl_seg.tensor(torch.int64, (2 * P.CTL_HITS_RING,),
                                                          offset=P.CTL_HITS_AT * 8).numpy())
        self._epoch_at_attach = int(self._ctl[P.CTL_WRITER_EPOCH])
        """Writer epoch in the control segment right after this client attached: a larger one later is a
        writer that attached after it (epochs only grow), see ``ReadSide._follow_writer``."""
        self._published_at_attach = int(self._ctl[P.CTL_PUBLISHED_STEP])
        """The publication word right after this client attached: a reader follows no writer whose last
        publication came before it (``ReadSide._follow_writer``)."""
        self._follows = 0
        """Reader: the epoch of the one writer whose steps this reader's step ids are, set once
        (``ReadSide._follow_writer``); 0 until then."""
        if self.is_writer:
            # The same words as plain ints: a store or load per step, no torch or numpy dispatch.
            self._ctl_mv = memoryview(self._ctl.numpy())
            self._ctl_mv[P.CTL_PUBLISHED_STEP] = -1
            self._link.acked_marker = self._acked_word
            self._pages = StagingPages(config.staging_depth, cap, cache)
            self._flusher = Flusher(
                region=lambda key: self._keys[key].staging, row0=self._pages.flush_row0, rows=cap,
                to_host=self._flush_copy, chunk_bytes=config.copy_chunk_bytes,
                key_index=lambda key: self._keys[key].index, send=self._link.submit,
                on_task_done=self._on_task_done, timeout_s=config.commit_timeout_s)
            self._sender = StepSender(self._link.submit)
        else:
            # Readers stage nothing, but the same depth bounds their unconsumed step ids (and the
            # step rows they keep for them).
            self._pages = StagingPages(config.staging_depth, cap, cache)
            self._prefetcher = SerialThread("omnishm-prefetch", self._prefetch)
            for seg in welcome.keys:
                self._keys[seg.key] = KeyViews.map(seg, config.num_slots, readonly=True)
        self._link.gauges = self._staging_gauges  # once the pages exist: the I/O thread calls it at its next beat
        _ATTACHED.add(self)

    def _detach(self) -> None:
        """``shutdown``'s work, under its lock; each step may run again after an interrupted first pass."""
        # Not on a fatal writer, nor over a link a pass an interrupt cut short closed (its ``finally``): then
        # what the flusher could not land is said once it stopped (review, 2026-12-06), not lost quietly.
        flush = self.is_writer and self._fatal is None and self._link.dead is None
        # One bound for the open deferred writes, the last step's write and the threads' stops: a stuck committer or
        # copy must not hold an exit for a timeout each (review, stop 60: the thread joins each took a fresh one, a
        # stuck flusher copy held a shutdown 2 x commit_timeout_s).
        deadline = time.monotonic() + self.config.commit_timeout_s
        if self._pages is not None:
            self._pages.close("the manager is shut down")
        try:
            # The plain lock, entered in C, not ``with self._landed``: a Condition's ``__enter__`` is Python code,
            # and a signal handler's exception raised there left the state lock held for good. The CI of stop
            # 57 hung so, in the teardown of a test that interrupts shutdowns (see PagePool's lock, segments.py).
            with self._lock:
                self._landed.notify_all()  # a save waiting for deferred room sees the shutdown
            if flush:
                with self._lock:
                    tasks = [t for t in self._open.values()]
                    for t in tasks:
                        self._close_task_locked(t)
                self._flush(list(tasks))  # _flush empties the list it is given
                # The last step's write went before them, so it lands first.
                for t in tasks:
                    try:
                        t.done.result(timeout=max(0.0, deadline - time.monotonic()))
                    except Exception as exc:  # logged: shutdown must finish detaching
                        why = str(exc) or f"{type(exc).__name__}: no answer in {self.config.commit_timeout_s:.1f}s"
                        logger.warning("cache %s: deferred write %d unflushed at shutdown: %s", self.cache, t.tid, why)
                try:
                    self._join_previous_write(deadline)
                except OmniPrefixCacheUnmatchError as exc:
                    logger.warning("cache %s: last step write failed at shutdown: %s", self.cache, exc)
        finally:
            try:
                self._stop_threads(deadline)
                if self.is_writer:  # a healthy shutdown too: a write another thread closed meanwhile is named
                    self._report_unlanded_writes()
                self._unregister_staging()
            finally:
                self._link.close()  # whatever failed before: the session and its writer seat must go
                self.result_pool.close()  # the threads that take blocks have stopped

    def _report_unlanded_writes(self) -> None:
        """Shutdown of a writer, once the flusher stopped: the deferred writes still open or closed and not
        done never land (a hit on their rows is refused): those of a fatal writer, and on a healthy one
        those another thread closed while this shutdown ran. One the flusher failed said so itself."""
        with self._lock:
            lost = sorted(t.tid for t in [*self._open.values(), *self._closing.values()] if not t.done.done())
        if not lost:
            return
        why = self._fatal or self._link.dead
        if not why and self._flusher is not None and self._flusher.running():
            why = (f"the flusher did not land them within the shutdown's commit_timeout_s "
                   f"({self.config.commit_timeout_s:.1f}s)")
        logger.warning("cache %s: deferred writes %s do not land: %s", self.cache, lost,
                       why or "closed by another thread while this shutdown ran, after the flusher stopped")

    def _unregister_staging(self) -> None:
        """Shutdown: unpin the staging (``device.unregister_after_drain``); what stays registered is logged."""
        if self._registrations:
            why = unregister_after_drain(self._ops, self._registrations, self.config.commit_timeout_s)
            if why:
                logger.warning("cache %s: %s at shutdown; the staging stays registered", self.cache, why)
            self._registrations.clear()

    def _stop_threads(self, deadline: float) -> None:
        """Stop the flusher, prefetch and sender threads, waiting for them until ``deadline`` (monotonic)."""
        for thread in (self._flusher, self._prefetcher, self._sender):
            if thread is not None:
                thread.stop(max(0.0, deadline - time.monotonic()))
