"""Omni prefix cache, manager side: the seed's contract over a committer.

One ``OmniPrefixCacheManager`` per runner process (per TP rank). The writer
(the engine's output rank) claims slots, stages the step's rows in its
staging page and sends one ``StepWrite`` per step; the committer copies them
into the shared pool. Readers run the same API and only read the pool.

Threads and locks
- Engine thread: ``new_step_starts``, ``save_outputs`` (exactly once per real
  step, in that order). Only this thread writes the claim table.
- Any thread: ``materialize``, ``discard_step`` (exactly once per step id).
- ``omnishm-link`` (I/O) and ``omnishm-flusher`` threads complete writes;
  ``omnishm-prefetch`` (readers) gathers hit rows after a save, and
  ``omnishm-sender`` (a CUDA writer) sends a step no materialize sent.
- ``_lock`` (the state lock) guards the step contexts, pins, row sources and
  deferred writes. It never covers a wait, a row copy or a committer round
  trip: those run after it is released.
- A signal handler's exception (KeyboardInterrupt, SystemExit) raised inside
  one of these calls goes on as it is, and turns the cache sticky-fatal
  (``_note_interrupt``, ``client/sticky.py``); ``shutdown`` still detaches.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from omnishm import protocol as P
from omnishm.client.adapter import PrefixCacheEventKind as EventKind
from omnishm.client.adapter import PrefixCacheSchedulerAdapter
from omnishm.client.deferred import DeferredWrites
from omnishm.client.device import DeviceOps, HostRegistration, StepSender, choose_ops, freeze_step, tensors_in
from omnishm.client.link import CommitterLink
from omnishm.client.reads import ReadSide
from omnishm.client.result_pool import ResultPool
from omnishm.client.segments import KeyViews, StagingPages, row_width
from omnishm.client.serial import SerialThread
from omnishm.client.session import SessionSide
from omnishm.client.steps import HitSpan, PendingHit, StepCtx, StepLifecycle, as_step_id
from omnishm.client.sticky import StickyErrors
from omnishm.client.tokens import CHAIN, PromptChains, SlotTokens, hits_token_tags
from omnishm.client.writer import WriterSide
from omnishm.client.writes import Flusher, RowSource, WriteTask
from omnishm.config import manager_connection
from omnishm.interface import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    TensorName,
)
from omnishm.versions import make_cv, warn_if_weakly_ordered

if TYPE_CHECKING:
    from omnishm.client.adapter import PrefixCacheStep, PrefixCacheWriteLayout

_HIT_KINDS = (EventKind.STARTED, EventKind.RESUMED)
_END_KINDS = (EventKind.FINISHED, EventKind.ABORTED)

logger = logging.getLogger(__name__)

_POLL_S = 0.0005


def _token_count(value: Any, name: str) -> int:
    """``int(value)``, or a ``TypeError`` naming the argument (``int(None)`` named none)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"save_outputs: {name} must be an int, got {type(value).__name__} {repr(value)[:40]}") \
            from None


