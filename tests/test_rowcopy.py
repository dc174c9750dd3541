"""Hit reads copy runs of consecutive pool rows with one memmove each (client/rowcopy.py).

``gather_rows`` must equal ``index_select`` bit for bit whatever path it takes, and a hit
large enough for the run path must come back exact through a real committer, on the writer and
on a reader.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnishm.client import OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client import rowcopy
from omnishm.client.rowcopy import gather_rows

from manager_helpers import Part, build, rows, started


def pool_of(n: int, width: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.int64).remainder(30011).to(dtype).view(n, width)


@pytest.mark.parametrize("slots", [
    list(range(64, 64 + 512)),  # one run of 512 rows (4 MiB)
    list(range(256, 384)) + list(range(0, 128)) + list(range(640, 768)),  # three runs, out of order
    list(range(0, 512, 2)),  # scattered: mean run below RUN_MIN_BYTES
    [3, 9],  # small: under RUN_COPY_MIN_BYTES
], ids=["one-run", "three-runs", "scattered", "small"])
def test_gather_rows_equals_index_select(slots):
    pool = pool_of(1024, 4096)
    idx = torch.tensor(slots, dtype=torch.int64)
    out = torch.full((len(slots), 4096), -1.0, dtype=torch.bfloat16)
    gather_rows(pool, idx, out)
    assert torch.equal(out.view(torch.int16), pool.index_select(0, idx).view(torch.int16))


def test_gather_rows_takes_the_run_path_and_refuses_a_slot_outside_the_pool_before_copying(monkeypatch):
    pool = pool_of(1024, 4096)
    calls = []
    monkeypatch.setattr(rowcopy, "_memmove", lambda *a: calls.append(a) or rowcopy.ctypes.memmove(*a))
    idx = torch.arange(100, 400)
    out = torch.empty((300, 4096), dtype=torch.bfloat16)
    gather_rows(pool, idx, out)
    assert len(calls) == 1 and calls[0][2] == 300 * 4096 * 2
    assert torch.equal(out.view(torch.int16), pool[100:400].view(torch.int16))

    out.fill_(7)
    with pytest.raises(IndexError, match=r"slot out of range: \[900, 1199\] in a pool of 1024 rows"):
        gather_rows(pool, torch.arange(900, 1200), out)
    assert bool((out == 7).all()), "rows were copied before the range was checked"


def test_gather_rows_refuses_the_slot_just_past_the_pool_on_the_run_path():
    """MUTATION (2026-12-06): a run-path read naming slot ``len(pool)`` (one past the last row) raises
    ``IndexError`` before copying anything. With the bound check off by one (``hi > len(pool)``), it memmoved
    the row lying past the end of the pool (here a sentinel row of the larger tensor the pool is a view of;
    past a real pool, another allocation's bytes, or a crash)."""
    backing = pool_of(1025, 4096)
    pool = backing[:1024]  # row 1024 of backing lies right after the pool in memory
    out = torch.full((300, 4096), 7.0, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=r"slot out of range: \[725, 1024\] in a pool of 1024 rows"):
        gather_rows(pool, torch.arange(725, 1025), out)
    assert bool((out == 7).all()), "rows were copied before the range was checked"


def test_gather_rows_keeps_index_select_for_rows_it_cannot_memmove():
    pool = pool_of(1024, 4096)
    idx = torch.arange(0, 300)
    strided = torch.empty((4096, 300), dtype=torch.bfloat16).t()  # not contiguous
    gather_rows(pool, idx, strided)
    assert torch.equal(strided.view(torch.int16), pool[:300].view(torch.int16))
    with pytest.raises(RuntimeError):  # a dtype the pool does not hold: index_select's own error
        gather_rows(pool, idx, torch.empty((300, 4096), dtype=torch.float32))


def test_a_hit_large_enough_for_the_run_path_is_exact_on_the_writer_and_a_reader(committer, monkeypatch):
    # Blocks of 128 rows of 4 KiB (512 KiB): the hit is blocks 4-5 then 1-2, two runs of 1 MiB.
    bs, width = 128, 1024
    cfg = PrefixCacheConfig(num_blocks=8, block_size=bs, staging_capacity_tokens=4 * bs, staging_depth=2,
                            staging_claim_timeout_s=5.0, commit_timeout_s=5.0)
    runs = []
    monkeypatch.setattr(rowcopy, "_memmove", lambda *a: runs.append(a[2]) or rowcopy.ctypes.memmove(*a))
    w = OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False)
    r = OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False)
    try:
        def step(m, events, part):
            m.new_step_starts(events)
            _, _, layout, n, padded = build([part], bs, mm_key=None)
            hidden = rows(part.tag, range(part.first, part.first + part.count), width)
            return m.save_outputs(hidden, {}, num_tokens_unpadded=n, num_tokens_padded=padded, write_layout=layout)

        blocks = [4, 5, 1, 2]
        for m in (w, r):
            m.discard_step(step(m, [started("a", blocks)], Part("a", 1, blocks, 0, 4 * bs)))
        w.wait_idle()
        for m, role in ((w, "writer"), (r, "reader")):
            runs.clear()
            sid = step(m, [started("b", blocks + [7], hit=4 * bs)], Part("b", 1, blocks + [7], 4 * bs, 8))
            out = m.materialize(sid, ["b"])
            assert out.num_hit_tokens["b"] == 4 * bs
            assert torch.equal(out.hidden_states["b"], rows(1, range(4 * bs + 8), width)), role
            assert runs == [2 * bs * width * 4] * 2, role  # one memmove per run
    finally:
        r.shutdown()
        w.shutdown()


