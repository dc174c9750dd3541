"""The client's connection to its committer: one DEALER socket, one I/O thread.

ZeroMQ sockets are not thread-safe, so exactly one thread (``omnishm-link``)
touches the socket. Other threads hand it messages through a deque and a wake
pipe, and get a ``Future`` that the I/O thread completes with the reply whose
``rid`` matches. The I/O thread also sends heartbeats (carrying the client's
counters) and fails every pending future with ``OmniPrefixCacheCommitterError``
when the committer stops answering, so no caller ever waits forever.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from omnishm import protocol as P
from omnishm import shm
from omnishm.interface import OmniPrefixCacheCommitterError

logger = logging.getLogger(__name__)


def default_endpoint(cache: str, runtime_dir: Path | None = None) -> str:
    runtime_dir = Path(runtime_dir) if runtime_dir is not None else shm.default_runtime_dir()
    return f"ipc://{shm.socket_path(runtime_dir, cache)}"


def start_committer(cache: str, runtime_dir: Path, *, exit_when_idle: bool = True) -> subprocess.Popen:
    """Start an embedded committer for ``cache`` in its own session (it outlives no client)."""
    cmd = [sys.executable, "-m", "omnishm.committer", "--name", cache, "--runtime-dir", str(runtime_dir)]
    if exit_when_idle:
        cmd.append("--exit-when-idle")
    log = open(Path(runtime_dir) / f"{cache}.autostart.log", "ab")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    finally:
        log.close()
    # Reap it when it exits so it never lingers as a zombie of the runner.
    threading.Thread(target=proc.wait, name=f"omnishm-reap-{cache}", daemon=True).start()
    logger.info("cache %s: autostarted committer pid %d", cache, proc.pid)
    return proc


class CommitterLink:
    """A session with one committer.

    Thread-safe: ``request`` and ``submit`` may be called from any thread.
    ``close`` says goodbye (bounded) and stops the I/O thread; exactly once.
    """

    def __init__(self, *, cache: str, role: str, endpoint: str | None = None, layout: P.Layout | None = None,
                 staging_rows: int = 0, autostart: bool = False, connect_timeout_s: float = 30.0,
                 request_timeout_s: float = 30.0, runtime_dir: Path | None = None):
        shm.check_cache_name(cache)
        self.cache = cache
        self.role = role
        self.client_id = uuid.uuid4().hex
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else shm.default_runtime_dir()
        self.endpoint = endpoint or default_endpoint(cache, self.runtime_dir)
        self.request_timeout_s = request_timeout_s
        self.counters: dict[str, float] = {}
        self.readers = 0
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[Future, float]] = {}
        self._outbox: collections.deque[bytes] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._dead: str | None = None
        self._heartbeat_s = 1.0
        self._heartbeat_timeout_s = 10.0
        self._last_heard = time.monotonic()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self._sock.connect(self.endpoint)
        self._thread = threading.Thread(target=self._run, name=f"omnishm-link-{cache}", daemon=True)
        self._thread.start()
        try:
            self.welcome = self._hello(layout, staging_rows, autostart, connect_timeout_s)
        except BaseException:
            self._shutdown_thread()
            raise
        self._heartbeat_s = self.welcome.heartbeat_s
        self._heartbeat_timeout_s = self.welcome.heartbeat_timeout_s
        logger.info("cache %s: client %s attached as %s (committer pid %d, epoch %d)", cache,
                    self.client_id[:12], role, self.welcome.committer_pid, self.welcome.epoch)

    # ------------------------------------------------------------ public

    def submit(self, make: Callable[[int], msgspec.Struct]) -> Future:
        """Queue ``make(rid)`` for sending; the future gets its reply (or an error)."""
        if self._dead is not None:
            raise OmniPrefixCacheCommitterError(self._dead)
        rid = next(self._rids)
        fut: Future = Future()
        data = P.encode(make(rid))
        self._pending[rid] = (fut, time.monotonic())
        self._outbox.append(data)
        self._wake()
        return fut

    def request(self, make: Callable[[int], msgspec.Struct], timeout_s: float | None = None) -> msgspec.Struct:
        """Round trip; raises OmniPrefixCacheCommitterError on Error replies, timeouts and death."""
        fut = self.submit(make)
        try:
            reply = fut.result(timeout=timeout_s or self.request_timeout_s)
        except TimeoutError as exc:
            raise OmniPrefixCacheCommitterError(
                f"cache {self.cache}: committer at {self.endpoint} did not answer within "
                f"{timeout_s or self.request_timeout_s:.1f}s") from exc
        if isinstance(reply, P.Error):
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer error {reply.code}: {reply.message}")
        if isinstance(reply, P.Refused):
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer refused: {reply.reason}")
        return reply

    def close(self, *, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        if self._dead is None:
            try:
                self.request(lambda rid: P.Goodbye(rid=rid), timeout_s=timeout_s)
            except OmniPrefixCacheCommitterError as exc:
                logger.warning("cache %s: goodbye not acknowledged: %s", self.cache, exc)
        self._shutdown_thread()
        logger.info("cache %s: client %s detached", self.cache, self.client_id[:12])

    @property
    def dead(self) -> str | None:
        return self._dead

    # ------------------------------------------------------------ internals

    def _hello(self, layout: P.Layout | None, staging_rows: int, autostart: bool, timeout_s: float) -> P.Welcome:
        deadline = time.monotonic() + timeout_s
        started = False
        while True:
            if autostart and not started and self.endpoint.startswith("ipc://") \
                    and not shm.cache_is_live(self.runtime_dir, self.cache):
                shm.ensure_runtime_dir(self.runtime_dir)
                start_committer(self.cache, self.runtime_dir)
                started = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise OmniPrefixCacheCommitterError(
                    f"cache {self.cache}: no committer answered at {self.endpoint} within {timeout_s:.1f}s; "
                    f"start one with `scripts/launch_committer.sh --name {self.cache}` or pass autostart=True")
            fut = self.submit(lambda rid: P.Hello(
                rid=rid, protocol=P.PROTOCOL_VERSION, client_id=self.client_id, pid=os.getpid(), uid=os.geteuid(),
                role=self.role, cache=self.cache, layout=layout, staging_rows=staging_rows))
            try:
                reply = fut.result(timeout=min(remaining, 2.0 if autostart and not started else remaining))
            except TimeoutError:
                self._pending.clear()
                continue
            if isinstance(reply, P.Welcome):
                return reply
            reason = reply.reason if isinstance(reply, P.Refused) else f"{reply.code}: {reply.message}"
            raise OmniPrefixCacheCommitterError(f"cache {self.cache}: committer refused this {self.role}: {reason}")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:
            pass  # a wake byte is already pending

    def _shutdown_thread(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        self._fail_all("client link closed")
        self._wake_r.close()
        self._wake_w.close()

    def _fail_all(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(OmniPrefixCacheCommitterError(f"cache {self.cache}: {reason}"))

    def _run(self) -> None:
        """I/O thread: the only code that touches the socket."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        next_beat = time.monotonic() + self._heartbeat_s
        try:
            while not self._closed:
                events = dict(poller.poll(timeout=max(1, int(self._heartbeat_s * 250))))
                if self._wake_r.fileno() in events:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                while self._outbox:
                    self._sock.send(self._outbox.popleft(), copy=False)
                if self._sock in events:
                    self._drain()
                now = time.monotonic()
                if now >= next_beat and hasattr(self, "welcome") and self._dead is None:
                    counters = dict(self.counters)
                    fut = self.submit(lambda rid: P.Heartbeat(rid=rid, counters=counters))
                    fut.add_done_callback(self._on_heartbeat)
                    next_beat = now + self._heartbeat_s
                if self._pending and now - self._last_heard > self._heartbeat_timeout_s:
                    oldest = min(t for _, t in self._pending.values())
                    if now - oldest > self._heartbeat_timeout_s:
                        self._dead = (f"cache {self.cache}: committer at {self.endpoint} has not answered for "
                                      f"{now - self._last_heard:.1f}s (heartbeat timeout)")
                        logger.error(self._dead)
                        self._fail_all("committer unreachable")
        finally:
            self._sock.close(linger=0)

    def _drain(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                reply = P.reply_decoder.decode(frame.buffer)
            except msgspec.DecodeError as exc:
                logger.error("cache %s: undecodable reply from committer: %s", self.cache, exc)
                continue
            entry = self._pending.pop(reply.rid, None)
            if entry is None:
                if isinstance(reply, P.Error):
                    logger.error("cache %s: committer error %s: %s", self.cache, reply.code, reply.message)
                continue
            fut, _ = entry
            if not fut.done():
                fut.set_result(reply)

    def _on_heartbeat(self, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        reply = fut.result()
        if isinstance(reply, P.HeartbeatAck):
            self.readers = reply.readers
