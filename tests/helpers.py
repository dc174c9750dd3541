"""Test helpers: a raw DEALER speaking omnishm.protocol, a writer built on it, packing."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from omnishm import liveness, protocol, shm
from omnishm.client.segments import DTYPES

REPLY_TIMEOUT_S = 5.0


def pack(values) -> bytes:
    """Packed little-endian int64, as StepWrite carries them."""
    return np.asarray(values, dtype="<i8").tobytes()


def unpack(buf: bytes) -> list[int]:
    return np.frombuffer(buf, dtype="<i8").tolist()


def loud(make):
    """Wrap a manager's StepWrite factory so the committer answers the step (quiet=False): for tests
    that stand between the link and the manager and wait for the committer's reply themselves."""
    def build(rid: int):
        msg = make(rid)
        if isinstance(msg, protocol.StepWrite):
            msg.quiet = False
        return msg
    return build


class RawClient:
    """One DEALER socket. ``call`` sends a Struct and returns the decoded reply (TimeoutError if none)."""

    def __init__(self, endpoint: str, cache: str):
        self.endpoint = endpoint
        self.cache = cache
        self.client_id = uuid.uuid4().hex
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._rid = 100

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def send(self, msg) -> None:
        self.sock.send(protocol.encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S):
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout_s}s")
        return protocol.reply_decoder.decode(self.sock.recv())

    def call(self, msg, timeout_s: float = REPLY_TIMEOUT_S):
        self.send(msg)
        return self.recv(timeout_s)

    def hello(self, role: str, layout: protocol.Layout | None = None, staging_rows: int = 0,
              version: int = protocol.PROTOCOL_VERSION, timeout_s: float = REPLY_TIMEOUT_S, **fields):
        """``fields``: any other ``Hello`` field (``pid``, ``started``, ``resume``, ``resume_epoch``, ...)."""
        return self.call(protocol.Hello(**{"rid": self.next_rid(), "protocol": version, "client_id": self.client_id,
                                           "pid": os.getpid(), "uid": os.geteuid(), "role": role, "cache": self.cache,
                                           "layout": layout, "staging_rows": staging_rows, **fields}), timeout_s)

    def goodbye(self):
        return self.call(protocol.Goodbye(rid=self.next_rid()))

    def status(self) -> dict:
        reply = self.call(protocol.StatusRequest(rid=self.next_rid()))
        assert isinstance(reply, protocol.StatusReply), reply
        return reply.status

    def close(self) -> None:
        self.sock.close()

    def leave(self) -> None:
        """Goodbye, unless closed already, then close; idempotent, for a test's ``finally``: a session left
        attached to a module's shared committer (a writer's seat) would fail that module's later tests."""
        if self.sock.closed:
            return
        try:
            self.call(protocol.Goodbye(rid=self.next_rid()))
        except TimeoutError:  # the committer is gone or frozen: nothing to leave
            pass
        finally:
            self.close()


@dataclass
class KeyView:
    """A key's segments mapped in the test process (as a writer client would map them)."""

    segments: protocol.KeySegments
    dtype: torch.dtype
    pool: torch.Tensor
    claim: torch.Tensor
    commit: torch.Tensor
    staging: torch.Tensor | None
    _segs: list = field(default_factory=list)


def map_key(ks: protocol.KeySegments, num_slots: int) -> KeyView:
    dtype = DTYPES[ks.dtype]
    pool_seg = shm.Segment.attach(ks.pool, readonly=True)
    claim_seg = shm.Segment.attach(ks.claim)  # the writer owns the claim table
    commit_seg = shm.Segment.attach(ks.commit, readonly=True)
    segs = [pool_seg, claim_seg, commit_seg]
    staging = None
    if ks.staging:
        stage_seg = shm.Segment.attach(ks.staging)
        staging = stage_seg.tensor(dtype, (ks.staging_rows, ks.width))
        segs.append(stage_seg)
    return KeyView(ks, dtype, pool_seg.tensor(dtype, (num_slots, ks.width)),
                   claim_seg.tensor(torch.int64, (num_slots,)), commit_seg.tensor(torch.int64, (num_slots,)),
                   staging, segs)


