"""The token check's chain (``client/tokens.py``): every path's chains against the definition (computed in plain
Python by ``test_token_check.tags_of``), the writer's ``PromptChains`` that lets a run continuing a prompt start
where its request's tags got to, and the integrations that hand it to their views. The tags' exact part and the
views' other duties are in ``test_token_tags.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import test_runner_mixin as trm
import test_vllm_hooks as tvh
from manager_helpers import BS, Part, quick_config, started
from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
from omnishm.client import tokens as tok
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheSchedulerAdapter
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.client.tokens import hit_token_tags, row_tags
from test_token_check import PROMPT, hit_event, save_tagged, tags_of
from test_token_tags import _batch, _hooks, _ids, _new, _so, dropin_parts


# the chain: every path sums the prompt from position 0 ----------------------------------------------

@pytest.mark.parametrize("shape", ["small", "large", "many"])
def test_a_run_that_continues_a_prompt_chains_from_position_0_on_every_path(shape):
    """A chunk of a prompt (positions from ``num_computed``) gets the chains of the whole prompt up to each row,
    on the plain-Python path (at most 256 rows), the numpy path (more) and the many-runs gather; an id vLLM
    cannot know (an embedding) before the chunk leaves the chunk's rows without a chain, but with their tags."""
    n, plen, first, count = {"small": (2, 40, 12, 20), "large": (2, 600, 100, 300), "many": (12, 40, 9, 20)}[shape]
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 50_000, (n, plen)).astype(np.int32)
    is_ids = np.ones((n, plen), dtype=bool)
    is_ids[1, 3] = False  # request 1: an embedding before its chunk
    nb = -(-plen // BS)
    table = torch.arange(n * nb, dtype=torch.int32).reshape(n, nb)
    bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.full(n, nb))
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_computed_tokens_cpu=np.full(n, first, np.int32),
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                            num_prompt_tokens=np.full(n, plen, dtype=np.int32), is_token_ids=is_ids)
    got = FullAttentionGroupView(batch, BS).step_token_tags_cpu([count] * n)
    want = np.concatenate([tags_of(ids[i], first, count, known=is_ids[i]) for i in range(n)])
    assert (got == want).all()
    assert (got[count:2 * count, 1] == 0).all() and (got[count:2 * count, 0] != 0).all()
    assert (got[:count, 1] != 0).all()


def test_an_unknown_id_before_a_run_leaves_it_without_a_chain_and_ids_past_2_32_too():
    """``row_tags``: a negative id or one of 2**32 or more before the run (or in it) ends the chain there; the
    rows' exact tags stay known where their own id is."""
    prompt = [5, -1, 7, 8, 9, 10]
    got = row_tags(4, [(0, 2, prompt, None, None)])
    assert got[:, 1].tolist() == [0] * 4 and got[:, 0].tolist() == tags_of(prompt, 2, 4)[:, 0].tolist() != [0] * 4
    big = [5, 6, 1 << 32, 8]
    got = row_tags(4, [(0, 0, big, None, None)])
    assert got[:2, 1].all() and got[2:].tolist() == [[0, 0], [got[3, 0], 0]] and got[3, 0]
    assert (got == tags_of(big, 0, 4)).all()


def test_chains_tell_prefixes_apart_that_differ_at_one_position_and_are_alike_after():
    """Two filled-in templates of one length: alike from position 4 on, so their exact tags are alike there and
    their chains are not, at every position after the difference; alike prompts have alike chains."""
    a = hit_token_tags(PROMPT, 40)
    b = hit_token_tags([1, 2, 3, 4] + PROMPT[4:], 40)
    assert (a[4:, 0] == b[4:, 0]).all() and (a[:, 1] != b[:, 1]).all()
    assert (hit_token_tags(list(PROMPT), 40) == a).all() and (tok.prefix_chains(np.array(PROMPT)) == a[:, 1]).all()
    for p in range(40):  # one token other than PROMPT's at position p: every chain from p on differs
        c = list(PROMPT)
        c[p] += 1
        chains = hit_token_tags(c, 40)[:, 1]
        assert (chains[:p] == a[:p, 1]).all() and (chains[p:] != a[p:, 1]).all()


