"""The committer's message loop at its edges, in real committer processes (stop 52's mutation review of
omnishm/committer/server.py): an unexpected error in a handler is answered to its own request at once and the
committer serves on; a message that reaches a stopping committer after its last receive round is still
answered by the stop's drain; a peer's large frames do not make a receive batch hold everyone's replies.
"""

from __future__ import annotations

import signal

import zmq

from omnishm import protocol
from omnishm.committer.server import RECV_BATCH_BYTES
from omnishm.client.link import CommitterLink
from omnishm.interface import OmniPrefixCacheCommitterError

from helpers import RawClient, until

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)

_OPEN_KEY_BOOM = """
import sys
from omnishm.committer.server import Committer
orig = Committer.on_open_key
def on_open_key(self, session, msg):
    if msg.key == "boom":
        raise RuntimeError("boom: an unexpected error in the committer")
    return orig(self, session, msg)
Committer.on_open_key = on_open_key
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_unexpected_error_is_answered_to_its_own_request_at_once_and_the_committer_serves_on(committer_factory):
    """Contract (server.py module docstring, ``handle_frames``): a message that trips an unexpected error gets an
    ``Error(code="internal")`` reply, a log line and a count, and the loop goes on serving everyone else. The
    reply carries the request's own ``rid``, so the client's ``request`` raises the committer's error at once
    instead of waiting out its timeout (a stall of the calling thread); and the committer process stays up.
    The error is injected into a real committer (``on_open_key`` patched to raise for one key name)."""
    handle = committer_factory(python_args=("-c", _OPEN_KEY_BOOM))
    link = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    try:
        try:
            link.request(lambda rid: protocol.OpenKey(rid=rid, key="boom", dtype="float32", width=4), timeout_s=10.0)
        except OmniPrefixCacheCommitterError as exc:
            err = str(exc)
        else:
            raise AssertionError("an internal error was answered as a success")
        assert "committer error internal" in err and "RuntimeError: boom" in err, err
        status = link.request(lambda rid: protocol.StatusRequest(rid=rid), timeout_s=10.0).status
        assert status["rejected"].get("internal") == 1, status["rejected"]
        assert handle.proc.poll() is None
    finally:
        link.close()


_HELD_AFTER_ITS_LAST_ROUND = """
import os, sys, time
import zmq
from omnishm.committer.server import Committer
flag = os.environ["OMNISHM_TEST_FLAG"]
orig = Committer.reap
def reap(self):
    # The stop signal came and the loop's own receive round is over: hold here until a message reaches the
    # socket (the client sends it once the flag file exists), so that only the stop's drain can answer it.
    if self.stopping and not os.path.exists(flag):
        open(flag, "w").close()
        self.sock.poll(10000, zmq.POLLIN)
    return orig(self)
Committer.reap = reap
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_message_that_reaches_a_stopping_committer_after_its_last_round_is_still_answered(committer_factory,
                                                                                           tmp_path, monkeypatch):
    """Contract (server.py module docstring, ``_serve_until_quiet``): a committer stopped by a signal answers
    what reaches it until ``STOP_QUIET_S`` pass without a message (at most ``STOP_DRAIN_S``) before it unlinks
    its segments; a message it does not receive goes unanswered until its client's timeout. Here the message
    arrives after the receive round of the loop pass in which SIGTERM came (the patched committer holds
    between that round and the loop's end until the message is in its socket): only the drain answers it."""
    flag = tmp_path / "stopping"
    monkeypatch.setenv("OMNISHM_TEST_FLAG", str(flag))
    handle = committer_factory(python_args=("-c", _HELD_AFTER_ITS_LAST_ROUND))
    raw = RawClient(handle.endpoint, handle.name)
    try:
        assert isinstance(raw.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        handle.proc.send_signal(signal.SIGTERM)
        until(flag.exists, 10.0, "the committer to stop after its receive round")
        reply = raw.call(protocol.StatusRequest(rid=raw.next_rid()), timeout_s=5.0)
        assert isinstance(reply, protocol.StatusReply), reply
        assert handle.proc.wait(timeout=15) == 0
    finally:
        raw.close()


_BATCH_BYTES_RECORDED = """
import os, sys, time
from omnishm.committer.metrics import Observability
from omnishm.committer.server import Committer
flag = os.environ["OMNISHM_TEST_FLAG"]
state = {"bytes": 0, "max": 0}
serve = Committer.serve_pending
def serve_pending(self, deadline=None):
    if os.path.exists(flag):  # the test's frames are on their way: let libzmq's I/O thread queue them all first
        os.unlink(flag)
        time.sleep(0.5)
    return serve(self, deadline)
handle = Committer.handle_frames
def handle_frames(self, frames):
    state["bytes"] += sum(map(len, frames))
    return handle(self, frames)
done = Observability.batch_done
def batch_done(self, messages, received_at, now):
    if state["bytes"] > state["max"]:
        state["max"] = state["bytes"]
        with open(flag + ".max", "w") as f:
            f.write(str(state["max"]))
    state["bytes"] = 0
    return done(self, messages, received_at, now)
Committer.serve_pending = serve_pending
Committer.handle_frames = handle_frames
Observability.batch_done = batch_done
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_receive_batch_stops_at_recv_batch_bytes_so_a_peers_large_frames_hold_no_one(committer_factory, tmp_path,
                                                                                        monkeypatch):
    """Contract (``RECV_BATCH_BYTES``): a receive batch is all received before any of it is answered, so its size
    is how long every other client waits. A peer sending large frames (junk here, 1 MiB each; a stuck or buggy
    one) made batches of up to 1024 of them: seconds and GiB in which no step write was answered (review, stop
    60: an engine step of 12 s with 4 MiB frames, and a status round trip of 8.6 s). Here 48 frames wait in the
    committer's socket at once; no batch holds more than RECV_BATCH_BYTES and one frame, and every frame is
    still answered (a decode error each), with the committer serving on."""
    flag = tmp_path / "flood"
    monkeypatch.setenv("OMNISHM_TEST_FLAG", str(flag))
    handle = committer_factory(python_args=("-c", _BATCH_BYTES_RECORDED))
    raw = RawClient(handle.endpoint, handle.name)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(handle.endpoint)
    frame = b"\xc1" * (1 << 20)  # 0xc1: a byte msgpack never uses, so each is one decode error
    try:
        assert isinstance(raw.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        flag.touch()
        for _ in range(48):
            peer.send(frame)
        replies = []
        while len(replies) < 48 and peer.poll(10_000):
            replies.append(protocol.reply_decoder.decode(peer.recv()))
        assert len(replies) == 48 and all(isinstance(r, protocol.Error) and r.code == "decode" for r in replies)
        status = raw.call(protocol.StatusRequest(rid=raw.next_rid()), timeout_s=10.0)
        assert sum(status.status["decode_errors"].values()) == 48, status.status["decode_errors"]
        largest = int((tmp_path / "flood.max").read_text())
        assert largest <= RECV_BATCH_BYTES + len(frame) + 64, f"a receive batch held {largest} bytes"
        assert handle.proc.poll() is None
    finally:
        peer.close()
        raw.close()
