"""The link's I/O thread (``omnishm-link``): the loop that receives replies, heartbeats, flushes the outbox,
and sees the committer lost.

``LinkIO`` is a mixin of ``CommitterLink`` (``client/link.py``: the socket, the locks, pending requests,
``submit``), which creates all the state it works on and starts the thread on ``_run``. Every method here
runs on that thread, apart from ``_readable`` (any thread, under ``_slock``). Losing and resuming the
committer (``_lost``, ``_reconnect_step``, ``_on_resume_reply``) are ``client/attach.py``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import msgspec
import zmq

from omnishm import protocol as P
from omnishm.client.attach import CONNECTED, DEAD, RECONNECTING, logger
from omnishm.interface import OmniPrefixCacheCommitterError
from omnishm.liveness import proc_identity


class LinkIO:
    """The I/O thread's loop and what it calls (mixin of ``CommitterLink``; all state lives there)."""

    def _run(self) -> None:
        """I/O thread: receives, heartbeats, the outbox, losing and resuming the committer."""
        next_beat = time.monotonic() + self._heartbeat_s
        ran_at = time.monotonic()
        try:
            while not self._closed:
                tick = 20 if self._state == RECONNECTING else max(1, int(self._heartbeat_s * 250))
                if self._readable():
                    tick = 0  # ZMQ_FD only signals edges: a reply already queued would not wake the poll
                events = dict(self._poller.poll(timeout=tick))
                ran_at = self._note_stall(ran_at, tick)
                if self._wake_r.fileno() in events:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                if self._state == DEAD:
                    continue
                if self._state == CONNECTED:
                    self._flush_outbox()
                self._drain()
                now = time.monotonic()
                if self._state == RECONNECTING:
                    self._reconnect_step(now)
                    next_beat = now + self._heartbeat_s
                    continue
                if not self._welcomed or self._state != CONNECTED or self._leaving:
                    continue
                next_beat = min(next_beat, now + self._heartbeat_s)  # the period the Welcome set, from the first
                if now >= next_beat:
                    next_beat = now + self._heartbeat_s
                    counters = self._report()
                    # Counted before it is sent: a wait that starts once the beat is on the wire must not
                    # take its answer (which may predate the wait) for a later one.
                    self.heartbeats_sent += 1
                    beat = self.heartbeats_sent
                    try:
                        fut = self.submit(lambda rid: P.Heartbeat(rid=rid, counters=counters), bounded=False)
                    except OmniPrefixCacheCommitterError:
                        continue
                    fut.beat = beat  # type: ignore[attr-defined]
                    fut.add_done_callback(self._on_heartbeat)
                    if self._committer_ident is not None and \
                            proc_identity(self.welcome.committer_pid) != self._committer_ident:
                        self._lost(f"committer process {self.welcome.committer_pid} is gone")
                        continue
                ran_at = self._note_stall(ran_at, 0)  # a stall inside this pass (a lock held elsewhere, say)
                if now - self._last_heard > self._heartbeat_timeout_s:
                    # Only a request the committer answers counts: a quiet StepWrite is acknowledged in the
                    # control word, never by a reply, and after a stall of this thread (no heartbeat left
                    # meanwhile, so none came back) it was taken for an unanswered request.
                    with self._plock:
                        oldest = min((e.sent_at for e in self._pending.values() if not e.marker), default=now)
                    if now - oldest > self._heartbeat_timeout_s:
                        self._lost(f"no answer for {now - self._last_heard:.1f}s (heartbeat timeout "
                                   f"{self._heartbeat_timeout_s:.1f}s)")
        except Exception as exc:  # noqa: BLE001 - the link must not outlive its thread: every wait fails now
            if not self._closed:
                logger.exception("cache %s: the link's I/O thread failed", self.cache)
                self._go_dead(f"cache {self.cache}: the link's I/O thread failed: {exc!r}")
        finally:
            with self._slock:
                self._close_socket_locked()

    def _note_stall(self, ran_at: float, tick_ms: int) -> float:
        """I/O thread, after each poll and before the silence check: log and count a loop that did not run for
        far longer than ``tick_ms`` since ``ran_at`` (the process starved of CPU or frozen, or the GIL or a
        lock held elsewhere). Returns the time now.

        Silence is judged on heartbeats, and none left while this thread stood still: such a stall is this
        process's, not the committer's. The committer's silence is judged again from the stall's end, and
        the warning says what happened when the committer then reaps this client.
        """
        now = time.monotonic()
        stalled = now - ran_at - tick_ms / 1000
        if stalled > max(1.0, 2 * self._heartbeat_s):
            self.stats["io_stalls"] += 1
            # Silence is not judged over time this thread did not listen: in a frozen process libzmq's own
            # thread stood still too, so a reply to a request sent before may not even be readable yet.
            self._last_heard = max(self._last_heard, now)
            logger.warning("cache %s: this process's omnishm link thread did not run for %.1f s (the process was "
                           "starved of CPU or frozen, the GIL or a lock of this client was held elsewhere, or an "
                           "autostart took that long); the committer's heartbeat timeout is %.1f s",
                           self.cache, stalled, self._heartbeat_timeout_s)
        return now

    def _readable(self) -> bool:
        with self._slock:
            return self._sock is not None and bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _flush_outbox(self) -> None:
        """I/O thread: send what callers queued, in order; a full socket keeps the rest for the next tick."""
        with self._slock:
            assert self._sock is not None
            while self._outbox:
                with self._plock:
                    entry = self._pending.get(self._outbox[0])
                if entry is not None:
                    try:
                        self._sock.send(entry.data, zmq.NOBLOCK)
                    except zmq.Again:
                        return
                self._outbox.popleft()

    def _drain(self) -> None:
        while True:
            with self._slock:
                if self._sock is None:  # the link went dead on a reply just taken (a refused resume)
                    return
                try:
                    frame = self._sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
            self._last_heard = time.monotonic()
            try:
                reply = P.reply_decoder.decode(frame.buffer)
            except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep for msgspec
                logger.error("cache %s: undecodable reply from committer: %s", self.cache, exc)
                continue
            if self._state == RECONNECTING:
                if self._hello_rid > 0 and reply.rid == self._hello_rid:
                    self._on_resume_reply(reply)
                continue  # anything else answers a socket we gave up
            if isinstance(reply, P.Error) and reply.code == "no_session" and self._welcomed and not self._leaving:
                # A restarted committer that does not know this socket (or we were reaped): resume, then re-send.
                self._lost(f"committer does not know this session ({reply.message})")
                return
            with self._plock:
                entry = self._pending.pop(reply.rid, None)
                self._made_room()
            if entry is None:
                if isinstance(reply, P.Error):
                    logger.error("cache %s: committer error %s: %s", self.cache, reply.code, reply.message)
                continue
            if isinstance(reply, P.KeyOpened) and reply.segments.staging:
                self._staging_names.add(reply.segments.staging)
            if not entry.fut.done():
                entry.fut.set_result(reply)

    def _on_heartbeat(self, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        reply = fut.result()
        if isinstance(reply, P.HeartbeatAck):
            self.readers = reply.readers
            beat = getattr(fut, "beat", 0)
            # A committer of an earlier release reports a writer without its epoch: that answer says
            # nothing about which writer, so it is not taken (no wait then ends early on its account).
            if beat > self.writer_ack[0] and (reply.writer_epoch or not reply.writer):
                self.writer_ack = (beat, reply.writer_epoch if reply.writer else 0)
