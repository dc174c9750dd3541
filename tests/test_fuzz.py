"""Fuzz the committer's socket: >= 100,000 malformed messages, then a well-formed client is served bit-exact.

Kinds: random bytes, truncated frames, an oversized frame (dropped by libzmq, ZMQ_MAXMSGSIZE),
valid msgpack of the wrong shape, wrong protocol versions and other bad Hellos, out-of-range and
negative slots, unknown tensor names, dtype/width mismatches, broken packed buffers, replayed and
duplicated descriptors, descriptors from an unknown session, a reader session and a reaped session.
Messages are pipelined (a window of requests in flight, not one round trip each); every one must
get exactly one reply, the committer must stay up, and the other clients must see no change.
``OMNISHM_FUZZ_MESSAGES`` raises the count (default 100,000: CI's short mode).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import msgspec
import torch
import zmq

from omnishm import protocol
from omnishm.client.link import CommitterLink

from helpers import RawClient, Writer, bits, pack, random_rows, unpack

LAYOUT = protocol.Layout(num_blocks=16, block_size=4)
NUM_SLOTS = 64
STAGING = 16
TOTAL = int(os.environ.get("OMNISHM_FUZZ_MESSAGES", "100000"))
WINDOW = 400


def _hello(rng: random.Random, cache: str, **over) -> protocol.Hello:
    fields = dict(rid=rng.randrange(1 << 30), protocol=protocol.PROTOCOL_VERSION, client_id=f"f{rng.randrange(1 << 40):x}",
                  pid=rng.randrange(1 << 22), uid=os.geteuid(), role=protocol.ROLE_READER, cache=cache, layout=LAYOUT)
    fields.update(over)
    return protocol.Hello(**fields)


def _bad_hellos(rng: random.Random, cache: str) -> list[bytes]:
    """Every one of these is refused (never creates a session)."""
    enc = protocol.encode
    return [
        enc(_hello(rng, cache, protocol=rng.choice([0, protocol.PROTOCOL_VERSION + 1, 999, -1, 1 << 40]))),
        enc(_hello(rng, cache, role=rng.choice(["", "root", "writerx", "x" * 300]))),
        enc(_hello(rng, cache, client_id=rng.choice(["", "a/b", "x" * 65, "../../etc", "\x00"]))),
        enc(_hello(rng, cache + "-other")),
        enc(_hello(rng, cache, uid=os.geteuid() + 1 + rng.randrange(1000))),
        enc(_hello(rng, cache, staging_rows=-rng.randrange(1, 1 << 40))),
        enc(_hello(rng, cache, layout=protocol.Layout(num_blocks=rng.choice([17, 1 << 40, -3]), block_size=4))),
        enc(_hello(rng, cache, layout=protocol.Layout(16, 4, {"h": protocol.KeySpec("float32", 8)}))),  # dtype
        enc(_hello(rng, cache, layout=protocol.Layout(16, 4, {"h": protocol.KeySpec("bfloat16", 9)}))),  # width
        enc(_hello(rng, cache, resume=True, resume_generation="nope")),
        enc(_hello(rng, cache, role=protocol.ROLE_WRITER, resume=True, resume_generation="x", resume_epoch=-5)),
    ]


def _wrong_shapes(rng: random.Random) -> list[bytes]:
    m = msgspec.msgpack.encode
    tag = rng.choice(["hello", "open_key", "step_write", "heartbeat", "status", "goodbye", "nope", "welcome", 7])
    return [
        m(rng.randrange(-(1 << 63), 1 << 63)),
        m([rng.random() for _ in range(rng.randrange(8))]),
        m({"type": tag}),
        m({"type": tag, "rid": "not-an-int"}),
        m({"type": "step_write", "rid": 1, "step": 1, "keys": "h", "key_idx": 5, "tids": [], "cvs": b"",
           "src_rows": b"", "counts": b"", "slots": b""}),
        m({"type": "heartbeat", "rid": 1, "counters": {"x": "y"}}),
        m({"type": "open_key", "rid": 1, "key": "h", "dtype": "bfloat16", "width": 8,
           "row_shape": rng.choice(["2x4", [2.0, 4.0], {"a": 1}, [(1 << 64) - 1]])}),
        m({"rid": 3, "key": "h"}),
        m(None), m(b"\x00" * rng.randrange(64)), m("type"),
        protocol.encode(protocol.Bye(rid=4)),  # a reply type is not a request
    ]


def _step(rng: random.Random, keys: list[str], n: int, *, slots=None, counts=None, src=None, cvs=None,
          key_idx=None, tids=None, cut: str | None = None) -> bytes:
    counts = counts if counts is not None else [1] * n
    total = sum(max(c, 0) for c in counts)
    fields = dict(rid=rng.randrange(1 << 30), step=rng.randrange(1 << 20), keys=keys,
                  key_idx=pack(key_idx if key_idx is not None else [0] * n),
                  tids=pack(tids if tids is not None else [rng.randrange(1, 1 << 40) for _ in range(n)]),
                  cvs=pack(cvs if cvs is not None else [rng.randrange(1, 1 << 62) for _ in range(n)]),
                  src_rows=pack(src if src is not None else [0] * n), counts=pack(counts),
                  slots=pack(slots if slots is not None else [rng.randrange(NUM_SLOTS) for _ in range(total)]))
    if cut:
        fields[cut] = fields[cut][:-rng.randrange(1, 8)] if fields[cut] else b"\x01"
    return protocol.encode(protocol.StepWrite(**fields))


def _bad_steps(rng: random.Random, key: str) -> list[bytes]:
    """StepWrites that fail validation as a whole (nothing applied)."""
    return [
        _step(rng, [key], 1, slots=[-rng.randrange(1, 1 << 62)]),                       # negative slot
        _step(rng, [key], 1, slots=[NUM_SLOTS + rng.randrange(1 << 40)]),               # slot out of range
        _step(rng, [key], 2, counts=[1, 1], slots=[3, 1 << 63 - 1]),
        _step(rng, ["no-such-" + str(rng.randrange(99))], 1),                            # unknown tensor name
        _step(rng, [key], 1, key_idx=[rng.choice([-1, 1, 1 << 40])]),                   # key_idx out of range
        _step(rng, [key], 1, counts=[-rng.randrange(1, 99)], slots=[]),                 # negative count
        _step(rng, [key], 1, counts=[3], slots=[1, 2]),                                  # counts != slots
        _step(rng, [key], 1, src=[STAGING - 1 + rng.randrange(1, 1 << 30)]),            # beyond staging
        _step(rng, [key], 1, src=[-rng.randrange(1, 99)]),
        _step(rng, [key], 1, cvs=[rng.choice([0, -1, -(1 << 62)])]),                     # claim version <= 0
        _step(rng, [key], 2, cut=rng.choice(["tids", "cvs", "slots", "key_idx", "counts", "src_rows"])),
        _step(rng, [key], 1, tids=[1], key_idx=[0, 0]),                                  # ragged entries
    ]


class Fuzzer:
    """One DEALER pipelining messages with at most WINDOW unanswered; counts replies by kind."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sent = 0
        self.replies: Counter[str] = Counter()
        self.received = 0

    def _drain(self, timeout_ms: int) -> None:
        if not self.sock.poll(timeout_ms):
            return
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.received += 1
            reply = protocol.reply_decoder.decode(data)
            if isinstance(reply, protocol.Error):
                self.replies[f"error:{reply.code}"] += 1
            elif isinstance(reply, protocol.StepDone):
                kind = "step_failed" if reply.failed_tids or reply.reason else "step_skipped"
                self.replies["step_wrote_rows" if reply.rows_written else kind] += 1
            else:
                self.replies[type(reply).__name__.lower()] += 1

    def blast(self, corpus: list[list[bytes]], count: int) -> None:
        for i in range(count):
            while self.sent - self.received >= WINDOW:
                self._drain(1000)
            self.sock.send_multipart(corpus[i % len(corpus)], copy=False)
            self.sent += 1
            if i % 64 == 0:
                self._drain(0)

    def settle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.received < self.sent and time.monotonic() < deadline:
            self._drain(200)
        assert self.received == self.sent, f"{self.sent - self.received} of {self.sent} messages got no reply"

    def call(self, msg) -> object:
        self.sock.send(protocol.encode(msg))
        assert self.sock.poll(5000), "no reply"
        self.received += 1
        self.sent += 1
        return protocol.reply_decoder.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()


