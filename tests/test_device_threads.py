"""Which device omnishm's CUDA calls run on, on threads that never chose one (review, stop 59).

CUDA keeps a current device per thread, and a new thread's is device 0. vLLM sets ``cuda:r`` on TP rank r's
engine thread only; omnishm's flusher and sender threads, a caller's materialize thread and a shutdown on
another thread start on device 0. A runtime call there (``cudaEventSynchronize``, ``cudaHostUnregister``) or a
stream context that restores device 0's stream (``cudaSetDevice``) makes GPU 0's primary context in rank r's
process: hundreds of MB of GPU 0 per rank that vLLM's memory planning never counted.

CPU only: the C entry points torch's CUDA context managers call (device exchange, current and set stream, the
event's base) are stood in for by a model that keeps a current device per thread and logs the device of each
call that needs a context; ``torch.cuda.device``, ``torch.cuda.stream`` (``StreamContext``) and
``torch.cuda.Event`` are torch's own code, and ``CudaOps`` and ``DeviceEvent`` omnishm's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from omnishm.client.device import CudaOps, DeviceEvent, unregister_after_drain

# The model stands in for the CPU build's placeholder of torch's C event type (a Python class it can patch); a
# CUDA build's is the real one, which tests/test_cuda.py drives on a device.
pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU build of torch (the model patches "
                                "its placeholder event type)")
ENGINE_DEVICE = 1


class CudaModel:
    """CUDA's per-thread current device, and every call that needs a context, with its thread and device."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self.contexts = {ENGINE_DEVICE}  # the engine thread's set_device made its device's context
        self.calls: list[tuple[str, str, int]] = []

    @property
    def current(self) -> int:
        return getattr(self._tls, "device", 0)

    def use(self, what: str, device: int | None = None) -> None:
        """A runtime call in ``device``'s context (default: the current one), which makes it if missing."""
        device = self.current if device is None else device
        self.calls.append((threading.current_thread().name, what, device))
        self.contexts.add(device)

    def set_device(self, device: int) -> None:
        if device != self.current:
            self.use("cudaSetDevice", device)  # CUDA 12: makes the device's primary context at once
        self._tls.device = device

    def exchange(self, device: int) -> int:
        prev = self.current
        if device >= 0:
            self.set_device(device)
        return prev

    def maybe_exchange(self, device: int) -> int:
        """c10's MaybeExchangeDevice: switch only to a device whose primary context exists."""
        prev = self.current
        if device >= 0 and device in self.contexts:
            self._tls.device = device
        return prev


class FakeStream:
    device_type = 1

    def __init__(self, index: int) -> None:
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.stream_id = index + 1

    def wait_event(self, event: Any) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def cuda(monkeypatch) -> CudaModel:
    model = CudaModel()
    streams = {i: FakeStream(i) for i in range(4)}

    def index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
        if isinstance(device, int):
            return device
        if device is None or getattr(device, "index", None) is None:
            return model.current
        return torch.device(device).index

    def set_stream(stream: FakeStream | None) -> None:  # torch's _cuda_setStream: cudaSetDevice on another device
        if stream is not None:
            model.set_device(stream.device_index)

    base = torch.cuda.Event.__mro__[1]  # the C event type's placeholder

    def record(event: Any, stream: FakeStream) -> None:
        model.use("cudaEventRecord", stream.device_index)
        event._model_device = stream.device_index

    monkeypatch.setattr(torch.cuda, "_get_device_index", index)
    monkeypatch.setattr(torch.cuda, "_exchange_device", model.exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", model.maybe_exchange)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: streams[index(device)])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(base, "__new__", lambda cls, **kw: object.__new__(cls))
    monkeypatch.setattr(base, "__init__", lambda self, *a, **kw: None)
    monkeypatch.setattr(base, "record", record, raising=False)
    monkeypatch.setattr(base, "synchronize", lambda self: model.use("cudaEventSynchronize"), raising=False)
    monkeypatch.setattr(base, "query", lambda self: model.use("cudaEventQuery") or True, raising=False)
    monkeypatch.setattr(base, "device", property(lambda self: torch.device("cuda", self._model_device)),
                        raising=False)
    model.set_device(ENGINE_DEVICE)  # the engine thread: vLLM's worker chose its rank's device
    model.streams = streams  # type: ignore[attr-defined]
    return model


def cuda_ops(model: CudaModel) -> CudaOps:
    ops = object.__new__(CudaOps)  # its streams are the model's (CudaOps.__init__ makes real ones)
    ops.device = torch.device("cuda", ENGINE_DEVICE)
    ops.copy_stream = FakeStream(ENGINE_DEVICE)
    ops.read_stream = FakeStream(ENGINE_DEVICE)
    return ops


def on_thread(name: str, fn: Any) -> None:
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised on the test's thread
            failure.append(exc)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{name} did not finish"
    if failure:
        raise failure[0]


class Registration:
    def __init__(self, model: CudaModel) -> None:
        self.model = model

    def unregister(self) -> None:
        self.model.use("cudaHostUnregister")


def test_every_cuda_call_off_the_engine_thread_runs_on_the_ops_device(cuda):
    """The flusher's copy and its wait, the sender's wait of a freeze event, a materializing thread's wait, and
    a shutdown's unregister on another thread: each in ``cuda:1``'s context, and no context made on GPU 0.
    Before the fix the flusher's stream context restored device 0's stream (``cudaSetDevice(0)``) and every
    wait on a helper thread ran on device 0."""
    ops = cuda_ops(cuda)
    freeze = ops.record_freeze()  # the engine thread, at a save
    dst, src = torch.zeros(4, 3), torch.ones(4, 3)
    on_thread("omnishm-flusher", lambda: ops.to_host([(dst, src)], freeze).synchronize())
    on_thread("omnishm-sender", freeze.synchronize)
    on_thread("a caller's materialize", lambda: freeze.query())
    on_thread("a shutdown", lambda: unregister_after_drain(ops, [Registration(cuda)], 1.0))
    assert torch.equal(dst, src)
    wrong = [call for call in cuda.calls if call[2] != ENGINE_DEVICE]
    assert not wrong, f"CUDA calls on another device than the ops' (a context on GPU 0 for rank 1): {wrong}"
    assert cuda.contexts == {ENGINE_DEVICE}
    assert isinstance(freeze, DeviceEvent)
    waits = {(thread, what) for thread, what, _ in cuda.calls}
    assert {("omnishm-flusher", "cudaEventSynchronize"), ("omnishm-sender", "cudaEventSynchronize"),
            ("a caller's materialize", "cudaEventQuery"), ("a shutdown", "cudaHostUnregister")} <= waits


def test_the_ops_leave_the_callers_current_device_as_it_was(cuda):
    """A call on a thread whose current device is another (a caller's thread on ``cuda:2``) runs on the ops'
    device and gives the thread its own back: omnishm chooses no device for a thread it does not own."""
    ops = cuda_ops(cuda)
    seen: list[int] = []

    def callers_thread() -> None:
        cuda.set_device(2)  # the caller's own choice (its context exists from here on)
        ops.to_host([(torch.zeros(2), torch.ones(2))], ops.record_freeze()).synchronize()
        seen.append(cuda.current)

    on_thread("a caller", callers_thread)
    assert seen == [2]
    assert all(device == ENGINE_DEVICE for thread, what, device in cuda.calls
               if thread == "a caller" and what != "cudaSetDevice")
