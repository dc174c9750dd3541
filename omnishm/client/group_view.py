"""KV-cache group access and runner-side config gates for the omni prefix cache.

``FullAttentionGroupView`` is a view over the one full-attention KV-cache group
of a vLLM ``InputBatch``: which requests are in the batch (batch order) and the
vLLM slot id of every token this step computes. Slots come from the CPU block
table (``step_slots_cpu``), never the device ``slot_mapping``: reading that back
would need a stream sync, which stalls the whole forward, and the CPU block
table carries the same information (positions are ``num_computed .. +
num_scheduled`` per request).

The ``check_*`` functions and ``stage_prefix_cache_config`` are the refusals a
stage must pass before it may run an omni prefix cache. Each raises
``PrefixCacheConfigError`` (a ``ValueError``) whose message says what to
disable or change; ``check_prefix_cache_token_accounting`` is a per-step
contract check and raises ``OmniPrefixCacheUnmatchError``.

Import invariant: nothing here imports vllm at module scope. Real vLLM spec
classes are only consulted when ``vllm.v1.kv_cache_interface`` is already loaded
(a real spec object cannot exist otherwise); fakes are classified by class name.
All functions are pure reads of the objects they are given; any thread, no locks.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from array import array
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from omnishm.client.tokens import (FEW_RUNS, PromptChains, Run, fill_befores, note_chains, row_tags, run_index,
                                   scatter_tags)
from omnishm.interface import PrefixCacheConfig, ReqId, staging_capacity_from_vllm, unmatch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.v1.worker.gpu_input_batch import InputBatch

logger = logging.getLogger(__name__)

__all__ = [
    "PrefixCacheConfigError",
    "FullAttentionGroupView",
    "check_prefix_cache_block_layout",
    "check_prefix_cache_kv_groups",
    "check_prefix_cache_kv_transfer",
    "check_prefix_cache_token_accounting",
    "stage_prefix_cache_config",
    "get_prefix_cache_group_view",
]

_DISABLE_HINT = "or disable the omni prefix cache for this stage"
_SMALL_BATCH_REQS = 64
"""Batches of more requests than this look for prompt rows with numpy first (``step_token_tags_cpu``)."""


def extend_slots(out: array, blocks: Sequence[int] | Any, pos: int, end: int, block_size: int) -> None:
    """Append to ``out`` the slots of positions ``pos..end`` of a request whose block ids are ``blocks``:
    ``slot = blocks[p // block_size] * block_size + p % block_size``, one ``range`` per block run (plain Python:
    right after the forward, each torch or numpy call on small arrays costs tens of microseconds of cold code).
    The caller has checked that ``end - 1`` falls inside ``blocks``."""
    bs = block_size
    while pos < end:
        b = pos // bs
        stop = min(end, (b + 1) * bs)
        base = (int(blocks[b]) - b) * bs  # slot = block id * bs + (pos - b * bs)
        out.extend(range(base + pos, base + stop))
        pos = stop


class PrefixCacheConfigError(ValueError):
    """A stage configuration the omni prefix cache cannot serve correctly.

    Raised at configuration / KV-cache init time, never mid-step. The message
    names the offending setting and what to disable or change, and, raised by an
    integration's gate (``naming_the_cache``), the cache.
    """


@contextlib.contextmanager
def naming_the_cache(cache: Callable[[], str | None]) -> Iterator[None]:
    """A ``PrefixCacheConfigError`` (or ``ConfigError``: a bad ``OMNISHM_*`` knob the gate read, or a rule across
    knobs such as the staging bound; it named no cache either, review, stop 54) raised inside is raised again,
    of the same type, with ``cache()``'s name in its message: in a
    thinker/talker pipeline each stage has its cache, and a refusal that named none did not say which stage
    was refused (review, 2026-12-07; README, "Every error names the cache"). ``cache`` is called only then;
    if it raises or gives None, the error goes on as it was."""
    from omnishm.config import ConfigError  # the gate's OMNISHM_* knobs and cross-knob rules (stop 54)

    try:
        yield
    except (PrefixCacheConfigError, ConfigError) as exc:
        try:
            name = cache()
        except Exception:  # noqa: BLE001 - the refusal is the error to raise, named or not
            name = None
        if not name:
            raise
        text, lead = str(exc), "omni prefix cache: "
        named = f"{lead}cache {name}: {text[len(lead):]}" if text.startswith(lead) else f"cache {name}: {text}"
        raise type(exc)(named).with_traceback(exc.__traceback__) from None


# ---------------------------------------------------------------------------
# Group view
# ---------------------------------------------------------------------------


class FullAttentionGroupView:
    """View over one full-attention KV-cache group of a vLLM ``InputBatch``.

    Reads ``input_batch`` at call time (``req_ids``, ``num_computed_tokens_cpu``
    and ``block_table[group_index].block_table.cpu``); it holds no copy, so
    build it from the runner's *current* ``input_batch`` (vLLM may re-create
    the batch after KV-cache init). Engine thread only: the batch is mutated by
    ``_update_states``; call after it and before the next step's.
    """

    def __init__(self, input_batch: "InputBatch | Any", block_size: int, group_index: int = 0) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.input_batch = input_batch
        self.block_size = block_size
        self.group_index = group_index
        self._table: torch.Tensor | None = None
        self._table_np: Any = None
        table = self._group_table()
        table_block_size = getattr(table, "block_size", None)
        if table_block_size is not None and int(table_block_size) != block_size:
            raise PrefixCacheConfigError(
                f"omni prefix cache: block table of KV group {group_index} uses block_size "
                f"{table_block_size}, the cache uses {block_size}; set --block-size so they agree "
                f"{_DISABLE_HINT}")

    # -- raw accessors (duck-typed over vLLM 0.32's InputBatch/BlockTable) ---------

    def _group_table(self) -> Any:
        multi = self.input_batch.block_table
        tables = getattr(multi, "block_tables", None)
        if tables is not None:
            return tables[self.group_index]
        return multi[self.group_index]

    def _block_table_cpu(self) -> torch.Tensor:
        """The group's CPU block table, ``int32 [max_num_reqs, max_blocks]``."""
        table = self._group_table()
        buf = getattr(table, "block_table", table)
        cpu = getattr(buf, "cpu", None)
        if isinstance(cpu, torch.Tensor):
            return cpu
        if isinstance(buf, torch.Tensor):
            return buf
        getter = getattr(table, "get_cpu_tensor", None)
        if getter is not None:
            return getter()
        return torch.as_tensor(buf)

    def _blocks_per_row(self) -> Any:
        """vLLM's per-row block counts (a numpy array or a tensor), or None when the table has none."""
        return getattr(self._group_table(), "num_blocks_per_row", None)

    def _rows(self) -> tuple[list[ReqId], list[int]]:
        ids: list[ReqId] = []
        rows: list[int] = []
        for row, rid in enumerate(self.input_batch.req_ids):
            if rid is not None:
                ids.append(rid)
                rows.append(row)
        return ids, rows

    # -- public -------------------------------------------------------------------

    @property
    def batch_req_ids(self) -> list[ReqId]:
        """Request ids in batch (row) order, ``None`` holes skipped.

        This is the order of the forward's output rows (``hidden_states``).
        """
        return self._rows()[0]

    def step_slots_cpu(self, num_scheduled_tokens: Sequence[int] | Mapping[ReqId, int]) -> torch.Tensor:
        """This step's slot mapping, computed on CPU from the block table.

        ``num_scheduled_tokens`` is either one count per ``batch_req_ids`` entry
        (same order) or a mapping by request id (a batch request missing from
        it raises). Returns ``int64 [sum(counts)]``: for batch row ``i`` and
        ``pos = num_computed_tokens_cpu[i] + arange(n_i)``,
        ``slot = block_table[i, pos // block_size] * block_size + pos % block_size``.

        Raises ``OmniPrefixCacheUnmatchError`` when a position falls outside
        the request's block-table row (past the blocks vLLM gave it): the view
        and vLLM disagree, and guessing a slot would corrupt the cache.
        """
        ids, rows = self._rows()
        # A list is the usual argument (build_write_layout's): tested first, since the ABC check for Mapping
        # costs tens of microseconds of cold code right after the forward.
        if type(num_scheduled_tokens) is not list and isinstance(num_scheduled_tokens, Mapping):
            missing = [rid for rid in ids if rid not in num_scheduled_tokens]
            if missing:
                raise unmatch(f"batch requests {missing} have no scheduled-token count",
                              req_id=missing[0])
            counts_list = [int(num_scheduled_tokens[rid]) for rid in ids]
        else:
            counts_list = [int(n) for n in num_scheduled_tokens]
            if len(counts_list) != len(ids):
                raise unmatch(f"{len(counts_list)} scheduled-token counts for {len(ids)} batch requests")
        if any(n < 0 for n in counts_list):
            raise unmatch(f"negative scheduled-token count in {counts_list}")
        if not sum(counts_list):
            return torch.empty(0, dtype=torch.int64)
        # Plain Python over block runs: this runs right after the forward, where each torch or numpy call
        # on small arrays costs tens of microseconds of cold code (a vectorised version of this took about
        # 0.4 ms for a decode batch of 8 requests; this about 0.13 ms).
        table = self._block_table_cpu()
        # vLLM keeps one table tensor: its numpy view is made once (again if it is replaced or resized).
        if table is not self._table or table.shape != self._table_np.shape:
            self._table, self._table_np = table, table.numpy()
        tab = self._table_np
        width = int(tab.shape[1])
        computed = self.input_batch.num_computed_tokens_cpu
        per_row = self._blocks_per_row()
        bs = self.block_size
        out = array("q")
        for rid, row, n in zip(ids, rows, counts_list):
            if not n:
                continue
            pos = int(computed[row])
            end = pos + n
            limit = width if per_row is None else min(width, int(per_row[row]))
            if (end - 1) // bs >= limit:
                first = max(pos, limit * bs)
                raise unmatch(
                    f"position {first} (block {first // bs}) is outside the block-table row of batch row {row} "
                    f"({limit} blocks, block_size {bs})", req_id=rid)
            extend_slots(out, tab[row], pos, end, bs)
        return torch.frombuffer(out, dtype=torch.int64)

    def step_token_tags_cpu(self, counts: Sequence[int], chains: PromptChains | None = None) -> np.ndarray | None:
        """This step's row tags (``client/tokens.py``), ``rows x 2`` int64 in ``step_slots_cpu``'s order, from the
        batch's CPU token ids: the tags of each prompt token given as an id, 0 for every other row (a generated
        token: under async scheduling the runner's CPU copy of a step's sampled input may not be written yet;
        a prompt embedding: no id). None when no row of the step has a known token (a decode step) or the
        batch keeps no token ids. ``counts`` as ``step_slots_cpu`` took them (a list, in batch order).
        ``chains``: the writer's ``PromptChains``, where a run continuing a prompt finds the chain before it
        (else it sums the prompt's earlier ids), and notes its own for the request's next run."""
        batch = self.input_batch
        token_ids = getattr(batch, "token_ids_cpu", None)
        prompt_len = getattr(batch, "num_prompt_tokens", None)
        if token_ids is None or prompt_len is None:
            return None
        # A decode step of a large batch has no row inside its prompt: one comparison over the batch's rows says
        # so (the loop below took 169 us for 1024 requests: review, stop 55). Not for small batches: right after
        # the forward its numpy calls cost about 30 us of cold code, more than the loop (figure 6: 66 against 36
        # us a step). Rows at the batch's holes may hold stale counts; they only send the step to the loop.
        top = len(batch.req_ids)
        if top > _SMALL_BATCH_REQS and not bool((batch.num_computed_tokens_cpu[:top] < prompt_len[:top]).any()):
            return None
        rids, rows = self._rows()
        if not rows:
            return None
        # Plain ints of the batch's rows (in vLLM's condensed batch, about its request count).
        top = rows[-1] + 1
        computed = batch.num_computed_tokens_cpu[:top].tolist()
        prompt_end = prompt_len[:top].tolist()
        spans: list[tuple[int, int, int, int, ReqId]] = []  # (step row, batch row, first position, end, request)
        at = 0
        for rid, row, n in zip(rids, rows, counts):
            if n:
                pos = computed[row]
                end = min(pos + n, prompt_end[row])
                if end > pos:
                    spans.append((at, row, pos, end, rid))
                at += n
        if not spans:
            return None
        is_ids = getattr(batch, "is_token_ids", None)  # vLLM 0.32: False where the prompt gave an embedding
        # A run at position 0 starts from 0; one continuing a prompt from where the writer's PromptChains has it.
        befores = [(chains.before(rid, pos, None if is_ids is None else is_ids[row]) if chains is not None
                    else None) if pos else 0 for _, row, pos, _, rid in spans]
        if len(spans) > FEW_RUNS:  # many runs: gather their own ids from the batch in one index
            befores = fill_befores(befores, lambda i: (token_ids[spans[i][1], :spans[i][2]], None if is_ids is None
                                                       else is_ids[spans[i][1], :spans[i][2]]))
            runs = np.array([span[:4] for span in spans], dtype=np.int64)
            lens = runs[:, 3] - runs[:, 2]
            positions = run_index(runs[:, 2], lens)
            batch_rows = np.repeat(runs[:, 1], lens)
            tags = scatter_tags(at, runs[:, 0], runs[:, 2], lens, token_ids[batch_rows, positions],
                                None if is_ids is None else is_ids[batch_rows, positions], befores)
        else:
            tags = row_tags(at, [Run(start, pos, token_ids[row, :end], None if is_ids is None else is_ids[row, :end], b)
                                 for (start, row, pos, end, _), b in zip(spans, befores)])
        note_chains(chains, [(rid, end, start + end - pos - 1) for start, row, pos, end, rid in spans
                             if end < prompt_end[row]], tags)  # (a run that ends its prompt has no next run)
        return tags


