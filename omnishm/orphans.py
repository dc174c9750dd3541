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

from omnishm.paths import default_runtime_dir, socket_path
from omnishm.shm import (OWNER, SHM_DIR, CacheLock, cache_is_live, clients_attached, flock_within,
                         generation_owned, list_segments, lock_path, parse_segment_name, recorded_runtime_dir,
                         segment_name, still_names, unlink_segment)

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
                if named is None or (named != Path(only_dir).absolute() and not _abandoned(named)):
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


def _abandoned(runtime_dir: Path) -> bool:
    """Whether no committer serves from ``runtime_dir`` any more: it is gone, or none of its cache locks is held.

    What a whole session killed at once leaves (a test run cut off, a container's processes
    SIGKILLed with its dir on a shared /tmp): nobody would ever start there again to sweep it.
    """
    try:
        locks = [p.name[:-len(".lock")] for p in runtime_dir.glob("*.lock")]
    except OSError:
        return not runtime_dir.exists()
    return not any(cache_is_live(runtime_dir, name) for name in locks)


def _remove_dead_runtime_files(runtime_dir: Path, cache: str) -> list[str]:
    """Socket and lock file of a cache whose committer is gone, removed while holding its lock.

    Holding the lock while unlinking means a committer starting meanwhile either
    waits for it or finds the file replaced (``CacheLock.acquire`` re-checks the
    inode): it never ends up locking a file that is already gone. The sweep makes
    the same check: the file it opened may have been removed (a clean stop, another
    sweep) and a new committer's made before its ``flock``, and a lock on a removed
    file guards nothing. A socket with no lock file is swept under a lock file made
    for the purpose, since a committer starting now makes its lock before its socket.
    """
    lock, sock = lock_path(runtime_dir, cache), socket_path(runtime_dir, cache)
    made = False
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        if not sock.exists():
            return []
        try:
            fd, made = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
        except OSError:
            return []  # made meanwhile: a committer starting
    removed = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # live
        if not still_names(lock, fd):
            return []  # replaced since the open: whoever made the new file owns it
        for path in (sock, lock):
            try:
                path.unlink()
                if not (made and path == lock):
                    removed.append(str(path))
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return removed
