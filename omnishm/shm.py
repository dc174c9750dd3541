"""Named POSIX shared-memory segments, mapped as torch tensor views (clients) or numpy arrays (the committer).

One naming scheme for every segment omnishm makes::

    /omnishm.<cache>.<generation>.<what>

``cache`` is the cache (and committer) name, ``generation`` the committer
instance that created it, ``what`` the purpose (``ctl``, ``pool.k0``,
``claim.k0``, ``commit.k0``, ``stage.<client>.k0``). Segments are created
0600 by the committer only, reserved with ``posix_fallocate`` (a full
``/dev/shm`` fails cleanly with ENOSPC instead of a later SIGBUS, trap 3) and
optionally pre-faulted.

Liveness: the committer of a cache holds an exclusive ``flock`` on
``<runtime_dir>/<cache>.lock`` for its whole life. A segment of a cache whose
lock no process holds is an orphan (the committer was SIGKILLed, trap 1);
``sweep`` unlinks it. Views never outlive their mapping: every tensor made by
``Segment.tensor`` (the clients') and every array made by ``Segment.array`` (the
committer's) holds a reference to the ``mmap`` (trap 5), and nothing in omnishm
calls ``mmap.close`` explicitly.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import socket
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import posix_ipc

from omnishm.paths import default_runtime_dir, ipc_endpoint, socket_path  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "omnishm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11
PAGE = mmap.PAGESIZE


def is_cache_name(cache: object) -> bool:
    """Whether ``cache`` is a valid cache name (``check_cache_name``)."""
    return isinstance(cache, str) and _NAME_RE.match(cache) is not None


def check_cache_name(cache: str) -> str:
    """Cache names go into file and segment names: letters, digits, ``_`` and ``-``."""
    if not is_cache_name(cache):
        raise ValueError(f"invalid cache name {cache!r}: use 1-64 letters, digits, '_' or '-'")
    return cache


def segment_name(cache: str, generation: str, what: str) -> str:
    return f"/{PREFIX}.{cache}.{generation}.{what}"


def parse_segment_name(name: str) -> tuple[str, str, str] | None:
    """``(cache, generation, what)`` of an omnishm segment name, else None."""
    name = name.lstrip("/")
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[0] != PREFIX:
        return None
    return parts[1], parts[2], parts[3]


def list_segments(cache: str | None = None) -> list[str]:
    """Names (with leading ``/``) of this user's omnishm segments in /dev/shm, optionally of one cache.

    Another user's segments (0600, so unreadable anyway) are never listed: another
    user's cache of the same name is none of ours to adopt, sweep or clean up.
    """
    out = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return out
    uid = os.geteuid()
    for entry in entries:
        parsed = parse_segment_name(entry)
        if parsed is None:
            continue
        if cache is not None and parsed[0] != cache:
            continue
        try:
            if os.stat(SHM_DIR / entry).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        out.append("/" + entry)
    return sorted(out)


def unlink_segment(name: str) -> bool:
    """Unlink by name; False when it was already gone (or is not ours to unlink)."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False


OWNER = "owner"
"""The segment a committer holds an exclusive ``flock`` on for as long as it serves its generation."""


