"""The committer's session table and Hello handling at their edges.

Each test kills a mutant of ``omnishm/committer/sessions.py`` or ``on_hello`` (``omnishm/committer/attach.py``)
that survived the rest of the suite (mutation review, 2026-12-06: 27 mutants, 12 killed before). Three more
survivors (the wait a stall's credited clock gives, an admin's re-Hello, two processes of one start time) have
only timing-bound tests, which are not here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from omnishm import protocol, shm
from omnishm.client.link import CommitterLink
from omnishm.liveness import proc_identity
from omnishm.committer.sessions import Session, SessionTable
from omnishm.versions import MAX_EPOCH

from helpers import RawClient, Writer, stopped_at_hello

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


ARGS = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "30")
# A committer whose second key's staging cannot be made for a client whose id starts with "nospace" (what a
# full /dev/shm does to the committer's segment creation).
NO_SPACE_FOR_SECOND_KEY = """
import sys
from omnishm.committer import pool
ensure = pool.CachePool.ensure_staging
def ensure_staging(self, client_id, state, rows):
    if client_id.startswith("nospace") and state.index == 1 and client_id not in state.staging:
        raise OSError(28, "No space left on device")
    return ensure(self, client_id, state, rows)
pool.CachePool.ensure_staging = ensure_staging
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_writer_refused_for_staging_space_leaves_no_staging_behind(committer_factory):
    """A writer's Hello that the committer refuses because one key's staging cannot be made (no space) must leave none
    of that writer's staging segments behind: the ones already made for its other keys are unlinked with the
    refusal, so /dev/shm holds nothing of a client the committer does not know. Mutation review (2026-12-06,
    ``drop_client`` dropped from ``on_hello``'s staging refusal: the first key's staging leaked for the committer's
    life, and a retry by another client id leaked another)."""
    handle = committer_factory(*ARGS, python_args=("-c", NO_SPACE_FOR_SECOND_KEY))
    first = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    first.open_key("k0", "float32", 8)
    first.open_key("k1", "float32", 8)
    first.goodbye()
    second = RawClient(handle.endpoint, handle.name)
    second.client_id = "nospace" + second.client_id[:20]
    try:
        r = second.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(r, protocol.Refused) and "cannot create staging segments" in r.reason, r
        left = [n for n in shm.list_segments(handle.name) if "nospace" in n]
        assert left == [], left
    finally:
        second.close()


def test_a_session_whose_process_is_gone_may_be_resumed_from_another_process(committer_factory):
    """``resume_taken`` guards a live process's session only (docs/FAULTS.md, "Clients resume"): a resume under a
    client id whose session was said Hello from a process that is gone now is accepted and moves the session to the
    new socket. Mutation review (2026-12-06, ``not process_gone(session)`` dropped from ``on_resume``: the resume of
    a dead process's session was refused for good as taken). The first Hello names a real child process, confirmed
    by its start time, which is then killed and reaped. Also pinned (the resumed session kept the dead process's pid
    and start time)."""
    handle = committer_factory(*ARGS)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    a, b = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    b.client_id = a.client_id
    try:
        started = proc_identity(child.pid)
        assert started is not None
        w = a.hello(protocol.ROLE_READER, LAYOUT, pid=child.pid, started=started)
        assert isinstance(w, protocol.Welcome), w
        # while the child lives, another process may not take its session
        r = b.hello(protocol.ROLE_READER, LAYOUT, resume=True, resume_generation=w.generation)
        assert isinstance(r, protocol.Refused) and "which is alive" in r.reason, r
        child.kill()
        child.wait()
        r = b.hello(protocol.ROLE_READER, LAYOUT, resume=True, resume_generation=w.generation)
        assert isinstance(r, protocol.Welcome) and r.resumed, r
        # the session is the resuming process's now (status, and the next resume_taken check, go by it)
        adm = RawClient(handle.endpoint, handle.name)
        try:
            assert isinstance(adm.hello(protocol.ROLE_ADMIN), protocol.Welcome)
            ent = [c for c in adm.status()["clients"] if c["client_id"] == b.client_id]
            assert len(ent) == 1 and ent[0]["pid"] == os.getpid(), ent
            adm.goodbye()
        finally:
            adm.close()
        assert isinstance(b.goodbye(), protocol.Bye)
    finally:
        if child.poll() is None:
            child.kill(); child.wait()
        a.close(); b.close()


