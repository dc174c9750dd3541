"""Runner-facing access layer for the omni prefix cache.

``PrefixCacheRunnerMixin`` is mixed into a vLLM ``GPUModelRunner``-like class
(vLLM 0.32: ``CPUModelRunner`` subclasses ``GPUModelRunner``). It is thin
wiring: the cache state lives in ``OmniPrefixCacheManager``; the mixin only
holds the manager, the scheduler adapter, the policy snapshot and the
save-time request ids of each unconsumed step id.

How a runner uses it (engine thread unless noted)::

    model loaded            -> self._prefix_cache_load_policy(model)
    execute_model(so):
        self.prefix_cache_step_begin(so)        # BEFORE _update_states
        self._update_states(so); ...forward...
        step_id = self.prefix_cache_save(hidden, mm, n_unpadded, n_padded, so)
    any thread, once per step id:
        out = self.prefix_cache_materialize(step_id)   # or prefix_cache_discard(step_id)
    shutdown                -> self.prefix_cache_shutdown()

What the mixin reads from the runner (all vLLM 0.32 ``GPUModelRunner``
attributes): ``vllm_config`` (or ``cache_config``/``scheduler_config``/
``model_config``/``speculative_config``/``parallel_config``/
``kv_transfer_config``), ``kv_cache_config``, ``is_pooling_model``, ``input_batch`` (read at every save:
vLLM may re-create it) and ``get_model()``. Knobs, settable on the class or
instance: ``prefix_cache_name`` (the committer cache, e.g. the stage name),
``prefix_cache_endpoint``, ``prefix_cache_autostart``, ``prefix_cache_eager``,
``prefix_cache_role`` (None: chosen from TP/PP rank at run time) and
``prefix_cache_config_overrides`` (``PrefixCacheConfig`` fields replacing the
gate's sizing, e.g. ``{"staging_depth": 8}``).

Import invariant: vllm is only imported inside ``_prefix_cache_role``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from omnishm.client.adapter import PrefixCacheSchedulerAdapter, PrefixCacheStep
from omnishm.client.group_view import FullAttentionGroupView, naming_the_cache, stage_prefix_cache_config
from omnishm.client.steps import as_step_id, request_ids
from omnishm.interface import (
    ModelCachePolicy,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    unmatch,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from omnishm.client.manager import OmniPrefixCacheManager

logger = logging.getLogger(__name__)

__all__ = ["PrefixCacheRunnerMixin"]


def _total_scheduled(scheduler_output: Any) -> int:
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if total is None:
        total = sum((getattr(scheduler_output, "num_scheduled_tokens", None) or {}).values())
    return int(total)


def _vllm_ranks() -> tuple[int, bool] | None:
    """(TP rank, whether on the last PP stage) from vLLM's parallel state at call time, or None when vllm
    is absent or its parallel groups are not initialised (single-process tests, offline tools). vllm is
    imported here, never at module scope."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        return ps.get_tensor_model_parallel_rank(), bool(ps.get_pp_group().is_last_rank)
    except (AssertionError, AttributeError, RuntimeError) as exc:
        logger.warning("omni prefix cache: cannot read TP/PP rank (%s); acting as TP rank 0 of the last "
                       "stage", exc)
        return None


V1_RUNNER_ATTRS = ("execute_model", "_update_states", "execute_model_state", "input_batch")
"""What the hooks and the mixin read of vLLM's V1 ``GPUModelRunner`` family (the runner's persistent
``input_batch`` and its ``_update_states``); vLLM's V2 runner has neither."""


