"""The client link shared by threads: each caller sends on its own thread under the socket lock.

A real committer process; several threads submit at once, in bursts that fill the socket (the
outbox path), while the I/O thread receives. Every request gets exactly its own reply.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from omnishm import paths, protocol, shm
from omnishm.client import OmniPrefixCacheManager
from omnishm.client.link import CommitterLink
from omnishm.interface import OmniPrefixCacheCommitterError

from manager_helpers import Part, extended, save, small_config, started

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def test_callers_on_many_threads_each_get_their_own_replies(committer):
    link = CommitterLink(cache=committer.name, role=protocol.ROLE_READER, endpoint=committer.endpoint,
                         layout=LAYOUT)
    errors: list[str] = []
    answered = [0] * 6

    def round_trips(i: int) -> None:
        try:
            for _ in range(150):
                fut = link.submit(lambda rid: protocol.StatusRequest(rid=rid))
                reply = fut.result(timeout=30)
                if not isinstance(reply, protocol.StatusReply) or reply.rid != fut.rid:
                    errors.append(f"thread {i}: request {fut.rid} got {reply!r}")
                answered[i] += 1
        except Exception as exc:  # reported below, with the thread
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    def burst(i: int) -> None:
        try:
            # More than the socket's send high-water mark (1000) at once: some wait in the outbox.
            futs = [link.submit(lambda rid: protocol.StatusRequest(rid=rid)) for _ in range(1500)]
            for fut in futs:
                reply = fut.result(timeout=60)
                if reply.rid != fut.rid:
                    errors.append(f"burst {i}: request {fut.rid} got the reply of {reply.rid}")
            answered[i] += len(futs)
        except Exception as exc:  # reported below, with the thread
            errors.append(f"burst {i}: {type(exc).__name__}: {exc}")

    try:
        threads = [threading.Thread(target=round_trips, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=burst, args=(i,)) for i in (4, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller hung"
        assert errors == []
        assert answered == [150] * 4 + [1500] * 2
        assert link.dead is None and link.stats["committer_lost"] == 0
    finally:
        link.close()


def test_a_client_that_went_silent_is_told_so_not_that_the_committer_was_lost(committer_factory):
    """The link's I/O thread stalls past the committer's heartbeat timeout (here: its socket lock is held, as a
    frozen process would): the committer reaps the session and refuses the resume. The committer never went
    away, so the error says this client went silent and names the committer as still running."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_WRITER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=8, reconnect_timeout_s=10.0)  # a writer: its staging is gone once reaped
    try:
        with link._slock:  # no heartbeat leaves while this is held
            deadline = time.monotonic() + 10
            while "reaped after" not in handle.log():
                assert time.monotonic() < deadline, handle.log()
                time.sleep(0.05)
        deadline = time.monotonic() + 20
        while link.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.dead is not None
        assert "this client" in link.dead and "went silent" in link.dead, link.dead
        assert f"pid {handle.proc.pid}, still running" in link.dead and "reaped" in link.dead, link.dead
    finally:
        link.close()


