"""``omnishm demo`` and ``omnishm/cpus.py`` at their edges: the verdict, the rank checker, the rank group.

Each test kills a mutant that survived the rest of the suite (mutation review, 2026-12-06, 25 mutants, 13
survivors): a demo exiting 0 with a reader's wrong rows, wrong rows a rank did not count, a rank left running
at the deadline, a stop without SIGTERM, a cleanup cut by a second signal, a runtime file not reported, the
duration bound, the memory policy, and a lockstep rank failing mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnishm import shm

from conftest import RUNTIME_DIR, unique_cache_name

HERE = Path(__file__).resolve().parent


def test_a_demo_whose_reader_serves_wrong_rows_exits_1_and_reports_them():
    """The demo's promise: it exits non-zero on any mismatch, whichever rank saw it, and still leaves nothing
    behind. A real ``omnishm demo`` (two spawned ranks, their autostarted committer) whose reader rank flips
    one element of every hidden row it is served: the reader's mismatches must reach the summary (not only
    the writer's) and the exit code must be 1 with FAILED said; the cache's segments and files are gone."""
    name = unique_cache_name("bad")
    proc = subprocess.run([sys.executable, str(HERE / "demo_bad_reader.py"), "demo", "--name", name, "--tp", "2",
                           "--steps", "20", "--num-blocks", "64", "--block-size", "8", "--max-batched-tokens", "64",
                           "--hidden-size", "32", "--mm-width", "8", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    summary = json.loads(proc.stdout)
    assert summary["mismatches"] > 0 and not summary["failures"] and not summary["leaked_segments"], summary
    assert "omnishm demo: FAILED" in proc.stderr
    assert not shm.list_segments(name) and not list(RUNTIME_DIR.glob(f"{name}.*"))


@pytest.mark.parametrize("kind", ["element", "short_row", "mm_code"])
def test_the_rank_counts_every_wrong_row_it_is_served_at_every_step(committer, monkeypatch, kind):
    """A rank checks every row it materializes, of every step (the last ``lag`` ones too), against ground truth:
    the hidden rows and each multimodal key. One rank in-process, lag 2; ``materialize`` corrupts one row per
    served request: one element of a hidden row, a hidden tensor one row short, or a row of the second
    (immediate) multimodal key. A wrong element is one mismatch, a short tensor counts all the request's rows
    (shapes differ), and every step is materialized."""
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.demo.rank import IMMEDIATE_MM_KEY, RankOptions, run_rank

    real = OmniPrefixCacheManager.materialize
    calls, corrupted = [], []

    def corrupt(self, step_id, req_ids, **kw):
        out = real(self, step_id, req_ids, **kw)
        calls.append(step_id)
        for r in req_ids:
            t = out.hidden_states[r] if kind != "mm_code" else out.mm_outputs[r][IMMEDIATE_MM_KEY]
            if t.shape[0] == 0:
                continue
            rows = t.shape[0]  # a short tensor: every row of the request counts as wrong (shapes differ)
            if kind == "short_row":
                t = t[:-1].clone()
            else:
                t = t.clone()
                t[0, 0] += 1
            if kind == "mm_code":
                out.mm_outputs[r][IMMEDIATE_MM_KEY] = t
            else:
                out.hidden_states[r] = t
            corrupted.append(rows if kind == "short_row" else 1)
        return out

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", corrupt)
    opts = RankOptions(cache=committer.name, tp=1, steps=30, lag=2, autostart=False, num_blocks=64, width=32,
                       mm_width=8, preempt_rate=0.2)
    res = run_rank(0, opts)
    assert res.failure is None and res.errors == {}, res
    assert len(calls) == opts.steps, (len(calls), opts.steps)
    assert corrupted and res.mismatches == sum(corrupted), (res.mismatches, sum(corrupted))


def test_a_rank_still_running_at_the_deadline_is_killed_and_reported_timed_out(committer_factory):
    """``RankGroup.wait``'s contract: a rank still running at its deadline writes its stacks, is killed (no rank
    outlives the demo's --timeout-s holding the cache) and its result says "timed out" (so the demo fails).
    Two ranks of an endless run, both past their start (each reported progress), then a wait of 0.1 s."""
    group = _running_group(committer_factory)
    try:
        results = group.wait(0.1)
        assert [r.failure for r in results] == ["timed out", "timed out"], results
        assert not any(p.is_alive() for p in group.procs)
    finally:
        group.stop()


def test_a_second_signal_does_not_cut_the_cleanup_the_first_started():
    """``InterruptOnce``: the first SIGINT or SIGTERM raises KeyboardInterrupt, a later one is ignored, so the
    demo's bounded cleanup and its report run to their end (README: exit 130 with the report)."""
    from omnishm.committer.early_stop import InterruptOnce

    io = InterruptOnce()
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        try:  # during the cleanup: ignored
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            pytest.fail("a second signal interrupted the cleanup the first one started")
        assert io.fired == signal.SIGTERM
    finally:
        io.restore()


