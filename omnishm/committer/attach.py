"""How clients attach to the committer: ``Hello`` (a new session) and ``Hello(resume=True)``.

``Attach`` is a mixin of ``Committer`` (``committer/server.py``) and works on
its state: the ``SessionTable``, the ``CachePool`` and the writer epochs. Loop
thread only. Every refusal is a ``Refused`` reply naming the reason, counted
as ``hello_<why>`` in the rejected-message metric; the loop goes on serving
everyone else. Resumes are how clients survive a committer restart
(docs/FAULTS.md).
"""

from __future__ import annotations

import logging
import os
import re
import time

import msgspec

from omnishm import protocol
from omnishm.protocol import shown
from omnishm.committer.pool import MAX_STAGING_ROWS, PoolError
from omnishm.committer.sessions import Session
from omnishm.liveness import proc_identity
from omnishm.versions import MAX_EPOCH

logger = logging.getLogger("omnishm.committer")

_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: "$" also matches before a final newline
REHELLO = "re-hello"
"""Why a session ends when its socket says Hello as another client; its log lines are rate-limited together."""


MAX_SESSIONS = 1024
"""Sessions a committer holds at most (an engine has one a rank, an operator's command one while it runs). Past
it a reader's or admin's new session is refused, retryable once the dead ones are reaped; a writer's never is.
Unbounded, a process that opened and dropped sessions with large heartbeat counters grew the committer by 54
KiB each, and past about 3,500 its status reply outgrew the message limit (review, stop 56)."""


def process_gone(session: Session) -> bool:
    """Whether the process ``session`` said Hello from is gone: its pid names no live process now, or one
    started at another time. False when its Hello's pid was not confirmed (``confirmed_start``)."""
    return session.started is not None and proc_identity(session.pid) != session.started


def confirmed_start(msg: protocol.Hello) -> str | None:
    """The start time of the process ``msg`` came from, when this committer's ``/proc`` shows its pid with
    the start time the client gave (``Hello.started``), else None. A client in another pid namespace names
    a pid of its own, which may be an unrelated process here: once that one exited, a live writer was
    taken for gone (review, 2026-12-06)."""
    seen = proc_identity(msg.pid) if msg.started else None
    return seen if seen == msg.started else None


