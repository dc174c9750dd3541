"""FullAttentionGroupView: batch order and CPU-block-table slots; group selection; token accounting."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnishm.client.group_view import (
    FullAttentionGroupView,
    PrefixCacheConfigError,
    check_prefix_cache_block_layout,
    check_prefix_cache_token_accounting,
    get_prefix_cache_group_view,
    naming_the_cache,
)
from omnishm.interface import OmniPrefixCacheUnmatchError


class FullAttentionSpec:
    def __init__(self, block_size=32):
        self.block_size = block_size


class SlidingWindowSpec(FullAttentionSpec):
    pass


class _DeviceOnly:
    """Stands in for the device-side buffers: any read fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"group view read device state ({name})")


class _Table:
    """Shaped like vLLM 0.32's BlockTable: block_table is a CpuGpuBuffer, slot_mapping must not be read."""

    def __init__(self, block_size, cpu, per_row):
        self.block_size = block_size
        self.block_table = SimpleNamespace(cpu=cpu, np=cpu.numpy(), gpu=_DeviceOnly())
        self.num_blocks_per_row = per_row
        self.slot_mapping = _DeviceOnly()


def make_batch(block_size, rows, width=16, max_reqs=8, per_row_attr=True, multi_as_list=False):
    table = torch.zeros(max_reqs, width, dtype=torch.int32)
    per_row = np.zeros(max_reqs, dtype=np.int32)
    computed = np.zeros(max_reqs, dtype=np.int32)
    for i, (rid, c, blocks) in enumerate(rows):
        if rid is None:
            continue
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        per_row[i] = len(blocks)
        computed[i] = c
    bt = _Table(block_size, table, per_row)
    if not per_row_attr:
        del bt.num_blocks_per_row
    multi = [bt] if multi_as_list else SimpleNamespace(block_tables=[bt])
    return SimpleNamespace(req_ids=[r[0] for r in rows], num_computed_tokens_cpu=computed, block_table=multi)


def reference_slots(rows, counts, block_size):
    out = []
    for (rid, c, blocks), n in zip([r for r in rows if r[0] is not None], counts):
        for pos in range(c, c + n):
            out.append(blocks[pos // block_size] * block_size + pos % block_size)
    return out


def test_batch_req_ids_skip_holes_and_are_read_at_call_time():
    batch = make_batch(32, [("a", 0, [1]), (None, 0, []), ("b", 0, [2])])
    view = FullAttentionGroupView(batch, 32)
    assert view.batch_req_ids == ["a", "b"]
    batch.req_ids[1] = "c"
    assert view.batch_req_ids == ["a", "c", "b"]


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_step_slots_match_per_token_reference(block_size):
    rng = random.Random(block_size)
    pool = list(range(1, 200))
    for _ in range(40):
        rng.shuffle(pool)
        rows, counts, used = [], [], 0
        for i in range(rng.randint(0, 7)):
            if rng.random() < 0.15:
                rows.append((None, 0, []))
                continue
            computed = rng.randint(0, 5 * block_size)
            n = rng.randint(0, 3 * block_size)
            nblocks = -(-(computed + n) // block_size)
            blocks = pool[used:used + nblocks]  # non-contiguous, never sorted
            used += nblocks
            rows.append((f"r{i}", computed, blocks))
            counts.append(n)
        view = FullAttentionGroupView(make_batch(block_size, rows, width=16), block_size)
        ids = view.batch_req_ids
        expected = reference_slots(rows, counts, block_size)
        got = view.step_slots_cpu(counts)
        assert got.dtype == torch.int64 and got.tolist() == expected
        assert view.step_slots_cpu(dict(zip(ids, counts))).tolist() == expected


def test_list_shaped_multi_group_table_and_no_per_row_counts():
    rows = [("a", 30, [5, 9])]
    view = FullAttentionGroupView(make_batch(32, rows, width=2, per_row_attr=False, multi_as_list=True), 32)
    assert view.step_slots_cpu([4]).tolist() == [5 * 32 + 30, 5 * 32 + 31, 9 * 32, 9 * 32 + 1]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="outside the block-table row"):
        view.step_slots_cpu([35])  # past the table width


def test_position_past_the_requests_blocks_raises():
    view = FullAttentionGroupView(make_batch(32, [("a", 0, [3]), ("b", 32, [4, 6])]), 32)
    assert view.step_slots_cpu([32, 32]).numel() == 64
    with pytest.raises(OmniPrefixCacheUnmatchError, match="request='b'"):
        view.step_slots_cpu([32, 33])  # b's position 64 needs a third block it does not have


def test_bad_counts_raise():
    view = FullAttentionGroupView(make_batch(32, [("a", 0, [3]), ("b", 0, [4])]), 32)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="2 batch requests"):
        view.step_slots_cpu([1])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no scheduled-token count"):
        view.step_slots_cpu({"a": 1})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="negative"):
        view.step_slots_cpu([1, -1])
    assert view.step_slots_cpu([0, 0]).tolist() == []
    assert FullAttentionGroupView(make_batch(32, []), 32).step_slots_cpu([]).dtype == torch.int64