def check_v1_runner(runner: Any, attrs: Iterable[str] = V1_RUNNER_ATTRS) -> None:
    """Raise ``RuntimeError`` when ``runner`` lacks one of ``attrs`` of vLLM's V1 model-runner family, with the
    remedy this vLLM allows. vLLM 0.32 and 0.33 keep the V1 runner beside the V2 one they pick on GPU builds
    (``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1); vLLM 0.34 removed it, and refuses that variable, so on 0.34
    the message names what works rather than a setting that vLLM rejects (review, stop 47). The worker
    extension's hooks check a V2 runner apart (``client/v2_view.is_v2_runner``) and call this for the rest.
    vllm is imported here, never at module scope."""
    missing = [attr for attr in attrs if not hasattr(runner, attr)]
    if not missing:
        return
    name = type(runner).__name__
    try:
        import importlib.util

        import vllm
        has_v1 = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
        version = getattr(vllm, "__version__", "?")
    except ImportError:  # not in a vLLM process (a stand-in runner): the setting is the remedy
        has_v1, version = True, "?"
    if not has_v1:
        raise RuntimeError(f"omnishm: vLLM {version} has no V1 model runner (vLLM 0.34 removed it), and model "
                           f"runner {name} has no {', '.join(map(repr, missing))}; PrefixCacheRunnerMixin needs "
                           "the V1 runner: use vLLM 0.32 or 0.33 with VLLM_USE_V2_MODEL_RUNNER=0 on a GPU build, "
                           "or omnishm's worker extension (omnishm.integrations.vllm), which runs on V2")
    raise RuntimeError(f"omnishm: model runner {name} has no {', '.join(map(repr, missing))}; the vLLM "
                       "integration needs the V1 GPUModelRunner family (set VLLM_USE_V2_MODEL_RUNNER=0)")


def vllm_runner_role() -> str:
    """``"writer"`` iff this process is TP rank 0 of the last PP stage, else ``"reader"``; ``"writer"``
    when vLLM's parallel state cannot be read (``_vllm_ranks``)."""
    ranks = _vllm_ranks()
    return "writer" if ranks is None or ranks == (0, True) else "reader"


def vllm_last_pp_stage() -> bool:
    """Whether this process is on the last pipeline stage, the one whose forward returns the model's final
    hidden states (an earlier stage's are ``IntermediateTensors`` for the next stage); True when vLLM's
    parallel state cannot be read, as ``vllm_runner_role`` assumes too."""
    ranks = _vllm_ranks()
    return ranks is None or ranks[1]


