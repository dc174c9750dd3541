"""Committer restarts at the edges of a writer's life (found by review, 2026-12-04; docs/FAULTS.md).

Each test SIGKILLs a real committer at one moment and starts another for the same cache, which adopts it:

- a writer attached but with no key yet (an engine before its first request) resumes;
- a crash after a new key was recorded and before the writer's staging for it existed, or inside the
  staging's creation (an empty segment): the writer resumes, and its re-sent ``OpenKey`` makes that staging;
- a crash after a new writer was recorded and before its Welcome went out: its Hello, sent again, takes its
  own recorded seat at once;
- a new writer arriving while the adopted seat of a dead writer is kept for its resume is told to retry, and
  gets the seat once the placeholder is reaped;
- a first ``Hello`` that a committer held when it was killed is sent again, so the restarted committer answers.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq

from helpers import stopped_at_hello
from manager_helpers import BS, Part, rows, save, small_config, started
from omnishm import protocol, shm
from omnishm.client import OmniPrefixCacheManager
from omnishm.client.link import CommitterLink
from omnishm.interface import HIDDEN_KEY, OmniPrefixCacheCommitterError

FAST = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def _patched_committer(patch: str) -> tuple[str, ...]:
    """``python_args`` running the committer with ``patch`` applied first (a crash or a stall at one point)."""
    return ("-c", textwrap.dedent(patch) + "\nfrom omnishm.committer.start import main\nsys.exit(main(sys.argv[1:]))\n")


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _attach_in_a_thread(committer, **link_kw) -> tuple[threading.Thread, dict[str, object]]:
    """A client attaching (its first Hello) on a started thread; ``out`` gets its ``welcome`` or its ``error``."""
    out: dict[str, object] = {}

    def attach() -> None:
        try:
            link = CommitterLink(cache=committer.name, endpoint=committer.endpoint, layout=LAYOUT,
                                 connect_timeout_s=20.0, **link_kw)
            out["welcome"] = link.welcome
            link.close()
        except Exception as exc:  # reported by the caller's assertion
            out["error"] = exc

    thread = threading.Thread(target=attach)
    thread.start()
    return thread, out


def test_a_writer_with_no_key_yet_resumes_after_a_restart_and_writes(committer_factory):
    first = committer_factory(*FAST)
    m = OmniPrefixCacheManager(small_config(reconnect_timeout_s=20.0, commit_timeout_s=10.0), cache=first.name,
                               endpoint=first.endpoint, autostart=False)
    try:
        first.stop(signal.SIGKILL)
        second = committer_factory(*FAST, name=first.name)
        _wait(lambda: m._link.stats["reconnects"] >= 1 or m._link.dead is not None, 20, "the resume")
        assert m._link.dead is None, m._link.dead
        assert "1 writer(s) expected to resume" in second.log()
        m.new_step_starts([started("a", [0])])
        step = save(m, [Part("a", 1, [0], 0, 4)], BS)
        m.discard_step(step)
        m.wait_idle(timeout_s=10)
        assert torch.equal(m._keys[HIDDEN_KEY].pool[0:4], rows(1, range(4)))
    finally:
        m.shutdown()


_DIE_BEFORE_K1_STAGING = """
    import os, signal, sys
    from omnishm.committer import pool
    ensure = pool.CachePool.ensure_staging
    def die_before_k1_staging(self, cid, state, rows):
        if state.name == "k1" and cid not in state.staging:
            os.kill(os.getpid(), signal.SIGKILL)  # open_key recorded k1; the staging is not made yet
        return ensure(self, cid, state, rows)
    pool.CachePool.ensure_staging = die_before_k1_staging
"""

_DIE_INSIDE_K1_STAGING = """
    import os, signal, sys
    import posix_ipc
    from omnishm import shm
    create = shm.Segment.create.__func__
    def die_inside_k1_staging(cls, name, size, **kw):
        if ".stage." in name and name.endswith(".k1"):
            posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)  # opened, not sized yet
            os.kill(os.getpid(), signal.SIGKILL)
        return create(cls, name, size, **kw)
    shm.Segment.create = classmethod(die_inside_k1_staging)
