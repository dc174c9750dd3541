"""Omni prefix cache, manager side: the seed's contract over a committer.

One ``OmniPrefixCacheManager`` per runner process (per TP rank). The writer
(the engine's output rank) claims slots, stages the step's rows in its
staging page and sends one ``StepWrite`` per step; the committer copies them
into the shared pool. Readers run the same API and only read the pool.

Threads and locks
- Engine thread: ``new_step_starts``, ``save_outputs`` (exactly once per real
  step, in that order). Only this thread writes the claim table.
- Any thread: ``materialize``, ``discard_step`` (exactly once per step id).
- ``omnishm-link`` (I/O) and ``omnishm-flusher`` threads complete writes.
- ``_lock`` (the state lock) guards the step contexts, pins, row sources and
  deferred writes. It never covers a wait, a row copy or a committer round
  trip: those run after it is released.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from omnishm import protocol as P
from omnishm.client.link import CommitterLink
from omnishm.client.segments import KeyViews, StagingPages, dtype_name, row_width
from omnishm.client.steps import HitSpan, StepCtx
from omnishm.client.writes import Chunk, Flusher, RowSource, TaskState, WriteTask, build_step_write
from omnishm.interface import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheCommitterError,
                               OmniPrefixCacheUnmatchError, PrefixCacheConfig, ReqId, StageCacheOutputs, StepId,
                               TensorName, unmatch)
from omnishm.shm import Segment
from omnishm.versions import cv_epoch, cv_step, make_cv

if TYPE_CHECKING:
    from omnishm.client.adapter import PrefixCacheStep, PrefixCacheWriteLayout

logger = logging.getLogger(__name__)

_POLL_S = 0.0005


class OmniPrefixCacheManager:
    """The runner-side cache. Use as a context manager or call ``shutdown``."""

    def __init__(self, config: PrefixCacheConfig, *, cache: str = "default", role: str = "writer",
                 endpoint: str | None = None, autostart: bool = True, eager: bool | None = None,
                 runtime_dir: str | Path | None = None, connect_timeout_s: float = 30.0):
        if role not in (P.ROLE_WRITER, P.ROLE_READER):
            raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
        self.config = config
        self.cache = cache
        self.role = role
        self.is_writer = role == P.ROLE_WRITER
        self.eager = bool(eager)
        self._policy = ModelCachePolicy()
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._closed = False
        self._next_step: StepId = 0
        self._ctxs: dict[StepId, StepCtx] = {}
        self._pinned: dict[StepId, StepCtx] = {}
        self._consumed: set[StepId] = set()
        self._live: set[ReqId] = set()
        self._pending_hits: dict[ReqId, torch.Tensor] = {}
        self._keys: dict[TensorName, KeyViews] = {}
        self._sources: dict[tuple[TensorName, int], RowSource] = {}
        self._open: dict[tuple[ReqId, TensorName], WriteTask] = {}
        self._open_by_cv: dict[tuple[TensorName, int], WriteTask] = {}
        self._deferred_order: OrderedDict[int, WriteTask] = OrderedDict()
        self._closing: dict[int, WriteTask] = {}
        self._pending_bytes = 0
        self._tids = itertools.count(1)
        self._prev_write: Future | None = None
        self._pin_count = torch.zeros(config.num_slots, dtype=torch.int32)
        self.counters: dict[str, float] = {k: 0.0 for k in (
            "steps_saved", "hit_tokens", "hit_rows_served", "rows_served", "cow_rescues", "unmatch_errors",
            "save_seconds", "materialize_seconds", "staging_waits", "deferred_flushes", "budget_flushes")}
        cap = config.staging_capacity_tokens
        staging_rows = config.staging_depth * cap + cap if self.is_writer else 0
        self._link = CommitterLink(
            cache=cache, role=role, endpoint=endpoint, autostart=autostart, connect_timeout_s=connect_timeout_s,
            request_timeout_s=config.commit_timeout_s, runtime_dir=Path(runtime_dir) if runtime_dir else None,
            layout=P.Layout(num_blocks=config.num_blocks, block_size=config.block_size),
            staging_rows=staging_rows)
        self._link.counters = self.counters
        welcome = self._link.welcome
        self._epoch = welcome.epoch
        self._ctl_seg = Segment.attach(welcome.control, readonly=not self.is_writer)
        self._ctl = self._ctl_seg.tensor(torch.int64, (P.CTL_WORDS,))
        if self.is_writer:
            self._ctl[P.CTL_PUBLISHED_STEP] = -1
            self._pages: StagingPages | None = StagingPages(config.staging_depth, cap)
            self._flusher: Flusher | None = Flusher(
                region=lambda key: self._keys[key].staging, row0=self._pages.flush_row0, rows=cap,
                key_index=lambda key: self._keys[key].index, send=self._link.submit,
                on_task_done=self._on_task_done, timeout_s=config.commit_timeout_s)
        else:
            self._pages = None
            self._flusher = None
            for seg in welcome.keys:
                self._keys[seg.key] = KeyViews.map(seg, config.num_slots, readonly=True)

    # ------------------------------------------------------------------ API

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy; call before the first save."""
        if self._next_step:
            raise RuntimeError("register_policy must be called before the first save_outputs")
        self._policy = policy

    @property
    def policy(self) -> ModelCachePolicy:
        return self._policy

    def new_step_starts(self, events: "PrefixCacheStep | Iterable[Any]", *,
                        num_scheduled_tokens: Mapping[ReqId, int] | None = None) -> None:
        """Handle one scheduler step. Engine thread only, exactly once per real step.

        Call it before the runner's ``_update_states`` drops finished requests.
        Registers new and resumed requests' prefix hits (raises at once when a
        hit is not block aligned or lacks block ids), and closes the open
        deferred writes of finished or aborted requests (aborts still land) and
        of hit rows, handing them to the flusher after the lock is released.
        """
        from omnishm.client.adapter import PrefixCacheEventKind as K
        from omnishm.client.adapter import PrefixCacheSchedulerAdapter

        self._check_usable()
        step = PrefixCacheSchedulerAdapter().translate_step(events, num_scheduled_tokens)
        bs = self.config.block_size
        planned: dict[ReqId, torch.Tensor | None] = {}
        for ev in step.events:
            if ev.kind in (K.STARTED, K.RESUMED) and ev.num_computed_tokens > 0 and \
                    not (ev.kind == K.STARTED and ev.req_id in self._live):
                hit = ev.num_computed_tokens
                if hit % bs:
                    raise self._unmatch(f"prefix hit of {hit} tokens is not a multiple of block_size {bs} "
                                        "(sub-block prefix match is not supported)", req_id=ev.req_id)
                nblocks = hit // bs
                if len(ev.block_ids) < nblocks:
                    raise self._unmatch(f"prefix hit of {hit} tokens carries {len(ev.block_ids)} block ids, "
                                        f"needs {nblocks}", req_id=ev.req_id)
                blocks = torch.as_tensor(list(ev.block_ids[:nblocks]), dtype=torch.int64)
                planned[ev.req_id] = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.int64)).reshape(-1)
        to_flush: list[WriteTask] = []
        with self._lock:
            for ev in step.events:
                if ev.kind in (K.FINISHED, K.ABORTED):
                    self._live.discard(ev.req_id)
                    self._pending_hits.pop(ev.req_id, None)
                    to_flush.extend(self._close_request_locked(ev.req_id))
                elif ev.kind in (K.STARTED, K.RESUMED, K.REPLACED):
                    replaced = ev.kind == K.REPLACED or (ev.kind == K.STARTED and ev.req_id in self._live)
                    self._live.add(ev.req_id)
                    slots = None if replaced else planned.get(ev.req_id)
                    if slots is not None:
                        self._pending_hits[ev.req_id] = slots
                        to_flush.extend(self._close_hit_writes_locked(slots))
                    else:
                        self._pending_hits.pop(ev.req_id, None)
        self._flush(to_flush)

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None, *,
                     num_tokens_unpadded: int, num_tokens_padded: int,
                     write_layout: "PrefixCacheWriteLayout") -> StepId:
        """Write this step's outputs into the cache; returns the step id.

        Engine thread only, after the forward and before materialize. The
        returned id MUST be consumed exactly once, by ``materialize`` or
        ``discard_step``. Waits (unlocked) for the previous step's immediate
        writes and for a free staging page; raises
        ``OmniPrefixCacheStagingTimeoutError`` when none frees in time, and
        ``OmniPrefixCacheUnmatchError`` for a step larger than the page.
        """
        t0 = time.perf_counter()
        self._check_usable()
        n = int(num_tokens_unpadded)
        step_id = self._next_step
        if n > self.config.staging_capacity_tokens:
            raise self._unmatch(f"step of {n} tokens exceeds staging_capacity_tokens="
                                f"{self.config.staging_capacity_tokens} (raise max_num_batched_tokens sizing)",
                                step_id=step_id)
        if int(num_tokens_padded) < n or write_layout.num_tokens != n:
            raise self._unmatch(f"token accounting: unpadded={n}, padded={num_tokens_padded}, "
                                f"layout rows={write_layout.num_tokens}", step_id=step_id)
        layout_slots = write_layout.slots
        if n and (int(layout_slots.min()) < 0 or int(layout_slots.max()) >= self.config.num_slots):
            raise self._unmatch(f"write layout has slots outside [0, {self.config.num_slots}) "
                                f"(min {int(layout_slots.min())}, max {int(layout_slots.max())})", step_id=step_id)
        immediate, deferred, leftover = self._split_outputs(hidden_states, mm_outputs, n, int(num_tokens_padded))
        if self.is_writer:
            for key, rows in itertools.chain(immediate.items(), deferred.items()):
                self._ensure_key(key, rows)
        self._join_previous_write()
        writes = [w for w in write_layout.writes if w.num_tokens > 0]
        slots = write_layout.slots.to(torch.int64)
        ctx = StepCtx(step_id=step_id, req_ids=tuple(w.req_id for w in write_layout.writes),
                      spans={w.req_id: (w.token_start, w.num_tokens) for w in write_layout.writes},
                      leftover=leftover,
                      row_shapes={k: tuple(v.shape[1:]) for k, v in itertools.chain(immediate.items(),
                                                                                     deferred.items())})
        self._next_step += 1
        if self.is_writer:
            assert self._pages is not None
            ctx.page = self._pages.claim(step_id, self.config.staging_claim_timeout_s)
            rows = self._pages.rows(ctx.page)
            for key, data in immediate.items():
                view = self._keys[key].staging[rows][:n]
                view.copy_(data.reshape(n, -1))
                ctx.step_rows[key] = view
        else:
            for key, data in immediate.items():
                ctx.step_rows[key] = data.reshape(n, -1).clone()
        for key, data in deferred.items():
            ctx.step_rows[key] = data.reshape(n, -1).clone()
        counts = torch.as_tensor([w.num_tokens for w in writes], dtype=torch.int64)
        cvs = [make_cv(self._epoch, step_id, seq + 1) for seq in range(len(writes))] if self.is_writer else []
        row_cv = torch.repeat_interleave(torch.as_tensor(cvs, dtype=torch.int64), counts) if cvs else None
        to_flush: list[WriteTask] = []
        if self.is_writer and row_cv is not None:
            self._rescue_before_claim(slots, row_cv)
            for key in itertools.chain(immediate, deferred):
                self._keys[key].claim[slots] = row_cv
            to_flush = self._register_writes(ctx, writes, cvs, slots, immediate, deferred)
        with self._lock:
            for w in writes:
                hit = self._pending_hits.pop(w.req_id, None)
                if hit is None:
                    continue
                span = HitSpan(slots=hit, cvs={key: kv.claim[hit].clone() for key, kv in self._keys.items()})
                ctx.hits[w.req_id] = span
                self._pin_count[hit] += 1
                if self.is_writer:
                    to_flush.extend(self._close_hit_writes_locked(hit))
            self._ctxs[step_id] = ctx
            self._pinned[step_id] = ctx
        self._flush(to_flush)
        if self.is_writer:
            self._ctl[P.CTL_PUBLISHED_STEP] = step_id
            self._send_step(ctx, writes, cvs, slots, immediate)
            if self.eager:
                self._join_previous_write()
        self.counters["steps_saved"] += 1
        self.counters["save_seconds"] += time.perf_counter() - t0
        return step_id

    def materialize(self, step_id: StepId, req_ids: Iterable[ReqId]) -> StageCacheOutputs:
        """Per-request merged outputs (cached prefix rows + this step's rows).

        Any thread; consumes ``step_id`` exactly once (an unknown or already
        consumed id raises). ``req_ids`` must be a subset of the save-time
        requests. A hit span that resolves to absent or reused rows raises
        ``OmniPrefixCacheUnmatchError`` (never a silent miss); the step's
        staging page is released either way.
        """
        t0 = time.perf_counter()
        self._check_usable()
        req_ids = list(req_ids)
        with self._lock:
            peek = self._ctxs.get(step_id)
        if peek is not None:
            outside = [r for r in req_ids if r not in peek.spans]
            if outside:  # a caller bug caught before any work: the step id stays unconsumed
                raise self._unmatch(f"materialize asked for requests {outside} that were not in the save-time "
                                    f"batch {list(peek.req_ids)} (reading the live batch?)", step_id=step_id)
        ctx = self._take_ctx(step_id, "materialize")
        try:
            if not self.is_writer:
                self._wait_published(step_id)
            hidden: dict[ReqId, Any] = {}
            mm: dict[ReqId, dict[TensorName, Any]] = {}
            hits: dict[ReqId, int] = {}
            for req in req_ids:
                start, count = ctx.spans[req]
                span = ctx.hits.get(req)
                h = len(span.slots) if span is not None else 0
                hits[req] = h
                merged: dict[TensorName, Any] = {}
                for key, step_rows in ctx.step_rows.items():
                    out = torch.empty((h + count, step_rows.shape[1]), dtype=step_rows.dtype)
                    if h:
                        self._read_hit(ctx, span, key, out[:h], req)
                    out[h:].copy_(step_rows[start:start + count])
                    merged[key] = out.view((h + count, *ctx.row_shapes[key]))
                if span is not None:
                    self.counters["hit_tokens"] += h
                    self.counters["hit_rows_served"] += h * len(ctx.step_rows)
                self.counters["rows_served"] += (h + count) * len(ctx.step_rows)
                hidden[req] = merged.pop(HIDDEN_KEY, None)
                for key, value in ctx.leftover.items():
                    merged[key] = value
                mm[req] = merged
            return StageCacheOutputs(hidden_states=hidden, mm_outputs=mm, num_hit_tokens=hits)
        except OmniPrefixCacheUnmatchError:
            self.counters["unmatch_errors"] += 1
            raise
        finally:
            self._release_ctx(ctx)
            self.counters["materialize_seconds"] += time.perf_counter() - t0

    def discard_step(self, step_id: StepId) -> None:
        """Consume the step id when nothing will materialize it (exactly once, any thread).

        Only the read-side snapshot is dropped; the cache write proceeds.
        """
        self._check_usable()
        self._release_ctx(self._take_ctx(step_id, "discard_step"))

    def shutdown(self) -> None:
        """Flush open deferred writes, wait for acknowledgements (bounded), detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_writer and self._fatal is None and self._link.dead is None:
                with self._lock:
                    tasks = [t for t in self._open.values()]
                    for t in tasks:
                        self._close_task_locked(t)
                self._flush(tasks)
                for t in tasks:
                    try:
                        t.done.result(timeout=self.config.commit_timeout_s)
                    except Exception as exc:  # logged: shutdown must finish detaching
                        logger.warning("cache %s: deferred write %d not flushed at shutdown: %s",
                                       self.cache, t.tid, exc)
                try:
                    self._join_previous_write()
                except OmniPrefixCacheUnmatchError as exc:
                    logger.warning("cache %s: last step write failed at shutdown: %s", self.cache, exc)
        finally:
            if self._flusher is not None:
                self._flusher.stop()
            self._link.close()

    def __enter__(self) -> "OmniPrefixCacheManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ status

    @property
    def client_id(self) -> str:
        return self._link.client_id

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every closed write was acknowledged (tests, demos, shutdown).

        Open deferred writes stay open: they land when their request ends.
        Any thread but the engine thread's hot path; raises on a failed write.
        """
        timeout_s = self.config.commit_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._lock:
            closed = [t for t in self._closing.values()]
        for t in closed:
            t.done.result(timeout=max(deadline - time.monotonic(), 0.001))
        if self._prev_write is not None:
            self._prev_write.result(timeout=max(deadline - time.monotonic(), 0.001))
        self._check_usable()

    def unconsumed_step_ids(self) -> list[StepId]:
        with self._lock:
            return sorted(self._ctxs)

    # ------------------------------------------------------------------ internals: save

    def _split_outputs(self, hidden: torch.Tensor | None, mm: Mapping[str, Any] | None, n: int, padded: int):
        immediate: dict[TensorName, torch.Tensor] = {}
        deferred: dict[TensorName, torch.Tensor] = {}
        leftover: dict[TensorName, Any] = {}
        if hidden is not None and self._policy.hidden_key is not None:
            if hidden.dim() < 1 or hidden.shape[0] not in (n, padded):
                raise self._unmatch(f"hidden_states has {tuple(hidden.shape)} rows; expected {n} or {padded}",
                                    key=HIDDEN_KEY, step_id=self._next_step)
            immediate[HIDDEN_KEY] = hidden[:n]
        for key, value in (mm or {}).items():
            if key == HIDDEN_KEY:
                raise ValueError(f"mm_outputs may not use the reserved key {HIDDEN_KEY!r}")
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] in (n, padded) and n > 0:
                rows = value[:n]
                if self._policy.skip_immediate_mm(key):
                    deferred[key] = rows
                else:
                    immediate[key] = rows
            else:
                # Leftover: copied now so later overwrites of live (graph) buffers change nothing.
                leftover[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        return immediate, deferred, leftover

    def _ensure_key(self, key: TensorName, rows: torch.Tensor) -> KeyViews:
        row_shape = tuple(rows.shape[1:])
        width = row_width(row_shape)
        kv = self._keys.get(key)
        if kv is None:
            reply = self._link.request(lambda rid: P.OpenKey(rid=rid, key=key, dtype=dtype_name(rows.dtype),
                                                             width=width))
            kv = KeyViews.map(reply.segments, self.config.num_slots, readonly=not self.is_writer,
                              row_shape=row_shape)
            self._keys[key] = kv
        if kv.dtype != rows.dtype or kv.width != width:
            raise self._unmatch(f"tensor {key!r} is {rows.dtype} width {width}, but the cache holds "
                                f"{kv.dtype} width {kv.width}", key=key, step_id=self._next_step)
        kv.row_shape = row_shape
        return kv

    def _join_previous_write(self) -> None:
        fut = self._prev_write
        if fut is None:
            return
        try:
            reply = fut.result(timeout=self.config.commit_timeout_s)
        except TimeoutError as exc:
            raise self._set_fatal(f"previous step's writes not acknowledged within "
                                  f"{self.config.commit_timeout_s:.1f}s") from exc
        except OmniPrefixCacheCommitterError as exc:
            raise self._set_fatal(f"previous step's writes were lost: {exc}") from exc
        self._prev_write = None
        self._check_reply(reply)

    def _check_reply(self, reply: Any) -> None:
        if isinstance(reply, P.StepDone) and not reply.failed_tids:
            return
        reason = reply.reason if isinstance(reply, P.StepDone) else repr(reply)
        raise self._set_fatal(f"write of step {getattr(reply, 'step', '?')} failed: {reason}")

    def _register_writes(self, ctx: StepCtx, writes: list, cvs: list[int], slots: torch.Tensor,
                         immediate: dict, deferred: dict) -> list[WriteTask]:
        """Row sources for this step's claims, and its deferred chunks. Engine thread."""
        to_flush: list[WriteTask] = []
        with self._lock:
            for w, cv in zip(writes, cvs):
                req_slots = slots[w.token_start:w.token_start + w.num_tokens]
                for key in immediate:
                    self._sources[(key, cv)] = ctx.sources.setdefault(
                        key, RowSource(cv=0, slots=slots, rows=ctx.step_rows[key]))
                    ctx.source_keys.append((key, cv))
                for key in deferred:
                    rows = ctx.step_rows[key][w.token_start:w.token_start + w.num_tokens]
                    task = self._open.get((w.req_id, key))
                    if task is None:
                        task = WriteTask(tid=next(self._tids), req_id=w.req_id, key=key, opened_step=ctx.step_id)
                        self._open[(w.req_id, key)] = task
                        self._deferred_order[task.tid] = task
                    task.chunks.append(Chunk(cv=cv, step_id=ctx.step_id, slots=req_slots, rows=rows))
                    self._open_by_cv[(key, cv)] = task
                    self._sources[(key, cv)] = RowSource(cv=cv, slots=req_slots, rows=rows)
                    self._pending_bytes += rows.numel() * rows.element_size()
            while self._pending_bytes > self.config.gpu_staging_bytes and self._deferred_order:
                oldest = next(iter(self._deferred_order.values()))
                self._close_task_locked(oldest)
                self.counters["budget_flushes"] += 1
                to_flush.append(oldest)
        return to_flush

    def _send_step(self, ctx: StepCtx, writes: list, cvs: list[int], slots: torch.Tensor,
                   immediate: dict) -> None:
        keys = list(immediate)
        assert self._pages is not None and ctx.page is not None
        row0 = ctx.page * self._pages.capacity
        if not keys or not writes:
            self._pages.release(ctx.page, "write")
            self._drop_sources(ctx)
            return
        key_idx, tids, e_cvs, src, counts = [], [], [], [], []
        step_tids = [next(self._tids) for _ in writes]
        for ki, _key in enumerate(keys):
            for w, cv, tid in zip(writes, cvs, step_tids):
                key_idx.append(ki)
                tids.append(tid)
                e_cvs.append(cv)
                src.append(row0 + w.token_start)
                counts.append(w.num_tokens)
        # Entries list each key's writes in batch order, so their slots are the step's slots per key.
        all_slots = slots.repeat(len(keys))
        page = ctx.page
        fut = self._link.submit(lambda rid: build_step_write(rid, ctx.step_id, keys, key_idx, tids, e_cvs, src,
                                                              counts, all_slots))

        def done(f: Future) -> None:
            self._drop_sources(ctx)
            assert self._pages is not None
            self._pages.release(page, "write")
            try:
                self._check_reply(f.result())
            except Exception as exc:  # recorded as the sticky fatal error
                self._set_fatal(f"write of step {ctx.step_id} failed: {exc}")

        fut.add_done_callback(done)
        self._prev_write = fut

    def _drop_sources(self, ctx: StepCtx) -> None:
        with self._lock:
            for src in ctx.sources.values():
                src.alive = False
            for k in ctx.source_keys:
                self._sources.pop(k, None)
            ctx.source_keys.clear()

    def _rescue_before_claim(self, slots: torch.Tensor, row_cv: torch.Tensor) -> None:
        """Copy-on-write: keep rows a pending read planned before their slots change tenant."""
        if not self._pinned or not bool((self._pin_count[slots] > 0).any()):
            return
        with self._lock:
            pinned = list(self._pinned.values())
        hot = slots[self._pin_count[slots] > 0]
        for ctx in pinned:
            for req, span in ctx.hits.items():
                inter = torch.isin(span.slots, hot)
                if not bool(inter.any()):
                    continue
                for key, planned in span.cvs.items():
                    want = span.slots[inter]
                    cvs = planned[inter]
                    keep = cvs != 0
                    want, cvs = want[keep], cvs[keep]
                    if len(want) == 0:
                        continue
                    out = self._keys[key].rows_out(len(want))
                    try:
                        self._resolve_rows(self._keys[key], want, cvs, out, None, key, req, ctx.step_id)
                    except OmniPrefixCacheUnmatchError:
                        continue  # nothing valid to keep; the read will raise
                    with self._lock:
                        store = ctx.rescue.setdefault(key, {})
                        for i, s in enumerate(want.tolist()):
                            store[s] = out[i]
                    self.counters["cow_rescues"] += len(want)

    # ------------------------------------------------------------------ internals: deferred writes

    def _close_task_locked(self, task: WriteTask) -> None:
        if task.state is not TaskState.OPEN:
            return
        task.state = TaskState.CLOSED
        self._closing[task.tid] = task
        self._open.pop((task.req_id, task.key), None)
        self._deferred_order.pop(task.tid, None)
        for c in task.chunks:
            self._open_by_cv.pop((task.key, c.cv), None)
        self._pending_bytes -= task.nbytes

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
        if not tasks:
            return
        assert self._flusher is not None
        for t in tasks:
            self.counters["deferred_flushes"] += 1
            self._flusher.put(t)

    def _on_task_done(self, task: WriteTask, result: Any) -> None:
        """Flusher thread: a deferred write landed (or failed)."""
        failed: str | None = None
        if isinstance(result, BaseException):
            failed = str(result)
        elif result.failed_tids:
            failed = result.reason
        with self._lock:
            task.state = TaskState.FAILED if failed else TaskState.DONE
            self._closing.pop(task.tid, None)
            for c in task.chunks:
                src = self._sources.pop((task.key, c.cv), None)
                if src is not None:
                    src.alive = False
        if failed:
            err = self._set_fatal(f"deferred write {task.tid} of request {task.req_id!r} tensor {task.key!r} "
                                  f"failed: {failed}")
            task.done.set_exception(err)
        else:
            task.done.set_result(result)

    # ------------------------------------------------------------------ internals: reads

    def _read_hit(self, ctx: StepCtx, span: HitSpan, key: TensorName, out: torch.Tensor, req: ReqId) -> None:
        if self.is_writer:
            kv = self._keys.get(key)
            planned = span.cvs.get(key)
            if kv is None or planned is None:
                raise self._unmatch("hit on a tensor the cache never held", req_id=req, key=key,
                                    step_id=ctx.step_id)
            self._resolve_rows(kv, span.slots, planned, out, ctx, key, req, ctx.step_id)
        else:
            kv = self._reader_key(key, out, req, ctx.step_id)
            self._read_committed(kv, span.slots, out, key, req, ctx.step_id)

    def _reader_key(self, key: TensorName, out: torch.Tensor, req: ReqId, step_id: StepId) -> KeyViews:
        """Map a key the writer opened; this rank's rows must have the same dtype and width."""
        kv = self._keys.get(key)
        if kv is None:
            try:
                reply = self._link.request(lambda rid: P.OpenKey(rid=rid, key=key, dtype=dtype_name(out.dtype),
                                                                 width=int(out.shape[1])))
            except OmniPrefixCacheCommitterError as exc:
                raise self._unmatch(f"hit on a tensor the writer never wrote or wrote with another layout "
                                    f"({exc})", req_id=req, key=key, step_id=step_id) from exc
            kv = KeyViews.map(reply.segments, self.config.num_slots, readonly=True)
            self._keys[key] = kv
        if kv.dtype != out.dtype or kv.width != out.shape[1]:
            raise self._unmatch(f"this rank's rows are {out.dtype} width {out.shape[1]}, the pool holds "
                                f"{kv.dtype} width {kv.width}", req_id=req, key=key, step_id=step_id)
        return kv

    def _resolve_rows(self, kv: KeyViews, slots: torch.Tensor, cvs: torch.Tensor, out: torch.Tensor,
                      ctx: StepCtx | None, key: TensorName, req: ReqId, step_id: StepId) -> None:
        """Writer: rows of ``slots`` at versions ``cvs`` from the pool, a live source or a rescue."""
        if bool(((cvs == 0) | ((cvs >> 48) != self._epoch)).any()):
            # 0: never written; another epoch: written by an earlier writer this engine never saw.
            raise self._unmatch("hit span resolves to absent rows (never written by this writer)",
                                req_id=req, key=key, step_id=step_id)
        torch.index_select(kv.pool, 0, slots, out=out)
        ok = (kv.commit[slots] == cvs) & (kv.claim[slots] == cvs)
        if not bool(ok.all()):
            self._fix_rows(kv, slots, cvs, out, ~ok, ctx, key, req, step_id)
        # Seqlock: a claim that moved while we copied means the row may be the new tenant's.
        moved = ok & (kv.claim[slots] != cvs)
        if bool(moved.any()):
            self._fix_rows(kv, slots, cvs, out, moved, ctx, key, req, step_id, from_pool=False)

    def _fix_rows(self, kv: KeyViews, slots: torch.Tensor, cvs: torch.Tensor, out: torch.Tensor,
                  mask: torch.Tensor, ctx: StepCtx | None, key: TensorName, req: ReqId, step_id: StepId,
                  from_pool: bool = True) -> None:
        idx = torch.nonzero(mask).reshape(-1)
        deadline = time.monotonic() + self.config.commit_timeout_s
        for cv in torch.unique(cvs[idx]).tolist():
            sel = idx[cvs[idx] == cv]
            want = slots[sel]
            while True:
                with self._lock:
                    src = self._sources.get((key, cv))
                    rescue = ctx.rescue.get(key) if ctx is not None else None
                if src is not None:
                    rows = src.take(want)
                    if rows is not None and src.alive:
                        out[sel] = rows
                        break
                if rescue is not None and all(s in rescue for s in want.tolist()):
                    out[sel] = torch.stack([rescue[s] for s in want.tolist()])
                    break
                claim = kv.claim[want]
                if bool((claim != cv).any()):
                    raise self._unmatch(f"slot reused before the read (planned version {cv:#x}, now "
                                        f"{int(claim[claim != cv][0]):#x}) and no copy-on-write rescue",
                                        req_id=req, key=key, step_id=step_id)
                if from_pool and bool((kv.commit[want] == cv).all()):
                    out[sel] = kv.pool.index_select(0, want)
                    if bool((kv.claim[want] == cv).all()):
                        break
                    continue
                self._check_usable()
                if time.monotonic() > deadline:
                    raise self._unmatch(f"rows of version {cv:#x} did not land within "
                                        f"{self.config.commit_timeout_s:.1f}s", req_id=req, key=key,
                                        step_id=step_id)
                time.sleep(_POLL_S)

    def _read_committed(self, kv: KeyViews, slots: torch.Tensor, out: torch.Tensor, key: TensorName,
                        req: ReqId, step_id: StepId) -> None:
        """Reader: wait until the writer's rows for ``slots`` landed, copy, validate (seqlock)."""
        deadline = time.monotonic() + self.config.commit_timeout_s
        while True:
            epoch = int(self._ctl[P.CTL_WRITER_EPOCH])
            claim = kv.claim[slots].clone()
            if bool((claim == 0).any()):
                raise self._unmatch("hit span resolves to absent rows (never written)", req_id=req, key=key,
                                    step_id=step_id)
            bad_epoch = (claim >> 48) != epoch
            later = ((claim >> 16) & 0xFFFFFFFF) > step_id
            if bool((bad_epoch | later).any()):
                raise self._unmatch("slot reused after the hit was planned (reader has no rescue)",
                                    req_id=req, key=key, step_id=step_id)
            if bool((kv.commit[slots] == claim).all()):
                torch.index_select(kv.pool, 0, slots, out=out)
                if bool((kv.claim[slots] == claim).all()):
                    return
                raise self._unmatch("slot reused while reading it", req_id=req, key=key, step_id=step_id)
            self._check_usable()
            if time.monotonic() > deadline:
                raise self._unmatch(f"hit rows not committed within {self.config.commit_timeout_s:.1f}s",
                                    req_id=req, key=key, step_id=step_id)
            time.sleep(_POLL_S)

    def _wait_published(self, step_id: StepId) -> None:
        deadline = time.monotonic() + self.config.commit_timeout_s
        while int(self._ctl[P.CTL_PUBLISHED_STEP]) < step_id:
            self._check_usable()
            if time.monotonic() > deadline:
                raise self._unmatch(f"writer did not publish step {step_id} within "
                                    f"{self.config.commit_timeout_s:.1f}s (published "
                                    f"{int(self._ctl[P.CTL_PUBLISHED_STEP])})", step_id=step_id)
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ internals: step ids

    def _take_ctx(self, step_id: StepId, what: str) -> StepCtx:
        with self._lock:
            ctx = self._ctxs.pop(step_id, None)
            if ctx is None:
                reason = "was already consumed" if step_id in self._consumed else "was never saved"
                raise self._unmatch(f"{what}: step id {step_id} {reason} (each step id is consumed exactly once)",
                                    step_id=step_id)
            self._consumed.add(step_id)
            if len(self._consumed) > 4096:
                self._consumed = {s for s in self._consumed if s > step_id - 2048}
            return ctx

    def _release_ctx(self, ctx: StepCtx) -> None:
        with self._lock:
            if self._pinned.pop(ctx.step_id, None) is not None:
                for span in ctx.hits.values():
                    self._pin_count[span.slots] -= 1
        if ctx.page is not None and self._pages is not None:
            self._pages.release(ctx.page, "ctx")

    # ------------------------------------------------------------------ errors

    def _unmatch(self, reason: str, *, req_id: ReqId | None = None, key: TensorName | None = None,
                 step_id: StepId | None = None) -> OmniPrefixCacheUnmatchError:
        return unmatch(f"cache {self.cache}: {reason}", req_id=req_id, key=key, step_id=step_id)

    def _set_fatal(self, reason: str) -> OmniPrefixCacheUnmatchError:
        err = self._unmatch(f"failed write (sticky; recreate the cache): {reason}")
        if self._fatal is None:
            self._fatal = err
            logger.error("%s", err)
        return err

    def _check_usable(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise RuntimeError(f"cache {self.cache}: manager is shut down")
        if self._link.dead is not None:
            raise OmniPrefixCacheCommitterError(self._link.dead)


__all__ = ["OmniPrefixCacheManager"]
