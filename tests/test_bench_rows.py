"""The bench times only rows that landed right: figures 1, 2 and 3 refuse a product that moves wrong rows.

Review (2026-12-06, stop 49): a committer that wrote the large step's rows in the wrong order, a
materialize that skipped a row into recycled result memory, and a bug common to all of figure 3's omnishm
arms each left their figure printing a ratio and the bench exiting 0; a faster wrong product would have
looked better. Each test here injects one such wrong row into a real run (a real committer process,
real segments) and expects the figure to raise, naming what differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnishm import protocol as P
from omnishm.bench import manager_figures as mf
from omnishm.bench import write_figures as wf
from omnishm.bench.common import Cleanup, RawWriter
from omnishm.client import OmniPrefixCacheManager
from omnishm.interface import StageCacheOutputs

QUICK_WRITE = wf.WriteSize(1024, 2048, 3, (1, 64, 256), 3)  # omnishm.bench.run's quick geometries
QUICK_READ = mf.ReadSize(2048, 8192, 1024, 3)
QUICK_ENGINE = mf.EngineSize(512, 256, 8, 2048, 4, 3)


@pytest.fixture
def cleanup():
    c = Cleanup()
    yield c
    c.close()


@pytest.mark.parametrize("which, what", [(1, r"step \d+: 1 of 1024"), (12, r"decode step \d+: 1 of 256")],
                         ids=["large-step", "last-decode-step"])
def test_figure_1_refuses_a_pool_row_that_is_not_the_staged_row(cleanup, monkeypatch, which, what):
    """Figure 1 compares every row of every timed step with the row staged for it (outside the clock).
    One row that differs right after the committer's reply (its staged row is changed: a client maps the
    pool read-only), in the first measured large step or in the last decode step, fails the figure; before
    the fix only the first row of the last decode step was read."""
    real_call = RawWriter.call
    seen = {"steps": 0}

    def call(self, msg, **kwargs):
        reply = real_call(self, msg, **kwargs)
        if isinstance(msg, P.StepWrite):
            if seen["steps"] == which:  # the staged row of the step's last slot (the pool is read-only here)
                last = int(np.frombuffer(msg.src_rows, dtype="<i8")[-1] + np.frombuffer(msg.counts, dtype="<i8")[-1])
                self.keys["hidden"]["staging"][last - 1].view(torch.int16)[0] ^= 1
            seen["steps"] += 1
        return reply

    monkeypatch.setattr(RawWriter, "call", call)
    with pytest.raises(RuntimeError, match=f"figure 1, {what} pool rows differ from their staged rows"):
        wf.figure_write(cleanup, QUICK_WRITE, np.random.default_rng(0))
    assert seen["steps"] == which + 1  # the figure stopped at the spoiled step


def test_figure_2_refuses_a_row_skipped_into_recycled_result_memory(cleanup, monkeypatch):
    """Figure 2 checks every materialize, not only its warm-up calls, and spoils each result row after the
    check: a copy that skips the last row into memory it wrote before would otherwise find the previous
    call's identical row there. The first reuse of recycled memory is a measured call."""
    from omnishm.client import reads

    real_gather = reads.gather_rows
    written: set[int] = set()
    skipped = []

    def gather_rows(pool, slots, out):
        if out.data_ptr() in written:  # memory this copy wrote before: leave its last row alone
            skipped.append(out.data_ptr())
            real_gather(pool, slots[:-1], out[:-1])
            return
        written.add(out.data_ptr())
        real_gather(pool, slots, out)

    monkeypatch.setattr(reads, "gather_rows", gather_rows)
    with pytest.raises(RuntimeError, match=r"figure 2, call \d+ \((pool|out)\): the materialized hit differs"):
        mf.figure_read(cleanup, QUICK_READ)
    assert skipped, "no copy went into recycled memory: the test did not reach its case"


