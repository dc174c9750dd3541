"""What the vLLM hooks keep for the ``omnishm_take_*`` RPCs, and the plain-type wire form those RPCs use.

``HeldResults`` bounds the completed prompts' rows a worker keeps until a caller takes them;
``encode_tensor`` / ``decode_tensor`` / ``decode_results`` carry tensors across vLLM's msgpack RPC
(the engine-core process boundary). Split out of ``integrations/vllm.py``: the hooks (``vllm_hooks.py``)
decide what completes, this module only holds and ships it. Import invariant: no vllm import.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from omnishm.client.result_pool import kept_bytes
from omnishm.interface import ReqId

logger = logging.getLogger(__name__)

__all__ = ["HeldResults", "encode_tensor", "decode_tensor", "decode_results"]


class HeldResults:
    """Completed prompts' rows kept for the takers: results (``"done"``: rows and hit tokens) and raw rows
    (``"raw"``), within ``bound`` bytes. Past it the oldest go, raw ones first (a check, not a result), so a
    server that never calls ``omnishm_take_*`` holds at most ``bound`` (counted in ``results_dropped``,
    with a warning on the first drop); a value larger than ``bound`` by itself is dropped alone (a warning
    on the first such). ``hold`` on the engine thread; ``take`` and ``stats`` any thread,
    under the lock."""

    def __init__(self, bound: int) -> None:
        if bound < 0:  # the knob's own check, for an argument too
            raise ValueError(f"omnishm: held_bytes must be >= 0, got {bound}")
        self.bound = bound
        self._lock = threading.Lock()
        self._tables: dict[str, dict[ReqId, Any]] = {"raw": {}, "done": {}}
        self._held = 0
        self._dropped = 0
        self._oversized = 0

    def hold(self, name: str, rid: ReqId, value: Any) -> None:
        value = _own(value)  # a view would keep the whole step's result buffer alive, uncounted
        dropped = 0
        nbytes = _nbytes(value)
        with self._lock:
            table = self._tables[name]
            old = table.pop(rid, None)
            self._held -= _nbytes(old) if old is not None else 0
            oversized = nbytes > self.bound
            if oversized:
                # It could never fit: drop it alone, not every result that fits first (review, stop 56).
                dropped = 1
            else:
                self._held += nbytes
                table[rid] = value
            while self._held > self.bound:
                victims = self._tables["raw"] or self._tables["done"]
                self._held -= _nbytes(victims.pop(next(iter(victims))))
                dropped += 1
            first = dropped and not self._dropped
            first_oversized = oversized and not self._oversized
            self._oversized += oversized
            self._dropped += dropped
        if first_oversized:
            logger.warning("omnishm: request %r's completed prompt rows (%d bytes) exceed vllm_held_bytes=%d by "
                           "themselves: dropped (counted in results_dropped; only the first such drop is logged)",
                           rid, nbytes, self.bound)
        elif first:
            logger.warning("omnishm: completed prompt rows exceed vllm_held_bytes=%d (no omnishm_take_* call "
                           "took them); dropping the oldest (counted in results_dropped)", self.bound)

    def take(self, name: str) -> dict[ReqId, Any]:
        """Everything held of ``name`` (``"done"`` or ``"raw"``), now no longer held."""
        with self._lock:
            out, self._tables[name] = self._tables[name], {}
            self._held -= sum(_nbytes(v) for v in out.values())
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"held_bytes": self._held, "results_dropped": self._dropped}


def _own(value: Any) -> Any:
    """A held result (a tensor, or ``(tensor, hit tokens)``) whose tensor owns exactly its bytes: a view of a
    larger buffer (one request's rows of a step's result) is cloned."""
    t = value[0] if isinstance(value, tuple) else value
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone()
        return (t, *value[1:]) if isinstance(value, tuple) else t
    return value


def _nbytes(value: Any) -> int:
    """Bytes a held result (a tensor, or ``(tensor, hit tokens)``) keeps: a result of ``materialize``'s pool
    keeps its whole block (review, 2026-12-06: its own bytes were counted, up to 25% plus 2 MiB less)."""
    return kept_bytes(value[0] if isinstance(value, tuple) else value)


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A CPU tensor as plain msgpack-able types (dtype name, shape, raw bytes)."""
    t = t.detach().to("cpu").contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def decode_tensor(payload: Any) -> torch.Tensor:
    """Inverse of ``encode_tensor``; a tensor passes through (in-process RPC)."""
    if isinstance(payload, torch.Tensor):
        return payload
    dtype = getattr(torch, payload["dtype"])
    data = bytearray(payload["data"])
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.reshape(payload["shape"])


def decode_results(result: dict[ReqId, dict[str, Any]]) -> dict[ReqId, tuple[torch.Tensor, int]]:
    """``omnishm_take_results`` output (one rank's) as ``{req id: (hidden [P, H], hit tokens)}``."""
    return {rid: (decode_tensor(v["hidden"]), int(v["hit_tokens"])) for rid, v in result.items()}
