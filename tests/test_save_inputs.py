"""save_outputs' inputs, as a review of 2026-12-04 found them: torch modes, refusals on every rank, types.

Against a real committer. Every refused call is followed by saves and hits that must still be exact,
and a TP reader beside the writer must keep counting step ids alike: a reader one id ahead of its
writer reads a later step's claims as its own and serves another request's rows.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from typing import NamedTuple

import pytest
import torch

from manager_helpers import (BS, MM_WIDTH, Part, build, expect, finished, one_applied_step, quick_config, rows, save,
                             small_config, started)
from omnishm.client import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheCommitterError, OmniPrefixCacheManager,
                            OmniPrefixCacheUnmatchError)
from omnishm.client import steps as steps_mod
from omnishm.client.adapter import PrefixCacheWrite, PrefixCacheWriteLayout


def layout(writes, slots) -> PrefixCacheWriteLayout:
    return PrefixCacheWriteLayout(tuple(PrefixCacheWrite(*w) for w in writes), torch.as_tensor(slots))


def hit_round(m, materialize=None, tag: int = 1) -> None:
    """a writes blocks 0-1, b hits block 0 a step later; b's rows must be exact; both finish."""
    materialize = materialize or m.materialize
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", tag, [0, 1], 0, 8)], BS))
    m.new_step_starts([started("b", [0, 2], hit=4)])
    out = materialize(save(m, [Part("b", tag, [0, 2], 4, 3)], BS), ["b"])
    assert torch.equal(out.hidden_states["b"], expect(tag, 4, tag, 4, 3))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(tag, 4, tag, 4, 3, mm=True))
    m.new_step_starts([finished("a"), finished("b")])  # deferred writes close and flush here
    m.wait_idle()


def on_a_thread(m):
    def materialize(sid, reqs):
        got: dict = {}

        def run():
            try:
                got["out"] = m.materialize(sid, reqs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                got["exc"] = exc
        t = threading.Thread(target=run)
        t.start()
        t.join(20)
        assert not t.is_alive()
        if "exc" in got:
            raise got["exc"]
        return got["out"]
    return materialize


@pytest.mark.parametrize("where", ["engine thread", "another thread"])
def test_an_engine_thread_under_inference_mode(committer, where):
    """vLLM runs execute_model under torch.inference_mode. The shared-memory views and the pin counts
    were made there as inference tensors, which the flusher thread (a deferred key's rows, at a finish)
    and a materialize on another thread may not write: the first deferred write failed, sticky."""
    with torch.inference_mode():
        m = OmniPrefixCacheManager(quick_config(), cache=committer.name, autostart=False)
    try:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        for tag in (1, 2):
            with torch.inference_mode():
                hit_round(m, m.materialize if where == "engine thread" else on_a_thread(m), tag)
        assert m.counters["deferred_flushes"] >= 2
        assert m.unconsumed_step_ids() == []
    finally:
        m.shutdown()


def test_outputs_that_require_grad_are_saved_detached(mgr):
    """The staging copy of a tensor that requires grad joined the autograd graph, and every later
    materialize raised a torch error about views modified in place."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
    m.discard_step(m.save_outputs(h.requires_grad_(True), {k: v.requires_grad_(True) for k, v in mm.items()},
                                  num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay))
    m.new_step_starts([started("b", [0, 2], hit=4)])
    out = m.materialize(save(m, [Part("b", 1, [0, 2], 4, 3)], BS), ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 3))
    assert not out.hidden_states["b"].requires_grad
    m.new_step_starts([finished("a"), finished("b")])
    hit_round(m, tag=3)


BAD_LAYOUTS = {
    "gap": ([("g", 0, 2), ("y", 3, 1)], [40, 41, 42, 44]),
    "overlap": ([("g", 0, 3), ("y", 2, 2)], [40, 41, 42, 44]),
    "a request twice": ([("g", 0, 2), ("g", 2, 2)], [40, 41, 42, 43]),
    "a negative count": ([("g", 0, 4), ("y", 4, -2)], [40, 41, 42, 43]),
    "short cover": ([("g", 0, 2)], [40, 41, 42, 43]),
    # Which row a slot named twice holds was not defined: the step's row source served the last, the
    # committer's run copy the first, its scatter the last (a review of 2026-12-04).
    "a slot twice in one write": ([("g", 0, 4)], [40, 41, 40, 43]),
    "a slot twice in two writes": ([("g", 0, 2), ("y", 2, 2)], [40, 41, 42, 41]),
}


@pytest.mark.parametrize("vectorised", [False, True], ids=["small", "vectorised"])
@pytest.mark.parametrize("bad", sorted(BAD_LAYOUTS))
def test_every_rank_refuses_a_bad_layout_and_the_ranks_keep_counting_alike(committer, monkeypatch, bad, vectorised):
    """Only the writer checked the writes' order and coverage: a reader took the step and its ids ran one
    ahead, so a late hit read found the next tenant's claim, 'not later than its step', and served its
    rows. Duplicate requests and negative counts were taken by both ranks (one request's rows lost)."""
    writes, slots = BAD_LAYOUTS[bad]
    if vectorised:  # steps over _SMALL_STEP tokens check their slots with numpy
        monkeypatch.setattr(steps_mod, "_SMALL_STEP", 0)
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("g", [10]), started("y", [11])])
            with pytest.raises(OmniPrefixCacheUnmatchError, match="write layout"):
                m.save_outputs(rows(3, range(4)), {"feat": rows(503, range(4), MM_WIDTH)}, num_tokens_unpadded=4,
                               num_tokens_padded=4, write_layout=layout(writes, slots))
            m.new_step_starts([finished("g"), finished("y")])
        assert_reader_follows(w, r)


