"""Client sessions of one committer: roles, liveness, reaping.

Single-threaded: only the committer's server loop touches a ``SessionTable``.
A session is keyed by the ROUTER identity of the client's DEALER socket; any
message from that identity refreshes its liveness. Its ``client_id`` (a uuid
the client chose) survives the socket: a client that lost its committer
resumes on a new socket, and the session moves to the new identity
(``rekey``). A committer that adopted a live cache holds a placeholder
session (``adopted``) for each writer it found, so a writer that never comes
back is reaped like a silent one.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from omnishm import protocol


@dataclass
class Session:
    """One attached client. ``staging_rows`` is only meaningful for the writer."""

    identity: bytes
    client_id: str
    role: str
    pid: int
    uid: int
    attached_at: float
    last_seen: float
    staging_rows: int = 0
    epoch: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    adopted: bool = False
    """Placeholder of a writer found by an adopting restart; no socket until it resumes."""
    resumes: int = 0

    @property
    def is_data_client(self) -> bool:
        """Writers and readers keep an ``--exit-when-idle`` committer alive; admin tools do not."""
        return self.role in (protocol.ROLE_WRITER, protocol.ROLE_READER)


class SessionTable:
    """Sessions by identity, plus the (at most one) writer."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, Session] = {}
        self.writer: Session | None = None
        self.ever_had_data_client = False
        self.reaped = 0
        self.resumed = 0
        self.reaped_ids: OrderedDict[str, str] = OrderedDict()
        """client_id -> why it was reaped (bounded): a late resume is refused with the reason."""
        self.reaped_identities: OrderedDict[bytes, str] = OrderedDict()
        """ROUTER identity -> client_id of reaped sessions (bounded): late writes are failed and counted."""

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self):
        return iter(list(self._by_identity.values()))

    def get(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def add(self, session: Session) -> None:
        """Register ``session`` (the caller has checked the writer slot is free)."""
        self._by_identity[session.identity] = session
        if session.role == protocol.ROLE_WRITER:
            self.writer = session
        if session.is_data_client:
            self.ever_had_data_client = True

    def remove(self, identity: bytes) -> Session | None:
        session = self._by_identity.pop(identity, None)
        if session is not None and self.writer is session:
            self.writer = None
        return session

    def by_client(self, client_id: str) -> Session | None:
        for s in self._by_identity.values():
            if s.client_id == client_id:
                return s
        return None

    def rekey(self, session: Session, identity: bytes, now: float) -> None:
        """Move ``session`` to the socket ``identity`` (a resume); it is live again from ``now``."""
        self._by_identity.pop(session.identity, None)
        session.identity = identity
        session.adopted = False
        session.last_seen = now
        session.resumes += 1
        self.resumed += 1
        self._by_identity[identity] = session

    def mark_reaped(self, session: Session, why: str, keep: int = 4096) -> None:
        self.reaped += 1
        self.reaped_ids[session.client_id] = why
        self.reaped_identities[session.identity] = session.client_id
        while len(self.reaped_ids) > keep:
            self.reaped_ids.popitem(last=False)
        while len(self.reaped_identities) > keep:
            self.reaped_identities.popitem(last=False)

    def touch(self, identity: bytes, now: float) -> Session | None:
        session = self._by_identity.get(identity)
        if session is not None:
            session.last_seen = now
        return session

    def expired(self, now: float, timeout_s: float) -> list[Session]:
        """Sessions silent for longer than ``timeout_s`` (not removed; the caller reaps)."""
        return [s for s in self._by_identity.values() if now - s.last_seen > timeout_s]

    def readers(self) -> int:
        return sum(1 for s in self._by_identity.values() if s.role == protocol.ROLE_READER)

    def data_clients(self) -> int:
        return sum(1 for s in self._by_identity.values() if s.is_data_client)

    def idle(self) -> bool:
        """True once a writer/reader has attached and none remains."""
        return self.ever_had_data_client and self.data_clients() == 0

    def describe(self, now: float) -> list[dict]:
        out = []
        for s in self._by_identity.values():
            entry = {"client_id": s.client_id, "role": s.role, "pid": s.pid,
                     "last_seen_s_ago": round(now - s.last_seen, 3),
                     "attached_s_ago": round(now - s.attached_at, 3)}
            if s.role == protocol.ROLE_WRITER:
                entry["epoch"] = s.epoch
                entry["staging_rows"] = s.staging_rows
            if s.adopted:
                entry["adopted"] = True
            if s.resumes:
                entry["resumes"] = s.resumes
            entry.update(proc_memory(s.pid))
            if s.counters:
                entry["counters"] = dict(s.counters)
            out.append(entry)
        return out


def proc_memory(pid: int) -> dict[str, int]:
    """Resident and shared bytes of ``pid`` from /proc/PID/statm; {} when unreadable."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        return {"rss_bytes": int(fields[1]) * page, "shared_bytes": int(fields[2]) * page}
    except (OSError, ValueError, IndexError):
        return {}


def monotonic() -> float:
    return time.monotonic()
