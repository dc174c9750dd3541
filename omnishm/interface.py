"""Identities, configuration, policy, outputs and errors of the omni prefix cache.

This is the seed's ``interface`` module. Everything here is a plain value: no
process, socket or shared memory is touched, and nothing imports vllm at
module scope (the import invariant; ``tests/test_import_invariant.py`` scans).
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

logger = logging.getLogger(__name__)

TensorName = str
"""Name of a cached per-token tensor: ``HIDDEN_KEY`` or an mm output key."""
ReqId = str
"""vLLM request id as the runner sees it."""
Tid = int
"""Write id, unique within one writer session; names writes in the committer's replies.
The version of a slot's row is its claim version (``omnishm.versions``), not the tid."""
StepId = int
"""Id of one saved step; consumed exactly once by materialize or discard_step."""

HIDDEN_KEY: TensorName = "__hidden_states__"
"""Pool key of the full-prompt hidden states (the shared identity)."""


MAX_TIMEOUT_S = 1e6
"""The longest wait a timeout may name (about 11.6 days): a thread join or a ZeroMQ poll fails with
OverflowError on one past ~9.2e9 s, long after it was set (a review's 1e10 s broke a shutdown)."""


class WriteSchedule(enum.Enum):
    """When a write's rows go from the client to the pool.

    ``JOIN_NEXT_STEP``: staged at save; the next save waits for it to land.
    ``JOIN_ON_FINISH``: rows stay with the client until the request finishes or
    aborts, the GPU-byte budget forces the oldest pending write out, or a hit
    reads them (then the write is closed and flushed so every rank can see it).
    """

    JOIN_NEXT_STEP = "join_next_step"
    JOIN_ON_FINISH = "join_on_finish"


class OmniPrefixCacheUnmatchError(RuntimeError):
    """Contract, config, or KV-occupancy error that must raise.

    Includes hit spans that resolve to absent slots (the omni cache diverged
    from vLLM's KV), a step id consumed twice or never saved, a step larger than
    the staging page, and a failed write. Do not pretend these were a miss.
    ``req_id``, ``key`` and ``step_id`` name what the message names, where it does (``unmatch``), else None.
    """

    req_id: ReqId | None = None
    key: TensorName | None = None
    step_id: StepId | None = None


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """Save waited for a free staging slot and timed out."""


class OmniPrefixCacheCommitterError(OmniPrefixCacheUnmatchError):
    """The committer refused a request, went away, or did not answer in time."""


def unmatch(reason: str, *, req_id: ReqId | None = None, key: TensorName | None = None,
            step_id: StepId | None = None,
            cls: type[OmniPrefixCacheUnmatchError] = OmniPrefixCacheUnmatchError) -> OmniPrefixCacheUnmatchError:
    """Build an unmatch error (of ``cls``) whose message names request, tensor, step and reason, as its
    attributes do."""
    err = cls(
        f"omni prefix cache: {reason} (request={req_id!r}, tensor={key!r}, step_id={step_id!r})")
    err.req_id, err.key, err.step_id = req_id, key, step_id
    return err


MAX_SLOTS = 1 << 34
"""Upper bound on ``num_blocks * block_size`` (bad input gets a clear error, never an overflow)."""
MAX_STAGING_ROWS = 1 << 26
"""Upper bound on a writer's staging rows, ``(staging_depth + 1) * staging_capacity_tokens``."""


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Sizing and flow-control knobs (mirrors KVCacheConfig).

    ``num_blocks * block_size`` is the number of pool rows per tensor name, so a
    vLLM slot id indexes a row directly. A staging page holds one step (the
    whole batch): ``staging_capacity_tokens`` rows. ``staging_depth`` is how many
    unconsumed step ids may exist at once; a save past it waits up to
    ``staging_claim_timeout_s`` and then raises
    ``OmniPrefixCacheStagingTimeoutError``. A step larger than the capacity
    raises at once: that is a configuration break, never clamped.
    """

    num_blocks: int
    block_size: int
    staging_capacity_tokens: int = 8192
    staging_depth: int = 4
    staging_claim_timeout_s: float = 30.0
    gpu_staging_bytes: int = 1 << 30
    copy_chunk_bytes: int = 4 << 20
    commit_timeout_s: float = 30.0
    reconnect_timeout_s: float = 30.0
    """How long a client tries to resume with a restarted committer before every call fails."""
    result_pool_bytes: int = 1 << 30
    """Free, pre-faulted host memory kept for materialize's results (0: allocate fresh each call)."""
    token_check: bool = True
    """The writer checks each prefix hit's rows against the hit request's tokens (``client/tokens.py``); off: it
    keeps no tags and serves what the slots hold, as before stop 55 (for a vLLM whose token ids it misreads)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "staging_capacity_tokens", "staging_depth",
                     "gpu_staging_bytes", "copy_chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be a positive int, got {value!r}")
        if self.num_blocks * self.block_size > MAX_SLOTS:
            # The client's pin counts were allocated for them before the committer could refuse the layout.
            raise ValueError(f"PrefixCacheConfig.num_blocks * block_size = {self.num_blocks * self.block_size} "
                             f"exceeds {MAX_SLOTS} slots")
        if self.staging_rows > MAX_STAGING_ROWS:
            # Refused by the committer at attach naming neither knob, or a bare OverflowError encoding the Hello
            # (review, stop 54).
            raise ValueError(f"PrefixCacheConfig.(staging_depth + 1) * staging_capacity_tokens = "
                             f"({self.staging_depth} + 1) * {self.staging_capacity_tokens} staging rows exceeds "
                             f"{MAX_STAGING_ROWS}")
        if not isinstance(self.result_pool_bytes, int) or isinstance(self.result_pool_bytes, bool) \
                or self.result_pool_bytes < 0:
            raise ValueError(f"PrefixCacheConfig.result_pool_bytes must be an int >= 0, got {self.result_pool_bytes!r}")
        if not isinstance(self.token_check, bool):
            raise ValueError(f"PrefixCacheConfig.token_check must be a bool, got {self.token_check!r}")
        for name in ("staging_claim_timeout_s", "commit_timeout_s", "reconnect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(f"PrefixCacheConfig.{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                                 f"got {value!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def staging_rows(self) -> int:
        """A writer's staging rows: ``staging_depth`` pages of one step each, plus the deferred writes' page."""
        return (self.staging_depth + 1) * self.staging_capacity_tokens

    @classmethod
    def from_vllm_config(cls, *, num_blocks: int, block_size: int, scheduler_config: Any = None,
                         model_config: Any = None, **overrides: Any) -> "PrefixCacheConfig":
        """Size device-to-host staging from the running scheduler.

        A staging page holds one step, not one request: the capacity is
        ``max_num_batched_tokens`` (falling back to ``max_model_len``), and the
        depth is how many unconsumed step ids may exist, not ``max_num_seqs``.
        """
        capacity = staging_capacity_from_vllm(scheduler_config, model_config)
        kwargs: dict[str, Any] = {"num_blocks": int(num_blocks), "block_size": int(block_size)}
        if capacity:
            kwargs["staging_capacity_tokens"] = capacity
        kwargs.update(overrides)
        return cls(**kwargs)


def staging_capacity_from_vllm(scheduler_config: Any = None, model_config: Any = None) -> int | None:
    """A staging page's tokens for a vLLM stage (``PrefixCacheConfig.from_vllm_config``'s rule):
    ``max_num_batched_tokens``, else ``max_model_len``; None when neither is known."""
    capacity = getattr(scheduler_config, "max_num_batched_tokens", None)
    if not capacity:
        capacity = getattr(model_config, "max_model_len", None)
    if not capacity:
        capacity = getattr(scheduler_config, "max_model_len", None)
    return int(capacity) if capacity else None


def _refuse_one_string(keys: Any, what: str) -> None:
    """A set of tensor names given as one name: ``frozenset("feat")`` is four one-letter keys, and the key
    itself would then be written JOIN_NEXT_STEP without a word (review, 2026-12-07). Raises TypeError."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{what} must be a collection of tensor names, got the string {keys!r} "
                        f"(write frozenset({{{keys!r}}}))")


