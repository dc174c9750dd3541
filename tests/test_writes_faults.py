"""Write-side faults: a stalled committer, a failed step write, keys a step does not write, a bad layout.

Real committer processes; a stall is a SIGSTOP of the committer (what a long
GC pause, swapping or a debugger does), so replies come late, not never.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from helpers import loud
from manager_helpers import Part, build, finished, one_applied_step, rows, save, small_config, started
from omnishm import protocol as P
from omnishm.client import HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout
from omnishm.client.writes import TaskState

BS = 4


def test_a_flush_piece_acknowledged_late_never_commits_another_requests_rows(committer_factory):
    """The flusher gives up on a's piece (commit_timeout_s) while the committer is stopped. It must not
    stage b's rows in the region the late piece will still read: a's slots, once committed at a's
    claim version, hold a's rows; and the failure is sticky."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    m = OmniPrefixCacheManager(small_config(commit_timeout_s=1.0), cache=handle.name, autostart=False)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    try:
        m.new_step_starts([started("a", [0]), started("b", [4])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4), Part("b", 2, [4], 0, 4)], BS))
        m.wait_idle()
        feat = m._keys["feat"]
        a_slots = torch.arange(0, 4)
        cv_a = feat.claim[a_slots].clone()
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            m.new_step_starts([finished("a"), finished("b")])  # both writes go to the flusher
            deadline = time.monotonic() + 10
            while m._fatal is None and time.monotonic() < deadline:  # a's piece times out (1 s)
                time.sleep(0.05)
            assert m._fatal is not None and "commit_timeout_s" in str(m._fatal), m._fatal
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not torch.equal(feat.commit[a_slots], cv_a) and time.monotonic() < deadline:
            time.sleep(0.05)  # the committer applies a's late piece
        assert torch.equal(feat.commit[a_slots], cv_a) and torch.equal(feat.claim[a_slots], cv_a)
        assert torch.equal(feat.pool[a_slots], rows(501, range(4), 3)), "a's slots hold rows that are not a's"
        with pytest.raises(OmniPrefixCacheUnmatchError, match="not reused|commit_timeout_s"):
            m.wait_idle(timeout_s=2.0)
    finally:
        m.shutdown()


