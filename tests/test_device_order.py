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

from manager_helpers import small_config, Part, build, extended, finished, rows, save, started
from omnishm.client import ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.interface import HIDDEN_KEY

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


class FakeOps:
    is_cuda = True  # take the device branches (device clone of deferred rows, etc.)

    def __init__(self):
        self.log: list = []
        self.events: list[FakeEvent] = []
        self.auto = False

    def _event(self, name: str) -> FakeEvent:
        e = FakeEvent(name, self.log)
        self.events.append(e)
        if self.auto:
            e.complete()
        return e

    def freeze(self, t):
        self.log.append(("freeze", threading.current_thread().name))
        return t.clone()

    def record_freeze(self):
        return self._event("freeze")

    def to_host(self, pairs, after):
        self.log.append(("copy", threading.current_thread().name, [d.shape[0] for d, _ in pairs]))
        for dst, src in pairs:
            dst.copy_(src.reshape(dst.shape))
        return self._event(f"d2h{len(self.events)}")

    def read_rows(self, t, index=None):
        self.log.append(("read", threading.current_thread().name))
        return t.index_select(0, index) if index is not None else t.clone()

    def leftover(self, value):
        return value.clone(), self._event("leftover")


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
        assert ("read", "MainThread") in ops.log  # in-flight deferred rows came through the read path
        ops.auto = True
        for e in list(ops.events):
            e.complete()


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