def vllm_dp_rank(parallel_config: Any = None) -> int | None:
    """This engine's data-parallel replica index when vLLM runs more than one DP replica, else None.

    Two ways vLLM 0.32 runs DP replicas, and both are seen here:

    - a MoE model: the replicas form a DP process group (``get_dp_group()``, world size > 1);
    - a dense model: each replica is an independent engine, reset to DP size 1 and DP rank 0
      (``ParallelConfig.reconfigure_for_independent_dp_rank``). Only
      ``parallel_config.data_parallel_index`` (the runner's ``ParallelConfig``) still holds its
      index, so replica 0 of a dense model cannot be told from a lone engine: None for it.

    vllm is imported here, never at module scope; None when it is absent or its groups are not
    initialised and ``parallel_config`` names no replica.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if isinstance(index, int) and not isinstance(index, bool) and index > 0:
        return index
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        group = ps.get_dp_group()
        return int(group.rank_in_group) if int(group.world_size) > 1 else None
    except (AssertionError, AttributeError, RuntimeError):
        return None


def replica_cache_name(cache: str | None, endpoint: str | None = None, *,
                       parallel_config: Any = None) -> str | None:
    """The cache name for this engine replica: ``cache`` for a lone engine and DP replica 0, else
    ``<name>-dp<index>``.

    DP replicas have separate KV caches (each its own block ids), so each needs its own omnishm cache;
    one name for all would make their TP rank 0s two writers of one cache. Replica 0 keeps the plain
    name because a dense model's replica 0 looks like a lone engine (``vllm_dp_rank``; pass the
    runner's ``parallel_config``). With ``cache`` None the name is ``OMNISHM_NAME`` / the file's
    (``default``). Each replica's cache is served on its own socket (autostarted, or ``omnishm
    committer --name <name>-dp<index>``), so an explicit ``endpoint`` argument is refused wherever DP
    shows (not one from ``OMNISHM_ENDPOINT`` or the file: replica 0 then uses it, and a replica k > 0,
    having a name of its own, its own socket; a dense model's replica 0 cannot be told from a lone engine,
    so there an ``endpoint`` argument is accepted and only the replicas k > 0 refuse it). Raises
    ConfigError for that and for a bad name setting.
    """
    rank = vllm_dp_rank(parallel_config)
    if rank is None:
        return cache
    from omnishm.config import ConfigError, resolve

    if endpoint is not None:
        raise ConfigError(f"vLLM runs data-parallel replicas: each needs its own cache (<name>-dp<index>) on its "
                          f"own socket, so an explicit endpoint ({endpoint}) cannot serve them; leave it unset "
                          f"and autostart, or launch `omnishm committer --name <name>-dp<index>` per replica "
                          f"(replica 0: <name>)")
    if not rank:
        return cache
    if cache is None:
        cache = resolve("client", {}, names=("name",)).values["name"]
    return f"{cache}-dp{rank}"


def stage_cache_name(cache: str | None, endpoint: str | None = None, *, parallel_config: Any = None) -> str:
    """The name the manager of this stage will use (``replica_cache_name``, then ``OMNISHM_NAME`` / the file's
    when none is given): what the config gate's refusal names (``group_view.naming_the_cache``). Raises
    ConfigError as those do."""
    from omnishm.config import manager_connection

    return manager_connection(cache=replica_cache_name(cache, endpoint, parallel_config=parallel_config))["cache"]


def runner_parallel_config(runner: Any) -> Any:
    """A vLLM runner's ``ParallelConfig`` (``vllm_config.parallel_config`` or its own), or None. For a
    runner this module does not mix into (vllm-omni's); the mixin reads it like its other configs."""
    vllm_config = getattr(runner, "vllm_config", None)
    found = getattr(vllm_config, "parallel_config", None) if vllm_config is not None else None
    return found if found is not None else getattr(runner, "parallel_config", None)


class PrefixCacheRunnerMixin:
    """Omni prefix cache hooks for a GPUModelRunner-like object. See the module docstring.

    No ``__init__``: every attribute has a class-level default, so the mixin
    can sit anywhere in the runner's MRO. Not thread-safe except
    ``prefix_cache_materialize`` / ``prefix_cache_discard`` (any thread; the
    step-id bookkeeping is a single dict ``pop``).
    """

    # None: from OMNISHM_* / the TOML file / the built-in default (omnishm.config.manager_connection);
    # a value set on the class or instance is an explicit override and ranks above them, and a name set
    # without an endpoint means that cache's own socket, whatever OMNISHM_ENDPOINT says.
    prefix_cache_name: str | None = None
    prefix_cache_endpoint: str | None = None
    prefix_cache_autostart: bool | None = None
    prefix_cache_eager: bool | None = None
    prefix_cache_role: str | None = None
    prefix_cache_config_overrides: Mapping[str, Any] | None = None

    _prefix_cache_manager: "OmniPrefixCacheManager | None" = None
    _prefix_cache_adapter: PrefixCacheSchedulerAdapter | None = None
    _prefix_cache_policy: ModelCachePolicy | None = None
    _prefix_cache_block_size: int = 0
    _prefix_cache_initialized: bool = False
    _prefix_cache_step_req_ids: "dict[StepId, tuple[ReqId, ...]] | None" = None

    # ------------------------------------------------------------------ setup

    @property
    def prefix_cache_manager(self) -> "OmniPrefixCacheManager | None":
        """The manager, or None before the first real step or when the stage runs no cache."""
        return self._prefix_cache_manager

    def _prefix_cache_config_source(self, name: str) -> Any:
        vllm_config = getattr(self, "vllm_config", None)
        if vllm_config is not None and hasattr(vllm_config, name):
            return getattr(vllm_config, name)
        return getattr(self, name, None)

    def _prefix_cache_role(self) -> str:
        """``"writer"`` iff TP rank 0 of the last PP stage, else ``"reader"``.

        Falls back to writer when vllm is absent or its parallel groups are
        not initialised (single-process tests, offline tools).
        """
        if self.prefix_cache_role is not None:
            return self.prefix_cache_role
        return vllm_runner_role()

    def _prefix_cache_load_policy(self, model: Any = None) -> ModelCachePolicy:
        """Snapshot ``ModelCachePolicy.from_model(model)`` at model load.

        ``model`` defaults to ``self.get_model()`` (vLLM unwraps cudagraph
        wrappers there). Later attribute changes on the model are not seen. If
        the manager already exists, the policy is registered with it (the
        manager refuses that after its first save).
        """
        if model is None:
            model = self.get_model()  # type: ignore[attr-defined]
        policy = ModelCachePolicy.from_model(model)
        self._prefix_cache_policy = policy
        if self._prefix_cache_manager is not None:
            self._prefix_cache_manager.register_policy(policy)
        return policy

    def _prefix_cache_stage_config(self) -> "PrefixCacheConfig | None":
        """The gate (``stage_prefix_cache_config``) on the runner's current configs, with
        ``prefix_cache_config_overrides`` applied: the cache's config, or None when the stage runs no cache
        (prefix caching off, pooling stage). Raises ``PrefixCacheConfigError`` for an unsupported stage,
        ``ValueError``/``TypeError`` for a bad override."""
        src = self._prefix_cache_config_source
        with naming_the_cache(lambda: stage_cache_name(self.prefix_cache_name, self.prefix_cache_endpoint,
                                                       parallel_config=src("parallel_config"))):
            config = stage_prefix_cache_config(
                kv_cache_config=getattr(self, "kv_cache_config", None),
                cache_config=src("cache_config"),
                kv_transfer_config=src("kv_transfer_config"),
                scheduler_config=src("scheduler_config"),
                model_config=src("model_config"),
                is_pooling_model=bool(getattr(self, "is_pooling_model", False)),
                speculative_config=src("speculative_config"),
                parallel_config=src("parallel_config"),
            )
        if config is not None and self.prefix_cache_config_overrides:
            # dataclasses.replace re-runs PrefixCacheConfig validation (ValueError/TypeError on a bad knob).
            config = dataclasses.replace(config, **dict(self.prefix_cache_config_overrides))
        return config

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``initialize_kv_cache``, then the gate: the seed refuses an unsupported stage (hybrid or
        multi-group KV cache, KV transfer consumer, speculative decoding, ...) at KV-cache init, where its
        ``PrefixCacheConfigError`` fails the engine's start, not at the first request. Not for a GPU
        runner's profiling call (``is_profiling=True``: a minimal config). The manager is still built on
        the first real step. A bad ``prefix_cache_config_overrides`` raises ValueError/TypeError here too, and
        a runner outside vLLM's V1 family RuntimeError (``check_v1_runner``). The mixin must come before
        the runner class in the bases."""
        out = super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        if not kwargs.get("is_profiling", False):
            check_v1_runner(self, ("input_batch",))  # at engine start, not an AttributeError at the first save
            self._prefix_cache_stage_config()
        return out

    def _prefix_cache_init_once(self, scheduler_output: Any) -> "OmniPrefixCacheManager | None":
        """Build the manager on the first real step; later calls return it.

        A step with ``total_num_scheduled_tokens == 0`` (dummy/profile runs,
        finish-only steps) is not real and does not trigger construction. The
        gate (``stage_prefix_cache_config``) raises ``PrefixCacheConfigError``
        for an unsupported stage; that is not remembered, so every later real
        step raises again. Returns None when the stage runs no cache (prefix
        caching off, pooling stage) — decided once.
        """
        if self._prefix_cache_initialized:
            return self._prefix_cache_manager
        if _total_scheduled(scheduler_output) == 0:
            return None
        src = self._prefix_cache_config_source
        config = self._prefix_cache_stage_config()
        if config is None:
            self._prefix_cache_initialized = True
            logger.info("omni prefix cache: off for this stage (prefix caching disabled or pooling)")
            return None
        policy = self._prefix_cache_policy
        if policy is None:  # _prefix_cache_load_policy was not called at load: snapshot now
            try:
                policy = self._prefix_cache_load_policy()
            except (AttributeError, ValueError):  # no get_model / model not loaded (vLLM raises ValueError)
                policy = ModelCachePolicy()
                logger.warning("omni prefix cache: no model to read a cache policy from; using the default")
        role = self._prefix_cache_role()
        from omnishm.client.manager import OmniPrefixCacheManager
        # Knobs left at None are resolved by the manager, by its rule: OMNISHM_* and the file, except that
        # a name set here without an endpoint means that cache's own socket (config.manager_connection).
        cache = replica_cache_name(self.prefix_cache_name, self.prefix_cache_endpoint,
                                   parallel_config=src("parallel_config"))
        manager = OmniPrefixCacheManager(config, role=role, eager=self.prefix_cache_eager, cache=cache,
                                         endpoint=self.prefix_cache_endpoint, autostart=self.prefix_cache_autostart)
        try:
            manager.register_policy(policy)
        except BaseException:
            manager.shutdown()
            raise
        self._prefix_cache_manager = manager
        self._prefix_cache_adapter = PrefixCacheSchedulerAdapter()
        self._prefix_cache_block_size = config.block_size
        self._prefix_cache_step_req_ids = {}
        self._prefix_cache_initialized = True
        logger.info("omni prefix cache %r: %s, %d blocks x %d, staging %d x %d tokens", manager.cache,
                    role, config.num_blocks, config.block_size, config.staging_depth,
                    config.staging_capacity_tokens)
        return manager

    # ------------------------------------------------------------------ per step

    def prefix_cache_step_begin(self, scheduler_output: Any) -> PrefixCacheStep | None:
        """Translate ``scheduler_output`` and hand it to the manager.

        Engine thread, BEFORE ``_update_states`` (the manager must see
        finished requests before vLLM drops them), exactly once per
        ``execute_model`` call. A zero-token step (vLLM still runs
        ``_update_states`` for it to drop finished requests) is forwarded only
        when it carries finish/abort events and the manager exists. Returns
        the step given to the manager, or None.
        """
        manager = self._prefix_cache_init_once(scheduler_output)
        if manager is None:
            return None
        assert self._prefix_cache_adapter is not None
        try:
            step = self._prefix_cache_adapter.translate_scheduler_output(scheduler_output)
            if _total_scheduled(scheduler_output) == 0 and not step.events:
                return None
            manager.new_step_starts(step)
            return step
        except BaseException as exc:  # a signal handler's: sticky (``OmniPrefixCacheManager.note_interrupt``)
            manager.note_interrupt("prefix_cache_step_begin", exc)
            raise

    def prefix_cache_save(self, hidden_states: "torch.Tensor | None", mm_outputs: Mapping[str, Any] | None,
                          num_tokens_unpadded: int, num_tokens_padded: int, scheduler_output: Any) -> StepId | None:
        """Save this step's outputs; returns the step id (None: no cache / no tokens).

        Engine thread, after the forward and before the next step's
        ``prefix_cache_step_begin``. The write layout is built from the
        runner's current ``input_batch`` (the batch the forward ran) and
        ``scheduler_output.num_scheduled_tokens``; the save-time request ids
        are remembered for ``prefix_cache_materialize``. The returned id must
        be consumed exactly once (materialize or discard). A step with no token
        scheduled saves nothing (None), whatever counts it is given. Raises
        ``OmniPrefixCacheUnmatchError`` when the token accounting or the batch
        disagree with the schedule.
        """
        manager = self._prefix_cache_manager
        if manager is None or _total_scheduled(scheduler_output) == 0:
            return None
        try:
            counts: Mapping[ReqId, int] = scheduler_output.num_scheduled_tokens
            view = FullAttentionGroupView(self.input_batch, self._prefix_cache_block_size)  # type: ignore[attr-defined]
            # Token accounting is save_outputs' to refuse (check_prefix_cache_token_accounting's rules), once
            # it holds the layout: the slots of a refused step must become absent.
            layout = PrefixCacheSchedulerAdapter.build_write_layout(view, counts, token_tags=manager.keeps_token_tags,
                                                                    chains=manager.prompt_chains)
            mm = dict(mm_outputs) if mm_outputs is not None else None
        except BaseException as exc:  # before the manager's save, any exception: the step's slots are unknown
            manager.note_interrupt("prefix_cache_save", exc)  # first: a signal's says so
            manager.note_unsaved_step("prefix_cache_save", exc)
            raise
        try:  # from here the manager's save answers for the step's slots (a refusal makes them absent)
            step_id = manager.save_outputs(hidden_states, mm, num_tokens_unpadded=num_tokens_unpadded,
                                           num_tokens_padded=num_tokens_padded, write_layout=layout)
            assert self._prefix_cache_step_req_ids is not None
            self._prefix_cache_step_req_ids[step_id] = tuple(layout.req_ids)
            return step_id
        except BaseException as exc:  # a signal handler's: sticky (``OmniPrefixCacheManager.note_interrupt``)
            manager.note_interrupt("prefix_cache_save", exc)
            raise

    def prefix_cache_save_time_req_ids(self, step_id: StepId) -> tuple[ReqId, ...]:
        """Request ids of ``step_id``'s save (batch order); KeyError if unknown or consumed."""
        if self._prefix_cache_step_req_ids is None:
            raise KeyError(step_id)
        return self._prefix_cache_step_req_ids[step_id]

    def prefix_cache_materialize(self, step_id: StepId, req_ids: Iterable[ReqId] | None = None) -> StageCacheOutputs:
        """Merged outputs for the step saved as ``step_id`` (any thread, exactly once).

        ``req_ids`` defaults to the save-time request ids, never the live
        batch; a given subset is passed through. An id outside the save
        raises before anything is consumed (the step id stays valid). Raises ``OmniPrefixCacheUnmatchError`` for an
        unknown or consumed id, and whatever the manager raises.
        """
        step_id = as_step_id(step_id, "prefix_cache_materialize")  # the table's key is the id the manager takes
        manager = self._prefix_cache_require(step_id)
        table = self._prefix_cache_step_req_ids
        saved = table.get(step_id) if table else None
        ids = list(request_ids(req_ids)) if req_ids is not None else list(saved or ())
        if saved is not None:
            outside = [r for r in ids if r not in saved]
            if outside:  # caller bug: leave the step id (and its save-time ids) unconsumed
                raise unmatch(f"materialize asked for requests {outside} that were not in the save-time batch "
                              f"{list(saved)} (reading the live batch?)", step_id=step_id)
            assert table is not None
            table.pop(step_id, None)
        return manager.materialize(step_id, ids)

    def prefix_cache_discard(self, step_id: StepId) -> None:
        """Consume ``step_id`` without reading it (any thread, exactly once)."""
        step_id = as_step_id(step_id, "prefix_cache_discard")
        manager = self._prefix_cache_require(step_id)
        if self._prefix_cache_step_req_ids:
            self._prefix_cache_step_req_ids.pop(step_id, None)
        manager.discard_step(step_id)

    def prefix_cache_shutdown(self) -> None:
        """Shut the manager down (flushes deferred writes, detaches). Idempotent.

        The runner lets the manager go once its shutdown ran to its end: a call that a signal handler's exception
        cut short, or one made inside this thread's own shutdown, leaves it here, and the next call finishes it
        (reviews, 2026-12-06)."""
        manager = self._prefix_cache_manager
        if manager is not None:
            manager.shutdown()
            if not manager.shut_down:  # called inside this thread's own shutdown (a signal handler's): not yet
                return
        self._prefix_cache_manager = None
        self._prefix_cache_adapter = None
        self._prefix_cache_step_req_ids = None

    def _prefix_cache_require(self, step_id: StepId) -> "OmniPrefixCacheManager":
        manager = self._prefix_cache_manager
        if manager is None:
            raise unmatch("no omni prefix cache on this runner (not started, off, or shut down)", step_id=step_id)
        return manager
