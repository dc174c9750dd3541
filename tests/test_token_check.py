"""The writer's token check of prefix hits (``client/tokens.py``): a hit whose rows were computed for other
tokens raises on every rank, never serves them. Real committer, real shared memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from manager_helpers import BS, Part, build, expect, finished, quick_config, save, started
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheWriteLayout
from omnishm.client.tokens import _CHAIN_BASE, token_tags

PROMPT = list(range(100, 140))  # request a's tokens; position p holds 100 + p


def tags_of(tokens, first: int, count: int, known=None) -> np.ndarray:
    """The ``count x 2`` tags of positions ``first..`` of ``tokens`` (``known``: None, or one bool per token),
    computed here in plain Python from their definition (``client/tokens.py``), not with its code."""
    out = np.zeros((count, 2), dtype=np.int64)
    chain, chained = 0, True
    for p, t in enumerate(tokens[:first + count]):
        t = int(t)
        ok = 0 <= t < 1 << 32 and (known is None or bool(known[p]))
        chained = chained and ok
        if chained:
            chain = (chain + (t + 1) * pow(_CHAIN_BASE, p, 1 << 64)) % (1 << 64)
        if p >= first:
            out[p - first] = ((p + 1) << 32 | t if ok else 0,
                              (chain - (1 << 64) if chain >= 1 << 63 else chain) if chained else 0)
    return out


def save_tagged(m, parts: list[Part], tokens: dict[str, list[int] | None]) -> int:
    """``manager_helpers.save`` with each part's rows tagged with its request's tokens (None: unknown)."""
    h, mm, layout, n, pad = build(parts, BS)
    tags = np.concatenate([tags_of(tokens[p.req], p.first, p.count) if tokens.get(p.req) is not None
                           else np.zeros((p.count, 2), dtype=np.int64) for p in parts])
    layout = replace(layout, token_tags=tags)
    return m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)


def hit_event(req: str, blocks, hit: int, tokens) -> E:
    return E(K.STARTED, req, num_computed_tokens=hit, block_ids=tuple(blocks), token_ids=tokens)


def test_a_hit_on_rows_of_the_same_tokens_is_served(mgr):
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 10)], {"a": PROMPT}))
    m.new_step_starts([hit_event("b", [0, 1, 5], 8, PROMPT[:8] + [7, 7, 7])])
    sid = save_tagged(m, [Part("b", 1, [0, 1, 5], 8, 3)], {"b": PROMPT[:8] + [7, 7, 7]})
    out = m.materialize(sid, ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 1, 8, 3)) and out.num_hit_tokens["b"] == 8
    assert m.counters["token_mismatches"] == 0 and m.counters["token_checked_rows"] == 8 and m.keeps_token_tags


TEMPLATE = [1, 2, 3, 4] + PROMPT[4:]  # another prompt of the same length: other first block, same tokens after


def test_a_hit_on_rows_of_the_same_tokens_after_other_earlier_tokens_raises(mgr):
    """The chain: b's block 3 holds rows of PROMPT's tokens 4 to 7 at positions 4 to 7, but computed after
    other first tokens (two filled-in templates of one length), so they are not c's rows. The exact tags match
    there; the chains do not. c's hit on a's block 0 and b's block 3 raises, naming the chain; a hit on a's own
    blocks is served."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1]), started("b", [2, 3])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8), Part("b", 2, [2, 3], 0, 8)],
                               {"a": PROMPT, "b": TEMPLATE}))
    m.new_step_starts([hit_event("c", [0, 3, 5], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("c", 3, [0, 3, 5], 8, 1)], {"c": PROMPT})
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=r"4 of its rows were computed for other tokens \(first at position 4, slot 12 \(the "
                             r"same token there, after other earlier tokens\)\).*request='c'.*step_id=1"):
        m.materialize(sid, ["c"])
    assert m.counters["token_mismatches"] == 4 and m.counters["token_checked_rows"] == 8
    m.new_step_starts([hit_event("d", [0, 1, 6], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("d", 3, [0, 1, 6], 8, 1)], {"d": PROMPT})
    assert torch.equal(m.materialize(sid, ["d"]).hidden_states["d"], expect(1, 8, 3, 8, 1))


def test_exact_tags_without_a_chain_are_compared_alone(mgr):
    """A layout may give one exact tag a row (an integration that knows no chain): those rows' chains are
    unknown, so only their (token, position) pairs are compared, and b's block 3 passes for c's (the limit
    such an integration keeps). A hit given other tokens is still refused."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1]), started("b", [2, 3])])
    h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8), Part("b", 2, [2, 3], 0, 8)], BS)
    exact = np.concatenate([tags_of(PROMPT, 0, 8)[:, 0], tags_of(TEMPLATE, 0, 8)[:, 0]])
    m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                                  write_layout=replace(layout, token_tags=exact)))
    m.new_step_starts([hit_event("c", [0, 3, 5], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("c", 3, [0, 3, 5], 8, 1)], {"c": PROMPT})
    assert torch.equal(m.materialize(sid, ["c"]).hidden_states["c"][4:8], expect(2, 8, 3, 8, 1)[4:8])
    assert m.counters["token_checked_rows"] == 8 and m.counters["token_mismatches"] == 0
    m.new_step_starts([hit_event("e", [2, 6], 4, PROMPT[:5])])
    sid = save_tagged(m, [Part("e", 3, [2, 6], 4, 1)], {"e": PROMPT})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"first at position 0, slot 8\)"):
        m.materialize(sid, ["e"])


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
    for bad in (np.zeros(4, dtype=np.int32), np.zeros(3, dtype=np.int64), [0, 0, 0, 0], np.zeros((4, 3), np.int64),
                np.zeros((3, 2), dtype=np.int64), np.zeros((2, 2, 2), dtype=np.int64)):
        with pytest.raises(TypeError, match="token_tags"):
            m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                           write_layout=PrefixCacheWriteLayout(layout.writes, layout.slots, bad))


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
    # The first token differs, so every row of the hit was computed after other tokens (the chain).
    assert m.counters["token_mismatches"] == hit.num_computed_tokens


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
    2), so rows 6 to 11 were computed after other tokens; all those slots become absent, so an unchecked hit
    on block 2 alone raises instead of serving a's rows."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 12)], {"a": PROMPT}))
    other = list(PROMPT[:13])
    other[6], other[9] = 1, 1
    m.new_step_starts([hit_event("c", [0, 1, 2, 3], 12, other)])
    sid = save_tagged(m, [Part("c", 3, [0, 1, 2, 3], 12, 1)], {"c": other})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="6 of its rows were computed for other tokens "
                       r"\(first at position 6, slot 6\)"):
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


def test_the_check_can_be_turned_off(mgr, monkeypatch):
    """``token_check=False`` (``OMNISHM_TOKEN_CHECK=0``): the writer keeps no tags and serves what the slots hold,
    for a vLLM whose token ids it would misread; the integrations then build no tags either."""
    from omnishm.config import load_prefix_cache_config

    monkeypatch.setenv("OMNISHM_TOKEN_CHECK", "0")
    assert load_prefix_cache_config(num_blocks=16, block_size=BS).token_check is False
    m = mgr(token_check=False)
    assert not m.keeps_token_tags
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([hit_event("c", [0, 1, 3], 8, [0] * 9)])
    sid = save_tagged(m, [Part("c", 1, [0, 1, 3], 8, 1)], {"c": [0] * 9})
    assert torch.equal(m.materialize(sid, ["c"]).hidden_states["c"], expect(1, 8, 1, 8, 1))
    assert m.counters["token_checked_rows"] == 0


def test_the_hits_of_one_step_are_checked_together_and_each_refusal_names_its_own_rows(mgr, caplog):
    """Fresh-eyes review (stop 55): 256 hits checked one by one took 0.95 ms; they are compared in one pass now,
    and each wrong row is still put to its own hit: b (right) is not named, c and d each name their own count and
    first wrong position and slot (in the writer's log; c's in its error too)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2, 3])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2, 3], 0, 16)], {"a": PROMPT}))
    c_ids = PROMPT[:4] + [0] + PROMPT[5:9]
    d_ids = PROMPT[:2] + [0] * 3
    m.new_step_starts([hit_event("b", [0, 1, 2, 5], 12, PROMPT[:13]), hit_event("c", [0, 1, 6], 8, c_ids),
                       hit_event("d", [0, 7], 4, d_ids)])
    sid = save_tagged(m, [Part("b", 1, [0, 1, 2, 5], 12, 1), Part("c", 3, [0, 1, 6], 8, 1),
                          Part("d", 4, [0, 7], 4, 1)], {"b": PROMPT, "c": c_ids, "d": d_ids})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="first at position 4, slot 4"):
        m.materialize(sid, ["c"])
    logged = {r.getMessage().split("request ")[1][:3]: r.getMessage() for r in caplog.records
              if "computed for other tokens" in r.getMessage()}
    assert set(logged) == {"'c'", "'d'"}, logged
    # c differs at position 4 only, yet rows 4 to 7 were computed after another token 4 (the chain).
    assert "4 of its rows" in logged["'c'"] and "2 of its rows were computed for other tokens (first at position 2, " \
        "slot 2)" in logged["'d'"]
    assert m.counters["token_mismatches"] == 4 + 2 and m.counters["token_checked_rows"] == 12 + 8 + 4


