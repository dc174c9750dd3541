"""The writer's token check of prefix hits (``client/tokens.py``): a hit whose rows were computed for other
tokens raises on every rank, never serves them. Real committer, real shared memory."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from manager_helpers import BS, Part, build, expect, finished, quick_config, save, started
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheSchedulerAdapter, PrefixCacheWriteLayout
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.client.tokens import hit_token_tags, token_tags

PROMPT = list(range(100, 140))  # request a's tokens; position p holds 100 + p


def tags_of(tokens, first: int, count: int) -> np.ndarray:
    return token_tags(np.asarray(tokens[first:first + count], dtype=np.int64),
                      np.arange(first, first + count, dtype=np.int64))


def save_tagged(m, parts: list[Part], tokens: dict[str, list[int] | None]) -> int:
    """``manager_helpers.save`` with each part's rows tagged with its request's tokens (None: unknown)."""
    h, mm, layout, n, pad = build(parts, BS)
    tags = np.concatenate([tags_of(tokens[p.req], p.first, p.count) if tokens.get(p.req) is not None
                           else np.zeros(p.count, dtype=np.int64) for p in parts])
    layout = replace(layout, token_tags=tags)
    return m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)


def hit_event(req: str, blocks, hit: int, tokens) -> E:
    return E(K.STARTED, req, num_computed_tokens=hit, block_ids=tuple(blocks), token_ids=tokens)


def test_tags_are_distinct_for_distinct_tokens_and_positions_and_zero_only_for_unknown():
    tokens = np.repeat(np.arange(0, 300, dtype=np.int64), 300)
    positions = np.tile(np.arange(0, 300, dtype=np.int64), 300)
    tags = token_tags(tokens, positions)
    assert len(np.unique(tags)) == len(tags) and (tags != 0).all()
    assert (token_tags(np.array([-1, 5]), np.array([0, 1])) == [0, token_tags(np.array([5]), np.array([1]))[0]]).all()
    assert hit_token_tags(None, 8) is None and hit_token_tags([], 8) is None
    assert (hit_token_tags(PROMPT, 8) == tags_of(PROMPT, 0, 8)).all()
    assert len(hit_token_tags(PROMPT[:5], 8)) == 5  # ids past the ones given are not compared


def test_a_hit_on_rows_of_the_same_tokens_is_served(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 10)], {"a": PROMPT}))
    m.new_step_starts([hit_event("b", [0, 1, 5], 8, PROMPT[:8] + [7, 7, 7])])
    sid = save_tagged(m, [Part("b", 1, [0, 1, 5], 8, 3)], {"b": PROMPT[:8] + [7, 7, 7]})
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 1, 8, 3)) and out.num_hit_tokens["b"] == 8
    assert m.counters["token_mismatches"] == 0 and m.counters["token_checked_rows"] == 8


def test_a_hit_on_rows_computed_for_other_tokens_raises_and_the_slots_become_absent(mgr):
    """The fault of vLLM's priority scheduling (stop 54): vLLM hits blocks it never computed for this prompt,
    whose slots still hold an earlier request's rows. The writer raises, naming the request, the tensor, the
    step and the first wrong position, instead of serving them; the slots are absent from then on."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 10)], {"a": PROMPT}))
    other = PROMPT[:5] + [9, 9, 9]  # same first block and first token of block 1, then other tokens
    m.new_step_starts([hit_event("c", [0, 1, 5], 8, other + [1])])
    sid = save_tagged(m, [Part("c", 3, [0, 1, 5], 8, 1)], {"c": other + [1]})
    with pytest.raises(OmniPrefixCacheUnmatchError) as err:
        m.materialize(sid, ["c"])
    text = str(err.value)
    assert "'c'" in text and f"step_id={sid}" in text and "3 of its rows were computed for other tokens" in text \
        and "first at position 5, slot 5" in text, text
    assert m.counters["token_mismatches"] == 3
    # Slots 5..7 are absent now; block 0 and slot 4 kept a's rows, and a hit on block 0 alone is served.
    m.new_step_starts([hit_event("d", [0, 6], 4, PROMPT[:5])])
    sid = save_tagged(m, [Part("d", 1, [0, 6], 4, 1)], {"d": PROMPT[:5]})
    assert torch.equal(m.materialize(sid, ["d"]).hidden_states["d"], expect(1, 4, 1, 4, 1))
    m.new_step_starts([hit_event("e", [0, 1, 7], 8, PROMPT)])
    sid = save_tagged(m, [Part("e", 1, [0, 1, 7], 8, 1)], {"e": PROMPT})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        m.materialize(sid, ["e"])