def test_a_stall_of_this_clients_own_io_thread_is_not_taken_for_a_silent_committer(committer_factory):
    """The writer's I/O thread stalls (a starved or frozen engine process; here its socket lock is held) with a
    quiet step write pending, which the committer acknowledges in the control word, never by a reply. No
    heartbeat left during the stall, so none was answered; the link used to count the quiet write as a
    request left unanswered and declared the committer lost, then resumed. Seen in the vLLM tier: "writer
    client ... resumed" in a committer's log with nothing wrong on its side, 10 to 30 s into a test on a
    2-vCPU machine full of vLLM's busy-waiting processes. The client here judges silence after 1 s, the
    committer reaps after 30 s: the stall is long only to this client."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "30")
    m = OmniPrefixCacheManager(small_config(), cache=handle.name, endpoint=handle.endpoint, autostart=False)
    try:
        link = m._link
        link._heartbeat_timeout_s = 1.0
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], 4))
        deadline = time.monotonic() + 10
        while True:
            link._slock.acquire()
            # Under the socket lock nothing is sent: with only the quiet write pending, no reply is on its way
            # that would count as heard once the stall ends.
            with link._plock:
                only_quiet = all(e.marker for e in link._pending.values())
            if only_quiet:
                break
            link._slock.release()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        try:
            assert len(link._pending) == 1  # the quiet write, settled from the control word by the next step, not before
            stalled = time.monotonic()
            while time.monotonic() - stalled < 3 * link._heartbeat_timeout_s:  # the stall
                time.sleep(0.01)
        finally:
            link._slock.release()
        beats = link.heartbeats_sent
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < beats + 20:  # two seconds of heartbeats after the stall, each answered
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert link.stats["committer_lost"] == 0 and link.stats["resume_attempts"] == 0, link.stats
        assert link.stats["io_stalls"] >= 1, link.stats  # and it said so
        assert "resumed" not in handle.log(), handle.log()
        m.new_step_starts([extended("a", 8, (2,))])
        m.discard_step(save(m, [Part("a", 1, [0, 1, 2], 8, 2)], 4))
        m.wait_idle(timeout_s=10)
    finally:
        m.shutdown()


def test_after_a_stall_of_its_own_the_link_judges_the_committers_silence_afresh(committer_factory):
    """A frozen client process: libzmq's thread stood still too, so the answer to a heartbeat sent just before
    may not be readable for a moment after. Modelled with the committer stopped while the link's I/O thread
    stalls, and let go 0.3 s after the stall ends: the heartbeat pending from before the stall is older than
    the link's timeout, but the time it did not listen is not counted, and the answer comes in time."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "30")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=0, heartbeat_timeout_s=1.0)
    try:
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            with link._slock:
                deadline = time.monotonic() + 10
                while True:  # a heartbeat the stopped committer has not answered, then the stall
                    with link._plock:
                        if link._pending:
                            break
                    assert time.monotonic() < deadline
                    link._slock.release()
                    time.sleep(0.01)
                    link._slock.acquire()
                stalled = time.monotonic()
                while time.monotonic() - stalled < 3.0:
                    time.sleep(0.01)
            released = time.monotonic()
            while time.monotonic() - released < 0.3:
                time.sleep(0.01)
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        beats = link.heartbeats_sent
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < beats + 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert link.stats["committer_lost"] == 0 and link.stats["io_stalls"] >= 1, link.stats
    finally:
        link.close()


def test_a_closing_link_sends_no_heartbeat_after_its_goodbye_and_loses_no_session(committer_factory):
    """A heartbeat the I/O thread sent after ``close``'s Goodbye was answered ``no_session`` (the session is
    gone), and the I/O thread took that for a lost committer: a warning, a resume, and, when the committer
    had already exited, an autostart of a committer for the cache being left. Found with a real TP=2 vLLM
    engine (2 of 46 cache switches). Heartbeats every 10 ms make the window wide."""
    handle = committer_factory("--heartbeat-s", "0.01", "--heartbeat-timeout-s", "5")
    lost = 0
    for _ in range(40):
        link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                             staging_rows=0)
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < 2:  # heartbeats flowing, as in a running engine
            assert time.monotonic() < deadline
            time.sleep(0.001)
        link.close()
        lost += link.stats["committer_lost"]
    assert lost == 0
    assert "no_session" not in handle.log(), handle.log()


def test_close_ends_at_once_when_its_goodbye_is_answered_no_session(committer_factory):
    """The committer was restarted (SIGKILL, then a start that adopts the cache) and the link has not noticed
    yet (heartbeats every 30 s). close()'s Goodbye reaches the new committer, which answers no_session; that
    answer completes the Goodbye instead of being taken for a lost session, so close() does not wait out its
    timeout (review of the closing-link change)."""
    first = committer_factory("--heartbeat-s", "30", "--heartbeat-timeout-s", "120")
    link = CommitterLink(cache=first.name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                         staging_rows=0)
    first.proc.kill()
    first.proc.wait()
    committer_factory("--heartbeat-s", "30", "--heartbeat-timeout-s", "120", name=first.name)  # adopts the cache
    t0 = time.monotonic()
    link.close()
    assert time.monotonic() - t0 < 2.0


