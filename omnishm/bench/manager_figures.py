"""Figures 2 (hit read bandwidth), 3 (engine-thread cost per step) and 6 (0%-hit overhead).

All three drive ``OmniPrefixCacheManager`` on this (the engine) thread, the
way a model runner does: ``new_step_starts``, ``save_outputs``,
``materialize``. Main thread only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from omnishm.bench.common import Cleanup, Memcpy, ProcessCommitter, Row, Stats, ThreadCommitter, prefaulted, timed
from omnishm.bench.vllm_omni_arm import (InputBatch, VllmOmniOwnCache, same_results, scheduler_output,
                                         vllm_omni_version)
from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import (PrefixCacheSchedulerAdapter, PrefixCacheStep, PrefixCacheWrite,
                                    PrefixCacheWriteLayout)
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.client.result_pool import ResultPool
from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager

BS = 16
BLOCK = 5
"""Figure 6 runs each arm for this many consecutive steps at a time."""


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


def figure_read(cleanup: Cleanup, size: ReadSize) -> list[Row]:
    """Figure 2: materialize of a long hit vs memcpy of its bytes; plus the copy strategies it could use."""
    h, width = size.hit_tokens, size.width
    nb = h // BS
    cfg = PrefixCacheConfig(num_blocks=nb + 4, block_size=BS, staging_capacity_tokens=size.chunk, staging_depth=2,
                            commit_timeout_s=60.0, staging_claim_timeout_s=60.0)
    rows_truth = torch.randn(h, width).to(torch.bfloat16)
    ref = Memcpy(h, width, torch.bfloat16)
    out_rows: list[Row] = []
    with ProcessCommitter(cleanup, "read") as com:
        m = OmniPrefixCacheManager(cfg, cache=com.name, endpoint=com.endpoint, autostart=False,
                                   runtime_dir=com.runtime_dir)
        try:
            blocks = list(range(nb))
            _fill(m, "prefix", blocks, h, size.chunk, rows_truth)
            tail = torch.randn(BS, width).to(torch.bfloat16)
            kv = m._keys["__hidden_states__"]
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
                sid = _save(m, [(req, blocks + [nb], h, BS)], tail)
                t0 = time.perf_counter()
                out = m.materialize(sid, [req], out={req: {"__hidden_states__": merged_buf}} if mode == "out" else None)
                dt = time.perf_counter() - t0
                m.new_step_starts([E(K.FINISHED, req)])
                got = out.hidden_states[req]
                if i < 3:  # warm-up (the pool faults its block in once), and the rows are exact, bit for bit
                    if not torch.equal(got[:h].view(torch.int16), rows_truth.view(torch.int16)):
                        raise RuntimeError(f"figure 2: materialized hit ({mode}) differs from the rows written")
                    continue
                del out, got
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


def _forward(reps: int, a: torch.Tensor, b: torch.Tensor) -> None:
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
    _forward(3, a, b)
    per = min(timed(lambda: _forward(5, a, b)) / 5 for _ in range(3))
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
        self.save_s = 0.0
        self.last: Any = None
        self.prev: list[str] = []
        self.i = 0

    def blocks(self, n: int) -> list[int]:
        out = [self.ring0 + (self.next_block + j) % self.ring_len for j in range(n)]
        self.next_block = (self.next_block + n) % self.ring_len
        return out

    def prepare(self) -> None:
        if self.size.hit_tokens:
            k = -(-self.size.hit_tokens // len(self.hidden))
            _fill(self.m, "prefix", self.prefix_blocks, self.size.hit_tokens, len(self.hidden),
                  self.hidden.repeat(k, 1), {key: v.repeat(k, 1) for key, v in self.mm.items()})

    def step(self) -> float:
        """One engine step; returns the seconds spent inside save_outputs + materialize."""
        s, self.i = self.size, self.i + 1
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
        self.prev = [p[0] for p in parts]
        layout = _layout(parts)  # the runner's write layout: built before the clock starts
        t0 = time.perf_counter()
        sid = _save(self.m, parts, self.hidden, self.mm, layout)
        t1 = time.perf_counter()
        self.last = self.m.materialize(sid, self.prev)
        t2 = time.perf_counter()
        self.save_s = t1 - t0
        return t2 - t0

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
                forwards.append(timed(lambda: _forward(reps, a, b)))
                dt = arm.step()
                if i >= 2:
                    times[k].append(dt)
                    saves[k].append(arm.save_s)
            if omni is not None:  # every step, outside the timed calls
                same_results(arms[0].last, arms[-1].last, arms[0].prev, f"figure 3, step {i}")
    finally:
        for arm in arms:
            arm.close()
    v, rf, eager, *theirs = (Stats.of(np.array(t) * 1e3) for t in times)
    save_ms = [float(np.median(x)) * 1e3 for x in saves]
    fwd_ms = float(np.median(forwards)) * 1e3  # calibrated to size.forward_ms; hosts drift from it
    tokens = size.prefill_tokens + (BS if size.hit_tokens else 0) + size.decodes
    where = "" if device == "cpu" else f", outputs on {device}"
    extra_rows = []
    if theirs:
        mode = _omni_mode(arms[-1].m.eager)
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


# ---------------------------------------------------------------- figure 6


@dataclass
class OverheadSize:
    steps: int
    width: int
    max_batched_tokens: int
    forward_ms: float


def no_hit_engine(size: OverheadSize) -> Any:
    """A sim engine with no shared prefixes: no system prompt, no conversation turns, a vocabulary too big
    to collide; every request finished forgets its history."""
    from omnishm.sim import SimEngine

    class NoHitEngine(SimEngine):
        def _finish(self, req, aborted: bool) -> None:
            super()._finish(req, aborted)
            self.histories.clear()

    return NoHitEngine(num_blocks=512, block_size=BS, max_batched_tokens=size.max_batched_tokens, width=size.width,
                       mm_key="mm_feat", mm_width=16, seed=7, system_prompts=1, system_len=0, vocab=1_000_003,
                       abort_rate=0.0)


class _FloorArm:
    """The least the engine thread must do per step with the cache on (figure 6's floor variant).

    Copy the step's rows into a staging page, send one ZeroMQ message the size of the step's
    descriptor, copy the rows back out into new per-request tensors. No bookkeeping, nothing cached.
    The pages are private memory: writing shared memory costs the same after a forward (127 KiB,
    this machine: 95 us private, 98 us shared, measured 2026-11-29). Main thread only.
    """

    def __init__(self, cleanup: Cleanup, capacity: int):
        ctx = zmq.Context.instance()
        endpoint = f"ipc://{cleanup.runtime_dir}/floor.sock"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(endpoint)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)
        self.capacity = capacity
        self.pages: dict[str, torch.Tensor] = {}
        self.page = 0

    def step(self, rows: dict[str, torch.Tensor], sizes: list[int]) -> None:
        n = sum(sizes)
        self.page ^= 1
        staged = []
        for key, r in rows.items():
            pages = self.pages.get(key)
            if pages is None:
                pages = self.pages[key] = torch.empty((2, self.capacity, *r.shape[1:]), dtype=r.dtype)
            page = pages[self.page, :n]
            page.copy_(r[:n])
            staged.append(page)
        # A StepWrite carries each key's slots (8 bytes a row) and four 8-byte fields per write.
        self.push.send(bytes(len(rows) * (8 * n + 32 * len(sizes)) + 128), zmq.NOBLOCK)
        for page in staged:
            torch.empty_like(page).copy_(page).split_with_sizes(sizes)

    def drain(self) -> None:
        while self.pull.poll(0):
            self.pull.recv()

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


def figure_overhead(cleanup: Cleanup, size: OverheadSize, device: str = "cpu") -> list[Row]:
    """Figure 6: sim engine step loop, cache on with 0% hits vs cache off, same work, in rotating blocks.

    Both arms hand every scheduled request's rows to the next stage as CPU tensors: with the cache
    off, a vllm-omni runner does that itself (``GPUARModelRunner`` snapshots the step's hidden states
    and multimodal outputs to CPU every step, prefix cache or not), with the cache on,
    ``materialize`` returns them. So the difference is what the cache adds: the staging copy, the
    bookkeeping and the descriptor. A third arm, the floor (``_FloorArm``), does only the copies and
    the one message the design needs, so the table shows how much of the overhead is bookkeeping.
    The cache-on arm does what omnishm's runner hooks do every step: translate the scheduler output
    and ``new_step_starts`` before the forward (before ``_update_states``), then build the write layout
    from the batch (``FullAttentionGroupView``), ``save_outputs`` and ``materialize`` after it. Every arm
    gets the same stand-ins for vLLM's own work (a ``SchedulerOutput``, the batch ``_update_states``
    leaves). On ``cuda`` the outputs live on the device.
    """
    reps, a, b = calibrate_forward(size.forward_ms, device)
    on, off, low, theirs, dropin = (no_hit_engine(size) for _ in range(5))
    cfg = PrefixCacheConfig(num_blocks=512, block_size=BS, staging_capacity_tokens=size.max_batched_tokens,
                            staging_depth=2, commit_timeout_s=60.0, staging_claim_timeout_s=60.0)
    times: dict[Any, list[float]] = {on: [], off: [], low: [], theirs: [], dropin: []}
    batches = {eng: InputBatch(16, 64, BS) for eng in times}
    adapter = PrefixCacheSchedulerAdapter()
    view = FullAttentionGroupView(batches[on], BS)
    t_mgr, t_hooks, forwards = [], [], []
    hits = 0
    omni = vllm_omni_version()
    vm = (VllmOmniOwnCache(num_blocks=512, block_size=BS, staging_capacity_tokens=size.max_batched_tokens,
                           staging_depth=2, batch=batches[theirs]) if omni is not None else None)
    dm: Any = None
    floor = _FloorArm(cleanup, size.max_batched_tokens)
    try:
        with contextlib.ExitStack() as stack:
            com = stack.enter_context(ProcessCommitter(cleanup, "overhead"))
            m = OmniPrefixCacheManager(cfg, cache=com.name, endpoint=com.endpoint, autostart=False,
                                       runtime_dir=com.runtime_dir)
            if vm is not None:  # omnishm through the vllm-omni drop-in, its slots from vllm-omni's view
                com2 = stack.enter_context(ProcessCommitter(cleanup, "dropin"))
                dm = VllmOmniPrefixCacheManager(
                    vm.config, type(vm.view)(batches[dropin], BS), cache=com2.name, endpoint=com2.endpoint,
                    autostart=False, runtime_dir=com2.runtime_dir, role="writer")
                stack.callback(dm.shutdown)
            try:
                # Blocks of consecutive steps per arm, the arms in rotation: what a step leaves behind
                # (the committer's reply, handled by the link's I/O thread) lands in the same arm's next
                # step, as in a real engine, not in another arm's. A block's first step is not counted.
                arms = (on, off, low) if vm is None else (on, off, low, theirs, dropin)
                for i in range(-(-size.steps // (BLOCK - 1)) * len(arms) + len(arms)):
                    eng = arms[i % len(arms)]
                    for j in range(BLOCK):
                        t0 = time.perf_counter()
                        while len(eng.waiting) + len(eng.running) < 8:
                            eng.add_request()
                        st = eng.schedule()
                        so = scheduler_output(st.step)  # vLLM's work, in every arm alike
                        hidden, mm = st.hidden, st.mm
                        if device != "cpu":
                            hidden, mm = hidden.to(device), {k: v.to(device) for k, v in mm.items()}
                        mgr = hooks = 0.0
                        if eng is on:  # a runner's hook calls it before _update_states, so before the forward
                            t1 = time.perf_counter()
                            step = adapter.translate_scheduler_output(so)
                            t2 = time.perf_counter()
                            m.new_step_starts(step)
                            t3 = time.perf_counter()
                            mgr, hooks = t3 - t2, t2 - t1
                        elif eng is theirs:
                            vm.new_step_starts(so)
                        elif eng is dropin:
                            dm.new_step_starts(so)
                        batches[eng].update(st, {r.req_id: r.blocks for r in eng.running})  # vLLM's _update_states
                        t_fwd = time.perf_counter()
                        _forward(reps, a, b)
                        t_fwd = time.perf_counter() - t_fwd
                        sizes = [w.num_tokens for w in st.layout.writes]
                        if eng is on:
                            t1 = time.perf_counter()
                            layout = adapter.build_write_layout(view, so.num_scheduled_tokens)
                            t2 = time.perf_counter()
                            sid = m.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                 num_tokens_padded=st.num_tokens, write_layout=layout)
                            out = m.materialize(sid, layout.req_ids)
                            t3 = time.perf_counter()
                            mgr += t3 - t2
                            hooks += t2 - t1
                            hits += sum(out.num_hit_tokens.values())
                        elif eng is theirs:
                            sid = vm.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                  num_tokens_padded=st.num_tokens)
                            vm.materialize(sid, [w.req_id for w in st.layout.writes])
                        elif eng is dropin:
                            sid = dm.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                  num_tokens_padded=st.num_tokens)
                            dm.materialize(sid, [w.req_id for w in st.layout.writes])
                        elif eng is low:
                            floor.step({"hidden": hidden, **mm}, sizes)
                        else:
                            # The runner's own per-request CPU rows for the next stage (what materialize replaces).
                            n = sum(sizes)
                            hidden[:n].to("cpu", copy=True).split_with_sizes(sizes)
                            for v in mm.values():
                                v[:n].to("cpu", copy=True).split_with_sizes(sizes)
                        eng.advance(st)
                        dt = time.perf_counter() - t0
                        if eng is low:
                            floor.drain()
                        if eng is on and not torch.equal(layout.slots, st.layout.slots):
                            raise RuntimeError("figure 6: the group view's slots differ from the simulation's")
                        if i >= len(arms) and j > 0:
                            times[eng].append(dt)
                            forwards.append(t_fwd)
                            if eng is on:
                                t_mgr.append(mgr)
                                t_hooks.append(hooks)
            finally:
                m.shutdown()
    finally:
        floor.close()
        if vm is not None:
            vm.shutdown()
    if hits:
        raise RuntimeError(f"figure 6: {hits} hit tokens in a 0%-hit run")
    v, rf, fl = (Stats.of(np.array(times[e]) * 1e3) for e in (on, off, low))
    mgr_ms = float(np.median(t_mgr)) * 1e3
    hooks_ms = float(np.median(t_hooks)) * 1e3
    fwd_ms = float(np.median(forwards)) * 1e3  # calibrated to size.forward_ms; hosts drift from it
    # Step i of every arm schedules the same requests (same seed): per-step ratios pair like with like.
    paired = float(np.median(np.array(times[on]) / np.array(times[off])))
    paired_floor = float(np.median(np.array(times[low]) / np.array(times[off])))
    where = "" if device == "cpu" else f", outputs on {device}"
    ref_name = "same loop, cache off (the runner copies each request's rows to CPU itself)"
    return [Row("6", f"sim step loop, cache on, 0% hits (<= {size.max_batched_tokens} tok x {size.width} f32{where})",
                "ms", v, ref_name, rf, v.median / rf.median, "< 1.02", v.median / rf.median < 1.02,
                note=f"manager calls {mgr_ms:.2f} ms/step median = {100 * mgr_ms / rf.median:.1f}% of a step, the "
                     f"runner hooks' translation and write layout {hooks_ms:.2f} ms; forward {fwd_ms:.1f} ms "
                     f"(median); median of per-step ratios {paired:.3f}",
                extra={"device": device, "manager_ms_per_step": mgr_ms, "manager_share": mgr_ms / rf.median,
                       "hooks_ms_per_step": hooks_ms, "paired_ratio": paired, "forward_ms": fwd_ms}),
            Row("6", "  variant: floor: the same loop doing only the staging copy, one descriptor-sized ZeroMQ "
                     "message and the copy out (no bookkeeping)", "ms", fl, ref_name, rf, fl.median / rf.median,
                "-", None, note=f"what any design with a staging page and a committer process pays; median of "
                                f"per-step ratios {paired_floor:.3f}",
                extra={"device": device, "paired_ratio": paired_floor}),
            *([] if vm is None else [
                _their_overhead_row(omni, vm.eager, times[theirs], times[off], rf, ref_name, device),
                _dropin_overhead_row(omni, times[dropin], times[off], rf, ref_name, device)])]


def _omni_mode(eager: bool) -> str:
    return "eager: its mode without CUDA" if eager else "threaded: its mode with CUDA (copy streams)"


def _their_overhead_row(version: str, eager: bool, theirs: list[float], off: list[float], rf: Stats,
                        ref_name: str, device: str) -> Row:
    """Figure 6's row for vllm-omni's own in-process cache, fed the same steps as the cache-on arm."""
    v = Stats.of(np.array(theirs) * 1e3)
    paired = float(np.median(np.array(theirs) / np.array(off)))
    return Row("6", f"  variant: vllm-omni {version}'s own in-process cache in the same loop, 0% hits",
               "ms", v, ref_name, rf, v.median / rf.median, "-", None,
               note=f"vllm_omni OmniPrefixCacheManager ({_omni_mode(eager)}); median of per-step ratios {paired:.3f}",
               extra={"device": device, "paired_ratio": paired, "vllm_omni": version,
                      "vllm_omni_mode": _omni_mode(eager)})


def _dropin_overhead_row(version: str, dropin: list[float], off: list[float], rf: Stats, ref_name: str,
                        device: str) -> Row:
    """Figure 6's row for omnishm behind the vllm-omni drop-in: what ``OMNISHM_VLLM_OMNI=1`` runs."""
    v = Stats.of(np.array(dropin) * 1e3)
    paired = float(np.median(np.array(dropin) / np.array(off)))
    return Row("6", f"  variant: omnishm through the vllm-omni {version} drop-in in the same loop, 0% hits",
               "ms", v, ref_name, rf, v.median / rf.median, "-", None,
               note=f"VllmOmniPrefixCacheManager over a committer process, vllm-omni's calls and group view; "
                    f"median of per-step ratios {paired:.3f}", extra={"device": device, "paired_ratio": paired})