def test_a_hit_on_blocks_the_same_step_computes_is_checked_against_that_steps_tokens(mgr):
    """vLLM hits blocks computed in the same step (two identical prompts scheduled together): the step's own
    tags are recorded before its hits are checked, so the hit is served, and a wrong one still raises."""
    m = mgr()
    m.new_step_starts([started("a", [3, 4])])
    m.discard_step(save_tagged(m, [Part("a", 9, [3, 4], 0, 8)], {"a": [5] * 8}))  # the slots' earlier tenant
    m.new_step_starts([started("a2", [3, 4]), hit_event("b", [3, 4, 6], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("a2", 1, [3, 4], 0, 8), Part("b", 1, [3, 4, 6], 8, 1)],
                      {"a2": PROMPT, "b": PROMPT})
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 1, 8, 1))
    m.new_step_starts([started("a3", [8, 9]), hit_event("c", [8, 9, 10], 8, [1] * 9)])
    sid = save_tagged(m, [Part("a3", 1, [8, 9], 0, 8), Part("c", 1, [8, 9, 10], 8, 1)],
                      {"a3": PROMPT, "c": [1] * 9})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="first at position 0, slot 32"):
        m.materialize(sid, ["c"])


@pytest.mark.parametrize("known", ["writer", "hit"])
def test_rows_or_hits_without_tokens_are_not_checked(mgr, known):
    """A position unknown on either side is not compared: rows saved without tags (generated tokens, an
    integration that knows no tokens) and hits that carry no token ids are served as before."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT if known == "writer" else None}))
    m.new_step_starts([hit_event("b", [0, 2], 4, [1, 2, 3, 4] if known == "hit" else None)])
    sid = save_tagged(m, [Part("b", 1, [0, 2], 4, 1)], {"b": PROMPT})
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(1, 4, 1, 4, 1))
    assert m.counters["token_mismatches"] == 0 and m.counters["token_checked_rows"] == 0


@pytest.fixture
def pair(committer):
    """A writer and a reader of the module's committer, where request a saved its 8 tagged rows (blocks 0-1)
    and the committer applied them; both shut down at teardown."""
    made = []
    try:
        w = OmniPrefixCacheManager(quick_config(), cache=committer.name, autostart=False)
        made.append(w)
        r = OmniPrefixCacheManager(quick_config(), cache=committer.name, autostart=False, role="reader")
        made.append(r)
        for m in (w, r):
            m.new_step_starts([started("a", [0, 1])])
            m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
        w.wait_idle()
        yield w, r
    finally:
        for m in reversed(made):
            m.shutdown()


def test_a_reader_raises_where_its_writer_found_other_tokens(pair):
    """Readers keep no tags: the writer makes the wrong slots absent before it publishes the step, so a
    reader's read of them raises too, never serves the rows."""
    w, r = pair
    sids = []
    for m in (w, r):
        m.new_step_starts([hit_event("c", [0, 1, 3], 8, [0] * 9)])
        sids.append(save_tagged(m, [Part("c", 3, [0, 1, 3], 8, 1)], {"c": [0] * 9}))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="computed for other tokens"):
        w.materialize(sids[0], ["c"])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows") as err:
        r.materialize(sids[1], ["c"])
    assert "'c'" in str(err.value) and f"step_id={sids[1]}" in str(err.value)


