"""A small vLLM-like engine simulation with known ground truth.

Used by ``omnishm demo``, the randomized contract tests, the chaos test and
the benchmarks. It has what makes the omni prefix cache hard: a block
allocator with prefix hashing and LRU reuse of freed blocks (a freed block
keeps its hash until reused, and is revived by a hit), chunked prefill, decode,
finish, abort and preemption, hashes registered at scheduling time (so a
request can hit blocks another request computes in the same step), and
finished ids reported one step late, as vLLM does.

Ground truth: the output row of a token depends only on the token prefix that
ends at it (a rolling hash), exactly like a causal model's hidden state, so
any rank and any replay produce the same rows. Every row carries its token tag
and every hit its tokens, as the vLLM integration gives them, so the writer's
token check (``client/tokens.py``) runs wherever the simulation does.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnishm.client.adapter import (PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheStep,
                                    PrefixCacheWrite, PrefixCacheWriteLayout)
from omnishm.client.tokens import prefix_chains, token_tags

if TYPE_CHECKING:
    from omnishm.client.manager import OmniPrefixCacheManager

_MASK = (1 << 61) - 1
MAX_NEW_TOKENS = 12
"""A request generates 1 to this many tokens after its prompt."""
MM_SALT = 0x5A5A
"""The ground-truth salt of the first multimodal key (``SimEngine.mm_salt``): each key's rows differ."""


def _mix(h: int, token: int) -> int:
    return ((h * 1000003) ^ (token * 0x9E3779B1) ^ (h >> 29)) & _MASK


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 1469598103934665603 & _MASK
    for t in tokens:
        h = _mix(h, t)
        out.append(h)
    return out


def truth_rows(hashes: list[int], width: int, salt: int = 0) -> torch.Tensor:
    """Deterministic float32 rows, exact in bf16/fp16 too (small integers)."""
    if not hashes:
        return torch.empty((0, width), dtype=torch.float32)
    h = torch.tensor([(x ^ salt) & 0xFFFFFF for x in hashes], dtype=torch.int64)
    j = torch.arange(width, dtype=torch.int64)
    # Column j mixes in its own 12-bit window of the hash (modulo 251 alone would leave 251 distinct rows,
    # so a row served from the wrong position would match 1 time in 251).
    window = (h[:, None] >> ((j[None, :] % 13) * 1)) & 0xFFF
    return (((window * 131 + h[:, None] * 17 + j[None, :] * 7919) % 251) - 125).to(torch.float32)


@dataclass
class SimRequest:
    req_id: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    abort_at: int | None = None
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    started: bool = False
    hashes: list[int] = field(default_factory=list)

    @property
    def remaining_prompt(self) -> int:
        return max(self.prompt_len - self.num_computed, 0)

    @property
    def generated(self) -> int:
        return max(len(self.tokens) - self.prompt_len, 0)


class BlockAllocator:
    """Blocks with prefix hashing and LRU reuse of freed blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.reuses = 0

    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, block_hashes: list[int]) -> list[int]:
        out = []
        for h in block_hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take_hit(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)  # least recently freed first
        old = self.block_hash[b]
        if old is not None:
            self.by_hash.pop(old, None)
            self.block_hash[b] = None
            self.reuses += 1
        self.ref[b] = 1
        return b

    def register(self, block: int, h: int) -> None:
        if self.block_hash[block] is None and h not in self.by_hash:
            self.block_hash[block] = h
            self.by_hash[h] = block

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None


@dataclass
class SimStep:
    """One scheduled step: events for new_step_starts, the write layout, the outputs."""

    step: PrefixCacheStep
    layout: PrefixCacheWriteLayout
    hidden: torch.Tensor
    mm: dict[str, torch.Tensor]
    positions: dict[str, tuple[int, int, int]]  # req -> (hit tokens, first computed pos, count)
    hashes: dict[str, list[int]]
    hit_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The blocks of each request's hit (requests with one only): its hit rows are their slots."""
    prompts: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    """Each request's tokens (the engine's live list: later steps append to it) and prompt length."""

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    def run(self, manager: "OmniPrefixCacheManager", *, with_mm: bool = True, device: str | None = None) -> int:
        """``new_step_starts`` then ``save_outputs`` of this step, as a runner calls them; the step id.

        With a ``device`` (``"cuda"``) the outputs are saved from device buffers, and those buffers are
        overwritten with NaN right after the save returns, as the next CUDA-graph replay overwrites a
        runner's live output buffers: a cache that read them late would serve NaN rows.
        """
        manager.new_step_starts(self.step)
        hidden, mm = self.hidden, (self.mm if with_mm else {})
        if device is not None and device != "cpu":
            hidden, mm = hidden.to(device), {k: v.to(device) for k, v in mm.items()}
        sid = manager.save_outputs(hidden, mm, num_tokens_unpadded=self.num_tokens,
                                   num_tokens_padded=self.num_tokens, write_layout=self.layout)
        if hidden is not self.hidden:
            for live in (hidden, *mm.values()):
                live.fill_(float("nan"))
        return sid


