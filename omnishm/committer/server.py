"""The committer's ROUTER loop: decode, dispatch, reply, reap, stop.

Single-threaded: one loop owns the socket, the ``SessionTable`` and the
``CachePool``. Signals only set a flag and write a byte to a wakeup socket
(``signal.set_wakeup_fd``) that the poller watches, so a stop signal
(``early_stop.STOP_SIGNALS``: SIGTERM, SIGINT, SIGHUP, SIGQUIT) ends the poll
at once; the loop then answers what reaches it until ``STOP_QUIET_S`` (20 ms) pass
without a message, for at most ``STOP_DRAIN_S`` (0.2 s), and unlinks every segment it made.

Bad input never kills the loop: a frame that does not decode, has the wrong
shape, or trips an unexpected error gets an ``Error`` reply, a log line and a
count, and the loop goes on serving everyone else. Log lines about bad input
are rate-limited per reason (``LogLimiter``) so a flood cannot fill the disk;
the counters in ``status`` count every message. Frames above
``protocol.MAX_MESSAGE_BYTES`` never reach us: libzmq drops them and the peer's
connection (ZMQ_MAXMSGSIZE); a list, tuple or map of more than ``protocol.MAX_ITEMS`` items is refused
from its length header, before any item is made.

Starting the process (the cache lock, adopting a live cache or sweeping an
orphaned one, exit codes) is ``committer/start.py``; attaching (``Hello``) and
resuming (``Hello(resume=True)``, after which a client re-sends what was never
acknowledged) is ``committer/attach.py``.
See docs/FAULTS.md.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import socket
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from omnishm import protocol
from omnishm.committer.apply import failed_step
from omnishm.committer.attach import REHELLO, Attach
from omnishm.committer.config import EXIT_OK, CommitterConfig
from omnishm.committer.early_stop import install, restore, stop_signals
from omnishm.committer.metrics import CLIENT_COUNTERS, CLIENT_GAUGES, MAX_COUNTER_NAME, Observability
from omnishm.committer.pool import CachePool, PoolError
from omnishm.committer.sessions import Session, SessionTable
from omnishm.committer.stores import threshold_in_effect
from omnishm.liveness import proc_identity
from omnishm.versions import MAX_STEP, make_cv

if TYPE_CHECKING:
    from omnishm.committer.early_stop import EarlyStop

logger = logging.getLogger("omnishm.committer")

RECV_BATCH = 1024
RECV_BATCH_BYTES = 8 << 20
"""A batch stops growing at this many bytes: it is all received before any of it is answered, and a peer sending
large frames (real descriptors are KiB) held every reply, step writes' too, for 1024 of them (review, stop 60:
frames of 4 MiB took an engine step to 12 s and the committer to 4 GiB)."""
REPLY_BURST = 32
"""Replies wait in ``Committer.replies`` until this many are ready or the receive batch is handled.

Sent back to back, only the first of a burst wakes libzmq's I/O thread (a syscall and, on
a 2-core machine, a context switch); one send per message cost ~15 us of the committer's
~50 us per small step (py-spy). A reply waits at most REPLY_BURST messages of work."""
UNUSED_EXIT_S = 60.0
"""An ``--exit-when-idle`` committer that no writer or reader attached to within this long exits
(an autostarted one sooner: once the client process that started it is gone, ``Committer._unused``)."""
SERVE_ROUND_S = 0.05
"""The loop receives for at most this long (and the batch under way) before it looks at signals, reaps
silent clients and ticks its metrics: clients that never stop sending held it in its receive rounds."""
STOP_QUIET_S = 0.02
STOP_DRAIN_S = 0.2
"""A committer stopped by a signal answers what reaches it until nothing came for STOP_QUIET_S, for at
most STOP_DRAIN_S: a message already in the kernel's socket queue reaches libzmq's I/O thread only once
that thread runs (a committer stopped and continued, a busy machine), and one not received goes
unanswered until its client's timeout."""
EXPORTED_CLIENT_NAMES = frozenset(CLIENT_COUNTERS) | frozenset(CLIENT_GAUGES)
"""Client counters kept first when a client sends more than ``MAX_COUNTERS``."""
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
MAX_COUNTERS = 256
"""Heartbeat counters kept per session (more are dropped and counted)."""


