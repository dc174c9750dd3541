"""The client's connection to its committer: one DEALER socket, one I/O thread.

ZeroMQ sockets are not thread-safe; every use of the socket (send, receive,
``EVENTS``, replacement, close) happens under the socket lock ``_slock``, a
full memory barrier, as ZeroMQ requires of a socket shared by threads. The
calling thread sends its own message under that lock (``submit``): the
engine thread never hands a step's descriptor to another Python thread, so
sending costs it no GIL hand-off, only a non-blocking ``zmq_send`` that
libzmq's own (GIL-free) I/O thread writes out. The I/O thread
(``omnishm-link``) receives: it waits on the socket's ``ZMQ_FD`` (a plain
file descriptor, so waiting touches no socket state) and on a wake pipe,
completes the ``Future`` whose ``rid`` matches each reply, sends heartbeats,
and sends what a caller could not send at once (``_outbox``: the socket was
full or the link was resuming). ``ZMQ_FD`` is edge-triggered: whoever
operates on the socket reads ``EVENTS`` afterwards and wakes the I/O thread
when a reply is already waiting.

Liveness, both ways. The I/O thread sends a ``Heartbeat`` (carrying the
client's counters) every ``heartbeat_s`` the committer asked for; the
committer reaps a client silent for its ``heartbeat_timeout_s`` and answers
each heartbeat with a ``HeartbeatAck``. The link declares its committer lost
when (a) nothing came back for ``heartbeat_timeout_s`` while a request it
answers was outstanding (a heartbeat, say; a quiet ``StepWrite`` gets no reply,
so it does not count, and a stall of this process, which sends no heartbeat
meanwhile, is not the committer's silence: ``_note_stall`` logs it), (b) the
committer's process is gone (``/proc/PID/stat``, checked every heartbeat;
zombie or a new process under the pid counts as gone), or (c) the committer
answers ``no_session`` (a restarted committer that does not know this socket,
or we were reaped).

Losing the committer is not yet an error: the link resumes the session
(``Hello(resume=True)`` on a fresh socket, then every unanswered request but
heartbeats is re-sent) for up to ``reconnect_timeout_s``, and only then is it
dead, failing every pending future and every later ``submit`` with
``OmniPrefixCacheCommitterError``. Nothing waits forever: a round trip is
bounded by its timeout, a lost committer by ``heartbeat_timeout_s +
reconnect_timeout_s``.

Attaching (the first ``Hello``, autostart-if-down), resuming and the liveness
lock on the control segment are ``client/attach.py`` (``LinkAttach``, a mixin
of ``CommitterLink``); the I/O thread's loop is ``client/link_io.py``
(``LinkIO``, a mixin too); this module is the transport: the socket, its
locks, pending requests, sending and closing.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # builtin TimeoutError only from Python 3.11
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from omnishm import cpus
from omnishm import protocol as P
from omnishm import paths, shm
from omnishm.client.attach import CONNECTED, DEAD, LinkAttach
from omnishm.client.link_io import LinkIO
from omnishm.client.committer_process import AutostartedCommitter
from omnishm.config import ConfigError, check_endpoint
from omnishm.interface import OmniPrefixCacheCommitterError

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 256
"""Unanswered requests a link allows at once; a caller past it waits for room. The committer's
ROUTER drops a reply, silently, once 1000 wait for this client in its socket and 1000 in ours
(ZeroMQ's high-water marks), and the request would then only time out."""


_CONTEXT_LOCK = threading.Lock()
_CONTEXT: tuple[int, zmq.Context] | None = None
"""This process's pid and the ZeroMQ context of its links (``client_context``)."""


def _new_context_lock() -> None:
    global _CONTEXT_LOCK
    _CONTEXT_LOCK = threading.Lock()  # a fork while another thread held it would leave the child's held


os.register_at_fork(after_in_child=_new_context_lock)


def client_context() -> zmq.Context:
    """The ZeroMQ context every link of this process uses; any thread.

    One per process, made again in a forked child, as ``zmq.Context.instance()`` is; but not that one,
    which the engine may share: libzmq starts a context's I/O thread with its first socket, and the thread
    inherits the CPU set and scheduling policy of the thread that created that socket. Ours is created here,
    as a helper (``cpus.as_helper``: every allowed CPU, and ``SCHED_BATCH`` with ``helper_sched = batch``,
    since the descriptor every step sends wakes it). The engine's own context keeps its threads as the
    engine made them.
    """
    global _CONTEXT
    pid = os.getpid()
    with _CONTEXT_LOCK:
        if _CONTEXT is None or _CONTEXT[0] != pid or _CONTEXT[1].closed:
            with cpus.as_helper():
                ctx = zmq.Context(io_threads=1)
                ctx.socket(zmq.PAIR).close(linger=0)  # starts the I/O thread now, inside as_helper
            _CONTEXT = (pid, ctx)
        return _CONTEXT[1]


@dataclass
class _Pending:
    fut: Future
    sent_at: float
    data: bytes
    resend: bool
    """Re-sent after a resume (everything but heartbeats)."""
    marker: int = 0
    """A quiet StepWrite's acknowledgement marker (``CTL_ACKED_STEP``); 0 for every other request."""


class CommitterLink(LinkIO, LinkAttach):
    """A session with one committer.

    Thread-safe: ``request`` and ``submit`` may be called from any thread.
    ``close`` says goodbye (bounded) and stops the I/O thread; idempotent, and a second call finishes a
    first one an interrupt cut short.
    ``reconnect_timeout_s`` (default: ``request_timeout_s``; a manager passes its
    config's, where ``OMNISHM_RECONNECT_TIMEOUT_S`` applies) bounds how long a lost
    committer is waited for;
    ``heartbeat_timeout_s`` (default: the committer's) how long silence is
    tolerated before the committer counts as lost.
    """

    def __init__(self, *, cache: str, role: str, endpoint: str | None = None, layout: P.Layout | None = None,
                 staging_rows: int = 0, autostart: bool = False, connect_timeout_s: float = 30.0,
                 request_timeout_s: float = 30.0, runtime_dir: Path | None = None,
                 reconnect_timeout_s: float | None = None, heartbeat_timeout_s: float | None = None,
                 config_file: str | os.PathLike | None = None):
        shm.check_cache_name(cache)
        self.cache = cache
        self.role = role
        self.client_id = uuid.uuid4().hex
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else paths.default_runtime_dir()
        self.endpoint = endpoint or paths.ipc_endpoint(self.runtime_dir, cache)
        if endpoint is None:  # one given was checked as a knob; this one is the runtime dir's
            try:
                check_endpoint(self.endpoint)
            except ValueError as exc:
                raise ConfigError(f"runtime_dir {str(self.runtime_dir)!r} for cache {cache!r}: {exc}") from None
        sock_path = paths.ipc_path(self.endpoint)
        if sock_path is not None:
            if os.path.realpath(sock_path.parent) == os.path.realpath(self.runtime_dir):  # however spelled
                paths.ensure_runtime_dir(self.runtime_dir)  # ours from the start: nobody else's socket can be in it
            paths.check_socket_path(sock_path)
        self.request_timeout_s = request_timeout_s
        if reconnect_timeout_s is None:
            reconnect_timeout_s = request_timeout_s
        if reconnect_timeout_s <= 0:
            raise ValueError(f"reconnect_timeout_s must be positive, got {reconnect_timeout_s}")
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.counters: dict[str, float] = {}
        self.gauges: Callable[[], dict[str, float]] = dict
        """Called on the I/O thread for each heartbeat and for the goodbye; its values join ``counters``
        there. For values that must be current when sent (the manager's staging pages in use). What it
        raises is logged and the beat goes without them (``_read_gauges``)."""
        self.stats: collections.Counter[str] = collections.Counter()
        """``committer_lost``, ``reconnects``, ``resent`` (requests re-sent after a resume), ``resume_attempts``,
        ``settled_on_resume`` (quiet steps the lost committer had applied, not re-sent)."""
        self.readers = 0
        self.heartbeats_sent = 0
        """Heartbeats the I/O thread has sent (its own counter; any thread may read it)."""
        self.writer_ack: tuple[int, int] = (0, 0)
        """``(n, epoch)`` of the latest ``HeartbeatAck``: heartbeat number ``n`` (``heartbeats_sent`` counts it
        before it is sent) found the writer of ``epoch`` attached (0: none). Set by the I/O thread as one
        tuple; read by any thread (``ReadSide._writer_left``)."""
        self.acked_marker: Callable[[], int] | None = None
        """Reads ``CTL_ACKED_STEP`` (set by a writer's manager): a resume does not re-send quiet steps
        the word shows applied. Any thread."""
        cpus.helpers_batched()  # a bad helper_sched raises here, before anything is built
        self._layout = layout
        self._staging_rows = staging_rows
        self._autostart = autostart
        self._config_file = config_file
        self._spawn_policy = cpus.thread_policy()
        """The policy of the thread that builds the link: a committer it autostarts gets it, also one the
        I/O thread (a helper's policy) starts on a resume."""
        self._rids = itertools.count(1)
        self._slock = threading.Lock()  # guards _sock (every call on it), _outbox and _state changes
        self._plock = threading.Lock()  # guards _pending and _dead; taken inside _slock, never around it
        self._room = threading.Condition(self._plock)  # a pending entry left (MAX_IN_FLIGHT)
        self._room_waiters = 0
        self._pending: dict[int, _Pending] = {}
        self._outbox: collections.deque[int] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._detached = False  # close() ran to its end
        self._leaving = False
        """Set by ``close`` before its Goodbye: from then on the I/O thread sends no heartbeat and loses no
        session. A heartbeat sent after the Goodbye was answered ``no_session`` (the session is gone), and
        the I/O thread took that for a lost committer and began to resume, autostarting a committer for the
        cache it was leaving when the last one had exited."""
        self._dead: str | None = None
        self._state = CONNECTED
        self._welcomed = False
        self._heartbeat_s = 1.0
        self._heartbeat_timeout_override = heartbeat_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s or 10.0
        self._last_heard = time.monotonic()
        self._committer_ident: str | None = None
        self._lost_reason = ""
        self._reconnect_deadline = 0.0
        self._attempt_deadline = 0.0
        self._hello_rid = 0
        """The rid of the resume ``Hello`` in flight; 0 while none is (rids start at 1)."""
        self._last_autostart = 0.0
        self._autostarted: list[AutostartedCommitter] = []  # committers this link started, until a Welcome
        self._autostart_error = ""  # why the latest autostart could not launch a committer, for the error
        self._socket_refused = ""  # why a resume did not connect to the endpoint's socket (logged once each)
        self._live_fd = -1
        self._staging_names: set[str] = set()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._sock: zmq.Socket | None = None
        self._sock_fd = -1
        # The link's I/O thread inherits this thread's CPU set and scheduling policy: a helper's (omnishm/cpus.py).
        with cpus.as_helper():
            self._ctx = client_context()
            self._new_socket()
            self._thread = threading.Thread(target=self._run, name=f"omnishm-link-{cache}", daemon=True)
            self._thread.start()
        try:
            self.welcome = self._hello(connect_timeout_s)
            self._hold_liveness_lock(self.welcome)
        except BaseException:
            self._shutdown_thread()
            raise
        self._adopt_welcome(self.welcome)
        self._welcomed = True
        logger.info("cache %s: client %s attached as %s (committer pid %d, epoch %d)", cache,
                    self.client_id[:12], role, self.welcome.committer_pid, self.welcome.epoch)

    # ------------------------------------------------------------ public

    def submit(self, make: Callable[[int], msgspec.Struct], *, bounded: bool = True, ack_marker: int = 0,
               room_timeout_s: float | None = None) -> Future:
        """Send ``make(rid)``; the future gets its reply (or an error). Any thread; raises when dead.

        Sends on the calling thread under ``_slock`` (non-blocking). While the
        link resumes, or when the socket is full, the message waits in the
        outbox (or, resuming, in ``_pending``, which a resume re-sends) and the
        I/O thread sends it. With ``MAX_IN_FLIGHT`` requests unanswered, a
        ``bounded`` caller first waits for room (up to ``room_timeout_s``, default
        ``request_timeout_s``, then raises); the I/O thread's own heartbeats are not bounded.
        ``ack_marker`` (> 0): a quiet ``StepWrite``, acknowledged by the committer
        storing this marker in ``CTL_ACKED_STEP`` and settled with ``settle``.
        It usually gets no reply, so when no other request is pending it skips
        the ``EVENTS`` check after the send: a reply its send hid from
        ``ZMQ_FD`` waits for the I/O thread's next poll tick (at most a quarter
        of a heartbeat period), unless the caller that waits for the step calls
        ``wake_if_replied``. A resume does
        not re-send it once the word shows it applied (``_on_resume_reply``,
        ``client/attach.py``).
        """
        if bounded and len(self._pending) >= MAX_IN_FLIGHT:
            self._wait_for_room(self.request_timeout_s if room_timeout_s is None else room_timeout_s)
        rid = next(self._rids)
        msg = make(rid)
        data = P.encode(msg)
        fut: Future = Future()
        fut.rid = rid  # type: ignore[attr-defined]
        wake = False
        with self._slock:
            with self._plock:
                if self._dead is not None:
                    raise OmniPrefixCacheCommitterError(self._dead)
                self._pending[rid] = _Pending(fut, time.monotonic(), data, not isinstance(msg, P.Heartbeat),
                                              ack_marker)
            if self._state == CONNECTED:
                sock = self._sock
                sent = False
                if sock is not None and not self._outbox:  # never overtake a queued message
                    try:
                        sock.send(data, zmq.NOBLOCK)
                        sent = True
                        # A quiet send skips the EVENTS check (microseconds on the engine thread) only while
                        # nothing else is pending: else it may take the ZMQ_FD edge of a reply someone waits for
                        # (a deferred write's piece, an OpenKey), which would then wait for the I/O thread's tick.
                        wake = (not ack_marker or len(self._pending) > 1) \
                            and bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
                    except zmq.ZMQError:
                        pass  # full (EAGAIN) or closing: the I/O thread sends it or fails it
                if not sent:
                    self._outbox.append(rid)
                    wake = True
        if wake:
            self._wake()
        return fut

    def settle(self, rid: int, reply: msgspec.Struct) -> bool:
        """Complete request ``rid`` with ``reply``, learned without a reply (a quiet ``StepWrite``).

        Any thread. Whoever removes the pending entry completes its future, so
        this and a reply the I/O thread takes never both do; False when the
        entry was gone (answered, failed or never sent). The future's done
        callbacks run on the calling thread.
        """
        with self._plock:
            entry = self._pending.pop(rid, None)
            self._made_room()
        if entry is None:
            return False
        if not entry.fut.done():
            entry.fut.set_result(reply)
        return True

    def wake_if_replied(self) -> None:
        """Wake the I/O thread when a reply already waits in the socket; any thread.

        For a caller that waits on a quiet send's outcome: the send reads no
        ``EVENTS`` afterwards, so it may have taken the ``ZMQ_FD`` edge of a
        reply that came in meanwhile, and a later reply (the step's rejection)
        then comes in without one.
        """
        with self._slock:
            # A message still in the outbox also wakes it: reading EVENTS may take the edge that said the
            # socket has room again.
            ready = self._state == CONNECTED and self._sock is not None \
                and (bool(self._outbox) or bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN))
        if ready:
            self._wake()

    def _wait_for_room(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # The plain lock, entered in C: ``with self._room`` runs the Condition's Python ``__enter__``, and a signal
        # handler's exception raised there (Ctrl-C on the engine thread) left _plock held, the I/O thread blocked.
        with self._plock:
            self._room_waiters += 1
            try:
                while len(self._pending) >= MAX_IN_FLIGHT and self._dead is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise OmniPrefixCacheCommitterError(
                            f"cache {self.cache}: {len(self._pending)} requests to the committer at {self.endpoint} "
                            f"still unanswered after {timeout_s:.1f}s (at most {MAX_IN_FLIGHT} in flight)")
                    self._room.wait(remaining)
            finally:
                self._room_waiters -= 1

    def _made_room(self) -> None:
        """_plock held: pending entries left; wake callers waiting for room."""
        if self._room_waiters:
            self._room.notify_all()

    def request(self, make: Callable[[int], msgspec.Struct], timeout_s: float | None = None) -> msgspec.Struct:
        """Round trip; raises OmniPrefixCacheCommitterError on Error replies, timeouts and death.

        ``timeout_s`` (default ``request_timeout_s``) bounds the whole call: the wait for in-flight room
        and the wait for the reply together."""
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        fut = self.submit(make, room_timeout_s=timeout_s)
        try:
            reply = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout as exc:
            with self._plock:
                self._pending.pop(fut.rid, None)  # type: ignore[attr-defined]
                self._made_room()
            state = f" (link {self._state}: {self._lost_reason})" if self._state != CONNECTED else ""
            raise OmniPrefixCacheCommitterError(
                f"cache {self.cache}: committer at {self.endpoint} did not answer within {timeout_s:.1f}s{state}") \
                from exc
        if isinstance(reply, P.Error):
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer error {reply.code}: {reply.message}")
        if isinstance(reply, P.Refused):
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer refused: {reply.reason}")
        return reply

    def _read_gauges(self) -> dict[str, float]:
        """``gauges()``, or none when it raises: a metric must never stop the I/O thread (its heartbeats)."""
        try:
            return {k: float(v) for k, v in self.gauges().items()}
        except Exception:  # noqa: BLE001 - logged; the beat is sent without the gauges
            logger.exception("cache %s: reading the client's gauges failed; heartbeat sent without them", self.cache)
            return {}

    def _report(self) -> dict[str, float]:
        """What a heartbeat and the goodbye carry: the client's counters, its gauges and the link's own
        ``link_*`` stats. The goodbye once left the last out, and the committer's totals went back by them."""
        # float() each: a counter a caller's numpy count reached is a numpy float, which msgspec cannot encode,
        # and the I/O thread that failed to encode a heartbeat died with the link (review, 2026-12-07).
        return {**{k: float(v) for k, v in self.counters.items()}, **self._read_gauges(),
                **{f"link_{k}": float(v) for k, v in self.stats.items()}}

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Say goodbye (bounded by ``timeout_s``), stop the I/O thread, drop the liveness lock; any thread.

        Idempotent. A call after one that a signal handler's exception cut short (Ctrl-C, vLLM's SIGTERM
        handler, on the engine thread) finishes it: left half done, the I/O thread kept heartbeating, and a
        writer's seat stayed taken for the rest of the process (2 in 259 interrupted shutdowns, 2026-12-06).
        """
        if self._detached:
            return
        self._leaving = True
        if self._closed:
            pass  # the I/O thread is stopping: nothing would answer a goodbye, and the committer reaps the session
        elif self._dead is None and self._state == CONNECTED:
            try:
                counters = self._report()
                self.request(lambda rid: P.Goodbye(rid=rid, counters=counters), timeout_s=timeout_s)
            except OmniPrefixCacheCommitterError as exc:
                logger.warning("cache %s: goodbye not acknowledged: %s", self.cache, exc)
        elif self._dead is None:
            logger.warning("cache %s: closing while %s (%s); the committer reaps the session", self.cache,
                           self._state, self._lost_reason)
        self._shutdown_thread()
        self._detached = True
        logger.info("cache %s: client %s detached", self.cache, self.client_id[:12])

    @property
    def dead(self) -> str | None:
        """Why the link is unusable, or None (also None while it is reconnecting)."""
        return self._dead

    @property
    def state(self) -> str:
        return self._state

    # ------------------------------------------------------------ internals

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake byte is already pending, or we are closing

    def _new_socket(self) -> None:
        """A fresh DEALER (new identity, nothing queued): the only way to drop what a dead peer never read.

        The I/O thread waits on the socket's ``ZMQ_FD``, never on the socket itself: a poll of the
        socket would be a socket call outside ``_slock``.
        """
        with self._slock:
            self._close_socket_locked()
            sock = self._ctx.socket(zmq.DEALER)
            if self.endpoint.startswith("tcp://["):  # ::1 (the committer's ROUTER sets it too)
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
            sock.connect(self.endpoint)
            self._sock_fd = sock.getsockopt(zmq.FD)
            self._poller.register(self._sock_fd, zmq.POLLIN)
            self._sock = sock

    def _close_socket_locked(self) -> None:
        """``_slock`` held: close the socket, if any, and stop polling it."""
        if self._sock is not None:
            self._poller.unregister(self._sock_fd)
            self._sock.close(linger=0)
            self._sock = None

    def _shutdown_thread(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        with self._plock:  # a submit after this raises: nothing would ever send or answer it
            if self._dead is None:
                self._dead = f"cache {self.cache}: client link closed"
        self._fail_all("client link closed")
        self._wake_r.close()
        self._wake_w.close()
        self._release_liveness_lock()
        self._sweep_if_committer_gone()

    def _fail_all(self, reason: str) -> None:
        with self._slock:
            self._outbox.clear()
            with self._plock:
                pending, self._pending = self._pending, {}
                self._made_room()
        if not reason.startswith(f"cache {self.cache}:"):
            reason = f"cache {self.cache}: {reason}"
        for entry in pending.values():
            if not entry.fut.done():
                entry.fut.set_exception(OmniPrefixCacheCommitterError(reason))

    def _go_dead(self, reason: str) -> None:
        """I/O thread: the link is over. Its socket closes now: a late frame would else keep it readable
        with nobody draining it, and the loop would spin on it until ``close``."""
        with self._slock:
            with self._plock:
                self._dead = reason
            self._state = DEAD
            self._close_socket_locked()
        logger.error("%s", reason)
        self._fail_all(reason)