def test_the_v2_mirror_makes_a_prompt_an_array_once_and_drops_ids_that_are_no_integers():
    from omnishm.client.v2_view import BlockIdMirror

    m = BlockIdMirror()
    m.update(_so([_new("a", [1, 2, 3]), _new("f", [1.0, 2.0]), _new("s", ["x", "y"])]))
    first = m.prompt("a")
    assert isinstance(first[0], np.ndarray) and first[0].dtype == np.int64 and first[0].tolist() == [1, 2, 3]
    assert m.prompt("a")[0] is first[0]  # kept as an array
    assert m.prompt("f") is None and m.prompt("s") is None


# PromptChains: a run continuing a prompt starts from where its request's tags got to ------------------------

def _chunk_batch(n, plen, computed, ids, is_ids=None):
    nb = -(-plen // BS)
    table = torch.arange(n * nb, dtype=torch.int32).reshape(n, nb)
    bt = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=table), num_blocks_per_row=np.full(n, nb))
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_computed_tokens_cpu=np.array(computed, np.int32),
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                            num_prompt_tokens=np.full(n, plen, dtype=np.int32))
    if is_ids is not None:
        batch.is_token_ids = is_ids
    return batch


@pytest.mark.parametrize("view", ["v1", "v2"])
@pytest.mark.parametrize("n,count", [(2, 20), (2, 300), (12, 20)])  # small, large and many-runs paths
def test_chunks_take_their_chain_from_the_writers_prompt_chains_not_from_the_prompt(monkeypatch, view, n, count):
    """Review (stop 56): each run summed its prompt from position 0 every step (23-45 ms for a step of 16 runs
    deep in 30k-token prompts). With the writer's ``PromptChains`` a request's next chunk starts where its last
    ended: no run of the second and third chunks sums earlier ids, and every tag equals the definition's.
    Request 1 has an embedding in its first chunk: no chain in its later chunks, as without the cache."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    plen = 3 * count
    rng = np.random.default_rng(n + count)
    ids = rng.integers(0, 50_000, (n, plen)).astype(np.int32)
    is_ids = np.ones((n, plen), dtype=bool)
    is_ids[1, 3] = False
    chains = tok.PromptChains()
    if view == "v2":
        mirror = BlockIdMirror()
        mirror.update(_so([SimpleNamespace(req_id=f"r{i}", block_ids=([0],), prompt_token_ids=ids[i].tolist(),
                                           prompt_is_token_ids=is_ids[i].tolist()) for i in range(n)]))
    summed = []
    one, many = tok.chain_before, tok.chains_before
    monkeypatch.setattr(tok, "chain_before", lambda *a: summed.append(a[2]) or one(*a))
    monkeypatch.setattr(tok, "chains_before", lambda p: summed.extend(len(ids) for ids, _ in p) or many(p))
    for chunk in range(3):
        computed = [chunk * count] * n
        if view == "v1":
            got = FullAttentionGroupView(_chunk_batch(n, plen, computed, ids, is_ids), BS).step_token_tags_cpu(
                [count] * n, chains)
        else:
            c = np.full(n, count, dtype=np.int32)
            batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_scheduled_tokens=c,
                                    query_start_loc_np=np.concatenate([[0], np.cumsum(c)]),
                                    num_computed_tokens_np=np.array(computed, dtype=np.int32))
            got = V2StepGroupView(batch, mirror, BS).step_token_tags_cpu([count] * n, chains)
        want = np.concatenate([tags_of(ids[i], chunk * count, count, known=is_ids[i]) for i in range(n)])
        assert (got == want).all(), chunk
        assert (got[count:2 * count, 1] == 0).all() if chunk else True
    assert [p for p in summed if p] == [] and len(chains) == n


def test_a_miss_or_a_stale_entry_sums_the_prompt_and_events_end_an_entry(committer_factory):
    """``PromptChains`` is a cache only: an entry at another position is not used (the run sums its prompt); the
    manager seeds a hit's chain, forgets a request that finishes and starts a new lifetime on STARTED."""
    from omnishm.client import OmniPrefixCacheManager
    from manager_helpers import quick_config

    chains = tok.PromptChains()
    prompt = np.arange(100, 140, dtype=np.int64)
    chains.note("a", 8, 12345)  # a stale entry: at position 8, the run starts at 12
    got = row_tags(4, [(0, 12, prompt[:16], None, chains.before("a", 12))])
    assert chains.before("a", 12) is None and (got == tags_of(prompt, 12, 4)).all()
    chains.note("b", 4, 0)  # an unknown chain: the run has none either
    assert chains.before("b", 4) == tok.UNKNOWN
    assert (row_tags(4, [(0, 4, prompt[:8], None, tok.UNKNOWN)])[:, 1] == 0).all()
    name = committer_factory().name
    with OmniPrefixCacheManager(quick_config(), cache=name, autostart=False) as m, \
            OmniPrefixCacheManager(quick_config(), cache=name, autostart=False, role="reader") as r:
        pc = m.prompt_chains
        assert r.prompt_chains is None  # readers tag nothing
        m.new_step_starts([E(K.STARTED, "h", num_computed_tokens=8, block_ids=(0, 1), token_ids=prompt.tolist())])
        # Seeded from the hit's event ids, used only where the request's mask says all before it are ids (an
        # embedding's placeholder id passes for a token in the event: review, stop 56)
        assert pc.before("h", 8) == int(tags_of(prompt, 7, 1)[0, 1]) & ((1 << 64) - 1)
        assert pc.before("h", 8, np.ones(16, dtype=bool)) == pc.before("h", 8)
        assert pc.before("h", 8, np.arange(16) != 3) is None
        pc.note("h", 12, 99)
        m.new_step_starts([E(K.STARTED, "h", num_computed_tokens=0, block_ids=(2,)), E(K.STARTED, "g", block_ids=(3,))])
        assert pc.before("h", 12) is None  # a STARTED of it: its entry is gone
        pc.note("g", 4, 7)
        m.new_step_starts([E(K.FINISHED, "g")])
        assert pc.before("g", 4) is None and len(pc) == 0


