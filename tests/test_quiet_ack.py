"""Quiet step acknowledgements: a ``StepWrite`` applied in full gets no reply, only a control word.

The committer stores ``make_cv(epoch, step, 0)`` in ``CTL_ACKED_STEP`` after the
rows and their commit words; anything else (a rejected step) is answered as
before. Real committer processes, real ZeroMQ, real shared memory.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from omnishm import protocol as P
from omnishm import shm
from omnishm.client import HIDDEN_KEY, OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.versions import make_cv

from conftest import unique_cache_name
from helpers import Writer, bits, random_rows
from manager_helpers import Part, extended, one_applied_step, rows, save, small_config, started

LAYOUT = P.Layout(num_blocks=16, block_size=4)  # the shared committer's layout: 64 slots
STAGING_ROWS = 32
BS = 4


def _acked_word(control: str) -> int:
    seg = shm.Segment.attach(control, readonly=True)
    return int(seg.tensor(torch.int64, (P.CTL_WORDS,))[P.CTL_ACKED_STEP])


def _unanswered(m: OmniPrefixCacheManager) -> list:
    """The link's pending requests a resume would re-send (heartbeats are not among them)."""
    return [e for e in m._link._pending.values() if e.resend]


def _next_reply_is_status(writer: Writer) -> None:
    """The committer answers in order: a StepDone for the quiet step would come before this StatusReply."""
    reply = writer.raw.call(P.StatusRequest(rid=writer.raw.next_rid()))
    assert isinstance(reply, P.StatusReply), reply


