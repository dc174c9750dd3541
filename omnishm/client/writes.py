"""Write tasks of the writer client: row sources, deferred writes, the flusher.

A ``RowSource`` is where the rows of one claim version live until the
committer has them: a view of a staging page (JOIN_NEXT_STEP) or a clone
held by a deferred write (JOIN_ON_FINISH). Hits on in-transit rows read them
here. A ``WriteTask`` is one request's deferred write of one tensor name: it
collects chunks step after step until the request finishes or aborts, the
GPU-byte budget forces it out (oldest first), it holds ``MAX_TASK_CHUNKS``
chunks, or a hit reads it; then it is
closed and handed to the ``Flusher`` thread, which copies it through the
staging flush region to the committer. A closed write is never reopened: the
request's next deferred rows open a new write.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # builtin TimeoutError only from Python 3.11
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from omnishm import protocol as P
from omnishm.client.serial import SerialThread
from omnishm.interface import ReqId, StepId, TensorName, Tid

logger = logging.getLogger(__name__)


MAX_TASK_CHUNKS = 1024
"""A deferred write holding this many chunks (steps of its request) is closed and flushed like one the budget
forces out; the request's later rows open a new write. Each chunk's objects take about 1.7 KiB of host
memory that no budget counts (a Chunk, a RowSource, two views, two index entries; measured), so one write of
a request decoding for 100,000 steps would hold 170 MiB (review, stop 57)."""


class TaskState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    DONE = "done"
    FAILED = "failed"


@dataclass
class RowSource:
    """Rows of one claim version for one key, readable until ``alive`` drops.

    ``slots[i]`` is the slot of ``rows[i]`` (a list for a small step: made into a tensor only when
    read). Readers copy, then check ``alive`` again: a source that died during the copy may have had
    its page reused. ``ready``: the event after which device ``rows`` hold their values (their step's
    freeze event; None: host rows, or rows ready as they are).
    """

    cv: int
    slots: torch.Tensor | list[int]
    rows: torch.Tensor
    alive: bool = True
    done: Future | None = None
    ready: Any = None

    def take(self, want: torch.Tensor, read: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
             ) -> torch.Tensor | None:
        """Host rows for ``want`` slots (a subset of ``slots``), or None if any is missing.

        ``read(rows, index, ready)`` gathers on the host, or through the read stream
        when the rows are still on the device clone.
        """
        if len(self.slots) == 0:
            return None
        # Stable sort, then the rightmost match: the last occurrence wins when one write holds a
        # slot twice (the last chunk wins).
        slots = torch.as_tensor(self.slots, dtype=torch.int64)
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots[order]
        pos = (torch.searchsorted(sorted_slots, want, right=True) - 1).clamp(min=0)
        if not bool((sorted_slots[pos] == want).all()):
            return None
        idx = order[pos]
        return read(self.rows, idx, self.ready)


@dataclass(eq=False)
class HeldRows:
    """One step's clone of one deferred key, which each of that step's requests' chunks holds a slice of: all of
    it stays allocated while any chunk does. ``DeferredWrites`` counts its ``nbytes`` once in ``_pending_bytes``
    while an open write's chunk holds it (``open_chunks``), and once in ``_held_bytes`` until the last write
    holding a chunk of it has landed or failed (``chunks``). Both under the manager's state lock."""

    nbytes: int
    open_chunks: int = 0
    chunks: int = 0

    def open_chunk(self) -> tuple[int, int]:
        """A chunk of an open write takes a slice: the bytes this adds to (``_pending_bytes``, ``_held_bytes``)."""
        added = (0 if self.open_chunks else self.nbytes, 0 if self.chunks else self.nbytes)
        self.open_chunks += 1
        self.chunks += 1
        return added

    def close_chunk(self) -> int:
        """A chunk's write closed: the bytes this takes from ``_pending_bytes``."""
        self.open_chunks -= 1
        return 0 if self.open_chunks else self.nbytes

    def land_chunk(self) -> int:
        """A chunk's write landed or failed: the bytes this takes from ``_held_bytes``."""
        self.chunks -= 1
        return 0 if self.chunks else self.nbytes


@dataclass
class Chunk:
    cv: int
    step_id: StepId
    slots: torch.Tensor
    rows: torch.Tensor
    freeze: Any = None
    """Event after which ``rows`` (a device clone on CUDA) are complete."""
    held: HeldRows | None = None
    """The step's clone ``rows`` is a slice of (None: rows held by nothing else)."""


@dataclass
class WriteTask:
    """One request's deferred write of one tensor name (JOIN_ON_FINISH)."""

    tid: Tid
    req_id: ReqId
    key: TensorName
    opened_step: StepId
    chunks: list[Chunk] = field(default_factory=list)
    state: TaskState = TaskState.OPEN
    done: Future = field(default_factory=Future)


