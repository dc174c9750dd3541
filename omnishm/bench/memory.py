"""Figure 5: host bytes with TP ranks mapping one shared mirror vs one private mirror per rank.

The benchmark starts 4 rank worker processes (``python -m omnishm.bench.memory``)
and drives them with JSON lines on stdin. A worker either attaches the cache
the way a rank does (rank 0 as the writer, others as readers; each maps the
pool and reads every row of it, as hits over the whole pool would), or
allocates and fills a private pool-sized mirror (the in-process design, one
per rank). Bytes are the sum of ``Pss_Shmem`` plus ``Pss_Anon`` growth (``/proc/PID/smaps_rollup``)
over every process involved, the committer included: shared pages count once.
"""

from __future__ import annotations

import gc
import json
import mmap
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from omnishm.bench.common import (Cleanup, ProcessCommitter, Row, Stats, close_all, dies_with_bench, fmt_bytes,
                                  smaps_rollup)


@dataclass
class MemorySize:
    num_blocks: int
    width: int
    tps: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3


BS = 16


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "omnishm.bench.memory"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     preexec_fn=dies_with_bench(deaf_to_ctrl_c=True))

    def call(self, **req: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"memory worker {self.proc.pid} died (rc {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"memory worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except (RuntimeError, BrokenPipeError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def host_bytes(pid: int | str = "self") -> dict[str, int]:
    """Anonymous and shared-memory Pss of a process (library pages left out)."""
    r = smaps_rollup(pid)
    return {"anon": r.get("Pss_Anon", 0), "shmem": r.get("Pss_Shmem", 0)}


def _growth(before: dict[str, int], after: dict[str, int]) -> int:
    """What the cache added: all shared-memory Pss (only omnishm segments are shm here) + anon growth."""
    return after["shmem"] + after["anon"] - before["anon"]


def figure_memory(cleanup: Cleanup, size: MemorySize) -> list[Row]:
    pool_bytes = size.num_blocks * BS * size.width * 2
    workers = [Worker() for _ in range(max(size.tps))]
    rows: list[Row] = []
    try:
        for w in workers:
            w.call(op="ready")
        with ProcessCommitter(cleanup, "mem") as com:
            c_base = host_bytes(com.pid)  # before any key: the pool does not exist yet
            for tp in size.tps:
                ranks = workers[:tp]
                samples = [_sample(ranks, com, size, pool_bytes, c_base) for _ in range(size.repeats)]
                ours, mirror = (Stats.of([x[i] / 2**20 for x in samples]) for i in (0, 1))
                rows.append(Row("5", f"host bytes, TP={tp}, pool {fmt_bytes(pool_bytes)} (writer + {tp - 1} "
                                     f"readers)", "MiB", ours, f"one private mirror per rank ({tp} x pool)", mirror,
                                ours.median / mirror.median, "<= 1/TP + 5%" if tp > 1 else "-",
                                (ours.median / mirror.median <= 1 / tp + 0.05) if tp > 1 else None,
                                note=f"sum of Pss_Anon+Pss_Shmem growth over ranks and committer; "
                                     f"{size.repeats} attach/release rounds"))
    finally:
        close_all(workers)
    return rows


def _sample(ranks: list[Worker], com: ProcessCommitter, size: MemorySize, pool_bytes: int,
            c_base: dict[str, int]) -> tuple[int, int]:
    """One round for ``len(ranks)`` ranks: (omnishm's bytes, the private mirrors' bytes).

    Every rank releases what it held before the round ends, so rounds are independent samples; the
    committer's pool outlives them (it is the cache's), and each round counts it again.
    """
    # One private mirror per rank (the in-process design).
    before = [w.call(op="pss") for w in ranks]
    after = [w.call(op="mirror", bytes=pool_bytes) for w in ranks]
    mirror = sum(a["anon"] + a["shmem"] - b["anon"] - b["shmem"] for a, b in zip(after, before))
    for w in ranks:
        w.call(op="release")
    # omnishm: one committer-owned pool, rank 0 writes, every rank maps and reads it.
    before = [w.call(op="pss") for w in ranks]
    for i, w in enumerate(ranks):
        w.call(op="attach", endpoint=com.endpoint, cache=com.name, runtime_dir=str(com.runtime_dir),
               num_blocks=size.num_blocks, width=size.width, writer=i == 0)
    after = [w.call(op="pss") for w in ranks]  # every rank mapped: shares settled
    ours = sum(_growth(b, a) for a, b in zip(after, before)) + _growth(c_base, host_bytes(com.pid))
    for w in ranks:
        w.call(op="release")
    return ours, mirror


# ---------------------------------------------------------------- the worker process


def _worker() -> int:
    import torch

    torch.set_num_threads(1)
    held: dict[str, Any] = {}

    def pss() -> dict[str, int]:
        gc.collect()
        return host_bytes()

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "exit":
                print(json.dumps({"ok": True}), flush=True)
                return 0
            if op == "ready":  # import now, so the client modules' own pages are not counted as the cache's
                import omnishm.client.link  # noqa: F401
                import omnishm.client.segments  # noqa: F401
            elif op == "mirror":
                # Its own mapping (not the malloc heap, which keeps freed chunks): released means returned.
                # (Python anonymous mmaps are MAP_SHARED, so they show as Pss_Shmem: counted by _growth.)
                buf = mmap.mmap(-1, req["bytes"])
                t = torch.frombuffer(buf, dtype=torch.uint8)
                t.fill_(1)
                held["mirror"] = (buf, t)
            elif op == "attach":
                from pathlib import Path

                from omnishm import protocol as P
                from omnishm.client.link import CommitterLink
                from omnishm.client.segments import KeyViews

                role = P.ROLE_WRITER if req["writer"] else P.ROLE_READER
                link = CommitterLink(cache=req["cache"], role=role, endpoint=req["endpoint"],
                                     layout=P.Layout(num_blocks=req["num_blocks"], block_size=BS),
                                     staging_rows=BS * 4 if req["writer"] else 0, runtime_dir=Path(req["runtime_dir"]))
                held["link"] = link
                reply = link.request(lambda rid: P.OpenKey(rid=rid, key="hidden", dtype="bfloat16",
                                                           width=req["width"]))
                kv = KeyViews.map(reply.segments, req["num_blocks"] * BS, readonly=not req["writer"])
                held["kv"] = kv
                pool = kv.pool.view(torch.uint8)
                for lo in range(0, pool.shape[0], 4096):  # read every page (what hits over the pool do)
                    pool[lo:lo + 4096].max()
            elif op == "release":
                link = held.pop("link", None)
                mirror = held.pop("mirror", None)
                held.clear()
                if mirror is not None:
                    buf = mirror[0]
                    del mirror  # the tensor (the buffer's only export) goes first
                    gc.collect()
                    buf.close()
                if link is not None:
                    link.close()
            print(json.dumps(pss()), flush=True)
        except Exception as exc:  # reported to the benchmark, which fails the figure
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