def test_a_key_only_the_writer_can_refuse_takes_the_step_id_on_the_writer_too(committer):
    """The committer refuses to open a key whose name is too long: the writer opens keys, the reader
    does not, so the reader takes the step. The writer consumes the id anyway (published with nothing
    claimed), so the reader's ids stay its writer's."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("z", [12])])
            m.discard_step(save(m, [Part("z", 5, [12], 0, 4)], BS))
        h, mm, lay, n, _ = build([Part("g", 2, [10], 0, 4)], BS)
        sid = save_where_only_the_writer_refuses(w, r, [finished("z"), started("g", [10])], h, unopenable(mm), lay,
                                                 OmniPrefixCacheCommitterError, "bad_key")
        r.discard_step(sid)  # its wait for the writer's publication ends at once
        for m in (w, r):
            m.new_step_starts([finished("g")])
        assert_reader_follows(w, r)


CHANGES = {  # how the rows of feat change: (the writer's refusal, what it says, what the reader's read says)
    "dtype": (OmniPrefixCacheUnmatchError, "float64", "float64"),
    # The reader compares the shapes itself when it mapped feat before (its welcome named the keys the committer
    # had), else the committer refuses its map of the key: which one depends on the tests the module's committer
    # served before (mutation review, stop 59: the second failed under xdist's per-test distribution).
    "row shape": (OmniPrefixCacheUnmatchError, "shape", r"rows of shape \(3, 1\), the pool holds .* shape \(3,\)"
                                                        r"|holds rows of shape \(3,\), reader asked for rows of shape \(3, 1\)"),
    "a dtype no cache holds": (OmniPrefixCacheUnmatchError, "complex64", "complex64"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_reader_never_serves_a_hit_in_another_dtype_or_row_shape_than_its_rows_were_saved_in(committer, change):
    """The writer refuses rows of a cached key in another dtype or row shape; the reader took them and
    served a hit's rows cached as (3,) viewed as (3, 1), with no error (a review of 2026-12-04). Rows of a
    dtype no cache holds raised a ValueError from the reader's key open instead of the unmatch error."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        z_holds_block_0(w, r)
        h, mm, lay, n, _ = build([Part("b", 1, [0, 2], 4, 3)], BS)
        refused, says, reads = CHANGES[change]
        if change == "row shape":
            mm = row_shaped(mm)
        else:
            mm = {k: v.to(torch.float64 if change == "dtype" else torch.complex64) for k, v in mm.items()}
        sid = save_where_only_the_writer_refuses(w, r, [started("b", [0, 2], hit=4)], h, mm, lay, refused, says)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=reads):
            r.materialize(sid, ["b"])
        for m in (w, r):
            m.new_step_starts([finished("b"), finished("z")])
        assert_reader_follows(w, r)


NOT_THE_POOLS_SHAPE = (r"holds rows of shape \(2, 3\), reader asked for rows of shape \(3, 2\)"  # the reader's map
                       r"|rows of shape \(3, 2\), the pool holds torch.float32 rows of shape \(2, 3\)")  # mapped before
"""What a reader's hit on ``sq`` says when its rows are (3, 2) and the key's (2, 3): the committer refuses
its map of the key, or, when the reader mapped it before (its welcome names the keys the committer had),
the reader compares the shapes itself."""


def sq(parts: list[Part], shape: tuple[int, ...]):
    """A step of ``parts`` whose one mm key ``sq`` has rows of 6 values in ``shape``: (hidden, rows, layout)."""
    h, _, lay, n, _ = build(parts, BS, mm_key=None)
    vals = torch.cat([rows(p.tag + 700, range(p.first, p.first + p.count), 6) for p in parts])
    return h, vals.reshape(n, *shape), lay


