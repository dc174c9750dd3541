"""One mirror for all TP ranks: a writer and readers on one committer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from manager_helpers import MM_WIDTH, WIDTH, small_config, Part, aborted, expect, finished, hit_beside_plain, rows, save, started
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omnishm.demo.launch import RankGroup
from omnishm.demo.rank import START_BARRIER_S, RankOptions, RankResult, run_rank
from omnishm.interface import HIDDEN_KEY, OmniPrefixCacheCommitterError

BS = 4
WAIT_S = 90.0
"""A rank group's bound: under pytest's 120 s timeout, so a hung rank's stacks are written (RankGroup.wait)."""


def cfg(**kw) -> PrefixCacheConfig:
    return small_config(**{"commit_timeout_s": 3.0, **kw})


def rank_opts(cache: str, **kw) -> RankOptions:
    base = dict(cache=cache, tp=3, steps=80, num_blocks=48, block_size=16, max_batched_tokens=96, width=32,
                mm_width=4, lag=1, autostart=False, commit_timeout_s=10.0)
    base.update(kw)
    return RankOptions(**base)


def test_writer_and_two_reader_processes_serve_identical_exact_rows(committer_factory):
    # Lockstep with materialize in the step (lag 0): no rank can re-claim a slot another still reads.
    # Preemptions forced now and then: a review (2026-12-05) found these sizes never ran out of blocks, so
    # no request was ever resumed, with a hit on its own cached blocks, in this test or the demo.
    results = RankGroup(rank_opts(committer_factory().name, lag=0, preempt_rate=0.15)).start().wait(WAIT_S)
    for r in results:
        assert r.failure is None, r
        assert r.mismatches == 0 and r.errors == {}, r
        assert r.rows_checked > 5_000
    writer, *readers = results
    assert writer.hit_tokens > 1_000
    assert writer.resumed_hits > 0 and all(r.resumed_hits == writer.resumed_hits for r in readers), results
    for r in readers:
        assert r.role == "reader" and r.hit_tokens == writer.hit_tokens


def test_a_reader_serves_requests_without_a_hit_with_no_wait_on_its_writer(committer):
    """Review (stop 56): a reader's materialize of requests without a hit waited for its writer's publication
    whenever another request of the step had a hit, and refused its own rows when the writer was late. Here the
    writer never saves the steps (commit_timeout_s 3 s): e's rows are served; a read of f's hit still waits and raises,
    naming f."""
    with OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg(), cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        w.wait_idle()
        r.new_step_starts([started("d", [0, 2], hit=4), started("e", [3])])
        sid = save(r, [Part("d", 4, [0, 2], 4, 2), Part("e", 5, [3], 0, 3)], BS)
        assert torch.equal(r.materialize(sid, ["e"]).hidden_states["e"], expect(5, 0, 5, 0, 3))
        r.new_step_starts([started("f", [0, 4], hit=4)])
        sid = save(r, [Part("d", 6, [0, 2], 6, 1), Part("f", 6, [0, 4], 4, 1)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"did not publish step 2.*request='f'"):
            r.materialize(sid, ["d", "f"])


def test_reader_reads_same_step_hits_and_stays_exact_when_slots_are_reused_next_step(committer):
    with OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg(), cache=committer.name, role="reader", autostart=False) as r:
        steps = [
            ([started("a", [0, 1]), started("b", [0, 2], hit=4)],
             [Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)]),  # b hits a's block 0 in the same step
            ([finished("a"), aborted("b"), started("c", [0])], [Part("c", 9, [0], 0, 4)]),  # block 0 reused
            ([started("d", [0, 3], hit=4)], [Part("d", 9, [0, 3], 4, 2)]),
        ]
        outs = []
        for (events, parts), want in zip(steps, [("b", expect(1, 4, 1, 4, 3)), None, ("d", expect(9, 4, 9, 4, 2))]):
            ids = []
            for m in (w, r):
                m.new_step_starts(events)
                ids.append(save(m, parts, BS))
            # In lockstep every rank reads step N before any rank saves step N+1 (the next forward's collective).
            if want is None:
                w.discard_step(ids[0])
                r.discard_step(ids[1])
                continue
            req, rows_want = want
            out_w, out_r = w.materialize(ids[0], [req]), r.materialize(ids[1], [req])
            assert torch.equal(out_r.hidden_states[req], rows_want)
            assert torch.equal(out_r.hidden_states[req], out_w.hidden_states[req])
            assert torch.equal(out_r.mm_outputs[req]["feat"], out_w.mm_outputs[req]["feat"])
            outs.append(out_r)
        assert torch.equal(outs[0].mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 3, mm=True))
        # Readers map everything read-only and own no mirror.
        assert all(seg.readonly for seg in r._keys[HIDDEN_KEY].segments)
        assert r._keys[HIDDEN_KEY].staging is None


