"""Where the token check's tags come from (``client/tokens.py``): the tag itself, the rows' tags that the V1
and V2 views, the adapter, the vLLM hooks, the runner mixin and the vllm-omni drop-in build (the writer's only),
and the hit's token ids the adapter takes from vLLM's scheduler output. The writer's check itself is in
``test_token_check.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import omnishm.integrations.vllm_hooks as vllm_mod
from manager_helpers import BS
from omnishm.client import tokens as tok
from omnishm.client.adapter import PrefixCacheEventKind as K
from omnishm.client.adapter import PrefixCacheRequestEvent as E
from omnishm.client.adapter import PrefixCacheSchedulerAdapter
from omnishm.client.group_view import FullAttentionGroupView
from omnishm.client.tokens import FEW_RUNS, hit_token_tags, row_tags, token_tags
from test_token_check import PROMPT, tags_of

import test_runner_mixin as trm
import test_vllm_hooks as tvh


def test_tags_are_distinct_for_distinct_tokens_and_positions_and_zero_only_for_unknown():
    tokens = np.repeat(np.arange(0, 300, dtype=np.int64), 300)
    positions = np.tile(np.arange(0, 300, dtype=np.int64), 300)
    tags = token_tags(tokens, positions)
    assert len(np.unique(tags)) == len(tags) and (tags != 0).all()
    assert (token_tags(np.array([-1, 5]), np.array([0, 1])) == [0, token_tags(np.array([5]), np.array([1]))[0]]).all()
    assert hit_token_tags(None, 8) is None and hit_token_tags([], 8) is None
    assert (hit_token_tags(PROMPT, 8) == tags_of(PROMPT, 0, 8)).all()
    assert len(hit_token_tags(PROMPT[:5], 8)) == 5  # ids past the ones given are not compared


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
    want = np.concatenate([tags_of(ids[0], 4, 2), np.zeros((2, 2), dtype=np.int64), tags_of(ids[1], 0, 3)])
    assert got.dtype == np.int64 and got.shape == (7, 2) and (got == want).all()
    is_ids = np.ones((2, 16), dtype=bool)
    is_ids[1, 1] = False  # an embedding at b's position 1: unknown there, and no chain from there on
    got = FullAttentionGroupView(_batch([6, 10], [4, 0], ids, is_ids), BS).step_token_tags_cpu([4, 3])
    assert got[5].tolist() == [0, 0] and (got[4] == want[4]).all() and got[6].tolist() == [want[6][0], 0]
    assert (got[4:] == tags_of(ids[1], 0, 3, known=is_ids[1])).all()
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
        want = np.zeros((n, 2), dtype=np.int64)
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
    b = tags_of([7] * 5, 0, 3, known=[True, False] * 2 + [True]).tolist()
    assert b[1] == [0, 0] and b[2][1] == 0  # unknown at the embedding; no chain after it
    assert got.tolist() == [*tags_of(PROMPT, 4, 2).tolist(), [0, 0], [0, 0], *b, [0, 0], [0, 0]]
    mirror.update(SimpleNamespace(finished_req_ids={"a", "b"}, preempted_req_ids=None, scheduled_new_reqs=[],
                                  scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
    assert mirror.prompt("a") is None and mirror.prompt("b") is None


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
    want = np.concatenate([tags_of(ids[0], 0, n_rows - 10), np.zeros((10, 2), dtype=np.int64),
                           tags_of(ids[1], 0, n_rows, known=is_ids[1])])
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


def dropin_parts(committer_factory):
    """The vllm-omni drop-in's stand-in module, its config, a committer's cache name and a simulated engine."""
    from omnishm.integrations.vllm_omni import load_prefix_cache
    from omnishm.sim import SimEngine

    vo, _ = load_prefix_cache(standin=True)
    cfg = vo.PrefixCacheConfig(num_blocks=64, block_size=16, staging_capacity_tokens=128, staging_depth=2,
                               staging_claim_timeout_s=10.0)
    eng = SimEngine(num_blocks=64, block_size=16, max_batched_tokens=128, width=16, mm_width=4, seed=3)
    return vo, cfg, committer_factory().name, eng


def test_reader_ranks_tag_no_rows(committer_factory, monkeypatch):
    """Docs review (stop 55): readers keep no tags, yet every rank tagged each step (tens of microseconds a step
    on a reader's engine thread, thrown away). Only the writer's layouts carry tags: here the vllm-omni drop-in's
    writer and reader on the same simulated steps, and ``build_write_layout(token_tags=False)``, which the
    vLLM hooks and the runner mixin pass on a reader."""
    from omnishm.bench.vllm_omni_arm import InputBatch, scheduler_output
    from omnishm.integrations.vllm_omni import VllmOmniPrefixCacheManager

    tagged = {"writer": 0, "reader": 0}
    real = FullAttentionGroupView.step_token_tags_cpu
    role = []

    def counting(self, counts, chains=None):
        out = real(self, counts, chains)
        tagged[role[-1]] += 0 if out is None else len(out)
        return out

    monkeypatch.setattr(FullAttentionGroupView, "step_token_tags_cpu", counting)
    vo, cfg, name, eng = dropin_parts(committer_factory)
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
            want.append(tags_of(ids[i], p, 1, known=is_ids[i])[0].tolist() if known else [0, 0])
    assert got.dtype == np.int64 and got.tolist() == want


# hit_token_tags' dtype check (M8, M10) -------------------------------------------------------------

@pytest.mark.parametrize("ids", [[100.0, 101.0, 102.0, 103.0], np.arange(4, dtype=np.float32) + 100.5])
def test_hit_ids_of_floats_are_not_compared(ids):
    """Floats would be cut to integers and compared as token ids: no tags."""
    assert hit_token_tags(ids, 4) is None


@pytest.mark.parametrize("dtype", [np.uint32, np.uint16, np.int32])
def test_hit_ids_of_any_integer_dtype_are_compared(dtype):
    """An unsigned or narrow integer array of ids (numpy arrays of a tokenizer's ids) is checked, not skipped."""
    ids = np.arange(100, 108, dtype=dtype)
    got = hit_token_tags(ids, 6)
    assert got is not None and got.dtype == np.int64 and got.tolist() == tags_of(range(100, 106), 0, 6).tolist()


# row_tags' many-runs path with runs of mixed 'known' (M11, M12) ------------------------------------

def _reference(rows, spans):
    """``row_tags``' result computed from the definition: run (start, pos, prompt ids from 0, known) writes
    positions pos.. at rows start..."""
    out = [[0, 0]] * rows
    for start, pos, ids, known, _ in spans:
        out[start:start + len(ids) - pos] = tags_of(list(ids), pos, len(ids) - pos, known=known).tolist()
    return out


@pytest.mark.parametrize("n_runs", [9, 24])  # over FEW_RUNS (8)
def test_many_runs_where_only_some_carry_a_known_mask_are_tagged_like_few(n_runs):
    """Runs whose ``known`` is None (all ids) beside runs with a mask (an embedding at some positions): every
    None run's rows are tagged, every masked-out row is 0."""
    spans, at = [], 0
    for i in range(n_runs):
        ids = list(range(1000 + 10 * i, 1000 + 10 * i + i + 3 + i % 4))  # positions i.. are the run's
        known = None if i % 2 else [k % 3 != 1 for k in range(len(ids))]
        spans.append((at + 1, i, ids, known, None))  # a generated row (0) before each run
        at += 1 + len(ids) - i
    got = row_tags(at, spans)
    assert got.dtype == np.int64 and got.tolist() == _reference(at, spans)


def test_the_v2_view_tags_many_prompts_with_and_without_is_ids_masks():
    """vLLM gives ``prompt_is_token_ids`` None for a prompt of ids only: among many new prompts those must be
    tagged too, and the masked ones only at their id positions."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    n = 18  # over FEW_RUNS (8)
    prompts = [list(range(500 + 7 * i, 500 + 7 * i + 5)) for i in range(n)]
    masks = [None if i % 2 else [True, False, True, True, False] for i in range(n)]
    mirror = BlockIdMirror()
    mirror.update(SimpleNamespace(
        finished_req_ids=set(), preempted_req_ids=None,
        scheduled_new_reqs=[SimpleNamespace(req_id=f"r{i}", block_ids=([i],), prompt_token_ids=prompts[i],
                                            prompt_is_token_ids=masks[i]) for i in range(n)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[])))
    counts = np.full(n, 5, dtype=np.int32)
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_scheduled_tokens=counts,
                            query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]),
                            num_computed_tokens_np=np.zeros(n, dtype=np.int32))
    got = V2StepGroupView(batch, mirror, 8).step_token_tags_cpu(counts.tolist())
    want = _reference(5 * n, [(5 * i, 0, prompts[i], masks[i], None) for i in range(n)])
    assert got.tolist() == want and all(want[5 * i + 4][1] for i in range(1, n, 2))


# the one-gather paths are taken (performance contract; M6, M7, M16) --------------------------------

def _spans(n):
    return [(4 * i, 0, [1, 2, 3, 4], None, None) for i in range(n)]


def test_over_few_runs_row_tags_gathers_once_and_up_to_few_runs_it_does_not(monkeypatch):
    """``FEW_RUNS`` runs are tagged run by run; one more goes through ``scatter_tags`` (one set of numpy calls)."""
    assert 1 <= FEW_RUNS < 256  # a step admitting 256 prompts is a many-runs step (its docstring)
    calls = []
    real = tok.scatter_tags
    monkeypatch.setattr(tok, "scatter_tags", lambda *a: calls.append(1) or real(*a))
    a = row_tags(4 * FEW_RUNS, _spans(FEW_RUNS))
    assert calls == []
    b = row_tags(4 * (FEW_RUNS + 1), _spans(FEW_RUNS + 1))
    assert calls == [1] and a.tolist() == b[:4 * FEW_RUNS].tolist()


def test_a_step_admitting_256_short_prompts_is_tagged_in_one_gather(monkeypatch):
    """The case ``FEW_RUNS`` was tuned for (256 new 8-token prompts: 1.2-1.6 ms run by run, about 0.13 ms)."""
    calls = []
    real = tok.scatter_tags
    monkeypatch.setattr(tok, "scatter_tags", lambda *a: calls.append(1) or real(*a))
    spans = [(8 * i, 0, list(range(i, i + 8)), None, None) for i in range(256)]
    assert row_tags(8 * 256, spans).tolist() == _reference(8 * 256, spans) and calls == [1]


def test_the_v1_view_gathers_many_prompt_runs_from_the_batch_in_one_index(monkeypatch):
    """Over ``FEW_RUNS`` prompt runs the V1 view indexes the batch's token ids once (``scatter_tags``), never
    slicing each run for ``row_tags``."""
    import omnishm.client.group_view as gv

    n = 64  # many new prompts (over FEW_RUNS)
    ids = np.arange(n * 16, dtype=np.int32).reshape(n, 16) + 7
    bt = SimpleNamespace(block_size=4, block_table=SimpleNamespace(cpu=torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)),
                         num_blocks_per_row=np.full(n, 4))
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(n)], num_computed_tokens_cpu=np.zeros(n, dtype=np.int32),
                            block_table=SimpleNamespace(block_tables=[bt]), token_ids_cpu=ids,
                            num_prompt_tokens=np.full(n, 3, dtype=np.int32))

    def no_per_run(*a, **kw):
        raise AssertionError("many runs tagged run by run")

    monkeypatch.setattr(gv, "row_tags", no_per_run)
    got = gv.FullAttentionGroupView(batch, 4).step_token_tags_cpu([3] * n)
    assert got.tolist() == np.concatenate([tags_of(ids[i], 0, 3) for i in range(n)]).tolist()


# BlockIdMirror's prompts (M19, M21) and the V2 view's None (M22) -------------------------------------

def _so(new=(), finished=(), preempted=None):
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=preempted,
                           scheduled_new_reqs=list(new), scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))


def _new(rid, prompt):
    return SimpleNamespace(req_id=rid, block_ids=([0, 1],), prompt_token_ids=prompt, prompt_is_token_ids=None)


def test_a_preempted_request_keeps_no_prompt_in_the_mirror():
    """The mirror keeps live requests' prompts only: a preempted one's goes (re-sent when it resumes)."""
    from omnishm.client.v2_view import BlockIdMirror

    m = BlockIdMirror()
    m.update(_so([_new("a", [1, 2, 3]), _new("b", [4, 5])]))
    m.update(_so(preempted={"a"}))
    assert m.prompt("a") is None and m.prompt("b") is not None


def test_a_request_sent_again_as_new_without_ids_drops_the_prompt_it_had():
    from omnishm.client.v2_view import BlockIdMirror

    m = BlockIdMirror()
    m.update(_so([_new("a", [1, 2, 3])]))
    m.update(_so([_new("a", None)]))
    assert m.prompt("a") is None


def test_the_v2_view_gives_none_for_a_step_without_prompt_rows():
    """Docstring: None when no row of the step is a known prompt row (a decode step)."""
    from omnishm.client.v2_view import BlockIdMirror, V2StepGroupView

    m = BlockIdMirror()
    m.update(_so([_new("a", [1, 2, 3]), _new("b", [4, 5])]))
    counts = np.array([1, 1], dtype=np.int32)
    batch = SimpleNamespace(req_ids=["a", "b"], num_scheduled_tokens=counts,
                            query_start_loc_np=np.array([0, 1, 2]), num_computed_tokens_np=np.array([3, 2], dtype=np.int32))
    assert V2StepGroupView(batch, m, 4).step_token_tags_cpu([1, 1]) is None


def _ids(max_reqs, width):
    return np.tile(np.arange(width, dtype=np.int32) + 300, (max_reqs, 1))


def _held(table, slots):
    return np.stack([table.tags[slots], table.chains[slots]], axis=1).tolist()


def _want(first, count):
    return tags_of(list(range(300, 300 + first + count)), first, count)


@pytest.fixture
def counted(monkeypatch):
    tagged = []
    real = FullAttentionGroupView.step_token_tags_cpu

    def counting(self, counts, chains=None):
        tagged.append(id(self.input_batch))
        return real(self, counts, chains)

    monkeypatch.setattr(FullAttentionGroupView, "step_token_tags_cpu", counting)
    return tagged


def _hooks(committer, monkeypatch, role):
    monkeypatch.setattr(vllm_mod, "vllm_runner_role", lambda: role)
    runner = tvh.FakeV1Runner()
    runner.input_batch.token_ids_cpu = _ids(tvh.MAX_REQS, tvh.MAX_BLOCKS * tvh.BS)
    runner.input_batch.num_prompt_tokens = np.full(tvh.MAX_REQS, 16, dtype=np.int32)
    h = vllm_mod.OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    return h, runner


def test_the_hooks_tag_the_writers_rows_and_the_reader_tags_none(committer, monkeypatch, counted):
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    made = {}
    try:
        for role in ("writer", "reader"):  # the manager is made at the first step, under its role
            made[role] = h, runner = _hooks(committer, monkeypatch, role)
            tvh.step(runner, tvh.so(new=[("A", 16, 0, [3, 5])], counts={"A": 8}))
            assert h.manager.role == role
        w, wr = made["writer"]
        r, rr = made["reader"]
        slots = np.array([12, 13, 14, 15, 20, 21, 22, 23])  # blocks 3, 5 at block size 4: positions 0..7
        assert _held(w.manager._slot_tokens, slots) == _want(0, 8).tolist()
        assert id(wr.input_batch) in counted and id(rr.input_batch) not in counted
    finally:
        for h, _ in made.values():
            h.uninstall()


def test_the_runner_mixin_tags_the_writers_rows_and_the_reader_tags_none(committer, counted):
    made = {}
    try:
        for role in ("writer", "reader"):
            r = trm.FakeRunner(committer.name, torch.nn.Identity())
            r.prefix_cache_role = role
            r.input_batch.token_ids_cpu = _ids(trm.MAX_REQS, trm.MAX_BLOCKS * trm.BS)
            r.input_batch.num_prompt_tokens = np.full(trm.MAX_REQS, 16, dtype=np.int32)
            r.tags.update(a=1)
            made[role] = r
        for role, r in made.items():
            r.execute_model(trm.sched(new=[("a", 0, [5, 2])], counts={"a": 6}))
            assert r.prefix_cache_manager.role == role
        w = made["writer"].prefix_cache_manager
        slots = np.array([20, 21, 22, 23, 8, 9])
        assert _held(w._slot_tokens, slots) == _want(0, 6).tolist()
        assert id(made["writer"].input_batch) in counted and id(made["reader"].input_batch) not in counted
    finally:
        for r in made.values():
            r.prefix_cache_shutdown()


def test_many_hits_are_tagged_in_one_pass_as_each_alone():
    """Fresh-eyes review (stop 55): a step admitting 256 requests that each hit a block spent 0.86 ms tagging
    their tokens one by one. Over ``FEW_RUNS`` hits they are tagged together, with what each alone gives: no
    ids, fewer ids than the hit, numpy ids; one request's odd ids (floats) leave the others checked."""
    from omnishm.client.tokens import hits_token_tags

    hits = [(list(range(10 * i, 10 * i + 6)), 4) for i in range(12)]
    hits[3] = (None, 4)
    hits[5] = ([7, 8], 4)
    hits[7] = (np.arange(100, 108, dtype=np.uint32), 8)
    for odd in (None, [1.5] * 4):
        if odd is not None:
            hits[9] = (odd, 4)
        got = hits_token_tags(hits)
        want = [hit_token_tags(ids, hit) for ids, hit in hits]
        assert len(got) == len(want) and all((g is None and w is None) or (g is not None and w is not None and
                                                                         g.tolist() == w.tolist())
                                             for g, w in zip(got, want)), (got, want)
    assert want[9] is None and want[3] is None and want[0] is not None