def test_a_quiet_step_applied_in_full_is_acknowledged_by_the_control_word_not_a_reply(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    key = f"q-{unique_cache_name('k')}"
    view = writer.open_key(key, "float32", 8)
    staged = random_rows(torch.float32, (STAGING_ROWS, 8), torch.Generator().manual_seed(3))
    view.staging.copy_(staged)
    slots = [5, 6, 7, 40]
    cv = writer.new_cv(11)
    assert writer.step_write(11, [(key, 1, cv, 2, slots)], quiet=True) is None
    _next_reply_is_status(writer)
    assert _acked_word(writer.welcome.control) == make_cv(writer.epoch, 11, 0)
    for i, slot in enumerate(slots):
        assert torch.equal(bits(view.pool[slot]), bits(staged[2 + i])) and int(view.commit[slot]) == cv
    writer.goodbye()


def test_a_rejected_quiet_step_is_answered_and_leaves_the_control_word(committer):
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    key = f"q-{unique_cache_name('k')}"
    writer.open_key(key, "float32", 8)
    assert writer.step_write(3, [(key, 1, writer.new_cv(3), 0, [1, 2])], quiet=True) is None
    _next_reply_is_status(writer)
    before = _acked_word(writer.welcome.control)
    assert before == make_cv(writer.epoch, 3, 0)
    writer.step_write(4, [(key, 2, writer.new_cv(4), 0, [1, 64])], quiet=True)  # slot 64 is out of range
    done = writer.raw.recv()
    assert isinstance(done, P.StepDone) and done.step == 4 and "64" in done.reason and done.failed_tids, done
    assert _acked_word(writer.welcome.control) == before
    writer.goodbye()


def test_the_manager_settles_each_step_from_the_control_word(committer):
    """Nothing stays pending on the link for a resume to re-send, the rows land, and readers read them."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
        for first in range(8, 16, 2):
            m.new_step_starts([extended("a", first, (2, 3) if first == 8 else ())])
            m.discard_step(save(m, [Part("a", 1, [0, 1, 2, 3], first, 2)], BS))
            assert len(_unanswered(m)) <= 1  # only the step just sent
        m.wait_idle()
        assert not _unanswered(m)
        assert _acked_word(m._link.welcome.control) == make_cv(m._epoch, m._next_step - 1, 0)
        m.new_step_starts([started("b", [0, 1, 2, 3, 4], hit=16)])
        sid = save(m, [Part("b", 1, [0, 1, 2, 3, 4], 16, 1)], BS)
        out = m.materialize(sid, ["b"])
        assert torch.equal(out.hidden_states["b"][:16], rows(1, range(16)))
        assert m.counters["hit_tokens"] == 16
    finally:
        m.shutdown()


def test_a_failed_quiet_step_is_fatal_at_the_next_save(committer):
    """The committer answers a rejected quiet step: the join sees the failure, not a missing word."""
    m = OmniPrefixCacheManager(small_config(), cache=committer.name, autostart=False)
    try:
        one_applied_step(m)
        real_submit = m._link.submit

        def submit(make, **kw):  # the next step's descriptor names a slot outside the pool
            def bad(rid: int) -> P.StepWrite:
                msg = make(rid)
                msg.slots = (1 << 40).to_bytes(8, "little") + msg.slots[8:]
                return msg
            return real_submit(bad, **kw)

        m._link.submit = submit
        try:
            m.new_step_starts([extended("a", 4, (1,))])
            sid = save(m, [Part("a", 1, [0, 1], 4, 2)], BS)
        finally:
            m._link.submit = real_submit
        # The rejection may be in by any of these calls (the link's I/O thread takes it at any time).
        with pytest.raises(OmniPrefixCacheUnmatchError, match="failed"):
            m.discard_step(sid)
            m.new_step_starts([extended("a", 6)])
            save(m, [Part("a", 1, [0, 1], 6, 1)], BS)
        assert "slot" in str(m._fatal) and "out of range" in str(m._fatal)
    finally:
        m.shutdown()


def test_a_step_the_lost_committer_applied_is_settled_on_resume_not_re_sent(committer_factory):
    """Step 0 is applied (marker stored) but not yet settled when its committer dies. A re-sent copy,
    applied by the next committer after the writer settled step 0 from the word and reused its staging
    page for step 1, would copy step 1's rows into step 0's slots: the resume settles it instead."""
    fast = ("--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
    first = committer_factory(*fast)
    m = OmniPrefixCacheManager(small_config(reconnect_timeout_s=30.0, commit_timeout_s=20.0), cache=first.name,
                               endpoint=first.endpoint, autostart=False)
    second = None
    stopped: list[int] = []
    try:
        m.new_step_starts([started("a", [0, 1])])
        s0 = save(m, [Part("a", 1, [0, 1], 0, 8)], BS)
        m.discard_step(s0)  # the step's page stays held for its write until the step is settled
        marker = make_cv(m._epoch, s0, 0)
        deadline = time.monotonic() + 10
        while m._ctl_mv[P.CTL_ACKED_STEP] < marker:  # applied by the first committer, not settled
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert len(_unanswered(m)) == 1
        link = m._link
        resumed = link._on_resume_reply

        def stop_the_new_committer(reply):  # before it could read anything re-sent
            if isinstance(reply, P.Welcome) and not stopped:
                os.kill(reply.committer_pid, signal.SIGSTOP)
                stopped.append(reply.committer_pid)
            resumed(reply)

        link._on_resume_reply = stop_the_new_committer
        first.stop(signal.SIGKILL)
        second = committer_factory(*fast, name=first.name, wait=False)  # adopts: we hold the liveness lock
        deadline = time.monotonic() + 20
        while link.stats["reconnects"] < 1:
            assert time.monotonic() < deadline, "no resume"
            time.sleep(0.01)
        assert stopped == [second.proc.pid]
        assert link.stats["settled_on_resume"] == 1 and link.stats["resent"] == 0
        m.new_step_starts([started("b", [4, 5])])
        m.discard_step(save(m, [Part("b", 2, [4, 5], 0, 8)], BS))  # staged where step 0 was
        os.kill(second.proc.pid, signal.SIGCONT)
        m.wait_idle(timeout_s=20)
        hidden = m._keys[HIDDEN_KEY]
        assert bool(hidden.commit[0:8].eq(hidden.claim[0:8]).all())
        assert torch.equal(hidden.pool[0:8], rows(1, range(8)))  # step 0's rows, not step 1's
        assert torch.equal(hidden.pool[16:24], rows(2, range(8)))
    finally:
        if second is not None and second.proc.poll() is None:
            os.kill(second.proc.pid, signal.SIGCONT)
        m.shutdown()


def test_a_marker_of_a_later_writers_epoch_acknowledges_none_of_this_writers_steps(committer_factory):
    """A writer frozen past its reaping sees the next writer's markers in the word: they are larger than
    its own, but they do not say its step was applied (it was not: the committer stopped here)."""
    handle = committer_factory()
    m = OmniPrefixCacheManager(small_config(), cache=handle.name, endpoint=handle.endpoint, autostart=False)
    try:
        one_applied_step(m)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            m.new_step_starts([extended("a", 4, (1,))])
            m.discard_step(save(m, [Part("a", 1, [0, 1], 4, 2)], BS))  # sent; nobody applies it yet
            ctl = m._ctl_mv
            own = ctl[P.CTL_ACKED_STEP]
            ctl[P.CTL_ACKED_STEP] = make_cv(m._epoch + 1, 0, 0)  # what the next writer's first step stores
            m.new_step_starts([extended("a", 6)])
            assert m._prev_write is not None and len(_unanswered(m)) == 1  # not settled
            ctl[P.CTL_ACKED_STEP] = own
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        m.discard_step(save(m, [Part("a", 1, [0, 1], 6, 1)], BS))  # joins step 1 once it is applied
        m.wait_idle()
        hidden = m._keys[HIDDEN_KEY]
        assert torch.equal(hidden.pool[0:7], rows(1, range(7)))
    finally:
        m.shutdown()


def test_an_older_quiet_step_never_takes_an_acknowledgement_back(committer):
    """MUTATION REVIEW (2026-12-06): storing every quiet step's marker, not only a larger one, survived the
    suite: a re-sent older step lowered ``CTL_ACKED_STEP``, and a writer waiting for a later marker would
    wait out its commit timeout. The word only grows."""
    writer = Writer(committer.endpoint, committer.name, LAYOUT, STAGING_ROWS)
    key = f"q-{unique_cache_name('k')}"
    view = writer.open_key(key, "float32", 8)
    view.staging.copy_(random_rows(torch.float32, (STAGING_ROWS, 8), torch.Generator().manual_seed(3)))
    try:
        assert writer.step_write(11, [(key, 1, writer.new_cv(11), 0, [5])], quiet=True) is None
        assert writer.step_write(7, [(key, 2, writer.new_cv(7), 1, [6])], quiet=True) is None  # a re-send
        assert isinstance(writer.raw.call(P.StatusRequest(rid=writer.raw.next_rid())), P.StatusReply)  # both applied
        assert _acked_word(writer.welcome.control) == make_cv(writer.epoch, 11, 0)
    finally:
        writer.goodbye()


def test_a_later_epochs_ack_marker_acknowledges_no_step_of_this_writer(committer_factory):
    """MUTATION (2026-12-06): ``CTL_ACKED_STEP`` holding a marker of a later writer epoch (a successor's, after
    this writer was reaped while frozen) says nothing about this writer's steps; ``_acked_word`` without its
    epoch check survived the suite. With the committer stopped, this writer's step is not applied, and the
    word is set as a successor would leave it: ``wait_idle`` must time out, not take the step as landed."""
    handle = committer_factory("--heartbeat-timeout-s", "60")
    m = OmniPrefixCacheManager(small_config(commit_timeout_s=5.0), cache=handle.name, autostart=False)
    try:
        m.new_step_starts([started("a", [0])])
        m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
        m.wait_idle()
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            m.new_step_starts([started("b", [1])])
            m.discard_step(save(m, [Part("b", 2, [1], 0, 4)], BS))
            old = m._ctl_mv[P.CTL_ACKED_STEP]
            m._ctl_mv[P.CTL_ACKED_STEP] = make_cv(m._epoch + 1, 0, 0)
            try:
                with pytest.raises(TimeoutError):
                    m.wait_idle(timeout_s=0.5)
            finally:
                m._ctl_mv[P.CTL_ACKED_STEP] = old  # markers only grow: the committer would never lower it
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        m.wait_idle()
        assert torch.equal(m._keys[HIDDEN_KEY].pool[4:8], rows(2, range(4)))
    finally:
        m.shutdown()
