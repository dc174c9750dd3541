"""Contracts of the client's transport (``client/link.py``, ``link_io.py``, ``attach.py``) that the rest of the
suite did not pin: the outbox's order and wakes, quiet sends and the ``ZMQ_FD`` edges they may take,
``settle`` and in-flight room, silence and loss, resume pacing and what a resume re-sends. Each test killed a
mutant the suite let through (mutation review, 2026-12-06; the mutant named in each docstring as ``mN``).
Real committer processes, real ZeroMQ."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from omnishm import protocol as P
from omnishm.client.link import CommitterLink

from helpers import io_thread_parked, until

LAYOUT = P.Layout(num_blocks=8, block_size=4)


class _PollWatch:
    """Stands in for the link's poller: tells when the I/O thread waits in a poll of ``long_ms`` or more."""

    def __init__(self, real, long_ms: int = 10000) -> None:
        self._real = real
        self._long_ms = long_ms
        self.long_poll = threading.Event()

    def poll(self, timeout=None):
        if timeout is not None and timeout >= self._long_ms:
            self.long_poll.set()
        try:
            return self._real.poll(timeout)
        finally:
            self.long_poll.clear()

    def __getattr__(self, name):
        return getattr(self._real, name)


def _idle(link) -> None:
    """Nothing pending, and the I/O thread waits in a poll of its whole tick (10 s here; the first polls after
    the Welcome may still use the 250 ms tick of the default 1 s period): only a wake or an edge ends it."""
    if not isinstance(link._poller, _PollWatch):
        link._poller = _PollWatch(link._poller)
        # The I/O thread may have entered its whole-tick poll on the real poller before the swap (the constructor
        # ran late on a loaded host: CI, 2026-12-06): it would sit there 10 s unseen. A wake ends that poll.
        link._wake()
    until(lambda: link._poller.long_poll.is_set() and not link._pending, 5.0, "an idle link in a long poll")


def test_a_request_never_overtakes_one_queued_in_the_outbox(committer_factory):
    """m3: ``submit`` sends on the caller's thread only while the outbox is empty. With a request already
    queued (the socket was full a moment ago), a later one queues behind it: the committer answers in the
    order it receives, so replies come back in submit order. The mutant sent the later one first."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # tick 10 s
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    order: list[int] = []
    queued: list[int] = []

    def make_b(rid: int) -> P.StatusRequest:
        # Queue A as a full socket would have (pending + outbox, not sent), just before B is submitted.
        rid_a = next(link._rids)
        fut_a = Future()
        fut_a.rid = rid_a
        fut_a.add_done_callback(lambda f: order.append(f.result().rid))
        from omnishm.client.link import _Pending
        with link._slock:
            with link._plock:
                link._pending[rid_a] = _Pending(fut_a, time.monotonic(), P.encode(P.StatusRequest(rid=rid_a)), True)
            link._outbox.append(rid_a)
        queued.append(rid_a)
        return P.StatusRequest(rid=rid)

    try:
        fut_b = link.submit(make_b)
        fut_b.add_done_callback(lambda f: order.append(f.result().rid))
        link._wake()  # the outbox is flushed by the I/O thread
        until(lambda: len(order) == 2, 10.0, "both replies")
        assert order == [queued[0], fut_b.rid], f"replies came back as {order}: the later request overtook"
    finally:
        link.close()


@contextlib.contextmanager
def _reply_unread(committer_factory, while_stopped: Callable[[CommitterLink], Any], *,
                  before_events_check: bool = False) -> Iterator[tuple[CommitterLink, threading.Event, Any]]:
    """A link whose I/O thread is parked after its ``EVENTS`` check, before its poll (``before_events_check``:
    before that check; until the yielded gate is set), and a reply waiting unread in its socket: ``while_stopped(link)`` ran while the committer was stopped
    (its result is yielded), and the committer's answer came in once it ran again. The next send may take
    that reply's ``ZMQ_FD`` edge. The poll tick is 10 s, so only a wake answers sooner."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # tick 10 s
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        _idle(link)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            with io_thread_parked(link, before_events_check=before_events_check) as gate:
                try:
                    got = while_stopped(link)
                finally:
                    os.kill(handle.proc.pid, signal.SIGCONT)
                assert select.select([link._sock_fd], [], [], 5)[0], "the reply did not signal"
                time.sleep(0.003)  # premise only: libzmq handles commands in a send at most about once a ms
                yield link, gate, got
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)  # also when the I/O thread never came round
    finally:
        link.close()


