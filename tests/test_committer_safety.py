"""One client's bad input, or a refused restart, must not damage another client's cache.

Each test starts real committers and speaks the wire protocol by hand
(``helpers.RawClient``, ``helpers.Writer``): an admin reusing the writer's
client_id, key names too long for the metadata, a writer without staging rows,
a restart that refuses to start after adopting a live cache, a restart that
finds a generation it cannot adopt, a committer or ``omnishm cleanup`` looking
from another runtime dir at a live cache, and a socket that keeps saying Hello.
Autostart and stop signals have their own files (``test_autostart_lifecycle.py``,
``test_committer_signals.py``).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import types
import uuid

import msgspec
import posix_ipc
import pytest
import torch

from omnishm import liveness, orphans, paths, protocol, shm
from omnishm.committer import meta
from omnishm.committer.pool import MAX_KEY_NAME, MAX_KEYS, MAX_STAGING_ROWS, CachePool

from conftest import unique_cache_name
from helpers import RawClient, Writer, pack, unpack

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
FAST = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "5.0")
SLOW = ("--heartbeat-s", "0.5", "--heartbeat-timeout-s", "60")


def _hello(raw: RawClient, role: str, client_id: str, layout: protocol.Layout | None = None,
           staging_rows: int = 0) -> object:
    return raw.call(protocol.Hello(rid=raw.next_rid(), protocol=protocol.PROTOCOL_VERSION, client_id=client_id,
                                   pid=os.getpid(), uid=os.geteuid(), role=role, cache=raw.cache, layout=layout,
                                   staging_rows=staging_rows))


def _hold_attached(control: str) -> int:
    """A shared flock on the control segment: a client is attached, so a restart must adopt, not sweep."""
    seg = posix_ipc.SharedMemory(control, 0)
    fcntl.flock(seg.fd, fcntl.LOCK_SH)
    return seg.fd


def test_admin_cannot_take_the_writers_client_id(committer_factory):
    """An admin Hello with the writer's client_id is refused, and an admin leaving never touches staging."""
    handle = committer_factory(*FAST)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    view = writer.open_key("k", "float32", 4)
    admin = RawClient(handle.endpoint, handle.name)
    try:
        reply = _hello(admin, protocol.ROLE_ADMIN, writer.raw.client_id)
        assert isinstance(reply, protocol.Refused) and "already attached" in reply.reason, reply
        assert isinstance(_hello(admin, protocol.ROLE_ADMIN, admin.client_id), protocol.Welcome)
        assert isinstance(admin.goodbye(), protocol.Bye)
        assert view.segments.staging in shm.list_segments(handle.name)
        view.staging[0:2] = torch.arange(8, dtype=torch.float32).view(2, 4)
        done = writer.step_write(1, [("k", 1, writer.new_cv(1), 0, [0, 1])])
        assert isinstance(done, protocol.StepDone) and unpack(done.done_tids) == [1] and not done.failed_tids, done
        assert torch.equal(view.pool[0:2], torch.arange(8, dtype=torch.float32).view(2, 4))
    finally:
        admin.close()
        writer.goodbye()


def test_an_admin_session_cannot_open_a_key(committer_factory):
    """MUTATION (stop 60, S13): the refusal survived the suite. An admin session (``omnishm status``, a probe)
    has no staging and chooses no spec: its OpenKey is refused (``bad_role``, counted) and opens nothing, so
    the writer opens the key afterwards with the spec it chooses. Without the refusal the admin fixed the key
    as float16 of width 2, and the writer's float32 rows of width 4 were refused."""
    handle = committer_factory(*FAST)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)  # the layout is set: only the role refuses
    admin = RawClient(handle.endpoint, handle.name)
    try:
        assert isinstance(_hello(admin, protocol.ROLE_ADMIN, admin.client_id), protocol.Welcome)
        before = sorted(shm.list_segments(handle.name))
        reply = admin.call(protocol.OpenKey(rid=admin.next_rid(), key="k", dtype="float16", width=2))
        assert isinstance(reply, protocol.Error) and reply.code == "bad_role", reply
        status = admin.call(protocol.StatusRequest(rid=admin.next_rid())).status
        assert status["rejected"].get("open_key_admin") == 1 and "k" not in status["keys"], status
        assert sorted(shm.list_segments(handle.name)) == before
        view = writer.open_key("k", "float32", 4)
        assert view.pool.dtype == torch.float32 and view.pool.shape[1] == 4
        assert isinstance(admin.goodbye(), protocol.Bye)
    finally:
        admin.close()
        writer.goodbye()


def test_a_hello_refused_as_a_duplicate_leaves_the_cache_as_it_was(committer_factory):
    """The duplicate-client refusal comes before anything that changes the pool: a Hello with an attached
    client's id, and a layout the cache has not taken yet (only an admin is attached), does not fix it."""
    handle = committer_factory(*FAST)
    admin, duplicate, reader = (RawClient(handle.endpoint, handle.name) for _ in range(3))
    try:
        assert isinstance(_hello(admin, protocol.ROLE_ADMIN, admin.client_id), protocol.Welcome)
        reply = _hello(duplicate, protocol.ROLE_READER, admin.client_id, protocol.Layout(num_blocks=16, block_size=4))
        assert isinstance(reply, protocol.Refused) and "already attached" in reply.reason, reply
        welcome = _hello(reader, protocol.ROLE_READER, reader.client_id, LAYOUT)
        assert isinstance(welcome, protocol.Welcome), welcome
        assert welcome.layout.num_blocks == LAYOUT.num_blocks
        assert isinstance(reader.goodbye(), protocol.Bye)
        assert isinstance(admin.goodbye(), protocol.Bye)
    finally:
        for raw in (admin, duplicate, reader):
            raw.close()


def test_a_client_id_is_1_to_64_name_characters_and_nothing_after_them(committer_factory):
    """A Hello's ``client_id`` is 1-64 letters, digits, '_' or '-' (it is logged, shown by ``omnishm status`` and
    kept in the session table). One ending in a newline is refused like any other bad id: a pattern ending in
    ``$`` used with ``match`` took ``"abc\\n"`` (``$`` matches before a final newline; mutation review, stop 47).
    64 characters are welcomed, 65 refused, and the committer serves on."""
    handle = committer_factory(*SLOW)
    raw = RawClient(handle.endpoint, handle.name)
    try:
        for bad in ("abc\n", "k" * 64 + "\n", "k" * 65, ""):
            reply = _hello(raw, protocol.ROLE_READER, bad, LAYOUT)
            assert isinstance(reply, protocol.Refused) and "must be 1-64 letters" in reply.reason, (bad, reply)
        assert isinstance(_hello(raw, protocol.ROLE_READER, "k" * 64, LAYOUT), protocol.Welcome)
        assert [c["client_id"] for c in raw.status()["clients"]] == ["k" * 64]
    finally:
        raw.close()


