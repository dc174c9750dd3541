"""Session state of the vLLM tier, shared by its conftest and test modules.

A plain module (not ``conftest``) so that importing it never picks up another
directory's conftest. The runtime dir is set by ``conftest.py`` before this is used.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path

# A child process of a tier test (test_engine_v2.py) names its caches with its parent's prefix, so the session's
# leak checks see them too.
SESSION_PREFIX = os.environ.get("OMNISHM_TIER_SESSION_PREFIX") or f"v{uuid.uuid4().hex[:6]}"
_counter = itertools.count()
CLEAN_TIMEOUT_S = 30.0

TIER_COUNTS = {"requests": 0, "rows": 0, "mismatches": 0, "hit_requests": 0, "hit_rows": 0,
               "scheduler_rows": 0, "scheduler_steps": 0}
"""Totals over the session, printed in the terminal summary."""


def unique_cache_name(tag: str = "c") -> str:
    return f"{SESSION_PREFIX}-{tag}{next(_counter)}"




def runtime_dir() -> Path:
    return Path(os.environ["OMNISHM_RUNTIME_DIR"])


def _our_segments() -> list[str]:
    from omnishm import shm

    out = []
    for seg in shm.list_segments():
        parsed = shm.parse_segment_name(seg)
        if parsed is not None and parsed[0].startswith(SESSION_PREFIX):
            out.append(seg)
    return sorted(out)


def _our_runtime_files() -> list[str]:
    # Autostart logs are the link's append-only diagnostics; sockets and locks must go.
    return sorted(f for f in os.listdir(runtime_dir()) if not f.endswith(".autostart.log"))


def wait_clean(timeout_s: float = CLEAN_TIMEOUT_S) -> tuple[list[str], list[str]]:
    """Bounded wait until this tier's caches left /dev/shm and the runtime dir.

    A detached embedded committer exits when idle and unlinks its segments; the
    wait is for that condition, not a fixed sleep. Returns what is left.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        segs, files = _our_segments(), _our_runtime_files()
        if (not segs and not files) or time.monotonic() > deadline:
            return segs, files
        time.sleep(0.05)




def skip_without_vllm() -> None:
    """Skip the calling test module unless the real vllm is installed.

    Checks for a real install (a regular package), not just any importable
    name ``vllm``: a stray namespace directory of that name must not count.
    """
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin in (None, "namespace") or spec.origin.startswith(str(Path(__file__).parent)):
        pytest.skip("vllm is not installed (optional tier: tests/vllm_tier/run_tier.sh)", allow_module_level=True)
    pytest.importorskip("vllm")
