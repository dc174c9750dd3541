"""The bench's arithmetic and verdicts (``omnishm/bench``): the numbers a user picks a cache by.

From the mutation review of stop 51, which found that nothing checked a ratio, its reference, a median or a goal's
verdict (``tests/test_bench.py`` checks that every figure is there and ordered).

Each figure test runs the real figure (real committer processes, real segments) at a tiny geometry and
replaces only the *durations* it reads (the committer's apply seconds, the reference's copy time, the
engine arms' step time, the throughput loop's seconds) with known values, so the ratio, the reference it
is taken against, the spread and the goal's verdict can be asserted exactly.
"""

from __future__ import annotations

import argparse
import math
import threading
import types

import numpy as np
import pytest
import torch

import omnishm.bench as bench
from omnishm import shm
from omnishm.bench import common
from omnishm.bench import manager_figures as mf
from omnishm.bench import memory, overhead
from omnishm.bench import write_figures as wf
from omnishm.bench.common import Cleanup, Memcpy, ProcessCommitter, Stats
from omnishm.client import OmniPrefixCacheManager


@pytest.fixture
def cleanup():
    c = Cleanup()
    yield c
    assert c.close() == []


def _fixed_memcpy(monkeypatch, seconds: float) -> list[int]:
    """Every reference sample takes ``seconds`` (all three ways); returns the rows each sample was asked to copy."""
    asked: list[int] = []
    real = Memcpy.time

    def time(self, rows):
        real(self, rows)  # the real copy still runs (and validates ``rows``)
        asked.append(rows)
        return seconds, seconds * 2, seconds * 4
    monkeypatch.setattr(Memcpy, "time", time)
    return asked


def _spoil_materialize(monkeypatch, spoil) -> None:
    """Every ``OmniPrefixCacheManager.materialize`` result goes through ``spoil(manager, result)`` before it is
    returned: the bug a figure's row check must catch."""
    real = OmniPrefixCacheManager.materialize

    def materialize(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        spoil(self, result)
        return result
    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)


# ---------------------------------------------------------------- statistics


def test_stats_are_a_median_with_quartiles_and_rates_swap_min_and_max():
    """A figure is the median of its samples, not their mean, with min/quartiles/max as its spread; turning
    times into rates (``scaled``) inverts every statistic and swaps min with max and q1 with q3."""
    s = Stats.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median, s.min, s.max, s.q1, s.q3, s.n) == (3.0, 1.0, 100.0, 2.0, 4.0, 5)
    r = s.scaled(12.0)
    assert (r.median, r.min, r.max, r.q1, r.q3, r.n) == (4.0, 0.12, 12.0, 3.0, 6.0, 5)
    assert r.min <= r.q1 <= r.median <= r.q3 <= r.max


def test_memcpy_reference_is_the_fastest_way_by_median_and_reports_each():
    """``Memcpy.reference`` sets a figure against the fastest of its three ways of copying (here the
    committer-threshold memcpy, the third), names it, and reports every way's median GB/s in ``extra``."""
    samples = [(2.0, 4.0, 1.0), (2.0, 4.0, 1.0), (2.0, 4.0, 1.0)]
    st, name, extra = Memcpy.reference(samples, 8 * 10**9)
    assert st.median == 8.0 and "committer's stores" in name
    assert extra == {"memcpy_glibc_GBps": 4.0, "memcpy_torch_copy_GBps": 2.0,
                     "memcpy_glibc_committer_threshold_GBps": 8.0}
    st, name, _ = Memcpy.reference([(1.0, 4.0, None), (1.0, 4.0, None)], 10**9)
    assert st.median == 1.0 and name.startswith("memcpy (glibc,")


def test_latency_percentile_rows_take_their_own_percentile():
    """Figure 4's p50 and p99 rows each report their own percentile of all round trips, its spread over the
    blocks' same percentile: a p99 row that reported the p50 would hide the tail the goal (< 1000 us) judges."""
    blocks = [np.array([1.0] * 98 + [50.0, 50.0]) * 1e-6, np.array([2.0] * 98 + [60.0, 60.0]) * 1e-6]
    p99 = wf._percentile_stats(blocks, 99)
    p50 = wf._percentile_stats(blocks, 50)
    assert p99.median > 40 and p50.median < 3
    assert p99.min <= p99.median <= p99.max and p99.n == 2
    assert p99.max == pytest.approx(60.0)