def test_a_reader_holds_a_hit_to_the_layout_of_the_step_that_wrote_it(committer):
    """A second review: the reader took its first save of a key as the pool's layout, but the writer had
    refused that save (a key before it the committer would not open) and opened the key with the next
    step's layout, so the reader refused the writer's layout and served a's (2, 3) rows as (3, 2). The
    committer now holds each key's one row shape, and the reader's key open is refused in another."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        h, v, lay = sq([Part("z", 5, [12], 0, 4)], (3, 2))
        r.discard_step(save_where_only_the_writer_refuses(
            w, r, [started("z", [12])], h, {**unopenable({"f": v.reshape(4, 6)}), "sq": v}, lay,
            OmniPrefixCacheCommitterError, "bad_key"))
        h, v, lay = sq([Part("a", 1, [0, 1], 0, 8)], (2, 3))
        for m in (w, r):  # the writer opens sq with rows of (2, 3); the reader takes it too
            m.new_step_starts([finished("z"), started("a", [0, 1])])
            m.discard_step(m.save_outputs(h, {"sq": v}, num_tokens_unpadded=8, num_tokens_padded=8, write_layout=lay))
        w.wait_idle()
        h, v, lay = sq([Part("b", 1, [0, 2], 4, 3)], (3, 2))
        sid = save_where_only_the_writer_refuses(w, r, [started("b", [0, 2], hit=4)], h, {"sq": v}, lay,
                                                 OmniPrefixCacheUnmatchError, "shape")
        with pytest.raises(OmniPrefixCacheUnmatchError, match=NOT_THE_POOLS_SHAPE):
            r.materialize(sid, ["b"])
        h, v, lay = sq([Part("c", 1, [0, 3], 4, 3)], (2, 3))
        sids = {}
        for m in (w, r):  # in the writer's layout the reader reads the same hit exactly
            m.new_step_starts([finished("a"), finished("b"), started("c", [0, 3], hit=4)])
            sids[m.role] = m.save_outputs(h, {"sq": v}, num_tokens_unpadded=3, num_tokens_padded=3, write_layout=lay)
        want = torch.cat([rows(701, range(4), 6), rows(701, range(4, 7), 6)]).reshape(7, 2, 3)
        for m in (w, r):
            assert torch.equal(m.materialize(sids[m.role], ["c"]).mm_outputs["c"]["sq"], want), m.role


def test_a_reader_whose_saves_never_had_the_writers_row_shape_refuses_the_hit(committer):
    """Ranks whose rows of a key disagree in shape from the first save (the lockstep contract says they do
    not; a restarted reader, or ranks with different mm key sets, come to the same). The writer opened the
    key with its (2, 3) rows, and the reader, which had recorded only its own (3, 2), had nothing to hold
    a hit to and served the writer's rows as (3, 2) (left open by stop 34). Now the committer holds the
    key's row shape, and the reader's hit is refused: at its map of the key, or by the reader itself."""
    cfg = small_config(commit_timeout_s=5.0)
    shapes = {"writer": (2, 3), "reader": (3, 2)}
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            h, v, lay = sq([Part("a", 1, [0, 1], 0, 8)], shapes[m.role])
            m.new_step_starts([started("a", [0, 1])])
            m.discard_step(m.save_outputs(h, {"sq": v}, num_tokens_unpadded=8, num_tokens_padded=8, write_layout=lay))
        w.wait_idle()
        for attempt in range(2):  # the refused map is not cached: the next hit is refused alike
            sids = {}
            for m in (w, r):
                h, v, lay = sq([Part("b", 1, [0, 2], 4, 3)], shapes[m.role])
                m.new_step_starts([started("b", [0, 2], hit=4)])
                sids[m.role] = m.save_outputs(h, {"sq": v}, num_tokens_unpadded=3, num_tokens_padded=3,
                                              write_layout=lay)
            want = torch.cat([rows(701, range(4), 6), rows(701, range(4, 7), 6)]).reshape(7, 2, 3)
            assert torch.equal(w.materialize(sids["writer"], ["b"]).mm_outputs["b"]["sq"], want)
            with pytest.raises(OmniPrefixCacheUnmatchError, match=NOT_THE_POOLS_SHAPE):
                r.materialize(sids["reader"], ["b"])
            for m in (w, r):
                m.new_step_starts([finished("b")])
        assert r.counters["unmatch_errors"] == 2 and w.counters["unmatch_errors"] == 0


def save_where_only_the_writer_refuses(w, r, events, hidden, mm, lay, refused: type, says: str) -> int:
    """Both ranks start the step and save it; the writer refuses (``refused``, saying ``says``), the reader
    takes it. Returns the reader's step id."""
    sids = {}
    for m in (w, r):
        m.new_step_starts(events)
        try:
            sids[m.role] = m.save_outputs(hidden, mm, num_tokens_unpadded=lay.num_tokens,
                                          num_tokens_padded=lay.num_tokens, write_layout=lay)
        except refused as exc:
            assert m is w and says in str(exc)
    assert list(sids) == ["reader"]
    return sids["reader"]