def test_a_save_only_the_writer_refuses_still_checks_the_hits_its_readers_take(pair):
    """REVIEW (stop 55): a save the writer alone refuses (a staging timeout) is burned, and the readers' save of
    the same step takes its hits; the burn took them unchecked, so the wrong slots kept their earlier tenant's
    claims and the reader served a's rows for c. The burn checks them as a save does."""
    from omnishm.client import OmniPrefixCacheStagingTimeoutError

    w, r = pair

    def timed_out(step_id, *a, **kw):
        raise OmniPrefixCacheStagingTimeoutError(f"cache {w.cache}: no free staging page (simulated)")

    for m in (w, r):
        m.new_step_starts([hit_event("c", [0, 1, 3], 8, [0] * 9)])
    real_claim, w._pages.claim = w._pages.claim, timed_out
    try:
        with pytest.raises(OmniPrefixCacheStagingTimeoutError):
            save_tagged(w, [Part("c", 3, [0, 1, 3], 8, 1)], {"c": [0] * 9})
    finally:
        w._pages.claim = real_claim
    sid = save_tagged(r, [Part("c", 3, [0, 1, 3], 8, 1)], {"c": [0] * 9})
    assert w.counters["token_mismatches"] == 8
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        r.materialize(sid, ["c"])


@pytest.mark.parametrize("odd", [[2 ** 64] * 8, [1, None] * 4, np.zeros((2, 4), dtype=np.int64)])
def test_token_ids_that_are_no_int64_list_are_not_checked_and_lose_no_event(mgr, odd):
    """REVIEW (stop 55): token ids numpy could not make int64 raised out of the writer's new_step_starts before
    any event of the step was applied (a's FINISHED lost on the writer alone, where readers compute no tags).
    Such ids are not compared: the hit is served as an unchecked one, and every other event is applied."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([finished("a"), hit_event("b", [0, 2], 4, odd)])
    assert "a" not in m._live
    sid = save_tagged(m, [Part("b", 1, [0, 2], 4, 1)], {"b": None})
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(1, 4, 1, 4, 1))
    assert m.counters["token_checked_rows"] == 0


def test_token_tags_that_are_not_one_int64_per_row_are_refused(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0])])
    h, mm, layout, n, pad = build([Part("a", 1, [0], 0, 4)], BS)
    for bad in (np.zeros(4, dtype=np.int32), np.zeros(3, dtype=np.int64), [0, 0, 0, 0]):
        with pytest.raises(TypeError, match="token_tags"):
            m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                           write_layout=PrefixCacheWriteLayout(layout.writes, layout.slots, bad))


def _batch(prompt_len, computed, token_ids, is_ids=None):
    """A V1-shaped input batch of two requests, a (blocks 0..3) and b (blocks 4..7), block size 4."""
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.array([4, 4]))
    batch = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_cpu=np.array(computed, dtype=np.int32),
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=token_ids,
                            num_prompt_tokens=np.array(prompt_len, dtype=np.int32))
    if is_ids is not None:
        batch.is_token_ids = is_ids
    return batch


def test_the_group_view_tags_prompt_tokens_given_as_ids_only():
    ids = np.arange(32, dtype=np.int32).reshape(2, 16) + 100
    view = FullAttentionGroupView(_batch([6, 10], [4, 0], ids), BS)
    # a: positions 4..7, prompt ends at 6 (6 and 7 are generated); b: positions 0..2, all prompt.
    got = view.step_token_tags_cpu([4, 3])
    want = np.concatenate([tags_of(ids[0], 4, 2), [0, 0], tags_of(ids[1], 0, 3)])
    assert got.dtype == np.int64 and (got == want).all()
    is_ids = np.ones((2, 16), dtype=bool)
    is_ids[1, 1] = False  # an embedding at b's position 1
    got = FullAttentionGroupView(_batch([6, 10], [4, 0], ids, is_ids), BS).step_token_tags_cpu([4, 3])
    assert got[5] == 0 and got[4] == want[4] and got[6] == want[6]
    assert view.step_token_tags_cpu([0, 0]) is None  # nothing to tag
    assert FullAttentionGroupView(_batch([6, 10], [6, 10], ids), BS).step_token_tags_cpu([1, 1]) is None  # decode
    no_ids = _batch([6, 10], [4, 0], ids)
    del no_ids.token_ids_cpu
    assert FullAttentionGroupView(no_ids, BS).step_token_tags_cpu([4, 3]) is None
    layout = PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 4, "b": 3})
    assert (layout.token_tags == want).all()


def test_the_adapter_gives_a_hits_token_ids_from_vllms_scheduler_output():
    """STARTED: the prompt's ids (V2: prefill_token_ids first); RESUMED (V1): ``all_token_ids``; no hit: none."""
    new = [SimpleNamespace(req_id="h", num_computed_tokens=8, block_ids=([0, 1, 2],), prompt_token_ids=PROMPT),
           SimpleNamespace(req_id="n", num_computed_tokens=0, block_ids=([3],), prompt_token_ids=[1, 2])]
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([4, 5],)],
                             num_computed_tokens=[4], all_token_ids={"r": [7] * 9})
    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                         num_scheduled_tokens={"h": 2, "n": 2, "r": 1})
    got = {ev.req_id: ev.token_ids for ev in PrefixCacheSchedulerAdapter().translate_scheduler_output(so).events}
    assert got == {"h": PROMPT, "n": None, "r": [7] * 9}
    v2 = SimpleNamespace(req_id="v", num_computed_tokens=4, block_ids=([0, 1],), prompt_token_ids=[1] * 4,
                         prefill_token_ids=[2] * 6)
    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[v2], scheduled_cached_reqs=None,
                         num_scheduled_tokens={"v": 2})
    assert PrefixCacheSchedulerAdapter().translate_scheduler_output(so).events[0].token_ids == [2] * 6
    with pytest.raises(ValueError, match="only the id"):
        E(K.FINISHED, "x", token_ids=[1])
    with pytest.raises(ValueError, match="sequence of token ids"):
        E(K.STARTED, "x", num_computed_tokens=4, block_ids=(0,), token_ids="abcd")


