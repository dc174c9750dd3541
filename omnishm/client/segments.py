"""The client's mapped view of the cache: per-key pool, tables, staging pages.

``KeyViews`` owns one tensor name's mappings in this process. ``StagingPages``
owns the writer's page accounting: a page is held from the save that claimed
it until BOTH the step id was consumed (materialize/discard) and the committer
acknowledged the step's writes (it reads rows from the page until then).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from omnishm import protocol as P
from omnishm.interface import OmniPrefixCacheStagingTimeoutError, StepId, unmatch
from omnishm.shm import Segment

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be cached (supported: {', '.join(DTYPES)})")


@dataclass
class KeyViews:
    """One tensor name as mapped here. Readers map everything read-only."""

    key: str
    index: int
    dtype: torch.dtype
    width: int
    row_shape: tuple[int, ...]
    pool: torch.Tensor
    claim: torch.Tensor
    commit: torch.Tensor
    staging: torch.Tensor | None
    segments: list[Segment] = field(default_factory=list, repr=False)
    claim_np: np.ndarray | None = field(default=None, repr=False)
    """Writer: ``claim`` as a numpy array (same memory) for the per-step claim writes; None on readers."""
    claim_mv: memoryview | None = field(default=None, repr=False)
    """Writer: the same words as a memoryview (plain Python stores for small steps); None on readers."""

    @classmethod
    def map(cls, seg: P.KeySegments, num_slots: int, *, readonly: bool) -> "KeyViews":
        dtype = DTYPES[seg.dtype]
        pool_seg = Segment.attach(seg.pool, readonly=True)
        claim_seg = Segment.attach(seg.claim, readonly=readonly)
        commit_seg = Segment.attach(seg.commit, readonly=True)
        segments = [pool_seg, claim_seg, commit_seg]
        staging = None
        if seg.staging is not None:
            stage_seg = Segment.attach(seg.staging, readonly=False)
            segments.append(stage_seg)
            staging = stage_seg.tensor(dtype, (seg.staging_rows, seg.width))
        claim = claim_seg.tensor(torch.int64, (num_slots,))
        return cls(
            key=seg.key, index=seg.index, dtype=dtype, width=seg.width,
            row_shape=tuple(seg.row_shape),
            pool=pool_seg.tensor(dtype, (num_slots, seg.width)),
            claim=claim, commit=commit_seg.tensor(torch.int64, (num_slots,)),
            staging=staging, segments=segments, claim_np=None if readonly else claim.numpy(),
            claim_mv=None if readonly else memoryview(claim.numpy()))

    def rows_out(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.width), dtype=self.dtype)


def row_width(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape)) if shape else 1


class StagingPages:
    """Page claims of the writer's staging segments (same page index for every key).

    Thread-safe (own condition). ``claim`` waits for a free page up to the
    timeout and then raises ``OmniPrefixCacheStagingTimeoutError`` naming the
    unconsumed step ids that hold the pages; once ``close`` was called (the
    manager's shutdown, from any thread) it raises ``RuntimeError`` at once,
    also in a wait that had begun.
    """

    def __init__(self, depth: int, capacity: int, cache: str = ""):
        self.cache = cache
        """The cache's name, for the timeout's message."""
        self.depth = depth
        self.capacity = capacity
        # Entered as a plain lock (``with self._lock``, a C call): a Condition's own ``__enter__`` is Python
        # code, and an exception a signal handler raised there on the engine thread left it held, so the
        # threads that release pages (the link's, the flusher) blocked for good (see serial.py).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._holds: list[set[str]] = [set() for _ in range(depth)]
        self._owner: list[StepId | None] = [None] * depth
        self._closed = ""
        """Why claims are refused (``close``); empty while the pages are in use."""
        self.waits = 0
        self.used = 0
        """Pages held now (changed under the condition; read it without, as a gauge)."""

    @property
    def flush_row0(self) -> int:
        """First row of the flush region that follows the step pages."""
        return self.depth * self.capacity

    def claim(self, step_id: StepId, timeout_s: float, holds: tuple[str, ...] = ("ctx", "write")) -> int:
        deadline = 0.0
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError(f"cache {self.cache}: no staging page for step {step_id}: {self._closed}")
                for page in range(self.depth):
                    if not self._holds[page]:
                        self._holds[page] = set(holds)
                        self._owner[page] = step_id
                        self.used += 1
                        return page
                if not deadline:
                    self.waits += 1
                    deadline = time.monotonic() + timeout_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    owners = sorted(o for o in self._owner if o is not None)
                    raise unmatch(f"cache {self.cache}: no free staging page for step {step_id} after "
                                  f"{timeout_s:.1f}s; unconsumed step ids {owners} hold all {self.depth} pages: "
                                  f"call materialize() or discard_step() for each, or raise staging_depth",
                                  step_id=step_id, cls=OmniPrefixCacheStagingTimeoutError)
                self._cond.wait(remaining)

    def close(self, why: str) -> None:
        """Refuse every claim from now on, and wake the ones waiting; any thread, idempotent."""
        with self._lock:
            self._closed = self._closed or why
            self._cond.notify_all()

    def release(self, page: int, hold: str) -> None:
        with self._lock:
            held = self._holds[page]
            if hold not in held:
                return
            held.discard(hold)
            if not held:
                self._owner[page] = None
                self.used -= 1
                self._cond.notify_all()

    def in_use(self) -> int:
        return self.used
