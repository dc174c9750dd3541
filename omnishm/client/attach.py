"""Attaching a ``CommitterLink`` to its committer, and resuming the session when the committer is lost.

``LinkAttach`` is a mixin of ``CommitterLink`` (``client/link.py``, the
transport: the socket, pending requests; its I/O thread's loop is
``client/link_io.py``) and works on its state, all of which
``CommitterLink.__init__`` creates. The committer's side
of the same exchange is ``committer/attach.py``. The first ``Hello`` runs on
the thread that constructs the link (``_hello``, through ``submit``); losing
the committer (``_lost``, called when the transport sees silence, a gone
process or ``no_session``) and every resume attempt run on the link's I/O
thread.

Losing the committer is not yet an error. The link keeps every request that
was never answered together with its encoded bytes, and for up to
``reconnect_timeout_s`` opens a fresh socket and sends ``Hello(resume=True)``
with the same client id, generation, epoch and staging segment names. When a
committer (the restarted one, which adopted the cache's segments) welcomes the
session back, every unanswered request except heartbeats is re-sent in its
original order: re-applying a ``StepWrite`` is idempotent (rows land only
where the claim table still holds the descriptor's claim version and the
commit table does not hold it yet, and the staging page is held until the
acknowledgement). When no committer resumes
the session in time, or one refuses (it could not adopt the cache, or the
writer was reaped), the link is dead: every pending future and every later
``submit`` fails with ``OmniPrefixCacheCommitterError`` naming the reason.

With ``autostart``, both the first ``Hello`` and every resume attempt start
an embedded committer first when nothing holds the cache lock
(``_autostart_if_down``, via ``committer_process.start_committer``).

While attached, the link holds ``flock(LOCK_SH)`` on the cache's control
segment: a restarting committer adopts a cache only while some client holds
it (``omnishm.committer.meta``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout  # builtin TimeoutError only from Python 3.11
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import posix_ipc

from omnishm import protocol as P
from omnishm import liveness, orphans, paths
from omnishm.client.committer_process import start_committer
from omnishm.interface import OmniPrefixCacheCommitterError
from omnishm.liveness import flock_within, proc_identity
from omnishm.versions import cv_step

if TYPE_CHECKING:
    from omnishm.client.link import _Pending

logger = logging.getLogger("omnishm.client.link")  # one logger for the whole link, as before the splits

# The link's states (``CommitterLink.state``), changed under ``_slock``. Here rather than in link.py because
# losing and resuming the committer is what moves between them; link.py imports them from here.
CONNECTED = "connected"
RECONNECTING = "reconnecting"
DEAD = "dead"

AUTOSTART_TRIES = 2
"""Committers a link starts that end while nothing holds the cache lock (each started at once when the
last one ended) before it stops starting more: such a start was refused (a bad ``OMNISHM_*`` value, a
metrics port taken), and its successor would be too. The first Hello then fails at once with the end of
the autostart log, instead of starting one every 5 s until ``connect_timeout_s``."""
LIVENESS_LOCK_PATIENCE_S = 2.0
"""How long a new client waits for its shared liveness lock on the control segment (``_hold_liveness_lock``)
while another process holds it exclusively: a probe holds it for microseconds, so only a stopped one lasts."""
HELLO_RETRY_S = 2.0
"""How long the first ``Hello`` waits for its answer before it is sent again (``_hello``); a retried ``Hello``
of the same client is answered like the first."""


_LIVENESS_LOCK_HOLDERS: weakref.WeakSet[LinkAttach] = weakref.WeakSet()
"""The links of this process that hold a liveness lock (``_hold_liveness_lock``)."""


def _drop_inherited_liveness_locks() -> None:
    """In a forked child: close its copies of the liveness lock fds. A ``flock`` belongs to the open file, which
    a fork shares, so a child that outlived its parent's shutdown (a fork-pool worker) kept the lock, and the
    last client's sweep of a dead committer's generation took that for a client still attached: the
    generation stayed in /dev/shm (review, 2026-12-06). The parent keeps the lock through its own fd. A
    forked manager never uses its link, so the child loses nothing."""
    for link in list(_LIVENESS_LOCK_HOLDERS):
        link._release_liveness_lock()  # closes the child's fd only: the parent's still holds the lock


os.register_at_fork(after_in_child=_drop_inherited_liveness_locks)


class LinkAttach:
    """Hello, resume, autostart-if-down and the liveness lock (mixin of ``CommitterLink``; all state lives there)."""

    def _hello(self, timeout_s: float) -> P.Welcome:
        """Constructing thread: the first ``Hello``, retried (autostarting when allowed) until ``timeout_s``.

        Returns the ``Welcome``; raises ``OmniPrefixCacheCommitterError`` when no committer answered in
        time or one refused this client (a refusal marked retryable, ``Refused.retry_after_s``, only
        once ``timeout_s`` passed).
        """
        deadline = time.monotonic() + timeout_s
        refused = ""  # the latest retryable refusal
        while True:
            # Again while nothing holds the cache lock: the committer this client started may have lost
            # the lock to another rank's, which then exited before this Hello reached it (nobody had
            # attached to it, and the rank that started it was gone).
            self._autostart_if_down(time.monotonic())
            if len(self._autostarted) >= AUTOSTART_TRIES and self._autostart_error:
                raise OmniPrefixCacheCommitterError(f"cache {self.cache}: {self._autostart_error}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if refused:
                    raise OmniPrefixCacheCommitterError(
                        f"cache {self.cache}: committer refused this {self.role} until {timeout_s:.1f}s passed: "
                        f"{refused}")
                if self._autostart_error:
                    hint = f"autostart is on, and the committer could not be launched: {self._autostart_error}"
                elif self._autostart and self.endpoint.startswith("ipc://") and self._autostarted:
                    hint = (f"autostart is on: why the committer it started did not answer is in "
                            f"{self.runtime_dir}/{self.cache}.autostart.log")
                elif self._autostart and self.endpoint.startswith("ipc://"):
                    # It started none: a committer held the cache lock all along (launched, or another
                    # rank's), so the autostart log is not where its story is (review, 2026-12-06).
                    held = liveness.CacheLock.holder(liveness.lock_path(Path(self.runtime_dir), self.cache))
                    who = f"pid {held[1]}" if held is not None else "a process"
                    own_endpoint = paths.ipc_endpoint(self.runtime_dir, self.cache)
                    if self.endpoint != own_endpoint and liveness.endpoint_served(own_endpoint):
                        # Not frozen: it serves the cache's own socket, and this client asked elsewhere
                        # (an OMNISHM_ENDPOINT or endpoint= of another cache or an old start; review, stop 48).
                        hint = (f"autostart is on, but {who} holds the cache's committer lock, so none was started; "
                                f"that committer serves {own_endpoint}, not this client's endpoint: give the client that "
                                f"endpoint (endpoint=, OMNISHM_ENDPOINT), or none")
                    else:
                        hint = (f"autostart is on, but {who} holds the cache's committer lock, so none was started: "
                                f"a committer that does not answer (frozen, stopped, starved of CPU or stuck); "
                                f"`omnishm ping --name {self.cache} --runtime-dir {self.runtime_dir}` checks it, and "
                                f"`kill -USR1 PID` writes its threads' stacks to its log")
                else:
                    own = self.endpoint == paths.ipc_endpoint(self.runtime_dir, self.cache)
                    hint = (f"start one with `omnishm committer --name {self.cache}"
                            f"{'' if own else f' --endpoint {self.endpoint}'}` (or scripts/launch_committer.sh)"
                            + ("; autostart covers ipc endpoints only" if not self.endpoint.startswith("ipc://")
                               else " or pass autostart=True"))
                raise OmniPrefixCacheCommitterError(
                    f"cache {self.cache}: no committer answered at {self.endpoint} within {timeout_s:.1f}s; {hint}")
            fut = self.submit(lambda rid: self._hello_msg(rid, resume=False))
            try:
                # Bounded even without autostart: a committer killed while it held this Hello never answers
                # it, and its restart (a supervisor's, seconds later) only answers a Hello sent again.
                reply = fut.result(timeout=min(remaining, HELLO_RETRY_S))
            except FutureTimeout:
                with self._plock:
                    self._pending.clear()
                continue
            if isinstance(reply, P.Welcome):
                return reply
            if isinstance(reply, P.Refused) and reply.retry_after_s > 0:
                # In the way: a client silent for a while (an engine killed and started again at once, before
                # the committer reaped its writer); it is reaped within the committer's heartbeat timeout.
                if not refused:
                    logger.info("cache %s: committer refused this %s for now (%s); trying again for up to %.1fs",
                                self.cache, self.role, reply.reason, deadline - time.monotonic())
                refused = reply.reason
                time.sleep(max(0.0, min(reply.retry_after_s, 1.0, deadline - time.monotonic())))
                continue
            reason = reply.reason if isinstance(reply, P.Refused) else f"{reply.code}: {reply.message}"
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer refused this {self.role}: {reason}")

    def _autostart_if_down(self, now: float, *, io_thread: bool = False) -> None:
        """Start an embedded committer when this link may (``autostart``, an ipc endpoint), nothing holds
        the cache lock, and no committer this link started still runs: at once when the last one it
        started ended, else once the last launch (one that failed) was over 5 s ago. After
        ``AUTOSTART_TRIES`` it started ended, none: ``_autostart_error`` says why (the log's end).

        A start under load can take seconds (it took 3-4 s while committers imported torch); one still
        starting is waited for, not joined by another: each more starting on a machine that vLLM's
        busy-waiting processes already fill slowed the first one further (seen: four committers started
        for one cache of a TP=2 engine).

        A runtime dir that cannot be used raises (``PermissionError``, ``OSError``) on the attaching thread;
        on the I/O thread (``io_thread``, a resume) that error, like a launch that fails anywhere, is kept
        for the link's deadlines to report: nothing may raise into the link's loop.
        """
        if not (self._autostart and self.endpoint.startswith("ipc://")) or any(p.alive() for p in self._autostarted):
            return
        if not self._autostarted and now - self._last_autostart <= 5.0:
            return  # a launch that failed (``_autostart_failed``): again in 5 s; one that ended: again at once
        try:
            if liveness.cache_is_live(self.runtime_dir, self.cache):
                return  # another rank's won the lock (the one this link started lost it and ended)
            if liveness.endpoint_served(self.endpoint):
                return  # a committer serves the endpoint (from another runtime dir): one started here is refused
            paths.ensure_runtime_dir(self.runtime_dir)
        except OSError as exc:
            if not io_thread:
                raise
            self._autostart_failed(now, exc)
            return
        if len(self._autostarted) >= AUTOSTART_TRIES:
            if not self._autostart_error:
                log = Path(self.runtime_dir) / f"{self.cache}.autostart.log"
                self._autostart_error = (f"the {len(self._autostarted)} committers autostart started ended without "
                                         f"serving (a refused start); {log} ends with: {_tail(log)}")
                logger.warning("cache %s: %s", self.cache, self._autostart_error)
            return
        self._last_autostart = now
        try:
            self._autostarted.append(start_committer(self.cache, self.runtime_dir, endpoint=self.endpoint,
                                                     policy=self._spawn_policy,
                                                     config_file=self._config_file))
        except OSError as exc:
            self._autostart_failed(now, exc)

    def _autostart_failed(self, now: float, exc: OSError) -> None:
        self._last_autostart = now  # tried again in 5 s, not at every tick
        self._autostart_error = str(exc)
        logger.warning("cache %s: cannot autostart a committer: %s", self.cache, exc)

    def _stop_autostart_losers(self, committer_pid: int) -> None:
        """Stop every committer this link autostarted that is not the one that welcomed it (``committer_pid``).

        Such a committer lost the race for the cache lock (to another rank's, or to a launched one). Usually
        it is refused at the lock and gone already. But one slowed at start-up (on a core a busy rank
        shares: seconds) may reach the lock only after the winner served a short-lived cache and
        exited, and then hold the cache's lock, socket and owner segment with nobody to serve until its
        spawner exits or ``UNUSED_EXIT_S`` passes (found with a real TP=2 vLLM engine). SIGTERM: stopped
        during start-up it exits 0 having made nothing; stopped later it unlinks what it made. Called
        with each ``Welcome``: on the constructing thread for the first, on the I/O thread for a resume's.
        """
        losers = [p for p in self._autostarted if p.pid != committer_pid and p.alive()]
        self._autostarted.clear()
        for proc in losers:
            logger.info("cache %s: stopping committer pid %d, which this client autostarted and which lost the "
                        "cache lock to committer pid %d", self.cache, proc.pid, committer_pid)
            proc.terminate()

    def _hello_msg(self, rid: int, resume: bool) -> P.Hello:
        """The ``Hello`` for ``rid``; a resume names the session it resumes (generation, epoch, staging)."""
        welcome = getattr(self, "welcome", None)
        return P.Hello(
            rid=rid, protocol=P.PROTOCOL_VERSION, client_id=self.client_id, pid=os.getpid(), uid=os.geteuid(),
            role=self.role, cache=self.cache, layout=self._layout, staging_rows=self._staging_rows, resume=resume,
            resume_generation=welcome.generation if resume and welcome else "",
            resume_epoch=welcome.epoch if resume and welcome else 0,
            resume_staging=sorted(self._staging_names) if resume else [], started=proc_identity(os.getpid()) or "")

    def _adopt_welcome(self, welcome: P.Welcome) -> None:
        """Take the heartbeat period and timeout, the committer's identity and the staging names from a
        ``Welcome`` (the first one, or a resume's on the I/O thread); stop this link's autostarted losers."""
        self._stop_autostart_losers(welcome.committer_pid)
        self._heartbeat_s = welcome.heartbeat_s
        self._heartbeat_timeout_s = self._heartbeat_timeout_override or welcome.heartbeat_timeout_s
        self._committer_ident = proc_identity(welcome.committer_pid)
        self._last_heard = time.monotonic()
        self._staging_names.update(k.staging for k in welcome.keys if k.staging)
        # What the committer saw as this welcome was made, as if a heartbeat had just been answered.
        self.writer_ack = (self.heartbeats_sent, welcome.writer_epoch)

    def _hold_liveness_lock(self, welcome: P.Welcome) -> None:
        """Shared flock on the control segment while attached: tells a restarting committer to adopt."""
        if not welcome.control or self._live_fd >= 0:
            return
        try:
            seg = posix_ipc.SharedMemory(welcome.control, 0, read_only=True)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as exc:
            logger.warning("cache %s: cannot hold the liveness lock on %s (%s): a committer restart will not "
                           "adopt the cache for this client", self.cache, welcome.control, exc)
            return
        # A starting committer's adoption check and the orphan sweep hold LOCK_EX for a probe of microseconds;
        # a blocking flock waited out a holder that was stopped mid-probe, on the engine thread that builds the
        # manager, past connect_timeout_s, forever for a frozen one (review, 2026-12-06).
        if not flock_within(seg.fd, LIVENESS_LOCK_PATIENCE_S, shared=True):
            os.close(seg.fd)
            logger.warning("cache %s: another process held %s for %.0f s: attached without the liveness lock, so a "
                           "committer restart will not adopt the cache for this client", self.cache,
                           welcome.control, LIVENESS_LOCK_PATIENCE_S)
            return
        self._live_fd = seg.fd
        _LIVENESS_LOCK_HOLDERS.add(self)

    def _release_liveness_lock(self) -> None:
        """Drop the shared flock (closing, after the I/O thread stopped); no-op when none is held."""
        fd, self._live_fd = self._live_fd, -1  # before the close: an interrupted close must not close it twice
        _LIVENESS_LOCK_HOLDERS.discard(self)
        if fd >= 0:
            os.close(fd)

    def _sweep_if_committer_gone(self) -> list[str]:
        """Closing, after the liveness lock is dropped: remove the cache's orphans when our committer is dead.

        A committer SIGKILLed while clients were attached leaves every segment (they may resume with a
        restart, which adopts them). When nothing restarted it and its clients shut down, nobody else would
        ever unlink them, so the last client to leave does: ``shm.sweep`` without ``force`` leaves alone a
        generation a live committer owns, every cache whose lock a committer holds, and a generation
        other clients still hold their liveness lock on (they still wait to resume). The last of them to
        close removes it. Returns what was removed.
        """
        welcome = getattr(self, "welcome", None)
        if welcome is None or self._committer_ident is None \
                or proc_identity(welcome.committer_pid) == self._committer_ident:
            return []  # never attached, or the committer lives: it unlinks what it made
        try:
            removed = orphans.sweep(self.runtime_dir, self.cache)
        except Exception:  # closing must finish; `omnishm cleanup` or the next start removes them then
            logger.exception("cache %s: cannot remove the dead committer's segments", self.cache)
            return []
        if removed:
            logger.warning("cache %s: committer pid %d is gone and this was its last client: removed %d "
                           "orphaned object(s)", self.cache, welcome.committer_pid, len(removed))
        return removed

    # ------------------------------------------------------------ losing and resuming the committer

    def _lost(self, reason: str) -> None:
        """I/O thread: the committer is gone or forgot us; start resuming (bounded by reconnect_timeout_s)."""
        if self._state != CONNECTED or self._leaving:  # closing: a no_session answer to a late beat is expected
            return
        now = time.monotonic()
        self.stats["committer_lost"] += 1
        with self._slock:
            self._state = RECONNECTING
        self._lost_reason = reason
        self._reconnect_deadline = now + self.reconnect_timeout_s
        self._attempt_deadline = 0.0
        self._hello_rid = 0  # no resume sent yet: no reply (a committer's rid -1, an earlier resume's) answers one
        logger.warning("cache %s: session with the committer at %s lost (%s); resuming for up to %.1fs", self.cache,
                       self.endpoint, reason, self.reconnect_timeout_s)
        with self._plock:
            beats = [rid for rid, e in self._pending.items() if not e.resend]
            dropped = [self._pending.pop(rid) for rid in beats]
            self._made_room()
        for entry in dropped:
            entry.fut.set_exception(OmniPrefixCacheCommitterError(f"cache {self.cache}: heartbeat lost"))

    def _reconnect_step(self, now: float) -> None:
        """I/O thread, while resuming: go dead past the deadline, else send a ``Hello(resume=True)`` on a
        fresh socket when the previous attempt's time is up."""
        if now >= self._reconnect_deadline:
            self._go_dead(f"cache {self.cache}: committer at {self.endpoint} lost ({self._lost_reason}) and no "
                          f"committer resumed client {self.client_id} within reconnect_timeout_s="
                          f"{self.reconnect_timeout_s:.1f}s; its unacknowledged requests failed"
                          + (f" (not connected: {self._socket_refused})" if self._socket_refused else ""))
            return
        if now < self._attempt_deadline:
            return
        self._autostart_if_down(now, io_thread=True)
        sock_path = paths.ipc_path(self.endpoint)
        if sock_path is not None:
            try:
                # Again at each resume: in a shared sticky directory another user may have bound the name
                # since the committer's socket went (review: the resume sent its Hello there).
                paths.check_socket_path(sock_path)
            except OSError as exc:
                if self._socket_refused != str(exc):
                    logger.warning("cache %s: not connecting for the resume: %s", self.cache, exc)
                    self._socket_refused = str(exc)
                self._attempt_deadline = min(now + max(1.0, 2 * self._heartbeat_s), self._reconnect_deadline)
                return
            self._socket_refused = ""
        self._new_socket()
        self.stats["resume_attempts"] += 1
        self._hello_rid = next(self._rids)
        with self._slock:
            assert self._sock is not None
            self._sock.send(P.encode(self._hello_msg(self._hello_rid, resume=True)))
        self._attempt_deadline = min(now + max(1.0, 2 * self._heartbeat_s), self._reconnect_deadline)

    def _on_resume_reply(self, reply: msgspec.Struct) -> None:
        """I/O thread: the answer to a resume's ``Hello``; a ``Welcome`` re-sends what was never answered
        (under ``_slock``), anything else makes the link dead."""
        if not isinstance(reply, P.Welcome):
            reason = reply.reason if isinstance(reply, P.Refused) else getattr(reply, "message", repr(reply))
            pid = self.welcome.committer_pid
            if self._committer_ident is not None and proc_identity(pid) == self._committer_ident:
                # The same committer is still running: this client was the silent one (a frozen process or
                # a stalled I/O thread), and its session was reaped.
                self._go_dead(f"cache {self.cache}: this client ({self.client_id}) went silent "
                              f"({self._lost_reason}) and the committer at {self.endpoint} (pid {pid}, still "
                              f"running) refused to resume it: {reason}")
            else:
                self._go_dead(f"cache {self.cache}: committer at {self.endpoint} was lost ({self._lost_reason}) "
                              f"and the committer now there refused to resume client {self.client_id}: {reason}")
            return
        self.welcome = reply
        self._adopt_welcome(reply)
        resent = 0
        applied: list[tuple[int, _Pending]] = []
        # Under _slock: a caller's submit either landed in _pending before this snapshot (and is
        # re-sent here) or sees CONNECTED afterwards and sends it itself, never both.
        with self._slock:
            with self._plock:
                # A quiet step the word shows applied (by the lost committer) is settled here, never
                # re-sent: its writer may settle it from the word any time and reuse its staging page,
                # and a re-sent copy would then be applied from the reused page. Read under _plock, the
                # lock of the writer's own settle; the word only grows, and after this read it reaches
                # a re-sent step's marker only when that step is applied again.
                try:
                    acked = self.acked_marker() if self.acked_marker is not None else 0
                except Exception:  # never leave the link half resumed; re-sending is the old behaviour
                    logger.exception("cache %s: cannot read the acknowledgement word", self.cache)
                    acked = 0
                for rid in sorted(self._pending):
                    entry = self._pending[rid]
                    if 0 < entry.marker <= acked:
                        applied.append((rid, self._pending.pop(rid)))
                entries = [self._pending[rid] for rid in sorted(self._pending)]
                if applied:
                    self._made_room()
            self._state = CONNECTED
            self._outbox.clear()
            assert self._sock is not None
            for entry in entries:
                if entry.resend:
                    entry.sent_at = time.monotonic()
                    self._sock.send(entry.data)
                    resent += 1
        for rid, entry in applied:
            if not entry.fut.done():
                entry.fut.set_result(P.StepDone(rid=rid, step=cv_step(entry.marker), done_tids=b""))
        self.stats["reconnects"] += 1
        self.stats["resent"] += resent
        self.stats["settled_on_resume"] += len(applied)
        logger.warning("cache %s: session resumed with committer pid %d (generation %s); re-sent %d unacknowledged "
                       "request(s), settled %d step(s) the lost committer had applied", self.cache,
                       reply.committer_pid, reply.generation, resent, len(applied))


def _tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` non-empty lines of a log, joined, or why it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read it: {exc.strerror or exc})"
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:]) or "(nothing)"
