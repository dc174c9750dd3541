"""``omnishm.integrations.vllm_omni``: vllm-omni's runners on an omnishm cache, against vllm-omni's own cache.

The drop-in (``VllmOmniPrefixCacheManager``, over a real committer process) and vllm-omni 0.30.0's
``OmniPrefixCacheManager`` (eager, its mode without CUDA) get the same vLLM V1 scheduler outputs, the
same group view and the same outputs; every ``materialize`` must return the same structure and the
same tensors. vllm-omni is installed without its dependencies by ``scripts/install.sh``; its values
that need vllm at materialize (leftover mm) are covered by ``test_vllm_omni_dropin_paths.py`` (with a
stand-in for vllm's logger) and by the vLLM tier (``tests/vllm_tier/test_vllm_omni_runner.py``).
"""

from __future__ import annotations

import importlib
import queue
import random
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from omnishm.bench.vllm_omni_arm import BatchView, CachedRequests, NewRequest, SchedulerOutput, scheduler_output
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout
from omnishm.config import ConfigError
from omnishm.integrations import vllm_omni_plugin
from omnishm.integrations.vllm_omni import SUPPORTED, VllmOmniPrefixCacheManager, install, load_prefix_cache
from omnishm.sim import SimEngine, truth_rows

VO, VERSION = load_prefix_cache(standin=True)
assert VERSION == SUPPORTED, f"these tests compare against vllm-omni {SUPPORTED}: pip install --no-deps vllm-omni=={SUPPORTED}"


def same(a: Any, b: Any, where: str) -> None:
    """Equal structure (dict keys, list lengths, None) and bit-equal tensors of the same dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    elif isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for k in a:
            same(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def materialized_alike(ours: Any, theirs: Any, sids: tuple, req_ids: list[str], where: str) -> Any:
    """Materialize ``sids`` (ours, theirs) for ``req_ids`` in both managers; assert the same results (``same``);
    return the drop-in's."""
    got = ours.materialize(sids[0], req_ids)
    same(got, theirs.materialize(sids[1], req_ids), where)
    return got


def managers(committer, num_blocks: int, cap: int, policy: Any = None) -> tuple[Any, Any, BatchView]:
    cfg = VO.PrefixCacheConfig(num_blocks=num_blocks, block_size=16, staging_capacity_tokens=cap, staging_depth=2,
                               staging_claim_timeout_s=10.0)
    view = BatchView(16)
    theirs = VO.OmniPrefixCacheManager(cfg, view, eager=True)
    ours = VllmOmniPrefixCacheManager(cfg, view, cache=committer.name, autostart=False, role="writer")
    if policy is not None:
        theirs.register_policy(policy)
        ours.register_policy(policy)
    return ours, theirs, view


