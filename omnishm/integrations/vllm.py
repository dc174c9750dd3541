"""Run the omni prefix cache inside a vLLM v1 engine through public extension points.

Enable it with one argument::

    LLM(model, enable_prefix_caching=True,
        worker_extension_cls="omnishm.integrations.vllm.OmniPrefixCacheWorkerExtension")

The hooks run on vLLM's V1 model runner (its persistent ``input_batch``; the CPU build's runner) and on its V2
runner (vLLM 0.34's only one, the default of 0.32/0.33 GPU builds), whose block table is on the device: there
each request's block ids come from the scheduler outputs (``client/v2_view.py``) and the batch order from the
step's own ``InputBatch``. A runner of neither family is refused at install (``runner_mixin.check_v1_runner``).

vLLM mixes ``OmniPrefixCacheWorkerExtension`` into its worker class. When the
worker assigns ``self.model_runner`` (in ``init_device``) the extension wraps
``execute_model`` on that runner *instance* (no vLLM class is patched):

1. step begin: ``PrefixCacheSchedulerAdapter.translate_scheduler_output`` and
   ``OmniPrefixCacheManager.new_step_starts``, BEFORE the runner's
   ``_update_states`` drops finished requests;
2. the runner's own ``execute_model`` (``_update_states`` + forward);
3. save: the first ``num_tokens_unpadded`` rows of
   ``runner.execute_model_state.hidden_states`` (``input_batch.req_ids``
   order) with the write layout built from the CPU block table of the
   runner's *current* ``input_batch``;
4. ``materialize`` with the save-time request ids. The merged rows (cached
   prefix + this step) are accumulated per request up to its prompt length, so
   each request ends with its whole prompt's hidden states, retrievable with
   ``llm.collective_rpc("omnishm_take_prompt_hidden")`` (or ``omnishm_take_results``
   across vLLM's engine-core process). They are held until taken, up to
   ``$OMNISHM_VLLM_HELD_BYTES`` (default 1 GiB); beyond it the oldest are
   dropped and counted in ``results_dropped``. ``$OMNISHM_VLLM_CAPTURE_RAW=1``
   also keeps each no-hit prompt's rows read straight from the runner, for
   ``omnishm_take_raw_prompt_hidden`` (a check of the cache; off by default).

The manager is built on the first real step (the KV-cache config is known
then), with ``autostart=True`` (an embedded committer) and the cache named by
``$OMNISHM_NAME`` (or its alias ``$OMNISHM_CACHE``, or the TOML ``name``; default ``"default"``;
``<name>-dp<k>`` for data-parallel replica k > 0, ``runner_mixin.replica_cache_name``). Call
``llm.collective_rpc("omnishm_shutdown")`` before the engine goes away: it
detaches from the committer (which exits when idle and removes its segments)
and removes the hooks. ``omnishm_install`` re-installs them; do it only on a
fresh vLLM prefix cache (``llm.reset_prefix_cache()``), because a new cache
holds none of the rows behind vLLM's existing hits.

Request ids are the runner's internal ids (vLLM appends ``-<8 chars>`` to the
caller's id); ``external_req_id`` strips that suffix.

Threads: every hook runs on the engine (worker) thread; the RPC methods run on
the thread vLLM uses for ``collective_rpc`` (the same thread in both the
in-process and the engine-core-process setups), and the held results
(``HeldResults``) take a lock of their own anyway. Errors from the cache (``OmniPrefixCacheUnmatchError``
and subclasses) propagate into vLLM: they are fatal by contract.

Import invariant: vllm is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from typing import Any, Iterator

import torch

from omnishm.client.adapter import PrefixCacheEventKind, PrefixCacheSchedulerAdapter
from omnishm.client.group_view import (
    PrefixCacheConfigError,
    get_prefix_cache_group_view,
    naming_the_cache,
    stage_prefix_cache_config,
)
from omnishm.client.manager import OmniPrefixCacheManager
from omnishm.client.runner_mixin import (
    check_v1_runner,
    replica_cache_name,
    stage_cache_name,
    vllm_last_pp_stage,
    vllm_runner_role,
)
from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView, is_v2_runner
from omnishm.integrations.held_results import HeldResults, decode_results, decode_tensor, encode_tensor
from omnishm.interface import ModelCachePolicy, PrefixCacheConfig, ReqId

logger = logging.getLogger(__name__)

__all__ = ["OmniPrefixCacheWorkerExtension", "OmniPrefixCacheRunnerHooks", "external_req_id", "EXTENSION_CLS",
           "encode_tensor", "decode_tensor", "decode_results"]

EXTENSION_CLS = "omnishm.integrations.vllm.OmniPrefixCacheWorkerExtension"

_K = PrefixCacheEventKind
_SCHEDULED_KINDS = (_K.STARTED, _K.REPLACED, _K.RESUMED, _K.EXTENDED)


def external_req_id(internal_req_id: str) -> str:
    """The caller's request id: vLLM's runner id minus its ``-<8 chars>`` suffix."""
    head, sep, tail = internal_req_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_req_id


class _PromptRows:
    """One request's accumulated full-prompt rows (engine thread only)."""

    __slots__ = ("prompt_len", "parts", "length", "hit_tokens")

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.parts: list[torch.Tensor] = []
        self.length = 0
        self.hit_tokens = 0

    def add(self, start: int, rows: torch.Tensor) -> bool:
        """Rows for prompt positions ``start ..``; True when the prompt is complete.

        A start before the accumulated length (a preempted request recomputed
        from its hit) drops the rows from ``start`` on; a start past it would
        leave a hole and raises ``RuntimeError`` (the accumulation is broken).
        """
        if start > self.length:
            raise RuntimeError(f"prompt rows jump from position {self.length} to {start}")
        if start < self.length:
            kept = torch.cat(self.parts)[:start] if self.parts else rows[:0]
            self.parts = [kept] if start else []
            self.length = start
        take = rows[:max(0, self.prompt_len - start)]
        if take.shape[0]:
            self.parts.append(take)
            self.length += int(take.shape[0])
        return self.length >= self.prompt_len

    def tensor(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) != 1 else self.parts[0]


