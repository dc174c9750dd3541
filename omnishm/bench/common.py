"""Shared pieces of ``omnishm bench``: statistics, results, committers (process and thread), references.

Everything here runs on the benchmark's main thread unless said otherwise.
Every committer a figure starts is registered with a ``Cleanup`` so its
segments, socket and lock file are removed even when the figure fails.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import zmq

from omnishm import protocol as P
from omnishm import liveness, orphans, paths, shm
from omnishm.bench.nt_memcpy import NonTemporalMemcpy

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


# ---------------------------------------------------------------- statistics and results


@dataclass
class Stats:
    """Median and spread of repeated samples (same unit as the samples)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, samples: list[float] | np.ndarray) -> "Stats":
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            raise ValueError("no samples")
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(a.min()), float(a.max()), float(q1), float(q3), int(a.size))

    def scaled(self, k: float) -> "Stats":
        """Samples were times: ``k / t`` turns them into rates (min and max swap)."""
        return Stats(k / self.median, k / self.max, k / self.min, k / self.q3, k / self.q1, self.n)


@dataclass
class Row:
    """One line of the results table: a measured value next to its reference and their ratio."""

    figure: str
    name: str
    unit: str
    value: Stats
    reference_name: str
    reference: Stats
    ratio: float
    goal: str
    met: bool | None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["value"] = asdict(self.value)
        d["reference"] = asdict(self.reference)
        return d


def rate_rows_ratio(value: Stats, reference: Stats) -> float:
    return value.median / reference.median if reference.median else float("nan")


# ---------------------------------------------------------------- cleanup and committers


RUN_DIR_PREFIX = "omnishm-bench-"
"""A run's private runtime dir in the temp dir: ``tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)``."""
RUN_LOCK = "run.flock"
"""In a run's dir, ``flock``ed by the run while it lives; not a ``*.lock``, which sweeps read as a cache's lock."""


def _hold_run_dir(run_dir: Path) -> int:
    """The fd of ``run_dir/RUN_LOCK``, ``flock``ed for as long as this process lives (or until closed).

    Locked before its name is given: a sweep (``sweep_dead_runs``) that finds the name always finds it held
    by a live run, never in the moment between a create and a lock."""
    made = run_dir / f".{RUN_LOCK}.new"
    fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(made, run_dir / RUN_LOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_dead_runs(parent: Path) -> list[Path]:
    """Remove the runtime dirs of earlier runs that died without ``Cleanup.close`` (SIGKILL, a lost host
    session): the committer logs a killed run left in the temp dir for good (stop 49's list).

    A dir goes only when it is this user's real directory (not a link), its ``RUN_LOCK`` is there and no
    process holds it, and no cache lock in it is held (``orphans.abandoned``: a killed run's committer,
    told by the kernel to stop, may still be stopping; the next run removes the dir). A dir of a run from
    before ``RUN_LOCK``, or of another user, is left as it is. Never raises; returns the dirs removed."""
    removed: list[Path] = []
    try:
        candidates = sorted(parent.glob(RUN_DIR_PREFIX + "*"))
    except OSError:
        return removed
    for run_dir in candidates:
        try:
            st = os.lstat(run_dir)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(run_dir / RUN_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run's
            if not orphans.abandoned(run_dir):  # never raises
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            if not run_dir.exists():
                removed.append(run_dir)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d runtime dir(s) that killed benchmark runs left: %s", len(removed),
                    ", ".join(map(str, removed)))
    return removed


class Cleanup:
    """Runtime dir and every cache name the run created; ``close`` sweeps them (idempotent).

    Made on the bench's main thread; its dir is held (``RUN_LOCK``) until ``close``, and the dirs earlier
    killed runs left beside it are removed first (``sweep_dead_runs``; ``swept`` lists them)."""

    def __init__(self) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))  # 0700
        self._held: int | None = None
        try:
            self._held = _hold_run_dir(self.runtime_dir)
            self.swept = sweep_dead_runs(self.runtime_dir.parent)
        except BaseException:  # a Ctrl-C: nothing of this run is left
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            if self._held is not None:
                os.close(self._held)
            raise
        self.caches: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._run = uuid.uuid4().hex[:6]

    def cache_name(self, tag: str) -> str:
        name = f"bench{self._run}-{tag}"
        self.caches.append(name)
        return name

    def close(self) -> list[str]:
        removed: list[str] = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for name in self.caches:
            for seg in shm.list_segments(name):
                if shm.unlink_segment(seg):
                    removed.append(seg)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._held is not None:  # after the rmtree: a sweep never takes a dir that is still emptying
            os.close(self._held)
            self._held = None
        return removed


