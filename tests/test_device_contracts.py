"""Contracts of the device path (omnishm/client/device.py and its callers) that a mutation review found untested
(stop 47: 29 mutants, 20 killed by the suite): each device-to-host copy fenced by its own step's freeze event, the
flusher waiting its copies, every leftover tensor's copy waited, a host deferred key snapshotted at the save, the
drain of both streams, ``to_host``'s order, and a step sent only after its copy landed.

CPU only: ``FakeOps``-style stand-ins for the streams and events, and the real ``CudaOps`` methods that use
nothing CUDA-only with the CUDA objects stood in for (as tests/test_device_order.py does). The tests at the end
(stop 52's mutation review: CPU leftovers snapshotted, a leftover that holds itself, nested tensors handed out as
the ops' host copies, a late copy error of a step already sent) run the CPU build's ops on a real manager.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from manager_helpers import BS, MM_WIDTH, Part, build, extended, finished, rows, save, small_config, started
from omnishm.client import ModelCachePolicy, OmniPrefixCacheManager
from omnishm.client import device as device_module
from omnishm.client.device import DONE, CpuOps, CudaOps, StepSender
from test_device_order import FakeOps, LandsOnWait, StayOnDevice


class RecordingOps(FakeOps):
    """``FakeOps`` (events complete at once) that also records each ``to_host``'s thread and ``after``
    event, and keeps every freeze event it recorded."""

    def __init__(self):
        super().__init__()
        self.auto = True
        self.freezes: list = []
        self.copies: list[tuple[str, object, object]] = []  # (thread, after, completion event)

    def record_freeze(self):
        event = super().record_freeze()
        self.freezes.append(event)
        return event

    def to_host(self, pairs, after):
        import threading

        done = super().to_host(pairs, after)
        self.copies.append((threading.current_thread().name, after, done))
        return done


def test_every_device_to_host_copy_is_fenced_by_its_own_steps_freeze_and_the_flusher_waits_it(committer):
    """Contract: a step's staging copy and every deferred flush copy of a chunk wait the freeze event of the
    step that made the chunk's device clone (``to_host(pairs, after=that event)``; a copy fenced by nothing
    may read the clone before the engine's stream wrote it), and the flusher waits each copy's completion
    event before it sends the piece's descriptor (the committer may read the region only once it landed).
    Killed mutants: ``to_host(pairs, DONE)`` at the save, a flush copy passed ``DONE`` or a chunk without its
    freeze event, and ``_flush_copy`` not waiting its copy."""
    ops = RecordingOps()
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 4)], BS))
        m.new_step_starts([extended("a", 4)])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 2)], BS))
        f0, f1 = ops.freezes
        step_copies = [(after, done) for thread, after, done in ops.copies if thread == "MainThread"]
        assert [after for after, _ in step_copies] == [f0, f1]
        m.new_step_starts([finished("a")])  # closes a's deferred write: the flusher copies both chunks
        m.wait_idle()
        flushes = [(after, done) for thread, after, done in ops.copies if thread == "omnishm-flusher"]
        # One flush piece per chunk (copy_chunk_bytes is far larger), each fenced by its own step's freeze.
        assert [after for after, _ in flushes] == [f0, f1], [getattr(a, "name", a) for a, _ in flushes]
        for _, done in flushes:
            assert "omnishm-flusher" in done.waiters  # the piece's copy was waited before its descriptor left
        feat = m._keys["feat"]
        assert torch.equal(feat.pool[torch.arange(6)], rows(501, range(6), MM_WIDTH))


class LandingLeftoverOps(FakeOps):
    """``FakeOps`` whose leftover copies land only when their own event is waited (as late as CUDA may land
    a non-blocking device-to-host copy): a leftover read without waiting its event reads -999."""

    def __init__(self):
        super().__init__()
        self.auto = True

    def leftover(self, value):
        event = LandsOnWait()
        out = torch.full(value.shape, -999.0, dtype=value.dtype)
        event.pending.append((out, value.clone()))
        return out, event


def test_materialize_waits_the_copy_of_every_top_level_leftover_tensor(committer):
    """Contract: a leftover mm tensor (one not written to the pool) is copied off the device by
    ``ops.leftover`` without blocking the engine thread, and materialize waits that copy's event before it
    hands the value out, for every leftover tensor of the step, not only the last one or only nested ones.
    Killed mutants: ``snapshot_leftover`` dropping a top-level tensor's event, and ``_wait_step_events``
    waiting the last leftover event only."""
    ops = LandingLeftoverOps()
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.new_step_starts([started("a", [0, 1])])
        first, second = torch.arange(5.0), torch.arange(7.0) + 100
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS, extra_mm={"m1": first, "m2": second})
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["a"]["m1"], torch.arange(5.0))
        assert torch.equal(out.mm_outputs["a"]["m2"], torch.arange(7.0) + 100)
        assert torch.equal(out.hidden_states["a"], rows(1, range(6)))


def test_a_cpu_deferred_key_is_snapshotted_at_the_save(committer):
    """Contract: ``save_outputs`` takes a snapshot of a deferred key's rows on the host too (a contiguous
    clone in ``freeze_step``): a runner that reuses its output buffer for the next step after the save must
    not change what materialize returns nor what the deferred write flushes to the pool. Killed mutant: the
    host deferred rows kept as the caller's tensor."""
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        m.new_step_starts([started("a", [0, 1])])
        h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 6)], BS)
        sid = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
        mm["feat"].fill_(-7.0)  # the runner's buffer, rewritten for its next step
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["a"]["feat"], rows(501, range(6), MM_WIDTH))
        m.new_step_starts([finished("a")])
        m.wait_idle()
        assert torch.equal(m._keys["feat"].pool[torch.arange(6)], rows(501, range(6), MM_WIDTH))