def test_a_writers_resume_sent_again_on_its_own_socket_keeps_its_staging(committer_factory):
    """A writer's resume Hello that reaches the committer on the socket its session already has (a resume sent again
    because its first reply was slow) moves nothing and drops nothing: the writer keeps its seat, its epoch and its
    staging segments, named again in the Welcome. Mutation review (2026-12-06, ``previous is not session`` dropped
    from ``on_resume``: the session was detached as a re-Hello first, which unlinked the writer's staging under a
    writer that still maps and uses it)."""
    handle = committer_factory(*ARGS)
    w = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    w.open_key("k0", "float32", 8)
    try:
        staging = [n for n in shm.list_segments(handle.name) if ".stage." in n]
        assert len(staging) == 1, staging
        r = w.raw.hello(protocol.ROLE_WRITER, LAYOUT, 4, resume=True, resume_generation=w.welcome.generation,
                        resume_epoch=w.epoch, resume_staging=staging)
        assert isinstance(r, protocol.Welcome) and r.resumed and r.epoch == w.epoch, r
        assert [k.staging for k in r.keys] == staging, r.keys
        assert [n for n in shm.list_segments(handle.name) if ".stage." in n] == staging
    finally:
        w.goodbye()


def test_a_writer_may_resume_naming_only_the_staging_it_was_told_of(committer_factory):
    """A writer's resume names the staging segments it mapped; one it never got back (the committer died before its
    ``KeyOpened`` reply) may be missing, so a subset of the committer's staging names is accepted (docs/FAULTS.md,
    "Clients resume": "a subset: a name the client never got back is fine"), and a name the committer does not hold
    is refused. Mutation review (2026-12-06, the subset check made an equality: such a writer's resume was refused
    for good, losing every unacknowledged write)."""
    handle = committer_factory(*ARGS)
    w = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    w.open_key("k0", "float32", 8)
    w.open_key("k1", "float32", 8)
    try:
        staging = sorted(n for n in shm.list_segments(handle.name) if ".stage." in n)
        assert len(staging) == 2, staging
        bogus = staging[0][:-1] + "9"
        r = w.raw.hello(protocol.ROLE_WRITER, LAYOUT, 4, resume=True, resume_generation=w.welcome.generation,
                        resume_epoch=w.epoch, resume_staging=[bogus])
        assert isinstance(r, protocol.Refused) and "staging" in r.reason, r
        r = w.raw.hello(protocol.ROLE_WRITER, LAYOUT, 4, resume=True, resume_generation=w.welcome.generation,
                        resume_epoch=w.epoch, resume_staging=staging[:1])
        assert isinstance(r, protocol.Welcome) and r.resumed and r.epoch == w.epoch, r
        assert sorted(k.staging for k in r.keys) == staging, r.keys
    finally:
        w.goodbye()