def test_gauges_that_raise_leave_the_heartbeats_going(committer_factory):
    """The manager's gauges were read before its staging pages existed: the AttributeError ended the
    link's I/O thread, and with it every reply (the next request waited out its 60 s)."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "30")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=0)
    calls = []

    def broken() -> dict:
        calls.append(1)
        raise AttributeError("no _pages yet")

    link.gauges = broken
    try:
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < 5:
            assert time.monotonic() < deadline, "heartbeats stopped"
            time.sleep(0.01)
        assert calls and isinstance(link.request(lambda rid: protocol.Heartbeat(rid=rid), timeout_s=5),
                                    protocol.HeartbeatAck)
    finally:
        link.close()


_NESTED_STATUS_REPLY = """
    import sys
    import msgspec
    from omnishm import protocol
    encode = protocol.encode
    sent = []
    def hostile(msg):
        if isinstance(msg, protocol.StatusReply) and not sent:  # the first one only
            sent.append(1)
            return (b"\\x83\\xa4type\\xacstatus_reply\\xa3rid" + msgspec.msgpack.encode(msg.rid) + b"\\xa6status"
                    + b"\\x81\\xa1a" + b"\\x91" * 100_000 + b"\\xc0")  # nested past msgspec's recursion limit
        return encode(msg)
    protocol.encode = hostile
    from omnishm.committer.start import main
    sys.exit(main(sys.argv[1:]))
"""


def test_a_reply_nested_too_deep_to_decode_is_dropped_and_the_link_goes_on(committer_factory):
    """msgspec raises ``RecursionError``, not a ``DecodeError``, for a reply nested too deep: it ended the
    link's I/O thread, and with it every reply and heartbeat, and the link never went dead (review)."""
    import textwrap

    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "30",
                               python_args=("-c", textwrap.dedent(_NESTED_STATUS_REPLY)))
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=0)
    try:
        with pytest.raises(OmniPrefixCacheCommitterError, match="did not answer within"):  # the reply was dropped
            link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=1.0)
        beats = link.heartbeats_sent
        reply = link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=5.0)
        assert isinstance(reply, protocol.StatusReply) and reply.status["name"] == handle.name
        deadline = time.monotonic() + 10
        while link.heartbeats_sent < beats + 3:
            assert time.monotonic() < deadline and link._thread.is_alive(), "heartbeats stopped"
            time.sleep(0.01)
        assert link.dead is None
    finally:
        link.close()


def test_an_error_on_the_links_io_thread_makes_the_link_dead_with_the_reason(committer_factory):
    """Anything raised in the I/O thread's loop ended the thread and left the link looking alive: requests
    were taken and never answered, and ``reconnect_timeout_s`` never ran out (review). Now the link is dead
    at once, naming the error, and every request fails with it."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "2")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=0)
    try:
        def broken() -> None:
            raise RuntimeError("injected in the I/O loop")

        link._flush_outbox = broken
        link._wake()
        deadline = time.monotonic() + 10
        while link.dead is None:
            assert time.monotonic() < deadline, "the link did not go dead"
            time.sleep(0.01)
        assert "I/O thread failed" in link.dead and "injected in the I/O loop" in link.dead
        with pytest.raises(OmniPrefixCacheCommitterError, match="injected in the I/O loop"):
            link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=5.0)
    finally:
        link.close()


def test_a_dead_link_closes_its_socket_so_a_late_reply_cannot_make_it_spin(committer_factory):
    """No committer resumed in time (here a frozen one), so the link is dead with its last resume Hello still
    queued. The committer answered it once it ran again, and nothing drained the dead link's socket: its I/O
    thread polled a readable socket with no timeout until the link was closed (review: a core at 100 %)."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "30")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         staging_rows=0, heartbeat_timeout_s=0.5, reconnect_timeout_s=1.0)
    probe = None
    try:
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 15
            while link.dead is None:
                assert time.monotonic() < deadline, "the link did not give up on a frozen committer"
                time.sleep(0.02)
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        probe = CommitterLink(cache=handle.name, role=protocol.ROLE_ADMIN, endpoint=handle.endpoint)
        assert isinstance(probe.request(lambda rid: protocol.StatusRequest(rid=rid)), protocol.StatusReply)
        cpu0, wall0 = time.thread_time(), time.monotonic()
        cpu_all0 = time.process_time()
        time.sleep(1.0)  # the window measured: this thread idles, the link's thread must too
        busy = (time.process_time() - cpu_all0) - (time.thread_time() - cpu0)
        assert busy < 0.3 * (time.monotonic() - wall0), f"{busy:.2f}s of CPU in 1 s with a dead link"
    finally:
        if probe is not None:
            probe.close()
        link.close()


