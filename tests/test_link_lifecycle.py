"""A client link's close and its timeouts, against real committer processes (stop 52's mutation
review of omnishm/client/link.py: gaps the suite did not cover).

A closed link fails every pending request at once and wakes a caller waiting for in-flight room; a request's
``timeout_s`` bounds its wait for room and for the reply together; an ``Error`` reply raises. (That a resume
re-sends no heartbeat of the lost session, and that a link closed while it resumes sends no goodbye, are in
test_link.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from omnishm import protocol
from omnishm.client.link import MAX_IN_FLIGHT, CommitterLink
from omnishm.interface import OmniPrefixCacheCommitterError

from helpers import until, wait_stopped

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def test_a_request_the_committer_refuses_raises_its_error_and_the_link_goes_on(committer_factory):
    """Contract (``CommitterLink.request``): a round trip raises ``OmniPrefixCacheCommitterError`` on an
    ``Error`` reply, naming the committer's code and message; it never hands the ``Error`` back as if it were
    the answer. A reader's ``OpenKey`` of a key the writer never opened is refused (``unknown_key``), and the
    link serves the next request as before."""
    handle = committer_factory()
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        try:
            reply = link.request(lambda rid: protocol.OpenKey(rid=rid, key="never-opened", dtype="float32", width=4),
                                 timeout_s=10.0)
        except OmniPrefixCacheCommitterError as exc:
            assert "committer error unknown_key" in str(exc) and "never-opened" in str(exc), exc
        else:
            raise AssertionError(f"an Error reply was returned as the answer: {reply!r}")
        assert isinstance(link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=10.0),
                          protocol.StatusReply)
    finally:
        link.close()


def test_close_fails_every_request_still_pending_at_once(committer_factory):
    """Contract (``CommitterLink.close`` / ``_shutdown_thread``): once the link is closed nothing will ever
    send or answer its requests, so every one still pending is failed then with
    ``OmniPrefixCacheCommitterError`` ("client link closed"); a thread waiting on such a future (a step's
    outcome, another thread's round trip) must not wait out its own timeout, or forever when it waits
    without one. The committer is frozen (SIGSTOP) so that a request stays unanswered across the close."""
    handle = committer_factory()
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(handle.proc.pid)
        fut = link.submit(lambda rid: protocol.StatusRequest(rid=rid))
        link.close(timeout_s=0.5)  # its goodbye goes unanswered too
        exc = fut.exception(timeout=5.0)  # raises TimeoutError when the future was left pending
        assert isinstance(exc, OmniPrefixCacheCommitterError) and "client link closed" in str(exc), exc
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
        link.close()


@contextlib.contextmanager
def _frozen_with_a_full_window(committer_factory, **link_kw: Any) -> Iterator[tuple[CommitterLink, list[Future]]]:
    """A link whose committer is frozen (SIGSTOP) with ``MAX_IN_FLIGHT`` requests unanswered: yields the link and
    the futures of the first 16 it submitted. The committer is thawed and the link closed on the way out."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                         **link_kw)
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(handle.proc.pid)
        first = [link.submit(_status) for _ in range(16)]
        while len(link._pending) < MAX_IN_FLIGHT:  # nothing is answered: the window fills
            link.submit(_status)
        yield link, first
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
        link.close()


def _status(rid: int) -> protocol.StatusRequest:
    return protocol.StatusRequest(rid=rid)


def test_a_caller_waiting_for_in_flight_room_is_failed_at_once_when_the_link_closes(committer_factory):
    """Contract (``CommitterLink.submit`` / ``_fail_all``): with ``MAX_IN_FLIGHT`` requests unanswered a caller
    waits for room, for at most its timeout; when the link closes (or dies) every pending request is failed,
    and that caller must be woken then and raise at once, not sit out the rest of its timeout on the engine
    thread. The window is filled against a frozen committer; the caller's timeout (20 s) is far above the
    bound asserted."""
    outcome: list[BaseException | None] = []
    with _frozen_with_a_full_window(committer_factory, request_timeout_s=20.0) as (link, _):
        def caller() -> None:
            try:
                link.request(_status, timeout_s=20.0)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - judged below
                outcome.append(exc)

        thread = threading.Thread(target=caller)
        thread.start()
        try:
            until(lambda: link._room_waiters == 1, 5.0, "the caller to wait for room")
            t0 = time.monotonic()
            link.close(timeout_s=0.2)
            thread.join(timeout=5.0)
            assert not thread.is_alive(), f"the caller still waits for room {time.monotonic() - t0:.1f}s after close"
        finally:
            link.close()
            thread.join(timeout=30.0)
    assert len(outcome) == 1 and isinstance(outcome[0], OmniPrefixCacheCommitterError), outcome


def test_a_request_whose_wait_for_room_ended_late_still_ends_within_its_own_timeout(committer_factory):
    """Contract (``CommitterLink.request``): ``timeout_s`` bounds the whole call, the wait for in-flight room and
    the wait for the reply together, so an engine-thread caller never waits longer than it asked. The window is
    full against a frozen committer; room frees (16 entries settled) only after 3 of the caller's 4 s, and its
    request then goes unanswered: it must raise at about 4 s, not 3 s + another 4 s."""
    took: list[float] = []
    errors: list[BaseException] = []
    with _frozen_with_a_full_window(committer_factory, request_timeout_s=30.0) as (link, first):
        def caller() -> None:
            t0 = time.monotonic()
            try:
                link.request(_status, timeout_s=4.0)
            except OmniPrefixCacheCommitterError as exc:
                errors.append(exc)
            took.append(time.monotonic() - t0)

        started = time.monotonic()
        thread = threading.Thread(target=caller)
        thread.start()
        try:
            until(lambda: link._room_waiters == 1, 5.0, "the caller to wait for room")
            until(lambda: time.monotonic() - started >= 3.0, 10.0, "3 s of the caller's timeout to pass")
            # 16 entries settled: room even with the I/O thread's own (unbounded) heartbeats pending too
            assert all(link.settle(f.rid, protocol.StatusReply(rid=f.rid, status={})) for f in first)
            thread.join(timeout=15.0)
        finally:
            link.close()
            thread.join(timeout=30.0)
    assert len(errors) == 1, errors
    assert took[0] < 4.0 + 1.5, f"request(timeout_s=4.0) took {took[0]:.1f}s"


def test_closed_links_leave_no_socket_or_fd_behind(committer_factory):
    """A closed link's socket is closed by its I/O thread on the way out, so links a long-lived process builds
    and closes leave no socket or file descriptor behind, even while something still references them.
    MUTATION (stop 57): with the thread's ``finally`` not closing it, 8 closed links kept 13 fds."""
    handle = committer_factory()
    # One link first: the process-wide ZeroMQ context (and its I/O thread's fds) is made once, and stays.
    warm = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    warm.close()
    base = len(os.listdir("/proc/self/fd"))
    links = []
    for _ in range(8):
        link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
        assert isinstance(link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=10.0),
                          protocol.StatusReply)
        link.close()
        links.append(link)  # still referenced, as a manager keeps its link: no garbage collection closes it
    assert all(link._sock is None for link in links), "a closed link still holds its ZeroMQ socket"
    # libzmq closes a socket's connection in its own I/O thread, just after zmq_close: polled, not slept.
    until(lambda: len(os.listdir("/proc/self/fd")) <= base, 10.0, f"file descriptors back to {base}")
