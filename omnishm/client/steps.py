"""Step contexts: what ``save_outputs`` snapshots for ``materialize``, and their life.

A ``StepCtx`` lives from the save that created its step id until that id is
consumed; while it lives it pins its hit slots (copy-on-write rescue keeps
the planned rows if the writer re-claims them) and, on the writer, holds its
staging page. Owned by the manager; mutated under the manager's state lock.
``StepLifecycle`` (a mixin of the manager, no state of its own) checks a
save's write layout and its slots alike on every rank before the id is issued
(``_check_layout``, ``_check_slots``), checks the hits a save takes against their tokens on the writer
(``_check_hit_tokens``), consumes the id of a refused save (``_burn_step``) after the writer made its slots
absent (``_forget_refused``),
consumes a step id exactly once (``_take_ctx``),
releases what its context holds (``_release_ctx``), and undoes a save that
failed after it issued the id (``_abandon_step``).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from omnishm import protocol as P
from omnishm.client.writes import RowSource
from omnishm.interface import ReqId, StepId, TensorName
from omnishm.versions import make_cv

logger = logging.getLogger("omnishm.client.manager")  # the manager's one logger, as writer.py's


def as_step_id(step_id: Any, what: str) -> StepId:
    """``step_id`` as an int: a numpy int or a 0-d integer tensor is one. A bool, a float or anything else is
    a ``TypeError``: a bool or a float consumed the step it equals, a tensor was "never saved" and its step
    stayed unconsumed (review, 2026-12-07)."""
    if type(step_id) is int:
        return step_id
    try:
        if isinstance(step_id, bool):
            raise TypeError
        return operator.index(step_id)
    except TypeError:
        raise TypeError(f"{what}: a step id is the int save_outputs returned, got {step_id!r}") from None


def request_ids(req_ids: Iterable[ReqId]) -> Iterable[ReqId]:
    """``req_ids``, refused (``TypeError``) when it is one string: ``list("req-1")`` is five one-letter ids
    (review, 2026-12-07)."""
    if isinstance(req_ids, (str, bytes)):
        raise TypeError(f"materialize takes a collection of request ids, got the string {req_ids!r} "
                        f"(write [{req_ids!r}])")
    return req_ids


class PendingHit(NamedTuple):
    """A prefix hit ``new_step_starts`` registered, until the request's save takes it."""

    slots: torch.Tensor
    tags: np.ndarray | None = None
    """Writer: the tags the hit's rows must have (``tokens.hit_token_tags``); None: not checked."""


@dataclass
class HitSpan:
    """One request's prefix hit: its slots and, per key, the claim versions it must read."""

    slots: torch.Tensor
    cvs: dict[TensorName, torch.Tensor]
    refused: str | None = None
    """Writer: why the hit's rows are not the request's (``_check_hit_tokens``); its read raises with it."""


@dataclass
class StepCtx:
    step_id: StepId
    req_ids: tuple[ReqId, ...]
    spans: dict[ReqId, tuple[int, int]]
    leftover: dict[TensorName, Any]
    step_rows: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    row_shapes: dict[TensorName, tuple[int, ...]] = field(default_factory=dict)
    hits: dict[ReqId, HitSpan] = field(default_factory=dict)
    """Hit requests; a step with hits is in the manager's ``_pinned`` until consumed."""
    rescue: dict[TensorName, dict[int, torch.Tensor]] = field(default_factory=dict)
    sources: dict[TensorName, RowSource] = field(default_factory=dict)
    """Writer: the step source of each immediate key (also in the manager's ``_step_sources``)."""
    page: int | None = None
    freeze_event: Any = None
    d2h_event: Any = None
    pending_send: Any = None
    """CUDA writer: the step's ``PendingSend`` (``client/device.py``); materialize sends it if still unsent."""
    leftover_events: list[Any] = field(default_factory=list)
    prefetched: dict[tuple[ReqId, TensorName], torch.Tensor] = field(default_factory=dict)
    abandoned: bool = False
    """``_abandon_step`` ran (it runs at most once)."""
    prefetch_taken: threading.Lock | None = None
    """Reader: taken once, by whoever comes to the step first: the prefetch thread (it reads the hit rows)
    or ``_take_ctx`` (the step was consumed while the prefetch thread was still busy with earlier steps:
    it skips the step, and ``prefetch_lock`` is dropped: nothing of the step will be prefetched)."""
    prefetch_claims: dict[ReqId, threading.Event | None] = field(default_factory=dict)
    """Reader, under ``prefetch_lock``: who reads each hit request's rows, claimed by whoever comes to it first.
    The prefetch thread's claim is an Event it sets once the request is done (its rows in ``prefetched``, or
    failed); materialize's is None, and the prefetch thread then skips the request. So a materialize waits
    for the prefetch of the requests it asked for only, never for another request's rows in transit (review,
    2026-12-06: ``materialize(["x"])`` waited out b's held rows, 2.8 s)."""
    prefetch_lock: threading.Lock | None = None
    """Reader: set while the prefetch thread may still read the step (None: it never will)."""


