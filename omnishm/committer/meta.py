"""What a restarted committer needs to adopt a live cache, and how it knows the cache is live.

The control segment (``/omnishm.<cache>.<generation>.ctl``) is the cache's
anchor. Its first ``CTL_WORDS`` int64 words are the control words clients map
(``omnishm.protocol``); from ``META_OFFSET`` on it carries the cache's
metadata: layout, keys (name, index, dtype, width), the highest writer epoch
handed out, and every writer welcomed and not dropped (client id, staging
rows, epoch). A writer's staging segments are found by name
(``stage.<client>.k<index>``), so making one changes nothing here. Only the
committer writes it, at every change of that state (first layout,
``open_key``, dropped client, new epoch), never on the write path.

Torn writes: the metadata has two slots. A write goes to the slot the current
one is not in, with a sequence number one higher and a CRC32 over sequence,
length and JSON body; a reader takes the valid slot with the highest sequence.
A committer SIGKILLed in the middle of a write leaves the previous slot intact.

Client liveness: every client holds ``flock(LOCK_SH)`` on the control
segment's fd for as long as it is attached (``omnishm.client.attach``). The
kernel drops it when the client dies. A starting committer probes it with
``LOCK_EX|LOCK_NB``: refused means a client is still attached, so the cache
is adopted; granted means nobody is left, so the cache is swept.

Single-threaded: only the committer's server loop (and ``main`` before it)
calls into this module.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from typing import Any


from omnishm import liveness, protocol, shm

logger = logging.getLogger(__name__)

META_VERSION = 2
"""2: each key records its row shape (1 had none: such a cache is not adopted)."""
META_OFFSET = 4096
"""Byte offset of the metadata area in the control segment (the control words come first)."""
SLOT_BYTES = 64 << 10
_HEADER = struct.Struct("<QQI4x")  # seq, length, crc32
CTL_BYTES = META_OFFSET + 2 * SLOT_BYTES
assert (protocol.CTL_HITS_AT + 2 * protocol.CTL_HITS_RING) * 8 <= META_OFFSET  # the hits ring ends before


class MetaError(Exception):
    """Metadata missing, torn in both slots, of another version, or too large."""


def _crc(seq: int, body: bytes) -> int:
    return zlib.crc32(body, zlib.crc32(struct.pack("<QQ", seq, len(body))))


def write(mm, doc: dict[str, Any], seq: int) -> int:
    """Write ``doc`` as sequence ``seq`` into slot ``seq % 2`` of ``mm``; returns ``seq``.

    Raises MetaError when the JSON does not fit a slot (the caller logs it; the
    previous slot stays valid, so a restart adopts the older state).
    """
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    if _HEADER.size + len(body) > SLOT_BYTES:
        raise MetaError(f"cache metadata of {len(body)} bytes does not fit a {SLOT_BYTES}-byte slot")
    off = META_OFFSET + (seq % 2) * SLOT_BYTES
    # Body first, header last: a torn write fails the CRC and the other slot wins.
    mm[off + _HEADER.size: off + _HEADER.size + len(body)] = body
    mm[off: off + _HEADER.size] = _HEADER.pack(seq, len(body), _crc(seq, body))
    return seq


def read(mm) -> tuple[int, dict[str, Any]]:
    """``(seq, doc)`` of the newest valid slot; raises MetaError when neither slot is valid."""
    best: tuple[int, dict[str, Any]] | None = None
    problems = []
    for slot in (0, 1):
        off = META_OFFSET + slot * SLOT_BYTES
        if len(mm) < off + _HEADER.size:
            problems.append(f"slot {slot}: segment too small ({len(mm)} bytes)")
            continue
        seq, length, crc = _HEADER.unpack(mm[off: off + _HEADER.size])
        if seq == 0 or length > SLOT_BYTES - _HEADER.size:
            problems.append(f"slot {slot}: empty")
            continue
        body = bytes(mm[off + _HEADER.size: off + _HEADER.size + length])
        if _crc(seq, body) != crc:
            problems.append(f"slot {slot}: checksum mismatch (torn write)")
            continue
        try:
            doc = json.loads(body)
        except ValueError as exc:
            problems.append(f"slot {slot}: bad JSON ({exc})")
            continue
        if best is None or seq > best[0]:
            best = (seq, doc)
    if best is None:
        raise MetaError("no valid metadata in the control segment: " + "; ".join(problems))
    torn = [p for p in problems if not p.endswith(": empty")]
    if torn:  # the other slot holds the state before the last change, which a crash in its save lost
        logger.warning("metadata of the control segment: %s; using the other slot (sequence %d)", "; ".join(torn),
                       best[0])
    if best[1].get("version") != META_VERSION:
        raise MetaError(f"metadata version {best[1].get('version')!r}, this committer reads {META_VERSION}")
    return best


def live_generations(cache: str) -> list[str]:
    """Generations of ``cache`` in /dev/shm whose control segment has an attached client and whose
    committer is gone (a generation a live committer owns, from any runtime dir, is never adopted)."""
    gens = sorted({shm.parse_segment_name(n)[1] for n in shm.list_segments(cache)})  # type: ignore[index]
    return [g for g in gens if liveness.clients_attached(shm.segment_name(cache, g, "ctl"))
            and not liveness.generation_owned(cache, g)]


def empty_doc(cache: str, generation: str, layout: protocol.Layout) -> dict[str, Any]:
    return {"version": META_VERSION, "cache": cache, "generation": generation,
            "num_blocks": layout.num_blocks, "block_size": layout.block_size,
            "key_specs": {}, "keys": [], "epoch": 0, "writers": {}}