class Attach:
    """Hello and resume handling (mixin of ``Committer``; all state lives there)."""

    def refuse(self, msg: protocol.Hello, reason: str, counter: str, retry_after_s: float = 0.0) -> protocol.Refused:
        self.rejected[f"hello_{counter}"] += 1
        self.ratelog(logging.WARNING, f"hello_{counter}", "committer %s: refused %s client %s (pid %s): %s",
                     self.name, shown(msg.role, 20), shown(msg.client_id, 70), msg.pid, reason)
        return protocol.Refused(rid=msg.rid, reason=reason, retry_after_s=retry_after_s)

    def _reaped_soon(self, sessions: list[Session]) -> float:
        """Seconds until the last of ``sessions`` is reaped when each is likely dead, else 0.

        Likely dead: nothing came from any of them for over two heartbeat periods (each heartbeats every
        ``heartbeat_s``), or the process each said Hello from is gone (``process_gone``): an engine
        restarted at once said Hello within two periods of its killed writer's last beat, and was refused
        for good (review, 2026-12-06). Likely dead goes by the last message (``heard_at``), the wait by
        the reaping clock (``last_seen``, which a stall of the committer moved later): a stall credited a
        killed engine's writer, and the restarted engine's writer was refused for good instead of told to
        retry (review). Only the refused client's wait depends on this: nobody is reaped early."""
        if not sessions:
            return 0.0
        now = time.monotonic()
        if min(now - s.heard_at for s in sessions) <= 2 * self.cfg.heartbeat_s \
                and not all(process_gone(s) for s in sessions):
            return 0.0
        return max(0.1, self.cfg.heartbeat_timeout_s - min(now - s.last_seen for s in sessions))

    def on_hello(self, identity: bytes, msg: protocol.Hello) -> msgspec.Struct:
        if msg.protocol != protocol.PROTOCOL_VERSION:
            return self.refuse(msg, f"protocol version mismatch: client speaks {msg.protocol}, committer of cache "
                                    f"{self.name} speaks {protocol.PROTOCOL_VERSION}", "protocol")
        if msg.cache != self.name:
            return self.refuse(msg, f"this committer serves cache {self.name!r}, not {shown(msg.cache)}", "cache")
        if msg.role not in protocol.ROLES:
            return self.refuse(msg, f"unknown role {shown(msg.role)} (use one of {', '.join(protocol.ROLES)})",
                               "role")
        if not _CLIENT_ID_RE.fullmatch(msg.client_id):
            return self.refuse(msg, f"client_id {shown(msg.client_id)} must be 1-64 letters, digits, '_' or '-'",
                               "client_id")
        if msg.uid != os.geteuid():
            return self.refuse(msg, f"client uid {msg.uid} differs from committer uid {os.geteuid()}; "
                                    f"segments are 0600", "uid")
        if not 0 <= msg.staging_rows <= MAX_STAGING_ROWS:
            # Here, not only when a key's staging is made: a writer with no key yet would else be recorded
            # (and its resume accepted) with rows no staging can ever have.
            return self.refuse(msg, f"staging_rows must be in 0..{MAX_STAGING_ROWS}, got {msg.staging_rows}",
                               "staging")
        if msg.resume and self.stopping:
            # A Welcome now would be followed at once by the stop, which unlinks the generation with its
            # clients attached: the resume could never hold. Refused for good, with the reason.
            return self.refuse(msg, f"cannot resume: committer {self.name} is stopping "
                                    f"({self.stop_reason or 'signal'}) and unlinks generation {self.generation} "
                                    f"with it, so every unacknowledged write is lost", "stopping")
        if msg.resume:
            return self.on_resume(identity, msg)  # a resumed writer keeps the staging it has
        if self.stopping:
            # Answered on the way out (a Hello queued before the stop signal): a Welcome would name segments
            # this committer unlinks next, and the client failed mapping them. Refused for now instead: the
            # client tries again, and the next committer of the cache (a supervisor's, an autostart) answers.
            return self.refuse(msg, f"committer {self.name} is stopping ({self.stop_reason or 'signal'})",
                               "stopping", retry_after_s=0.5)
        if msg.role == protocol.ROLE_WRITER and msg.staging_rows < 1:
            return self.refuse(msg, f"staging_rows must be >= 1 for a writer, got {msg.staging_rows}", "staging")
        previous = self.sessions.get(identity)
        if previous is not None and (previous.client_id, previous.role) == (msg.client_id, msg.role) \
                and msg.role != protocol.ROLE_ADMIN:
            # A retried Hello of the same client (its first reply was slow): keep its staging, answer again.
            previous.heard(time.monotonic())
            return self.welcome(msg.rid, previous)
        if previous is not None:  # same socket says Hello again as someone else: start over
            self.detach(previous, REHELLO)
        full = self._full(msg)
        if full is not None:
            return full
        other = self.sessions.by_client(msg.client_id)
        # Before anything below changes the pool (a layout set, staging made). The one session a Hello may
        # take over by its client_id is a writer's seat kept by an adopting restart (below).
        seat = other is not None and other.adopted and other is self.sessions.writer
        if other is not None and not (seat and msg.role == protocol.ROLE_WRITER):
            return self.refuse(msg, f"client_id {msg.client_id} is already attached on another socket "
                                    f"(resume with Hello(resume=True) to move it)", "duplicate_client")
        if msg.role == protocol.ROLE_WRITER and self.sessions.writer is not None:
            w = self.sessions.writer
            if w.adopted and w.client_id == msg.client_id:
                return self._welcome_recorded_writer(identity, msg, w)
            if w.adopted:
                # The seat of a writer the dead committer knew, kept for its resume: it is reaped if it does
                # not resume within the heartbeat timeout, so the new writer may retry until then.
                wait = max(0.1, self.cfg.heartbeat_timeout_s - (time.monotonic() - w.last_seen))
                return self.refuse(msg, f"cache {self.name} keeps the seat of writer {w.client_id} (epoch {w.epoch}), "
                                        f"which this committer adopted at its restart, for that writer's resume; "
                                        f"it is reaped in {wait:.1f}s if it does not resume", "second_writer", wait)
            # A writer silent for a while, or whose process is gone, is likely a killed engine's (an engine
            # restarted at once): retryable, and the refusal says when its seat frees.
            wait = self._reaped_soon([w])
            why = ""
            if wait:
                why = (f"; its process is gone, and its seat is freed in {wait:.1f}s" if process_gone(w)
                       else f"; it has been silent, and is reaped in {wait:.1f}s unless it speaks")
            elif w.started is not None and w.started == confirmed_start(msg) and w.pid == msg.pid:
                # The usual cause: after a sticky error the new manager was made before the old one was shut
                # down, and a pid alone did not tell the newcomer it was their own.
                why = "; that writer is this same process: shut its manager down (shutdown()) before making another"
            return self.refuse(msg, f"cache {self.name} already has a writer (client {w.client_id}, pid {w.pid}{why})",
                               "second_writer", wait)
        if msg.role != protocol.ROLE_ADMIN:
            if msg.layout is not None:
                mismatch = self.pool.layout_mismatch(msg.layout)
                if mismatch is not None:
                    # Retryable only while every client is silent: once reaped, an --exit-when-idle committer
                    # exits and the next start takes the new layout.
                    return self.refuse(msg, f"layout mismatch: {mismatch}", "layout",
                                       self._reaped_soon([c for c in self.sessions if c.is_data_client])
                                       if self.cfg.exit_when_idle else 0.0)
                try:
                    # A writer's new key specs are declared only once it is welcomed (below): a refused
                    # writer's specs refused the next writer's layout for good (review, 2026-12-06).
                    self.pool.fix_layout(msg.layout, room_for_specs=msg.role == protocol.ROLE_WRITER)
                except PoolError as exc:
                    return self.refuse(msg, exc.message, exc.code)
            elif self.pool.layout is None:
                return self.refuse(msg, f"cache {self.name} has no layout yet; the first client must send one",
                                   "no_layout")
        now = time.monotonic()
        session = Session(identity=identity, client_id=msg.client_id, role=msg.role, pid=msg.pid, uid=msg.uid,
                          attached_at=now, last_seen=now, staging_rows=msg.staging_rows,
                          started=confirmed_start(msg))
        if msg.role == protocol.ROLE_WRITER:
            refused = self._make_staging(msg, msg.staging_rows)
            if refused is not None:
                self.pool.drop_client(msg.client_id)
                return refused
            if self.epoch >= MAX_EPOCH:
                self.pool.drop_client(msg.client_id)
                return self.refuse(msg, f"cache {self.name} used all {MAX_EPOCH} writer epochs; recreate it",
                                   "epochs")
            declared = self.pool.declare_specs(msg.layout) if msg.layout is not None else []
            self.epoch += 1  # never handed out again, even when refused below
            session.epoch = self.epoch
            if not self.pool.set_writer_epoch(self.epoch, msg.client_id, session.staging_rows,  # saves the specs
                                              session.pid, session.started):
                self.pool.forget_specs(declared)
                self.pool.drop_client(msg.client_id)
                return self.refuse(msg, f"cache {self.name} cannot record this writer's epoch in its metadata (see "
                                        f"the committer log); a restart could hand the epoch out again", "meta")
        self.sessions.add(session)
        self.ratelog(logging.DEBUG if msg.role == protocol.ROLE_ADMIN else logging.INFO,
                     REHELLO if previous is not None else None,  # limited with the re-hello detach it follows
                     "committer %s: %s client %s attached (pid %d%s)", self.name, msg.role, msg.client_id, msg.pid,
                     f", epoch {session.epoch}" if session.epoch else "")
        return self.welcome(msg.rid, session)

    def _welcome_recorded_writer(self, identity: bytes, msg: protocol.Hello, seat: Session) -> msgspec.Struct:
        """A writer's first ``Hello`` again, to the committer that adopted the cache after the one that recorded
        this writer (its epoch saved) was killed before its ``Welcome`` went out: the adopted seat is this
        client's. It never got a Welcome, so it maps none of the seat's staging; it takes the seat, its
        recorded epoch and that staging (made now for any key that lacks it)."""
        if msg.layout is not None:
            mismatch = self.pool.layout_mismatch(msg.layout)
            if mismatch is not None:
                return self.refuse(msg, f"layout mismatch: {mismatch}", "layout")
        if msg.staging_rows != seat.staging_rows:
            return self.refuse(msg, f"writer {msg.client_id} was recorded with staging_rows={seat.staging_rows}, "
                                    f"its Hello says {msg.staging_rows}", "staging")
        taken = self._seat_taken(msg, seat)
        if taken is not None:
            return taken
        refused = self._make_staging(msg, seat.staging_rows)
        if refused is not None:
            return refused
        self.sessions.rekey(seat, identity, time.monotonic())
        recorded_pid = seat.pid
        seat.pid, seat.started = msg.pid, confirmed_start(msg)
        self.pool.set_writer_epoch(seat.epoch, seat.client_id, seat.staging_rows,  # recorded: publishes the word
                                   seat.pid, seat.started)
        logger.info("committer %s: writer client %s attached (pid %d, epoch %d, recorded before the restart%s)",
                    self.name, msg.client_id, msg.pid, seat.epoch,
                    f" by pid {recorded_pid}" if recorded_pid else "")
        return self.welcome(msg.rid, seat)

    def _seat_taken(self, msg: protocol.Hello, session: Session) -> protocol.Refused | None:
        """The refusal when ``session`` (live, or a writer's seat an adopting restart kept) belongs to another
        live process than the one ``msg`` comes from, else None. A client id is printed by `omnishm status` and
        logged, and one taken by mistake (a copied config, a stale id) moved the session and its staging away
        from its writer, whose next call got no_session (review, 2026-12-06); after a restart it took the
        seat's epoch too, so two processes wrote under one epoch (review, stop 56). Within one process the id
        is the only name a session has; a link resuming after a lost socket is always its own session's."""
        if process_gone(session) or session.started is None \
                or (msg.pid, confirmed_start(msg)) == (session.pid, session.started):
            return None
        return self.refuse(msg, f"cannot resume {session.role} {msg.client_id}: its session belongs to "
                                f"process {session.pid}, which is alive, and this Hello comes from pid "
                                f"{msg.pid}; a client id names one client", "resume_taken")

    def _full(self, msg: protocol.Hello) -> protocol.Refused | None:
        """The refusal of a reader's or admin's new session past ``MAX_SESSIONS``, else None."""
        if msg.role == protocol.ROLE_WRITER or len(self.sessions) < MAX_SESSIONS:
            return None
        return self.refuse(msg, f"cache {self.name} holds {len(self.sessions)} sessions, its limit: retry once the "
                                f"sessions of clients gone silent are reaped", "too_many_sessions",
                           self.cfg.heartbeat_timeout_s)

    def _make_staging(self, msg: protocol.Hello, rows: int) -> protocol.Refused | None:
        """The writer's staging of ``rows`` rows for every key that lacks one; the refusal when one cannot be
        made (the caller decides what to drop)."""
        try:
            for state in self.pool.keys.values():
                self.pool.ensure_staging(msg.client_id, state, rows)
        except PoolError as exc:
            return self.refuse(msg, exc.message, exc.code)
        except (OSError, ValueError, OverflowError) as exc:
            return self.refuse(msg, f"cannot create staging segments: {exc}", "no_space")
        return None

    def welcome(self, rid: int, session: Session, resumed: bool = False) -> protocol.Welcome:
        staging_of = session.client_id if session.role == protocol.ROLE_WRITER else None
        return protocol.Welcome(
            rid=rid, client_id=session.client_id, generation=self.generation, epoch=session.epoch,
            control=self.pool.ctl_seg.name if self.pool.ctl_seg else "", layout=self.pool.current_layout(),
            keys=[self.pool.key_segments(s, staging_of) for s in self.pool.keys.values()],
            heartbeat_s=self.cfg.heartbeat_s, heartbeat_timeout_s=self.cfg.heartbeat_timeout_s,
            committer_pid=os.getpid(), resumed=resumed, instance=self.instance,
            writer_epoch=self.sessions.writer.epoch if self.sessions.writer is not None else 0)

    def on_resume(self, identity: bytes, msg: protocol.Hello) -> msgspec.Struct:
        """A client that lost its committer re-attaches: same client_id, generation, epoch and staging.

        The session (live on an old socket, or a placeholder of an adopted
        writer) moves to this socket. Refused, with the reason, when this
        committer does not hold the client's cache generation (the restart
        could not adopt it), the layout differs, or a writer's session or
        staging is gone (reaped).
        """
        if msg.resume_generation != self.generation:
            return self.refuse(msg, f"cannot resume: this committer of cache {self.name} holds generation "
                                    f"{self.generation}, the client was attached to generation "
                                    f"{shown(msg.resume_generation, 20)}; the restarted committer did not adopt it "
                                    f"(its clients had all gone, or its metadata was unusable: see the committer "
                                    f"log), so every unacknowledged write is lost", "resume_generation")
        if msg.layout is not None:
            mismatch = self.pool.layout_mismatch(msg.layout)
            if mismatch is not None:
                return self.refuse(msg, f"cannot resume: layout mismatch: {mismatch}", "layout")
        now = time.monotonic()
        session = self.sessions.by_client(msg.client_id)
        if session is not None and session.role != msg.role:
            return self.refuse(msg, f"cannot resume: client {msg.client_id} was a {session.role}, not a "
                                    f"{shown(msg.role, 20)}", "resume_role")
        taken = self._seat_taken(msg, session) if session is not None else None
        if taken is not None:  # another live process's session
            return taken
        if msg.role == protocol.ROLE_WRITER:
            if session is None:
                why = self.sessions.reaped_ids.get(msg.client_id, "unknown to this committer")
                return self.refuse(msg, f"cannot resume writer {msg.client_id}: its session was {why}, and this "
                                        f"committer holds no staging for it", "resume_unknown")
            if msg.resume_epoch != session.epoch:
                return self.refuse(msg, f"cannot resume writer {msg.client_id}: epoch {msg.resume_epoch} != "
                                        f"{session.epoch}", "resume_epoch")
            have = self.pool.staging_names(msg.client_id)
            # The client may lack a name it never got (the committer died before the KeyOpened reply).
            if not set(msg.resume_staging) <= set(have):
                return self.refuse(msg, f"cannot resume writer {msg.client_id}: staging "
                                        f"{shown(sorted(msg.resume_staging), 200)} != {sorted(have)}",
                                   "resume_staging")
        previous = self.sessions.get(identity)
        if previous is not None and previous is not session:
            self.detach(previous, REHELLO)
        if session is None:  # a reader or admin: no state to recover, attach afresh
            full = self._full(msg)
            if full is not None:
                return full
            session = Session(identity=identity, client_id=msg.client_id, role=msg.role, pid=msg.pid, uid=msg.uid,
                              attached_at=now, last_seen=now, started=confirmed_start(msg))
            self.sessions.add(session)
            self.sessions.resumed += 1
        else:
            self.sessions.rekey(session, identity, now)
            session.pid, session.started = msg.pid, confirmed_start(msg)
        if session.role == protocol.ROLE_WRITER:
            self.pool.set_writer_epoch(session.epoch, session.client_id, session.staging_rows, session.pid,
                                       session.started)
        logger.info("committer %s: %s client %s resumed (pid %d%s)", self.name, msg.role, msg.client_id, msg.pid,
                    f", epoch {session.epoch}" if session.epoch else "")
        return self.welcome(msg.rid, session, resumed=True)