# ---------------------------------------------------------------------------
# Spec classification
# ---------------------------------------------------------------------------

_REJECTED_NAME_PARTS = ("SlidingWindow", "ChunkedLocal", "Mamba", "RSWA", "Sink", "CrossAttention",
                        "EncoderOnly", "CircularBuffer", "HiSparse")


def _groups_of(kv_cache_groups_or_config: object) -> list[Any]:
    groups = getattr(kv_cache_groups_or_config, "kv_cache_groups", kv_cache_groups_or_config)
    if groups is None:
        raise PrefixCacheConfigError(
            f"omni prefix cache: no KV-cache groups given; the gate needs kv_cache_config.kv_cache_groups "
            f"(call it after KV-cache init) {_DISABLE_HINT}")
    return list(groups)  # type: ignore[call-overload]


def _layer_specs(spec: Any) -> list[Any]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs wraps per-layer specs
    if isinstance(inner, Mapping):
        return list(inner.values())
    return [spec]


def _not_full_attention_reason(spec: Any) -> str | None:
    """Why ``spec`` (one layer's) cannot be mirrored, or None when it can.

    Accepted: vLLM's ``FullAttentionSpec`` and its block-stable subclasses
    (MLA, hidden-state cache): one block per ``block_size`` tokens for every
    token, prefix hits share whole blocks. Rejected: sliding window, chunked
    local, mamba, R-SWA (frees gap blocks mid-request), attention sinks,
    cross/encoder-only attention, and non-causal layers (a prefix's outputs
    would depend on later tokens).
    """
    name = type(spec).__name__
    if getattr(spec, "non_causal", False):
        return f"{name} is non-causal (prefix outputs depend on later tokens)"
    kvi = sys.modules.get("vllm.v1.kv_cache_interface")
    base = getattr(kvi, "KVCacheSpec", None) if kvi is not None else None
    if base is not None and isinstance(spec, base):
        full = getattr(kvi, "FullAttentionSpec")
        if not isinstance(spec, full):
            return f"{name} is not full attention"
        for bad in ("RSWASpec", "SinkFullAttentionSpec"):
            cls = getattr(kvi, bad, None)
            if cls is not None and isinstance(spec, cls):
                return f"{name} does not keep a stable block per token span"
        return None
    mro_names = [c.__name__ for c in type(spec).__mro__]
    for part in _REJECTED_NAME_PARTS:
        if any(part in n for n in mro_names):
            return f"{name} is not plain full attention ({part})"
    if not any("FullAttention" in n for n in mro_names):
        return f"{name} is not full attention"
    return None