def test_view_block_size_must_match_the_table():
    with pytest.raises(PrefixCacheConfigError, match="--block-size"):
        FullAttentionGroupView(make_batch(64, [("a", 0, [1])]), 32)
    with pytest.raises(ValueError):
        FullAttentionGroupView(make_batch(32, []), 0)


def test_get_group_view_checks_spec_first_and_selects_full_attention_table():
    batch = make_batch(32, [("a", 0, [1])])
    groups = [SimpleNamespace(kv_cache_spec=FullAttentionSpec(32), layer_names=["l0"])]
    view = get_prefix_cache_group_view(batch, 32, groups)
    assert isinstance(view, FullAttentionGroupView) and view.group_index == 0
    assert get_prefix_cache_group_view(batch, 32) is not None
    # the spec check runs before looking at the batch
    bad = [SimpleNamespace(kv_cache_spec=SlidingWindowSpec(32))]
    with pytest.raises(PrefixCacheConfigError):
        get_prefix_cache_group_view(SimpleNamespace(req_ids=[]), 32, bad)
    # no block table (e.g. attention-free batch) -> None
    assert get_prefix_cache_group_view(SimpleNamespace(req_ids=[]), 32, groups) is None
    assert get_prefix_cache_group_view(SimpleNamespace(req_ids=[], block_table=None), 32) is None
    assert get_prefix_cache_group_view(
        SimpleNamespace(req_ids=[], block_table=SimpleNamespace(block_tables=[])), 32) is None


def test_token_accounting():
    check_prefix_cache_token_accounting(10, 16, {"a": 4, "b": 6})
    check_prefix_cache_token_accounting(10, 10, [4, 6])
    check_prefix_cache_token_accounting(0, 0, {})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="num_tokens_unpadded=9"):
        check_prefix_cache_token_accounting(9, 16, {"a": 4, "b": 6})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="num_tokens_padded=8"):
        check_prefix_cache_token_accounting(10, 8, {"a": 4, "b": 6})


def test_slots_follow_the_table_in_place_and_a_replaced_table():
    """The view keeps a numpy view of the table between calls: edits in place and a new table tensor are
    seen (vLLM writes the table in place every step; its table has a numpy view, so it cannot be resized)."""
    batch = make_batch(32, [("a", 0, [3])], width=2)
    view = FullAttentionGroupView(batch, 32)
    assert view.step_slots_cpu([2]).tolist() == [96, 97]
    batch.block_table.block_tables[0].block_table.cpu[0, 0] = 5  # _update_states writes in place
    assert view.step_slots_cpu([2]).tolist() == [160, 161]
    batch.block_table.block_tables[0].block_table.cpu = torch.tensor([[7, 8]], dtype=torch.int32)  # replaced
    assert view.step_slots_cpu([2]).tolist() == [224, 225]


def test_slots_follow_a_replaced_table_tensor_of_the_same_shape():
    """MUTATION (2026-12-06): pins that the view re-reads the table when the tensor object is replaced, not
    only when its shape changes. The mutant (``table is not self._table`` -> ``self._table is None``) kept the
    numpy view of the old tensor while the new one had the same shape: rows went to the old table's slots."""
    batch = make_batch(32, [("a", 0, [3])], width=2)
    view = FullAttentionGroupView(batch, 32)
    assert view.step_slots_cpu([2]).tolist() == [96, 97]
    old = batch.block_table.block_tables[0].block_table.cpu
    new = torch.zeros_like(old)
    new[0, 0] = 9
    batch.block_table.block_tables[0].block_table.cpu = new
    assert view.step_slots_cpu([2]).tolist() == [288, 289]


@pytest.mark.parametrize("multi_as_list", [False, True])
def test_group_index_selects_that_groups_table(multi_as_list):
    """MUTATION (2026-12-06): pins that ``group_index`` picks that KV group's block table, from vLLM's
    ``MultiGroupBlockTable.block_tables`` and from a plain list of tables. The mutants (``tables[0]``,
    ``multi[0]``) always read group 0's table."""
    batch = make_batch(32, [("a", 0, [5])], multi_as_list=multi_as_list)
    group1 = make_batch(32, [("a", 0, [7])], multi_as_list=multi_as_list).block_table
    if multi_as_list:
        batch.block_table.append(group1[0])
    else:
        batch.block_table.block_tables.append(group1.block_tables[0])
    assert FullAttentionGroupView(batch, 32).step_slots_cpu([2]).tolist() == [160, 161]
    assert FullAttentionGroupView(batch, 32, group_index=1).step_slots_cpu([2]).tolist() == [224, 225]


