"""The client's attach and resume at their edges (``omnishm/client/attach.py``, ``link_io.py``).

Each test kills a mutant that survived the rest of the suite (mutation review, 2026-12-06): heartbeats in
flight at a loss, staging named by a Welcome, a committer still starting, the pacing of a failed launch, a
refused resume inside the drain, and silence judged across an I/O-thread stall. Real committer processes
(``committer_factory``, autostart), real ZeroMQ, real shared memory.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import unique_cache_name
from helpers import io_thread_parked, until
from manager_helpers import small_config
from omnishm import liveness, shm
from omnishm import protocol as P
from omnishm.client import OmniPrefixCacheManager
from omnishm.client import attach as attach_mod
from omnishm.client.link import CommitterLink
from omnishm.interface import OmniPrefixCacheCommitterError

LAYOUT = P.Layout(num_blocks=8, block_size=4)


def test_heartbeats_in_flight_when_the_committer_is_lost_are_failed_not_kept(committer_factory):
    """``_lost`` fails every heartbeat still unanswered when the committer goes ("heartbeat lost") and drops it
    from the link's pending table: a heartbeat is never re-sent by a resume, so one kept there would never be
    answered, its future would never settle, and it would hold a place among the ``MAX_IN_FLIGHT`` requests and
    count as the oldest unanswered request in the silence check for the rest of the link's life. The link
    notices a SIGKILLed committer right after submitting a heartbeat (the identity check follows the submit),
    so at least one heartbeat is in flight at the loss. After the resume nothing sent before it may remain."""
    fast = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "60")
    first = committer_factory(*fast)
    link = CommitterLink(cache=first.name, role=P.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0)
    try:
        beats = []
        submit = link.submit

        def watch(make, **kw):  # note every heartbeat's future
            fut = submit(make, **kw)
            if kw.get("bounded") is False:
                beats.append(fut)
            return fut

        link.submit = watch
        resumed_at = []
        on_resume = link._on_resume_reply

        def note(reply):
            resumed_at.append(time.monotonic())
            on_resume(reply)

        link._on_resume_reply = note
        until(lambda: len(beats) >= 2, 5.0, "two heartbeats")
        first.stop(signal.SIGKILL)
        committer_factory(*fast, name=first.name)  # adopts the cache: this link holds the liveness lock
        until(lambda: link.dead is not None or link.stats["reconnects"] > 0, 15.0, "the resume")
        assert link.dead is None, link.dead
        t = resumed_at[0]
        with link._plock:
            stale = [rid for rid, e in link._pending.items() if e.sent_at < t]
        assert stale == [], f"requests from before the resume still pending: {stale}"
        lost = [f for f in beats if f.done() and f.exception() is not None]
        assert lost and "heartbeat lost" in str(lost[0].exception())
    finally:
        link.close()


def test_a_writer_names_the_staging_its_welcome_gave_it_when_it_resumes(committer_factory):
    """A writer that attaches to a cache whose keys exist already gets its staging segments in the
    ``Welcome`` (``KeySegments.staging``), not in a ``KeyOpened``; the link records them too
    (``_adopt_welcome``) and names them in its resume ``Hello``. A restarted committer that lost one of them
    refuses the resume (the writer would stage into a segment nobody reads). Not recorded, the resume named no
    staging, which the committer's subset check accepts: the session was welcomed with a staging gone."""
    fast = ("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    first = committer_factory(*fast)
    opener = CommitterLink(cache=first.name, role=P.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                           staging_rows=4, reconnect_timeout_s=20.0)
    try:
        opener.request(lambda rid: P.OpenKey(rid=rid, key="k0", dtype="float32", width=4))
    finally:
        opener.close()
    link = CommitterLink(cache=first.name, role=P.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                         staging_rows=4, reconnect_timeout_s=20.0)
    try:
        staging = [k.staging for k in link.welcome.keys if k.staging]
        assert len(staging) == 1, link.welcome.keys
        first.stop(signal.SIGKILL)
        assert shm.unlink_segment(staging[0])
        committer_factory(*fast, name=first.name)  # adopts the cache: this link holds the liveness lock
        until(lambda: link.dead is not None or link.stats["reconnects"] > 0, 15.0, "the resume's answer")
        assert link.dead is not None and "cannot resume writer" in link.dead and staging[0] in link.dead, \
            (link.dead, dict(link.stats))
    finally:
        link.close()


def test_a_committer_still_starting_is_waited_for_not_joined_by_another(tmp_path, monkeypatch):
    """``_autostart_if_down`` starts no committer while one this link started still runs: a start under
    load takes seconds, and the first ``Hello`` is sent again every ``HELLO_RETRY_S``; each retry must wait
    for the committer still starting, not start another (seen: four committers for one cache of a TP=2
    engine). The autostarted committer is held stopped (SIGSTOP) until the first retry's autostart check
    ran, so it has not taken the cache lock then; it is then let go, and exactly one was started."""
    started: list = []
    real_start = attach_mod.start_committer

    def start(*a, **kw):
        proc = real_start(*a, **kw)
        os.kill(proc.pid, signal.SIGSTOP)  # still starting: alive, no lock yet
        started.append(proc)
        return proc

    checks = []
    real_check = attach_mod.LinkAttach._autostart_if_down

    def check(self, now, **kw):
        real_check(self, now, **kw)
        checks.append(now)
        if len(checks) == 2:  # the first Hello's retry: let the committer(s) start now
            for proc in started:
                os.kill(proc.pid, signal.SIGCONT)

    monkeypatch.setattr(attach_mod, "start_committer", start)
    monkeypatch.setattr(attach_mod.LinkAttach, "_autostart_if_down", check)
    name = unique_cache_name("slow")
    runtime = tmp_path / "rt"
    m = None
    try:
        m = OmniPrefixCacheManager(small_config(), cache=name, autostart=True, runtime_dir=runtime,
                                   connect_timeout_s=60.0)
        assert len(checks) >= 2
        assert len(started) == 1, f"{len(started)} committers started for one cache"
        assert m._link.welcome.committer_pid == started[0].pid
    finally:
        for proc in started:
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)
        if m is not None:
            m.shutdown()
    until(lambda: not liveness.cache_is_live(runtime, name) and not any(p.alive() for p in started), 30,
          "the autostarted committer's exit")
    assert shm.list_segments(name) == []


