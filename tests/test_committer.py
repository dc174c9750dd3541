"""The committer as a real subprocess, driven over real ZeroMQ and real shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from omnishm import liveness, protocol, shm
from omnishm.committer.config import check_endpoint

from conftest import RUNTIME_DIR, unique_cache_name
from helpers import RawClient, Writer, bits, catches_signal, pack, random_rows, unpack, wait_stopped

LAYOUT = protocol.Layout(num_blocks=16, block_size=4)  # the shared committer's layout: 64 slots
NUM_SLOTS = 64
STAGING_ROWS = 32
KEYS = [("f32", "float32", 16), ("bf16", "bfloat16", 8), ("f16", "float16", 4), ("i64", "int64", 3)]


def unique_key(tag: str) -> str:
    return f"{tag}-{unique_cache_name('k')}"


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnishm", *args], capture_output=True, text=True, timeout=timeout)


def fill_staging(writer: Writer, key: str, seed: int) -> torch.Tensor:
    view = writer.keys[key]
    rows = random_rows(view.dtype, tuple(view.staging.shape), torch.Generator().manual_seed(seed))
    view.staging.copy_(rows)
    return rows


def check_rows(writer: Writer, key: str, expect: dict[int, tuple[torch.Tensor, int]]) -> None:
    """Every slot in ``expect`` holds the row bit-exact and commit == cv; every other slot is untouched."""
    view = writer.keys[key]
    for slot, (row, cv) in expect.items():
        assert torch.equal(bits(view.pool[slot]), bits(row)), f"{key} slot {slot} differs"
        assert int(view.commit[slot]) == cv, f"{key} slot {slot} commit {int(view.commit[slot])} != {cv}"
    others = [s for s in range(NUM_SLOTS) if s not in expect]
    assert int(view.commit[others].count_nonzero()) == 0
    assert int(bits(view.pool[others]).count_nonzero()) == 0


def test_rows_land_bit_exact_for_several_keys_and_dtypes(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    names = {}
    for tag, dtype, width in KEYS:
        names[tag] = unique_key(tag)
        writer.open_key(names[tag], dtype, width)
    staged = {tag: fill_staging(writer, names[tag], seed) for seed, (tag, _, _) in enumerate(KEYS)}
    step = 7
    entries, expect, tids = [], {tag: {} for tag in names}, []
    for n, tag in enumerate(names):
        # A run of two whole blocks, a scattered set, and a run at another staging offset.
        pieces = [(0, list(range(8 + 4 * n, 16 + 4 * n))), (10, [3, 41, 60 - n, 2]), (20, [48, 49, 50])]
        for src, slots in pieces:
            tid, cv = 1000 + len(tids), writer.new_cv(step)
            tids.append(tid)
            entries.append((names[tag], tid, cv, src, slots))
            for i, slot in enumerate(slots):
                expect[tag][slot] = (staged[tag][src + i], cv)
    # One more key staged in order but scattered over the pool (the no-gather index_copy_ path).
    names["seq"] = unique_key("seq")
    writer.open_key(names["seq"], "float32", 5)
    staged["seq"] = fill_staging(writer, names["seq"], 99)
    tids.append(2000)
    cv = writer.new_cv(step)
    entries.append((names["seq"], 2000, cv, 5, [7, 3, 30, 31, 12, 63]))
    expect["seq"] = {slot: (staged["seq"][5 + i], cv) for i, slot in enumerate(entries[-1][4])}
    done = writer.step_write(step, entries)
    assert isinstance(done, protocol.StepDone), done
    assert done.reason == "" and done.failed_tids == b""
    assert sorted(unpack(done.done_tids)) == sorted(tids)
    assert done.rows_written == sum(len(e[4]) for e in entries) and done.rows_skipped == 0
    for tag in names:
        check_rows(writer, names[tag], expect[tag])
    stage_segs = [kv.segments.staging for kv in writer.keys.values()]
    assert all(s in shm.list_segments(committer.name) for s in stage_segs)
    writer.goodbye()
    # Goodbye unlinks the writer's staging segments; pool, claim and commit stay.
    left = shm.list_segments(committer.name)
    assert not any(s in left for s in stage_segs)
    assert all(kv.segments.pool in left for kv in writer.keys.values())


def test_slot_claimed_by_newer_write_is_skipped(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    key = unique_key("skip")
    view = writer.open_key(key, "float32", 8)
    staged = fill_staging(writer, key, 42)
    before = writer.raw.status()["rows_skipped"]
    slots = list(range(16, 24))
    cv_old = writer.new_cv(3)
    view.claim[torch.tensor(slots)] = cv_old
    cv_new = writer.new_cv(4)
    view.claim[[18, 21]] = cv_new  # reclaimed by a newer write before the committer got to step 3
    done = writer.step_write(3, [(key, 1, cv_old, 0, slots)], claim=False)
    assert done.rows_written == 6 and done.rows_skipped == 2 and unpack(done.done_tids) == [1]
    check_rows(writer, key, {s: (staged[i], cv_old) for i, s in enumerate(slots) if s not in (18, 21)})
    assert writer.raw.status()["rows_skipped"] == before + 2
    writer.goodbye()


@pytest.mark.parametrize("keys", [1, 2], ids=["one key (fast path)", "two keys (general path)"])
def test_a_committed_row_is_never_written_again_under_its_version(committer, keys):
    """A reader plans on (slot, version) and trusts a row whose commit and claim still hold that version after
    its copy, so a row rewritten under the version it was committed with would pass that check half-written.
    A step sent again under its versions (a replay, or a later step naming an earlier step's version) copies
    nothing and counts its rows skipped (review, stop 56); a new version writes the slot as before."""
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    names = [unique_key(f"once{k}") for k in range(keys)]
    for name in names:
        writer.open_key(name, "float32", 8)
    first = {name: fill_staging(writer, name, 5 + k) for k, name in enumerate(names)}
    slots = [3, 4, 5, 9]
    cv = writer.new_cv(1)
    # The second key's entry has another tid, so its part of the step differs and the fast path declines it.
    entries = [(name, 1 + k, cv, 0, slots) for k, name in enumerate(names)]
    assert writer.step_write(1, entries).rows_written == 4 * keys
    before = writer.raw.status()["rows_skipped"]
    second = {name: fill_staging(writer, name, 50 + k) for k, name in enumerate(names)}
    again = writer.step_write(2, entries)
    assert (again.rows_written, again.rows_skipped, again.reason, again.failed_tids) == (0, 4 * keys, "", b"")
    assert sorted(unpack(again.done_tids)) == list(range(1, 1 + keys))
    cv_new = writer.new_cv(3)
    mixed = [e for name in names for e in ((name, 1, cv, 0, slots[:2]), (name, 2, cv_new, 2, slots[2:]))]
    done = writer.step_write(3, mixed)
    assert (done.rows_written, done.rows_skipped) == (2 * keys, 2 * keys), done
    for name in names:
        check_rows(writer, name, {3: (first[name][0], cv), 4: (first[name][1], cv),
                                  5: (second[name][2], cv_new), 9: (second[name][3], cv_new)})
    assert writer.raw.status()["rows_skipped"] == before + 6 * keys
    writer.goodbye()


@pytest.mark.parametrize("keys", [1, 2], ids=["one key (fast path)", "two keys (general path)"])
@pytest.mark.parametrize("left", ["rows, no commit", "rows, half the commits", "first key committed"])
def test_a_step_sent_again_after_a_cut_short_apply_lands_every_row(committer, keys, left):
    """What a committer killed inside an apply leaves (rows copied and no commit, some commits, one key
    committed and the next untouched), then the link's re-send of the step to its successor: every row
    lands and is committed, the rows already committed under their version copied no second time
    (review, stop 57)."""
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    names = [unique_key(f"cut{k}") for k in range(keys)]
    for name in names:
        writer.open_key(name, "float32", 8)
    staged = {name: fill_staging(writer, name, 7 + k) for k, name in enumerate(names)}
    slots = [3, 4, 5, 9, 10, 40]
    cv = writer.new_cv(1)
    committed = 0
    for k, name in enumerate(names):
        writer.keys[name].claim[torch.tensor(slots)] = cv
        if left == "first key committed" and k == 1:
            continue
        # The killed committer's own writable maps of the pool and commit table.
        ks = writer.keys[name].segments
        segs = [shm.Segment.attach(ks.pool), shm.Segment.attach(ks.commit)]
        try:
            segs[0].tensor(torch.float32, (NUM_SLOTS, 8))[slots] = staged[name][:len(slots)]
            done_slots = {"rows, no commit": [], "rows, half the commits": slots[:3]}.get(left, slots)
            segs[1].tensor(torch.int64, (NUM_SLOTS,))[done_slots] = cv
            committed += len(done_slots)
        finally:
            for seg in segs:
                seg.close()
    done = writer.step_write(1, [(name, 1 + k, cv, 0, slots) for k, name in enumerate(names)], claim=False)
    assert (done.reason, done.rows_written, done.rows_skipped) == ("", len(slots) * keys - committed, committed)
    for name in names:
        check_rows(writer, name, {slot: (staged[name][i], cv) for i, slot in enumerate(slots)})
    writer.goodbye()


def test_bad_requests_get_clear_errors_while_another_client_is_served(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    key = unique_key("err")
    writer.open_key(key, "bfloat16", 8)
    staged = fill_staging(writer, key, 7)
    bad = committer.client()
    expect: dict[int, tuple[torch.Tensor, int]] = {}

    def good_step(step: int, slots: list[int], src: int) -> None:
        cv = writer.new_cv(step)
        done = writer.step_write(step, [(key, step, cv, src, slots)])
        assert done.rows_written == len(slots) and done.reason == "", done
        expect.update({s: (staged[src + i], cv) for i, s in enumerate(slots)})
        check_rows(writer, key, expect)

    reply = bad.call(protocol.StatusRequest(rid=5))  # no Hello yet
    assert isinstance(reply, protocol.Error) and reply.code == "no_session" and reply.rid == 5
    good_step(1, [0, 1, 2, 3], 0)
    bad.send_raw(b"\xc1\xff not msgpack")
    reply = bad.recv()
    assert isinstance(reply, protocol.Error) and reply.code == "decode" and reply.rid == -1
    bad.send_raw(b"", protocol.encode(protocol.StatusRequest(rid=6)))  # REQ-style delimiter: wrong shape
    reply = bad.recv()
    assert isinstance(reply, protocol.Error) and reply.code == "decode" and "frames" in reply.message
    bad.send_raw(protocol.encode(protocol.Bye(rid=9)))  # a reply type is not a request
    assert bad.recv().code == "decode"
    good_step(2, [4, 5], 4)
    reply = bad.hello(protocol.ROLE_READER, LAYOUT, version=999)
    assert isinstance(reply, protocol.Refused)
    assert "999" in reply.reason and f"speaks {protocol.PROTOCOL_VERSION}" in reply.reason
    good_step(3, [9, 10, 11], 6)

    # A bad descriptor fails as a whole, names the step, key and value, and applies nothing.
    cv = writer.new_cv(4)
    done = writer.step_write(4, [(key, 40, cv, 0, [12, 13]), (key, 41, cv, 2, [14, NUM_SLOTS + 5])])
    assert unpack(done.done_tids) == [] and sorted(unpack(done.failed_tids)) == [40, 41]
    assert "step 4" in done.reason and key in done.reason and str(NUM_SLOTS + 5) in done.reason
    writer.keys[key].claim[[12, 13, 14, NUM_SLOTS - 1]] = 0
    check_rows(writer, key, expect)
    done = writer.step_write(5, [("no-such-key", 50, writer.new_cv(5), 0, [20])], claim=False)
    assert unpack(done.failed_tids) == [50] and "unknown key 'no-such-key'" in done.reason
    done = writer.step_write(6, [(key, 60, writer.new_cv(6), STAGING_ROWS - 1, [21, 22])])
    assert unpack(done.failed_tids) == [60] and "staging rows" in done.reason
    writer.keys[key].claim[[21, 22]] = 0
    msg = protocol.StepWrite(rid=77, step=7, keys=[key], key_idx=pack([0]), tids=pack([70]), cvs=b"\x01\x02\x03",
                             src_rows=pack([0]), counts=pack([1]), slots=pack([30]))
    done = writer.raw.call(msg)
    assert unpack(done.failed_tids) == [70] and "not a multiple of 8" in done.reason
    good_step(8, [24, 25, 26, 27, 28], 10)

    reader = committer.client()
    assert isinstance(reader.hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
    reply = reader.call(protocol.StepWrite(rid=3, step=1, keys=[key], key_idx=b"", tids=b"", cvs=b"", src_rows=b"",
                                           counts=b"", slots=b""))
    assert isinstance(reply, protocol.Error) and reply.code == "not_writer"
    good_step(9, [40], 20)

    status = writer.raw.status()
    assert status["decode_errors"]["msgpack"] >= 1 and status["decode_errors"]["frames"] >= 1
    assert status["rejected"]["step_invalid"] >= 4 and status["rejected"]["hello_protocol"] >= 1
    assert status["rejected"]["no_session"] >= 1 and status["rejected"]["not_writer"] >= 1
    assert isinstance(reader.goodbye(), protocol.Bye)
    for client in (bad, reader):
        client.close()
    writer.goodbye()


def test_second_writer_refused_then_next_writer_gets_new_epoch(committer):
    first = Writer(committer.endpoint, committer.name, LAYOUT, 4)
    second = committer.client()
    try:
        reply = second.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(reply, protocol.Refused)
        assert "already has a writer" in reply.reason
        assert first.raw.client_id in reply.reason and f"pid {os.getpid()}" in reply.reason
        first.goodbye()
        welcome = second.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(welcome, protocol.Welcome) and welcome.epoch == first.epoch + 1
        ctl = shm.Segment.attach(welcome.control, readonly=True).tensor(torch.int64, (protocol.CTL_WORDS,))
        assert int(ctl[protocol.CTL_WRITER_EPOCH]) == welcome.epoch
        assert int(ctl[protocol.CTL_COMMITTER_PID]) == committer.proc.pid
        assert isinstance(second.goodbye(), protocol.Bye)
    finally:  # the module's committer: a writer left attached would fail its later tests
        first.raw.leave()
        second.leave()


def test_layout_mismatch_refused(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, 4)
    key = unique_key("lay")
    writer.open_key(key, "float16", 8)
    client = committer.client()
    reply = client.hello(protocol.ROLE_READER, protocol.Layout(num_blocks=17, block_size=4))
    assert isinstance(reply, protocol.Refused) and "num_blocks=16" in reply.reason and "num_blocks=17" in reply.reason
    reply = client.hello(protocol.ROLE_READER, protocol.Layout(16, 4, {key: protocol.KeySpec("float32", 8)}))
    assert isinstance(reply, protocol.Refused) and key in reply.reason and "float16[8]" in reply.reason
    reply = writer.raw.call(protocol.OpenKey(rid=1, key=key, dtype="float16", width=9))
    assert isinstance(reply, protocol.Error) and reply.code == "layout_mismatch" and "float16[9]" in reply.message
    reply = writer.raw.call(protocol.OpenKey(rid=2, key=unique_key("dt"), dtype="complex64", width=2))
    assert isinstance(reply, protocol.Error) and reply.code == "bad_dtype" and "complex64" in reply.message
    welcome = client.hello(protocol.ROLE_READER, protocol.Layout(16, 4, {key: protocol.KeySpec("float16", 8)}))
    assert isinstance(welcome, protocol.Welcome)
    assert all(ks.staging is None for ks in welcome.keys) and key in [ks.key for ks in welcome.keys]
    reply = client.call(protocol.OpenKey(rid=3, key=unique_key("nope"), dtype="float16", width=8))
    assert isinstance(reply, protocol.Error) and reply.code == "unknown_key"
    opened = client.call(protocol.OpenKey(rid=4, key=key, dtype="float16", width=8))
    assert isinstance(opened, protocol.KeyOpened) and opened.segments.staging is None
    ack = client.call(protocol.Heartbeat(rid=5, counters={"reads": 3.0}))
    assert isinstance(ack, protocol.HeartbeatAck) and ack.writer and ack.readers == 1
    me = [c for c in writer.raw.status()["clients"] if c["client_id"] == client.client_id]
    assert me and me[0]["counters"] == {"reads": 3.0} and me[0]["rss_bytes"] > 0
    assert isinstance(client.goodbye(), protocol.Bye)
    client.close()
    writer.goodbye()


def test_a_key_keeps_the_row_shape_it_was_first_opened_with(committer):
    """Every row of a key has one row shape for the life of the cache: the committer refuses an OpenKey
    (a writer's, or a reader's map) of the same width in another shape, so no client can read rows back
    in a shape they were not written in; a malformed shape gets a clear error and the client goes on."""
    writer = Writer(committer.endpoint, committer.name, LAYOUT, 4)
    key, flat = unique_key("shape"), unique_key("flat")
    opened = writer.raw.call(protocol.OpenKey(rid=1, key=key, dtype="float32", width=6, row_shape=(2, 3)))
    assert isinstance(opened, protocol.KeyOpened) and opened.segments.row_shape == (2, 3)
    again = writer.raw.call(protocol.OpenKey(rid=2, key=key, dtype="float32", width=6, row_shape=(2, 3)))
    assert isinstance(again, protocol.KeyOpened) and again.segments.pool == opened.segments.pool
    for rid, shape in enumerate([(3, 2), (6,), None], start=3):
        reply = writer.raw.call(protocol.OpenKey(rid=rid, key=key, dtype="float32", width=6, row_shape=shape))
        assert isinstance(reply, protocol.Error) and reply.code == "layout_mismatch", reply
        assert "holds rows of shape (2, 3)" in reply.message and f"rows of shape {shape or (6,)}" in reply.message
    for rid, shape in enumerate([(4, 2), (6, 0), (0,), (-2, -3), (1,) * 9], start=10):
        reply = writer.raw.call(protocol.OpenKey(rid=rid, key=flat, dtype="float32", width=6, row_shape=shape))
        assert isinstance(reply, protocol.Error) and reply.code == "bad_row_shape" and "row shape" in reply.message
    huge = (1,) * protocol.MAX_ITEMS  # a client's shape is echoed in the reply and the log: cut, not all of it
    for rid, name in ((21, key), (22, flat)):
        reply = writer.raw.call(protocol.OpenKey(rid=rid, key=name, dtype="float32", width=6, row_shape=huge))
        assert isinstance(reply, protocol.Error) and "4096 dims" in reply.message and len(reply.message) < 400
    writer.raw.send(protocol.OpenKey(rid=23, key=key, dtype="float32", width=6, row_shape=huge + (1,)))
    undecodable = writer.raw.recv()  # refused from its length header (protocol.MAX_ITEMS)
    assert isinstance(undecodable, protocol.Error) and undecodable.code == "decode", undecodable
    assert "length <= 4096 - at `$.row_shape`" in undecodable.message and len(undecodable.message) < 400
    scalar = writer.raw.call(protocol.OpenKey(rid=20, key=flat, dtype="float32", width=1, row_shape=()))
    assert isinstance(scalar, protocol.KeyOpened) and scalar.segments.row_shape == ()
    reader = committer.client()
    declared = reader.hello(protocol.ROLE_READER, protocol.Layout(16, 4, {key: protocol.KeySpec("float32", 6, (3, 2))}))
    assert isinstance(declared, protocol.Refused) and "holds rows of shape (2, 3)" in declared.reason
    declared = reader.hello(protocol.ROLE_READER, protocol.Layout(16, 4, {key: protocol.KeySpec("float32", 6, huge)}))
    assert isinstance(declared, protocol.Refused) and "4096 dims" in declared.reason and len(declared.reason) < 400
    welcome = reader.hello(protocol.ROLE_READER, protocol.Layout(16, 4))
    assert isinstance(welcome, protocol.Welcome)
    assert {ks.key: ks.row_shape for ks in welcome.keys if ks.key in (key, flat)} == {key: (2, 3), flat: ()}
    refused = reader.call(protocol.OpenKey(rid=1, key=key, dtype="float32", width=6, row_shape=(3, 2)))
    assert isinstance(refused, protocol.Error) and refused.code == "layout_mismatch"
    assert "reader asked for rows of shape (3, 2)" in refused.message
    mapped = reader.call(protocol.OpenKey(rid=2, key=key, dtype="float32", width=6, row_shape=(2, 3)))
    assert isinstance(mapped, protocol.KeyOpened) and mapped.segments.row_shape == (2, 3)
    assert writer.raw.status()["rejected"]["layout_mismatch"] >= 5
    assert len(committer.log()) < 200_000
    assert isinstance(reader.goodbye(), protocol.Bye)
    reader.close()
    writer.goodbye()


def test_second_committer_with_same_name_refuses(committer):
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", committer.name],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"cache {committer.name!r} already has a running committer" in proc.stderr
    assert f"pid {committer.proc.pid}" in proc.stderr
    assert committer.proc.poll() is None  # the first one is untouched and still answers
    client = committer.client()
    assert isinstance(client.hello(protocol.ROLE_ADMIN), protocol.Welcome)
    client.goodbye()
    client.close()


def test_status_json_and_ping(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, 4)
    key = unique_key("st")
    writer.open_key(key, "int64", 2)
    proc = run_cli("status", "--name", committer.name, "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["name"] == committer.name and status["pid"] == committer.proc.pid
    assert status["layout"]["num_slots"] == NUM_SLOTS and status["segment_bytes"] > 0
    assert key in [k["name"] for k in status["keys"]]
    assert writer.raw.client_id in [c["client_id"] for c in status["clients"]]
    proc = run_cli("status", "--name", committer.name)
    assert proc.returncode == 0 and key in proc.stdout and "MiB" in proc.stdout
    assert run_cli("ping", "--name", committer.name).returncode == 0
    writer.goodbye()


def test_status_and_ping_fail_when_nothing_answers():
    name = unique_cache_name("absent")
    for cmd in ("status", "ping"):
        proc = run_cli(cmd, "--name", name, "--json")if cmd == "status" else run_cli(cmd, "--name", name)
        assert proc.returncode == 1 and f"no committer for cache {name!r}" in proc.stderr
    # A reachable-looking endpoint where nobody answers: bounded by --timeout-s.
    t0 = time.monotonic()
    proc = run_cli("ping", "--name", name, "--endpoint", "tcp://127.0.0.1:9", "--timeout-s", "0.5")
    assert proc.returncode == 1 and "within 0.5s" in proc.stderr
    assert time.monotonic() - t0 < 20


def test_endpoint_policy():
    for ok in ("ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"):
        assert check_endpoint(ok) == ok
    for bad in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "udp://127.0.0.1:1", "inproc://x"):
        with pytest.raises(ValueError, match="refused"):
            check_endpoint(bad)


def test_large_write_throughput_then_sigterm_unlinks_everything(committer_factory):
    """The largest write: 8192 rows x 4 KiB in runs of one block, against a plain copy_ of the same bytes."""
    handle = committer_factory("--prefault")
    layout = protocol.Layout(num_blocks=512, block_size=16)
    n, width = 512 * 16, 1024
    writer = Writer(handle.endpoint, handle.name, layout, n)
    view = writer.open_key("hidden", "float32", width)
    writer.open_key("mm", "bfloat16", 64)
    staged = fill_staging(writer, "hidden", 1)
    blocks = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    slots = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1).tolist()
    cv = writer.new_cv(1)
    view.claim[torch.tensor(slots)] = cv
    nbytes = n * width * 4
    assert writer.step_write(1, [("hidden", 1, cv, 0, slots)], claim=False).rows_written == n  # faults pages in
    warm = writer.raw.status()
    times = []
    for step in range(2, 7):
        cv = writer.new_cv(step)  # each step claims anew: a row committed under a version is never rewritten
        view.claim[torch.tensor(slots)] = cv
        t0 = time.perf_counter()
        done = writer.step_write(step, [("hidden", step, cv, 0, slots)], claim=False)
        times.append(time.perf_counter() - t0)
        assert done.rows_written == n, done
    expect = torch.empty_like(staged)
    expect[torch.tensor(slots)] = staged
    assert torch.equal(bits(view.pool), bits(expect)) and bool((view.commit == cv).all())
    src, dst = torch.randn(n, width), torch.zeros(n, width)
    copies = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the committer (LIMITS.md): one thread against one thread
    try:
        dst.copy_(src)  # fault dst in, as the warm-up step did for the pool
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    status = writer.raw.status()
    assert status["prefault_seconds"] > 0
    inside = (status["apply_seconds"] - warm["apply_seconds"]) / (status["steps_applied"] - warm["steps_applied"])
    print(f"\n[omnishm] committer wrote {nbytes / 2**20:.0f} MiB in runs of 16 rows: "
          f"{nbytes / np.median(times) / 1e9:.2f} GB/s round trip, {nbytes / inside / 1e9:.2f} GB/s inside "
          f"apply_step; plain torch copy_ of the same bytes here: {nbytes / np.median(copies) / 1e9:.2f} GB/s")

    reader = handle.client()
    welcome = reader.hello(protocol.ROLE_READER)
    assert isinstance(welcome, protocol.Welcome) and welcome.layout.num_blocks == 512
    pool_copy = shm.Segment.attach(welcome.keys[0].pool, readonly=True).tensor(torch.float32, (n, width))
    assert len(shm.list_segments(handle.name)) == 2 + 2 * 3 + 2  # owner, ctl, 2 x (pool, claim, commit), 2 staging
    rc = handle.stop(signal.SIGTERM)
    assert rc == 0, handle.log()
    assert shm.list_segments(handle.name) == []
    assert not (RUNTIME_DIR / f"{handle.name}.sock").exists() and not (RUNTIME_DIR / f"{handle.name}.lock").exists()
    assert torch.equal(bits(pool_copy[:4]), bits(expect[:4]))  # mappings outlive the unlink (trap 11)
    # The stop line counts every segment it removed, the owner segment included (review, 2026-12-06: it was
    # left out, so a committer with 2 clients attached and 10 segments said "9 segment(s) unlinked").
    assert "stopped (SIGTERM) with 2 client(s) attached, which lose the cache: 10 segment(s) unlinked" in handle.log()
    reader.close()
    writer.raw.close()


def _kill_with_segments(committer_factory):
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    writer.open_key("k", "float32", 4)
    segs = shm.list_segments(handle.name)
    assert len(segs) == 6  # owner, ctl, pool, claim, commit, staging
    handle.stop(signal.SIGKILL)
    writer.raw.close()
    assert shm.list_segments(handle.name) == segs  # SIGKILL leaves them (trap 1)
    return handle, segs


def test_sigkilled_committer_segments_removed_by_next_start(committer_factory):
    handle, segs = _kill_with_segments(committer_factory)
    again = committer_factory(name=handle.name)
    assert not set(segs) & set(shm.list_segments(handle.name))
    assert "removed 6 segment(s) of a previous committer" in again.log()


def test_sigkilled_committer_segments_removed_by_cleanup(committer_factory):
    handle, segs = _kill_with_segments(committer_factory)
    proc = run_cli("cleanup", "--name", handle.name)
    assert proc.returncode == 0, proc.stderr
    for seg in segs:
        assert f"removed {seg}" in proc.stdout
    assert shm.list_segments(handle.name) == []
    assert not (RUNTIME_DIR / f"{handle.name}.lock").exists() and not (RUNTIME_DIR / f"{handle.name}.sock").exists()


def test_silent_client_is_reaped_and_idle_committer_exits(committer_factory):
    handle = committer_factory("--exit-when-idle", "--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    writer.open_key("k", "float16", 4)
    reader = handle.client()
    assert isinstance(reader.hello(protocol.ROLE_READER), protocol.Welcome)
    assert any(".stage." in s for s in shm.list_segments(handle.name))
    # The writer goes silent and is reaped; the reader keeps heartbeating and stays.
    deadline = time.monotonic() + 10
    while True:
        ack = reader.call(protocol.Heartbeat(rid=reader.next_rid()), timeout_s=2)
        assert isinstance(ack, protocol.HeartbeatAck) and ack.readers == 1, ack
        if not ack.writer:
            break
        assert time.monotonic() < deadline, "silent writer was not reaped"
        reader.sock.poll(100)  # heartbeat pacing (nothing arrives on this socket meanwhile)
    assert not any(".stage." in s for s in shm.list_segments(handle.name))
    status = reader.status()
    assert status["clients_reaped"] == 1 and [c["role"] for c in status["clients"]] == ["reader"]
    assert handle.proc.poll() is None  # a reader is still attached
    assert isinstance(reader.goodbye(), protocol.Bye)  # the last client leaves: the committer exits 0
    assert handle.proc.wait(15) == 0, handle.log()
    assert "reaped after" in handle.log() and "stopped (idle)" in handle.log()
    assert shm.list_segments(handle.name) == []
    reader.close()
    writer.raw.close()


def test_committer_refuses_non_loopback_tcp_via_cli_and_script():
    name = unique_cache_name("tcp")
    proc = subprocess.run([sys.executable, "-m", "omnishm", "committer", "--name", name,
                           "--endpoint", "tcp://0.0.0.0:5555"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "only on loopback" in proc.stderr
    script = Path(__file__).resolve().parents[1] / "scripts" / "launch_committer.sh"
    proc = subprocess.run(["bash", str(script), "--name", name, "--endpoint", "tcp://10.1.2.3:5555"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2 and "'10.1.2.3'" in proc.stderr


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_stalled_committer_loop_is_logged_and_counted(committer_factory, busy):
    """A committer frozen (SIGSTOP here; starved of CPU in the vLLM tier) for longer than two heartbeat periods
    says so on waking, in its log and in its status: its clients then saw it silent, and whether a client's
    resume came from the committer's stall or its own (which its link logs) is told apart by these lines.

    Busy: a second client keeps it answering, so the stop mostly lands while it handles a batch, not in its
    poll; the first status after the stall still counts it (it once answered 0 there and lost the stall)."""
    handle = committer_factory("--heartbeat-s", "0.2", "--heartbeat-timeout-s", "30")
    client = RawClient(handle.endpoint, handle.name)
    other = RawClient(handle.endpoint, handle.name)
    done = threading.Event()
    answered: list[int] = []

    def keep_busy() -> None:
        while not done.is_set():
            answered.append(other.status()["loop_stalls"])

    thread = threading.Thread(target=keep_busy, daemon=True)
    try:
        assert isinstance(client.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        assert isinstance(other.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        assert client.status()["loop_stalls"] == 0
        if busy:
            thread.start()
            deadline = time.monotonic() + 30
            while len(answered) < 50:  # it answers the other client in a loop before the stop
                assert thread.is_alive() and time.monotonic() < deadline, answered
                time.sleep(0.01)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < 2.0:  # the stall: over max(1 s, 2 heartbeats)
                time.sleep(0.05)
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        assert client.status()["loop_stalls"] >= 1
        assert "its loop answered nothing for" in handle.log(), handle.log()
    finally:
        done.set()
        if thread.is_alive():
            thread.join(timeout=30)
        client.close()
        other.close()


@pytest.mark.parametrize("beating", [False, True], ids=["silent", "beating"])
def test_a_committer_that_stood_still_reaps_no_client_for_its_own_silence(committer_factory, beating):
    """REVIEW (2026-12-05): a committer frozen for longer than its heartbeat timeout (a starved host, a VM
    pause) reaped its writer on waking, before the heartbeats sent meanwhile were readable (in a frozen
    process libzmq's own thread stands still too): staging unlinked, the writer's resume refused, its link
    dead. The time its loop stood still is not its clients' silence. Silent: a whole host paused, the
    client beats again only after; beating: the client kept beating on its socket throughout."""
    handle = committer_factory("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1")
    writer = RawClient(handle.endpoint, handle.name)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(0.05):
            writer.send(protocol.Heartbeat(rid=writer.next_rid(), counters={}))

    thread = threading.Thread(target=beat, daemon=True)
    try:
        assert isinstance(writer.hello(protocol.ROLE_WRITER, LAYOUT, 4), protocol.Welcome)
        assert isinstance(writer.call(protocol.Heartbeat(rid=writer.next_rid(), counters={})),
                          protocol.HeartbeatAck)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            if beating:
                thread.start()
            stopped = time.monotonic()
            while time.monotonic() - stopped < 2.5:  # the stall: over the heartbeat timeout (1 s)
                time.sleep(0.05)
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        if not beating:
            time.sleep(0.3)  # the paused host's client beats again a little after the committer woke
        done.set()
        if thread.is_alive():
            thread.join(timeout=30)
        while writer.sock.poll(500, zmq.POLLIN):  # the answers to the beats sent meanwhile
            writer.sock.recv()
        reply = writer.call(protocol.Heartbeat(rid=writer.next_rid(), counters={}))
        assert isinstance(reply, protocol.HeartbeatAck), reply
        status = writer.status()
        assert status["clients_reaped"] == 0 and status["loop_stalls"] >= 1, status
        assert "detached" not in handle.log(), handle.log()
    finally:
        done.set()
        if thread.is_alive():
            thread.join(timeout=30)
        writer.close()


def test_a_second_writer_of_the_seated_writers_own_process_is_told_so(committer):
    """NEWCOMER (2026-12-06): a manager made again after a sticky error, before the old one was shut down, was
    refused with a pid alone. The refusal says the writer is the same process only when both Hellos name
    that process with the start time the committer's ``/proc`` shows."""
    me = {"pid": os.getpid(), "started": liveness.proc_identity(os.getpid())}
    first, other, again = (RawClient(committer.endpoint, committer.name) for _ in range(3))
    try:
        assert isinstance(first.hello(protocol.ROLE_WRITER, LAYOUT, 4, **me), protocol.Welcome)
        stranger = other.hello(protocol.ROLE_WRITER, LAYOUT, 4, pid=committer.proc.pid,
                               started=liveness.proc_identity(committer.proc.pid))
        assert isinstance(stranger, protocol.Refused) and "already has a writer" in stranger.reason, stranger
        assert "same process" not in stranger.reason and stranger.retry_after_s == 0, stranger
        own = again.hello(protocol.ROLE_WRITER, LAYOUT, 4, **me)
        assert isinstance(own, protocol.Refused) and own.retry_after_s == 0, own
        assert own.reason.endswith(f"pid {os.getpid()}; that writer is this same process: shut its manager down "
                                   f"(shutdown()) before making another)"), own.reason
        assert isinstance(first.goodbye(), protocol.Bye)
    finally:
        for c in (first, other, again):
            c.close()


def test_a_killed_writer_credited_by_a_stall_still_lets_its_replacement_retry(committer_factory):
    """REVIEW (2026-12-05): a stall's credit moved a killed engine's writer's silence later, so the restarted
    engine's writer, refused as a second writer, was told no retry (silence under two heartbeats: a live
    writer) and failed at once. Whether a writer is likely dead goes by its last message now; the wait, by
    the credited clock. The new writer is told to retry, and is welcomed once the dead one is reaped."""
    handle = committer_factory("--heartbeat-s", "0.2", "--heartbeat-timeout-s", "3")
    dead, new = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    try:
        assert isinstance(dead.hello(protocol.ROLE_WRITER, LAYOUT, 4), protocol.Welcome)
        dead.close()  # the engine is killed: its writer never says another word
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            wait_stopped(handle.proc.pid)
            stopped = time.monotonic()
            while time.monotonic() - stopped < 1.5:  # the stall: longer than two heartbeats
                time.sleep(0.05)
            new.send(protocol.Hello(rid=new.next_rid(), protocol=protocol.PROTOCOL_VERSION,
                                    client_id=new.client_id, pid=os.getpid(), uid=os.geteuid(),
                                    role=protocol.ROLE_WRITER, cache=handle.name, layout=LAYOUT, staging_rows=4))
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        refused = new.recv()
        assert isinstance(refused, protocol.Refused) and "already has a writer" in refused.reason, refused
        assert 0.5 < refused.retry_after_s <= 3, refused  # the dead writer is reaped 3 s after the stall ended
        deadline = time.monotonic() + 30
        while True:  # the client's retries
            reply = new.hello(protocol.ROLE_WRITER, LAYOUT, 4)
            if isinstance(reply, protocol.Welcome):
                break
            assert isinstance(reply, protocol.Refused) and reply.retry_after_s > 0, reply
            assert time.monotonic() < deadline, reply
            time.sleep(min(reply.retry_after_s, 0.5))  # as the link's retry waits
        assert isinstance(new.goodbye(), protocol.Bye)
    finally:
        new.close()


_WRITER_CHILD = """
import os, sys, time, zmq
from omnishm import protocol
from omnishm.liveness import proc_identity
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(protocol.encode(protocol.Hello(
    rid=1, protocol=protocol.PROTOCOL_VERSION, client_id="k" * 32, pid=os.getpid(), uid=os.geteuid(),
    role=protocol.ROLE_WRITER, cache=sys.argv[2], layout=protocol.Layout(num_blocks=16, block_size=4),
    staging_rows=4, started=proc_identity(os.getpid()))))
print(type(protocol.reply_decoder.decode(sock.recv())).__name__, flush=True)
time.sleep(600)
"""


def test_a_writer_whose_process_is_gone_lets_its_replacement_retry_at_once(committer_factory):
    """REVIEW (2026-12-06, a newcomer's walkthrough): an engine restarted right after its writer was killed
    said Hello within two heartbeats of the dead writer's last message, was refused as a second writer
    with no retry (silence that short is a live writer's), and failed at once, though the README says an
    engine restarted at once attaches. The committer now also asks whether the writer's process is gone
    (the pid it said Hello from, with that process's start time): then the refusal is retryable, says
    so, and the new writer is welcomed once the dead one is reaped."""
    handle = committer_factory("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "2")
    child = subprocess.Popen([sys.executable, "-c", _WRITER_CHILD, handle.endpoint, handle.name],
                             stdout=subprocess.PIPE, text=True)
    new = RawClient(handle.endpoint, handle.name)
    try:
        assert child.stdout.readline().strip() == "Welcome"
        child.kill()
        child.wait()
        killed = time.monotonic()
        refused = new.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(refused, protocol.Refused) and "its process is gone" in refused.reason, refused
        assert 0 < refused.retry_after_s <= 2, refused
        while True:  # the client's retries
            reply = new.hello(protocol.ROLE_WRITER, LAYOUT, 4)
            if isinstance(reply, protocol.Welcome):
                break
            assert isinstance(reply, protocol.Refused) and reply.retry_after_s > 0, reply
            assert time.monotonic() - killed < 15, reply
            time.sleep(min(reply.retry_after_s, 0.5))
        assert isinstance(new.goodbye(), protocol.Bye)
        # A live writer in the way is still refused at once: two engines given one name.
        other = RawClient(handle.endpoint, handle.name)
        try:
            assert isinstance(other.hello(protocol.ROLE_WRITER, LAYOUT, 4), protocol.Welcome)
            second = new.hello(protocol.ROLE_WRITER, LAYOUT, 4)
            assert isinstance(second, protocol.Refused) and second.retry_after_s == 0, second
            other.goodbye()
        finally:
            other.close()
    finally:
        child.kill()
        child.wait()
        new.close()


def test_a_live_writer_whose_hello_named_another_process_is_never_taken_for_gone(committer_factory):
    """REVIEW (2026-12-06): a client in another pid namespace names a pid of its own, which may be an
    unrelated process in the committer's. Once that process exited, a live, heartbeating writer was taken
    for gone, and a second writer (two engines given one name) was told, at every retry, that its seat
    frees in a few seconds. The committer now trusts a Hello's pid only when its ``/proc`` shows that pid
    with the start time the client gave (``Hello.started``)."""
    from omnishm.liveness import proc_identity

    handle = committer_factory("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "2")
    other = subprocess.Popen(["sleep", "60"])  # the unrelated process the foreign pid names here
    live, second = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    try:
        # Its own start time, as its own /proc shows it, beside a pid that names another process here.
        welcome = live.hello(protocol.ROLE_WRITER, LAYOUT, 4, pid=other.pid, started=proc_identity(os.getpid()))
        assert isinstance(welcome, protocol.Welcome), welcome
        other.kill()
        other.wait()
        assert isinstance(live.call(protocol.Heartbeat(rid=live.next_rid())), protocol.HeartbeatAck)
        refused = second.hello(protocol.ROLE_WRITER, LAYOUT, 4)
        assert isinstance(refused, protocol.Refused) and refused.retry_after_s == 0, refused
        assert "gone" not in refused.reason, refused
        assert isinstance(live.goodbye(), protocol.Bye)
    finally:
        other.kill()
        other.wait()
        live.close()
        second.close()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_committer_goes_on(committer_factory):
    """``kill -USR1`` is how an operator sees where a committer that stalls stands: its threads' stacks land in
    its log (the loop's poll among them), and it keeps serving, then stops cleanly."""
    handle = committer_factory()
    client = RawClient(handle.endpoint, handle.name)
    try:
        assert isinstance(client.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        assert catches_signal(handle.proc.pid, signal.SIGUSR1)
        os.kill(handle.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "most recent call first" not in handle.log():
            assert time.monotonic() < deadline, handle.log()
            time.sleep(0.02)
        assert client.status()["steps_applied"] == 0  # still answering
        assert "server.py" in handle.log() and "in run" in handle.log(), handle.log()
    finally:
        client.close()


def test_a_writers_resume_naming_another_epoch_is_refused(committer):
    """MUTATION REVIEW (2026-12-06): refusing only a resume of a later epoch than the writer's (``>``, not
    ``!=``) survived the suite: a resume naming an older epoch was welcomed, and every step after it failed
    validation, far from the cause. Either way the resume is refused, naming the epoch."""
    writer = Writer(committer.endpoint, committer.name, LAYOUT, 32)
    other = RawClient(committer.endpoint, committer.name)
    other.client_id = writer.raw.client_id
    try:
        for bad in (writer.epoch - 1, writer.epoch + 1):
            reply = other.hello(protocol.ROLE_WRITER, LAYOUT, 32, resume=True,
                                resume_generation=writer.welcome.generation, resume_epoch=bad)
            assert isinstance(reply, protocol.Refused) and f"epoch {bad} != {writer.epoch}" in reply.reason, reply
    finally:
        other.close()
        writer.goodbye()


def test_a_live_writers_session_is_not_taken_by_another_processs_resume(committer):
    """REVIEW (2026-12-06): a resume naming a live writer's client id, generation and epoch (all of which
    `omnishm status` prints) and no staging was welcomed from any socket: the session and its staging moved
    there, and the writer's next call got ``no_session``. A resume from another live process than the one
    the session said Hello from is refused now, naming both pids; the writer goes on."""
    writer = RawClient(committer.endpoint, committer.name)
    other = RawClient(committer.endpoint, committer.name)
    other.client_id = writer.client_id
    bystander = subprocess.Popen(["sleep", "60"])  # a live process that is not the writer's
    try:
        welcome = writer.hello(protocol.ROLE_WRITER, LAYOUT, 32, started=liveness.proc_identity(os.getpid()))
        assert isinstance(welcome, protocol.Welcome), welcome
        reply = other.hello(protocol.ROLE_WRITER, LAYOUT, 32, resume=True, resume_generation=welcome.generation,
                            resume_epoch=welcome.epoch, resume_staging=[], pid=bystander.pid,
                            started=liveness.proc_identity(bystander.pid))
        assert isinstance(reply, protocol.Refused), reply
        assert f"belongs to process {os.getpid()}, which is alive" in reply.reason, reply.reason
        assert f"from pid {bystander.pid}" in reply.reason, reply.reason
        assert isinstance(writer.call(protocol.Heartbeat(rid=writer.next_rid())), protocol.HeartbeatAck)
        assert isinstance(writer.goodbye(), protocol.Bye)
    finally:
        bystander.kill()
        bystander.wait()
        other.close()
        writer.close()


@pytest.mark.parametrize("role", [protocol.ROLE_READER, protocol.ROLE_ADMIN])
def test_a_resume_of_another_generation_is_refused_by_a_committer_that_adopted_nothing(committer, role):
    """MUTATION REVIEW (2026-12-06): checking a resume's generation only on a committer that adopted a cache
    survived the suite (``test_faults`` resumes a writer on an adopting one). A reader of a gone generation
    resumed on a fresh committer would keep its maps of that generation's unlinked segments, rows no
    writer keeps any more. Refused, naming both generations; the live generation's resume is welcomed."""
    raw = RawClient(committer.endpoint, committer.name)
    generation = committer.status()["generation"]
    try:
        for gen, welcomed in (("deadbeef", False), (generation, True)):
            reply = raw.hello(role, resume=True, resume_generation=gen)
            if welcomed:
                assert isinstance(reply, protocol.Welcome) and reply.resumed, reply
            else:
                assert isinstance(reply, protocol.Refused) and "did not adopt" in reply.reason, reply
                assert f"holds generation {generation}" in reply.reason, reply
        assert isinstance(raw.goodbye(), protocol.Bye)
    finally:
        raw.close()