def _times_out(link: CommitterLink) -> None:
    """A request that times out while the committer is stopped: its reply comes in late, to nobody."""
    from omnishm.interface import OmniPrefixCacheCommitterError

    with pytest.raises(OmniPrefixCacheCommitterError, match="did not answer"):
        link.request(lambda rid: P.StatusRequest(rid=rid), timeout_s=0.1)


def test_a_quiet_send_with_one_other_request_pending_does_not_swallow_its_replys_edge(committer_factory):
    """m4: a quiet send (``ack_marker``) skips the ``EVENTS`` check only when nothing else is pending. With one
    other request pending whose reply came in (its ``ZMQ_FD`` edge not yet taken), the send may take that
    edge; the pristine submit reads ``EVENTS`` and wakes the I/O thread. The mutant (``> 2``) skipped it with
    exactly one other pending, and that reply waited out the I/O thread's poll tick (10 s here)."""
    with _reply_unread(committer_factory, lambda link: link.submit(lambda rid: P.StatusRequest(rid=rid))) \
            as (link, gate, status):
        assert len(link._pending) == 1
        quiet = link.submit(lambda rid: P.StatusRequest(rid=rid), ack_marker=1)  # the one other pending: status
        assert not select.select([link._sock_fd], [], [], 0)[0], "the quiet send left the edge (test premise)"
        gate.set()
        status.result(timeout=3)  # the I/O thread's tick is 10 s: only a wake gets it sooner
        quiet.result(timeout=3)


class _FullOnce:
    """Stands in for the link's socket: its next ``full`` sends raise ``zmq.Again`` (a full socket)."""

    def __init__(self, sock) -> None:
        self._real = sock
        self.full = 0
        self.refused = 0

    def send(self, data, flags=0):
        import zmq
        if self.full > 0:
            self.full -= 1
            self.refused += 1
            raise zmq.Again()
        return self._real.send(data, flags)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _with_full_socket(link, full: int) -> _FullOnce:
    with link._slock:
        proxy = _FullOnce(link._sock)
        proxy.full = full
        link._sock = proxy
    return proxy


def test_a_request_queued_in_the_outbox_wakes_the_io_thread(committer_factory):
    """m6: a request that found the socket full waits in the outbox, and ``submit`` wakes the I/O thread to
    send it. The mutant did not wake it: the request went out only at the I/O thread's next poll tick (10 s)."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # tick 10 s
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        _idle(link)
        time.sleep(0.05)  # premise only: the I/O thread is back in its 10 s poll
        proxy = _with_full_socket(link, 1)
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
        assert proxy.refused == 1, "the submit's own send was not refused (test premise)"
        assert isinstance(fut.result(timeout=3), P.StatusReply)
    finally:
        link.close()


def test_wake_if_replied_wakes_the_io_thread_for_a_message_still_in_the_outbox(committer_factory):
    """m9/m10: ``wake_if_replied`` also wakes the I/O thread while a message waits in the outbox (reading
    ``EVENTS`` may take the edge that said the socket has room again). The mutant woke it only for a reply,
    and the queued request waited for the I/O thread's next poll tick (10 s)."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # tick 10 s
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        _idle(link)
        proxy = _with_full_socket(link, 2)  # the submit's send, then the I/O thread's flush
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
        until(lambda: proxy.refused == 2, 5.0, "the I/O thread's flush to find the socket full")
        time.sleep(0.05)  # premise only: the I/O thread is back in its 10 s poll
        assert list(link._outbox) == [fut.rid] and not fut.done()
        link.wake_if_replied()
        assert isinstance(fut.result(timeout=3), P.StatusReply)
    finally:
        link.close()


