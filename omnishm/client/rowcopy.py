"""Copying pool rows out at memcpy speed: ``gather_rows``.

A hit's slots are its blocks' slots, and a block is ``block_size`` consecutive
slots, so a hit is a few runs of consecutive pool rows (one run when its blocks
are consecutive, as a long prompt's usually are in a fresh cache). torch's
``index_select`` copies row by row, and torch's ``copy_`` uses ordinary stores
whatever the size. glibc's ``memcpy`` switches to non-temporal stores once a
copy outgrows its cache-size threshold, which skips reading the destination
first. On the build machines one ``memcpy`` of a 256 MiB run moves 10.6-11.4
GB/s, against 6.2-6.5 GB/s for ``index_select`` or ``copy_`` of the same bytes,
and per 128 KiB block either way moves about 6.1 GB/s (measured 2026-12-04,
benchmarks/README.md, figure 2). So a large read whose runs are long copies
each run with one ``memmove`` call; a read of scattered blocks keeps the row
gather.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

RUN_COPY_MIN_BYTES = 1 << 20
"""Reads below this many bytes use ``index_select``: finding runs costs a few numpy calls, more than
the copy of a small hit saves."""
RUN_MIN_BYTES = 1 << 20
"""The runs must average at least this many bytes: shorter ones copy no faster than the row gather."""

_memmove = ctypes.memmove  # a CFUNCTYPE: the GIL is released for the copy


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = pool[slots[i]]`` for every i. Any thread; takes no lock.

    ``pool`` and ``out`` are CPU tensors with the same dtype and row shape; ``slots`` a 1-D int64 CPU
    tensor with ``len(out)`` entries. A large read whose slots form long runs copies each run with
    one ``memmove`` (see the module docstring); anything else (non-contiguous tensors, small reads,
    scattered slots) goes through ``index_select``. Raises ``IndexError`` for a slot outside the pool
    before copying anything (``index_select`` raises its own error for it).
    """
    n = len(slots)
    row_bytes = math.prod(pool.shape[1:]) * pool.element_size()
    nbytes = n * row_bytes
    if (nbytes < RUN_COPY_MIN_BYTES or not pool.is_contiguous() or not out.is_contiguous()
            or out.dtype != pool.dtype or out.shape != (n, *pool.shape[1:]) or slots.dtype != torch.int64
            or out.device.type != "cpu" or pool.device.type != "cpu" or slots.device.type != "cpu"):
        torch.index_select(pool, 0, slots, out=out)
        return
    s = slots.numpy()
    breaks = np.flatnonzero(np.diff(s) != 1) + 1
    if nbytes // (len(breaks) + 1) < RUN_MIN_BYTES:
        torch.index_select(pool, 0, slots, out=out)
        return
    lo, hi = int(s.min()), int(s.max())
    if lo < 0 or hi >= len(pool):
        raise IndexError(f"slot out of range: [{lo}, {hi}] in a pool of {len(pool)} rows")
    src, dst = pool.data_ptr(), out.data_ptr()
    starts = np.concatenate(([0], breaks)).tolist()
    ends = breaks.tolist() + [n]
    for a, b in zip(starts, ends):
        _memmove(dst + a * row_bytes, src + int(s[a]) * row_bytes, (b - a) * row_bytes)