def _random_workload(committer, seed: int, consumer: "queue.Queue | None", policy: Any = None) -> Counter:
    """250 sim steps into both managers; consumed late and out of order on this thread, or, with a
    ``consumer`` queue, one step late on another thread (vllm-omni's async output thread)."""
    rng, crng = random.Random(seed), random.Random(seed + 1)
    blocks, cap = 40, 96
    eng = SimEngine(num_blocks=blocks, block_size=16, max_batched_tokens=cap, width=16, mm_width=4, seed=seed,
                    abort_rate=0.1)
    ours, theirs, view = managers(committer, blocks, cap, policy)
    stats: Counter = Counter()
    pending: list = []

    def consume(item: tuple) -> None:
        sid, their_sid, st, resumed = item
        reqs = [r for r in st.layout.req_ids if crng.random() < 0.9]
        got, want = ours.materialize(sid, reqs), theirs.materialize(their_sid, reqs)
        same(got.hidden_states, want.hidden_states, f"step {sid} hidden")
        same(got.mm_outputs, want.mm_outputs, f"step {sid} mm")
        for r in reqs:
            hit, first, count = st.positions[r]
            hs = st.hashes[r]
            # A resumed request gets this step's rows only, as vllm-omni serves it.
            keep = hs[first:first + count] if r in resumed else hs[:hit] + hs[first:first + count]
            if got.hidden_states is not None:
                assert torch.equal(got.hidden_states[r], truth_rows(keep, 16)), (sid, r, st.positions[r])
            assert torch.equal(got.mm_outputs["mm_feat"][r], truth_rows(keep, 4, salt=0x5A5A)), (sid, r)
            stats["rows"] += len(keep)
            stats["hit_tokens"] += 0 if r in resumed else hit

    errors: list[BaseException] = []

    def drain() -> None:
        while (item := consumer.get()) is not None:
            if errors:
                continue  # keep taking items, so the engine thread's put never blocks on a dead consumer
            try:
                consume(item)
            except BaseException as exc:  # handed to the test thread, which raises it
                errors.append(exc)

    thread = threading.Thread(target=drain, daemon=True) if consumer is not None else None
    try:
        if thread is not None:
            thread.start()
        for _ in range(250):
            eng.top_up(3)
            st = eng.schedule()
            so = scheduler_output(st.step)
            resumed = {ev.req_id for ev in st.step.events if ev.kind is K.RESUMED}
            stats["resumed"] += len(resumed)
            ours.new_step_starts(so)
            theirs.new_step_starts(so)
            view.set_step(st.layout)
            kw = dict(num_tokens_unpadded=st.num_tokens, num_tokens_padded=st.num_tokens)
            item = (ours.save_outputs(st.hidden, dict(st.mm), **kw), theirs.save_outputs(st.hidden, dict(st.mm), **kw),
                    st, resumed)
            eng.advance(st)
            if consumer is not None:
                consumer.put(item)
                assert not errors, errors
                continue
            pending.append(item)
            while pending and (len(pending) >= 2 or rng.random() < 0.5):  # staging_depth 2: late, out of order
                consume(pending.pop(rng.randrange(len(pending))))
        while pending:
            consume(pending.pop())
    finally:
        if thread is not None:
            consumer.put(None)
            thread.join(60)
        ours.shutdown()
        theirs.shutdown()
    if errors:
        raise errors[0]
    print(f"\nvllm-omni drop-in: {stats['rows']} rows, {stats['hit_tokens']} hit tokens, {stats['resumed']} resumes, "
          f"{eng.alloc.reuses} block reuses")
    assert stats["rows"] > 10_000 and stats["hit_tokens"] > 1_000
    assert stats["resumed"] > 0 and eng.alloc.reuses > 50
    return stats


def test_random_workload_with_preemption_same_outputs_as_vllm_omni(committer):
    """Hits, same-step hits, chunked prefill, aborts, preemption and block reuse; materialize late, in any order."""
    _random_workload(committer, 5, None)


def test_talker_policy_deferred_mm_and_no_hidden_states(committer_factory):
    """vllm-omni's talkers: hidden states not cached, their audio codes written when a request ends."""
    policy = VO.ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"mm_feat"}))
    _random_workload(committer_factory(), 9, None, policy)


def test_materialize_on_another_thread_one_step_late(committer_factory):
    """vllm-omni's async output thread materializes step N while the engine thread saves step N+1."""
    _random_workload(committer_factory(), 7, queue.Queue(maxsize=1))