def assert_reader_follows(w, r) -> None:
    """Both ranks save the same steps; the reader materializes b's hit late, after block 0 changed
    tenant: it must raise, or serve a's rows, never the new tenant's."""
    for m in (w, r):
        m.new_step_starts([started("a", [0, 1])])
        m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    sids = {}
    for m in (w, r):
        m.new_step_starts([started("b", [0, 2], hit=4)])
        sids[m.role] = save(m, [Part("b", 1, [0, 2], 4, 3)], BS)
    assert sids["writer"] == sids["reader"]
    assert torch.equal(w.materialize(sids["writer"], ["b"]).hidden_states["b"], expect(1, 4, 1, 4, 3))
    later = {}
    for m in (w, r):
        m.new_step_starts([finished("a"), finished("b"), started("c", [0])])
        later[m.role] = save(m, [Part("c", 9, [0], 0, 4)], BS)
    w.discard_step(later["writer"])
    w.wait_idle()
    try:
        got = r.materialize(sids["reader"], ["b"]).hidden_states["b"]
    except OmniPrefixCacheUnmatchError as exc:
        assert "reused" in str(exc)
    else:
        assert torch.equal(got, expect(1, 4, 1, 4, 3)), "the reader served the new tenant's rows"
    r.discard_step(later["reader"])
    for m in (w, r):
        m.new_step_starts([finished("c")])


def assert_interrupted_writer_stops(w, r) -> None:
    """After an interrupt inside its save (the ids still counted alike), the writer refuses every call
    (sticky since 2026-12-06: what the interrupted call changed is unknown), and the reader goes on with its
    own rows."""
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"interrupted \(sticky.*save_outputs was cut short by "
                                                          r"KeyboardInterrupt"):
        w.new_step_starts([finished("g")])
    r.new_step_starts([finished("g"), started("h", [11])])
    assert torch.equal(r.materialize(save(r, [Part("h", 3, [11], 0, 4)], BS), ["h"]).hidden_states["h"],
                       rows(3, range(4)))


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], torch.zeros(2, 2, dtype=torch.int64),
                                   torch.tensor([0.0, 1.0, 2.0, 3.0])], ids=["list", "2-D", "float"])
def test_slots_must_be_a_1d_integer_tensor(mgr, slots):
    m = mgr()
    m.new_step_starts([started("a", [0])])
    h, mm, lay, n, _ = build([Part("a", 1, [0], 0, 4)], BS)
    with pytest.raises(TypeError, match="dense 1-D integer tensor"):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=PrefixCacheWriteLayout(lay.writes, slots))
    m.new_step_starts([finished("a")])
    hit_round(m)


@pytest.mark.parametrize("key", [5, ("feat", 1)], ids=["int", "tuple"])
def test_an_mm_key_that_is_not_a_str_is_a_type_error_at_once(mgr, key):
    """It was sent to the committer, whose decode error has no request to answer: the save waited out
    commit_timeout_s and then blamed the committer."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    h, mm, lay, n, _ = build([Part("a", 1, [0], 0, 4)], BS)
    with pytest.raises(TypeError, match="keys must be str"):
        m.save_outputs(h, {**mm, key: mm["feat"]}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay)
    m.new_step_starts([finished("a")])
    hit_round(m)


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("out", [lambda ok: ["a"], lambda ok: {"a": None}, lambda ok: {"a": {"feat": [0.0]}},
                                 lambda ok: {"a": {"feat": ok.to("meta")}},
                                 lambda ok: {"a": {"feat": ok.requires_grad_()}},
                                 lambda ok: {"a": {"feat": _inference(ok)}}],
                         ids=["not a mapping", "request None", "not a tensor", "meta device", "requires grad",
                              "inference tensor"])
def test_materialize_refuses_bad_out_buffers_before_consuming_the_step(mgr, out):
    """The last two were a bare torch RuntimeError once the step id was consumed, its rows lost (review):
    torch writes neither a tensor that requires grad nor, outside inference mode, an inference tensor."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    sid = save(m, [Part("a", 1, [0], 0, 4)], BS)
    with pytest.raises((TypeError, ValueError), match=r"materialize\(step \d+\) out"):
        m.materialize(sid, ["a"], out=out(torch.empty(4, MM_WIDTH)))
    assert torch.equal(m.materialize(sid, ["a"]).hidden_states["a"], rows(1, range(4)))
    m.new_step_starts([finished("a")])
    hit_round(m)


# A second review (of 02aff1e) found the slots of a refused save keeping their previous tenant's claims.


def z_holds_block_0(*ms) -> None:
    """Block 0 holds an earlier tenant's rows (z, tag 5), committed, on every rank's count."""
    for m in ms:
        m.new_step_starts([started("z", [0])])
        m.discard_step(save(m, [Part("z", 5, [0], 0, 4)], BS))
    ms[0].wait_idle()


def row_shaped(mm):
    """feat rows of shape (3, 1): the dtype and width of the cache's (3,), another row shape."""
    return {k: v.reshape(v.shape[0], MM_WIDTH, 1) for k, v in mm.items()}


def unopenable(mm):
    """mm under a key name the committer refuses to open (too long): a refusal only the writer makes,
    since only the writer opens keys at a save."""
    return {"y" * 201: v for v in mm.values()}


