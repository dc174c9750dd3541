"""vllm-omni's own model runners on an omnishm cache: a drop-in for its ``OmniPrefixCacheManager``.

vllm-omni 0.30.0 builds its in-process cache in ``PrefixCacheRunnerMixin._ensure_omni_prefix_cache``
as ``OmniPrefixCacheManager(config, view)``, a name that method looks up in its own module at call
time. ``install()`` rebinds that name to ``VllmOmniPrefixCacheManager``, which takes the same
arguments, has the same methods and returns the same results, but keeps the cache in an omnishm
committer shared by every TP rank. Enable it in every worker process, before the first step:

    OMNISHM_VLLM_OMNI=1 vllm-omni serve ...   # the vLLM plugin entry point calls install()

or call ``omnishm.integrations.vllm_omni.install()`` yourself. The cache is named by
``$OMNISHM_NAME`` (default ``"default"``): give each stage of a pipeline (thinker, talker) its own.

What changes against vllm-omni's manager (docs/CLIENT.md, section 2):

- the cache is a committer process (autostarted by default), TP rank 0 of the last PP stage writes
  it and the other ranks read it;
- where vllm-omni would serve zeros or a shorter prefix (mm rows never written, fewer block ids than
  the hit), this raises ``OmniPrefixCacheUnmatchError``;
- ``aborted_req_ids`` also close a request's writes;
- a request scheduled 0 tokens in a step gets no rows from that step's ``materialize``: its hit's rows
  come with those of the first step that computes its tokens (vllm-omni serves them at the 0-token step).
  Each row is served once either way.

Kept as vllm-omni does it: a resumed (preempted) request is not a hit, only ``scheduled_new_reqs``
carry hits; ``mm_outputs`` is tensor name -> request -> value; ``hidden_states`` is None when the
model does not cache them; values that are not per-token rows of at least 2 dimensions are leftover,
cut per request by vllm-omni's own ``to_payload_element``; an ``mm_outputs`` key named ``HIDDEN_KEY``
is ignored. Errors are vllm-omni's classes (the omnishm error is their ``__cause__``).

Threads: ``new_step_starts`` and ``save_outputs`` on the engine thread; ``materialize`` and
``discard_step`` on any thread, as vllm-omni's (``_lock`` covers the saved-step table only).
Import invariant: neither vllm nor vllm_omni is imported at module scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import threading
import types
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch

from omnishm.client.adapter import (PrefixCacheEventKind, PrefixCacheSchedulerAdapter, PrefixCacheStep,
                                    PrefixCacheWrite, PrefixCacheWriteLayout)
from omnishm.client.device import DeviceEvent
from omnishm.client.group_view import (
    FullAttentionGroupView,
    PrefixCacheConfigError,
    naming_the_cache,
    stage_prefix_cache_config,
)
from omnishm.client.manager import OmniPrefixCacheManager
from omnishm.client.runner_mixin import replica_cache_name, runner_parallel_config, stage_cache_name, vllm_runner_role
from omnishm.client.steps import as_step_id, request_ids
from omnishm.config import load_prefix_cache_config
from omnishm.interface import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheStagingTimeoutError,
                               OmniPrefixCacheUnmatchError, ReqId, StepId)

logger = logging.getLogger(__name__)

__all__ = ["VllmOmniPrefixCacheManager", "install", "load_prefix_cache"]

PACKAGE = "vllm-omni"
SUPPORTED = "0.30.0"
"""The vllm-omni release whose API the drop-in takes (its tests compare against that release)."""

_BUILDING: contextvars.ContextVar[Any] = contextvars.ContextVar("omnishm_vllm_omni_runner", default=None)
"""The vllm-omni runner whose ``_ensure_omni_prefix_cache`` is building its cache (``install`` wraps it):
vllm-omni hands the manager only its config and group view, and a DP replica's cache name needs the
runner's ``ParallelConfig`` (``replica_cache_name``)."""

