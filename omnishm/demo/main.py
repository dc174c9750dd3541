"""``omnishm demo``: TP ranks of a simulated engine sharing one embedded committer.

Rank 0 writes, the other ranks read; every rank checks every row it
materializes against ground truth. Ends with a table and exits non-zero on any
mismatch, failed rank, or shared memory left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omnishm import liveness, paths, shm
from omnishm.config import ConfigError, check_endpoint, manager_connection, resolve, seconds_argument
from omnishm.committer.early_stop import EarlyStop, InterruptOnce
from omnishm.demo.launch import RankGroup
from omnishm.demo.rank import RankOptions, RankResult


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (wrong input is a usage error, exit 2, naming the argument)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _rate(text: str) -> float:
    """An argparse type: a probability, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def _cache_name(text: str) -> str:
    try:
        return shm.check_cache_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=_at_least(1), default=2, help="runner processes (rank 0 writes, others read)")
    parser.add_argument("--steps", type=_at_least(1), default=300, help="engine steps per rank")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="run for this long instead of --steps (ranks then drift apart: no lockstep); at least "
                             "30 s under --timeout-s")
    parser.add_argument("--name", type=_cache_name, default="demo", help="cache (and embedded committer) name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=_at_least(1), default=256)
    parser.add_argument("--block-size", type=_at_least(1), default=16)
    parser.add_argument("--max-batched-tokens", type=_at_least(1), default=256)
    parser.add_argument("--hidden-size", type=_at_least(1), default=256)
    parser.add_argument("--mm-width", type=_at_least(1), default=16)
    parser.add_argument("--lag", type=_at_least(0), default=0, help="steps between save and materialize")
    parser.add_argument("--preempt-rate", type=_rate, default=0.02,
                        help="chance per step that the simulated scheduler preempts a running request (it resumes "
                             "later, with a hit on its own cached blocks)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="save the outputs from this device (cuda: copy stream, events, pinned staging)")
    parser.add_argument("--timeout-s", type=seconds_argument, default=600.0)
    parser.add_argument("--json", action="store_true", help="print the final table as JSON")


START_MARGIN_S = 30.0
"""What --timeout-s must leave beyond --duration-s for the ranks' start (torch's import, the committer's
start, the meeting)."""


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):.2f} GiB"


def summarize(opts: RankOptions, results: list[RankResult], leaked: list[str], seconds: float) -> dict:
    writer = results[0]
    mirror = max((r.mirror_bytes for r in results), default=0)
    return {
        "tp": opts.tp, "steps": writer.steps, "requests": writer.requests,
        "preemptions": writer.preemptions, "resumed_hits": writer.resumed_hits,
        "hit_tokens": sum(r.hit_tokens for r in results),
        "token_checked_rows": writer.token_checked_rows,
        "rows_served": sum(r.rows_served for r in results),
        "rows_checked": sum(r.rows_checked for r in results),
        "mismatches": sum(r.mismatches for r in results),
        "errors": {f"rank{r.rank}": r.errors for r in results if r.errors},
        "failures": {f"rank{r.rank}": r.failure for r in results if r.failure},
        "mirror_bytes": mirror,
        "per_rank_mirror_bytes": mirror * opts.tp,
        "leaked_segments": leaked,
        "seconds": round(seconds, 2),
    }