def test_settle_of_a_request_no_longer_pending_says_so(committer_factory):
    """m8: ``settle`` returns False when the entry is gone (answered, failed, never sent): a writer's join
    then takes the reply that completed the future (a rejection) instead of the StepDone it made up."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
        reply = fut.result(timeout=5)
        assert link.settle(fut.rid, P.StepDone(rid=fut.rid, step=0, done_tids=b"")) is False
        assert fut.result() is reply
    finally:
        link.close()


def test_a_send_with_nothing_else_pending_still_wakes_for_a_late_reply_it_took_the_edge_of(committer_factory):
    """m5: only a quiet send skips the ``EVENTS`` check. A plain request sent while the reply to one that
    timed out (no longer pending) waits unread may take that reply's ``ZMQ_FD`` edge; its own reply then comes
    in behind it without one. The pristine submit reads ``EVENTS`` and wakes the I/O thread; the mutant
    (the check skipped whenever nothing else is pending) left the request to wait out the poll tick (10 s)."""
    with _reply_unread(committer_factory, _times_out) as (link, gate, _):
        assert not link._pending
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
        assert not select.select([link._sock_fd], [], [], 0)[0], "the send left the edge (test premise)"
        gate.set()
        assert isinstance(fut.result(timeout=3), P.StatusReply)  # the tick is 10 s: only a wake is sooner


def test_settling_a_request_wakes_a_caller_waiting_for_in_flight_room(committer_factory):
    """m7: ``settle`` frees a place of the ``MAX_IN_FLIGHT`` window and wakes callers waiting for one (a
    writer's next step, say, while the committer is slow to answer). The mutant did not notify: the waiting
    caller sat out its whole room timeout (12 s here) and then raised, though there was room."""
    from omnishm.client.link import MAX_IN_FLIGHT

    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         request_timeout_s=12.0)
    out: list[object] = []
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        futs = [link.submit(lambda rid: P.StatusRequest(rid=rid), ack_marker=1) for _ in range(MAX_IN_FLIGHT)]

        def caller() -> None:
            try:
                out.append(link.submit(lambda rid: P.StatusRequest(rid=rid)))
            except Exception as exc:  # noqa: BLE001 - shown below
                out.append(exc)

        t = threading.Thread(target=caller)
        t.start()
        until(lambda: link._room_waiters == 1, 5.0, "the caller to wait for room")
        t0 = time.monotonic()
        assert link.settle(futs[0].rid, P.StepDone(rid=futs[0].rid, step=0, done_tids=b"")) is True
        t.join(5.0)
        assert not t.is_alive() and out and not isinstance(out[0], Exception), out
        assert time.monotonic() - t0 < 5.0
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
        link.close()


def test_a_reply_the_io_threads_own_events_check_took_the_edge_of_is_drained_at_once(committer_factory):
    """m18: the I/O thread reads ``EVENTS`` before it polls (``_readable``); that read takes a new reply's
    ``ZMQ_FD`` edge, so the poll that follows must not wait (tick 0). The mutant polled a whole tick (10 s)
    with the reply queued."""
    def submit(link: CommitterLink) -> Any:
        return link.submit(lambda rid: P.StatusRequest(rid=rid))  # its own EVENTS check: nothing yet

    with _reply_unread(committer_factory, submit, before_events_check=True) as (_link, gate, fut):
        gate.set()  # the I/O thread's EVENTS check takes the edge
        assert isinstance(fut.result(timeout=3), P.StatusReply)


def test_silence_counts_only_while_a_request_the_committer_answers_is_outstanding(committer_factory):
    """m25: a link with nothing outstanding is not silent, however long since the last reply (here the
    client's ``heartbeat_timeout_s`` of 0.5 s is shorter than the committer's 2 s heartbeat period). The
    mutant took every gap between heartbeats for a lost committer."""
    handle = committer_factory("--heartbeat-s", "2", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         heartbeat_timeout_s=0.5)
    try:
        n0 = link.heartbeats_sent
        until(lambda: link.heartbeats_sent >= n0 + 2 and link.writer_ack[0] >= n0 + 2, 10.0, "two answered beats")
        assert link.stats["committer_lost"] == 0 and link.state == "connected"
    finally:
        link.close()


def test_a_silent_committer_is_lost_after_the_clients_heartbeat_timeout(committer_factory):
    """m23/m44: with ``heartbeat_timeout_s=2`` (the client's own, overriding the committer's 60 s) a frozen
    committer counts as lost about 2 s after the first unanswered beat (beats every 0.25 s), not later.
    Mutants: twice the timeout (m23), or the committer's 60 s (m44, the override ignored)."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         heartbeat_timeout_s=2.0, reconnect_timeout_s=30.0)
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        until(lambda: link.state != "connected", 10.0, "the committer lost")
        took = time.monotonic() - t0
        assert 1.9 <= took < 3.6, f"lost after {took:.2f}s with heartbeat_timeout_s=2"
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
        link.close()


def test_a_link_nobody_resumes_is_dead_once_reconnect_timeout_s_passed(committer_factory):
    """m37: no committer resumes a killed one's session: the link is dead ``reconnect_timeout_s`` (2 s) after it
    saw the committer gone, not twice that (the mutant)."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=2.0)
    try:
        handle.stop(signal.SIGKILL)
        until(lambda: link.state != "connected", 5.0, "the committer seen gone")
        t0 = time.monotonic()
        until(lambda: link.dead is not None, 10.0, "the link dead")
        took = time.monotonic() - t0
        assert took < 3.5, f"dead {took:.2f}s after it was lost, reconnect_timeout_s=2"
        assert "reconnect_timeout_s=2.0" in link.dead
    finally:
        link.close()


def test_a_plain_request_outstanding_at_a_resume_is_re_sent_and_answered_not_settled(committer_factory):
    """m40: a resume settles only quiet steps (marker > 0) the word shows applied; a plain request is re-sent
    and gets its own reply. The mutant (``0 <= marker``) completed it with a made-up ``StepDone``."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0)
    try:
        handle.stop(signal.SIGKILL)
        until(lambda: link.state != "connected", 5.0, "the committer seen gone")
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))  # pending while resuming
        committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60", name=handle.name)
        reply = fut.result(timeout=15)
        assert isinstance(reply, P.StatusReply), reply
        assert link.stats["reconnects"] == 1 and link.stats["resent"] >= 1
    finally:
        link.close()


