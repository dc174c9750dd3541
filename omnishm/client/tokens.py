"""What each slot's rows were computed for: the writer's token tags, and the hit check they serve.

vLLM decides a prefix hit by its own block hashes; omnishm serves the rows its pool holds at the hit's
slots. The two agree only if vLLM computed every block it hits. A block vLLM put in its prefix cache and
never computed holds the rows of the slot's previous tenant, and omnishm served them as the hit's rows with
no error: vLLM 0.32's priority scheduler did it (stop 54; the gate refuses that policy since, docs/CLIENT.md
§3). This module is the safety net for that class of fault, whatever causes it next.

- **The tag.** A row's tag is its token id and its position in its request, packed in 64 bits
  (``token_tags``; position + 1 in the high half): exact, so two distinct (token, position) pairs never
  share a tag, and 0 is free to mean "unknown".
- **Recorded by the writer**, for every slot it claims, on the engine thread (``SlotTokens.record``): the
  tag of the row's token where the integration knows it, else 0. The vLLM integration knows prompt tokens
  given as ids (``FullAttentionGroupView.step_token_tags_cpu`` for the V1 runner, ``V2StepGroupView``'s for
  the V2 runner); generated tokens are 0, since under async
  scheduling the runner's CPU copy of a step's sampled input token may not be written yet when it saves.
- **Checked by the writer** when a save takes a request's prefix hit, after the step's own tags are
  recorded (vLLM may hit blocks the same step computes): the tags of the hit request's own tokens
  (``PrefixCacheRequestEvent.token_ids``) against the tags of the hit's slots (``SlotTokens.check``).
  A position unknown on either side is not compared. On a mismatch the writer makes those slots absent, so
  its readers' reads of them raise too, and its own ``materialize`` of the request raises
  ``OmniPrefixCacheUnmatchError`` naming the first wrong position.

What it does not catch: a row whose token and position match but whose earlier tokens differ (the tag has
no chain: a chained one needs every earlier token of both requests, which the writer does not keep); the
multimodal placeholder rows of another image or clip at the same positions (every image's placeholder has
the same token id; vLLM tells them apart by the items' hashes, which the tag does not hold); rows of
generated tokens and of prompt embeddings (unknown); and a hit on rows an earlier writer of the cache
claimed (unknown to this writer: its table starts empty). A wrong row of those kinds needs vLLM to hit a
block it never computed *and* that block's previous tenant to hold the same token at the same position.

The table is the writer's alone (``SlotTokens``, owned by the manager, engine thread only, no lock); it
lives in the writer's private memory, as 8 bytes a slot, touched only where written.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any

import numpy as np

__all__ = ["SlotTokens", "hit_token_tags", "hits_token_tags", "row_tags", "run_index", "scatter_tags", "token_tag",
           "token_tags"]

_POSITION = 32
"""A tag is ``(position + 1) << 32 | token id``: the position in the high half, plus one so a known tag is
never 0."""


_MAX_ID = 1 << _POSITION
"""Token ids at or past this would reach the position half: unknown (vLLM's are int32)."""


def token_tag(token_id: int, position: int) -> int:
    """The tag of one row (plain Python, for small steps); 0 for an unknown token id (negative, or 2**32 or
    more, which would reach the position half: review, stop 55)."""
    return ((position + 1) << _POSITION) | token_id if 0 <= token_id < _MAX_ID else 0


def token_tags(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The int64 tag of each (token id, position) pair; 0 where the token id is unknown (negative, or 2**32 or
    more).

    Exact: the pair itself, packed (``token_tag``), for token ids under 2**32 (vLLM's are int32) and
    positions under 2**31 - 1, so distinct pairs never share a tag and no hash can collide."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    out = ((np.asarray(positions, dtype=np.int64) + 1) << _POSITION) | tokens
    unknown = (tokens < 0) | (tokens >= _MAX_ID)
    if unknown.any():
        out[unknown] = 0
    return out


def hit_token_tags(token_ids: Any, hit: int) -> np.ndarray | None:
    """The tags a hit of ``hit`` tokens must find, from the request's own token ids (position 0 first), or
    None when there are none to compare: no ids given, or ids that are no one-dimensional list of integers (a
    None, a float or a string in them, a Python int past 2**63). An unsigned array's values past 2**63 wrap
    negative, so those positions are unknown and not compared. Never raises: only the writer computes these,
    and a raise in ``new_step_starts`` lost the step's other events on it alone (review, stop 55). Ids past
    the ones given are not compared."""
    if token_ids is None:
        return None
    try:
        arr = np.asarray(token_ids[:hit])
    except Exception:  # noqa: BLE001 - any container numpy cannot read (a sparse tensor: NotImplementedError)
        return None
    if arr.dtype.kind not in "iu" or arr.ndim != 1 or not len(arr):
        return None  # floats or strings would be cut to numbers and compared (docs review, stop 55)
    return token_tags(arr.astype(np.int64), np.arange(len(arr), dtype=np.int64))


SMALL_STEP_ROWS = 256
"""Steps of at most this many rows are tagged in plain Python (``row_tags``): the bound the save's slot
bookkeeping uses too (``steps._SMALL_STEP``), for the same reason."""


FEW_RUNS = 8
"""Steps of more known runs than this are tagged with a fixed number of numpy calls (``run_index``): one set
of calls a run cost 1.2-1.6 ms for a step admitting 256 short prompts (real-engine review, stop 55)."""


def run_index(firsts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For runs of ``lens[i]`` items from ``firsts[i]``: every item's index (``firsts[i] + k``), in run order."""
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(firsts, lens) + offsets


def scatter_tags(rows: int, starts: np.ndarray, positions: np.ndarray, lens: np.ndarray, ids: np.ndarray,
                 known: np.ndarray | None) -> np.ndarray:
    """A step's ``rows`` tags from many runs at once: run ``i`` covers rows ``starts[i]..+lens[i]``; ``positions``,
    ``ids`` and ``known`` (None: all) hold its items flat, in run order."""
    ids = ids.astype(np.int64)
    if known is not None:
        ids[~known.astype(bool)] = -1
    out = np.zeros(rows, dtype=np.int64)
    out[run_index(starts, lens)] = token_tags(ids, positions)
    return out


def hits_token_tags(hits: list[tuple[Any, int]]) -> list[np.ndarray | None]:
    """``hit_token_tags`` of each ``(token ids, hit)``, in order. More than ``FEW_RUNS`` hits are tagged in one
    pass (a step admitting 256 requests that each hit a block spent 0.86 ms tagging them one by one: review,
    stop 55); if their ids together are no list of integers, each is tagged alone, so one request's odd ids
    leave the others checked."""
    if len(hits) <= FEW_RUNS:
        return [hit_token_tags(ids, hit) for ids, hit in hits]
    try:
        runs = [ids[:hit] if ids is not None else () for ids, hit in hits]
        lens = np.array([len(run) for run in runs], dtype=np.int64)
        flat = np.asarray(list(chain.from_iterable(runs)))
    except Exception:  # noqa: BLE001 - some request's ids are no sequence: each is judged alone
        return [hit_token_tags(ids, hit) for ids, hit in hits]
    if flat.dtype.kind not in "iu" or flat.ndim != 1 or len(flat) != int(lens.sum()):
        return [hit_token_tags(ids, hit) for ids, hit in hits]
    tags = token_tags(flat.astype(np.int64), run_index(np.zeros(len(runs), dtype=np.int64), lens))
    ends = np.cumsum(lens).tolist()
    return [tags[end - n:end] if n else None for end, n in zip(ends, lens.tolist())]


Run = tuple[int, int, Any, Any]
"""One known run of a step's rows for ``row_tags``: (first row, first position, token ids, known: None or one
bool per id); ids and masks are lists or numpy arrays."""


def row_tags(rows: int, spans: list[Run]) -> np.ndarray:
    """A step's ``rows`` tags (0 where unknown) from its known runs: ``(first row, first position, token ids,
    known)`` each, ``token ids`` a sequence or array of the run's ids and ``known`` None (all known) or one bool
    per id. Many runs (over ``FEW_RUNS``) go through ``scatter_tags``. A step of up to ``SMALL_STEP_ROWS`` rows
    is tagged in plain Python: right after the forward each numpy call on small arrays costs tens of
    microseconds of cold code (a vectorised version took 117 us a step inside figure 6's hooks arm, 37 rows a
    step)."""
    if len(spans) > FEW_RUNS:
        lens = np.array([len(ids) for _, _, ids, _ in spans], dtype=np.int64)
        flat = np.fromiter(chain.from_iterable(ids for _, _, ids, _ in spans), dtype=np.int64, count=int(lens.sum()))
        known = None
        if any(k is not None for _, _, _, k in spans):
            known = np.fromiter(chain.from_iterable(k if k is not None else [True] * len(ids)
                                                    for _, _, ids, k in spans), dtype=bool, count=len(flat))
        starts = np.array([start for start, _, _, _ in spans], dtype=np.int64)
        firsts = np.array([pos for _, pos, _, _ in spans], dtype=np.int64)
        return scatter_tags(rows, starts, run_index(firsts, lens), lens, flat, known)
    if rows <= SMALL_STEP_ROWS:
        small = array("q", bytes(8 * rows))
        for start, pos, ids, known in spans:
            ids = ids.tolist() if hasattr(ids, "tolist") else ids
            known = known.tolist() if hasattr(known, "tolist") else known
            for k, token in enumerate(ids):
                if known is None or known[k]:
                    small[start + k] = token_tag(token, pos + k)
        return np.frombuffer(small, dtype=np.int64)
    out = np.zeros(rows, dtype=np.int64)
    for start, pos, ids, known in spans:
        run = np.asarray(ids, dtype=np.int64)
        if known is not None:
            run = np.where(np.asarray(known, dtype=bool), run, -1)
        out[start:start + len(run)] = token_tags(run, np.arange(pos, pos + len(run), dtype=np.int64))
    return out


class SlotTokens:
    """The writer's tag of every slot's rows (0: unknown). Owned by the manager; engine thread only."""

    def __init__(self, num_slots: int) -> None:
        # np.zeros takes pages from the kernel on first write: slots never written cost nothing.
        self.tags = np.zeros(num_slots, dtype=np.int64)

    def record(self, slots: np.ndarray | list[int], tags: np.ndarray | None) -> None:
        """The rows at ``slots`` (in the pool, each once) now hold the rows of ``tags`` (None: unknown)."""
        self.tags[slots] = 0 if tags is None else tags

    def forget(self, slots: np.ndarray) -> None:
        """The rows at ``slots`` are no longer known."""
        self.tags[slots] = 0

    def check(self, slots: np.ndarray, expected: np.ndarray) -> tuple[int, np.ndarray]:
        """Compare the first ``len(expected)`` of ``slots`` with ``expected``: how many positions were known on
        both sides (compared), and the indices of those whose slot holds another tag."""
        held = self.tags[slots[:len(expected)]]
        known = (held != 0) & (expected != 0)
        return int(np.count_nonzero(known)), np.flatnonzero(known & (held != expected))