# ---------------------------------------------------------------- figure 1


@pytest.mark.parametrize("apply_s, met", [(1.0 / 0.75, False), (1.0 / 0.85, True)], ids=["ratio-0.75", "ratio-0.85"])
def test_figure_1_ratio_is_committer_over_memcpy_of_the_same_bytes_judged_at_0_8(cleanup, monkeypatch, apply_s, met):
    """Figure 1's headline row is the committer's apply bandwidth divided by the memcpy reference's, both of
    the step's bytes (the reference copies the step's rows, every rep), with its spread over ``reps`` samples,
    and its goal is met exactly when that ratio is >= 0.8."""
    real = wf._apply_and_time

    def apply_and_time(w, msg):
        _, rt, reply = real(w, msg)
        return apply_s, rt, reply
    monkeypatch.setattr(wf, "_apply_and_time", apply_and_time)
    asked = _fixed_memcpy(monkeypatch, 1.0)
    size = wf.WriteSize(256, 64, 3, (4,), 2)
    rows = wf.figure_write(cleanup, size, np.random.default_rng(0))
    head = rows[0]
    gb = 256 * 64 * 2 / 1e9
    assert head.value.median == pytest.approx(gb / apply_s) and head.value.n == 3
    assert head.reference.median == pytest.approx(gb) and head.reference.n == 3  # fastest way: 1 s
    assert head.ratio == pytest.approx(1 / apply_s)
    assert head.met is met
    assert asked == [256] * 3 + [4] * 2  # the reference copies each figure's own bytes
    # The same step against glibc's copy of its own pieces (a real child, timed): the same value, judged by no goal.
    pieces = rows[1]
    assert "pieces of" in pieces.name and pieces.value == head.value and pieces.reference.n == 3
    assert pieces.ratio == pytest.approx(head.value.median / pieces.reference.median) and pieces.met is None
    assert rows[2].ratio == pytest.approx(1 / apply_s) and rows[2].met is None


# ---------------------------------------------------------------- figure 2


def test_figure_2_ratio_is_materialize_over_memcpy_of_the_hit_judged_at_0_7(cleanup, monkeypatch):
    """Figure 2's headline row is the materialize bandwidth over the memcpy reference of the same hit's
    bytes (each rep copies the hit's rows), with one sample per rep, and its goal is met exactly when the
    ratio is >= 0.7: a ratio of 0.6 is not met."""
    clock = {"t": 0.0}

    def perf_counter():  # every materialize takes 1 s on this clock
        clock["t"] += 1.0
        return clock["t"]
    monkeypatch.setattr(mf, "time", types.SimpleNamespace(perf_counter=perf_counter))
    asked = _fixed_memcpy(monkeypatch, 0.6)
    size = mf.ReadSize(64, 64, 64, 2)
    rows = mf.figure_read(cleanup, size)
    head = rows[0]
    gb = 64 * 64 * 2 / 1e9
    assert head.value.median == pytest.approx(gb) and head.value.n == 2
    assert head.reference.median == pytest.approx(gb / 0.6) and head.reference.n == 2
    assert head.ratio == pytest.approx(0.6)
    assert head.met is False
    assert asked == [64, 64]


# ---------------------------------------------------------------- figure 3


def test_figure_3_ratio_is_process_arm_over_thread_arm_judged_at_0_5(cleanup, monkeypatch):
    """Figure 3's headline row is the committer-process arm's step time over the in-process (thread) arm's,
    median over ``steps`` measured steps (warm-up steps left out), judged met when <= 0.5; its eager
    variant is the same arm over the eager in-process arm."""
    real = mf._EngineArm.step

    def step(self):
        real(self)
        if isinstance(self.com, ProcessCommitter):
            return 1.0
        return 1.5 if self.m.eager else 3.0
    monkeypatch.setattr(mf._EngineArm, "step", step)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    size = mf.EngineSize(32, 32, 2, 64, 3, 0.05)
    rows = mf.figure_engine(cleanup, size)
    head, eager = rows[0], rows[1]
    assert head.value.median == 1000.0 and head.reference.median == 3000.0
    assert head.value.n == 3 and head.reference.n == 3
    assert head.ratio == pytest.approx(1 / 3) and head.met is True
    assert eager.reference.median == 1500.0 and eager.ratio == pytest.approx(2 / 3) and eager.met is None


# ---------------------------------------------------------------- figure 4