def test_lagging_reader_gets_rescued_rows_or_a_clear_error_never_a_reused_slot(committer):
    with OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg(), cache=committer.name, role="reader", autostart=False) as r:
        w.new_step_starts([started("a", [0, 1])])
        w.discard_step(save(w, [Part("a", 1, [0, 1], 0, 8)], BS))
        r.new_step_starts([started("a", [0, 1])])
        r.discard_step(save(r, [Part("a", 1, [0, 1], 0, 8)], BS))
        hit_step = [finished("a"), started("b", [0, 2], hit=4)]
        w.new_step_starts(hit_step)
        w.discard_step(save(w, [Part("b", 1, [0, 2], 4, 2)], BS))
        # The writer runs ahead: b aborts and block 0 gets a new tenant before the reader even saves.
        w.new_step_starts([aborted("b"), started("c", [0])])
        w.discard_step(save(w, [Part("c", 8, [0], 0, 4)], BS))
        w.wait_idle()
        assert torch.equal(w._keys[HIDDEN_KEY].pool[torch.arange(4)], rows(8, range(4)))
        r.new_step_starts(hit_step)
        late = save(r, [Part("b", 1, [0, 2], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"reused.*'b'.*__hidden_states__.*step_id=1") as exc:
            r.materialize(late, ["b"])
        assert (exc.value.req_id, exc.value.key, exc.value.step_id) == ("b", HIDDEN_KEY, 1)  # for a caller's code
        assert r.counters["prefetch_dropped"] == 1


def test_lagging_ranks_without_lockstep_never_serve_a_wrong_row(committer_factory):
    results = RankGroup(rank_opts(committer_factory().name, lockstep=False, lag=3, num_blocks=24)).start().wait(WAIT_S)
    for r in results:
        assert r.failure is None, r
        assert r.mismatches == 0, r
        assert set(r.errors) <= {"reused"}, r
    assert results[0].errors == {}  # the writer rescues its own late reads


def test_a_lagging_lockstep_reader_that_refuses_rows_that_were_there_fails_the_demo(committer_factory, monkeypatch):
    """REVIEW (2026-12-05, stop 42, the demo's checker): in a lagging run the demo accepted any number of
    "reused" refusals from readers, so a reader that refused every hit passed. In lockstep the steps saved
    after the refused one are known (the ranks' pending steps): a "reused" refusal that none of them
    explains (no later step wrote a slot of the hit) now fails the demo. The writer and a reader as threads
    of this process, lockstep, --lag 2; the broken reader turns each step with a hit into a refusal."""
    from omnishm.demo.main import passed
    from omnishm.demo.rank import UNEXPLAINED_REUSE
    from omnishm.interface import unmatch

    opts = rank_opts(committer_factory().name, tp=2, lag=2, steps=60, num_blocks=96)

    def run_pair() -> dict[int, RankResult]:
        barrier = threading.Barrier(2)
        results: dict[int, RankResult] = {}
        reader = threading.Thread(target=lambda: results.__setitem__(1, run_rank(1, opts, barrier=barrier)))
        reader.start()
        results[0] = run_rank(0, opts, barrier=barrier)
        reader.join()
        return results

    def verdict(results: dict[int, RankResult]) -> bool:
        return passed({"mismatches": sum(r.mismatches for r in results.values()), "failures": {},
                       "leaked_segments": [], "errors": {f"rank{k}": r.errors for k, r in results.items()}}, opts)

    clean = run_pair()
    assert all(r.failure is None for r in clean.values()), clean
    assert clean[1].hit_tokens > 0 and UNEXPLAINED_REUSE not in clean[1].errors and verdict(clean), clean
    real = OmniPrefixCacheManager.materialize

    def refuses_every_hit(self, step_id, req_ids, **kw):
        out = real(self, step_id, req_ids, **kw)
        hit = next((r for r, n in out.num_hit_tokens.items() if n), None)
        if not self.is_writer and hit is not None:
            raise unmatch("slot reused after the hit was planned (reader has no rescue)", req_id=hit,
                          key=HIDDEN_KEY, step_id=step_id)
        return out

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", refuses_every_hit)
    broken = run_pair()
    assert all(r.failure is None for r in broken.values()), broken
    assert broken[1].errors.get(UNEXPLAINED_REUSE, 0) > 0 and not verdict(broken), broken
    assert broken[0].errors == {}, broken


def test_a_reader_that_starts_after_its_writer_could_finish_still_follows_it_once_the_ranks_meet_at_start(
        committer_factory):
    """Without lockstep the ranks still meet once, all attached, before the first step (a TP engine's start).
    A reader that attached after its writer's last publication could never bind to that writer and waited
    out commit_timeout_s at every step: the lagging-ranks test hung 90 s that way on a loaded host (its
    writer finished its 80 steps before the reader's process had imported torch). The reader here attaches
    only once the writer could run: without the meeting, after the writer's last step."""
    opts = rank_opts(committer_factory().name, tp=2, lockstep=False, lag=0, steps=20, num_blocks=256,
                     commit_timeout_s=4.0)
    barrier = threading.Barrier(2)
    results: dict[int, RankResult] = {}

    def rank(r: int) -> None:
        results[r] = run_rank(r, opts, barrier=barrier)

    writer_thread = threading.Thread(target=rank, args=(0,))
    writer_thread.start()
    # The reader's process is slow to start: it attaches only once the writer is attached and free to run
    # (waiting at the meeting), or, with no meeting, has run all its steps.
    while barrier.n_waiting == 0 and writer_thread.is_alive():
        time.sleep(0.01)
    rank(1)
    writer_thread.join()
    writer, reader = results[0], results[1]
    for r in (writer, reader):
        assert r.failure is None and r.mismatches == 0 and r.steps == 20, r
    assert writer.errors == {} and set(reader.errors) <= {"reused"}, reader
    assert reader.hit_tokens > 0 and reader.rows_checked > 0, reader


def test_a_rank_that_fails_to_attach_stops_the_others_at_the_start_meeting_at_once(committer_factory):
    """Rank 0 is refused (another engine's writer holds the seat); rank 1, attached and waiting for it at the
    start meeting, fails at once with the broken barrier instead of waiting out START_BARRIER_S."""
    opts = rank_opts(committer_factory().name, tp=2, lockstep=False)
    barrier = threading.Barrier(2)
    results: dict[int, RankResult] = {}

    def reader() -> None:
        results[1] = run_rank(1, opts, barrier=barrier)

    with OmniPrefixCacheManager(opts.prefix_cache_config(), cache=opts.cache, autostart=False):
        t = threading.Thread(target=reader)
        t0 = time.monotonic()
        t.start()
        while barrier.n_waiting == 0 and t.is_alive():  # until the reader attached and waits at the meeting
            time.sleep(0.01)
        results[0] = run_rank(0, opts, barrier=barrier)
        t.join()
        elapsed = time.monotonic() - t0
    assert "already has a writer" in (results[0].failure or ""), results[0]
    assert results[1].failure == "BrokenBarrierError: ", results[1]
    assert results[1].steps == 0 and elapsed < START_BARRIER_S / 2, elapsed


def test_a_rank_killed_before_the_start_meeting_stops_its_peers_at_once(committer_factory):
    """SIGKILL (an OOM kill while it imports torch, say) leaves no word: RankGroup.wait sees the exit and breaks
    the meeting, so the writer waiting there fails at once instead of waiting out START_BARRIER_S."""
    group = RankGroup(rank_opts(committer_factory().name, tp=2, lockstep=False)).start()
    os.kill(group.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    results = group.wait(WAIT_S)
    assert results[1].failure == f"process exited with {-signal.SIGKILL}", results[1]
    assert results[0].failure == "BrokenBarrierError: " and results[0].steps == 0, results[0]
    assert time.monotonic() - t0 < START_BARRIER_S / 2


def test_second_writer_is_refused(committer):
    """NEWCOMER (2026-12-06): a second writer made in the writer's own process (the old manager not shut down
    after a sticky error) was told only a pid; the refusal now says the writer is this same process."""
    with OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False):
        with pytest.raises(OmniPrefixCacheCommitterError,
                           match=rf"already has a writer \(client \w+, pid {os.getpid()}; that writer is this same "
                                 r"process: shut its manager down"):
            OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False)


def signal_rank_at_step(group: RankGroup, rank: int, sig: int, step: int = 20):
    """(on_progress for ``group.wait``, the list it records into): sends ``sig`` to ``rank`` once it
    reported ``step`` steps."""
    sent: list[int] = []

    def on_progress(r: int, steps: int, _mismatches: int, _refused: int) -> None:
        if r == rank and steps >= step and not sent:
            os.kill(group.procs[rank].pid, sig)
            sent.append(steps)

    return on_progress, sent


def test_a_rank_killed_holding_the_meeting_lock_does_not_hang_the_demo(committer_factory):
    """REVIEW (2026-12-05): a rank SIGKILLed while it held the lockstep barrier's lock (each wait takes it
    for a moment) left it held for good; the demo's abort of the meeting took that lock with no timeout
    and hung, its --timeout-s never firing, and the peers hung at their next meeting. Here the demo's
    barrier stands in for one whose lock died (its abort never returns): the demo stops the other ranks
    and reports at once, long before the peers' own meeting timeout (60 s here) or the demo's (600 s)."""
    from omnishm.demo import launch

    class DeadLock:
        def abort(self) -> None:
            threading.Event().wait()  # the lock a killed rank held: never free again

    group = RankGroup(rank_opts(committer_factory().name, tp=2, lag=0, steps=10_000, commit_timeout_s=60.0))
    group.start()
    real = group.barrier  # kept: the ranks unpickle its semaphores from the parent's, by name
    group.barrier = DeadLock()
    on_progress, killed = signal_rank_at_step(group, 1, signal.SIGKILL, step=10)
    t0 = time.monotonic()
    results = group.wait(600, on_progress)
    assert killed and time.monotonic() - t0 < 45, (time.monotonic() - t0, results)
    assert group._meeting_dead and all(not p.is_alive() for p in group.procs)
    assert results[1].failure == f"process exited with {-signal.SIGKILL}", results[1]
    assert results[0].failure is not None and results[0].steps < 10_000, results[0]
    assert launch.ABORT_WAIT_S < 45
    del real


def test_killing_a_reader_leaves_the_writer_and_the_other_reader_working(committer_factory):
    group = RankGroup(rank_opts(committer_factory().name, lockstep=False, steps=120))
    group.start()
    on_progress, killed = signal_rank_at_step(group, 2, signal.SIGKILL)
    results = group.wait(WAIT_S, on_progress)
    assert killed
    assert results[2].failure is not None
    for r in results[:2]:
        assert r.failure is None and r.mismatches == 0 and set(r.errors) <= {"reused"}, r
        assert r.steps == 120
    assert results[0].errors == {}


def test_a_reader_waiting_for_a_step_the_writer_never_publishes_stops_once_the_writer_left(committer_factory):
    """The writer says goodbye after step 0; the reader, one step ahead, is told within a heartbeat or so,
    instead of waiting out commit_timeout_s (60 s here) for a step that cannot come."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    step0 = [started("a", [0, 1])]
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        with OmniPrefixCacheManager(config, cache=handle.name, autostart=False) as w:
            w.new_step_starts(step0)
            w.materialize(save(w, [Part("a", 1, [0, 1], 0, 8)], BS), ["a"])
            r.new_step_starts(step0)
            out = r.materialize(save(r, [Part("a", 1, [0, 1], 0, 8)], BS), ["a"])
            assert torch.equal(out.hidden_states["a"], rows(1, range(8)))
        # Steps with hits (on a's block 0): only they need the writer's publication.
        r.new_step_starts([finished("a"), started("b", [0, 2], hit=4)])
        ahead = save(r, [Part("b", 2, [0, 2], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError,
                           match=r"writer left the cache \(goodbye, or reaped\) before publishing step 1 "
                                 r"\(published 0\).*step_id=1"):
            r.materialize(ahead, ["b"])
        # Every later wait too, the heartbeat answers saying "no writer" by now (a soak found each later
        # step waiting out the whole timeout).
        r.new_step_starts([finished("b"), started("c", [0, 3], hit=4)])
        further = save(r, [Part("c", 3, [0, 3], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"writer left the cache.*step 2 .*step_id=2"):
            r.materialize(further, ["c"])
    finally:
        r.shutdown()


def test_a_reader_waiting_for_hit_rows_that_never_land_stops_once_the_writer_left(committer_factory):
    """The writer claims and publishes steps 0 and 1 but their rows are never sent (as if it died right
    after the claims), then leaves. A reader's hit on those rows is refused as soon as it sees the writer gone, not
    after commit_timeout_s (60 s here), and names why."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    step0 = [started("a", [0, 1])]
    step1 = [finished("a"), started("b", [0, 2], hit=4)]
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        with OmniPrefixCacheManager(config, cache=handle.name, autostart=False) as w:
            w._send_step = lambda *args, **kw: None  # claimed and published, never sent
            w.new_step_starts(step0)
            w.discard_step(save(w, [Part("a", 1, [0, 1], 0, 8)], BS))
            w.new_step_starts(step1)
            w.discard_step(save(w, [Part("b", 1, [0, 2], 4, 2)], BS))
        r.new_step_starts(step0)
        r.discard_step(save(r, [Part("a", 1, [0, 1], 0, 8)], BS))
        r.new_step_starts(step1)
        hit = save(r, [Part("b", 1, [0, 2], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError,
                           match=r"hit rows not committed before their writer left the cache.*'b'.*step_id=1"):
            r.materialize(hit, ["b"])
    finally:
        r.shutdown()


def assert_refused_within(timeout: float, r: OmniPrefixCacheManager, sid: int, req: str, match: str) -> None:
    """``r.materialize(sid, [req])`` raises (``match``) within 1.5 x ``timeout``: one bound for all its waits."""
    t0 = time.monotonic()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=match):
        r.materialize(sid, [req])
    took = time.monotonic() - t0
    assert took < 1.5 * timeout, f"materialize blocked {took:.2f}s with commit_timeout_s={timeout}"


def test_a_reader_materialize_waits_for_hit_rows_at_most_commit_timeout_s_in_all(committer_factory):
    """A same-step hit whose rows do not land (the committer is stopped): the reader's materialize raises after
    commit_timeout_s in all. It used to wait for its prefetch thread, then start a fresh wait of its own: twice
    the bound (up to three times with the wait for publication)."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    timeout = 2.0
    w = OmniPrefixCacheManager(cfg(commit_timeout_s=30.0), cache=handle.name, autostart=False)
    r = None
    try:
        w.new_step_starts([started("a", [0])])
        w.discard_step(save(w, [Part("a", 1, [0], 0, 4)], BS))
        w.wait_idle()
        r = OmniPrefixCacheManager(cfg(commit_timeout_s=timeout), cache=handle.name, role="reader", autostart=False)
        r.new_step_starts([started("a", [0])])
        r.discard_step(save(r, [Part("a", 1, [0], 0, 4)], BS))
        events = [started("c", [1]), started("d", [1, 2], hit=4)]  # d hits the block c writes in this step
        parts = [Part("c", 3, [1], 0, 4), Part("d", 3, [1, 2], 4, 2)]
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            w.new_step_starts(events)
            sid_w = save(w, parts, BS)
            r.new_step_starts(events)
            assert_refused_within(timeout, r, save(r, parts, BS), "d", r"hit rows not committed within 2.0s.*'d'")
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        assert torch.equal(w.materialize(sid_w, ["d"]).hidden_states["d"], rows(3, range(6)))
    finally:
        if r is not None:
            r.shutdown()
        w.shutdown()


def test_a_reader_mapping_a_key_for_its_first_hit_waits_at_most_commit_timeout_s_in_all(committer_factory):
    """The reader attached before the writer opened the key, so its first hit maps the key (OpenKey) first; the
    committer is stopped. The prefetch thread's OpenKey and materialize's own share materialize's one bound."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    timeout = 2.0
    r = OmniPrefixCacheManager(cfg(commit_timeout_s=timeout), cache=handle.name, role="reader", autostart=False)
    try:
        with OmniPrefixCacheManager(cfg(commit_timeout_s=30.0), cache=handle.name, autostart=False) as w:
            w.new_step_starts([started("a", [0])])
            w.discard_step(save(w, [Part("a", 1, [0], 0, 4)], BS))
            w.wait_idle()  # step 0's rows are in the pool
            assert not r._keys
            r.new_step_starts([started("a", [0])])
            r.discard_step(save(r, [Part("a", 1, [0], 0, 4)], BS))
            events = [finished("a"), started("b", [0, 1], hit=4)]
            w.new_step_starts(events)
            sid_w = save(w, [Part("b", 2, [0, 1], 4, 2)], BS)
            w.wait_idle()  # published
            os.kill(handle.proc.pid, signal.SIGSTOP)
            try:
                r.new_step_starts(events)
                assert_refused_within(timeout, r, save(r, [Part("b", 2, [0, 1], 4, 2)], BS), "b",
                                      r"could not map.*did not answer.*'b'")
            finally:
                os.kill(handle.proc.pid, signal.SIGCONT)
            w.discard_step(sid_w)
    finally:
        r.shutdown()


def test_a_reader_waits_for_a_writer_that_attaches_after_the_previous_writer_left(committer_factory):
    """The cache's previous writer left (its epoch is still in the control segment); a reader starts
    waiting for step 1 (a hit on step 0's rows) before the next writer attaches. Heartbeats answered
    "no writer" meanwhile must not end the wait: the new writer's rows are served once it publishes them."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    OmniPrefixCacheManager(config, cache=handle.name, autostart=False).shutdown()  # epoch 1 attached and left
    step0 = [started("a", [0, 1])]
    step1 = [finished("a"), started("b", [0, 2], hit=4)]
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    got: list = []
    try:
        r.new_step_starts(step0)
        # No hits: the reader's own rows, with no writer to wait for.
        assert torch.equal(r.materialize(save(r, [Part("a", 1, [0, 1], 0, 8)], BS), ["a"]).hidden_states["a"],
                           rows(1, range(8)))
        r.new_step_starts(step1)
        sid = save(r, [Part("b", 2, [0, 2], 4, 2)], BS)
        first = r._link.heartbeats_sent
        reader = threading.Thread(target=lambda: got.append(_outcome(lambda: r.materialize(sid, ["b"]))))
        reader.start()
        deadline = time.monotonic() + 30
        while r._link.writer_ack[0] < first + 2:  # two answers "no writer" while the reader waits
            assert reader.is_alive(), got
            assert time.monotonic() < deadline, "no heartbeat answered"
            time.sleep(0.01)
        with OmniPrefixCacheManager(config, cache=handle.name, autostart=False) as w:
            w.new_step_starts(step0)
            w.materialize(save(w, [Part("a", 1, [0, 1], 0, 8)], BS), ["a"])
            w.new_step_starts(step1)
            w.materialize(save(w, [Part("b", 2, [0, 2], 4, 2)], BS), ["b"])
            reader.join(60)
        assert not reader.is_alive()
        assert torch.equal(got[0].hidden_states["b"], torch.cat([rows(1, range(4)), rows(2, [4, 5])])), got
    finally:
        r.shutdown()


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # the test reports what the reader got, value or error
        return exc


def test_a_rank_stopped_by_sigterm_is_reported_at_once_and_the_others_finish(committer_factory):
    """SIGTERM to one rank: it shuts its client down and exits 143 (128 + SIGTERM) without a result, so
    ``RankGroup.wait`` reports it when it exits rather than after its whole timeout; the others finish."""
    group = RankGroup(rank_opts(committer_factory().name, tp=2, lockstep=False, steps=120))
    group.start()
    on_progress, stopped = signal_rank_at_step(group, 1, signal.SIGTERM)
    results = group.wait(600, on_progress)
    assert stopped
    assert group.procs[1].exitcode == 128 + signal.SIGTERM
    assert results[1].failure == f"process exited with {128 + signal.SIGTERM}", results[1]
    assert results[0].failure is None and results[0].mismatches == 0 and results[0].steps == 120, results[0]


def test_a_reader_that_saw_its_writer_leave_refuses_every_later_step_at_once(committer_factory):
    """The reader attached while the writer was attached (its Welcome named the writer), then heartbeat
    answers said "no writer": each later wait still ends at the next answer, not after commit_timeout_s
    (60 s here). A soak found every step after the first waiting out the whole timeout."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    step0 = [started("a", [0, 1])]
    w = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        for m in (w, r):
            m.new_step_starts(step0)
            m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], BS), ["a"])
        w.shutdown()
        deadline = time.monotonic() + 30
        while r._link.writer_ack[1] != 0:  # a heartbeat answer has said "no writer"
            assert time.monotonic() < deadline, "no heartbeat answered"
            time.sleep(0.01)
        for step, req, block in ((1, "b", 2), (2, "c", 3)):
            r.new_step_starts([started(req, [0, block], hit=4)])  # a hit: only then is the writer waited for
            sid = save(r, [Part(req, step + 1, [0, block], 4, 2)], BS)
            with pytest.raises(OmniPrefixCacheUnmatchError,
                               match=rf"writer left the cache.*before publishing step {step} .*step_id={step}"):
                r.materialize(sid, [req])
    finally:
        w.shutdown()
        r.shutdown()