def cli_main(args: argparse.Namespace, early: EarlyStop | None = None) -> int:
    """Run the demo. ``early``: the caller's record of a stop signal that came before ``InterruptOnce`` is in
    place (``omnishm.cli.run_external``); the demo then stops as if it came once it is (exit 130)."""
    opts = RankOptions(cache=shm.check_cache_name(args.name), tp=args.tp, seed=args.seed, steps=args.steps,
                       duration_s=args.duration_s, num_blocks=args.num_blocks, block_size=args.block_size,
                       max_batched_tokens=args.max_batched_tokens, width=args.hidden_size,
                       mm_width=args.mm_width, lag=args.lag, lockstep=args.duration_s is None,
                       device=args.device, preempt_rate=args.preempt_rate)
    from omnishm.sim import MAX_NEW_TOKENS, SimEngine  # torch: only once the demo runs

    if args.duration_s is not None and not 0 < args.duration_s <= args.timeout_s - START_MARGIN_S:
        # Else every rank is stopped as timed out before the run ends, and the demo reports a failure.
        print(f"omnishm demo: --duration-s {args.duration_s:g} must be positive and at least {START_MARGIN_S:g}s "
              f"under --timeout-s {args.timeout_s:g}, which also covers the ranks' start", file=sys.stderr)
        return 2
    need = SimEngine.blocks_for_longest_request(opts.block_size, opts.max_batched_tokens)
    if opts.num_blocks < need:
        # Else the longest request is never scheduled in full, and every step after it is empty, for good.
        longest = SimEngine.max_prompt_tokens(opts.block_size, opts.max_batched_tokens) + MAX_NEW_TOKENS
        print(f"omnishm demo: --num-blocks {opts.num_blocks} of --block-size {opts.block_size} cannot hold the "
              f"longest request of --max-batched-tokens {opts.max_batched_tokens} ({longest} tokens): give "
              f"--num-blocks >= {need}", file=sys.stderr)
        return 2
    try:
        opts.prefix_cache_config()  # what every rank will build: a bad OMNISHM_* knob stops the demo here
        if opts.autostart:
            # The committer a rank autostarts reads the same environment and file. A bad committer knob made
            # each rank's start fail in turn, and the refused starts' logs were counted as leaks (review).
            resolve("committer", {"name": opts.cache})
    except (ConfigError, ValueError) as exc:
        print(f"omnishm demo: {exc}", file=sys.stderr)
        return 2
    try:  # what every rank's manager checks: else each rank failed, and then the demo's own check raised
        # The socket path first: one too long to bind failed every rank after the dir was made (review, stop 54).
        check_endpoint(opts.endpoint or paths.ipc_endpoint(_runtime_dir(opts), opts.cache))
        runtime_dir = paths.ensure_runtime_dir(_runtime_dir(opts))
        live = liveness.cache_is_live(runtime_dir, opts.cache)
    except (OSError, ValueError) as exc:
        print(f"omnishm demo: {exc}", file=sys.stderr)
        return 2
    if live:
        # Its ranks would attach to that committer, which outlives them: its segments, counted as leaked,
        # failed a correct run (review, 2026-12-06).
        print(f"omnishm demo: cache {opts.cache!r} already has a committer (in {runtime_dir}); the demo "
              f"starts its own and checks that it leaves nothing behind: give the demo another --name",
              file=sys.stderr)
        return 2
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("omnishm demo: --device cuda needs a CUDA device, and torch sees none", file=sys.stderr)
            return 2
    progress: dict[int, int] = {}
    shown: list[str] = []
    t0 = time.perf_counter()
    total = opts.steps if opts.duration_s is None else None
    tty = sys.stderr.isatty()

    def on_progress(rank: int, steps: int, _mismatches: int, _refused: int) -> None:
        progress[rank] = steps
        if args.json:
            return
        slowest = min(progress.get(r, 0) for r in range(opts.tp))
        if total:
            line = f"omnishm demo {_bar(slowest, total)} {slowest}/{total} steps (tp={opts.tp})"
            key = line if tty else str(10 * slowest // max(total, 1))
        else:
            line = f"omnishm demo {time.perf_counter() - t0:6.1f}s, {slowest} steps (tp={opts.tp})"
            key = line if tty else str(int(time.perf_counter() - t0) // 10)
        if shown and shown[-1] == key:
            return
        shown.append(key)
        sys.stderr.write(("\r" + line) if tty else (line + "\n"))
        sys.stderr.flush()

    # A second signal must not cut the bounded cleanup short (STOP_TIMEOUT_S, then _wait_for_cleanup's
    # timeout), or the report of what was left would be lost.
    interrupts: InterruptOnce | None = None
    group: RankGroup | None = None
    try:
        interrupts = InterruptOnce()  # inside: a signal as it goes in raises here, and is handled below
        interrupts.raise_pending(early)
        group = RankGroup(opts)
        results = group.start().wait(args.timeout_s, on_progress)
        if not args.json and tty:
            sys.stderr.write("\n")
        # Still under InterruptOnce: the wait for the committer's exit takes up to 20 s, and a signal in it
        # ended the demo by the default action (143, or a traceback), not 130 with its report (review).
        leaked = _wait_for_cleanup(opts)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the ranks, let the committer go, report what is left
        if group is not None:
            group.stop()
        leaked = _wait_for_cleanup(opts)
        print(f"\nomnishm demo: interrupted; ranks stopped, leaked segments {len(leaked)}"
              + (f": {leaked}" if leaked else ""), file=sys.stderr)
        return 130
    finally:
        if interrupts is not None:
            interrupts.restore()
    summary = summarize(opts, results, leaked, time.perf_counter() - t0)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary))
    ok = passed(summary, opts)
    if not ok:
        print("omnishm demo: FAILED (mismatches, a refused read the writer or a lockstep reader must not refuse, "
              "a failed rank, or leaked shared memory)", file=sys.stderr)
    return 0 if ok else 1