def test_prompt_chains_start_over_past_their_limit(monkeypatch):
    monkeypatch.setattr(tok.PromptChains, "LIMIT", 4)
    chains = tok.PromptChains()
    for i in range(4):
        chains.note(i, 8, 7)
    chains.note(0, 12, 9)  # an entry of a request it holds: no start over
    assert len(chains) == 4 and chains.before(0, 12) == 9
    chains.note("new", 4, 5)
    assert len(chains) == 1 and chains.before("new", 4) == 5


def test_the_v2_mirror_checks_a_prompt_given_as_a_numpy_array_too():
    """Review (stop 56): a prompt already a numpy array was taken as checked: float or 2-D ids raised out of the
    save. They are dropped like a list of them."""
    from omnishm.client.v2_view import BlockIdMirror

    m = BlockIdMirror()
    m.update(_so([_new("f", np.array([1.0, 2.0])), _new("d", np.array([[1, 2], [3, 4]])),
                  _new("i", np.array([5, 6], dtype=np.int32))]))
    assert m.prompt("f") is None and m.prompt("d") is None and m.prompt("i")[0].tolist() == [5, 6]


def _mirror_of(prompt, is_ids):
    from omnishm.client.v2_view import BlockIdMirror

    m = BlockIdMirror()
    m.update(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=None,
                             scheduled_new_reqs=[SimpleNamespace(req_id="b", block_ids=([0, 1],),
                                                                 prompt_token_ids=prompt,
                                                                 prompt_is_token_ids=is_ids)],
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
    return m


@pytest.mark.parametrize("is_ids", [[True, False], [True] * 7, [[True] * 5]])
def test_a_mask_of_another_shape_than_the_ids_leaves_the_request_untagged(is_ids):
    """Mutation review (stop 56): a ``prompt_is_token_ids`` that is not one bool per id leaves the request
    untagged, not an IndexError on the engine thread inside the save's tagging."""
    from omnishm.client.v2_view import V2StepGroupView

    m = _mirror_of([7] * 5, is_ids)
    assert m.prompt("b") is None
    m = _mirror_of([7] * 5, is_ids)
    counts = np.array([3], dtype=np.int32)
    batch = SimpleNamespace(req_ids=["b"], num_scheduled_tokens=counts,
                            query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]),
                            num_computed_tokens_np=np.array([0], dtype=np.int32))
    assert V2StepGroupView(batch, m, BS).step_token_tags_cpu([3]) is None