def close_all(things: Iterable[Any]) -> None:
    """``close()`` each of ``things``, every one even when one raises; then the first error is raised (the first
    ``KeyboardInterrupt`` or ``SystemExit`` before any ``Exception``).

    A figure's arms and workers: a ``ProcessCommitter`` whose process did not stop cleanly raises from its
    ``stop`` by design, and a plain loop then left the arms after it running (in-process committer threads
    serving through the later figures, over segments ``Cleanup.close`` unlinks; review, stop 51)."""
    first: BaseException | None = None
    for thing in things:
        try:
            thing.close()
        except BaseException as exc:  # noqa: BLE001 - raised below, once every one was closed
            # A Ctrl-C or an exit wins over an error: raised as the error, the run went on to the next figure.
            if first is None or (isinstance(first, Exception) and not isinstance(exc, Exception)):
                first = exc
    if first is not None:
        raise first


def _stop_with_bench(bench: int) -> None:
    """A committer's ``preexec_fn``: it gets SIGTERM (stops, unlinks its segments) when the bench dies, even by
    SIGKILL. A bench killed mid-figure left its committer serving, and holding its pool, for good (review,
    2026-12-06). A bench gone before this call: exit before the exec."""
    if not liveness.die_with_parent(bench):
        os._exit(1)


def dies_with_bench(*, deaf_to_ctrl_c: bool = False) -> Callable[[], None]:
    """``preexec_fn`` of every child process of the bench (``_stop_with_bench`` of this process): none outlives a
    bench killed mid-figure. Figure 4's echo server had none, and outlived it waiting for good, holding the
    caller's stderr pipe open (review, stop 54). ``deaf_to_ctrl_c``: the child ignores SIGINT (Python keeps it
    ignored), for a worker the bench stops itself that writes to the bench's stderr: a terminal's Ctrl-C, sent
    to the whole process group, printed a traceback of each beside the bench's one line (review, stop 54)."""
    return functools.partial(_child_of_bench, os.getpid(), deaf_to_ctrl_c)