def test_fuzzed_committer_stays_up_and_serves_a_good_client_bit_exact(committer_factory):
    handle = committer_factory("--heartbeat-s", "0.2", "--heartbeat-timeout-s", "2.0")
    rng = random.Random(1234)
    t_start = time.perf_counter()
    observer = CommitterLink(cache=handle.name, role=protocol.ROLE_READER, endpoint=handle.endpoint, layout=LAYOUT)
    fz_writer = Fuzzer(handle.endpoint)
    anon, rd = Fuzzer(handle.endpoint), Fuzzer(handle.endpoint)
    try:
        # Phase 1: a fuzzing writer session sends broken, replayed and duplicated descriptors.
        welcome = fz_writer.call(_hello(rng, handle.name, role=protocol.ROLE_WRITER, staging_rows=STAGING))
        assert isinstance(welcome, protocol.Welcome), welcome
        assert isinstance(fz_writer.call(protocol.OpenKey(rid=1, key="h", dtype="bfloat16", width=8)),
                          protocol.KeyOpened)
        mismatch = [protocol.encode(protocol.OpenKey(rid=2, key="h", dtype="float32", width=8)),
                    protocol.encode(protocol.OpenKey(rid=3, key="h", dtype="bfloat16", width=16)),
                    protocol.encode(protocol.OpenKey(rid=4, key="z", dtype="complex64", width=8)),
                    protocol.encode(protocol.OpenKey(rid=5, key="", dtype="bfloat16", width=8)),
                    protocol.encode(protocol.OpenKey(rid=6, key="w", dtype="int8", width=-1)),
                    protocol.encode(protocol.OpenKey(rid=7, key="h", dtype="bfloat16", width=8, row_shape=(2, 4))),
                    protocol.encode(protocol.OpenKey(rid=8, key="w", dtype="int8", width=8, row_shape=(1 << 62, 2))),
                    protocol.encode(protocol.OpenKey(rid=9, key="w", dtype="int8", width=8, row_shape=(8, 1, -1, -1)))]
        # Replays: a valid-looking descriptor whose claim version nobody holds (skipped, never applied), twice
        # in a row and duplicated inside one message.
        replay = _step(rng, ["h"], 2, slots=[5, 5], cvs=[7 << 48 | 1, 7 << 48 | 1], tids=[77, 77])
        corpus1 = [[b] for b in _bad_steps(rng, "h") + mismatch] + [[replay], [replay]]
        n1 = TOTAL // 5
        fz_writer.blast(corpus1, n1)
        fz_writer.settle()
        # Phase 2: random bytes, truncations, wrong shapes, bad Hellos, writes without a (writer) session.
        valid = [protocol.encode(_hello(rng, handle.name)), replay,
                 protocol.encode(protocol.StatusRequest(rid=9)), protocol.encode(protocol.Heartbeat(rid=8))]
        corpus2: list[list[bytes]] = []
        for _ in range(400):
            corpus2.append([rng.randbytes(rng.randrange(0, 200))])
            v = rng.choice(valid)
            corpus2.append([v[:rng.randrange(len(v))]])
            corpus2.append([rng.choice(_wrong_shapes(rng))])
            corpus2.append([rng.choice(_bad_hellos(rng, handle.name))])
            corpus2.append([rng.randbytes(8), rng.randbytes(rng.randrange(50))])  # two frames
        corpus2.append([b""])
        steps_anon = [[b] for b in _bad_steps(rng, "h")] + [[replay]]
        assert isinstance(rd.call(_hello(rng, handle.name)), protocol.Welcome)  # a reader session
        rest = TOTAL - n1
        anon.blast(corpus2 + steps_anon, rest * 3 // 4)
        rd.blast([[replay], [mismatch[0]], [protocol.encode(protocol.OpenKey(rid=11, key="nope", dtype="int8",
                                                                            width=1))]], rest - rest * 3 // 4)
        anon.settle()
        rd.settle()
        # The fuzzing writer fell silent meanwhile: reaped. Its late descriptors are failed and counted.
        deadline = time.monotonic() + 15
        admin = RawClient(handle.endpoint, handle.name)
        assert isinstance(admin.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        while admin.status()["clients_reaped"] < 1:
            assert time.monotonic() < deadline, "the silent fuzzing writer was not reaped"
            observer.request(lambda rid: protocol.Heartbeat(rid=rid))  # paces the loop on a real round trip
        late = fz_writer.call(protocol.request_decoder.decode(replay))
        assert isinstance(late, protocol.StepDone) and late.failed_tids and "reaped" in late.reason
        elapsed = time.perf_counter() - t_start
        sent = fz_writer.sent + anon.sent + rd.sent

        # An oversized frame is dropped by libzmq before decoding: no reply, not counted as a message.
        def bad_total(st: dict) -> int:
            return sum(st["decode_errors"].values()) + sum(st["rejected"].values())

        before = bad_total(admin.status())
        big = Fuzzer(handle.endpoint)
        big.sock.send(b"\x81" + bytes(protocol.MAX_MESSAGE_BYTES))  # would be a schema error if it got through
        assert not big.sock.poll(1000), "an oversized frame was answered: ZMQ_MAXMSGSIZE did not drop it"
        assert bad_total(admin.status()) == before, "the oversized frame reached the decoder"
        big.close()

        # The committer is up, the observer never noticed anything, and a well-formed writer is served bit-exact.
        assert handle.proc.poll() is None
        assert observer.dead is None and observer.stats["committer_lost"] == 0
        writer = Writer(handle.endpoint, handle.name, LAYOUT, STAGING)
        view = writer.open_key("h", "bfloat16", 8)
        staged = random_rows(torch.bfloat16, (STAGING, 8), torch.Generator().manual_seed(3))
        view.staging.copy_(staged)
        slots = [5, 6, 7, 40, 41, 63, 0, 1]
        cv = writer.new_cv(1)
        done = writer.step_write(1, [("h", 1, cv, 0, slots)])
        assert unpack(done.done_tids) == [1] and done.rows_written == len(slots), done
        assert torch.equal(bits(view.pool[slots]), bits(staged[:len(slots)]))
        untouched = sorted(set(range(NUM_SLOTS)) - set(slots))
        assert int(view.commit[untouched].count_nonzero()) == 0 and int(bits(view.pool[untouched]).count_nonzero()) == 0
        status = admin.status()
        writer.goodbye()
        admin.goodbye()
        admin.close()
    finally:
        for f in (fz_writer, anon, rd):
            f.close()
        observer.close()
    replies = fz_writer.replies + anon.replies + rd.replies
    assert replies["step_wrote_rows"] == 0, replies  # no malformed or replayed descriptor wrote a row
    # No bad Hello created a session (a "bad" protocol version equal to PROTOCOL_VERSION once did: each re-send
    # then logged a detach and an attach, unthrottled, and 1,000,000 messages logged 4,849 lines).
    assert anon.replies["welcome"] == 0, anon.replies
    assert status["rejected"].get("internal", 0) == 0, status["rejected"]
    assert status["log_lines_suppressed"] > 0  # bad input was logged, rate-limited
    log_lines = handle.log().count("\n")
    assert log_lines < 2000, f"the committer logged {log_lines} lines for {sent} bad messages"
    print(f"\n[omnishm fuzz] {sent} malformed messages in {elapsed:.1f}s ({sent / elapsed:,.0f}/s), every one "
          f"answered; replies {dict(replies)}; committer decode errors {status['decode_errors']}, rejected "
          f"{status['rejected']}; {status['log_lines_suppressed']} log lines suppressed, {log_lines} written")
    assert sent >= TOTAL
