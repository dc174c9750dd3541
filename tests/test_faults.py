"""Faults: reaping, bounded failure without a committer, restart with adoption, cleanup after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from omnishm import liveness, orphans, protocol, shm
from omnishm.client.link import CommitterLink
from omnishm.interface import OmniPrefixCacheCommitterError
from omnishm.versions import make_cv

from conftest import REPO, RUNTIME_DIR, unique_cache_name, wait_ready
from helpers import RawClient, Writer, bits, map_key, pack, random_rows, unpack

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
NUM_SLOTS = 32
FAST = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")


def _until(cond, timeout_s: float, what: str, pace=None):
    """Poll ``cond`` (bounded); ``pace`` waits on something real between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        (pace or (lambda: time.sleep(0.02)))()


def _step_write(rid: int, step: int, key: str, tid: int, cv: int, src: int, slots: list[int]) -> protocol.StepWrite:
    return protocol.StepWrite(rid=rid, step=step, keys=[key], key_idx=pack([0]), tids=pack([tid]), cvs=pack([cv]),
                              src_rows=pack([src]), counts=pack([len(slots)]), slots=pack(slots))


def test_silent_writer_is_reaped_and_its_late_writes_fail_counted(committer_factory):
    handle = committer_factory(*FAST)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    view = writer.open_key("k", "float32", 4)
    stage = view.segments.staging
    assert stage in shm.list_segments(handle.name)
    # The writer says nothing: reaped after the timeout, staging unlinked.
    _until(lambda: handle.status()["clients_reaped"] == 1, 15, "the silent writer to be reaped")
    assert stage not in shm.list_segments(handle.name)
    # Its in-flight write arrives late: failed (every tid), with the reason, and counted.
    done = writer.step_write(1, [("k", 11, writer.new_cv(1), 0, [0, 1]), ("k", 12, writer.new_cv(1), 2, [2])])
    assert isinstance(done, protocol.StepDone), done
    assert unpack(done.done_tids) == [] and sorted(unpack(done.failed_tids)) == [11, 12]
    assert "reaped after" in done.reason and "staging" in done.reason
    status = handle.status()
    assert status["tids_failed_reaped"] == 2 and status["rejected"]["reaped_write"] == 1
    assert "reaped after" in handle.log()
    writer.raw.close()


def test_link_fails_within_bound_when_committer_is_gone(committer_factory):
    handle = committer_factory(*FAST)
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=1.0)
    try:
        assert isinstance(link.request(lambda rid: protocol.StatusRequest(rid=rid)), protocol.StatusReply)
        handle.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(OmniPrefixCacheCommitterError, match="within reconnect_timeout_s=1.0s"):
            link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=30)
        elapsed = time.monotonic() - t0
        # Lost (process gone: seen at the next heartbeat) + 1 s of resume attempts; never the 30 s request timeout.
        assert elapsed < 1.0 + 1.0 + 2.0, elapsed
        assert link.dead is not None and link.stats["committer_lost"] == 1
        with pytest.raises(OmniPrefixCacheCommitterError):
            link.submit(lambda rid: protocol.StatusRequest(rid=rid))
    finally:
        link.close()
    # The SIGKILLed committer's segments: its last client removed them as it closed.
    assert shm.list_segments(handle.name) == []