def _child_of_bench(bench: int, deaf_to_ctrl_c: bool) -> None:
    _stop_with_bench(bench)
    if deaf_to_ctrl_c:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class ProcessCommitter:
    """A real committer subprocess (``python -m omnishm.committer --prefault``) that stops with the bench."""

    def __init__(self, cleanup: Cleanup, tag: str):
        self.cleanup = cleanup
        self.name = cleanup.cache_name(tag)
        self.runtime_dir = cleanup.runtime_dir
        self.endpoint = paths.ipc_endpoint(self.runtime_dir, self.name)
        self.log_path = self.runtime_dir / f"{self.name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "omnishm.committer", "--name", self.name, "--runtime-dir",
                 str(self.runtime_dir), "--prefault", "--heartbeat-timeout-s", "120", "--log-level", "WARNING"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=dies_with_bench())
        cleanup.procs.append(self.proc)
        self._wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self) -> None:
        from omnishm.cli import CommitterUnavailable, admin_request

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"committer {self.name} exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                admin_request(self.name, self.endpoint, None, 1.0)
                return
            except CommitterUnavailable:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"committer {self.name} did not answer within {START_TIMEOUT_S}s") from None
                time.sleep(0.05)

    def stop(self, *, check: bool = True) -> None:
        """SIGTERM, wait, sweep what is left. With ``check``, raises when the committer did not stop cleanly
        (exit status not 0, killed after ``STOP_TIMEOUT_S``, or segments left): a committer that died during
        a figure must not pass unnoticed, and the sweep would else hide what it left from ``Cleanup``."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed = True
        left = shm.list_segments(self.name)
        orphans.sweep(self.runtime_dir, self.name)
        problems = [f"did not stop within {STOP_TIMEOUT_S}s of SIGTERM (killed)"] if killed else \
            [f"exited {self.proc.returncode}"] if self.proc.returncode != 0 else []
        if left:
            problems.append(f"left {len(left)} segment(s): {', '.join(sorted(left))}")
        if check and problems:
            raise RuntimeError(f"committer {self.name} {'; '.join(problems)}: "
                               f"{self.log_path.read_text(errors='replace')[-2000:]}")

    def __enter__(self) -> "ProcessCommitter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop(check=exc_type is None)  # an error on the way out is the one to report


class ThreadCommitter:
    """The in-process baseline: the same ``Committer`` code served by a thread of this process.

    ``Committer.run`` installs signal handlers (main thread only), so the thread
    runs the same receive/dispatch/reap steps itself. The socket is created,
    bound, used and closed by that thread only.
    """

    def __init__(self, cleanup: Cleanup, tag: str):
        from omnishm.committer.config import CommitterConfig
        from omnishm.committer.server import Committer

        self.name = cleanup.cache_name(tag)
        self.runtime_dir = cleanup.runtime_dir
        self.endpoint = paths.ipc_endpoint(self.runtime_dir, self.name)
        generation = uuid.uuid4().hex[:8]
        self.lock = liveness.CacheLock.acquire(self.runtime_dir, self.name, generation)
        if self.lock is None:
            raise RuntimeError(f"cache {self.name} is already locked")
        # Held as the committer process holds it: a committer starting meanwhile, from any runtime
        # dir, sweeps dead caches of other names and must see this one as live.
        self.owner = liveness.GenerationOwner.acquire(self.name, generation, runtime_dir=self.runtime_dir)
        if self.owner is None:
            self.lock.release(remove=True)
            raise RuntimeError(f"generation {generation} of cache {self.name} is already owned")
        cfg = CommitterConfig(name=self.name, runtime_dir=self.runtime_dir, endpoint=self.endpoint, heartbeat_s=1.0,
                              heartbeat_timeout_s=120.0, exit_when_idle=False, prefault=True, log_level="WARNING")
        try:
            self.committer = Committer(cfg, generation)
        except BaseException:
            self.owner.release(unlink=True)
            self.lock.release(remove=True)
            raise
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"omnishm-bench-committer-{tag}", daemon=True)
        self.thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            self.stop(check=False)
            raise RuntimeError(f"in-process committer {self.name} did not start: {self._error}")

    def _run(self) -> None:
        c = self.committer
        try:
            c.bind()
            poller = zmq.Poller()
            poller.register(c.sock, zmq.POLLIN)
            self._ready.set()
            while not self._stop.is_set():
                ready = poller.poll(20)
                c.note_stall()  # as the process's loop does: an idle poll is not a stall
                if ready:
                    c.serve_pending()
                c.reap()
        except BaseException as exc:  # reported by start/stop; the thread must not die silently
            self._error = exc
            self._ready.set()
        finally:
            c.close()

    def stop(self, *, check: bool = True) -> None:
        """Stop the thread and release the cache. With ``check``, raises what ended the thread early: the
        figure must not pass on a baseline whose committer died (it would else show only as a timeout)."""
        self._stop.set()
        self.thread.join(STOP_TIMEOUT_S)
        if self.thread.is_alive():  # still serving: its cache stays owned (and mapped) until the process exits
            raise RuntimeError(f"in-process committer {self.name} did not stop within {STOP_TIMEOUT_S}s")
        if self.owner is not None:
            self.owner.release(unlink=True)
            self.owner = None
        if self.lock is not None:
            self.lock.release(remove=True)
            self.lock = None
        orphans.sweep(self.runtime_dir, self.name)
        if check and self._error is not None:
            raise RuntimeError(f"in-process committer {self.name} failed while serving: {self._error!r}") \
                from self._error

    def __enter__(self) -> "ThreadCommitter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop(check=exc_type is None)


# ---------------------------------------------------------------- a raw writer (protocol by hand)


class RawWriter:
    """One DEALER speaking the protocol synchronously: the writer side without the manager.

    Maps each key's claim table (writable: the writer owns it) and staging rows.
    """

    def __init__(self, endpoint: str, cache: str, layout: P.Layout, staging_rows: int):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.cache = cache
        self.num_slots = layout.num_blocks * layout.block_size
        self.rid = 0
        self.client_id = uuid.uuid4().hex
        welcome = self.call(P.Hello(rid=self.next_rid(), protocol=P.PROTOCOL_VERSION, client_id=self.client_id,
                                    pid=os.getpid(), uid=os.geteuid(), role=P.ROLE_WRITER, cache=cache, layout=layout,
                                    staging_rows=staging_rows))
        if not isinstance(welcome, P.Welcome):
            raise RuntimeError(f"writer refused: {welcome}")
        self.epoch = welcome.epoch
        self.keys: dict[str, dict[str, Any]] = {}
        self._segs: list[shm.Segment] = []

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def send(self, data: bytes) -> None:
        self.sock.send(data, copy=False)

    def recv(self, timeout_s: float = 30.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply from committer of {self.cache} within {timeout_s}s")
        return P.reply_decoder.decode(self.sock.recv())

    def call(self, msg, timeout_s: float = 30.0):
        self.send(P.encode(msg))
        return self.recv(timeout_s)

    def status(self) -> dict:
        reply = self.call(P.StatusRequest(rid=self.next_rid()))
        assert isinstance(reply, P.StatusReply), reply
        return reply.status

    def open_key(self, key: str, dtype: torch.dtype, width: int) -> dict[str, Any]:
        from omnishm.client.segments import dtype_name

        reply = self.call(P.OpenKey(rid=self.next_rid(), key=key, dtype=dtype_name(dtype), width=width))
        if not isinstance(reply, P.KeyOpened):
            raise RuntimeError(f"OpenKey {key} failed: {reply}")
        ks = reply.segments
        claim_seg = shm.Segment.attach(ks.claim)
        stage_seg = shm.Segment.attach(ks.staging)
        pool_seg = shm.Segment.attach(ks.pool, readonly=True)
        self._segs += [claim_seg, stage_seg, pool_seg]
        view = {"index": ks.index,
                "claim": claim_seg.tensor(torch.int64, (self.num_slots,)).numpy(),
                "staging": stage_seg.tensor(dtype, (ks.staging_rows, width)),
                "pool": pool_seg.tensor(dtype, (self.num_slots, width))}
        self.keys[key] = view
        return view

    def close(self) -> None:
        try:
            self.call(P.Goodbye(rid=self.next_rid()), timeout_s=5.0)
        except TimeoutError:
            pass
        self.sock.close()


def step_write(rid: int, step: int, keys: list[str], key_idx, tids, cvs, src_rows, counts, slots) -> P.StepWrite:
    def pack(v) -> bytes:
        return np.ascontiguousarray(v, dtype="<i8").tobytes()

    return P.StepWrite(rid=rid, step=step, keys=keys, key_idx=pack(key_idx), tids=pack(tids), cvs=pack(cvs),
                       src_rows=pack(src_rows), counts=pack(counts), slots=pack(slots))


# ---------------------------------------------------------------- references


def prefaulted(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        t.view(torch.uint8).fill_(1)  # touch every page now, so timed copies never fault
    return t


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Memcpy:
    """The physical reference: a single-thread copy of the same bytes between preallocated, pre-faulted
    buffers, timed three ways in every sample: glibc ``memcpy`` in one call, torch ``copy_``, and glibc
    ``memcpy`` in a child process started with the committer's non-temporal threshold (``nt_memcpy``).

    ``reference`` takes the fastest of them, by median. glibc switches to non-temporal stores once a
    copy outgrows its cache-size threshold, which torch's ``copy_`` never does: for 256 MiB on the build
    machines, 10.6-11.4 GB/s against 6.2-6.5 GB/s (2026-12-04; figure 2). For a few rows torch's call
    overhead makes it the slower too. The committer lowers that threshold for itself, so its copies of
    64 MiB beat a memcpy of this process's: the third way is that memcpy with the committer's threshold
    (review, 2026-12-05; before, figure 1 came out 1.42 against 0.795 with it). The figures before
    2026-12-04 used torch's ``copy_`` alone, those before 2026-12-05 22:35 the first two ways. ``close`` (or the
    end of a ``with``) ends the child.
    """

    def __init__(self, rows: int, width: int, dtype: torch.dtype):
        self.src = prefaulted((rows, width), dtype)
        self.dst = prefaulted((rows, width), dtype)
        self.row_bytes = width * self.src.element_size()
        self._flip = False
        self.nt = NonTemporalMemcpy.start(rows * self.row_bytes)

    def close(self) -> None:
        if self.nt is not None:
            self.nt.close()
            self.nt = None

    def __enter__(self) -> "Memcpy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def time(self, rows: int) -> tuple[float, float, float | None]:
        """Seconds to copy ``rows`` rows: (glibc ``memcpy``, torch ``copy_``, the committer's ``memcpy`` or
        None where it is the first), the first two in alternating order."""
        if not 0 <= rows <= len(self.src):
            raise ValueError(f"Memcpy holds {len(self.src)} rows, asked to copy {rows}")
        src, dst = self.src[:rows], self.dst[:rows]
        sp, dp, n = src.data_ptr(), dst.data_ptr(), rows * self.row_bytes
        self._flip = not self._flip
        if self._flip:
            libc = timed(lambda: ctypes.memmove(dp, sp, n))
            torch_t = timed(lambda: dst.copy_(src))
        else:
            torch_t = timed(lambda: dst.copy_(src))
            libc = timed(lambda: ctypes.memmove(dp, sp, n))
        return libc, torch_t, (self.nt.time(n) if self.nt is not None else None)

    @staticmethod
    def reference(samples: list[tuple[float, float, float | None]], nbytes: int
                  ) -> tuple[Stats, str, dict[str, float]]:
        """From ``time``'s samples: (GB/s of the fastest way, its name for the table, each way's median in
        GB/s)."""
        ways = {"memcpy_glibc_GBps": ("glibc", [s[0] for s in samples]),
                "memcpy_torch_copy_GBps": ("torch copy_", [s[1] for s in samples]),
                "memcpy_glibc_committer_threshold_GBps": ("glibc, committer's stores",
                                                          [s[2] for s in samples if s[2] is not None])}
        stats = {k: Stats.of(times).scaled(nbytes / 1e9) for k, (_, times) in ways.items() if times}
        extra = {k: st.median for k, st in stats.items()}
        best = max(stats, key=lambda k: stats[k].median)
        others = "; ".join(f"{ways[k][0]} {stats[k].median:.3g} GB/s" for k in stats if k != best)
        return stats[best], f"memcpy ({ways[best][0]}, 1 thread; {others})", extra


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Bytes from /proc/PID/smaps_rollup (Rss, Pss, Pss_Shmem, Shared_*, Private_*)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"
