"""Removing what dead committers left: their generations' segments and their runtime-dir files.

``sweep`` is the one place that decides what is an orphan. A committer runs it at
start-up (its own name's older generations, then dead caches of other names), the
last client of a dead committer runs it for that cache, and ``omnishm cleanup`` runs
it on request. The liveness signals it reads are defined in ``omnishm.shm``: the
host-wide owner lock (``GenerationOwner``), the cache lock in a runtime dir
(``CacheLock``) and the clients' shared lock on a control segment.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import posix_ipc

from omnishm.liveness import (OWNER, CacheLock, cache_is_live, clients_attached, flock_within, generation_owned,
                              link_new_file, lock_path, recorded_runtime_dir, socket_lock_path, still_names)
from omnishm.paths import default_runtime_dir, socket_in_use, socket_path
from omnishm.shm import SHM_DIR, is_cache_name, list_segments, parse_segment_name, segment_name, unlink_segment

logger = logging.getLogger(__name__)


def sweep(runtime_dir: Path | str | None = None, cache: str | None = None, *,
          keep_generation: str | None = None, assume_dead: bool = False, force: bool = False,
          foreign_dirs: bool = True) -> list[str]:
    """Unlink segments (and stale sockets/locks) of caches no live committer owns.

    ``assume_dead`` is for a committer that holds the lock itself: every
    segment of ``cache`` other than ``keep_generation`` is then an orphan.
    Without ``force``, a generation whose control segment is still locked by
    attached clients is kept even when its committer is dead: those clients
    are waiting to resume with a restarted committer, which adopts it.
    Whatever the flags, a generation whose owner lock a live committer holds
    (``GenerationOwner``) is never touched, and one is removed only while the
    sweep holds that lock itself (``_remove_generation``). ``foreign_dirs=False``
    (a committer's start-up sweep of other names) also leaves a generation whose
    owner names none, or another runtime dir where a committer still serves
    (a dir nobody serves from any more is abandoned: its dead caches go). Without
    ``cache``, only runtime-dir files of caches whose lock file a committer wrote
    are considered (a shared dir's other sockets and locks are not ours).
    Returns what was removed.
    """
    runtime_dir = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
    removed: list[str] = []
    live: dict[str, bool] = {}
    generations = sorted({parse_segment_name(n)[:2] for n in list_segments(cache)})  # type: ignore[index]
    for seg_cache, generation in generations:
        if keep_generation is not None and generation == keep_generation:
            continue
        if generation_owned(seg_cache, generation):
            continue
        if seg_cache not in live:
            live[seg_cache] = False if (assume_dead and seg_cache == cache) else cache_is_live(runtime_dir, seg_cache)
        if live[seg_cache]:
            continue
        keep_attached = not force and not assume_dead
        if keep_attached and clients_attached(segment_name(seg_cache, generation, "ctl")):
            continue
        removed += _remove_generation(seg_cache, generation, keep_attached=keep_attached,
                                      only_dir=None if foreign_dirs else runtime_dir)
    if runtime_dir.is_dir():
        caches = [cache] if cache is not None else sorted(
            p.name[:-len(".lock")] for p in runtime_dir.glob("*.lock") if CacheLock.holder(p) is not None)
        for name in caches:
            if assume_dead and name == cache:
                continue
            if name.endswith(".sock"):  # a ``<socket>.lock`` (no cache name has a dot)
                stem = name[:-len(".sock")]
                if is_cache_name(stem):
                    # Also cache ``stem``'s own socket, so also under its cache lock, which its committer takes
                    # first (and one of a version before 2026-12-05 takes alone): under the socket lock only,
                    # a sweep removed the socket such a committer had just bound (review).
                    # The lock alone, when neither the socket nor the cache's lock is there (a committer
                    # killed between its socket lock and its bind): no cache lock to take, and nothing to bind.
                    removed += (_remove_dead_runtime_files(runtime_dir, stem)
                                or _remove_dead_socket(runtime_dir / name))
                else:
                    removed += _remove_dead_socket(runtime_dir / name)
            else:
                removed += _remove_dead_runtime_files(runtime_dir, name)
    if removed:
        logger.info("swept %d orphaned omnishm object(s): %s", len(removed), ", ".join(removed))
    return removed


def _remove_generation(cache: str, generation: str, *, keep_attached: bool, only_dir: Path | None) -> list[str]:
    """Unlink every segment of a dead generation while holding its owner lock; the owner segment goes last.

    Holding the lock makes the removal and an adoption exclusive: a committer adopting the
    generation holds it first (the removal is then skipped) or takes it after the owner
    segment is gone (its adoption then finds nothing and says so). Taken after the checks of
    ``sweep``: a lock held only while removing is never mistaken for an owner by a restart that
    looks for a generation to adopt, as the removal happens only when nobody is attached (checked
    again under the lock). ``only_dir``: leave the generation when its owner names none, or names
    another runtime dir where some committer still holds a cache lock. Returns what was removed.
    """
    owner = segment_name(cache, generation, OWNER)
    fd = -1
    try:
        fd = posix_ipc.SharedMemory(owner, 0).fd
    except posix_ipc.ExistentialError:
        if only_dir is not None:
            return []  # whose it is cannot be told
    except posix_ipc.PermissionsError:
        return []
    try:
        if fd >= 0:
            if not flock_within(fd, 0.05):
                return []  # owned, or being adopted, now
            if not still_names(SHM_DIR / owner.lstrip("/"), fd):
                return []  # removed (and made again) meanwhile: not the generation checked
            if only_dir is not None:
                named = recorded_runtime_dir(fd)
                if named is None or (named != Path(only_dir).absolute() and not abandoned(named)):
                    return []
        if keep_attached and clients_attached(segment_name(cache, generation, "ctl")):
            return []
        removed = [n for n in list_segments(cache)
                   if parse_segment_name(n)[1] == generation and n != owner and unlink_segment(n)]  # type: ignore[index]
        if fd >= 0 and unlink_segment(owner):
            removed.append(owner)
        return removed
    finally:
        if fd >= 0:
            os.close(fd)


def abandoned(runtime_dir: Path) -> bool:
    """Whether no committer serves from ``runtime_dir`` any more: it is gone, or none of its cache locks is held.

    What a whole session killed at once leaves (a test run cut off, a container's processes
    SIGKILLed with its dir on a shared /tmp): nobody would ever start there again to sweep it.
    Never raises: a lock it cannot read counts as held.
    """
    try:
        locks = [p.name[:-len(".lock")] for p in runtime_dir.glob("*.lock")]
    except OSError:
        return not runtime_dir.exists()
    for name in locks:
        try:
            if cache_is_live(runtime_dir, name):
                return False
        except OSError:  # cannot tell (an I/O error): served, the safe reading before a removal
            return False
    return True


SWEEP_RECORD = b"sweep %d"
"""What a lock file a sweep makes for the purpose holds (``generation pid``, as a committer's): read by
``CacheLock.holder`` as a holder named ``sweep``, dead once the sweeper is."""


def _take_lock_file(path: Path, *, make: bool) -> tuple[int, bool] | None:
    """``(fd, made)``: lock file ``path`` open and ``flock``ed by us (made for the purpose when missing and
    ``make``), or None when a live process holds it, or it is missing (and not ``make``), or it was made or
    replaced meanwhile. A lock on a file removed between our ``open`` and ``flock`` guards nothing, so the
    path must still name it (``still_names``)."""
    made = False
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        if not make:
            return None
        # Made whole, as a committer's is (``SWEEP_RECORD``): a sweeper killed while it holds the file leaves
        # one the next sweep takes for a dead holder's and removes, not an empty one that no sweep without a
        # cache name may take for ours (stop 52).
        linked = link_new_file(path, SWEEP_RECORD % os.getpid())
        if linked is not None:
            return linked, True
        try:
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), True
        except OSError:
            return None  # made meanwhile: a committer starting
    except OSError:
        return None  # a link, or not ours to open: not a lock we may take
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None  # live
    if not still_names(path, fd):
        os.close(fd)
        return None  # replaced since the open: whoever made the new file owns it
    return fd, made


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _remove_dead_socket(sock: Path) -> list[str]:
    """A socket file nobody serves, removed under its own ``<socket>.lock`` (``socket_lock_path``), with that
    lock file when it was a dead committer's.

    The lock is the one a committer serving ``sock`` holds for its life, and takes before it checks, unlinks
    and binds the socket: holding it, a sweep cannot unlink the new socket of a committer starting there. It
    is made for the purpose when missing. A socket that answers a connect is never removed, whoever serves
    it: a committer of another cache may have been given this path as its endpoint (review: ``cleanup
    --name Y`` unlinked the live socket of a committer serving ``Y.sock``).
    """
    lock = socket_lock_path(sock)
    taken = _take_lock_file(lock, make=os.path.lexists(sock))
    if taken is None:
        return []
    fd, made = taken
    removed: list[str] = []
    try:
        if os.path.lexists(sock) and not socket_in_use(sock) and _unlink(sock):
            removed.append(str(sock))
        if _unlink(lock) and not made:
            removed.append(str(lock))
    finally:
        os.close(fd)
    return removed


def _remove_dead_runtime_files(runtime_dir: Path, cache: str) -> list[str]:
    """Socket and lock file of a cache whose committer is gone, removed while holding its lock.

    Holding the lock while unlinking means a committer starting meanwhile either
    waits for it or finds the file replaced (``CacheLock.acquire`` re-checks the
    inode): it never ends up locking a file that is already gone. The sweep makes
    the same check (``_take_lock_file``). A socket with no lock file is swept under a
    lock file made for the purpose, since a committer starting now makes its lock
    before its socket. The socket itself goes by ``_remove_dead_socket``, under its own
    lock: it may be another cache's committer's explicit endpoint.
    """
    lock, sock = lock_path(runtime_dir, cache), socket_path(runtime_dir, cache)
    taken = _take_lock_file(lock, make=os.path.lexists(sock))
    if taken is None:
        return []
    fd, made = taken
    try:
        removed = _remove_dead_socket(sock)
        if _unlink(lock) and not made:
            removed.append(str(lock))
    finally:
        os.close(fd)
    return removed