def test_the_simulated_engine_checks_every_hit_and_a_hit_given_other_tokens_raises(committer_factory):
    """``omnishm.sim`` tags every row and gives each hit its tokens, so the randomized tests, the demo and the
    benchmarks run with the check on (a wrong tag there fails them as a refusal). Here: hits are compared
    position by position and served, and the first hit whose event is given another first token raises."""
    from omnishm.interface import PrefixCacheConfig
    from omnishm.sim import SimEngine

    cfg = PrefixCacheConfig(num_blocks=40, block_size=16, staging_capacity_tokens=96, staging_depth=4,
                            staging_claim_timeout_s=5.0, commit_timeout_s=10.0)
    eng = SimEngine(num_blocks=40, block_size=16, max_batched_tokens=96, width=16, mm_width=4, seed=5)
    with OmniPrefixCacheManager(cfg, cache=committer_factory().name, autostart=False) as m:
        for _ in range(300):
            eng.top_up(3)
            st = eng.schedule()
            hit = next((ev for ev in st.step.events if ev.token_ids is not None), None)
            if hit is not None and m.counters["token_checked_rows"] > 500:
                wrong = replace(hit, token_ids=(hit.token_ids[0] + 1, *hit.token_ids[1:]))
                st.step = replace(st.step, events=tuple(wrong if ev is hit else ev for ev in st.step.events))
                sid = st.run(m)
                with pytest.raises(OmniPrefixCacheUnmatchError, match="first at position 0"):
                    m.materialize(sid, [hit.req_id])
                break
            sid = st.run(m)
            out = m.materialize(sid, st.layout.req_ids)
            for r in st.layout.req_ids:
                assert torch.equal(out.hidden_states[r], eng.expected(st, r))
            eng.advance(st)
        else:
            pytest.fail(f"no hit after {m.counters['token_checked_rows']} compared positions")
    assert m.counters["token_mismatches"] == 1


