"""The group view of vLLM's V2 model runner (the only runner in vLLM 0.34; vLLM 0.32/0.33's GPU default).

vLLM's V1 runner keeps a persistent ``input_batch`` with a CPU block table, which ``FullAttentionGroupView``
reads. The V2 runner keeps its block table on the device only (``block_tables``, a staged GPU tensor) and
builds its slot mapping there, in a kernel; reading that back would wait for the forward and stall the engine
thread. Its per-step ``InputBatch`` (``execute_model_state.input_batch``) does carry, on the host, the batch
order (``req_ids``), each request's token count (``num_scheduled_tokens``) and computed-token count
(``num_computed_tokens_np``). What is missing is each request's block ids: ``BlockIdMirror`` keeps them from
the scheduler outputs, exactly as the runner's own ``finish_requests`` / ``add_requests`` /
``update_requests`` do (finished and preempted requests dropped; a new request's ids replace any; a cached
request's new ids appended). ``V2StepGroupView`` then gives ``batch_req_ids`` and ``step_slots_cpu`` as the
V1 view does, with ``slot = blocks[pos // block_size] * block_size + pos % block_size``.

Row order: V2 sorts a step's requests (decodes first, then by token count), so the forward's rows follow
``input_batch.req_ids``, not the scheduler's order; ``query_start_loc_np`` must be the running sum of the
counts in that order (checked: rows attributed to another request would be wrong rows).

The gate admits exactly one KV-cache group, so block ids are group 0's. Engine thread only. Nothing here
imports vllm.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import numpy as np
import torch

from omnishm.client.adapter import id_collection
from omnishm.client.group_view import extend_slots
from omnishm.client.tokens import PromptChains, Run, note_chains, row_tags
from omnishm.interface import ReqId, unmatch

__all__ = ["BlockIdMirror", "V2StepGroupView", "is_v2_runner"]


def is_v2_runner(runner: Any) -> bool:
    """Whether ``runner`` is of vLLM's V2 model-runner family: request states and ``add_requests``, per-step
    input batches, no persistent ``input_batch`` nor ``_update_states`` (``vllm/v1/worker/gpu/model_runner.py``;
    its ``block_tables`` come only at KV-cache init, after the worker extension installs the hooks)."""
    return (hasattr(runner, "req_states") and hasattr(runner, "add_requests")
            and hasattr(runner, "execute_model_state") and not hasattr(runner, "_update_states"))


class BlockIdMirror:
    """Each live request's KV block ids (the one full-attention group), kept on the host from the scheduler
    outputs. ``update`` must see every scheduler output the runner sees, in order, before the runner's
    ``execute_model`` (the hooks call it at step begin). Engine thread only."""

    def __init__(self) -> None:
        self._blocks: dict[ReqId, list[int]] = {}
        self._prompts: dict[ReqId, tuple[Any, Any, bool]] = {}
        """Each live request's prompt token ids and which of them are ids (vLLM 0.32's ``prompt_is_token_ids``;
        None: all), as its scheduler output gave them (kept, not copied), and whether ``prompt`` made them
        checked arrays yet (none for a prompt of embeddings or a request seeded from the runner): the rows the
        view tags (``client/tokens.py``)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def update(self, scheduler_output: Any) -> None:
        """Apply one step's scheduler output, as the V2 runner applies it to its own block table."""
        so = scheduler_output
        for rid in id_collection(so.finished_req_ids, "finished_req_ids"):
            self._blocks.pop(rid, None)
            self._prompts.pop(rid, None)
        for rid in id_collection(getattr(so, "preempted_req_ids", None), "preempted_req_ids"):
            self._blocks.pop(rid, None)  # re-sent as new, with all its block ids, when it resumes
            self._prompts.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = [int(b) for b in new.block_ids[0]]
            prompt = getattr(new, "prompt_token_ids", None)
            if prompt is not None:
                self._prompts[new.req_id] = (prompt, getattr(new, "prompt_is_token_ids", None), False)
            else:
                self._prompts.pop(new.req_id, None)
        cached = so.scheduled_cached_reqs
        resumed = set(id_collection(getattr(cached, "resumed_req_ids", None), "resumed_req_ids"))
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            ids = [int(b) for b in new_ids[0]]
            if rid in resumed:  # vLLM 0.32/0.33's resume as a cached request: its whole list
                self._blocks[rid] = ids
            else:
                self._blocks.setdefault(rid, []).extend(ids)

    def seed(self, runner: Any) -> int:
        """Take the block ids of the requests the runner holds now (hooks installed while requests run:
        ``omnishm_install`` after ``omnishm_shutdown``); returns how many. Reads the runner's own tables once,
        between steps (``req_states.req_id_to_index``, group 0 of ``block_tables`` and its ``num_blocks``): a
        one-off device-to-host copy in an admin call, never on a step. A runner without them (before its KV
        cache exists) holds no request."""
        index = getattr(getattr(runner, "req_states", None), "req_id_to_index", None)
        tables = getattr(runner, "block_tables", None)
        if not index or tables is None:
            return 0
        table = tables.block_tables[0].gpu
        counts = tables.num_blocks.np[0]
        for rid, idx in index.items():
            self._blocks[rid] = [int(b) for b in table[idx, :int(counts[idx])].tolist()]
        return len(index)

    def prompt(self, rid: ReqId) -> tuple[Sequence[int], Sequence[bool] | None] | None:
        """The request's prompt token ids and which are ids (None: all), or None when the mirror has none or
        its ids are no list of integers. Made numpy arrays on first use and kept so: each chunk's tags need
        the prompt from position 0 (the chain), and a list made an array again each step cost O(prompt)."""
        known = self._prompts.get(rid)
        if known is None or known[2]:
            return None if known is None else (known[0], known[1])
        try:
            ids = np.asarray(known[0])
            is_ids = None if known[1] is None else np.asarray(known[1], dtype=bool)
        except Exception:  # noqa: BLE001 - ids numpy cannot read are not compared (tokens.hit_token_tags)
            ids = is_ids = None
        if ids is None or ids.dtype.kind not in "iu" or ids.ndim != 1 or \
                (is_ids is not None and is_ids.shape != ids.shape):
            self._prompts.pop(rid, None)
            return None
        ids = ids.astype(np.int64, copy=False)
        self._prompts[rid] = (ids, is_ids, True)
        return ids, is_ids

    def blocks(self, rid: ReqId) -> list[int]:
        """The request's block ids; ``OmniPrefixCacheUnmatchError`` when the mirror has none for it."""
        try:
            return self._blocks[rid]
        except KeyError:
            raise unmatch("no block ids were seen for this batch request (the mirror missed a scheduler "
                          "output)", req_id=rid) from None