def test_block_layout_refuses_a_group_with_one_layer_of_another_block_size():
    """MUTATION (2026-12-06): pins that every layer spec of a group must have the cache's block size, not just
    one of them. The mutant (``sizes != {block_size}`` -> ``block_size not in sizes``) let a group whose layers
    mix 32- and 64-token blocks through, though the 64-token layer's slots (block id * 64 + offset) name
    other tokens than the cache's (block id * 32 + offset)."""

    class UniformTypeKVCacheSpecs:  # vLLM's wrapper of per-layer specs of one type
        def __init__(self, block_size, kv_cache_specs):
            self.block_size, self.kv_cache_specs = block_size, kv_cache_specs

    same = UniformTypeKVCacheSpecs(32, {"l0": FullAttentionSpec(32), "l1": FullAttentionSpec(32)})
    check_prefix_cache_block_layout(32, [SimpleNamespace(kv_cache_spec=same)])
    mixed = UniformTypeKVCacheSpecs(32, {"l0": FullAttentionSpec(32), "l1": FullAttentionSpec(64)})
    with pytest.raises(PrefixCacheConfigError, match=r"KV-cache group 0 uses block size \[32, 64\]"):
        check_prefix_cache_block_layout(32, [SimpleNamespace(kv_cache_spec=mixed)])


def test_padded_one_short_of_unpadded_is_refused():
    """Mutation review (2026-12-06): the per-step contract is ``padded >= unpadded``; one row short is
    already a broken step (the last output row would be read past the forward's rows). The existing test used
    a shortfall of 2, so a bound off by one (``padded < unpadded - 1``) survived."""
    check_prefix_cache_token_accounting(10, 10, {"a": 4, "b": 6})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="num_tokens_padded=9"):
        check_prefix_cache_token_accounting(10, 9, {"a": 4, "b": 6})


def test_slots_follow_a_table_tensor_resized_in_place():
    """Mutation review (2026-12-06): the view caches a numpy view of the CPU block table and must make it
    again when the same tensor object changes shape (``resize_`` in place), else rows are addressed with the
    old row stride and every request past row 0 gets another row's blocks (wrong slots, hence wrong rows
    served later). With the shape check gone the stale view of the 4x8 table was used for the 8x4 one."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    tbl = SimpleNamespace(block_size=4, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=None)
    batch = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_cpu=np.zeros(8, dtype=np.int32),
                            block_table=SimpleNamespace(block_tables=[tbl]))
    table[0, 0], table[1, 0] = 3, 5
    view = FullAttentionGroupView(batch, 4)
    assert view.step_slots_cpu([2, 2]).tolist() == [12, 13, 20, 21]
    table.resize_(8, 4)  # same object, same storage, new row stride
    table.zero_()
    table[0, 0], table[1, 0] = 6, 7
    assert view.step_slots_cpu([2, 2]).tolist() == [24, 25, 28, 29]


# MUTATION (2026-12-07, stop 53): a refusal is named by the cache, and goes on unnamed when the name cannot be read.


def _boom():
    raise RuntimeError("no connection config")


def test_a_refusal_goes_on_unnamed_when_the_name_cannot_be_read():
    with pytest.raises(PrefixCacheConfigError, match="^omni prefix cache: prefix caching is off$"):
        with naming_the_cache(_boom):
            raise PrefixCacheConfigError("omni prefix cache: prefix caching is off")


def test_a_refusal_is_named_once_the_name_is_read():
    with pytest.raises(PrefixCacheConfigError, match="^omni prefix cache: cache stage1: prefix caching is off$"):
        with naming_the_cache(lambda: "stage1"):
            raise PrefixCacheConfigError("omni prefix cache: prefix caching is off")


def test_a_knob_refusal_the_gate_reads_is_named_too():
    """REVIEW (2026-12-07, stop 54): a bad ``OMNISHM_*`` knob, or a rule across knobs (the staging bound), is a
    ``ConfigError`` from the gate's ``load_prefix_cache_config``; it named no cache, so a pipeline's operator
    could not tell which stage was refused. It is named, and stays a ``ConfigError``."""
    from omnishm.config import ConfigError

    with pytest.raises(ConfigError, match=r"^cache stage1: bad staging_depth = '0' \(from env"):
        with naming_the_cache(lambda: "stage1"):
            raise ConfigError("bad staging_depth = '0' (from env OMNISHM_STAGING_DEPTH): must be >= 1")
    with pytest.raises(ConfigError, match=r"^bad staging_depth"):
        with naming_the_cache(_boom):
            raise ConfigError("bad staging_depth = '0' (from env OMNISHM_STAGING_DEPTH): must be >= 1")


def test_more_scheduled_counts_than_batch_requests_raise():
    """One count per batch request: a list longer than the batch is a disagreement, not cut short (a request's
    rows would be dropped, or the next request's taken for another's). MUTATION (stop 57): ``<`` for ``!=``
    took it; only a list too short was tested."""
    view = FullAttentionGroupView(make_batch(32, [("a", 0, [3]), ("b", 0, [4])]), 32)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="2 batch requests"):
        view.step_slots_cpu([1, 1, 1])
