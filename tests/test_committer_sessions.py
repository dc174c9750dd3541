"""The committer's session table and Hello handling at their edges.

Each test kills a mutant of ``omnishm/committer/sessions.py`` or ``on_hello`` (``omnishm/committer/attach.py``)
that survived the rest of the suite (mutation review, 2026-12-06: 27 mutants, 12 killed before). Three more
survivors (the wait a stall's credited clock gives, an admin's re-Hello, two processes of one start time) have
only timing-bound tests, which are not here.
"""

from __future__ import annotations

import os
import signal

from omnishm import protocol
from omnishm.client.link import CommitterLink
from omnishm.committer.sessions import Session, SessionTable
from omnishm.versions import MAX_EPOCH

from helpers import RawClient

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def mk(ident: bytes, cid: str, role: str = protocol.ROLE_WRITER, t: float = 100.0, adopted: bool = False) -> Session:
    return Session(identity=ident, client_id=cid, role=role, pid=1, uid=0, attached_at=t, last_seen=t,
                   adopted=adopted)


def test_rekey_keeps_writer_and_unadopts_placeholder():
    """MUTATION (2026-12-06): a resume's rekey that lost the writer seat (a second writer then welcomed), left the
    session marked adopted, or did not count the Hello as heard, survived."""
    t = SessionTable()
    w = mk(b"", "w", adopted=True)
    t.add(w)
    assert t.writer is w and t.get(b"x") is None and t.by_client("w") is w
    t.rekey(w, b"x", 200.0)
    assert t.writer is w                       # S4
    assert w.adopted is False                  # S5
    assert w.last_seen == 200.0 and w.heard_at == 200.0   # S6
    assert t.get(b"x") is w and len(t) == 1
    t.remove(w)                                # S5: removal must find it among live sessions
    assert len(t) == 0 and t.writer is None


def test_mark_reaped_reader_keeps_no_identity():
    """MUTATION (2026-12-06): keeping a reaped reader's socket as a reaped writer's survived (its StepWrite was then
    answered as the writer's failed writes)."""
    t = SessionTable()
    r = mk(b"r", "r", role=protocol.ROLE_READER)
    t.add(r)
    t.mark_reaped(r, "reaped")
    assert "r" in t.reaped_ids and b"r" not in t.reaped_identities    # S7
    w = mk(b"w", "w")
    t.add(w)
    t.mark_reaped(w, "reaped")
    assert t.reaped_identities[b"w"] == "w"


def test_touch_refreshes():
    t = SessionTable()
    r = mk(b"r", "r", role=protocol.ROLE_READER)
    t.add(r)
    assert t.touch(b"r", 150.0) is r and r.last_seen == 150.0 and r.heard_at == 150.0   # S8
    assert t.touch(b"nobody", 150.0) is None


def test_credit_capped_at_now():
    """MUTATION (2026-12-06): crediting a loop stall past ``now`` (a session heard in the future) survived."""
    t = SessionTable()
    r = mk(b"r", "r", role=protocol.ROLE_READER, t=100.0)
    t.add(r)
    t.credit(50.0, 120.0)
    assert r.last_seen == 120.0      # S9
    assert r.heard_at == 100.0


def test_placeholders_count_expire_and_are_found():
    """MUTATION (2026-12-06): an adopted writer's placeholder left out of the data clients survived: a committer
    holding only that placeholder counted as idle, and ``--exit-when-idle`` could exit before the writer resumed."""
    t = SessionTable()
    w = mk(b"", "w", adopted=True, t=100.0)
    t.add(w)
    assert t.by_client("w") is w               # S12
    assert t.data_clients() == 1 and not t.idle()   # S11
    assert t.expired(200.0, 10.0) == [w]      # S10
    assert t.readers() == 0
    t.add(mk(b"r", "r", role=protocol.ROLE_READER))
    assert t.readers() == 1