class OmniPrefixCacheRunnerHooks:
    """The cache's hooks on one vLLM v1 model runner (``GPUModelRunner`` or a subclass).

    ``install`` wraps ``runner.execute_model`` on the instance; ``uninstall``
    shuts the manager down and removes the wrapper. Engine thread only, apart
    from the ``take_*``/``stats`` readers (``HeldResults`` locks).
    """

    def __init__(self, runner: Any, *, cache: str | None = None, capture_raw: bool | None = None,
                 held_bytes: int | None = None, held: "HeldResults | None" = None) -> None:
        self._passing_through = 0
        """Nonzero inside ``passing_through`` (the worker's warm-up)."""
        self._step_unsaved = False
        """Between this step's ``new_step_starts`` and its ``save_outputs``: an exception then turns the cache
        sticky (``OmniPrefixCacheManager.note_unsaved_step``). Reset as each ``execute_model`` begins."""
        self._mirror: BlockIdMirror | None = None
        """vLLM's V2 runner (``is_v2_runner``): each request's block ids, from the scheduler outputs; None on V1."""
        if is_v2_runner(runner):
            self._mirror = BlockIdMirror()
        else:
            check_v1_runner(runner)
        self.runner = runner
        from omnishm.config import client_settings

        # Unless given: OMNISHM_NAME (or its alias OMNISHM_CACHE), OMNISHM_VLLM_CAPTURE_RAW,
        # OMNISHM_VLLM_HELD_BYTES, the TOML file, then the defaults, by the committer's rules (omnishm.config).
        settings = client_settings()
        self.cache = cache or settings.name
        self._cache_given = cache
        """The name passed in, or None: the manager then resolves name and endpoint from OMNISHM_* and the
        file; a name given without an endpoint means that cache's own socket (``config.manager_connection``)."""
        self.capture_raw = settings.vllm["vllm_capture_raw"] if capture_raw is None else bool(capture_raw)
        self.held = held if held is not None else HeldResults(
            settings.vllm["vllm_held_bytes"] if held_bytes is None else int(held_bytes))
        """Completed rows kept for the takers (``held_bytes``). Given: the worker's, which outlives these hooks
        (``OmniPrefixCacheWorkerExtension``), so what they completed is still taken after their shutdown."""
        self.manager: OmniPrefixCacheManager | None = None
        self.disabled = False
        self._last_manager_stats: dict[str, Any] = {}  # of the manager ``uninstall`` let go
        self._adapter = PrefixCacheSchedulerAdapter()
        self._block_size = 0
        self._num_blocks = 0
        self._orig_execute: Any = None
        self._orig_init_kv: Any = None
        self._prompts: dict[ReqId, _PromptRows] = {}
        self._raw: dict[ReqId, _PromptRows] = {}
        self.counters: dict[str, int] = {k: 0 for k in (
            "steps", "saves", "rows_saved", "requests", "hit_requests", "hit_tokens", "rows", "raw_requests",
            "incomplete_dropped", "max_hit_requests_per_step", "prompts_abandoned", "raw_abandoned",
            "kv_init_gated")}

    @property
    def held_bytes(self) -> int:
        """The bound on the rows held for the takers."""
        return self.held.bound

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        """Wrap ``execute_model`` and ``initialize_kv_cache`` on the runner instance (idempotent).

        The seed refuses an unsupported stage (hybrid or multi-group KV cache, KV transfer consumer,
        speculative decoding, ...) at KV-cache init, not at the first step: ``initialize_kv_cache`` runs the
        gate (``stage_prefix_cache_config``) after vLLM's own, and its ``PrefixCacheConfigError`` fails the
        engine's start. Installed on a runner whose KV cache is already initialised (``omnishm_install``
        after ``omnishm_shutdown``), the gate runs here and raises the same. The manager is still built on
        the first real step.
        """
        if self._orig_execute is not None:
            return
        runner = self.runner
        if self._mirror is not None and not len(self._mirror):
            self._mirror.seed(runner)  # requests already running (installed again after a shutdown)
        if getattr(runner, "kv_cache_config", None) is not None:
            self._stage_config()  # raises for an unsupported stage before anything is wrapped
        self._orig_execute = runner.execute_model  # bound method of the class
        hooks = weakref.proxy(self)

        def execute_model(scheduler_output: Any, intermediate_tensors: Any = None, **kwargs: Any) -> Any:
            return hooks.execute_model(scheduler_output, intermediate_tensors, **kwargs)

        execute_model.__omnishm_hooks__ = True  # type: ignore[attr-defined]
        runner.execute_model = execute_model
        orig_init = getattr(runner, "initialize_kv_cache", None)
        if orig_init is not None and not getattr(orig_init, "__omnishm_hooks__", False):
            self._orig_init_kv = orig_init  # held here, as execute_model's: the wrapper keeps no runner alive

            def initialize_kv_cache(*args: Any, **kwargs: Any) -> Any:
                out = hooks._orig_init_kv(*args, **kwargs)
                if not kwargs.get("is_profiling", False):  # a GPU runner's minimal config for CUDA graph profiling
                    hooks._stage_config()
                    hooks.counters["kv_init_gated"] += 1
                return out

            initialize_kv_cache.__omnishm_hooks__ = True  # type: ignore[attr-defined]
            runner.initialize_kv_cache = initialize_kv_cache

    def uninstall(self) -> dict[str, Any]:
        """Shut the manager down (flush, detach) and remove the wrapper; returns final stats. Idempotent. A
        manager shut down is let go, its last stats kept: its segment views go with it (LIMITS.md, trap 11)."""
        try:
            if self.manager is not None:
                self.manager.shutdown()
        finally:
            for name in ("execute_model", "initialize_kv_cache"):
                if getattr(self.runner.__dict__.get(name), "__omnishm_hooks__", False):
                    del self.runner.__dict__[name]
            self._orig_execute = self._orig_init_kv = None
        if self.manager is not None and self.manager.shut_down:
            self._last_manager_stats = self._manager_stats(self.manager)
            self.manager = None
        return self.stats()

    @staticmethod
    def _manager_stats(m: OmniPrefixCacheManager) -> dict[str, Any]:
        # role: "writer" on TP rank 0 of the last PP stage; client_id as the committer's status lists it
        return {"manager": dict(m.counters), "num_slots": m.config.num_slots, "role": m.role, "client_id": m.client_id}

    # ------------------------------------------------------------------ engine thread

    def _stage_config(self) -> PrefixCacheConfig | None:
        """The gate on the runner's current KV-cache config: the cache's config, None when the stage runs no
        cache (prefix caching off, pooling). Raises ``PrefixCacheConfigError`` for an unsupported stage."""
        r = self.runner
        vc = r.vllm_config
        with naming_the_cache(lambda: stage_cache_name(self._cache_given, parallel_config=vc.parallel_config)):
            return stage_prefix_cache_config(
                kv_cache_config=r.kv_cache_config, cache_config=r.cache_config,
                kv_transfer_config=vc.kv_transfer_config, scheduler_config=vc.scheduler_config,
                model_config=vc.model_config, is_pooling_model=bool(getattr(r, "is_pooling_model", False)),
                speculative_config=vc.speculative_config, parallel_config=vc.parallel_config)

    def _ensure_manager(self) -> OmniPrefixCacheManager | None:
        """One-shot construction on the first real step (KV-cache config known then)."""
        if self.manager is not None or self.disabled:
            return self.manager
        r = self.runner
        vc = r.vllm_config
        cfg = self._stage_config()
        if cfg is None:
            logger.info("omnishm: prefix caching is off (or a pooling stage); hooks pass through")
            self.disabled = True
            return None
        if not vllm_last_pp_stage():
            # Its forward hands IntermediateTensors to the next stage, not hidden states; under
            # external_launcher vLLM still records them as the step's (broadcast_pp_output).
            logger.info("omnishm: not the last pipeline stage; hooks pass through")
            self.disabled = True
            return None
        self._block_size = cfg.block_size
        self._num_blocks = cfg.num_blocks
        # Endpoint, autostart, runtime dir and connect timeout come from OMNISHM_* / the TOML file, by the
        # manager's rule (a cache name given to install() without an endpoint: that cache's own socket).
        cache = replica_cache_name(self._cache_given, parallel_config=vc.parallel_config)
        manager = OmniPrefixCacheManager(cfg, role=vllm_runner_role(), cache=cache)
        self.cache = manager.cache
        try:
            model = r.get_model() if hasattr(r, "get_model") else getattr(r, "model", None)
            manager.register_policy(ModelCachePolicy.from_model(model))
        except BaseException:
            manager.shutdown()
            raise
        self.manager = manager
        logger.info("omnishm: cache %s on %d blocks x %d (staging %d tokens)", self.cache, cfg.num_blocks,
                    cfg.block_size, cfg.staging_capacity_tokens)
        return manager

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None, **kwargs: Any) -> Any:
        """The runner's ``execute_model`` with the cache's step around it. ``kwargs``: the V2 runner's own
        (``dummy_run=True`` from its ``_dummy_run``: a warm-up or profile forward, passed straight through)."""
        so = scheduler_output
        self._step_unsaved = False
        try:
            if self._passing_through or kwargs.get("dummy_run"):
                return self._orig_execute(so, intermediate_tensors, **kwargs)
            return self._execute_step(so, intermediate_tensors, kwargs)
        except BaseException as exc:
            # Any exception between new_step_starts and save_outputs (the forward, the layout) and a signal
            # handler's anywhere in the step turn the cache sticky: an engine that went on was served the step's
            # slots' previous tenant's rows (review, stop 58: a sweep of interrupts after every C call).
            if self.manager is not None:
                self.manager.note_interrupt("execute_model", exc)  # first: a signal's says so
                if self._step_unsaved:
                    self.manager.note_unsaved_step("execute_model", exc)
            raise

    def _execute_step(self, so: Any, intermediate_tensors: Any, kwargs: dict[str, Any]) -> Any:
        """``execute_model``'s step: the runner's forward with the cache's calls around it."""
        orig = functools.partial(self._orig_execute, **kwargs) if kwargs else self._orig_execute
        if self._mirror is not None:
            self._mirror.update(so)  # every real step, as the runner updates its own block table
        n = int(so.total_num_scheduled_tokens)
        idle = n == 0 and not so.finished_req_ids and not getattr(so, "aborted_req_ids", None)
        if self.disabled or (idle and self.manager is None):
            return orig(so, intermediate_tensors)  # dummy/profile step before the first real one: nothing to track
        manager = self._ensure_manager()
        if manager is None:
            return orig(so, intermediate_tensors)
        if self.runner.kv_cache_config.num_blocks > self._num_blocks:
            self._refuse_grown_kv_cache()
        # Every step once the manager exists, idle ones too: a step that schedules nothing may still report
        # preempted_req_ids, which the adapter needs to tell a later re-add (a resume) from a replacement.
        step = self._adapter.translate_scheduler_output(so)
        if idle and not step.events:
            return orig(so, intermediate_tensors)
        manager.new_step_starts(step)  # before _update_states (inside orig) drops finished requests
        self._step_unsaved = True  # until save_outputs has the step (it makes a refused step's slots absent)
        self.counters["steps"] += 1
        computed: dict[ReqId, int] = {}
        resumed: set[ReqId] = set()
        for ev in step.events:
            if ev.kind in (_K.FINISHED, _K.ABORTED):
                self._drop(ev.req_id)
            elif ev.kind in _SCHEDULED_KINDS:
                computed[ev.req_id] = ev.num_computed_tokens
                if ev.kind is _K.RESUMED:
                    resumed.add(ev.req_id)
        for new in so.scheduled_new_reqs:
            if new.req_id in resumed and new.req_id in self._prompts:
                # The V2 runner's resume: re-sent as new. Its prompt rows so far stay (V1 resumes it as a
                # cached request): a prompt completed before the preemption must not complete twice.
                continue
            if new.prompt_token_ids is not None:
                plen = len(new.prompt_token_ids)
            else:
                plen = int(new.prompt_embeds.shape[0])
            self._prompts[new.req_id] = _PromptRows(plen)
            if self.capture_raw:
                self._raw[new.req_id] = _PromptRows(plen) if new.num_computed_tokens == 0 else None

        out = orig(so, intermediate_tensors)
        if n == 0:
            return out
        state = self.runner.execute_model_state
        if state is None:  # pooling / non-last PP rank returned early: no hidden states to save
            return out
        hidden = state.hidden_states
        if self._mirror is not None:
            view: Any = V2StepGroupView(state.input_batch, self._mirror, self._block_size)
        else:
            view = get_prefix_cache_group_view(self.runner.input_batch, self._block_size)
            if view is None:
                raise RuntimeError("omnishm: the runner's input batch has no block table")
        layout = self._adapter.build_write_layout(view, so.num_scheduled_tokens, token_tags=manager.keeps_token_tags,
                                                  chains=manager.prompt_chains)
        self._step_unsaved = False
        step_id = manager.save_outputs(hidden, None, num_tokens_unpadded=n,
                                       num_tokens_padded=int(hidden.shape[0]), write_layout=layout)
        self.counters["saves"] += 1
        self.counters["rows_saved"] += n
        merged = manager.materialize(step_id, layout.req_ids)
        self._accumulate(merged, computed)
        if self.capture_raw:
            for w in layout.writes:
                raw = self._raw.get(w.req_id)
                if raw is not None and raw.length < raw.prompt_len:
                    start = computed.get(w.req_id, raw.length)
                    if start > raw.length:  # resumed past its own rows (a longer hit): no full raw prompt
                        self._raw[w.req_id] = None
                        self.counters["raw_abandoned"] += 1
                        continue
                    rows = hidden[w.token_start:w.token_start + w.num_tokens].detach().to("cpu", copy=True)
                    if raw.add(start, rows):
                        self.held.hold("raw", w.req_id, raw.tensor())
                        self.counters["raw_requests"] += 1
        return out

    def _refuse_grown_kv_cache(self) -> None:
        """Raise ``PrefixCacheConfigError``: the runner's KV cache has more blocks than the pool was sized for.

        The pool is sized once, from ``kv_cache_config.num_blocks`` at the first real step; a slot past it
        would otherwise be refused later by ``save_outputs`` as "slots outside the pool", which names no
        cause. vLLM 0.34's extensible KV cache settles its size (``extend_kv_cache``) before the engine
        serves, so this is not expected; the check keeps a later vLLM that grows it while serving loud and
        clear. Engine thread; raised before the step reaches the runner."""
        grown = int(self.runner.kv_cache_config.num_blocks)
        raise PrefixCacheConfigError(
            f"omnishm: cache {self.cache}: the runner's KV cache grew to {grown} blocks after the cache's pool "
            f"was sized for {self._num_blocks} (at its first step); the pool cannot mirror the new blocks. "
            f"Start the engine with a fixed KV cache (--no-enable-extensible-kv-cache on vLLM 0.34)")

    @contextlib.contextmanager
    def passing_through(self) -> Iterator[None]:
        """Every ``execute_model`` inside passes straight to the runner: nothing tracked, saved or held. For
        the worker's ``compile_or_warm_up_model``: on vLLM's V2 runner its kernel warm-up (``warmup_kernels``:
        at engine start, and during serving in elastic EP's ``warm_and_capture``) runs made-up requests on
        made-up block ids through the worker's ``execute_model``. Seen by the hooks, they were held as
        results, and their rows overwrote the pool rows of live cached blocks that later hits read (review,
        stop 47: 12 wrong rows of a 96-token hit). Engine thread."""
        self._passing_through += 1
        try:
            yield
        finally:
            self._passing_through -= 1

    def _accumulate(self, merged: Any, computed: dict[ReqId, int]) -> None:
        step_hits = sum(1 for h in merged.num_hit_tokens.values() if h)
        self.counters["max_hit_requests_per_step"] = max(self.counters["max_hit_requests_per_step"], step_hits)
        for rid, rows in merged.hidden_states.items():
            acc = self._prompts.get(rid)
            if acc is None or rows is None or acc.length >= acc.prompt_len:
                continue  # unknown, hidden not cached, or prompt already complete (decode / recompute)
            hit = int(merged.num_hit_tokens.get(rid, 0))
            start = computed[rid] - hit
            if start >= acc.prompt_len:
                continue  # decode token: not a prompt row
            if start > acc.length:
                # Rows past a gap: a live id sent again as new (vLLM's REPLACED: streaming input), whose
                # earlier rows this tracker no longer has. Never raise into vLLM's execute_model.
                self._prompts.pop(rid, None)
                self.counters["prompts_abandoned"] += 1
                logger.warning("omnishm: request %s: prompt rows resume at position %d after %d; its "
                               "full-prompt rows are not collected", rid, start, acc.length)
                continue
            acc.hit_tokens = max(acc.hit_tokens, hit)
            if acc.add(start, rows):
                self.held.hold("done", rid, (acc.tensor(), acc.hit_tokens))
                self.counters["requests"] += 1
                self.counters["rows"] += acc.prompt_len
                if acc.hit_tokens:
                    self.counters["hit_requests"] += 1
                    self.counters["hit_tokens"] += acc.hit_tokens
                acc.parts = []  # the tensor is held now

    def _drop(self, rid: ReqId) -> None:
        acc = self._prompts.pop(rid, None)
        self._raw.pop(rid, None)
        if acc is not None and acc.length < acc.prompt_len:
            self.counters["incomplete_dropped"] += 1  # finished/aborted before its prompt was computed

    # ------------------------------------------------------------------ readers (any thread)

    def take_results(self) -> dict[ReqId, tuple[torch.Tensor, int]]:
        """Completed requests since the last take: ``{runner req id: (prompt rows [P, H], hit tokens)}``.

        Hit tokens: the longest prefix hit over the request's schedulings. A request preempted and
        scheduled again with a longer hit reports that one, where vLLM's ``num_cached_tokens`` keeps the
        first scheduling's (a real-engine soak, 2026-12-02: 27 preempted requests of 8,093; their rows
        were right).
        """
        return self.held.take("done")

    def take_raw(self) -> dict[ReqId, torch.Tensor]:
        """Full-prompt hidden states read straight from the runner, for requests that had no hit."""
        return self.held.take("raw")

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counters, **self.held.stats()}
        out["cache"] = self.cache
        out["pid"] = os.getpid()
        out["runner"] = "v2" if self._mirror is not None else "v1"  # the model runner family the hooks follow
        out.update(self._manager_stats(self.manager) if self.manager is not None else self._last_manager_stats)
        return out


