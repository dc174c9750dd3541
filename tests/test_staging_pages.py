"""Unit contracts of the writer's staging pages (``client/segments.py``) and the deferred writes' flusher
(``client/writes.py``): who may claim a page, who wakes a waiting claim, exact hold counts, and a flush
region never written again after a piece of unknown outcome. Mutation review (2026-12-06): each test kills a
mutant the suite let through."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from omnishm import protocol as P
from omnishm.client.segments import StagingPages
from omnishm.client.writes import Chunk, Flusher, WriteTask
from omnishm.interface import OmniPrefixCacheStagingTimeoutError


def _flusher(send, region, copies, chunk_bytes=1 << 20, row0=0, rows=8):
    done: list = []
    ev = threading.Event()

    def to_host(dst, src, after):
        copies.append(src.clone())
        dst.copy_(src)

    def on_done(task, result):
        done.append((task, result))
        ev.set()

    f = Flusher(region=lambda key: region, row0=row0, rows=rows, to_host=to_host, chunk_bytes=chunk_bytes,
                key_index=lambda key: 0, send=send, on_task_done=on_done, timeout_s=5.0)
    return f, done, ev


def _task(tid, req, slots, tag):
    s = torch.as_tensor(slots, dtype=torch.int64)
    rows = torch.full((len(slots), 2), float(tag))
    return WriteTask(tid=tid, req_id=req, key="feat", opened_step=1,
                     chunks=[Chunk(cv=100 + tid, step_id=1, slots=s, rows=rows)])


def test_flusher_never_reuses_the_region_after_a_piece_whose_send_failed():
    """MUTATION: a failed send's piece not recorded as unsettled: a piece
    whose send future failed (the link lost it, say) has an unknown outcome: the committer may still apply
    it from the region later. The next task must fail without writing the region (b's rows in it would be
    committed under a's claim versions)."""
    region = torch.zeros((8, 2))
    copies: list = []
    sent: list = []

    def send(make):
        fut: Future = Future()
        sent.append(make(len(sent) + 1))
        if len(sent) == 1:
            fut.set_exception(ConnectionError("link lost"))
        else:
            fut.set_result(P.StepDone(rid=len(sent), step=1, done_tids=b"", rows_written=4))
        return fut

    f, done, ev = _flusher(send, region, copies)
    try:
        f.put(_task(1, "a", [0, 1, 2, 3], 1))
        assert ev.wait(5); ev.clear()
        assert isinstance(done[0][1], ConnectionError)
        f.put(_task(2, "b", [4, 5, 6, 7], 2))
        assert ev.wait(5)
        assert isinstance(done[1][1], RuntimeError) and "not reused" in str(done[1][1]), done[1][1]
        assert len(copies) == 1 and len(sent) == 1, "the region was written again after an unsettled piece"
        assert torch.equal(region[:4], torch.full((4, 2), 1.0))
    finally:
        f.stop()


def _wait_until(pred, what, limit=5.0):
    end = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.001)


def test_close_wakes_a_claim_already_waiting_for_a_page():
    """``close`` must wake waiting claims: a claim waiting for a full staging
    must raise at once when the manager shuts down, not wait out its staging_claim_timeout_s (here 60 s:
    the thread would still be waiting when joined)."""
    pages = StagingPages(depth=1, capacity=4, cache="k")
    pages.claim(1, 1.0)
    got: list = []

    def waiter():
        try:
            got.append(pages.claim(2, 60.0))
        except BaseException as exc:  # noqa: BLE001
            got.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    _wait_until(lambda: pages.waits == 1, "the claim never waited")
    with pages._lock:  # the waiter counted its wait and is inside cond.wait (same lock hold)
        pass
    pages.close("shutting down")
    t.join(5.0)
    assert not t.is_alive(), "close did not wake the waiting claim"
    assert isinstance(got[0], RuntimeError) and "shutting down" in str(got[0])


def test_release_hands_the_page_to_a_claim_already_waiting():
    """MUTATION: ``release`` without its wake: a claim waiting for a full staging
    gets the page as soon as its last hold goes, not after its timeout (60 s here)."""
    pages = StagingPages(depth=1, capacity=4, cache="k")
    page = pages.claim(1, 1.0)
    got: list = []
    t = threading.Thread(target=lambda: got.append(pages.claim(2, 60.0)), daemon=True)
    t.start()
    _wait_until(lambda: pages.waits == 1, "the claim never waited")
    pages.release(page, "ctx")
    assert t.is_alive() or got == [], "a page with a hold left was handed out"
    pages.release(page, "write")
    t.join(5.0)
    assert not t.is_alive() and got == [0], "release did not wake the waiting claim"
    assert pages.in_use() == 1


def test_releasing_a_hold_twice_or_on_a_free_page_changes_nothing():
    """MUTATION: the ``hold not in held`` check dropped, or ``used`` not
    counted: a hold released twice (a done callback and an abandon both run) must not free the page
    again: ``used`` (the staging gauge) stays exact and never goes negative."""
    pages = StagingPages(depth=2, capacity=4, cache="k")
    a = pages.claim(1, 1.0)
    b = pages.claim(2, 1.0)
    assert pages.in_use() == 2
    pages.release(a, "write")
    pages.release(a, "write")
    assert pages.in_use() == 2
    pages.release(a, "ctx")
    pages.release(a, "ctx")
    pages.release(a, "write")
    assert pages.in_use() == 1 and pages._owner[a] is None and pages._owner[b] == 2
    assert pages.claim(3, 1.0) == a and pages.in_use() == 2


def test_a_closed_staging_refuses_a_claim_even_with_a_free_page():
    """MUTATION: the ``_closed`` check dropped: once the manager shut down (close), no
    save may claim a page of segments about to be unmapped, free page or not."""
    pages = StagingPages(depth=2, capacity=4, cache="k")
    pages.close("the manager shut down")
    with pytest.raises(RuntimeError, match="shut down"):
        pages.claim(1, 1.0)
    assert pages.in_use() == 0


def test_a_page_stays_held_until_both_the_step_is_consumed_and_its_write_acknowledged():
    """Mutation review (2026-12-06): ``StagingPages`` contract (segments.py docstring): a writer's page is held from
    the claim until BOTH the step id was consumed (``ctx`` hold: materialize/discard) AND the committer acknowledged
    the step's writes (``write`` hold: it reads the rows from the page until then). Consuming the step alone must
    not free the page: a new step's rows would overwrite rows the committer has yet to copy (wrong row in the pool).
    A claim with no page free fails at once with ``timeout_s=0`` (no waiting involved), naming the holder step."""
    pages = StagingPages(depth=1, capacity=4, cache="k")
    page = pages.claim(7, 1.0)  # the writer's default holds: ("ctx", "write")
    pages.release(page, "ctx")  # consumed, write not yet acknowledged
    assert pages.in_use() == 1
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=r"unconsumed step ids \[7\]"):
        pages.claim(8, 0.0)
    pages.release(page, "write")
    assert pages.claim(8, 0.0) == page and pages.in_use() == 1


def test_the_flush_region_lies_past_every_step_page():
    """The flusher's region (``flush_row0`` onwards, ``capacity`` rows) must not overlap any step page
    (``page * capacity`` .. ``+ capacity``): a deferred write's rows copied there while a step's page is still read
    by the committer would overwrite that step's rows (wrong row). It starts right after the last page."""
    for depth, cap in ((1, 4), (3, 32)):
        pages = StagingPages(depth=depth, capacity=cap, cache="k")
        assert pages.flush_row0 == depth * cap
        for p in range(depth):
            assert (p + 1) * cap <= pages.flush_row0
