"""What each slot's rows were computed for: the writer's token tags, and the hit check they serve.

vLLM decides a prefix hit by its own block hashes; omnishm serves the rows its pool holds at the hit's
slots. The two agree only if vLLM computed every block it hits. A block vLLM put in its prefix cache and
never computed holds the rows of the slot's previous tenant, and omnishm served them as the hit's rows with
no error: vLLM 0.32's priority scheduler did it (stop 54; the gate refuses that policy since, docs/CLIENT.md
§3). This module is the safety net for that class of fault, whatever causes it next.

- **The tag.** A row's tag is two int64 (``TAG``, ``CHAIN``; 0 in either means "unknown"):
  - its token id and its position in its request, packed (``token_tags``; position + 1 in the high half):
    exact, so two distinct (token, position) pairs never share one;
  - the **chain**: a 64-bit hash of every token of its request up to and including it (``prefix_chains``),
    since a row's outputs depend on all of them. Two prompts alike at a position but not before it (two
    filled-in templates of the same length) differ there. Prefixes that differ at one position only never
    share a chain; others by chance about once in 2**64, but it is a polynomial hash mod 2**64, so prefixes
    built to collide do, whatever the base (a review's: 100 + t and 101 - t over a 1024-token Thue-Morse
    sequence t). Unknown from the first unknown token of the prompt on.
- **Recorded by the writer**, for every slot it claims, on the engine thread (``SlotTokens.record``): the
  tags of the row's token where the integration knows it, else 0. The vLLM integration knows prompt tokens
  given as ids (``FullAttentionGroupView.step_token_tags_cpu`` for the V1 runner, ``V2StepGroupView``'s for
  the V2 runner); generated tokens are 0, since under async
  scheduling the runner's CPU copy of a step's sampled input token may not be written yet when it saves.
- **Checked by the writer** when a save takes a request's prefix hit, after the step's own tags are
  recorded (vLLM may hit blocks the same step computes): the tags of the hit request's own tokens
  (``PrefixCacheRequestEvent.token_ids``) against the tags of the hit's slots (``SlotTokens.check_runs``).
  A tag unknown on either side is not compared. On a mismatch the writer makes those slots absent, so
  its readers' reads of them raise too, and its own ``materialize`` of the request raises
  ``OmniPrefixCacheUnmatchError`` naming the first wrong position.

What it does not catch: the multimodal placeholder rows of another image or clip at the same positions
after the same tokens (every image's placeholder has the same token id; vLLM tells them apart by the items'
hashes, which the tag does not hold); rows of generated tokens and of prompt embeddings, and every row
after a prompt embedding (unknown); and a hit on rows an earlier writer of the cache claimed (unknown to
this writer: its table starts empty). A wrong row of those kinds needs vLLM to hit a block it never
computed *and* that block's previous tenant to hold the same tokens up to it.

The table is the writer's alone (``SlotTokens``, owned by the manager, engine thread only, no lock); it
lives in the writer's private memory, as 16 bytes a slot, touched only where written.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["CHAIN", "FEW_RUNS", "LONG_PREFIX", "SMALL_STEP_ROWS", "TAG", "UNKNOWN", "PromptChains", "Run",
           "SlotTokens", "chain_before", "chains_before", "fill_befores", "hit_token_tags", "hits_token_tags",
           "note_chains", "prefix_chains", "row_tags", "run_index", "scatter_tags", "token_tag", "token_tags"]

_POSITION = 32
"""A tag is ``(position + 1) << 32 | token id``: the position in the high half, plus one so a known tag is
never 0."""


_MAX_ID = 1 << _POSITION
"""Token ids at or past this would reach the position half: unknown (vLLM's are int32)."""

TAG, CHAIN = 0, 1
"""The columns of a tags array (``rows x 2`` int64): the exact (token, position) tag and the chain."""

_CHAIN_BASE = 0x9E3779B97F4A7C15
"""The chain of position ``p`` is ``sum((token_i + 1) * _CHAIN_BASE**i for i <= p) mod 2**64``. The base is
odd, so each power is a unit: prefixes that differ at one position only never share a chain. A sum of
per-position terms (not a running hash) is what lets a run's chain start from any position and many runs
go through one cumulative sum (``_segment_chains``)."""

_MASK = (1 << 64) - 1

_powers_np = np.ones(1, dtype=np.uint64)
_powers_py: list[int] = [1]


def _powers(n: int) -> np.ndarray:
    """``_CHAIN_BASE**i mod 2**64`` for ``i < n`` (uint64; a view of a table grown by doubling, never shrunk:
    8 bytes a position of the longest prompt seen). Grown with numpy (a Python loop took 31 ms for a first
    128k-token prompt: review, stop 56); a table is replaced whole, never changed, so threads agree."""
    global _powers_np
    if len(_powers_np) < n:
        size = max(n, 2 * len(_powers_np))
        grown = np.empty(size, dtype=np.uint64)
        grown[0] = 1
        grown[1:] = np.uint64(_CHAIN_BASE)
        _powers_np = np.cumprod(grown, dtype=np.uint64)  # wraps mod 2**64, as the chain's sums do
    return _powers_np[:n]


def _powers_list(n: int) -> list[int]:
    """The powers as Python ints for ``row_tags``' plain loop, at least ``n`` of them."""
    global _powers_py
    if len(_powers_py) < n:
        _powers_py = _powers(max(n, 2 * len(_powers_py))).tolist()
    return _powers_py


def _unknown(ids: np.ndarray) -> np.ndarray:
    """Where int64 ``ids`` are no token id a tag can hold (negative, or 2**32 or more)."""
    return (ids < 0) | (ids >= _MAX_ID)


def token_tag(token_id: int, position: int) -> int:
    """The exact tag of one row (plain Python, for small steps); 0 for an unknown token id (negative, or
    2**32 or more, which would reach the position half: review, stop 55)."""
    return ((position + 1) << _POSITION) | token_id if 0 <= token_id < _MAX_ID else 0


def token_tags(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The exact int64 tag of each (token id, position) pair (the ``TAG`` column); 0 where the token id is
    unknown (negative, or 2**32 or more).

    Exact: the pair itself, packed (``token_tag``), for token ids under 2**32 (vLLM's are int32) and
    positions under 2**31 - 1, so distinct pairs never share a tag and no hash can collide."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    out = ((np.asarray(positions, dtype=np.int64) + 1) << _POSITION) | tokens
    unknown = _unknown(tokens)
    if unknown.any():
        out[unknown] = 0
    return out


def _segment_chains(ids: np.ndarray, lens: np.ndarray, positions: np.ndarray | None = None,
                    befores: np.ndarray | None = None) -> np.ndarray:
    """The chain (int64) of every item of runs of ``lens[i]`` prompt ids each, flat in ``ids`` (int64; an
    unknown id is negative or 2**32 or more): 0 from a run's first unknown id on. A run starts at position 0
    (``positions`` None), or at its items' own ``positions`` from ``befores[i]`` (a Python-int list: the
    chain before the run, ``UNKNOWN`` for none: then so is the whole run). A fixed number of passes over
    the items, whatever the number of runs."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    if positions is None:
        positions = run_index(np.zeros(len(lens), dtype=np.int64), lens)
    unknown = _unknown(ids)
    # uint64 products and sums wrap silently: the arithmetic is mod 2**64 by design.
    terms = (ids.astype(np.uint64) + np.uint64(1)) * _powers(int(positions.max()) + 1)[positions]
    sums = np.cumsum(terms, dtype=np.uint64)
    firsts = np.cumsum(lens) - lens
    base = np.where(firsts > 0, sums[np.maximum(firsts - 1, 0)], np.uint64(0))
    if befores is not None:
        # chain = sums - base + before (mod 2**64); a run without a known chain before it has none
        base = base - np.array([b if b != UNKNOWN else 0 for b in befores], dtype=np.uint64)
        dark = np.array([b == UNKNOWN for b in befores], dtype=bool)
        if dark.any():
            unknown = unknown | np.repeat(dark, lens)
    chains = (sums - np.repeat(base, lens)).view(np.int64)
    if unknown.any():
        seen = np.cumsum(unknown, dtype=np.int64)
        seen_before = np.where(firsts > 0, seen[np.maximum(firsts - 1, 0)], 0)
        chains[(seen - np.repeat(seen_before, lens)) > 0] = 0
    return chains


def prefix_chains(token_ids: np.ndarray) -> np.ndarray:
    """The chain (the ``CHAIN`` column) of every position of one prompt's ids from position 0 (int64; a
    negative id or one of 2**32 or more is unknown): 0 from the first unknown id on."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.cumsum((ids.astype(np.uint64) + np.uint64(1)) * _powers(len(ids)), dtype=np.uint64).view(np.int64)
    unknown = _unknown(ids)
    if unknown.any():
        out[int(unknown.argmax()):] = 0
    return out


def _pair(tags: np.ndarray, chains: np.ndarray) -> np.ndarray:
    out = np.empty((len(tags), 2), dtype=np.int64)
    out[:, TAG] = tags
    out[:, CHAIN] = chains
    return out


def hit_token_tags(token_ids: Any, hit: int) -> np.ndarray | None:
    """The tags (``rows x 2``) a hit of ``hit`` tokens must find, from the request's own token ids (position
    0 first), or None when there are none to compare: no ids given, or ids that are no one-dimensional list
    of integers (a None, a float or a string in them, a Python int past 2**63). An unsigned array's values
    past 2**63 wrap negative, so those positions are unknown and not compared. Never raises: only the writer
    computes these, and a raise in ``new_step_starts`` lost the step's other events on it alone (review,
    stop 55). Ids past the ones given are not compared."""
    if token_ids is None:
        return None
    try:
        arr = np.asarray(token_ids[:hit])
    except Exception:  # noqa: BLE001 - any container numpy cannot read (a sparse tensor: NotImplementedError)
        return None
    if arr.dtype.kind not in "iu" or arr.ndim != 1 or not len(arr):
        return None  # floats or strings would be cut to numbers and compared (docs review, stop 55)
    ids = arr.astype(np.int64)
    return _pair(token_tags(ids, np.arange(len(ids), dtype=np.int64)), prefix_chains(ids))


SMALL_STEP_ROWS = 256
"""Steps of at most this many rows are tagged in plain Python (``row_tags``): the bound the save's slot
bookkeeping uses too (``steps._SMALL_STEP``), for the same reason."""


FEW_RUNS = 8
"""Steps of more known runs than this are tagged with a fixed number of numpy calls (``scatter_tags``): one
set of calls a run cost 1.2-1.6 ms for a step admitting 256 short prompts (real-engine review, stop 55)."""


def run_index(firsts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For runs of ``lens[i]`` items from ``firsts[i]``: every item's index (``firsts[i] + k``), in run order."""
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(firsts, lens) + offsets


def scatter_tags(rows: int, starts: np.ndarray, firsts: np.ndarray, lens: np.ndarray, ids: np.ndarray,
                 known: np.ndarray | None, befores: list[int]) -> np.ndarray:
    """A step's ``rows x 2`` tags from many runs at once: run ``i`` covers positions ``firsts[i]..+lens[i]`` of
    its prompt, written at rows ``starts[i]..``; ``ids`` and ``known`` (None: all) hold the runs' items flat, in
    run order; ``befores`` the chain before each run (``chain_before``, ``PromptChains.before``)."""
    ids = ids.astype(np.int64)
    if known is not None:
        ids[~known.astype(bool)] = -1
    positions = run_index(firsts, lens)
    out = np.zeros((rows, 2), dtype=np.int64)
    at = run_index(starts, lens)
    out[at, TAG] = token_tags(ids, positions)
    out[at, CHAIN] = _segment_chains(ids, lens, positions, befores)
    return out


def note_chains(chains: "PromptChains | None", ends: list[tuple[Any, int, int]], tags: np.ndarray | None) -> None:
    """After a step's ``tags`` are made: each run's request, the position after its last row and that row,
    ``(rid, end, row)``, noted in ``chains`` (None: the writer keeps none) for the request's next run. The
    views pass only runs that end before their prompt does: a run that ends it has no next run to tag."""
    if chains is None or tags is None or not ends:
        return
    for (rid, end, _), value in zip(ends, tags[[row for _, _, row in ends], CHAIN].tolist()):
        chains.note(rid, end, value)


def hits_token_tags(hits: list[tuple[Any, int]]) -> list[np.ndarray | None]:
    """``hit_token_tags`` of each ``(token ids, hit)``, in order. Hits of the same ids up to the same length
    (requests admitted together on one shared system prompt) share one array, made once: 64 hits on a
    4k-token prefix spent 15 ms making each (real-engine review, stop 56). More than ``FEW_RUNS`` distinct
    hits are tagged in one pass (a step admitting 256 requests that each hit a block spent 0.86 ms tagging them
    one by one: review, stop 55); if their ids together are no list of integers, each is tagged alone, so one
    request's odd ids leave the others checked."""
    same = _same_prefixes(hits)
    distinct = [hits[i] for i in range(len(hits)) if same[i] is None]
    made = iter(_distinct_hits_token_tags(distinct))
    out: list[np.ndarray | None] = []
    for i, j in enumerate(same):
        # An earlier hit of equal values that made no tags (float or bool ids, refused) shares nothing: this
        # hit is tagged alone (a review: an int hit took a float hit's None and was served unchecked).
        shared = next(made) if j is None else out[j]
        out.append(shared if shared is not None or j is None else hit_token_tags(*hits[i]))
    return out


def _same_prefixes(hits: list[tuple[Any, int]]) -> list[int | None]:
    """For each hit, the index of an earlier hit of the same ids up to the same length, else None. One full
    comparison a hit at most: only the first hit of each (length, first, middle and last id) is compared
    with, so distinct prompts cost no more than a glance each."""
    firsts: dict[Any, int] = {}
    out: list[int | None] = [None] * len(hits)
    for i, (ids, hit) in enumerate(hits):
        try:
            n = min(int(hit), len(ids))
            key = (n, ids[0], ids[n // 2], ids[n - 1]) if n > 0 else None
            j = firsts.setdefault(key, i) if key is not None else i
        except Exception:  # noqa: BLE001 - ids that are no sequence, or unhashable items: tagged alone
            continue
        if j != i and _equal_ids(hits[j][0], ids, n):
            out[i] = j
    return out


def _equal_ids(a: Any, b: Any, n: int) -> bool:
    """Whether two id sequences agree on their first ``n`` ids (False when either cannot say)."""
    try:
        if isinstance(a, list) and isinstance(b, list):
            return a[:n] == b[:n]  # C-speed list comparison (vLLM's prompt ids are lists)
        return bool(np.array_equal(np.asarray(a[:n]), np.asarray(b[:n])))
    except Exception:  # noqa: BLE001 - odd ids are not shared
        return False


def _distinct_hits_token_tags(hits: list[tuple[Any, int]]) -> list[np.ndarray | None]:
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
    flat = flat.astype(np.int64)
    tags = _pair(token_tags(flat, run_index(np.zeros(len(runs), dtype=np.int64), lens)),
                 _segment_chains(flat, lens))
    ends = np.cumsum(lens).tolist()
    return [tags[end - n:end] if n else None for end, n in zip(ends, lens.tolist())]


class Run(NamedTuple):
    """One known run of a step's rows for ``row_tags``; ids and masks are lists or numpy arrays."""

    row: int
    """The step row of the run's first row."""
    pos: int
    """The position of its first row in its prompt."""
    ids: Any
    """The prompt's token ids from position 0 to the run's end: the run's own rows are those from ``pos``."""
    known: Any
    """None, or one bool per id (False: not an id, a prompt embedding)."""
    before: "int | None"
    """The chain before the run (``PromptChains.before``; 0 at position 0), or None to sum the ids before it."""


UNKNOWN = -1
"""A chain before a run that is not known (an id before it is): no chain in the run either. Chains before a
run are unsigned Python ints otherwise (0 before position 0)."""


def chain_before(ids: Any, known: Any, pos: int) -> int:
    """The chain before position ``pos`` of a prompt (its sum over positions ``0..pos-1``; 0 at position 0),
    ``UNKNOWN`` when an id before ``pos`` is: one dot product, for a run that continues a prompt and whose
    chain ``PromptChains`` does not hold."""
    if not pos:
        return 0
    before = np.asarray(ids[:pos], dtype=np.int64)
    if _unknown(before).any() or (known is not None and not np.asarray(known[:pos]).all()):
        return UNKNOWN
    return int(np.dot(before.astype(np.uint64) + np.uint64(1), _powers(pos)))


LONG_PREFIX = 4096
"""A run continuing a prompt past this many tokens sums its earlier tokens alone (``chain_before``); shorter
ones of a many-runs step are summed together (``chains_before``)."""


def fill_befores(befores: list["int | None"], prefix: Callable[[int], tuple[Any, Any]]) -> list[int]:
    """``befores`` with each None replaced by the chain before that run, summed from ``prefix(i)`` (the ids and
    the mask, or None, before run ``i``) by ``chains_before``: a many-runs step's misses in one pass."""
    missing = [i for i, b in enumerate(befores) if b is None]
    out = list(befores)
    for i, b in zip(missing, chains_before([prefix(i) for i in missing])):
        out[i] = b
    return out


def chains_before(prefixes: list[tuple[Any, Any]]) -> list[int]:
    """``chain_before`` of many runs, each given as its prompt's ids and known mask (None: all) before it:
    the short ones in one set of numpy calls (a step admitting 256 requests on one-block hits would
    otherwise make a set a run), the long ones one dot product each."""
    out = [0] * len(prefixes)
    short = [i for i, (ids, _) in enumerate(prefixes) if 0 < len(ids) <= LONG_PREFIX]
    for i, (ids, known) in enumerate(prefixes):
        if len(ids) > LONG_PREFIX:
            out[i] = chain_before(ids, known, len(ids))
    if short:
        lens = np.array([len(prefixes[i][0]) for i in short], dtype=np.int64)
        flat = np.concatenate([np.asarray(prefixes[i][0], dtype=np.int64) for i in short])
        bad = _unknown(flat)
        if any(prefixes[i][1] is not None for i in short):
            bad |= ~np.concatenate([np.asarray(prefixes[i][1], dtype=bool) if prefixes[i][1] is not None
                                    else np.ones(len(prefixes[i][0]), dtype=bool) for i in short])
        starts = np.cumsum(lens) - lens
        positions = run_index(np.zeros(len(short), dtype=np.int64), lens)
        terms = (flat.astype(np.uint64) + np.uint64(1)) * _powers(int(lens.max()))[positions]
        sums = np.add.reduceat(terms, starts, dtype=np.uint64).tolist()  # every run is non-empty
        dark = np.add.reduceat(bad.astype(np.int64), starts).tolist()
        for i, total, unknown in zip(short, sums, dark):
            out[i] = UNKNOWN if unknown else total
    return out


def row_tags(rows: int, spans: list[Run]) -> np.ndarray:
    """A step's ``rows x 2`` tags (0 where unknown) from its known runs (``Run``). Many runs (over
    ``FEW_RUNS``) go through ``scatter_tags``, with only their own items. A step of up to ``SMALL_STEP_ROWS``
    rows is tagged in plain Python: right after the forward each numpy call on small arrays costs tens of
    microseconds of cold code (a vectorised version took 117 us a step inside figure 6's hooks arm, 37 rows a
    step). A run's chain starts from its given chain before it; a run without one sums its earlier ids (a
    dot product, once a run), so a step's cost follows its rows, not its prompts' lengths, where
    ``PromptChains`` knows the runs (review, stop 56: 16 runs deep in 30k-token prompts took 23 ms a step
    when every run summed its prompt from position 0)."""
    # (plain tuples are runs too: fields by index)
    spans = [run if run[4] is not None or run[1] else Run(*run[:4], 0) for run in spans]
    if len(spans) > FEW_RUNS:
        befores = fill_befores([run[4] for run in spans],
                               lambda i: (spans[i][2][:spans[i][1]],
                                          None if spans[i][3] is None else spans[i][3][:spans[i][1]]))
        lens = np.array([len(ids) - pos for _, pos, ids, _, _ in spans], dtype=np.int64)
        flat = np.concatenate([np.asarray(ids[pos:], dtype=np.int64) for _, pos, ids, _, _ in spans])
        known = None
        if any(k is not None for _, _, _, k, _ in spans):
            known = np.concatenate([np.asarray(k[pos:], dtype=bool) if k is not None else np.ones(n, dtype=bool)
                                    for (_, pos, _, k, _), n in zip(spans, lens.tolist())])
        starts = np.array([start for start, _, _, _, _ in spans], dtype=np.int64)
        firsts = np.array([pos for _, pos, _, _, _ in spans], dtype=np.int64)
        return scatter_tags(rows, starts, firsts, lens, flat, known, befores)
    befores = [b if b is not None else chain_before(ids, known, pos) for _, pos, ids, known, b in spans]
    if rows <= SMALL_STEP_ROWS:
        return _small_row_tags(rows, spans, befores)
    out = np.zeros((rows, 2), dtype=np.int64)
    for (start, pos, ids, known, _), before in zip(spans, befores):
        run = np.asarray(ids[pos:], dtype=np.int64)
        if known is not None:
            run = np.where(np.asarray(known[pos:], dtype=bool), run, -1)
        n = len(run)
        positions = np.arange(pos, pos + n, dtype=np.int64)
        out[start:start + n, TAG] = token_tags(run, positions)
        out[start:start + n, CHAIN] = _segment_chains(run, np.array([n], dtype=np.int64), positions, [before])
    return out


def _small_row_tags(rows: int, spans: list[Run], befores: list[int]) -> np.ndarray:
    """``row_tags`` in plain Python (at most ``SMALL_STEP_ROWS`` rows and ``FEW_RUNS`` runs)."""
    small = array("Q", bytes(16 * rows))  # TAG and CHAIN interleaved; unsigned, read back as int64
    for (start, pos, ids, known, _), before in zip(spans, befores):
        chained = before != UNKNOWN  # every id before the run known
        chain_at = before if chained else 0
        run = ids[pos:]
        run = run.tolist() if hasattr(run, "tolist") else list(run)
        mask = None if known is None else known[pos:]
        mask = mask.tolist() if hasattr(mask, "tolist") else mask
        powers = _powers_list(pos + len(run))
        at = 2 * start
        for k, token in enumerate(run):
            if (mask is None or mask[k]) and 0 <= token < _MAX_ID:
                p = pos + k
                small[at] = ((p + 1) << _POSITION) | token
                if chained:
                    chain_at = (chain_at + (token + 1) * powers[p]) & _MASK
                    small[at + 1] = chain_at
            else:
                chained = False
            at += 2
    return np.frombuffer(small, dtype=np.int64).reshape(rows, 2)


class PromptChains:
    """The writer's chain of each live request's prompt where its last tagged run ended, so the next run
    of the request starts from it instead of summing the prompt from position 0 (review, stop 56: O(prompt)
    a run, 23-45 ms for a step of 16 runs deep in 30k-token prompts). Filled by the views from their own
    ids and masks (``note``) and by the manager from a hit's own chain (``seed``), which a view uses only
    where its mask says every token before is an id: a hit's event ids take an embedding's placeholder id
    for a token, and seeds used unchecked refused correct hits on prompts mixing ids and embeddings
    (review, stop 56). Only a cache: an entry is the chain of the request's own prompt up to a position,
    which no later step changes, and a miss sums the prompt again. Entries go with their request's lifetime (the manager
    forgets a request that finishes, aborts, or starts, resumes or is replaced anew); past ``LIMIT`` entries
    (an integration that never says a request finished) it starts over. Owned by the manager; engine thread
    only."""

    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._at: dict[Any, tuple[int, int, bool]] = {}  # rid: (position, chain before it, from a hit)

    def __len__(self) -> int:
        return len(self._at)

    def before(self, rid: Any, pos: int, known: Any = None) -> int | None:
        """The chain before position ``pos`` of ``rid``'s prompt (``UNKNOWN``: not known), or None when this
        cache does not hold it. ``known``: the request's mask of ids (None: all ids), which a chain seeded
        from its hit needs all true before ``pos``: the hit's event ids take an embedding's placeholder id
        for a token (a seed the views could not check refused correct hits in a real engine: review, stop
        56)."""
        got = self._at.get(rid)
        if got is None or got[0] != pos:
            return None
        if got[2] and known is not None and not np.asarray(known[:pos]).all():
            return None
        return got[1]

    def note(self, rid: Any, end: int, chain: int) -> None:
        """``rid``'s row at position ``end - 1`` has ``chain`` (a tags array's ``CHAIN`` value: 0 unknown)."""
        self._put(rid, end, (chain & _MASK) if chain else UNKNOWN, False)

    def seed(self, rid: Any, end: int, chain: int) -> None:
        """``rid``'s hit of ``end`` tokens has ``chain`` at its last position, by its event ids (nonzero: all
        known): its first run starts there, where its mask says they are all ids (``before``). A step
        admitting 64 requests on one 4k-token prefix summed it 64 times (real-engine review, stop 56)."""
        if chain:
            self._put(rid, end, chain & _MASK, True)

    def _put(self, rid: Any, end: int, value: int, seeded: bool) -> None:
        if len(self._at) >= self.LIMIT and rid not in self._at:
            self._at.clear()
        self._at[rid] = (end, value, seeded)

    def forget(self, rid: Any) -> None:
        self._at.pop(rid, None)


class SlotTokens:
    """The writer's tags of every slot's rows (0: unknown), as two columns: ``tags`` (exact) and ``chains``.
    Owned by the manager; engine thread only."""

    def __init__(self, num_slots: int) -> None:
        # np.zeros takes pages from the kernel on first write: slots never written cost nothing. Two arrays,
        # not one of two columns: indexing a 2-D table by slots cost 5 times as much (72 against 2x12 us for
        # 8192 slots).
        self.tags = np.zeros(num_slots, dtype=np.int64)
        self.chains = np.zeros(num_slots, dtype=np.int64)

    def record(self, slots: np.ndarray | list[int], tags: np.ndarray | None) -> None:
        """The rows at ``slots`` (in the pool, each once) now hold the rows of ``tags``: ``rows x 2``, or one
        exact tag a row (no chain known), or None (unknown)."""
        if tags is None:
            self.tags[slots] = 0
            self.chains[slots] = 0
        elif tags.ndim == 1:
            self.tags[slots] = tags
            self.chains[slots] = 0
        else:
            self.tags[slots] = tags[:, TAG]
            self.chains[slots] = tags[:, CHAIN]

    def forget(self, slots: np.ndarray) -> None:
        """The rows at ``slots`` are no longer known."""
        self.tags[slots] = 0
        self.chains[slots] = 0

    def check_runs(self, slots: np.ndarray, expected: np.ndarray, lens: list[int]) -> tuple[list[int], np.ndarray]:
        """Compare the first ``len(expected)`` of ``slots`` with ``expected`` (``rows x 2``), as runs of ``lens``
        rows each: each run's count of rows whose exact tag both sides know (compared), and the indices (into
        the flat rows) of those whose slot holds another exact tag or, where both know it, another chain."""
        slots = slots[:len(expected)]
        held, want = self.tags[slots], expected[:, TAG]
        known = (held != 0) & (want != 0)
        wrong = known & (held != want)
        held, want = self.chains[slots], expected[:, CHAIN]
        wrong |= (held != 0) & (want != 0) & (held != want)
        seen = np.concatenate([[0], np.cumsum(known)])
        run_lens = np.asarray(lens, dtype=np.int64)
        ends = np.cumsum(run_lens)
        return (seen[ends] - seen[ends - run_lens]).tolist(), np.flatnonzero(wrong)

    def chain_only(self, slot: int, expected: np.ndarray) -> bool:
        """Whether the row at ``slot`` holds ``expected``'s exact tag (so only its chain differs)."""
        return int(self.tags[slot]) == int(expected[TAG])