# ---------------------------------------------------------------------------
# Config gates
# ---------------------------------------------------------------------------


def check_prefix_cache_kv_groups(kv_cache_groups: object) -> None:
    """Reject hybrid / multi-group / non-full-attention models at KV-cache init.

    Takes ``kv_cache_config.kv_cache_groups`` (or the config itself). Exactly
    one group, every layer full attention (see ``_not_full_attention_reason``),
    default group role. Raises ``PrefixCacheConfigError``.
    """
    groups = _groups_of(kv_cache_groups)
    if len(groups) != 1:
        kinds = [type(getattr(g, "kv_cache_spec", g)).__name__ for g in groups]
        raise PrefixCacheConfigError(
            f"omni prefix cache: needs exactly one KV-cache group (full attention), this model has "
            f"{len(groups)} {kinds}; hybrid/multi-group models are not supported: pass "
            f"--disable-hybrid-kv-cache-manager if the model allows it, {_DISABLE_HINT}")
    group = groups[0]
    spec = getattr(group, "kv_cache_spec", None)
    if spec is None:
        raise PrefixCacheConfigError(f"omni prefix cache: KV-cache group has no kv_cache_spec {_DISABLE_HINT}")
    role = getattr(group, "role", None)
    role_value = getattr(role, "value", role)
    if role_value not in (None, "default"):
        raise PrefixCacheConfigError(
            f"omni prefix cache: KV-cache group role {role_value!r} is not supported (HiSparse); "
            f"disable HiSparse {_DISABLE_HINT}")
    layers = _layer_specs(spec)
    if not layers:
        raise PrefixCacheConfigError(f"omni prefix cache: KV-cache group has no layer specs {_DISABLE_HINT}")
    for layer in layers:
        reason = _not_full_attention_reason(layer)
        if reason is not None:
            raise PrefixCacheConfigError(
                f"omni prefix cache: the KV-cache group must be full attention: {reason}; "
                f"use a full-attention model {_DISABLE_HINT}")