NO_META_FOR_SOME_WRITERS = """
import sys
from omnishm.committer import pool
record = pool.CachePool.set_writer_epoch
def set_writer_epoch(self, epoch, client_id=None, staging_rows=0, *process):
    if client_id is not None and client_id.startswith("nometa"):
        return False  # what a metadata save that failed (disk full, EIO) returns
    return record(self, epoch, client_id, staging_rows, *process)
pool.CachePool.set_writer_epoch = set_writer_epoch
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_writer_refused_for_its_metadata_leaves_its_key_specs_undeclared(committer_factory):
    """A writer refused because its epoch cannot be recorded in the metadata declares nothing: the key specs its
    Hello's layout brought are taken back, so the next writer may declare the same key with other geometry and is
    welcomed, and the cache's layout (its Welcome) names only that writer's spec. Mutation review (2026-12-06,
    ``forget_specs`` dropped from that refusal: the refused writer's spec stayed, and every later writer with its
    own spec for the key was refused for good with a layout mismatch)."""
    handle = committer_factory(*ARGS, python_args=("-c", NO_META_FOR_SOME_WRITERS))
    refused, ok = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    refused.client_id = "nometa" + refused.client_id[:20]
    try:
        mine = protocol.Layout(8, 4, {"k0": protocol.KeySpec("float32", 8)})
        r = refused.hello(protocol.ROLE_WRITER, mine, 4)
        assert isinstance(r, protocol.Refused) and "metadata" in r.reason, r
        theirs = protocol.Layout(8, 4, {"k0": protocol.KeySpec("float16", 16)})
        w = ok.hello(protocol.ROLE_WRITER, theirs, 4)
        assert isinstance(w, protocol.Welcome), w
        assert w.layout.keys["k0"].dtype == "float16" and w.layout.keys["k0"].width == 16, w.layout
        assert isinstance(ok.goodbye(), protocol.Bye)
    finally:
        refused.close(); ok.close()


def test_a_layout_refusal_is_retryable_only_while_every_client_is_likely_dead(committer_factory):
    """An ``--exit-when-idle`` committer refuses a Hello of another layout for good while any client is likely alive,
    and with a wait only once every data client is likely dead (silent, or its process gone): one killed process
    among live clients keeps the cache, and so its layout, for good. Mutation review (2026-12-06, ``not
    all(process_gone ...)`` made ``not any``: one killed reader among live ones made the refusal retryable, and the
    refused engine retried against a cache that would not go idle)."""
    handle = committer_factory("--exit-when-idle", *ARGS)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead, live, other = (RawClient(handle.endpoint, handle.name) for _ in range(3))
    try:
        started = proc_identity(child.pid)
        assert started is not None
        assert isinstance(dead.hello(protocol.ROLE_READER, LAYOUT, pid=child.pid, started=started), protocol.Welcome)
        assert isinstance(live.hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
        child.kill()
        child.wait()
        r = other.hello(protocol.ROLE_READER, protocol.Layout(16, 4))
        assert isinstance(r, protocol.Refused) and "layout mismatch" in r.reason, r
        assert r.retry_after_s == 0.0, r
        assert isinstance(live.goodbye(), protocol.Bye)
    finally:
        if child.poll() is None:
            child.kill(); child.wait()
        for c in (dead, live, other):
            c.close()


def test_a_stopping_committer_tells_a_new_client_to_retry(committer_factory):
    """A new client's Hello answered by a committer on its way out (the stop signal came while the Hello was queued) is
    refused for now, not for good: the Refused says the committer is stopping and carries a retry delay, so the
    client tries again and the cache's next committer (a supervisor's, an autostart) answers it. Mutation review
    (2026-12-06, ``retry_after_s`` dropped from that refusal: the client took it as final and its engine failed to
    start)."""
    handle = committer_factory(*ARGS, python_args=stopped_at_hello('msg.client_id.startswith("late")'))
    c = RawClient(handle.endpoint, handle.name)
    c.client_id = "late" + c.client_id[:20]
    try:
        r = c.hello(protocol.ROLE_READER, LAYOUT)
        assert isinstance(r, protocol.Refused) and "is stopping" in r.reason, r
        assert r.retry_after_s > 0, r
        assert handle.proc.wait(20) == 0, handle.log()
    finally:
        c.close()


# MUTATION S5 (SessionTable.credit over live sessions only): a committer's loop stall was not credited to an
# adopted writer's placeholder, so after an adopting restart that stalled, the writer's seat was reaped early and
# its resume refused for good (every unacknowledged write lost). Placeholders are credited like sessions. (stop 54)
def test_a_stall_is_credited_to_an_adopted_writers_placeholder():
    t = SessionTable()
    seat = Session(identity=b"", client_id="w", role=protocol.ROLE_WRITER, pid=1, uid=0, attached_at=100.0,
                   last_seen=100.0, adopted=True)
    reader = Session(identity=b"r", client_id="r", role=protocol.ROLE_READER, pid=1, uid=0, attached_at=100.0,
                     last_seen=100.0)
    t.add(seat)
    t.add(reader)
    t.credit(8.0, 112.0)  # the loop stood still 8 s of the 12 s since the adoption
    assert seat.last_seen == 108.0 and reader.last_seen == 108.0
    assert t.expired(112.0, 10.0) == []  # 4 s of real silence: neither is reaped
    assert seat in t.expired(118.5, 10.0)


_SEATED_WRITER = """
import sys, time
from omnishm import protocol
from omnishm.client.link import CommitterLink
link = CommitterLink(cache=sys.argv[1], role="writer", endpoint=sys.argv[2],
                     layout=protocol.Layout(num_blocks=8, block_size=4), staging_rows=4, reconnect_timeout_s=20.0)