def _step(view: BatchView, batch: list[tuple[str, int, list[int], int]], *, new: tuple = (),
          finished: tuple = ()) -> SchedulerOutput:
    """batch: (req, first position, blocks, count); ``new``: (req, hit, blocks) started this step."""
    writes, slots, start = [], [], 0
    for req, first, blk, count in batch:
        if count:
            writes.append(PrefixCacheWrite(req, start, count))
            pos = torch.arange(first, first + count)
            slots.append(torch.tensor(blk)[pos // 16] * 16 + pos % 16)
            start += count
    view.set_step(PrefixCacheWriteLayout(tuple(writes), torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)))
    view.req_ids = [b[0] for b in batch]  # 0-token requests stay in the batch order
    counts = {b[0]: b[3] for b in batch}
    running = [b for b in batch if b[0] not in {n[0] for n in new}]
    return SchedulerOutput([NewRequest(r, hit, (list(blk),)) for r, hit, blk in new],
                           CachedRequests([b[0] for b in running], set(), [None] * len(running),
                                          [b[1] for b in running]),
                           counts, sum(counts.values()), set(finished))


def _both(ours: Any, theirs: Any, view: BatchView, so: SchedulerOutput, hidden: torch.Tensor | None,
          mm: dict, n: int, padded: int) -> tuple[Any, Any]:
    ours.new_step_starts(so)
    theirs.new_step_starts(so)
    return (ours.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded),
            theirs.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded))


