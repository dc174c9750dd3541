"""Read-side internals of the manager: finding and validating hit rows.

``ReadSide`` is a mixin of ``OmniPrefixCacheManager`` and works on its state.
The writer resolves a hit slot through its own knowledge (pool row, a live row
source, or a copy-on-write rescue); a reader waits until the writer published
the step and the rows are committed, then copies and re-checks the claim
versions (a seqlock): it raises rather than serve a reused slot. It also
runs ``materialize`` (``_materialize``), lays out its result tensors (``_arena``) and checks ``out=`` buffers.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from omnishm import protocol as P
from omnishm.client.device import DONE
from omnishm.client.rowcopy import gather_rows
from omnishm.client.segments import KeyViews, dtype_name
from omnishm.client.steps import HitSpan, StepCtx, as_step_id, hits_digest, request_ids
from omnishm.interface import (HIDDEN_KEY, OmniPrefixCacheCommitterError, ReqId,
                               StageCacheOutputs, StepId, TensorName)
from omnishm.versions import cv_epoch, cv_step, make_cv

_POLL_S = 0.0005


class ReadSide:
    """Hit-row reads (mixin; all state lives in the manager).

    Every wait for rows, a publication or a key takes a ``deadline`` (``time.monotonic()``) from its
    caller: one bound for all the waits of one ``materialize`` (or one prefetch, one rescue).
    """

    def _deadline(self) -> float:
        """``commit_timeout_s`` from now: the bound of one call's waits."""
        return time.monotonic() + self.config.commit_timeout_s

    def _materialize(self, step_id: StepId, req_ids: Iterable[ReqId],
                     out: Mapping[ReqId, Mapping[TensorName, torch.Tensor]] | None) -> StageCacheOutputs:
        """``materialize``'s work (its contract is on the manager's method); any thread."""
        t0 = time.perf_counter()
        self._check_usable()
        step_id = as_step_id(step_id, "materialize")
        req_ids = list(request_ids(req_ids))
        served = [0, 0]  # hit tokens, rows served
        ctx = self._take_ctx(step_id, "materialize", req_ids, out)
        try:  # at once: a consumed step's page and pins go back whatever is raised from here on
            nkeys = len(ctx.step_rows)
            deadline = self._deadline()  # one bound for every wait of this call, not one per wait
            named = next((r for r in req_ids if r in ctx.hits), None) if ctx.hits else None
            if not self.is_writer and named is not None:
                # Only hit rows come from the writer: requests without a hit are this rank's own rows, and
                # waiting for a publication they do not need would stall the engine thread on a late or
                # stuck writer (up to commit_timeout_s every step), then refuse rows it had. So a reader
                # waits only when a request asked for has a hit (review, stop 56: it waited when any
                # request of the step had one). A refusal names that request and a tensor of the step.
                self._wait_published(step_id, deadline, req=named, key=next(iter(ctx.row_shapes), None))
                self._check_same_plan(ctx, named)
            hidden: dict[ReqId, Any] = {}
            mm: dict[ReqId, dict[TensorName, Any]] = {}
            hits: dict[ReqId, int] = {}
            self._wait_step_events(ctx)
            # One allocation per key for the whole call; each request gets a view of it, and the
            # step rows of requests without a hit are already in place (see _arena).
            ready = self._prefetched_requests(ctx, req_ids, deadline) if out is None else set()
            views = self._arena(ctx, req_ids, ready) if out is None else None
            if views is not None and not ctx.hits:
                return self._plain_results(ctx, req_ids, views, served)
            for req in req_ids:
                start, count = ctx.spans[req]
                span = ctx.hits.get(req)
                h = len(span.slots) if span is not None else 0
                hits[req] = h
                if views is not None and not h:
                    merged: dict[TensorName, Any] = {key: v[req] for key, v in views.items()}
                else:
                    merged = {}
                    for key, step_rows in ctx.step_rows.items():
                        width = step_rows.shape[1]
                        given = out.get(req, {}).get(key) if out is not None else None
                        pre = self._take_prefetched(ctx, req, key, deadline) if h else None
                        if given is not None:
                            dst = given.view(h + count, width)  # not -1: a request of 0 rows has no inferable width
                        elif pre is not None and req in ready:
                            dst = pre  # the prefetch's result: hit rows in place
                        elif views is not None and req in views[key]:  # not: prefetched (a second time, here)
                            dst = views[key][req].view(h + count, width)
                        else:
                            dst = self.result_pool.empty((h + count, width), step_rows.dtype)
                        if pre is None and h:
                            self._read_hit(ctx, span, key, dst[:h], req, deadline)
                        elif pre is not None and dst is not pre:
                            dst[:h].copy_(pre[:h])
                        own = step_rows[start:start + count]
                        self._copy_step_rows(dst[h:], own, ctx.freeze_event)
                        merged[key] = dst.view((h + count, *ctx.row_shapes[key]))
                served[0] += h
                served[1] += (h + count) * nkeys
                hidden[req] = merged.pop(HIDDEN_KEY, None)
                for key, value in ctx.leftover.items():
                    # Cloned out, so the caller never holds pinned pages or a shared snapshot.
                    merged[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                mm[req] = merged
            return StageCacheOutputs(hidden_states=hidden, mm_outputs=mm, num_hit_tokens=hits)
        finally:
            self._release_ctx(ctx)
            pool = self.result_pool.stats
            self.counters["result_blocks_reused"] = float(pool["reused"])
            self.counters["result_blocks_faulted"] = float(pool["faulted"])
            if served[1]:  # counted per served request, also when a later one raised
                self.counters["hit_tokens"] += served[0]
                self.counters["hit_rows_served"] += served[0] * nkeys
                self.counters["rows_served"] += served[1]
            self.counters["materialize_seconds"] += time.perf_counter() - t0

    @staticmethod
    def _plain_results(ctx: StepCtx, req_ids: list[ReqId], views: dict[TensorName, dict[ReqId, torch.Tensor]],
                       served: list[int]) -> StageCacheOutputs:
        """``materialize``'s result for a step without hits (every decode step): each result is ``_arena``'s
        view already, in place. The same result as the general loop, with no per-request work but the
        dicts (a decode step of 512 requests took a third less time; perf review, 2026-12-06)."""
        spans = ctx.spans
        served[1] += sum([spans[req][1] for req in req_ids]) * len(ctx.step_rows)
        # _arena's own dict: every request once, in the order first asked (one asked twice: its later view).
        hv = views.get(HIDDEN_KEY)
        hidden: dict[ReqId, Any] = dict.fromkeys(req_ids) if hv is None else hv
        rest = [(key, v) for key, v in views.items() if key != HIDDEN_KEY]
        leftover = ctx.leftover
        mm: dict[ReqId, dict[TensorName, Any]] = {}
        for req in req_ids:
            merged: dict[TensorName, Any] = {key: v[req] for key, v in rest}
            for key, value in leftover.items():  # cloned out, as in the general loop
                merged[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            mm[req] = merged
        return StageCacheOutputs(hidden_states=hidden, mm_outputs=mm, num_hit_tokens=dict.fromkeys(req_ids, 0))

    def _arena(self, ctx: StepCtx, req_ids: list[ReqId], prefetched: set[ReqId]
               ) -> dict[TensorName, dict[ReqId, torch.Tensor]]:
        """Result tensors ``(hit + step rows, *row_shape)`` of every requested request and key but those whose
        whole result the prefetch made (``prefetched``).

        One allocation per key (``result_pool``). The requests without a hit
        come first, in ``req_ids`` order, with their step rows already in
        place: each run of them that is adjacent in the step is ONE copy per key
        (the whole batch without hits is one copy). Each hit request gets its
        own region after those, which the caller fills (hit rows, then its step
        rows).
        """
        plain: list[ReqId] = []
        sizes: list[int] = []
        runs: list[list[int]] = []  # [step row, result row, rows] of each adjacent run
        hit_reqs: list[ReqId] = []
        hit_sizes: list[int] = []
        off = 0
        for req in req_ids:
            start, count = ctx.spans[req]
            span = ctx.hits.get(req)
            if span is None:
                if runs and runs[-1][0] + runs[-1][2] == start:
                    runs[-1][2] += count
                else:
                    runs.append([start, off, count])
                plain.append(req)
                sizes.append(count)
                off += count
            elif req not in prefetched:
                hit_reqs.append(req)
                hit_sizes.append(len(span.slots) + count)
        total = off + sum(hit_sizes)
        arena: dict[TensorName, dict[ReqId, torch.Tensor]] = {}
        whole = len(runs) == 1 and not hit_reqs and runs[0][0] == 0  # the usual step: one copy, no slicing
        for key, rows in ctx.step_rows.items():
            # Recycled, pre-faulted memory: a fresh allocation would pay a page fault per 4 KiB.
            shape = ctx.row_shapes[key]
            buf = self.result_pool.empty((total, *shape), rows.dtype)
            flat = buf if len(shape) == 1 else buf.view(total, rows.shape[1])
            if whole:
                self._copy_step_rows(flat, rows if total == len(rows) else rows[:total], ctx.freeze_event)
            else:
                for start, at, count in runs:
                    self._copy_step_rows(flat[at:at + count], rows[start:start + count], ctx.freeze_event)
            arena[key] = dict(zip(plain + hit_reqs, buf.split_with_sizes(sizes + hit_sizes)))
        return arena

    def _read_device_rows(self, rows: torch.Tensor, index: torch.Tensor | None, ready: Any) -> torch.Tensor:
        """``rows[index]`` (all of ``rows``: None) on the host, read from a live row source or a step's rows (a
        device tensor through the copy ops, once ``ready``, its step's freeze event, happened; None: now)."""
        if self._ops is None:
            return rows.index_select(0, index) if index is not None else rows.clone()
        return self._ops.read_rows(rows, index, DONE if ready is None else ready)

    def _copy_step_rows(self, dst: torch.Tensor, rows: torch.Tensor, ready: Any) -> None:
        dst.copy_(rows if not rows.is_cuda else self._read_device_rows(rows, None, ready))

    @staticmethod
    def _check_out_buffers(ctx: StepCtx, req_ids: list[ReqId],
                           out: Mapping[ReqId, Mapping[TensorName, torch.Tensor]]) -> None:
        """Refuse a wrong ``out`` buffer before the step id is consumed (``TypeError``, ``ValueError``, naming the
        step, the request and the tensor)."""
        at = f"materialize(step {ctx.step_id}) out"
        if not isinstance(out, Mapping):
            raise TypeError(f"{at} must map request ids to {{name: tensor}}, got {type(out).__name__}")
        for req in req_ids:
            span = ctx.hits.get(req)
            rows = (len(span.slots) if span is not None else 0) + ctx.spans[req][1]
            bufs = out.get(req, {})
            if not isinstance(bufs, Mapping):
                raise TypeError(f"{at}[{req!r}] must map tensor names to tensors, got {type(bufs).__name__}")
            for key, given in bufs.items():
                step_rows = ctx.step_rows.get(key)
                if step_rows is None:
                    raise ValueError(f"{at}[{req!r}] names {key!r}, which this step did not save")
                if not isinstance(given, torch.Tensor):
                    raise TypeError(f"{at}[{req!r}][{key!r}] must be a tensor, got {type(given).__name__}")
                shape = (rows, *ctx.row_shapes[key])
                if tuple(given.shape) != shape or given.dtype != step_rows.dtype or not given.is_contiguous() \
                        or given.device.type != "cpu":
                    raise ValueError(f"{at}[{req!r}][{key!r}] must be a contiguous CPU tensor "
                                     f"{shape} {step_rows.dtype}, got {tuple(given.shape)} {given.dtype} "
                                     f"on {given.device}")
                # torch refuses these writes only once the step is consumed (review): say so before
                if given.requires_grad and torch.is_grad_enabled():  # under no_grad torch writes it
                    raise ValueError(f"{at}[{req!r}][{key!r}] requires grad: rows cannot be copied "
                                     f"into it with grad enabled (call materialize under torch.no_grad(), or pass "
                                     f"a tensor that does not require grad)")
                if given.is_inference() and not torch.is_inference_mode_enabled():
                    raise ValueError(f"{at}[{req!r}][{key!r}] was made under torch.inference_mode and "
                                     f"this thread is not in it: torch refuses to write it here")

    def _read_hit(self, ctx: StepCtx, span: HitSpan, key: TensorName, out: torch.Tensor, req: ReqId,
                  deadline: float) -> None:
        """A hit's rows of ``key`` into ``out``; waits for rows still landing until ``deadline`` (monotonic)."""
        if span.refused is not None:  # the writer found them computed for other tokens (client/tokens.py)
            raise self._unmatch(span.refused, req_id=req, key=key, step_id=ctx.step_id)
        if self.is_writer:
            kv = self._keys.get(key)
            planned = span.cvs.get(key)
            if kv is None or planned is None:
                raise self._unmatch("hit on a tensor the cache never held", req_id=req, key=key,
                                    step_id=ctx.step_id)
            self._resolve_rows(kv, span.slots, planned, out, ctx, key, req, ctx.step_id, deadline)
        else:
            kv = self._reader_key(key, out, ctx.row_shapes[key], req, ctx.step_id, deadline)
            self._read_committed(kv, span.slots, out, key, req, ctx.step_id, deadline)

    def _reader_key(self, key: TensorName, out: torch.Tensor, row_shape: tuple[int, ...], req: ReqId,
                    step_id: StepId, deadline: float) -> KeyViews:
        """Map a key the writer opened; this rank's rows (``out``, flat, of ``row_shape``) must have the
        dtype and row shape of the key's rows. Every row of a key has the one shape the committer holds for
        it (``OpenKey``), whichever step wrote it, so this step's shape is all there is to check; a rank
        whose own save took another shape than its writer's is refused here. The committer's answer is
        awaited until ``deadline``."""
        kv = self._keys.get(key)
        if kv is None:
            try:
                dtype = dtype_name(out.dtype)
            except ValueError as exc:  # the writer refused such rows at its save; this rank took them
                raise self._unmatch(f"hit on rows of a dtype the cache cannot hold: {exc}", req_id=req, key=key,
                                    step_id=step_id) from exc
            timeout_s = max(0.01, deadline - time.monotonic())
            try:
                reply = self._link.request(lambda rid: P.OpenKey(rid=rid, key=key, dtype=dtype, width=int(out.shape[1]),
                                                                 row_shape=row_shape), timeout_s)
            except OmniPrefixCacheCommitterError as exc:
                raise self._unmatch(f"hit on a tensor this reader could not map: the writer never wrote it, "
                                    f"wrote it with another layout, or the committer did not answer ({exc})",
                                    req_id=req, key=key, step_id=step_id) from exc
            try:
                kv = KeyViews.map(reply.segments, self.config.num_slots, readonly=True)
            except OSError as exc:  # unlinked after the answer (the committer stopped, or was swept)
                raise self._unmatch(f"hit on a tensor whose segments were gone before this reader mapped them "
                                    f"(its committer stopped?): {exc}", req_id=req, key=key,
                                    step_id=step_id) from exc
            self._publish_key(key, kv)
        if kv.dtype != out.dtype or kv.row_shape != row_shape:
            raise self._unmatch(f"this rank's rows are {out.dtype} rows of shape {row_shape}, the pool holds "
                                f"{kv.dtype} rows of shape {kv.row_shape}", req_id=req, key=key, step_id=step_id)
        return kv

    def _resolve_rows(self, kv: KeyViews, slots: torch.Tensor, cvs: torch.Tensor, out: torch.Tensor,
                      ctx: StepCtx | None, key: TensorName, req: ReqId, step_id: StepId,
                      deadline: float) -> None:
        """Writer: rows of ``slots`` at versions ``cvs`` from the pool, a live source or a rescue."""
        if bool(((cvs == 0) | ((cvs >> 48) != self._epoch)).any()):
            # 0: never written; another epoch: written by an earlier writer this engine never saw.
            raise self._unmatch("hit span resolves to absent rows (never written by this writer, or cleared by a "
                                "refused save or a hit's token check)", req_id=req, key=key, step_id=step_id)
        # Seqlock: committed BEFORE the copy (a row still landing may be copied half old, half new, and
        # be committed by the time a check after the copy runs), and still claimed after it.
        ok = (kv.commit[slots] == cvs) & (kv.claim[slots] == cvs)
        gather_rows(kv.pool, slots, out)
        if not bool(ok.all()):
            self._fix_rows(kv, slots, cvs, out, ~ok, ctx, key, req, step_id, deadline)
        # A claim that moved while we copied means the row may be the new tenant's.
        moved = ok & (kv.claim[slots] != cvs)
        if bool(moved.any()):
            self._fix_rows(kv, slots, cvs, out, moved, ctx, key, req, step_id, deadline, from_pool=False)

    def _fix_rows(self, kv: KeyViews, slots: torch.Tensor, cvs: torch.Tensor, out: torch.Tensor,
                  mask: torch.Tensor, ctx: StepCtx | None, key: TensorName, req: ReqId, step_id: StepId,
                  deadline: float, from_pool: bool = True) -> None:
        idx = torch.nonzero(mask).reshape(-1)
        for cv in torch.unique(cvs[idx]).tolist():
            sel = idx[cvs[idx] == cv]
            want = slots[sel]
            while True:
                with self._lock:
                    # A deferred write's per-request source, else the step source of an immediate key.
                    src = self._sources.get((key, cv))
                    if src is None:
                        src = self._step_sources.get((key, cv_step(cv)))
                    rescue = ctx.rescue.get(key) if ctx is not None else None
                if src is not None:
                    rows = src.take(want, self._read_device_rows)
                    if rows is not None and src.alive:
                        out[sel] = rows
                        break
                if rescue is not None:
                    rescued = [rescue.get(s) for s in want.tolist()]
                    if any(r is not None for r in rescued):
                        # Rescued slots are served from the rescue; the others (a deferred write that
                        # landed after the pool copy, its source dropped) go on to the pool below.
                        kept = torch.tensor([r is not None for r in rescued], dtype=torch.bool)
                        out[sel[kept]] = torch.stack([r for r in rescued if r is not None])
                        sel, want = sel[~kept], want[~kept]
                        if len(want) == 0:
                            break
                claim = kv.claim[want]
                if bool((claim != cv).any()):
                    # The engine thread rescues a slot's rows before it claims the slot again, so a claim seen
                    # moved here has its rescue in place now, though it may not have had when looked up above
                    # (this thread was inside take meanwhile): look again before refusing.
                    with self._lock:
                        rescue = ctx.rescue.get(key) if ctx is not None else None
                    if rescue is not None and any(rescue.get(s) is not None for s in want.tolist()):
                        continue
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
                        req: ReqId, step_id: StepId, deadline: float) -> None:
        """Reader: wait until the writer's rows for ``slots`` landed, copy, validate (seqlock).

        Raises ``OmniPrefixCacheUnmatchError`` for absent or reused rows, and
        for rows that did not land within ``commit_timeout_s`` or whose writer
        left the cache first (``_writer_left``), by ``deadline``.
        """
        since = self._follow_mark()
        # Claims of the writer this reader follows only (bound by the step's _wait_published): rows of an
        # earlier engine's writer, or of one that took the followed writer's place, are never this reader's.
        epoch = self._follows
        while True:
            claim = kv.claim[slots].clone()
            if bool((claim == 0).any()):
                raise self._unmatch("hit span resolves to absent rows (never written, or cleared by a refused "
                                    "save or by the writer's token check of a hit)", req_id=req, key=key,
                                    step_id=step_id)
            bad_epoch = (claim >> 48) != epoch
            later = ((claim >> 16) & 0xFFFFFFFF) > step_id
            if bool((bad_epoch | later).any()):
                raise self._unmatch("slot reused after the hit was planned (reader has no rescue)",
                                    req_id=req, key=key, step_id=step_id)
            if bool((kv.commit[slots] == claim).all()):
                gather_rows(kv.pool, slots, out)
                if bool((kv.claim[slots] == claim).all()):
                    return
                raise self._unmatch("slot reused while reading it", req_id=req, key=key, step_id=step_id)
            self._check_usable()
            # A replaced writer left too (its staging went with it), whichever writer ``since`` names.
            left = self._writer_left(since) or bool(self._replaced())
            if left or time.monotonic() > deadline:
                if left and bool((kv.commit[slots] == claim).all()):
                    continue  # landed before the writer left: read it on the next pass
                raise self._unmatch("hit rows not committed " + (
                    "before their writer left the cache (goodbye, or reaped)" if left
                    else f"within {self.config.commit_timeout_s:.1f}s"), req_id=req, key=key, step_id=step_id)
            time.sleep(_POLL_S)

    def _check_same_plan(self, ctx: StepCtx, req: ReqId) -> None:
        """Reader, the thread of ``materialize``, before any hit row is served: raise
        ``OmniPrefixCacheUnmatchError`` unless the writer it follows planned the same hits for this step
        (``P.CTL_HITS_RING``). The step is published (``_wait_published``), so the writer recorded its plan
        before: what differs is the ranks' calls (another scheduler output, step ids that drifted apart), and
        the slots this rank planned may hold other requests' rows. ``req``: the hit request asked for that the
        error names."""
        at = 2 * (ctx.step_id % P.CTL_HITS_RING)
        ring = self._hits_ring
        marker, digest, again = ring[at], ring[at + 1], ring[at]
        want = make_cv(self._follows, ctx.step_id, 0)
        if marker == again == want and digest == hits_digest(ctx.hits, self.config.block_size):
            return
        if marker == again == want:
            why = "the writer planned other hits (other requests, blocks or hit lengths)"
        elif marker != again or marker == -1 or (marker > 0 and cv_epoch(marker) == self._follows
                                                  and cv_step(marker) > ctx.step_id):
            # This step's entry was whole before its publication: one changing now is a later step's.
            why = (f"the writer's record of this step was overwritten: this reader runs {P.CTL_HITS_RING} or more "
                   f"steps with hits behind it")
        else:
            why = "the writer planned no hit"
        raise self._unmatch(f"ranks disagree on the step's hits ({why}); every rank must be given the same "
                            f"scheduler output and make the same calls", req_id=req,
                            key=next(iter(ctx.row_shapes), None), step_id=ctx.step_id)

    def _wait_published(self, step_id: StepId, deadline: float, *, req: ReqId | None = None,
                        key: TensorName | None = None) -> None:
        """Reader, any thread: wait until the writer this reader follows published ``step_id`` (its claims
        are in the table); ``_published`` says which writer that is.

        Raises ``OmniPrefixCacheUnmatchError`` at once when another writer took the followed writer's
        place (nothing of the followed one will come, and the new one's step ids are not this reader's),
        as soon as the followed writer has left the cache without
        publishing ``step_id`` (``_writer_left``), and after ``commit_timeout_s``; naming ``req`` and ``key``.
        """
        since = self._follow_mark()
        while not self._published(step_id):
            self._check_usable()
            if since is None:
                since = self._follow_mark()  # bound now: from here its leaving ends the wait
            replaced = self._replaced()
            if replaced:
                raise self._unmatch(f"the writer this reader follows (epoch {self._follows}) was replaced by "
                                    f"writer epoch {replaced} before this reader read step {step_id}; a reader "
                                    f"serves the steps of one writer only", req_id=req, key=key, step_id=step_id)
            left = self._writer_left(since)
            if left or time.monotonic() > deadline:
                if self._published(step_id):  # published, then left: it counts
                    return
                why = "left the cache (goodbye, or reaped) before publishing" if left else "did not publish"
                raise self._unmatch(f"writer {why} step {step_id}"
                                    + ("" if left else f" within {self.config.commit_timeout_s:.1f}s")
                                    + f" ({self._publication()})", req_id=req, key=key, step_id=step_id)
            time.sleep(_POLL_S)

    def _published(self, step_id: StepId) -> bool:
        """Reader, any thread: whether the writer this reader follows (``_follow_writer``) published
        ``step_id``. A publication carries its writer's epoch, so no other writer's counts."""
        word = int(self._ctl[P.CTL_PUBLISHED_STEP])
        if word < 0 or cv_step(word) < step_id:
            return False
        follows = self._follow_writer()
        return follows != 0 and cv_epoch(word) == follows

    def _follow_writer(self) -> int:
        """Reader, any thread: the epoch of the writer this reader follows, 0 while it knows of none.

        A reader's step ids are the steps of ONE writer: its engine's output
        rank, which runs the same steps in lockstep. That is the first writer
        seen alive since this reader attached (looked for at each
        ``save_outputs`` and each wait until then): the writer in the control
        segment if it attached after this reader (a larger epoch than at
        attach), or if it published a step since (the publication word moved
        on and carries its epoch). Being attached is not enough: an earlier
        engine's writer, killed and not yet reaped, still holds the seat (and
        a Welcome names it), but it never publishes again. The binding is set
        once, under the state lock; a publication or claim of any other
        writer is never this reader's (``_wait_published``, ``_read_committed``).
        """
        if not self._follows:
            epoch = int(self._ctl[P.CTL_WRITER_EPOCH])
            word = int(self._ctl[P.CTL_PUBLISHED_STEP])
            fresh = word != self._published_at_attach and word >= 0 and cv_epoch(word) == epoch
            if epoch and (epoch > self._epoch_at_attach or fresh):
                with self._lock:
                    if not self._follows:
                        self._follows = epoch
        return self._follows

    def _replaced(self) -> int:
        """Reader, any thread: the epoch of a writer that took the followed writer's place, else 0.
        Epochs only grow, and 0 is none (a restarted committer before its writer resumed)."""
        epoch = int(self._ctl[P.CTL_WRITER_EPOCH])
        return epoch if self._follows and epoch > self._follows else 0

    def _publication(self) -> str:
        """What the control segment says was published, for an error message."""
        word = int(self._ctl[P.CTL_PUBLISHED_STEP])
        if word < 0:
            return "published none"
        if cv_epoch(word) == self._follows:
            return f"published {cv_step(word)}"
        if not self._follows:  # (the writer may be this reader's, idle since before it attached)
            return (f"published {cv_step(word)} of writer epoch {cv_epoch(word)}; this reader follows no writer yet: "
                    f"none attached or published since it attached")
        return f"published {cv_step(word)} of writer epoch {cv_epoch(word)}, not this reader's"

    def _follow_mark(self) -> tuple[int, int] | None:
        """Where a wait begins: (the followed writer's epoch, heartbeats sent so far), for
        ``_writer_left``; it also ends every later wait at the next answer once that writer has left.
        None while this reader follows no writer (``_follow_writer``: none seen alive since it attached;
        a reader may start first, or the cache's previous writer left and the next is on its way): then
        only the timeout ends the wait, and a writer that leaves meanwhile was not this reader's."""
        follows = self._follow_writer()
        return (follows, self._link.heartbeats_sent) if follows else None

    def _writer_left(self, since: tuple[int, int] | None) -> bool:
        """True once a heartbeat sent after ``since`` was answered without the writer of ``since``'s epoch
        (none, or another one): it left (goodbye, or reaped; a reaped writer cannot resume) and its
        unpublished steps and unsent rows will never come. Heartbeats come every ``heartbeat_s``, so this
        is seen within about one period. Any thread."""
        if since is None:
            return False
        beat, epoch = self._link.writer_ack
        return beat > since[1] and epoch != since[0]

    def _prefetch(self, ctx: StepCtx) -> None:
        """Reader, prefetch thread: copy a step's hit rows as soon as the writer published them.

        Reading right after publication, not at a late materialize, keeps the
        window in which the writer may re-claim a hit slot small; what fails
        here is simply read (and raised) again by materialize.
        """
        if ctx.prefetch_taken is not None and not ctx.prefetch_taken.acquire(blocking=False):
            return  # consumed before this thread got to it (``_take_ctx``): nobody waits for these rows
        try:
            deadline = self._deadline()
            self._wait_published(ctx.step_id, deadline)  # a refusal here is materialize's to raise, named there
            assert ctx.prefetch_lock is not None
            for req, span in ctx.hits.items():
                with ctx.prefetch_lock:
                    if req in ctx.prefetch_claims:
                        continue  # materialize came to it first and reads it itself
                    done = ctx.prefetch_claims[req] = threading.Event()
                try:
                    self._prefetch_request(ctx, req, span, deadline)
                finally:
                    done.set()
        except Exception:  # materialize reads again and raises with full context
            pass

    def _prefetch_request(self, ctx: StepCtx, req: ReqId, span: HitSpan, deadline: float) -> None:
        """Reader, prefetch thread: make ``req``'s result for every key, its hit rows in place."""
        h = len(span.slots)
        for key, step_rows in ctx.step_rows.items():
            # The request's whole result: its hit rows here, its step rows by materialize, which
            # returns it without copying the hit again (``_prefetched_requests``). Recycled,
            # pre-faulted memory: a fresh buffer paid its page faults every step (a review measured a
            # 32 MiB hit at 20.5 ms against 2.6 ms, 2026-12-05).
            out = self.result_pool.empty((h + ctx.spans[req][1], step_rows.shape[1]), step_rows.dtype)
            kv = self._reader_key(key, out[:h], ctx.row_shapes[key], req, ctx.step_id, deadline)
            self._read_committed(kv, span.slots, out[:h], key, req, ctx.step_id, deadline)
            ctx.prefetched[(req, key)] = out