@pytest.mark.parametrize("refusal", ["dtype", "layout"])
def test_a_hit_on_slots_of_a_refused_save_raises_instead_of_serving_their_previous_tenant(mgr, refusal):
    """vLLM's KV cache holds the refused step's tokens all the same: the next step's hit on a's block 0
    served z's rows (its claim still held). The refused save's slots are now absent."""
    m = mgr()
    z_holds_block_0(m)
    h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
    if refusal == "layout":
        lay = PrefixCacheWriteLayout((PrefixCacheWrite("a", 1, 8),), lay.slots)
    m.new_step_starts([finished("z"), started("a", [0, 1])])
    with pytest.raises(OmniPrefixCacheUnmatchError):
        m.save_outputs(h.double() if refusal == "dtype" else h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=lay)
    m.new_step_starts([started("c", [0, 3], hit=4)])
    sid = save(m, [Part("c", 1, [0, 3], 4, 2)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
        m.materialize(sid, ["c"])
    m.new_step_starts([finished("a"), finished("c")])
    hit_round(m, tag=4)


def test_a_same_step_hit_in_a_step_only_the_writer_refused_is_refused_by_the_reader(committer):
    """a writes blocks 0-1 and b hits block 0 in the same step; the writer refuses feat's row shape and
    consumes the id. The reader took the step, and its read of b's hit served z's rows."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        z_holds_block_0(w, r)
        h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)], BS)
        sid = save_where_only_the_writer_refuses(
            w, r, [finished("z"), started("a", [0, 1]), started("b", [0, 2], hit=4)], h, unopenable(mm), lay,
            OmniPrefixCacheCommitterError, "bad_key")
        with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
            r.materialize(sid, ["b"])
        for m in (w, r):
            m.new_step_starts([finished("a"), finished("b")])
        assert_reader_follows(w, r)


def test_a_step_only_the_writer_refused_takes_its_planned_hits_on_every_rank(committer):
    """The readers' save took b's planned hit; the writer's refusal left it pending, so the step saved next
    served b a 4-token hit on the writer and none on the reader. Now the refusal takes it on the writer too,
    and every rank refuses the same scheduler step saved again, which would serve b without its hit's rows
    (stop 57: the reader, whose save took the hit, served b none of it); the ranks count the step alike."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        for m in (w, r):
            m.new_step_starts([started("a", [0, 1])])
            m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
        w.wait_idle()
        h, mm, lay, n, _ = build([Part("b", 1, [0, 2], 4, 3)], BS)
        for m in (w, r):
            m.new_step_starts([started("b", [0, 2], hit=4)])
            try:
                m.discard_step(m.save_outputs(h, unopenable(mm), num_tokens_unpadded=n, num_tokens_padded=n,
                                              write_layout=lay))
            except OmniPrefixCacheCommitterError:
                assert m is w
        hits = {}
        for m in (w, r):
            try:
                hits[m.role] = m.materialize(save(m, [Part("b", 1, [0, 2], 4, 3)], BS), ["b"]).num_hit_tokens["b"]
            except OmniPrefixCacheUnmatchError as exc:
                assert "request 'b': its prefix hit was taken by step 1 of this scheduler step" in str(exc)
                hits[m.role] = None
        assert hits == {"writer": None, "reader": None} and w._next_step == r._next_step
        for m in (w, r):
            m.new_step_starts([finished("a"), finished("b")])


def test_an_interrupt_inside_the_writers_key_open_keeps_the_ranks_counting_alike(committer):
    """A KeyboardInterrupt (not an Exception) while the writer opened a new key left the reader one id
    ahead, and it then served the next tenant's rows."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        h, mm, lay, n, _ = build([Part("g", 2, [10], 0, 4)], BS)
        real = w._link.request

        def interrupted(make, *args, **kw):
            raise KeyboardInterrupt

        w._link.request = interrupted
        for m in (w, r):
            m.new_step_starts([started("g", [10])])
            try:
                m.discard_step(m.save_outputs(h, {**mm, "interrupted_key": mm["feat"]}, num_tokens_unpadded=n,
                                              num_tokens_padded=n, write_layout=lay))
            except KeyboardInterrupt:
                assert m is w
        w._link.request = real
        assert w._next_step == r._next_step
        assert_interrupted_writer_stops(w, r)


# A third review (of 74c514a): slots it skipped or cleared too widely, and refusals past the checks.


def hit_on_block_0_is_absent(m) -> None:
    """c hits block 0, which vLLM now holds as a's: the read raises "absent" (a's rows never landed)."""
    m.new_step_starts([started("c", [0, 3], hit=4)])
    sid = save(m, [Part("c", 1, [0, 3], 4, 2)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
        m.materialize(sid, ["c"])


@pytest.mark.parametrize("form", ["list", "2-D", "float"])
def test_slots_of_the_wrong_type_are_still_cleared_when_the_save_is_refused(mgr, form):
    m = mgr()
    z_holds_block_0(m)
    h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
    bad = {"list": lay.slots.tolist(), "2-D": lay.slots[:, None], "float": lay.slots.double()}[form]
    m.new_step_starts([finished("z"), started("a", [0, 1])])
    with pytest.raises(TypeError):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=PrefixCacheWriteLayout(lay.writes, bad))
    hit_on_block_0_is_absent(m)
    m.new_step_starts([finished("a"), finished("c")])
    hit_round(m, tag=6)


def test_meta_slots_are_a_type_error_and_leave_the_cache_usable(mgr):
    """They passed the type check and turned the cache sticky-fatal when clearing them failed."""
    m = mgr()
    m.new_step_starts([started("a", [1])])
    h, mm, lay, n, _ = build([Part("a", 1, [1], 0, 4)], BS)
    with pytest.raises(TypeError, match="dense 1-D integer tensor"):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=PrefixCacheWriteLayout(lay.writes, lay.slots.to("meta")))
    m.new_step_starts([finished("a")])
    hit_round(m, tag=7)


@pytest.mark.parametrize("form", ["sparse", "meta"])
def test_rows_that_are_not_a_dense_tensor_are_a_type_error_and_leave_the_cache_usable(mgr, form):
    """Their staging copy failed after the step id was issued and turned the writer sticky-fatal."""
    m = mgr()
    m.new_step_starts([started("a", [1])])
    h, mm, lay, n, _ = build([Part("a", 1, [1], 0, 4)], BS)
    bad = mm["feat"].to_sparse() if form == "sparse" else mm["feat"].to("meta")
    kind = "torch.sparse_coo" if form == "sparse" else "meta"
    with pytest.raises(TypeError, match=f"'feat' must be a dense tensor with storage, got a {kind}"):
        m.save_outputs(h, {"feat": bad}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay)
    with pytest.raises(TypeError, match="must be a dense tensor"):
        m.save_outputs(h.to_sparse() if form == "sparse" else h.to("meta"), mm, num_tokens_unpadded=n,
                       num_tokens_padded=n, write_layout=lay)
    m.new_step_starts([finished("a")])
    hit_round(m, tag=7)


def test_the_callers_slot_buffer_may_be_rewritten_after_the_save(mgr):
    """vLLM keeps its slot mapping in a persistent buffer. The writer kept the layout's slots by reference
    for a deferred key's write, and flushed its rows to the slots the buffer named at flush time (a
    permutation here: the committer's claim check passed, and a hit served the rows out of order)."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    buf = torch.zeros(16, dtype=torch.int64)
    buf[:8] = torch.arange(8)
    h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8)], BS)
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                                  write_layout=PrefixCacheWriteLayout(lay.writes, buf[:8])))
    buf[:8] = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])  # the runner's next step
    m.new_step_starts([finished("a")])  # a's deferred write closes and flushes here
    m.wait_idle()
    m.new_step_starts([started("b", [0, 2], hit=4)])
    out = m.materialize(save(m, [Part("b", 1, [0, 2], 4, 3)], BS), ["b"])
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 3, mm=True))
    assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 3))
    m.new_step_starts([finished("b")])


