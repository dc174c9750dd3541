"""Recycled, pre-faulted host memory for ``materialize``'s result tensors.

A fresh large allocation gets fresh pages from the kernel, and the first write
to each 4 KiB page faults: 4-5 us per page on these machines, about 1.2 s per
GiB, several times the cost of the copy that fills it (LIMITS.md,
benchmarks/README.md figure 2). ``materialize`` returns new tensors every call,
so without recycling the engine thread pays those faults on every step.

``ResultPool.empty`` hands out tensors backed by blocks that were faulted in
once and come back when the caller drops the last tensor (or view) of a block:
the tensor holds a numpy view of the block, and a ``weakref.finalize`` on that
view returns the block. Nothing is reused while any tensor of it is alive, so a
caller may keep, mutate or hand on a result for as long as it likes; a block
held long just means the next call faults in a new one. Free blocks are kept up
to ``max_free_bytes``; the surplus is freed at the pool's next call (``empty`` or
``free_bytes``), not when the caller drops it: after a burst of large results, a
process that calls no more keeps that peak until it does (a finalizer may run on
any thread, inside a call holding the lock, so it only files the block). Allocations under ``min_bytes``
(32 MiB) come from torch's allocator: glibc serves those from its heap, which
recycles freed memory without faults once its dynamic mmap threshold has risen,
and that threshold stops at 32 MiB, so every larger allocation is a fresh mmap
(measured: a 34 MiB result filled at 2.8 GB/s fresh, 10.3 GB/s recycled, 13 GB/s
into a preallocated buffer).

Thread-safe: ``empty`` from any thread; blocks come back from whichever thread
drops the last reference (a lock-free deque, drained under the lock by
``empty``, so a finalizer that runs inside ``empty`` cannot deadlock). Blocks
evicted over the cap are let go after the lock is released: unmapping one costs
about 150 ms per GiB, which no other thread's ``empty`` waits for.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref

import numpy as np
import torch

PAGE = 4096
MIN_POOLED_BYTES = 32 << 20
GRAIN = 2 << 20
"""Blocks are whole multiples of this; a request takes the smallest free block that fits
with at most 25% (plus one grain) to spare."""

_BLOCK_BYTES: dict[int, int] = {}
"""The block size behind each pooled tensor handed out and still alive, by its memory's address (every
pool's: one process, one address each); its entry goes before the block comes back."""


def kept_bytes(t: torch.Tensor) -> int:
    """The host bytes ``t``'s memory keeps alive: its pool block's size for a pooled result (up to 25% plus
    one grain over its own bytes), else its own bytes. Any thread."""
    block = _BLOCK_BYTES.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
    return block if block is not None else t.numel() * t.element_size()


class ResultPool:
    """Pre-faulted host blocks, recycled when their tensors die (see the module docstring)."""

    def __init__(self, max_free_bytes: int, *, min_bytes: int = MIN_POOLED_BYTES):
        self.max_free_bytes = int(max_free_bytes)
        self.min_bytes = int(min_bytes)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []  # oldest return first: the first evicted when over the cap
        self._free_bytes = 0
        self._returned: collections.deque[np.ndarray] = collections.deque()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        """``reused``, ``faulted`` (new blocks), ``unpooled`` (small or pool off), ``dropped`` (over the cap)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor; its memory is recycled once every view of it is gone."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.max_free_bytes <= 0 or nbytes < self.min_bytes or nbytes == 0:  # 0 bytes: no view to make
            self.stats["unpooled"] += 1
            if self._returned:
                # Blocks back from a burst of large results are filed (and the surplus over the cap let go)
                # by small calls too: else they stay held until the next large one, whatever the cap.
                with self._lock:
                    dropped = self._drain_returned()
                del dropped  # unmapped here, after the lock (see _drain_returned)
            return torch.empty(shape, dtype=dtype)
        block = self._take(nbytes)
        if block is None:
            # torch's allocator aligns to 64 bytes (numpy's to 16: slower copies); .numpy() shares it.
            block = torch.empty(-(-nbytes // GRAIN) * GRAIN, dtype=torch.uint8).numpy()
            block[::PAGE] = 0  # fault every page in now, once for the block's life
            self.stats["faulted"] += 1
        else:
            self.stats["reused"] += 1
        view = block[:nbytes]
        address = view.ctypes.data
        _BLOCK_BYTES[address] = block.nbytes
        done = weakref.finalize(view, self._give_back, address, block)
        done.atexit = False
        return torch.from_numpy(view).view(dtype).view(shape)

    def _give_back(self, address: int, block: np.ndarray) -> None:
        """The finalizer of a block's last view, on whichever thread dropped it: forget the address before the
        block can be handed out again (dict and deque operations are atomic), then file it."""
        _BLOCK_BYTES.pop(address, None)
        if not self._closed:  # a closed pool keeps nothing: the block goes with this last reference
            self._returned.append(block)
            if self._closed:  # ``close`` ran between the check and the append (no lock here: see above)
                self._returned.clear()

    def close(self) -> None:
        """Let go of every free block now, and of each block still in use once its tensors die (the manager's
        shutdown: a pool of a shut-down manager held up to ``max_free_bytes`` for the manager's life, review,
        stop 56). Later ``empty`` calls still work, unpooled. Any thread."""
        with self._lock:
            self._closed = True
            self.max_free_bytes = 0
            dropped, self._free, self._free_bytes = self._free + list(self._returned), [], 0
            self._returned.clear()
        del dropped  # unmapped here, after the lock (see _drain_returned)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            dropped = self._drain_returned()
            free = self._free_bytes
        del dropped  # unmapped here, after the lock (see _drain_returned)
        return free

    def _take(self, nbytes: int) -> np.ndarray | None:
        limit = nbytes + nbytes // 4 + GRAIN
        with self._lock:
            dropped = self._drain_returned()
            block = self._best_locked(nbytes, limit)
        del dropped  # unmapped here, after the lock (see _drain_returned)
        return block

    def _best_locked(self, nbytes: int, limit: int) -> np.ndarray | None:
        """Lock held: take the smallest free block of ``nbytes`` to ``limit`` bytes, or None."""
        best = -1
        for i, block in enumerate(self._free):
            if nbytes <= block.nbytes <= limit and (best < 0 or block.nbytes < self._free[best].nbytes):
                best = i
        if best < 0:
            return None
        block = self._free.pop(best)
        self._free_bytes -= block.nbytes
        return block

    def _drain_returned(self) -> list[np.ndarray]:
        """Lock held: file the blocks that came back, evicting the oldest free ones over the cap.

        Returns the dropped blocks: the caller lets go of them after releasing the lock, since the last
        reference unmaps the block (about 150 ms per GiB) and another thread's ``empty`` must not wait
        for that."""
        dropped: list[np.ndarray] = []
        while self._returned:
            block = self._returned.popleft()
            if block.nbytes > self.max_free_bytes:
                self.stats["dropped"] += 1
                dropped.append(block)  # its memory goes back to the OS with the last reference
                continue
            while self._free_bytes + block.nbytes > self.max_free_bytes:
                old = self._free.pop(0)
                self._free_bytes -= old.nbytes
                dropped.append(old)
                self.stats["dropped"] += 1
            self._free.append(block)
            self._free_bytes += block.nbytes
        return dropped