def test_a_readers_step_without_hits_never_waits_for_its_writer(committer):
    """REVIEW (2026-12-05): a reader's step without hits reads nothing of the writer's, yet its materialize
    waited for the writer's publication of the step. A writer that is late or stuck (a fatal writer
    keeps heartbeating, so it never counts as gone) stalled every such step of every reader's engine
    thread for commit_timeout_s (60 s here), then raised. Now it returns the reader's own rows at once;
    a step with hits still waits, bounded as before."""
    config = cfg(commit_timeout_s=60.0)
    with OmniPrefixCacheManager(config, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(config, cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.materialize(save(m, [Part("a", 1, [0], 0, 4)], BS), ["a"])
        # The writer never saves step 1 (it is alive and attached); the reader runs it alone.
        r.new_step_starts([finished("a"), started("b", [1])])
        sid = save(r, [Part("b", 2, [1], 0, 4)], BS)
        t0 = time.monotonic()
        out = r.materialize(sid, ["b"])
        assert time.monotonic() - t0 < 10, "the reader waited for a publication it does not need"
        assert torch.equal(out.hidden_states["b"], rows(2, range(4)))
        assert out.num_hit_tokens == {"b": 0}


def test_a_key_whose_segments_went_away_before_the_reader_mapped_them_is_a_clear_refusal(committer_factory):
    """REVIEW (2026-12-05): the committer answers the reader's OpenKey, then its segments are unlinked (it
    stopped, or was swept) before the reader maps them: a raw FileNotFoundError escaped materialize. It is
    OmniPrefixCacheUnmatchError naming the request, the tensor and the step."""
    import posix_ipc

    from omnishm import protocol as P

    handle = committer_factory()
    with OmniPrefixCacheManager(cfg(), cache=handle.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg(), cache=handle.name, role="reader", autostart=False) as r:
        ask = r._link.request

        def request(make, *args, **kw):
            reply = ask(make, *args, **kw)
            if isinstance(reply, P.KeyOpened):
                try:
                    posix_ipc.unlink_shared_memory(reply.segments.pool)
                except posix_ipc.ExistentialError:
                    pass  # the prefetch thread's OpenKey came first
            return reply

        r._link.request = request
        ids = [None, None]
        for i, m in enumerate((w, r)):
            m.new_step_starts([started("a", [0, 1])])
            m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
            m.new_step_starts([finished("a"), started("b", [0, 2], hit=4)])
            ids[i] = save(m, [Part("b", 1, [0, 2], 4, 2)], BS)
        w.materialize(ids[0], ["b"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"segments were gone before this reader mapped "
                                                              r"them.*request='b', tensor='[^']+', step_id=1"):
            r.materialize(ids[1], ["b"])


def test_a_step_with_no_tokens_is_saved_alike_on_writer_and_reader(committer):
    """SOAK (2026-12-02): the demo's sim schedules 0-token steps when it starves; the writer's save_outputs
    returns a step id for them, a reader's raised RuntimeError from ``data.reshape(0, -1)`` (a tensor of 0
    elements cannot infer -1) and killed the rank. Every rank must count the same steps."""
    with OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg(), cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        ids = []
        for m in (w, r):
            m.new_step_starts([])
            ids.append(save(m, [], BS))
        assert ids[0] == ids[1]
        for m, sid in zip((w, r), ids):
            out = m.materialize(sid, [])
            assert out.hidden_states == {}


def test_a_reader_never_serves_rows_of_a_writer_that_took_its_writers_place(committer_factory):
    """REVIEW (2026-12-04): the reader's step 1 hits block 0 of its writer's step 0; its writer leaves
    before saving step 1 and a new writer (a new epoch) writes other rows into block 0 and publishes its
    own steps 0 and 1. The reader used to take that publication and those claims for its own and served
    the new writer's rows (tag 9) for the hit. It follows one writer: it refuses at once, naming both."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    w1 = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    w2 = None
    try:
        for m in (w1, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        w1.wait_idle()
        r.new_step_starts([started("b", [0, 1], hit=4)])
        sid = save(r, [Part("b", 1, [0, 1], 4, 2)], BS)
        w1.shutdown()
        w2 = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)
        for step, (req, tag, block) in enumerate((("x", 9, 0), ("y", 7, 2))):
            w2.new_step_starts([started(req, [block])])
            w2.discard_step(save(w2, [Part(req, tag, [block], 0, 4)], BS))
        w2.wait_idle()
        t0 = time.monotonic()
        with pytest.raises(OmniPrefixCacheUnmatchError,
                           match=r"follows \(epoch 1\) was replaced by writer epoch 2 before this reader read "
                                 r"step 1.*step_id=1"):
            r.materialize(sid, ["b"])
        assert time.monotonic() - t0 < 10  # at once, not after commit_timeout_s (60 s)
    finally:
        for m in (w1, r, w2):
            if m is not None:
                m.shutdown()


_AHEAD_STEPS = [([started("a", [0])], [Part("a", 5, [0], 0, 4)]),
                ([started("b", [0, 2], hit=4)], [Part("b", 5, [0, 2], 4, 2)])]
"""A new engine's steps 0 (block 0: tag 5) and 1 (a hit on block 0), for a reader that runs ahead of its writer."""


def _reader_runs_ahead(r: OmniPrefixCacheManager) -> tuple[threading.Thread, list]:
    """``r`` saves ``_AHEAD_STEPS`` and materializes step 1 on a thread, which must still wait a second later
    (no writer of its own yet). Returns the thread and the list its outcome lands in."""
    sids = []
    for events, parts in _AHEAD_STEPS:
        r.new_step_starts(events)
        sids.append(save(r, parts, BS))
    r.discard_step(sids[0])
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_outcome(lambda: r.materialize(sids[1], ["b"]))))
    reader.start()
    reader.join(1.0)
    assert reader.is_alive(), f"served before its writer attached: {got}"
    return reader, got


def _writer_catches_up(w: OmniPrefixCacheManager, reader: threading.Thread, got: list) -> None:
    """``w`` runs ``_AHEAD_STEPS``; the waiting reader then gets its own writer's rows (tag 5)."""
    for events, parts in _AHEAD_STEPS:
        w.new_step_starts(events)
        w.discard_step(save(w, parts, BS))
    reader.join(60)
    assert not reader.is_alive()
    assert not isinstance(got[0], Exception), got
    assert torch.equal(got[0].hidden_states["b"], expect(5, 4, 5, 4, 2))
    assert torch.equal(got[0].mm_outputs["b"]["feat"], expect(5, 4, 5, 4, 2, mm=True))


def test_a_reader_ahead_of_its_writer_ignores_the_previous_writers_publication(committer_factory):
    """REVIEW (2026-12-04): an earlier engine's writer ran steps 0 and 1 (block 0: tag 1) and left; its
    publication of step 1 stays in the control segment. A new engine's reader runs its steps 0 (block 0:
    tag 5) and 1 (a hit on block 0) before its own writer attached. It used to take the stale publication
    and the old claims for its own and served tag 1 rows at once. It waits for its writer, and serves
    that writer's rows (tag 5) once they land."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5")
    config = cfg(commit_timeout_s=60.0)
    with OmniPrefixCacheManager(config, cache=handle.name, autostart=False) as w0:
        for tag, blocks in ((1, [0]), (2, [1])):
            w0.new_step_starts([started(f"o{tag}", blocks)])
            w0.discard_step(save(w0, [Part(f"o{tag}", tag, blocks, 0, 4)], BS))
        w0.wait_idle()
    r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
    try:
        reader, got = _reader_runs_ahead(r)
        with OmniPrefixCacheManager(config, cache=handle.name, autostart=False) as w1:
            _writer_catches_up(w1, reader, got)
    finally:
        r.shutdown()


_KILLED_ENGINES_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from manager_helpers import small_config, Part, save, started
from omnishm.client import OmniPrefixCacheManager
w = OmniPrefixCacheManager(small_config(commit_timeout_s=60.0), cache=sys.argv[1], autostart=False)
for tag, blocks in ((1, [0]), (2, [1])):
    w.new_step_starts([started(f"o{tag}", blocks)])
    w.discard_step(save(w, [Part(f"o{tag}", tag, blocks, 0, 4)], 4))
w.wait_idle()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_reader_never_follows_a_killed_engines_writer_that_still_holds_the_seat(committer_factory):
    """REVIEW (2026-12-04, of the fix above): the earlier engine's writer ran steps 0 and 1 (block 0: tag 1)
    and was SIGKILLed; until it is reaped it still holds the writer seat, and a new reader's Welcome names
    it. The new engine's reader saves steps 0 and 1 (a hit on block 0) before its own writer can attach.
    Bound to the writer the Welcome named, it took the dead writer's publication and served tag 1 rows
    at once, and after its own writer came it refused every step. A reader follows only a writer seen
    alive since it attached (attached later, or published since): it waits, serves its own writer's rows
    (tag 5), and goes on with it."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "2")
    config = cfg(commit_timeout_s=60.0)
    old = subprocess.Popen([sys.executable, "-c", _KILLED_ENGINES_WRITER, handle.name, str(Path(__file__).parent)],
                           stdout=subprocess.PIPE, text=True)
    r = w = None
    try:
        assert old.stdout.readline().strip() == "ready"
        r = OmniPrefixCacheManager(config, cache=handle.name, role="reader", autostart=False)
        old.kill()
        old.wait()
        reader, got = _reader_runs_ahead(r)
        w = OmniPrefixCacheManager(config, cache=handle.name, autostart=False)  # once the dead one is reaped
        _writer_catches_up(w, reader, got)
        for m in (w, r):  # and the next step in lockstep too
            m.new_step_starts([started("c", [3])])
        w.discard_step(save(w, [Part("c", 6, [3], 0, 4)], BS))
        out = r.materialize(save(r, [Part("c", 6, [3], 0, 4)], BS), ["c"])
        assert torch.equal(out.hidden_states["c"], rows(6, range(4)))
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
        for m in (r, w):
            if m is not None:
                m.shutdown()


@pytest.mark.parametrize("ids", [["d"], ["e", "d", "d"]], ids=["one", "duplicates-and-no-hit"])
def test_a_readers_prefetched_hit_is_its_result_not_copied_again(committer, ids):
    """A reader's prefetch read a hit into a buffer of its own, which materialize copied into the result
    (a second copy of every hit row on the reader's engine thread: 32 MiB took 5.9 ms, now 0.7 ms). The
    prefetch now makes the request's whole result, hit rows in place, and materialize adds the step's
    rows and returns it. A request named twice gets a result of its own the second time."""
    cfg = small_config()
    w = OmniPrefixCacheManager(cfg, cache=committer.name, role="writer", autostart=False)
    r = OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False)
    handle = r._prefetcher._handle
    made: dict = {}

    class Recording(dict):
        def __setitem__(self, key, value):
            made[key] = value.data_ptr()
            super().__setitem__(key, value)

    prefetched = threading.Event()

    def recording(ctx):
        ctx.prefetched = Recording()
        handle(ctx)
        prefetched.set()  # as during the forward: it has read by the time the engine materializes

    r._prefetcher._handle = recording
    try:
        sid = hit_beside_plain(w, r)
        assert prefetched.wait(30)  # the first step had no hits: it was never handed to the prefetch
        out = r.materialize(sid, ids)
        assert torch.equal(out.hidden_states["d"], expect(1, 4, 4, 4, 2))
        assert torch.equal(out.mm_outputs["d"]["feat"], expect(1, 4, 4, 4, 2, mm=True))
        if "e" in ids:
            assert torch.equal(out.hidden_states["e"], expect(0, 0, 5, 0, 3))
        assert r.counters["prefetch_used"] >= 2
        if ids == ["d"]:  # the prefetch's buffers are the results
            assert out.hidden_states["d"].data_ptr() == made[("d", HIDDEN_KEY)]
            assert out.mm_outputs["d"]["feat"].data_ptr() == made[("d", "feat")]
    finally:
        r.shutdown()
        w.shutdown()