def test_a_same_step_hit_is_served_from_the_step_source_after_the_caller_rewrote_its_slot_buffer(mgr, committer):
    """An immediate key's step source keeps a small step's slots as a list, not the caller's buffer. Here d
    hits, in the very step that writes it, the block c writes; the committer is frozen, so d's prefix can only
    come from the step source, and ``materialize`` runs after the runner rewrote its slot buffer for the next
    step (a permutation of the same slots, so only the order of the rows could go wrong)."""
    m = mgr()
    one_applied_step(m)  # the keys are open: nothing below needs the committer to answer
    m.new_step_starts([finished("a"), started("c", [1, 2]), started("d", [1, 3], hit=4)])
    h, mm, lay, n, _ = build([Part("c", 5, [1, 2], 0, 8), Part("d", 5, [1, 3], 4, 3)], BS)
    buf = lay.slots.clone()
    os.kill(committer.proc.pid, signal.SIGSTOP)
    try:
        step = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                              write_layout=PrefixCacheWriteLayout(lay.writes, buf))
        buf[:8] = torch.tensor([5, 4, 7, 6, 9, 8, 11, 10])  # the runner's next step
        out = m.materialize(step, ["c", "d"])
    finally:
        os.kill(committer.proc.pid, signal.SIGCONT)
    assert torch.equal(out.hidden_states["d"], expect(5, 4, 5, 4, 3))
    assert torch.equal(out.mm_outputs["d"]["feat"], expect(5, 4, 5, 4, 3, mm=True))
    assert torch.equal(out.hidden_states["c"], expect(5, 0, 5, 0, 8))
    m.new_step_starts([finished("c"), finished("d")])
    m.wait_idle()


