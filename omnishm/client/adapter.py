"""Translate vLLM's scheduler output into the omni prefix cache's step events.

vLLM tells the runner about a step through ``SchedulerOutput``; the manager
wants a flat, ordered list of per-request events plus the step's token counts
(``PrefixCacheStep``), and, after the forward, where each request's output rows
go (``PrefixCacheWriteLayout``). This module is that translation and nothing
else: no cache state, no process, no vllm import.

Event semantics (what ``OmniPrefixCacheManager.new_step_starts`` relies on):

- Order within a step: FINISHED/ABORTED, then STARTED/REPLACED (in
  ``scheduled_new_reqs`` order), then RESUMED, then EXTENDED (both in
  ``scheduled_cached_reqs`` order). A finish therefore always precedes a
  re-add of the same id in the same step.
- STARTED: first time the request is scheduled. ``num_computed_tokens`` is the
  tokens vLLM already has (a prefix hit; vLLM hits are whole blocks, so the
  manager checks alignment) and ``block_ids`` the request's full block list of
  the KV group.
- REPLACED: a "new" request whose id is still live (async-chunk continuation:
  the same id re-enters as new). Same payload as STARTED; the manager must not
  treat its ``num_computed_tokens`` as a hit.
- RESUMED: a preempted request scheduled again (V1 runner: listed in
  ``scheduled_cached_reqs.resumed_req_ids``; V2 runner: re-sent as new after
  being reported in ``preempted_req_ids``). Carries its *full new* block list
  (vLLM replaces, not appends) and its ``num_computed_tokens`` (may be a hit
  again).
- EXTENDED: a running request scheduled again; ``block_ids`` are only the
  newly appended blocks (possibly empty), ``num_computed_tokens`` the tokens
  computed before this step.
- FINISHED / ABORTED: carry only the id. vLLM reports an id in the step
  *after* it finished, and may report ids the runner never saw (a request
  finished or aborted while waiting); the manager ignores unknown ids.
  Preemption is not an event: a preempted request simply is not scheduled.
"""

from __future__ import annotations

import enum
import logging
import operator
from collections import abc
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from omnishm.interface import ReqId, unmatch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from omnishm.client.group_view import FullAttentionGroupView
    from omnishm.client.tokens import PromptChains

logger = logging.getLogger(__name__)

__all__ = [
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
    "PrefixCacheSchedulerAdapter",
]


class PrefixCacheEventKind(enum.Enum):
    STARTED = "started"
    EXTENDED = "extended"
    RESUMED = "resumed"
    FINISHED = "finished"
    ABORTED = "aborted"
    REPLACED = "replaced"

    # Members are singletons compared by identity, so they hash by identity too: Enum's own __hash__ is a
    # Python-level call, and the engine thread hashes a kind per event several times a step (a decode step
    # of 512 requests spent about 0.1 ms in it; perf review, 2026-12-06).
    __hash__ = object.__hash__


_END_KINDS = frozenset({PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED})
_ORDER = {
    PrefixCacheEventKind.FINISHED: 0,
    PrefixCacheEventKind.ABORTED: 0,
    PrefixCacheEventKind.STARTED: 1,
    PrefixCacheEventKind.REPLACED: 1,
    PrefixCacheEventKind.RESUMED: 2,
    PrefixCacheEventKind.EXTENDED: 3,
}


def _int(value: Any, what: str) -> int:
    """``value`` as an int; numpy integers and 0-d integer tensors accepted, bools and floats not."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None


_IN_ORDER = (list, tuple, range)


def _ordered(values: Any, req_id: ReqId, what: str) -> Any:
    """``values``, refused when they have no order: a set's or a mapping's iteration order is not the
    caller's, and block ids taken in it served a hit's rows out of order (review, 2026-12-07). Called for
    every request of every step: vLLM's lists and tuples pass at one type check."""
    if type(values) in _IN_ORDER or not isinstance(values, (abc.Set, abc.Mapping)):
        return values
    raise ValueError(f"{req_id}: {what} must be in order (a list, tuple or array), got a {type(values).__name__}")


