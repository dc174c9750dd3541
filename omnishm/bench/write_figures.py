"""Figures 1 (pool write bandwidth) and 4 (control plane), against a real committer subprocess.

Both drive the committer with a ``RawWriter`` (the protocol by hand, as the
manager would send it), so what is timed is the committer, not the client.
Main thread only.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnishm import protocol as P
import zmq

from omnishm.bench.common import (Cleanup, Memcpy, ProcessCommitter, RawWriter, Row, Stats, dies_with_bench,
                                  step_write)
from omnishm.bench.nt_memcpy import NonTemporalMemcpy
from omnishm.versions import make_cv

BS = 16


@dataclass
class WriteSize:
    step_tokens: int
    width: int
    reps: int
    decode_sizes: tuple[int, ...]
    decode_reps: int


def _claim(writer: RawWriter, key: str, slots: np.ndarray, cvs: np.ndarray) -> None:
    writer.keys[key]["claim"][slots] = cvs


def _apply_and_time(writer: RawWriter, msg: P.StepWrite) -> tuple[float, float, P.StepDone]:
    """(committer apply seconds from its status, round trip seconds, reply) of one StepWrite.

    Raises unless the committer wrote every row the message names: a step whose rows were skipped
    (claims not this step's) would time an apply that copied nothing."""
    before = writer.status()["apply_seconds"]
    t0 = time.perf_counter()
    reply = writer.call(msg)
    rt = time.perf_counter() - t0
    after = writer.status()["apply_seconds"]
    if not isinstance(reply, P.StepDone) or reply.failed_tids:
        raise RuntimeError(f"step write failed: {reply}")
    rows = int(np.frombuffer(msg.counts, dtype="<i8").sum())
    if reply.rows_skipped or reply.rows_written != rows:
        raise RuntimeError(f"step write applied {reply.rows_written} of {rows} rows "
                           f"({reply.rows_skipped} skipped): the figure would time a copy that did not happen")
    return after - before, rt, reply


def _check_landed(kv: dict, slots: np.ndarray, first_row: int, what: str) -> None:
    """Raise unless ``pool[slots[i]]`` equals staging row ``first_row + i`` for every i, bit for bit.

    Run after each timed step, outside its clock: a committer that moved the right number of bytes
    into the wrong rows (or skipped some) would otherwise be timed as a faster committer. The staged
    rows stay the same from step to step, but each step picks new random slots, so a slot that kept
    an older step's row holds another staging row than the one this step names."""
    got = kv["pool"][torch.as_tensor(slots, dtype=torch.int64)].view(torch.int16)
    want = kv["staging"][first_row:first_row + len(slots)].view(torch.int16)
    bad = (got != want).any(dim=1).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RuntimeError(f"figure 1, {what}: {len(bad)} of {len(slots)} pool rows differ from their staged rows "
                           f"(first: slot {int(slots[i])}, staging row {first_row + i})")


def figure_write(cleanup: Cleanup, size: WriteSize, rng: np.random.Generator) -> list[Row]:
    """Figure 1: committer applying realistic steps vs a single-thread memcpy of the same bytes."""
    n, width = size.step_tokens, size.width
    num_blocks = 2 * n // BS
    layout = P.Layout(num_blocks=num_blocks, block_size=BS)
    rows: list[Row] = []
    with Memcpy(n, width, torch.bfloat16) as ref, ProcessCommitter(cleanup, "write") as com:
        w = RawWriter(com.endpoint, com.name, layout, staging_rows=n)
        # The step's own pieces, one memcpy each, with the committer's stores (nt_memcpy's scatter).
        pieces = ref.nt if ref.nt is not None else NonTemporalMemcpy.start(ref.row_bytes * n, always=True)
        try:
            kv = w.open_key("hidden", torch.bfloat16, width)
            kv["staging"].copy_(torch.randn(n, width).to(torch.bfloat16))
            step = 0

            def large_step() -> tuple[P.StepWrite, np.ndarray, np.ndarray]:
                nonlocal step
                step += 1
                # 4 prefill requests of n/4 tokens, each in randomly placed blocks (runs of BS rows).
                blocks = rng.permutation(num_blocks)[: n // BS]
                slots = (blocks[:, None] * BS + np.arange(BS)).reshape(-1)
                reqs = 4
                per = n // reqs
                cvs = np.array([make_cv(w.epoch, step, i + 1) for i in range(reqs)], dtype=np.int64)
                _claim(w, "hidden", slots, np.repeat(cvs, per))
                return step_write(w.next_rid(), step, ["hidden"], [0] * reqs, range(1, reqs + 1), cvs,
                                  np.arange(reqs) * per, [per] * reqs, slots), slots, blocks

            msg, slots, blocks = large_step()  # warm-up
            _apply_and_time(w, msg)
            _check_landed(kv, slots, 0, "warm-up step")
            assert pieces is not None
            pieces.scatter(BS * ref.row_bytes, blocks.tolist())  # grows the child's destination, untimed
            apply_t, rt_t, ref_t, piece_t = [], [], [], []
            for _ in range(size.reps):
                msg, slots, blocks = large_step()
                a, r, _ = _apply_and_time(w, msg)
                _check_landed(kv, slots, 0, f"step {step}")  # every row of the step, staged in order from row 0
                apply_t.append(a)
                rt_t.append(r)
                ref_t.append(ref.time(n))
                piece_t.append(pieces.scatter(BS * ref.row_bytes, blocks.tolist()))
            nbytes = n * width * 2
            v, (rf, ref_name, ref_extra) = Stats.of(apply_t).scaled(nbytes / 1e9), Memcpy.reference(ref_t, nbytes)
            rt = Stats.of(rt_t).scaled(nbytes / 1e9)
            rows.append(Row("1", f"pool write, {n} tok x {width} bf16 ({nbytes >> 20} MiB), blocks of {BS}",
                            "GB/s", v, ref_name, rf, v.median / rf.median, ">= 0.8",
                            v.median / rf.median >= 0.8,
                            note="committer's own apply time (status apply_seconds)",
                            extra={"round_trip_GBps": rt.median, "round_trip_ratio": rt.median / rf.median,
                                   **ref_extra}))
            per_piece = Stats.of(piece_t).scaled(nbytes / 1e9)
            rows.append(Row("1", f"  variant: the same step against glibc memcpy of its {n // BS} pieces of "
                            f"{BS * ref.row_bytes >> 10} KiB to its places, one call each", "GB/s", v,
                            "memcpy per piece (glibc, committer's stores, 1 thread)", per_piece,
                            v.median / per_piece.median, "-", None,
                            note="what of the gap above is the pieces' (bench/nt_memcpy.py)",
                            extra={"pieces_vs_one_memcpy": per_piece.median / rf.median}))
            for k in size.decode_sizes:
                apply_t, ref_t = [], []
                for _ in range(size.decode_reps):
                    step += 1
                    slots = rng.choice(num_blocks * BS, size=k, replace=False)
                    cvs = np.array([make_cv(w.epoch, step, i + 1) for i in range(k)], dtype=np.int64)
                    _claim(w, "hidden", slots, cvs)
                    # One row per request, staged one after the other in batch order, as the manager stages
                    # a step (random staging rows took the committer's general path: 1.2-1.5x the time).
                    first = int(rng.integers(0, n - k + 1))
                    msg = step_write(w.next_rid(), step, ["hidden"], [0] * k, range(1, k + 1), cvs,
                                     first + np.arange(k), [1] * k, slots)
                    a, _, _ = _apply_and_time(w, msg)
                    apply_t.append(a)
                    # The reference right after the apply, as before the check came: the check's gather (a new
                    # tensor) between them slowed this small copy, which runs from cache (review, 2026-12-06).
                    ref_t.append(ref.time(k))
                    _check_landed(kv, slots, first, f"decode step {step}")
                nbytes = k * width * 2
                v, (rf, ref_name, ref_extra) = Stats.of(apply_t).scaled(nbytes / 1e9), Memcpy.reference(ref_t, nbytes)
                rows.append(Row("1", f"pool write, decode {k} tok at random slots", "GB/s", v,
                                ref_name, rf, v.median / rf.median, "-", None,
                                note=f"{Stats.of(apply_t).median * 1e6:.0f} us per step inside apply",
                                extra=ref_extra))
        finally:
            w.close()
            if pieces is not None and pieces is not ref.nt:
                pieces.close()
    return rows


def _percentile_stats(blocks: list[np.ndarray], q: float) -> Stats:
    """Percentile ``q`` of all samples (seconds) as the value, in us; min, quartiles and max over the
    same percentile of each block: a latency figure with its spread over repeated runs."""
    per_block = np.array([np.percentile(b, q) for b in blocks]) * 1e6
    value = float(np.percentile(np.concatenate(blocks), q)) * 1e6
    # The pooled percentile lies within the blocks' up to interpolation and rounding: 4010.45839826111 us
    # against a least block's 4010.45839826112 us failed the bench test's min <= median <= max (CI flake,
    # 2026-12-06). The spread is widened to hold it.
    return Stats(value, min(value, float(per_block.min())), max(value, float(per_block.max())),
                 float(np.percentile(per_block, 25)), float(np.percentile(per_block, 75)), len(blocks))


# ---------------------------------------------------------------- figure 4


@dataclass
class ControlSize:
    descriptors: int
    reps: int
    latency_samples: int
    window: int = 256


class _Cycle:
    """Sends ``msgs`` in turn, cycling across calls; where ``claims`` are given, message k's claim versions go
    into ``claim[slot_sets[k]]`` first, as a writer claims its step's slots before sending it."""

    def __init__(self, send: Callable[[bytes], object], msgs: list[bytes], claim: np.ndarray | None = None,
                 slot_sets: list[np.ndarray] | None = None, claims: list[np.ndarray] | None = None):
        self.send, self.msgs, self.claim, self.slot_sets, self.claims = send, msgs, claim, slot_sets, claims
        self.sent = 0

    def __call__(self) -> None:
        k = self.sent % len(self.msgs)
        self.sent += 1
        if self.claims is not None:
            self.claim[self.slot_sets[k]] = self.claims[k]  # type: ignore[index]
        self.send(self.msgs[k])


def _throughput(send: Callable[[], None], recv: Callable[[], None], count: int, window: int) -> float:
    """Seconds to push ``count`` messages with at most ``window`` in flight."""
    sent = got = 0
    t0 = time.perf_counter()
    while got < count:
        while sent < count and sent - got < window:
            send()
            sent += 1
        recv()
        got += 1
    return time.perf_counter() - t0


def _latency(send: Callable[[], None], recv: Callable[[], None], samples: int) -> np.ndarray:
    """Round-trip seconds of ``samples`` messages, one in flight at a time."""
    out = np.empty(samples)
    for i in range(samples):
        t0 = time.perf_counter()
        send()
        recv()
        out[i] = time.perf_counter() - t0
    return out


def figure_control(cleanup: Cleanup, size: ControlSize, rng: np.random.Generator, width: int) -> list[Row]:
    """Figure 4: descriptors/s and tasks/s with 64 tiny tasks each; round trip p50/p99 of a decode step."""
    tasks, per_task = 64, 2
    # One slot set per descriptor in flight, each with two versions sent in turn and claimed right before
    # its send: the committer never writes a row again under the version it committed it with, so a
    # descriptor sent twice as it is would copy nothing the second time.
    ring = max(64, size.window)
    num_slots = ring * tasks * per_task * 2
    layout = P.Layout(num_blocks=num_slots // BS, block_size=BS)
    rows: list[Row] = []
    with ProcessCommitter(cleanup, "control") as com:
        w = RawWriter(com.endpoint, com.name, layout, staging_rows=tasks * per_task)
        echo_ep = f"ipc://{cleanup.runtime_dir / (com.name + '-echo.sock')}"
        with open(cleanup.runtime_dir / (com.name + "-echo.log"), "wb") as echo_log:  # not the caller's pipes
            echo = subprocess.Popen([sys.executable, "-m", "omnishm.bench.echo", echo_ep], stdin=subprocess.DEVNULL,
                                    stdout=echo_log, stderr=subprocess.STDOUT, preexec_fn=dies_with_bench())
        cleanup.procs.append(echo)
        e = None
        try:
            w.open_key("tiny", torch.float32, 4)
            w.open_key("hidden", torch.bfloat16, width)
            slots = rng.permutation(num_slots)[: ring * tasks * per_task].reshape(ring, tasks * per_task)
            # Message i is version i // ring of slot set i % ring, so a slot set's next send is its other version.
            msgs, claims = [], []
            for i in range(2 * ring):
                cvs = np.array([make_cv(w.epoch, i + 1, t + 1) for t in range(tasks)], dtype=np.int64)
                claims.append(np.repeat(cvs, per_task))
                msgs.append(P.encode(step_write(i + 1, i + 1, ["tiny"], [0] * tasks, range(1, tasks + 1), cvs,
                                                np.arange(tasks) * per_task, [per_task] * tasks, slots[i % ring])))
            to_committer = _Cycle(w.send, msgs, w.keys["tiny"]["claim"], [slots[i % ring] for i in range(2 * ring)],
                                  claims)
            # Decode step for the latency: 64 requests x 1 token of the wide key at random slots, two versions.
            dslots = rng.choice(num_slots, size=tasks, replace=False)
            dclaims, decodes = [], []
            for v in range(2):
                dcvs = np.array([make_cv(w.epoch, 2 * ring + v + 1, t + 1) for t in range(tasks)], dtype=np.int64)
                dclaims.append(dcvs)
                decodes.append(P.encode(step_write(1, 2 * ring + v + 1, ["hidden"], [0] * tasks, range(1, tasks + 1),
                                                   dcvs, np.arange(tasks), [1] * tasks, dslots)))
            decode_to_committer = _Cycle(w.send, decodes, w.keys["hidden"]["claim"], [dslots, dslots], dclaims)

            def recv_ok() -> None:
                reply = w.recv()
                if not isinstance(reply, P.StepDone) or reply.failed_tids or reply.rows_skipped:
                    raise RuntimeError(f"figure 4: unexpected reply {reply}")

            e = zmq.Context.instance().socket(zmq.DEALER)
            e.setsockopt(zmq.LINGER, 0)
            e.connect(echo_ep)

            def e_recv() -> None:
                if not e.poll(30000):
                    raise TimeoutError("echo reference did not answer")
                P.reply_decoder.decode(e.recv())

            to_echo, decode_to_echo = _Cycle(e.send, msgs), _Cycle(e.send, decodes)
            _throughput(to_committer, recv_ok, min(size.descriptors, 2000), size.window)  # warm-up
            _throughput(to_echo, e_recv, min(size.descriptors, 2000), size.window)
            com_t, echo_t, apply_us = [], [], []
            for _ in range(size.reps):
                before = w.status()
                com_t.append(_throughput(to_committer, recv_ok, size.descriptors, size.window))
                after = w.status()
                apply_us.append((after["apply_seconds"] - before["apply_seconds"]) /
                                (after["steps_applied"] - before["steps_applied"]) * 1e6)
                echo_t.append(_throughput(to_echo, e_recv, size.descriptors, size.window))
            d, de = Stats.of(com_t).scaled(size.descriptors), Stats.of(echo_t).scaled(size.descriptors)
            apply_med = float(np.median(apply_us))
            rows.append(Row("4", f"descriptors/s ({tasks} tasks x {per_task} rows of 16 B each)", "desc/s", d,
                            "echo ROUTER (decode + reply, no apply)", de, d.median / de.median, ">= 20000/s",
                            d.median >= 20000,
                            note=f"{apply_med:.1f} us inside apply_step per descriptor",
                            extra={"apply_us_per_descriptor": apply_med}))
            t, te = Stats.of(com_t).scaled(size.descriptors * tasks), Stats.of(echo_t).scaled(size.descriptors * tasks)
            rows.append(Row("4", "write tasks/s (same run)", "tasks/s", t, "echo ROUTER (decode + reply, no apply)",
                            te, t.median / te.median, ">= 1000000/s", t.median >= 1e6))
            _latency(decode_to_committer, recv_ok, 50)
            _latency(decode_to_echo, e_recv, 50)
            lat_c, lat_e = [], []
            for _ in range(size.latency_samples // 100):  # interleaved blocks share the machine's noise
                lat_c.append(_latency(decode_to_committer, recv_ok, 100))
                lat_e.append(_latency(decode_to_echo, e_recv, 100))
            for q in (50, 99):
                vc, ve = _percentile_stats(lat_c, q), _percentile_stats(lat_e, q)
                rows.append(Row("4", f"round trip p{q}, decode step {tasks} tok x {width} bf16", "us",
                                vc, "echo ROUTER round trip, same bytes", ve, vc.median / ve.median,
                                "< 1000 us" if q == 99 else "-", (vc.median < 1000) if q == 99 else None,
                                note=f"DEALER send to StepDone received, one in flight; p{q} of all "
                                     f"{sum(map(len, lat_c))} round trips, spread: p{q} of each block of 100"))
        finally:
            if e is not None:
                e.send(P.encode(P.Goodbye(rid=0)))
                e.poll(5000)
                e.close()
            try:
                echo.wait(5)
            except subprocess.TimeoutExpired:
                echo.kill()
                echo.wait()
            w.close()
    return rows