def test_a_refused_save_clears_every_slot_its_layout_names(mgr):
    """Slots that disagree with the step's row count: which of them vLLM wrote is unknown, so all are
    cleared (a needless clear costs a later hit a refusal, a missed one a wrong row). A review found the
    vllm-omni drop-in's slots, all of them this step's, cut to the row count, and a hit on the rest
    served their previous tenant's rows."""
    m = mgr()
    m.new_step_starts([started("z", [5])])
    m.discard_step(save(m, [Part("z", 5, [5], 0, 4)], BS))
    m.wait_idle()
    h, mm, lay, n, _ = build([Part("a", 1, [0], 0, 4)], BS)
    m.new_step_starts([started("a", [0])])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="token accounting"):
        m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                       write_layout=PrefixCacheWriteLayout(lay.writes, torch.cat([lay.slots, torch.arange(20, 24)])))
    m.new_step_starts([started("c", [5, 6], hit=4)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
        m.materialize(save(m, [Part("c", 5, [5, 6], 4, 2)], BS), ["c"])
    m.new_step_starts([finished("z"), finished("a"), finished("c")])
    hit_round(m, tag=8)


def test_a_refused_save_takes_its_step_id_on_every_rank_whatever_refused_it(committer):
    """A failure before the first check (here in the writer's split of its outputs; an interrupt there, in
    the first version of this test) left the reader one id ahead, and it then served the next tenant's rows."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        real = w._split_outputs

        def failed(*args, **kw):
            w._split_outputs = real
            raise RuntimeError("injected: the split failed")

        w._split_outputs = failed
        h, mm, lay, n, _ = build([Part("g", 2, [10], 0, 4)], BS)
        sid = save_where_only_the_writer_refuses(w, r, [started("g", [10])], h, mm, lay, RuntimeError, "injected")
        r.discard_step(sid)
        assert w._next_step == r._next_step
        for m in (w, r):
            m.new_step_starts([finished("g")])
        assert_reader_follows(w, r)


@pytest.mark.parametrize("where", ["join", "staging page"])
def test_an_interrupt_in_the_writers_waits_keeps_the_ranks_counting_alike(committer, where):
    """The engine thread sleeps in the join of the previous step's write and in the staging page's wait;
    an interrupt there left the reader one id ahead, and it then served the next tenant's rows."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        owner, name = (w, "_join_previous_write") if where == "join" else (w._pages, "claim")
        real = getattr(owner, name)

        def interrupted(*args, **kw):
            setattr(owner, name, real)
            raise KeyboardInterrupt

        setattr(owner, name, interrupted)
        h, mm, lay, n, _ = build([Part("g", 2, [10], 0, 4)], BS)
        for m in (w, r):
            m.new_step_starts([started("g", [10])])
            try:
                m.discard_step(m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=lay))
            except KeyboardInterrupt:
                assert m is w
        assert w._next_step == r._next_step
        assert_interrupted_writer_stops(w, r)


def test_a_failed_rescue_still_clears_and_publishes_the_step_the_writer_refused(committer):
    """When the copy-on-write before clearing fails inside a writer-only refusal, the cache turns fatal,
    and the step must still be taken, cleared and published: the reader's materialize waited out
    commit_timeout_s, and (a fourth review) a reader's same-step hit served the slot's previous tenant."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        z_holds_block_0(w, r)

        def broken(slots):
            raise RuntimeError("injected: the rescue failed")

        w._rescue_before_claim = broken
        h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)], BS)
        sid = save_where_only_the_writer_refuses(
            w, r, [finished("z"), started("a", [0, 1]), started("b", [0, 2], hit=4)], h, unopenable(mm), lay,
            OmniPrefixCacheCommitterError, "bad_key")
        del w._rescue_before_claim
        assert w._next_step == r._next_step and "copy-on-write" in str(w._fatal)
        t0 = time.monotonic()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
            r.materialize(sid, ["b"])  # waits for the writer's publication of the step, then finds no rows
        assert time.monotonic() - t0 < 2.0
        r.new_step_starts([finished("a"), finished("b")])


def test_a_writer_turning_fatal_inside_a_refused_save_still_clears_its_slots(committer):
    """A fourth review: the join of the previous step's write failed inside the save (the cache turns
    sticky-fatal), the step was taken and published without clearing its slots, and the reader's
    same-step hit served their previous tenant's rows."""
    cfg = small_config(commit_timeout_s=5.0)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, role="reader", autostart=False) as r:
        z_holds_block_0(w, r)
        real = w._join_previous_write

        def lost():
            w._join_previous_write = real
            raise w._set_fatal("previous step's writes were lost (injected)")

        w._join_previous_write = lost
        h, mm, lay, n, _ = build([Part("a", 1, [0, 1], 0, 8), Part("b", 1, [0, 2], 4, 3)], BS)
        sid = save_where_only_the_writer_refuses(
            w, r, [finished("z"), started("a", [0, 1]), started("b", [0, 2], hit=4)], h, mm, lay,
            OmniPrefixCacheUnmatchError, "lost")
        assert w._fatal is not None and w._next_step == r._next_step
        with pytest.raises(OmniPrefixCacheUnmatchError, match="absent"):
            r.materialize(sid, ["b"])
        r.new_step_starts([finished("a"), finished("b")])