def id_collection(values: Any, what: str) -> Iterable[Any]:
    """A scheduler output's collection of request ids: None is none, an array its items; one string is
    refused (``set("req-1")`` is five one-letter ids, so ``req-1`` never finished: review, 2026-12-07)."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} must be a collection of request ids, got the string {values!r}")
    tolist = getattr(values, "tolist", None)  # a numpy array has no truth value; its items are numpy strs
    return tolist() if callable(tolist) else values


def _nonneg_int(value: Any, what: str) -> int:
    """``value`` as a non-negative int; numpy integers accepted, bools and floats not."""
    out = _int(value, what)
    if out < 0:
        raise ValueError(f"{what} must be >= 0, got {out}")
    return out


@dataclass(frozen=True)
class PrefixCacheRequestEvent:
    """One request's change in one step; see the module docstring for semantics.

    ``block_ids`` is coerced to a tuple of ints. Raises ``ValueError`` for an
    unknown kind, a negative count or block id, block ids without an order (a
    set or a mapping: the hit's rows follow their order), or a FINISHED/ABORTED
    event that carries tokens or blocks.
    """

    kind: PrefixCacheEventKind
    req_id: ReqId
    num_computed_tokens: int = 0
    block_ids: tuple[int, ...] = ()
    token_ids: Sequence[int] | None = field(default=None, compare=False, repr=False)
    """Optional, for a prefix hit: the request's token ids from position 0 (vLLM's prompt token ids, or all
    its tokens for a resumed request), kept as given (not copied). The writer checks the hit's rows were
    computed for these tokens (``client/tokens.py``); None: not checked. Only STARTED and RESUMED events,
    the ones that carry a hit, may carry them."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, PrefixCacheEventKind):
            raise ValueError(f"unknown prefix-cache event kind {self.kind!r}")
        if not isinstance(self.req_id, str) or not self.req_id:
            raise ValueError(f"req_id must be a non-empty str, got {self.req_id!r}")
        n = self.num_computed_tokens
        if type(n) is not int or n < 0:
            object.__setattr__(self, "num_computed_tokens", _nonneg_int(n, f"{self.req_id}: num_computed_tokens"))
        ids = self.block_ids
        blocks = ids if type(ids) is tuple else tuple(_ordered(ids, self.req_id, "block_ids"))
        # vLLM's block ids are plain ints: one pass over them, not a checked call per id (a long prompt
        # carries hundreds, and this runs on the engine thread every step).
        if blocks and not (all(type(b) is int for b in blocks) and min(blocks) >= 0):
            blocks = tuple(_nonneg_int(b, f"{self.req_id}: block id") for b in blocks)
        object.__setattr__(self, "block_ids", blocks)
        if self.kind in _END_KINDS and (self.num_computed_tokens or blocks or self.token_ids is not None):
            raise ValueError(f"{self.kind.name} event for {self.req_id} must carry only the id")
        if self.token_ids is not None:
            if self.kind not in (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.RESUMED):
                raise ValueError(f"{self.kind.name} event for {self.req_id} carries no token ids (only a hit's are "
                                 f"checked, and only STARTED and RESUMED events carry one)")
            if isinstance(self.token_ids, (str, bytes)) or not hasattr(self.token_ids, "__len__"):
                raise ValueError(f"{self.req_id}: token_ids must be a sequence of token ids, got "
                                 f"{type(self.token_ids).__name__}")


