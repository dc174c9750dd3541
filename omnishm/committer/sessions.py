"""Client sessions of one committer: roles, liveness, reaping.

Single-threaded: only the committer's server loop touches a ``SessionTable``.
A session is keyed by the ROUTER identity of the client's DEALER socket; any
message from that identity refreshes its liveness. Its ``client_id`` (a uuid
the client chose) survives the socket: a client that lost its committer
resumes on a new socket, and the session moves to the new identity
(``rekey``). A committer that adopted a live cache holds a placeholder
session (``adopted``) for each writer it found, so a writer that never comes
back is reaped like a silent one. Placeholders have no socket: they are kept
apart from the sessions by identity, so no message is ever taken as one's
(a DEALER can choose any routing id, so no identity is out of a peer's reach).
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
    """The ROUTER identity of the client's socket; ``b""`` for a placeholder (``adopted``)."""
    client_id: str
    role: str
    pid: int
    uid: int
    attached_at: float
    last_seen: float
    """When its silence began, for reaping: its last message, moved later by time the committer stood still
    (``SessionTable.credit``)."""
    staging_rows: int = 0
    epoch: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    adopted: bool = False
    """Placeholder of a writer found by an adopting restart; no socket until it resumes."""
    resumes: int = 0
    started: str | None = None
    """Its process's start time (``liveness.proc_identity`` of ``pid``) at its Hello, when the committer's
    ``/proc`` confirmed it (``attach.confirmed_start``): a process since gone is a killed client's
    (``attach.process_gone``)."""
    heard_at: float = field(init=False)
    """When its last message came, never credited: whether it is likely dead (``Attach._reaped_soon``)."""

    def __post_init__(self) -> None:
        self.heard_at = self.last_seen

    def heard(self, now: float) -> None:
        """A message from the client came at ``now``."""
        self.last_seen = self.heard_at = now

    @property
    def is_data_client(self) -> bool:
        """Writers and readers keep an ``--exit-when-idle`` committer alive; admin tools do not."""
        return self.role in (protocol.ROLE_WRITER, protocol.ROLE_READER)


class SessionTable:
    """Sessions by identity, placeholders by client_id, plus the (at most one) writer."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, Session] = {}
        self._placeholders: dict[str, Session] = {}
        """Adopted writers not resumed yet, by client_id: never found by ``get`` or ``touch``."""
        self.writer: Session | None = None
        self.ever_had_data_client = False
        self.reaped = 0
        self.resumed = 0
        self.reaped_ids: OrderedDict[str, str] = OrderedDict()
        """client_id -> why it was reaped (bounded): a late resume is refused with the reason."""
        self.reaped_identities: OrderedDict[bytes, str] = OrderedDict()
        """ROUTER identity -> client_id of reaped sessions (bounded): late writes are failed and counted."""

    def __len__(self) -> int:
        return len(self._by_identity) + len(self._placeholders)

    def __iter__(self):
        return iter(self._all())

    def _all(self) -> list[Session]:
        return [*self._by_identity.values(), *self._placeholders.values()]

    def get(self, identity: bytes) -> Session | None:
        """The session of the socket ``identity``; never a placeholder."""
        return self._by_identity.get(identity)

    def add(self, session: Session) -> None:
        """Register ``session``, a placeholder when ``session.adopted`` (the caller has checked the writer slot
        is free and that no session holds ``session.identity``)."""
        if session.adopted:
            session.identity = b""
            self._placeholders[session.client_id] = session
        else:
            self._by_identity[session.identity] = session
        if session.role == protocol.ROLE_WRITER:
            self.writer = session
        if session.is_data_client:
            self.ever_had_data_client = True

    def remove(self, session: Session) -> None:
        """Forget ``session`` (live or placeholder); a no-op when it is not registered."""
        table = self._placeholders if session.adopted else self._by_identity
        key = session.client_id if session.adopted else session.identity
        if table.get(key) is session:
            del table[key]
        if self.writer is session:
            self.writer = None

    def by_client(self, client_id: str) -> Session | None:
        for s in self._all():
            if s.client_id == client_id:
                return s
        return None

    def rekey(self, session: Session, identity: bytes, now: float) -> None:
        """Move ``session`` (live, or a placeholder) to the socket ``identity`` (a resume); it is live again from
        ``now``. The caller has detached any other session of ``identity``."""
        was_writer = self.writer is session
        self.remove(session)
        if was_writer:
            self.writer = session
        session.identity = identity
        session.adopted = False
        session.heard(now)
        session.resumes += 1
        self.resumed += 1
        self._by_identity[identity] = session

    def mark_reaped(self, session: Session, why: str, keep: int = 4096) -> None:
        self.reaped += 1
        self.reaped_ids[session.client_id] = why
        # Only a writer's socket: a later StepWrite from it is answered as the reaped writer's failed writes. A
        # reaped reader's or admin's was answered so too, and counted as a writer's (review, 2026-12-06).
        if not session.adopted and session.role == protocol.ROLE_WRITER:  # a placeholder had no socket
            self.reaped_identities[session.identity] = session.client_id
        while len(self.reaped_ids) > keep:
            self.reaped_ids.popitem(last=False)
        while len(self.reaped_identities) > keep:
            self.reaped_identities.popitem(last=False)

    def touch(self, identity: bytes, now: float) -> Session | None:
        session = self._by_identity.get(identity)
        if session is not None:
            session.heard(now)
        return session

    def credit(self, seconds: float, now: float) -> None:
        """Take ``seconds`` in which the committer's loop stood still off every session's silence (up to
        ``now``): placeholders of adopted writers included, whose clock runs from adoption."""
        for s in self._all():
            s.last_seen = min(now, s.last_seen + seconds)

    def expired(self, now: float, timeout_s: float) -> list[Session]:
        """Sessions silent for longer than ``timeout_s`` (not removed; the caller reaps)."""
        return [s for s in self._all() if now - s.last_seen > timeout_s]

    def readers(self) -> int:
        return sum(1 for s in self._by_identity.values() if s.role == protocol.ROLE_READER)

    def data_clients(self) -> int:
        return sum(1 for s in self._all() if s.is_data_client)

    def idle(self) -> bool:
        """True once a writer/reader has attached and none remains."""
        return self.ever_had_data_client and self.data_clients() == 0

    def describe(self, now: float) -> list[dict]:
        out = []
        for s in self._all():
            entry = {"client_id": s.client_id, "role": s.role, "pid": s.pid,
                     "last_seen_s_ago": round(now - s.heard_at, 3),
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
