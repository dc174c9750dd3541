"""Event and ordering logic of the device path, on CPU, with recording fakes.

``FakeOps`` stands in for CUDA streams: copies are recorded (and done, so the
data is right), but their completion events fire only when the test says so.
That makes the seed's ordering rules observable: no descriptor leaves before
its copy event, the engine thread never waits a copy of the current step, and
the GPU-byte budget flushes the oldest pending write first.
"""

from __future__ import annotations

import threading

import pytest
import torch

from manager_helpers import MM_WIDTH, WIDTH, small_config, Part, build, extended, finished, rows, save, started
from omnishm.client import ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client import device as device_module
from omnishm.client.adapter import PrefixCacheWriteLayout
from omnishm.client.device import DONE, CpuOps, CudaOps
from omnishm.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError

BS = 4


class FakeEvent:
    def __init__(self, name: str, log: list):
        self.name = name
        self.log = log
        self.thread = threading.current_thread().name
        self._done = threading.Event()
        self.waiters: list[str] = []

    def complete(self) -> None:
        self.log.append(("complete", self.name))
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waiters.append(threading.current_thread().name)
        assert self._done.wait(10), f"event {self.name} never completed"


class StayOnDevice:
    """``torch.cuda.device`` for the real ``CudaOps`` methods on a CPU build: no device to switch to
    (tests/test_device_threads.py models the switch)."""

    def __init__(self, device: object) -> None:
        self.idx = -1

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


class FakeOps:
    is_cuda = True  # take the device branches (device clone of deferred rows, etc.)

    def __init__(self):
        self.log: list = []
        self.events: list[FakeEvent] = []
        self.auto = False
        self.frozen: list[torch.Tensor] = []
        self.drained = True

    def _event(self, name: str) -> FakeEvent:
        e = FakeEvent(name, self.log)
        self.events.append(e)
        if self.auto:
            e.complete()
        return e

    def freeze(self, t):
        self.log.append(("freeze", threading.current_thread().name))
        out = t.clone(memory_format=torch.contiguous_format)  # as CudaOps.freeze
        self.frozen.append(out)
        return out

    def record_freeze(self):
        return self._event("freeze")

    def to_host(self, pairs, after):
        self.log.append(("copy", threading.current_thread().name, [d.shape[0] for d, _ in pairs]))
        for dst, src in pairs:
            dst.copy_(src.reshape(dst.shape))
        return self._event(f"d2h{len(self.events)}")

    def read_rows(self, t, index=None, after=DONE):
        """As ``CudaOps.read_rows``: waits ``after`` (the rows' own step's freeze event), nothing else."""
        self.log.append(("read", threading.current_thread().name, getattr(after, "name", "done")))
        after.synchronize()
        return t.index_select(0, index) if index is not None else t.clone()

    def leftover(self, value):
        return value.clone(), self._event("leftover")

    def drain(self, timeout_s):
        self.log.append(("drain", self.drained))
        return self.drained


def config(**kw) -> PrefixCacheConfig:
    return small_config(**kw)


def test_no_descriptor_is_sent_before_its_copy_event_and_save_does_not_wait_it(committer):
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        sent = []
        real_submit = m._link.submit

        def submit(make, **kw):
            msg = make(0)
            if type(msg).__name__ == "StepWrite":
                sent.append(msg.step)
                ops.log.append(("send", msg.step))
            return real_submit(make, **kw)

        m._link.submit = submit
        m._sender._send = submit
        m.new_step_starts([started("a", [0, 1])])
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS)  # returns although the copy event is pending
        d2h = [e for e in ops.events if e.name.startswith("d2h")][0]
        assert sent == [] and not d2h.query()
        assert threading.current_thread().name not in d2h.waiters
        for e in ops.events:
            if e is not d2h:
                e.complete()
        d2h.complete()
        m.wait_idle()
        assert sent == [0]
        order = [x for x in ops.log if x[0] in ("copy", "complete", "send")]
        assert order.index(("complete", d2h.name)) < order.index(("send", 0))
        assert d2h.waiters == ["omnishm-sender"]
        kv = m._keys[HIDDEN_KEY]
        assert torch.equal(kv.pool[torch.arange(6)], rows(1, range(6)))
        # materialize waits the events of its own step only.
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
        assert threading.current_thread().name in d2h.waiters


