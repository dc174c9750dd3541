"""Who is alive: the committer's lock files, the owner locks on segments, and process identity.

A committer of a cache holds an exclusive ``flock`` on ``<runtime_dir>/<cache>.lock`` (``CacheLock``) and
on its generation's owner segment ``/omnishm.<cache>.<generation>.owner`` (``GenerationOwner``) for its
whole life; the kernel drops both when it dies, however it dies. A client holds a shared ``flock`` on the
control segment it attached to. Everything that decides whether a cache, a generation or a client is
alive asks here: the client's autostart (``cache_is_live``), the committer's adoption of a generation and
the orphan sweep (``generation_owned``, ``clients_attached``, ``omnishm.orphans``). A pid alone names no
process for long (pids are reused), so a process is named by its pid and its start time
(``proc_identity``). Standard library and ``posix_ipc`` only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import posix_ipc

from omnishm.paths import ipc_path
from omnishm.shm import SHM_DIR, segment_name, unlink_segment


_PR_SET_PDEATHSIG = 1
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None
"""libc's ``prctl``, looked up once here: ``die_with_parent`` may run between a fork and an exec, where a
lookup (``dlopen``) could wait on a lock another thread of the parent held at the fork."""

OWNER = "owner"
"""The segment a committer holds an exclusive ``flock`` on for as long as it serves its generation."""


def flock_within(fd: int, patience_s: float, *, shared: bool = False) -> bool:
    """``LOCK_EX`` (``LOCK_SH`` when ``shared``) on ``fd``, retried for ``patience_s``: the probes
    (``cache_is_live``: a client's autostart check, ``omnishm ping``; ``generation_owned``,
    ``clients_attached``) hold their lock for microseconds, and a committer that takes the cache lock or an
    owner segment, or a client its liveness lock, must wait them out, not take them for a live holder."""
    deadline = time.monotonic() + patience_s
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def still_names(path: Path | str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``: a sweeper may have unlinked it (and someone made
    it again) between an ``open`` and a ``flock``, and a lock on an unlinked file guards nothing."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class GenerationOwner:
    """A committer's claim on its generation, visible host-wide (whatever its runtime dir).

    The cache lock file lives in one runtime dir, but segment names are host-wide: a
    committer started with another runtime dir (another ``XDG_RUNTIME_DIR``, another
    config) must not sweep or adopt a generation a live committer serves. So the
    committer holds ``flock(LOCK_EX)`` on ``/omnishm.<cache>.<generation>.owner`` for
    its life, and ``sweep``, adoption and ``omnishm cleanup`` leave every generation
    whose owner lock is held alone. The kernel drops the lock when the committer dies.
    """

    def __init__(self, name: str, fd: int):
        self.name = name
        self._fd = fd

    @classmethod
    def acquire(cls, cache: str, generation: str, *, runtime_dir: Path | None = None,
                patience_s: float = 0.2) -> "GenerationOwner | None":
        """Create (or open, for an adopted generation) the owner segment and lock it; None if held.

        ``generation_owned`` and ``sweep`` take the lock for a moment, so a lock held
        for less than ``patience_s`` is a probe, not a committer: wait it out.
        ``runtime_dir`` is written into the segment: a committer's start-up sweep
        leaves the dead caches of another runtime dir where a committer still
        serves to that dir's committers (``orphans.sweep(foreign_dirs=False)``).
        """
        name = segment_name(cache, generation, OWNER)
        deadline = time.monotonic() + patience_s
        while True:
            seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREAT, mode=0o600, size=0)
            try:
                os.fchmod(seg.fd, 0o600)
                locked = flock_within(seg.fd, deadline - time.monotonic())
            except BaseException:
                os.close(seg.fd)
                raise
            if not locked:
                os.close(seg.fd)
                return None
            if still_names(SHM_DIR / name.lstrip("/"), seg.fd):  # else take it again on the current one
                if runtime_dir is not None:
                    _record_dir(seg.fd, runtime_dir)
                return cls(name, seg.fd)
            os.close(seg.fd)

    def release(self, *, unlink: bool) -> bool:
        """Drop the claim; ``unlink`` also removes the segment (while still holding the lock). Whether
        this call removed it (the committer's stop line counts it with the cache's segments)."""
        if self._fd < 0:
            return False
        removed = unlink and unlink_segment(self.name)
        os.close(self._fd)
        self._fd = -1
        return removed


def _record_dir(fd: int, runtime_dir: Path) -> None:
    """Write ``runtime_dir`` into the owner segment ``fd`` (its whole content)."""
    data = os.fsencode(str(Path(runtime_dir).absolute()))
    os.ftruncate(fd, len(data))
    os.pwrite(fd, data, 0)


def recorded_runtime_dir(fd: int) -> Path | None:
    """The runtime dir an owner segment names; None when it names none (an owner made before it did)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if 0 < size <= 4096 else b""
    return Path(os.fsdecode(data)) if data else None