def test_a_hit_on_a_prompt_mixing_ids_and_embeddings_leaves_its_next_run_without_a_chain(committer_factory):
    """Review (stop 56): the manager seeded ``PromptChains`` from a hit's event ids, which take an embedding's
    placeholder id for a token; the request's next rows got chains the batch's own mask gives none, and a real
    engine refused a correct hit of another request with other placeholder ids. The cache is filled by the
    views only: the run after the hit has no chain from the embedding on, as without the cache."""
    from omnishm.client import OmniPrefixCacheManager
    from manager_helpers import quick_config

    ids = np.arange(10, 26, dtype=np.int32).reshape(1, 16)
    is_ids = np.ones((1, 16), dtype=bool)
    is_ids[0, 2] = False  # position 2 an embedding (its placeholder id 12 in the prompt's ids)
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([E(K.STARTED, "r0", num_computed_tokens=8, block_ids=(0, 1, 2, 3),
                             token_ids=ids[0].tolist())])
        view = FullAttentionGroupView(_chunk_batch(1, 16, [8], ids, is_ids), BS)
        plain = view.step_token_tags_cpu([8])
        cached = view.step_token_tags_cpu([8], m.prompt_chains)
    assert (plain == cached).all() and (cached[:, 1] == 0).all() and (cached[:, 0] != 0).all()


def test_many_runs_missing_their_chain_sum_short_prefixes_together_and_long_ones_alone():
    """``chains_before``: prefixes of up to ``LONG_PREFIX`` tokens in one set of numpy calls, longer ones one dot
    product each, all equal to ``chain_before`` of each; an unknown id or a masked position makes it UNKNOWN."""
    rng = np.random.default_rng(11)
    prefixes = []
    for n in (0, 1, 7, 300, tok.LONG_PREFIX, tok.LONG_PREFIX + 1, 9000):
        ids = rng.integers(0, 50_000, n).astype(np.int32)
        prefixes.append((ids, None))
        prefixes.append((ids, np.arange(n) != n // 2 if n else None))
    prefixes.append((np.array([5, -1, 6]), None))
    got = tok.chains_before(prefixes)
    want = [tok.chain_before(ids, known, len(ids)) for ids, known in prefixes]
    assert got == want and got[-1] == tok.UNKNOWN and got[0] == 0 and got[5] == tok.UNKNOWN != got[4]


# the integrations hand the writer's PromptChains to their views (mutation review, stop 56) ---------------

_MASK64 = (1 << 64) - 1


def _chain(ids, end):
    """The chain of positions 0..end-1 as ``PromptChains`` holds it (unsigned)."""
    return int(tags_of(list(ids), end - 1, 1)[0, 1]) & _MASK64


def test_build_write_layout_notes_the_chains_it_is_given(monkeypatch):
    """Mutation review (stop 56): ``build_write_layout`` ignoring ``chains=``, or an integration passing None,
    left every tag right and brought the O(prompt) sums back; each path must leave its rows' chain in the
    writer's ``prompt_chains``, and the next chunk must sum nothing."""
    ids = np.arange(32, dtype=np.int32).reshape(2, 16) + 100
    pc = tok.PromptChains()
    view = FullAttentionGroupView(_batch([16, 16], [0, 0], ids), BS)
    PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 4, "b": 3}, chains=pc)
    assert pc.before("a", 4) == _chain(ids[0], 4) and pc.before("b", 3) == _chain(ids[1], 3)
    # the next chunk starts from the noted chain: no sum of the earlier ids
    calls = []
    real = tok.chain_before
    monkeypatch.setattr(tok, "chain_before", lambda *a: calls.append(a[2]) or real(*a))
    view = FullAttentionGroupView(_batch([16, 16], [4, 3], ids), BS)
    PrefixCacheSchedulerAdapter.build_write_layout(view, {"a": 4, "b": 4}, chains=pc)
    assert calls == [] and pc.before("a", 8) == _chain(ids[0], 8) and pc.before("b", 7) == _chain(ids[1], 7)