@dataclass(frozen=True)
class PrefixCacheStep:
    """Events of one real scheduler step plus its per-request token counts.

    ``num_scheduled_tokens`` is stored as a read-only mapping.
    """

    events: tuple[PrefixCacheRequestEvent, ...]
    num_scheduled_tokens: Mapping[ReqId, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "num_scheduled_tokens", MappingProxyType(dict(self.num_scheduled_tokens)))

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class PrefixCacheWrite:
    """One request's rows in this step's outputs: ``token_start .. +num_tokens``.

    Both counts are stored as Python ints: numpy integers (what a runner reads from vLLM's ``*_np``
    arrays) and 0-d integer tensors are converted here; a bool or a float raises ValueError. Kept
    as given, a numpy count made the served-rows counter a numpy float that the link could not encode
    at its next heartbeat (the link died, the cache went sticky-fatal), a float passed the layout check
    and failed the save after its step id was issued, and a tensor count was added to in place by the
    read plan (review, 2026-12-07). Signs are the save's to check (``_check_layout``). ``req_id`` must
    be a non-empty str, as an event's (ValueError).
    """

    req_id: ReqId
    token_start: int
    num_tokens: int

    def __post_init__(self) -> None:
        if type(self.req_id) is not str or not self.req_id:  # as an event's: b"c" hit nothing, without a word
            raise ValueError(f"req_id must be a non-empty str, got {self.req_id!r}")
        if type(self.token_start) is not int or type(self.num_tokens) is not int:  # vLLM's own ints pass at once
            object.__setattr__(self, "token_start", _int(self.token_start, f"{self.req_id}: token_start"))
            object.__setattr__(self, "num_tokens", _int(self.num_tokens, f"{self.req_id}: num_tokens"))


@dataclass(frozen=True)
class PrefixCacheWriteLayout:
    """Where this step's output rows go.

    ``writes`` in batch order, contiguous from row 0. ``slots`` is ``int64``
    CPU, one vLLM slot id per output row in batch order; its length is
    ``num_tokens`` (= ``num_tokens_unpadded``). Rows past it (padding) are
    never written. ``writes`` is stored as a tuple: a one-shot iterator was used up by
    the save's layout check, and the step then held an empty batch (review, 2026-12-07).
    """

    writes: tuple[PrefixCacheWrite, ...]
    slots: torch.Tensor
    token_tags: np.ndarray | None = None
    """Optional: ``rows x 2`` int64, each row's exact tag (``tokens.token_tags`` of its token id and its position
    in its request) and its chain (``tokens.prefix_chains`` of its request's tokens up to it), 0 where unknown
    (None: all unknown); or one exact tag a row (no chain). Their form is checked on every rank, so the ranks refuse a
    save alike; the writer keeps them per slot and checks later hits against them (``client/tokens.py``)."""

    def __post_init__(self) -> None:
        if type(self.writes) is not tuple:
            object.__setattr__(self, "writes", tuple(self.writes))

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    @property
    def req_ids(self) -> list[ReqId]:
        return [w.req_id for w in self.writes]


def _group_blocks(per_group: Any, group_index: int, req_id: ReqId) -> tuple[int, ...]:
    """Block ids of one KV group from vLLM's ``tuple[list[int], ...]`` (None -> ()).

    A flat list of ints is the one KV group of vLLM before the hybrid allocator (0.8 and older:
    ``block_ids: list[int]``); it names group 0 only. Raises ``ValueError`` for a group the ids do not have.
    """
    if per_group is None:
        return ()
    if not len(per_group):
        if group_index == 0:
            return ()  # a flat list with no new blocks
        raise ValueError(f"{req_id}: block ids have no KV group {group_index}: {per_group!r}")
    _ordered(per_group, req_id, "block ids")
    first = per_group[0]
    if isinstance(first, int) or (hasattr(first, "__index__") and not hasattr(first, "__iter__")):
        if group_index:
            raise ValueError(f"{req_id}: a flat block id list is KV group 0 only, not group {group_index}: "
                             f"{per_group!r}")
        return tuple(per_group)
    try:
        return tuple(_ordered(per_group[group_index], req_id, "block ids of a KV group"))
    except IndexError:
        raise ValueError(f"{req_id}: block ids have no KV group {group_index}: {per_group!r}") from None