def test_a_resume_never_connects_to_a_socket_name_another_user_could_have_bound(committer_factory, tmp_path):
    """REVIEW (2026-12-05, permissions): a link checked its endpoint's socket once, when it was built; its
    resumes connected to whatever socket was at the path by then. In a shared sticky directory another user
    bound the name after the committer's went, and the resume sent its Hello there. Each resume checks the
    path again and does not connect while the socket is missing (or not ours), then fails as before."""
    from conftest import unique_cache_name, wait_ready

    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    name = unique_cache_name("resume")
    endpoint = f"ipc://{shared}/{name}.sock"
    handle = committer_factory("--endpoint", endpoint, "--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5",
                               name=name, wait=False)
    handle.endpoint = endpoint
    wait_ready(handle)
    link = CommitterLink(cache=name, role=protocol.ROLE_READER, endpoint=endpoint,
                         layout=protocol.Layout(num_blocks=8, block_size=4), reconnect_timeout_s=3.0)
    try:
        assert isinstance(link.request(lambda rid: protocol.StatusRequest(rid=rid)), protocol.StatusReply)
        handle.stop(signal.SIGTERM)  # a clean stop: its socket is gone, the name is free for anyone
        deadline = time.monotonic() + 30
        while not link._socket_refused:
            assert link.dead is None and time.monotonic() < deadline, link.dead
            time.sleep(0.02)
        assert "does not exist yet in the shared directory" in link._socket_refused
        assert link.stats["resume_attempts"] == 0  # no Hello went anywhere
        with pytest.raises(OmniPrefixCacheCommitterError, match="not connected: socket .* does not exist yet"):
            link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=30)
    finally:
        link.close()


# Mutation review of the link (2026-12-06): behaviours no other test pinned.


def _until(cond, timeout_s: float, what: str) -> float:
    """Seconds until ``cond()`` held, polled; fails naming ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s:.1f}s"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_request_that_timed_out_leaves_no_pending_entry(committer_factory):
    """MUTATION (2026-12-06): a ``request`` that timed out takes its entry off the pending requests. Kept
    (the mutant), it held one of the ``MAX_IN_FLIGHT`` places until answered, and a resume would send again
    a request its caller had given up on."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            with pytest.raises(OmniPrefixCacheCommitterError, match="did not answer within 0.2s"):
                link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=0.2)
        assert [rid for rid, e in link._pending.items() if e.resend] == []
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
        link.close()


def test_heartbeats_go_out_at_the_committers_rate(committer_factory):
    """MUTATION (2026-12-06): the link beats every ``heartbeat_s`` the committer asks for (0.25 s here: 4
    beats take about 1 s). With the I/O thread's poll tick ten times longer, the beats came 2.5 times apart,
    and a committer with a tight ``heartbeat_timeout_s`` would reap a live client."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        n0 = link.heartbeats_sent
        _until(lambda: link.heartbeats_sent - n0 >= 4, 2.4, "4 heartbeats 0.25 s apart")
    finally:
        link.close()


def test_a_killed_committer_is_seen_gone_from_proc_long_before_its_silence_counts(committer_factory):
    """MUTATION (2026-12-06): a SIGKILLed committer is seen gone through ``/proc`` within about a heartbeat,
    not only once its silence passed the heartbeat timeout (60 s here); then the last client's close
    removes its segments. Without the ``/proc`` check (the mutant) the link stayed connected for the 60 s."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=1.5)
    try:
        assert shm.list_segments(handle.name)
        os.kill(handle.proc.pid, signal.SIGKILL)
        handle.proc.wait()
        _until(lambda: link.state != "connected", 6.0, "the link to see its committer gone")
    finally:
        link.close()
    assert shm.list_segments(handle.name) == []