def test_a_runtime_file_left_by_the_cache_is_reported_as_leaked(tmp_path):
    """The demo checks it leaves /dev/shm and the runtime dir as found: a file of its cache left in the runtime
    dir (a committer's log, lock or socket) is reported among the leaks, so the demo fails."""
    from omnishm.demo.main import _wait_for_cleanup
    from omnishm.demo.rank import RankOptions

    name = unique_cache_name("left")
    left = tmp_path / f"{name}.log"
    left.write_text("x")
    assert _wait_for_cleanup(RankOptions(cache=name, runtime_dir=str(tmp_path)), timeout_s=1.0) == [str(left)]


_DROP_POLICY = """
import ctypes, platform, sys
from omnishm import cpus
libc = ctypes.CDLL(None, use_errno=True)
GET = {"x86_64": 239, "aarch64": 236}[platform.machine()]
mask = ctypes.c_ulong(1)  # node 0
SET = ctypes.c_long(cpus.SET_MEMPOLICY[platform.machine()])
assert libc.syscall(SET, 1, ctypes.byref(mask), ctypes.c_ulong(64)) == 0
mode = ctypes.c_int(-1)
dropped = cpus.default_memory_policy()
assert libc.syscall(ctypes.c_long(GET), ctypes.byref(mode), None, ctypes.c_ulong(0), None, ctypes.c_ulong(0)) == 0
print(dropped, mode.value)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="set_mempolicy numbers known here for x86_64 and aarch64")
def test_default_memory_policy_drops_an_inherited_policy_and_says_so():
    """An autostarted committer drops the NUMA policy it inherited from its rank (``MPOL_PREFERRED`` to node 0
    here, as a rank's binding) before it touches the pool; ``default_memory_policy`` returns True when it did,
    which the thread's policy (read back with ``get_mempolicy``) confirms: ``MPOL_DEFAULT``."""
    probe = subprocess.run([sys.executable, "-c", _DROP_POLICY], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 and "assert libc.syscall" in probe.stderr:
        pytest.skip(f"the kernel refuses set_mempolicy here: {probe.stderr[-200:]}")
    assert probe.returncode == 0 and probe.stdout.split() == ["True", "0"], probe.stdout + probe.stderr


def test_a_duration_exactly_the_start_margin_under_the_timeout_is_accepted(monkeypatch):
    """``--duration-s`` may be as long as ``--timeout-s`` less ``START_MARGIN_S`` (the message says "at least 30s
    under"): that boundary runs the demo, it is not refused with exit 2. The rank group is replaced by one that
    stops at once, so the test sees only that the checks let the run start."""
    from omnishm import cli
    from omnishm.demo import main as demo

    class Started(Exception):
        pass

    def group(opts):
        raise Started(opts.duration_s)

    monkeypatch.setattr(demo, "RankGroup", group)
    with pytest.raises(Started):
        cli.main(["demo", "--name", unique_cache_name("edge"), "--duration-s", str(60.0 - demo.START_MARGIN_S),
                  "--timeout-s", "60"])


def _running_group(committer_factory, tp: int = 2):
    """A started rank group of an endless run, once every rank reported progress (all past their start)."""
    from omnishm.demo.launch import RankGroup
    from omnishm.demo.rank import RankOptions

    opts = RankOptions(cache=committer_factory().name, tp=tp, steps=10**9, lockstep=False, lag=0, autostart=False,
                       num_blocks=48, block_size=16, max_batched_tokens=96, width=32, mm_width=4,
                       commit_timeout_s=10.0)
    group = RankGroup(opts).start()
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 90
    while len(seen) < tp:
        assert time.monotonic() < deadline and all(p.exitcode is None for p in group.procs), seen
        group._pump(lambda r, steps, *_: seen.__setitem__(r, steps))
        time.sleep(0.05)
    return group


def test_stopping_a_rank_group_interrupts_each_rank_so_it_shuts_its_client_down(committer_factory):
    """``RankGroup.stop`` (the demo's Ctrl-C or SIGTERM): every running rank is interrupted with SIGTERM, shuts
    its manager down (the Goodbye) and exits 128 + SIGTERM, at once; SIGKILL is only for a rank that does not
    stop within STOP_TIMEOUT_S (a killed rank says no Goodbye, and its committer waits out a heartbeat)."""
    from omnishm.demo.launch import STOP_TIMEOUT_S

    group = _running_group(committer_factory)
    try:
        t0 = time.monotonic()
        group.stop()
        elapsed = time.monotonic() - t0
        assert [p.exitcode for p in group.procs] == [128 + signal.SIGTERM] * 2, [p.exitcode for p in group.procs]
        assert elapsed < STOP_TIMEOUT_S, elapsed
    finally:
        group.stop()


def test_a_lockstep_rank_that_fails_mid_run_stops_its_peers_at_the_next_meeting_at_once(committer, monkeypatch):
    """In lockstep the ranks meet before every step (a TP engine's collectives). A rank that fails after the
    start (here the reader's materialize raises a plain error at its 10th step) breaks the meeting before
    its manager shuts down, so its peer fails at once with BrokenBarrierError, as a TP engine whose rank
    died, instead of waiting out the meeting's timeout (commit_timeout_s, 60 s here). Two ranks as threads."""
    import threading

    from omnishm.client import OmniPrefixCacheManager
    from omnishm.demo.rank import RankOptions, run_rank

    real = OmniPrefixCacheManager.materialize
    reader_calls = []

    def fails_at_ten(self, *a, **kw):
        if not self.is_writer:
            reader_calls.append(1)
            if len(reader_calls) == 10:
                raise RuntimeError("reader broke")
        return real(self, *a, **kw)

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", fails_at_ten)
    opts = RankOptions(cache=committer.name, tp=2, steps=10**6, lag=0, lockstep=True, autostart=False,
                       num_blocks=64, width=32, mm_width=8, commit_timeout_s=60.0)
    barrier = threading.Barrier(2)
    results = {}
    reader = threading.Thread(target=lambda: results.__setitem__(1, run_rank(1, opts, barrier=barrier)))
    t0 = time.monotonic()
    reader.start()
    results[0] = run_rank(0, opts, barrier=barrier)
    reader.join()
    elapsed = time.monotonic() - t0
    assert results[1].failure == "RuntimeError: reader broke", results[1]
    assert results[0].failure == "BrokenBarrierError: ", results[0]
    assert elapsed < 30, elapsed


# Mutation review (stop 54): ``InterruptOnce.raise_pending`` must count the remembered signal as the first one,
# so a signal during the cleanup it started (the demo's stop of its ranks and report, the bench's stop of its
# committers) is ignored, as one after a signal caught by the handler itself is. Without ``fired`` set there, a
# second Ctrl-C cut that cleanup short (a traceback, no report).
@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_a_remembered_one_does_not_cut_the_cleanup_short(first):
    from omnishm.committer.early_stop import EarlyStop, InterruptOnce

    early = EarlyStop((signal.SIGTERM, signal.SIGINT))
    try:
        signal.raise_signal(first)  # while "the command imports torch": only remembered
        assert early.reason == first.name
        io = InterruptOnce()
        try:
            with pytest.raises(KeyboardInterrupt):
                io.raise_pending(early)
            assert io.fired == first
            try:  # during the cleanup: ignored
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
            except KeyboardInterrupt:
                pytest.fail("a second signal interrupted the cleanup the remembered one started")
        finally:
            io.restore()
    finally:
        early.restore()