def test_a_flush_that_times_out_is_a_failed_write(committer_factory):
    """A bare TimeoutError (no message) is still a failure: the task is FAILED and the error sticky."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    m = OmniPrefixCacheManager(small_config(commit_timeout_s=1.0), cache=handle.name, autostart=False)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    try:
        one_applied_step(m)
        task = m._open[("a", "feat")]
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            m.new_step_starts([finished("a")])
            with pytest.raises(OmniPrefixCacheUnmatchError, match="TimeoutError"):
                task.done.result(timeout=10)
            assert task.state is TaskState.FAILED and m._fatal is not None
            with pytest.raises(OmniPrefixCacheUnmatchError):
                m.wait_idle(timeout_s=0.5)
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
    finally:
        m.shutdown()


def test_a_key_the_slots_new_tenant_does_not_write_is_absent_not_the_old_tenants(committer):
    """Block 0 first holds a's hidden and feat rows, then b's hidden only. A hit on b's prefix that
    needs feat raises (absent rows); it never merges a's feat rows into b's prefix."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        m.new_step_starts([finished("a")])
        m.new_step_starts([started("b", [0])])
        m.discard_step(save(m, [Part("b", 2, [0], 0, 4)], BS, mm_key=None))  # no feat this step
        m.new_step_starts([finished("b")])
        m.wait_idle()
        assert m._keys["feat"].claim[:4].tolist() == [0, 0, 0, 0]
        m.new_step_starts([started("c", [0, 1], hit=4)])
        sid = save(m, [Part("c", 3, [0, 1], 4, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows") as err:
            m.materialize(sid, ["c"])
        assert "request='c'" in str(err.value) and "tensor='feat'" in str(err.value)
    finally:
        m.shutdown()


def test_a_large_step_makes_a_key_its_slots_new_tenant_does_not_write_absent(committer_factory):
    """MUTATION (2026-12-06): the test above for a step over 256 tokens, whose claims go through numpy (no
    slot list). Blocks 0-64 first hold a's hidden and feat rows, then b's hidden only; a hit on b's prefix
    that needs feat must raise (absent rows). With the large-step path leaving the claims of a key the step
    does not write in place, a's feat rows stayed claimed and were served as b's."""
    n = 260  # > 256 tokens
    blocks = list(range(n // BS))
    handle = committer_factory()  # its own: a larger pool than the module's committer holds
    m = OmniPrefixCacheManager(small_config(num_blocks=128, staging_capacity_tokens=320), cache=handle.name,
                               autostart=False)
    try:
        m.new_step_starts([started("a", blocks)])
        m.discard_step(save(m, [Part("a", 1, blocks, 0, n)], BS))
        m.new_step_starts([finished("a")])
        m.new_step_starts([started("b", blocks)])
        m.discard_step(save(m, [Part("b", 2, blocks, 0, n)], BS, mm_key=None))  # no feat this step
        m.new_step_starts([finished("b")])
        m.wait_idle()
        m.new_step_starts([started("c", blocks + [100], hit=n)])
        sid = save(m, [Part("c", 3, blocks + [100], n, 2)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows") as err:
            out = m.materialize(sid, ["c"])
            pytest.fail(f"served the old tenant's feat rows: {out.mm_outputs['c']['feat'][0].tolist()}")
        assert "request='c'" in str(err.value) and "tensor='feat'" in str(err.value)
    finally:
        m.shutdown()


def test_wait_idle_raises_for_a_failed_step_write_whoever_holds_the_state_lock(committer):
    """wait_idle reads the step's outcome itself: a failure raises even before the done callback (which
    needs the state lock) has recorded it."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)
        real_submit = m._link.submit
        captured: list[tuple[Future, Future]] = []

        def submit(make, **kw):  # the test decides when, and with what, the step's outcome arrives
            inner = real_submit(loud(make), **kw)  # answered: the test sees when it was applied
            outer: Future = Future()
            captured.append((inner, outer))
            return outer

        m._link.submit = submit
        m.new_step_starts([started("b", [1])])
        m.discard_step(save(m, [Part("b", 2, [1], 0, 4)], BS))
        m._link.submit = real_submit
        inner, outer = captured[0]
        inner.result(timeout=5)
        failed = P.StepDone(rid=1, step=1, done_tids=b"", failed_tids=(7).to_bytes(8, "little"),
                            reason="reaped after 10 s of silence")
        result: list[str] = []

        def waiter() -> None:
            try:
                m.wait_idle(timeout_s=2.0)
                result.append("returned")
            except OmniPrefixCacheUnmatchError as exc:
                result.append(f"raised: {exc}")

        waiting = threading.Event()
        real_await = m._await_step_write

        def await_step_write(fut, timeout_s):
            waiting.set()  # wait_idle now waits for this step's outcome
            return real_await(fut, timeout_s)

        m._await_step_write = await_step_write
        w = threading.Thread(target=waiter)
        w.start()
        assert waiting.wait(timeout=5), result
        m._lock.acquire()  # another thread holds the state lock when the reply arrives
        try:
            setter = threading.Thread(target=outer.set_result, args=(failed,))
            setter.start()
            w.join(timeout=3)
        finally:
            m._lock.release()
        setter.join()
        assert len(result) == 1 and result[0].startswith("raised:") and "reaped" in result[0], result
    finally:
        m.shutdown()


def test_writes_out_of_batch_order_are_refused(committer):
    """Claim versions follow the writes' order, rows their token_start: a layout where they disagree
    raises a clear unmatch error naming the request, and nothing is written."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0]), started("b", [1])])
        slots = torch.tensor([0, 1, 2, 3, 4, 5])
        hidden = torch.cat([rows(1, range(4)), rows(2, range(2))])
        layout = PrefixCacheWriteLayout((PrefixCacheWrite("b", 4, 2), PrefixCacheWrite("a", 0, 4)), slots)
        next_step = m._next_step
        with pytest.raises(OmniPrefixCacheUnmatchError, match="starts at row 4, expected 0") as err:
            m.save_outputs(hidden, {}, num_tokens_unpadded=6, num_tokens_padded=6, write_layout=layout)
        assert "request='b'" in str(err.value)
        assert m._next_step == next_step + 1 and all(kv.claim[:6].eq(0).all() for kv in m._keys.values())
    finally:
        m.shutdown()


def test_a_step_write_that_cannot_be_sent_leaves_no_step_behind(committer):
    """The link refuses the step's StepWrite (nothing is sent): ``save_outputs`` raises the sticky error, so the
    caller never gets the step id, and the step's context, page holds and hit pins go with it (they stayed,
    and the id was listed as unconsumed for good; review)."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)

        def down(make, **kw):
            raise OSError("link down")

        m._link.submit = down
        m.new_step_starts([started("b", [0, 1], hit=4)])
        try:
            with pytest.raises(OmniPrefixCacheUnmatchError, match="write of step 1 could not be sent: link down"):
                save(m, [Part("b", 1, [0, 1], 4, 2)], BS)
        finally:
            del m._link.submit  # the link's own again, for the Goodbye
        assert m.unconsumed_step_ids() == [] and m._pages.in_use() == 0 and int(m._pin_count.sum()) == 0
        with pytest.raises(OmniPrefixCacheUnmatchError, match="could not be sent"):
            m.materialize(1, ["b"])
    finally:
        m.shutdown()


def test_a_save_that_fails_after_its_step_id_was_issued_frees_its_page_and_is_sticky(committer):
    """Anything raising between the page claim and the step's registration (here the copy-on-write
    check) re-raises as is, frees the staging page, and turns the writer sticky-fatal naming the step:
    its claim stores may be half done. The committer serves the next writer."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)

        def broken(slots):
            raise RuntimeError("copy-on-write check broke")

        m._rescue_before_claim = broken
        m.new_step_starts([started("b", [1])])
        with pytest.raises(RuntimeError, match="copy-on-write check broke"):
            save(m, [Part("b", 2, [1], 0, 4)], BS)
        assert m._pages.in_use() == 0
        with pytest.raises(OmniPrefixCacheUnmatchError, match="step 1 failed after the step id was issued"):
            save(m, [Part("b", 2, [1], 0, 4)], BS)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="step 1 failed after the step id was issued"):
            m.wait_idle()
    finally:
        m.shutdown()
    m2 = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        m2.new_step_starts([started("c", [1])])
        m2.discard_step(save(m2, [Part("c", 3, [1], 0, 4)], BS))
        m2.wait_idle()
        assert torch.equal(m2._keys[HIDDEN_KEY].pool[4:8], rows(3, range(4)))
    finally:
        m2.shutdown()


def _without_tids(send):
    """``send`` (the link's submit, or the flusher's send) with the tids of every StepWrite dropped on the
    way: the committer refuses such a piece with a reason (a client bug, as far as it knows)."""
    def mangled_send(make, **kw):
        def mangled(rid: int):
            msg = make(rid)
            if isinstance(msg, P.StepWrite):
                msg.tids = b""
            return msg
        return send(mangled, **kw)
    return mangled_send


def test_a_refused_step_that_names_no_failed_tid_still_fails_the_write(committer):
    """A refusal of a step whose tids field is empty comes back as a StepDone with a reason and no failed
    tid; the writer took that for success, and the step's rows, never written, were waited for by every
    hit on them. Here the step's message loses its tids on the way (a client bug, as far as the committer
    knows): the write fails, sticky, with the committer's reason."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)
        m._link.submit = _without_tids(m._link.submit)
        m.new_step_starts([started("b", [2])])
        try:
            m.discard_step(save(m, [Part("b", 2, [2], 0, 4)], BS))
            with pytest.raises(OmniPrefixCacheUnmatchError, match=r"write of step 1 failed: step 1: key_idx has \d+ "
                                                                  r"entries, tids has 0"):
                m.wait_idle()
        finally:
            del m._link.submit
    finally:
        m.shutdown()


def test_a_deferred_write_whose_flush_piece_is_refused_fails(committer):
    """MUTATION (2026-12-06): a deferred write whose flush piece the committer refuses (here its tids are
    dropped on the way) fails: its task is FAILED with the committer's reason, and the writer is sticky-fatal.
    With the piece's failure dropped by the flusher, the write was reported done and its rows, never
    written, were waited for by every hit on them."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    try:
        one_applied_step(m)
        task = m._open[("a", "feat")]
        m._flusher._send = _without_tids(m._flusher._send)
        m.new_step_starts([finished("a")])  # a's deferred write is flushed
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"tids has 0"):
            task.done.result(timeout=10)
        assert task.state is TaskState.FAILED
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"tids has 0"):
            m.wait_idle(timeout_s=2.0)
    finally:
        m.shutdown()


def test_a_deferred_write_that_fails_on_a_writer_already_fatal_is_said_lost(committer, monkeypatch, caplog):
    """REVIEW (2026-12-06): a deferred write that failed once the writer was already sticky-fatal (here a
    Ctrl-C caught inside a call) recorded no error of its own, so nothing said its rows never land: the
    sticky error logged was the interrupt's. It is logged as a warning now."""
    from helpers import interrupt_once

    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    try:
        one_applied_step(m)
        task = m._open[("a", "feat")]
        interrupt_once(monkeypatch, m, "_take_ctx")
        with pytest.raises(KeyboardInterrupt):
            m.discard_step(save(m, [Part("b", 2, [2], 0, 4)], BS))
        m._flusher._send = _without_tids(m._flusher._send)
        with m._lock:
            m._close_task_locked(task)
        m._flush([task])
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"tids has 0"):
            task.done.result(timeout=10)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(f"deferred write {task.tid} of request 'a'" in x and "tids has 0" in x for x in said), said
    finally:
        m.shutdown()


def test_discard_step_on_a_sticky_fatal_writer_raises_the_sticky_error(committer):
    """MUTATION (2026-12-06): once the writer is sticky-fatal (here a step write the committer refused),
    ``discard_step`` of a step id still held raises the sticky error, as every other call does. With its
    usability check taken out, it returned quietly on a cache that serves nothing any more."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)
        submit = m._link.submit
        m._link.submit = _without_tids(submit)
        m.new_step_starts([started("b", [2])])
        try:
            sid = save(m, [Part("b", 2, [2], 0, 4)], BS)
            with pytest.raises(OmniPrefixCacheUnmatchError, match="write of step 1 failed"):
                m.wait_idle()
        finally:
            del m._link.submit
        with pytest.raises(OmniPrefixCacheUnmatchError, match="write of step 1 failed"):
            m.discard_step(sid)
    finally:
        m.shutdown()


def test_a_refused_save_makes_its_slots_absent_in_every_key_not_only_the_first(mgr):
    """``_forget_refused``: the slots of a refused save become absent (claim 0) in EVERY key of the cache, so
    that no reader, of whichever tensor, can take the slots' previous tenant's committed row for the refused
    step's tokens (vLLM's KV cache holds those tokens all the same). MUTATION (mutR m4): clearing only the
    first key's claim table (hidden) survived the suite, since a hit plans every key and one absent key
    already makes it raise; the other keys' claim tables kept z's committed claims."""
    m = mgr()
    m.new_step_starts([started("z", [0])])
    m.discard_step(save(m, [Part("z", 5, [0], 0, 4)], BS))
    m.wait_idle()
    slots = torch.arange(0, 4)
    assert set(m._keys) == {HIDDEN_KEY, "feat"}
    for key, kv in m._keys.items():
        assert bool((kv.claim[slots] != 0).all()), key  # z's rows are committed in both keys
    h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
    m.new_step_starts([finished("z"), started("a", [0, 1])])
    with pytest.raises(OmniPrefixCacheUnmatchError):
        m.save_outputs(h.double(), mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay)
    for key, kv in m._keys.items():
        assert torch.equal(kv.claim[torch.arange(0, 8)], torch.zeros(8, dtype=kv.claim.dtype)), \
            f"tensor {key!r} still claims slots of the refused save"