class _Stream:
    def __init__(self, busy_queries: int):
        self.busy = busy_queries  # queries answered False before the stream is idle (-1: never idle)

    def query(self) -> bool:
        if self.busy == 0:
            return True
        if self.busy > 0:
            self.busy -= 1
        return False


def _cuda_ops_with(copy_busy: int, read_busy: int) -> CudaOps:
    ops = object.__new__(CudaOps)  # no real streams: drain only queries them
    ops.device = torch.device("cuda", 0)
    ops.copy_stream, ops.read_stream = _Stream(copy_busy), _Stream(read_busy)
    return ops


def test_cuda_drain_reports_drained_only_when_both_streams_are_idle():
    """Contract: ``CudaOps.drain`` (shutdown, before the pinned staging is unregistered) returns True only
    once the copy stream AND the read stream ran everything queued on them, and False when either is still
    busy at the deadline: unregistering host memory under a queued copy is undefined in CUDA. Killed
    mutants: ``or`` for ``and`` in the idle check, and True returned at the deadline."""
    assert _cuda_ops_with(0, 0).drain(1.0) is True
    assert _cuda_ops_with(3, 2).drain(5.0) is True  # both go idle before the deadline
    assert _cuda_ops_with(0, -1).drain(0.02) is False  # the read stream never drains
    assert _cuda_ops_with(-1, 0).drain(0.02) is False  # the copy stream never drains