def check_prefix_cache_block_layout(block_size: int, kv_cache_config: object) -> None:
    """Every KV-cache group's block size must equal the cache's ``block_size``.

    The pool is indexed by ``block_id * block_size + offset``; a group with
    another block size would address different rows. Raises
    ``PrefixCacheConfigError``.
    """
    for i, group in enumerate(_groups_of(kv_cache_config)):
        spec = getattr(group, "kv_cache_spec", group)
        sizes = {int(getattr(s, "block_size", block_size)) for s in [spec, *_layer_specs(spec)]}
        if sizes != {int(block_size)}:
            raise PrefixCacheConfigError(
                f"omni prefix cache: KV-cache group {i} uses block size {sorted(sizes)}, the cache uses "
                f"{block_size}; set --block-size to the KV-cache block size {_DISABLE_HINT}")


def check_prefix_cache_kv_transfer(kv_transfer_config: object) -> None:
    """Reject ``kv_consumer`` / ``kv_both`` stages.

    KV loaded from a producer also shows up as ``num_computed_tokens``; the
    manager would read it as a local hit with no rows behind it. Producers and
    stages without KV transfer pass. Raises ``PrefixCacheConfigError``.
    """
    if kv_transfer_config is None:
        return
    role = getattr(kv_transfer_config, "kv_role", None)
    consumer = getattr(kv_transfer_config, "is_kv_consumer", False) is True
    if role in ("kv_consumer", "kv_both") or consumer:
        raise PrefixCacheConfigError(
            f"omni prefix cache: kv_role {role!r} loads KV from another instance, which looks like a "
            f"local prefix hit with no cached rows behind it; use kv_role 'kv_producer', remove "
            f"--kv-transfer-config, {_DISABLE_HINT}")