def test_a_hello_a_dying_committer_swallowed_is_sent_again_and_not_kept(committer_factory):
    """MUTATION (2026-12-06): a committer that took the first Hello and died never answers it: the link sends
    Hello again (every ``HELLO_RETRY_S``) and attaches to the committer started next, and the swallowed
    Hello's entry is dropped. Kept (the mutant), a resume would have sent that plain Hello again."""
    import zmq

    from conftest import RUNTIME_DIR, unique_cache_name

    name = unique_cache_name()
    endpoint = paths.ipc_endpoint(RUNTIME_DIR, name)
    ctx = zmq.Context()
    dying = ctx.socket(zmq.ROUTER)
    dying.setsockopt(zmq.LINGER, 0)
    dying.bind(endpoint)
    out: list[object] = []

    def attach() -> None:
        try:
            out.append(CommitterLink(cache=name, role=protocol.ROLE_READER, endpoint=endpoint, layout=LAYOUT,
                                     connect_timeout_s=25.0))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            out.append(exc)

    t = threading.Thread(target=attach)
    t.start()
    try:
        assert dying.poll(10000), "no Hello reached the first committer"
        dying.recv_multipart()  # swallowed: the committer dies holding it
        dying.close()
        ctx.term()
        committer_factory(name=name)
        t.join(30)
        assert out and isinstance(out[0], CommitterLink), out
        assert [rid for rid, e in out[0]._pending.items() if e.resend] == []
    finally:
        t.join(30)
        for link in out:
            if isinstance(link, CommitterLink):
                link.close()


def _link_whose_committer_was_killed(committer_factory, **link_kw) -> tuple:
    """``(handle, link)``: a reader's link whose committer was SIGKILLed and that has seen it gone (resuming)."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         **link_kw)
    try:
        os.kill(handle.proc.pid, signal.SIGKILL)
        handle.proc.wait()
        _until(lambda: link.state == "reconnecting", 6.0, "the link to see its committer gone")
    except BaseException:
        link.close()
        raise
    return handle, link


def test_after_a_resume_no_heartbeat_of_the_lost_session_stays_pending(committer_factory):
    """MUTATION (2026-12-06): the heartbeats unanswered when the committer was lost are failed then. Kept
    (the mutant), they were never answered (a resume does not send heartbeats again) and held places of the
    ``MAX_IN_FLIGHT`` window for good. Nor are they re-sent (stop 52's mutation review: heartbeats marked for
    re-sending passed): one carries stale counters and an old beat number, and the next beat goes out fresh.
    The link finds a killed committer gone right after it submits a beat, so one beat is outstanding at the
    loss, and with nothing else pending the resume re-sends nothing."""
    handle, link = _link_whose_committer_was_killed(committer_factory, reconnect_timeout_s=20.0)
    try:
        lost = time.monotonic()
        committer_factory("--heartbeat-timeout-s", "60", name=handle.name)
        _until(lambda: link.stats["reconnects"] == 1, 15.0, "the resume")
        assert link.dead is None
        assert [rid for rid, e in link._pending.items() if not e.resend and e.sent_at < lost] == []
        assert link.stats["resent"] == 0, dict(link.stats)
    finally:
        link.close()


def test_closing_a_link_that_is_resuming_does_not_wait_for_a_goodbye(committer_factory):
    """Contract (``CommitterLink.close``): a link closed while it resumes a lost committer sends no goodbye
    (nothing would answer it; the committer reaps the session) and returns at once, so an engine shutting down
    while its committer is gone is not held ``timeout_s`` (here 8 s) on its close (stop 52's mutation review)."""
    _, link = _link_whose_committer_was_killed(committer_factory, reconnect_timeout_s=30.0)
    try:
        t0 = time.monotonic()
        link.close(timeout_s=8.0)
        took = time.monotonic() - t0
        assert took < 3.0, f"close took {took:.1f}s while the link was resuming"
    finally:
        link.close()  # the killed committer's segments: swept by the closing link (``_sweep_if_committer_gone``)
