"""The vllm-omni drop-in's paths that its main tests (test_vllm_omni_dropin.py) left out, against vllm-omni.

Mutation review (2026-12-06, stop 49): vllm-omni's real group view over a vLLM-shaped input batch (the drop-in's
own slots, its production path), an ``mm_outputs`` key named ``HIDDEN_KEY``, leftover per-token values at
materialize, a request scheduled 0 tokens with a hit, ``install()``'s wrap of the runner's build, and the staging
timeout's class. Each compares ``VllmOmniPrefixCacheManager`` (over a real committer process) with vllm-omni
0.30.0's own ``OmniPrefixCacheManager`` fed the same scheduler outputs, views and outputs, where both answer.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omnishm.bench.vllm_omni_arm import BatchView, CachedRequests, NewRequest, SchedulerOutput
from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager, load_prefix_cache
from conftest import unique_cache_name
from test_vllm_omni_dropin import _both, _step, managers, materialized_alike, same

VO, _ = load_prefix_cache(standin=True)


class _Tables:
    """vLLM's MultiGroupBlockTable as both views read it: ``block_tables[0]`` (omnishm) and ``[0]`` (vllm-omni)."""

    def __init__(self, table: Any):
        self.block_tables = [table]

    def __getitem__(self, i: int) -> Any:
        return self.block_tables[i]


def _vllm_batch(max_reqs: int = 4, max_blocks: int = 4) -> SimpleNamespace:
    """The fields of vLLM 0.32's ``InputBatch`` that both group views read."""
    cpu = torch.zeros(max_reqs, max_blocks, dtype=torch.int32)
    table = SimpleNamespace(block_size=16, block_table=SimpleNamespace(cpu=cpu),
                            num_blocks_per_row=np.zeros(max_reqs, dtype=np.int32))
    return SimpleNamespace(req_ids=[], req_id_to_index={}, num_computed_tokens_cpu=np.zeros(max_reqs, dtype=np.int32),
                           block_table=_Tables(table))