def flock_within(fd: int, patience_s: float) -> bool:
    """``LOCK_EX`` on ``fd``, retried for ``patience_s``: the probes (``cache_is_live``: a client's autostart
    check, ``omnishm ping``; ``generation_owned``) hold their lock for microseconds, and a committer that
    takes the cache lock or an owner segment must wait them out, not take them for a live holder."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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

    def release(self, *, unlink: bool) -> None:
        """Drop the claim; ``unlink`` also removes the segment (while still holding the lock)."""
        if self._fd < 0:
            return
        if unlink:
            unlink_segment(self.name)
        os.close(self._fd)
        self._fd = -1


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


class Segment:
    """One mapped POSIX shared-memory segment.

    Owned by whoever created or attached it; ``unlink`` is called only by the
    committer (the creator). Dropping the object unmaps once no tensor view of
    it remains, because every view holds the ``mmap`` alive.
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, *, readonly: bool, created: bool):
        self.name = name
        self.size = size
        self.readonly = readonly
        self.created = created
        self._mmap: mmap.mmap | None = mm

    @classmethod
    def create(cls, name: str, size: int, *, prefault: bool = False, mlock: bool = False) -> "Segment":
        """Create a new 0600 segment of ``size`` bytes (fails if the name exists).

        Raises OSError(ENOSPC) when /dev/shm cannot hold it; the name is then
        unlinked again so nothing is left behind. Raises FileExistsError when the
        name exists (left by someone else: never reused).
        """
        size = max(int(size), 1)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError as exc:
            raise FileExistsError(errno.EEXIST, f"shared memory segment {name} already exists") from exc
        try:
            os.fchmod(shm.fd, 0o600)  # mode is filtered by umask; make it exact
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, f"No space left on device: {SHM_DIR} cannot hold segment {name} of "
                                            f"{size / 2**20:.1f} MiB ({_free_mib()} MiB free)") from None
            mm = mmap.mmap(shm.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            shm.close_fd()
            unlink_segment(name)
            raise
        shm.close_fd()
        seg = cls(name, mm, size, readonly=False, created=True)
        if prefault:
            seg.prefault()
        if mlock:
            seg.mlock()
        return seg

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> "Segment":
        """Map an existing segment; read-only maps cannot be written (the OS enforces it)."""
        flags = os.O_RDONLY if readonly else os.O_RDWR
        try:
            shm = posix_ipc.SharedMemory(name, 0, read_only=readonly)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"shared memory segment {name} does not exist") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(errno.EACCES, f"no permission to map {name}: it belongs to another user") from exc
        del flags
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(errno.EACCES, f"segment {name} is owned by uid {st.st_uid}, not us")
            size = st.st_size
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(shm.fd, size, mmap.MAP_SHARED, prot)
        finally:
            shm.close_fd()
        return cls(name, mm, size, readonly=readonly, created=False)

    @property
    def mmap(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    def _view_numel(self, shape: tuple[int, ...], itemsize: int, offset: int) -> int:
        """Elements of a view of ``shape`` at byte ``offset``; raises ``ValueError`` when it overruns the segment."""
        numel = 1
        for dim in shape:
            numel *= int(dim)
        if offset + numel * itemsize > self.size:
            raise ValueError(f"view of {numel * itemsize} bytes at {offset} exceeds segment {self.name} ({self.size})")
        return numel

    def array(self, dtype: np.dtype | str, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A zero-copy numpy view of ``shape`` at byte ``offset`` (read-only where the map is); it keeps the
        mapping alive. The committer's views: numpy, not torch (``protocol.DTYPE_ITEMSIZE``)."""
        import numpy as np  # here, not at module scope: the CLI's cleanup and lock use this module

        dt = np.dtype(dtype)
        numel = self._view_numel(shape, dt.itemsize, offset)
        return np.frombuffer(self.mmap, dtype=dt, count=numel, offset=offset).reshape(shape)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A zero-copy view of ``shape`` at byte ``offset``; it keeps the mapping alive."""
        import torch  # here, not at module scope: the committer's option parsing and lock use this module

        numel = self._view_numel(shape, torch.empty((), dtype=dtype).element_size(), offset)
        # A normal tensor even when made under torch.inference_mode (vLLM runs execute_model in it): an
        # inference tensor may not be written outside that mode, and other threads (the flusher, a
        # materialize on a pool thread) write these views.
        with warnings.catch_warnings(), torch.inference_mode(False):
            if numel == 0:  # torch.frombuffer refuses an empty view
                return torch.empty(shape, dtype=dtype)
            # Read-only maps: torch warns that the buffer is not writable. The
            # mapping is PROT_READ, so a stray write faults instead of
            # corrupting the shared pool; readers only ever copy out of it.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.mmap, dtype=dtype, count=numel, offset=offset).view(shape)

    def prefault(self) -> float:
        """Fault every page in now (creation time) so first writes do not; returns seconds."""
        t0 = time.perf_counter()
        try:
            self.mmap.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            view = memoryview(self.mmap)
            for off in range(0, self.size, PAGE):
                view[off] = view[off]
            view.release()
        return time.perf_counter() - t0

    def mlock(self) -> bool:
        """Page-lock the mapping; False (logged) when RLIMIT_MEMLOCK refuses."""
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        buf = (ctypes.c_char * self.size).from_buffer(self.mmap)
        try:
            rc = libc.mlock(ctypes.addressof(buf), ctypes.c_size_t(self.size))
        finally:
            del buf
        if rc != 0:
            logger.warning("mlock of %s (%d bytes) failed: %s", self.name, self.size,
                           os.strerror(ctypes.get_errno()))
            return False
        return True

    def unlink(self) -> bool:
        return unlink_segment(self.name)

    def close(self) -> None:
        """Drop this object's reference; the pages unmap when the last view is gone."""
        self._mmap = None


# ---------------------------------------------------------------------------
# runtime directory, lock files and the orphan sweep


def ensure_runtime_dir(path: Path | str | None = None) -> Path:
    """Create (0700) or validate the socket and lock directory.

    Refuses a directory owned by another user or writable by group/others: a
    socket or lock file there could be replaced by someone else.
    """
    path = Path(path) if path is not None else default_runtime_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"runtime dir {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"runtime dir {path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"runtime dir {path} has mode {stat.S_IMODE(st.st_mode):04o}; others could replace our socket. "
            f"Run `chmod 700 {path}` or pick another runtime dir (--runtime-dir, OMNISHM_RUNTIME_DIR, runtime_dir=)")
    return path


def socket_in_use(path: Path) -> bool:
    """Whether a live process listens on the unix socket ``path`` (a connect succeeds): a socket file is
    stale, and may be replaced, only when a connect is refused. The cache lock guards a cache's default
    socket; an explicit endpoint may be named by committers of other caches or runtime dirs too (trap 4)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # cannot tell (a full backlog, a timeout, no permission): never take it over
    finally:
        probe.close()
    return True


def check_socket_path(path: Path) -> None:
    """A client's check before it connects to an ipc socket: the directory and socket are ours.

    The directory, if it exists, must be a real directory owned by us that nobody else can write
    (else another user could have put their own socket there and read our Hello and descriptors);
    the socket, if it exists, must be ours. A sticky shared directory such as ``/tmp`` is
    accepted once our socket is there: nobody else can remove or replace it then. Before it is there,
    anyone may bind a socket of their own at the name, and a client that connected would send them its
    Hello and descriptors (review: it did); so there the socket must exist, and be ours, when the client
    connects: a committer is started before its clients (autostart needs a directory of our own). A
    directory that does not exist yet is refused too (the runtime dir, the client makes first: ``CommitterLink``).
    Raises PermissionError naming the path.
    """
    if str(path).startswith("@"):
        return  # Linux abstract socket: no file, no directory
    try:
        st = path.parent.lstat()
    except FileNotFoundError:
        # Whoever made it next would own it: another user, whose socket there got our Hello (review).
        raise PermissionError(f"socket directory {path.parent} does not exist: make it (mode 0700) before the "
                              f"client connects, or use the runtime dir, which the client makes") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"socket directory {path.parent} is not a directory (a symlink?)")
    private = st.st_uid == os.geteuid() and not st.st_mode & 0o022
    sticky_shared = bool(st.st_mode & stat.S_ISVTX) and st.st_uid in (0, os.geteuid())
    if not private and not sticky_shared:
        raise PermissionError(f"socket directory {path.parent} is owned by uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):04o}; it must be ours (uid {os.geteuid()}) and "
                              f"writable by nobody else")
    try:
        sock_uid = path.lstat().st_uid
    except FileNotFoundError:
        if private:
            return
        raise PermissionError(f"socket {path} does not exist yet in the shared directory {path.parent}: anyone may "
                              f"bind a socket there first and read this client's messages; start the committer "
                              f"first, or use a directory of your own") from None
    if sock_uid != os.geteuid():
        raise PermissionError(f"socket {path} belongs to uid {sock_uid}, not to us (uid {os.geteuid()})")


def _free_mib() -> str:
    """Free bytes of SHM_DIR in MiB, as text ("?" when it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "?"
    return f"{st.f_bavail * st.f_frsize / 2**20:.1f}"


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
        while True:
            fd = _open_own_file(path)
            if not flock_within(fd, 0.2):  # a live committer holds it for good; a probe for microseconds
                ino = os.fstat(fd).st_ino
                os.close(fd)
                if _replaced_soon(path, ino, 0.2):
                    continue  # a sweeper held it to remove a dead committer's file: take the new one
                return None
            if still_names(path, fd):  # else take it again on the current file
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{generation} {os.getpid()}\n".encode())
        return cls(path, fd)

    @staticmethod
    def holder(path: Path) -> tuple[str, int] | None:
        """``(generation, pid)`` a committer wrote into lock file ``path``; None when it is gone or reads
        otherwise (not a committer's: a shared runtime dir holds other programs' locks too)."""
        try:
            with open(path, "rb") as f:
                parts = f.read(256).split()
        except OSError:
            return None
        if len(parts) != 2 or not parts[1].isdigit():
            return None
        return parts[0].decode(errors="replace"), int(parts[1])

    def release(self, *, remove: bool = True) -> None:
        if self.fd < 0:
            return
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = -1


def _open_own_file(path: Path) -> int:
    """Open (creating, 0600) a lock file that is a plain file of ours with one name; raises PermissionError.

    A socket's lock file may sit in a shared sticky directory such as /tmp, where another user can put a
    symlink (a root committer truncated and wrote the file it pointed to: review), a hard link, or a file of
    their own held locked (which blamed "a running committer" for it) at the name first."""
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
    path = lock_path(runtime_dir, cache)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
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
