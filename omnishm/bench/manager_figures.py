"""Figures 2 (hit read bandwidth) and 3 (engine-thread cost per step); figure 6 is ``overhead``.

Both drive ``OmniPrefixCacheManager`` on this (the engine) thread, the
way a model runner does: ``new_step_starts``, ``save_outputs``,
``materialize``. Main thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnishm.bench.common import (Cleanup, Memcpy, ProcessCommitter, Row, Stats, ThreadCommitter, close_all, prefaulted,
                                  timed)
from omnishm.bench.vllm_omni_arm import (VllmOmniOwnCache, omni_mode, same_results, same_rows, served_rows,
                                         vllm_omni_version)
from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheStep, PrefixCacheWrite, PrefixCacheWriteLayout
from omnishm.client.result_pool import ResultPool
from omnishm.interface import HIDDEN_KEY

BS = 16


def _slots(blocks: list[int], first: int, count: int) -> torch.Tensor:
    pos = torch.arange(first, first + count, dtype=torch.int64)
    b = torch.as_tensor(blocks, dtype=torch.int64)
    return b[pos // BS] * BS + pos % BS


def _layout(parts: list[tuple[str, list[int], int, int]]) -> PrefixCacheWriteLayout:
    """parts: (req, blocks, first position, count), rows in batch order (the runner builds this, not the cache)."""
    writes, slots, start = [], [], 0
    for req, blocks, first, count in parts:
        writes.append(PrefixCacheWrite(req, start, count))
        slots.append(_slots(blocks, first, count))
        start += count
    return PrefixCacheWriteLayout(tuple(writes), torch.cat(slots))


def _save(m: Any, parts: list[tuple[str, list[int], int, int]], hidden: torch.Tensor,
          mm: dict[str, torch.Tensor] | None = None, layout: PrefixCacheWriteLayout | None = None) -> int:
    layout = layout or _layout(parts)
    n = layout.num_tokens
    return m.save_outputs(hidden[:n], {k: v[:n] for k, v in (mm or {}).items()}, num_tokens_unpadded=n,
                          num_tokens_padded=n, write_layout=layout)


def _fill(m: Any, req: str, blocks: list[int], tokens: int, chunk: int, rows: torch.Tensor,
          mm: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``tokens`` rows of ``req`` (and of each ``mm`` key) in chunks, then finish it (rows land)."""
    for first in range(0, tokens, chunk):
        count = min(chunk, tokens - first)
        ev = E(K.STARTED, req, 0, tuple(blocks)) if first == 0 else E(K.EXTENDED, req, first, ())
        m.new_step_starts(PrefixCacheStep((ev,), {req: count}))
        part_mm = {k: v[first:first + count] for k, v in (mm or {}).items()}
        m.discard_step(_save(m, [(req, blocks, first, count)], rows[first:first + count], part_mm))
    m.new_step_starts(PrefixCacheStep((E(K.FINISHED, req),), {}))
    m.wait_idle()


# ---------------------------------------------------------------- figure 2


@dataclass
class ReadSize:
    hit_tokens: int
    width: int
    chunk: int
    reps: int


def _check_and_spoil(got: torch.Tensor, hit: torch.Tensor, tail: torch.Tensor, what: str) -> None:
    """Raise unless ``got`` is ``hit`` then ``tail``, bit for bit; then spoil one element of each of its rows.

    Every call, outside the clock. The result memory is recycled (the result pool, the ``out=`` buffer),
    so a copy skipped into it would still find the previous call's identical rows there: flipping bits
    of each row's first element makes such a row differ at the next check. It dirties one cache line per
    row (1/128 of the bytes at 8 KiB rows), which the copies of whole hits between two uses of the same
    memory evict."""
    h = len(hit)
    rows = got.view(torch.int16)
    ok = (len(got) == h + len(tail) and torch.equal(rows[:h], hit.view(torch.int16))
          and torch.equal(rows[h:], tail.view(torch.int16)))
    if not ok:
        raise RuntimeError(f"figure 2, {what}: the materialized hit differs from the rows written")
    rows[:, 0] ^= 0x5A5A