def test_key_names_are_bounded_so_the_metadata_always_fits(committer_factory):
    """A key name past MAX_KEY_NAME, or more than MAX_KEYS names, is refused with the reason."""
    handle = committer_factory(*SLOW)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    reader = RawClient(handle.endpoint, handle.name)
    try:
        big = protocol.Layout(8, 4, {"x" * 70_000: protocol.KeySpec("float32", 4)})
        reply = _hello(reader, protocol.ROLE_READER, reader.client_id, big)
        assert isinstance(reply, protocol.Refused) and f"1..{MAX_KEY_NAME} characters" in reply.reason, reply
        # Counted as the metadata writes them: MAX_KEYS names of 190 "é" took 73 KiB of JSON, past its slot.
        wide = protocol.Layout(8, 4, {"é" * (MAX_KEY_NAME - 10): protocol.KeySpec("float32", 4)})
        reply = _hello(reader, protocol.ROLE_READER, reader.client_id, wide)
        assert isinstance(reply, protocol.Refused) and "bytes as JSON" in reply.reason, reply
        many = protocol.Layout(8, 4, {f"key{i}": protocol.KeySpec("float32", 4) for i in range(MAX_KEYS + 1)})
        reply = _hello(reader, protocol.ROLE_READER, reader.client_id, many)
        assert isinstance(reply, protocol.Refused) and f"limit of {MAX_KEYS}" in reply.reason, reply
        opened = writer.raw.call(protocol.OpenKey(rid=writer.raw.next_rid(), key="y" * (MAX_KEY_NAME + 1),
                                                  dtype="float32", width=4))
        assert isinstance(opened, protocol.Error) and opened.code == "bad_key", opened
        # The cache is unharmed: a normal key still opens and its metadata still saves.
        writer.open_key("k", "float32", 4)
        assert "does not fit" not in handle.log()
    finally:
        reader.close()
        writer.goodbye()


def test_an_epoch_the_metadata_cannot_record_is_never_handed_out(tmp_path, monkeypatch):
    """set_writer_epoch saves before it publishes; a failed save publishes nothing and says so."""
    name = unique_cache_name("safe")
    pool = CachePool(name, uuid.uuid4().hex[:8])
    try:
        pool.set_layout(LAYOUT)
        assert pool.set_writer_epoch(1, "w1")
        assert int(pool.ctl[protocol.CTL_WRITER_EPOCH]) == 1

        def fail(*_args, **_kw):
            raise meta.MetaError("metadata does not fit")

        monkeypatch.setattr(meta, "write", fail)
        assert not pool.set_writer_epoch(2, "w2")
        assert int(pool.ctl[protocol.CTL_WRITER_EPOCH]) == 1
        assert pool.max_epoch == 1 and "w2" not in pool.writers
    finally:
        pool.close()
    assert shm.list_segments(name) == []


def test_a_writer_needs_staging_rows(committer_factory):
    """staging_rows=0 for a writer, or more than MAX_STAGING_ROWS for anyone, is refused at Hello (before
    the cache has a key whose staging would check it); nothing is created, nothing leaks."""
    handle = committer_factory(*SLOW)
    raw = RawClient(handle.endpoint, handle.name)
    try:
        reply = _hello(raw, protocol.ROLE_WRITER, raw.client_id, LAYOUT, staging_rows=0)
        assert isinstance(reply, protocol.Refused) and "staging_rows must be >= 1" in reply.reason, reply
        reply = _hello(raw, protocol.ROLE_WRITER, raw.client_id, LAYOUT, staging_rows=MAX_STAGING_ROWS + 1)
        assert isinstance(reply, protocol.Refused), reply
        assert f"staging_rows must be in 0..{MAX_STAGING_ROWS}, got {MAX_STAGING_ROWS + 1}" in reply.reason, reply
    finally:
        raw.close()
    handle.stop(signal.SIGTERM)
    assert shm.list_segments(handle.name) == []


def test_a_refused_restart_leaves_the_adopted_cache_for_the_next_one(committer_factory):
    """A restart that adopts a live cache and then cannot serve (metrics port taken) exits 2 and unlinks
    nothing; the next restart adopts the same generation and the writer resumes its staging."""
    first = committer_factory(*SLOW)
    name = first.name
    writer = Writer(first.endpoint, name, LAYOUT, 8)
    writer.open_key("k", "float32", 4)
    fd = _hold_attached(writer.welcome.control)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        first.stop(signal.SIGKILL)
        before = sorted(shm.list_segments(name))
        failed = committer_factory(*SLOW, "--metrics-port", str(busy.getsockname()[1]), name=name, wait=False)
        assert failed.proc.wait(60) == 2
        assert sorted(shm.list_segments(name)) == before, failed.log()
        assert "left for the next committer to adopt" in failed.log()
        second = committer_factory(*SLOW, name=name)
        assert f"adopted live generation {writer.welcome.generation}" in second.log()
        assert sorted(shm.list_segments(name)) == before
    finally:
        busy.close()
        os.close(fd)
        writer.raw.close()


def test_a_generation_that_fails_to_adopt_in_any_way_is_logged_and_left_to_the_sweep(monkeypatch, caplog):
    """adopt_live_cache never lets an adoption error stop the committer from starting."""
    from omnishm.committer import pool as pool_mod
    from omnishm.committer import start

    from conftest import RUNTIME_DIR

    def broken(cls, name, generation, *, prefault=False):
        raise RuntimeError("cannot reshape tensor of 0 elements")

    monkeypatch.setattr(start.meta, "live_generations", lambda name: ["0badc0de"])
    monkeypatch.setattr(pool_mod.CachePool, "adopt", classmethod(broken))
    name = unique_cache_name("safe")
    try:
        with caplog.at_level("ERROR", logger="omnishm.committer.start"):
            cfg = types.SimpleNamespace(name=name, prefault=False, runtime_dir=RUNTIME_DIR)
            assert start.adopt_live_cache(cfg) == (None, None)
        assert "0badc0de" in caplog.text and "cannot be adopted" in caplog.text and "0 elements" in caplog.text
        assert not liveness.generation_owned(name, "0badc0de")  # the owner lock was let go for the sweep
    finally:
        for seg in shm.list_segments(name):
            shm.unlink_segment(seg)


