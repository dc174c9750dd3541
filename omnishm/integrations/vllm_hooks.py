"""The cache's hooks on one vLLM model runner: what each engine step does around the runner's ``execute_model``.

``OmniPrefixCacheRunnerHooks`` wraps ``execute_model`` on a runner *instance* (V1's persistent ``input_batch``,
or V2's scheduler-output views: ``client/v2_view.py``): step begin, the runner's own step, the save, and
``materialize`` into each request's accumulated prompt rows. The worker extension that installs them and its
RPC methods are ``omnishm/integrations/vllm.py``, whose docstring is the user's guide. Every hook runs on the
engine (worker) thread.

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
from omnishm.integrations.held_results import HeldResults
from omnishm.interface import ModelCachePolicy, PrefixCacheConfig, ReqId

logger = logging.getLogger("omnishm.integrations.vllm")  # the integration's one logger, as before the split

__all__ = ["OmniPrefixCacheRunnerHooks", "external_req_id"]

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