def random_rows(dtype: torch.dtype, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Byte view of rows, for bit-exact comparison whatever the dtype."""
    return t.contiguous().view(torch.uint8)


class Writer:
    """The writer side of the protocol done by hand: hello, open keys, claim, stage, StepWrite."""

    def __init__(self, endpoint: str, cache: str, layout: protocol.Layout, staging_rows: int):
        self.raw = RawClient(endpoint, cache)
        self.layout = layout
        self.num_slots = layout.num_blocks * layout.block_size
        self.welcome = self.raw.hello(protocol.ROLE_WRITER, layout, staging_rows)
        assert isinstance(self.welcome, protocol.Welcome), self.welcome
        self.epoch = self.welcome.epoch
        self.keys: dict[str, KeyView] = {ks.key: map_key(ks, self.num_slots) for ks in self.welcome.keys}
        self._seq = 0

    def open_key(self, key: str, dtype: str, width: int) -> KeyView:
        reply = self.raw.call(protocol.OpenKey(rid=self.raw.next_rid(), key=key, dtype=dtype, width=width))
        assert isinstance(reply, protocol.KeyOpened), reply
        self.keys[key] = map_key(reply.segments, self.num_slots)
        return self.keys[key]

    def new_cv(self, step: int) -> int:
        from omnishm.versions import make_cv

        self._seq += 1
        return make_cv(self.epoch, step, self._seq)

    def step_write(self, step: int, entries: list[tuple[str, int, int, int, list[int]]], claim: bool = True,
                   keys: list[str] | None = None, quiet: bool = False):
        """entries: (key, tid, cv, src_row, slots). Claims the slots (unless claim=False), sends one StepWrite
        and returns its reply; a ``quiet`` one is only sent (None), as it is answered only when it fails."""
        keys = keys if keys is not None else sorted({e[0] for e in entries})
        for key, _tid, cv, _src, slots in entries:
            in_range = [s for s in slots if 0 <= s < self.num_slots]  # bad slots are the test's point
            if claim and key in self.keys:
                self.keys[key].claim[torch.tensor(in_range, dtype=torch.int64)] = cv
        msg = protocol.StepWrite(
            rid=self.raw.next_rid(), step=step, keys=keys,
            key_idx=pack([keys.index(e[0]) for e in entries]), tids=pack([e[1] for e in entries]),
            cvs=pack([e[2] for e in entries]), src_rows=pack([e[3] for e in entries]),
            counts=pack([len(e[4]) for e in entries]), slots=pack([s for e in entries for s in e[4]]), quiet=quiet)
        if quiet:
            self.raw.send(msg)
            return None
        return self.raw.call(msg)

    def goodbye(self) -> None:
        assert isinstance(self.raw.goodbye(), protocol.Bye)
        self.raw.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_mask_has(pid: int, sig: int, mask: str) -> bool:
    """Whether ``sig`` is in the mask ``mask`` (``SigCgt``, ``SigIgn``) of /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(mask + ":"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def catches_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig``."""
    return _signal_mask_has(pid, sig, "SigCgt")


def maps_library(pid: int, name: str) -> bool:
    """Whether process ``pid`` has a file whose path contains ``name`` mapped (a shared library it is loading)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


def signal_when(argv: list[str], ready: Callable[[int], bool], sig: int, timeout_s: float,
                **popen: Any) -> tuple[int, str]:
    """Start ``argv`` (stdout and stderr piped), send it ``sig`` the moment ``ready(pid)`` holds (a busy poll:
    the window it aims at may be milliseconds), and return its exit status and stderr. The process is killed if
    it is still running at the end; the poll fails if it exits first or ``timeout_s`` passes."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def children_running(pid: int, needle: str) -> list[int]:
    """Pids of the children of ``pid`` whose command line contains ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and needle in cmdline:
            found.append(int(entry))
    return found


def ignores_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig``."""
    return _signal_mask_has(pid, sig, "SigIgn")


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of process ``pid`` stands still after a SIGSTOP (``kill`` returns before they
    do: a thread may still read a socket meanwhile). Raises AssertionError at the deadline."""
    import glob
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(stat, "rb") as f:
                    text = f.read()
            except OSError:
                continue  # a thread that ended meanwhile
            states.append(text[text.rfind(b")") + 2:][:1])
        if states and all(s == b"T" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped within {timeout_s}s: {states}"
        time.sleep(0.001)


def wait_queued_at(sock_path: str, timeout_s: float = 10.0) -> None:
    """Wait until bytes wait in the receive queue of a connection accepted on unix socket ``sock_path``: a
    message sent to a stopped process (``wait_stopped``) has reached it. Polls ``ss -x`` (iproute2), whose Recv-Q
    column is that queue; raises AssertionError at the deadline."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        rows = subprocess.run(["ss", "-xH", "src", str(sock_path)], capture_output=True, text=True,
                              check=True).stdout.split("\n")
        if any(len(f) > 2 and f[2].isdigit() and int(f[2]) > 0 for f in (r.split() for r in rows)):
            return
        assert time.monotonic() < deadline, f"nothing queued at {sock_path} within {timeout_s}s: {rows}"
        time.sleep(0.01)


def interrupt_once(monkeypatch, owner: object, name: str, *, after_real: bool = False) -> list[int]:
    """``owner.name`` raises KeyboardInterrupt (a SIGINT) on its next call, after running the real one when
    ``after_real``, then is itself again; returns a list that holds 1 once it fired."""
    real = getattr(owner, name)
    fired: list[int] = []

    def once(*args, **kw):
        monkeypatch.setattr(owner, name, real)
        if after_real:
            real(*args, **kw)
        fired.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, once)
    return fired


def shutdown_cut_by_sigterm(monkeypatch, link, shutdown) -> None:
    """Call ``shutdown`` (a runner's or a worker's) while a SIGTERM comes as ``link``'s goodbye is on its way,
    handled as an engine's handler does: it calls ``shutdown`` itself, then raises ``SystemExit``. Asserts the
    ``SystemExit`` reaches the caller, and puts the previous SIGTERM handler back."""
    import signal

    import pytest

    real = link.request

    def goodbye(*args, **kw):
        monkeypatch.setattr(link, "request", real)
        signal.raise_signal(signal.SIGTERM)
        return real(*args, **kw)

    def handler(*_):
        shutdown()
        raise SystemExit(143)

    monkeypatch.setattr(link, "request", goodbye)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit):
            shutdown()
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def io_thread_parked(link, *, before_events_check: bool = False) -> Iterator[threading.Event]:
    """The link's I/O thread held in its loop (until the yielded gate is set, at the latest on exit): after
    its ``EVENTS`` check and before its poll, or with ``before_events_check`` before that check. Lets a test
    put a reply in the socket, or take its ``ZMQ_FD`` edge with a send, at a chosen point of the loop."""
    real_readable = link._readable
    parked, gate = threading.Event(), threading.Event()

    def readable() -> bool:
        if before_events_check and not parked.is_set():
            parked.set()
            gate.wait(10)
            return real_readable()
        ready = real_readable()
        if not ready and not before_events_check and not parked.is_set():
            parked.set()
            gate.wait(10)
        return ready

    link._readable = readable
    try:
        link._wake()
        assert parked.wait(5), "the I/O thread did not come round"
        yield gate
    finally:
        gate.set()
        link._readable = real_readable



def dead_socket(path) -> None:
    """Leave at ``path`` what a SIGKILLed committer leaves: a unix socket file nobody listens on. A regular file
    does not stand in for it: omnishm never removes what is not a socket (``paths.socket_in_use``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    finally:
        sock.close()

def until(cond, timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 5 ms until it holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.1f}s"
        time.sleep(0.005)


def stopped_at_hello(condition: str) -> tuple[str, ...]:
    """``python_args`` of a committer that sends itself SIGTERM when a Hello for which ``condition`` (a Python
    expression over ``msg``) holds arrives, and handles that Hello once it is stopping: the stop signal comes
    while the Hello is queued."""
    return ("-c", f"""
import os, signal, sys, time
from omnishm.committer.attach import Attach
orig = Attach.on_hello
def on_hello(self, identity, msg):
    if ({condition}) and not self.stopping:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
    return orig(self, identity, msg)
Attach.on_hello = on_hello
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
""")


def dead_generation(cache: str, gen: str, recorded) -> list[str]:
    """The segments a committer of ``cache`` SIGKILLed while serving ``gen`` leaves (its owner segment naming the
    runtime dir ``recorded``): sorted names, the owner's included.

    A committer that another session of the suite starts meanwhile sweeps them when ``recorded`` is a dir nobody
    serves from (``orphans.abandoned``): a test that sweeps them itself names a served dir, as the session's
    ``RUNTIME_DIR`` is (review, stop 51)."""
    names = [shm.segment_name(cache, gen, w) for w in ("ctl", "pool.k0")]
    for name in names:
        shm.Segment.create(name, 64).close()
    liveness.GenerationOwner.acquire(cache, gen, runtime_dir=recorded).release(unlink=False)
    return sorted(names + [shm.segment_name(cache, gen, liveness.OWNER)])