def test_a_committer_of_the_same_name_in_another_runtime_dir_leaves_a_live_cache_alone(committer_factory,
                                                                                       tmp_path):
    """Segment names are host-wide, lock files per runtime dir: a second committer of the same name started
    with another runtime dir (another XDG_RUNTIME_DIR, another config) neither adopts nor sweeps a generation
    a live committer owns, and stopping it leaves that generation alone."""
    a = committer_factory(*SLOW)
    writer = Writer(a.endpoint, a.name, LAYOUT, 8)
    view = writer.open_key("k", "float32", 4)
    fd = _hold_attached(writer.welcome.control)  # a client attached: what made a restart adopt
    before = set(shm.list_segments(a.name))
    log = tmp_path / "second.log"
    with open(log, "wb") as out:
        second = subprocess.Popen([sys.executable, "-m", "omnishm.committer", "--name", a.name, "--runtime-dir",
                                   str(tmp_path / "other-runtime"), *SLOW], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "started" not in log.read_text() and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "started" in text, text
        assert "adopted" not in text and "removed" not in text, text
        assert before <= set(shm.list_segments(a.name))
    finally:
        second.send_signal(signal.SIGTERM)
        rc = second.wait(60)
        os.close(fd)
    assert rc == 0, log.read_text()
    assert before <= set(shm.list_segments(a.name)), "stopping the second committer removed the live cache"
    view.staging[0:2] = torch.ones(2, 4)
    done = writer.step_write(1, [("k", 1, writer.new_cv(1), 0, [0, 1])])
    assert isinstance(done, protocol.StepDone) and not done.failed_tids, done
    writer.goodbye()


def test_cleanup_never_removes_a_live_committers_segments_whatever_runtime_dir_it_looks_in(committer_factory,
                                                                                          tmp_path):
    """`omnishm cleanup` pointed at the wrong runtime dir finds no lock file, but the live committer's owner
    lock still keeps its generation; with the right dir (here via OMNISHM_CONFIG) the lock file does."""
    handle = committer_factory(*SLOW)
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    writer.open_key("k", "float32", 4)
    before = set(shm.list_segments(handle.name))
    empty = tmp_path / "empty-runtime"
    empty.mkdir(mode=0o700)
    config = tmp_path / "omnishm.toml"
    config.write_text(f'runtime_dir = "{handle.runtime_dir}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNISHM_")}
    for extra_env, args in (({}, ["--runtime-dir", str(empty)]), ({"OMNISHM_CONFIG": str(config)}, [])):
        proc = subprocess.run([sys.executable, "-m", "omnishm", "cleanup", "--name", handle.name, *args],
                              capture_output=True, text=True, timeout=60, env={**env, **extra_env})
        assert proc.returncode == 0 and "0 orphaned object(s) removed" in proc.stdout, proc.stdout + proc.stderr
        assert set(shm.list_segments(handle.name)) == before
    assert (handle.runtime_dir / f"{handle.name}.lock").exists()
    writer.goodbye()


def test_a_socket_that_keeps_saying_hello_as_another_client_cannot_fill_the_log(committer_factory):
    """SOAK (2026-12-02): each Hello of a new client id on one socket ends the socket's session ("re-hello") and
    starts another, and both were logged at INFO without a limit: a client doing it in a loop filled the log
    (the fuzz test's 1,000,000 messages logged 4,849 lines). Each one is still served."""
    handle = committer_factory(*SLOW)
    raw = RawClient(handle.endpoint, handle.name)
    try:
        for _ in range(300):
            last = uuid.uuid4().hex
            assert isinstance(_hello(raw, protocol.ROLE_READER, last, LAYOUT), protocol.Welcome)
        status = raw.status()
        # One session, the socket's latest: every earlier one was detached.
        assert [(c["role"], c["client_id"]) for c in status["clients"]] == [("reader", last)], status["clients"]
        assert status["log_lines_suppressed"] >= 500, status["log_lines_suppressed"]
        log = handle.log()
        assert log.count("(re-hello)") <= 10 and log.count(" attached (pid") <= 12, log
    finally:
        raw.close()


def test_a_committer_never_takes_over_a_live_socket_at_an_explicit_endpoint(committer_factory, tmp_path):
    """The cache lock guards a cache's own socket only: a committer of another cache given the same explicit
    ipc endpoint unlinked the live socket and bound its own (trap 4), and clients of the first cache reached
    it (review). It is refused now (exit 2), and the first committer keeps serving there."""
    from conftest import wait_ready

    endpoint = f"ipc://{tmp_path}/shared.sock"
    first = committer_factory("--endpoint", endpoint, name=unique_cache_name("ep"), wait=False)
    first.endpoint = endpoint
    wait_ready(first)
    second = committer_factory("--endpoint", endpoint, name=unique_cache_name("ep"), wait=False)
    assert second.proc.wait(30) == 2
    assert "belongs to a running committer" in second.log() and f"pid {first.proc.pid}" in second.log()
    client = RawClient(endpoint, first.name)
    try:
        assert isinstance(client.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        assert isinstance(client.goodbye(), protocol.Bye)
    finally:
        client.close()


@pytest.mark.parametrize("what", ["file", "link"])
def test_a_committer_refuses_an_explicit_endpoint_that_names_a_file_and_leaves_the_file(committer_factory, tmp_path,
                                                                                      what):
    """MUTATION REVIEW (stop 51): a connect to a regular file is refused as one to a stale socket is, so a
    committer given ``--endpoint ipc://FILE`` took the user's file for its own dead socket, unlinked it and bound
    there. Whatever is at the path that is not a socket, a file or a link, is refused now (exit 2, "not a
    socket"), and left as it was; nothing of the committer's is left beside it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    path = notes if what == "file" else tmp_path / "link.sock"
    if what == "link":
        path.symlink_to(notes)
    handle = committer_factory("--endpoint", f"ipc://{path}", name=unique_cache_name("file"), wait=False)
    assert handle.proc.wait(30) == 2, handle.log()
    assert f"{path} is not a socket; refusing to replace it" in handle.log()
    assert notes.read_text() == "precious" and not notes.is_socket() and os.path.lexists(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"notes.txt", path.name})


def test_a_sweep_never_removes_a_file_that_is_not_a_socket_at_a_caches_socket_path(tmp_path):
    """MUTATION REVIEW (stop 51): the sweep judged a dead cache's socket by a connect alone, which a regular file
    refuses too: whatever else is at the socket's path is not a committer's to remove."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("notsock")
    sock = paths.socket_path(rt, cache)
    sock.write_text("not a socket")
    assert orphans.sweep(rt, cache) == []
    assert sock.read_text() == "not a socket" and sorted(p.name for p in rt.iterdir()) == [sock.name]


def test_a_committer_binds_an_explicit_endpoint_only_under_its_sockets_lock(committer_factory, tmp_path):
    """REVIEW (2026-12-05): checking an explicit endpoint's socket, unlinking it when stale and binding were
    not under one lock: two committers of different caches given one endpoint at the same instant both found
    it free or stale, and the second unlinked the first's new socket (2 of 12 rounds in an audit). Each holds
    ``<socket>.lock`` for its life now. Here the test holds it, as a committer between its check and its bind
    would: a start is refused although no socket is there yet, and takes nothing over once it is let go."""
    from conftest import assert_clean_stop, wait_ready

    path = tmp_path / "shared.sock"
    endpoint = f"ipc://{path}"
    held = liveness.CacheLock.at(liveness.socket_lock_path(path), "feedf00d")
    assert held is not None and liveness.socket_lock_path(path) == tmp_path / "shared.sock.lock"
    try:
        refused = committer_factory("--endpoint", endpoint, name=unique_cache_name("ep"), wait=False)
        assert refused.proc.wait(30) == 2
        assert "belongs to a running committer (generation feedf00d" in refused.log(), refused.log()
        assert not path.exists()
    finally:
        held.release(remove=True)
    handle = committer_factory("--endpoint", endpoint, name=unique_cache_name("ep"), wait=False)
    handle.endpoint = endpoint
    wait_ready(handle)
    assert liveness.CacheLock.holder(tmp_path / "shared.sock.lock")[1] == handle.proc.pid
    assert_clean_stop(handle)
    assert not path.exists() and not (tmp_path / "shared.sock.lock").exists()


def test_a_stopping_committer_removes_only_the_socket_it_bound(committer_factory, tmp_path):
    """REVIEW (2026-12-05): a committer's stop unlinked whatever file was at its ipc path. At an explicit
    endpoint another cache's committer may have bound its own socket there since (two starting at the same
    instant both pass the live check), and the first one's stop took the second's away. Here the path
    holds another listening socket by then: it is left alone."""
    import socket as pysocket

    from conftest import assert_clean_stop, wait_ready

    path = tmp_path / "shared.sock"
    first = committer_factory("--endpoint", f"ipc://{path}", name=unique_cache_name("ep"), wait=False)
    first.endpoint = f"ipc://{path}"
    wait_ready(first)
    path.unlink()
    other = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        other.bind(str(path))  # the socket of the committer that took the path since
        other.listen()
        assert_clean_stop(first)
        assert path.exists() and paths.socket_in_use(path)
    finally:
        other.close()
        path.unlink(missing_ok=True)


_RECORD_SOCKET_MODE = """
import os, sys
from omnishm.committer import server
chmod = os.chmod
def recording(path, mode, *a, **kw):  # the socket's mode as bound, before the committer's own chmod
    open(os.environ["OMNISHM_TEST_MODE_FILE"], "w").write(oct(os.stat(path).st_mode & 0o777))
    return chmod(path, mode, *a, **kw)
server.os.chmod = recording
os.umask(0o002)
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_explicit_endpoints_socket_is_private_from_the_moment_it_is_bound(committer_factory, tmp_path,
                                                                             monkeypatch):
    """Bound under the caller's umask (002 here) and only then made 0600, an explicit endpoint's socket in a
    shared sticky dir was connectable by the group in between (review)."""
    from conftest import wait_ready

    record = tmp_path / "mode"
    monkeypatch.setenv("OMNISHM_TEST_MODE_FILE", str(record))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    endpoint = f"ipc://{shared}/s.sock"
    handle = committer_factory("--endpoint", endpoint, name=unique_cache_name("mode"), wait=False,
                               python_args=("-c", _RECORD_SOCKET_MODE))
    handle.endpoint = endpoint
    wait_ready(handle)
    assert int(record.read_text(), 8) & 0o077 == 0, record.read_text()


def test_a_start_stopped_before_it_began_removes_a_killed_committers_stale_socket(committer_factory):
    """A SIGKILLed committer leaves its socket and lock file; the next start of the name, stopped before its
    loop, removed the lock file only, and sweeps go by lock files: the socket stayed (review)."""
    from conftest import RUNTIME_DIR
    from omnishm.committer import start
    from omnishm.committer.early_stop import EarlyStop

    handle = committer_factory()
    handle.proc.send_signal(signal.SIGKILL)
    handle.proc.wait()
    sock = RUNTIME_DIR / f"{handle.name}.sock"
    assert sock.exists() and (RUNTIME_DIR / f"{handle.name}.lock").exists()
    early = EarlyStop()
    early.reason = "SIGTERM"
    try:
        assert start.main(["--name", handle.name, "--runtime-dir", str(RUNTIME_DIR)], early) == 0
        assert not sock.exists() and not (RUNTIME_DIR / f"{handle.name}.lock").exists()
    finally:
        orphans.sweep(RUNTIME_DIR, handle.name)  # the killed committer's segments (main restored the handlers)


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_message_with_millions_of_tiny_items_is_refused_from_its_header(committer_factory):
    """REVIEW (2026-12-05, wire fuzz): a request's lists and maps had no bound on their items, and a frame is
    decoded in full before the session check: one 64 MiB StepWrite of 22 M two-byte key names took the
    committer from 40 MiB to 1.6 GiB and 2 s. Every list, tuple and map holds at most ``protocol.MAX_ITEMS``
    now, refused from its length header (here 3 M names, a 9 MiB frame, from a socket with no session)."""
    handle = committer_factory()
    raw = handle.client()
    try:
        before = _peak_rss_kib(handle.proc.pid)
        frame = msgspec.msgpack.encode({"type": "step_write", "rid": 7, "step": 1, "keys": ["hh"] * 3_000_000,
                                        "key_idx": b"", "tids": b"", "cvs": b"", "src_rows": b"", "counts": b"",
                                        "slots": b""})
        raw.send_raw(frame)
        reply = raw.recv()
        assert isinstance(reply, protocol.Error) and f"length <= {protocol.MAX_ITEMS}" in reply.message, reply
        assert _peak_rss_kib(handle.proc.pid) - before < 32 << 10  # without the bound: +230 MiB
        assert isinstance(raw.hello(protocol.ROLE_ADMIN), protocol.Welcome)  # still serving
        assert isinstance(raw.goodbye(), protocol.Bye)
    finally:
        raw.close()


def test_a_readers_hello_layout_fixes_no_key_the_writer_has_not_opened(committer_factory):
    """REVIEW (2026-12-05, wire fuzz): a reader's Hello layout was stored as the cache's key specs, for the life
    of the cache, though the writer opens keys: a reader (a misconfigured rank, a stray tool) declaring
    'feat' as int8[1], or 64 names, made the writer's later opens fail (layout_mismatch, too_many_keys). A
    reader's layout is only checked now; one that disagrees with a key the cache holds is still refused."""
    handle = committer_factory()
    reader, writer = handle.client(), Writer(handle.endpoint, handle.name, LAYOUT, 4)
    try:
        junk = {f"junk{i}": protocol.KeySpec("int8", 1) for i in range(MAX_KEYS - 1)}
        declared = reader.hello(protocol.ROLE_READER, protocol.Layout(8, 4, {"feat": protocol.KeySpec("int8", 1),
                                                                             **junk}))
        assert isinstance(declared, protocol.Welcome), declared
        assert isinstance(reader.goodbye(), protocol.Bye)
        opened = writer.raw.call(protocol.OpenKey(rid=writer.raw.next_rid(), key="feat", dtype="float32", width=3))
        assert isinstance(opened, protocol.KeyOpened) and opened.segments.dtype == "float32", opened
        more = writer.raw.call(protocol.OpenKey(rid=writer.raw.next_rid(), key="other", dtype="float32", width=3))
        assert isinstance(more, protocol.KeyOpened), more
        assert [k["name"] for k in writer.raw.status()["keys"]] == ["feat", "other"]
        late = handle.client()
        try:
            refused = late.hello(protocol.ROLE_READER, protocol.Layout(8, 4, {"feat": protocol.KeySpec("int8", 1)}))
            assert isinstance(refused, protocol.Refused) and "layout mismatch" in refused.reason, refused
        finally:
            late.close()
    finally:
        reader.close()
        writer.goodbye()


def test_an_adoption_names_a_control_segment_cut_short_and_a_torn_metadata_slot(caplog):
    """REVIEW (2026-12-05, restart): a control segment cut to one metadata slot was adopted from that slot,
    then failed in its save with "mmap slice assignment is wrong size" and a traceback; a torn newest slot
    was passed over without a word. The size is checked first, and a slot passed over is logged."""
    import logging

    name, generation = unique_cache_name("meta"), "feedf00d"
    short = meta.CTL_BYTES - meta.SLOT_BYTES
    seg = shm.Segment.create(shm.segment_name(name, generation, "ctl"), short)
    try:
        with pytest.raises(meta.MetaError, match=f"has {short} bytes, expected {meta.CTL_BYTES}"):
            CachePool.adopt(name, generation)
    finally:
        seg.unlink()
        seg.close()
    area = bytearray(meta.CTL_BYTES)
    meta.write(area, {"version": meta.META_VERSION, "keys": ["a"]}, 1)
    meta.write(area, {"version": meta.META_VERSION, "keys": ["a", "b"]}, 2)
    area[meta.META_OFFSET + 32] ^= 0xFF  # slot 0 (sequence 2), torn by a crash inside its write
    with caplog.at_level(logging.WARNING, logger="omnishm.committer.meta"):
        seq, doc = meta.read(area)
    assert seq == 1 and doc["keys"] == ["a"]
    assert "slot 0: checksum mismatch (torn write); using the other slot (sequence 1)" in caplog.text, caplog.text


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_a_sockets_lock_file_someone_else_planted_is_refused_and_left_untouched(committer_factory, tmp_path,
                                                                                 planted):
    """REVIEW (2026-12-05, permissions): ``<socket>.lock`` may sit in a shared sticky directory such as /tmp,
    where another user can plant a link at the name before the committer starts: a root committer followed
    a symlink and truncated the file it named, writing its generation and pid there. A lock file must be a
    plain file of ours with one name (opened without following a link): the start is refused, exit 2, and
    the linked file keeps its bytes."""
    victim = tmp_path / "victim.conf"
    victim.write_text("IMPORTANT\n")
    lock = tmp_path / "s.sock.lock"
    (lock.symlink_to if planted == "symlink" else lock.hardlink_to)(victim)
    handle = committer_factory("--endpoint", f"ipc://{tmp_path}/s.sock", name=unique_cache_name("ep"), wait=False)
    assert handle.proc.wait(30) == 2
    assert f"lock file {lock} is" in handle.log() and "someone else put it there" in handle.log(), handle.log()
    assert victim.read_text() == "IMPORTANT\n" and not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_a_cache_lock_file_someone_else_planted_is_a_refused_start_not_a_crash(committer_factory, tmp_path,
                                                                              planted):
    """REVIEW (2026-12-07, stop 54): the socket's lock file planted by someone else was refused (exit 2, one
    line), but the same at the cache's own lock file (``<runtime dir>/<name>.lock``) ended the start in a
    traceback with exit 1, which a supervisor or the autostart takes for a crash, not a refusal. Both are
    refused alike now, and the linked file keeps its bytes."""
    from conftest import RUNTIME_DIR

    victim = tmp_path / "victim.conf"
    victim.write_text("IMPORTANT\n")
    name = unique_cache_name("lk")
    lock = RUNTIME_DIR / f"{name}.lock"
    (lock.symlink_to if planted == "symlink" else lock.hardlink_to)(victim)
    try:
        handle = committer_factory(name=name, wait=False)
        assert handle.proc.wait(30) == 2, handle.log()
        log = handle.log()
        assert "Traceback" not in log and f"omnishm committer: lock file {lock} is" in log, log
        assert "someone else put it there" in log, log
        assert victim.read_text() == "IMPORTANT\n" and not (RUNTIME_DIR / f"{name}.sock").exists()
    finally:
        lock.unlink()


def test_a_segment_name_someone_else_took_is_refused_as_taken_not_as_no_space(committer_factory):
    """REVIEW (2026-12-05, permissions): segment names are predictable from /dev/shm's listing, and a
    segment another user created at the next key's name made that key's open fail as ``no_space``. It is
    ``name_taken`` now, naming the segment (the key cannot be opened in this generation: left alone)."""
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    try:
        writer.open_key("a", "float32", 4)
        taken = shm.segment_name(handle.name, writer.welcome.generation, "pool.k1")
        seg = shm.Segment.create(taken, 4096)
        try:
            reply = writer.raw.call(protocol.OpenKey(rid=writer.raw.next_rid(), key="b", dtype="float32", width=4))
            assert isinstance(reply, protocol.Error) and reply.code == "name_taken", reply
            assert f"shared memory segment {taken} already exists" in reply.message, reply
            assert writer.raw.status()["rejected"]["name_taken"] == 1
        finally:
            seg.unlink()
            seg.close()
    finally:
        writer.goodbye()


def test_cleanup_of_a_name_never_unlinks_a_socket_another_caches_committer_serves(committer_factory):
    """REVIEW (2026-12-05, stop 42, CLI): a committer may be given another cache's own socket path as its
    explicit endpoint. ``omnishm cleanup --name Y`` found no committer holding Y's lock and unlinked
    ``Y.sock``: the live committer serving it kept running and no new client could reach it. A socket that
    answers a connect is never removed now, and the socket goes under its own ``<socket>.lock``."""
    from conftest import RUNTIME_DIR, unique_cache_name, wait_ready

    from omnishm import cli

    sock = RUNTIME_DIR / f"{unique_cache_name('y')}.sock"
    handle = committer_factory(*SLOW, "--endpoint", f"ipc://{sock}", wait=False)
    handle.endpoint = f"ipc://{sock}"
    wait_ready(handle)
    removed = orphans.sweep(RUNTIME_DIR, sock.name[:-len(".sock")])
    assert removed == [] and sock.exists(), removed
    welcome = cli.admin_request(handle.name, handle.endpoint, None, 10.0)  # still reachable
    assert welcome.committer_pid == handle.proc.pid


def test_a_sweep_removes_a_killed_committers_explicit_endpoint_socket_in_the_runtime_dir(committer_factory):
    """REVIEW (2026-12-05, stop 42, CLI): after a SIGKILL, the sweep read ``E.sock.lock`` (an explicit
    endpoint's socket lock) as the lock of a cache named ``E.sock``, looked for ``E.sock.sock``, removed the
    lock and left ``E.sock``, which nothing named any more. It removes the socket, then its lock."""
    from conftest import RUNTIME_DIR, unique_cache_name, wait_ready

    runtime_dir = RUNTIME_DIR
    sock = runtime_dir / f"{unique_cache_name('ep')}.sock"
    handle = committer_factory(*SLOW, "--endpoint", f"ipc://{sock}", wait=False)
    handle.endpoint = f"ipc://{sock}"
    wait_ready(handle)
    assert orphans.sweep(runtime_dir) == [] and sock.exists()  # live: nothing of it goes
    handle.proc.kill()
    handle.proc.wait()
    removed = orphans.sweep(runtime_dir)
    lock = liveness.socket_lock_path(sock)
    assert str(sock) in removed and str(lock) in removed, removed
    assert not os.path.lexists(sock) and not os.path.lexists(lock)


def test_a_sweep_removes_a_dead_endpoints_socket_under_the_lock_of_the_cache_whose_own_socket_it_is(
        committer_factory, monkeypatch):
    """REVIEW (2026-12-05, stop 42, this stop's diff): a killed committer given ``ipc://RUNTIME_DIR/Y.sock``
    leaves ``Y.sock`` and ``Y.sock.lock``. The sweep removed that socket under ``Y.sock.lock`` alone, but
    ``Y.sock`` is also cache Y's own socket, which Y's committer guards with ``Y.lock`` alone: a sweep paused
    between its probe and its unlink removed the socket Y had just bound. The sweep holds ``Y.lock`` too."""
    import threading

    from conftest import RUNTIME_DIR, unique_cache_name, wait_ready

    y = unique_cache_name("y")
    sock = RUNTIME_DIR / f"{y}.sock"
    handle = committer_factory(*SLOW, "--endpoint", f"ipc://{sock}", wait=False)
    handle.endpoint = f"ipc://{sock}"
    wait_ready(handle)
    handle.proc.kill()
    handle.proc.wait()
    real_probe = orphans.socket_in_use
    lock_held_by_the_sweep: list[bool] = []

    def probe(path):
        if path == sock:  # the sweep's probe: does it hold Y's cache lock here, where Y would unlink and bind?
            fd = os.open(liveness.lock_path(RUNTIME_DIR, y), os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_held_by_the_sweep.append(False)
            except BlockingIOError:  # flock conflicts between open file descriptions, threads alike
                lock_held_by_the_sweep.append(True)
            finally:
                os.close(fd)
        return real_probe(path)

    monkeypatch.setattr(orphans, "socket_in_use", probe)
    sweeper = threading.Thread(target=orphans.sweep, args=(RUNTIME_DIR,))
    sweeper.start()
    sweeper.join(30)
    assert lock_held_by_the_sweep == [True]
    assert not os.path.lexists(sock) and not os.path.lexists(liveness.socket_lock_path(sock))
    assert not os.path.lexists(liveness.lock_path(RUNTIME_DIR, y))  # made for the purpose, and removed


def test_a_caches_own_socket_is_held_under_its_socket_lock_too(committer_factory):
    """REVIEW (2026-12-05, stop 42, LIMITS traps): a committer on its cache's own socket guarded it with the cache
    lock alone, and a committer of another cache given that path as its explicit endpoint took only the
    socket's lock: the two never excluded each other, and when both passed the stale-socket check before
    either bound, the later bind took the socket (both ran; the first served a socket nobody could reach).
    The cache's own socket is held under ``<socket>.lock`` too, and the other start is refused by that lock
    (before, only by a connect to the socket once it was bound)."""
    from conftest import assert_clean_stop, unique_cache_name

    own = committer_factory(*SLOW)
    sock = own.runtime_dir / f"{own.name}.sock"
    lock = liveness.socket_lock_path(sock)
    assert liveness.CacheLock.holder(lock)[1] == own.proc.pid
    other = committer_factory(*SLOW, "--endpoint", f"ipc://{sock}", name=unique_cache_name("other"), wait=False)
    assert other.proc.wait(30) == 2
    assert "belongs to a running committer (generation" in other.log() and f"pid {own.proc.pid}" in other.log()
    assert_clean_stop(own)
    assert not sock.exists() and not lock.exists()


def test_a_refused_writers_key_specs_are_not_the_caches(committer_factory):
    """REVIEW (2026-12-06): a writer's Hello declared its layout's new key specs before its staging was made,
    and a refusal after that (no room for its staging) kept them: the next writer, declaring its own spec
    for that key, was refused with "layout mismatch" for good, by a client that was never let in. Specs
    are declared once the writer is welcomed, and saved with its epoch."""
    handle = committer_factory()
    first = Writer(handle.endpoint, handle.name, LAYOUT, 8)
    first.open_key("h", "float32", 1024)  # a key a later writer needs staging for
    first.goodbye()
    refused = RawClient(handle.endpoint, handle.name)
    try:
        reply = refused.hello(protocol.ROLE_WRITER, protocol.Layout(8, 4, {"x": protocol.KeySpec("float32", 4)}),
                              staging_rows=MAX_STAGING_ROWS)  # 4 KiB rows: more than /dev/shm holds
        assert isinstance(reply, protocol.Refused) and "cannot create staging" in reply.reason, reply
    finally:
        refused.close()

    def specs() -> dict:
        admin = RawClient(handle.endpoint, handle.name)
        try:
            welcome = admin.hello(protocol.ROLE_ADMIN)
            admin.goodbye()
        finally:
            admin.close()
        return welcome.layout.keys

    assert set(specs()) == {"h"}
    later = Writer(handle.endpoint, handle.name, protocol.Layout(8, 4, {"x": protocol.KeySpec("bfloat16", 8)}), 8)
    try:
        assert later.welcome.layout.keys["x"] == specs()["x"] == protocol.KeySpec("bfloat16", 8)
    finally:
        later.goodbye()


def test_a_key_whose_commit_table_cannot_be_made_leaves_no_segment(monkeypatch):
    """MUTATION REVIEW (2026-12-06): ``open_key`` unlinking none of the segments it had made when a later one
    failed (/dev/shm full while making the commit table) survived the suite: its pool and claim table
    stayed in /dev/shm. They go, and the error is the caller's."""
    pool = CachePool(unique_cache_name("safe"), uuid.uuid4().hex[:8])
    try:
        pool.set_layout(LAYOUT)
        made = pool._create

        def create(what: str, size: int):
            if what.startswith("commit."):
                raise OSError(28, "No space left on device")
            return made(what, size)

        monkeypatch.setattr(pool, "_create", create)
        with pytest.raises(OSError, match="No space left"):
            pool.open_key("h", protocol.KeySpec("float32", 4, (4,)))
        assert [s for s in shm.list_segments(pool.name) if ".ctl" not in s] == [], shm.list_segments(pool.name)
    finally:
        pool.close()
    assert shm.list_segments(pool.name) == []


def test_an_unknown_key_of_megabytes_is_named_cut_in_the_step_reply(committer_factory):
    """REVIEW (stop 47): a bad StepWrite gets a clear error naming what is wrong; a client-supplied name in it is
    cut, as the OpenKey path cuts it (``protocol.shown``): a 1 MiB key name of control characters (4 characters each in a repr) must not make
    the committer build and send a 4 MiB reason (a 60 MiB name: a reply over the client's ZMQ_MAXMSGSIZE,
    which drops the connection instead of delivering the error)."""
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, protocol.Layout(num_blocks=4, block_size=4, keys={}), 8)
    writer.open_key("k", "float32", 4)
    try:
        for keys in (["\x00" * (1 << 20)], ["k", "\x01" * (1 << 20), "\x01" * (1 << 20)]):
            msg = protocol.StepWrite(rid=writer.raw.next_rid(), step=1, keys=keys, key_idx=b"", tids=b"", cvs=b"",
                                     src_rows=b"", counts=b"", slots=b"")
            reply = writer.raw.call(msg)
            assert isinstance(reply, protocol.StepDone) and reply.reason, reply
            assert len(reply.reason) < 1000, (len(reply.reason), reply.reason[:120])
    finally:
        writer.goodbye()


def test_a_step_of_no_entries_that_sends_slots_is_refused_by_name(committer_factory):
    """``validate_step``: a StepWrite with no entries but a slot buffer is refused with a StepDone naming
    the mismatch ("1 slots but no entries"), nothing applied, and the writer's next good step still applies:
    bad input gets a clear error reply, not an internal error, and the committer loses nothing else. MUTATION
    (stop 47): without that check the reply was ``Error(code="internal")`` with numpy's ValueError."""
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, protocol.Layout(num_blocks=4, block_size=4, keys={}), 8)
    view = writer.open_key("k", "float32", 4)
    try:
        bad = protocol.StepWrite(rid=writer.raw.next_rid(), step=1, keys=["k"], key_idx=b"", tids=b"", cvs=b"",
                                 src_rows=b"", counts=b"", slots=pack([3]))
        reply = writer.raw.call(bad)
        assert isinstance(reply, protocol.StepDone), reply
        assert "1 slots but no entries" in reply.reason and reply.done_tids == b"", reply
        cv = writer.new_cv(2)
        good = writer.step_write(2, [("k", 7, cv, 0, [3])])
        assert isinstance(good, protocol.StepDone) and not good.reason and good.rows_written == 1, good
        assert int(view.commit[3]) == cv
    finally:
        writer.goodbye()


def test_a_readers_open_key_of_an_unknown_huge_name_is_answered_with_the_name_cut(committer_factory):
    """REVIEW (2026-12-06): a reader's OpenKey of an unknown key echoed the whole name back: a 5 MB name made
    a 5 MB reply, built on the loop thread. The name is cut as every other client-supplied value is."""
    h = committer_factory()
    raw = h.client()
    try:
        assert isinstance(raw.hello(protocol.ROLE_READER, LAYOUT), protocol.Welcome)
        reply = raw.call(protocol.OpenKey(rid=raw.next_rid(), key="z" * 5_000_000, dtype="bfloat16", width=8))
        assert isinstance(reply, protocol.Error) and reply.code == "unknown_key", reply
        assert len(reply.message) < 300 and "(5000002 chars)" in reply.message, reply.message[:300]
        assert isinstance(raw.goodbye(), protocol.Bye)
    finally:
        raw.close()


def test_a_committer_whose_runtime_files_were_removed_leaves_its_successors_lock_files(committer_factory, capsys):
    """REVIEW (2026-12-06): a committer whose runtime dir was emptied under it (``rm -rf``, a tmp cleaner)
    unlinked, when it stopped, the lock files of the committer of its name started meanwhile. That live
    committer then looked dead: ``omnishm ping`` called its socket "left over from one that is gone", and
    every client's autostart started a committer bound to fail. A lock file is removed only while its path
    still names the lock's own file."""
    from omnishm import cli
    from conftest import RUNTIME_DIR

    a = committer_factory()
    name = a.name
    files = [RUNTIME_DIR / f"{name}.lock", RUNTIME_DIR / f"{name}.sock.lock", RUNTIME_DIR / f"{name}.sock"]
    for f in files:
        f.unlink()
    b = committer_factory(name=name)
    try:
        assert liveness.cache_is_live(RUNTIME_DIR, name)
        assert a.stop() == 0
        assert b.proc.poll() is None and all(f.exists() for f in files), [f.exists() for f in files]
        assert liveness.cache_is_live(RUNTIME_DIR, name)
        capsys.readouterr()
        assert cli.main(["ping", "--name", name, "--runtime-dir", str(RUNTIME_DIR)]) == 0, capsys.readouterr()
    finally:
        assert b.stop() == 0
    assert not any(f.exists() for f in files)


def test_a_message_of_three_frames_is_a_decode_error_and_the_queue_depth_is_true(committer_factory):
    """MUTATION (2026-12-06): the status ``queue_depth`` one off the batch size survived (1 for a request alone
    in its batch), and a three-frame message is a decode error of kind ``frames``."""
    h = committer_factory()
    c = h.client()
    try:
        assert isinstance(c.hello(protocol.ROLE_ADMIN), protocol.Welcome)
        c.send_raw(protocol.encode(protocol.StatusRequest(rid=7)), b"trailing")
        reply = c.recv()
        assert isinstance(reply, protocol.Error) and reply.code == "decode" and "frames" in reply.message, reply
        st = c.status()  # alone in its batch: nothing queued behind it
        assert st["queue_depth"] == 0 and st["decode_errors"].get("frames") == 1, st
        assert isinstance(c.goodbye(), protocol.Bye)
    finally:
        c.close()



def test_a_step_done_naming_failed_tids_without_a_reason_is_a_failure():
    """``StepDone.failure`` is the one test the client's writer and flusher make of a reply
    (``writer._check_reply``, ``writes``'s flush, ``_on_task_done``): a reply that names failed tids is a
    failed write even when it carries no reason, so the client never takes rows the committer did not
    apply for landed ones. MUTATION (stop 48): ``failure()`` returning "" for failed tids without a reason
    survived the suite, because today's committer always sends a reason with its failed tids."""
    failed = protocol.StepDone(rid=1, step=3, done_tids=b"", failed_tids=pack([7]))
    assert failed.failure() == "tids failed"
    assert protocol.StepDone(rid=1, step=3, done_tids=pack([7])).failure() == ""
    # It survives the wire as well: the client judges the decoded reply.
    decoded = protocol.reply_decoder.decode(protocol.encode(failed))
    assert decoded.failure()


def test_a_hello_layout_key_of_width_0_is_refused_and_the_cache_stays_usable(committer_factory):
    """A key's rows are ``width`` elements, at least 1: a Hello whose layout declares a key of width 0 (no row
    shape, so the row-shape check has nothing to refuse) is refused by name (``bad_width``), and declares
    nothing: the next writer's good layout is welcomed and opens the key. MUTATION (stop 48): ``_check_spec``
    taking width 0 survived the suite; the width-0 spec was then declared and every later ``OpenKey`` of that
    key was refused (a row shape of 0 or a width mismatch) for the life of the cache."""
    handle = committer_factory()
    bad, good = handle.client(), handle.client()
    try:
        layout = protocol.Layout(8, 4, {"k": protocol.KeySpec("float32", 0)})
        reply = bad.hello(protocol.ROLE_WRITER, layout, staging_rows=8)
        assert isinstance(reply, protocol.Refused), reply
        assert "width" in reply.reason, reply.reason
        welcome = good.hello(protocol.ROLE_WRITER, protocol.Layout(8, 4, {"k": protocol.KeySpec("float32", 4)}),
                             staging_rows=8)
        assert isinstance(welcome, protocol.Welcome), welcome
        opened = good.call(protocol.OpenKey(rid=good.next_rid(), key="k", dtype="float32", width=4))
        assert isinstance(opened, protocol.KeyOpened), opened
        assert opened.segments.width == 4
        assert handle.status()["rejected"].get("hello_bad_width", 0) == 1
    finally:
        bad.close()
        good.close()


def test_a_hello_with_negative_staging_rows_is_refused_whatever_its_role(committer_factory):
    """``Hello.staging_rows`` must be in ``0..MAX_STAGING_ROWS`` for every role (bad input gets a clear
    error): a reader's Hello of -1 staging rows is refused naming the field, and the same client is welcomed
    once it sends 0. MUTATION (stop 48): dropping the lower bound of that check survived the suite (a
    writer's -1 is still refused by the writer's own ``>= 1`` rule, a reader's was welcomed)."""
    handle = committer_factory()
    writer, reader = handle.client(), handle.client()
    try:
        layout = protocol.Layout(8, 4)
        assert isinstance(writer.hello(protocol.ROLE_WRITER, layout, staging_rows=8), protocol.Welcome)
        reply = reader.hello(protocol.ROLE_READER, layout, staging_rows=-1)
        assert isinstance(reply, protocol.Refused), reply
        assert "staging_rows" in reply.reason and "-1" in reply.reason, reply.reason
        assert isinstance(reader.hello(protocol.ROLE_READER, layout, staging_rows=0), protocol.Welcome)
    finally:
        writer.close()
        reader.close()


# MUTATION REVIEW (stop 51): StepDone.failure on a real committer's reply.
def test_a_refused_step_that_names_no_tids_is_a_failure_by_its_reason(committer_factory):
    """Contract: ``StepDone.failure`` is the client's one test of a step reply, and a reply with a reason is
    a failure even when it names no failed tids: a real committer refusing a StepWrite with no entries (here
    an unknown key) answers a reason and an empty ``failed_tids``, and the client must not take it for a
    landed step. Kills the mutant that consults only ``failed_tids`` (the refusal read as success)."""
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, protocol.Layout(8, 4, {"k": protocol.KeySpec("float32", 4)}), 8)
    try:
        reply = writer.step_write(1, [], keys=["no-such-key"])
        assert isinstance(reply, protocol.StepDone), reply
        assert reply.failed_tids == b"" and "unknown key 'no-such-key'" in reply.reason, reply
        assert reply.failure() == reply.reason
    finally:
        writer.goodbye()


# REVIEW (2026-12-07, stop 53): FAULTS.md says client-supplied strings are cut before they reach a reply. An
# OpenKey's dtype came back whole: 1 MiB in, 1 MiB out; one of 17 MB of control characters, repr'd to 68 MB,
# passed the client's ZMQ_MAXMSGSIZE, and the connection dropped with no reply at all.

@pytest.mark.parametrize("who", ["writer, a new key", "reader, the writer's key"])
def test_a_dtype_of_a_megabyte_is_cut_in_the_refusal(committer_factory, who):
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    try:
        writer.open_key("k", "float32", 4)
        asker = writer.raw if who.startswith("writer") else RawClient(handle.endpoint, handle.name)
        if asker is not writer.raw:
            assert isinstance(asker.hello("reader"), protocol.Welcome)
        key = "new" if who.startswith("writer") else "k"
        reply = asker.call(protocol.OpenKey(rid=asker.next_rid(), key=key, dtype="x" * (1 << 20), width=4))
        assert isinstance(reply, protocol.Error) and reply.code in ("bad_dtype", "layout_mismatch"), reply
        assert "'xxxxxxxx" in reply.message and f"...({(1 << 20) + 2} chars)" in reply.message, reply.message[:300]
        assert len(reply.message) < 400, len(reply.message)
        if asker is not writer.raw:
            asker.leave()
    finally:
        writer.goodbye()


def test_a_dtype_that_repr_makes_four_times_longer_is_still_answered(committer_factory):
    import zmq

    handle = committer_factory()
    c = RawClient(handle.endpoint, handle.name)
    c.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)  # as the client's link sets it
    try:
        assert isinstance(c.hello("writer", LAYOUT, staging_rows=4), protocol.Welcome)
        msg = protocol.OpenKey(rid=c.next_rid(), key="k", dtype="\x01" * (17 << 20), width=4)
        assert len(protocol.encode(msg)) <= protocol.MAX_MESSAGE_BYTES
        reply = c.call(msg)
        assert isinstance(reply, protocol.Error) and reply.code == "bad_dtype" and len(reply.message) < 400, reply
        c.leave()
    finally:
        c.close()