class PrefixCacheSchedulerAdapter:
    """Stateful translator of vLLM ``SchedulerOutput`` into ``PrefixCacheStep``.

    Tracks the ids of live requests (started and not yet finished/aborted) so
    a "new" request whose id is still live becomes REPLACED, and of live
    requests reported in ``preempted_req_ids`` (vLLM's V2 model runner) so
    that such a request re-sent as new becomes RESUMED. Engine thread only,
    one call per scheduler output (zero-token ones included, so no finish is
    missed), in step order; not thread-safe.
    """

    def __init__(self, group_index: int = 0) -> None:
        self.group_index = group_index
        self._live: set[ReqId] = set()
        self._preempted: set[ReqId] = set()  # live ids reported in preempted_req_ids, not yet resumed

    @property
    def live_req_ids(self) -> frozenset[ReqId]:
        return frozenset(self._live)

    def translate_scheduler_output(self, scheduler_output: Any) -> PrefixCacheStep:
        """Events of one ``SchedulerOutput`` (duck-typed over vLLM 0.32 and older).

        Reads ``finished_req_ids``, optional ``aborted_req_ids``,
        ``scheduled_new_reqs`` (``req_id``, ``num_computed_tokens``,
        ``block_ids`` per group), ``scheduled_cached_reqs`` (``req_ids``,
        ``resumed_req_ids`` set or the older ``resumed_from_preemption`` list,
        ``new_block_ids``, ``num_computed_tokens``), optional
        ``preempted_req_ids`` and ``num_scheduled_tokens``. Raises
        ``ValueError`` on a malformed output (e.g. a resumed request without
        block ids) and then leaves the live-id state unchanged.
        """
        g = self.group_index
        # Work on copies and commit at the end: a malformed output leaves the state unchanged.
        live = set(self._live)
        preempted = set(self._preempted)
        finished = set(id_collection(getattr(scheduler_output, "finished_req_ids", None), "finished_req_ids"))
        aborted = set(id_collection(getattr(scheduler_output, "aborted_req_ids", None), "aborted_req_ids"))
        events: list[PrefixCacheRequestEvent] = []
        for rid in sorted(finished | aborted):
            kind = PrefixCacheEventKind.ABORTED if rid in aborted else PrefixCacheEventKind.FINISHED
            events.append(PrefixCacheRequestEvent(kind, rid))
            live.discard(rid)
            preempted.discard(rid)

        for rid in id_collection(getattr(scheduler_output, "preempted_req_ids", None), "preempted_req_ids"):
            if rid in live:
                preempted.add(rid)

        resumed: list[PrefixCacheRequestEvent] = []
        extended: list[PrefixCacheRequestEvent] = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            rid = new.req_id
            blocks = _group_blocks(new.block_ids, g, rid)
            # A hit's tokens, for the writer's check of its rows (client/tokens.py): the V2 runner's resumed
            # request carries all its tokens in prefill_token_ids, the prompt's come first in either.
            tokens = None
            if new.num_computed_tokens:
                tokens = getattr(new, "prefill_token_ids", None)
                if tokens is None:
                    tokens = getattr(new, "prompt_token_ids", None)
            if rid in preempted:
                # vLLM's V2 model runner re-sends a resumed request as new (after
                # reporting it in preempted_req_ids): a resume, not a replacement.
                preempted.discard(rid)
                resumed.append(PrefixCacheRequestEvent(PrefixCacheEventKind.RESUMED, rid,
                                                       new.num_computed_tokens, blocks, tokens))
                continue
            kind = PrefixCacheEventKind.REPLACED if rid in live else PrefixCacheEventKind.STARTED
            events.append(PrefixCacheRequestEvent(kind, rid, new.num_computed_tokens, blocks,
                                                  tokens if kind is PrefixCacheEventKind.STARTED else None))
            live.add(rid)

        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for rid, is_resumed, per_group, computed in self._cached_rows(cached):
            if is_resumed:
                if per_group is None:
                    raise ValueError(f"{rid}: resumed request without block ids")
                # vLLM 0.32's V1 runner gets a resumed request's tokens in all_token_ids (older ones: none).
                every = getattr(cached, "all_token_ids", None) if computed else None
                tokens = every.get(rid) if isinstance(every, abc.Mapping) else None
                resumed.append(PrefixCacheRequestEvent(PrefixCacheEventKind.RESUMED, rid, computed,
                                                       _group_blocks(per_group, g, rid), tokens))
            else:
                extended.append(PrefixCacheRequestEvent(PrefixCacheEventKind.EXTENDED, rid, computed,
                                                        _group_blocks(per_group, g, rid)))
            live.add(rid)
            preempted.discard(rid)
        events.extend(resumed)
        events.extend(extended)
        step = PrefixCacheStep(tuple(events), dict(scheduler_output.num_scheduled_tokens))
        # Last, and no call after it: a signal handler's exception raised before it leaves the adapter as it was.
        self._live, self._preempted = live, preempted
        return step

    @staticmethod
    def _cached_rows(cached: Any) -> Iterable[tuple[ReqId, bool, Any, int]]:
        """(req_id, resumed, per-group new block ids, num_computed_tokens) per cached request."""
        if cached is None:
            return []
        if isinstance(cached, (list, tuple)):  # vLLM <= 0.9: one object per request
            return [(c.req_id, bool(getattr(c, "resumed_from_preemption", False)), c.new_block_ids,
                     c.num_computed_tokens) for c in cached]
        req_ids: Sequence[ReqId] = cached.req_ids
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        if resumed_ids is not None:
            resumed_set = set(id_collection(resumed_ids, "resumed_req_ids"))
            flags = [rid in resumed_set for rid in req_ids]
        else:
            given = getattr(cached, "resumed_from_preemption", None)  # (len, not truth: it may be an array)
            flags = [bool(f) for f in given] if given is not None and len(given) else [False] * len(req_ids)
        new_blocks = cached.new_block_ids
        computed = cached.num_computed_tokens
        if not (len(flags) == len(new_blocks) == len(computed) == len(req_ids)):
            raise ValueError("scheduled_cached_reqs fields have different lengths")
        return list(zip(req_ids, flags, new_blocks, computed))

    def translate_step(self, step_or_events: PrefixCacheStep | Iterable[PrefixCacheRequestEvent],
                       num_scheduled_tokens: Mapping[ReqId, int] | None = None) -> PrefixCacheStep:
        """Normalise and validate a step given as a ``PrefixCacheStep`` or events.

        Events are put in the canonical order (stable: FINISHED/ABORTED,
        STARTED/REPLACED, RESUMED, EXTENDED). ``num_scheduled_tokens`` defaults
        to the step's own mapping (or empty for bare events); passing both a
        step and a different mapping is an error. Raises ``ValueError`` for a
        non-event item, an unknown kind, negative counts, two finishes or two
        non-finish events for one id, and a RESUMED or EXTENDED event of an id
        that ends in the same step (only a new request, STARTED or REPLACED, may
        take an ended id: the one scheduled again is gone, and its deferred rows
        would stay open with nothing left to close them). Does not touch the
        live-id state.
        """
        if isinstance(step_or_events, PrefixCacheStep):
            events = list(step_or_events.events)
            counts: Mapping[ReqId, int] = step_or_events.num_scheduled_tokens
            if num_scheduled_tokens is not None and dict(num_scheduled_tokens) != dict(counts):
                raise ValueError("num_scheduled_tokens given twice with different values")
        else:
            try:
                events = list(step_or_events)
            except TypeError:
                raise TypeError(f"a step must be a PrefixCacheStep or an iterable of PrefixCacheRequestEvent, "
                                f"got {type(step_or_events).__name__}") from None
            counts = num_scheduled_tokens if num_scheduled_tokens is not None else {}
        ranks: list[int] = []
        for ev in events:  # every item is checked before any duplicate is looked for
            if not isinstance(ev, PrefixCacheRequestEvent):
                raise ValueError(f"not a PrefixCacheRequestEvent: {ev!r}")
            if not isinstance(ev.kind, PrefixCacheEventKind):
                raise ValueError(f"unknown prefix-cache event kind {ev.kind!r}")
            if ev.num_computed_tokens < 0 or (ev.block_ids and min(ev.block_ids) < 0):
                raise ValueError(f"negative count in {ev!r}")
            ranks.append(_ORDER[ev.kind])
        ordered = all(map(operator.le, ranks, ranks[1:]))
        ended: set[ReqId] = set()
        active: set[ReqId] = set()
        for ev, rank in zip(events, ranks):
            bucket = ended if rank == 0 else active
            if ev.req_id in bucket:
                raise ValueError(f"two {'finish' if bucket is ended else 'schedule'} events for {ev.req_id}")
            bucket.add(ev.req_id)
        if ended and active:  # (checked once all ends are known: the order of ``events`` is not canonical yet)
            for ev, rank in zip(events, ranks):
                if rank >= _ORDER[PrefixCacheEventKind.RESUMED] and ev.req_id in ended:
                    raise ValueError(f"{ev.kind.name} event for {ev.req_id}, which ends in the same step "
                                     "(only STARTED or REPLACED may follow its finish)")
        clean: dict[ReqId, int] = {}
        for rid, n in counts.items():
            if not isinstance(rid, str):
                raise ValueError(f"num_scheduled_tokens key must be a str, got {rid!r}")
            # A plain non-negative int is the usual case; anything else gets the full check.
            clean[rid] = n if type(n) is int and n >= 0 else _nonneg_int(n, f"num_scheduled_tokens[{rid}]")
        if not ordered:  # (already canonical is the usual case)
            events.sort(key=lambda ev: _ORDER[ev.kind])
        return PrefixCacheStep(tuple(events), clean)

    @staticmethod
    def build_write_layout(group_view: "FullAttentionGroupView", num_scheduled_tokens: Mapping[ReqId, int], *,
                           token_tags: bool = True, chains: "PromptChains | None" = None) -> PrefixCacheWriteLayout:
        """Write layout of this step's outputs, in the batch order of ``group_view``.

        Call after the forward, before the next ``_update_states`` (the batch
        must be the one the forward ran). Every batch request must be in
        ``num_scheduled_tokens`` and vice versa (else
        ``OmniPrefixCacheUnmatchError``: the outputs would be attributed to the
        wrong requests). Requests with 0 tokens get no write. Slots come from
        ``group_view.step_slots_cpu`` (CPU block table, vectorised); the rows' token tags from
        ``group_view.step_token_tags_cpu`` where the view has it, unless ``token_tags`` is False (a reader
        rank: only the writer keeps and checks them), given the writer's ``chains`` (``manager.prompt_chains``:
        without them each run continuing a prompt sums the prompt's earlier tokens).
        """
        req_ids = group_view.batch_req_ids
        batch = set(req_ids)
        extra = [rid for rid in num_scheduled_tokens if rid not in batch]
        if extra:
            raise unmatch(f"scheduled requests {sorted(extra)} are not in the input batch", req_id=extra[0])
        missing = [rid for rid in req_ids if rid not in num_scheduled_tokens]
        if missing:
            raise unmatch(f"batch requests {missing} have no scheduled-token count", req_id=missing[0])
        counts = [int(num_scheduled_tokens[rid]) for rid in req_ids]
        writes: list[PrefixCacheWrite] = []
        start = 0
        for rid, n in zip(req_ids, counts):
            if n < 0:
                raise unmatch(f"negative scheduled-token count {n}", req_id=rid)
            if n:
                writes.append(PrefixCacheWrite(rid, start, n))
                start += n
        slots = group_view.step_slots_cpu(counts)
        if int(slots.numel()) != start:  # a view that disagrees with its own counts is a bug upstream
            raise unmatch(f"group view returned {int(slots.numel())} slots for {start} tokens")
        tagger = getattr(group_view, "step_token_tags_cpu", None) if token_tags else None  # (a view may know none)
        tags = None if tagger is None else tagger(counts, chains) if chains is not None else tagger(counts)
        return PrefixCacheWriteLayout(tuple(writes), slots, tags)
