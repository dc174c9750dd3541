"""Hand-built steps for the manager contract tests.

A request's rows are a pure function of a content tag and token position, so
a test states what content a slot must hold and checks it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout
from omnishm.interface import PrefixCacheConfig

WIDTH = 8
MM_WIDTH = 3
BS = 4


def small_config(**kw) -> PrefixCacheConfig:
    """The small geometry of the hand-built tests (16 blocks of 4 slots, 3 staging pages of 32 rows)."""
    base = dict(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3,
                staging_claim_timeout_s=2.0, commit_timeout_s=5.0)
    base.update(kw)
    return PrefixCacheConfig(**base)


def quick_config(**kw) -> PrefixCacheConfig:
    """``small_config`` whose full staging fails fast (0.5 s): the manager tests' default."""
    return small_config(**{"staging_claim_timeout_s": 0.5, **kw})


def rows(tag: int, positions, width: int = WIDTH, dtype=torch.float32) -> torch.Tensor:
    pos = torch.as_tensor(list(positions), dtype=torch.int64)
    j = torch.arange(width, dtype=torch.int64)
    return (tag * 1000 + pos[:, None] * 10 + j[None, :]).to(dtype)


def started(req: str, blocks, hit: int = 0) -> E:
    return E(K.STARTED, req, num_computed_tokens=hit, block_ids=tuple(blocks))


def extended(req: str, computed: int, new_blocks=()) -> E:
    return E(K.EXTENDED, req, num_computed_tokens=computed, block_ids=tuple(new_blocks))


def finished(req: str) -> E:
    return E(K.FINISHED, req)


def aborted(req: str) -> E:
    return E(K.ABORTED, req)


@dataclass
class Part:
    """One request's share of a step: positions first..first+count of content ``tag`` in ``blocks``."""

    req: str
    tag: int
    blocks: list[int]
    first: int
    count: int


def build(parts: list[Part], block_size: int, *, mm_key: str | None = "feat", padded: int = 0):
    """(hidden, mm, layout, n, padded) for a step made of ``parts`` in batch order."""
    writes, slots, hidden, mm = [], [], [], []
    start = 0
    for p in parts:
        pos = torch.arange(p.first, p.first + p.count)
        blocks = torch.as_tensor(p.blocks, dtype=torch.int64)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        hidden.append(rows(p.tag, pos.tolist()))
        mm.append(rows(p.tag + 500, pos.tolist(), MM_WIDTH))
        writes.append(PrefixCacheWrite(p.req, start, p.count))
        start += p.count
    n = start
    pad = padded or n
    h = torch.cat(hidden) if hidden else torch.empty((0, WIDTH))
    f = torch.cat(mm) if mm else torch.empty((0, MM_WIDTH))
    if pad > n:
        h = torch.cat([h, torch.full((pad - n, WIDTH), -1.0)])
        f = torch.cat([f, torch.full((pad - n, MM_WIDTH), -1.0)])
    layout = PrefixCacheWriteLayout(tuple(writes), torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64))
    return h, ({mm_key: f} if mm_key else {}), layout, n, pad


def save(m, parts: list[Part], block_size: int, *, extra_mm: dict | None = None, mm_key: str | None = "feat",
         padded: int = 0) -> int:
    h, mm, layout, n, pad = build(parts, block_size, mm_key=mm_key, padded=padded)
    mm.update(extra_mm or {})
    return m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)


def one_applied_step(m) -> None:
    """Request "a" saves its first 4 rows (tag 1, block 0) and the committer applies them: how a fault
    test starts (the keys are open and mapped, one step is acknowledged). ``BS`` blocks."""
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()


def expect(tag_prefix: int, hit: int, tag_step: int, first: int, count: int, width: int = WIDTH,
           mm: bool = False) -> torch.Tensor:
    off = 500 if mm else 0
    w = MM_WIDTH if mm else width
    parts = []
    if hit:
        parts.append(rows(tag_prefix + off, range(hit), w))
    parts.append(rows(tag_step + off, range(first, first + count), w))
    return torch.cat(parts)


def hit_beside_plain(w, r) -> int:
    """A writer ``w`` and a reader ``r``: request a's block 0 (tag 1) committed, then a step where d hits it
    (4 tokens, then 2 rows of tag 4) beside e (3 rows of tag 5, no hit). The writer's step is discarded
    once saved; returns the reader's step id."""
    for m in (w, r):
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    w.wait_idle()
    sids = []
    for m in (w, r):
        m.new_step_starts([started("d", [0, 2], hit=4), started("e", [3])])
        sids.append(save(m, [Part("d", 4, [0, 2], 4, 2), Part("e", 5, [3], 0, 3)], BS))
    w.discard_step(sids[0])
    return sids[1]
