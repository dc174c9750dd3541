"""An autostarted committer outlives a SIGKILL of its engine's whole process tree, then cleans up.

vLLM 0.32 stops ``vllm serve`` by SIGTERMing its engine processes and, once its shutdown timeout
(0 s by default) has passed, SIGKILLing every descendant of each one still running
(``vllm.utils.system_utils.kill_process_tree``). A committer that a rank autostarted was such a
descendant: a real ``--data-parallel-size 2`` server stopped with Ctrl-C left both caches'
segments in /dev/shm and their lock, socket and log in the runtime dir. Here a rank process
(real manager, real committer, real shm) is killed the way vLLM does it, by walking /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omnishm import shm
from omnishm.shm import proc_identity

_RANK = """
import sys, time
from omnishm.client import OmniPrefixCacheManager
sys.path.insert(0, sys.argv[3])
from manager_helpers import Part, save, small_config, started
name, rt = sys.argv[1], sys.argv[2]
m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=rt, connect_timeout_s=60.0)
m.new_step_starts([started("a", [0, 1])])
m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], 4), ["a"])
print(m._link.welcome.committer_pid, flush=True)
time.sleep(600)
"""


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children by ppid, recursively), as psutil's ``children(recursive=True)``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _kill_process_tree(pid: int) -> None:
    """What vLLM's ``kill_process_tree`` does: SIGKILL every descendant, then the process."""
    for child in _descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(pid, signal.SIGKILL)


def test_an_autostarted_committer_survives_vllms_tree_kill_and_cleans_up(tmp_path):
    from conftest import unique_cache_name

    name = unique_cache_name("tree")
    runtime = tmp_path / "rt"
    # The committer inherits the rank's environment: it reaps the killed rank after 1 s of silence.
    env = {**os.environ, "OMNISHM_HEARTBEAT_S": "0.2", "OMNISHM_HEARTBEAT_TIMEOUT_S": "1.0"}
    rank = subprocess.Popen([sys.executable, "-c", _RANK, name, str(runtime), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    committer = 0
    try:
        line = rank.stdout.readline()
        assert line.strip().isdigit(), rank.stderr.read() if rank.poll() is not None else line
        committer = int(line)
        ident = proc_identity(committer)
        assert ident is not None and shm.list_segments(name), "the rank's committer is not up"
        assert committer not in _descendants(rank.pid), "the autostarted committer is in the rank's process tree"
        _kill_process_tree(rank.pid)
        rank.wait(10)
        deadline = time.monotonic() + 30
        while proc_identity(committer) == ident and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_identity(committer) != ident, "the committer outlived its only client by 30 s"
        assert shm.list_segments(name) == [], "the committer left its segments"
        assert sorted(os.listdir(runtime)) == [], "the committer left its lock, socket or log"
    finally:
        if rank.poll() is None:
            _kill_process_tree(rank.pid)
            rank.wait(10)
        if committer and proc_identity(committer) is not None:
            os.kill(committer, signal.SIGTERM)  # failed: stop it (it unlinks what it made)
