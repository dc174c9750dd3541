"""Named POSIX shared-memory segments, mapped as torch tensor views (clients) or numpy arrays (the committer).

One naming scheme for every segment omnishm makes::

    /omnishm.<cache>.<generation>.<what>

``cache`` is the cache (and committer) name, ``generation`` the committer
instance that created it, ``what`` the purpose (``ctl``, ``pool.k0``,
``claim.k0``, ``commit.k0``, ``stage.<client>.k0``). Segments are created
0600 by the committer only, reserved with ``posix_fallocate`` (a full
``/dev/shm`` fails cleanly with ENOSPC instead of a later SIGBUS, trap 3) and
optionally pre-faulted.

Which segments are alive is ``omnishm.liveness``'s: a segment of a cache whose
committer holds no lock is an orphan (the committer was SIGKILLed, trap 1), and
``omnishm.orphans.sweep`` unlinks it. Views never outlive their mapping: every tensor made by
``Segment.tensor`` (the clients') and every array made by ``Segment.array`` (the
committer's) holds a reference to the ``mmap`` (trap 5), and nothing in omnishm
calls ``mmap.close`` explicitly.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import posix_ipc

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "omnishm"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: "$" also matches before a final newline
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11
PAGE = mmap.PAGESIZE


def is_cache_name(cache: object) -> bool:
    """Whether ``cache`` is a valid cache name (``check_cache_name``)."""
    return isinstance(cache, str) and _NAME_RE.fullmatch(cache) is not None


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


def _free_mib() -> str:
    """Free bytes of SHM_DIR in MiB, as text ("?" when it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "?"
    return f"{st.f_bavail * st.f_frsize / 2**20:.1f}"
