"""omnishm.shm: segments, views, modes, runtime dir checks, lock liveness and the sweep."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from omnishm import shm

from conftest import unique_cache_name


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
    assert name not in shm.list_segments()


def test_runtime_dir_checks(tmp_path):
    good = shm.ensure_runtime_dir(tmp_path / "rt")
    assert stat.S_IMODE(good.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(PermissionError, match="0777"):
        shm.ensure_runtime_dir(open_dir)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            shm.ensure_runtime_dir(foreign)
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises((PermissionError, FileExistsError, NotADirectoryError)):
        shm.ensure_runtime_dir(not_dir)


def test_lock_liveness_and_sweep(tmp_path):
    rt = shm.ensure_runtime_dir(tmp_path / "rt")
    live, dead = unique_cache_name("live"), unique_cache_name("dead")
    lock = shm.CacheLock.acquire(rt, live, "gen1")
    assert lock is not None and shm.cache_is_live(rt, live)
    assert shm.CacheLock.acquire(rt, live, "gen2") is None  # one committer per name
    assert lock.path.read_text().split() == ["gen1", str(os.getpid())]
    segs = [shm.Segment.create(shm.segment_name(cache, gen, "ctl"), 128)
            for cache, gen in ((live, "gen1"), (live, "old0"), (dead, "gen9"))]
    try:
        Path(rt, f"{dead}.sock").touch()
        Path(rt, f"{dead}.lock").touch()  # lock file nobody holds: stale
        assert not shm.cache_is_live(rt, dead)
        removed = shm.sweep(rt, dead)
        assert segs[2].name in removed and str(Path(rt, f"{dead}.sock")) in removed
        assert not Path(rt, f"{dead}.lock").exists()
        assert shm.sweep(rt, live) == []  # a live committer's segments are never swept
        # The committer itself, holding the lock, removes older generations of its cache only.
        assert shm.sweep(rt, live, keep_generation="gen1", assume_dead=True) == [segs[1].name]
        assert shm.list_segments(live) == [segs[0].name]
    finally:
        for seg in segs:
            seg.unlink()
        lock.release()
    assert not lock.path.exists() and not shm.cache_is_live(rt, live)


def test_cache_name_checked():
    assert shm.check_cache_name("thinker_0-a") == "thinker_0-a"
    for bad in ("", "a.b", "a/b", "x" * 65, "sp ace"):
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
    shm.ensure_runtime_dir(RUNTIME_DIR)
    path = shm.lock_path(RUNTIME_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe in flight ...
    threading.Timer(0.05, os.close, (fd,)).start()  # ... that ends 50 ms later
    lock = shm.CacheLock.acquire(RUNTIME_DIR, name, "g")
    try:
        assert lock is not None, "refused while only a probe held the lock"
    finally:
        if lock is not None:
            lock.release(remove=True)
        path.unlink(missing_ok=True)