_LONG_REPLIES = """
import sys
from omnishm import protocol
from omnishm.committer.server import Committer
dispatch = Committer.dispatch
def long_winded(self, identity, msg):
    if isinstance(msg, protocol.StatusRequest):
        return protocol.Error(rid=msg.rid, code="internal", message="z" * 100_000)
    if isinstance(msg, protocol.Hello) and msg.role == "reader":
        return protocol.Refused(rid=msg.rid, reason="r" * 100_000)
    return dispatch(self, identity, msg)
Committer.dispatch = long_winded
from omnishm.committer.start import main
sys.exit(main(sys.argv[1:]))
"""


def test_no_error_or_refusal_is_longer_than_its_bound(committer_factory):
    """Whatever a handler builds, the reply carries at most ``MAX_REPLY_TEXT`` characters of it: a real committer
    whose status handler answers 100,000 characters, and whose Hello handler refuses readers with as many (only
    the ``Error`` was pinned: mutation review, 2026-12-07)."""
    handle = committer_factory(python_args=("-c", _LONG_REPLIES))
    admin, reader = RawClient(handle.endpoint, handle.name), RawClient(handle.endpoint, handle.name)
    try:
        assert isinstance(admin.hello("admin"), protocol.Welcome)
        reply = admin.call(protocol.StatusRequest(rid=admin.next_rid()))
        assert isinstance(reply, protocol.Error)
        assert reply.message == "z" * protocol.MAX_REPLY_TEXT + "...(100000 chars)"
        admin.leave()
        refused = reader.hello("reader")
        assert isinstance(refused, protocol.Refused)
        assert refused.reason == "r" * protocol.MAX_REPLY_TEXT + "...(100000 chars)"
    finally:
        admin.close()
        reader.close()


