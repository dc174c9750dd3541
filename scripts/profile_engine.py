"""cProfile of the engine thread's cache calls, on CPU or with the outputs on a GPU.

    python scripts/profile_engine.py [--workload engine|overhead] [--device cuda] [--steps 20] [--top 25]
                                     [--between forward|spin|none] [--gap-ms 20]

``engine``: figure 3's mixed step (prefill 4096 + hit 2048 + 64 decodes, width 4096 bf16);
``overhead``: figure 6's 0%-hit sim loop (<= 256 tokens x 1024 f32). Prints the median
time of each manager call and the functions with the most own time.

``--between`` (overhead only) sets what runs between two steps: the forward (default), a Python
loop spinning ``--gap-ms`` on the clock, or nothing. On the 2-vCPU build hosts the same calls take
about twice as long after a 20 ms spin (a loop that touches almost no memory) as back to back, and
no longer after a 5 ms one: the time away, not the forward's data, makes them cold
(benchmarks/README.md, figure 6, "What is left").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import numpy as np
import torch

from omnishm.bench import manager_figures as mf
from omnishm.bench import overhead as ov
from omnishm.bench.common import Cleanup, ProcessCommitter


def engine(cleanup: Cleanup, args: argparse.Namespace, prof: cProfile.Profile) -> dict[str, list[float]]:
    size = mf.EngineSize(4096, 2048, 64, 4096, args.steps, 20)
    times: dict[str, list[float]] = defaultdict(list)
    arm = mf._EngineArm(cleanup, size, in_process=False, device=args.device)
    try:
        arm.prepare()
        reps, a, b = mf.calibrate_forward(size.forward_ms, args.device)
        for i in range(args.steps + 3):
            mf.simulated_forward(reps, a, b)
            prof.enable()
            dt = arm.step()
            prof.disable()
            if i >= 3:
                times["save_outputs"].append(arm.save_s)
                times["materialize"].append(dt - arm.save_s)
    finally:
        arm.close()
    return times


def overhead(cleanup: Cleanup, args: argparse.Namespace, prof: cProfile.Profile) -> dict[str, list[float]]:
    from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig

    eng = ov.no_hit_engine(ov.OverheadSize(args.steps, 1024, 256, 20))
    reps, a, b = mf.calibrate_forward(20, args.device)
    cfg = PrefixCacheConfig(num_blocks=512, block_size=mf.BS, staging_capacity_tokens=256, staging_depth=2)
    times: dict[str, list[float]] = defaultdict(list)
    with ProcessCommitter(cleanup, "profile") as com:
        m = OmniPrefixCacheManager(cfg, cache=com.name, endpoint=com.endpoint, autostart=False,
                                   runtime_dir=com.runtime_dir)
        try:
            for i in range(args.steps + 3):
                while len(eng.waiting) + len(eng.running) < 8:
                    eng.add_request()
                st = eng.schedule()
                hidden, mm = st.hidden, st.mm
                if args.device != "cpu":
                    hidden, mm = hidden.to(args.device), {k: v.to(args.device) for k, v in mm.items()}
                if args.between == "forward":
                    mf.simulated_forward(reps, a, b)
                elif args.between == "spin":
                    until = time.perf_counter() + args.gap_ms / 1e3
                    while time.perf_counter() < until:
                        pass
                prof.enable()
                t0 = time.perf_counter()
                m.new_step_starts(st.step)
                t1 = time.perf_counter()
                sid = m.save_outputs(hidden, mm, num_tokens_unpadded=st.num_tokens,
                                     num_tokens_padded=st.num_tokens, write_layout=st.layout)
                t2 = time.perf_counter()
                m.materialize(sid, [w.req_id for w in st.layout.writes])
                t3 = time.perf_counter()
                prof.disable()
                eng.advance(st)
                if i >= 3:
                    for name, dt in (("new_step_starts", t1 - t0), ("save_outputs", t2 - t1),
                                     ("materialize", t3 - t2)):
                        times[name].append(dt)
        finally:
            m.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="engine", choices=["engine", "overhead"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--between", default="forward", choices=["forward", "spin", "none"],
                        help="overhead: what runs between two steps")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="--between spin: how long")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cleanup = Cleanup()
    prof = cProfile.Profile()
    try:
        times = (engine if args.workload == "engine" else overhead)(cleanup, args, prof)
    finally:
        cleanup.close()
    parts = ", ".join(f"{k} {np.median(v) * 1e3:.3f} ms" for k, v in times.items())
    gap = f" {args.gap_ms:g} ms" if args.between == "spin" else ""
    between = f", {args.between}{gap} between steps" if args.workload == "overhead" else ""
    print(f"{args.workload} on {args.device}: {parts} (medians of {args.steps} steps{between})")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