_VO_FIELDS = ("staging_depth", "staging_capacity_tokens", "staging_claim_timeout_s", "gpu_staging_bytes",
              "copy_chunk_bytes")


def load_prefix_cache(*, standin: bool = False) -> tuple[types.ModuleType, str]:
    """``(vllm_omni.core.prefix_cache, version)``; raises ImportError when vllm-omni is absent.

    A vllm-omni process has imported ``vllm_omni`` already; otherwise it is imported here, which needs
    vllm. ``standin=True`` (benchmarks and tests, without vllm): vllm-omni keeps its prefix-cache
    subpackage importable without vllm (its own import invariant) but not its top-level package (it
    patches vllm and registers model configs), so that package is entered without running its
    ``__init__``, and the stand-in stays in ``sys.modules`` for the rest of the process. Main thread.
    """
    name = "vllm_omni.core.prefix_cache"
    if standin and "vllm_omni" not in sys.modules:
        spec = importlib.util.find_spec("vllm_omni")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{PACKAGE} is not installed (pip install --no-deps {PACKAGE}==0.30.0)")
        parent = types.ModuleType("vllm_omni")
        parent.__path__ = list(spec.submodule_search_locations)
        sys.modules["vllm_omni"] = parent
        try:
            return importlib.import_module(name), _version()
        except BaseException:
            for mod in [m for m in sys.modules if m == "vllm_omni" or m.startswith("vllm_omni.")]:
                del sys.modules[mod]
            raise
    return importlib.import_module(name), _version()