def test_cut_text_keeps_exactly_the_limit():
    lim = protocol.MAX_REPLY_TEXT
    assert protocol.cut_text("x" * lim) == "x" * lim
    assert protocol.cut_text("x" * (lim + 1)) == "x" * lim + f"...({lim + 1} chars)"
    assert protocol.cut_text("abcdef", 3) == "abc...(6 chars)"


# MUTATION D10 (committer/start.py: the cache lock's non-permission OSError no longer caught): a directory at
# ``<runtime dir>/<name>.lock`` (another program's, or a mistaken mkdir) makes the lock's open fail with EISDIR,
# an OSError that is no PermissionError. It must be a refused start (exit 2, one line naming the lock file), not
# a traceback with exit 1 that a supervisor or the autostart takes for a crash; and nothing is left behind. (stop 54)
def test_a_directory_at_the_cache_lock_path_is_a_refused_start_not_a_crash(committer_factory):
    from conftest import RUNTIME_DIR

    name = unique_cache_name("lkdir")
    lock = RUNTIME_DIR / f"{name}.lock"
    lock.mkdir()
    try:
        handle = committer_factory(name=name, wait=False)
        assert handle.proc.wait(30) == 2, handle.log()
        log = handle.log()
        assert "Traceback" not in log, log
        assert f"omnishm committer: cannot take the cache lock {lock}" in log, log
        assert lock.is_dir() and not (RUNTIME_DIR / f"{name}.sock").exists()
        assert shm.list_segments(name) == [], shm.list_segments(name)
    finally:
        lock.rmdir()
