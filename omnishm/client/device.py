"""Device copies of the writer: freeze, device-to-host staging, events, pinning.

The seed's rule: the engine thread never waits a device-to-host copy of the
current step, and every copy is fenced against the compute that produced it
(and against CUDA-graph buffers that will be overwritten). So on CUDA:

1. ``freeze``: clone the step's rows on the device (the live buffers may be
   reused by the next graph replay) and record a *freeze event* on the
   compute stream.
2. ``to_host``: on a dedicated copy stream that waits the freeze event, copy
   each key's whole step into its pinned staging page, then record a
   *completion event*.
3. The step's descriptor is sent only once that event completed: the
   committer (which never touches CUDA) may read the page only once the copy
   landed. ``materialize`` waits that event anyway (it reads the step's
   rows), so the thread that materializes sends it (``StepSender.send_now``);
   the ``StepSender`` thread is the backstop for a step that is materialized
   late or discarded: it waits the event, then up to ``SEND_GRACE_S`` for the
   materializing thread to take the step, and sends it if nobody did. Whoever
   takes a step first sends it, exactly once. Without the grace both threads wake on the
   same event and fight for the GIL (A/B on an H200 machine, 256-token
   steps: ``materialize`` 0.46-0.52 ms with the grace, 0.54-0.66 ms without).

``CpuOps`` runs the same sequence on CPU tensors: freeze is a no-op (the
staging copy is the snapshot), copies are synchronous, and events are
already complete. ``CudaOps`` is the real thing. Tests substitute recording
fakes to check the order of waits, copies and sends.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Protocol

import torch

from omnishm.client.serial import SerialThread

logger = logging.getLogger(__name__)

REGISTER_CHUNK_BYTES = 64 << 30
"""cudaHostRegister is called in row-aligned chunks of at most this size."""
SEND_GRACE_S = 0.001
"""How long the sender thread leaves a completed step to the materializing thread before sending it."""


class Event(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DoneEvent:
    """An event that has already happened (CPU copies are synchronous)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE = DoneEvent()


class DeviceOps(Protocol):
    """What the manager needs from a device; see the module docstring."""

    is_cuda: bool

    def freeze(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows that stay as they are until the step's copies ran. On a device: a contiguous clone, made on
        the engine's current stream before ``record_freeze``, so that every later reshape of it is a view (a
        reshape that copies is a kernel after the freeze event, which no copy or read waits)."""
        ...

    def record_freeze(self) -> Event: ...

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event) -> Event: ...

    def read_rows(self, rows: torch.Tensor, index: torch.Tensor | None = None, after: Event = DONE) -> torch.Tensor:
        """``rows`` (or ``rows[index]``) as host rows, waited for on the calling thread. ``after``: the event
        after which ``rows`` hold their values (the freeze event of the step that made the device clone).
        Only that is waited, never the copy stream as a whole: by then it holds later steps' copies, each
        behind its own step's forward, and the engine thread reads in-flight rows at a save's copy-on-write
        (review, 2026-12-06)."""
        ...

    def leftover(self, value: torch.Tensor) -> tuple[torch.Tensor, Event]: ...

    def drain(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until every copy issued on the ops' own streams ran; whether they did.
        Before host memory they copy into is unregistered (shutdown)."""
        ...


class CpuOps:
    """CPU build: same calls, synchronous copies, completed events."""

    is_cuda = False

    def freeze(self, rows: torch.Tensor) -> torch.Tensor:
        return rows  # the staging copy that follows is the snapshot

    def record_freeze(self) -> Event:
        return DONE

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event) -> Event:
        after.synchronize()
        for dst, src in pairs:
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
        return DONE

    def read_rows(self, rows: torch.Tensor, index: torch.Tensor | None = None, after: Event = DONE) -> torch.Tensor:
        return rows.index_select(0, index) if index is not None else rows.clone()

    def leftover(self, value: torch.Tensor) -> tuple[torch.Tensor, Event]:
        return value.clone(), DONE

    def drain(self, timeout_s: float) -> bool:
        return True  # every copy was synchronous


class DeviceEvent(torch.cuda.Event):
    """A CUDA event waited (and queried) with its own device current, on whatever thread waits it.

    ``cudaEventSynchronize`` runs in the calling thread's current device's context, and a thread that never
    chose a device has device 0: omnishm's flusher and sender threads, and a caller's thread that
    materializes. On TP rank r's process (its engine thread on ``cuda:r``) such a wait made GPU 0's primary
    context, hundreds of MB of GPU 0 per rank that vLLM's memory planning never counted (review, stop 59).
    Every event omnishm records is one of these."""

    def synchronize(self) -> None:
        with torch.cuda.device(self.device):
            super().synchronize()

    def query(self) -> bool:
        with torch.cuda.device(self.device):
            return super().query()