def test_the_vllm_hooks_pass_the_writers_chains(committer, monkeypatch):
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    h, runner = _hooks(committer, monkeypatch, "writer")
    try:
        tvh.step(runner, tvh.so(new=[("A", 16, 0, [3, 5])], counts={"A": 8}))
        prompt = _ids(1, tvh.MAX_BLOCKS * tvh.BS)[0][:16]
        assert h.manager.prompt_chains.before("A", 8) == _chain(prompt, 8)
    finally:
        h.uninstall()


def test_the_runner_mixin_passes_the_writers_chains(committer):
    r = trm.FakeRunner(committer.name, torch.nn.Identity())
    r.prefix_cache_role = "writer"
    r.input_batch.token_ids_cpu = _ids(trm.MAX_REQS, trm.MAX_BLOCKS * trm.BS)
    r.input_batch.num_prompt_tokens = np.full(trm.MAX_REQS, 16, dtype=np.int32)
    r.tags.update(a=1)
    try:
        r.execute_model(trm.sched(new=[("a", 0, [5, 2])], counts={"a": 6}))
        prompt = _ids(1, trm.MAX_BLOCKS * trm.BS)[0][:16]
        assert r.prefix_cache_manager.prompt_chains.before("a", 6) == _chain(prompt, 6)
    finally:
        r.prefix_cache_shutdown()


def test_the_vllm_omni_drop_in_passes_the_writers_chains(committer_factory, monkeypatch):
    from omnishm.bench.vllm_omni_arm import InputBatch, scheduler_output
    from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager

    given = []
    real = FullAttentionGroupView.step_token_tags_cpu

    def recording(self, counts, chains=None):
        given.append(chains)
        return real(self, counts, chains)

    monkeypatch.setattr(FullAttentionGroupView, "step_token_tags_cpu", recording)
    vo, cfg, name, eng = dropin_parts(committer_factory)
    batch = InputBatch(16, 64, 16)
    m = VllmOmniPrefixCacheManager(cfg, vo.FullAttentionGroupView(batch, 16), cache=name, autostart=False,
                                   role="writer")
    try:
        for _ in range(6):
            eng.top_up(3)
            st = eng.schedule()
            blocks = {q.req_id: q.blocks for q in eng.running}
            m.new_step_starts(scheduler_output(st.step))
            batch.update(st, blocks)
            m.materialize(m.save_outputs(st.hidden, dict(st.mm), num_tokens_unpadded=st.num_tokens,
                                         num_tokens_padded=st.num_tokens), list(st.layout.req_ids))
            eng.advance(st)
        pc = m._m.prompt_chains
        assert given and pc is not None and all(c is pc for c in given), given
        assert len(pc) > 0
    finally:
        m.shutdown()


def test_hits_of_one_shared_prefix_are_tagged_once_and_compared_once(committer_factory, monkeypatch, caplog):
    """Real-engine review (stop 56): a step admitting 64 requests on one 4k-token system prompt tagged the prefix
    64 times, compared it 64 times and summed it 64 times for the requests' first runs (23 ms). Hits of the same
    ids up to the same length share one tags array; hits sharing it on the same slots are compared once, every
    request still counted and, when wrong, refused by name; a request's first run starts from its hit's chain."""
    from omnishm.client import OmniPrefixCacheManager, OmniPrefixCacheUnmatchError
    from manager_helpers import Part, quick_config, started
    from test_token_check import save_tagged, hit_event

    prefix = list(range(100, 108))  # two blocks of 4
    hits = [(prefix + [i, i + 1], 8) for i in range(12)] + [(list(range(300, 310)), 8), (prefix[:8], 8)]
    tags = tok.hits_token_tags(hits)
    assert all(t is tags[0] for t in tags[1:12]) and tags[12] is not tags[0] and tags[13] is tags[0]
    assert all((t == tok.hit_token_tags(ids, hit)).all() for t, (ids, hit) in zip(tags, hits))
    checks = []
    real = tok.SlotTokens.check_runs
    monkeypatch.setattr(tok.SlotTokens, "check_runs", lambda self, *a: checks.append(a[2]) or real(self, *a))
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8)], {"a": prefix}))
        reqs = [f"r{i}" for i in range(10)]
        m.new_step_starts([hit_event(r, [0, 1, 2 + i], 8, prefix + [i]) for i, r in enumerate(reqs)])
        assert all(m.prompt_chains.before(r, 8) == int(tags_of(prefix, 7, 1)[0, 1]) & ((1 << 64) - 1) for r in reqs)
        sid = save_tagged(m, [Part(r, 2, [0, 1, 2 + i], 8, 1) for i, r in enumerate(reqs)],
                          {r: prefix + [i] for i, r in enumerate(reqs)})
        assert checks == [[8]] and m.counters["token_checked_rows"] == 80
        m.materialize(sid, reqs)
        other = [9] + prefix[1:]  # a wrong first token: every request of the shared wrong hit is refused
        m.new_step_starts([hit_event(r, [0, 1, 12 + i], 8, other + [i]) for i, r in enumerate(["x", "y"])])
        sid = save_tagged(m, [Part(r, 3, [0, 1, 12 + i], 8, 1) for i, r in enumerate(["x", "y"])],
                          {"x": other + [0], "y": other + [1]})
        with pytest.raises(OmniPrefixCacheUnmatchError, match="8 of its rows .*request='x'"):
            m.materialize(sid, ["x", "y"])
        assert m.counters["token_mismatches"] == 16 and checks[-1] == [8]
        logged = [r.getMessage() for r in caplog.records if "computed for other tokens" in r.getMessage()]
        assert len(logged) == 2 and "request 'x'" in logged[0] and "request 'y'" in logged[1], logged


