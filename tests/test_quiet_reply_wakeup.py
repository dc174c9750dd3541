"""A rejected quiet step is seen at once, even when a quiet send took the edge of ``ZMQ_FD``.

``ZMQ_FD`` is edge-triggered: an operation on the socket may take the
notification of a reply that came in meanwhile, and a quiet ``StepWrite``'s
send reads no ``ZMQ_EVENTS`` afterwards (it expects no reply). When the link's
I/O thread is between its ``EVENTS`` check and its poll at that moment
(descheduled, or waiting for the GIL), it then sleeps a whole poll tick (a
quarter of a heartbeat period) with a reply queued, and a rejection of the
quiet step comes in behind it without an edge: the writer's next save waited
the tick out before its join saw the failure. Real committer, real ZeroMQ; the
test holds the I/O thread at that point of its loop and lets the committer
answer (SIGSTOP/SIGCONT) while it is held.
"""

from __future__ import annotations

import os
import select
import signal
import time

import pytest

from omnishm import protocol as P
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError

from helpers import io_thread_parked
from manager_helpers import Part, extended, one_applied_step, save, small_config

BS = 4


def test_a_rejected_quiet_step_is_seen_at_once_when_a_quiet_send_took_the_edge(committer_factory):
    handle = committer_factory("--heartbeat-s", "40", "--heartbeat-timeout-s", "120")  # the I/O thread's tick: 10 s
    m = OmniPrefixCacheManager(small_config(), cache=handle.name, endpoint=handle.endpoint, autostart=False)
    link = m._link
    real_submit = link.submit

    def submit(make, **kw):  # the step's descriptor names a slot outside the pool: rejected, answered
        def bad(rid: int):
            msg = make(rid)
            msg.slots = (1 << 40).to_bytes(8, "little") + msg.slots[8:]
            return msg
        return real_submit(bad, **kw)

    try:
        one_applied_step(m)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            with io_thread_parked(link) as gate:  # after its EVENTS check, before its poll
                try:
                    # A request whose reply the I/O thread takes (a flush piece, a heartbeat); answered once the
                    # committer runs again, and the reply signals ZMQ_FD.
                    status = link.submit(lambda rid: P.StatusRequest(rid=rid))
                finally:
                    os.kill(handle.proc.pid, signal.SIGCONT)
                assert select.select([link._sock_fd], [], [], 5)[0], "the reply did not signal"
                time.sleep(0.003)  # libzmq handles commands in a send at most about once a millisecond
                link.submit = submit
                m.new_step_starts([extended("a", 4, (1,))])
                sid = save(m, [Part("a", 1, [0, 1], 4, 2)], BS)  # its quiet send takes the reply's edge
                link.submit = real_submit
                assert not select.select([link._sock_fd], [], [], 0)[0], "the quiet send left the edge (premise)"
                time.sleep(0.05)  # the committer rejects the step; its reply comes in behind the first one
                assert not status.done()
                gate.set()  # the I/O thread goes on to its poll
                t0 = time.monotonic()
                with pytest.raises(OmniPrefixCacheUnmatchError, match="out of range"):
                    m.discard_step(sid)
                    m.new_step_starts([extended("a", 6)])
                    save(m, [Part("a", 1, [0, 1], 6, 1)], BS)  # joins the rejected step
                waited = time.monotonic() - t0
                assert waited < 3, \
                    f"the rejection was seen after {waited * 1000:.0f} ms (the I/O thread's poll tick: 10 s)"
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
    finally:
        link.submit = real_submit
        m.shutdown()
