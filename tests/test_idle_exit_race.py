"""An ``--exit-when-idle`` committer never welcomes a client and then exits under it.

The loop decides "idle" (the last writer or reader left) and then, before it
unlinks the cache, handles and answers what it already received. A ``Hello``
that came in meanwhile (a new rank, or a client resuming) was welcomed there,
and the committer then exited anyway and unlinked every segment named in that
``Welcome``: the client's link lost its committer at the next heartbeat, and a
resume had nothing to resume (a new committer holds a new generation). Real
committer process; its idle decision waits until a message is queued in its
socket, so the ``Hello`` is in that window every time.
"""

from __future__ import annotations

import textwrap
import time

from omnishm import protocol, shm
from omnishm.client.link import CommitterLink

from conftest import REPO, CommitterHandle, assert_clean_stop, start_committer, unique_cache_name

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
FAST = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")


def _slow_idle_committer(tmp_path, marker) -> CommitterHandle:
    """A committer (``--exit-when-idle``) that says when it first found itself idle (``marker``), then
    decides so only once a message waits in its socket, and says so (``marker.decided``)."""
    name = unique_cache_name("idle")
    code = textwrap.dedent(f"""
        import pathlib, sys, time
        import zmq
        sys.path.insert(0, {str(REPO)!r})
        from omnishm.committer import server, start
        done_serving = server.Committer._done_serving
        first = [True]
        def done_when_a_hello_waits(self, started):
            reason = done_serving(self, started)
            if reason != "idle" or not first[0]:
                return reason
            first[0] = False
            pathlib.Path({str(marker)!r}).touch()
            deadline = time.monotonic() + 30
            while not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
                time.sleep(0.005)
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                pathlib.Path({str(marker)!r} + ".decided").touch()
            return reason
        server.Committer._done_serving = done_when_a_hello_waits
        sys.exit(start.main(sys.argv[1:]))
    """)
    return start_committer(tmp_path, name, "--exit-when-idle", *FAST, python_args=("-c", code))


def test_a_client_welcomed_while_the_committer_decides_it_is_idle_keeps_its_committer(tmp_path):
    marker = tmp_path / "idle"
    handle = _slow_idle_committer(tmp_path, marker)
    link = None
    try:
        first = handle.client()
        assert isinstance(first.hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
        assert isinstance(first.goodbye(), protocol.Bye)  # the last client leaves: the committer is idle
        first.close()
        deadline = time.monotonic() + 10
        while not marker.exists():
            assert time.monotonic() < deadline and handle.proc.poll() is None, handle.log()
            time.sleep(0.01)
        # A reader attaches right then (a new rank): welcomed, so the cache must stay.
        link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT,
                             reconnect_timeout_s=1.0)
        decided = marker.with_name(marker.name + ".decided")
        assert decided.exists(), "the reader's Hello did not wait in the socket at the idle decision (test premise)"
        # The committer's loop goes on after its decision: it answers, and the link keeps it.
        assert isinstance(link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=5),
                          protocol.StatusReply), handle.log()
        assert handle.proc.poll() is None, f"the committer exited under a client it welcomed:\n{handle.log()}"
        assert link.dead is None and link.stats["committer_lost"] == 0, link.dead
        link.close()
        link = None
        assert handle.proc.wait(15) == 0, handle.log()  # now the last client is gone: it exits, cleanly
        assert "stopped (idle)" in handle.log() and shm.list_segments(handle.name) == []
    finally:
        if link is not None:
            link.close()
        if handle.proc.poll() is None:
            assert_clean_stop(handle)
