"""A real vLLM engine with tensor_parallel_size=2: two worker processes, one committer.

vLLM's multiprocess executor runs one ``CPUWorker`` per TP rank (gloo + the CPU
shm communicator). The extension installs the hooks in both: TP rank 0 attaches
as the writer, rank 1 as a reader of the same cache, so the committer's status
must list exactly those two clients. Every request's full-prompt hidden states
are checked on both ranks against the same prompt run with the prefix cache
reset: the writer's bit for bit (the rule of the other tier modules); the
reader's hit rows come out of shared memory (written by the writer), so its
prefix must equal the writer's ground truth and its computed rows its own.

On one NUMA node vLLM's automatic OpenMP binding refuses TP=2 ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers",
``vllm/utils/ompmultiprocessing.py``); the engine fixture binds the ranks to
halves of the allowed CPUs through ``VLLM_CPU_OMP_THREADS_BIND`` unless it is set.

What it found (2026-12-02): each rank autostarts the committer of a new cache, and the loser of that
race, pinned to its rank's busy core, could start seconds late, take the lock after the winner served a
short-lived cache and exited, and hold the cache's lock, socket and owner segment until the engine
exited (the leak check failed). The client now stops the committers it autostarted once another
welcomed it (``LinkAttach._stop_autostart_losers``). And the client's threads and the autostarted
committer inherited the rank's pinned core, where the rank's main thread busy-waits: starved there, a
Hello sat 10 s in the committer's accept backlog, and a rank was reaped (the engine died) in 3 of 7
runs of this module. They now run on every allowed CPU (``omnishm/cpus.py``).
"""

from __future__ import annotations

import os

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

import tp_scenarios  # noqa: E402
from tp_scenarios import BIND_ENV, NUM_BLOCKS, TP, TPHarness, omp_bind_per_rank  # noqa: E402
from vllm_harness import close_llm, make_llm  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        if BIND_ENV not in os.environ:
            mp.setenv(BIND_ENV, omp_bind_per_rank())  # read by the engine-core process vLLM spawns
        llm = make_llm(tiny_model_dir, multiprocess=True, cache=unique_cache_name("tp"),
                       num_gpu_blocks_override=NUM_BLOCKS, tensor_parallel_size=TP)
    try:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == TP
        yield {"harness": TPHarness(llm), "first": True}
    finally:
        close_llm(llm)


def test_tp2_one_committer_prefix_hits(h):
    tp_scenarios.one_committer_prefix_hits(h)


def test_tp2_abort_chunked_and_reused_blocks(h):
    tp_scenarios.abort_chunked_and_reused_blocks(h)