class _Emb(NamedTuple):
    data: torch.Tensor
    n: int


def test_a_leftover_value_comes_back_as_it_was_saved_whatever_holds_its_tensors(mgr):
    """A leftover value (not written to the pool) comes back as a deep copy of what was saved: its container
    types (a NamedTuple, an OrderedDict, a defaultdict), one copy of a tensor it holds twice, and its own
    cycles, with every tensor in it copied at the save (review of 4ddc682: rebuilding the value to copy its
    tensors made a NamedTuple a tuple and a dict subclass a dict, and a value holding itself raised
    RecursionError in save_outputs)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    t = torch.arange(3.0)
    cyc: list = [t]
    cyc.append(cyc)
    value = {"emb": _Emb(t, 3), "od": collections.OrderedDict(x=t), "dd": collections.defaultdict(list, k=[t]),
             "cyc": cyc}
    sid = save(m, [Part("a", 1, [0, 1], 0, 6)], BS, extra_mm={"value": value})
    t.fill_(-1)
    got = m.materialize(sid, ["a"]).mm_outputs["a"]["value"]
    assert type(got["emb"]) is _Emb and got["emb"].n == 3 and torch.equal(got["emb"].data, torch.arange(3.0))
    assert type(got["od"]) is collections.OrderedDict and type(got["dd"]) is collections.defaultdict
    assert got["emb"].data is got["od"]["x"] is got["dd"]["k"][0] is got["cyc"][0]  # held four times, one copy
    assert got["cyc"][1] is got["cyc"]
    m.new_step_starts([finished("a")])
    hit_round(m)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_out_buffer_that_requires_grad_is_written_under_no_grad_and_refused_with_grad(mgr, grad):
    """Under torch.no_grad() torch writes a buffer that requires grad (the review of e0eb49e: it was
    refused there too); with grad enabled it refuses, after the step id was consumed, so materialize says
    so first."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    sid = save(m, [Part("a", 1, [0], 0, 4)], BS)
    buf = torch.zeros(4, MM_WIDTH, requires_grad=True)
    if grad:
        with pytest.raises(ValueError, match="requires grad: rows cannot be copied into it with grad enabled"):
            m.materialize(sid, ["a"], out={"a": {"feat": buf}})
        assert torch.equal(m.materialize(sid, ["a"]).hidden_states["a"], rows(1, range(4)))
    else:
        with torch.no_grad():
            got = m.materialize(sid, ["a"], out={"a": {"feat": buf}})
        assert got.mm_outputs["a"]["feat"].data_ptr() == buf.data_ptr()
        assert torch.equal(buf.detach(), rows(501, range(4), MM_WIDTH))
    m.new_step_starts([finished("a")])
    hit_round(m)


def test_a_save_refused_for_a_slot_past_the_pool_leaves_the_writer_healthy(mgr):
    """MUTATION (2026-12-06): a save refused for a slot id past the pool (a runner bug) makes absent the slots
    it can name and skips the one that is no slot; the refusal is that save's alone. With the bound off by
    one (``slots <= num_slots``), clearing index ``num_slots`` raised and turned the whole cache sticky-fatal."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))
    m.wait_idle()
    h, mm, _, _, _ = build([Part("b", 2, [1], 0, 2)], BS)
    bad = PrefixCacheWriteLayout((PrefixCacheWrite("b", 0, 2),),
                                 torch.tensor([4, m.config.num_slots], dtype=torch.int64))
    m.new_step_starts([started("b", [1])])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="outside"):
        m.save_outputs(h, mm, num_tokens_unpadded=2, num_tokens_padded=2, write_layout=bad)
    assert m._fatal is None, m._fatal
    m.new_step_starts([started("c", [2])])
    m.discard_step(save(m, [Part("c", 3, [2], 0, 4)], BS))
    m.wait_idle()
    assert torch.equal(m._keys[HIDDEN_KEY].pool[8:12], rows(3, range(4)))


def test_a_save_whose_padded_count_is_below_its_unpadded_count_is_refused(mgr):
    """num_tokens_padded=3 with num_tokens_unpadded=4: hidden states of 3 rows would pass the row-count check
    (as "padded" rows) and keep 3 rows for 4 slots; the save is refused before its id is issued (mutation
    review, stop 59: ``_check_layout`` without ``padded < n`` passed every test, and the mutant failed the
    save after the id was issued, the writer's cache turned sticky-fatal)."""
    m = mgr()
    m.new_step_starts([started("a", [0])])
    _, _, layout, n, _ = build([Part("a", 1, [0], 0, 4)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="token accounting"):
        m.save_outputs(rows(1, range(3)), {}, num_tokens_unpadded=n, num_tokens_padded=n - 1, write_layout=layout)
    m.new_step_starts([])
    m.discard_step(save(m, [Part("a", 1, [0], 0, 4)], BS))  # the cache stays usable
