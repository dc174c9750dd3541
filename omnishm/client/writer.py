"""Writer-side internals of the manager: keys, claims, step writes (deferred writes: ``client/deferred.py``).

``WriterSide`` is a mixin of ``OmniPrefixCacheManager`` and works on its state
(see the manager's docstring for the threads and the state lock). It holds no
state of its own. Claim-table writes happen only on the engine thread.
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # builtin TimeoutError only from Python 3.11
from typing import Any

import numpy as np
import torch

from omnishm import protocol as P
from omnishm.client.device import DONE, HostRegistration
from omnishm.client.segments import KeyViews, dtype_name, row_width
from omnishm.client.steps import StepCtx
from omnishm.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheCommitterError,
    OmniPrefixCacheUnmatchError,
    StepId,
    TensorName,
    unmatch,
)
from omnishm.versions import cv_epoch, make_cv

logger = logging.getLogger("omnishm.client.manager")  # one logger for the whole manager, as before the split

_ONE_I64 = struct.Struct("<q")
_WRITE_STRUCTS: dict[int, struct.Struct] = {}
"""Packers of ``n`` int64s by ``n`` (a step's writes): compiled once, not per step."""
_ACK_POLL_S = 50e-6
_ACK_POLL_MAX_S = 250e-6
"""A join re-reads ``CTL_ACKED_STEP`` after 50 us while the committer is still applying the step,
then at doubling intervals up to 250 us: a reply used to end the wait at once, and a large step's
apply takes milliseconds, so the polls add at most a quarter of a millisecond to a wait; a long wait
(a committer restarting) costs at most 4,000 short wakes a second."""


def _check_dense(rows: torch.Tensor, key: TensorName) -> None:
    """``TypeError`` unless ``rows`` is a dense tensor with storage (the staging copy needs one)."""
    if rows.layout is not torch.strided or rows.is_meta:
        raise TypeError(f"tensor {key!r} must be a dense tensor with storage, got a "
                        f"{'meta' if rows.is_meta else str(rows.layout)} tensor")


class WriterSide:
    """Writes of the writer client (mixin; all state lives in the manager)."""

    def _split_outputs(self, hidden: torch.Tensor | None, mm: Mapping[str, Any] | None, n: int, padded: int
                       ) -> tuple[dict[TensorName, torch.Tensor], dict[TensorName, torch.Tensor], dict[TensorName, Any]]:
        """A step's outputs as (immediate, deferred, leftover) by key; engine thread, no lock.

        Raises ``OmniPrefixCacheUnmatchError`` for hidden states not 2-D of ``n`` or ``padded`` rows,
        ``TypeError`` for hidden states that are not a tensor, an mm key that is not a str, and rows that
        are not a dense tensor (sparse or meta: their staging copy would fail after the step id was
        issued, which turns the writer fatal). An mm key that is ``HIDDEN_KEY`` is skipped, as the seed's
        ``skip_immediate_mm`` says (and vllm-omni and the drop-in do): it is neither cached nor returned.
        Tensors that require grad are taken detached: the copies of them must not join an autograd graph
        (the staging views would).
        """
        immediate: dict[TensorName, torch.Tensor] = {}
        deferred: dict[TensorName, torch.Tensor] = {}
        leftover: dict[TensorName, Any] = {}
        if hidden is not None and self._policy.hidden_key is not None:
            if not isinstance(hidden, torch.Tensor):  # e.g. IntermediateTensors of a pipeline stage
                raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden).__name__}")
            if hidden.dim() < 2 or hidden.shape[0] not in (n, padded):
                raise self._unmatch(f"hidden_states has shape {tuple(hidden.shape)}; expected ({n} or {padded}, "
                                    f"hidden size)", key=HIDDEN_KEY, step_id=self._next_step)
            if hidden.requires_grad:
                hidden = hidden.detach()
            _check_dense(hidden, HIDDEN_KEY)
            immediate[HIDDEN_KEY] = hidden if hidden.shape[0] == n else hidden[:n]
        for key, value in (mm or {}).items():
            if type(key) is not str:
                raise TypeError(f"mm_outputs keys must be str (tensor names), got {type(key).__name__} {key!r}")
            if key == HIDDEN_KEY:  # the seed's skip_immediate_mm: hidden rows come from hidden_states only
                continue
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value = value.detach()
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] in (n, padded) and n > 0:
                _check_dense(value, key)
                rows = value if value.shape[0] == n else value[:n]
                if self._policy.skip_immediate_mm(key):
                    deferred[key] = rows
                else:
                    immediate[key] = rows
            else:
                leftover[key] = value  # copied by save_outputs (device.snapshot_leftover), tensors in it too
        return immediate, deferred, leftover

    def _flush_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Flusher thread: one piece of a deferred write into the flush region (waits its copy)."""
        assert self._ops is not None
        self._ops.to_host([(dst, src)], after if after is not None else DONE).synchronize()

    def _ensure_key(self, key: TensorName, rows: torch.Tensor) -> KeyViews:
        kv = self._keys.get(key)
        if kv is not None and kv.dtype is rows.dtype and kv.row_shape == rows.shape[1:]:
            return kv  # every step's case, in as few calls as can be (torch dtypes are singletons)
        row_shape = tuple(rows.shape[1:])
        width = row_width(row_shape)
        if kv is None:
            # The committer refuses a row shape other than the one the key was first opened with (by this
            # writer or one before it), so every pool row of the key has the shape its readers check for.
            try:
                dtype = dtype_name(rows.dtype)
            except ValueError as exc:  # a dtype the pool has no rows of (complex, say)
                raise self._unmatch(f"tensor {key!r}: {exc}", key=key, step_id=self._next_step) from exc
            try:
                reply = self._link.request(lambda rid: P.OpenKey(rid=rid, key=key, dtype=dtype, width=width,
                                                                 row_shape=row_shape))
            except OmniPrefixCacheCommitterError as exc:
                # The key's tensor and step named, as a mismatch this client sees itself is: a key an earlier
                # writer opened as another dtype or width is refused by the committer (review, 2026-12-07).
                raise unmatch(f"tensor {key!r} ({dtype}, rows of shape {row_shape}) could not be opened: {exc}",
                              key=key, step_id=self._next_step, cls=OmniPrefixCacheCommitterError) from exc
            try:
                kv = KeyViews.map(reply.segments, self.config.num_slots, readonly=not self.is_writer)
            except OSError as exc:  # unlinked after the answer (the committer stopped, or was swept)
                raise self._unmatch(f"tensor {key!r}: its segments were gone before this client mapped them "
                                    f"(its committer stopped?): {exc}", key=key, step_id=self._next_step) from exc
            if rows.is_cuda and kv.staging is not None:
                self._registrations.append(HostRegistration(kv.staging))
            self._publish_key(key, kv)
        if kv.dtype != rows.dtype or kv.width != width:
            raise self._unmatch(f"tensor {key!r} is {rows.dtype} width {width}, but the cache holds "
                                f"{kv.dtype} width {kv.width}", key=key, step_id=self._next_step)
        if kv.row_shape != row_shape:  # rows saved as one shape are never read back as another
            raise self._unmatch(f"tensor {key!r} has rows of shape {row_shape}, the cache holds rows of "
                                f"shape {kv.row_shape}", key=key, step_id=self._next_step)
        return kv

    def _make_absent(self, slots: np.ndarray) -> None:
        """Writer, engine thread: the rows at ``slots`` (pool slot ids) are absent in every key (a later read
        raises) and their token tags unknown. Copy-on-write is the caller's, before."""
        for kv in self._keys.values():
            kv.claim_np[slots] = 0
        if self._slot_tokens is not None:
            self._slot_tokens.forget(slots)

    def _store_claims(self, step_id: StepId, counts: list[int], slots: torch.Tensor, slot_list: list[int] | None,
                      slots_np: np.ndarray | None, immediate: dict, deferred: dict) -> list[int]:
        """Claim this step's slots in the claim tables; returns each write's claim version. Engine thread.

        Versions are seq 1..len(counts) of this step (``make_cv`` checks the largest one). Copy-on-write
        runs first. A key this step does not write has no row at these slots now: absent (0), so a later
        hit raises instead of reading the slots' previous tenant's rows of that key. A small step stores
        through ``slot_list`` and the memoryviews (plain Python), a large one through numpy.
        """
        last = make_cv(self._epoch, step_id, len(counts))
        cvs = list(range(last - len(counts) + 1, last + 1))
        self._rescue_before_claim(slots)
        absent = [kv for key, kv in self._keys.items() if key not in immediate and key not in deferred]
        if slot_list is not None:
            row_cv = [cv for cv, count in zip(cvs, counts) for _ in range(count)]
            for key in itertools.chain(immediate, deferred):
                claim = self._keys[key].claim_mv
                for slot, cv in zip(slot_list, row_cv):
                    claim[slot] = cv
            for kv in absent:
                for slot in slot_list:
                    kv.claim_mv[slot] = 0
        else:
            row_np = np.repeat(np.asarray(cvs, dtype=np.int64), counts)
            for key in itertools.chain(immediate, deferred):
                self._keys[key].claim_np[slots_np] = row_np
            for kv in absent:
                kv.claim_np[slots_np] = 0
        return cvs

    def _join_previous_write(self, deadline: float | None = None) -> None:
        """Wait for the previous step's write (``commit_timeout_s``, or until ``deadline``, monotonic: shutdown's
        one bound for everything it waits for); raises ``OmniPrefixCacheUnmatchError`` and turns the cache
        sticky-fatal when it is not acknowledged in time, was lost or failed."""
        fut = self._prev_write
        if fut is None:
            return
        timeout_s = self.config.commit_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            reply = self._await_step_write(fut, timeout_s)
        except TimeoutError as exc:
            raise self._set_fatal(f"previous step's writes not acknowledged within "
                                  f"{self.config.commit_timeout_s:.1f}s", step_id=fut.step) from exc
        except OmniPrefixCacheCommitterError as exc:
            raise self._set_fatal(f"previous step's writes were lost: {exc}", step_id=fut.step) from exc
        self._prev_write = None
        self._check_reply(reply)

    def _await_step_write(self, fut: Future, timeout_s: float) -> Any:
        """The outcome of a step's quiet ``StepWrite`` (``fut``: its ``step`` and ``marker``); any thread.

        A step applied in full gets no reply: the committer stores its marker
        ``make_cv(epoch, step, 0)`` in ``CTL_ACKED_STEP`` after the rows and
        their commit words, and this call settles the link's pending request
        with a ``StepDone`` (its done callbacks, which free the staging page,
        run here). A rejected or partly failed step is answered, and the reply
        completes ``fut`` as before. Steps are joined in order and a marker
        only grows, so a marker of this writer's epoch at or past this step's
        acknowledges it (``_acked_word``). Raises ``TimeoutError`` after
        ``timeout_s``, and what ``fut`` raises.
        """
        marker = fut.marker  # type: ignore[attr-defined]
        deadline = 0.0  # read the clock only when the usual case (acknowledged already) did not happen
        poll = _ACK_POLL_S
        woke = False
        while True:
            if marker <= self._acked_word():
                done = self._settle_quiet(fut)
                if done is not None:
                    return done
            if fut.done():  # a reply or a failure; or settled by another thread
                return fut.result()
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout_s
            elif now >= deadline:
                raise TimeoutError(f"cache {self.cache}: step {fut.step} not acknowledged within "  # type: ignore
                                   f"{timeout_s:.1f}s")
            elif not woke and getattr(fut, "rid", None) is not None:
                # Still no marker after a poll, and the step was sent: its quiet send may have taken the
                # ZMQ_FD edge of a reply, so a rejection would wait for the I/O thread's tick. Once is
                # enough: no quiet send of this writer comes between this check and the step's reply.
                woke = True
                self._link.wake_if_replied()
            time.sleep(min(poll, deadline - now))
            poll = min(2 * poll, _ACK_POLL_MAX_S)  # a long wait (a committer restarting) must not spin

    def _settle_if_acked(self) -> None:
        """Engine thread, from ``new_step_starts``: settle the previous step if its marker is there.

        Never waits (the join in ``save_outputs`` does). Settling frees the step's staging page
        and row sources; here, before the forward, it runs in warm caches (measured 24 us against
        55 us in the join right after a forward, benchmarks/README.md figure 6).
        """
        fut = self._prev_write
        if fut is None or fut.marker > self._acked_word():  # type: ignore[attr-defined]
            return
        done = self._settle_quiet(fut)
        if done is not None:  # else a reply or a failure completes it, and the join sees that
            self._prev_write = None
            self._check_reply(done)

    def _acked_word(self) -> int:
        """``CTL_ACKED_STEP`` when it holds a marker of this writer's epoch, else 0; any thread.

        The one acknowledgement test: a step with ``marker <= _acked_word()`` was applied in full.
        A marker of a later epoch is another writer's (this one was reaped while frozen, say): it
        acknowledges none of this writer's steps.
        """
        word = self._ctl_mv[P.CTL_ACKED_STEP]
        return word if cv_epoch(word) == self._epoch else 0

    def _settle_quiet(self, fut: Future) -> P.StepDone | None:
        """Complete an acknowledged quiet step with the ``StepDone`` it stands for, which is returned;
        None when it is not sent yet or someone else completes it (a reply, a failure)."""
        rid = getattr(fut, "rid", None)  # a CUDA step has one once the sender thread sent it
        if rid is None:
            return None
        done = P.StepDone(rid=rid, step=fut.step, done_tids=b"")  # type: ignore[attr-defined]
        return done if self._link.settle(rid, done) else None

    def _check_reply(self, reply: Any) -> None:
        """A write's reply: a ``StepDone`` without a ``failure``, else the sticky error."""
        if isinstance(reply, P.StepDone) and not reply.failure():
            return
        reason = reply.reason if isinstance(reply, P.StepDone) else repr(reply)
        raise self._set_fatal(f"write of step {getattr(reply, 'step', '?')} failed: {reason}",
                              step_id=getattr(reply, "step", None))

    def _send_step(self, ctx: StepCtx, cvs: list[int], starts: list[int], counts: list[int],
                   slots: bytes, immediate: dict) -> None:
        """Send the step's one ``StepWrite`` (all immediate keys). Engine thread.

        Entries list each key's writes in batch order, so every packed field is
        the step's per-write values once per key (and ``slots``, the step's
        packed slots, once per key): each is packed once and repeated as bytes,
        with no per-entry Python objects.
        """
        keys = list(immediate)
        assert self._pages is not None and ctx.page is not None
        row0 = ctx.page * self._pages.capacity
        nw = len(cvs)
        if not keys or not nw:
            self._pages.release(ctx.page, "write")
            self._drop_sources(ctx)
            return
        nk = len(keys)
        per_write = _WRITE_STRUCTS.get(nw)
        if per_write is None:
            per_write = _WRITE_STRUCTS.setdefault(nw, struct.Struct(f"<{nw}q"))
        key_idx = b"".join(_ONE_I64.pack(ki) * nw for ki in range(nk))
        tids = per_write.pack(*itertools.islice(self._tids, nw)) * nk
        e_cvs = per_write.pack(*cvs) * nk
        src = per_write.pack(*[row0 + s for s in starts]) * nk
        e_counts = per_write.pack(*counts) * nk
        all_slots = slots * nk
        step_id = ctx.step_id
        page = ctx.page
        marker = make_cv(self._epoch, step_id, 0)
        def make(rid: int) -> P.StepWrite:
            return P.StepWrite(rid=rid, step=step_id, keys=keys, key_idx=key_idx, tids=tids, cvs=e_cvs,
                               src_rows=src, counts=e_counts, slots=all_slots, quiet=True)

        try:
            if ctx.d2h_event is DONE:
                fut = self._link.submit(make, ack_marker=marker)  # the copy already landed (CPU): no thread hop
            else:
                # Sent once the step's copy event completed (only then may the committer read the page):
                # by materialize, which waits that event anyway, or else by the sender thread.
                ctx.pending_send = self._sender.submit(ctx.d2h_event, make, marker)
                fut = ctx.pending_send.outer
        except BaseException as exc:  # nothing was sent: the page is free, the step's claims will never land
            err = self._set_fatal(f"write of step {ctx.step_id} could not be sent: {str(exc) or type(exc).__name__}",
                                  step_id=ctx.step_id)
            # The caller never gets the step id: the step's context, its page holds and its pins go now.
            self._abandon_step(ctx)
            if not isinstance(exc, Exception):
                raise  # a signal handler's KeyboardInterrupt or SystemExit stays what it is: the caller stops
            raise err from exc

        def done(f: Future) -> None:
            self._drop_sources(ctx)
            assert self._pages is not None
            self._pages.release(page, "write")
            try:
                self._check_reply(f.result())
            except Exception as exc:  # recorded as the sticky fatal error
                self._set_fatal(f"write of step {ctx.step_id} failed: {exc}", step_id=ctx.step_id)

        fut.add_done_callback(done)
        fut.step = step_id  # type: ignore[attr-defined]  # set before it is published: wait_idle reads them
        fut.marker = marker  # type: ignore[attr-defined]
        self._prev_write = fut

    def _drop_sources(self, ctx: StepCtx) -> None:
        with self._lock:
            for key, src in ctx.sources.items():
                src.alive = False
                self._step_sources.pop((key, ctx.step_id), None)

    def _rescue_before_claim(self, slots: torch.Tensor) -> None:
        """Copy-on-write: keep rows a pending read planned before their slots change tenant.

        ``_pinned`` holds only unconsumed steps with hits, so a step with no
        pending hit read returns at once. A slot rescued at an earlier change of
        tenant is left out: its claim moved on, so resolving it again would fail
        and take every other slot of the batch down with it.
        """
        if not self._pinned or not bool((self._pin_count[slots] > 0).any()):
            return
        with self._lock:
            pinned = list(self._pinned.values())
        hot = slots[self._pin_count[slots] > 0]
        deadline = self._deadline()
        for ctx in pinned:
            for req, span in ctx.hits.items():
                inter = torch.isin(span.slots, hot)
                if not bool(inter.any()):
                    continue
                for key, planned in span.cvs.items():
                    want = span.slots[inter]
                    cvs = planned[inter]
                    keep = cvs != 0
                    kept = ctx.rescue.get(key)  # only this (engine) thread adds to it
                    if kept:
                        keep &= torch.tensor([s not in kept for s in want.tolist()], dtype=torch.bool)
                    want, cvs = want[keep], cvs[keep]
                    if len(want) == 0:
                        continue
                    out = self._keys[key].rows_out(len(want))
                    try:
                        self._resolve_rows(self._keys[key], want, cvs, out, None, key, req, ctx.step_id, deadline)
                    except OmniPrefixCacheUnmatchError:
                        continue  # nothing valid to keep; the read will raise
                    with self._lock:
                        store = ctx.rescue.setdefault(key, {})
                        for i, s in enumerate(want.tolist()):
                            store[s] = out[i]
                    self.counters["cow_rescues"] += len(want)

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every closed write was acknowledged (tests, demos, shutdown).

        Open deferred writes stay open: they land when their request ends.
        Any thread but the engine thread's hot path; raises on a failed write
        (at once when one already made the cache sticky-fatal: its writes may never be acknowledged),
        and ``TimeoutError`` when ``timeout_s`` (default ``commit_timeout_s``) passes first.
        """
        try:
            self._wait_idle(timeout_s)
        except BaseException as exc:
            self._note_interrupt("wait_idle", exc)  # it may have cut a settle short
            raise

    def _wait_idle(self, timeout_s: float | None) -> None:
        self._check_usable()
        timeout_s = self.config.commit_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._lock:
            closed = list(self._closing.values())
        for t in closed:
            try:
                t.done.result(timeout=max(deadline - time.monotonic(), 0.001))
            except FutureTimeout:  # the builtin TimeoutError, on Python 3.10 too
                raise TimeoutError(f"cache {self.cache}: deferred write {t.tid} of request {t.req_id!r} tensor "
                                   f"{t.key!r} not acknowledged within {timeout_s:.1f}s") from None
        prev = self._prev_write
        if prev is not None:
            # The outcome itself: the done callback that records a failure may not have run yet.
            self._check_reply(self._await_step_write(prev, max(deadline - time.monotonic(), 0.001)))
        self._check_usable()