# hits sharing tags and seeds (review and mutation review of the shared-prefix change, stop 56) -------

def test_float_ids_do_not_share_their_missing_tags_with_an_int_hit():
    """hit_token_tags refuses float ids (None: not compared) but _equal_ids says [100.0, ...] == [100, ...], so a
    later int-id hit of the same values shares the float hit's None and goes unchecked."""
    P = list(range(100, 108))
    got = tok.hits_token_tags([([float(t) for t in P], 8), (P, 8)])
    assert got[0] is None
    assert got[1] is not None, "the int hit lost its tags to an earlier float hit"


def test_an_int_hit_on_wrong_rows_is_refused_even_after_a_float_hit(committer_factory):
    P, Q = list(range(100, 108)), list(range(200, 208))
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1]), started("q", [4, 5])])
        m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8), Part("q", 2, [4, 5], 0, 8)], {"a": P, "q": Q}))
        # f: float ids (an integration's odd ids), y: P's ids on Q's blocks (rows of other tokens)
        m.new_step_starts([hit_event("f", [0, 1, 8], 8, [float(t) for t in P] + [1.0]),
                           hit_event("y", [4, 5, 9], 8, P + [2])])
        sid = save_tagged(m, [Part("f", 3, [0, 1, 8], 8, 1), Part("y", 3, [4, 5, 9], 8, 1)],
                          {"f": P + [1], "y": P + [2]})
        with pytest.raises(OmniPrefixCacheUnmatchError, match="request='y'"):
            m.materialize(sid, ["y"])




def test_shared_hit_tags_equal_each_hits_own_tags():
    """Kills M1 (key without the length) and M2 (no full comparison): a hit shares an earlier hit's tags only
    when its ids up to its length are the same; hits alike at the first, middle and last ids are not."""
    a = [5, 6, 7, 8, 7, 9, 9, 8]
    hits = [(a, 8), (a, 4),                                  # same first/middle/last at another length
            ([5, 1, 1, 1, 7, 1, 1, 8], 8),                   # same (n, first, middle, last), other ids
            (np.array(a, dtype=np.int64), 8), (a + [3], 8)]  # numpy and longer ids: the same tags
    got = tok.hits_token_tags(hits)
    for (ids, hit), t in zip(hits, got):
        assert t.shape == tok.hit_token_tags(ids, hit).shape and (t == tok.hit_token_tags(ids, hit)).all()
    assert got[3] is got[0] and got[4] is got[0] and got[1] is not got[0] and got[2] is not got[0]


def test_a_seed_is_not_used_where_the_mask_has_an_embedding_just_before_the_run():
    """Kills M6 (mask checked up to pos - 1): an embedding at position pos - 1."""
    pc = tok.PromptChains()
    pc.seed("r", 8, 12345)
    mask = np.ones(16, dtype=bool)
    assert pc.before("r", 8, mask) == 12345
    mask[7] = False
    assert pc.before("r", 8, mask) is None


