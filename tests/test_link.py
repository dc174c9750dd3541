"""The client link shared by threads: each caller sends on its own thread under the socket lock.

A real committer process; several threads submit at once, in bursts that fill the socket (the
outbox path), while the I/O thread receives. Every request gets exactly its own reply.
"""

from __future__ import annotations

import threading
import time

from omnishm import protocol
from omnishm.client.link import CommitterLink

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
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "0.5")
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