def test_a_request_queued_in_the_outbox_when_the_committer_was_lost_is_sent_once_after_the_resume(committer_factory):
    """m41: the resume re-sends every unanswered request from ``_pending`` and clears the outbox. The mutant kept
    the outbox, and the I/O thread sent a request queued there at the loss a second time (for a quiet step: a
    copy applied after its writer settled it and reused its staging page)."""
    fast = ("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    handle = committer_factory(*fast)
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0)
    sent: list[bytes] = []
    stopped: list[int] = []
    real_new_socket, real_resumed = link._new_socket, link._on_resume_reply

    class Counting(_FullOnce):
        def send(self, data, flags=0):
            sent.append(bytes(data))
            return self._real.send(data, flags)

    def new_socket() -> None:
        real_new_socket()
        with link._slock:
            link._sock = Counting(link._sock)

    def resumed(reply) -> None:  # the new committer reads nothing re-sent until the outbox had its chance
        if isinstance(reply, P.Welcome) and not stopped:
            os.kill(reply.committer_pid, signal.SIGSTOP)
            stopped.append(reply.committer_pid)
        real_resumed(reply)

    try:
        until(lambda: not link._pending, 5.0, "an idle link")
        proxy = _with_full_socket(link, 10 ** 9)  # the socket stays full: the request waits in the outbox
        fut = link.submit(lambda rid: P.StatusRequest(rid=rid))
        data = link._pending[fut.rid].data
        until(lambda: proxy.refused >= 2, 5.0, "the flush to find the socket full")
        assert list(link._outbox) == [fut.rid]
        link._new_socket, link._on_resume_reply = new_socket, resumed
        handle.stop(signal.SIGKILL)
        until(lambda: link.state != "connected", 5.0, "the committer seen gone")
        committer_factory(*fast, name=handle.name, wait=False)
        until(lambda: link.stats["reconnects"] == 1, 20.0, "the resume")
        # Several passes of the I/O thread's loop (each flushes the outbox), all before the committer runs again.
        n = link.heartbeats_sent
        until(lambda: link.heartbeats_sent >= n + 2, 5.0, "two heartbeats after the resume")
        assert sent.count(data) == 1, f"the queued request went out {sent.count(data)} times after the resume"
        os.kill(stopped[0], signal.SIGCONT)
        assert isinstance(fut.result(timeout=10), P.StatusReply)
    finally:
        if stopped:
            os.kill(stopped[0], signal.SIGCONT)
        link._new_socket, link._on_resume_reply = real_new_socket, real_resumed
        link.close()


