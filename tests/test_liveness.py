"""Liveness, the orphan sweep, the committer's start-up sweep and its metadata at their edges.

Each test kills a mutant of ``omnishm/orphans.py``, ``omnishm/liveness.py``, ``omnishm/committer/start.py`` or
``omnishm/committer/meta.py`` that survived the rest of the suite (mutation review, 2026-12-06: 50 mutants, 34
killed before). Races between a sweep and a starting committer are placed by patching ``flock_within``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import posix_ipc
import pytest

from conftest import RUNTIME_DIR, unique_cache_name
from helpers import dead_generation
from omnishm import liveness, orphans, paths, shm
from omnishm.committer import meta, start


# MUTATION (2026-12-06), O5 survived the suite: a committer's own start-up sweep (assume_dead) removes its name's
# other generations even with clients attached (a generation that failed to adopt, or a second live one):
# adopt_live_cache logs that they are swept.
def test_assume_dead_sweeps_other_generations_with_clients_attached(tmp_path):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("twolive")
    made = []
    for gen in ("g0", "g1"):
        for w in ("ctl", "pool.k0"):
            name = shm.segment_name(cache, gen, w)
            shm.Segment.create(name, 64).close()
            made.append(name)
    lock = liveness.CacheLock.acquire(rt, cache, "g1")
    owner = liveness.GenerationOwner.acquire(cache, "g1", runtime_dir=rt)
    fd = posix_ipc.SharedMemory(shm.segment_name(cache, "g0", "ctl"), 0).fd
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a client still attached to g0
    try:
        removed = orphans.sweep(rt, cache, keep_generation="g1", assume_dead=True)
        assert sorted(removed) == sorted(n for n in made if ".g0." in n), removed
    finally:
        os.close(fd)
        owner.release(unlink=True)
        lock.release()
        for n in shm.list_segments(cache):
            shm.unlink_segment(n)


# MUTATION (2026-12-06), O14 survived the suite: _remove_generation must re-check that the owner segment's name
# still names the fd it locked.
def test_sweep_leaves_a_generation_whose_owner_was_remade_and_is_held_between_open_and_lock(tmp_path, monkeypatch):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("remade")
    made = dead_generation(cache, "g0", RUNTIME_DIR)
    owner_name = shm.segment_name(cache, "g0", liveness.OWNER)
    held = []
    real = orphans.flock_within

    def flock_within(fd, patience):
        if not held:  # between the sweep's open of the owner and its lock: removed, and made again by a committer
            shm.unlink_segment(owner_name)
            held.append(liveness.GenerationOwner.acquire(cache, "g0", runtime_dir=rt))
            # held: a committer adopting g0 owns it now
        return real(fd, patience)

    monkeypatch.setattr(orphans, "flock_within", flock_within)
    try:
        removed = orphans.sweep(rt, cache, force=True)
        assert removed == [], removed
        assert sorted(shm.list_segments(cache)) == made
    finally:
        monkeypatch.undo()
        if held and held[0] is not None:
            held[0].release(unlink=False)
        for n in made:
            shm.unlink_segment(n)


# MUTATION (2026-12-06), O18 survived the suite: a client that attaches between sweep's first clients_attached check
# and its owner lock keeps its generation (the re-check under the lock in _remove_generation).
def test_a_client_attaching_while_the_sweep_takes_the_owner_lock_keeps_the_generation(tmp_path, monkeypatch):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("lateclient")
    dead_generation(cache, "g0", RUNTIME_DIR)
    fds = []
    real = orphans.flock_within

    def flock_within(fd, patience):
        if not fds:
            cfd = posix_ipc.SharedMemory(shm.segment_name(cache, "g0", "ctl"), 0).fd
            fcntl.flock(cfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fds.append(cfd)
        return real(fd, patience)

    monkeypatch.setattr(orphans, "flock_within", flock_within)
    try:
        assert orphans.sweep(rt, cache) == []
        assert len(shm.list_segments(cache)) == 3
    finally:
        monkeypatch.undo()
        for fd in fds:
            os.close(fd)
        for n in shm.list_segments(cache):
            shm.unlink_segment(n)


# MUTATION (2026-12-06), L5 survived the suite: GenerationOwner.acquire must hold its lock on the segment the name
# names now, not on one unlinked (by a sweep) between its open and its flock: else two committers both own the
# generation.
def test_owner_acquire_retakes_a_segment_unlinked_before_its_lock(monkeypatch):
    cache = unique_cache_name("ownrace")
    name = shm.segment_name(cache, "g0", liveness.OWNER)
    real = liveness.flock_within
    calls = []

    def flock_within(fd, patience):
        if not calls:  # a sweep removed the owner segment between acquire's open and its flock
            calls.append(1)
            shm.unlink_segment(name)
        return real(fd, patience)

    monkeypatch.setattr(liveness, "flock_within", flock_within)
    owner = liveness.GenerationOwner.acquire(cache, "g0")
    monkeypatch.undo()
    try:
        assert owner is not None
        assert liveness.generation_owned(cache, "g0"), "the owner lock is on an unlinked segment"
        assert liveness.GenerationOwner.acquire(cache, "g0", patience_s=0.05) is None
    finally:
        if owner is not None:
            owner.release(unlink=True)
        shm.unlink_segment(name)


# MUTATION (2026-12-06), L13 survived the suite: CacheLock.at holds the file its path names now, not one a sweep
# unlinked between its open and flock.
def test_cache_lock_retakes_a_file_unlinked_before_its_flock(tmp_path, monkeypatch):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("unl")
    path = liveness.lock_path(rt, cache)
    real = liveness.flock_within
    calls = []

    def flock_within(fd, patience):
        if not calls:
            calls.append(1)
            path.unlink()
        return real(fd, patience)

    monkeypatch.setattr(liveness, "flock_within", flock_within)
    lock = liveness.CacheLock.acquire(rt, cache, "g1")
    monkeypatch.undo()
    try:
        assert lock is not None and path.exists() and liveness.still_names(path, lock.fd)
        assert liveness.cache_is_live(rt, cache)
    finally:
        if lock is not None:
            lock.release()


# MUTATION (2026-12-06), L9 survived the suite: a segment not ours to open (PermissionsError: another user's) counts
# as locked, never as free to remove.
def test_a_segment_we_may_not_open_counts_as_locked(monkeypatch):
    def denied(name, flags=0, *a, **k):
        raise posix_ipc.PermissionsError("denied")

    monkeypatch.setattr(liveness.posix_ipc, "SharedMemory", denied)
    assert liveness.segment_locked("/omnishm.someone.g0.ctl")
    assert liveness.clients_attached("/omnishm.someone.g0.ctl")
    assert liveness.generation_owned("someone", "g0")


# MUTATION (2026-12-06), L14 survived the suite: a lock file with more than two words is not a committer's: a sweep
# of every cache leaves it.
def test_a_three_word_lock_file_is_not_a_committers(tmp_path):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    (rt / "app.lock").write_text("app 1234 extra\n")
    assert liveness.CacheLock.holder(rt / "app.lock") is None
    assert orphans.sweep(rt) == []
    assert os.listdir(rt) == ["app.lock"]


# MUTATION (2026-12-06), L19 survived the suite: cache_is_live is a shared probe: another probe in flight (a shared
# lock) is not a live committer.
def test_a_probe_in_flight_is_not_a_committer(tmp_path):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("probe")
    path = liveness.lock_path(rt, cache)
    path.write_text("dead 4194304\n")
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # another cache_is_live (a client's autostart check) in flight
        assert not liveness.cache_is_live(rt, cache)
    finally:
        os.close(fd)
        path.unlink()


# MUTATION (2026-12-06), L17/L18/L21 survived the suite: proc_identity: None for a zombie; the start time (field 22
# of /proc/PID/stat), even when the command name holds ') '.
def _starttime(pid):
    text = open(f"/proc/{pid}/stat", "rb").read()
    return text[text.rfind(b")") + 2:].split()[19].decode()


def test_a_zombie_has_no_identity():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        for _ in range(200):
            if open(f"/proc/{pid}/stat", "rb").read().split(b") ")[1][:1] == b"Z":
                break
            time.sleep(0.01)
        assert liveness.proc_identity(pid) is None
    finally:
        os.waitpid(pid, 0)


def test_identity_is_the_start_time():
    assert liveness.proc_identity(os.getpid()) == _starttime(os.getpid())
    assert liveness.proc_identity(os.getpid()) != "0"


def test_identity_of_a_process_whose_name_holds_a_paren():
    code = ("import ctypes,sys,time; ctypes.CDLL(None).prctl(15, b'a) b c d e', 0, 0, 0); "
            "print('ok', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        assert b"a) b c d e" in open(f"/proc/{p.pid}/stat", "rb").read()
        assert liveness.proc_identity(p.pid) == _starttime(p.pid)
    finally:
        p.kill()
        p.wait()


# MUTATION (2026-12-06), S10 survived the suite: a committer's start-up sweep of other names leaves the dead
# generations of another runtime dir where a committer still serves (another session's), and those whose owner names
# no dir.
def test_start_up_sweep_leaves_a_served_foreign_dirs_dead_cache(tmp_path):
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    other = paths.ensure_runtime_dir(tmp_path / "other")
    cache, nodir = unique_cache_name("foreign"), unique_cache_name("nodir")
    lock = liveness.CacheLock.acquire(other, "alive", "g1")  # first: a dir nobody serves is another session's to sweep
    made = dead_generation(cache, "g0", other)
    made2 = dead_generation(nodir, "g0", None)
    try:
        start._sweep_dead_caches(rt, "me")
        assert sorted(shm.list_segments(cache)) == made
        assert sorted(shm.list_segments(nodir)) == made2
    finally:
        lock.release()
        for n in made + made2:
            shm.unlink_segment(n)


# MUTATION (2026-12-06), X1/X2/X3/X5 survived the suite: meta.read/write: an empty slot is not a torn one; the
# newest valid slot wins; a torn newest write leaves the previous one readable; another version is refused.
def _mm():
    return bytearray(meta.CTL_BYTES)


def test_one_write_reads_back_without_a_torn_warning(caplog):
    mm = _mm()
    doc = {"version": meta.META_VERSION, "x": 1}
    meta.write(mm, doc, 1)
    with caplog.at_level(logging.WARNING, logger="omnishm"):
        assert meta.read(mm) == (1, doc)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_the_newest_slot_wins_and_a_torn_newest_write_leaves_the_previous():
    mm = _mm()
    for seq in (1, 2, 3):
        meta.write(mm, {"version": meta.META_VERSION, "seq": seq}, seq)
    assert meta.read(mm)[0] == 3
    off = meta.META_OFFSET + (3 % 2) * meta.SLOT_BYTES
    mm[off + 24] ^= 0xFF  # tear the body of the newest write
    assert meta.read(mm) == (2, {"version": meta.META_VERSION, "seq": 2})


def test_metadata_too_large_for_a_slot_is_refused_and_the_previous_state_stays_readable():
    """``meta.write`` of a document larger than a slot raises ``MetaError`` and writes nothing. Its slot (0, for
    sequence 2) lies before slot 1, which holds the previous state: a body run past its slot would tear that one too,
    and a restarted committer found neither slot valid and could not adopt a live cache (mutation review, stop 47:
    the size check taken out survived)."""
    mm = _mm()
    doc = {"version": meta.META_VERSION, "keys": ["a"]}
    meta.write(mm, doc, 1)
    before = bytes(mm)
    big = {"version": meta.META_VERSION, "keys": ["k" * 100] * (meta.SLOT_BYTES // 100)}
    with pytest.raises(meta.MetaError, match="does not fit"):
        meta.write(mm, big, 2)
    assert bytes(mm) == before
    assert meta.read(mm) == (1, doc)


def test_another_version_is_refused():
    mm = _mm()
    meta.write(mm, {"version": 1}, 1)
    with pytest.raises(meta.MetaError, match="version"):
        meta.read(mm)


def test_cleanup_given_a_file_as_its_runtime_dir_still_sweeps_dead_segments(tmp_path, capsys):
    """REVIEW (2026-12-06): ``omnishm cleanup --runtime-dir FILE`` exited 1 ("Not a directory") as soon as any
    dead generation existed: ``cache_is_live`` caught only a missing lock file. A runtime dir that is a file
    holds no lock, and the segments are swept still (the owner lock still guards a live committer's). Since stop 54
    the command then names the dir as not one, with exit 1, as ping and the committer refuse it."""
    from omnishm import cli

    bad = tmp_path / "a-file"
    bad.write_text("x")
    cache = unique_cache_name("notdir")
    shm.Segment.create(shm.segment_name(cache, "g0", "ctl"), 64).close()
    try:
        assert cli.main(["cleanup", "--runtime-dir", str(bad), "--name", cache]) == 1
        out, err = capsys.readouterr()
        assert "1 orphaned object(s) removed" in out and "is not a directory" in err, (out, err)
        assert shm.list_segments(cache) == []
    finally:
        for name in shm.list_segments(cache):
            shm.unlink_segment(name)


# MUTATION (2026-12-06), S3 survived the suite: a committer's start no longer sweeping other names' dead caches
# left a SIGKILLed committer's segments and files for good when its name never started again.
def test_a_committer_of_another_name_sweeps_a_killed_caches_leftovers(committer_factory):
    from conftest import RUNTIME_DIR, _cache_of_file

    dead = committer_factory()
    dead.client().close()
    assert shm.list_segments(dead.name), "a committer has segments"
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait()
    other = committer_factory()
    assert shm.list_segments(dead.name) == [], other.log()
    assert [f for f in os.listdir(RUNTIME_DIR) if _cache_of_file(f) == dead.name] == []


def test_an_adopting_committer_records_its_own_runtime_dir_not_the_tail_of_the_previous_one(tmp_path):
    """Mutation review (2026-12-06): the owner segment names exactly the runtime dir of the committer holding it now. A committer
    that adopts a generation (opening the owner segment its dead predecessor left) from a runtime dir whose
    path is shorter must not leave the tail of the longer old path behind: ``recorded_runtime_dir`` is what
    the start-up sweep (``foreign_dirs=False``) uses to decide whose dead generation it may remove."""
    long_rt = paths.ensure_runtime_dir(tmp_path / ("a-much-longer-runtime-directory-name" * 2))
    short_rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("adopt")
    liveness.GenerationOwner.acquire(cache, "g0", runtime_dir=long_rt).release(unlink=False)  # predecessor died
    owner = liveness.GenerationOwner.acquire(cache, "g0", runtime_dir=short_rt)
    assert owner is not None
    try:
        fd = posix_ipc.SharedMemory(shm.segment_name(cache, "g0", liveness.OWNER), 0).fd
        try:
            assert liveness.recorded_runtime_dir(fd) == Path(short_rt).absolute()
        finally:
            os.close(fd)
    finally:
        owner.release(unlink=True)
    assert shm.list_segments(cache) == []


def test_a_committer_takes_the_cache_lock_a_slow_sweeper_was_removing(tmp_path, monkeypatch):
    """Mutation review (2026-12-06): a lock file held locked by a sweeper that is removing a dead committer's files (``sweep`` takes
    the lock, unlinks the file, then drops it) does not make a starting committer report "a live committer
    holds it": when the held file stops being at that path right after the committer's wait ran out,
    ``CacheLock.acquire`` takes the new file instead of returning None. The sweeper's hold is made to outlast
    the committer's patience by finishing it from inside the committer's failed ``flock_within``, no sleep."""
    import fcntl

    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("swept")
    path = liveness.lock_path(rt, cache)
    sweeper = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(sweeper, fcntl.LOCK_EX)  # the sweeper holds the dead committer's lock while removing it
    real = liveness.flock_within
    finished = []

    def patience_runs_out(fd, patience_s):
        got = real(fd, 0 if not finished else patience_s)
        if not got and not finished:  # the sweeper now removes the file and lets go
            path.unlink()
            os.close(sweeper)
            finished.append(True)
        return got

    monkeypatch.setattr(liveness, "flock_within", patience_runs_out)
    lock = liveness.CacheLock.acquire(rt, cache, "gen1")
    try:
        assert finished and lock is not None
        assert liveness.cache_is_live(rt, cache)
        assert liveness.CacheLock.holder(path) == ("gen1", os.getpid())
    finally:
        if lock is not None:
            lock.release()
        if not finished:
            os.close(sweeper)
    assert not path.exists()


def test_a_sweep_of_a_shared_runtime_dir_passes_over_another_programs_lock_file(tmp_path):
    """Mutation review (2026-12-06): a runtime dir may be shared with other programs, whose ``*.lock`` files are not a committer's:
    ``CacheLock.holder`` reads such a file (two words, the second not a pid) as no holder (None), and the
    orphan sweep of that dir (a committer's start-up sweep, ``omnishm cleanup``) passes over it and leaves it,
    instead of failing on it."""
    from omnishm import orphans

    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    foreign = rt / "someprogram.lock"
    foreign.write_text("locked by-someprogram\n")
    assert liveness.CacheLock.holder(foreign) is None
    assert orphans.sweep(rt) == []
    assert foreign.read_text() == "locked by-someprogram\n"


def test_start_up_sweep_leaves_a_dead_generation_that_has_no_owner_segment(tmp_path):
    """A committer's start-up sweep of other names (``foreign_dirs=False``) removes only generations whose owner
    segment names its own runtime dir (or an abandoned one); a generation with no owner segment at all cannot
    be told whose it is (a committer of another runtime dir killed before it made its owner, or segments of a
    version that made none), so it is left, not unlinked under a committer that may still serve it. Mutation
    review (2026-12-06): with the missing-owner early return dropped from ``_remove_generation`` the start-up
    sweep unlinked such a generation's segments."""
    rt = paths.ensure_runtime_dir(tmp_path / "rt")
    cache = unique_cache_name("noowner")
    made = sorted(shm.segment_name(cache, "g0", w) for w in ("ctl", "pool.k0"))
    for name in made:
        shm.Segment.create(name, 64).close()
    try:
        start._sweep_dead_caches(rt, "me")
        assert sorted(shm.list_segments(cache)) == made
    finally:
        for n in made:
            shm.unlink_segment(n)


_KILLED_IN_LOCK_WRITE = """
import os, signal, sys
from pathlib import Path
from omnishm import liveness

at, calls = int(sys.argv[2]), [0]
def killed(real):
    def call(*args):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    return call
for fn in ("write", "pwrite", "ftruncate"):
    setattr(os, fn, killed(getattr(os, fn)))
liveness.CacheLock.at(Path(sys.argv[1]), "gen2")
os.kill(os.getpid(), signal.SIGKILL)  # after its last write, when it made fewer than `at`
"""


@pytest.mark.parametrize("old_record", [None, "gen1-of-a-longer-name 4194304"], ids=["new", "over-a-dead-ones"])
@pytest.mark.parametrize("killed_at", [1, 2, 3])
def test_a_committer_killed_while_writing_its_lock_file_never_leaves_it_empty(tmp_path: Path, old_record, killed_at):
    """Stop 52 (stop 45's list): a committer SIGKILLed between making (or emptying) its ``<cache>.lock`` and writing
    its ``generation pid`` into it left a zero-byte file, which a sweep without a cache name (``omnishm cleanup``)
    cannot take for a committer's and leaves for good. A new lock file now has its record before its name
    appears, and an old one is overwritten in one write: after a kill before any of the lock's writes (or after
    the last) there is no file, or one a sweep of the dir reads as a dead committer's and removes."""
    path = tmp_path / f"{unique_cache_name()}.lock"
    if old_record is not None:
        path.write_text(old_record + "\n")
    proc = subprocess.run([sys.executable, "-c", _KILLED_IN_LOCK_WRITE, str(path), str(killed_at)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if path.exists():
        assert liveness.CacheLock.holder(path) is not None, f"left {path.read_bytes()!r}"
        assert orphans.sweep(tmp_path) == [str(path)]
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_over_a_longer_old_record_reads_as_its_new_holder(tmp_path: Path):
    """The record is padded over an old, longer one (no truncate before the write); the holder still reads as
    ``(generation, pid)``, and a release removes the file."""
    path = tmp_path / "c.lock"
    path.write_text("a-much-longer-generation-name 4194304\n")
    lock = liveness.CacheLock.at(path, "g")
    try:
        assert liveness.CacheLock.holder(path) == ("g", os.getpid())
    finally:
        lock.release()
    assert not path.exists()


def test_a_lock_file_is_made_the_usual_way_where_unnamed_files_cannot_be(tmp_path: Path, monkeypatch):
    """Where the kernel or file system has no ``O_TMPFILE`` (or no ``/proc``), ``link_new_file`` gives up and the
    lock file is created, locked and written as before: the lock works, only the kill window is back."""
    monkeypatch.setattr(liveness, "link_new_file", lambda path, record: None)
    lock = liveness.CacheLock.acquire(tmp_path, "c", "g")
    try:
        assert liveness.CacheLock.holder(tmp_path / "c.lock") == ("g", os.getpid())
        assert liveness.CacheLock.acquire(tmp_path, "c", "g2") is None
    finally:
        lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_startup_sweep_goes_on_past_another_programs_lock_directory_in_a_foreign_dir(tmp_path: Path):
    """Review (stop 52): a committer's start-up sweep asks whether a dead cache's recorded runtime dir is still
    served (``orphans.abandoned``), by every ``*.lock`` in it. A ``*.lock`` that is a directory there (another
    program's, in a shared dir) raised ``IsADirectoryError`` out of ``lock_held``, which stopped the whole
    sweep: every dead cache after it kept its segments, at every start. It is no committer's lock, so the dir
    is served by nobody and the dead cache is swept."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.lock").mkdir()
    assert liveness.lock_held(foreign / "x.lock") is False
    cache = unique_cache_name("odd")
    names = dead_generation(cache, "g0", foreign)
    try:
        removed = orphans.sweep(RUNTIME_DIR, foreign_dirs=False)
        assert sorted(removed) == names and shm.list_segments(cache) == []
    finally:
        for n in shm.list_segments(cache):
            shm.unlink_segment(n)


def test_lock_held_reads_only_a_plain_file_of_a_live_holder(tmp_path: Path):
    """``lock_held`` is True only for a plain file some process holds a ``flock`` on; a fifo (never opened for
    good: the open does not block), a directory, a link to a held lock and a file this user may not open
    read as not held."""
    held = tmp_path / "held.lock"
    lock = liveness.CacheLock.at(held, "g")
    try:
        assert liveness.lock_held(held)
        (tmp_path / "link.lock").symlink_to(held)
        assert not liveness.lock_held(tmp_path / "link.lock")
        os.mkfifo(tmp_path / "fifo.lock")
        assert not liveness.lock_held(tmp_path / "fifo.lock")
        (tmp_path / "dir.lock").mkdir()
        assert not liveness.lock_held(tmp_path / "dir.lock")
    finally:
        lock.release()
    assert not liveness.lock_held(held)


def test_a_lock_whose_record_cannot_be_written_is_not_left_held(tmp_path: Path, monkeypatch):
    """Review (stop 52): a record write that fails (a full or failing file system) raised out of
    ``CacheLock.at`` with its fd left open and flocked, so the path read as held by a live process until this
    one exited. The fd is closed: the error is raised and the lock is free."""
    path = tmp_path / "c.lock"
    path.write_text("old-generation 4194304\n")  # an existing file: the record goes by _write_record's pwrite
    before = set(os.listdir("/proc/self/fd"))

    def failing_pwrite(fd, data, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    with pytest.raises(OSError, match="Input/output error"):
        liveness.CacheLock.at(path, "g")
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert not liveness.lock_held(path)


def test_a_sweeper_killed_while_it_holds_a_lock_file_it_made_leaves_one_the_next_sweep_removes(tmp_path: Path):
    """Review (stop 52): a sweep that finds a dead cache's socket without its lock file makes one to hold while it
    removes the socket (``orphans._take_lock_file``). It made it empty: a sweeper killed while holding it left a
    zero-byte ``<cache>.lock`` that no sweep without a cache name takes for ours. It is made whole now
    (``sweep PID``), so the next sweep of the dir reads it as a dead holder's and removes it."""
    path = tmp_path / f"{unique_cache_name()}.lock"
    proc = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from omnishm import orphans\n"
        "assert orphans._take_lock_file(Path(sys.argv[1]), make=True) is not None\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"), str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert liveness.CacheLock.holder(path) is not None, f"left {path.read_bytes()!r}"
    assert orphans.sweep(tmp_path) == [str(path)]
    assert list(tmp_path.iterdir()) == []


# MUTATION L8 (liveness.lock_held without its S_ISREG check): another program's lock *directory* named like a
# cache's lock file, held with flock by that program, read as a live committer (cache_is_live True), so
# ``ping``/autostart blamed a committer that does not exist and a start-up sweep never took the dir for
# abandoned. Only a plain file can be a committer's lock. (stop 54)
_DIR_LOCK_HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
sys.stdout.write("held\n"); sys.stdout.flush()
sys.stdin.read()  # hold until the test closes our stdin
"""


def test_a_flocked_lock_directory_of_another_program_is_no_live_committer(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    (runtime / "somecache.lock").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _DIR_LOCK_HOLDER, str(runtime / "somecache.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the other program holds its lock now
        assert liveness.lock_held(runtime / "somecache.lock") is False
        assert liveness.cache_is_live(runtime, "somecache") is False
        assert orphans.abandoned(runtime) is True
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_fifo_at_a_lock_path_hangs_nothing(committer_factory, capsys):
    """REVIEW (2026-12-07, stop 54): ``CacheLock.holder`` opened a lock file with a blocking ``open``: a fifo at
    ``NAME.lock`` (or at a ``<socket>.lock`` in a shared sticky directory, where another user can make one) hung
    ``ping`` and ``status`` past their ``--timeout-s``, ``cleanup``, and a committer's start in its sweep, after it
    had taken its own lock, deaf to SIGTERM, until someone wrote to the fifo. A fifo holds no committer's record."""
    from omnishm import cli

    fifo_name = unique_cache_name("fifo")
    fifo = RUNTIME_DIR / f"{fifo_name}.lock"
    os.mkfifo(fifo, 0o600)
    try:
        assert liveness.CacheLock.holder(fifo) is None
        assert liveness.cache_is_live(RUNTIME_DIR, fifo_name) is False
        handle = committer_factory()  # its start sweeps the dir's dead caches, reading every lock file
        assert handle.proc.poll() is None and fifo.exists()  # not a committer's: passed over
        t0 = time.monotonic()
        assert cli.main(["ping", "--name", fifo_name, "--timeout-s", "2"]) == 1
        assert cli.main(["cleanup"]) == 0  # every lock file of the dir is read
        assert cli.main(["cleanup", "--name", fifo_name]) == 0
        assert time.monotonic() - t0 < 30
        capsys.readouterr()
    finally:
        fifo.unlink(missing_ok=True)


# Mutation review (stop 54): ``CacheLock.holder`` now reads with ``os.open``; it must close the descriptor on
# every path (a record, a fifo, a short file). Dropping the ``finally: os.close`` passed the suite, and every call
# then leaked one descriptor (a client's refused attach names the holder, a sweep reads every lock of the dir).
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_holder_leaks_no_descriptor(tmp_path: Path):
    good = tmp_path / "good.lock"
    good.write_bytes(b"gen1 %d" % os.getpid())
    bad = tmp_path / "bad.lock"
    bad.write_bytes(b"not a record at all")
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo, 0o600)
    assert liveness.CacheLock.holder(good) == ("gen1", os.getpid())
    before = _open_fds()
    for _ in range(50):
        assert liveness.CacheLock.holder(good) == ("gen1", os.getpid())
        assert liveness.CacheLock.holder(bad) is None
        assert liveness.CacheLock.holder(fifo) is None
    assert _open_fds() == before
