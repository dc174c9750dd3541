"""Figure 6 (0%-hit overhead): a simulated engine step loop with the cache on and nothing ever hit, against
the same loop with the cache off, the floor (``_FloorArm``), vllm-omni's own cache and omnishm behind its
drop-in. Drives the managers on this (the engine) thread, the way a model runner does. Main thread only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from omnishm.bench.common import Cleanup, ProcessCommitter, Row, Stats
from omnishm.bench.manager_figures import BS, calibrate_forward, simulated_forward
from omnishm.bench.vllm_omni_arm import (InputBatch, VllmOmniOwnCache, omni_mode, row_digest, same_rows,
                                         scheduler_output, served_rows, vllm_omni_version)
from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.adapter import PrefixCacheSchedulerAdapter
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.client.link import client_context
from omnishm.interface import HIDDEN_KEY
from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager

BLOCK = 5
"""Each arm runs this many consecutive steps at a time."""


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
        ctx = client_context()  # the links' context: its I/O thread runs as omnishm's do (omnishm/cpus.py)
        endpoint = f"ipc://{cleanup.runtime_dir}/floor.sock"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(endpoint)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)
        self.capacity = capacity
        self.pages: dict[str, torch.Tensor] = {}
        self.page = 0

    def step(self, rows: dict[str, torch.Tensor], sizes: list[int]) -> dict[str, tuple[torch.Tensor, ...]]:
        """The step's rows of each key, one tensor per request (in ``sizes``' order)."""
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
        return {key: torch.empty_like(page).copy_(page).split_with_sizes(sizes) for key, page in zip(rows, staged)}

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
    names = {on: "omnishm", off: "the cache-off runner", low: "the floor", theirs: "vllm-omni", dropin: "the drop-in"}
    # Each arm's k-th step schedules the same requests (same seed), so every arm must hand the next stage
    # the same rows: the first arm's digest of step k (omnishm's), checked outside the timed part.
    served: dict[int, dict] = {}
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
                        simulated_forward(reps, a, b)
                        t_fwd = time.perf_counter() - t_fwd
                        sizes = [w.num_tokens for w in st.layout.writes]
                        reqs = [w.req_id for w in st.layout.writes]
                        if eng is on:
                            t1 = time.perf_counter()
                            layout = adapter.build_write_layout(view, so.num_scheduled_tokens,
                                                                chains=m.prompt_chains)
                            t2 = time.perf_counter()
                            sid = m.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                 num_tokens_padded=st.num_tokens, write_layout=layout)
                            out = m.materialize(sid, layout.req_ids)
                            t3 = time.perf_counter()
                            mgr += t3 - t2
                            hooks += t2 - t1
                            hits += sum(out.num_hit_tokens.values())
                            handed: Any = (out, False)
                        elif eng is theirs:
                            sid = vm.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                  num_tokens_padded=st.num_tokens)
                            handed = (vm.materialize(sid, reqs), True)
                        elif eng is dropin:
                            sid = dm.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                                  num_tokens_padded=st.num_tokens)
                            handed = (dm.materialize(sid, reqs), True)
                        elif eng is low:
                            handed = floor.step({HIDDEN_KEY: hidden, **mm}, sizes)
                        else:
                            # The runner's own per-request CPU rows for the next stage (what materialize replaces).
                            n = sum(sizes)
                            handed = {key: v[:n].to("cpu", copy=True).split_with_sizes(sizes)
                                      for key, v in ((HIDDEN_KEY, hidden), *mm.items())}
                        eng.advance(st)
                        dt = time.perf_counter() - t0
                        digest = row_digest(  # handed: {key: rows per request}, or a result and its nesting
                            {(r, key): rows[x] for key, rows in handed.items() for x, r in enumerate(reqs)}
                            if isinstance(handed, dict) else served_rows(handed[0], reqs, key_first=handed[1]))
                        k = i // len(arms) * BLOCK + j
                        same_rows(served.setdefault(k, digest), digest, f"figure 6, step {k}", names[eng])
                        del handed
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
        try:
            floor.close()
        finally:
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


def _their_overhead_row(version: str, eager: bool, theirs: list[float], off: list[float], rf: Stats,
                        ref_name: str, device: str) -> Row:
    """Figure 6's row for vllm-omni's own in-process cache, fed the same steps as the cache-on arm."""
    v = Stats.of(np.array(theirs) * 1e3)
    paired = float(np.median(np.array(theirs) / np.array(off)))
    return Row("6", f"  variant: vllm-omni {version}'s own in-process cache in the same loop, 0% hits",
               "ms", v, ref_name, rf, v.median / rf.median, "-", None,
               note=f"vllm_omni OmniPrefixCacheManager ({omni_mode(eager)}); median of per-step ratios {paired:.3f}",
               extra={"device": device, "paired_ratio": paired, "vllm_omni": version,
                      "vllm_omni_mode": omni_mode(eager)})


def _dropin_overhead_row(version: str, dropin: list[float], off: list[float], rf: Stats, ref_name: str,
                        device: str) -> Row:
    """Figure 6's row for omnishm behind the vllm-omni drop-in: what ``OMNISHM_VLLM_OMNI=1`` runs."""
    v = Stats.of(np.array(dropin) * 1e3)
    paired = float(np.median(np.array(dropin) / np.array(off)))
    return Row("6", f"  variant: omnishm through the vllm-omni {version} drop-in in the same loop, 0% hits",
               "ms", v, ref_name, rf, v.median / rf.median, "-", None,
               note=f"VllmOmniPrefixCacheManager over a committer process, vllm-omni's calls and group view; "
                    f"median of per-step ratios {paired:.3f}", extra={"device": device, "paired_ratio": paired})
