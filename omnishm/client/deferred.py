"""Deferred writes of the writer client: the seed's ``WriteTask``s of ``JOIN_NEXT_STEP`` / ``JOIN_ON_FINISH`` keys.

A deferred key's rows stay in the step's clone (device memory on CUDA) and collect, step after step, in one
open ``WriteTask`` per request and key. A write closes when its request ends, when a hit reads its rows, when
it reaches ``MAX_TASK_CHUNKS`` chunks, or when the open ones hold more than ``gpu_staging_bytes`` (oldest
first); a closed write goes to the flusher (``client/writes.py``), which sends it and completes its future
(``_on_task_done``). ``DeferredWrites`` is a mixin of ``OmniPrefixCacheManager`` with no state of its own: its
books (``_open``, ``_open_by_cv``, ``_deferred_order``, ``_closing``, ``_pending_bytes``, ``_held_bytes``,
``_sources``) are the manager's, changed under its state lock (``_lock``; ``_landed`` is a condition over it,
notified when a write lands). ``_locked`` methods run with that lock held.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout  # builtin TimeoutError only from Python 3.11
from typing import Any

import torch

from omnishm.client.steps import StepCtx
from omnishm.client.writes import MAX_TASK_CHUNKS, Chunk, HeldRows, RowSource, TaskState, WriteTask
from omnishm.interface import OmniPrefixCacheStagingTimeoutError, ReqId, StepId, unmatch

logger = logging.getLogger("omnishm.client.manager")  # one logger for the whole manager, as before the split


class DeferredWrites:
    """Open, close, hand over and land the writer's deferred writes (mixin; all state lives in the manager)."""

    def _wait_for_deferred_room(self, step_id: StepId) -> None:
        """Engine thread, unlocked, before a save with deferred rows claims its page: while the deferred writes
        not landed yet hold more than ``gpu_staging_bytes`` of step clones and some of them are with the
        flusher, wait for those to land (counted once in ``deferred_waits``), up to ``staging_claim_timeout_s``;
        then raises ``OmniPrefixCacheStagingTimeoutError``, or ``RuntimeError`` once another thread shut the
        manager down. Closing the oldest open writes (the budget) moves
        their clones to the flusher but does not free them: with no wait, a flusher behind the engine let
        closed writes pile up, their clones (device memory on CUDA) past any bound (review, stop 57)."""
        budget = self.config.gpu_staging_bytes
        if self._held_bytes <= budget:  # read unlocked: only a write's outcome lowers it, and the wait re-reads it
            return
        deadline = 0.0
        with self._lock:  # not ``with self._landed``: see ``_detach`` (a signal here left the lock held)
            while self._held_bytes > budget and self._closing:
                if self._closed:  # shut down by another thread, which woke this wait (``_detach``)
                    raise RuntimeError(f"cache {self.cache}: manager is shut down")
                if not deadline:
                    self.counters["deferred_waits"] += 1
                    deadline = time.monotonic() + self.config.staging_claim_timeout_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise unmatch(f"cache {self.cache}: deferred writes not landed yet hold {self._held_bytes} "
                                  f"bytes of step clones, over gpu_staging_bytes={budget}, after "
                                  f"{self.config.staging_claim_timeout_s:.1f}s: the committer is behind or "
                                  f"stalled (see its status), or raise gpu_staging_bytes",
                                  step_id=step_id, cls=OmniPrefixCacheStagingTimeoutError)
                self._landed.wait(remaining)

    def _register_writes_locked(self, ctx: StepCtx, writes: list, cvs: list[int], slots: torch.Tensor,
                                slot_list: list[int] | None, immediate: dict, deferred: dict) -> list[WriteTask]:
        """Row sources for this step's claims, and its deferred chunks. Engine thread, state lock held.

        They keep ``slot_list`` (a small step's copy) or a copy of ``slots``, never the caller's tensor,
        which a runner may rewrite for its next step while they live (``_check_slots``).

        An immediate key gets ONE row source per step (all the step's slots and
        staged rows), registered under ``(key, step)``: a claim version finds it
        through ``cv_step`` (``ReadSide._fix_rows``). A deferred key gets one
        source per request under ``(key, cv)``: its rows live in the request's
        write task, whose chunks collect step after step.
        """
        to_flush: list[WriteTask] = []
        for key in immediate:
            src = RowSource(cv=0, slots=slot_list if slot_list is not None else slots, rows=ctx.step_rows[key])
            ctx.sources[key] = src
            self._step_sources[(key, ctx.step_id)] = src
        if deferred:
            if slot_list is not None:
                slots = slots.clone()  # chunks keep slices of it until their request ends
            # A chunk's rows are a slice of the step's whole clone, which stays allocated while any chunk holds
            # it, so the budget counts the whole clone: counting each chunk's slice let one long request keep
            # every step's clone of a batch (up to 8192 times its own rows) while the budget saw one row a step
            # (review, stop 57). No slice is copied out: on CUDA that is a kernel a request a step.
            helds = {key: HeldRows(rows.numel() * rows.element_size())
                     for key, rows in ctx.step_rows.items() if key in deferred}
            for w, cv in zip(writes, cvs):
                req_slots = slots[w.token_start:w.token_start + w.num_tokens]
                for key in deferred:
                    rows = ctx.step_rows[key][w.token_start:w.token_start + w.num_tokens]
                    task = self._open.get((w.req_id, key))
                    if task is None:
                        task = WriteTask(tid=next(self._tids), req_id=w.req_id, key=key,
                                         opened_step=ctx.step_id)
                        self._open[(w.req_id, key)] = task
                        self._deferred_order[task.tid] = task
                    held = helds[key]
                    opened, kept = held.open_chunk()
                    self._pending_bytes += opened
                    self._held_bytes += kept
                    task.chunks.append(Chunk(cv=cv, step_id=ctx.step_id, slots=req_slots, rows=rows,
                                             freeze=ctx.freeze_event, held=held))
                    self._open_by_cv[(key, cv)] = task
                    self._sources[(key, cv)] = RowSource(cv=cv, slots=req_slots, rows=rows, ready=ctx.freeze_event)
                    if len(task.chunks) >= MAX_TASK_CHUNKS:
                        self._close_task_locked(task)
                        self.counters["budget_flushes"] += 1
                        to_flush.append(task)
        while self._pending_bytes > self.config.gpu_staging_bytes and self._deferred_order:
            oldest = next(iter(self._deferred_order.values()))
            self._close_task_locked(oldest)
            self.counters["budget_flushes"] += 1
            to_flush.append(oldest)
        return to_flush

    def _close_task_locked(self, task: WriteTask) -> None:
        if task.state is not TaskState.OPEN:
            return
        task.state = TaskState.CLOSED
        self._closing[task.tid] = task
        self._open.pop((task.req_id, task.key), None)
        self._deferred_order.pop(task.tid, None)
        for c in task.chunks:
            self._open_by_cv.pop((task.key, c.cv), None)
            if c.held is not None:
                self._pending_bytes -= c.held.close_chunk()

    def _close_request_locked(self, req_id: ReqId) -> list[WriteTask]:
        tasks = [t for (r, _), t in self._open.items() if r == req_id]
        for t in tasks:
            self._close_task_locked(t)
        return tasks

    def _close_hit_writes_locked(self, slots: torch.Tensor) -> list[WriteTask]:
        """Close open deferred writes a hit reads, so the rows land and every rank can read them."""
        if not self._open_by_cv:
            return []
        out: list[WriteTask] = []
        for key in {k for k, _ in self._open_by_cv}:
            kv = self._keys.get(key)
            if kv is None:
                continue
            for cv in torch.unique(kv.claim[slots]).tolist():
                task = self._open_by_cv.get((key, cv))
                if task is not None and task.state is TaskState.OPEN:
                    self._close_task_locked(task)
                    out.append(task)
        return out

    def _flush(self, tasks: list[WriteTask]) -> None:
        """Hand closed deferred writes to the flusher, taking each out of ``tasks`` once handed over: after
        an interrupt, what is left in the list is handed over again by the caller. A write handed over twice
        (an interrupt between the two) is sent twice under the same claim versions: the first to be applied
        lands its rows, the second finds them committed and skips them; one lost would never land. Once
        another thread's shutdown stopped the flusher, the writes left fail (their futures complete, the loss
        is logged) and ``RuntimeError`` (shut down) is raised."""
        if not tasks:
            return
        assert self._flusher is not None
        while tasks:
            if not self._flusher.put(tasks[0]):
                # Another thread's shutdown stopped the flusher after this call closed them (the engine's
                # new_step_starts racing a shutdown): they fail now, said and counted, instead of waiting on
                # a stopped thread for good (review, 2026-12-07).
                err = RuntimeError(f"cache {self.cache}: manager is shut down")
                for task in tasks:
                    self._on_task_done(task, err)
                tasks.clear()
                raise err
            del tasks[0]
            self.counters["deferred_flushes"] += 1

    def _join_flushed(self, tasks: list[WriteTask]) -> None:
        """Eager mode, the engine thread: wait until the deferred writes just handed over (``_flush``) landed,
        as the seed's eager escalate writes the pool before ``new_step_starts`` returns. Raises what a
        failed write raised (the cache is sticky-fatal then), and a sticky-fatal error when one is not
        acknowledged within ``commit_timeout_s`` of the one before (the flusher bounds each write's pieces
        so, one after the other)."""
        for t in tasks:
            try:
                t.done.result(timeout=self.config.commit_timeout_s)
            except FutureTimeout:  # the builtin TimeoutError, on Python 3.10 too
                raise self._set_fatal(f"deferred write {t.tid} of request {t.req_id!r} tensor {t.key!r} not "
                                      f"acknowledged within {self.config.commit_timeout_s:.1f}s", req_id=t.req_id,
                                      key=t.key, step_id=t.opened_step) from None

    def _on_task_done(self, task: WriteTask, result: Any) -> None:
        """Flusher thread: a deferred write landed (or failed). A write handed over twice (``_flush``, after an
        interrupt) is done by the first outcome; the second is dropped (completing the future again raised
        InvalidStateError and ended the flusher thread)."""
        # str() alone is "" for a bare TimeoutError
        failed = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else result.failure()
        with self._lock:
            # Checked and set under the lock: the engine thread (``_flush`` failing it) and the flusher may
            # both get here for a write handed over twice, and only one may give its clones back.
            if task.state in (TaskState.DONE, TaskState.FAILED):
                return
            task.state = TaskState.FAILED if failed else TaskState.DONE
            self._closing.pop(task.tid, None)
            for c in task.chunks:
                src = self._sources.pop((task.key, c.cv), None)
                if src is not None:
                    src.alive = False
                if c.held is not None:
                    self._held_bytes -= c.held.land_chunk()
            self._landed.notify_all()
        if failed:
            already = self._fatal is not None
            err = self._set_fatal(f"deferred write {task.tid} of request {task.req_id!r} tensor {task.key!r} "
                                  f"failed: {failed}", req_id=task.req_id, key=task.key,
                                  step_id=task.opened_step)
            if already:  # the sticky error logged was another's: this write's loss is said here
                logger.warning("%s", err)
            task.done.set_exception(err)
        else:
            task.done.set_result(result)