class V2StepGroupView:
    """Batch order and slots of one V2 step: its ``InputBatch`` (``execute_model_state.input_batch``, read after
    the forward) and the mirror's block ids. Duck-types ``FullAttentionGroupView`` for ``build_write_layout``."""

    def __init__(self, input_batch: Any, mirror: BlockIdMirror, block_size: int) -> None:
        self.input_batch = input_batch
        self.mirror = mirror
        self.block_size = block_size

    @property
    def batch_req_ids(self) -> list[ReqId]:
        """Request ids in the forward's row order."""
        return list(self.input_batch.req_ids)

    def step_slots_cpu(self, num_scheduled_tokens: Sequence[int]) -> torch.Tensor:
        """``int64 [sum(counts)]``: each token's slot, in row order. ``num_scheduled_tokens``: one count per
        ``batch_req_ids`` entry. Raises ``OmniPrefixCacheUnmatchError`` when the counts or the row offsets
        disagree with the batch's, or a position falls past the request's block ids."""
        ib = self.input_batch
        ids = self.batch_req_ids
        counts = [int(n) for n in num_scheduled_tokens]
        theirs = [int(n) for n in ib.num_scheduled_tokens[:len(ids)]]
        if counts != theirs:
            raise unmatch(f"scheduled-token counts {counts} differ from the runner's batch {theirs}")
        starts = [int(s) for s in ib.query_start_loc_np[:len(ids) + 1]]
        running = 0
        for rid, n, start in zip(ids, counts, starts):
            if start != running:  # rows not in batch order: they would go to another request
                raise unmatch(f"batch rows start at {start}, not {running}", req_id=rid)
            running += n
        computed = ib.num_computed_tokens_np
        bs = self.block_size
        out = array("q")
        for i, (rid, n) in enumerate(zip(ids, counts)):
            if not n:
                continue
            blocks = self.mirror.blocks(rid)
            pos = int(computed[i])
            end = pos + n
            if (end - 1) // bs >= len(blocks):
                first = max(pos, len(blocks) * bs)
                raise unmatch(f"position {first} (block {first // bs}) is past the request's {len(blocks)} "
                              f"blocks (block_size {bs})", req_id=rid)
            extend_slots(out, blocks, pos, end, bs)
        return torch.frombuffer(out, dtype=torch.int64) if out else torch.empty(0, dtype=torch.int64)

    def step_token_tags_cpu(self, num_scheduled_tokens: Sequence[int],
                            chains: PromptChains | None = None) -> np.ndarray | None:
        """This step's row tags (``client/tokens.py``, ``rows x 2``) in ``step_slots_cpu``'s order, from the
        prompt token ids the mirror kept: each prompt row's tags, 0 for generated tokens and for requests
        without ids. None when no row of the step is a known prompt row. Call after ``step_slots_cpu`` checked
        the counts. ``chains``: as ``FullAttentionGroupView.step_token_tags_cpu`` takes it."""
        computed = self.input_batch.num_computed_tokens_np
        spans: list[Run] = []
        ends: list[tuple[ReqId, int, int]] = []
        at = 0
        for i, (rid, n) in enumerate(zip(self.batch_req_ids, num_scheduled_tokens)):
            n = int(n)
            known = self.mirror.prompt(rid) if n else None
            if known is not None:
                prompt, is_ids = known
                pos = int(computed[i])
                end = min(pos + n, len(prompt))
                if end > pos:
                    before = (chains.before(rid, pos, is_ids) if chains is not None else None) if pos else 0
                    spans.append(Run(at, pos, prompt[:end], None if is_ids is None else is_ids[:end], before))
                    if end < len(prompt):  # (a run that ends its prompt has no next run)
                        ends.append((rid, end, at + end - pos - 1))
            at += n
        if not spans:
            return None
        tags = row_tags(at, spans)
        note_chains(chains, ends, tags)
        return tags