def _set_rows(batch: SimpleNamespace, rows: list[tuple[str | None, int, list[int]]]) -> None:
    """rows: (request, num_computed_tokens, block ids), in batch order; a request of None is a hole (a removed
    request's row, not yet condensed)."""
    table = batch.block_table.block_tables[0]
    batch.req_ids = [r for r, _, _ in rows]
    batch.req_id_to_index = {r: i for i, (r, _, _) in enumerate(rows) if r is not None}
    for i, (_, computed, blocks) in enumerate(rows):
        batch.num_computed_tokens_cpu[i] = computed
        table.block_table.cpu[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        table.num_blocks_per_row[i] = len(blocks)


@pytest.mark.parametrize("hole", [False, True], ids=["condensed", "with-a-hole"])
def test_slots_from_vllms_block_table_match_vllm_omnis_view_and_hits_serve_the_rows_written(committer_factory, hole):
    """Contract: with vllm-omni's real ``FullAttentionGroupView`` over a vLLM-shaped input batch (how vllm-omni's
    runner builds the drop-in), the drop-in computes the step's slots with its own view over that batch
    (``_own_view``), each request's count paired with its own block-table row. Rows must land at the slots
    vllm-omni's view names: a later hit of another request on those blocks gets exactly the rows first saved, as
    vllm-omni's own manager returns them. Without vLLM, the tests elsewhere run the drop-in on a stand-in view
    that has no ``_input_batch``, so this production path ran only in the vLLM tier.

    With a hole in the batch (``None`` in vLLM's ``req_ids``, a removed request's row not yet condensed),
    vllm-omni's ``batch_req_ids`` lists it where omnishm's view skips it: the drop-in then takes vllm-omni's
    ``step_slots_cpu``, and the step is saved, not refused for a count list that does not match its rows (stop
    52's mutation review: the order guard was unpinned)."""
    cfg = VO.PrefixCacheConfig(num_blocks=16, block_size=16, staging_capacity_tokens=64, staging_depth=2,
                               staging_claim_timeout_s=10.0)
    batch = _vllm_batch()
    view = VO.FullAttentionGroupView(batch, 16)
    theirs = VO.OmniPrefixCacheManager(cfg, view, eager=True)
    ours = VllmOmniPrefixCacheManager(cfg, view, cache=committer_factory().name, autostart=False, role="writer")
    try:
        assert ours._ours is not None  # the drop-in's own view is the one under test
        # Step 1: "a" prefills 20 tokens (blocks 5, 6), "b" 4 tokens (block 9); b first in the batch.
        _set_rows(batch, [("b", 0, [9]), *([(None, 0, [1])] if hole else []), ("a", 0, [5, 6])])
        so = SchedulerOutput([NewRequest("b", 0, ([9],)), NewRequest("a", 0, ([5, 6],))], CachedRequests([], set(), [], []),
                             {"b": 4, "a": 20}, 24, set())
        h = torch.randn(24, 8)
        mm = {"feat": torch.randn(24, 4)}
        ours.new_step_starts(so)
        theirs.new_step_starts(so)
        sids = (ours.save_outputs(h, mm, num_tokens_unpadded=24, num_tokens_padded=24),
                theirs.save_outputs(h, mm, num_tokens_unpadded=24, num_tokens_padded=24))
        materialized_alike(ours, theirs, sids, ["b", "a"], "step 1")
        # Step 2: "a" and "b" finish; "c" hits a's first block (16 tokens) and computes 3 more in block 7.
        _set_rows(batch, [("c", 16, [5, 7])])
        so = SchedulerOutput([NewRequest("c", 16, ([5, 7],))], CachedRequests([], set(), [], []), {"c": 3}, 3, {"a", "b"})
        h2, mm2 = torch.randn(3, 8), {"feat": torch.randn(3, 4)}
        ours.new_step_starts(so)
        theirs.new_step_starts(so)
        sids = (ours.save_outputs(h2, mm2, num_tokens_unpadded=3, num_tokens_padded=3),
                theirs.save_outputs(h2, mm2, num_tokens_unpadded=3, num_tokens_padded=3))
        got = materialized_alike(ours, theirs, sids, ["c"], "hit on a's block")
        assert torch.equal(got.hidden_states["c"], torch.cat([h[4:20], h2]))
        assert torch.equal(got.mm_outputs["feat"]["c"], torch.cat([mm["feat"][4:20], mm2["feat"]]))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_an_mm_output_named_hidden_key_is_ignored_as_vllm_omni_ignores_it(committer_factory):
    """Contract (module docstring: "an ``mm_outputs`` key named ``HIDDEN_KEY`` is ignored"): a model output that
    happens to carry the hidden-states key among its mm outputs neither replaces the hidden states that are cached
    and served, nor appears as an mm output; the drop-in returns what vllm-omni returns, also for a later hit."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        h = torch.randn(20, 8)
        mm = {VO.HIDDEN_KEY: torch.randn(20, 8), "feat": torch.randn(20, 4)}
        so = _step(view, [("a", 0, [0, 1], 20)], new=(("a", 0, [0, 1]),))
        sids = _both(ours, theirs, view, so, h, dict(mm), 20, 20)
        got = materialized_alike(ours, theirs, sids, ["a"], "HIDDEN_KEY in mm_outputs")
        assert torch.equal(got.hidden_states["a"], h) and set(got.mm_outputs) == {"feat"}
        so = _step(view, [("b", 16, [0, 3], 2)], new=(("b", 16, [0, 3]),), finished=("a",))
        h2 = torch.randn(2, 8)
        sids = _both(ours, theirs, view, so, h2, {VO.HIDDEN_KEY: torch.randn(2, 8), "feat": torch.randn(2, 4)}, 2, 2)
        got = materialized_alike(ours, theirs, sids, ["b"], "hit")
        assert torch.equal(got.hidden_states["b"], torch.cat([h[:16], h2]))
    finally:
        ours.shutdown()
        theirs.shutdown()


@pytest.fixture
def vllm_logger_standin(monkeypatch):
    """vllm-omni's ``to_payload_element`` (which both managers' materialize call for leftover mm) needs only
    ``vllm.logger.init_logger`` of vllm: where vLLM is not installed, a stand-in for that one function, removed
    again afterwards, lets the real vllm-omni function run."""
    if importlib.util.find_spec("vllm") is not None:  # the real one is here: nothing to stand in for
        yield
        return
    vllm = types.ModuleType("vllm")
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = logging.getLogger
    vllm.logger = logger_mod
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.logger", logger_mod)
    loaded = {"vllm_omni.utils", "vllm_omni.utils.mm_outputs"} & set(sys.modules)
    yield
    for name in {"vllm_omni.utils", "vllm_omni.utils.mm_outputs"} - loaded:
        sys.modules.pop(name, None)


def test_leftover_per_token_values_are_cut_to_each_requests_rows_as_vllm_omni_cuts_them(committer_factory,
                                                                                        vllm_logger_standin):
    """Contract (module docstring: values that are not per-token rows of at least 2 dimensions are leftover, cut
    per request by vllm-omni's own ``to_payload_element``): a 1-D per-token output of the step (one value per
    scheduled token, e.g. codes) comes back from materialize as each request's own slice of it, a 0-token request
    getting an empty one, and lists pass through whole; the drop-in returns exactly what vllm-omni returns."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20), ("z", 0, [4], 0), ("b", 0, [2], 4)],
                   new=(("a", 0, [0, 1]), ("z", 0, [4]), ("b", 0, [2])))
        codes = torch.arange(24)
        mm = {"feat": torch.randn(24, 6), "codes": codes, "lengths": [20, 0, 4]}
        sids = _both(ours, theirs, view, so, torch.randn(24, 8), mm, 24, 24)
        got, want = ours.materialize(sids[0], ["b", "a", "z"]), theirs.materialize(sids[1], ["b", "a", "z"])
        same(got.mm_outputs, want.mm_outputs, "leftover")
        assert torch.equal(got.mm_outputs["codes"]["a"], codes[:20])
        assert torch.equal(got.mm_outputs["codes"]["b"], codes[20:24])
        assert got.mm_outputs["codes"]["z"].numel() == 0
        assert got.mm_outputs["lengths"]["b"] == [20, 0, 4]
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_hit_of_a_request_scheduled_zero_tokens_is_served_not_lost(committer_factory):
    """Contract: a request in the batch with 0 scheduled tokens takes no write and no rows of the step (module
    docstring, ``spans``), and its prefix hit is not lost: over its first step (0 tokens) and the step that
    computes its tokens, materialize serves the hit's cached rows once, followed by the computed rows. (vllm-omni
    serves the hit rows at the 0-token step; the drop-in at the first computed step; both serve them once.)"""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        h = torch.randn(16, 8)
        sids = _both(ours, theirs, view, _step(view, [("a", 0, [0], 16)], new=(("a", 0, [0]),)), h, {}, 16, 16)
        materialized_alike(ours, theirs, sids, ["a"], "a")
        # "z" starts with a 16-token hit on a's block but is scheduled 0 tokens this step; "b" computes 4.
        so = _step(view, [("b", 0, [2], 4), ("z", 16, [0, 1], 0)], new=(("b", 0, [2]), ("z", 16, [0, 1])),
                   finished=("a",))
        sids = _both(ours, theirs, view, so, torch.randn(4, 8), {}, 4, 4)
        got, want = ours.materialize(sids[0], ["b", "z"]), theirs.materialize(sids[1], ["b", "z"])
        same(got.hidden_states["b"], want.hidden_states["b"], "b")
        served = [got.hidden_states["z"]]
        h3 = torch.randn(2, 8)
        sids = _both(ours, theirs, view, _step(view, [("z", 16, [0, 1], 2)]), h3, {}, 2, 2)
        theirs.discard_step(sids[1])
        served.append(ours.materialize(sids[0], ["z"]).hidden_states["z"])
        assert torch.equal(torch.cat(served), torch.cat([h, h3])), [tuple(t.shape) for t in served]
    finally:
        ours.shutdown()
        theirs.shutdown()