def passed(summary: dict, opts: RankOptions) -> bool:
    """The demo's verdict: no mismatch, no failed rank, nothing leaked, and no refused read where none can be.

    The writer (rank 0) keeps copy-on-write rescues for its late reads, so it never refuses one. In
    lockstep (a step count, no --duration-s) with every step materialized in the step (--lag 0), no read
    can come late, so a reader's refusal is a failure too. A reader that lags (--lag) may find a hit's
    slots already given to a new tenant and refuse it ("reused"), as it must (docs/DESIGN-NOTES.md), but
    only when a step saved after the read's own wrote a slot of the hit: the rank checks that against its
    pending steps, and any other "reused" is counted as ``rank.UNEXPLAINED_REUSE``, a failure. One that
    drifts (--duration-s) may also run ahead of the writer, or outlive it, and time out; its refusals are
    not checked (which steps the writer saved meanwhile is not known).
    """
    errors = summary["errors"] or {}
    writer_refused = sum(errors.get("rank0", {}).values())
    reader_kinds = {kind for rank, per_rank in errors.items() if rank != "rank0" for kind, n in per_rank.items() if n}
    readers_ok = not opts.lockstep or reader_kinds <= ({"reused"} if opts.lag > 0 else set())
    return summary["mismatches"] == 0 and not summary["failures"] and not summary["leaked_segments"] and \
        writer_refused == 0 and readers_ok


def _runtime_dir(opts: RankOptions) -> Path:
    """Where the ranks' managers look: OMNISHM_RUNTIME_DIR or the config file's, else the default."""
    return Path(opts.runtime_dir or manager_connection(runtime_dir=None)["runtime_dir"] or paths.default_runtime_dir())


def _wait_for_cleanup(opts: RankOptions, timeout_s: float = 20.0) -> list[str]:
    """The embedded committer exits once the last rank said goodbye; then nothing may remain."""
    runtime_dir = _runtime_dir(opts)
    deadline = time.monotonic() + timeout_s
    while liveness.cache_is_live(runtime_dir, opts.cache) and time.monotonic() < deadline:
        time.sleep(0.05)
    files = sorted(str(p) for p in runtime_dir.glob(f"{opts.cache}.*")) if runtime_dir.is_dir() else []
    return shm.list_segments(opts.cache) + files


def format_table(s: dict) -> str:
    rows = [
        ("TP ranks", s["tp"]), ("steps", s["steps"]), ("requests finished", s["requests"]),
        ("preempted (resumed with a hit)", f"{s['preemptions']} ({s['resumed_hits']})"),
        ("hit tokens (all ranks)", s["hit_tokens"]), ("hit rows token-checked (writer)", s["token_checked_rows"]),
        ("rows served", s["rows_served"]),
        ("rows checked", s["rows_checked"]), ("mismatches", s["mismatches"]),
        ("errors raised", s["errors"] or 0), ("failed ranks", s["failures"] or 0),
        ("bytes in the shared mirror", _mib(s["mirror_bytes"])),
        ("a mirror per rank would need", _mib(s["per_rank_mirror_bytes"])),
        ("leaked segments", len(s["leaked_segments"])), ("seconds", s["seconds"]),
    ]
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 24 + "+"
    out = [line]
    out += [f"| {k:<{width}} | {str(v):>22} |" for k, v in rows]
    out.append(line)
    return "\n".join(out)