def _inject_unanswered(link, marker: int) -> int:
    """A pending request the committer will never answer (its reply lost, or a quiet step applied in full)."""
    from concurrent.futures import Future

    from omnishm.client.link import _Pending
    rid = next(link._rids)
    fut: Future = Future()
    fut.rid = rid
    with link._plock:
        link._pending[rid] = _Pending(fut, time.monotonic(), P.encode(P.StatusRequest(rid=rid)), True, marker)
    return rid


def test_a_quiet_step_outstanding_does_not_make_the_committer_silent(committer_factory):
    """m24: a quiet ``StepWrite`` gets no reply, so it never counts as an unanswered request when silence is
    judged. With the client's ``heartbeat_timeout_s`` (0.5 s) shorter than the committer's heartbeat period (2 s),
    the mutant took a quiet step outstanding over a gap between heartbeats for a lost committer."""
    handle = committer_factory("--heartbeat-s", "2", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         heartbeat_timeout_s=0.5)
    try:
        rid = _inject_unanswered(link, marker=1)
        n0 = link.heartbeats_sent
        until(lambda: link.heartbeats_sent >= n0 + 2 and link.writer_ack[0] >= n0 + 2, 10.0, "two answered beats")
        assert link.stats["committer_lost"] == 0 and link.state == "connected"
        assert link.settle(rid, P.StepDone(rid=rid, step=0, done_tids=b"")) is True
    finally:
        link.close()


def test_replies_to_other_requests_keep_the_committer_heard(committer_factory):
    """m29: silence is judged from the last reply received. A request whose reply never comes (lost) while the
    committer answers every heartbeat (0.25 s apart) is not the committer's silence; the mutant, which no longer
    noted when it last heard anything, lost the committer after ``heartbeat_timeout_s`` (1 s)."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         heartbeat_timeout_s=1.0)
    try:
        rid = _inject_unanswered(link, marker=0)
        n0 = link.heartbeats_sent
        until(lambda: link.writer_ack[0] >= n0 + 8, 10.0, "eight answered beats (2 s)")
        assert link.stats["committer_lost"] == 0 and link.state == "connected"
        assert link.settle(rid, P.StepDone(rid=rid, step=0, done_tids=b"")) is True
    finally:
        link.close()


def test_wake_if_replied_wakes_the_io_thread_for_a_reply_a_quiet_send_took_the_edge_of(committer_factory):
    """m10: a quiet send with nothing else pending reads no ``EVENTS``, so it may take the ``ZMQ_FD`` edge of a
    reply waiting unread (here the late reply to a request that timed out); the quiet step's own reply (its
    rejection) then comes in without an edge. ``wake_if_replied``, which the writer's join calls, wakes the I/O
    thread then; the mutant did not, and the reply waited out the I/O thread's poll tick (10 s)."""
    with _reply_unread(committer_factory, _times_out) as (link, gate, _):
        quiet = link.submit(lambda rid: P.StatusRequest(rid=rid), ack_marker=1)  # answered, like a rejection
        assert not select.select([link._sock_fd], [], [], 0)[0], "the quiet send left the edge (test premise)"
        gate.set()
        link.wake_if_replied()
        assert isinstance(quiet.result(timeout=3), P.StatusReply)  # the tick is 10 s: only a wake is sooner