def test_a_hit_whose_ids_have_an_unknown_id_seeds_nothing(committer_factory):
    """Kills M8 (a seed of chain 0 kept): a hit with an unknown id (-1) has no chain at its end; the request's
    first run must sum its own ids (None), not start from chain 0 as if nothing came before it."""
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1])])
        ids = list(range(100, 116))
        ids[3] = -1
        m.new_step_starts([hit_event("h", [0, 1, 2], 8, ids)])
        assert m.prompt_chains.before("h", 8) is None


def _two_hits(committer_factory, b_blocks, b_tokens, b_hit_tokens):
    """a computes PROMPT-like prefix P in blocks 0,1 and Q in blocks 4,5; requests x (P on 0,1) and y hit."""
    P = list(range(100, 108))
    Q = list(range(200, 208))
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([started("a", [0, 1]), started("q", [4, 5])])
        m.discard_step(save_tagged(m, [Part("a", 1, [0, 1], 0, 8), Part("q", 2, [4, 5], 0, 8)], {"a": P, "q": Q}))
        xt, yt = P + [1], b_hit_tokens(P, Q) + [2]
        m.new_step_starts([hit_event("x", [0, 1, 8], 8, xt), hit_event("y", list(b_blocks) + [9], 8, yt)])
        sid = save_tagged(m, [Part("x", 3, [0, 1, 8], 8, 1), Part("y", 3, list(b_blocks) + [9], 8, 1)],
                          {"x": xt, "y": yt})
        with pytest.raises(OmniPrefixCacheUnmatchError, match="computed for other tokens.*request='y'"):
            m.materialize(sid, ["y", "x"])
        return dict(m.counters)


def test_hits_of_one_prefix_on_other_blocks_are_each_compared(committer_factory):
    """Kills M14 (_same_hits ignoring the slots): x and y share P's tags array, x on P's blocks, y on Q's
    blocks (rows of other tokens): y must be refused, not merged with x's passing comparison (a wrong row)."""
    c = _two_hits(committer_factory, (4, 5), None, lambda P, Q: P)
    assert c["token_mismatches"] == 8 and c["token_checked_rows"] == 16


def test_hits_of_other_prefixes_on_the_same_blocks_are_each_compared(committer_factory):
    """Kills M18 (_same_hits keyed by the tags' length, not the array): x (P) and y (Q, same length) both hit
    P's blocks: y's rows are another prompt's and must be refused."""
    c = _two_hits(committer_factory, (0, 1), None, lambda P, Q: Q)
    assert c["token_mismatches"] == 8 and c["token_checked_rows"] == 16


def test_v2_view_does_not_use_a_seed_where_the_mask_has_an_embedding(committer_factory):
    """Kills M23 (V2 view passing no mask to PromptChains.before): the V1 view's test, for V2: a hit on a
    prompt whose position 2 is an embedding leaves the run after it without a chain."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    ids = list(range(10, 26))
    is_ids = [True] * 16
    is_ids[2] = False
    with OmniPrefixCacheManager(quick_config(), cache=committer_factory().name, autostart=False) as m:
        m.new_step_starts([E(K.STARTED, "r0", num_computed_tokens=8, block_ids=(0, 1, 2, 3), token_ids=ids)])
        assert m.prompt_chains.before("r0", 8) is not None  # seeded from the event ids
        mirror = BlockIdMirror()
        mirror.update(_so([SimpleNamespace(req_id="r0", block_ids=([0, 1, 2, 3],), prompt_token_ids=ids,
                                           prompt_is_token_ids=is_ids)]))
        c = np.array([8], dtype=np.int32)
        batch = SimpleNamespace(req_ids=["r0"], num_scheduled_tokens=c, query_start_loc_np=np.array([0, 8]),
                                num_computed_tokens_np=np.array([8], dtype=np.int32))
        got = V2StepGroupView(batch, mirror, BS).step_token_tags_cpu([8], m.prompt_chains)
    want = tags_of(ids, 8, 8, known=is_ids)
    assert (got == want).all() and (got[:, 1] == 0).all() and (got[:, 0] != 0).all()