def test_cuda_to_host_waits_a_host_event_first_and_records_its_completion_after_the_copies(monkeypatch):
    """Contract: ``CudaOps.to_host`` fences its copies behind ``after`` (a host-side event is synchronized
    before any copy is issued) and records the completion event after every copy of the step (the sender
    sends the step's descriptor once that event completed; recorded before the copies, it would complete
    before they land). The real method, with the CUDA objects stood in for (a CPU stream, an event that
    snapshots the destination when it is recorded). Killed mutants: the host event not synchronized, the
    completion event recorded before the copies."""
    dst = torch.zeros(4, MM_WIDTH)
    src = rows(501, range(4), MM_WIDTH)
    seen: dict[str, torch.Tensor] = {}

    class Recorded:
        def record(self, stream=None) -> None:
            seen["at_record"] = dst.clone()

    class HostEvent:
        def synchronize(self) -> None:
            seen["at_after"] = dst.clone()

        def query(self) -> bool:
            return True

    monkeypatch.setattr(device_module, "DeviceEvent", Recorded)
    monkeypatch.setattr(torch.cuda, "device", StayOnDevice)
    ops = object.__new__(CudaOps)
    ops.device = torch.device("cuda", 0)
    ops.copy_stream = torch.Stream(device="cpu")
    done = ops.to_host([(dst, src)], HostEvent())
    assert isinstance(done, Recorded) and torch.equal(dst, src)
    assert torch.equal(seen["at_after"], torch.zeros(4, MM_WIDTH))  # waited before the copy
    assert torch.equal(seen["at_record"], src)  # recorded after it
    assert ops.to_host([(dst, src)], DONE) is not None


def test_materialize_sends_its_step_only_after_waiting_the_steps_copy(committer):
    """Contract: the thread that materializes a CUDA writer's step sends the step's descriptor itself
    (``StepSender.send_now``) only once it waited the step's device-to-host copy event: the committer may
    read the staging page only after the copy landed. The materialize runs on a helper thread while the
    copy event is held open; once that thread waits the event, nothing of the step may have been sent.
    Killed mutant: ``_wait_step_events`` sending before it waits the event."""
    import threading
    import time

    ops = FakeOps()
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        sent: list[tuple[int, bool]] = []
        real_submit = m._link.submit

        def submit(make, **kw):
            msg = make(0)
            if type(msg).__name__ == "StepWrite":
                sent.append((msg.step, d2h.query()))
            return real_submit(make, **kw)

        m._link.submit = submit
        m._sender._send = submit
        m._sender.grace_s = 30.0  # the sender thread leaves the step to materialize
        m.new_step_starts([started("a", [0, 1])])
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS)
        d2h = [e for e in ops.events if e.name.startswith("d2h")][0]
        for e in ops.events:
            if e is not d2h:
                e.complete()
        got: dict = {}
        worker = threading.Thread(target=lambda: got.update(out=m.materialize(sid, ["a"])), name="materializer")
        worker.start()
        deadline = time.monotonic() + 10
        while "materializer" not in d2h.waiters:  # the condition waited for: the worker is in the event's wait
            assert time.monotonic() < deadline, "materialize never waited the step's copy event"
            time.sleep(0.001)
        assert sent == [], sent  # nothing left before the copy landed
        d2h.complete()
        worker.join(10)
        m.wait_idle()
        assert sent == [(sid, True)]
        assert torch.equal(got["out"].hidden_states["a"], rows(1, range(6)))



def test_a_cpu_leftover_tensor_is_snapshotted_at_the_save(committer):
    """Contract: a leftover mm tensor (one the policy does not write to the pool) is snapshotted by
    ``save_outputs`` on the CPU build too (``CpuOps.leftover`` clones it): a runner that reuses that buffer
    for its next step after the save must not change what ``materialize`` hands out for this step, nested
    or top-level. Killed mutant: ``CpuOps.leftover`` returning the caller's tensor itself."""
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1])])
        top, inner = torch.arange(5.0), torch.arange(3.0) + 10
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS, extra_mm={"m1": top, "nested": {"x": inner}})
        top.fill_(-1.0)  # the runner's buffers, rewritten for its next step
        inner.fill_(-1.0)
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["a"]["m1"], torch.arange(5.0))
        assert torch.equal(out.mm_outputs["a"]["nested"]["x"], torch.arange(3.0) + 10)
        assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
        m.new_step_starts([finished("a")])


