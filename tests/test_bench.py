"""``omnishm bench --quick --json``: every figure present with its reference and ratio, exit 0, nothing left."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posix_ipc
import pytest
import torch

from conftest import REPO
from omnishm import liveness, shm
from omnishm.bench.common import RUN_DIR_PREFIX, RUN_LOCK, Cleanup, _hold_run_dir, sweep_dead_runs
from omnishm.liveness import OWNER, generation_owned, recorded_runtime_dir

EXPECTED_FIGURES = {"1", "2", "3", "4", "5", "6"}


def _of_this_bench(segment: str, tmp: Path) -> bool:
    """Whether ``segment`` is a bench cache's that the bench run with ``TMPDIR=tmp`` made, or nobody's now.

    A generation a live committer owns is this run's when its owner names a runtime dir under ``tmp`` (the
    bench's ``mkdtemp``): one that outlived the bench. Another session's live bench (the other xdist worker's
    test_bench_rows) names its own (review, stop 51: judging every owned generation as another's let this run's
    leaked committer pass)."""
    cache, generation, _ = shm.parse_segment_name(segment)
    if not cache.startswith("bench"):
        return False
    if not generation_owned(cache, generation):
        return True
    try:
        fd = posix_ipc.SharedMemory(shm.segment_name(cache, generation, OWNER), 0).fd
    except posix_ipc.ExistentialError:
        return True
    try:
        named = recorded_runtime_dir(fd)
    finally:
        os.close(fd)
    return named is None or named.is_relative_to(tmp)


def test_bench_quick_json_reports_every_figure_with_reference_and_ratio():
    before = set(shm.list_segments())
    with tempfile.TemporaryDirectory(prefix="omnishm-bt-") as tmp:  # short: a socket path has 107 bytes
        proc = subprocess.run([sys.executable, "-m", "omnishm", "bench", "--quick", "--json"], cwd=REPO,
                              capture_output=True, text=True, timeout=110, env={**os.environ, "TMPDIR": tmp})
        bench_segments = [s for s in set(shm.list_segments()) - before if _of_this_bench(s, Path(tmp))]
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    doc = json.loads(proc.stdout)
    assert doc["mode"] == "quick" and doc["goals_judged"] is False and doc["errors"] == {}
    assert doc["date"] and doc["machine"]["cores"]
    rows = doc["figures"]
    assert {r["figure"] for r in rows} == EXPECTED_FIGURES
    for r in rows:
        for side in ("value", "reference"):
            stats = r[side]
            # A median over repeated runs with its spread, for every figure (figure 5 too since 2026-12-05).
            assert stats["n"] >= 2 and stats["min"] <= stats["median"] <= stats["max"], r
            assert math.isfinite(stats["median"]) and stats["median"] > 0, r
        assert r["reference_name"] and r["unit"] and r["goal"], r
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["met"] in (True, False, None), r
    # Every goal of the issue has a row that states whether it is met.
    goals = {(r["figure"], r["goal"]) for r in rows if r["met"] is not None}
    assert {f for f, _ in goals} >= {"1", "2", "3", "4", "6"}
    # vllm-omni's own in-process cache (scripts/install.sh installs it) is an arm of figures 3 and 6.
    theirs = {r["figure"] for r in rows if "vllm-omni" in r["name"]}
    assert theirs == {"3", "6"}, "no vllm-omni rows: " + proc.stderr[-2000:]
    assert any("drop-in" in r["name"] for r in rows if r["figure"] == "6")  # omnishm behind vllm-omni's calls
    # REVIEW (2026-12-05, stop 42, bench): the memcpy reference of figures 1 and 2 ran with glibc's default
    # non-temporal threshold, the committer with its own, and figure 1 came out 1.42 against 0.78. The
    # committer's kind of memcpy is one of the reference's ways now (glibc on x86-64: these machines).
    from omnishm.committer import stores

    pieces = [r for r in rows if r["figure"] == "1" and "pieces of" in r["name"]]
    if stores._applies():
        for r in rows:
            if r["figure"] in ("1", "2") and r not in pieces:
                assert r["extra"]["memcpy_glibc_committer_threshold_GBps"] > 0, r
    # Figure 1's large step against glibc's copy of its own pieces: what of its gap is the pieces' (2026-12-07).
    assert len(pieces) == 1 and pieces[0]["extra"]["pieces_vs_one_memcpy"] > 0, pieces
    assert bench_segments == []


def test_bench_forward_threads_applies_to_the_engine_figures_only():
    """``--forward-threads 2`` runs figure 6's forward on two torch threads and says so in its rows and the
    document; figure 1 keeps one thread (its reference is a single-thread memcpy). A bad count exits 2."""
    proc = subprocess.run([sys.executable, "-m", "omnishm", "bench", "--quick", "--json", "--only", "1,6",
                           "--forward-threads", "2"], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    doc = json.loads(proc.stdout)
    assert doc["forward_threads"] == 2 and doc["errors"] == {}
    six = [r for r in doc["figures"] if r["figure"] == "6"]
    one = [r for r in doc["figures"] if r["figure"] == "1"]
    assert six and one
    assert all(r["extra"]["forward_threads"] == 2 for r in six)
    assert six[0]["name"].endswith("forward on 2 torch threads")
    assert not any("forward_threads" in r["extra"] or "threads" in r["name"] for r in one)
    bad = subprocess.run([sys.executable, "-m", "omnishm", "bench", "--forward-threads", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--forward-threads must be >= 1" in bad.stderr


def test_a_measured_committer_that_died_or_failed_is_reported_not_swept():
    """REVIEW (2026-12-05): the bench's committers hid their failures. A committer subprocess killed during
    a figure stopped without a word, and the sweep removed what it left before the leak check looked; the
    in-process baseline's thread kept the error that ended it and ``stop`` never raised it."""
    import os
    import signal

    import pytest
    import zmq

    from omnishm.bench.common import Cleanup, ProcessCommitter, ThreadCommitter

    cleanup = Cleanup()
    try:
        com = ProcessCommitter(cleanup, "crash")
        os.kill(com.pid, signal.SIGKILL)
        com.proc.wait()
        with pytest.raises(RuntimeError, match=rf"committer {com.name} exited -9; left \d+ segment\(s\)"):
            com.stop()
        assert shm.list_segments(com.name) == []  # swept all the same
        inproc = ThreadCommitter(cleanup, "thread")

        def fail() -> None:
            raise ValueError("a bug on the committer thread")

        inproc.committer.serve_pending = fail
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(inproc.endpoint)
        sock.send(b"wake it")
        inproc.thread.join(30)
        sock.close()
        with pytest.raises(RuntimeError, match="failed while serving: ValueError"):
            inproc.stop()
    finally:
        assert cleanup.close() == []