def _version() -> str:
    """The installed vllm-omni's version; a source checkout without package metadata reads its version module."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module("vllm_omni.version"), "__version__", "unknown"))


class _Saved(NamedTuple):
    """What materialize needs beyond omnishm's own step: vllm-omni's batch order and its leftovers."""

    spans: dict[ReqId, tuple[int, int]]  # every batch request (0-token ones too): (start, count)
    n: int
    leftover: dict[str, Any]
    leftover_event: Any  # CUDA event of the leftover copies, or None
    empty: dict[str, torch.Tensor]  # key -> a 0-row tensor of its row shape (0-token requests)
    hidden: bool  # hidden states were cached this step


class VllmOmniPrefixCacheManager:
    """vllm-omni 0.30.0's ``OmniPrefixCacheManager`` interface over an omnishm ``OmniPrefixCacheManager``.

    ``config`` is vllm-omni's ``PrefixCacheConfig`` (read by field: ``num_blocks``, ``block_size``
    and the staging knobs, which ``OMNISHM_*`` settings override); ``view`` its group view
    (``batch_req_ids()``, ``step_slots_cpu(req_ids, num_scheduled)``). ``cache``, ``role`` and the
    connection keywords go to omnishm's manager (default: ``$OMNISHM_NAME``, the rank's role from
    vLLM's parallel state, an autostarted committer). ``parallel_config`` (default: that of the runner
    whose ``_ensure_omni_prefix_cache`` builds this, once ``install`` ran) names a DP replica's cache
    (``replica_cache_name``). Raises vllm-omni's ``OmniPrefixCacheUnmatchError`` when no committer answers,
    ``PrefixCacheConfigError`` (omnishm's) for a stage omnishm's gate refuses (``_gate``) or a batch whose
    block table has another block size than ``view.block_size``.
    """

    def __init__(self, config: Any, view: Any, *, eager: bool | None = None, cache: str | None = None,
                 role: str | None = None, parallel_config: Any = None, **connection: Any):
        self._vo, self.version = load_prefix_cache()
        derived = {k: getattr(config, k) for k in _VO_FIELDS if getattr(config, k, None) is not None}
        cfg = load_prefix_cache_config(int(config.num_blocks), int(config.block_size), derived=derived)
        runner = _BUILDING.get()
        if parallel_config is None:
            parallel_config = runner_parallel_config(runner)
        with naming_the_cache(lambda: stage_cache_name(cache, connection.get("endpoint"),
                                                       parallel_config=parallel_config)):
            _gate(runner, int(config.num_blocks))
        self._view = view
        self._ours = self._own_view(view)
        self._adapter = PrefixCacheSchedulerAdapter()
        self._num_scheduled: dict[ReqId, int] = {}
        self._hidden = True
        self._lock = threading.Lock()
        self._saved: dict[StepId, _Saved] = {}
        with self._errors():
            cache = replica_cache_name(cache, connection.get("endpoint"), parallel_config=parallel_config)
            self._m = OmniPrefixCacheManager(cfg, cache=cache, role=role or vllm_runner_role(), eager=eager,
                                             **connection)

    @staticmethod
    def _own_view(view: Any) -> FullAttentionGroupView | None:
        """omnishm's group view over the batch vllm-omni's view reads, or None to ask vllm-omni's.

        The same slots (tests/vllm_tier/test_vllm_omni_runner.py compares the results), from one pass over
        block runs instead of a few torch calls per request: about 0.13 ms instead of 0.36 ms for 8 requests
        right after a forward.
        """
        batch, block_size = getattr(view, "_input_batch", None), getattr(view, "block_size", None)
        if batch is None or not isinstance(block_size, int):
            return None
        try:
            return FullAttentionGroupView(batch, block_size)
        except PrefixCacheConfigError:
            # The block table's block size is not the cache's: vllm-omni's view, which does not check it, would
            # take block ids of one size for the other's and save rows at slots vLLM does not use (review).
            raise
        except (AttributeError, IndexError, TypeError, ValueError):  # a layout only vllm-omni's view reads
            return None

    @property
    def manager(self) -> OmniPrefixCacheManager:
        """The omnishm manager underneath (counters, ``wait_idle``, ``cache``)."""
        return self._m

    def register_policy(self, policy: Any) -> None:
        """vllm-omni's ``ModelCachePolicy`` (``needs_full_hidden_states``, ``deferred_keys``); before the first save."""
        hidden = bool(getattr(policy, "needs_full_hidden_states", True))
        deferred = getattr(policy, "deferred_keys", None)
        deferred = () if deferred is None else deferred  # (not ``or``: an array has no truth value)
        if isinstance(deferred, str):  # vllm-omni's ``key in deferred_keys`` defers that key; frozenset() split it
            deferred = (deferred,)
        self._m.register_policy(ModelCachePolicy(cache_hidden=hidden, deferred_keys=frozenset(deferred)))
        self._hidden = hidden  # only once omnishm took it: a refused policy changes nothing

    def new_step_starts(self, scheduler_output: Any) -> None:
        """vLLM's ``SchedulerOutput`` of one real step; engine thread, before ``_update_states``."""
        try:
            try:
                step = self._adapter.translate_scheduler_output(scheduler_output)
            except (ValueError, TypeError, AttributeError) as exc:  # a malformed output; the adapter keeps its state
                raise self._vo.OmniPrefixCacheUnmatchError(f"scheduler output: {exc}") from exc
            # vllm-omni registers hits of scheduled_new_reqs only: a resumed request gets this step's rows.
            events = tuple(dataclasses.replace(ev, kind=PrefixCacheEventKind.REPLACED, token_ids=None)
                           if ev.kind is PrefixCacheEventKind.RESUMED else ev for ev in step.events)
            # vLLM can schedule a negative span (vllm-omni's runner skips such a step after this call): none.
            self._num_scheduled = {r: max(int(c), 0) for r, c in step.num_scheduled_tokens.items()}
            with self._errors():
                self._m.new_step_starts(PrefixCacheStep(events, self._num_scheduled))
        except BaseException as exc:  # a signal handler's: sticky (OmniPrefixCacheManager.note_interrupt)
            self._m.note_interrupt("new_step_starts", exc)
            raise

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None, *,
                     num_tokens_unpadded: int, num_tokens_padded: int) -> StepId:
        """Save the step (vllm-omni's signature); returns the step id to materialize or discard once."""
        try:
            hidden, rows, layout, saved = self._prepare_save(hidden_states, mm_outputs, num_tokens_unpadded,
                                                             num_tokens_padded)
        except BaseException as exc:  # before omnishm's save, any exception: the step's slots are unknown
            self._m.note_interrupt("save_outputs", exc)  # first: a signal's says so
            self._m.note_unsaved_step("save_outputs", exc)
            raise
        try:  # from here omnishm's save answers for the step's slots (a refusal makes them absent)
            with self._errors():
                sid = self._m.save_outputs(hidden, rows, num_tokens_unpadded=num_tokens_unpadded,
                                           num_tokens_padded=num_tokens_padded, write_layout=layout)
            with self._lock:
                self._saved[sid] = saved
            return sid
        except BaseException as exc:  # a signal handler's: sticky (OmniPrefixCacheManager.note_interrupt)
            self._m.note_interrupt("save_outputs", exc)
            raise

    def _prepare_save(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                      num_tokens_unpadded: Any, num_tokens_padded: Any
                      ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], PrefixCacheWriteLayout, _Saved]:
        """``save_outputs``' work before omnishm's save: the rows to save, the step's layout in vllm-omni's batch
        order, and what ``materialize`` needs beyond omnishm's step (the leftovers, snapshotted)."""
        order = list(self._view.batch_req_ids())
        counts = {r: int(self._num_scheduled.get(r, 0)) for r in order}
        try:
            n, padded = int(num_tokens_unpadded), int(num_tokens_padded)
        except (TypeError, ValueError, OverflowError):
            # The counts go to the manager as given: its save refuses them by name, taking the step id and making
            # the step's slots absent. Raised here, before it, a later hit on them served their previous tenant's
            # rows (review, stop 57). The layout is the scheduled tokens'.
            n = padded = sum(counts.values())
        spans, writes, start = {}, [], 0
        for r in order:
            spans[r] = (start, counts[r])
            if counts[r] > 0:
                writes.append(PrefixCacheWrite(r, start, counts[r]))
            start += counts[r]
        tags = None  # rows' token tags (client/tokens.py): known through omnishm's own view of the batch only,
        # and kept by the writer only
        if n <= 0:
            slots = torch.empty(0, dtype=torch.int64)
        elif self._ours is not None and self._ours.batch_req_ids == order:
            ordered = [counts[r] for r in order]
            with self._errors():
                slots = self._ours.step_slots_cpu(ordered)
                if self._m.keeps_token_tags:
                    tags = self._ours.step_token_tags_cpu(ordered, self._m.prompt_chains)
        else:
            slots = self._view.step_slots_cpu(order, counts)
        rows: dict[str, torch.Tensor] = {}
        leftover: dict[str, Any] = {}
        for key, value in (mm_outputs or {}).items():
            if key == HIDDEN_KEY:
                continue  # vllm-omni ignores it too
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and int(value.shape[0]) in (n, padded) and n:
                rows[key] = value
            else:
                leftover[key] = value
        hidden = None
        if self._hidden and hidden_states is not None and n:
            # Too few rows, or slots that disagree with n, are the manager's to refuse: a refused save's slots
            # must become absent (a later hit on them would serve their previous tenant's rows).
            enough = (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 2
                      and hidden_states.shape[0] >= n)
            hidden = hidden_states[:n] if enough else hidden_states
        leftover, event = _snapshot(leftover)
        empty = {key: v.new_empty((0, *v.shape[1:]), device="cpu") for key, v in rows.items()}
        if isinstance(hidden, torch.Tensor):  # another type is omnishm's save's to refuse, by name
            empty[HIDDEN_KEY] = hidden.new_empty((0, *hidden.shape[1:]), device="cpu")
        return (hidden, rows, PrefixCacheWriteLayout(tuple(writes), slots, tags),
                _Saved(spans, n, leftover, event, empty, hidden is not None))

    def materialize(self, step_id: StepId, req_ids: list[ReqId]) -> Any:
        """vllm-omni's ``StageCacheOutputs(hidden_states, mm_outputs)``; consumes ``step_id`` once. Any thread.
        A step id that is no int, or one string for the request ids, is a ``TypeError`` before anything is
        touched (the drop-in's record is keyed by the id omnishm consumes: review, 2026-12-07)."""
        step_id = as_step_id(step_id, "materialize")
        req_ids = list(request_ids(req_ids))
        with self._lock:
            saved = self._saved.get(step_id)
            if saved is not None:
                outside = [r for r in req_ids if r not in saved.spans]
                if outside:  # the step stays unconsumed, as omnishm's own materialize leaves it
                    raise self._vo.OmniPrefixCacheUnmatchError(
                        f"materialize(step {step_id}) got req ids outside the save snapshot: {outside[:8]}")
                del self._saved[step_id]
        with self._errors():  # an unknown or consumed id raises here
            out = self._m.materialize(step_id, req_ids if saved is None else
                                      [r for r in req_ids if saved.spans[r][1] > 0])
        if saved is None:  # omnishm's materialize raised for an id the drop-in never saved: not reached
            raise self._vo.OmniPrefixCacheUnmatchError(f"materialize(step {step_id}): no such saved step")
        hidden = None
        if saved.hidden:
            hidden = {r: out.hidden_states[r] if r in out.hidden_states else saved.empty[HIDDEN_KEY] for r in req_ids}
        mm: dict[str, dict[ReqId, Any]] = {}
        for key in saved.empty:
            if key != HIDDEN_KEY:
                mm[key] = {r: out.mm_outputs[r][key] if r in out.mm_outputs else saved.empty[key] for r in req_ids}
        if saved.leftover:
            leftover = saved.leftover
            if saved.leftover_event is not None:
                saved.leftover_event.synchronize()
                leftover = _map_tensors(_unpin, leftover)
            from vllm_omni.utils.mm_outputs import to_payload_element  # imports vllm, as vllm-omni's does here

            index = {r: i for i, r in enumerate(saved.spans)}  # batch order
            for key, value in leftover.items():
                mm[key] = {}
                for r in req_ids:
                    start, count = saved.spans[r]
                    mm[key][r] = to_payload_element(value, index[r], start=start, end=start + count,
                                                    pass_lists_through=True, seq_len=saved.n)
        return self._vo.StageCacheOutputs(hidden_states=hidden, mm_outputs=mm)

    def discard_step(self, step_id: StepId) -> None:
        """Consume ``step_id`` without reading it (the write still lands). Any thread."""
        step_id = as_step_id(step_id, "discard_step")
        with self._errors():
            self._m.discard_step(step_id)
        with self._lock:
            self._saved.pop(step_id, None)  # only once omnishm took the id: a wrong id changes nothing

    def shutdown(self) -> None:
        """Land open writes and detach from the committer (idempotent)."""
        self._m.shutdown()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Re-raise omnishm's cache errors as vllm-omni's classes, so a vllm-omni ``except`` catches them; the
        message and the ``req_id``, ``key`` and ``step_id`` it names come along."""
        try:
            yield
        except OmniPrefixCacheUnmatchError as exc:
            timed_out = isinstance(exc, OmniPrefixCacheStagingTimeoutError)
            err = (self._vo.OmniPrefixCacheStagingTimeoutError if timed_out else self._vo.OmniPrefixCacheUnmatchError)(
                str(exc))
            err.req_id, err.key, err.step_id = exc.req_id, exc.key, exc.step_id
            raise err from exc


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, inside mappings, lists and tuples too."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(fn, v) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(fn, v) for v in value)
    return value


def _gate(runner: Any, num_blocks: int) -> None:
    """omnishm's refusals (``stage_prefix_cache_config``) for the stage of the vllm-omni runner building the
    drop-in, where it carries vLLM's configs and KV-cache config; raises ``PrefixCacheConfigError``.

    vllm-omni's own gate lets through stages whose prompt rows are not what a hit must serve (KV-sharing
    fast prefill computes a prompt token's final hidden state only where logits are) or whose block
    tables do not address whole-token rows (review): the drop-in refuses them as omnishm's runners do."""
    if runner is None or getattr(runner, "kv_cache_config", None) is None:
        return
    vllm_config = getattr(runner, "vllm_config", None)

    def src(name: str) -> Any:
        return getattr(vllm_config, name) if vllm_config is not None and hasattr(vllm_config, name) \
            else getattr(runner, name, None)

    if src("cache_config") is None:
        return
    stage_prefix_cache_config(kv_cache_config=runner.kv_cache_config, cache_config=src("cache_config"),
                              kv_transfer_config=src("kv_transfer_config"), scheduler_config=src("scheduler_config"),
                              model_config=src("model_config"), is_pooling_model=False,
                              speculative_config=src("speculative_config"), parallel_config=src("parallel_config"),
                              num_blocks=num_blocks)