def test_materialize_sends_its_step_once_and_the_sender_thread_sends_the_rest(committer):
    """The thread that materializes waited the copy event anyway: it sends the step itself (no GIL
    fight with the sender thread); a step nobody materializes in time goes out from the sender thread.
    Each exactly once."""
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        senders: list[tuple[int, str]] = []
        real_submit = m._link.submit

        def submit(make, **kw):
            msg = make(0)
            if type(msg).__name__ == "StepWrite":
                senders.append((msg.step, threading.current_thread().name))
            return real_submit(make, **kw)

        m._link.submit = submit
        m._sender._send = submit
        # A long grace for step 0: the sender thread leaves it to materialize (and stops waiting as soon
        # as materialize takes it); none for step 1, which nobody materializes.
        m._sender.grace_s = 30.0
        ops.auto = True  # copies complete at once: the race between the two threads is what is tested
        m.new_step_starts([started("a", [0, 1])])
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS)
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
        m._sender.grace_s = 0.0
        m.new_step_starts([extended("a", 6)])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 6, 2)], BS))
        m.wait_idle()
        assert senders == [(0, "MainThread"), (1, "omnishm-sender")]
        kv = m._keys[HIDDEN_KEY]
        assert torch.equal(kv.pool[torch.arange(8)], rows(1, range(8)))


def test_engine_thread_never_waits_the_current_steps_copy(committer):
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        ids = []
        for step in range(3):
            m.new_step_starts([started("a", [0, 1, 2, 3])] if step == 0 else [extended("a", 4 * step)])
            before = set(map(id, ops.events))
            ids.append(save(m, [Part("a", 1, [0, 1, 2, 3], 4 * step, 4)], BS))
            mine = [e for e in ops.events if id(e) not in before]
            # Nothing of this step was waited on the engine thread during its save ...
            assert all(threading.current_thread().name not in e.waiters for e in mine)
            for e in mine:  # ... and the copies complete later, as on a real copy stream.
                e.complete()
        for sid in ids:
            m.discard_step(sid)
        freezes = [x for x in ops.log if x[0] == "freeze"]
        copies = [x for x in ops.log if x[0] == "copy"]
        assert len(copies) == 3 and all(x[1] == "MainThread" for x in freezes + copies)  # launches only


def test_budget_flush_takes_the_oldest_pending_write_and_copies_off_the_engine_thread(committer):
    ops = FakeOps()
    ops.auto = True
    row_bytes = 3 * 4
    policy = ModelCachePolicy(deferred_keys=frozenset({"feat"}))
    with OmniPrefixCacheManager(config(gpu_staging_bytes=6 * row_bytes, copy_chunk_bytes=2 * row_bytes),
                                cache=committer.name, autostart=False, device_ops=ops) as m:
        m.register_policy(policy)
        m.new_step_starts([started("old", [0, 1])])
        m.discard_step(save(m, [Part("old", 1, [0, 1], 0, 4)], BS))
        m.new_step_starts([started("new", [4, 5]), extended("old", 4)])
        ops.log.clear()
        m.discard_step(save(m, [Part("new", 2, [4, 5], 0, 4)], BS))
        m.wait_idle()
        flush_copies = [x for x in ops.log if x[0] == "copy" and x[1] == "omnishm-flusher"]
        # The oldest write (4 rows of "old") went out in copy_chunk_bytes pieces of 2 rows, on the flusher thread.
        assert [x[2] for x in flush_copies] == [[2], [2]]
        feat = m._keys["feat"]
        assert torch.equal(feat.commit[torch.arange(0, 4)], feat.claim[torch.arange(0, 4)])
        assert not bool((feat.commit[torch.arange(16, 20)] == feat.claim[torch.arange(16, 20)]).any())
        m.new_step_starts([finished("old"), finished("new")])
        m.wait_idle()
        assert torch.equal(feat.pool[torch.arange(16, 20)], rows(502, range(4), 3))


