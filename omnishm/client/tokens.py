"""What each slot's rows were computed for: the writer's token tags, and the hit check they serve.

vLLM decides a prefix hit by its own block hashes; omnishm serves the rows its pool holds at the hit's
slots. The two agree only if vLLM computed every block it hits. A block vLLM put in its prefix cache and
never computed holds the rows of the slot's previous tenant, and omnishm served them as the hit's rows with
no error: vLLM 0.32's priority scheduler did it (stop 54; the gate refuses that policy since, docs/CLIENT.md
§3). This module is the safety net for that class of fault, whatever causes it next.

- **The tag.** A row's tag is a 64-bit mix of its token id and its position in its request
  (``token_tags``): a bijection of the pair, made odd, so two distinct (token, position) pairs of any real
  vocabulary and context length never share a tag, and 0 is free to mean "unknown".
- **Recorded by the writer**, for every slot it claims, on the engine thread (``SlotTokens.record``): the
  tag of the row's token where the integration knows it, else 0. The vLLM integration knows prompt tokens
  given as ids (``FullAttentionGroupView.step_token_tags_cpu``); generated tokens are 0, since under async
  scheduling the runner's CPU copy of a step's sampled input token may not be written yet when it saves.
- **Checked by the writer** when a save takes a request's prefix hit, after the step's own tags are
  recorded (vLLM may hit blocks the same step computes): the tags of the hit request's own tokens
  (``PrefixCacheRequestEvent.token_ids``) against the tags of the hit's slots (``SlotTokens.check``).
  A position unknown on either side is not compared. On a mismatch the writer makes those slots absent, so
  its readers' reads of them raise too, and its own ``materialize`` of the request raises
  ``OmniPrefixCacheUnmatchError`` naming the first wrong position.

What it does not catch: a row whose token and position match but whose earlier tokens differ (the tag has
no chain: a chained one needs every earlier token of both requests, which the writer does not keep), rows
of generated tokens and of prompt embeddings (unknown), and a hit on rows an earlier writer of the cache
claimed (unknown to this writer: its table starts empty). A wrong row of those kinds needs vLLM to hit a
block it never computed *and* that block's previous tenant to hold the same token at the same position.

The table is the writer's alone (``SlotTokens``, owned by the manager, engine thread only, no lock); it
lives in the writer's private memory, as 8 bytes a slot, touched only where written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SlotTokens", "token_tags", "hit_token_tags"]

_K = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)


def token_tags(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The int64 tag of each (token id, position) pair; 0 where the token id is negative (unknown).

    ``token + position * K`` (wrapping) is one-to-one for token ids under 2**32 and positions under 2**20
    (K is odd and no small multiple of it is small), and splitmix64's finaliser is a bijection, so distinct
    pairs get distinct values; the low bit set makes a known tag never 0. Vectorised: about 6 passes over
    the arrays."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    x = tokens.astype(np.uint64) + np.asarray(positions, dtype=np.int64).astype(np.uint64) * _K
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    x |= _ONE
    out = x.view(np.int64)
    unknown = tokens < 0
    if unknown.any():
        out[unknown] = 0
    return out


def hit_token_tags(token_ids: Sequence[int] | Any, hit: int) -> np.ndarray | None:
    """The tags a hit of ``hit`` tokens must find, from the request's own token ids (position 0 first), or
    None when there are none to compare (no ids given). Ids past the ones given are not compared."""
    if token_ids is None:
        return None
    ids = token_ids[:hit]
    if not len(ids):
        return None
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        return None  # not a token list (an integration's bug): nothing that can be compared
    return token_tags(arr, np.arange(len(arr), dtype=np.int64))


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