EPOCHS_NEARLY_USED_UP = """
import sys
from omnishm.committer import server
from omnishm.versions import MAX_EPOCH
init = server.Committer.__init__
def near_the_end(self, *a, **kw):
    init(self, *a, **kw)
    self.epoch = MAX_EPOCH - 1   # a cache that used all epochs but one
server.Committer.__init__ = near_the_end
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_epochs_run_out(committer_factory):
    """MUTATION (2026-12-06): ``> MAX_EPOCH`` for ``>=`` survived: a cache that had used all epochs but one handed
    out one past the 15 bits a claim version holds. The last epoch is handed out once; the next writer is refused."""
    handle = committer_factory("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "30",
                               python_args=("-c", EPOCHS_NEARLY_USED_UP))
    a, b = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    try:
        w = a.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(w, protocol.Welcome) and w.epoch == MAX_EPOCH, w
        assert isinstance(a.goodbye(), protocol.Bye)
        r = b.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(r, protocol.Refused) and f"used all {MAX_EPOCH} writer epochs" in r.reason, r
    finally:
        a.close(); b.close()


ARGS = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "30")
DIE_BEFORE_A_WRITERS_WELCOME = """
import os, signal, sys
from omnishm.committer import attach
welcome = attach.Attach.welcome
def die(self, rid, session, resumed=False):
    if session.role == "writer" and not resumed:
        os.kill(os.getpid(), signal.SIGKILL)
    return welcome(self, rid, session, resumed)
attach.Attach.welcome = die
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_adopted_seat_rules(committer_factory):
    """MUTATION (2026-12-06): the adopted seat of a writer recorded before its Welcome was lost. A reader under the
    seat's id, the seat's writer with other staging rows, and the seat's pid left stale on its taking all
    survived; each is checked here, in that order, on one restarted committer."""
    first = committer_factory(*ARGS, python_args=("-c", DIE_BEFORE_A_WRITERS_WELCOME))
    reader = CommitterLink(cache=first.name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                           reconnect_timeout_s=60.0)
    w0 = RawClient(first.endpoint, first.name)
    seat_id = w0.client_id
    try:
        w0.send(protocol.Hello(rid=w0.next_rid(), protocol=protocol.PROTOCOL_VERSION, client_id=seat_id,
                               pid=first.proc.pid, uid=os.geteuid(), role=protocol.ROLE_WRITER, cache=first.name,
                               layout=LAYOUT, staging_rows=4))
        assert first.proc.wait(20) == -signal.SIGKILL
        w0.close()
        second = committer_factory(*ARGS, name=first.name)
        other, rd, bad, mine, adm = (RawClient(second.endpoint, second.name) for _ in range(5))
        try:
            # another writer: told to wait for the seat (A7: would take it; A8: no retry)
            r = other.hello(protocol.ROLE_WRITER, LAYOUT, 4)
            assert isinstance(r, protocol.Refused) and "keeps the seat" in r.reason, r
            assert 20 < r.retry_after_s <= 30, r
            # a reader with the seat's id: a duplicate (A6)
            rd.client_id = seat_id
            r = rd.hello(protocol.ROLE_READER, LAYOUT)
            assert isinstance(r, protocol.Refused) and "already attached" in r.reason, r
            # the seat's writer with other staging rows (A12)
            bad.client_id = seat_id
            r = bad.hello(protocol.ROLE_WRITER, LAYOUT, 8)
            assert isinstance(r, protocol.Refused) and "recorded with staging_rows=4" in r.reason, r
            # the seat's writer itself: takes it, its pid now the Hello's (A13)
            mine.client_id = seat_id
            w = mine.hello(protocol.ROLE_WRITER, LAYOUT, 4)
            assert isinstance(w, protocol.Welcome) and w.epoch == 1, w
            assert isinstance(adm.hello(protocol.ROLE_ADMIN), protocol.Welcome)
            ent = [c for c in adm.status()["clients"] if c["client_id"] == seat_id]
            assert len(ent) == 1 and ent[0]["pid"] == os.getpid() and not ent[0].get("adopted"), ent
            assert isinstance(mine.goodbye(), protocol.Bye)
            adm.goodbye()
        finally:
            for c in (other, rd, bad, mine, adm):
                c.close()
    finally:
        reader.close()


def test_live_writers_id_from_another_socket_is_a_duplicate(committer):
    """MUTATION (2026-12-06): a live writer's id said again from another socket, refused as a second writer rather
    than a duplicate client id, survived."""
    w, dup = RawClient(committer.endpoint, committer.name), RawClient(committer.endpoint, committer.name)
    dup.client_id = w.client_id
    try:
        assert isinstance(w.hello(protocol.ROLE_WRITER, LAYOUT, 4), protocol.Welcome)
        r = dup.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(r, protocol.Refused) and "already attached on another socket" in r.reason, r
        assert isinstance(w.goodbye(), protocol.Bye)
    finally:
        w.close(); dup.close()