def test_padded_steps_zero_token_requests_and_hits_match_vllm_omni(committer_factory):
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        a_blocks, b_blocks = [0, 1], [2, 3]
        # Step 1: "a" prefills 20 tokens, "z" is in the batch with 0 tokens; hidden and mm padded to 24 rows.
        h = torch.randn(24, 8)
        mm = {"feat": torch.randn(24, 6), "codes": torch.arange(20.0).reshape(20, 1)}  # codes: unpadded
        so = _step(view, [("a", 0, a_blocks, 20), ("z", 0, [4], 0)], new=(("a", 0, a_blocks), ("z", 0, [4])))
        sids = _both(ours, theirs, view, so, h, mm, 20, 24)
        got = materialized_alike(ours, theirs, sids, ["a", "z"], "padded step")
        assert got.hidden_states["z"].shape == (0, 8) and got.mm_outputs["feat"]["a"].shape == (20, 6)
        # Step 2: "a" finishes; "b" hits a's first block (16 tokens) and computes 4 more.
        so = _step(view, [("b", 16, [0] + b_blocks[1:], 4)], new=(("b", 16, [0, 3]),), finished=("a",))
        h2 = torch.randn(4, 8)
        mm2 = {"feat": torch.randn(4, 6), "codes": torch.arange(4.0).reshape(4, 1)}
        sids = _both(ours, theirs, view, so, h2, mm2, 4, 4)
        got = materialized_alike(ours, theirs, sids, ["b"], "hit")
        assert torch.equal(got.hidden_states["b"], torch.cat([h[:16], h2]))
        # Unknown and consumed step ids raise vllm-omni's own error class.
        with pytest.raises(VO.OmniPrefixCacheUnmatchError):
            ours.materialize(sids[0], ["b"])
        with pytest.raises(VO.OmniPrefixCacheUnmatchError):
            ours.discard_step(999)
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_zero_token_request_first_in_the_batch_shifts_no_rows(committer_factory):
    """MUTATION (2026-12-06): pins that a 0-token request takes no rows of the step's outputs, also first in
    the batch: the save is taken, materialize matches vllm-omni's, and a later hit serves the rows written.
    The mutant (``start += max(counts[r], 1)``) started every later request's write one row late; omnishm
    refuses a layout whose writes are not contiguous from row 0, so it refused the save of this legitimate batch."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        h, mm = torch.randn(20, 8), {"feat": torch.randn(20, 6)}
        so = _step(view, [("z", 0, [4], 0), ("a", 0, [0, 1], 20)], new=(("z", 0, [4]), ("a", 0, [0, 1])))
        sids = _both(ours, theirs, view, so, h, mm, 20, 20)
        got = materialized_alike(ours, theirs, sids, ["z", "a"], "zero-token request first")
        assert torch.equal(got.hidden_states["a"], h) and got.hidden_states["z"].shape == (0, 8)
        # "b" hits a's first block: the rows landed at a's slots
        so = _step(view, [("b", 16, [0, 3], 4)], new=(("b", 16, [0, 3]),), finished=("a", "z"))
        h2 = torch.randn(4, 8)
        sids = _both(ours, theirs, view, so, h2, {"feat": torch.randn(4, 6)}, 4, 4)
        got = materialized_alike(ours, theirs, sids, ["b"], "hit after a zero-token request")
        assert torch.equal(got.hidden_states["b"], torch.cat([h[:16], h2]))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_leftover_mm_spans_are_each_requests_rows_in_batch_order(committer_factory):
    """MUTATION (2026-12-06): pins the (start, count) span per request that the drop-in keeps for the mm
    outputs it cannot save as rows ("leftover"), which its materialize slices with vllm-omni's
    ``to_payload_element``. That function imports vLLM, so nothing observable is reachable without vLLM
    (the vLLM tier compares the values): this test reads the drop-in's internal ``_saved[...].spans``.
    The mutant (``spans[r] = (start + 1, count)``) sliced every request's leftover values one row late."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        so = _step(view, [("a", 0, [0, 1], 20), ("z", 0, [4], 0), ("b", 0, [2], 4)],
                   new=(("a", 0, [0, 1]), ("z", 0, [4]), ("b", 0, [2])))
        ours.new_step_starts(so)
        sid = ours.save_outputs(torch.randn(24, 8), {"feat": torch.randn(24, 6), "lengths": [20, 0, 4]},
                                num_tokens_unpadded=24, num_tokens_padded=24)
        assert ours._saved[sid].spans == {"a": (0, 20), "z": (20, 0), "b": (20, 4)}
        assert list(ours._saved[sid].leftover) == ["lengths"]
        ours.discard_step(sid)
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_hidden_buffer_longer_than_the_padded_step_is_cut_to_the_steps_rows(committer_factory):
    """MUTATION (2026-12-06): pins that the drop-in passes only the step's ``num_tokens_unpadded`` rows of
    ``hidden_states`` on (a runner may hand its whole preallocated buffer, longer than the padded step), as
    vllm-omni does. The mutant (``hidden_states`` passed uncut) had omnishm refuse the save."""
    ours, theirs, view = managers(committer_factory(), 16, 64)
    try:
        h = torch.randn(32, 8)
        so = _step(view, [("a", 0, [0, 1], 20)], new=(("a", 0, [0, 1]),))
        sids = _both(ours, theirs, view, so, h, {}, 20, 24)
        got = materialized_alike(ours, theirs, sids, ["a"], "long hidden buffer")
        assert torch.equal(got.hidden_states["a"], h[:20])
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_leftover_snapshots_are_contiguous_detached_copies_as_vllm_omnis_are():
    """Review (2026-12-06): vllm-omni's ``_snapshot_leftover_mm_cpu`` makes every leftover tensor contiguous;
    the drop-in cloned them with their strides, so a per-request tensor made by a transpose came out of
    materialize non-contiguous, and a consumer's ``.view(-1)`` that works on vllm-omni's result raised.
    (Materialize hands the snapshots to vllm-omni's ``to_payload_element``, which needs vllm: the vLLM
    tier runs that part.)"""
    from omnishm.integrations.vllm_omni import _snapshot

    per_req = torch.randn(4, 2).t()
    grad = torch.randn(3, 2, requires_grad=True).t()
    values = {"per_req": per_req, "nested": {"lst": [torch.randn(3, 2).t()], "tup": (grad, "codes")}, "n": None}
    out, event = _snapshot(values)
    assert event is None
    got = [out["per_req"], out["nested"]["lst"][0], out["nested"]["tup"][0]]
    for want, t in zip([per_req, values["nested"]["lst"][0], grad], got):
        assert t.is_contiguous() and not t.requires_grad and torch.equal(t, want.detach())
        assert t.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()  # a copy, not a view
        t.view(-1)
    assert out["nested"]["tup"][1] == "codes" and out["n"] is None