class OmniPrefixCacheWorkerExtension:
    """vLLM worker extension (``worker_extension_cls``) that installs the cache's runner hooks.

    vLLM appends this class to the worker's bases, so it cannot override worker
    methods; it intercepts the ``model_runner`` attribute instead (a data
    descriptor here wins over the instance dict): when the worker assigns its
    runner, the hooks are installed on that instance. They are installed only
    if this engine's ``worker_extension_cls`` names this class (vLLM mutates the
    worker class for the whole process, so a later engine without the argument
    also inherits it). RPC methods (``llm.collective_rpc("name")``):
    ``omnishm_install``, ``omnishm_shutdown``, ``omnishm_take_prompt_hidden``,
    ``omnishm_take_results``, ``omnishm_take_raw_prompt_hidden``, ``omnishm_stats``.
    """

    @property
    def model_runner(self) -> Any:
        return self.__dict__.get("_omnishm_model_runner")

    @model_runner.setter
    def model_runner(self, runner: Any) -> None:
        old = self.__dict__.get("_omnishm_hooks")
        if old is not None and old.runner is not runner:
            self._omnishm_retire(old)
        self.__dict__["_omnishm_model_runner"] = runner
        if runner is not None and self._omnishm_enabled():
            self.omnishm_install()

    def _omnishm_enabled(self) -> bool:
        cfg = getattr(self, "vllm_config", None)
        wanted = getattr(getattr(cfg, "parallel_config", None), "worker_extension_cls", None)
        return wanted == EXTENSION_CLS or wanted is OmniPrefixCacheWorkerExtension

    def _omnishm_hooks_or_none(self) -> OmniPrefixCacheRunnerHooks | None:
        return self.__dict__.get("_omnishm_hooks")

    def _omnishm_retire(self, hooks: OmniPrefixCacheRunnerHooks) -> dict[str, Any]:
        """Uninstall ``hooks`` and let them go (they hold the old runner, whose model and KV cache must go):
        what they completed stays in the worker's ``HeldResults`` for the ``omnishm_take_*`` calls (a
        shutdown used to drop it, uncounted; review, 2026-12-05). Let go once their manager's shutdown ran to
        its end: one that a signal handler's exception cut short, or one made inside this thread's own, leaves
        them here, and the next shutdown finishes it."""
        stats = hooks.uninstall()
        done = hooks.manager is None or hooks.manager.shut_down  # not yet inside this thread's own shutdown
        if done and self.__dict__.get("_omnishm_hooks") is hooks:
            del self.__dict__["_omnishm_hooks"]
        return stats

    def _omnishm_held(self) -> HeldResults:
        """The worker's completed rows, within ``vllm_held_bytes``, shared by all its hooks in turn."""
        held = self.__dict__.get("_omnishm_held_results")
        if held is None:
            from omnishm.config import client_settings

            held = self.__dict__["_omnishm_held_results"] = HeldResults(client_settings().vllm["vllm_held_bytes"])
        return held

    def omnishm_install(self, cache: str | None = None) -> bool:
        """Install the hooks on the current model runner; False without a runner. Raises
        ``PrefixCacheConfigError`` when the runner's KV cache is initialised already and the stage is
        unsupported (no hooks are kept then).

        Idempotent while hooks are installed (``cache`` is then ignored). After
        ``omnishm_shutdown`` it makes fresh hooks on cache ``cache`` (default
        the configured name); reset vLLM's prefix cache first, a new cache holds
        none of the rows behind vLLM's existing hits.
        """
        runner = self.model_runner
        if runner is None:
            return False
        hooks = self._omnishm_hooks_or_none()
        if hooks is not None and ((hooks.manager is not None and hooks.manager.closed) or hooks.runner is not runner):
            self._omnishm_retire(hooks)  # a shutdown cut short (it kept them) or another runner's: finished first
            hooks = None
        if hooks is not None:
            hooks.install()
            return True
        hooks = OmniPrefixCacheRunnerHooks(runner, cache=cache, held=self._omnishm_held())
        hooks.install()  # the gate may refuse (KV cache initialised already): then nothing is kept (review)
        self.__dict__["_omnishm_hooks"] = hooks
        self._omnishm_wrap_warm_up()
        return True

    def _omnishm_wrap_warm_up(self) -> None:
        """Wrap the worker's ``compile_or_warm_up_model`` on the instance (once): the hooks pass through while
        it runs (``OmniPrefixCacheRunnerHooks.passing_through``). vLLM calls it by name on the worker
        (``collective_rpc``), so the instance attribute is the one called."""
        orig = getattr(self, "compile_or_warm_up_model", None)
        if orig is None or getattr(orig, "__omnishm_hooks__", False):
            return
        worker = weakref.proxy(self)

        def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
            hooks = worker._omnishm_hooks_or_none()
            with hooks.passing_through() if hooks is not None else contextlib.nullcontext():
                return orig(*args, **kwargs)

        compile_or_warm_up_model.__omnishm_hooks__ = True  # type: ignore[attr-defined]
        self.__dict__["compile_or_warm_up_model"] = compile_or_warm_up_model

    def omnishm_shutdown(self) -> dict[str, Any]:
        """Flush and detach the manager, remove the hooks; returns the final stats ({} if none). Results
        completed before it stay for the ``omnishm_take_*`` calls."""
        hooks = self._omnishm_hooks_or_none()
        return self._omnishm_retire(hooks) if hooks is not None else {}

    def omnishm_take_prompt_hidden(self) -> dict[ReqId, torch.Tensor]:
        """``{runner req id: full-prompt hidden states [P, H]}`` completed since the last take.

        Returns tensors: fine in-process; across vLLM's engine-core process
        boundary use ``omnishm_take_results`` (plain types) instead, unless
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
        """
        return {rid: t for rid, (t, _h) in self._omnishm_held().take("done").items()}

    def omnishm_take_results(self) -> dict[ReqId, dict[str, Any]]:
        """Completed requests as plain types (crosses vLLM's msgpack RPC): see ``decode_results``.

        ``{runner req id: {"hidden": encoded [P, H], "hit_tokens": int}}`` (hit tokens as in ``take_results``).
        """
        return {rid: {"hidden": encode_tensor(t), "hit_tokens": int(h)}
                for rid, (t, h) in self._omnishm_held().take("done").items()}

    def omnishm_take_raw_prompt_hidden(self) -> dict[ReqId, dict[str, Any]]:
        """Full-prompt hidden states read directly from the runner for requests without a hit (encoded)."""
        return {rid: encode_tensor(t) for rid, t in self._omnishm_held().take("raw").items()}

    def omnishm_stats(self) -> dict[str, Any]:
        """The installed hooks' stats; without hooks, what is still held for the takes ({} if nothing ever
        was)."""
        hooks = self._omnishm_hooks_or_none()
        if hooks is not None:
            return hooks.stats()
        held = self.__dict__.get("_omnishm_held_results")
        return {} if held is None else held.stats()
