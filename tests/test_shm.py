"""omnishm.shm: segments, views, modes, runtime dir checks, lock liveness and the sweep."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path

import pytest
import torch

from omnishm import liveness, orphans, paths, shm

from conftest import REPO, unique_cache_name
from helpers import dead_socket


def test_create_attach_view_unlink():
    name = shm.segment_name(unique_cache_name("shm"), "g1", "pool.k0")
    seg = shm.Segment.create(name, 64 * 16 * 4, prefault=True)
    try:
        assert name in shm.list_segments()
        mode = stat.S_IMODE(os.stat(shm.SHM_DIR / name.lstrip("/")).st_mode)
        assert mode == 0o600
        rows = seg.tensor(torch.float32, (64, 16))
        rows.copy_(torch.arange(64 * 16, dtype=torch.float32).view(64, 16))
        other = shm.Segment.attach(name)
        assert torch.equal(other.tensor(torch.float32, (64, 16)), rows)
        other.tensor(torch.float32, (64, 16))[3, 4] = -1.0  # a writable attach writes the same pages
        assert rows[3, 4].item() == -1.0
        ro = shm.Segment.attach(name, readonly=True)
        view = ro.tensor(torch.float32, (64, 16))
        assert torch.equal(view, rows) and ro.readonly
        with pytest.raises(TypeError):
            ro.mmap[0] = 1  # the mapping is PROT_READ: writes cannot reach the pool
        with pytest.raises(ValueError, match="exceeds segment"):
            seg.tensor(torch.float32, (65, 16))
        assert shm.parse_segment_name(name)[2] == "pool.k0"
        with pytest.raises(FileExistsError):  # never reuses (or truncates) an existing name
            shm.Segment.create(name, 16)
    finally:
        assert seg.unlink()
    assert name not in shm.list_segments()
    assert torch.equal(view[:2], torch.arange(32, dtype=torch.float32).view(2, 16))  # maps outlive unlink
    assert not seg.unlink()
    with pytest.raises(FileNotFoundError):
        shm.Segment.attach(name)


def test_create_too_large_fails_cleanly():
    name = shm.segment_name(unique_cache_name("big"), "g1", "pool.k0")
    free = os.statvfs(shm.SHM_DIR)
    with pytest.raises(OSError) as info:
        shm.Segment.create(name, free.f_bavail * free.f_frsize + (1 << 30))
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG)
    if info.value.errno == errno.ENOSPC:  # it says how much it asked for and how much was free (review)
        assert f"cannot hold segment {name} of " in str(info.value) and " MiB free)" in str(info.value), info.value
    assert name not in shm.list_segments()


def test_runtime_dir_checks(tmp_path):
    good = paths.ensure_runtime_dir(tmp_path / "rt")
    assert stat.S_IMODE(good.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(PermissionError, match="0777"):
        paths.ensure_runtime_dir(open_dir)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            paths.ensure_runtime_dir(foreign)
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises((PermissionError, FileExistsError, NotADirectoryError)):
        paths.ensure_runtime_dir(not_dir)


def test_lock_liveness_and_sweep(tmp_path):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    live, dead = unique_cache_name("live"), unique_cache_name("dead")
    lock = liveness.CacheLock.acquire(rt, live, "gen1")
    assert lock is not None and liveness.cache_is_live(rt, live)
    assert liveness.CacheLock.acquire(rt, live, "gen2") is None  # one committer per name
    assert lock.path.read_text().split() == ["gen1", str(os.getpid())]
    segs = [shm.Segment.create(shm.segment_name(cache, gen, "ctl"), 128)
            for cache, gen in ((live, "gen1"), (live, "old0"), (dead, "gen9"))]
    try:
        dead_socket(Path(rt, f"{dead}.sock"))
        Path(rt, f"{dead}.lock").touch()  # lock file nobody holds: stale
        assert not liveness.cache_is_live(rt, dead)
        removed = orphans.sweep(rt, dead)
        assert segs[2].name in removed and str(Path(rt, f"{dead}.sock")) in removed
        assert not Path(rt, f"{dead}.lock").exists()
        assert orphans.sweep(rt, live) == []  # a live committer's segments are never swept
        # The committer itself, holding the lock, removes older generations of its cache only.
        assert orphans.sweep(rt, live, keep_generation="gen1", assume_dead=True) == [segs[1].name]
        assert shm.list_segments(live) == [segs[0].name]
    finally:
        for seg in segs:
            seg.unlink()
        lock.release()
    assert not lock.path.exists() and not liveness.cache_is_live(rt, live)


def _dead_generation(cache: str, gen: str, recorded: Path | None) -> list[str]:
    """A generation a SIGKILLed committer left (control and pool segments, its owner segment unlocked)."""
    names = [shm.segment_name(cache, gen, w) for w in ("ctl", "pool.k0")]
    for name in names:
        shm.Segment.create(name, 64).close()
    owner = liveness.GenerationOwner.acquire(cache, gen, runtime_dir=recorded)
    owner.release(unlink=False)
    return sorted(names + [shm.segment_name(cache, gen, liveness.OWNER)])


def test_a_start_up_sweep_leaves_other_runtime_dirs_to_their_own_committers(tmp_path):
    """``sweep(foreign_dirs=False)``, what a committer runs at start-up over other names: it removes the dead
    generations whose owner names its runtime dir, a dir that is gone or one nobody serves from (a killed
    session's), and leaves those of a dir where a committer still holds a cache lock (another live test
    session's deliberate leftovers, say) or of no recorded dir; ``omnishm cleanup`` (``foreign_dirs=True``)
    removes them all."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    served = paths.ensure_runtime_dir(tmp_path / "served")
    abandoned = paths.ensure_runtime_dir(tmp_path / "abandoned")
    (abandoned / "killed.lock").write_text("0badc0de 4194304\n")  # its committer's lock, nobody holds it
    dirs = {"here": rt, "served": served, "abandoned": abandoned, "gone": tmp_path / "gone", "unknown": None}
    caches = {what: unique_cache_name(what) for what in dirs}
    made = {what: _dead_generation(caches[what], "g0", d) for what, d in dirs.items()}
    lock = liveness.CacheLock.acquire(served, "alive", "g1")  # a committer still serving from there
    try:
        removed = orphans.sweep(rt, foreign_dirs=False)
        assert sorted(removed) == sorted(made["here"] + made["abandoned"] + made["gone"])
        here = [n for n in removed if f".{caches['here']}." in n]
        assert here[-1].endswith("." + liveness.OWNER), here  # the owner segment goes last, its lock held till then
        assert {w: shm.list_segments(c) for w, c in caches.items()} == {
            "here": [], "served": made["served"], "abandoned": [], "gone": [], "unknown": made["unknown"]}
        assert sorted(orphans.sweep(rt)) == sorted(made["served"] + made["unknown"])
    finally:
        lock.release(remove=True)
        for names in made.values():
            for name in names:
                shm.unlink_segment(name)


def test_a_probe_in_flight_does_not_hide_a_generation_from_a_restart():
    """Review (2026-12-04): the owner probe was exclusive, so a restart looking for a generation to adopt took
    another committer's probe of the same owner segment (its start-up sweep) for an owner, adopted nothing, and
    its own sweep removed the generation its clients were waiting on. The probe is shared now."""
    import fcntl

    import posix_ipc

    from omnishm.committer import meta

    cache = unique_cache_name("probed")
    made = _dead_generation(cache, "g0", None)
    fds = []
    try:
        for what in ("ctl", liveness.OWNER):  # a client attached; a probe of the owner in flight
            fd = posix_ipc.SharedMemory(shm.segment_name(cache, "g0", what), 0).fd
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        assert meta.live_generations(cache) == ["g0"]
        assert not liveness.generation_owned(cache, "g0")
    finally:
        for fd in fds:
            os.close(fd)
        for name in made:
            shm.unlink_segment(name)


def test_a_sweep_without_a_name_leaves_runtime_files_no_committer_wrote(tmp_path):
    """A runtime dir may be shared (``$XDG_RUNTIME_DIR`` given as ``--runtime-dir``): a sweep of every cache removes
    only the socket and lock file of a dead cache whose lock a committer wrote (generation and pid)."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    dead = unique_cache_name("deadfiles")
    dead_socket(rt / "docker.sock")
    (rt / "app.lock").write_text("held by nobody\n")
    (rt / f"{dead}.lock").write_text("0badc0de 4194304\n")
    dead_socket(rt / f"{dead}.sock")
    assert sorted(orphans.sweep(rt)) == sorted([str(rt / f"{dead}.lock"), str(rt / f"{dead}.sock")])
    assert sorted(os.listdir(rt)) == ["app.lock", "docker.sock"]


def test_a_sweep_leaves_the_files_of_a_committer_that_started_while_it_waited_for_the_lock(tmp_path, monkeypatch):
    """The sweep opened a dead committer's lock file; before its ``flock`` the file went (a clean stop, another
    sweep) and a new committer made its own lock and socket. The sweep's lock on the removed file guards
    nothing: it leaves the new files alone (it removed them, and a third committer then started beside the
    second; review)."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("restarted")
    lock_file, sock_file = liveness.lock_path(rt, cache), Path(rt, f"{cache}.sock")
    lock_file.write_text("gen0 4194304\n")  # the dead committer's
    held: list[liveness.CacheLock] = []
    real_fcntl = orphans.fcntl

    def flock(fd, op):
        if not held:  # between the sweep's open and its flock
            lock_file.unlink()
            held.append(liveness.CacheLock.acquire(rt, cache, "gen1"))
            dead_socket(sock_file)
        return real_fcntl.flock(fd, op)

    monkeypatch.setattr(orphans, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=real_fcntl.LOCK_EX,
                                                                LOCK_NB=real_fcntl.LOCK_NB))
    try:
        assert orphans.sweep(rt, cache) == []
        assert sock_file.exists() and held[0] is not None and liveness.still_names(lock_file, held[0].fd)
    finally:
        monkeypatch.undo()
        if held and held[0] is not None:
            held[0].release()
        sock_file.unlink(missing_ok=True)
    # A socket left without its lock file is swept under a lock the sweep makes, and only the socket is reported.
    dead_socket(sock_file)
    assert orphans.sweep(rt, cache) == [str(sock_file)]
    assert os.listdir(rt) == []