def test_hidden_opt_out_gives_none_as_vllm_omni_does(committer_factory):
    policy = VO.ModelCachePolicy(needs_full_hidden_states=False)
    ours, theirs, view = managers(committer_factory(), 8, 32, policy)
    try:
        so = _step(view, [("a", 0, [0, 1], 18)], new=(("a", 0, [0, 1]),))
        sids = _both(ours, theirs, view, so, torch.randn(18, 8), {"feat": torch.randn(18, 4)}, 18, 18)
        got, want = ours.materialize(sids[0], ["a"]), theirs.materialize(sids[1], ["a"])
        assert got.hidden_states is None and want.hidden_states is None
        same(got.mm_outputs, want.mm_outputs, "opt-out mm")
        # A request outside the save snapshot raises vllm-omni's class; the step is still there to consume.
        sids = _both(ours, theirs, view, _step(view, [("a", 18, [0, 1], 1)]), torch.randn(1, 8),
                     {"feat": torch.randn(1, 4)}, 1, 1)
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="outside the save snapshot"):
            ours.materialize(sids[0], ["nope"])
        ours.discard_step(sids[0])
        theirs.discard_step(sids[1])
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_install_makes_vllm_omnis_runner_build_the_dropin(monkeypatch):
    mixin = importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")
    monkeypatch.setattr(mixin, "OmniPrefixCacheManager", mixin.OmniPrefixCacheManager)  # restored afterwards
    monkeypatch.setattr(mixin.PrefixCacheRunnerMixin, "_ensure_omni_prefix_cache",
                        mixin.PrefixCacheRunnerMixin._ensure_omni_prefix_cache)
    monkeypatch.delenv("OMNISHM_VLLM_OMNI", raising=False)
    vllm_omni_plugin()  # the vLLM plugin entry point: nothing without OMNISHM_VLLM_OMNI
    assert mixin.OmniPrefixCacheManager is VO.OmniPrefixCacheManager
    monkeypatch.setenv("OMNISHM_VLLM_OMNI", "1")
    vllm_omni_plugin()
    assert mixin.OmniPrefixCacheManager is VllmOmniPrefixCacheManager
    assert install() is True and mixin.OmniPrefixCacheManager is VllmOmniPrefixCacheManager
    monkeypatch.setenv("OMNISHM_VLLM_OMNI", "maybe")
    with pytest.raises(ConfigError, match="OMNISHM_VLLM_OMNI"):
        vllm_omni_plugin()
    # It runs in every vLLM process: a bad value of another knob is not its to refuse.
    monkeypatch.delenv("OMNISHM_VLLM_OMNI")
    monkeypatch.setenv("OMNISHM_STAGING_DEPTH", "abc")
    vllm_omni_plugin()


def test_the_manager_vllm_omni_builds_sees_its_runner_for_the_dp_replica_name():
    """``install`` wraps vllm-omni's ``_ensure_omni_prefix_cache`` once; while it runs, the drop-in reads the
    runner's ``ParallelConfig`` (a dense model's DP replica 1: ``<name>-dp1``), and afterwards no runner is set,
    also when the method raised."""
    from types import SimpleNamespace

    from omnishm.client.runner_mixin import runner_parallel_config
    from omnishm.integrations import vllm_omni as dropin

    seen: list[Any] = []

    class Mixin:
        def _ensure_omni_prefix_cache(self) -> None:
            seen.append(runner_parallel_config(dropin._BUILDING.get()))
            if getattr(self, "fail", False):
                raise RuntimeError("gate refused")

    dropin._expose_runner(Mixin)
    wrapped = Mixin._ensure_omni_prefix_cache
    dropin._expose_runner(Mixin)
    assert Mixin._ensure_omni_prefix_cache is wrapped  # idempotent
    runner = Mixin()
    runner.parallel_config = SimpleNamespace(data_parallel_index=1)
    runner._ensure_omni_prefix_cache()
    assert seen[-1] is runner.parallel_config and dropin._BUILDING.get() is None
    runner.fail = True
    with pytest.raises(RuntimeError, match="gate refused"):
        runner._ensure_omni_prefix_cache()
    assert dropin._BUILDING.get() is None
    from omnishm.client.runner_mixin import replica_cache_name

    assert replica_cache_name("talker", parallel_config=seen[-1]) == "talker-dp1"