def test_a_closing_link_sends_no_heartbeat_once_its_goodbye_went(committer_factory):
    """m15: ``close`` marks the link leaving before its Goodbye; from then on the I/O thread sends no heartbeat
    (one sent after the Goodbye is answered ``no_session`` and was taken for a lost committer: a resume, even an
    autostart). The window is held open here: the I/O thread makes 40 more passes (heartbeats due every 10 ms)
    between the Goodbye's answer and the thread's stop. The mutant kept beating, and lost the session."""
    handle = committer_factory("--heartbeat-s", "0.01", "--heartbeat-timeout-s", "5")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    passes = [0]
    real_note_stall, real_shutdown = link._note_stall, link._shutdown_thread
    seen: dict[str, float] = {}

    def note_stall(ran_at, tick_ms):
        passes[0] += 1
        return real_note_stall(ran_at, tick_ms)

    def shutdown() -> None:  # close(): the Goodbye was answered
        beats, p0 = link.heartbeats_sent, passes[0]
        until(lambda: passes[0] >= p0 + 80, 10.0, "40 passes of the I/O thread")
        seen["beats_after_goodbye"] = link.heartbeats_sent - beats
        seen["lost"] = link.stats["committer_lost"]
        real_shutdown()

    link._note_stall, link._shutdown_thread = note_stall, shutdown
    until(lambda: link.heartbeats_sent >= 2, 10.0, "heartbeats flowing")
    link.close()
    assert seen == {"beats_after_goodbye": 0, "lost": 0}, seen


def test_a_submit_after_close_raises_at_once(committer_factory):
    """m16: a closed link is dead (``dead`` names why), and a later ``submit`` raises at once: nothing would ever
    send or answer it. The mutant left ``dead`` None, and the submit returned a future nobody would complete."""
    from omnishm.interface import OmniPrefixCacheCommitterError

    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    link.close()
    assert link.dead is not None and "client link closed" in link.dead
    with pytest.raises(OmniPrefixCacheCommitterError, match="client link closed"):
        link.submit(lambda rid: P.StatusRequest(rid=rid))


def test_the_writer_ack_names_the_heartbeat_it_answers(committer_factory):
    """m21: ``writer_ack`` is ``(n, epoch)`` with ``n`` the number of the heartbeat answered (``heartbeats_sent``
    counts it before it goes): once a beat is answered and no other is out, ``writer_ack[0]`` equals
    ``heartbeats_sent``. A reader's ``_writer_left`` ends a wait at the first beat sent after it began; the mutant
    numbered each answer one lower, and every such wait lasted a heartbeat period longer."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        until(lambda: link.heartbeats_sent >= 3 and link.writer_ack[0] == link.heartbeats_sent, 5.0,
               "a heartbeat answered with none after it sent")
    finally:
        link.close()


def test_the_outbox_is_sent_in_order_each_request_once(committer_factory):
    """m28: the I/O thread sends what waits in the outbox from its head, in order. The mutant sent the tail
    entry's bytes and popped the head: the first request was never sent (its caller waited out its timeout)
    and the last went out twice."""
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # tick 10 s
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    order: list[int] = []
    try:
        _idle(link)
        proxy = _with_full_socket(link, 10 ** 9)  # full until told otherwise
        futs = [link.submit(lambda rid: P.StatusRequest(rid=rid)) for _ in range(3)]
        for f in futs:
            f.add_done_callback(lambda f: order.append(f.result().rid))
        assert list(link._outbox) == [f.rid for f in futs]
        with link._slock:
            proxy.full = 0  # room again
        link._wake()
        for f in futs:
            assert isinstance(f.result(timeout=3), P.StatusReply)
        assert order == [f.rid for f in futs]
    finally:
        link.close()


def test_a_writer_link_names_the_staging_of_keys_it_opened_when_it_resumes(committer_factory):
    """m32: the link records the staging segment of each ``KeyOpened`` and names it in its resume ``Hello``; a
    restarted committer that lost it refuses the resume (the writer would stage into a segment nobody reads,
    while a new one of that name got committed zero rows). The mutant did not record it: the resume named no
    staging and was welcomed."""
    from omnishm import shm

    fast = ("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    first = committer_factory(*fast)
    link = CommitterLink(cache=first.name, role=P.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                         staging_rows=4, reconnect_timeout_s=20.0)
    try:
        reply = link.request(lambda rid: P.OpenKey(rid=rid, key="k0", dtype="float32", width=4))
        staging = reply.segments.staging
        assert staging
        first.stop(signal.SIGKILL)
        assert shm.unlink_segment(staging)
        committer_factory(*fast, name=first.name)  # adopts the cache: this link holds the liveness lock
        until(lambda: link.dead is not None or link.stats["reconnects"] > 0, 15.0, "the resume's answer")
        assert link.dead is not None and "cannot resume writer" in link.dead and staging in link.dead, \
            (link.dead, dict(link.stats))
    finally:
        link.close()


def test_resume_attempts_are_paced_by_the_heartbeat_period(committer_factory):
    """m38: while no committer answers, a resume sends its ``Hello`` on a fresh socket once per attempt window,
    ``max(1 s, 2 heartbeat periods)``: a committer slow to answer (starting up, busy) has that long before
    its answer goes to a socket given up. The mutant tried every 50 ms: the third attempt came within 0.1 s."""
    handle = committer_factory("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=10.0)
    try:
        handle.stop(signal.SIGKILL)
        until(lambda: link.stats["resume_attempts"] >= 1, 5.0, "the first resume attempt")
        t0 = time.monotonic()
        until(lambda: link.stats["resume_attempts"] >= 3, 8.0, "the third resume attempt")
        took = time.monotonic() - t0
        assert took >= 1.9, f"three resume attempts within {took:.2f}s (one per second expected)"
        assert link.dead is None
    finally:
        link.close()


def test_a_resumes_welcome_counts_as_the_answer_to_the_latest_heartbeat(committer_factory):
    """m43: a ``Welcome`` tells which writer was attached as it was made, as if the latest heartbeat had just
    been answered: ``writer_ack`` becomes ``(heartbeats_sent, writer_epoch)``. A reader's wait begun before the
    resume then ends at once when its writer did not come back. The mutant recorded beat 0, so such waits
    lasted until the next heartbeat's answer."""
    fast = ("--heartbeat-s", "0.25", "--heartbeat-timeout-s", "60")
    handle = committer_factory(*fast)
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         reconnect_timeout_s=20.0)
    seen: list[tuple[int, int]] = []
    real_resumed = link._on_resume_reply

    def resumed(reply) -> None:  # I/O thread: nothing else moves heartbeats_sent or writer_ack meanwhile
        real_resumed(reply)
        if isinstance(reply, P.Welcome):
            seen.append((link.writer_ack[0], link.heartbeats_sent))

    try:
        until(lambda: link.heartbeats_sent >= 2, 5.0, "heartbeats flowing")
        link._on_resume_reply = resumed
        handle.stop(signal.SIGKILL)
        committer_factory(*fast, name=handle.name)
        # Waits for ``seen``, not the ``reconnects`` count: the I/O thread counts the resume inside
        # ``_on_resume_reply`` and appends to ``seen`` only after it returned.
        until(lambda: seen, 15.0, "the resume's Welcome")
        assert link.stats["reconnects"] == 1
        assert len(seen) == 1 and seen[0][1] >= 2 and seen[0][0] == seen[0][1], seen
    finally:
        link._on_resume_reply = real_resumed
        link.close()