def test_a_bench_killed_mid_figure_takes_its_committer_and_segments_with_it():
    """Review (2026-12-06): a bench SIGKILLed during a figure left its committer subprocess serving, and
    holding its pool (about 0.5 GB for figure 2's normal run) in /dev/shm, for good: nothing stopped it,
    and ``omnishm cleanup`` leaves a live committer's segments alone. The kernel now sends it SIGTERM when
    the bench dies, and it stops as it does on any SIGTERM, unlinking its segments."""
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", (
        "import sys\n"
        "from omnishm.bench.common import Cleanup, ProcessCommitter\n"
        "com = ProcessCommitter(Cleanup(), 'killed')\n"
        "print(com.pid, com.name, com.runtime_dir, flush=True)\n"
        "sys.stdin.read()\n")], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid, ident, line = 0, None, []
    try:
        line = child.stdout.readline().split()
        assert len(line) == 3, f"the child said {line!r}; exit {child.wait(30)}"
        pid, name, runtime_dir = int(line[0]), line[1], line[2]
        ident = liveness.proc_identity(pid)
        assert ident and shm.list_segments(name)
        child.kill()
        child.wait(30)
        deadline = time.monotonic() + 30
        while liveness.proc_identity(pid) == ident and time.monotonic() < deadline:
            time.sleep(0.05)
        assert liveness.proc_identity(pid) != ident, "the committer outlived the bench that started it"
        pid = 0
        assert shm.list_segments(name) == []
        # Its socket and lock gone; the run's own lock file, which nobody holds now, and the log stay ...
        assert sorted(f.name for f in Path(runtime_dir).iterdir()) == [f"{name}.log", RUN_LOCK]
        # ... until the next run, which removes the dir (stop 52: killed runs' dirs stayed in /tmp for good).
        nxt = Cleanup()
        try:
            assert Path(runtime_dir) in nxt.swept and not Path(runtime_dir).exists()
        finally:
            nxt.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if pid and liveness.proc_identity(pid) == ident:  # the bug: stop it, sweep what it holds
            os.kill(pid, signal.SIGTERM)
        if len(line) == 3:
            deadline = time.monotonic() + 30
            while shm.list_segments(line[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
            shutil.rmtree(line[2], ignore_errors=True)


def test_a_run_sweeps_only_the_dirs_of_dead_runs_whose_committers_are_gone(tmp_path: Path):
    """``sweep_dead_runs`` (stop 52) removes a run's dir only when the run's lock file is there and unheld and no
    cache lock in the dir is held. A live run's dir (its lock held, here by another open of this process), a
    dir whose committer still holds its cache lock (told to stop by the kernel, still stopping), a dir of a
    bench from before the lock file, and a link named like a run's are all left as they are."""
    def run_dir(tag: str) -> Path:
        d = tmp_path / f"{RUN_DIR_PREFIX}{tag}"
        d.mkdir()
        (d / "c.log").write_text("log")
        return d

    dead = run_dir("dead")
    (dead / RUN_LOCK).touch()
    live = run_dir("live")
    held = _hold_run_dir(live)
    stopping = run_dir("stopping")
    (stopping / RUN_LOCK).touch()
    lock = liveness.CacheLock.acquire(stopping, "c", "g1")
    old = run_dir("old")
    kept = tmp_path / "kept"  # a dead run's dir in all but its name, which a link named like a run's points to
    kept.mkdir()
    (kept / RUN_LOCK).touch()
    link = tmp_path / f"{RUN_DIR_PREFIX}link"
    link.symlink_to(kept)
    try:
        assert sweep_dead_runs(tmp_path) == [dead]
        assert not dead.exists() and live.is_dir() and stopping.is_dir() and old.is_dir()
        assert link.is_symlink() and (kept / RUN_LOCK).exists()
        lock.release()
        lock = None
        assert sweep_dead_runs(tmp_path) == [stopping]  # its committer is gone now
    finally:
        os.close(held)
        if lock is not None:
            lock.release()
    assert sweep_dead_runs(tmp_path) == [live]  # once its run is gone


def test_a_run_starts_beside_a_dead_runs_dir_that_holds_a_lock_directory(tmp_path: Path, monkeypatch):
    """Review (stop 52): a ``*.lock`` that is a directory in a dead run's dir (another program's lock, in the
    mkdir-as-lock habit) made ``sweep_dead_runs`` raise ``IsADirectoryError`` out of ``Cleanup()``, which left
    the new run's own dir behind, its lock held, on every try. Such an entry is no committer's lock: the dead
    run's dir goes, and the new run starts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{RUN_DIR_PREFIX}dead"
    dead.mkdir()
    (dead / RUN_LOCK).touch()
    (dead / "x.lock").mkdir()
    c = Cleanup()
    try:
        assert c.swept == [dead] and c.runtime_dir.parent == tmp_path
    finally:
        c.close()
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_a_selection_of_no_figure():
    """REVIEW (2026-12-05): ``--only ,`` ran nothing and exited 0 with an empty report."""
    for only in (",", ""):
        proc = subprocess.run([sys.executable, "-m", "omnishm", "bench", "--quick", "--only", only], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "names no figure" in proc.stderr, (only, proc.returncode, proc.stderr)


def test_the_memcpy_child_ends_with_its_figure_and_says_when_it_died():
    """REVIEW (2026-12-05, stop 42): figure 1's reference ``memcpy`` runs in a child with the committer's
    non-temporal threshold (``bench/nt_memcpy.py``). A figure that failed before its ``finally`` left the
    child running, holding twice the reference's bytes, until the run ended; a child that died gave a
    BrokenPipeError, and its close raised another over the figure's own error."""
    from omnishm.bench.common import Memcpy
    from omnishm.committer import stores

    assert stores._applies(), "these machines run glibc on x86-64"
    with pytest.raises(ZeroDivisionError):
        with Memcpy(64, 1024, torch.bfloat16) as ref:
            child = ref.nt.proc
            assert ref.time(64)[2] > 0
            1 / 0  # the figure fails
    assert child.poll() == 0  # ended with the figure
    ref = Memcpy(64, 1024, torch.bfloat16)
    ref.nt.proc.kill()
    ref.nt.proc.wait()
    with pytest.raises(RuntimeError, match="the non-temporal memcpy child exited"):
        ref.time(64)
    ref.close()  # no second error


def test_the_memcpy_childs_scatter_puts_each_piece_in_its_place_and_refuses_what_it_cannot(monkeypatch):
    """Figure 1's pieces reference (2026-12-07): the child copies piece i to ``places[i]``, one ``memcpy`` each,
    and checks after the clock that each landed there, so a reference that copied the wrong bytes cannot pass
    for a fast one. Pieces past its capacity, repeated places or pieces too small to check end the child, and
    the parent says so. With ``always``, a child starts where the threshold adds nothing."""
    from omnishm.bench.nt_memcpy import NonTemporalMemcpy

    child = NonTemporalMemcpy.start(1 << 20)
    assert child is not None
    try:
        assert child.scatter(64 << 10, [15, 3, 0, 7]) > 0
        assert child.scatter(64 << 10, list(range(31, 15, -1))) > 0  # 16 pieces, the whole source, reversed
        assert child.scatter(4096, [1000]) > 0  # a place far past the source: the destination grows
        with pytest.raises(RuntimeError, match="the non-temporal memcpy child exited"):
            child.scatter(64 << 10, [0, 1, 0])
    finally:
        child.close()
    for bad in ([(1 << 20) + 1, [0]], [64 << 10, list(range(17))], [4, [0]]):
        child = NonTemporalMemcpy.start(1 << 20)
        assert child is not None
        try:
            with pytest.raises(RuntimeError, match="the non-temporal memcpy child exited"):
                child.scatter(*bad)
        finally:
            child.close()
    monkeypatch.setenv("OMNISHM_NONTEMPORAL_THRESHOLD", "0")
    assert NonTemporalMemcpy.start(1 << 20) is None
    child = NonTemporalMemcpy.start(1 << 20, always=True)
    assert child is not None
    try:
        assert child.scatter(1024, [2, 0]) > 0 and child.time(1 << 20) > 0
    finally:
        child.close()


@pytest.mark.parametrize("quick", [False, True], ids=["normal", "quick"])
def test_the_quick_geometries_take_the_paths_the_normal_run_times(quick, monkeypatch):
    """Review (2026-12-06): CI's quick run must keep the code behind the headline figures from rotting, so its
    sizes must reach the same paths: figure 1's blocks long enough for one copy per run (not the scatter),
    figure 2's result from the recycled result pool, figure 3's hit one ``memmove`` per run. The quick sizes
    were below each threshold."""
    import omnishm.bench as bench
    from omnishm.bench import manager_figures as mf, write_figures as wf
    from omnishm.client.result_pool import MIN_POOLED_BYTES
    from omnishm.client.rowcopy import RUN_COPY_MIN_BYTES
    from omnishm.committer.apply import RUN_BYTES

    got: dict = {}
    monkeypatch.setattr(wf, "figure_write", lambda c, s, rng: got.setdefault("1", s) and [])
    monkeypatch.setattr(mf, "figure_read", lambda c, s: got.setdefault("2", s) and [])
    monkeypatch.setattr(mf, "figure_engine", lambda c, s, d: got.setdefault("3", s) and [])
    _, errors = bench.run(quick, {"1", "2", "3"}, 0)
    assert not errors, errors
    bf16 = 2
    min_run = max(2, -(-RUN_BYTES // (got["1"].width * bf16)))  # KeyState.min_run (committer/pool.py)
    assert wf.BS >= min_run, f"figure 1: blocks of {wf.BS} rows, runs of {min_run} rows: the scatter path"
    assert got["2"].hit_tokens * got["2"].width * bf16 >= MIN_POOLED_BYTES, "figure 2: the hit is not pooled"
    assert got["3"].hit_tokens * got["3"].width * bf16 >= RUN_COPY_MIN_BYTES, "figure 3: the hit is index_select"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_bench_loads_torch_exits_130_with_one_line(sig):
    """REVIEW (2026-12-07, stop 54): ``omnishm bench`` loaded torch after the start-up catcher was gone and had no
    handler of its own: Ctrl-C ended in a traceback (or was lost in the import, and the run went on to exit 0),
    SIGTERM killed it with 143 and no message. It now exits 130 with one line, its committers stopped."""
    from helpers import maps_library, signal_when

    # Signalled the moment torch starts to load.
    code, err = signal_when([sys.executable, "-m", "omnishm", "bench", "--quick", "--only", "5"],
                            lambda pid: maps_library(pid, "libtorch"), sig, 120, cwd=REPO)
    assert code == 130, err
    assert "Traceback" not in err and f"omnishm bench: interrupted ({sig.name})" in err, err


def test_figure_4s_echo_server_dies_with_a_killed_bench():
    """REVIEW (2026-12-07, stop 54): figure 4's echo server had no death signal, unlike the bench's committers: a
    bench SIGKILLed (or SIGTERMed) during figure 4 left it waiting in ``recv`` for good, holding the caller's
    stderr pipe open, so a caller reading that pipe never saw its end."""
    from helpers import children_running

    proc = subprocess.Popen([sys.executable, "-m", "omnishm", "bench", "--quick", "--only", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    echo: list[int] = []
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not echo:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            echo = children_running(proc.pid, "omnishm.bench.echo")
        children = children_running(proc.pid, "")  # the echo server and figure 4's committer
        proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.read()  # returns once every holder of the pipe (the echo server too) is gone
        deadline = time.monotonic() + 30
        while any(liveness.proc_identity(pid) is not None for pid in children):
            assert time.monotonic() < deadline, f"{children} outlived the killed bench"
            time.sleep(0.05)
    finally:
        for pid in children or echo:
            if liveness.proc_identity(pid) is not None:
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    Cleanup().close()  # the next run: it removes the dir the killed one left


def test_a_terminals_ctrl_c_to_the_bench_prints_one_line_and_no_workers_traceback():
    """REVIEW (2026-12-07, stop 54): a terminal's Ctrl-C goes to the whole process group. Figure 5's workers (and
    figure 1's ``memcpy`` child) write to the bench's stderr, and each printed a KeyboardInterrupt traceback
    beside the bench's one line. They ignore SIGINT now; the bench stops them itself."""
    from helpers import children_running, maps_library

    proc = subprocess.Popen([sys.executable, "-m", "omnishm", "bench", "--quick", "--only", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)  # its own process group, as a terminal's job
    try:
        deadline = time.monotonic() + 120
        # A worker running Python code (loading torch): with SIGINT not ignored, it raises there.
        while not any(maps_library(w, "libtorch") for w in children_running(proc.pid, "omnishm.bench.memory")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "omnishm bench: interrupted (SIGINT)" in err, err