"""


@pytest.mark.parametrize("patch", [_DIE_BEFORE_K1_STAGING, _DIE_INSIDE_K1_STAGING], ids=["before", "inside"])
def test_a_crash_around_making_a_new_keys_staging_keeps_the_writer(committer_factory, patch):
    first = committer_factory(*FAST, python_args=_patched_committer(patch))
    w = CommitterLink(cache=first.name, role=protocol.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                      staging_rows=4, reconnect_timeout_s=20.0)
    try:
        w.request(lambda rid: protocol.OpenKey(rid=rid, key="k0", dtype="float32", width=4))
        pending = w.submit(lambda rid: protocol.OpenKey(rid=rid, key="k1", dtype="float32", width=4))
        assert first.proc.wait(10) == -signal.SIGKILL
        k0, k1 = (shm.segment_name(first.name, w.welcome.generation, f"stage.{w.client_id[:12]}.k{i}") for i in (0, 1))
        assert {shm.parse_segment_name(n)[2] for n in shm.list_segments(first.name)} >= {"pool.k1"}
        second = committer_factory(*FAST, name=first.name)
        opened = pending.result(timeout=20)
        assert isinstance(opened, protocol.KeyOpened), opened
        assert opened.segments.staging == k1
        assert w.dead is None, w.dead
        assert "has no staging for key 'k1' yet" in second.log()
        assert k0 in shm.list_segments(first.name)  # the staging the writer maps was kept
    finally:
        w.close()


def test_a_resume_naming_staging_the_restarted_committer_lost_is_refused(committer_factory):
    """MUTATION (2026-12-06): welcoming a writer's resume that names a staging segment the adopting committer
    does not hold survived the suite. The writer would go on staging into its map of the lost segment, while
    the committer made a new one of the same name for the key's next OpenKey and committed its zero rows.
    Here the staging was unlinked while no committer ran; the resume is refused, naming it."""
    import fcntl

    import posix_ipc
    from helpers import RawClient, Writer

    first = committer_factory(*FAST)
    w = Writer(first.endpoint, first.name, LAYOUT, 4)
    again = RawClient(first.endpoint, first.name)
    again.client_id = w.raw.client_id
    control = posix_ipc.SharedMemory(w.welcome.control)  # held as a client holds it: the restart adopts
    try:
        fcntl.flock(control.fd, fcntl.LOCK_SH)
        staging = w.open_key("k0", "float32", 4).segments.staging
        first.stop(signal.SIGKILL)
        assert shm.unlink_segment(staging)
        second = committer_factory(*FAST, name=first.name)
        reply = again.hello(protocol.ROLE_WRITER, LAYOUT, 4, resume=True, resume_generation=w.welcome.generation,
                            resume_epoch=w.epoch, resume_staging=[staging])
        assert isinstance(reply, protocol.Refused), reply
        assert "cannot resume writer" in reply.reason and staging in reply.reason, reply.reason
        assert second.proc.poll() is None
    finally:
        control.close_fd()
        again.close()
        w.raw.close()


def test_an_adopted_key_keeps_the_row_shape_it_was_opened_with(committer_factory):
    """Each key's row shape is in the metadata a restarted committer adopts (metadata version 2), so a
    key still refuses rows of another shape after a restart, and its segments still name the shape."""
    first = committer_factory(*FAST)
    w = CommitterLink(cache=first.name, role=protocol.ROLE_WRITER, endpoint=first.endpoint, layout=LAYOUT,
                      staging_rows=4, reconnect_timeout_s=20.0)
    try:
        def open_sq(shape: tuple[int, ...]) -> protocol.KeyOpened:
            return w.request(lambda rid: protocol.OpenKey(rid=rid, key="sq", dtype="float32", width=6, row_shape=shape))

        opened = open_sq((2, 3))
        assert opened.segments.row_shape == (2, 3)
        first.stop(signal.SIGKILL)
        second = committer_factory(*FAST, name=first.name)
        _wait(lambda: w.stats["reconnects"] >= 1 or w.dead is not None, 20, "the resume")
        assert w.dead is None, w.dead
        assert "adopted live generation" in second.log()
        with pytest.raises(OmniPrefixCacheCommitterError, match=r"layout_mismatch.*holds rows of shape \(2, 3\)"):
            open_sq((3, 2))
        again = open_sq((2, 3))
        assert again.segments.row_shape == (2, 3) and again.segments.pool == opened.segments.pool
    finally:
        w.close()


_DIE_BEFORE_THE_WRITERS_WELCOME = """
    import os, signal, sys
    from omnishm.committer import attach
    welcome = attach.Attach.welcome
    def die_before_the_writers_welcome(self, rid, session, resumed=False):
        if session.role == "writer" and not resumed:
            os.kill(os.getpid(), signal.SIGKILL)  # the writer's epoch is recorded; its Welcome is not sent
        return welcome(self, rid, session, resumed)
    attach.Attach.welcome = die_before_the_writers_welcome
