"""Where a cache's files live: the runtime dir, its socket, its default endpoint.

The one place for these rules, and for the checks that a directory or socket there is ours before a
committer binds or a client connects. Standard library only, so the CLI's admin commands and the
configuration code use it without importing torch.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def default_runtime_dir() -> Path:
    """``$OMNISHM_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/omnishm``, else ``/tmp/omnishm-<uid>``."""
    env = os.environ.get("OMNISHM_RUNTIME_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "omnishm"
    return Path(f"/tmp/omnishm-{os.geteuid()}")


def socket_path(runtime_dir: Path, cache: str) -> Path:
    return Path(runtime_dir) / f"{cache}.sock"


def ipc_path(endpoint: str) -> Path | None:
    """Filesystem path of an ``ipc://`` endpoint (None for any other transport)."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def ipc_endpoint(runtime_dir: Path | None, cache: str) -> str:
    """The default endpoint of ``cache``: its socket in ``runtime_dir`` (default: ``default_runtime_dir()``)."""
    return f"ipc://{socket_path(runtime_dir if runtime_dir is not None else default_runtime_dir(), cache)}"


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
    socket; an explicit endpoint may be named by committers of other caches or runtime dirs too (trap 4).
    Whatever is there that is not a socket (a regular file, a link) is never taken over either: True. A connect
    to a regular file is refused too, and a committer whose endpoint named a user's file unlinked the file and
    bound its socket there (review, stop 51)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return True
    except FileNotFoundError:
        return False
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
