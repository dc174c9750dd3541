"""Permissions end to end: 0600 segments, 0700 socket dir, refused directories, other users locked out."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from omnishm import protocol, shm

from conftest import REPO, RUNTIME_DIR, unique_cache_name
from helpers import RawClient, Writer

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)
OTHER_UID = 65534


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_segments_socket_and_lock_are_private(committer_factory):
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    writer.open_key("k", "float32", 4)
    segs = shm.list_segments(handle.name)
    assert len(segs) == 6  # owner, ctl, pool, claim, commit, staging
    for seg in segs:
        st = os.stat(shm.SHM_DIR / seg.lstrip("/"))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), (seg, oct(st.st_mode))
    assert _mode(RUNTIME_DIR) == 0o700
    assert _mode(RUNTIME_DIR / f"{handle.name}.sock") == 0o600
    assert _mode(RUNTIME_DIR / f"{handle.name}.lock") == 0o600
    writer.goodbye()


@pytest.mark.parametrize("problem", ["world_writable", "group_writable", "other_owner"])
def test_committer_refuses_a_runtime_dir_others_could_write(problem):
    if problem == "other_owner" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    with tempfile.TemporaryDirectory() as tmp:
        rd = Path(tmp) / "rt"
        rd.mkdir(mode=0o700)
        if problem == "world_writable":
            os.chmod(rd, 0o777)
        elif problem == "group_writable":
            os.chmod(rd, 0o770)
        else:
            os.chown(rd, OTHER_UID, OTHER_UID)
        name = unique_cache_name("perm")
        proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", name, "--runtime-dir", str(rd)],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 2, proc.stderr
        expect = "owned by uid" if problem == "other_owner" else "others could replace our socket"
        assert expect in proc.stderr, proc.stderr
        assert os.listdir(rd) == [] and shm.list_segments(name) == []


def test_client_declaring_another_uid_is_refused(committer_factory):
    handle = committer_factory()
    raw = RawClient(handle.endpoint, handle.name)
    try:
        reply = raw.call(protocol.Hello(rid=1, protocol=protocol.PROTOCOL_VERSION, client_id=raw.client_id,
                                        pid=os.getpid(), uid=OTHER_UID, role=protocol.ROLE_READER, cache=handle.name,
                                        layout=LAYOUT))
        assert isinstance(reply, protocol.Refused) and f"client uid {OTHER_UID}" in reply.reason
    finally:
        raw.close()


_OTHER_USER_CLIENT = textwrap.dedent("""
    import json, os, sys
    import posix_ipc, zmq                       # loaded as root, before dropping privileges
    segs, sock_path, runtime_dir = json.loads(sys.argv[1])
    os.setgroups([]); os.setgid({uid}); os.setuid({uid})
    out = {{"uid": os.geteuid(), "mapped": [], "denied": [], "listdir": None, "reply": None}}
    for name in segs:
        try:
            posix_ipc.SharedMemory(name, 0, read_only=True)
            out["mapped"].append(name)
        except posix_ipc.PermissionsError:
            out["denied"].append(name)
    try:
        os.listdir(runtime_dir)
        out["listdir"] = "allowed"
    except PermissionError:
        out["listdir"] = "denied"
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("ipc://" + sock_path)
    s.send(b"\\x80")                              # any request: a reachable committer answers every frame
    out["reply"] = "answered" if s.poll(1500) else "unreachable"
    print(json.dumps(out))
""").format(uid=OTHER_UID)


def test_client_of_another_user_cannot_map_segments_or_reach_the_socket(committer_factory):
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    writer.open_key("k", "float32", 4)
    segs = shm.list_segments(handle.name)
    arg = json.dumps([segs, str(RUNTIME_DIR / f"{handle.name}.sock"), str(RUNTIME_DIR)])
    proc = subprocess.run([sys.executable, "-c", _OTHER_USER_CLIENT, arg], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["uid"] == OTHER_UID
    assert out["mapped"] == [] and sorted(out["denied"]) == sorted(segs)
    assert out["listdir"] == "denied" and out["reply"] == "unreachable"
    # The same probe as ourselves does reach it (the check above is not vacuous).
    reply = writer.raw.call(protocol.StatusRequest(rid=9))
    assert isinstance(reply, protocol.StatusReply)
    writer.goodbye()