class LogLimiter:
    """At most ``burst`` log lines per reason per ``window_s``; then one summary of what was suppressed.

    Single-threaded (the server loop).
    """

    def __init__(self, log: logging.Logger, burst: int = 5, window_s: float = 10.0):
        self.log = log
        self.burst = burst
        self.window_s = window_s
        self._state: dict[str, list[float]] = {}  # reason -> [window start, lines, suppressed]
        self.suppressed = 0

    def __call__(self, level: int, reason: str | None, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg`` under ``reason``'s limit; ``reason=None`` logs it without one."""
        if reason is None:
            self.log.log(level, msg, *args, exc_info=exc_info)
            return
        now = time.monotonic()
        st = self._state.get(reason)
        if st is None or now - st[0] >= self.window_s:
            if st is not None and st[2]:
                self.log.warning("%d more %r message(s) suppressed in the last %.0fs", int(st[2]), reason,
                                 now - st[0])
            st = self._state[reason] = [now, 0, 0]
        if st[1] < self.burst:
            st[1] += 1
            self.log.log(level, msg, *args, exc_info=exc_info)
        else:
            st[2] += 1
            self.suppressed += 1


class Committer(Attach):
    """One cache's committer. ``run`` serves until a signal (or idle exit) and returns the exit code.

    ``pool``: a ``CachePool`` adopted from a dead committer (``CachePool.adopt``);
    its generation stays the cache's, ``generation`` then only names this process.
    """

    def __init__(self, cfg: CommitterConfig, generation: str, pool: CachePool | None = None):
        self.cfg = cfg
        self.name = cfg.name
        self.instance = generation
        self.pool = pool if pool is not None else CachePool(cfg.name, generation, prefault=cfg.prefault)
        self.generation = self.pool.generation
        self.sessions = SessionTable()
        self.started = time.monotonic()
        self.spawner_pid = cfg.spawned_by if cfg.spawned_by_start or cfg.spawned_by == os.getppid() else 0
        """The autostarting client's pid, else 0 (not autostarted, or a bare ``--spawned-by PID`` that is not
        this process's parent, e.g. started through a launcher that forks: then only ``UNUSED_EXIT_S``
        applies). With its start time (``--spawned-by PID:START``, what autostart passes) the client is
        known whether or not it is still the parent: it may be gone before this check (``_spawner_alive``)."""
        if cfg.spawned_by and not self.spawner_pid:
            logger.warning("committer %s: --spawned-by %d is not this process's parent (%d); an unused committer "
                           "exits after %.0f s only", cfg.name, cfg.spawned_by, os.getppid(), UNUSED_EXIT_S)
        self.epoch = self.pool.max_epoch
        self.ratelog = LogLimiter(logger)
        self.tids_failed_reaped = 0
        self.loop_stalls = 0
        """Times the loop answered nothing for over max(1 s, 2 heartbeat periods) (``note_stall``)."""
        self._answered_at = time.monotonic()  # the last stall check (``note_stall``): after a poll, around a batch
        if self.pool.adopted:
            # The writers the dead committer knew: placeholders until they resume, reaped if they do not.
            for client_id, record in self.pool.writers.items():
                self.sessions.add(Session(identity=b"", client_id=client_id,
                                          role=protocol.ROLE_WRITER, pid=record.pid, uid=os.geteuid(),
                                          attached_at=self.started, last_seen=self.started,
                                          staging_rows=record.staging_rows, epoch=record.epoch, adopted=True,
                                          started=record.started))
        self.stopping = False
        self.stop_reason = ""
        self.queue_depth = 0
        self.replies: list[tuple[bytes, bytes]] = []
        """Encoded replies not sent yet (``send`` queues, ``flush_replies`` sends)."""
        self.messages = 0
        self.decode_errors: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self._sock_ino = 0
        """The inode of the ipc socket file this committer bound (0: none): ``close`` removes only that one."""
        # At least once a second, so metrics snapshots and /health stay fresh on an idle cache.
        self.tick_s = max(0.01, min(1.0, cfg.heartbeat_s, cfg.heartbeat_timeout_s / 4))
        self._poll_ms = max(int(1000 * self.tick_s), 10)
        self.obs = Observability(self, tick_s=self.tick_s)

    # ------------------------------------------------------------ loop

    def bind(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if self.cfg.endpoint.startswith("tcp://") and ("[" in self.cfg.endpoint or "::1" in self.cfg.endpoint):
            self.sock.setsockopt(zmq.IPV6, 1)
        umask = os.umask(0o077)  # the socket is 0600 from its first instant: no one else connects meanwhile
        try:
            self.sock.bind(self.cfg.endpoint)
        finally:
            os.umask(umask)
        if self.cfg.ipc_path is not None:
            os.chmod(self.cfg.ipc_path, 0o600)
            self._sock_ino = os.stat(self.cfg.ipc_path).st_ino

    def _on_signal(self, signum: int, _frame) -> None:
        self.stopping = True
        self.stop_reason = signal.Signals(signum).name

    def run(self, early_stop: "EarlyStop | None" = None) -> int:
        """Serve until a signal or an idle exit; returns ``EXIT_OK``. Main thread.

        ``early_stop``: a signal that came during start-up (``early_stop.EarlyStop``)
        stops the loop before its first poll; read after this loop's own
        handlers are installed, so no signal falls between the two.
        """
        assert self.sock is not None
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_fd = signal.set_wakeup_fd(wake_w.fileno())
        signals = early_stop.signals if early_stop is not None else stop_signals()
        old_handlers = install(signals, self._on_signal)
        if early_stop is not None and early_stop.reason:
            self.stopping = True
            self.stop_reason = early_stop.reason
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        logger.info("committer %s started: pid %d, generation %s, endpoint %s", self.name, os.getpid(),
                    self.generation, self.cfg.endpoint)
        started = self._answered_at = time.monotonic()
        try:
            while not self.stopping:
                poller.poll(self._poll_ms)
                self.note_stall()
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
                self.serve_pending(time.monotonic() + SERVE_ROUND_S)
                self.reap()
                self.obs.tick(time.monotonic())
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:  # one syscall a round
                    logger.info("committer %s: the process that started it (pid %d) is gone; stopping as on "
                                "SIGTERM (--exit-with-parent)", self.name, self.cfg.parent_pid)
                    self.stopping = True  # the loop ends, and answers what is sent until quiet, as on a signal
                    self.stop_reason = "parent gone"
                reason = self._done_serving(started) if self.cfg.exit_when_idle and not self.stopping else ""
                if reason:
                    # Answer what came in since the check. A writer or reader welcomed now (a new rank, a
                    # resume) maps this cache: it keeps its committer. What comes in after goes unanswered
                    # (its client retries, and autostarts a committer once this one is gone).
                    self.serve_pending(time.monotonic() + SERVE_ROUND_S)
                    if self.stopping:
                        break  # a signal's own reason stands
                    if not self.sessions.data_clients():
                        self.stop_reason = reason
                        break
            else:
                # Stopped by a signal (or its parent gone): handle (and answer) everything already sent to it before
                # unlinking.
                self._serve_until_quiet()
        finally:
            signal.set_wakeup_fd(old_fd)
            restore(old_handlers)
            wake_r.close()
            wake_w.close()
        return EXIT_OK

    def _serve_until_quiet(self) -> None:
        """Stopping on a signal: answer what arrives until STOP_QUIET_S pass without a message, for at most
        STOP_DRAIN_S (and the receive batch under way). Loop thread; a Hello is refused for now (``self.stopping``)."""
        assert self.sock is not None
        deadline = time.monotonic() + STOP_DRAIN_S
        self.serve_pending(deadline)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(min(STOP_QUIET_S, left) * 1000) or 1, zmq.POLLIN):
                return
            self.serve_pending(deadline)

    def _done_serving(self, started: float) -> str:
        """``--exit-when-idle``: why this committer is done ("idle": the last writer/reader left; "unused":
        none ever attached and none will, ``_unused``), or "" while it is needed. Loop thread."""
        if self.sessions.idle():
            return "idle"
        if not self.sessions.ever_had_data_client and self._unused(started):
            return "unused"
        return ""

    def _unused(self, started: float) -> bool:
        """An ``--exit-when-idle`` committer no writer or reader ever attached to: is it still wanted?

        No, once ``UNUSED_EXIT_S`` passed (the client that started it gave up), or once the client
        process that autostarted it (``--spawned-by``, ``_spawner_alive``) is gone: two ranks that
        both autostart start two committers, and the slower one may get the cache lock only after the
        other served the whole run and exited (or, the ranks killed, after they are gone too); nobody
        will attach to it (an engine that comes later autostarts its own), so it must not hold the
        cache's lock, socket and segments for a minute.
        """
        if time.monotonic() - started > UNUSED_EXIT_S:
            return True
        if self.spawner_pid and not self._spawner_alive():
            logger.info("committer %s: the client process that started it (pid %d) is gone and no client "
                        "attached; exiting", self.name, self.cfg.spawned_by)
            return True
        return False

    def _spawner_alive(self) -> bool:
        """The client process that autostarted this committer still runs: the process of that pid and
        start time, or, given a bare pid, this process's parent is still that pid."""
        if self.cfg.spawned_by_start:
            return proc_identity(self.spawner_pid) == self.cfg.spawned_by_start
        return os.getppid() == self.spawner_pid

    def serve_pending(self, deadline: float | None = None) -> None:
        """Receive what is queued (up to RECV_BATCH messages or RECV_BATCH_BYTES per round) and answer each
        message; with ``deadline`` (monotonic), no further round once it passed (clients that never stop sending
        could hold it)."""
        assert self.sock is not None
        recv = self.sock.recv_multipart
        while deadline is None or time.monotonic() < deadline:
            batch = []
            nbytes = 0
            while len(batch) < RECV_BATCH and nbytes < RECV_BATCH_BYTES:
                try:
                    frames = recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                batch.append(frames)
                nbytes += sum(map(len, frames))
            if not batch:
                return
            # Before answering any of it, so that a status request in this batch counts a stall that the
            # next poll would only have seen after this batch (the process stopped between two batches).
            self.note_stall()
            received_at = self._answered_at  # the check's own clock reading
            replies = self.replies
            for i, frames in enumerate(batch):
                self.queue_depth = len(batch) - i - 1
                self.handle_frames(frames)
                if len(replies) >= REPLY_BURST:
                    self.flush_replies()
            self.flush_replies()
            self.queue_depth = 0
            self.note_stall()  # one inside this batch: a frozen process, or one request that long
            self.obs.batch_done(len(batch), received_at, self._answered_at)

    def handle_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        self.messages += 1
        rid = -1
        try:
            if len(frames) != 2:
                self.decode_errors["frames"] += 1
                reply: msgspec.Struct | None = protocol.Error(
                    rid=-1, code="decode", message=f"expected one payload frame, got {len(frames) - 1} frames")
            else:
                try:
                    msg = protocol.request_decoder.decode(frames[1])
                except msgspec.ValidationError as exc:
                    self.decode_errors["schema"] += 1
                    reply = protocol.Error(rid=-1, code="decode",
                                           message=f"message does not match the protocol: {str(exc)[:200]}")
                except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
                    self.decode_errors["msgpack"] += 1
                    reply = protocol.Error(rid=-1, code="decode", message=f"undecodable payload: {str(exc)[:200]}")
                else:
                    rid = msg.rid
                    reply = self.dispatch(identity, msg)
        except Exception as exc:  # the loop never dies on one message; log, count, answer
            self.ratelog(logging.ERROR, "internal", "committer %s: error handling a message", self.name,
                         exc_info=True)
            self.rejected["internal"] += 1
            reply = protocol.Error(rid=rid, code="internal", message=f"{type(exc).__name__}: {exc}"[:1000])
        if isinstance(reply, protocol.Error):
            self.ratelog(logging.WARNING, reply.code, "committer %s: %s: %s", self.name, reply.code,
                         reply.message[:300])
            if len(reply.message) > protocol.MAX_REPLY_TEXT:  # the last bound on what a reply echoes
                reply = msgspec.structs.replace(reply, message=protocol.cut_text(reply.message))
        elif isinstance(reply, protocol.Refused) and len(reply.reason) > protocol.MAX_REPLY_TEXT:
            reply = msgspec.structs.replace(reply, reason=protocol.cut_text(reply.reason))
        if reply is not None:  # None: a quiet StepWrite, acknowledged through the control segment
            self.send(identity, reply)

    def send(self, identity: bytes, reply: msgspec.Struct) -> None:
        """Encode ``reply`` now and queue it for ``identity``; ``flush_replies`` sends it."""
        self.replies.append((identity, protocol.encode(reply)))

    def flush_replies(self) -> None:
        """Send every queued reply, in order, without blocking (loop thread)."""
        assert self.sock is not None
        send = self.sock.send
        for identity, payload in self.replies:
            try:
                send(identity, _SNDMORE_NOBLOCK)
                send(payload, _NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: it learns by timing out
                logger.warning("committer %s: reply to a client dropped: %s", self.name, exc)
        self.replies.clear()

    # ------------------------------------------------------------ dispatch

    def dispatch(self, identity: bytes, msg) -> msgspec.Struct | None:
        if isinstance(msg, protocol.Hello):
            return self.on_hello(identity, msg)
        session = self.sessions.touch(identity, time.monotonic())
        if session is None and isinstance(msg, protocol.StepWrite) and identity in self.sessions.reaped_identities:
            # A write of a reaped writer: its staging is gone, so fail every tid, loudly and counted.
            self.rejected["reaped_write"] += 1
            why = self.sessions.reaped_ids.get(self.sessions.reaped_identities[identity], "reaped")
            reply, failed = failed_step(msg, f"cache {self.name}: this writer's session was {why}; its staging "
                                             f"segments are unlinked and step {msg.step} cannot be applied")
            self.tids_failed_reaped += failed
            return reply
        if session is None:
            self.rejected["no_session"] += 1
            return protocol.Error(rid=msg.rid, code="no_session",
                                  message=f"cache {self.name}: no session for this socket; send Hello first "
                                          f"(or the session was reaped after {self.cfg.heartbeat_timeout_s}s of silence)")
        if isinstance(msg, protocol.StepWrite):
            return self.on_step_write(session, msg)
        if isinstance(msg, protocol.Heartbeat):
            self._take_counters(session, msg.counters)
            writer = self.sessions.writer
            return protocol.HeartbeatAck(rid=msg.rid, readers=self.sessions.readers(), writer=writer is not None,
                                         writer_epoch=writer.epoch if writer is not None else 0)
        if isinstance(msg, protocol.OpenKey):
            return self.on_open_key(session, msg)
        if isinstance(msg, protocol.StatusRequest):
            return protocol.StatusReply(rid=msg.rid, status=self.status())
        if isinstance(msg, protocol.Goodbye):
            if msg.counters:
                self._take_counters(session, msg.counters)
            self.detach(session, "goodbye")
            return protocol.Bye(rid=msg.rid)
        self.rejected["unexpected"] += 1
        return protocol.Error(rid=msg.rid, code="unexpected", message=f"unexpected message {type(msg).__name__}")

    def _take_counters(self, session: Session, counters: dict[str, float]) -> None:
        """A client's cumulative counters (heartbeat or goodbye), checked before they are kept.

        Names up to ``MAX_COUNTER_NAME`` characters and finite values >= 0 only;
        the exported names first, then others up to ``MAX_COUNTERS`` in all; a
        cumulative counter never goes back (the largest value seen is kept, also
        when a report leaves it out or sends a value that is dropped).
        """
        kept: dict[str, float] = {name: v for name, v in session.counters.items() if name in CLIENT_COUNTERS}
        dropped = 0
        ordered = sorted(counters.items(), key=lambda kv: kv[0] not in EXPORTED_CLIENT_NAMES)
        for name, value in ordered:
            if len(kept) >= MAX_COUNTERS or len(name) > MAX_COUNTER_NAME or not math.isfinite(value) or value < 0:
                dropped += 1
                continue
            if name in CLIENT_COUNTERS:
                value = max(value, session.counters.get(name, 0.0))
            kept[name] = float(value)
        if dropped:
            self.rejected["bad_counters"] += 1
        session.counters = kept
        self.obs.heartbeat(session)

    def on_open_key(self, session: Session, msg: protocol.OpenKey) -> msgspec.Struct:
        if session.role == protocol.ROLE_ADMIN:
            self.rejected["open_key_admin"] += 1
            return protocol.Error(rid=msg.rid, code="bad_role", message="admin sessions cannot open keys")
        if session.role == protocol.ROLE_READER:
            state = self.pool.keys.get(msg.key)
            if state is None:
                self.rejected["unknown_key"] += 1
                return protocol.Error(rid=msg.rid, code="unknown_key",  # the name cut: bad input can be megabytes
                                      message=f"cache {self.name} has no key {protocol.shown(msg.key, 70)} "
                                              f"(the writer opens keys)")
            # A reader's rows must be the writer's rows as they are: same dtype, width and row shape.
            why = self.pool.spec_mismatch(msg.key, state.spec, msg.spec(), "reader asked for")
            if why:
                self.rejected["layout_mismatch"] += 1
                return protocol.Error(rid=msg.rid, code="layout_mismatch", message=why)
            return protocol.KeyOpened(rid=msg.rid, segments=self.pool.key_segments(state))
        try:
            state = self.pool.open_key(msg.key, msg.spec())
            self.pool.ensure_staging(session.client_id, state, session.staging_rows)
        except PoolError as exc:
            self.rejected[exc.code] += 1
            return protocol.Error(rid=msg.rid, code=exc.code, message=exc.message)
        except OSError as exc:  # ENOSPC from posix_fallocate: /dev/shm is full; EEXIST: someone took the name
            code = "name_taken" if isinstance(exc, FileExistsError) else "no_space"
            self.rejected[code] += 1
            return protocol.Error(rid=msg.rid, code=code, message=f"cache {self.name} key {msg.key!r}: {exc}")
        return protocol.KeyOpened(rid=msg.rid, segments=self.pool.key_segments(state, session.client_id))

    def on_step_write(self, session: Session, msg: protocol.StepWrite) -> msgspec.Struct | None:
        if session.role != protocol.ROLE_WRITER:
            self.rejected["not_writer"] += 1
            return protocol.Error(rid=msg.rid, code="not_writer",
                                  message=f"cache {self.name}: only the writer sends StepWrite, this is a {session.role}")
        t0 = time.perf_counter()
        reply = self.pool.apply_step(session.client_id, msg, session.epoch)
        self.obs.step_applied(time.perf_counter() - t0)
        if reply.reason:
            self.rejected["step_invalid"] += 1
            self.ratelog(logging.WARNING, "step_invalid", "committer %s: step %d of client %s rejected: %s",
                         self.name, msg.step, session.client_id, reply.reason[:300])
        elif msg.quiet and not reply.failed_tids and session.epoch > 0 and 0 <= msg.step <= MAX_STEP:
            # Stored after the rows and their commit words: the writer frees the step's staging page once
            # it reads this marker, and skips the reply its I/O thread would take (docs/DESIGN-NOTES.md).
            # Only ever raised: a re-applied older step must not take an acknowledgement back.
            marker = make_cv(session.epoch, msg.step, 0)
            if marker > int(self.pool.ctl[protocol.CTL_ACKED_STEP]):
                self.pool.ctl[protocol.CTL_ACKED_STEP] = marker
            return None
        return reply

    # ------------------------------------------------------------ liveness

    def detach(self, session: Session, why: str) -> None:
        self.sessions.remove(session)
        # Only a writer owns staging; any other role's client_id must not reach the writer's segments.
        removed = self.pool.drop_client(session.client_id) if session.role == protocol.ROLE_WRITER else []
        self.obs.departed(session)
        # Limited only for a socket that keeps saying Hello as someone else: it must not fill the log.
        self.ratelog(logging.DEBUG if session.role == protocol.ROLE_ADMIN else logging.INFO,
                     REHELLO if why == REHELLO else None, "committer %s: %s client %s detached (%s)%s", self.name,
                     session.role, session.client_id, why,
                     f", {len(removed)} staging segment(s) unlinked" if removed else "")

    def note_stall(self) -> None:
        """Loop thread, after each poll and before and after each batch of ``serve_pending``: log and count a
        time, far longer than the poll's tick, in which it answered nothing (since the last of these checks):
        the process starved or frozen, or one request as long (opening a large key with ``--prefault``).
        Each stall is counted once, wherever in the loop the process stood still: each check consumes the
        time since the one before.

        Its clients then heard nothing from it for as long: each sees a silent committer (and resumes)
        once that passes their heartbeat timeout. A client's own stalls are logged by its link.

        A stall longer than a heartbeat period is not its clients' silence: it is taken off every
        session's silence (``SessionTable.credit``). A live client beat meanwhile, but in a frozen
        process libzmq's own thread stood still too, so those beats may not be readable yet, and a reap
        right after the stall detached live clients, the writer's staging included (review, 2026-12-05).
        """
        now = time.monotonic()
        stalled = now - self._answered_at - self._poll_ms / 1000
        self._answered_at = now
        if stalled > self.cfg.heartbeat_s:
            self.sessions.credit(stalled, now)
        if stalled > max(1.0, 2 * self.cfg.heartbeat_s):
            self.loop_stalls += 1
            logger.warning("committer %s: its loop answered nothing for %.1f s (the process was starved of CPU "
                           "or frozen, or one request took that long); clients judge silence after %.1f s",
                           self.name, stalled, self.cfg.heartbeat_timeout_s)

    def reap(self) -> None:
        """Detach sessions silent beyond the heartbeat timeout: staging unlinked, later writes failed and counted.
        A stall just before it is checked first (``note_stall``, whose clock reading is now): it is not the
        sessions' silence."""
        self.note_stall()
        now = self._answered_at
        for session in self.sessions.expired(now, self.cfg.heartbeat_timeout_s):
            why = (f"reaped after {now - session.heard_at:.1f}s of silence"
                   + (" (adopted at restart, never resumed)" if session.adopted else ""))
            self.sessions.mark_reaped(session, why)
            self.detach(session, why)

    # ------------------------------------------------------------ status and stop

    def status(self) -> dict:
        now = time.monotonic()
        layout = self.pool.layout
        keys = self.pool.describe_keys()
        return {
            "name": self.name, "generation": self.generation, "pid": os.getpid(),
            "instance": self.instance, "adopted": self.pool.adopted, "clients_resumed": self.sessions.resumed,
            "tids_failed_reaped": self.tids_failed_reaped, "log_lines_suppressed": self.ratelog.suppressed,
            "loop_stalls": self.loop_stalls,
            "endpoint": self.cfg.endpoint, "uptime_s": round(now - self.started, 3),
            "layout": None if layout is None else {"num_blocks": layout.num_blocks, "block_size": layout.block_size,
                                                   "num_slots": self.pool.num_slots},
            "writer_epoch": self.epoch, "keys": keys, "segment_bytes": self.pool.segment_bytes(),
            "clients": self.sessions.describe(now), "clients_reaped": self.sessions.reaped,
            "rows_written": sum(k["rows_written"] for k in keys),
            "bytes_written": sum(k["bytes_written"] for k in keys),
            "steps_applied": self.pool.steps_applied, "steps_failed": self.pool.steps_failed,
            "tids_failed": self.pool.tids_failed, "rows_skipped": self.pool.rows_skipped,
            "apply_seconds": self.pool.apply_seconds, "prefault_seconds": self.pool.prefault_seconds,
            "nontemporal_threshold": threshold_in_effect(),
            "messages": self.messages, "rejected": dict(self.rejected), "decode_errors": dict(self.decode_errors),
            "queue_depth": self.queue_depth,
            **self.obs.status_extras(now),
        }

    def close(self, *, unlink: bool = True) -> list[str]:
        """Unlink every segment (unless ``unlink`` is False), close the socket, remove the socket file.

        The caller holds the cache lock. ``unlink=False`` leaves an adopted cache
        whose clients wait to resume for the next committer to adopt.
        """
        self.obs.stop_http()
        removed = self.pool.close() if unlink else []
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.cfg.ipc_path is not None and self._sock_ino:
            try:
                # Only the socket this committer bound: at an explicit endpoint another cache's committer
                # may have bound its own since (a start racing this one's), and that one must keep it.
                if os.stat(self.cfg.ipc_path).st_ino == self._sock_ino:
                    self.cfg.ipc_path.unlink()
            except FileNotFoundError:
                pass
        return removed