def test_cache_name_checked():
    assert shm.check_cache_name("thinker_0-a") == "thinker_0-a"
    assert shm.check_cache_name("x" * 64) == "x" * 64
    # "abc\n": a pattern ending in "$" used with match took it ("$" matches before a final newline).
    for bad in ("", "a.b", "a/b", "x" * 65, "sp ace", "abc\n", "x" * 64 + "\n"):
        with pytest.raises(ValueError):
            shm.check_cache_name(bad)


def test_a_momentary_lock_probe_does_not_make_a_starting_committer_refuse():
    """``cache_is_live`` takes ``LOCK_SH`` on the cache lock for a moment (a client's autostart check, ``omnishm
    ping`` of a stale socket); a committer whose ``LOCK_EX`` lands then must wait it out, not refuse to start
    as if another committer ran (review)."""
    import fcntl
    import threading

    from conftest import RUNTIME_DIR, unique_cache_name

    name = unique_cache_name("probe")
    paths.ensure_runtime_dir(RUNTIME_DIR)
    path = liveness.lock_path(RUNTIME_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe in flight ...
    threading.Timer(0.05, os.close, (fd,)).start()  # ... that ends 50 ms later
    lock = liveness.CacheLock.acquire(RUNTIME_DIR, name, "g")
    try:
        assert lock is not None, "refused while only a probe held the lock"
    finally:
        if lock is not None:
            lock.release(remove=True)
        path.unlink(missing_ok=True)


def test_a_weakly_ordered_machine_is_warned_of_once(monkeypatch, caplog):
    """The seqlock rests on x86-64's store order (README, "Platform"): elsewhere the committer and every
    client say so, once per process; on x86-64 nothing is logged."""
    import logging
    import platform

    from omnishm import versions

    log = logging.getLogger("omnishm.test-order")
    monkeypatch.setattr(versions, "_warned", False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.WARNING, logger="omnishm.test-order"):
        assert versions.warn_if_weakly_ordered(log) is False
        assert caplog.records == []
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        assert versions.warn_if_weakly_ordered(log) is True
        assert versions.warn_if_weakly_ordered(log) is True
    assert [r.getMessage()[:40] for r in caplog.records] == ["omnishm: this aarch64 machine may reorde"]


def test_a_sweep_removes_a_socket_lock_left_without_its_socket_at_a_caches_socket_name(tmp_path):
    """REVIEW (2026-12-05, stop 42, docs): a committer killed between taking ``<socket>.lock`` and binding
    leaves the lock alone. At a name that is also a cache's socket (``X.sock``) with no ``X.lock`` the sweep
    went through cache X's files, found nothing to take, and kept the lock file for good."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    lock = runtime / "x.sock.lock"
    lock.write_text("deadbeef 999999\n")  # what a committer writes in its lock files
    assert liveness.CacheLock.holder(lock) == ("deadbeef", 999999)
    assert orphans.sweep(runtime) == [str(lock)] and not lock.exists()


OTHER_UID = 65534



@pytest.fixture
def foreign_segment():
    """A segment of ours chowned to another uid (root only: as root the kernel's 0600 mode does not stop
    ``shm_open``, so omnishm's own uid checks are the only guard)."""
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    cache = f"tforeign{uuid.uuid4().hex[:6]}"
    seg = shm.Segment.create(shm.segment_name(cache, "gen1", "ctl"), 4096)
    os.chown(shm.SHM_DIR / seg.name.lstrip("/"), OTHER_UID, OTHER_UID)
    try:
        yield cache, seg
    finally:
        seg.close()
        shm.unlink_segment(seg.name)
        assert not (shm.SHM_DIR / seg.name.lstrip("/")).exists()


def test_attach_refuses_a_segment_of_another_user_even_where_open_succeeds(foreign_segment):
    """Mutation review (2026-12-06): ``Segment.attach`` maps only segments of this process's own uid: one of another user
    (another user's cache of the same name) raises PermissionError naming its owner, and is never mapped,
    even where ``shm_open`` itself succeeds (root, or a 0666 segment)."""
    _cache, seg = foreign_segment
    with pytest.raises(PermissionError, match=f"owned by uid {OTHER_UID}"):
        shm.Segment.attach(seg.name)
    with pytest.raises(PermissionError, match=f"owned by uid {OTHER_UID}"):
        shm.Segment.attach(seg.name, readonly=True)


def test_list_segments_never_lists_another_users_segment(foreign_segment):
    """Mutation review (2026-12-06): ``list_segments`` (what sweep, adoption and cleanup walk) lists only this user's segments:
    another user's cache of the same name is none of ours to adopt, sweep or clean up."""
    cache, seg = foreign_segment
    assert shm.list_segments(cache) == []
    assert seg.name not in shm.list_segments()


def test_another_programs_segment_shaped_like_ours_is_not_one_of_ours():
    """Mutation review (2026-12-06): only ``/omnishm.<cache>.<generation>.<what>`` names are omnishm's. Another program's segment of
    the same dotted shape in /dev/shm (``/other.<cache>.<gen>.ctl``), of our own uid, is not parsed as a
    segment and not listed, so the orphan sweep and ``omnishm cleanup`` (which unlink what ``list_segments``
    names) never remove it. Runs as any user."""
    import posix_ipc

    cache = f"tshape{uuid.uuid4().hex[:6]}"
    name = f"/other.{cache}.gen1.ctl"
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    try:
        assert shm.parse_segment_name(name) is None
        assert shm.list_segments(cache) == []
        assert name not in shm.list_segments()
    finally:
        posix_ipc.unlink_shared_memory(name)

# The mutation review of shm.py and liveness.py (stop 60): what survived the suite. Tests that need another user
# switch a child to OTHER_UID (root opens and unlinks anything), as tests/test_permissions.py does.
OTHER_UID = 65534


def _seg_name(what: str = "ctl") -> str:
    return shm.segment_name(unique_cache_name("mut"), "gen1", what)


def test_an_empty_segment_is_one_byte_mapped_not_an_error():
    """``Segment.create`` of size 0 (a key of no rows) makes a 1-byte segment: ``posix_fallocate`` and ``mmap``
    refuse a length of 0. MUTATION: ``size = int(size)`` (no ``max(.., 1)``) survived."""
    name = _seg_name("pool.k0")
    seg = shm.Segment.create(name, 0)
    try:
        assert seg.size == 1 and os.stat(shm.SHM_DIR / name.lstrip("/")).st_size == 1
        assert seg.tensor(torch.float32, (0, 16)).shape == (0, 16)
    finally:
        assert seg.unlink()


def test_a_failing_reservation_keeps_its_errno_and_leaves_no_segment(monkeypatch):
    """Only ENOSPC is reported as a full /dev/shm; any other error of ``posix_fallocate`` (EIO, EFBIG) keeps its
    own errno, and the name is unlinked either way. MUTATION: dropping ``if exc.errno != errno.ENOSPC: raise``
    (every error reported as "No space left") survived."""
    def failing(fd, offset, length):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", failing)
    name = _seg_name("pool.k0")
    with pytest.raises(OSError) as info:
        shm.Segment.create(name, 4096)
    assert info.value.errno == errno.EIO, info.value
    assert "No space left" not in str(info.value)
    assert name not in shm.list_segments()


_OTHER_USER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from omnishm import shm                     # loaded as root, before dropping privileges
    name = sys.argv[1]
    os.setgroups([]); os.setgid({uid}); os.setuid({uid})
    out = {{"uid": os.geteuid()}}
    try:
        out["unlinked"] = shm.unlink_segment(name)
    except Exception as exc:
        out["unlinked"] = "raised " + type(exc).__name__
    try:
        shm.Segment.attach(name, readonly=True)
        out["attach"] = "mapped"
    except Exception as exc:
        out["attach"] = type(exc).__name__
    print(json.dumps(out))
""")


def test_another_user_can_neither_unlink_nor_map_our_segment():
    """Another user's process (a sweep or cleanup of its own, a client of its own) calling ``unlink_segment``
    on one of our segments (0600, in sticky /dev/shm) gets False, not an exception, and the segment stays;
    ``Segment.attach`` raises the builtin PermissionError, which callers catch. MUTATIONS: dropping
    ``posix_ipc.PermissionsError`` from ``unlink_segment``'s except, or ``attach``'s conversion of it, survived."""
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    seg = shm.Segment.create(_seg_name(), 4096)
    try:
        proc = subprocess.run([sys.executable, "-c", _OTHER_USER.format(repo=str(REPO), uid=OTHER_UID), seg.name],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out == {"uid": OTHER_UID, "unlinked": False, "attach": "PermissionError"}, out
        assert seg.name in shm.list_segments()
    finally:
        assert seg.unlink()


def test_a_hard_link_at_a_lock_path_is_refused_and_its_file_left_alone(tmp_path):
    """A lock file with a second name (a hard link someone put at the lock path, to a file of ours elsewhere)
    is not a committer's: ``CacheLock.at`` refuses it, and never writes its record into that other file.
    MUTATION: dropping ``st.st_nlink > 1`` from ``_open_own_file`` survived (the record overwrote the target)."""
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me\n")
    path = tmp_path / "cache.lock"
    os.link(target, path)
    with pytest.raises(PermissionError, match="link"):
        liveness.CacheLock.at(path, "gen1")
    assert target.read_bytes() == b"keep me\n"
    assert not liveness.lock_held(path)


_ORPHAN = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from omnishm import liveness
    print(liveness.die_with_parent(os.getppid()), liveness.die_with_parent(os.getppid() + 1000000))
""")


def test_die_with_parent_is_false_when_the_parent_named_is_not_ours():
    """``die_with_parent`` returns False when the process named is not (any more) this one's parent: the caller
    (a demo rank, a bench child) must stop then, or it outlives its launcher. Run in a child: it sets the
    parent death signal. MUTATION: ``return True`` survived."""
    proc = subprocess.run([sys.executable, "-c", _ORPHAN.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"], proc.stdout


def test_create_and_attach_leave_no_descriptor_open():
    """A segment's fd is closed once it is mapped (the mapping keeps the pages): a committer creates a staging
    segment per client and key for its whole life, and one fd each would run it out of descriptors. Only
    descriptors naming these segments are judged: other threads of the process open and close their own.
    MUTATION: dropping ``shm.close_fd()`` after a successful create survived."""
    import gc

    def ours() -> list[str]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # closed meanwhile
                continue
        return [link for link in links if any(n.lstrip("/") in link for n in names)]

    names = [_seg_name(f"stage.c{i}.k0") for i in range(8)]
    segs = [shm.Segment.create(n, 4096) for n in names]
    views = [shm.Segment.attach(s.name, readonly=True) for s in segs]
    for s in segs:
        assert s.unlink()
    del segs, views, s
    gc.collect()
    assert ours() == []


def test_a_segment_unlinked_while_listing_is_passed_over(monkeypatch):
    """``list_segments`` passes over an entry gone between ``listdir`` and its ``stat`` (a committer unlinking
    its segments while a sweep or cleanup lists): no FileNotFoundError out of the sweep.
    MUTATION: letting that stat's error through survived."""
    gone = shm.segment_name(unique_cache_name("gone"), "gen1", "ctl").lstrip("/")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": [*real(p), gone] if str(p) == str(shm.SHM_DIR) else real(p))
    names = shm.list_segments()
    assert "/" + gone not in names


_LOCK_HELD_AS_OTHER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from omnishm import liveness                 # loaded as root, before dropping privileges
    os.setgroups([]); os.setgid({uid}); os.setuid({uid})
    print(liveness.lock_held(liveness.Path(sys.argv[1])))
""")


def test_a_lock_file_another_user_may_not_open_reads_as_not_held(tmp_path):
    """``lock_held`` of a lock file this user may not open (another user's, or in a directory it may not
    search) is False, not a PermissionError out of every sweep and ping that asks.
    MUTATION: dropping PermissionError from ``lock_held``'s except survived (root opens anything)."""
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    lock = liveness.CacheLock.at(tmp_path / "c.lock", "gen1")
    try:
        proc = subprocess.run([sys.executable, "-c", _LOCK_HELD_AS_OTHER.format(repo=str(REPO), uid=OTHER_UID),
                               str(lock.path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["False"], proc.stdout
    finally:
        lock.release()