def test_figure_4_descriptor_goal_judges_the_committer_not_the_echo(cleanup, monkeypatch):
    """Figure 4's descriptors/s goal (>= 20000/s) is judged on the committer's rate, its ratio the committer's
    rate over the echo reference's: a committer at 2000/s fails it however fast the echo runs."""
    real = wf._throughput

    def throughput(send, recv, count, window):
        real(send, recv, count, window)
        committer = send.claims is not None  # the committer's descriptors are claimed before their send
        return count / 2000.0 if committer else count / 2e6
    monkeypatch.setattr(wf, "_throughput", throughput)
    rows = wf.figure_control(cleanup, wf.ControlSize(200, 2, 100), np.random.default_rng(0), 64)
    desc = rows[0]
    assert desc.value.median == pytest.approx(2000.0) and desc.reference.median == pytest.approx(2e6)
    assert desc.ratio == pytest.approx(1e-3) and desc.met is False
    assert rows[1].met is False  # 128000 tasks/s < 1e6


# ---------------------------------------------------------------- figure 5


@pytest.mark.parametrize("ours, met", [(6.0, False), (5.25, True)], ids=["ratio-0.6", "ratio-0.525"])
def test_figure_5_goal_is_one_over_tp_plus_5_percent(cleanup, monkeypatch, ours, met):
    """Figure 5's TP=2 row is omnishm's bytes over the private mirrors', met exactly when <= 1/2 + 5%: 0.6
    is not met, 0.525 is; the value and reference are each sample's own (MiB)."""
    monkeypatch.setattr(memory, "_sample", lambda ranks, com, size, pool_bytes, c_base: (ours * 2**20, 10 * 2**20))
    rows = memory.figure_memory(cleanup, memory.MemorySize(4, 64, (2,), repeats=2))
    (r,) = rows
    assert r.value.median == ours and r.reference.median == 10.0 and r.value.n == 2
    assert r.ratio == pytest.approx(ours / 10) and r.met is met


# ---------------------------------------------------------------- the run and its exit status


def test_a_failed_figure_is_an_error_and_exit_1_and_its_committer_is_stopped(monkeypatch, capsys):
    """A figure that raises is reported in ``errors`` (the other figures still run) and ``omnishm bench``
    exits 1; the committer it left serving is stopped and its segments removed by the run's cleanup."""
    started: list[ProcessCommitter] = []

    def failing(c, s, rng):
        started.append(ProcessCommitter(c, "failing"))
        raise ValueError("figure broke")
    monkeypatch.setattr(wf, "figure_write", failing)
    monkeypatch.setattr(mf, "figure_read", lambda c, s: [])
    rows, errors = bench.run(True, {"1", "2"}, 0)
    assert errors["1"] == "ValueError: figure broke" and set(errors) <= {"1", "cleanup"} and rows == []
    (com,) = started
    assert com.proc.poll() is not None, "the failed figure's committer still runs after the bench"
    assert shm.list_segments(com.name) == []
    monkeypatch.setattr(bench, "run", lambda *a, **k: ([], {"1": "ValueError: figure broke"}))
    args = argparse.Namespace(only="1", quick=True, json=True, seed=0, device="cpu", forward_threads=1)
    assert bench.cli_main(args) == 1
    assert '"1": "ValueError: figure broke"' in capsys.readouterr().out


# ---------------------------------------------------------------- figure 6


def test_figure_6_ratio_is_cache_on_over_cache_off(cleanup, monkeypatch):
    """Figure 6's rows are each arm's step time over the cache-off loop's (its reference), medians over the
    same number of measured steps, and the goal (< 1.02) is judged on that ratio."""
    monkeypatch.setattr(overhead, "vllm_omni_version", lambda: None)
    rows = overhead.figure_overhead(cleanup, overhead.OverheadSize(4, 32, 64, 0.05))
    for r in rows:
        assert r.ratio == pytest.approx(r.value.median / r.reference.median), r
        assert r.value.n == r.reference.n >= 4
    assert rows[0].met is (rows[0].ratio < 1.02)
    assert math.isfinite(rows[0].extra["paired_ratio"])