def _snapshot(values: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """CPU copies of the leftover values, and a CUDA event after them (None when nothing was on CUDA).

    Device tensors go to pinned memory without blocking the engine thread; materialize waits the event.
    Every copy is contiguous, as vllm-omni's ``_snapshot_leftover_mm_cpu`` makes them: a per-request tensor
    made by a transpose comes back one a consumer can ``view`` (review, 2026-12-06).
    """
    cuda = False

    def copy(t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda
        if t.is_cuda:
            cuda = True
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        if t.device.type == "cpu":
            return t.detach().clone(memory_format=torch.contiguous_format)
        return t.detach().to("cpu", memory_format=torch.contiguous_format)

    out = _map_tensors(copy, values)
    event = None
    if cuda:
        event = DeviceEvent()  # waited with its device current, whichever thread waits it
        event.record()
    return out, event


def _unpin(t: torch.Tensor) -> torch.Tensor:
    """A pageable copy of a pinned tensor (the payload must not hold, and keep, pinned pages)."""
    return t.clone() if t.is_pinned() else t


def install() -> bool:
    """Make vllm-omni's runners build ``VllmOmniPrefixCacheManager``; True when installed.

    Rebinds ``vllm_omni.core.prefix_cache.runner_mixin.OmniPrefixCacheManager`` (looked up when the
    runner builds its cache, so call this before the first step). Idempotent; logs and returns False
    when vllm-omni is not installed.
    """
    try:
        load_prefix_cache()
        mixin = importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")
    except ImportError as exc:
        logger.warning("omnishm: vllm-omni's runner mixin cannot be imported (%s); its cache is unchanged", exc)
        return False
    version = _version()
    if version != SUPPORTED:
        logger.warning("omnishm: the drop-in follows vllm-omni %s; this is %s", SUPPORTED, version)
    if mixin.OmniPrefixCacheManager is not VllmOmniPrefixCacheManager:
        mixin.OmniPrefixCacheManager = VllmOmniPrefixCacheManager
        logger.info("omnishm: vllm-omni's omni prefix cache now runs on omnishm (%s)", mixin.__name__)
    _expose_runner(mixin.PrefixCacheRunnerMixin)
    return True


def _expose_runner(mixin_cls: type) -> None:
    """Wrap ``mixin_cls._ensure_omni_prefix_cache`` so the manager it builds sees the runner (``_BUILDING``).

    Idempotent; the wrapper only sets and resets the context variable around vllm-omni's own method.
    """
    orig = mixin_cls._ensure_omni_prefix_cache
    if getattr(orig, "__omnishm_wrapped__", False):
        return

    @functools.wraps(orig)
    def _ensure_omni_prefix_cache(self: Any) -> Any:
        token = _BUILDING.set(self)
        try:
            return orig(self)
        finally:
            _BUILDING.reset(token)

    _ensure_omni_prefix_cache.__omnishm_wrapped__ = True  # type: ignore[attr-defined]
    mixin_cls._ensure_omni_prefix_cache = _ensure_omni_prefix_cache