def test_a_heartbeat_answer_naming_a_writer_without_its_epoch_is_not_taken(committer_factory):
    """A heartbeat answer naming a writer without its epoch (a committer of an earlier release) is not taken
    as ``writer_ack``: a reader's ``_writer_left`` would read its epoch 0 as "the followed writer left" and
    end a wait for rows still coming. An answer with the epoch, or saying there is no writer, is taken.
    MUTATION (stop 57). Answers are handed to the real link's ``_on_heartbeat``; its committer's own beats
    are a minute apart, so none races them."""
    handle = committer_factory("--heartbeat-s", "60", "--heartbeat-timeout-s", "600")
    link = CommitterLink(cache=handle.name, role=P.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)

    def answer(beat: int, reply: P.HeartbeatAck) -> None:
        fut: Future = Future()
        fut.beat = beat  # type: ignore[attr-defined]
        fut.set_result(reply)
        link._on_heartbeat(fut)

    try:
        until(lambda: link.state == "connected", 10.0, "connected")
        before = link.writer_ack
        beat = before[0] + 1000
        answer(beat, P.HeartbeatAck(rid=0, readers=1, writer=True, writer_epoch=0))
        assert link.writer_ack == before, f"an epoch-less writer's answer was taken: {link.writer_ack}"
        answer(beat, P.HeartbeatAck(rid=0, readers=1, writer=True, writer_epoch=7))
        assert link.writer_ack == (beat, 7)
        answer(beat + 1, P.HeartbeatAck(rid=0, readers=1, writer=False, writer_epoch=0))
        assert link.writer_ack == (beat + 1, 0)
    finally:
        link.close()