"""


def test_a_writer_recorded_before_its_welcome_was_lost_takes_its_own_seat(committer_factory):
    args = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "30")  # a seat kept for 30 s: taken at once
    first = committer_factory(*args, python_args=_patched_committer(_DIE_BEFORE_THE_WRITERS_WELCOME))
    reader = CommitterLink(cache=first.name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                           reconnect_timeout_s=60.0)  # holds the cache, so the next committer adopts it
    thread, out = _attach_in_a_thread(first, role=protocol.ROLE_WRITER, staging_rows=4)
    try:
        assert first.proc.wait(20) == -signal.SIGKILL
        second = committer_factory(*args, name=first.name)
    finally:
        thread.join(30)
        reader.close()
    welcome = out.get("welcome")
    assert isinstance(welcome, protocol.Welcome), out
    assert welcome.epoch == 1  # the recorded epoch: no epoch spent, none handed out twice
    assert "recorded before the restart" in second.log()


def _writer_that_waits(name: str, endpoint: str) -> str:
    return textwrap.dedent(f"""
        import time
        from omnishm import protocol
        from omnishm.client.link import CommitterLink
        link = CommitterLink(cache={name!r}, role="writer", endpoint={endpoint!r},
                             layout=protocol.Layout(num_blocks=8, block_size=4), staging_rows=4)
        link.request(lambda rid: protocol.OpenKey(rid=rid, key="k", dtype="float32", width=4))
        print("ready", link.client_id, flush=True)
        time.sleep(300)
    """)


def test_a_new_writer_waits_for_the_adopted_seat_of_a_dead_writer(committer_factory):
    args = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "4")
    first = committer_factory(*args)
    dead_writer = subprocess.Popen([sys.executable, "-c", _writer_that_waits(first.name, first.endpoint)],
                                   stdout=subprocess.PIPE, text=True)
    reader = None
    try:
        ready, dead_id = dead_writer.stdout.readline().split()
        assert ready == "ready"
        # A reader holds the cache, so the next committer adopts it with the dead writer's seat kept.
        reader = CommitterLink(cache=first.name, role=protocol.ROLE_READER, endpoint=first.endpoint, layout=LAYOUT,
                               reconnect_timeout_s=30.0)
        dead_writer.kill()
        dead_writer.wait()
        first.stop(signal.SIGKILL)
        second = committer_factory(*args, name=first.name)
        _a_socket_cannot_pose_as_the_seat(second.endpoint, dead_id)
        t0 = time.monotonic()
        writer = CommitterLink(cache=first.name, role=protocol.ROLE_WRITER, endpoint=second.endpoint, layout=LAYOUT,
                               staging_rows=4, connect_timeout_s=30.0)
        try:
            assert writer.welcome.epoch == 2
            assert time.monotonic() - t0 < 15
            assert "which this committer adopted at its restart" in second.log()
        finally:
            writer.close()
    finally:
        if dead_writer.poll() is None:
            dead_writer.kill()
            dead_writer.wait()
        if reader is not None:
            reader.close()


def _a_socket_cannot_pose_as_the_seat(endpoint: str, client_id: str) -> None:
    """The adopted seat has no socket, so no routing id a DEALER may choose reaches it (the placeholders were
    once keyed by ``b"adopted:" + client_id``): the impostor is a stranger, and keeps nobody's seat alive."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        for routing_id in (b"adopted:" + client_id.encode(), client_id.encode(), b"\x00" + client_id.encode()):
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.connect(endpoint)
            sock.send(protocol.encode(protocol.Heartbeat(rid=7)))
            assert sock.poll(10_000), "no reply to the impostor's heartbeat"
            reply = protocol.reply_decoder.decode(sock.recv())
            assert isinstance(reply, protocol.Error) and reply.code == "no_session", (routing_id, reply)
            sock.disconnect(endpoint)
    finally:
        sock.close()


_STALL_READER_HELLO = """
    import sys, time
    from omnishm.committer import attach
    on_hello = attach.Attach.on_hello
    def stalled(self, identity, msg):
        if msg.role == "reader":
            print("holding the Hello", file=sys.stderr, flush=True)
            time.sleep(60)  # a long stall (an apply, a prefault), killed meanwhile
        return on_hello(self, identity, msg)
    attach.Attach.on_hello = stalled
"""