def segment_locked(name: str, *, exclusive: bool = True) -> bool:
    """True when some process holds a ``flock`` on segment ``name``, or it is not ours to probe.

    False when nobody does or the segment is gone. Probes with a non-blocking lock that it
    drops at once (``GenerationOwner.acquire`` waits such a probe out): ``exclusive`` sees
    any holder (a client's shared lock on a control segment); a shared probe sees only an
    exclusive holder (a committer's owner lock) and, unlike an exclusive one, never makes
    another shared probe take it for an owner.
    """
    try:
        seg = posix_ipc.SharedMemory(name, 0)
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError:
        return True  # not ours: never treat it as free to remove
    try:
        fcntl.flock(seg.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(seg.fd)
    return False


def generation_owned(cache: str, generation: str) -> bool:
    """True when a live committer holds the owner lock of ``generation`` (or a sweep is removing it).

    A shared probe: two processes probing at once (a restarting committer looking for a
    generation to adopt, another committer's start-up sweep) must not see each other as its
    owner, or the restart would skip the generation its clients wait on and sweep it.
    """
    return segment_locked(segment_name(cache, generation, OWNER), exclusive=False)


def lock_path(runtime_dir: Path, cache: str) -> Path:
    return Path(runtime_dir) / f"{cache}.lock"


def socket_lock_path(sock: Path) -> Path:
    """The lock file ``<sock>.lock`` that a committer holds for its whole life for its ipc socket (the cache's
    own, or an explicit endpoint).

    Checking a socket file, unlinking it when stale and binding are one step only under a lock: two
    committers of different caches given one endpoint at once each found it stale, and the second unlinked
    the first's new socket; and a committer on its cache's own socket, under the cache lock alone, was not
    excluded by one of another cache given that path (reviews, 2026-12-05)."""
    return Path(sock).with_name(Path(sock).name + ".lock")


@dataclass
class CacheLock:
    """An exclusive flock held for a committer's whole life; the kernel drops it on death."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, runtime_dir: Path, cache: str, generation: str) -> "CacheLock | None":
        """Take the lock, or None when a live process holds it."""
        return cls.at(lock_path(runtime_dir, cache), generation)

    @classmethod
    def at(cls, path: Path, generation: str) -> "CacheLock | None":
        """Take the lock file ``path`` (a cache's, or a socket's: ``socket_lock_path``), or None when a live
        process holds it."""
        record = f"{generation} {os.getpid()}".encode()
        while True:
            fd = _open_own_file(path, record)
            if not flock_within(fd, 0.2):  # a live committer holds it for good; a probe for microseconds
                ino = os.fstat(fd).st_ino
                os.close(fd)
                if _replaced_soon(path, ino, 0.2):
                    continue  # a sweeper held it to remove a dead committer's file: take the new one
                return None
            if still_names(path, fd):  # else take it again on the current file
                break
            os.close(fd)
        try:
            _write_record(fd, record)
        except BaseException:  # a full or failing file system: the path must not read as held for good
            os.close(fd)
            raise
        return cls(path, fd)

    @staticmethod
    def holder(path: Path) -> tuple[str, int] | None:
        """``(generation, pid)`` a committer wrote into lock file ``path``; None when it is gone or reads
        otherwise (not a committer's: a shared runtime dir holds other programs' locks too)."""
        try:
            # A fifo at the name hung ping, status, cleanup and a committer's start (after it took its own lock,
            # deaf to SIGTERM) until someone wrote to it (review, stop 54).
            fd = _open_plain_file(path)
        except OSError:
            return None
        if fd is None:
            return None
        try:
            parts = os.read(fd, 256).split()
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(parts) != 2 or not parts[1].isdigit():
            return None
        return parts[0].decode(errors="replace"), int(parts[1])

    def release(self, *, remove: bool = True) -> None:
        """Drop the lock; ``remove`` also unlinks the file, while still holding the lock, and only when its path
        still names this lock's file. A committer whose runtime dir was emptied under it (``rm -rf``, a tmp
        cleaner) unlinked the lock of the committer started after it, which then looked dead to ``ping``,
        ``cache_is_live`` and autostart (review, 2026-12-06)."""
        if self.fd < 0:
            return
        if remove and still_names(self.path, self.fd):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = -1


_RECORD_PAD_MAX = 4096
"""An old lock file up to this size is overwritten in place, padded with spaces; a larger one is emptied first."""


def _write_record(fd: int, record: bytes) -> None:
    """Write ``record`` (``generation pid``) over lock file ``fd``'s contents in one ``pwrite``, padded with spaces
    to the old size: the file never reads empty or half-written, even to a kill between two calls. A committer
    SIGKILLed between truncating its lock file and writing it left a zero-byte ``<cache>.lock``, which no sweep
    without a cache name takes for a committer's (stop 45's list; fixed at stop 52)."""
    size = os.fstat(fd).st_size
    if size > _RECORD_PAD_MAX:
        os.ftruncate(fd, 0)
        size = 0
    os.pwrite(fd, record.ljust(size - 1, b" ") + b"\n", 0)  # at least the old size: no old byte is left


def link_new_file(path: Path, record: bytes) -> int | None:
    """Lock file ``path`` made with ``record`` in it and ``flock``ed before its name appears (an unnamed
    ``O_TMPFILE`` file, then ``linkat`` by its ``/proc/self/fd`` name): a kill at any point leaves either no
    file or a whole one. None when ``path`` exists already or this kernel or file system cannot do it (no
    ``O_TMPFILE``, no ``/proc``): the caller then opens it the usual way. Never raises OSError. For a
    committer's lock (``CacheLock.at``) and for one a sweep makes to hold a dead cache's files
    (``orphans._take_lock_file``)."""
    try:
        dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except (AttributeError, OSError):
        return None
    fd = -1
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        os.write(fd, record + b"\n")
        fcntl.flock(fd, fcntl.LOCK_EX)
        # A dir fd makes os.link call linkat with AT_SYMLINK_FOLLOW; without one it calls link(2), which links
        # the /proc entry itself and fails (EXDEV).
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dir_fd)
    except (AttributeError, OSError):
        if fd >= 0:
            os.close(fd)
        return None
    finally:
        os.close(dir_fd)
    return fd


def _open_own_file(path: Path, record: bytes) -> int:
    """Open (creating, 0600) a lock file that is a plain file of ours with one name; raises PermissionError.

    A file made here holds ``record`` from its first moment when the system allows (``link_new_file``).
    A socket's lock file may sit in a shared sticky directory such as /tmp, where another user can put a
    symlink (a root committer truncated and wrote the file it pointed to: review), a hard link, or a file of
    their own held locked (which blamed "a running committer" for it) at the name first."""
    if not os.path.lexists(path):
        fd = link_new_file(path, record)
        if fd is not None:
            return fd
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise PermissionError(f"lock file {path} is a symlink: someone else put it there; use a directory of "
                              f"your own") from None
    st = os.fstat(fd)
    # 0 links: a sweep removed it meanwhile; the caller's still_names check takes the new one
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink > 1:
        os.close(fd)
        raise PermissionError(f"lock file {path} is not a plain file of ours (uid {st.st_uid}, mode "
                              f"{st.st_mode:o}, {st.st_nlink} link(s)): someone else put it there; use a directory "
                              f"of your own")
    return fd


def _replaced_soon(path: Path, ino: int, within_s: float) -> bool:
    """True when ``path`` stops naming inode ``ino`` within ``within_s`` (a live lock never does)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if os.stat(path).st_ino != ino:
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state [0], ppid [1], start time [19]), or
    None when the process is gone or unknown. The name may hold spaces and parentheses: it ends at the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()
    return fields if len(fields) >= 20 else None