def hits_digest(hits: Mapping[ReqId, HitSpan], block_size: int) -> int:
    """A step's hit plan as one int64: each hit request's id, hit length and blocks, in request-id order (so that
    ranks whose batches list the same requests in another order agree). A hit's slots are whole blocks
    (``new_step_starts``), so its first slot of each block names them all: the 2048 of a 32k-token hit hash
    in about 24 us, all 32768 slots took 290. Equal on every rank given the same scheduler output; 64 bits of
    blake2b, so two plans that differ agree by chance once in 2**64."""
    h = hashlib.blake2b(digest_size=8)
    for req in sorted(hits):
        slots = hits[req].slots
        name = req.encode("utf-8", "surrogatepass")
        # Every field with its length first: an id may hold any byte, and one id must never read as another
        # plan's id, length and blocks (review, 2026-12-06: "a\0..." made two plans hash alike).
        h.update(len(name).to_bytes(8, "little") + name + len(slots).to_bytes(8, "little"))
        h.update(slots[::block_size].numpy().astype("<i8").tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


_SLOT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _same_hits(tags: list[np.ndarray], slots: list[np.ndarray]) -> list[int]:
    """For each hit, the first hit with the same tags array (one object: ``tokens.hits_token_tags`` shares it
    among hits of one prefix) on the same slots; itself when none. A few candidates a tags array at most:
    hits of one prefix on other blocks (vLLM holds one copy of a block) are compared each."""
    firsts: dict[int, list[int]] = {}
    out: list[int] = []
    for i, (t, s) in enumerate(zip(tags, slots)):
        seen = firsts.setdefault(id(t), [])
        same = next((j for j in seen if np.array_equal(slots[j], s)), None)
        if same is None:
            if len(seen) < 4:
                seen.append(i)
            same = i
        out.append(same)
    return out


_SMALL_STEP = 256
"""Steps of at most this many tokens do their slot bookkeeping in plain Python (``_check_slots``)."""


class StepLifecycle:
    """Checking a save's layout; taking, releasing and abandoning step contexts (mixin; all state lives in the
    manager)."""

    def _check_layout(self, write_layout: Any, n: int, padded: int, step_id: StepId) -> list[Any]:
        """``save_outputs``' checks of its write layout; engine thread, no lock. Returns the writes with rows.

        Made alike on every rank, writer and readers, before a step id is issued: a layout one rank
        refused and another took would leave their step ids apart, and a reader would then read a
        later step's claims as its own. Raises ``TypeError`` for slots that are not a 1-D integer
        tensor, ``OmniPrefixCacheUnmatchError`` for a layout that disagrees with the token counts
        or with itself: a negative count, a request twice, writes not contiguous from row 0 in batch
        order (claim versions follow the writes' order, rows their ``token_start``). Token tags that
        are not None, one int64 per row or two per row (tag and chain) are a ``TypeError``.
        """
        if not (hasattr(write_layout, "slots") and hasattr(write_layout, "writes")):
            raise TypeError(f"write_layout must be a PrefixCacheWriteLayout (writes and slots), got "
                            f"{type(write_layout).__name__}; a refused save whose slots cannot be read clears "
                            f"every slot of the cache (logged)")
        slots = write_layout.slots
        if not isinstance(slots, torch.Tensor) or slots.dtype not in _SLOT_DTYPES or slots.dim() != 1 \
                or slots.layout is not torch.strided or slots.is_meta:
            got = (f"{slots.dtype} of shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor)
                   else type(slots).__name__)
            raise TypeError(f"write_layout.slots must be a dense 1-D integer tensor, got {got}")
        if padded < n or slots.numel() != n:
            raise self._unmatch(f"token accounting: unpadded={n}, padded={padded}, layout rows={slots.numel()}",
                                step_id=step_id)
        tags = getattr(write_layout, "token_tags", None)
        if tags is not None and not (isinstance(tags, np.ndarray) and tags.dtype == np.int64
                                     and tags.shape in ((n,), (n, 2))):
            got = (f"{tags.dtype} of shape {tags.shape}" if isinstance(tags, np.ndarray) else type(tags).__name__)
            raise TypeError(f"write_layout.token_tags must be None or an int64 numpy array of one tag per row "
                            f"({n},) or one tag and chain per row ({n}, 2), got {got}")
        writes = []
        seen: set[ReqId] = set()
        row = 0
        for w in write_layout.writes:
            if w.num_tokens < 0 or w.req_id in seen:
                why = "a negative token count" if w.num_tokens < 0 else "a second write"
                raise self._unmatch(f"write layout: {why} for request {w.req_id!r}", req_id=w.req_id,
                                    step_id=step_id)
            seen.add(w.req_id)
            if w.num_tokens:
                if w.token_start != row:
                    raise self._unmatch(f"write layout: request {w.req_id!r} starts at row {w.token_start}, "
                                        f"expected {row} (writes must be contiguous from row 0, in batch order)",
                                        req_id=w.req_id, step_id=step_id)
                row += w.num_tokens
                writes.append(w)
        if row != n:
            raise self._unmatch(f"write layout: writes cover {row} rows, slots {n} "
                                "(writes must be contiguous from row 0)", step_id=step_id)
        return writes

    def _bad_hit(self, ev: Any) -> str:
        """Why the prefix hit of ``ev`` cannot be served (not block aligned, too few block ids, a block
        outside the pool), or ""."""
        hit, bs = ev.num_computed_tokens, self.config.block_size
        if hit % bs:
            return f"prefix hit of {hit} tokens is not a multiple of block_size {bs} (sub-block prefix match is " \
                   "not supported)"
        nblocks = hit // bs
        if len(ev.block_ids) < nblocks:
            return f"prefix hit of {hit} tokens carries {len(ev.block_ids)} block ids, needs {nblocks}"
        bad = [b for b in ev.block_ids[:nblocks] if not 0 <= b < self.config.num_blocks]
        if bad:
            return f"prefix hit names block id {bad[0]} outside 0..{self.config.num_blocks - 1}"
        return ""

    def _check_hit_tokens(self, writes: Sequence[Any], step_id: StepId) -> dict[ReqId, str]:
        """Writer, engine thread, in a save after its claims and tags are stored: the hits this save takes
        whose rows were computed for other tokens (``client/tokens.py``), with why. Their wrong slots become
        absent (copy-on-write first, as for a refused save's), so a reader's read of them raises too. No lock:
        the tag table and the claim tables are the engine thread's. All the step's hits are compared in one
        pass (256 hits compared one by one took 0.95 ms: review, stop 55)."""
        tokens = self._slot_tokens
        checked = [(w.req_id, hit) for w in writes
                   if (hit := self._pending_hits.get(w.req_id)) is not None and hit.tags is not None]
        if tokens is None or not checked:
            return {}
        slots = [hit.slots.numpy()[:len(hit.tags)] for _, hit in checked]
        # Hits of one shared prefix on the same blocks (requests admitted together on one system prompt) share
        # their tags (tokens.hits_token_tags) and are compared once: 64 hits on a 4k-token prefix compared one
        # after the other took 2.9 ms (real-engine review, stop 56).
        rep = _same_hits([hit.tags for _, hit in checked], slots)
        unique = sorted(set(rep))
        at = {u: k for k, u in enumerate(unique)}
        lens = [len(slots[u]) for u in unique]
        flat = np.concatenate([slots[u] for u in unique])
        counts, bad = tokens.check_runs(flat, np.concatenate([checked[u][1].tags for u in unique]), lens)
        self.counters["token_checked_rows"] += sum(counts[at[r]] for r in rep)
        if not len(bad):
            return {}
        ends = np.cumsum(lens)
        owner = np.searchsorted(ends, bad, side="right")  # the unique hit each wrong row belongs to
        wrong_rows = {k: bad[owner == k] - (ends[k] - lens[k]) for k in np.unique(owner).tolist()}
        refused: dict[ReqId, str] = {}
        for i, (req, hit) in enumerate(checked):
            mine = wrong_rows.get(at[rep[i]])
            if mine is None:
                continue
            first = int(mine[0])
            slot = int(slots[i][first])
            how = (" (the same token there, after other earlier tokens)"
                   if tokens.chain_only(slot, hit.tags[first]) else "")  # (before the slots are forgotten)
            refused[req] = (
                f"prefix hit of {len(hit.slots)} tokens: {len(mine)} of its rows were computed for other tokens "
                f"(first at position {first}, slot {slot}{how}): vLLM hit blocks it never computed "
                f"for this prompt; those slots are now absent")
            self.counters["token_mismatches"] += len(mine)
        wrong = flat[bad]
        self._rescue_before_claim(torch.from_numpy(wrong))
        self._make_absent(wrong)
        for req, why in refused.items():
            logger.warning("cache %s: step %s, request %r: %s", self.cache, step_id, req, why)
        return refused

    def _check_slots(self, slots: torch.Tensor, n: int, step_id: StepId
                     ) -> tuple[torch.Tensor, list[int] | None, np.ndarray | None]:
        """The layout's slots (``_check_layout`` checked their type and count), checked alike on every
        rank; engine thread. Returns them as an int64 CPU tensor, with a list of them for a small step
        (a copy) or a numpy view for a large one. A large step's tensor is always a copy; a small step's
        may be the caller's own, which vLLM rewrites step after step: what outlives the call keeps the
        list or a copy (``_register_writes_locked``; a copy costs about 50 us right after a forward).

        Raises ``OmniPrefixCacheUnmatchError`` for a slot outside the pool or named twice: which of
        two rows a slot named twice would hold is not defined (the step's row source, the committer's
        run copy and its scatter would each take a different one), and vLLM writes each slot at most
        once a step.
        """
        if slots.dtype is not torch.int64 or slots.device.type != "cpu":
            slots = slots.to(device="cpu", dtype=torch.int64)  # a copy
        elif n > _SMALL_STEP:
            slots = slots.clone()
        # Slot bookkeeping of a small step runs in plain Python (a list, a memoryview of the claim
        # table, struct packing): right after a forward every numpy or torch call on tiny arrays
        # costs tens of microseconds of cold code. A large step uses numpy (vectorised).
        slot_list: list[int] | None = slots.tolist() if n <= _SMALL_STEP else None
        slots_np = slots.numpy() if slot_list is None else None
        if not n:
            return slots, slot_list, slots_np
        if slot_list is not None:
            lo, hi = min(slot_list), max(slot_list)
            twice = len(set(slot_list)) != n
        else:
            lo, hi = int(slots_np.min()), int(slots_np.max())
            ordered = np.sort(slots_np)
            twice = bool((ordered[1:] == ordered[:-1]).any())
        if lo < 0 or hi >= self.config.num_slots:
            raise self._unmatch(f"write layout has slots outside [0, {self.config.num_slots}) "
                                f"(min {lo}, max {hi})", step_id=step_id)
        if twice:
            raise self._unmatch("write layout names a slot twice (vLLM writes each KV slot at most once a step)",
                                step_id=step_id)
        return slots, slot_list, slots_np

    def _forget_refused(self, write_layout: Any) -> None:
        """Writer, engine thread: the slots of a refused save become absent in every key.

        vLLM's KV cache holds the refused step's tokens all the same, and a later hit on them must raise
        ("absent"), not serve the rows of their previous tenant, whose claims still hold. Copy-on-write
        first keeps the rows that planned reads need. Every slot id the layout names is cleared, also past
        its row count: a slot cleared needlessly costs a later hit a refusal, one left out a wrong row.
        Slot ids outside the pool are skipped; slots that cannot be read as slot ids (no tensor of numbers,
        not whole numbers, on the meta device, sparse) clear every slot. The slots are cleared also on a
        fatal cache and when the rescue failed (the cache then turns sticky-fatal): its readers may still
        read the refused step. Raises only when the
        slots could not be cleared (or on an interrupt); the caller must then not publish the step.
        """
        try:
            slots = torch.as_tensor(getattr(write_layout, "slots", None))
            if slots.dtype is torch.bool or slots.is_complex():
                raise TypeError(f"slots of {slots.dtype}")
            slots = slots.reshape(-1).to("cpu")
            if slots.is_floating_point() and not bool((slots == slots.round()).all()):
                raise TypeError("slots that are not whole numbers")
            slots = slots.to(torch.int64)
            # A slot id outside the pool (vLLM's padding slot -1, a KV cache grown past the pool) holds no
            # row of the pool: nothing to clear there.
            slots = slots[(slots >= 0) & (slots < self.config.num_slots)]
        except Exception as exc:  # noqa: BLE001 - unreadable slots: every slot is cleared instead
            # They say nothing of where vLLM put this step's tokens, and whichever slots those are still
            # hold their previous tenant's claims: a later hit there served that tenant's rows (a layout on
            # the meta device or sparse; review, 2026-12-07). The whole cache's rows become absent.
            logger.warning("cache %s: a refused save's slots could not be read (%r); every slot is cleared, so "
                           "no later hit can read rows vLLM has given to another request", self.cache, exc)
            slots = torch.arange(self.config.num_slots, dtype=torch.int64)
        if not len(slots) or not self._keys:
            return
        try:
            if self._fatal is None:  # a fatal cache serves no later read of its own: nothing to keep
                self._rescue_before_claim(slots)
        except Exception as exc:  # noqa: BLE001 - the refusal is what the caller hears; the cache is fatal
            self._set_fatal(f"copy-on-write before clearing a refused save's slots failed: {exc!r}")
        finally:
            # Also when the rescue failed or the cache is fatal: its readers may still read the refused
            # step, and an absent slot only ever makes a read raise.
            try:
                self._make_absent(slots.numpy())
            except BaseException as exc:
                self._set_fatal(f"the slots of a refused save could not be made absent: {exc!r}")
                raise

    def _burn_step(self, step_id: StepId, write_layout: Any) -> None:
        """Consume ``step_id`` unsaved: ``save_outputs`` refused it before issuing it. Engine thread.

        A refusal may be this rank's alone (a key only the writer can refuse, a staging timeout, an
        interrupt in a wait) while the other ranks took the same save and issued ``step_id``. Taking it
        on every rank, whatever refused it, with the planned hits of its requests that their save took,
        keeps the ranks counting alike: a reader whose ids ran ahead of or behind its writer's would read
        another step's claims as its own step's. The writer first makes the layout's slots absent
        (``_forget_refused``, also on a fatal cache), then publishes the step so that its readers' waits
        for it end at once; not when the slots could not be cleared (its readers then wait out their
        bound and raise, rather than read the slots' previous tenant for a same-step hit). The hits its
        readers take are checked against their tokens first (``_check_hit_tokens``).
        """
        cleared = not self.is_writer
        try:
            # What a save takes (a 0-token request's hit waits for its next).
            writes = [w for w in write_layout.writes if w.num_tokens > 0 and isinstance(w.req_id, str)]
        except Exception:  # noqa: BLE001 - a layout refused as malformed names no request reliably
            writes = []
        try:
            if self.is_writer:
                self._forget_refused(write_layout)
                # The readers' save takes this step's hits: they are checked as a save's are, or a wrong one
                # would be served there (review, stop 55; the refusal is the readers' to raise, as absent rows).
                # The layout's own slots are unknown by now.
                if self._pending_hits:
                    self._check_hit_tokens(writes, step_id)
                cleared = True
        finally:
            taken: dict[ReqId, HitSpan] = {}
            with self._lock:
                for w in writes:
                    hit = self._pending_hits.pop(w.req_id, None)
                    if hit is not None:
                        taken[w.req_id] = HitSpan(slots=hit.slots, cvs={})
                        self._hits_taken[w.req_id] = step_id
                self._mark_consumed_locked(step_id)
            self._next_step += 1
            if self.is_writer and cleared:
                # The hits the readers' save took are this step's plan: a refusal on the writer alone is not the
                # ranks disagreeing (review, 2026-12-06: readers refused such hits as "planned no hit").
                self._record_plan(step_id, taken)
                self._ctl_mv[P.CTL_PUBLISHED_STEP] = make_cv(self._epoch, step_id, 0)

    def _record_plan(self, step_id: StepId, hits: Mapping[ReqId, HitSpan]) -> None:
        """Writer, engine thread, before it publishes ``step_id``: record the step's hit plan for its readers'
        check (``P.CTL_HITS_RING``); nothing for a step without hits."""
        if not hits:
            return
        at = 2 * (step_id % P.CTL_HITS_RING)
        self._hits_ring[at] = -1  # a reader that loads the entry meanwhile sees it is being written
        self._hits_ring[at + 1] = hits_digest(hits, self.config.block_size)
        self._hits_ring[at] = make_cv(self._epoch, step_id, 0)

    def _wait_step_events(self, ctx: StepCtx) -> None:
        """materialize waits only the events of the step it reads, then sends the step if still unsent."""
        if ctx.d2h_event is not None:
            ctx.d2h_event.synchronize()
            if ctx.pending_send is not None and self._sender is not None:
                self._sender.send_now(ctx.pending_send)
        for event in ctx.leftover_events:
            event.synchronize()

    def _prefetched_requests(self, ctx: StepCtx, req_ids: list[ReqId], deadline: float) -> set[ReqId]:
        """Reader: the requests of ``req_ids`` whose result the prefetch made for every key (hit rows in place,
        room for the step's rows after them), waiting for it as ``_take_prefetched`` does. Materialize fills
        and returns those: the hit is copied once, not into the prefetch's buffer and again into the result."""
        if ctx.prefetch_lock is None or not any(r in ctx.hits for r in req_ids):
            return set()  # never wait for other requests' hits (review: a call without hits waited them out)
        ready = set()
        for r in req_ids:
            done = self._prefetch_claim(ctx, r) if r in ctx.hits else None
            if done is not None:
                done.wait(max(0.0, deadline - time.monotonic()))
                if all((r, k) in ctx.prefetched for k in ctx.step_rows):
                    ready.add(r)
        return ready

    @staticmethod
    def _prefetch_claim(ctx: StepCtx, req: ReqId) -> threading.Event | None:
        """Reader, materialize's thread: the prefetch thread's Event for hit request ``req`` (set once it is
        done), or None when materialize reads ``req`` itself: claimed here first, the prefetch skips it."""
        assert ctx.prefetch_lock is not None
        with ctx.prefetch_lock:
            if req not in ctx.prefetch_claims:
                ctx.prefetch_claims[req] = None
            return ctx.prefetch_claims[req]

    def _take_prefetched(self, ctx: StepCtx, req: ReqId, key: TensorName, deadline: float) -> torch.Tensor | None:
        """The result the prefetch thread made for ``req``/``key`` (``(hit + step rows, width)``, the hit's rows
        in place), waiting for it until ``deadline`` (monotonic) once it has started this step; None when it
        has none (it failed, is still waiting, or has not started this step, being busy with earlier ones:
        materialize then reads itself, never waiting on those)."""
        if ctx.prefetch_lock is None:
            if ctx.prefetch_taken is not None:  # a prefetch the consumed step got ahead of (``_take_ctx``)
                self.counters["prefetch_dropped"] += 1
            return None
        done = self._prefetch_claim(ctx, req)
        if done is not None:
            done.wait(max(0.0, deadline - time.monotonic()))
        rows = ctx.prefetched.pop((req, key), None)
        self.counters["prefetch_used" if rows is not None else "prefetch_dropped"] += 1
        return rows

    def _check_requests(self, ctx: StepCtx, req_ids: list[ReqId]) -> None:
        outside = [r for r in req_ids if r not in ctx.spans]
        if outside:
            raise self._unmatch(f"materialize asked for requests {outside} that were not in the save-time "
                                f"batch {list(ctx.req_ids)} (reading the live batch?)", step_id=ctx.step_id,
                                req_id=outside[0] if len(outside) == 1 else None)

    def _mark_consumed_locked(self, step_id: StepId) -> None:
        """Record ``step_id`` as consumed (under ``_lock``), so a later call with it says "already consumed",
        not "never saved". Only recent ids are kept: past 4096, those more than 2048 behind this one go. Every
        way a step is consumed comes here: a refused save burned ids that only a read pruned, and a caller
        going on through refusals grew the set by one id a step (review, 2026-12-07)."""
        self._consumed.add(step_id)
        if len(self._consumed) > 4096:
            self._consumed = {s for s in self._consumed if s > step_id - 2048}

    def _take_ctx(self, step_id: StepId, what: str, req_ids: list[ReqId] | None = None,
                  out: Mapping[ReqId, Mapping[TensorName, torch.Tensor]] | None = None) -> StepCtx:
        """Consume ``step_id`` (exactly once). With ``req_ids`` (and ``out``), refuse requests outside
        its batch (and wrong buffers) first: a caller bug caught before any work leaves the step id
        unconsumed."""
        with self._lock:
            ctx = self._ctxs.get(step_id) if req_ids is not None else None
            if ctx is not None:
                self._check_requests(ctx, req_ids)
                if out is not None:
                    self._check_out_buffers(ctx, req_ids, out)
            ctx = self._ctxs.pop(step_id, None)
            if ctx is None:
                reason = "was already consumed" if step_id in self._consumed else "was never saved"
                raise self._unmatch(f"{what}: step id {step_id} {reason} (each step id is consumed exactly once)",
                                    step_id=step_id)
            self._mark_consumed_locked(step_id)
        if ctx.prefetch_taken is not None and ctx.prefetch_taken.acquire(blocking=False):
            ctx.prefetch_lock = None  # its prefetch never started and now never will: nothing to wait for
        return ctx

    def _release_ctx(self, ctx: StepCtx) -> None:
        try:
            if ctx.hits:  # only steps with hits are pinned (set before the step id was handed out)
                with self._lock:
                    self._unpin_locked(ctx)
        finally:  # a consumed step's page is free whatever happened
            if ctx.page is not None and self._pages is not None:
                self._pages.release(ctx.page, "ctx")

    def _staging_gauges(self) -> dict[str, float]:
        """The staging counters as they are now; the link's I/O thread, for each heartbeat and the goodbye.

        Read there, not at each save, so that a gauge does not keep a step's page after it was consumed.
        Plain int reads, no lock: one value may be a moment older than the other."""
        if self._pages is None:
            return {}
        gauges = {"staging_waits": float(self._pages.waits), "staging_pages_in_use": float(self._pages.in_use())}
        self.counters.update(gauges)  # the manager's own counters show them as of the last heartbeat
        return gauges

    def _unpin_locked(self, ctx: StepCtx) -> None:
        """State lock held: the step's hit slots are no longer planned reads (copy-on-write stops
        watching them). At most once per step: only the step that ``_pinned`` still holds unpins."""
        if self._pinned.pop(ctx.step_id, None) is not None:
            for span in ctx.hits.values():
                self._pin_count[span.slots] -= 1

    def _abandon_step(self, ctx: StepCtx) -> None:
        """``save_outputs`` failed after it issued ``ctx.step_id``; engine thread, the caller re-raises.

        Frees the step's staging page. On the writer the cache turns sticky-fatal:
        the step's claim-table stores may be half done and its rows will never
        land, so a later hit on those slots must raise at once, not wait out
        ``commit_timeout_s``. A reader only loses this step. At most once per step; later calls return.
        """
        if ctx.abandoned:
            return
        ctx.abandoned = True
        if self.is_writer:
            self._drop_sources(ctx)
            self._set_fatal(f"save_outputs of step {ctx.step_id} failed after the step id was issued",
                            step_id=ctx.step_id)
        with self._lock:  # an asynchronous exception may come after the step was registered
            self._ctxs.pop(ctx.step_id, None)
            self._mark_consumed_locked(ctx.step_id)  # a later materialize of the id says it is gone
            self._unpin_locked(ctx)
        if ctx.page is not None and self._pages is not None:
            for hold in ("ctx", "write"):  # each at most once; a hold already released is skipped
                self._pages.release(ctx.page, hold)
            ctx.page = None
