"""A real OpenAI API server of vLLM with ``--data-parallel-size 2`` (a dense model), omnishm in its workers.

Two things a plain ``vllm serve`` does that no engine in the other modules does, each of which broke
omnishm until 2026-12-02:

- vLLM 0.32 runs each DP replica of a dense model as an independent engine of DP size 1, rank 0
  (``ParallelConfig.reconfigure_for_independent_dp_rank``); only ``data_parallel_index`` keeps the
  replica's index. omnishm read the DP group, saw no DP, and both replicas' TP rank 0s went for one
  cache as two writers. Each replica must write its own cache: ``<name>`` and ``<name>-dp1``.
- Ctrl-C stops the server by SIGKILLing every descendant of its engine processes once the shutdown
  timeout (0 s by default) passes (``vllm.utils.system_utils.kill_process_tree``). The committers the
  workers autostarted were such descendants and died with the caches' segments still in /dev/shm, at
  every stop. Detached, they reap the killed workers after ``heartbeat_timeout_s`` and leave nothing.

Requests share a 70-token prefix, so each replica serves prefix hits from its own cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from omnishm.integrations.vllm import EXTENSION_CLS  # noqa: E402
from helpers import free_port  # noqa: E402
from test_engine_tp import BIND_ENV, omp_bind_per_rank  # noqa: E402
from vllm_tier import runtime_dir, unique_cache_name, wait_clean  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

DP = 2
START_TIMEOUT_S = 300.0


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _status(name: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "omnishm", "status", "--name", name, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"cache {name}: {out.stderr}"
    return json.loads(out.stdout)


def _wait_ready(server: subprocess.Popen, port: int, log_path: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited {server.returncode}:\n{log_path.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not come up in {START_TIMEOUT_S:.0f}s:\n{log_path.read_text()[-4000:]}")


def test_each_dp_replica_of_vllm_serve_writes_its_own_cache_and_a_stop_leaves_nothing(tiny_model_dir, tmp_path):
    name = unique_cache_name("serve")
    port = free_port()
    env = {**os.environ, "OMNISHM_NAME": name, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           # The autostarted committers inherit these: they reap the killed workers after 2 s, not 10.
           "OMNISHM_HEARTBEAT_S": "0.2", "OMNISHM_HEARTBEAT_TIMEOUT_S": "2.0"}
    env.setdefault(BIND_ENV, omp_bind_per_rank(DP))  # one OpenMP core per replica (one NUMA node here)
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--data-parallel-size", str(DP),
           "--worker-extension-cls", EXTENSION_CLS, "--enable-prefix-caching", "--block-size", "32",
           "--max-model-len", "512", "--dtype", "float32", "--enforce-eager", "--seed", "0",
           "--max-num-seqs", "8", "--num-gpu-blocks-override", "64", "--kv-cache-memory-bytes", str(64 << 20)]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_ready(server, port, log_path)
        prefix = list(range(4, 74))
        for i in range(8):
            out = _post(port, {"model": str(tiny_model_dir), "prompt": prefix + [100 + i], "max_tokens": 3,
                               "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == 3, out
        caches = [name, f"{name}-dp1"]
        stats = {c: _status(c) for c in caches}
        writers = {}
        for c, st in stats.items():
            data = [cl for cl in st["clients"] if cl["role"] != "admin"]  # the status request is an admin client
            assert [cl["role"] for cl in data] == ["writer"], f"cache {c}: clients {st['clients']}"
            assert st["steps_applied"] > 0 and st["rows_written"] > 0, f"cache {c} wrote nothing: {st}"
            writers[c] = data[0]
        assert writers[name]["pid"] != writers[f"{name}-dp1"]["pid"], writers  # two replicas, two processes
        hits = {c: int(w.get("counters", {}).get("hit_tokens", 0)) for c, w in writers.items()}
        assert sum(hits.values()) > 0, f"no prefix hit was served from either cache: {hits}"
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in the server's terminal
        server.wait(120)
        text = log_path.read_text()
        segs, files = wait_clean()
        assert not segs and not files, f"left after the server stopped: {segs} {files}\n{text[-3000:]}"
        print(f"[serve dp={DP}] caches {caches}: steps {[stats[c]['steps_applied'] for c in caches]}, "
              f"rows {[stats[c]['rows_written'] for c in caches]}, hit tokens {[hits[c] for c in caches]}; "
              f"vLLM's stop force-killed {text.count('force killing sub process')} processes; "
              f"nothing left in /dev/shm or {runtime_dir()}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