def test_manager_write_fails_sticky_within_bound_when_committer_is_gone(committer_factory, monkeypatch):
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig
    from omnishm.sim import SimEngine

    handle = committer_factory(*FAST)
    # Enough blocks for the sim's longest request: with fewer, every step after the first few is empty, and
    # the failure would come from the link alone, with no write in flight.
    blocks = SimEngine.blocks_for_longest_request(4, 64)
    cfg = PrefixCacheConfig(num_blocks=blocks, block_size=4, staging_capacity_tokens=64, staging_depth=3,
                            commit_timeout_s=20.0, staging_claim_timeout_s=20.0, reconnect_timeout_s=1.0)
    eng = SimEngine(num_blocks=blocks, block_size=4, max_batched_tokens=64, width=8, mm_key=None, seed=3)
    m = OmniPrefixCacheManager(cfg, cache=handle.name, endpoint=handle.endpoint, autostart=False)

    def one_step() -> None:
        eng.top_up(2)
        st = eng.schedule()
        assert st.num_tokens > 0  # every step writes rows
        m.discard_step(st.run(m, with_mm=False))
        eng.advance(st)

    try:
        for _ in range(3):
            one_step()
        m.wait_idle()
        handle.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(OmniPrefixCacheUnmatchError) as err:
            while time.monotonic() - t0 < 30:  # the next save joins the previous step's write: it fails, sticky
                one_step()
        assert time.monotonic() - t0 < 10, "failure was not bounded by heartbeat + reconnect timeouts"
        # The step in flight when the committer died failed, and the failure is the cache's sticky error.
        assert "failed write (sticky" in str(err.value) and "writes were lost" in str(err.value), err.value
        assert "reconnect_timeout_s" in str(err.value)
        with pytest.raises(OmniPrefixCacheUnmatchError):
            m.new_step_starts(eng.schedule().step)
    finally:
        m.shutdown()
    assert shm.list_segments(handle.name) == []  # removed by the last client's shutdown


def test_restart_adopts_live_cache_keeps_acked_rows_and_lands_resent_writes(committer_factory):
    first = committer_factory(*FAST)
    name = first.name
    writer = CommitterLink(cache=name, role=protocol.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                           staging_rows=16, reconnect_timeout_s=30.0)
    reader = CommitterLink(cache=name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                           reconnect_timeout_s=30.0)
    second = None
    try:
        opened = writer.request(lambda rid: protocol.OpenKey(rid=rid, key="h", dtype="bfloat16", width=8))
        view = map_key(opened.segments, NUM_SLOTS)
        staged = random_rows(torch.bfloat16, (16, 8), torch.Generator().manual_seed(5))
        view.staging.copy_(staged)
        epoch = writer.welcome.epoch
        cv1, cv2 = make_cv(epoch, 1, 1), make_cv(epoch, 2, 1)
        view.claim[0:8] = cv1
        done = writer.request(lambda rid: _step_write(rid, 1, "h", 1, cv1, 0, list(range(8))))
        assert done.rows_written == 8  # acknowledged before the kill
        # The committer freezes, takes a write it never answers, and dies.
        os.kill(first.proc.pid, signal.SIGSTOP)
        view.claim[8:16] = cv2
        pending = writer.submit(lambda rid: _step_write(rid, 2, "h", 2, cv2, 8, list(range(8, 16))))
        first.stop(signal.SIGKILL)
        assert not pending.done()
        segs = shm.list_segments(name)
        second = committer_factory(*FAST, name=name)
        reply = pending.result(timeout=20)
        assert isinstance(reply, protocol.StepDone) and unpack(reply.done_tids) == [2] and reply.rows_written == 8
        assert writer.stats["reconnects"] == 1 and writer.stats["resent"] >= 1
        assert torch.equal(bits(view.pool[:16]), bits(staged)), "acked or re-sent rows differ after the restart"
        assert view.commit[:8].eq(cv1).all() and view.commit[8:16].eq(cv2).all()
        assert shm.list_segments(name) == segs, "the restart must adopt the segments, not recreate them"
        status = second.status()
        assert status["adopted"] and status["generation"] == writer.welcome.generation
        assert status["writer_epoch"] == epoch and "adopted live generation" in second.log()
        _until(lambda: reader.stats["reconnects"] == 1, 15, "the reader to resume")
        assert reader.request(lambda rid: protocol.OpenKey(rid=rid, key="h", dtype="bfloat16", width=8))
        # A resume that does not fit is refused, with the reason.
        raw = RawClient(second.endpoint, name)
        try:
            bad = raw.call(protocol.Hello(rid=1, protocol=protocol.PROTOCOL_VERSION, client_id=raw.client_id,
                                          pid=os.getpid(), uid=os.geteuid(), role=protocol.ROLE_READER, cache=name,
                                          layout=protocol.Layout(num_blocks=9, block_size=4), resume=True,
                                          resume_generation=writer.welcome.generation))
            assert isinstance(bad, protocol.Refused) and "layout mismatch" in bad.reason
            bad = raw.call(protocol.Hello(rid=2, protocol=protocol.PROTOCOL_VERSION, client_id=raw.client_id,
                                          pid=os.getpid(), uid=os.geteuid(), role=protocol.ROLE_WRITER, cache=name,
                                          layout=LAYOUT, resume=True, resume_generation="deadbeef"))
            assert isinstance(bad, protocol.Refused) and "did not adopt" in bad.reason
        finally:
            raw.close()
    finally:
        if second is None:
            os.kill(first.proc.pid, signal.SIGCONT) if first.proc.poll() is None else None
        writer.close()
        reader.close()


