"""``omnishm bench``: every figure next to its reference measured in the same run.

``omnishm bench [--quick] [--json] [--only 1,2,...]``. ``--quick`` shrinks every
geometry so the whole run takes seconds (CI): it checks that every figure runs,
and its ratios are not judged against the goals (``goals_judged`` false in the
JSON); the normal run takes a few minutes on a 2-core machine. Each figure is a median over repeated runs with
its spread (min..max; quartiles in the JSON), its reference, the ratio and
whether the goal is met. benchmarks/README.md explains each figure.

Runs on the main thread. Every cache it creates lives in a private runtime
dir and is swept at the end, also when a figure fails (exit 1 then).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnishm.committer.early_stop import EarlyStop

FIGURES = ("1", "2", "3", "4", "5", "6")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny geometries, a few seconds per figure (CI)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--only", default=",".join(FIGURES), help="comma-separated figures to run (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where figures 3 and 6 keep the step's outputs (cuda: the engine thread only launches copies)")
    parser.add_argument("--forward-threads", type=int, default=1, metavar="N",
                        help="torch threads while figures 3 and 6 run (their stand-in forward and the engine "
                             "thread's copies). 1, the default, leaves the committer a core, as vLLM's CPU worker "
                             "does: it reserves a core per rank. The number of cores measures a host the forward "
                             "keeps busy, where the committer's work comes out of the engine's time")


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release()}


_ENGINE_FIGURES = ("3", "6")
"""The figures with a stand-in forward: ``--forward-threads`` applies to them only. The others keep one
thread, so that their references stay a single-thread memcpy."""


def run(quick: bool, only: set[str], seed: int, device: str = "cpu",
        forward_threads: int = 1) -> tuple[list[Any], dict[str, str]]:
    import numpy as np
    import torch

    from omnishm.bench import manager_figures as mf
    from omnishm.bench import memory, overhead, write_figures as wf
    from omnishm.bench.common import Cleanup

    rng = np.random.default_rng(seed)
    if quick:
        plan = {
            "1": lambda c: wf.figure_write(c, wf.WriteSize(1024, 2048, 3, (1, 64, 256), 3), rng),
            "2": lambda c: mf.figure_read(c, mf.ReadSize(2048, 8192, 1024, 3)),
            "3": lambda c: mf.figure_engine(c, mf.EngineSize(512, 256, 8, 2048, 4, 3), device),
            "4": lambda c: wf.figure_control(c, wf.ControlSize(2000, 2, 200), rng, 1024),
            "5": lambda c: memory.figure_memory(c, memory.MemorySize(64, 1024, (1, 2), repeats=2)),
            "6": lambda c: overhead.figure_overhead(c, overhead.OverheadSize(8, 256, 128, 3), device),
        }
    else:
        plan = {
            "1": lambda c: wf.figure_write(c, wf.WriteSize(8192, 4096, 15, (1, 16, 64, 256), 30), rng),
            "2": lambda c: mf.figure_read(c, mf.ReadSize(32768, 4096, 8192, 8)),
            "3": lambda c: mf.figure_engine(c, mf.EngineSize(4096, 2048, 64, 4096, 20, 20), device),
            "4": lambda c: wf.figure_control(c, wf.ControlSize(40000, 5, 2000), rng, 4096),
            "5": lambda c: memory.figure_memory(c, memory.MemorySize(4096, 4096, (1, 2, 4))),
            "6": lambda c: overhead.figure_overhead(c, overhead.OverheadSize(120, 1024, 256, 20), device),
        }
    rows: list[Any] = []
    errors: dict[str, str] = {}
    cleanup = Cleanup()
    try:
        for fig in FIGURES:
            if fig not in only:
                continue
            t0 = time.monotonic()
            threads = forward_threads if fig in _ENGINE_FIGURES else 1
            torch.set_num_threads(threads)
            try:
                got = plan[fig](cleanup)
                if threads != 1:
                    for r in got:
                        r.extra["forward_threads"] = threads
                        if not r.name.startswith(" "):  # a figure's main row; its variants follow it
                            r.name += f", forward on {threads} torch threads"
                rows += got
            except Exception as exc:  # one failed figure is reported; the others still run
                errors[fig] = f"{type(exc).__name__}: {exc}"
                logging.getLogger(__name__).error("figure %s failed:\n%s", fig, traceback.format_exc())
            finally:
                torch.set_num_threads(1)
            logging.getLogger(__name__).info("figure %s took %.1fs", fig, time.monotonic() - t0)
    finally:
        leaked = cleanup.close()
    if leaked:
        errors["cleanup"] = f"segments left behind and removed: {leaked}"
    return rows, errors


def _fmt(v: float) -> str:
    if v >= 1e5:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}" if v < 10 else f"{v:.1f}"


def format_table(rows: list[Any]) -> str:
    lines = ["| fig | what | median [min..max] | reference: median [min..max] | ratio | goal | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.figure} | {r.name}{' (' + r.note + ')' if r.note else ''} | "
                     f"{_fmt(r.value.median)} [{_fmt(r.value.min)}..{_fmt(r.value.max)}] {r.unit} | "
                     f"{r.reference_name}: {_fmt(r.reference.median)} [{_fmt(r.reference.min)}.."
                     f"{_fmt(r.reference.max)}] {r.unit} | {r.ratio:.3g} | {r.goal} | {met} |")
    return "\n".join(lines)


def cli_main(args: argparse.Namespace, early: EarlyStop | None = None) -> int:
    """Run the benchmark. ``early`` (an ``EarlyStop``): the caller's record of a stop signal that came before
    this installs ``InterruptOnce``; the run then stops as if it came once it has (exit 130). A Ctrl-C or
    SIGTERM stops the run, its committers and children (``Cleanup.close``), and exits 130 with one line; it
    ended in a traceback (Ctrl-C) or the default action's 143 with no message (SIGTERM) before (review, stop 54)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    if not only:  # "--only ," or "--only ''" would run nothing and report success
        print(f"omnishm bench: --only {args.only!r} names no figure; known: {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    unknown = only - set(FIGURES)
    if unknown:
        print(f"omnishm bench: unknown figure(s) {sorted(unknown)}; known: {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    if args.forward_threads < 1:
        print(f"omnishm bench: --forward-threads must be >= 1, got {args.forward_threads}", file=sys.stderr)
        return 2
    # Imported while the caller's record-only handler is in place (seconds): a signal in an import was lost there.
    import torch

    from omnishm.bench import manager_figures, memory, overhead, write_figures  # noqa: F401  (run's, imported now)
    from omnishm.committer.early_stop import InterruptOnce

    if args.device == "cuda" and not torch.cuda.is_available():
        print("omnishm bench: --device cuda needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    interrupts: InterruptOnce | None = None
    try:
        interrupts = InterruptOnce()  # a second signal does not cut the committers' stop short
        interrupts.raise_pending(early)
        rows, errors = run(args.quick, only, args.seed, args.device, args.forward_threads)
    except KeyboardInterrupt as exc:  # run's Cleanup.close has stopped every committer and child by now
        print(f"omnishm bench: interrupted ({exc or 'SIGINT'}); its committers and child processes stopped",
              file=sys.stderr)
        return 130
    finally:
        if interrupts is not None:
            interrupts.restore()
    doc = {"date": started.isoformat(timespec="seconds"), "mode": "quick" if args.quick else "normal",
           "goals_judged": not args.quick, "device": args.device, "forward_threads": args.forward_threads,
           "seconds": round(time.monotonic() - t0, 1), "machine": _machine(),
           "figures": [r.to_json() for r in rows], "errors": errors}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        m = doc["machine"]
        print(f"omnishm bench ({doc['mode']}), {doc['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
              f"{doc['seconds']}s\n")
        if args.quick:
            print("quick mode: tiny geometries that only check every figure runs; the ratios are not comparable with "
                  "the goals, which a normal run (without --quick) judges\n")
        print(format_table(rows))
        for fig, err in errors.items():
            print(f"\nfigure {fig} FAILED: {err}")
    return 1 if errors else 0


__all__ = ["add_arguments", "cli_main", "format_table", "run"]