def test_a_readers_prefetched_hit_rows_fill_its_out_buffers(committer):
    """MUTATION (2026-12-06): a reader whose prefetch had read a request's hit, asked for it with ``out=``, must
    copy the prefetched hit rows into the caller's buffers; skipping that copy survived the suite, and left
    the buffers' old contents as the hit's rows."""
    cfg = small_config()
    w = OmniPrefixCacheManager(cfg, cache=committer.name, role="writer", autostart=False)
    r = OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False)
    handle = r._prefetcher._handle
    prefetched = threading.Event()

    def recording(ctx):
        handle(ctx)
        prefetched.set()

    r._prefetcher._handle = recording
    try:
        sid = hit_beside_plain(w, r)
        assert prefetched.wait(30)
        out = {"d": {HIDDEN_KEY: torch.full((6, 8), -7.0), "feat": torch.full((6, 3), -7.0)}}
        res = r.materialize(sid, ["d"], out=out)
        assert torch.equal(out["d"][HIDDEN_KEY], expect(1, 4, 4, 4, 2))
        assert torch.equal(out["d"]["feat"], expect(1, 4, 4, 4, 2, mm=True))
        assert res.hidden_states["d"].data_ptr() == out["d"][HIDDEN_KEY].data_ptr()
        assert r.counters["prefetch_used"] >= 1
    finally:
        r.shutdown()
        w.shutdown()