def test_where_vllm_omni_serves_zeros_or_a_short_prefix_the_dropin_raises(committer_factory):
    ours, theirs, view = managers(committer_factory(), 8, 32)
    try:
        # "a" writes 16 rows of hidden states only; "feat" appears from step 2 on.
        so = _step(view, [("a", 0, [0], 16)], new=(("a", 0, [0]),))
        h = torch.randn(16, 8)
        sids = _both(ours, theirs, view, so, h, {}, 16, 16)
        ours.discard_step(sids[0])
        theirs.discard_step(sids[1])
        # "b" hits a's block; its "feat" rows behind the hit were never written.
        so = _step(view, [("b", 16, [0, 1], 2)], new=(("b", 16, [0, 1]),), finished=("a",))
        sids = _both(ours, theirs, view, so, torch.randn(2, 8), {"feat": torch.randn(2, 4)}, 2, 2)
        want = theirs.materialize(sids[1], ["b"])
        assert torch.equal(want.mm_outputs["feat"]["b"][:16], torch.zeros(16, 4))  # vllm-omni: zeros
        with pytest.raises(VO.OmniPrefixCacheUnmatchError) as err:
            ours.materialize(sids[0], ["b"])
        assert "request='b'" in str(err.value) and "tensor='feat'" in str(err.value), err.value
        # A hit of 32 tokens that carries one block id: vllm-omni shortens it, the drop-in refuses it.
        so = _step(view, [("c", 32, [0, 1, 2], 1)], new=(("c", 32, [0]),), finished=("b",))
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="block ids"):
            ours.new_step_starts(so)
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_negative_span_and_a_malformed_output_are_what_vllm_omni_makes_of_them(committer_factory):
    """vLLM can schedule a negative span (vllm-omni's runner then skips the step after new_step_starts)."""
    ours, theirs, view = managers(committer_factory(), 8, 32)
    try:
        so = _step(view, [("a", 0, [0], 4)], new=(("a", 0, [0]),))
        so.num_scheduled_tokens = {"a": -1}
        ours.new_step_starts(so)
        theirs.new_step_starts(so)
        so = _step(view, [("a", 0, [0], 4)])
        sids = _both(ours, theirs, view, so, torch.randn(4, 8), {}, 4, 4)
        materialized_alike(ours, theirs, sids, ["a"], "after a negative span")
        bad = _step(view, [("b", 0, [1], 2)], new=(("b", 0, [1]),))
        bad.scheduled_cached_reqs.req_ids.append("a")  # one list longer than the others
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="scheduler output"):
            ours.new_step_starts(bad)
    finally:
        ours.shutdown()
        theirs.shutdown()


@pytest.mark.parametrize("case", ["short hidden states", "row count off", "num_tokens_unpadded",
                                  "num_tokens_padded"])