@pytest.mark.parametrize("prefill_row", [None, 0, 99])
def test_a_large_batch_finds_its_prompt_rows_or_none(prefill_row):
    """Batches of over 64 requests look for prompt rows with numpy first (a decode step of 1024 requests took
    169 us in the loop: review, stop 55); a batch with one prompt row anywhere still gets its tags."""
    n = 100
    table = torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)
    bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.full(n, 4))
    computed = np.full(n, 10, dtype=np.int32)
    if prefill_row is not None:
        computed[prefill_row] = 2
    ids = np.arange(n * 16, dtype=np.int32).reshape(n, 16)
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_computed_tokens_cpu=computed,
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                            num_prompt_tokens=np.full(n, 8, dtype=np.int32))
    got = FullAttentionGroupView(batch, BS).step_token_tags_cpu([1] * n)
    if prefill_row is None:
        assert got is None
    else:
        want = np.zeros(n, dtype=np.int64)
        want[prefill_row] = tags_of(ids[prefill_row], 2, 1)[0]
        assert (got == want).all()


def test_the_v2_view_tags_prompt_rows_from_the_prompts_its_mirror_kept():
    """vLLM's V2 runner keeps no CPU token ids the hooks can read: the mirror keeps each new request's prompt
    ids from its scheduler output, and the view tags the step's prompt rows from them (0 past the prompt, at
    embedding positions, and for a request whose prompt came without ids)."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    def new(rid, prompt, is_ids=None):
        return SimpleNamespace(req_id=rid, block_ids=([0, 1, 2, 3],), prompt_token_ids=prompt,
                               prompt_is_token_ids=is_ids)

    mirror = BlockIdMirror()
    mirror.update(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=None,
                                  scheduled_new_reqs=[new("a", PROMPT[:6]), new("b", [7] * 5, [True, False] * 2 + [True]),
                                                      new("c", None)],
                                  scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
    counts = np.array([4, 3, 2], dtype=np.int32)
    batch = SimpleNamespace(req_ids=["a", "b", "c"], num_scheduled_tokens=counts,
                            query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]),
                            num_computed_tokens_np=np.array([4, 0, 0], dtype=np.int32))
    got = V2StepGroupView(batch, mirror, BS).step_token_tags_cpu([4, 3, 2])
    b = tags_of([7] * 5, 0, 3)
    assert got.tolist() == [*tags_of(PROMPT, 4, 2), 0, 0, b[0], 0, b[2], 0, 0]
    mirror.update(SimpleNamespace(finished_req_ids={"a", "b"}, preempted_req_ids=None, scheduled_new_reqs=[],
                                  scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
    assert mirror.prompt("a") is None and mirror.prompt("b") is None


def test_a_hit_position_whose_id_is_unknown_is_not_compared(mgr):
    """Mutation review (stop 55): a negative id in the hit's tokens is unknown,
    never a mismatch; the rows are served and that position is not counted."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    ids = PROMPT[:9]
    ids[2] = -1
    m.new_step_starts([hit_event("b", [0, 1, 2], 8, ids)])
    sid = save_tagged(m, [Part("b", 1, [0, 1, 2], 8, 1)], {"b": PROMPT})
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(1, 8, 1, 8, 1))
    assert m.counters["token_mismatches"] == 0 and m.counters["token_checked_rows"] == 7