def _writer_and_reader(committer):
    return (OmniPrefixCacheManager(cfg(), cache=committer.name, autostart=False),
            OmniPrefixCacheManager(cfg(), cache=committer.name, role="reader", autostart=False))


@pytest.mark.parametrize("into_out", [False, True], ids=["result", "out-buffers"])
def test_a_reader_given_other_block_ids_than_its_writer_refuses_the_hit(committer, into_out):
    """REVIEW (2026-12-06): a reader whose scheduler output named another block for a hit than its writer's
    served that block's rows, another request's (x's), as b's prefix, with no error. The writer records each
    step's hit plan (``P.CTL_HITS_RING``) and a reader serves no hit row of a step whose plan is not its own,
    whether ``materialize`` makes the result or fills the caller's ``out=`` buffers (stop 52's mutation review:
    nothing pinned the check, and the publication wait before it, for ``out=``)."""
    w, r = _writer_and_reader(committer)
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0]), started("x", [1])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4), Part("x", 7, [1], 0, 4)], BS))
        w.new_step_starts([started("b", [0, 2], hit=4)])
        r.new_step_starts([started("b", [1, 2], hit=4)])  # the reader's output names x's block for b's hit
        ids = [save(m, [Part("b", 1, [0, 2], 4, 2)], BS) for m in (w, r)]
        assert torch.equal(w.materialize(ids[0], ["b"]).hidden_states["b"], expect(1, 4, 1, 4, 2))
        out = {"b": {HIDDEN_KEY: torch.full((6, WIDTH), -7.0), "feat": torch.full((6, MM_WIDTH), -7.0)}} if into_out \
            else None
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"ranks disagree .*planned other hits") as err:
            r.materialize(ids[1], ["b"], out=out)
        assert "request='b'" in str(err.value) and f"step_id={ids[1]}" in str(err.value)
    finally:
        w.shutdown()
        r.shutdown()