link.request(lambda rid: protocol.OpenKey(rid=rid, key="k", dtype="float32", width=4))
first = link.welcome.committer_pid
print("ready", link.client_id, link.welcome.epoch, flush=True)
sys.stdin.readline()  # the test has killed the committer, started another and tried the seat
until = time.monotonic() + 20
while link.dead is None and link.welcome.committer_pid == first and time.monotonic() < until:
    time.sleep(0.02)
print("DEAD" if link.dead else "RESUMED", link.welcome.epoch, link.dead or "", flush=True)
link.close()
"""


@pytest.mark.parametrize("resume", [False, True])
def test_another_live_process_cannot_take_a_live_writers_seat_after_a_restart(committer_factory, resume):
    """Review (stop 56): a restart keeps the seat of each writer the dead committer knew, and that seat had no
    process: a Hello (plain or a resume) from another live process naming the writer's client id took it, its
    epoch and its staging, and the live writer's own resume was then refused. The metadata records each
    writer's process now: the other process is refused (``resume_taken``) while the writer lives, and the writer
    resumes its seat with its epoch."""
    first = committer_factory(*ARGS)
    w = subprocess.Popen([sys.executable, "-c", _SEATED_WRITER, first.name, first.endpoint], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    raw = None
    try:
        ready, wid, epoch = w.stdout.readline().split()
        assert ready == "ready"
        os.kill(w.pid, signal.SIGSTOP)  # the writer has not noticed the restart yet
        first.stop(signal.SIGKILL)
        second = committer_factory(*ARGS, name=first.name)  # adopts the cache: the writer holds its lock
        raw = RawClient(second.endpoint, second.name)
        raw.client_id = wid  # a client id taken by mistake (a copied config; `omnishm status` prints it)
        staging = [s for s in shm.list_segments(first.name) if ".stage." in s]
        extra = dict(resume=True, resume_generation=staging[0].split(".")[2], resume_epoch=int(epoch),
                     resume_staging=staging) if resume else {}
        reply = raw.hello(protocol.ROLE_WRITER, LAYOUT, 4, **extra)
        assert isinstance(reply, protocol.Refused) and f"belongs to process {w.pid}, which is alive" in reply.reason, \
            reply
        os.kill(w.pid, signal.SIGCONT)
        out, _ = w.communicate("go\n", timeout=60)
        assert out.split()[:2] == ["RESUMED", epoch], out
    finally:
        if raw is not None:
            raw.close()
        if w.poll() is None:
            os.kill(w.pid, signal.SIGCONT)
            w.kill()
            w.wait()


def _hello_as_owner(handle, **fields):
    raw = RawClient(handle.endpoint, handle.name)
    raw.client_id = "seat-owner"
    return raw, raw.hello(protocol.ROLE_WRITER, LAYOUT, 4, **fields)


def _as(pid: int) -> dict:
    """A Hello's process fields for ``pid``, its start time confirmed."""
    return dict(pid=pid, started=proc_identity(pid))


