"""Recycled result memory: a block is reused only once no tensor of it is alive."""

from __future__ import annotations

import gc
import threading

import torch

from manager_helpers import Part, expect, finished, rows, save, started
from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.result_pool import GRAIN, ResultPool

MIB = 1 << 20


def test_block_comes_back_only_after_every_view_is_gone():
    pool = ResultPool(64 * MIB, min_bytes=0)
    t = pool.empty((512, 1024), torch.float32)  # 2 MiB: one grain
    assert t.shape == (512, 1024) and t.is_contiguous() and t.dtype == torch.float32
    a, b = t.split_with_sizes([500, 12])
    del t
    gc.collect()
    assert pool.free_bytes == 0  # views still hold the block
    b.fill_(7.0)
    c = pool.empty((512, 1024), torch.float32)  # must be another block
    c.fill_(-1.0)
    assert torch.all(b == 7.0)
    assert pool.stats["faulted"] == 2 and pool.stats["reused"] == 0
    del a, b
    assert pool.free_bytes == GRAIN
    d = pool.empty((1024, 400), torch.float32)  # fits the free block with less than 25% to spare
    assert pool.stats["reused"] == 1
    e = pool.empty((256, 1024), torch.bfloat16)  # 0.5 MiB; both blocks are in use, so a third one
    assert pool.stats["faulted"] == 3
    del c, d, e
    assert pool.free_bytes == 3 * GRAIN