def test_rows_saved_without_tags_forget_the_slots_earlier_tags(mgr):
    """Mutation review (stop 55): a's tagged rows are overwritten by x's untagged ones; a
    hit on x's rows with x's tokens must be served (unknown rows are not compared), not refused as a's."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([finished("a"), started("x", [0, 1])])
    m.discard_step(save(m, [Part("x", 2, [0, 1], 0, 8)], BS))  # layout.token_tags is None
    m.new_step_starts([finished("x"), hit_event("b", [0, 1, 2], 8, [7] * 9)])
    sid = save_tagged(m, [Part("b", 2, [0, 1, 2], 8, 1)], {"b": [7] * 9})
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(2, 8, 2, 8, 1))
    assert m.counters["token_mismatches"] == 0


def test_a_refused_hit_rescues_the_rows_an_earlier_pending_read_planned(mgr):
    """Mutation review (stop 55): b's legitimate hit on a's rows is
    saved and not yet read when c's wrong hit on the same slots makes them absent; b's read still gets them."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([hit_event("b", [0, 1, 2], 8, PROMPT[:9])])
    late = save_tagged(m, [Part("b", 1, [0, 1, 2], 8, 1)], {"b": PROMPT})  # not consumed yet
    other = PROMPT[:5] + [9, 9, 9, 9]
    m.new_step_starts([hit_event("c", [0, 1, 3], 8, other)])
    sid = save_tagged(m, [Part("c", 3, [0, 1, 3], 8, 1)], {"c": other})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="computed for other tokens"):
        m.materialize(sid, ["c"])
    out = m.materialize(late, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 1, 8, 1))
    assert m.counters["cow_rescues"] > 0


def _big_batch(n_rows: int, is_ids=None):
    """Two requests of prompts of n_rows tokens, both prefilling positions 0..n_rows-1 (a step of 2*n_rows
    rows); block size 4."""
    nb = -(-n_rows // BS)
    table = torch.arange(2 * nb, dtype=torch.int32).reshape(2, nb)
    bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.array([nb, nb]))
    ids = (np.arange(2 * nb * BS, dtype=np.int32).reshape(2, nb * BS) + 1000)
    batch = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_cpu=np.array([0, 0], dtype=np.int32),
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                            num_prompt_tokens=np.array([n_rows - 10, n_rows], dtype=np.int32))
    if is_ids is not None:
        batch.is_token_ids = is_ids
    return batch, ids


@pytest.mark.parametrize("n_rows", [20, 200])  # a step of 40 rows (plain Python) and of 400 (numpy)
def test_a_steps_tags_are_alike_on_the_small_and_the_large_path(n_rows):
    """Mutation review (stop 55): both
    paths give each prompt row the tag of its (token, position), 0 for generated rows and embeddings."""
    nb = -(-n_rows // BS)
    is_ids = np.ones((2, nb * BS), dtype=bool)
    is_ids[1, 3] = False  # an embedding at b's position 3
    batch, ids = _big_batch(n_rows, is_ids)
    got = FullAttentionGroupView(batch, BS).step_token_tags_cpu([n_rows, n_rows])
    want = np.concatenate([tags_of(ids[0], 0, n_rows - 10), np.zeros(10, dtype=np.int64), tags_of(ids[1], 0, n_rows)])
    want[n_rows + 3] = 0
    assert got.dtype == np.int64 and got.shape == want.shape and (got == want).all()


def test_a_v2_request_resumed_as_new_carries_its_tokens():
    """Mutation review (stop 55): vLLM's V2 runner re-sends a preempted request as new; its RESUMED event keeps the hit's
    token ids (prefill_token_ids, else prompt_token_ids) so its hit is checked."""
    ad = PrefixCacheSchedulerAdapter()
    first = SimpleNamespace(req_id="p", num_computed_tokens=0, block_ids=([0, 1],), prompt_token_ids=[1] * 8)
    so = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[first], scheduled_cached_reqs=None,
                         num_scheduled_tokens={"p": 8})
    ad.translate_scheduler_output(so)
    back = SimpleNamespace(req_id="p", num_computed_tokens=8, block_ids=([0, 1, 2],), prompt_token_ids=[1] * 8,
                           prefill_token_ids=[1] * 8 + [5, 6])
    so = SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"p"}, scheduled_new_reqs=[back],
                         scheduled_cached_reqs=None, num_scheduled_tokens={"p": 2})
    evs = ad.translate_scheduler_output(so).events
    assert [ev.kind for ev in evs] == [K.RESUMED] and evs[0].token_ids == [1] * 8 + [5, 6]