def proc_identity(pid: int) -> str | None:
    """Start time of a live (not zombie) process ``pid`` from /proc, or None when it is gone or unknown."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def proc_parent(pid: int) -> int:
    """Parent pid of process ``pid`` (a zombie's too) from /proc, or 0 when it is gone or unknown."""
    fields = _proc_stat(pid)
    return 0 if fields is None else int(fields[1])


def cache_is_live(runtime_dir: Path, cache: str) -> bool:
    """True when some process holds the cache's committer lock."""
    return lock_held(lock_path(runtime_dir, cache))


def endpoint_served(endpoint: str) -> bool:
    """True when a committer holds the socket lock of ``endpoint`` (``socket_lock_path``): it serves that ipc
    socket, whatever its runtime dir or cache. False for any other transport."""
    sock = ipc_path(endpoint)
    return sock is not None and lock_held(socket_lock_path(sock))


def _open_plain_file(path: Path) -> int | None:
    """``path`` opened read-only, non-blocking (a fifo must not hang the open), no link followed; None (nothing
    left open) when it is no plain file: only a plain file can be a committer's lock (``_open_own_file``).
    Raises the open's OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        os.close(fd)
        raise
    os.close(fd)
    return None


def lock_held(path: Path) -> bool:
    """True when some process holds lock file ``path`` (a cache's lock, or a socket's: ``socket_lock_path``).

    Only a plain file that is no link can be a committer's lock (``_open_own_file``): anything else at the
    path, or a file this user may not open (another user's: a committer's lock is its own user's), is no
    committer's and reads as not held. A shared runtime dir holds other programs' locks too: a lock
    *directory* there raised ``IsADirectoryError`` out of every sweep that asked (review, stop 52). Opened
    read-only and non-blocking: a ``flock`` needs no write access, and a fifo must not hang the open. Raises
    OSError only for other errors of the open (an I/O error)."""
    try:
        fd = _open_plain_file(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):  # no lock of ours there; a runtime dir
        return False  # that is a file holds none
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link, or a runtime dir that is a symlink loop (review, stop 51)
            return False
        raise
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def clients_attached(ctl_name: str) -> bool:
    """True when some client holds its shared lock on the control segment ``ctl_name``."""
    return segment_locked(ctl_name)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process ``sig`` when its parent dies, even by SIGKILL (Linux: the parent
    death signal, kept across ``exec``; elsewhere nothing is set). False when parent ``parent`` is gone
    already (this process was orphaned before the call): the caller must stop then.

    The signal comes when the *thread* that forked this process ends, so fork from a thread that lives as
    long as the parent does (the main thread). Safe as a ``subprocess`` ``preexec_fn``: no lookup, no lock."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == parent