# MUTATION REVIEW (stop 51): the run path's bound checks.
def test_gather_rows_refuses_a_negative_slot_on_the_run_path_before_copying():
    """Contract: a run-path read (large, consecutive slots) naming a slot below 0 raises ``IndexError``
    before copying anything, as ``index_select`` would; it never memmoves the bytes lying before the pool
    (another allocation's, or here the sentinel row of the larger tensor the pool is a view of) into the
    result as if they were a cached row. Kills the mutant that drops ``lo < 0`` from the bound check."""
    backing = torch.full((1025, 4096), 3.0, dtype=torch.bfloat16)
    pool = backing[1:]  # row 0 of backing lies right before the pool in memory
    pool.copy_(torch.arange(1024 * 4096).remainder(30011).to(torch.bfloat16).view(1024, 4096))
    assert pool.is_contiguous()
    out = torch.full((300, 4096), 7.0, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=r"slot out of range: \[-1, 298\] in a pool of 1024 rows"):
        gather_rows(pool, torch.arange(-1, 299), out)
    assert bool((out == 7).all()), "rows were copied before the range was checked"


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")  # index_select's, then its error
def test_gather_rows_never_writes_past_an_out_tensor_shorter_than_the_slots():
    """Contract: ``gather_rows`` writes only inside ``out``. An ``out`` with fewer rows than ``slots`` (a
    caller's bug) is index_select's to refuse (its storage cannot grow), never memmoved past its end into
    whatever memory follows (here the spare row of the array ``out`` views). Kills the mutant that drops
    the ``out.shape`` check that routes such a call away from the run path."""
    pool = torch.arange(2048 * 1024, dtype=torch.float32).view(2048, 1024)
    n = 512  # 2 MiB: the run path
    base = np.zeros((n + 1, 1024), dtype=np.float32)
    out = torch.from_numpy(base[: n - 1])  # one row short; base[n - 1] is not out's
    with pytest.raises(RuntimeError):
        gather_rows(pool, torch.arange(100, 100 + n), out)
    assert not base[n - 1:].any(), "rows were written past the end of out"


def test_run_path_refuses_a_slot_past_the_pool_in_a_middle_run_before_copying():
    """MUTATION (2026-12-07, stop 53). Contract: the run path's bound check covers every slot, not just the first and last. Three runs out of
    order (the shape of a hit whose blocks were reused out of order): the middle run lies past the pool, the
    first and last runs inside it. ``gather_rows`` raises ``IndexError`` and copies nothing; it never memmoves
    the rows lying past the pool (here the sentinel rows of the larger tensor the pool is a view of) as if
    they were cached rows. Kills the mutant that bounds-checks ``s[0]``/``s[-1]`` instead of min/max."""
    backing = torch.full((1400, 4096), 5.0, dtype=torch.bfloat16)
    pool = backing[:1024]
    pool.copy_(torch.arange(1024 * 4096).remainder(30011).to(torch.bfloat16).view(1024, 4096))
    slots = torch.cat([torch.arange(0, 200), torch.arange(1100, 1300), torch.arange(500, 700)])
    out = torch.full((600, 4096), 7.0, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=r"slot out of range: \[0, 1299\] in a pool of 1024 rows"):
        gather_rows(pool, slots, out)
    assert bool((out == 7).all()), "rows were copied before the range was checked"


def test_a_non_contiguous_pool_is_gathered_row_by_row_not_memmoved():
    """MUTATION (2026-12-07, stop 53). Contract (docstring): a non-contiguous ``pool`` goes through ``index_select``. A pool that is a column
    slice of a wider tensor (row stride larger than its row) still returns exactly ``pool[slots]``; a memmove
    of ``run * row_bytes`` bytes from ``pool.data_ptr()`` would take the wider tensor's bytes (half of them
    not the pool's). Kills the mutant that drops ``not pool.is_contiguous()`` from the fallback test."""
    wide = torch.arange(1024 * 8192).remainder(30011).to(torch.bfloat16).view(1024, 8192)
    pool = wide[:, :4096]
    assert not pool.is_contiguous()
    slots = torch.arange(100, 400)  # 300 rows of 8 KiB: the run path's size
    out = torch.full((300, 4096), 7.0, dtype=torch.bfloat16)
    gather_rows(pool, slots, out)
    assert torch.equal(out.view(torch.int16), pool.index_select(0, slots).view(torch.int16))