def check_prefix_cache_token_accounting(num_tokens_unpadded: int, num_tokens_padded: int,
                                        num_scheduled_tokens: Mapping[ReqId, int] | Sequence[int]) -> None:
    """Per-step contract: ``unpadded == sum(scheduled)`` and ``padded >= unpadded``.

    Raises ``OmniPrefixCacheUnmatchError`` (a broken step is fatal, not a miss).
    """
    values = num_scheduled_tokens.values() if isinstance(num_scheduled_tokens, Mapping) else num_scheduled_tokens
    total = sum(int(n) for n in values)
    if int(num_tokens_unpadded) != total:
        raise unmatch(f"num_tokens_unpadded={num_tokens_unpadded} != sum of scheduled tokens {total}")
    if int(num_tokens_padded) < int(num_tokens_unpadded):
        raise unmatch(f"num_tokens_padded={num_tokens_padded} < num_tokens_unpadded={num_tokens_unpadded}")


def _check_sub_block(block_size: int, cache_config: object, kv_cache_config: object) -> None:
    checks = (
        ("cache_config.prefix_match_unit", getattr(cache_config, "prefix_match_unit", None),
         "unset --prefix-match-unit"),
        ("kv_cache_config.hash_block_size", getattr(kv_cache_config, "hash_block_size", None),
         "unset --prefix-match-unit"),
        ("cache_config.hash_block_size", getattr(cache_config, "hash_block_size", None),
         "unset --prefix-match-unit"),
        ("kv_cache_config.cache_hit_alignment_tokens",
         getattr(kv_cache_config, "cache_hit_alignment_tokens", None), "unset --prefix-match-unit"),
        ("cache_config.cache_hit_alignment_tokens", getattr(cache_config, "cache_hit_alignment_tokens", None),
         "unset --prefix-match-unit"),
    )
    for what, value, fix in checks:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % block_size:
            raise PrefixCacheConfigError(
                f"omni prefix cache: sub-block prefix matching ({what}={value}, block_size={block_size}) "
                f"would give hits inside a block; {fix} {_DISABLE_HINT}")
    mamba_mode = getattr(cache_config, "mamba_cache_mode", None)
    if mamba_mode not in (None, "none"):
        raise PrefixCacheConfigError(
            f"omni prefix cache: mamba_cache_mode={mamba_mode!r} caches hybrid state at sub-block "
            f"boundaries; set --mamba-cache-mode none {_DISABLE_HINT}")