class SimEngine:
    """Deterministic for a given seed; every TP rank running it sees the same steps."""

    def __init__(self, *, num_blocks: int, block_size: int, max_batched_tokens: int, width: int,
                 mm_key: str | None = "mm_feat", mm_width: int = 4, seed: int = 0, system_prompts: int = 3,
                 system_len: int = 96, max_running: int = 8, abort_rate: float = 0.05, vocab: int = 997,
                 preempt_rate: float = 0.0, extra_mm_keys: tuple[str, ...] = ()):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.bs = block_size
        self.budget = max_batched_tokens
        self.width = width
        self.mm_key = mm_key
        self.mm_width = mm_width
        self.mm_keys = ((mm_key,) if mm_key else ()) + tuple(extra_mm_keys)
        """Every multimodal key of a step's outputs, each ``mm_width`` wide, each with rows of its own."""
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.abort_rate = abort_rate
        self.preempt_rate = preempt_rate
        """Chance per step that the last running request is preempted although blocks are left: the demo's
        default sizes almost never run out of blocks, and so almost never resumed a request with a hit."""
        self.max_running = max_running
        self.systems = [[self.rng.randrange(vocab) for _ in range(system_len)] for _ in range(system_prompts)]
        self.histories: list[list[int]] = []
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.pending_finished: list[tuple[str, bool]] = []
        self.counter = 0
        self.requests_done = 0
        self.same_step_hits = 0
        self.preemptions = 0
        self.resumed_hits = 0
        """RESUMED events with a prefix hit: a preempted request scheduled again on cached blocks."""
        self.max_prompt = self.max_prompt_tokens(block_size, max_batched_tokens)

    @staticmethod
    def max_prompt_tokens(block_size: int, max_batched_tokens: int) -> int:
        """The longest prompt ``add_request`` makes (longer ones keep their last tokens)."""
        return max(block_size * 2, max_batched_tokens * 3)

    @classmethod
    def blocks_for_longest_request(cls, block_size: int, max_batched_tokens: int) -> int:
        """KV blocks the longest request can hold at once: its prompt plus ``MAX_NEW_TOKENS`` (a preempted
        request keeps what it generated as prompt, and only the rest of its budget to generate).

        With fewer blocks in the cache it is never scheduled in full: it is preempted, re-queued
        first, and every step after is a step of 0 tokens, for good.
        """
        return -(-(cls.max_prompt_tokens(block_size, max_batched_tokens) + MAX_NEW_TOKENS) // block_size)

    # ---------------------------------------------------------------- workload

    def top_up(self, waiting: int) -> None:
        """Add requests until ``waiting`` are queued."""
        while len(self.waiting) < waiting:
            self.add_request()

    def add_request(self) -> SimRequest:
        r = self.rng.random()
        if self.histories and r < 0.35:
            base = self.rng.choice(self.histories)  # next turn of a conversation
        else:
            base = list(self.rng.choice(self.systems))
        prompt = base + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 3 * self.bs))]
        prompt = prompt[-self.max_prompt:] if len(prompt) > self.max_prompt else prompt
        self.counter += 1
        req = SimRequest(req_id=f"req-{self.counter}", tokens=prompt, prompt_len=len(prompt),
                         max_new=self.rng.randint(1, MAX_NEW_TOKENS))
        if self.rng.random() < self.abort_rate:
            req.abort_at = self.rng.randint(0, 6)
        self.waiting.append(req)
        return req

    # ---------------------------------------------------------------- scheduling

    def _block_hashes(self, req: SimRequest, upto: int) -> list[int]:
        hs = prefix_hashes(req.tokens[:upto])
        return [hs[i + self.bs - 1] for i in range(0, upto - self.bs + 1, self.bs)]

    def _ensure_blocks(self, req: SimRequest, upto_tokens: int) -> bool:
        need = -(-upto_tokens // self.bs) - len(req.blocks)
        if need > self.alloc.num_free():
            return False
        for _ in range(max(need, 0)):
            req.blocks.append(self.alloc.allocate())
        return True

    def _register_full(self, req: SimRequest, upto_tokens: int) -> None:
        for i, h in enumerate(self._block_hashes(req, upto_tokens)):
            if i < len(req.blocks):
                self.alloc.register(req.blocks[i], h)

    def _finish(self, req: SimRequest, aborted: bool) -> None:
        self.running.remove(req)
        self.alloc.release(req.blocks)
        req.blocks = []
        self.pending_finished.append((req.req_id, aborted))
        self.requests_done += 1
        if not aborted and len(self.histories) < 64:
            self.histories.append(list(req.tokens))

    def _preempt(self) -> None:
        victim = self.running[-1]
        self.preemptions += 1
        self.running.remove(victim)
        self.alloc.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        # Recompute from scratch: the prompt is now everything seen so far. What it generated counts against
        # its budget (as vLLM's max_tokens does), so no request outgrows its prompt + max_new, the length
        # blocks_for_longest_request sizes the cache for.
        victim.max_new -= victim.generated
        if victim.abort_at is not None:
            victim.abort_at = max(victim.abort_at - victim.generated, 0)
        victim.prompt_len = len(victim.tokens)
        self.waiting.insert(0, victim)

    def schedule(self) -> SimStep:
        """Build the next step. Aborts and finishes become events of the following step."""
        events: list[PrefixCacheRequestEvent] = []
        for rid, aborted in self.pending_finished:
            events.append(PrefixCacheRequestEvent(
                PrefixCacheEventKind.ABORTED if aborted else PrefixCacheEventKind.FINISHED, rid))
        self.pending_finished = []
        if self.preempt_rate and len(self.running) > 1 and self.rng.random() < self.preempt_rate:
            self._preempt()  # no draw at rate 0: the schedules of a seed stay what they were
        budget = self.budget
        batch: list[tuple[SimRequest, int, int]] = []  # req, hit, count
        written: set[int] = set()  # blocks whose rows this step computes
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            count = min(req.remaining_prompt, budget) if req.remaining_prompt else 1
            while not self._ensure_blocks(req, req.num_computed + count):
                if len(self.running) <= 1 or self.running[-1] is req:
                    count = 0
                    break
                self._preempt()
            if count == 0 or req not in self.running:
                continue
            new_blocks = ()
            events.append(PrefixCacheRequestEvent(PrefixCacheEventKind.EXTENDED, req.req_id,
                                                  num_computed_tokens=req.num_computed, block_ids=new_blocks))
            batch.append((req, 0, count))
            written.update(self._written_blocks(req, count))
            self._register_full(req, min(req.num_computed + count, len(req.tokens)))
            budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            full = self._block_hashes(req, len(req.tokens))
            hit_blocks = self.alloc.lookup(full)
            max_hit = (len(req.tokens) - 1) // self.bs
            hit_blocks = hit_blocks[:max_hit]
            if any(b in written for b in hit_blocks):
                self.same_step_hits += 1
            hit = len(hit_blocks) * self.bs
            count = min(len(req.tokens) - hit, budget)
            need = -(-(hit + count) // self.bs) - len(hit_blocks)
            if need > self.alloc.num_free() - sum(1 for b in hit_blocks if self.alloc.ref[b] == 0):
                break
            self.waiting.pop(0)
            self.alloc.take_hit(hit_blocks)
            req.blocks = list(hit_blocks)
            req.num_computed = hit
            self._ensure_blocks(req, hit + count)
            kind = PrefixCacheEventKind.RESUMED if req.started else PrefixCacheEventKind.STARTED
            self.resumed_hits += kind == PrefixCacheEventKind.RESUMED and hit > 0
            req.started = True
            # The hit's tokens, as vLLM's scheduler output carries them: the writer checks its rows against them.
            events.append(PrefixCacheRequestEvent(kind, req.req_id, num_computed_tokens=hit,
                                                  block_ids=tuple(req.blocks),
                                                  token_ids=tuple(req.tokens) if hit else None))
            self.running.append(req)
            batch.append((req, hit, count))
            written.update(self._written_blocks(req, count))
            # Hashes are registered at scheduling time, as vLLM does: a later
            # request of this same step can hit blocks this one computes now.
            self._register_full(req, min(req.num_computed + count, len(req.tokens)))
            budget -= count
        return self._outputs(events, batch)

    def _written_blocks(self, req: SimRequest, count: int) -> set[int]:
        first, last = req.num_computed // self.bs, (req.num_computed + count - 1) // self.bs
        return set(req.blocks[first:last + 1])

    def _outputs(self, events, batch) -> SimStep:
        writes, slot_parts, rows, tags = [], [], [], []
        mm_rows: dict[str, list[torch.Tensor]] = {key: [] for key in self.mm_keys}
        positions: dict[str, tuple[int, int, int]] = {}
        prompts: dict[str, tuple[list[int], int]] = {}
        hashes: dict[str, list[int]] = {}
        hit_blocks: dict[str, tuple[int, ...]] = {}
        start = 0
        num_sched: dict[str, int] = {}
        for req, hit, count in batch:
            pos = torch.arange(req.num_computed, req.num_computed + count, dtype=torch.int64)
            blocks = torch.tensor(req.blocks, dtype=torch.int64)
            slot_parts.append(blocks[pos // self.bs] * self.bs + pos % self.bs)
            # Every row's token is known here, generated ones too (vLLM's integration tags prompt rows only).
            ids = np.asarray(req.tokens[:req.num_computed + count], dtype=np.int64)
            tags.append(np.stack([token_tags(ids[req.num_computed:], pos.numpy()),
                                  prefix_chains(ids)[req.num_computed:]], axis=1))
            prompts[req.req_id] = (req.tokens, req.prompt_len)
            hs = prefix_hashes(req.tokens[:req.num_computed + count])
            hashes[req.req_id] = hs
            rows.append(truth_rows(hs[req.num_computed:], self.width))
            for key, parts in mm_rows.items():
                parts.append(truth_rows(hs[req.num_computed:], self.mm_width, salt=self.mm_salt(key)))
            writes.append(PrefixCacheWrite(req.req_id, start, count))
            positions[req.req_id] = (hit, req.num_computed, count)
            if hit:
                hit_blocks[req.req_id] = tuple(req.blocks[:hit // self.bs])
            num_sched[req.req_id] = count
            start += count
        slots = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.int64)
        hidden = torch.cat(rows) if rows else torch.empty((0, self.width))
        mm = {key: torch.cat(parts) for key, parts in mm_rows.items()} if batch else {}
        return SimStep(step=PrefixCacheStep(tuple(events), num_sched),
                       layout=PrefixCacheWriteLayout(tuple(writes), slots,
                                                     np.concatenate(tags) if tags else None),
                       hidden=hidden, mm=mm, positions=positions, hashes=hashes, hit_blocks=hit_blocks,
                       prompts=prompts)

    def advance(self, sim_step: SimStep) -> None:
        """After the forward: account computed tokens, decode, finish, abort."""
        for req in list(self.running):
            if req.req_id not in sim_step.positions:
                continue
            _, first, count = sim_step.positions[req.req_id]
            req.num_computed = first + count
            if req.num_computed >= len(req.tokens):
                hs = sim_step.hashes[req.req_id]
                req.tokens.append(int(hs[-1] % self.vocab))  # the sampled token
                if req.abort_at is not None and req.generated >= req.abort_at:
                    self._finish(req, aborted=True)
                elif req.generated >= req.max_new:
                    self._finish(req, aborted=False)

    def mm_salt(self, key: str) -> int:
        """The ground-truth salt of multimodal key ``key`` (``expected``'s ``salt``)."""
        return MM_SALT ^ (0x10101 * self.mm_keys.index(key))

    def expected(self, sim_step: SimStep, req_id: str, salt: int = 0, width: int | None = None) -> torch.Tensor:
        """Ground truth of the merged rows for req: positions 0..hit-1, then this step's positions."""
        hit, first, count = sim_step.positions[req_id]
        hs = sim_step.hashes[req_id]
        return truth_rows(hs[:hit] + hs[first:first + count], width or self.width, salt)