def _client_script(name: str, endpoint: str) -> str:
    return textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from omnishm import protocol
        from omnishm.client.link import CommitterLink
        link = CommitterLink(cache={name!r}, role="writer", endpoint={endpoint!r},
                             layout=protocol.Layout(num_blocks=8, block_size=4), staging_rows=4)
        link.request(lambda rid: protocol.OpenKey(rid=rid, key="k", dtype="float32", width=4))
        print("ready", flush=True)
        time.sleep(120)
    """)


@pytest.mark.parametrize("how", ["restart", "another name", "cleanup"])
def test_sigkill_of_every_process_then_one_start_or_cleanup_leaves_nothing(committer_factory, how):
    handle = committer_factory(*FAST)
    client = subprocess.Popen([sys.executable, "-c", _client_script(handle.name, handle.endpoint)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        assert len(shm.list_segments(handle.name)) == 6  # owner, ctl (+metadata), pool, claim, commit, staging
    finally:
        client.kill()
        client.wait()
        handle.stop(signal.SIGKILL)
    assert len(shm.list_segments(handle.name)) == 6
    if how == "restart":
        again = committer_factory(*FAST, name=handle.name)
        left = [s for s in shm.list_segments(handle.name) if not s.endswith(".owner")]
        assert left == [], "nobody was attached: the new start must sweep, not adopt"
        assert "removed 6 segment(s)" in again.log() and "adopted" not in again.log()
        again.stop(signal.SIGTERM)
    elif how == "another name":  # a cache never started again (renamed, a test's unique name)
        other = committer_factory(*FAST)
        assert shm.list_segments(handle.name) == []
        log = other.log()
        assert "swept" in log and f"/omnishm.{handle.name}." in log and f"{handle.name}.sock" in log, log
        other.stop(signal.SIGTERM)
    else:
        proc = subprocess.run([sys.executable, "-m", "omnishm", "cleanup", "--name", handle.name],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
    assert shm.list_segments(handle.name) == []
    left = [f for f in os.listdir(RUNTIME_DIR) if f.startswith(handle.name + ".")]
    assert left == [], left


def test_a_start_sweeps_other_names_only_where_nobody_is_left(committer_factory):
    """What a start of another name leaves: a dead committer's generation that a client still maps (it waits
    to resume) and a generation whose owner lock a live committer holds, whatever its runtime dir (here
    this process, holding the lock the way a committer started with another ``--runtime-dir`` does)."""
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import PrefixCacheConfig

    from conftest import unique_cache_name

    waiting, dead = committer_factory(*FAST), committer_factory(*FAST)
    cfg = PrefixCacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=16, staging_depth=2,
                            reconnect_timeout_s=30.0, commit_timeout_s=5.0)
    m = OmniPrefixCacheManager(cfg, cache=waiting.name, endpoint=waiting.endpoint, autostart=False)
    elsewhere = unique_cache_name("elsewhere")
    owner = liveness.GenerationOwner.acquire(elsewhere, "g0", runtime_dir=RUNTIME_DIR)  # only its lock keeps it
    pool = shm.Segment.create(shm.segment_name(elsewhere, "g0", "pool.k0"), 4096)
    try:
        waiting.stop(signal.SIGKILL)
        dead.stop(signal.SIGKILL)
        kept = {c: shm.list_segments(c) for c in (waiting.name, elsewhere)}
        assert shm.list_segments(dead.name) and all(kept.values())
        starter = committer_factory(*FAST)
        assert shm.list_segments(dead.name) == []
        assert not (RUNTIME_DIR / f"{dead.name}.sock").exists()
        assert {c: shm.list_segments(c) for c in kept} == kept
        starter.stop(signal.SIGTERM)
        # Its socket and lock file went with the sweep (as with `omnishm cleanup`); a restart makes them again
        # and adopts the generation the client kept.
        again = committer_factory(*FAST, name=waiting.name)
        assert f"adopted live generation {m._link.welcome.generation}" in again.log(), again.log()
        again.stop(signal.SIGTERM)
    finally:
        m.shutdown()  # the last client of a dead committer removes its generation (see below)
        pool.unlink()
        owner.release(unlink=True)
    assert shm.list_segments(waiting.name) == [] and shm.list_segments(elsewhere) == []


def test_restart_with_unusable_metadata_sweeps_and_clients_fail_clearly(committer_factory):
    first = committer_factory(*FAST)
    link = CommitterLink(cache=first.name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0)
    try:
        ctl = shm.Segment.attach(link.welcome.control)
        first.stop(signal.SIGKILL)
        from omnishm.committer import meta

        ctl.mmap[meta.META_OFFSET:meta.META_OFFSET + 2 * meta.SLOT_BYTES] = bytes(2 * meta.SLOT_BYTES)  # both slots
        second = committer_factory(*FAST, name=first.name)
        assert "cannot be adopted" in second.log()
        _until(lambda: link.dead, 20, "the link to give up")
        assert "did not adopt" in link.dead
        wait_ready(second)
    finally:
        link.close()


def test_cleanup_keeps_what_attached_clients_map_unless_forced(committer_factory):
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import PrefixCacheConfig

    handle = committer_factory(*FAST)
    cfg = PrefixCacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=16, staging_depth=2,
                            reconnect_timeout_s=1.0, commit_timeout_s=5.0)
    m = OmniPrefixCacheManager(cfg, cache=handle.name, endpoint=handle.endpoint, autostart=False)
    try:
        handle.stop(signal.SIGKILL)
        segs = shm.list_segments(handle.name)
        assert segs
        orphans.sweep(RUNTIME_DIR, handle.name)  # the client still maps them and may resume: kept
        assert shm.list_segments(handle.name) == segs
    finally:
        m.shutdown()
    orphans.sweep(RUNTIME_DIR, handle.name)  # nobody maps them any more: gone
    assert shm.list_segments(handle.name) == []


def _rank_script(rank: int, name: str, endpoint: str) -> str:
    """A real TP rank (``omnishm.demo.rank``; its resume window comes from the environment); prints its
    result as the last line."""
    return textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from omnishm.demo import rank as R
        opts = R.RankOptions(cache={name!r}, tp=3, seed=5, steps=10**9, duration_s=60, num_blocks=32, block_size=4,
                             max_batched_tokens=32, width=16, mm_width=4, lag=1, autostart=False,
                             endpoint={endpoint!r}, commit_timeout_s=20.0, lockstep=False, step_delay_s=0.01)
        class Progress:
            def put(self, item):
                print("steps", item[1], flush=True)
        print(json.dumps(R.run_rank({rank}, opts, Progress()).to_dict()), flush=True)
    """)