def test_hits_on_in_flight_deferred_rows_read_through_the_read_path(committer):
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        m.new_step_starts([started("a", [0, 1]), started("b", [0, 2], hit=4)])
        h, mm, layout, n, _ = build([Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 2)], BS)
        sid = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
        for e in list(ops.events):
            if e.thread == "MainThread":  # the step's own copies; the flush of a's rows stays in flight
                e.complete()
        out = m.materialize(sid, ["b"])
        assert torch.equal(out.mm_outputs["b"]["feat"][:4], rows(501, range(4), 3))
        assert ("read", "MainThread", "freeze") in ops.log  # in-flight deferred rows came through the read path
        ops.auto = True
        for e in list(ops.events):
            e.complete()


class LandsOnWait:
    """A device event: the copies it stands for land when it is waited (as late as CUDA may land them)."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def synchronize(self) -> None:
        for dst, src in self.pending:
            dst.copy_(src)
        self.pending.clear()

    def query(self) -> bool:
        return not self.pending


class MixedOps:
    """``CudaOps`` for a step whose keys live on different devices: rows ``device_width`` wide are on the
    device, the others on the host. A device clone (``freeze``) lands when the step's freeze event is
    waited, a device-to-host copy (``leftover``) when its own event is; host rows are copied at once and
    get ``DONE``, as ``CudaOps`` gives them. A reader never stages."""

    is_cuda = True

    def __init__(self, device_width: int):
        self.device_width = device_width
        self._freeze = LandsOnWait()

    def _unlanded(self, t: torch.Tensor, event: LandsOnWait, src: torch.Tensor) -> torch.Tensor:
        out = torch.full(t.shape, -999.0, dtype=t.dtype)
        event.pending.append((out, src))
        return out

    def freeze(self, t):
        return t.clone() if t.shape[-1] != self.device_width else self._unlanded(t, self._freeze, t.clone())

    def record_freeze(self):
        event, self._freeze = self._freeze, LandsOnWait()
        return event

    def to_host(self, pairs, after):
        raise AssertionError("a reader never stages")

    def read_rows(self, t, index=None, after=DONE):
        after.synchronize()  # as CudaOps: the rows' own freeze event (a device clone lands when it is waited)
        return t.index_select(0, index) if index is not None else t.clone()

    def leftover(self, value):
        if value.shape[-1] != self.device_width:
            return value.clone(), DONE
        event = LandsOnWait()
        return self._unlanded(value, event, value), event  # copies the clone when it lands (stream order)


@pytest.mark.parametrize("device_key", [HIDDEN_KEY, "feat"])
def test_a_readers_step_with_keys_on_two_devices_waits_every_copy_before_reading(committer, device_key):
    """REVIEW (2026-12-05): a reader kept the copy event of the step's last immediate key only. With the
    hidden states on the device and "feat" on the host, the host key's DONE hid the hidden states' copy
    in flight, and materialize served the pinned buffer's old bytes. With "feat" deferred on the device
    and the hidden states on the host, that DONE also skipped the wait for the device clones."""
    ops = MixedOps(WIDTH if device_key == HIDDEN_KEY else MM_WIDTH)
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, role="reader",
                                   device_ops=ops) as r:
        if device_key == "feat":
            for m in (w, r):
                m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 6)], BS)
        sids = []
        for m in (w, r):
            m.new_step_starts([started("a", [0, 1])])
            sids.append(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout))
        w.materialize(sids[0], ["a"])
        out = r.materialize(sids[1], ["a"])
        assert torch.equal(out.hidden_states["a"], rows(1, range(6)))
        assert torch.equal(out.mm_outputs["a"]["feat"], rows(501, range(6), MM_WIDTH))


def test_a_first_step_without_rows_does_not_choose_the_device(committer, monkeypatch):
    """REVIEW (2026-12-05): the device ops were chosen once, from the first save's tensors. The
    vllm-omni drop-in saves a step of 0 tokens with no tensor at all, and CPU ops were then kept for
    good: every later step of device rows copied to the host on the engine thread, with no freeze
    clone. A step without rows now chooses nothing; the first step with rows chooses."""
    chosen: list[list[str]] = []
    cuda_like = FakeOps()
    cuda_like.auto = True

    def ops_for(tensors):
        chosen.append([t.device.type for t in tensors])
        return cuda_like if tensors else CpuOps()

    monkeypatch.setattr(device_module, "ops_for", ops_for)
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False) as m:
        m.new_step_starts([])
        m.discard_step(m.save_outputs(None, {}, num_tokens_unpadded=0, num_tokens_padded=0,
                                      write_layout=PrefixCacheWriteLayout((), torch.empty(0, dtype=torch.int64))))
        for step in range(2):
            m.new_step_starts([started(f"r{step}", [step])])
            out = m.materialize(save(m, [Part(f"r{step}", 1, [step], 0, 4)], BS), [f"r{step}"])
            assert torch.equal(out.hidden_states[f"r{step}"], rows(1, range(4)))
        assert m._ops is cuda_like and len(chosen) == 2 and chosen[0] == [], chosen
        assert ("freeze", "MainThread") in cuda_like.log  # the device path ran: a clone of the live rows


def test_cuda_ops_stage_a_host_key_beside_device_keys(monkeypatch):
    """REVIEW (2026-12-05): a writer whose hidden states are on the device and one mm tensor on the host
    gets ``CudaOps`` (any device tensor chooses them), whose ``to_host`` called ``record_stream`` on every
    source: on the host key's CPU clone that raises NotImplementedError (no CPU kernel), after the step
    id was issued, and the cache turned sticky-fatal. The real ``to_host``, with the CUDA-only objects
    stood in for (a CPU stream, an event that records nothing): a host source is copied, not recorded."""

    class Recorded:
        def record(self, stream=None) -> None:
            pass

    monkeypatch.setattr(device_module, "DeviceEvent", Recorded)
    monkeypatch.setattr(torch.cuda, "device", StayOnDevice)
    ops = object.__new__(CudaOps)
    ops.device = torch.device("cuda", 0)
    ops.copy_stream = torch.Stream(device="cpu")
    dst = torch.zeros(4, MM_WIDTH)
    src = rows(501, range(4), MM_WIDTH)
    assert isinstance(ops.to_host([(dst, src)], DONE), Recorded)
    assert torch.equal(dst, src)


def test_step_sender_sends_each_step_once_and_hands_copy_errors_to_the_waiter():
    """StepSender alone: a failed copy event fails the step's future (nothing is sent), and a step
    taken by ``send_now`` is never sent again by the sender thread."""
    from concurrent.futures import Future

    from omnishm.client.device import DONE, StepSender

    sent: list[int] = []

    def send(make, **_kw):
        fut: Future = Future()
        sent.append(make(0))
        fut.set_result(f"ack {sent[-1]}")
        return fut

    class BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("device copy failed")

        def query(self) -> bool:
            return True

    sender = StepSender(send, grace_s=30.0)  # taken steps end the wait at once; untaken ones would wait it
    try:
        broken = sender.submit(BrokenEvent(), lambda rid: 1)
        mine = sender.submit(DONE, lambda rid: 2)
        sender.send_now(mine)  # the materializing thread, which already waited the event
        sender.grace_s = 0.0  # nobody takes the next one: the sender thread sends it
        later = sender.submit(DONE, lambda rid: 3)
        assert mine.outer.result(timeout=5) == "ack 2"
        assert later.outer.result(timeout=5) == "ack 3"
        with pytest.raises(RuntimeError, match="device copy failed"):
            broken.outer.result(timeout=5)
        sender.send_now(later)  # already sent by the sender thread: nothing happens
    finally:
        sender.stop(5.0)
    assert sent == [2, 3]


def test_tensors_nested_in_a_leftover_value_go_through_the_device_copy_and_materialize_waits_them(committer):
    """REVIEW (2026-12-05, seed conformance): "Leftover mm is copied to CPU here so materialize never reads
    live graph buffers". Only top-level leftover tensors were; tensors inside a list or dict were deep-copied
    where they lay (on the GPU: returned on the GPU, held for every unconsumed step, copied again without
    waiting the engine's stream). Every one goes through ``ops.leftover`` now, and materialize waits its
    event; other values are still deep-copied."""
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.new_step_starts([started("a", [0, 1])])
        inner, other, meta = torch.arange(3.0), torch.ones(2), {"n": [1, 2]}
        sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS,
                   extra_mm={"nested": [inner, {"x": inner, "y": other}, meta]})
        inner.fill_(-1)
        meta["n"].append(3)
        leftovers = [e for e in ops.events if e.name == "leftover"]
        assert len(leftovers) == 2  # one device copy for each tensor in the value, however often it holds it
        for e in ops.events:
            if e.name != "leftover":
                e.complete()
        done = threading.Event()
        got: dict = {}
        thread = threading.Thread(target=lambda: (got.update(out=m.materialize(sid, ["a"])), done.set()))
        thread.start()
        assert not done.wait(0.3)  # every other event is complete: it waits the copies of the nested tensors
        for e in leftovers:
            e.complete()
        thread.join(10)
        value = got["out"].mm_outputs["a"]["nested"]
        assert torch.equal(value[0], torch.arange(3.0)) and value[1]["x"] is value[0]
        assert torch.equal(value[1]["y"], torch.ones(2)) and value[2] == {"n": [1, 2]}


def test_a_device_freeze_is_contiguous_so_the_steps_rows_are_views_of_it(committer):
    """REVIEW (2026-12-05, stop 42, CUDA path): ``CudaOps.freeze`` was ``clone()``, which keeps the strides of a
    dense tensor (a permuted head output). The manager's reshape of a deferred key to (n, width) was then a
    second clone, made on the engine's stream after the freeze event: the flusher's copy and materialize's
    reads wait that event only, and could read the rows before they were written. The freeze is contiguous
    now, and the step's rows are views of it."""
    permuted = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3).permute(0, 2, 1)
    ops = object.__new__(CudaOps)  # the real method: it uses nothing CUDA-only (no streams made)
    ops.device = torch.device("cuda", 0)
    frozen = ops.freeze(permuted)
    assert frozen.is_contiguous() and torch.equal(frozen, permuted)
    ops = FakeOps()
    ops.auto = True
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat3"})))
        m.new_step_starts([started("a", [0, 1])])
        h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8)], BS)
        mm["feat3"] = torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3).permute(0, 2, 1)
        sid = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
        rows3 = m._ctxs[sid].step_rows["feat3"]
        assert any(rows3.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in ops.frozen)
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["a"]["feat3"], mm["feat3"])