def pack(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def build_step_write(rid: int, step: StepId, keys: list[str], key_idx: list[int] | np.ndarray,
                     tids: list[int] | np.ndarray, cvs: list[int] | np.ndarray, src_rows: list[int] | np.ndarray,
                     counts: list[int] | np.ndarray, slots: torch.Tensor | np.ndarray) -> P.StepWrite:
    """One ``StepWrite`` of packed little-endian int64 entries (lists or int64 arrays)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.to(torch.int64).contiguous().numpy()
    return P.StepWrite(rid=rid, step=step, keys=keys, key_idx=pack(key_idx), tids=pack(tids), cvs=pack(cvs),
                       src_rows=pack(src_rows), counts=pack(counts), slots=pack(slots))


class Flusher:
    """Copies closed deferred writes through the flush region to the committer.

    Runs on its own thread (``omnishm-flusher``), never on the engine thread:
    it sends at most ``copy_chunk_bytes`` of rows per ``StepWrite`` (small
    pieces of a task's steps share one) and waits for each one's
    acknowledgement before reusing the region. A
    task's ``done`` future completes (or fails) once all its pieces landed.
    Once a piece's outcome is unknown (no reply within ``timeout_s``, or the
    link failed it), the region is never written again: the committer may still
    apply that piece, late or re-sent after a resume, and would then commit
    whatever the region holds under the piece's claim versions. Every later
    task fails instead (the manager's error is sticky anyway).
    """

    def __init__(self, *, region: Callable[[TensorName], torch.Tensor], row0: int, rows: int,
                 to_host: Callable[[torch.Tensor, torch.Tensor, Any], None], chunk_bytes: int,
                 key_index: Callable[[TensorName], int], send: Callable[[Callable[[int], P.StepWrite]], Future],
                 on_task_done: Callable[[WriteTask, P.StepDone | BaseException], None], timeout_s: float):
        self._region = region
        self._to_host = to_host
        self._chunk_bytes = chunk_bytes
        self._row0 = row0
        self._rows = rows
        self._key_index = key_index
        self._send = send
        self._on_task_done = on_task_done
        self._timeout_s = timeout_s
        self._unsettled: str | None = None
        """Why an earlier piece's outcome is unknown; the region is then never written again."""
        self._thread: SerialThread[WriteTask] = SerialThread("omnishm-flusher", self._run_task)

    def put(self, task: WriteTask) -> bool:
        """Hand ``task`` to the flusher thread; False once the flusher stopped (the task was not taken)."""
        return self._thread.put(task)

    def pending(self) -> int:
        return self._thread.pending()

    def stop(self, timeout_s: float | None = None) -> None:
        """Let the writes handed over so far be flushed, waiting ``timeout_s`` (default ``commit_timeout_s``)."""
        self._thread.stop(self._timeout_s if timeout_s is None else timeout_s)

    def running(self) -> bool:
        """Whether the flusher thread still runs (after ``stop``: it did not finish within its bound)."""
        return self._thread.running()

    def _run_task(self, task: WriteTask) -> None:
        try:
            result: P.StepDone | BaseException = self._flush(task)
        except BaseException as exc:  # reported to the manager, which makes it sticky
            result = exc
        self._on_task_done(task, result)

    def _flush(self, task: WriteTask) -> P.StepDone:
        if self._unsettled is not None:
            raise RuntimeError(f"not flushed: {self._unsettled}, so the flush region is not reused")
        region = self._region(task.key)
        written = skipped = 0
        last: P.StepDone | None = None
        pieces: list[tuple[Chunk, int, int]] = []
        row_bytes = max(region[0].numel() * region.element_size(), 1)
        # At most copy_chunk_bytes per StepWrite: the committer applies one message at a time, and the next
        # step's quiet write (which save_outputs joins on the engine thread) waits behind at most one piece.
        # A whole 64 MiB region in one message held that join 35-61 ms here; with 4 MiB pieces it took 0.02 ms
        # (tests/test_engine_stalls.py).
        step = max(1, min(self._rows, self._chunk_bytes // row_bytes))
        for chunk in task.chunks:
            for lo in range(0, len(chunk.slots), step):
                pieces.append((chunk, lo, min(len(chunk.slots), lo + step)))
        i = 0
        while i < len(pieces):
            used = 0
            batch: list[tuple[Chunk, int, int, int]] = []
            while i < len(pieces) and used + (pieces[i][2] - pieces[i][1]) <= step:
                chunk, lo, hi = pieces[i]
                self._to_host(region[self._row0 + used:self._row0 + used + hi - lo], chunk.rows[lo:hi],
                              chunk.freeze)
                batch.append((chunk, lo, hi, self._row0 + used))
                used += hi - lo
                i += 1
            slots = torch.cat([c.slots[lo:hi] for c, lo, hi, _ in batch])
            msg = lambda rid: build_step_write(  # noqa: E731
                rid, batch[0][0].step_id, [task.key], [0] * len(batch), [task.tid] * len(batch),
                [c.cv for c, _, _, _ in batch], [r0 for _, _, _, r0 in batch], [hi - lo for _, lo, hi, _ in batch],
                slots)
            try:
                reply = self._send(msg).result(timeout=self._timeout_s)
            except FutureTimeout as exc:
                self._unsettled = (f"a flush piece of request {task.req_id!r} tensor {task.key!r} was not "
                                   f"acknowledged within commit_timeout_s={self._timeout_s:.1f}s")
                raise TimeoutError(self._unsettled) from exc
            except BaseException as exc:
                self._unsettled = f"a flush piece of request {task.req_id!r} tensor {task.key!r} failed ({exc})"
                raise
            if not isinstance(reply, P.StepDone):
                raise RuntimeError(f"unexpected reply to a deferred flush: {reply!r}")
            if reply.failure():
                return reply
            written += reply.rows_written
            skipped += reply.rows_skipped
            last = reply
        if last is None:
            return P.StepDone(rid=0, step=task.opened_step, done_tids=pack([task.tid]))
        return P.StepDone(rid=last.rid, step=last.step, done_tids=pack([task.tid]), rows_written=written,
                          rows_skipped=skipped)