def test_a_save_the_dropin_refuses_leaves_its_slots_absent(committer_factory, case):
    """A review (2026-12-04): the drop-in refused short hidden states itself, before omnishm's save, so the
    refused step's slots kept their previous tenant's claims and a hit on them served its rows; and when n
    disagreed with the scheduled counts, only n of the slots were cleared, though all are this step's.
    REVIEW (stop 57): so did its own ``int(None)`` of a token count; omnishm's save now refuses it by name,
    taking the step id."""
    ours, theirs, view = managers(committer_factory(), 8, 64)
    try:
        ours.new_step_starts(_step(view, [("z", 0, [0], 16), ("y", 0, [1], 16)], new=(("z", 0, [0]), ("y", 0, [1]))))
        ours.discard_step(ours.save_outputs(torch.randn(32, 8), {}, num_tokens_unpadded=32, num_tokens_padded=32))
        ours.manager.wait_idle()
        ours.new_step_starts(_step(view, [("a", 0, [0], 16), ("b", 0, [1], 16)], new=(("a", 0, [0]), ("b", 0, [1])),
                                   finished=("z", "y")))
        hidden, n, padded, err, says = {
            "short hidden states": (torch.randn(8, 8), 32, 32, VO.OmniPrefixCacheUnmatchError, "hidden_states has"),
            "row count off": (torch.randn(32, 8), 16, 32, VO.OmniPrefixCacheUnmatchError, "token accounting"),
            "num_tokens_unpadded": (torch.randn(32, 8), None, 32, TypeError, "num_tokens_unpadded must be an int"),
            "num_tokens_padded": (torch.randn(32, 8), 32, None, TypeError, "num_tokens_padded must be an int"),
        }[case]
        before = ours.manager._next_step
        with pytest.raises(err, match=says):
            ours.save_outputs(hidden, {}, num_tokens_unpadded=n, num_tokens_padded=padded)
        assert ours.manager._next_step == before + 1  # the refusal took its step id
        ours.new_step_starts(_step(view, [("c", 16, [1, 2], 2)], new=(("c", 16, [1, 2]),)))
        sid = ours.save_outputs(torch.randn(2, 8), {}, num_tokens_unpadded=2, num_tokens_padded=2)
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="absent"):
            ours.materialize(sid, ["c"])
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_an_interrupt_in_the_dropins_save_before_omnishms_turns_the_cache_sticky(committer_factory, monkeypatch):
    """REVIEW (stop 58): a signal handler's exception raised in the drop-in's ``save_outputs`` before omnishm's
    (here as it snapshots the leftover outputs) left the step's slots under their previous tenant's claims and
    the cache usable. Now the next call raises the sticky error."""
    from helpers import interrupt_once
    from omnishm.integrations import vllm_omni as dropin_module

    ours, theirs, view = managers(committer_factory(), 8, 64)
    try:
        ours.new_step_starts(_step(view, [("a", 0, [0], 16)], new=(("a", 0, [0]),)))
        interrupt_once(monkeypatch, dropin_module, "_snapshot")
        with pytest.raises(KeyboardInterrupt):
            ours.save_outputs(torch.randn(16, 8), {}, num_tokens_unpadded=16, num_tokens_padded=16)
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="save_outputs was cut short by KeyboardInterrupt"):
            ours.new_step_starts(_step(view, [("b", 0, [1], 16)], new=(("b", 0, [1]),), finished=("a",)))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_an_exception_in_the_dropins_save_before_omnishms_turns_the_cache_sticky(committer_factory, monkeypatch):
    """REVIEW (stop 58): the drop-in's own code raising before omnishm's save (a leftover's clone out of memory,
    here) took no step id and left the slots under their previous tenant's claims: c's hit on block 1 was
    served y's rows. Now the cache turns sticky (``note_unsaved_step``)."""
    from omnishm.integrations import vllm_omni as dropin_module

    ours, theirs, view = managers(committer_factory(), 8, 64)
    try:
        ours.new_step_starts(_step(view, [("y", 0, [1], 16)], new=(("y", 0, [1]),)))
        ours.discard_step(ours.save_outputs(torch.randn(16, 8), {}, num_tokens_unpadded=16, num_tokens_padded=16))
        ours.new_step_starts(_step(view, [("b", 0, [1], 16)], new=(("b", 0, [1]),), finished=("y",)))

        def out_of_memory(_leftover):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(dropin_module, "_snapshot", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            ours.save_outputs(torch.randn(16, 8), {}, num_tokens_unpadded=16, num_tokens_padded=16)
        monkeypatch.undo()
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match=r"step not saved \(sticky; .*save_outputs ended in "
                                                                  r"RuntimeError"):
            ours.new_step_starts(_step(view, [("c", 16, [1, 2], 2)], new=(("c", 16, [1, 2]),), finished=("b",)))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_one_dimensional_hidden_states_are_refused_and_leave_the_key_alone(committer_factory):
    """vllm-omni refuses them; after a refactor the drop-in passed them on, and the cache then held the
    hidden states at width 1, refusing every later save."""
    ours, theirs, view = managers(committer_factory(), 8, 64)
    try:
        ours.new_step_starts(_step(view, [("a", 0, [0], 16)], new=(("a", 0, [0]),)))
        with pytest.raises(VO.OmniPrefixCacheUnmatchError, match="hidden_states has shape"):
            ours.save_outputs(torch.randn(16), {}, num_tokens_unpadded=16, num_tokens_padded=16)
        ours.new_step_starts(_step(view, [("b", 0, [1], 16)], new=(("b", 0, [1]),), finished=("a",)))
        ours.discard_step(ours.save_outputs(torch.randn(16, 8), {}, num_tokens_unpadded=16, num_tokens_padded=16))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_block_table_of_another_block_size_than_the_caches_is_refused_not_handed_to_vllm_omnis_view(committer):
    """REVIEW (2026-12-05, slot mapping): omnishm's group view refuses a block table whose block size is not
    the cache's, and the drop-in took that refusal for a layout only vllm-omni's view reads: it fell back to
    that view, which does not check, and saved 16-token blocks' rows at the slots of 32-token blocks (a real
    vLLM table: vLLM's slots 112..127, 48..63, 144..151; the drop-in's 224..255, 96..103)."""
    from types import SimpleNamespace

    from omnishm.client.group_view import PrefixCacheConfigError

    table = SimpleNamespace(block_size=16, block_table=SimpleNamespace(cpu=torch.zeros(4, 16, dtype=torch.int32)))
    batch = SimpleNamespace(req_ids=["a"], req_id_to_index={"a": 0}, block_table=SimpleNamespace(block_tables=[table]))
    view = SimpleNamespace(_input_batch=batch, block_size=32)
    cfg = VO.PrefixCacheConfig(num_blocks=64, block_size=32, staging_capacity_tokens=128, staging_depth=2)
    with pytest.raises(PrefixCacheConfigError, match="uses block_size 16, the cache uses 32"):
        VllmOmniPrefixCacheManager(cfg, view, cache=committer.name, autostart=False, role="writer")