class CudaOps:
    """Real CUDA streams and events. Constructed only when rows live on a CUDA device.

    Any thread: every call runs with ``device`` current (``torch.cuda.device``) and restores the caller's
    afterwards. A stream context on a thread whose current device is another (the flusher's, a caller's
    materialize thread: device 0) restored that device's stream on exit, which made that device current for
    good (``cudaSetDevice``, a primary context on GPU 0 for every rank; review, stop 59)."""

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)
        self.read_stream = torch.cuda.Stream(device=device)

    def _check_device(self, t: torch.Tensor) -> None:
        """``ValueError`` for a CUDA tensor on another device than this manager's: a copy runs on the current
        stream of its source's device, so neither the copy stream nor the freeze event (both on
        ``self.device``) would fence it, and its rows could be read before they landed (review, 2026-12-06)."""
        if t.is_cuda and t.device != self.device:
            raise ValueError(f"rows on {t.device}, but this manager's copies run on {self.device} (the device of "
                             f"its first device rows): one CUDA device per manager, as a vLLM worker has one")

    def freeze(self, rows: torch.Tensor) -> torch.Tensor:
        self._check_device(rows)
        # A plain clone keeps the strides of a dense tensor (a permuted head output, say), and the manager's
        # reshape of it to (n, width) was then a second clone, made after the freeze event (review).
        return rows.clone(memory_format=torch.contiguous_format)

    def record_freeze(self) -> Event:
        event = DeviceEvent()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Event) -> Event:
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            if isinstance(after, torch.cuda.Event):
                self.copy_stream.wait_event(after)
            else:
                after.synchronize()
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
                if src.is_cuda:  # a host key's rows (a CPU clone) were copied at once; record_stream has no CPU kernel
                    # The clone must outlive the copy although the engine drops it.
                    src.record_stream(self.copy_stream)
            done = DeviceEvent()
            done.record(self.copy_stream)
        return done

    def read_rows(self, rows: torch.Tensor, index: torch.Tensor | None = None, after: Event = DONE) -> torch.Tensor:
        if not rows.is_cuda:
            return rows.index_select(0, index) if index is not None else rows.clone()
        # The pinned result too: the host allocator's cudaHostAlloc runs in the current device's context.
        with torch.cuda.device(self.device), torch.cuda.stream(self.read_stream):
            if isinstance(after, torch.cuda.Event):
                self.read_stream.wait_event(after)
            else:
                after.synchronize()
            src = rows.index_select(0, index.to(rows.device)) if index is not None else rows
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out.copy_(src, non_blocking=True)
            done = DeviceEvent()
            done.record(self.read_stream)
        done.synchronize()  # a read of in-flight rows: only the materializing thread waits (under its device)
        return out

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not (self.copy_stream.query() and self.read_stream.query()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def leftover(self, value: torch.Tensor) -> tuple[torch.Tensor, Event]:
        if not value.is_cuda:
            return value.clone(), DONE
        self._check_device(value)
        with torch.cuda.device(self.device):
            out = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            out.copy_(value, non_blocking=True)
            event = DeviceEvent()
            event.record(torch.cuda.current_stream(self.device))
        return out, event


def choose_ops(current: "DeviceOps | None", tensors: list[torch.Tensor]) -> tuple["DeviceOps", bool]:
    """Engine thread, at a save whose ops are not chosen for good: ``(ops for this step, whether to keep them)``.

    A step without tensors (0 tokens) says no device, and one of host tensors only (a CPU leftover beside hidden
    states not cached, say) says no more than that: device ops are kept for good once a step has device
    tensors, CPU ops only until then. CPU ops kept for good from such a step copied every later step's device
    rows on the engine thread, without a freeze clone (review, 2026-12-05)."""
    found = ops_for(tensors)
    if current is None or found.is_cuda:
        return found, bool(tensors)
    return current, False


class FrozenStep(NamedTuple):
    """A save's outputs once ``freeze_step`` made them safe from the caller's later writes."""

    immediate: dict[str, torch.Tensor]
    deferred: dict[str, torch.Tensor]
    leftover: dict[str, Any]
    leftover_events: list[Event]
    freeze_event: Event


def freeze_step(ops: "DeviceOps", immediate: dict[str, torch.Tensor], deferred: dict[str, torch.Tensor],
                leftover: dict[str, Any]) -> FrozenStep:
    """Engine thread, first thing in a save (the live graph buffers may be overwritten once it returns): the
    rows frozen (``ops.freeze``; a deferred key on the host is cloned, contiguous as ``freeze``'s, so its
    (n, width) view is no other copy), the leftovers copied (``snapshot_leftover``), and the freeze event
    recorded after all of them."""
    immediate = {k: ops.freeze(v) for k, v in immediate.items()}
    if deferred:
        deferred = {k: (ops.freeze(v) if ops.is_cuda else v.clone(memory_format=torch.contiguous_format))
                    for k, v in deferred.items()}
    events: list[Event] = []
    leftover = {k: snapshot_leftover(ops, v, events) for k, v in leftover.items()}
    return FrozenStep(immediate, deferred, leftover, events, ops.record_freeze())


def snapshot_leftover(ops: "DeviceOps", value: Any, events: list[Event]) -> Any:
    """Engine thread: a copy of a leftover value (one not written to the pool) that later writes to the
    caller's buffers cannot change: a deep copy in which every tensor, in mappings, lists and tuples too,
    is the copy ``ops.leftover`` makes (a device tensor to pinned host memory without blocking; its event
    appended to ``events``), one per tensor however often the value holds it. Container types, shared
    parts and cycles are kept as ``copy.deepcopy`` keeps them. Nested device tensors were deep-copied on
    the device (review): they came back from materialize on the GPU, beside top-level ones on the CPU, held
    GPU memory for every unconsumed step, and were copied without waiting the engine's stream."""
    if isinstance(value, torch.Tensor):
        out, event = ops.leftover(value.detach() if value.requires_grad else value)
        events.append(event)
        return out
    memo: dict[int, Any] = {}
    for t in tensors_in(value):
        memo[id(t)], event = ops.leftover(t.detach() if t.requires_grad else t)
        events.append(event)
    return copy.deepcopy(value, memo)  # a tensor in memo is taken as its own copy: the snapshot


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, inside mappings, lists and tuples too, each once (a value may hold itself)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.setdefault(id(item), item)
        elif isinstance(item, (Mapping, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend(item.values() if isinstance(item, Mapping) else item)
    return list(found.values())


def ops_for(tensors: list[torch.Tensor]) -> DeviceOps:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return CudaOps(t.device)
    return CpuOps()


# ---------------------------------------------------------------------------- sender


class PendingSend:
    """One step's descriptor, waiting for its copy event; sent exactly once, by whoever takes it first."""

    __slots__ = ("event", "make", "marker", "outer", "taken", "_once")

    def __init__(self, event: Event, make: Callable[[int], Any], marker: int = 0):
        self.event = event
        self.make = make
        self.marker = marker
        """A quiet step's acknowledgement marker, handed to the send (0: none)."""
        self.outer: Future = Future()
        self.taken = threading.Event()
        self._once = threading.Lock()

    def take(self) -> bool:
        """True for the first caller only (it must send); later callers get False."""
        if not self._once.acquire(blocking=False):
            return False
        self.taken.set()
        return True


class StepSender:
    """Sends step descriptors once their copy event completed (see the module docstring).

    ``submit`` returns at once; the engine thread never waits here. The
    ``omnishm-sender`` thread keeps the order it was given, waits each event,
    then up to ``grace_s`` for ``send_now`` to take the step, and sends it if
    nothing did.
    ``send_now`` is for a thread that already waited the step's event.
    """

    def __init__(self, send: Callable[[Callable[[int], Any]], Future], *, grace_s: float = SEND_GRACE_S):
        self._send = send
        self.grace_s = grace_s
        self._thread: SerialThread[PendingSend] = SerialThread("omnishm-sender", self._send_after)

    def submit(self, event: Event, make: Callable[[int], Any], marker: int = 0) -> PendingSend:
        """Queue the step; raises ``RuntimeError`` once ``stop`` was called (another thread's shutdown):
        the step would never be sent, and its write's future never complete (review, 2026-12-07)."""
        item = PendingSend(event, make, marker)
        if not self._thread.put(item):
            raise RuntimeError("the sender thread is stopped (the manager is shut down)")
        return item

    def send_now(self, item: PendingSend) -> None:
        """Send ``item`` from this thread unless it was sent; its event must have completed."""
        if item.take():
            self._deliver(item)

    def stop(self, timeout_s: float) -> None:
        self._thread.stop(timeout_s)

    def _send_after(self, item: PendingSend) -> None:
        try:
            item.event.synchronize()
        except BaseException as exc:  # handed to whoever waits the step's write
            if item.take():
                item.outer.set_exception(exc)
            return
        item.taken.wait(self.grace_s)  # the materializing thread usually takes it now
        if item.take():
            self._deliver(item)

    def _deliver(self, item: PendingSend) -> None:
        try:
            inner = self._send(item.make, ack_marker=item.marker)
        except BaseException as exc:  # handed to whoever waits the step's write
            item.outer.set_exception(exc)
            return
        inner.add_done_callback(lambda f, outer=item.outer: _chain(f, outer))
        # Published last: whoever settles the quiet step by this rid then completes ``outer`` too.
        item.outer.rid = getattr(inner, "rid", None)  # type: ignore[attr-defined]


def _chain(inner: Future, outer: Future) -> None:
    exc = inner.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(inner.result())


# ---------------------------------------------------------------------------- pinning


def unregister_after_drain(ops: "DeviceOps | None", registrations: list["HostRegistration"],
                           timeout_s: float) -> str:
    """Shutdown: unpin the staging once the ops' streams drained; "" when done, else why not. A copy into
    registered staging may still be queued (a step abandoned after its copy was issued; a sender stopped by
    its timeout), and unregistering under it is undefined (review, 2026-12-05): staging that does not drain
    within ``timeout_s``, or whose drain fails (a CUDA error: ``Stream.query`` raises), stays registered.
    Never raises for the drain."""
    try:
        if ops is not None and not ops.drain(timeout_s):
            return f"device copies still queued after {timeout_s:.1f}s"
    except Exception as exc:
        return f"the copy streams failed: {exc}"
    # In the rows' device's context: shutdown may run on any thread, and one that never chose a device made
    # GPU 0's primary context for this call (``DeviceEvent``).
    with torch.cuda.device(ops.device) if isinstance(ops, CudaOps) else contextlib.nullcontext():
        for reg in registrations:  # before the mappings can go away
            reg.unregister()
    return ""


class HostRegistration:
    """``cudaHostRegister`` of a shared-memory view, in row-aligned chunks of <= 64 GiB.

    Registration is per process and per CUDA context, so every CUDA process
    that copies into or out of a segment registers it itself; the committer
    never does (it never initialises CUDA). On failure the sticky CUDA error is
    cleared, one loud warning is logged and the fallback is counted: copies then
    run unpinned, still correct but slower, and they stall: a device-to-host copy
    into pageable memory returns only once it ran, so ``save_outputs`` then waits
    its step's compute on the engine thread. ``unregister`` must run before the
    mapping goes away.
    """

    fallbacks = 0
    _warned = False

    def __init__(self, view: torch.Tensor, *, read_only: bool = False):
        self.ptrs: list[int] = []
        if view.numel() == 0 or not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        row_bytes = view[0].numel() * view.element_size() if view.dim() > 1 else view.element_size()
        chunk = max(REGISTER_CHUNK_BYTES // row_bytes, 1) * row_bytes
        base, total = view.data_ptr(), view.numel() * view.element_size()
        # cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current device's
        # (a thread whose current device is not the rows' would pin it for the wrong one; review, 2026-12-06);
        # cudaHostRegisterReadOnly for read-only maps.
        flags = 0x01 | (0x08 if read_only else 0)
        for off in range(0, total, chunk):
            size = min(chunk, total - off)
            rc = cudart.cudaHostRegister(base + off, size, flags)
            if int(rc) != 0:
                _clear_last_cuda_error()  # before torch's next launch check trips on it
                type(self).fallbacks += 1
                if not type(self)._warned:
                    type(self)._warned = True
                    logger.warning("cudaHostRegister of %d bytes failed (error %s): staging copies fall back to "
                                   "unpinned memory, which is slower and makes save_outputs wait for each step's "
                                   "compute. Check RLIMIT_MEMLOCK and the driver.",
                                   size, int(rc))
                self.unregister()
                return
            self.ptrs.append(base + off)

    @property
    def pinned(self) -> bool:
        return bool(self.ptrs)

    def unregister(self) -> None:
        if not self.ptrs:
            return
        cudart = torch.cuda.cudart()
        while self.ptrs:
            # Taken off once its call returned: an interrupt between the two leaves it listed, and a redo
            # unregisters it again (an error, cleared) rather than never (a mapping that goes away pinned).
            rc = cudart.cudaHostUnregister(ctypes.c_void_p(self.ptrs[-1]).value)
            self.ptrs.pop()
            if int(rc) != 0:
                _clear_last_cuda_error()  # not registered any more: before torch's next launch check trips on it


def _clear_last_cuda_error() -> None:
    """``cudaGetLastError()`` from the libcudart this process loaded (torch's binding has none)."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
    except OSError:
        pass
    for name in ([path] if path else []) + ["libcudart.so", "libcudart.so.12", "libcudart.so.13"]:
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue
    logger.warning("could not clear the CUDA error left by a failed cudaHostRegister (libcudart not found)")