def test_device_ops_are_chosen_once_a_step_has_device_tensors_after_host_only_steps(committer, monkeypatch):
    """REVIEW (2026-12-05, stop 42, CUDA path): the ops were chosen for good from the first step with any
    tensor. A first step of host tensors only (a CPU leftover beside hidden states not cached, say) kept CPU
    ops for good: every later step's device rows were copied on the engine thread, without a freeze clone.
    CPU ops are chosen again at each step until one has device tensors (stood in for here by marked ones)."""
    cuda_like = FakeOps()
    cuda_like.auto = True
    on_device: set[int] = set()

    def ops_for(tensors):
        return cuda_like if any(id(t) in on_device for t in tensors) else CpuOps()

    monkeypatch.setattr(device_module, "ops_for", ops_for)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA build: device tensors may come later
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False) as m:
        m.new_step_starts([started("r0", [0])])
        m.discard_step(save(m, [Part("r0", 1, [0], 0, 4)], BS))
        assert isinstance(m._ops, CpuOps) and cuda_like.log == []
        m.new_step_starts([started("r1", [1])])
        h, mm, layout, n, pad = build([Part("r1", 1, [1], 0, 4)], BS)
        on_device.add(id(h))
        out = m.materialize(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                                           write_layout=layout), ["r1"])
        assert torch.equal(out.hidden_states["r1"], rows(1, range(4)))
        assert m._ops is cuda_like and ("freeze", "MainThread") in cuda_like.log