def stage_prefix_cache_config(*, kv_cache_config: object, cache_config: object, kv_transfer_config: object,
                              scheduler_config: object, model_config: object, is_pooling_model: bool,
                              speculative_config: object = None, parallel_config: object = None,
                              num_blocks: int | None = None) -> PrefixCacheConfig | None:
    """Runner-side gate shared by every platform runner.

    Returns None when the stage does not run an omni prefix cache
    (``enable_prefix_caching`` off, or a pooling stage that never saves).
    Otherwise refuses, in this order, kv_consumer / kv_both, speculative
    decoding, priority scheduling, KV-sharing fast prefill, decode/prefill context parallel, sub-block prefix matching,
    other than exactly one full-attention KV group, and a block-size mismatch
    (all ``PrefixCacheConfigError``), then sizes the config from the scheduler
    (``PrefixCacheConfig.from_vllm_config``'s rule; ``num_blocks`` defaults to
    ``kv_cache_config.num_blocks``). One place, so no runner silently skips a
    refusal another one has.
    """
    if not getattr(cache_config, "enable_prefix_caching", False):
        return None
    if is_pooling_model:
        return None
    check_prefix_cache_kv_transfer(kv_transfer_config)
    if speculative_config is not None:
        method = getattr(speculative_config, "method", None)
        raise PrefixCacheConfigError(
            f"omni prefix cache: speculative decoding (method={method!r}) schedules draft tokens whose "
            f"outputs are not per-slot prompt rows; remove --speculative-config {_DISABLE_HINT}")
    policy = getattr(scheduler_config, "policy", None)
    if getattr(policy, "value", policy) == "priority":
        # vLLM 0.32's priority scheduler may preempt a request it already scheduled in the step, after
        # ``allocate_slots`` put its new full blocks in the prefix cache: nothing is ever computed for them, yet
        # they stay cached, and a later hit on them (the request's own resume) was served an earlier tenant's
        # rows with no error (review, stop 54, in a real engine). vLLM's own KV for them is stale too.
        raise PrefixCacheConfigError(
            "omni prefix cache: scheduling_policy='priority' may preempt a request vLLM already scheduled in "
            "the same step, leaving its new blocks in the prefix cache with nothing computed for them; a hit "
            f"on them would be served rows of an earlier request; use --scheduling-policy fcfs {_DISABLE_HINT}")
    if getattr(cache_config, "kv_sharing_fast_prefill", False) is True:
        raise PrefixCacheConfigError(
            "omni prefix cache: kv_sharing_fast_prefill lets the KV-sharing layers skip prompt tokens, so "
            "a prompt token's final hidden state is computed only where logits are; remove "
            f"--kv-sharing-fast-prefill {_DISABLE_HINT}")
    for attr, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = getattr(parallel_config, attr, 1) or 1
        if int(size) > 1:
            raise PrefixCacheConfigError(
                f"omni prefix cache: {attr}={size} shards KV slots across ranks, so block tables do "
                f"not address whole-token rows; set {flag} 1 {_DISABLE_HINT}")
    block_size = getattr(cache_config, "block_size", None)
    if not isinstance(block_size, int) or block_size <= 0:
        raise PrefixCacheConfigError(
            f"omni prefix cache: cache_config.block_size is {block_size!r}; run the gate after vLLM has "
            f"resolved the block size {_DISABLE_HINT}")
    _check_sub_block(block_size, cache_config, kv_cache_config)
    check_prefix_cache_kv_groups(kv_cache_config)
    check_prefix_cache_block_layout(block_size, kv_cache_config)
    if num_blocks is None:
        num_blocks = getattr(kv_cache_config, "num_blocks", None)
    if not isinstance(num_blocks, int) or num_blocks <= 0:
        raise PrefixCacheConfigError(
            f"omni prefix cache: kv_cache_config.num_blocks is {num_blocks!r}; run the gate after "
            f"KV-cache init {_DISABLE_HINT}")
    # OMNISHM_* variables and the TOML file beat what we derived from vLLM (omnishm.config). No config is built
    # from the derived value alone: its default depth refused a capacity an OMNISHM_STAGING_DEPTH made legal
    # (review, stop 54).
    from omnishm.config import load_prefix_cache_config

    return load_prefix_cache_config(num_blocks, block_size, derived={
        "staging_capacity_tokens": staging_capacity_from_vllm(scheduler_config, model_config)})


def get_prefix_cache_group_view(input_batch: "InputBatch | Any", block_size: int,
                                kv_cache_groups: object = None) -> FullAttentionGroupView | None:
    """Build the group view; None only if the batch has no block table.

    The group spec is checked first (raises ``PrefixCacheConfigError``).
    Selection is by spec, not by counting block tables: the view takes the
    block table of the full-attention group (vLLM gives encoder-only groups no
    block table, so the index skips them), and a table whose block size differs
    raises rather than letting ``step_slots_cpu`` address the wrong rows.
    """
    if kv_cache_groups is not None:
        check_prefix_cache_kv_groups(kv_cache_groups)
    # The check admits exactly one group and it is full attention, so its block
    # table is vLLM's table 0 (vLLM builds one table per non-encoder-only group,
    # in group order). If the gate ever admits more groups, derive the index
    # from the specs here, never from the number of block tables.
    table_index = 0
    multi = getattr(input_batch, "block_table", None)
    if multi is None:
        return None
    tables = getattr(multi, "block_tables", multi)
    try:
        count = len(tables)
    except TypeError:
        count = None
    if count is not None and count <= table_index:
        return None
    return FullAttentionGroupView(input_batch, block_size, table_index)