@dataclass(frozen=True)
class ModelCachePolicy:
    """Which of a model's outputs the cache keeps, and when.

    Hidden's name is ``HIDDEN_KEY`` (shared identity). This object answers
    whether this model caches it, and which mm keys are deferred
    (``WriteSchedule.JOIN_ON_FINISH``). Replaces getattr probing on models.
    """

    cache_hidden: bool = True
    deferred_keys: frozenset[TensorName] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _refuse_one_string(self.deferred_keys, "ModelCachePolicy.deferred_keys")
        object.__setattr__(self, "deferred_keys", frozenset(self.deferred_keys))
        if HIDDEN_KEY in self.deferred_keys:
            raise ValueError("HIDDEN_KEY is always written JOIN_NEXT_STEP; it cannot be deferred")

    @property
    def hidden_key(self) -> TensorName | None:
        """Pool key for hidden, or None when this model opts out."""
        return HIDDEN_KEY if self.cache_hidden else None

    @classmethod
    def from_model(cls, model: Any) -> "ModelCachePolicy":
        """Shim over legacy per-model attributes (deprecation window).

        Reads ``omni_prefix_cache_policy`` if the model has one; otherwise the
        legacy ``cache_hidden_states`` and ``prefix_cache_deferred_mm_keys``.
        """
        policy = getattr(model, "omni_prefix_cache_policy", None)
        if isinstance(policy, ModelCachePolicy):
            return policy
        cache_hidden = bool(getattr(model, "cache_hidden_states", True))
        deferred = getattr(model, "prefix_cache_deferred_mm_keys", None)
        deferred = () if deferred is None else deferred  # (not ``or``: an array has no truth value)
        _refuse_one_string(deferred, f"{type(model).__name__}.prefix_cache_deferred_mm_keys")
        return cls(cache_hidden=cache_hidden, deferred_keys=frozenset(deferred))

    def schedule(self, key: TensorName) -> WriteSchedule:
        return WriteSchedule.JOIN_ON_FINISH if key in self.deferred_keys else WriteSchedule.JOIN_NEXT_STEP

    def get_hit_keys(self, keys: Iterable[TensorName]) -> list[TensorName]:
        """Keys to plan/prefetch for a hit: hidden first (if cached), then mm."""
        out: list[TensorName] = []
        if self.hidden_key is not None:
            out.append(HIDDEN_KEY)
        out.extend(sorted(k for k in set(keys) if k != HIDDEN_KEY))
        return out

    def skip_immediate_mm(self, key: TensorName) -> bool:
        """Immediate staging must not take hidden or deferred keys from mm."""
        return key == HIDDEN_KEY or key in self.deferred_keys


class StageCacheOutputs(NamedTuple):
    """Plain value object: per-request merged stage outputs.

    ``hidden_states[req]`` is ``[hit_rows + step_rows, H]`` (None when the
    policy does not cache hidden). ``mm_outputs[req][key]`` is the merged
    per-token tensor for token-major keys, and the save-time copy of the
    value for leftover keys (non-token-major tensors, lists).
    """

    hidden_states: dict[ReqId, Any]
    mm_outputs: dict[ReqId, dict[TensorName, Any]]
    num_hit_tokens: dict[ReqId, int]
