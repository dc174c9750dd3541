"""A sweep next to a generation it must not take (stop 60's mutation review of omnishm/orphans.py): each guard here
was hidden by another one behind it, so removing it left the rest of the suite green.

Real shared memory, real owner and cache locks, and a real committer where one is live.
"""

from __future__ import annotations

import fcntl
import os
import socket

import posix_ipc

from conftest import RUNTIME_DIR, unique_cache_name
from helpers import dead_generation
from omnishm import orphans, paths, shm
from omnishm.committer import meta, start


def test_a_sweep_never_removes_a_generation_whose_owner_lock_a_live_committer_holds_when_it_looked_unowned(
        committer_factory, tmp_path, monkeypatch):
    """MUTATION O06: ``_remove_generation`` takes the owner lock before it unlinks anything, as a committer may
    take it (an adoption) between sweep's ``generation_owned`` probe and the removal. Here the probe says
    unowned (that window) and the sweep looks from another runtime dir, so the cache lock does not save it: the
    live committer keeps every segment, with ``force`` too. Without the lock the owner segment went."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    before = sorted(shm.list_segments(handle.name))
    assert before
    monkeypatch.setattr(orphans, "generation_owned", lambda cache, generation: False)
    elsewhere = paths.ensure_runtime_dir(tmp_path / "elsewhere")
    assert orphans.sweep(elsewhere, handle.name) == []
    assert orphans.sweep(elsewhere, handle.name, force=True) == []
    assert sorted(shm.list_segments(handle.name)) == before


def test_a_sweep_never_takes_the_owner_lock_of_a_generation_with_clients_attached(tmp_path, monkeypatch):
    """MUTATION O05: ``sweep`` leaves a dead generation with clients attached before it takes its owner lock.
    Without that check only the re-check under the lock kept the segments, but meanwhile the sweep held the
    owner lock of a generation whose clients wait to resume, and a committer restarting then
    (``meta.live_generations``, a shared probe of that lock) saw it owned and did not adopt it."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("attachedprobe")
    made = dead_generation(cache, "g0", RUNTIME_DIR)
    cfd = posix_ipc.SharedMemory(shm.segment_name(cache, "g0", "ctl"), 0).fd
    fcntl.flock(cfd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a client waiting to resume with a restarted committer
    seen = []
    real = orphans.flock_within

    def flock_within(fd, patience):
        got = real(fd, patience)
        if got:  # what a committer restarting right now would find to adopt
            seen.append(meta.live_generations(cache))
        return got

    monkeypatch.setattr(orphans, "flock_within", flock_within)
    try:
        assert meta.live_generations(cache) == ["g0"]
        assert orphans.sweep(rt, cache) == []
        assert all(gens == ["g0"] for gens in seen), f"a restart probing during the sweep saw {seen}"
        assert sorted(shm.list_segments(cache)) == made
    finally:
        monkeypatch.undo()
        os.close(cfd)
        for n in shm.list_segments(cache):
            shm.unlink_segment(n)


def test_a_start_up_sweep_leaves_a_foreign_dirs_dead_cache_when_a_lock_there_cannot_be_read(tmp_path):
    """MUTATION O14: ``orphans.abandoned`` reads a runtime dir whose cache lock it cannot read (an open failing
    other than as ``lock_held`` maps to "not held": ENXIO here, a unix socket named like a lock) as served, the
    safe reading before a removal. Read as abandoned, a committer's start-up sweep removed the dead caches of a
    foreign dir perhaps still served, which that dir's committers own."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    other = paths.ensure_runtime_dir(tmp_path / "other")
    cache = unique_cache_name("unreadable")
    odd = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    odd.bind(str(other / "odd.lock"))  # open() of it fails with ENXIO
    made = dead_generation(cache, "g0", other)
    try:
        assert orphans.abandoned(other) is False
        start._sweep_dead_caches(rt, "me")
        assert sorted(shm.list_segments(cache)) == made
    finally:
        odd.close()
        for n in shm.list_segments(cache):
            shm.unlink_segment(n)
