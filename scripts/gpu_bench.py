"""Device-to-host GB/s: whole-step staging copy into registered shm vs a plain pinned copy_."""

from __future__ import annotations

import statistics
import time
import uuid

import torch

from omnishm.client.device import CudaOps, HostRegistration
from omnishm.shm import Segment


def timed(fn, reps: int = 20) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    tokens, width = 8192, 4096
    nbytes = tokens * width * 2
    dev = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    seg = Segment.create(f"/omnishm.gpubench.{uuid.uuid4().hex[:8]}.stage", nbytes, prefault=True)
    try:
        stage = seg.tensor(torch.bfloat16, (tokens, width))
        reg = HostRegistration(stage)
        ops = CudaOps(dev.device)
        pinned = torch.empty((tokens, width), dtype=torch.bfloat16, pin_memory=True)

        def staging_copy():
            frozen = ops.freeze(dev)
            ops.to_host([(stage, frozen)], ops.record_freeze()).synchronize()

        def plain():
            pinned.copy_(dev, non_blocking=True)

        s = timed(staging_copy)
        p = timed(plain)
        gbs = lambda xs: nbytes / statistics.median(xs) / 1e9  # noqa: E731
        print(f"whole-step staging copy (clone + freeze event + copy stream -> registered shm, pinned={reg.pinned}): "
              f"{gbs(s):.1f} GB/s (median of {len(s)}, {nbytes >> 20} MiB)")
        print(f"plain pinned copy_ of the same bytes: {gbs(p):.1f} GB/s")
        print(f"ratio: {gbs(s) / gbs(p):.2f}")
        assert torch.equal(stage[:4].float(), dev[:4].float().cpu())
        reg.unregister()
    finally:
        seg.unlink()


if __name__ == "__main__":
    main()