@pytest.mark.parametrize("where", ["runner", "vllm_config"])
def test_install_lets_the_manager_vllm_omnis_runner_builds_name_its_dp_replicas_cache(committer_factory, monkeypatch,
                                                                                      where):
    """Contract (``install``: rebinds vllm-omni's manager name and wraps its runner's ``_ensure_omni_prefix_cache``
    so the drop-in it builds sees the runner): after ``install()`` alone, the manager a dense model's DP replica 1
    builds, with vllm-omni's two arguments only, attaches to that replica's own cache ``<name>-dp1`` (the runner's
    ``ParallelConfig``, its own or its ``vllm_config``'s: ``runner_parallel_config``), not to the plain name that
    replica 0 writes (stop 52's mutation review: nothing pinned the ``vllm_config`` one)."""
    from omnishm.integrations.vllm_omni import install

    mixin = importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")
    monkeypatch.setattr(mixin, "OmniPrefixCacheManager", mixin.OmniPrefixCacheManager)  # restored afterwards

    def ensure(self) -> None:  # vllm-omni 0.30.0's, past its vLLM-only parts (PP group, group-spec check)
        self.omni_prefix_cache = mixin.OmniPrefixCacheManager(self._omni_prefix_cache_cfg, BatchView(16))

    monkeypatch.setattr(mixin.PrefixCacheRunnerMixin, "_ensure_omni_prefix_cache", ensure)
    base = unique_cache_name("dp")
    committer_factory(name=f"{base}-dp1")
    monkeypatch.setenv("OMNISHM_NAME", base)
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    assert install() is True
    parallel = SimpleNamespace(data_parallel_index=1)
    runner = SimpleNamespace(_omni_prefix_cache_cfg=VO.PrefixCacheConfig(num_blocks=8, block_size=16,
                                                                         staging_capacity_tokens=32, staging_depth=2))
    if where == "runner":
        runner.parallel_config = parallel
    else:
        runner.vllm_config = SimpleNamespace(parallel_config=parallel)
    mixin.PrefixCacheRunnerMixin._ensure_omni_prefix_cache(runner)
    try:
        assert isinstance(runner.omni_prefix_cache, VllmOmniPrefixCacheManager)
        assert runner.omni_prefix_cache.manager.cache == f"{base}-dp1"
    finally:
        runner.omni_prefix_cache.shutdown()