def test_a_first_hello_held_by_a_killed_committer_is_sent_again(committer_factory):
    first = committer_factory(*FAST, python_args=_patched_committer(_STALL_READER_HELLO))
    thread, out = _attach_in_a_thread(first, role=protocol.ROLE_READER)
    try:
        _wait(lambda: "holding the Hello" in first.log(), 20, "the committer to hold the Hello")
    finally:
        first.stop(signal.SIGKILL)  # also when the wait failed: a committer stalled for 60 s ignores SIGTERM
    try:
        committer_factory(*FAST, name=first.name)
    finally:
        thread.join(30)
    assert isinstance(out.get("welcome"), protocol.Welcome), out



# SIGTERM arrives, and its handler runs, just before the committer handles a resume Hello.
def test_a_stopping_committer_refuses_a_resume_and_the_client_is_told_why(committer_factory):
    """A committer that is stopping refuses a resume Hello, saying so: its stop unlinks the generation with its
    clients attached, so the resume could never hold, and no later committer can resume it either. The writer's
    link dies at once with the reason. REVIEW (stop 48): the resume was welcomed (the stopping check came after
    it), the stop unlinked the cache 20 ms later, and the client waited its whole ``reconnect_timeout_s`` to
    fail with "no committer resumed", never told the committer was stopping."""
    first = committer_factory(*FAST)
    m = OmniPrefixCacheManager(small_config(reconnect_timeout_s=30.0, commit_timeout_s=10.0), cache=first.name,
                               endpoint=first.endpoint, autostart=False)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        m.wait_idle(timeout_s=10)
        first.stop(signal.SIGKILL)
        second = committer_factory(*FAST, name=first.name, python_args=stopped_at_hello("msg.resume"),
                                   wait=False)
        assert second.proc.wait(20) == 0, second.log()
        _wait(lambda: m._link.dead is not None, 15, "the link to go dead")  # well inside reconnect_timeout_s
        assert "cannot resume" in m._link.dead and "is stopping" in m._link.dead, m._link.dead
        assert m._link.stats["reconnects"] == 0
    finally:
        m.shutdown()


def test_a_client_attaches_past_a_probe_stopped_while_it_held_the_control_segment(committer_factory, caplog):
    """Review (2026-12-06): a new client took its liveness lock (a shared flock on the control segment) with a
    blocking flock, after the Welcome and outside ``connect_timeout_s``. A starting committer's adoption check
    or the orphan sweep holds the lock exclusively for a probe of microseconds; one stopped mid-probe held the
    constructor, on the engine thread that builds the manager, for as long as it stayed stopped. Now the
    client waits ``LIVENESS_LOCK_PATIENCE_S`` for it, then attaches without the lock and says so."""
    from omnishm.client.attach import LIVENESS_LOCK_PATIENCE_S

    h = committer_factory()
    OmniPrefixCacheManager(small_config(), cache=h.name, autostart=False).shutdown()  # the control segment is made
    ctl = [s for s in shm.list_segments(h.name) if s.endswith(".ctl")]
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, posix_ipc, sys
        seg = posix_ipc.SharedMemory({ctl[0]!r}, 0)
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a probe, stopped while it holds the lock
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    box: dict = {}
    attach = threading.Thread(target=lambda: box.setdefault(
        "writer", OmniPrefixCacheManager(small_config(), cache=h.name, autostart=False)))
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        attach.start()
        attach.join(LIVENESS_LOCK_PATIENCE_S + 30)
        assert not attach.is_alive(), "the constructor waited for the stopped probe"
        assert holder.poll() is None  # it still holds the lock: the constructor did not wait it out
        assert time.monotonic() - t0 >= LIVENESS_LOCK_PATIENCE_S  # it gave the probe its patience
        assert "attached without the liveness lock" in caplog.text
        m = box["writer"]
        assert m._link._live_fd < 0
        m.new_step_starts([started("a", [0])])
        sid = save(m, [Part("a", 1, [0], 0, 4)], BS)
        assert torch.equal(m.materialize(sid, ["a"]).hidden_states["a"], rows(1, range(4)))
    finally:
        holder.stdin.close()
        holder.wait(30)
        if attach.ident is not None:
            attach.join(60)
        if "writer" in box:
            box["writer"].shutdown()
