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

The hooks themselves are ``omnishm/integrations/vllm_hooks.py``.

Import invariant: vllm is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from omnishm.integrations.held_results import HeldResults, decode_results, decode_tensor, encode_tensor
from omnishm.integrations.vllm_hooks import OmniPrefixCacheRunnerHooks, external_req_id
from omnishm.interface import ReqId

__all__ = ["OmniPrefixCacheWorkerExtension", "OmniPrefixCacheRunnerHooks", "external_req_id", "EXTENSION_CLS",
           "encode_tensor", "decode_tensor", "decode_results"]

EXTENSION_CLS = "omnishm.integrations.vllm.OmniPrefixCacheWorkerExtension"


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
