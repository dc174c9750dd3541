"""cProfile of figure 3's engine step (save_outputs + materialize on the calling thread).

    python scripts/profile_engine.py [--device cuda] [--steps 20] [--top 25]

Prints the median save_outputs and whole-step times and the functions with the most
own time: where the engine thread's time goes, on CPU or with the outputs on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np
import torch

from omnishm.bench import manager_figures as mf
from omnishm.bench.common import Cleanup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = mf.EngineSize(4096, 2048, 64, 4096, args.steps, 20)
    cleanup = Cleanup()
    prof = cProfile.Profile()
    saves, steps = [], []
    try:
        arm = mf._EngineArm(cleanup, size, in_process=False, device=args.device)
        try:
            arm.prepare()
            reps, a, b = mf.calibrate_forward(size.forward_ms, args.device)
            for i in range(args.steps + 3):
                mf._forward(reps, a, b)
                if i >= 3:
                    prof.enable()
                dt = arm.step()
                prof.disable()
                if i >= 3:
                    saves.append(arm.save_s)
                    steps.append(dt)
        finally:
            arm.close()
    finally:
        cleanup.close()
    print(f"device {args.device}: save_outputs {np.median(saves) * 1e3:.2f} ms, save+materialize "
          f"{np.median(steps) * 1e3:.2f} ms (medians of {len(steps)} steps)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