def test_clients_that_outlive_a_sigkilled_committer_leave_nothing_when_they_shut_down(committer_factory):
    """The committer is SIGKILLed mid-run and nothing restarts it; its writer and readers fail within their
    resume window and shut down cleanly. The last of them to leave removes the dead generation (segments,
    socket, lock): nobody else ever would, short of a manual `omnishm cleanup` or a start of that name."""
    import json

    handle = committer_factory(*FAST)
    env = {**os.environ, "OMNISHM_RECONNECT_TIMEOUT_S": "1.0"}
    ranks = [subprocess.Popen([sys.executable, "-c", _rank_script(r, handle.name, handle.endpoint)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env=env) for r in range(3)]
    try:
        for p in ranks:  # every rank is attached and stepping
            _until(lambda: p.stdout.readline().startswith("steps"), 60, "a rank to make progress")
        assert len(shm.list_segments(handle.name)) > 6
        handle.stop(signal.SIGKILL)
        results = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0, 0]
    assert all(r["failure"] and "reconnect_timeout_s=1.0s" in r["failure"] for r in results), results
    assert shm.list_segments(handle.name) == [], "the dead committer's segments outlived every client"
    left = [f for f in os.listdir(RUNTIME_DIR) if f.startswith(handle.name + ".")]
    assert left == [], left