def figure_read(cleanup: Cleanup, size: ReadSize) -> list[Row]:
    """Figure 2: materialize of a long hit vs memcpy of its bytes; plus the copy strategies it could use."""
    h, width = size.hit_tokens, size.width
    nb = h // BS
    cfg = PrefixCacheConfig(num_blocks=nb + 4, block_size=BS, staging_capacity_tokens=size.chunk, staging_depth=2,
                            commit_timeout_s=60.0, staging_claim_timeout_s=60.0)
    rows_truth = torch.randn(h, width).to(torch.bfloat16)
    out_rows: list[Row] = []
    with Memcpy(h, width, torch.bfloat16) as ref, ProcessCommitter(cleanup, "read") as com:
        m = OmniPrefixCacheManager(cfg, cache=com.name, endpoint=com.endpoint, autostart=False,
                                   runtime_dir=com.runtime_dir)
        try:
            blocks = list(range(nb))
            _fill(m, "prefix", blocks, h, size.chunk, rows_truth)
            tail = torch.randn(BS, width).to(torch.bfloat16)
            kv = m._keys[HIDDEN_KEY]
            hit_slots = _slots(blocks, 0, h)
            pre_out = prefaulted((h, width), torch.bfloat16)
            run_starts = list(range(0, h, BS))
            t_mat, t_out, t_fresh, t_ref, t_pre, t_runs = [], [], [], [], [], []
            merged_buf = prefaulted((h + BS, width), torch.bfloat16)
            pool, no_pool = m.result_pool, ResultPool(0)
            for i in range(3 * size.reps + 3):
                req = f"hit{i}"
                mode = ("pool", "out", "fresh")[i % 3]  # interleaved: each sees the same machine noise
                m.result_pool = no_pool if mode == "fresh" else pool
                m.new_step_starts([E(K.STARTED, req, h, tuple(blocks) + (nb,))])
                tail[:, 0] = float(i % 251 - 125)  # unlike the last call's, in the same slots (review, 2026-12-06)
                sid = _save(m, [(req, blocks + [nb], h, BS)], tail)
                t0 = time.perf_counter()
                out = m.materialize(sid, [req], out={req: {HIDDEN_KEY: merged_buf}} if mode == "out" else None)
                dt = time.perf_counter() - t0
                m.new_step_starts([E(K.FINISHED, req)])
                _check_and_spoil(out.hidden_states[req], rows_truth, tail, f"call {i} ({mode})")
                if i < 3:  # warm-up: the pool faults its block in once
                    continue
                del out
                if mode != "pool":
                    (t_out if mode == "out" else t_fresh).append(dt)
                    continue
                t_mat.append(dt)
                t_ref.append(ref.time(h))
                t_pre.append(timed(lambda: torch.index_select(kv.pool, 0, hit_slots, out=pre_out)))

                def runs() -> None:
                    for a in run_starts:  # one slice copy per block (what a block-run read does)
                        s0 = blocks[a // BS] * BS
                        pre_out[a:a + BS].copy_(kv.pool[s0:s0 + BS])
                t_runs.append(timed(runs))
            nbytes = h * width * 2
            rf, ref_name, ref_extra = Memcpy.reference(t_ref, nbytes)
            for name, ts, goal in (
                    (f"materialize of a {h}-token hit ({nbytes >> 20} MiB), new result tensors (recycled memory)",
                     t_mat, ">= 0.7"),
                    ("  variant: materialize into the caller's buffers (out=)", t_out, "-"),
                    ("  variant: materialize into fresh pages (result_pool_bytes=0: first-touch faults)", t_fresh,
                     "-"),
                    ("  variant: index_select into a preallocated output", t_pre, "-"),
                    (f"  variant: one slice copy_ per block of {BS} rows, preallocated", t_runs, "-")):
                v = Stats.of(ts).scaled(nbytes / 1e9)
                out_rows.append(Row("2", name, "GB/s", v, ref_name, rf, v.median / rf.median,
                                    goal, (v.median / rf.median >= 0.7) if goal != "-" else None,
                                    note="calling thread, whole materialize()" if goal != "-" or "materialize" in name
                                    else "same pool view, measured for the proposal", extra=ref_extra))
        finally:
            m.shutdown()
    return out_rows


# ---------------------------------------------------------------- figure 3


@dataclass
class EngineSize:
    prefill_tokens: int
    hit_tokens: int
    decodes: int
    width: int
    steps: int
    forward_ms: float


def simulated_forward(reps: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """The simulated forward; on a GPU it ends with the sampler's synchronize, as a runner's step does."""
    for _ in range(reps):
        torch.mm(a, b)
    if a.is_cuda:
        torch.cuda.synchronize(a.device)


def calibrate_forward(target_ms: float, device: str = "cpu") -> tuple[int, torch.Tensor, torch.Tensor]:
    """A matmul loop that takes about ``target_ms`` on this thread (the simulated forward)."""
    if device == "cpu":
        a, b = torch.randn(256, 512), torch.randn(512, 512)
    else:
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    simulated_forward(3, a, b)
    per = min(timed(lambda: simulated_forward(5, a, b)) / 5 for _ in range(3))
    return max(1, int(round(target_ms / 1e3 / per))), a, b


class _EngineArm:
    """One manager and the bookkeeping of a repeated mixed step (prefill chunk + hit + decodes)."""

    def __init__(self, cleanup: Cleanup, size: EngineSize, in_process: bool, device: str = "cpu",
                 eager: bool = False, vllm_omni: bool = False):
        self.size = size
        step_tokens = size.prefill_tokens + BS + size.decodes
        self.prefix_blocks = list(range(size.hit_tokens // BS))
        self.ring0 = len(self.prefix_blocks)
        self.ring_len = 3 * (-(-step_tokens // BS) + size.decodes + 2)
        num_blocks = self.ring0 + self.ring_len
        self.com: Any = None
        if vllm_omni:
            self.m: Any = VllmOmniOwnCache(num_blocks=num_blocks, block_size=BS, staging_capacity_tokens=step_tokens,
                                          staging_depth=2)
        else:
            tag = "inproc-eager" if eager else "inproc"
            self.com = ThreadCommitter(cleanup, tag) if in_process else ProcessCommitter(cleanup, "engine")
            cfg = PrefixCacheConfig(num_blocks=num_blocks, block_size=BS, staging_capacity_tokens=step_tokens,
                                    staging_depth=2, commit_timeout_s=60.0, staging_claim_timeout_s=60.0)
            try:
                self.m = OmniPrefixCacheManager(cfg, cache=self.com.name, endpoint=self.com.endpoint,
                                                autostart=False, runtime_dir=self.com.runtime_dir, eager=eager)
            except BaseException:
                self.com.stop()
                raise
        self.next_block = 0
        gen = torch.Generator().manual_seed(3)  # every arm the same rows: their results are compared
        self.hidden = torch.randn(step_tokens, size.width, generator=gen).to(torch.bfloat16).to(device)
        self.mm = {"mm_feat": torch.randn(step_tokens, 64, generator=gen).to(device)}
        # The prefix's own rows, unlike any step's: a hit served the prefill's rows as its prefix must not pass.
        self.prefix = {HIDDEN_KEY: torch.randn(size.hit_tokens, size.width, generator=gen).to(torch.bfloat16).to(device),
                       "mm_feat": torch.randn(size.hit_tokens, 64, generator=gen).to(device)}
        self._row = torch.arange(step_tokens, device=device)
        self.save_s = 0.0
        self.last: Any = None
        self.parts: list[tuple[str, int, int]] = []  # the last step's (request, first position, rows)
        self.i = 0

    @property
    def prev(self) -> list[str]:
        """The last step's requests, in batch order."""
        return [req for req, _, _ in self.parts]

    def blocks(self, n: int) -> list[int]:
        out = [self.ring0 + (self.next_block + j) % self.ring_len for j in range(n)]
        self.next_block = (self.next_block + n) % self.ring_len
        return out

    def prepare(self) -> None:
        if self.size.hit_tokens:
            _fill(self.m, "prefix", self.prefix_blocks, self.size.hit_tokens, len(self.hidden),
                  self.prefix[HIDDEN_KEY], {"mm_feat": self.prefix["mm_feat"]})

    def _stamp(self) -> None:
        """Make this step's rows unlike the last step's, the same in every arm: column 0 of each row becomes a
        small integer (exact in bf16) of the step and the row. Otherwise every step saved the same rows, and
        rows served from an earlier step passed every check (review, 2026-12-06). Outside the clock."""
        stamp = ((self._row + 7 * self.i) % 251 - 125).to(torch.float32)
        self.hidden[:, 0] = stamp.to(self.hidden.dtype)
        for v in self.mm.values():
            v[:, 0] = stamp.to(v.dtype)

    def step(self) -> float:
        """One engine step; returns the seconds spent inside save_outputs + materialize."""
        s, self.i = self.size, self.i + 1
        self._stamp()
        events = [E(K.FINISHED, r) for r in self.prev]
        parts = []
        pf = f"p{self.i}"
        pf_blocks = self.blocks(-(-s.prefill_tokens // BS))
        events.append(E(K.STARTED, pf, 0, tuple(pf_blocks)))
        parts.append((pf, pf_blocks, 0, s.prefill_tokens))
        if s.hit_tokens:
            hit = f"h{self.i}"
            hb = self.prefix_blocks + self.blocks(1)
            events.append(E(K.STARTED, hit, s.hit_tokens, tuple(hb)))
            parts.append((hit, hb, s.hit_tokens, BS))
        for j in range(s.decodes):
            d = f"d{self.i}.{j}"
            db = self.blocks(1)
            events.append(E(K.STARTED, d, 0, tuple(db)))
            parts.append((d, db, 0, 1))
        self.m.new_step_starts(PrefixCacheStep(tuple(events), {p[0]: p[3] for p in parts}))
        self.parts = [(req, first, count) for req, _, first, count in parts]
        req_ids = self.prev
        layout = _layout(parts)  # the runner's write layout and the request list: built before the clock starts
        t0 = time.perf_counter()
        sid = _save(self.m, parts, self.hidden, self.mm, layout)
        t1 = time.perf_counter()
        self.last = self.m.materialize(sid, req_ids)
        t2 = time.perf_counter()
        self.save_s = t1 - t0
        return t2 - t0

    def expected_rows(self) -> dict[tuple[str, str], torch.Tensor]:
        """What the last step's ``materialize`` must serve, ``served_rows``' way, built from the rows written:
        each request's rows of this step, after the prefix's rows for the hit. The arms are compared with
        each other too, but they share the client and the committer's code, so only this check sees a
        bug they have in common (and the vllm-omni arm, the other witness, runs only where it is installed)."""
        want: dict[tuple[str, str], torch.Tensor] = {}
        # On the host: a ``--device cuda`` run's outputs live on the device, its results are compared here.
        written = [(HIDDEN_KEY, self.hidden.cpu())] + [(key, v.cpu()) for key, v in self.mm.items()]
        start = 0
        for req, first, count in self.parts:
            for key, rows in written:
                mine = rows[start:start + count]
                if first:  # the hit: the prefix's rows, written by ``prepare``
                    mine = torch.cat((self.prefix[key][:first].cpu(), mine))
                want[(req, key)] = mine
            start += count
        return want

    def close(self) -> None:
        try:
            self.m.shutdown()
        finally:
            if self.com is not None:
                self.com.stop()


def figure_engine(cleanup: Cleanup, size: EngineSize, device: str = "cpu") -> list[Row]:
    """Figure 3: calling-thread time of save+materialize, committer process vs committer thread.

    The goal's reference is the threaded in-process design. A variant row sets omnishm against the
    seed's *eager* mode (``eager=True`` on the same in-process arm: ``save_outputs`` returns only once
    the committer thread wrote the step into the pool), where the pool write is on the calling thread.
    On ``cuda`` the step's outputs live on the device, the forward is a device matmul loop that ends with
    a synchronize (the sampler's), and the engine thread only launches the staging copies.
    """
    reps, a, b = calibrate_forward(size.forward_ms, device)
    omni = vllm_omni_version()
    arms: list[_EngineArm] = []
    try:
        arms.append(_EngineArm(cleanup, size, in_process=False, device=device))
        arms.append(_EngineArm(cleanup, size, in_process=True, device=device))
        arms.append(_EngineArm(cleanup, size, in_process=True, device=device, eager=True))
        if omni is not None:
            arms.append(_EngineArm(cleanup, size, in_process=True, device=device, vllm_omni=True))
        for arm in arms:
            arm.prepare()
        times: list[list[float]] = [[] for _ in arms]
        saves: list[list[float]] = [[] for _ in arms]
        forwards: list[float] = []
        for i in range(size.steps + 2):
            for k, arm in enumerate(arms):  # interleaved: both arms see the same machine noise
                forwards.append(timed(lambda: simulated_forward(reps, a, b)))
                dt = arm.step()
                if i >= 2:
                    times[k].append(dt)
                    saves[k].append(arm.save_s)
            # Every step, outside the timed calls: omnishm served the rows written, and every arm the same.
            want = served_rows(arms[0].last, arms[0].prev)
            same_rows(arms[0].expected_rows(), {name: v.cpu() for name, v in want.items()}, f"figure 3, step {i}",
                      "omnishm", "the rows written")
            for arm, who in zip(arms[1:3], ("the in-process design", "the eager in-process design")):
                same_rows(want, served_rows(arm.last, arms[0].prev), f"figure 3, step {i}", who)
            if omni is not None:
                same_results(arms[0].last, arms[-1].last, arms[0].prev, f"figure 3, step {i}")
    finally:
        close_all(arms)
    v, rf, eager, *theirs = (Stats.of(np.array(t) * 1e3) for t in times)
    save_ms = [float(np.median(x)) * 1e3 for x in saves]
    fwd_ms = float(np.median(forwards)) * 1e3  # calibrated to size.forward_ms; hosts drift from it
    tokens = size.prefill_tokens + (BS if size.hit_tokens else 0) + size.decodes
    where = "" if device == "cpu" else f", outputs on {device}"
    extra_rows = []
    if theirs:
        mode = omni_mode(arms[-1].m.eager)
        extra_rows.append(Row(
            "3", f"  variant: the same omnishm arm against vllm-omni {omni}'s own in-process cache",
            "ms", v, f"vllm_omni OmniPrefixCacheManager ({mode}), same steps and rows", theirs[0],
            v.median / theirs[0].median, "-", None,
            note=f"its save_outputs {save_ms[3]:.2f} ms; its materialized rows equal omnishm's",
            extra={"device": device, "save_ms": save_ms[0], "reference_save_ms": save_ms[3],
                   "vllm_omni": omni, "vllm_omni_mode": mode}))
    return [Row("3", f"engine thread per step: save+materialize, {tokens} tok x {size.width} bf16 "
                     f"(prefill {size.prefill_tokens}, hit {size.hit_tokens}+{BS}, {size.decodes} decodes{where})",
                "ms", v, "same manager, committer as a thread of this process", rf, v.median / rf.median, "<= 0.5",
                v.median / rf.median <= 0.5,
                note=f"forward between steps: {fwd_ms:.1f} ms matmul (median); save_outputs {save_ms[0]:.2f} ms "
                     f"vs {save_ms[1]:.2f} ms in-process",
                extra={"device": device, "save_ms": save_ms[0], "reference_save_ms": save_ms[1],
                       "forward_ms": fwd_ms}),
            Row("3", "  variant: the same omnishm arm against the in-process design in the seed's eager mode",
                "ms", v, "committer thread, eager: save_outputs waits the pool write", eager,
                v.median / eager.median, "-", None,
                note=f"eager save_outputs {save_ms[2]:.2f} ms: the pool write on the calling thread",
                extra={"device": device, "save_ms": save_ms[0], "reference_save_ms": save_ms[2]}),
            *extra_rows]
