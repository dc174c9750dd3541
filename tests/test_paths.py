"""The runtime dir and the socket directory checks (omnishm/paths.py).

From the mutation review of stop 51.
"""

from __future__ import annotations

import os
import socket

import pytest

from omnishm import paths

OTHER_UID = 65534


def bound_socket(directory) -> tuple[socket.socket, object]:
    """A real unix socket of ours, bound (and listening) at ``directory/c.sock``."""
    path = directory / "c.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock, path


def test_a_group_writable_directory_of_ours_is_refused_even_with_our_socket_in_it(tmp_path):
    """Contract: a socket directory is accepted as private only when it is ours and writable by nobody else
    (no group or other write bit); without the sticky bit a group member could replace our socket and read
    the client's Hello and descriptors. So a 0770 directory is refused with a PermissionError naming it, even
    while our own socket is there. Kills the mutant that checks only the others-write bit (``& 0o002``)."""
    d = tmp_path / "grp"
    d.mkdir()
    d.chmod(0o770)
    sock, path = bound_socket(d)
    try:
        with pytest.raises(PermissionError, match=f"socket directory {d} is owned by uid {os.geteuid()} with "
                                                  f"mode 0770; it must be ours"):
            paths.check_socket_path(path)
        d.chmod(0o700)
        paths.check_socket_path(path)  # the same directory made private is accepted
    finally:
        sock.close()


def test_a_sticky_directory_owned_by_another_user_is_refused(tmp_path):
    """Contract: a sticky shared directory is accepted only when root or we own it: the owner of a sticky
    directory may remove or rename anyone's file in it, so another user's 1777 directory could have our
    socket replaced by theirs. A PermissionError names the directory and its owner. Kills the mutant that
    accepts any sticky directory whoever owns it."""
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    d = tmp_path / "theirs"
    d.mkdir()
    d.chmod(0o1777)
    sock, path = bound_socket(d)
    try:
        os.chown(d, OTHER_UID, OTHER_UID)
        with pytest.raises(PermissionError, match=f"socket directory {d} is owned by uid {OTHER_UID} with mode 1777"):
            paths.check_socket_path(path)
        os.chown(d, 0, 0)
        paths.check_socket_path(path)  # root's sticky directory (as /tmp) with our socket in it: accepted
    finally:
        sock.close()


def test_a_socket_whose_listener_is_too_busy_to_accept_is_in_use_not_stale(tmp_path):
    """Contract (trap 4): a socket file is stale, and may be unlinked by a starting committer or a sweep,
    only when a connect is refused; a live listener whose accept backlog is full (a busy or stopped
    committer) answers EAGAIN, which ``socket_in_use`` must count as in use ("cannot tell: never take it
    over"). Kills the mutant that reads any other OSError as stale."""
    path = tmp_path / "busy.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    held = []
    try:
        while True:  # fill the backlog: the next connect is answered EAGAIN, never refused
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.setblocking(False)
            try:
                probe.connect(str(path))
            except BlockingIOError:
                probe.close()
                break
            held.append(probe)
            assert len(held) < 64, "the backlog never filled"
        assert paths.socket_in_use(path)
        listener.close()
        assert not paths.socket_in_use(path)  # nobody listens any more: refused, stale
    finally:
        for probe in held:
            probe.close()
        listener.close()


def test_a_socket_directory_that_is_a_file_is_refused_with_a_permission_error_naming_it(tmp_path):
    """Contract: ``check_socket_path`` raises PermissionError naming the path for every directory it will not
    connect through (callers catch PermissionError: the CLI's ``admin_request``); a "directory" that is a
    regular file of ours is refused as "not a directory", never left to a bare NotADirectoryError from the
    socket's lstat. Kills the mutant that drops the ``S_ISDIR`` check."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    not_a_dir.chmod(0o600)
    with pytest.raises(PermissionError, match=f"socket directory {not_a_dir} is not a directory"):
        paths.check_socket_path(not_a_dir / "c.sock")


def test_the_runtime_dir_is_omnishm_runtime_dir_then_xdg_then_tmp(monkeypatch, tmp_path, committer_factory):
    """Contract (``default_runtime_dir``, README): ``$OMNISHM_RUNTIME_DIR`` wins, else
    ``$XDG_RUNTIME_DIR/omnishm``, else ``/tmp/omnishm-<uid>``; and a client that names no runtime dir finds a
    committer started in ``$OMNISHM_RUNTIME_DIR`` at its default endpoint. Kills the mutant that ignores
    ``$OMNISHM_RUNTIME_DIR`` (clients then looked in the XDG or /tmp directory and found no committer)."""
    from omnishm import protocol

    from helpers import RawClient

    handle = committer_factory()  # started with --runtime-dir = conftest's $OMNISHM_RUNTIME_DIR
    raw = RawClient(paths.ipc_endpoint(None, handle.name), handle.name)
    try:
        assert isinstance(raw.hello(protocol.ROLE_ADMIN), protocol.Welcome)
    finally:
        raw.leave()
    monkeypatch.setenv("OMNISHM_RUNTIME_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert paths.default_runtime_dir() == tmp_path / "mine"
    monkeypatch.delenv("OMNISHM_RUNTIME_DIR")
    assert paths.default_runtime_dir() == tmp_path / "xdg" / "omnishm"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(paths.default_runtime_dir()) == f"/tmp/omnishm-{os.geteuid()}"