def test_a_reader_whose_step_ids_ran_ahead_of_its_writers_refuses_the_hit(committer):
    """REVIEW (2026-12-06): a reader that saved one step more than its writer read its hit of step 2 after the
    writer's own step 2 had given the hit's block to c: c's claim carries step 2, not later than the reader's
    step, and the reader served c's rows as b's prefix. The writer's step 2 planned no hit, so the reader
    refuses; a ring entry overwritten by a later step (a reader far behind) is refused too."""
    w, r = _writer_and_reader(committer)
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        r.new_step_starts([])  # a step the writer never made
        r.discard_step(save(r, [], BS))
        hit = [finished("a"), started("b", [0, 2], hit=4)]
        w.new_step_starts(hit)
        w.discard_step(save(w, [Part("b", 1, [0, 2], 4, 2)], BS))
        w.new_step_starts([aborted("b"), started("c", [0])])
        w.discard_step(save(w, [Part("c", 9, [0], 0, 4)], BS))
        w.wait_idle()
        r.new_step_starts(hit)
        sid = save(r, [Part("b", 1, [0, 2], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"ranks disagree .*the writer planned no hit"):
            r.materialize(sid, ["b"])
        # The writer's entry for the reader's next step, overwritten as by one CTL_HITS_RING steps later.
        from omnishm import protocol
        from omnishm.versions import make_cv

        w.new_step_starts([])
        w.discard_step(save(w, [], BS))  # published: the reader's wait for it ends
        r.new_step_starts([started("d", [0, 3], hit=4)])
        sid = save(r, [Part("d", 9, [0, 3], 4, 2)], BS)
        at = 2 * (sid % protocol.CTL_HITS_RING)
        w._hits_ring[at + 1] = 12345
        w._hits_ring[at] = make_cv(w._epoch, sid + protocol.CTL_HITS_RING, 0)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"record of this step was overwritten"):
            r.materialize(sid, ["d"])
        # An entry caught mid-write after its step was published is a later step's too.
        w.new_step_starts([])
        w.discard_step(save(w, [], BS))
        r.new_step_starts([started("e", [0, 3], hit=4)])
        sid = save(r, [Part("e", 9, [0, 3], 4, 2)], BS)
        w._hits_ring[2 * (sid % protocol.CTL_HITS_RING)] = -1
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"record of this step was overwritten"):
            r.materialize(sid, ["e"])
    finally:
        w.shutdown()
        r.shutdown()