def test_a_launch_that_failed_is_tried_again_only_after_five_seconds(tmp_path, monkeypatch):
    """A committer launch that fails (``start_committer`` raises ``OSError``: no shell, a launcher that hung)
    is tried again 5 s later, not at every retry of the first ``Hello`` (every ``HELLO_RETRY_S``): each try
    costs a fork and up to the launcher's 10 s timeout on the engine thread. Within a 4.5 s
    ``connect_timeout_s`` one launch is tried, and the constructor's error names why it failed."""
    tries = []

    def start(*a, **kw):
        tries.append(time.monotonic())
        raise OSError("no launcher here (test)")

    monkeypatch.setattr(attach_mod, "start_committer", start)
    with pytest.raises(OmniPrefixCacheCommitterError, match="could not be launched: no launcher here"):
        OmniPrefixCacheManager(small_config(), cache=unique_cache_name("nolaunch"), autostart=True,
                               runtime_dir=tmp_path / "rt", connect_timeout_s=4.5)
    assert len(tries) == 1, f"{len(tries)} launches within 4.5 s"


def test_a_refused_resume_leaves_the_link_dead_for_that_reason_and_its_thread_running(committer_factory):
    """A refused resume makes the link dead (``_go_dead`` closes its socket) from inside ``_drain``; the
    drain must then stop at the closed socket (``_sock is None``) rather than receive from it. Receiving
    raised in the I/O thread, which ended it and replaced the link's reason (the refusal, which names the
    lost staging) with "the link's I/O thread failed: AttributeError". Pinned: the reason stays the
    refusal, and the I/O thread still comes round its loop afterwards."""
    fast = ("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    first = committer_factory(*fast)
    link = CommitterLink(cache=first.name, role=P.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                         staging_rows=4, reconnect_timeout_s=20.0)
    try:
        staging = link.request(lambda rid: P.OpenKey(rid=rid, key="k0", dtype="float32", width=4)).segments.staging
        first.stop(signal.SIGKILL)
        assert shm.unlink_segment(staging)
        committer_factory(*fast, name=first.name)  # adopts the cache, refuses this writer's resume
        until(lambda: link.dead is not None, 15.0, "the refused resume")
        with io_thread_parked(link):  # the I/O thread still runs its loop
            pass
        assert "cannot resume writer" in link.dead and "I/O thread failed" not in link.dead, link.dead
    finally:
        link.close()


def test_silence_is_not_judged_over_a_stall_of_the_link_thread(committer_factory):
    """``_note_stall``: after its I/O thread did not run for longer than the heartbeat timeout (a frozen or
    CPU-starved process), the link judges the committer's silence again from the stall's end, so a request
    sent before the stall whose answer is not readable yet does not make it give the committer up at once.
    Here the I/O thread is held for 1.5 s (the link's heartbeat timeout is 1 s) while the committer is
    stopped with a Status request unanswered; when the thread runs again the committer has not been silent
    for 1 s since the stall ended, and the link must stay connected (it counts the stall) and get its answer."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0, heartbeat_timeout_s=1.0)
    stopped = False
    try:
        with io_thread_parked(link):
            handle.proc.send_signal(signal.SIGSTOP)
            stopped = True
            fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
            t0 = time.monotonic()
            until(lambda: time.monotonic() - t0 > 1.5, 5.0, "the stall")  # the stall itself is what is tested
        with io_thread_parked(link):  # the thread ran one whole pass after the stall, silence check included
            pass
        assert link.stats["io_stalls"] >= 1
        assert link.stats["committer_lost"] == 0, link._lost_reason
        handle.proc.send_signal(signal.SIGCONT)
        stopped = False
        assert isinstance(fut.result(timeout=10), P.StatusReply)
    finally:
        if stopped:
            handle.proc.send_signal(signal.SIGCONT)
        link.close()