def test_figure_6_refuses_a_hit_in_its_zero_hit_run(cleanup, monkeypatch):
    """Figure 6 measures the cost of a cache that never hits; a manager that reports hit tokens there (its
    lookups matched what they must not) fails the figure instead of printing an overhead that includes
    served hits."""
    def spoil(manager, result):
        for req in list(result.num_hit_tokens)[:1]:
            result.num_hit_tokens[req] += 1  # the bug: a hit reported in a run with no shared prefix
    _spoil_materialize(monkeypatch, spoil)
    monkeypatch.setattr(overhead, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match=r"figure 6: \d+ hit tokens in a 0%-hit run"):
        overhead.figure_overhead(cleanup, overhead.OverheadSize(4, 32, 64, 0.05))


def test_figure_6_refuses_rows_unlike_the_cache_off_runners(cleanup, monkeypatch):
    """Figure 6 compares what every arm hands the next stage, step by step, with omnishm's rows: a
    materialize that served a wrong row (here one element changed) fails the figure when the cache-off
    arm hands the true rows."""
    def spoil(manager, result):
        for rows in list(result.hidden_states.values())[:1]:
            rows[0, 0] += 1.0
    _spoil_materialize(monkeypatch, spoil)
    monkeypatch.setattr(overhead, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match=r"figure 6, step \d+: the cache-off runner"):
        overhead.figure_overhead(cleanup, overhead.OverheadSize(4, 32, 64, 0.05))


def test_figure_3_refuses_a_wrong_row_of_its_reference_arm(cleanup, monkeypatch):
    """Figure 3's reference (the in-process arms) must serve the rows omnishm serves: an eager in-process
    arm that served one wrong row would be timed as the reference of a passing figure."""
    def spoil(manager, result):
        if manager.eager:
            for rows in list(result.hidden_states.values())[:1]:
                rows[0].view(torch.int16)[0] ^= 1
    _spoil_materialize(monkeypatch, spoil)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match=r"figure 3, step 0: the eager in-process design's"):
        mf.figure_engine(cleanup, mf.EngineSize(32, 32, 2, 64, 2, 0.05))


def test_figure_3_closes_the_in_process_arms_when_the_first_arms_close_fails(monkeypatch):
    """REVIEW (stop 51): figure 3 closes every arm it started, even when closing one of them fails.

    Contract (issue: no committer left behind after a bench error): ``figure_engine``'s ``finally`` closes its
    arms one after the other; when the first arm's close raises (its committer process did not stop cleanly,
    ``ProcessCommitter.stop`` raises by design), the in-process arms after it are never closed: their
    committer threads keep serving (polling every 20 ms) for the rest of the bench and their managers' links
    stay open, while ``Cleanup.close`` later unlinks the segments those threads still map."""
    real_stop = ProcessCommitter.stop

    def stop(self, *, check=True):
        real_stop(self, check=False)
        raise RuntimeError("committer bench-engine exited -9")  # what stop() says for a committer that died
    monkeypatch.setattr(ProcessCommitter, "stop", stop)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    cleanup = Cleanup()
    try:
        with pytest.raises(RuntimeError, match="exited -9"):
            mf.figure_engine(cleanup, mf.EngineSize(32, 32, 2, 64, 1, 0.05))
        alive = [t.name for t in threading.enumerate() if t.name.startswith("omnishm-bench-committer-")]
        assert alive == [], f"in-process committers still serving after figure 3 failed: {alive}"
    finally:
        cleanup.close()


def test_close_all_closes_every_one_and_a_ctrl_c_wins_over_an_error():
    """REVIEW (stop 51): ``close_all`` closes every arm, then raises the first error; a ``KeyboardInterrupt`` in a
    later close wins over an earlier ordinary error, which ``bench.run`` would record as the figure's error and go
    on to the next figure with, losing the user's Ctrl-C."""

    class Arm:
        def __init__(self, exc: BaseException | None = None) -> None:
            self.exc, self.closed = exc, 0

        def close(self) -> None:
            self.closed += 1
            if self.exc is not None:
                raise self.exc

    arms = [Arm(RuntimeError("exited -9")), Arm(KeyboardInterrupt()), Arm(), Arm(RuntimeError("second"))]
    with pytest.raises(KeyboardInterrupt):
        common.close_all(arms)
    assert [a.closed for a in arms] == [1, 1, 1, 1]
    arms = [Arm(), Arm(RuntimeError("first")), Arm(RuntimeError("second"))]
    with pytest.raises(RuntimeError, match="first"):
        common.close_all(arms)
    assert [a.closed for a in arms] == [1, 1, 1]