def test_figure_3_refuses_a_wrong_row_that_all_its_omnishm_arms_serve(cleanup, monkeypatch):
    """Figure 3 compares omnishm's served rows with the rows written, not only with its other arms: these
    run the same client and committer code, so a bug in it gives them the same wrong rows. With vllm-omni
    absent (its arm is the only other witness), a hit's row spoiled in every arm fails the figure."""
    real = OmniPrefixCacheManager.materialize

    def materialize(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        for req, rows in result.hidden_states.items():
            if req.startswith("h"):  # the hit: its first row, read from the pool
                rows[0].view(torch.int16)[0] ^= 1
        return result

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match=r"figure 3, step 0: omnishm's __hidden_states__ for h1 differ from "
                                           r"the rows written"):
        mf.figure_engine(cleanup, QUICK_ENGINE)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def test_figure_2_refuses_the_previous_calls_tail(cleanup, monkeypatch):
    """Review (2026-12-06): every call saved the same tail rows into the same block, so a materialize that
    served the previous call's tail (a stale staging page, a read that does not wait for its step) passed;
    the spoil covers reused result memory only, not a stale source. Each call's tail now differs."""
    real = OmniPrefixCacheManager.materialize
    state = {"prev_tail": None, "stale": 0}

    def materialize(self, step_id, req_ids, **kwargs):
        result = real(self, step_id, req_ids, **kwargs)
        for req, rows in result.hidden_states.items():
            h = result.num_hit_tokens[req]
            this_tail = rows[h:].clone()
            if state["prev_tail"] is not None:  # the bug: the tail of the previous call's step
                rows[h:] = state["prev_tail"]
                state["stale"] += 1
            state["prev_tail"] = this_tail
        return result

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)
    with pytest.raises(RuntimeError, match="figure 2"):
        mf.figure_read(cleanup, QUICK_READ)
    assert state["stale"]


def test_figure_3_refuses_the_previous_steps_rows(cleanup, monkeypatch):
    """Review of the checks above (2026-12-06): every step saved the same rows, so step i's requests served
    step i-1's rows (a staging page or step id mixed up, a read that does not wait for its step) in every
    omnishm arm passed. Each step's rows now differ (``_EngineArm._stamp``)."""
    real = OmniPrefixCacheManager.materialize
    prev: dict[int, tuple[list[str], StageCacheOutputs]] = {}
    served_stale = []

    def materialize(self, step_id, req_ids, **kwargs):
        req_ids = list(req_ids)
        result = real(self, step_id, req_ids, **kwargs)
        mine = (req_ids, StageCacheOutputs({r: _clone(v) for r, v in result.hidden_states.items()},
                                           {r: {k: _clone(v) for k, v in d.items()} for r, d in result.mm_outputs.items()},
                                           dict(result.num_hit_tokens)))
        old = prev.get(id(self))
        prev[id(self)] = mine
        if old is None or len(old[0]) != len(req_ids) or not req_ids[0].startswith("p"):
            return result
        # The bug: step i's requests get step i-1's rows (same roles, same order).
        ren = dict(zip(old[0], req_ids))
        served_stale.append(req_ids[0])
        return StageCacheOutputs({ren[r]: v for r, v in old[1].hidden_states.items()},
                                 {ren[r]: d for r, d in old[1].mm_outputs.items()},
                                 {ren[r]: n for r, n in old[1].num_hit_tokens.items()})

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match="figure 3"):
        mf.figure_engine(cleanup, QUICK_ENGINE)
    assert served_stale


def test_figure_3_refuses_the_prefills_rows_as_the_hits_prefix(cleanup, monkeypatch):
    """Review (2026-12-06): the hit's prefix was the step's rows repeated, so a hit served the prefill's rows as
    its prefix passed. The prefix has rows of its own now."""
    real = OmniPrefixCacheManager.materialize
    swapped = []

    def materialize(self, step_id, req_ids, **kwargs):
        result = real(self, step_id, req_ids, **kwargs)
        pf = [r for r in result.hidden_states if r.startswith("p")]
        hit = [r for r in result.hidden_states if r.startswith("h")]
        if pf and hit:
            n = result.num_hit_tokens[hit[0]]
            # The bug: the hit's prefix rows are read from the prefill request's rows of this step.
            result.hidden_states[hit[0]][:n] = result.hidden_states[pf[0]][:n]
            for key, v in result.mm_outputs.get(hit[0], {}).items():
                v[:n] = result.mm_outputs[pf[0]][key][:n]
            swapped.append(hit[0])
        return result

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)
    monkeypatch.setattr(mf, "vllm_omni_version", lambda: None)
    with pytest.raises(RuntimeError, match="figure 3"):
        mf.figure_engine(cleanup, QUICK_ENGINE)
    assert swapped