class OmniPrefixCacheManager(SessionSide, StepLifecycle, WriterSide, DeferredWrites, ReadSide, StickyErrors):
    """The runner-side cache. Use as a context manager or call ``shutdown``.

    Connection arguments left out (``cache``, ``endpoint``, ``autostart``, ``runtime_dir``,
    ``connect_timeout_s``; ``endpoint`` only with ``cache`` left out too) come from the client knobs:
    ``OMNISHM_*`` variables, the config file, then the defaults (``omnishm.config.manager_connection``).
    ``config`` is used as given: build it with
    ``omnishm.config.load_prefix_cache_config`` for ``OMNISHM_STAGING_DEPTH`` and the other sizing
    knobs to apply.
    """

    def __init__(self, config: PrefixCacheConfig, *, cache: str | None = None, role: str = "writer",
                 endpoint: str | None = None, autostart: bool | None = None, eager: bool | None = None,
                 runtime_dir: str | Path | None = None, connect_timeout_s: float | None = None,
                 device_ops: DeviceOps | None = None, config_file: str | Path | None = None):
        if role not in (P.ROLE_WRITER, P.ROLE_READER):
            raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
        warn_if_weakly_ordered(logger)
        if config_file is not None:
            # Read again by a committer autostarted later, maybe after a chdir: one a resume started could not
            # read a relative path, and the resume failed (review, stop 48).
            config_file = os.path.abspath(config_file)
        conn = manager_connection(cache=cache, endpoint=endpoint, autostart=autostart, runtime_dir=runtime_dir,
                                  connect_timeout_s=connect_timeout_s, config_file=config_file)
        cache, endpoint, autostart = conn["cache"], conn["endpoint"], conn["autostart"]
        runtime_dir, connect_timeout_s = conn["runtime_dir"], conn["connect_timeout_s"]
        self.config = config
        self.cache = cache
        self.role = role
        self.is_writer = role == P.ROLE_WRITER
        self.eager = bool(eager)
        self._policy = ModelCachePolicy()
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._closed = False
        """No call takes effect any more (``shutdown`` began)."""
        # One shutdown at a time; entered by ``with`` (a C call). Reentrant: a signal handler that shuts the
        # manager down inside this thread's own shutdown returns at once (``_detaching``) instead of waiting
        # on itself for good (review, 2026-12-06).
        self._shutdown_lock = threading.RLock()
        self._detaching = False
        self._shut_down = False
        """``shutdown`` ran to its end."""
        self._pid = os.getpid()
        """The process that made this manager: a forked child's copy never touches its link (``shutdown``)."""
        self._next_step: StepId = 0
        self._ctxs: dict[StepId, StepCtx] = {}
        self._pinned: dict[StepId, StepCtx] = {}
        self._consumed: set[StepId] = set()
        self._live: set[ReqId] = set()
        self._pending_hits: dict[ReqId, PendingHit] = {}
        self._hits_taken: dict[ReqId, StepId] = {}
        """Requests whose planned hit a save took since the last ``new_step_starts`` (accepted, or refused:
        ``_burn_step``), with its step id. Engine thread (the save's hit loop under the state lock). A save of
        one of them again before the next ``new_step_starts`` (a refused save retried; every rank, as each
        took the hit) would serve none of the hit's rows, and is refused."""
        # Writer, engine thread only (client/tokens.py): what each slot's rows were computed for, and where each
        # live request's tags got to, for the integrations' views (build_write_layout(chains=...)).
        self._slot_tokens = SlotTokens(config.num_slots) if self.is_writer and config.token_check else None
        self.prompt_chains = PromptChains() if self._slot_tokens is not None else None
        self._keys: dict[TensorName, KeyViews] = {}
        self._sources: dict[tuple[TensorName, int], RowSource] = {}  # deferred keys, by (key, cv)
        self._step_sources: dict[tuple[TensorName, StepId], RowSource] = {}  # immediate keys, by (key, step)
        self._translator = PrefixCacheSchedulerAdapter()  # translate_step only: it keeps no state
        self._open: dict[tuple[ReqId, TensorName], WriteTask] = {}
        self._open_by_cv: dict[tuple[TensorName, int], WriteTask] = {}
        self._deferred_order: OrderedDict[int, WriteTask] = OrderedDict()
        self._closing: dict[int, WriteTask] = {}
        self._pending_bytes = 0  # step clones held by open deferred writes (``HeldRows``)
        self._held_bytes = 0  # step clones held by deferred writes not landed yet, open or with the flusher
        self._landed = threading.Condition(self._lock)  # notified when a deferred write lands or fails
        self._tids = itertools.count(1)
        self._prev_write: Future | None = None
        """The last step's StepWrite outcome; its ``step`` and ``marker`` attributes name the step and
        its acknowledgement marker (``WriterSide._await_step_write``)."""
        self._ops: DeviceOps | None = device_ops
        self._ops_may_move = device_ops is None and torch.cuda.is_available()
        """Whether ``save_outputs`` may still move from CPU to device ops (``device.choose_ops``): ops given to the
        constructor are kept, and without CUDA no step can have device tensors. Checked at each step until
        then, it cost a CPU engine 5-9 us of its 260 us ``save_outputs`` (a nested leftover walked again)."""
        self._registrations: list[HostRegistration] = []
        with torch.inference_mode(False):  # counted on any thread: never an inference tensor (see shm.Segment.tensor)
            self._pin_count = torch.zeros(config.num_slots, dtype=torch.int32)
        self.counters: dict[str, float] = {k: 0.0 for k in (
            "steps_saved", "hit_tokens", "hit_rows_served", "rows_served", "cow_rescues", "unmatch_errors",
            "save_seconds", "materialize_seconds", "staging_waits", "deferred_flushes", "budget_flushes",
            "deferred_waits", "prefetch_used", "prefetch_dropped", "staging_pages_in_use", "result_blocks_reused",
            "result_blocks_faulted", "token_checked_rows", "token_mismatches")}
        self.result_pool = ResultPool(config.result_pool_bytes)
        cap = config.staging_capacity_tokens
        staging_rows = config.staging_rows if self.is_writer else 0
        self._link = CommitterLink(
            cache=cache, role=role, endpoint=endpoint, autostart=autostart, connect_timeout_s=connect_timeout_s,
            request_timeout_s=config.commit_timeout_s, runtime_dir=Path(runtime_dir) if runtime_dir else None,
            reconnect_timeout_s=config.reconnect_timeout_s,
            layout=P.Layout(num_blocks=config.num_blocks, block_size=config.block_size),
            staging_rows=staging_rows, config_file=config_file)
        self._pages: StagingPages | None = None
        self._flusher: Flusher | None = None
        self._prefetcher: SerialThread[StepCtx] | None = None
        self._sender: StepSender | None = None
        try:
            self._attach(config, cache, cap)
        except BaseException:
            # Welcomed but not built (a segment that will not map, a signal's exception): say goodbye now,
            # or the link's I/O thread keeps the session (and, for a writer, the cache's one writer seat)
            # alive with heartbeats for as long as this process lives.
            self._closed = True
            self._stop_threads(time.monotonic() + config.commit_timeout_s)
            self._link.close()
            raise

    # ------------------------------------------------------------------ API

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy; call before the first save."""
        if self._next_step:
            raise RuntimeError(f"cache {self.cache}: register_policy must be called before the first save_outputs")
        self._policy = policy

    @property
    def policy(self) -> ModelCachePolicy:
        return self._policy

    @property
    def keeps_token_tags(self) -> bool:
        """Whether this manager keeps and checks its rows' token tags (``client/tokens.py``): the writer, with
        ``token_check`` on. Integrations build a write layout's tags only then."""
        return self._slot_tokens is not None

    def new_step_starts(self, events: "PrefixCacheStep | Iterable[Any]", *,
                        num_scheduled_tokens: Mapping[ReqId, int] | None = None) -> None:
        """Handle one scheduler step. Engine thread only, exactly once per real step.

        Call it before the runner's ``_update_states`` drops finished requests.
        Registers new and resumed requests' prefix hits, and closes the open
        deferred writes of finished or aborted requests (aborts still land) and
        of hit rows, handing them to the flusher after the lock is released.
        A hit that is not block aligned, lacks block ids or names a block outside
        the pool is refused: every other event of the step is applied all the
        same, then ``OmniPrefixCacheUnmatchError`` names each refused request
        (the request itself stays live, without a hit). Eager mode: returns once
        the deferred writes it closed landed (each waited ``commit_timeout_s``;
        a failure or timeout turns the cache sticky-fatal).
        """
        try:
            self._new_step_starts(events, num_scheduled_tokens)
        except BaseException as exc:
            self._note_interrupt("new_step_starts", exc)
            raise

    def _new_step_starts(self, events: "PrefixCacheStep | Iterable[Any]",
                         num_scheduled_tokens: Mapping[ReqId, int] | None) -> None:
        self._check_usable()
        step = self._translator.translate_step(events, num_scheduled_tokens)
        self._hits_taken.clear()
        bs = self.config.block_size
        planned: dict[ReqId, PendingHit] = {}
        to_tag: list[tuple[ReqId, Any, int]] = []
        refused: list[tuple[ReqId, str]] = []
        # An id that finishes and is added again in this step (the adapter emits FINISHED first) is a
        # new request: its STARTED carries a real prefix hit, not a live request re-entering.
        # translate_step's canonical order lets each loop below stop early: finishes come first, and
        # EXTENDED events (a decode step's all) come last, carry no hit and change nothing here.
        ended = set()
        for ev in step.events:
            if ev.kind not in _END_KINDS:
                break
            ended.add(ev.req_id)
        chains = self.prompt_chains
        for ev in step.events:
            if ev.kind is EventKind.EXTENDED:
                break
            if chains is not None:  # a request's chains start over with each lifetime (tokens.PromptChains)
                chains.forget(ev.req_id)
            if ev.num_computed_tokens > 0 and ev.kind in _HIT_KINDS and \
                    not (ev.kind == EventKind.STARTED and ev.req_id in self._live and ev.req_id not in ended):
                why = self._bad_hit(ev)
                if why:
                    refused.append((ev.req_id, why))
                    continue
                blocks = torch.as_tensor(list(ev.block_ids[:ev.num_computed_tokens // bs]), dtype=torch.int64)
                slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.int64)).reshape(-1)
                planned[ev.req_id] = PendingHit(slots)
                if self._slot_tokens is not None:
                    to_tag.append((ev.req_id, ev.token_ids, ev.num_computed_tokens))
        if to_tag:  # the writer's expected tags of the step's hits, in one pass (client/tokens.py)
            for (req, _, _), tags in zip(to_tag, hits_token_tags([(ids, hit) for _, ids, hit in to_tag])):
                planned[req] = planned[req]._replace(tags=tags)
                if tags is not None and chains is not None:  # its first run starts there (PromptChains.seed)
                    chains.seed(req, len(tags), int(tags[-1, CHAIN]))
        to_flush: list[WriteTask] = []
        with self._lock:
            for ev in step.events:
                if ev.kind is EventKind.EXTENDED:
                    break
                if ev.kind in _END_KINDS:
                    self._live.discard(ev.req_id)
                    self._pending_hits.pop(ev.req_id, None)
                    to_flush.extend(self._close_request_locked(ev.req_id))
                elif ev.kind in (EventKind.STARTED, EventKind.RESUMED, EventKind.REPLACED):
                    replaced = ev.kind == EventKind.REPLACED or (
                        ev.kind == EventKind.STARTED and ev.req_id in self._live)
                    self._live.add(ev.req_id)
                    hit = None if replaced else planned.get(ev.req_id)
                    if hit is not None:
                        self._pending_hits[ev.req_id] = hit
                        to_flush.extend(self._close_hit_writes_locked(hit.slots))
                    else:
                        self._pending_hits.pop(ev.req_id, None)
        handed = list(to_flush) if self.eager else []
        self._flush(to_flush)
        self._join_flushed(handed)  # eager: they land before this returns, as the seed's escalate writes them
        self._settle_if_acked()
        if refused:
            # After the rest of the step: one bad hit used to lose every other event of it (finished
            # requests' deferred writes left open for good, other requests' valid hits dropped).
            req, why = refused[0]
            more = "".join(f"; request {r!r}: {w}" for r, w in refused[1:])
            raise self._unmatch(why + more, req_id=req)

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None, *,
                     num_tokens_unpadded: int, num_tokens_padded: int,
                     write_layout: "PrefixCacheWriteLayout") -> StepId:
        """Write this step's outputs into the cache; returns the step id.

        Engine thread only, after the forward and before materialize. The
        returned id MUST be consumed exactly once, by ``materialize`` or
        ``discard_step``. Waits (unlocked) for the previous step's immediate
        writes, for a free staging page and, while deferred writes not landed
        yet hold more than ``gpu_staging_bytes``, for them to land; raises
        ``OmniPrefixCacheStagingTimeoutError`` when none frees in time, and
        ``OmniPrefixCacheUnmatchError`` for a step larger than the page. A refused save takes its step
        id all the same, on every rank, unless the cache is fatal, shut down or disconnected
        (``_burn_step``): a refusal may be one rank's alone. Its slots become absent on the writer.
        """
        step_id = self._next_step
        usable = False
        t0 = 0.0
        # Every C call inside the ``try``, the clock's too: a signal handler's exception raised as one returns
        # must reach ``_note_interrupt``. Cut at the first clock read, a save took no step id and left the cache
        # usable, its slots keeping their previous tenant's claims (a later hit served that tenant's rows, and a
        # reader's step ids fell one behind its writer's); cut at the last, in a ``finally``, the step was issued
        # and sent but its id never returned, its staging page held for good (review, stop 58).
        try:
            t0 = time.perf_counter()
            self._check_usable()  # a fatal, closed or disconnected cache takes no step id
            usable = True
            issued = self._save_outputs(step_id, hidden_states, mm_outputs, num_tokens_unpadded, num_tokens_padded,
                                        write_layout)
            self.counters["save_seconds"] += time.perf_counter() - t0
            return issued
        except BaseException as exc:
            self._note_interrupt("save_outputs", exc, step_id, count=False)  # counted once it is what leaves
            # Refused before the id was issued: it is taken all the same, unless the manager was shut down
            # meanwhile (another thread): no step follows, and its claim tables are no longer this writer's.
            if usable and self._next_step == step_id and not self._closed:
                try:
                    self._burn_step(step_id, write_layout)
                except BaseException as cut:  # an interrupt in the burn: the slots may keep their old claims
                    self._note_interrupt("save_outputs", cut, step_id)
                    raise
            if isinstance(exc, OmniPrefixCacheUnmatchError):
                self.counters["unmatch_errors"] += 1
            if t0:  # a refused save's time too: a claim timeout is the engine thread's longest wait here
                self.counters["save_seconds"] += time.perf_counter() - t0
            raise

    def _save_outputs(self, step_id: StepId, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                      num_tokens_unpadded: int, num_tokens_padded: int, write_layout: "PrefixCacheWriteLayout"
                      ) -> StepId:
        n, padded = _token_count(num_tokens_unpadded, "num_tokens_unpadded"), \
            _token_count(num_tokens_padded, "num_tokens_padded")
        if n > self.config.staging_capacity_tokens:
            raise self._unmatch(f"step of {n} tokens exceeds staging_capacity_tokens="
                                f"{self.config.staging_capacity_tokens}: size the staging page to the engine's "
                                f"max_num_batched_tokens (OMNISHM_STAGING_CAPACITY_TOKENS; the vLLM integration "
                                f"derives it)",
                                step_id=step_id)
        writes = self._check_layout(write_layout, n, padded, step_id)
        if self._hits_taken:
            for w in writes:
                if w.req_id in self._hits_taken:
                    raise self._unmatch(f"request {w.req_id!r}: its prefix hit was taken by step "
                                        f"{self._hits_taken[w.req_id]} of this scheduler step (a save refused or "
                                        f"not); saving it again before new_step_starts would serve none of the "
                                        f"hit's rows: start the next step with new_step_starts",
                                        req_id=w.req_id, step_id=step_id)
        slots, slot_list, slots_np = self._check_slots(write_layout.slots, n, step_id)
        starts = [w.token_start for w in writes]
        counts = [w.num_tokens for w in writes]
        immediate, deferred, leftover = self._split_outputs(hidden_states, mm_outputs, n, padded)
        ops = self._ops
        if ops is None or (self._ops_may_move and not ops.is_cuda):
            ops, keep = choose_ops(ops, [*immediate.values(), *deferred.values(), *tensors_in(list(leftover.values()))])
            if keep:
                self._ops = ops
        immediate, deferred, leftover, leftover_events, freeze_event = freeze_step(ops, immediate, deferred, leftover)
        if self.is_writer:
            for key, rows in itertools.chain(immediate.items(), deferred.items()):
                self._ensure_key(key, rows)
        self._join_previous_write()
        if deferred and self.is_writer:
            self._wait_for_deferred_room(step_id)
            self._check_usable()  # a write that failed meanwhile (its failure may be what ended the wait)
        ctx = StepCtx(step_id=step_id, req_ids=tuple(w.req_id for w in write_layout.writes),
                      spans={w.req_id: (w.token_start, w.num_tokens) for w in write_layout.writes},
                      leftover=leftover, leftover_events=leftover_events, freeze_event=freeze_event)
        for key, v in itertools.chain(immediate.items(), deferred.items()):
            ctx.row_shapes[key] = tuple(v.shape[1:])
        assert self._pages is not None
        ctx.page = self._pages.claim(step_id, self.config.staging_claim_timeout_s,
                                     holds=("ctx", "write") if self.is_writer else ("ctx",))
        if self._closed:  # shut down by another thread meanwhile: no id is issued, nothing claimed or sent
            for hold in ("ctx", "write"):
                self._pages.release(ctx.page, hold)
            raise RuntimeError(f"cache {self.cache}: manager is shut down")
        self._next_step += 1
        try:
            if self.is_writer:
                base = self._pages.capacity * ctx.page
                pairs = []
                for key, data in immediate.items():
                    view = self._keys[key].staging[base:base + n]
                    pairs.append((view, data))
                    ctx.step_rows[key] = view
                # One whole-step device-to-host copy per key, fenced by the freeze event.
                ctx.d2h_event = ops.to_host(pairs, freeze_event)
            else:
                self._follow_writer()  # the writer attached now is the one this reader's steps are
                for key, data in immediate.items():
                    # An explicit width: reshape(n, -1) cannot infer -1 for a step of 0 tokens.
                    ctx.step_rows[key], event = ops.leftover(data.reshape(n, row_width(ctx.row_shapes[key])))
                    # Every key's copy is waited: keeping the last key's event only, a host key's DONE
                    # hid a device key's copy in flight, and its rows were read before they landed.
                    ctx.leftover_events.append(event)
                # Deferred keys are device clones made on the engine's stream: materialize's reads wait for
                # them (and the reads of the read stream are ordered after the copy stream only).
                ctx.d2h_event = freeze_event
            for key, data in deferred.items():
                ctx.step_rows[key] = data.reshape(n, row_width(ctx.row_shapes[key]))
            to_flush: list[WriteTask] = []
            cvs: list[int] = []
            refused: dict[ReqId, str] = {}
            if self.is_writer and writes:
                cvs = self._store_claims(step_id, counts, slots, slot_list, slots_np, immediate, deferred)
                if self._slot_tokens is not None:
                    self._slot_tokens.record(slot_list if slot_list is not None else slots_np,
                                             write_layout.token_tags)
                    if self._pending_hits:  # after this step's tags: vLLM may hit blocks this step computes
                        refused = self._check_hit_tokens(writes, step_id)
            with self._lock:
                if self.is_writer and writes:
                    to_flush = self._register_writes_locked(ctx, writes, cvs, slots, slot_list, immediate, deferred)
                if self._pending_hits:
                    for w in writes:
                        hit = self._pending_hits.pop(w.req_id, None)
                        if hit is None:
                            continue
                        self._hits_taken[w.req_id] = step_id
                        span = HitSpan(slots=hit.slots, refused=refused.get(w.req_id),
                                       cvs={key: kv.claim[hit.slots].clone() for key, kv in self._keys.items()})
                        ctx.hits[w.req_id] = span
                        self._pin_count[hit.slots] += 1
                        if self.is_writer:
                            to_flush.extend(self._close_hit_writes_locked(hit.slots))
                self._ctxs[step_id] = ctx
                if ctx.hits:  # only steps with hits pin slots (copy-on-write checks them)
                    self._pinned[step_id] = ctx
        except BaseException:
            self._abandon_step(ctx)
            raise
        try:
            self._flush(to_flush)
            if self._prefetcher is not None and ctx.hits:
                ctx.prefetch_taken = threading.Lock()
                ctx.prefetch_lock = threading.Lock()
                self._prefetcher.put(ctx)  # refused once shut down: nothing lost, materialize reads itself
            if self.is_writer:
                self._record_plan(step_id, ctx.hits)  # first: a published step's plan is there
                # Tagged with this writer's epoch: a reader takes no other writer's publication for its own.
                self._ctl_mv[P.CTL_PUBLISHED_STEP] = make_cv(self._epoch, step_id, 0)
                slot_bytes = (struct.pack(f"<{n}q", *slot_list) if slot_list is not None
                              else slots_np.astype("<i8", copy=False).tobytes())
                self._send_step(ctx, cvs, starts, counts, slot_bytes, immediate)
                if self.eager:
                    self._join_previous_write()
        except BaseException:
            # An interrupt (SIGINT) after the step was registered, or a failure: the caller never gets its id.
            # The step goes (on the writer the cache turns sticky-fatal: its claims may never land, and if it
            # was sent its page may still be read, so no later save may reuse it), and the deferred writes it
            # closed are still handed to the flusher (reviews, 2026-12-05). _send_step may have abandoned it.
            self._abandon_step(ctx)
            self._flush(to_flush)
            raise
        self.counters["steps_saved"] += 1
        return step_id

    def materialize(self, step_id: StepId, req_ids: Iterable[ReqId], *,
                    out: Mapping[ReqId, Mapping[TensorName, torch.Tensor]] | None = None) -> StageCacheOutputs:
        """Per-request merged outputs (cached prefix rows + this step's rows).

        Any thread; consumes ``step_id`` exactly once (an unknown or already
        consumed id raises; a step id that is no int is a ``TypeError``, as
        is one string for ``req_ids``, before the step is consumed).
        ``req_ids`` must be a subset of the save-time requests. A hit span
        that resolves to absent or reused rows raises
        ``OmniPrefixCacheUnmatchError`` (never a silent miss); the step's
        staging page is released either way.

        ``out`` optionally supplies preallocated buffers (``out[req][key]``,
        ``HIDDEN_KEY`` for hidden states) of exactly the merged shape and
        dtype; they are filled and returned instead of new tensors (a buffer torch
        would refuse to write, one that requires grad with grad enabled or an
        inference tensor outside inference mode, is a ``ValueError`` before the
        step is consumed, as a wrong shape is). New result
        tensors come from ``result_pool`` (recycled, pre-faulted memory that
        returns once the caller dropped every view of it), so they cost about
        what ``out=`` costs (benchmarks/README.md, figure 2). Each key's tensors of one
        step are views of one buffer: holding one request's keeps the whole step's
        buffer alive, and pickling it carries the other requests' rows. ``clone()``
        what is kept past the request's prompt or sent elsewhere (the vLLM
        integration and the drop-in do). Sending a result through
        ``torch.multiprocessing`` uncloned moves the whole buffer to new shared
        memory (``share_memory_()``): the tensors follow, but a numpy array made
        earlier from another request's result (``.numpy()``) stays on the old
        memory, which the result pool then hands to a later step.
        """
        try:
            return self._materialize(step_id, req_ids, out)
        except BaseException as exc:
            self._note_interrupt("materialize", exc, step_id)
            raise

    def discard_step(self, step_id: StepId) -> None:
        """Consume the step id when nothing will materialize it (exactly once, any thread).

        Only the read-side snapshot is dropped; the cache write proceeds.
        """
        try:
            self._check_usable()
            self._release_ctx(self._take_ctx(as_step_id(step_id, "discard_step"), "discard_step"))
        except BaseException as exc:
            self._note_interrupt("discard_step", exc, step_id)
            raise

    def shutdown(self) -> None:
        """Flush open deferred writes, wait for acknowledgements (bounded), detach. Idempotent: a second
        caller waits for a shutdown in progress on another thread, and a call after one that a signal
        handler's exception cut short (Ctrl-C) does what it left undone (review, 2026-12-06: a second call
        returned at once, and the link kept heartbeating, holding the writer's seat, with the helper threads
        alive).

        Any thread. A ``save_outputs`` waiting for a staging page on the engine thread meanwhile is woken
        and raises ``RuntimeError`` (shut down), and one that got its page meanwhile raises the same before it
        issues its step id; neither takes effect, as no call does after this one. A save already past that point
        when the link closes fails its send (sticky fatal): shut down from the engine thread where it can.

        The result pool's blocks go here; the views of the cache's segments go with this object (a call in
        flight may read them: ``omnishm/shm.py``): drop it, as the vLLM hooks do, for a stopped committer's
        segments to give their pages back (LIMITS.md, trap 11)."""
        self._closed = True
        if os.getpid() != self._pid:
            # A forked child's copy (its exit handlers run the vLLM hooks' shutdown): the link's socket and
            # threads are the parent's, and using them hung the child for good (review, 2026-12-05); the
            # shutdown lock may be one a parent's thread held at the fork.
            return
        with self._shutdown_lock:
            if self._shut_down or self._detaching:
                return
            self._detaching = True
            try:
                self._detach()
                self._shut_down = True
            finally:
                self._detaching = False

    def __enter__(self) -> "OmniPrefixCacheManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ status

    @property
    def client_id(self) -> str:
        return self._link.client_id

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` began (it may have been cut short: call it again to finish it)."""
        return self._closed

    @property
    def shut_down(self) -> bool:
        """Whether a ``shutdown`` ran to its end (in a forked child, whose copy never touches the parent's
        link: at once). A shutdown called inside this thread's own (a signal handler's) returns before that:
        let the manager go only once this holds."""
        return self._shut_down or os.getpid() != self._pid

    def unconsumed_step_ids(self) -> list[StepId]:
        with self._lock:
            return sorted(self._ctxs)

    # ------------------------------------------------------------------ internals: keys

    def _publish_key(self, key: TensorName, kv: KeyViews) -> None:
        """Add a mapped key, any thread. ``_keys`` is replaced, never changed in place: the engine
        thread iterates it (hit plans, absent claims) while a reader's prefetch thread maps keys."""
        with self._lock:
            self._keys = {**self._keys, key: kv}


__all__ = ["OmniPrefixCacheManager"]