@pytest.mark.parametrize("take_back", ["hello", "resume"])
def test_a_seat_taken_back_after_a_restart_keeps_its_process_over_a_second_restart(committer_factory, take_back):
    """Mutation reviews (stops 56 and 59): a writer taking its seat back after a restart, with a plain Hello or a
    resume, is recorded with its process again, so after a second restart another live process is still refused
    (``resume_taken``). The resume's case starts from a first Hello without a start time (unconfirmed: another
    pid namespace): without the resume's record (``on_resume``'s ``set_writer_epoch`` dropped, stop 59) the
    third committer's seat had no process, and another process took it, its epoch and its staging."""
    first = committer_factory(*ARGS)
    holder = CommitterLink(cache=first.name, role="reader", endpoint=first.endpoint, layout=LAYOUT,
                           reconnect_timeout_s=30.0)  # keeps the cache attached across the restarts
    raws = []
    try:
        raw, welcome = _hello_as_owner(first, **(_as(os.getpid()) if take_back == "hello" else {}))
        raws.append(raw)
        assert isinstance(welcome, protocol.Welcome), welcome
        epoch = welcome.epoch
        first.stop(signal.SIGKILL)
        second = committer_factory(*ARGS, name=first.name)
        resume = dict(resume=True, resume_generation=welcome.generation, resume_epoch=epoch, resume_staging=[])
        raw, again = _hello_as_owner(second, **_as(os.getpid()), **(resume if take_back == "resume" else {}))
        raws.append(raw)  # this same process takes its seat back
        assert isinstance(again, protocol.Welcome) and again.epoch == epoch, again
        assert again.resumed == (take_back == "resume"), again
        second.stop(signal.SIGKILL)
        third = committer_factory(*ARGS, name=first.name)
        raw, taken = _hello_as_owner(third, **_as(os.getppid()))  # another live process, its start time confirmed
        raws.append(raw)
        assert isinstance(taken, protocol.Refused) and f"belongs to process {os.getpid()}, which is alive" \
            in taken.reason, taken
        raw, mine = _hello_as_owner(third, **_as(os.getpid()))
        raws.append(raw)
        assert isinstance(mine, protocol.Welcome) and mine.epoch == epoch, mine
        raw.goodbye()
    finally:
        for raw in raws:
            raw.close()
        holder.close()


SMALL_SESSION_LIMIT = """
import sys
from omnishm.committer import attach
attach.MAX_SESSIONS = 3
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_past_its_session_limit_a_committer_refuses_readers_and_admins_but_never_a_writer(committer_factory):
    """Review (stop 56): sessions had no limit, and a process opening and dropping thousands of them grew the
    committer by 54 KiB each until its status reply outgrew the message limit. Past ``MAX_SESSIONS`` (3 here) a
    reader's or an admin's new session, plain or by resume, is refused, retryable after the heartbeat timeout;
    a writer still attaches, and a session that goes makes room."""
    handle = committer_factory(*ARGS, python_args=("-c", SMALL_SESSION_LIMIT))
    clients = [RawClient(handle.endpoint, handle.name) for _ in range(6)]
    try:
        for c in clients[:3]:
            assert isinstance(c.hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
        refused = clients[3].hello(protocol.ROLE_READER, LAYOUT)
        assert isinstance(refused, protocol.Refused) and "holds 3 sessions, its limit" in refused.reason, refused
        assert refused.retry_after_s == 30.0
        again = clients[4].hello(protocol.ROLE_READER, LAYOUT, resume=True, resume_generation="x" * 8)
        assert isinstance(again, protocol.Refused), again
        assert isinstance(clients[5].hello(protocol.ROLE_ADMIN), protocol.Refused)
        writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)  # the writer is never refused for it (4 now)
        for c in clients[:2]:
            c.goodbye()
        assert isinstance(clients[3].hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
        writer.raw.close()
    finally:
        for c in clients:
            c.close()