def test_best_fit_cap_small_allocations_and_disabled_pool():
    pool = ResultPool(4 * GRAIN, min_bytes=MIB)
    small = pool.empty((10, 10), torch.bfloat16)
    assert pool.stats["unpooled"] == 1 and small.dtype == torch.bfloat16
    big = pool.empty((4 * GRAIN,), torch.uint8)
    mid = pool.empty((2 * GRAIN,), torch.uint8)
    del big, mid
    assert pool.free_bytes == 2 * GRAIN and pool.stats["dropped"] == 1  # the oldest was evicted for the newest
    huge = pool.empty((5 * GRAIN,), torch.uint8)
    del huge
    assert pool.free_bytes == 2 * GRAIN and pool.stats["dropped"] == 2  # larger than the cap: never kept
    again = pool.empty((2 * GRAIN - 100,), torch.uint8)
    assert pool.stats["reused"] == 1 and pool.free_bytes == 0
    del again
    assert pool.free_bytes == 2 * GRAIN
    off = ResultPool(0)
    off.empty((64, MIB // 256), torch.float32)
    assert off.stats["unpooled"] == 1 and off.free_bytes == 0


def test_a_free_block_smaller_than_the_request_is_never_handed_out():
    """MUTATION (2026-12-06): after a 4 MiB block came back, a 5 MiB request gets a block that holds 5 MiB.
    With the best fit taking a free block up to one GRAIN smaller than the request, it got the 4 MiB block
    (the view of 5 MiB failed to build, or reached past the block)."""
    pool = ResultPool(64 * MIB, min_bytes=MIB)
    t = pool.empty((4 * MIB,), torch.uint8)
    del t
    gc.collect()
    assert pool.free_bytes == 4 * MIB
    big = pool.empty((5 * MIB,), torch.uint8)
    assert big.numel() == 5 * MIB
    big.fill_(7)
    assert int(big[0]) == 7 and int(big[-1]) == 7


def test_blocks_over_the_cap_are_let_go_by_the_next_small_result_too():
    """A burst of large results, all dropped, then only small ones (short steps): the pool holds at most its
    cap of them from the next call on (it held all four until the next large result; review)."""
    cap = 64 << 20
    pool = ResultPool(cap, min_bytes=1 << 20)
    results = [pool.empty((40 << 20,), torch.uint8) for _ in range(4)]
    del results
    gc.collect()
    pool.empty((16,), torch.float32)
    assert sum(b.nbytes for b in pool._returned) == 0
    assert pool._free_bytes <= cap and pool.stats["dropped"] >= 2


def test_blocks_released_from_other_threads():
    pool = ResultPool(256 * MIB, min_bytes=0)
    held = [pool.empty((GRAIN // 4,), torch.float32) for _ in range(16)]
    threads = [threading.Thread(target=held.pop) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not held and pool.free_bytes == 16 * GRAIN


def test_materialize_results_never_alias_while_held(committer):
    """Results kept by the caller stay exact while later steps reuse recycled memory."""
    bs = 4
    cfg = PrefixCacheConfig(num_blocks=16, block_size=bs, staging_capacity_tokens=32, staging_depth=2)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as m:
        m.result_pool = ResultPool(64 * MIB, min_bytes=0)  # pool every result, however small
        m.new_step_starts([started("a", [0, 1])])
        kept = m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], bs), ["a"])
        for step in range(2, 8):
            req = f"r{step}"
            m.new_step_starts([finished("a" if step == 2 else f"r{step - 1}"), started(req, [2, 3])])
            out = m.materialize(save(m, [Part(req, step, [2, 3], 0, 8)], bs), [req])
            assert torch.equal(out.hidden_states[req], rows(step, range(8)))
            out.hidden_states[req].fill_(float("nan"))  # the caller scribbles on its own result
            del out
        assert torch.equal(kept.hidden_states["a"], rows(1, range(8)))
        assert torch.equal(kept.mm_outputs["a"]["feat"], expect(1, 0, 1, 0, 8, mm=True))
        assert m.result_pool.stats["reused"] > 0
        assert m.counters["result_blocks_reused"] > 0


def test_a_pool_that_takes_every_size_hands_out_empty_results_too():
    """Review (2026-12-06): a pool built with ``min_bytes=0`` (as the tests' and benchmarks' are) raised
    ``stride(-1) must be 1`` for a result of 0 rows: there are no bytes to take a view of."""
    pool = ResultPool(1 << 20, min_bytes=0)
    for shape in ((0, 8), (4, 0), (0,)):
        t = pool.empty(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32
    assert pool.empty((2, 8), torch.float32).shape == (2, 8)


def test_a_free_block_of_exactly_the_requested_size_is_reused():
    """A block whose size is exactly the request's is the best possible fit: the pool must hand it out again
    (``reused``), not fault in a new one. MUTATION (stop 47): the fit's lower bound made strict (``nbytes < block``)
    left every same-size result, the common case of a steady batch, paying fresh page faults each step."""
    pool = ResultPool(64 << 20, min_bytes=0)
    t = pool.empty((GRAIN,), torch.uint8)
    del t
    gc.collect()
    assert pool.free_bytes == GRAIN
    again = pool.empty((GRAIN // 4,), torch.float32)  # GRAIN bytes exactly
    assert pool.stats["reused"] == 1 and pool.stats["faulted"] == 1 and pool.free_bytes == 0
    assert again.numel() == GRAIN // 4


def test_the_smallest_free_block_that_fits_is_taken():
    """Best fit: of two free blocks that both fit a request, the smaller is handed out and the larger stays free
    for a larger result. MUTATION (stop 47): the comparison flipped (worst fit) took the larger block."""
    pool = ResultPool(256 << 20, min_bytes=0)
    big = pool.empty((10 * GRAIN,), torch.uint8)
    small = pool.empty((8 * GRAIN,), torch.uint8)
    del big  # returned first: a first-fit or worst-fit scan meets it first
    del small
    gc.collect()
    assert pool.free_bytes == 18 * GRAIN
    got = pool.empty((8 * GRAIN,), torch.uint8)
    assert pool.stats["reused"] == 1 and pool.free_bytes == 10 * GRAIN
    del got


def test_a_block_exactly_the_cap_is_kept_and_the_oldest_is_evicted_first():
    """``max_free_bytes`` is the most free memory kept: a block of exactly the cap is kept (dropped only when larger),
    and when a returned block pushes the free total over the cap the OLDEST free block goes first. MUTATIONS (stop
    47): ``>=`` for ``>`` dropped a block of exactly the cap; ``pop()`` for ``pop(0)`` evicted the newest."""
    cap = 4 * GRAIN
    pool = ResultPool(cap, min_bytes=0)
    whole = pool.empty((cap,), torch.uint8)
    del whole
    gc.collect()
    assert pool.free_bytes == cap and pool.stats["dropped"] == 0
    pool2 = ResultPool(cap, min_bytes=0)
    a = pool2.empty((GRAIN,), torch.uint8)
    b = pool2.empty((2 * GRAIN,), torch.uint8)
    c = pool2.empty((2 * GRAIN,), torch.uint8)
    del a, b, c  # filed a, b, c: c pushes the total over the cap, so a (the oldest) goes
    gc.collect()
    assert pool2.free_bytes == cap and pool2.stats["dropped"] == 1
    assert sorted(blk.nbytes for blk in pool2._free) == [2 * GRAIN, 2 * GRAIN]


def test_a_free_block_far_larger_than_the_request_is_not_spent_on_it():
    """A request takes a free block with at most 25% (plus one grain) to spare: a small result must not pin a
    large free block (held for as long as the caller keeps the result, while the next large result faults a new
    one in). MUTATION (stop 47): the fit's upper bound dropped handed a 20 MiB block to a 2 MiB result."""
    pool = ResultPool(64 << 20, min_bytes=0)
    big = pool.empty((10 * GRAIN,), torch.uint8)
    del big
    gc.collect()
    small = pool.empty((GRAIN,), torch.uint8)
    assert pool.stats["reused"] == 0 and pool.stats["faulted"] == 2 and pool.free_bytes == 10 * GRAIN
    del small
    edge = pool.empty((8 * GRAIN,), torch.uint8)  # 8 + 2 + 1 = 11 grains allowed: the 10-grain block fits
    assert pool.stats["reused"] == 1
    del edge


def test_a_result_of_exactly_min_bytes_comes_from_the_pool():
    """Mutation review (2026-12-06): ``ResultPool``: allocations *under* ``min_bytes`` come from torch's allocator; one
    of exactly ``min_bytes`` is a pooled, pre-faulted block that comes back for the next result of that size once
    dropped (the module docstring's boundary). Pins the comparison at the threshold (``<`` not ``<=``)."""
    pool = ResultPool(4 * GRAIN, min_bytes=GRAIN)
    t = pool.empty((GRAIN,), torch.uint8)
    assert pool.stats["faulted"] == 1 and pool.stats["unpooled"] == 0
    del t
    assert pool.free_bytes == GRAIN
    again = pool.empty((GRAIN // 4,), torch.float32)
    assert pool.stats["reused"] == 1 and again.numel() == GRAIN // 4


def test_a_pool_with_no_room_hands_out_plain_tensors_for_large_results_too():
    """Mutation review (2026-12-06): ``result_pool_bytes=0`` turns the pool off: every result, whatever its size (also
    above ``min_bytes``), is a plain torch allocation, counted ``unpooled``; no block is faulted in up front (a
    page-touch pass over a block the pool could never keep is pure cost on the engine thread) and none is ever filed
    or dropped."""
    off = ResultPool(0, min_bytes=0)
    t = off.empty((2 * GRAIN,), torch.uint8)
    assert t.numel() == 2 * GRAIN
    del t
    assert off.free_bytes == 0
    assert off.stats["unpooled"] == 1 and off.stats["faulted"] == 0 and off.stats["dropped"] == 0


def test_a_closed_pool_lets_go_of_its_free_blocks_and_of_each_block_returned_later():
    """Review (stop 56): a shut-down manager's pool held up to ``max_free_bytes`` of free blocks for the manager's
    life. ``close`` (the manager's shutdown) lets go of them, and of a block whose result dies later; ``empty``
    still works, unpooled."""
    pool = ResultPool(64 * MIB, min_bytes=0)
    free = pool.empty((1024,), torch.float32)
    held = pool.empty((2048,), torch.float32)
    del free
    gc.collect()
    assert pool.free_bytes > 0
    pool.close()
    assert pool.free_bytes == 0
    del held
    gc.collect()
    assert pool.free_bytes == 0 and not pool._returned
    out = pool.empty((16,), torch.float32)
    assert out.shape == (16,) and pool.stats["unpooled"] == 1


def test_a_managers_shutdown_closes_its_result_pool(committer):
    bs = 4
    cfg = PrefixCacheConfig(num_blocks=16, block_size=bs, staging_capacity_tokens=32, staging_depth=2)
    m = OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False)
    m.result_pool = ResultPool(64 * MIB, min_bytes=0)
    m.new_step_starts([started("a", [0, 1])])
    out = m.materialize(save(m, [Part("a", 1, [0, 1], 0, 8)], bs), ["a"])
    del out
    gc.collect()
    assert m.result_pool.free_bytes > 0
    m.shutdown()
    assert m.result_pool.free_bytes == 0


def test_close_lets_go_of_blocks_returned_but_not_yet_filed():
    """Mutation review (stop 56): read through ``free_bytes`` first, a close that kept the blocks returned but
    not filed yet (no pool call since) passed; a shut-down manager's pool is never called again."""
    pool = ResultPool(64 * MIB, min_bytes=0)
    t = pool.empty((4096,), torch.float32)
    del t
    gc.collect()
    assert len(pool._returned) == 1  # back, not filed: no pool call since
    pool.close()
    assert not pool._returned and not pool._free


def test_a_block_whose_result_dies_after_close_is_not_kept():
    pool = ResultPool(64 * MIB, min_bytes=0)
    held = pool.empty((4096,), torch.float32)
    pool.close()
    del held
    gc.collect()
    assert not pool._returned and not pool._free


def test_a_block_returned_while_close_runs_is_not_kept():
    """Fresh-eyes review (stop 56): ``_give_back`` checks ``_closed``, then appends without the lock; a close on
    another thread in between left the block held. Forced here: the queue's append runs the close first."""
    import collections

    pool = ResultPool(16 * MIB, min_bytes=1)

    class CloseFirst(collections.deque):
        def append(self, block):
            pool.close()  # the other thread's close, between the check and the append
            super().append(block)

    t = pool.empty((1 << 18,), torch.float32)
    pool._returned = CloseFirst()
    del t
    gc.collect()
    assert pool._closed and not pool._returned


def test_a_large_returned_block_evicts_as_many_old_free_blocks_as_the_cap_needs():
    """The free blocks stay within ``max_free_bytes`` when one returned block needs several old ones dropped.
    MUTATION (stop 57): dropping one a return left the pool over its cap."""
    pool = ResultPool(4 * GRAIN, min_bytes=GRAIN)
    small = [pool.empty((GRAIN,), torch.uint8) for _ in range(2)]
    del small
    assert pool.free_bytes == 2 * GRAIN
    big = pool.empty((4 * GRAIN,), torch.uint8)  # no free block fits: a new one of 4 grains
    assert pool.stats["faulted"] == 3
    del big
    assert pool.free_bytes == 4 * GRAIN <= pool.max_free_bytes and pool.stats["dropped"] == 2