def test_a_manager_whose_construction_fails_after_the_welcome_says_goodbye(committer_factory, monkeypatch):
    """Anything that raises in ``OmniPrefixCacheManager(...)`` after the committer welcomed it (here a
    signal's ``KeyboardInterrupt`` as the demo's ranks raise it, landing as the manager maps the control
    segment) closes its link: the session ends with a goodbye at once, instead of the link's I/O thread
    heartbeating for it as long as the process lives, and a writer built again right after is welcomed
    (a cache has one writer)."""
    import threading

    from manager_helpers import small_config
    from omnishm.client import OmniPrefixCacheManager

    handle = committer_factory("--heartbeat-timeout-s", "60")

    def interrupted(self, *args):
        raise KeyboardInterrupt("injected: SIGTERM while mapping the control segment")

    monkeypatch.setattr(OmniPrefixCacheManager, "_attach", interrupted)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        OmniPrefixCacheManager(small_config(), cache=handle.name, autostart=False)
    monkeypatch.undo()
    assert not [t.name for t in threading.enumerate() if t.name == f"omnishm-link-{handle.name}"]
    _until(lambda: [c["role"] for c in handle.status()["clients"]] in ([], ["admin"]), 10,
           "the failed client's session to end")
    with OmniPrefixCacheManager(small_config(), cache=handle.name, autostart=False) as m:
        assert m.is_writer


_FORKING_CLIENT = r'''
import os, sys
from omnishm.client import OmniPrefixCacheManager
sys.path.insert(0, "tests")
from manager_helpers import Part, save, small_config, started
m = OmniPrefixCacheManager(small_config(), cache=sys.argv[1], endpoint=sys.argv[2], autostart=False)
m.new_step_starts([started("a", [0, 1])])
m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], 4), ["a"])
r, w = os.pipe()
child = os.fork()
if child == 0:  # a forked worker (multiprocessing's fork, a DataLoader worker) that does nothing with the cache
    os.close(w)
    os.read(r, 1)  # ends once its parent's shutdown is over (EOF), as a worker pool torn down last does
    os._exit(0)
os.close(r)
print("ready", flush=True)
sys.stdin.readline()  # the committer is SIGKILLed meanwhile
m.shutdown()  # the last client: sweeps the dead committer's generation
os.close(w)
os.waitpid(child, 0)
'''


def test_a_forked_child_of_the_last_client_does_not_keep_a_dead_committers_generation(committer_factory):
    """Review (2026-12-06): a client's liveness lock is a ``flock`` on the control segment, which belongs to the
    open file a fork shares. A child forked after the attach (a fork-pool worker) kept it past its parent's
    shutdown, so the last client's sweep of a SIGKILLed committer's generation took it for a client still
    attached and left all of it (10 segments here) in /dev/shm, for good once the child exited. A forked
    child now closes its copies of the lock."""
    # A committer start elsewhere sweeps a dead generation of a runtime dir where no committer holds a lock.
    guard = liveness.CacheLock.acquire(RUNTIME_DIR, unique_cache_name("guard"), "guard")
    handle = committer_factory(*FAST)
    env = {**os.environ, "OMNISHM_RECONNECT_TIMEOUT_S": "1.0"}
    p = subprocess.Popen([sys.executable, "-c", _FORKING_CLIENT, handle.name, handle.endpoint], cwd=REPO, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert len(shm.list_segments(handle.name)) > 6
        handle.stop(signal.SIGKILL)
        p.communicate("go\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if guard is not None:
            guard.release(remove=True)
    assert p.returncode == 0
    assert shm.list_segments(handle.name) == [], "the dead committer's generation outlived every client"
    assert [f for f in os.listdir(RUNTIME_DIR) if f.startswith(handle.name + ".")] == []
