"""vllm-omni's own in-process prefix cache as a benchmark arm (figures 3 and 6).

The figures' goals are set against an in-process design built from omnishm's code; users compare
against the cache they run today, ``vllm_omni.core.prefix_cache.OmniPrefixCacheManager``. When
vllm-omni is installed (``pip install --no-deps vllm-omni==0.30.0`` is enough) the figures add a
row against it, fed the same steps.

Only its prefix-cache package is loaded (``omnishm.integrations.vllm_omni.load_prefix_cache``).
The scheduler output and the group view are the two vLLM objects that manager reads; the ones
here carry exactly the fields it reads, built from the same steps the omnishm arm gets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheStep, PrefixCacheWriteLayout
from omnishm.interface import HIDDEN_KEY
from omnishm.integrations.vllm_omni import load_prefix_cache

if TYPE_CHECKING:
    from omnishm.sim import SimStep

logger = logging.getLogger(__name__)


def vllm_omni_version() -> str | None:
    """The installed vllm-omni's version once its prefix cache loads, else None (the reason is logged)."""
    try:
        return load_prefix_cache(standin=True)[1]
    except ImportError as exc:
        logger.warning("no vllm-omni arm in figures 3 and 6: %s", exc)
        return None


def omni_mode(eager: bool) -> str:
    """How a row names the mode vllm-omni's cache ran in."""
    return "eager: its mode without CUDA" if eager else "threaded: its mode with CUDA (copy streams)"


def served_rows(result: Any, req_ids: list[str], *, key_first: bool = False) -> dict[tuple[str, str], Any]:
    """What a ``materialize`` handed the next stage: ``{(request, tensor name): value}``, hidden states
    under ``HIDDEN_KEY``. omnishm nests ``mm_outputs`` request first; vllm-omni (and omnishm's drop-in,
    which answers in vllm-omni's API) tensor name first: ``key_first``."""
    rows: dict[tuple[str, str], Any] = {}
    for req in req_ids:
        hidden = (result.hidden_states or {}).get(req)
        if hidden is not None:
            rows[(req, HIDDEN_KEY)] = hidden
    if key_first:
        for key, per_req in result.mm_outputs.items():
            rows.update(((req, key), per_req[req]) for req in req_ids if req in per_req)
    else:
        for req in req_ids:
            rows.update(((req, key), val) for key, val in result.mm_outputs.get(req, {}).items())
    return rows


def same_rows(want: dict[tuple[str, str], Any], got: dict[tuple[str, str], Any], what: str, who: str,
              against: str = "omnishm's") -> None:
    """Raise RuntimeError unless ``got`` (``who``'s rows) holds exactly ``want``'s (``against``) tensors, bit for bit.

    Values may also be ``row_digest`` results: they compare as values."""
    if set(want) != set(got):
        diff = sorted(set(want) ^ set(got))[:4]
        raise RuntimeError(f"{what}: {who} served other (request, tensor) pairs than {against}: {diff}")
    for name, a in want.items():
        b = got[name]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            seen = f"{tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
        else:
            same, seen = a == b, f"{a} against {b}"
        if not same:
            raise RuntimeError(f"{what}: {who}'s {name[1]} for {name[0]} differ from {against} ({seen})")


def same_results(ours: Any, theirs: Any, req_ids: list[str], what: str) -> None:
    """Raise RuntimeError unless vllm-omni's materialize served exactly omnishm's rows."""
    same_rows(served_rows(ours, req_ids), served_rows(theirs, req_ids, key_first=True), what, "vllm-omni")


def row_digest(rows: dict[tuple[str, str], Any]) -> dict[tuple[str, str], tuple]:
    """A small stand-in for each value of ``served_rows``, to compare rows no longer held: shape, dtype,
    the sum, and a sum weighted by row position (rows out of order change it)."""
    out: dict[tuple[str, str], tuple] = {}
    for name, t in rows.items():
        if not isinstance(t, torch.Tensor):
            out[name] = (repr(t),)
            continue
        x = t.detach().to("cpu", torch.float64)
        per_row = x.reshape(1) if x.dim() == 0 else x.flatten(1).sum(1) if x.dim() > 1 else x
        out[name] = (tuple(t.shape), t.dtype, float(per_row.sum()),
                     float((per_row * torch.arange(1, len(per_row) + 1, dtype=torch.float64)).sum()))
    return out


@dataclass
class NewRequest:
    """The fields of vLLM's ``NewRequestData`` that the caches read."""

    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    prompt_token_ids: Sequence[int] | None = None
    """The request's tokens (the simulation's: the whole request, not the prompt alone; a hit's are the
    ones read)."""


@dataclass
class CachedRequests:
    """The fields of vLLM V1's ``CachedRequestData`` that the caches read (one list entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, Sequence[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    """The fields of vLLM V1's ``SchedulerOutput`` that the caches read."""

    scheduled_new_reqs: list[NewRequest]
    scheduled_cached_reqs: CachedRequests
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)