def test_a_staging_timeout_raises_vllm_omnis_staging_timeout_class(committer_factory):
    """Contract (``_errors``: omnishm's cache errors come out as vllm-omni's classes): when no staging page frees
    within ``staging_claim_timeout_s`` (every page held by a step not yet consumed), ``save_outputs`` raises
    vllm-omni's ``OmniPrefixCacheStagingTimeoutError``, the class vllm-omni's own manager raises there, not only its
    base ``OmniPrefixCacheUnmatchError``; once the held step is consumed, saves go on."""
    cfg = VO.PrefixCacheConfig(num_blocks=8, block_size=16, staging_capacity_tokens=32, staging_depth=1,
                               staging_claim_timeout_s=0.2)
    view = BatchView(16)
    ours = VllmOmniPrefixCacheManager(cfg, view, cache=committer_factory().name, autostart=False, role="writer")
    try:
        ours.new_step_starts(_step(view, [("a", 0, [0], 4)], new=(("a", 0, [0]),)))
        held = ours.save_outputs(torch.randn(4, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
        ours.new_step_starts(_step(view, [("a", 4, [0], 1)]))
        with pytest.raises(VO.OmniPrefixCacheStagingTimeoutError) as timed_out:
            ours.save_outputs(torch.randn(1, 8), {}, num_tokens_unpadded=1, num_tokens_padded=1)
        # The attributes the message names come along (review, 2026-12-06: only on __cause__ before).
        assert timed_out.value.step_id == held + 1 and f"step_id={held + 1}" in str(timed_out.value)
        ours.discard_step(held)
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="already consumed") as twice:
            ours.discard_step(held)
        assert (twice.value.req_id, twice.value.key, twice.value.step_id) == (None, None, held)
        assert not isinstance(twice.value, VO.OmniPrefixCacheStagingTimeoutError)
        ours.new_step_starts(_step(view, [("a", 5, [0], 1)]))
        ours.discard_step(ours.save_outputs(torch.randn(1, 8), {}, num_tokens_unpadded=1, num_tokens_padded=1))
    finally:
        ours.shutdown()


# Stop 52's mutation review of the drop-in (38 mutants, 30 killed by the suite): the gaps.
def test_a_discarded_step_keeps_no_snapshot_and_the_saved_table_stays_bounded(committer_factory):
    """Contract (``discard_step``: "Consume ``step_id`` without reading it"; ``_lock`` covers the saved-step
    table): a step id consumed by ``discard_step`` drops the drop-in's own record of that save (its spans and its
    leftover snapshots, which are pinned host copies on CUDA), as ``materialize`` does; an engine whose consumer
    discards every step (a stage whose outputs nobody reads back) must not keep one entry per step for the life of
    the process. A wrong id still changes nothing (the id stays consumable)."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        computed = 0
        for i in range(6):
            new = (("a", 0, [0, 1, 2, 3]),) if i == 0 else ()
            so = _step(view, [("a", computed, [0, 1, 2, 3], 4)], new=new)
            sids = _both(ours, theirs, view, so, torch.randn(4, 8),
                         {"feat": torch.randn(4, 4), "lengths": [4]}, 4, 4)
            computed += 4
            ours.discard_step(sids[0])
            theirs.discard_step(sids[1])
            assert sids[0] not in ours._saved
        assert len(ours._saved) == 0
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_one_dimensional_padded_outputs_are_leftover_as_vllm_omni_treats_them(committer_factory, vllm_logger_standin):
    """Contract (module docstring: "values that are not per-token rows of at least 2 dimensions are leftover, cut
    per request by vllm-omni's own ``to_payload_element``"): a 1-D output of the padded step's length (one value per
    padded token) is no per-token row; materialize returns for it exactly what vllm-omni returns (its
    ``to_payload_element`` over the drop-in's snapshot), for every request of the batch, and the step's 2-D
    rows are served alongside as usual."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20), ("z", 0, [4], 0)], new=(("a", 0, [0, 1]), ("z", 0, [4])))
        mm = {"feat": torch.randn(24, 6), "codes": torch.arange(24)}
        sids = _both(ours, theirs, view, so, torch.randn(24, 8), mm, 20, 24)
        got, want = ours.materialize(sids[0], ["a", "z"]), theirs.materialize(sids[1], ["a", "z"])
        same(got.mm_outputs, want.mm_outputs, "1-D padded output")
        same(got.hidden_states, want.hidden_states, "hidden")
    finally:
        ours.shutdown()
        theirs.shutdown()


@pytest.mark.parametrize("rows", [22, 27], ids=["between-n-and-padded", "past-padded"])
def test_a_2d_output_of_another_length_than_the_step_is_leftover_as_vllm_omni_treats_it(committer_factory,
                                                                                       vllm_logger_standin, rows):
    """A 2-D output whose first dimension is neither the step's token count (20) nor its padded count (24) is
    leftover, as vllm-omni's ``_is_step_token_tensor`` has it (``shape[0] in (n, padded)``): each request gets
    the whole value, never a slice served as per-token rows. MUTATION (stop 57): ``shape[0] >= n`` took such a
    value (a reference longer than the step, say) for the step's rows."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20), ("z", 0, [4], 0)], new=(("a", 0, [0, 1]), ("z", 0, [4])))
        mm = {"feat": torch.randn(24, 6), "ref": torch.randn(rows, 3)}
        sids = _both(ours, theirs, view, so, torch.randn(24, 8), mm, 20, 24)
        got, want = ours.materialize(sids[0], ["a", "z"]), theirs.materialize(sids[1], ["a", "z"])
        assert want.mm_outputs["ref"]["a"].shape == (rows, 3)  # vllm-omni: the whole value, for each request
        same(got.mm_outputs, want.mm_outputs, "2-D output of another length")
        same(got.hidden_states, want.hidden_states, "hidden")
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_the_drop_ins_shutdown_shuts_the_omnishm_manager_down(committer_factory):
    """``VllmOmniPrefixCacheManager.shutdown`` lands open writes and detaches: the omnishm manager under it is
    closed and shut down (its link stops, its writer seat frees), and a second call does nothing. MUTATION
    (stop 57): a no-op shutdown left all of that running."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20)], new=(("a", 0, [0, 1]),))
        sids = _both(ours, theirs, view, so, torch.randn(20, 8), {}, 20, 20)
        ours.discard_step(sids[0])
        theirs.discard_step(sids[1])
        ours.shutdown()
        assert ours.manager.closed and ours.manager.shut_down
        ours.shutdown()  # idempotent
        assert ours.manager.shut_down
    finally:
        ours.manager.shutdown()
        theirs.shutdown()


@pytest.mark.parametrize("case", ["ids of two types outside the step", "hidden states not a tensor",
                                  "scheduler output of another type"])
def test_the_drop_ins_bad_input_gets_a_clear_error(committer_factory, case):
    """REVIEW (stop 57): request ids of two types outside the step made the error's own message raise
    (``sorted`` of an int and a str), hidden states given as a list and a scheduler output of another type
    raised bare ``AttributeError``s."""
    from test_vllm_omni_dropin import VO

    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20)], new=(("a", 0, [0, 1]),))
        h = torch.randn(20, 8)
        if case == "scheduler output of another type":
            with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="scheduler output"):
                ours.new_step_starts(object())
            return
        ours.new_step_starts(so)
        if case == "hidden states not a tensor":
            with pytest.raises(TypeError, match="hidden_states"):
                ours.save_outputs(h.tolist(), {}, num_tokens_unpadded=20, num_tokens_padded=20)
            return
        sid = ours.save_outputs(h, {}, num_tokens_unpadded=20, num_tokens_padded=20)
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match=r"outside the save snapshot: \[5, 'q'\]"):
            ours.materialize(sid, [5, "q"])
        ours.discard_step(sid)
    finally:
        ours.shutdown()
        theirs.shutdown()
