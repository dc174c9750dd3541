"""Wire protocol between clients (DEALER) and the committer (ROUTER).

Every message is one msgpack frame of one of the Structs below, tagged by its
``type`` field, so one ``Decoder(Request)`` or ``Decoder(Reply)`` reads any of
them. Every request carries ``rid``, echoed in its reply, so a client can keep
several requests in flight on one socket.

A step's writes travel in ONE ``StepWrite``: entries are parallel packed
little-endian int64 buffers (no per-task Python objects on either side), and
the slot ids of all entries are one packed int64 buffer, entry after entry.
Entry ``i`` copies ``counts[i]`` rows starting at row ``src_rows[i]`` of the
writer's staging segment of key ``keys[key_idx[i]]`` to the pool rows
``slots[off_i : off_i + counts[i]]``, only where the claim table still holds
``cvs[i]`` (see ``omnishm.versions``). ``tids[i]`` is the write the entry
belongs to; ``StepDone`` reports every tid of the message as done or failed.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

PROTOCOL_VERSION = 5
"""4: keys carry their row shape (``OpenKey.row_shape``, ``KeySpec.row_shape``, ``KeySegments.row_shape``)."""
MAX_MESSAGE_BYTES = 64 << 20
"""Frames above this are dropped by libzmq (ZMQ_MAXMSGSIZE) before we decode them."""
MAX_ITEMS = 4096
"""Every list, tuple and map of a request holds at most this many items: a decoder refuses a longer one
from its length header, before making any item (a 64 MiB StepWrite of 22 M two-byte key names took the
committer 1.6 GiB and 2 s to decode, before the session check refused it). Far above every real use (64
keys, 63 dims, a few dozen counters): the committer's own limits refuse with their reasons below it."""
Items = msgspec.Meta(max_length=MAX_ITEMS)

ROLE_WRITER = "writer"
ROLE_READER = "reader"
ROLE_ADMIN = "admin"
ROLES = (ROLE_WRITER, ROLE_READER, ROLE_ADMIN)

# Words of the per-cache control segment (int64 each). Each word has one writer.
CTL_WORDS = 16
CTL_PUBLISHED_STEP = 0   # writer client: make_cv(epoch, step, 0) of its last step whose claims are in the claim table (-1: none)
CTL_WRITER_EPOCH = 1     # committer: epoch of the attached writer (0: none yet)
CTL_COMMITTER_PID = 2    # committer
# word 3: unused (kept so the words after it keep their places in a mixed-version restart)
CTL_ACKED_STEP = 4       # committer: make_cv(epoch, step, 0) of the writer's last quiet StepWrite applied in full
CTL_HITS_AT = CTL_WORDS  # word where the writer's ring of planned hits starts (after the control words)
CTL_HITS_RING = 240
"""Entries of the planned-hits ring (two words each; the committer maps none of them, only the writer writes them).

The entry of each step with hits, at word ``CTL_HITS_AT + 2 * (step % CTL_HITS_RING)``: ``make_cv(epoch, step, 0)``
(-1 while it is being written) and the digest of the writer's hit plan for that step (``steps.hits_digest``),
written before the step is published. A reader serves no hit row of a step whose digest is not its own: the TP
ranks must be given the same scheduler output and make the same calls, and a reader given other block ids, or
whose step ids had drifted from its writer's, served another request's or a later tenant's rows (review,
2026-12-06). The ring ends before the metadata (``committer.meta.META_OFFSET``); protocol version 5 has it."""


DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""The dtype names a ``KeySpec`` may carry (torch's names) and their bytes per element. The committer
copies rows as bytes and needs nothing more of a dtype, so it never imports torch (seconds of start-up and
~200 MiB of memory); the client maps the same names to torch dtypes (``client/segments.DTYPES``)."""


class KeySpec(msgspec.Struct, frozen=True):
    """Geometry of one tensor name: dtype (a ``DTYPE_ITEMSIZE`` name, e.g. ``bfloat16``), row width and
    row shape (the dims of one token's row; their product is ``width``). ``row_shape`` None: not declared
    (a Hello's layout may leave it out); the first ``OpenKey`` of the key fixes it. A reader's Hello layout
    is only checked against the cache's specs, never adds one."""

    dtype: str
    width: int
    row_shape: Annotated[tuple[int, ...], Items] | None = None


class Layout(msgspec.Struct, frozen=True):
    """Layout fingerprint: must match the committer's before a client attaches."""

    num_blocks: int
    block_size: int
    keys: Annotated[dict[str, KeySpec], Items] = {}


class KeySegments(msgspec.Struct, frozen=True):
    """Where one tensor name lives: pool, claim and commit table, and (writer) staging."""

    key: str
    index: int
    dtype: str
    width: int
    row_shape: tuple[int, ...]
    pool: str
    claim: str
    commit: str
    staging: str | None = None
    staging_rows: int = 0


# ---------------------------------------------------------------- requests


class Hello(msgspec.Struct, tag="hello"):
    rid: int
    protocol: int
    client_id: str
    pid: int
    uid: int
    role: str
    cache: str
    layout: Layout | None = None
    staging_rows: int = 0
    heartbeat_s: float | None = None
    resume: bool = False
    """Re-attach after the committer was lost: same ``client_id``; the committer
    re-registers the session with its existing staging (see docs/FAULTS.md)."""
    resume_generation: str = ""
    resume_epoch: int = 0
    resume_staging: Annotated[list[str], Items] = []
    started: str = ""
    """The client process's start time as its own ``/proc`` shows it (``liveness.proc_identity``). The
    committer trusts ``pid`` to name this client only when its ``/proc`` shows that pid with this start
    time: a client in another pid namespace names a pid of its own, maybe an unrelated process's here."""


class OpenKey(msgspec.Struct, tag="open_key"):
    """Open (writer) or map (reader) one tensor name. Every row of a key has one dtype and one row shape
    for the life of the cache, fixed by its first ``OpenKey`` (or a writer's Hello layout that declares it): an
    ``OpenKey`` that names another is refused (``layout_mismatch``), so a row is never read back in a shape
    it was not written in. ``row_shape`` None: flat rows, ``(width,)``; at most 63 dims."""

    rid: int
    key: str
    dtype: str
    width: int
    row_shape: Annotated[tuple[int, ...], Items] | None = None

    def spec(self) -> KeySpec:
        """The rows this open asks for, with their row shape made concrete."""
        return KeySpec(self.dtype, self.width, (self.width,) if self.row_shape is None else tuple(self.row_shape))


class StepWrite(msgspec.Struct, tag="step_write"):
    rid: int
    step: int
    keys: Annotated[list[str], Items]
    key_idx: bytes
    tids: bytes
    cvs: bytes
    src_rows: bytes
    counts: bytes
    slots: bytes
    quiet: bool = False
    """Applied in full: no reply; the committer stores the step's marker in ``CTL_ACKED_STEP`` instead.
    Anything else (a rejected or partly failed step) is answered as usual."""


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    rid: int
    counters: Annotated[dict[str, float], Items] = {}


class StatusRequest(msgspec.Struct, tag="status"):
    rid: int


class Goodbye(msgspec.Struct, tag="goodbye"):
    rid: int
    counters: Annotated[dict[str, float], Items] = {}
    """The client's final counters, so nothing counted after its last heartbeat is lost."""


Request = Union[Hello, OpenKey, StepWrite, Heartbeat, StatusRequest, Goodbye]


# ---------------------------------------------------------------- replies


class Welcome(msgspec.Struct, tag="welcome"):
    rid: int
    client_id: str
    generation: str
    epoch: int
    control: str
    layout: Layout
    keys: list[KeySegments]
    heartbeat_s: float
    heartbeat_timeout_s: float
    committer_pid: int
    resumed: bool = False
    instance: str = ""
    """Id of the committer process (its generation is the cache's, kept across an adopting restart)."""
    writer_epoch: int = 0
    """Epoch of the writer attached at this welcome (0: none; a writer's own welcome names itself)."""


class Refused(msgspec.Struct, tag="refused"):
    rid: int
    reason: str
    retry_after_s: float = 0.0
    """> 0: what is in the way is a client silent for a while, which the committer reaps once its heartbeat
    timeout passes (a killed engine's writer, say): the same Hello may succeed after about this long."""


class KeyOpened(msgspec.Struct, tag="key_opened"):
    rid: int
    segments: KeySegments


class StepDone(msgspec.Struct, tag="step_done"):
    rid: int
    step: int
    done_tids: bytes
    failed_tids: bytes = b""
    reason: str = ""
    rows_written: int = 0
    rows_skipped: int = 0

    def failure(self) -> str:
        """Why the write failed, "" when it did not: failed tids, or a reason alone (the refusal of a step
        whose tids field was empty fails none, and was once taken for success)."""
        if self.reason:
            return self.reason
        return "tids failed" if self.failed_tids else ""


class HeartbeatAck(msgspec.Struct, tag="heartbeat_ack"):
    rid: int
    readers: int = 0
    writer: bool = False
    writer_epoch: int = 0
    """Epoch of the writer attached when this heartbeat was answered (0: none); readers use it to see
    their writer leave (``ReadSide._writer_left``)."""


class StatusReply(msgspec.Struct, tag="status_reply"):
    rid: int
    status: dict


class Error(msgspec.Struct, tag="error"):
    rid: int
    code: str
    message: str


class Bye(msgspec.Struct, tag="bye"):
    rid: int


Reply = Union[Welcome, Refused, KeyOpened, StepDone, HeartbeatAck, StatusReply, Error, Bye]

_request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _request_encoder.encode(msg)


MAX_REPLY_TEXT = 4000
"""The most characters of an ``Error.message`` or a ``Refused.reason`` the committer sends (``cut_text``): each
input a reply echoes is cut already (``shown``); this bounds what a message built from several could add up to."""


def cut_text(text: str, limit: int = MAX_REPLY_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def shown(value: object, limit: int = 80) -> str:
    """repr of a client-supplied value for a log line or a reply, cut to ``limit`` characters: bad input can be
    megabytes, and a reply echoing it whole could pass the peer's ``ZMQ_MAXMSGSIZE`` (the connection dropped
    instead of the error delivered)."""
    return cut_text(repr(value), limit)