def test_two_hit_plans_never_share_a_digest_through_an_id_that_holds_other_fields():
    """REVIEW (2026-12-06): request ids went into the digest without their length, so a reader's one request
    whose id held NUL, a length and a block number ("a\\0...b") hashed as its writer's two requests "a" and "b",
    and was served x's rows. Every field goes in with its length first."""
    from omnishm.client.steps import HitSpan, hits_digest

    def span(blocks):
        return HitSpan(slots=(torch.tensor(blocks)[:, None] * BS + torch.arange(BS)).reshape(-1), cvs={})

    crafted = "a\0" + BS.to_bytes(8, "little").decode("latin-1") + (0).to_bytes(8, "little").decode("latin-1") + "b"
    assert hits_digest({"a": span([0]), "b": span([1])}, BS) != hits_digest({crafted: span([1])}, BS)
    # Without a NUL: the id's own length must go in too (mutation review, stop 59: leaving it out passed).
    bare = "a" + BS.to_bytes(8, "little").decode("latin-1") + (0).to_bytes(8, "little").decode("latin-1") + "b"
    assert hits_digest({"a": span([0]), "b": span([1])}, BS) != hits_digest({bare: span([1])}, BS)
    assert hits_digest({"a": span([0]), "b": span([1])}, BS) == hits_digest({"b": span([1]), "a": span([0])}, BS)
    assert hits_digest({"a": span([0, 1])}, BS) != hits_digest({"a": span([1, 0])}, BS)