def test_slots_a_check_made_absent_are_no_longer_known(mgr):
    """Mutation review (stop 55): a later hit on them is refused as absent rows, not
    counted again as rows computed for other tokens (token_mismatches counts each wrong row once)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    other = PROMPT[:5] + [9, 9, 9, 9]
    m.new_step_starts([hit_event("c", [0, 1, 3], 8, other)])
    sid = save_tagged(m, [Part("c", 3, [0, 1, 3], 8, 1)], {"c": other})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="computed for other tokens"):
        m.materialize(sid, ["c"])
    assert m.counters["token_mismatches"] == 3
    m.new_step_starts([hit_event("f", [0, 1, 4], 8, other)])
    sid = save_tagged(m, [Part("f", 3, [0, 1, 4], 8, 1)], {"f": other})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        m.materialize(sid, ["f"])
    assert m.counters["token_mismatches"] == 3


def test_every_wrong_slot_of_a_refused_hit_becomes_absent(mgr):
    """Mutation review (stop 55): c's hit is wrong at positions 6 and 9 (blocks 1 and
    2); both slots become absent, so an unchecked hit on block 2 alone raises instead of serving a's rows."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 12)], {"a": PROMPT}))
    other = list(PROMPT[:13])
    other[6], other[9] = 1, 1
    m.new_step_starts([hit_event("c", [0, 1, 2, 3], 12, other)])
    sid = save_tagged(m, [Part("c", 3, [0, 1, 2, 3], 12, 1)], {"c": other})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="2 of its rows were computed for other tokens"):
        m.materialize(sid, ["c"])
    m.new_step_starts([hit_event("e", [2, 5], 4, None)])
    sid = save(m, [Part("e", 4, [2, 5], 4, 1)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        m.materialize(sid, ["e"])


def test_a_refused_saves_slots_are_no_longer_known(mgr):
    """Mutation review (stop 55): z's save over a's slots is refused on the writer (a
    staging timeout), so the slots are absent and unknown; a later hit on them raises as absent rows and
    no row is counted as computed for other tokens."""
    from omnishm.client import OmniPrefixCacheStagingTimeoutError

    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([finished("a"), started("z", [0, 1])])

    def timed_out(step_id, *a, **kw):
        raise OmniPrefixCacheStagingTimeoutError(f"cache {m.cache}: no free staging page (simulated)")

    real_claim, m._pages.claim = m._pages.claim, timed_out
    try:
        with pytest.raises(OmniPrefixCacheStagingTimeoutError):
            save_tagged(m, [Part("z", 2, [0, 1], 0, 8)], {"z": [7] * 8})
    finally:
        m._pages.claim = real_claim
    m.new_step_starts([finished("z"), hit_event("b", [0, 1, 2], 8, [7] * 9)])
    sid = save_tagged(m, [Part("b", 2, [0, 1, 2], 8, 1)], {"b": [7] * 9})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent rows"):
        m.materialize(sid, ["b"])
    assert m.counters["token_mismatches"] == 0


def test_reader_ranks_tag_no_rows(committer_factory, monkeypatch):
    """Docs review (stop 55): readers keep no tags, yet every rank tagged each step (tens of microseconds a step
    on a reader's engine thread, thrown away). Only the writer's layouts carry tags: here the vllm-omni drop-in's
    writer and reader on the same simulated steps, and ``build_write_layout(token_tags=False)``, which the
    vLLM hooks and the runner mixin pass on a reader."""
    from omnishm.bench.vllm_omni_arm import InputBatch, scheduler_output
    from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager, load_prefix_cache
    from omnishm.sim import SimEngine

    tagged = {"writer": 0, "reader": 0}
    real = FullAttentionGroupView.step_token_tags_cpu
    role = []

    def counting(self, counts):
        out = real(self, counts)
        tagged[role[-1]] += 0 if out is None else len(out)
        return out

    monkeypatch.setattr(FullAttentionGroupView, "step_token_tags_cpu", counting)
    vo, _ = load_prefix_cache(standin=True)
    cfg = vo.PrefixCacheConfig(num_blocks=64, block_size=16, staging_capacity_tokens=128, staging_depth=2,
                               staging_claim_timeout_s=10.0)
    name = committer_factory().name
    eng = SimEngine(num_blocks=64, block_size=16, max_batched_tokens=128, width=16, mm_width=4, seed=3)
    batches = {r: InputBatch(16, 64, 16) for r in tagged}
    made = {r: VllmOmniPrefixCacheManager(cfg, vo.FullAttentionGroupView(batches[r], 16), cache=name,
                                          autostart=False, role=r) for r in tagged}
    try:
        for _ in range(20):
            eng.top_up(3)
            st = eng.schedule()
            blocks = {q.req_id: q.blocks for q in eng.running}
            for r, m in made.items():
                m.new_step_starts(scheduler_output(st.step))
                batches[r].update(st, blocks)
                role.append(r)
                m.materialize(m.save_outputs(st.hidden, dict(st.mm), num_tokens_unpadded=st.num_tokens,
                                             num_tokens_padded=st.num_tokens), list(st.layout.req_ids))
            eng.advance(st)
    finally:
        made["reader"].shutdown()
        made["writer"].shutdown()
    assert tagged["writer"] > 100 and tagged["reader"] == 0, tagged
    view = FullAttentionGroupView(_batch([6, 10], [4, 0], np.zeros((2, 16), dtype=np.int32)), BS)
    assert PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 4, "b": 3}, token_tags=False).token_tags is None