def test_without_cuda_the_cpu_ops_of_the_first_step_with_tensors_are_kept(committer, monkeypatch):
    """Reread (stop 42): re-choosing the ops at every step walked each step's tensors (leftovers included) again,
    5-9 us of a CPU engine's 260 us ``save_outputs``. Without CUDA no later step can have device tensors, so the
    first step with tensors chooses for good."""
    calls: list[int] = []
    real = device_module.ops_for

    def ops_for(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(device_module, "ops_for", ops_for)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False) as m:
        for step in range(3):
            m.new_step_starts([started(f"r{step}", [step])])
            m.discard_step(save(m, [Part(f"r{step}", 1, [step], 0, 4)], BS))
        assert isinstance(m._ops, CpuOps) and len(calls) == 1, calls


@pytest.mark.parametrize("drained", [True, False, "raises"])
def test_shutdown_unregisters_the_staging_only_once_the_copies_ran(committer, drained):
    """REVIEW (2026-12-05, stop 42, CUDA path): shutdown unregistered the pinned staging with a copy into it
    possibly still queued (a step abandoned after its copy was issued): undefined in CUDA. It drains the
    ops' streams first, and leaves the staging registered (logged) when they do not drain in time."""
    ops = FakeOps()
    ops.auto = True
    ops.drained = drained is True
    if drained == "raises":  # torch.cuda.Stream.query raises for a CUDA error (review of this test's fix):
        def drain(timeout_s):  # shutdown then left the link, and the writer's seat, open for good
            ops.log.append(("drain", None))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        ops.drain = drain
    unregistered: list[int] = []

    class Registration:
        def unregister(self) -> None:
            unregistered.append(len(ops.log))

    m = OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        m._registrations.append(Registration())  # what a key opened with device rows registers
    finally:  # the module's committer: a writer left attached would fail its later tests
        m.shutdown()
    drains = [i for i, e in enumerate(ops.log) if e[0] == "drain"]
    assert len(drains) == 1 and m._link._closed
    assert unregistered == ([drains[0] + 1] if drained is True else []) and m._registrations == []