def test_the_dropin_refuses_a_stage_omnishms_gate_refuses(committer):
    """REVIEW (2026-12-05, slot mapping): vllm-omni's own gate lets KV-sharing fast prefill through (a prompt
    token's final hidden state is then computed only where logits are: every cached hidden row but those
    would be wrong). The drop-in runs omnishm's gate on the runner that builds it, as omnishm's runners do."""
    from types import SimpleNamespace

    from omnishm.client.group_view import PrefixCacheConfigError
    from omnishm.integrations import vllm_omni as dropin

    cfg = VO.PrefixCacheConfig(num_blocks=64, block_size=16, staging_capacity_tokens=128, staging_depth=2)
    spec = SimpleNamespace(block_size=16)
    kv = SimpleNamespace(num_blocks=64, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])])

    def runner(**cache):
        cache_config = SimpleNamespace(enable_prefix_caching=True, block_size=16, **cache)
        return SimpleNamespace(kv_cache_config=kv, vllm_config=SimpleNamespace(
            cache_config=cache_config, kv_transfer_config=None, scheduler_config=None, model_config=None,
            speculative_config=None, parallel_config=SimpleNamespace(decode_context_parallel_size=1)))

    token = dropin._BUILDING.set(runner(kv_sharing_fast_prefill=True))
    try:
        # Naming the cache (review, 2026-12-07): each stage of a pipeline has its own, and one refusal names it.
        with pytest.raises(PrefixCacheConfigError, match=f"omni prefix cache: cache {committer.name}: .*"
                                                         "kv_sharing_fast_prefill"):
            VllmOmniPrefixCacheManager(cfg, BatchView(16), cache=committer.name, autostart=False, role="writer")
    finally:
        dropin._BUILDING.reset(token)