@pytest.mark.parametrize("view", ["v1", "v2"])
@pytest.mark.parametrize("prompt", [3, 40])  # a step of 24 short new prompts (plain Python rows), of long ones
def test_a_step_of_many_new_prompts_is_tagged_in_one_pass_alike(view, prompt):
    """Real-engine review (stop 55): a step admitting many short prompts spent 1.2-1.6 ms tagging them, one set
    of numpy calls a prompt. Over ``FEW_RUNS`` runs the tags come from one gather; they must equal each row's
    (token, position), with generated rows, embeddings and requests beside them left at 0."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    rng = np.random.default_rng(prompt)
    n = 24
    ids = rng.integers(0, 50_000, (n, 64)).astype(np.int32)
    is_ids = rng.random((n, 64)) > 0.1
    plen = rng.integers(1, prompt + 1, n).astype(np.int32)
    computed = np.where(np.arange(n) % 5 == 0, plen, 0).astype(np.int32)  # every 5th request decodes
    counts = [1 if c else int(p) for c, p in zip(computed, plen)]
    if view == "v1":
        table = torch.zeros((n, 16), dtype=torch.int32)
        bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.full(n, 16))
        batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_computed_tokens_cpu=computed,
                                block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                                num_prompt_tokens=plen, is_token_ids=is_ids)
        got = FullAttentionGroupView(batch, BS).step_token_tags_cpu(counts)
    else:
        mirror = BlockIdMirror()
        mirror.update(SimpleNamespace(
            finished_req_ids=set(), preempted_req_ids=None,
            scheduled_new_reqs=[SimpleNamespace(req_id=f"r{i}", block_ids=(list(range(16)),),
                                                prompt_token_ids=ids[i, :plen[i]].tolist(),
                                                prompt_is_token_ids=is_ids[i, :plen[i]].tolist()) for i in range(n)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
        c = np.array(counts, dtype=np.int32)
        batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_scheduled_tokens=c,
                                query_start_loc_np=np.concatenate([[0], np.cumsum(c)]), num_computed_tokens_np=computed)
        got = V2StepGroupView(batch, mirror, BS).step_token_tags_cpu(counts)
    want = []
    for i in range(n):
        for p in range(computed[i], computed[i] + counts[i]):
            known = p < plen[i] and is_ids[i, p]
            want.append(tags_of(ids[i], p, 1)[0] if known else 0)
    assert got.dtype == np.int64 and got.tolist() == want