def test_a_saves_copy_on_write_reads_in_flight_deferred_rows_after_their_own_freeze_only(committer):
    """Review (2026-12-06): a save whose new claims take slots an unconsumed step planned as a hit, on rows of
    a deferred write still on the device, reads those rows on the engine thread (copy-on-write). The read
    made the read stream wait the whole copy stream, which by then holds this step's own copy, queued behind
    this step's forward: the engine thread waited its own forward on the GPU. It waits the rows' freeze event
    now, the only thing they need."""
    ops = FakeOps()
    with OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        ops.auto = True
        m.new_step_starts([started("a", [0, 1])])
        h, mm, layout, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
        m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout))
        a_freeze = [e.name for e in ops.events if e.name == "freeze"]
        ops.auto = False
        # Step 1: b hits a's first block, whose deferred rows are still on the device (a's write is closed and
        # flushed; its flush stays in flight). Step 1 stays unconsumed.
        m.new_step_starts([started("b", [0, 2], hit=4)])
        h, mm, layout, n, _ = build([Part("b", 1, [0, 2], 4, 2)], BS)
        before = len(ops.events)
        sid1 = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
        for e in ops.events[before:]:
            if e.thread == "MainThread":
                e.complete()
        # Step 2: block 0 goes to c (a and b finished): copy-on-write keeps step 1's planned hit rows, read from
        # a's device clone while step 2's own copy is pending.
        m.new_step_starts([finished("a"), finished("b"), started("c", [0])])
        h, mm, layout, n, _ = build([Part("c", 7, [0], 0, 4)], BS)
        before_log = len(ops.log)
        sid2 = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
        reads = [x for x in ops.log[before_log:] if x[0] == "read" and x[1] == "MainThread"]
        assert reads, "no engine-thread read of in-flight rows (the scenario did not happen)"
        assert a_freeze and {x[2] for x in reads} == {"freeze"}, reads  # a's step's freeze, never a copy's event
        ops.auto = True
        for e in list(ops.events):
            e.complete()
        out = m.materialize(sid1, ["b"])
        assert torch.equal(out.mm_outputs["b"]["feat"][:4], rows(501, range(4), 3))  # the kept rows are a's
        m.discard_step(sid2)
        m.wait_idle()