class BatchView:
    """Stands in for vllm-omni's ``FullAttentionGroupView``: the batch order and the step's slots.

    The slots are the ones the omnishm arm gets in its write layout, set before the clock starts
    (the omnishm arm's layout is built there too), so neither arm's time includes deriving them.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.req_ids: list[str] = []
        self.slots = torch.empty(0, dtype=torch.int64)

    def set_step(self, layout: PrefixCacheWriteLayout) -> None:
        self.req_ids = [w.req_id for w in layout.writes]
        self.slots = layout.slots

    def batch_req_ids(self) -> list[str]:
        return list(self.req_ids)

    def step_slots_cpu(self, req_ids: list[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        return self.slots


def scheduler_output(step: PrefixCacheStep) -> SchedulerOutput:
    """What vLLM V1 would send for an omnishm step.

    A started request is new (with its hit); a resumed one is a cached request marked resumed, with
    its whole new block list; a running one a cached request; finished and aborted ids are finished.
    """
    new, cached, finished = [], CachedRequests(), set()
    for ev in step.events:
        if ev.kind in (K.FINISHED, K.ABORTED):
            finished.add(ev.req_id)
        elif ev.kind in (K.STARTED, K.REPLACED):
            new.append(NewRequest(ev.req_id, ev.num_computed_tokens, (list(ev.block_ids),), ev.token_ids))
        else:
            cached.req_ids.append(ev.req_id)
            cached.num_computed_tokens.append(ev.num_computed_tokens)
            cached.new_block_ids.append((list(ev.block_ids),) if ev.block_ids or ev.kind is K.RESUMED else None)
            if ev.kind is K.RESUMED:
                cached.resumed_req_ids.add(ev.req_id)
                if ev.token_ids is not None:
                    cached.all_token_ids[ev.req_id] = ev.token_ids
    counts = dict(step.num_scheduled_tokens)
    return SchedulerOutput(new, cached, counts, sum(counts.values()), finished)


class BlockTables(list):
    """vLLM's ``MultiGroupBlockTable``: indexable by KV group, and its ``block_tables``."""

    @property
    def block_tables(self) -> list:
        return list(self)


class InputBatch:
    """The fields of vLLM's ``InputBatch`` that the group views read (omnishm's and vllm-omni's), kept
    from the simulated engine's steps as vLLM's ``_update_states`` keeps them (not a cache's cost)."""

    def __init__(self, max_reqs: int, max_blocks: int, block_size: int):
        self.table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32)
        self.block_table = BlockTables([SimpleNamespace(block_table=SimpleNamespace(cpu=self.table),
                                                        block_size=block_size)])
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int32)
        # vLLM's CPU token ids and prompt lengths: omnishm's group view tags the step's prompt rows from them.
        self.token_ids_cpu = np.zeros((max_reqs, max_blocks * block_size), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int32)

    def update(self, step: "SimStep", blocks: dict[str, list[int]]) -> None:
        """The batch of ``step``, in its write layout's order; ``blocks``: each request's block list."""
        self.req_ids = [w.req_id for w in step.layout.writes]
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        for row, rid in enumerate(self.req_ids):
            ids = blocks[rid]
            self.table[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            _, first, count = step.positions[rid]
            self.num_computed_tokens_cpu[row] = first
            tokens, prompt_len = step.prompts[rid]
            # vLLM keeps a row's whole prompt there (its add_request; condense and swaps move whole rows), and
            # the tags' chains read it from position 0: this fake's rows change requests step by step.
            self.token_ids_cpu[row, :first + count] = tokens[:first + count]
            self.num_prompt_tokens[row] = prompt_len


class VllmOmniOwnCache:
    """vllm-omni's own in-process cache (its ``OmniPrefixCacheManager``), driven with omnishm's step objects
    so the benchmark's arms call both alike. Not omnishm's drop-in (``omnishm.integrations.vllm_omni``).

    With ``batch`` it reads the step's slots through vllm-omni's own group view over that batch, as in
    its runner; without, from the write layout (``BatchView``).
    """

    def __init__(self, *, num_blocks: int, block_size: int, staging_capacity_tokens: int, staging_depth: int,
                 eager: bool | None = None, batch: InputBatch | None = None):
        pc, self.version = load_prefix_cache(standin=True)
        cfg = pc.PrefixCacheConfig(num_blocks=num_blocks, block_size=block_size,
                                   staging_capacity_tokens=staging_capacity_tokens, staging_depth=staging_depth,
                                   staging_claim_timeout_s=60.0)
        self.config = cfg
        """vllm-omni's ``PrefixCacheConfig`` of this cache (the drop-in arm takes the same)."""
        self.view: Any = BatchView(block_size) if batch is None else pc.FullAttentionGroupView(batch, block_size)
        self.m: Any = pc.OmniPrefixCacheManager(cfg, self.view, eager=eager)
        self.eager = bool(self.m._controller._eager)
        self.hidden_key = pc.HIDDEN_KEY

    def new_step_starts(self, step: PrefixCacheStep | SchedulerOutput) -> None:
        self.m.new_step_starts(scheduler_output(step) if isinstance(step, PrefixCacheStep) else step)

    def save_outputs(self, hidden: torch.Tensor, mm: dict[str, torch.Tensor], *, num_tokens_unpadded: int,
                     num_tokens_padded: int, write_layout: PrefixCacheWriteLayout | None = None) -> int:
        """``write_layout`` only feeds a ``BatchView``; vllm-omni's save does not take one."""
        if isinstance(self.view, BatchView):
            assert write_layout is not None
            self.view.set_step(write_layout)
        return self.m.save_outputs(hidden, mm, num_tokens_unpadded=num_tokens_unpadded,
                                   num_tokens_padded=num_tokens_padded)

    def materialize(self, step_id: int, req_ids: list[str]) -> Any:
        return self.m.materialize(step_id, req_ids)

    def discard_step(self, step_id: int) -> None:
        self.m.discard_step(step_id)

    def wait_idle(self) -> None:
        """Every write the manager queued has landed in its pool (threaded mode; eager writes at once)."""
        ctl = self.m._controller
        ctl.join(list(ctl._tasks))

    def shutdown(self) -> None:
        self.m.shutdown()