def test_hit_plans_that_differ_in_a_later_block_or_in_hit_length_have_other_digests():
    """The readers' plan check (``_check_same_plan``) compares ``hits_digest`` of the writer's plan with its own:
    every block of every hit, and each hit's length, must go into it, else a reader whose plan differs from its
    writer's only past the first block (or in length) passes the check and serves rows of the writer's blocks
    for its own. MUTATIONS (stop 47): only the first slot hashed (``slots[:1]``); the hit length left out."""
    from omnishm.client.steps import HitSpan, hits_digest

    def span(blocks, n=None):
        slots = (torch.tensor(blocks)[:, None] * BS + torch.arange(BS)).reshape(-1)
        return HitSpan(slots=slots[:n] if n is not None else slots, cvs={})

    assert hits_digest({"a": span([0, 1])}, BS) != hits_digest({"a": span([0, 2])}, BS)
    assert hits_digest({"a": span([0, 1, 2])}, BS) != hits_digest({"a": span([0, 1, 3])}, BS)
    assert hits_digest({"a": span([5, 1])}, BS) != hits_digest({"a": span([5, 1], n=BS + 1)}, BS)
    assert hits_digest({"a": span([5, 1])}, BS) == hits_digest({"a": span([5, 1])}, BS)


def test_a_readers_shutdown_stops_its_prefetch_thread(committer):
    """``shutdown`` stops every helper thread the manager started: after a reader's shutdown returns, its
    ``omnishm-prefetch`` thread is gone (no thread, and no late prefetch touching a closed link or unmapped
    keys, outlives the manager; a process that makes a manager per engine would gather one thread per
    engine). MUTATION (stop 47): ``_stop_threads`` skipping the prefetcher left the thread running for good."""
    before = {t for t in threading.enumerate() if t.name == "omnishm-prefetch"}
    r = OmniPrefixCacheManager(small_config(), cache=committer.name, role="reader", autostart=False)
    mine = [t for t in threading.enumerate() if t.name == "omnishm-prefetch" and t not in before]
    assert len(mine) == 1 and mine[0].is_alive()
    r.shutdown()
    assert not mine[0].is_alive(), "the reader's prefetch thread outlived its shutdown"


def test_a_plan_refusal_names_the_hit_request_asked_for(committer):
    """Mutation review (stop 56): the reader's scheduler output names another block for c's hit than its
    writer's; a reader asked for c alone refuses naming c, not b, which it was not asked for."""
    w, r = _writer_and_reader(committer)
    try:
        for m in (w, r):
            m.new_step_starts([started("a", [0]), started("x", [1])])
            m.discard_step(save(m, [Part("a", 1, [0], 0, 4), Part("x", 7, [1], 0, 4)], BS))
        w.new_step_starts([started("b", [0, 2], hit=4), started("c", [0, 3], hit=4)])
        r.new_step_starts([started("b", [0, 2], hit=4), started("c", [1, 3], hit=4)])  # c: x's block on the reader
        parts = [Part("b", 1, [0, 2], 4, 2), Part("c", 1, [0, 3], 4, 2)]
        ids = [save(m, parts, BS) for m in (w, r)]
        assert torch.equal(w.materialize(ids[0], ["c"]).hidden_states["c"], expect(1, 4, 1, 4, 2))
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"ranks disagree") as err:
            r.materialize(ids[1], ["c"])
        assert "request='c'" in str(err.value), err.value
    finally:
        w.shutdown()
        r.shutdown()


def test_a_reader_save_failing_after_its_id_was_issued_takes_that_id_only(committer, monkeypatch):
    """A reader's save that fails after it issued its step id loses that step alone, and its next save gets the
    writer's next id (mutation review, stop 59: with the burn's ``_next_step == step_id`` guard gone the failed
    save was burnt too, the reader's ids ran one ahead of its writer's, and its next step read the claims of a
    step the writer had not saved yet as its own)."""
    cfg = small_config()
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        real = r._follow_writer

        def fail():  # called by a reader's save only after it issued the step id
            raise RuntimeError("injected: a reader's save fails after its id was issued")

        w.new_step_starts([started("a", [0])])
        w.discard_step(save(w, [Part("a", 1, [0], 0, 4)], BS))
        r.new_step_starts([started("a", [0])])
        monkeypatch.setattr(r, "_follow_writer", fail)
        with pytest.raises(RuntimeError, match="injected"):
            save(r, [Part("a", 1, [0], 0, 4)], BS)
        monkeypatch.setattr(r, "_follow_writer", real)
        assert r.unconsumed_step_ids() == []
        for m in (w, r):
            m.new_step_starts([started("b", [1])])
        ws, rs = save(w, [Part("b", 2, [1], 0, 4)], BS), save(r, [Part("b", 2, [1], 0, 4)], BS)
        assert ws == rs == 1
        w.discard_step(ws)
        assert torch.equal(r.materialize(rs, ["b"]).hidden_states["b"], expect(0, 0, 2, 0, 4))