def test_cuda_ops_refuse_rows_on_another_device_than_theirs():
    """Review (2026-12-06): a copy runs on the current stream of its source's device, so rows on a second GPU
    would be copied outside the copy stream and the freeze event, both on the manager's device, and read
    before they landed. ``CudaOps`` refuses them (``ValueError``; a save refused so takes its step id as
    every refused save does). Stand-ins for the tensors: this machine has no GPU."""
    from types import SimpleNamespace

    ops = object.__new__(CudaOps)  # no streams: only the device check runs
    ops.device = torch.device("cuda", 0)
    ops._check_device(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0)))
    ops._check_device(torch.zeros(2))  # host rows: copied at once, nothing to fence
    with pytest.raises(ValueError, match=r"rows on cuda:1, but this manager's copies run on cuda:0"):
        ops.freeze(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    with pytest.raises(ValueError, match="one CUDA device per manager"):
        ops.leftover(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))


def test_a_step_sent_after_another_threads_shutdown_stopped_the_sender_fails_its_send(committer):
    """REVIEW (2026-12-07, stop 54): ``shutdown`` stops the sender thread before it closes the link. A save on
    the engine thread past its shut-down check handed its step to the stopped sender, which dropped it: the
    save returned its step id, the write's future never completed, the page stayed held, nothing was said.
    ``shutdown``'s docstring promises that such a save "fails its send (sticky fatal)": now it does, with no
    step id issued."""
    ops = FakeOps()
    m = OmniPrefixCacheManager(config(), cache=committer.name, autostart=False, device_ops=ops)
    try:
        m.new_step_starts([started("a", [0, 1])])
        held, go_on, engine = threading.Event(), threading.Event(), {}
        real_submit = m._sender.submit

        def held_submit(*args, **kw):  # the engine's hand-over, held until the shutdown stopped the sender
            held.set()
            assert go_on.wait(10)
            return real_submit(*args, **kw)

        m._sender.submit = held_submit

        def step():
            try:
                engine["sid"] = save(m, [Part("a", 1, [0, 1], 0, 6)], BS)
            except Exception as exc:
                engine["raised"] = exc

        engine["thread"] = threading.Thread(target=step)
        engine["thread"].start()
        assert held.wait(10)
        stopper = threading.Thread(target=m.shutdown)
        stopper.start()
        stopper.join(15)
        assert not stopper.is_alive()
        go_on.set()
        engine["thread"].join(15)
        assert not engine["thread"].is_alive()
        assert "sid" not in engine, engine  # no step id for a write that is never sent
        raised = engine["raised"]
        assert isinstance(raised, OmniPrefixCacheUnmatchError), raised
        assert "could not be sent" in str(raised) and "sender thread is stopped" in str(raised), raised
        assert m._fatal is raised and not m._ctxs
        assert m._sender._thread.pending() == 0  # nothing queued behind the stop
    finally:
        go_on.set()
        m.shutdown()


def test_step_sender_refuses_a_step_once_stopped():
    """StepSender alone: ``submit`` after ``stop`` raises (the step would never be sent) and sends nothing."""
    from omnishm.client.device import StepSender

    sent: list[int] = []
    sender = StepSender(lambda make, **_kw: sent.append(make(0)), grace_s=0.0)
    sender.stop(5.0)
    with pytest.raises(RuntimeError, match="sender thread is stopped"):
        sender.submit(DONE, lambda rid: 1)
    assert sent == [] and sender._thread.pending() == 0