def test_a_leftover_value_that_holds_itself_is_snapshotted_without_hanging_the_save(committer):
    """Contract: ``save_outputs`` snapshots any leftover value, cycles included (``tensors_in`` visits each
    container once; ``copy.deepcopy`` keeps the cycle), and returns: the engine thread never spins on a
    self-referencing value, and materialize hands out a copy whose cycle and tensor are kept. The save runs on
    a daemon thread so that a spinning save fails the test instead of hanging it. Killed mutant:
    ``tensors_in`` without its ``seen`` set (an endless walk of the cycle)."""
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1])])
        t = torch.arange(4.0)
        value: list = [t]
        value.append(value)  # a value that holds itself
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(sid=save(m, [Part("a", 1, [0, 1], 0, 6)], BS,
                                                                 extra_mm={"cyc": value})), daemon=True)
        th.start()
        th.join(10)
        assert "sid" in got, "save_outputs did not return for a leftover value that holds itself"
        t.fill_(-1.0)
        out = m.materialize(got["sid"], ["a"])
        snap = out.mm_outputs["a"]["cyc"]
        assert snap is not value and snap[1] is snap and torch.equal(snap[0], torch.arange(4.0))
        m.new_step_starts([finished("a")])


def test_tensors_nested_in_a_leftover_value_are_handed_out_as_the_ops_host_copies(committer):
    """Contract: every tensor nested in a leftover value is replaced, in the snapshot materialize hands out,
    by the host copy ``ops.leftover`` made (on CUDA: the pinned host copy whose event materialize waits),
    once per tensor however often the value holds it; it is never deep-copied where it lay (on CUDA: a device
    copy, handed out on the GPU and never waited). Here ``meta`` tensors stand in for device tensors and
    recording CPU ops move them to the host. Killed mutant: ``snapshot_leftover`` deep-copying the value
    without the memo of ``ops.leftover``'s copies."""
    class MetaToHostOps(CpuOps):
        def __init__(self):
            self.calls = 0

        def leftover(self, value):
            self.calls += 1
            if value.is_meta:  # the "device" tensor: its host copy
                return torch.full(value.shape, 7.0), DONE
            return super().leftover(value)

    ops = MetaToHostOps()
    with OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.new_step_starts([started("a", [0, 1])])
        inner = torch.empty(3, device="meta")
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS, extra_mm={"nested": [inner, {"x": inner}]})
        value = m.materialize(sid, ["a"]).mm_outputs["a"]["nested"]
        assert ops.calls == 1  # one copy for the tensor the value holds twice
        assert value[0].device.type == "cpu" and torch.equal(value[0], torch.full((3,), 7.0))
        assert value[1]["x"] is value[0]
        m.new_step_starts([finished("a")])


def test_a_copy_error_after_the_step_was_sent_by_send_now_does_not_fail_its_write():
    """Contract (``StepSender``): whoever takes a step first sends it, exactly once, and only the sender
    thread that takes a step hands its copy error to the step's waiter. A step already taken and sent by the
    materializing thread (``send_now``) keeps the outcome of that send even when the sender thread's own wait
    of the event then raises. Killed mutant: ``_send_after`` setting the exception on the step's future
    without taking the step first."""
    inners: list[Future] = []

    def send(make, **_kw):
        fut: Future = Future()
        make(0)
        inners.append(fut)
        return fut

    release, waited = threading.Event(), threading.Event()

    class FailsLate:
        def synchronize(self) -> None:  # the sender thread's wait: fails once the test releases it
            waited.set()
            assert release.wait(10)
            raise RuntimeError("device copy failed")

        def query(self) -> bool:
            return True

    sender = StepSender(send, grace_s=0.0)
    try:
        item = sender.submit(FailsLate(), lambda rid: 1)
        assert waited.wait(10)
        sender.send_now(item)  # the materializing thread takes and sends it
        release.set()
    finally:
        sender.stop(5.0)  # the sender thread has handled the item once this returns
    assert len(inners) == 1
    inners[0].set_result("ack 1")
    assert item.outer.result(timeout=5) == "ack 1"