def test_token_ids_past_2_32_or_in_a_container_numpy_cannot_read_are_unknown():
    """Fresh-eyes review (stop 55): an id of 2**32 or more reached the position half of its tag, and a pair of
    distinct (token, position) shared one (b's rows served for a's); a sparse tensor of ids raised out of the
    writer's new_step_starts. Both are unknown now: never compared."""
    from omnishm.client.tokens import hit_token_tags, token_tag

    big = np.array([(1 << 32) + 5, 5], dtype=np.int64)
    assert token_tags(big, np.array([0, 1])).tolist()[0] == 0 and token_tag((1 << 32) + 5, 0) == 0
    assert token_tag(5, 0) == tags_of([5], 0, 1)[0][0] != 0
    assert hit_token_tags(torch.tensor([1, 2, 3, 4]).to_sparse(), 4) is None


def test_exact_only_tags_replace_the_slots_earlier_chains(mgr):
    """Mutation review (stop 56): a's chained rows overwritten by x's rows given one exact tag a row: their chains
    are unknown now, not a's, so a hit with x's tokens is served (a stale chain refused x's own rows)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": PROMPT}))
    m.new_step_starts([finished("a"), started("x", [0, 1])])
    h, mm, layout, n, pad = build([Part("x", 2, [0, 1], 0, 8)], BS)
    exact = tags_of(TEMPLATE, 0, 8)[:, 0].copy()  # one exact tag a row: x's chains unknown
    m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                                  write_layout=replace(layout, token_tags=exact)))
    m.new_step_starts([finished("x"), hit_event("b", [0, 1, 2], 8, TEMPLATE[:9])])
    sid = save_tagged(m, [Part("b", 3, [0, 1, 2], 8, 1)], {"b": TEMPLATE})
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(2, 8, 3, 8, 1))
    assert m.counters["token_mismatches"] == 0 and m.counters["token_checked_rows"] == 8


def test_two_hits_of_one_prompt_on_other_blocks_are_each_checked(mgr):
    """Hits of the same prompt ids share one tags array (``tokens.hits_token_tags``); ``_same_hits`` compares
    such hits once only when they are on the same slots. c's hit, on blocks 3 and 4 that hold z's rows for other
    tokens, is checked on its own and raises; b's, on a's rows of that prompt, is served (mutation review, stop
    59: ``_same_hits`` taking the slots as equal passed every test, and served z's rows to c unchecked)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1, 2]), started("z", [3, 4])])
    m.discard_step(save_tagged(m, [Part("a", 1, [0, 1, 2], 0, 10), Part("z", 9, [3, 4], 0, 8)],
                               {"a": PROMPT, "z": [7] * 8}))
    m.new_step_starts([hit_event("b", [0, 1, 5], 8, PROMPT[:9]), hit_event("c", [3, 4, 6], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("b", 1, [0, 1, 5], 8, 1), Part("c", 1, [3, 4, 6], 8, 1)],
                      {"b": PROMPT[:9], "c": PROMPT[:9]})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="computed for other tokens"):
        m.materialize(sid, ["c"])
    m.new_step_starts([hit_event("d", [0, 1, 7], 8, PROMPT[:9])])
    sid = save_tagged(m, [Part("d", 1, [0, 1, 7], 8, 1)], {"d": PROMPT[:9]})
    assert torch.equal(m.materialize(sid, ["d"]).hidden_states["d"], expect(1, 8, 1, 8, 1))
