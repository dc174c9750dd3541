"""What callers hand the API in types of their own: numpy counts, 0-d tensors, a string for a collection.

REVIEW (2026-12-07, stop 53): each case below either took the cache down or passed a wrong value on. A write
layout's counts read from vLLM's ``*_np`` arrays are numpy ints: the served-rows counter became a numpy float,
the link's I/O thread could not encode the next heartbeat and died (the cache went sticky-fatal), and the
goodbye raised at shutdown, leaving the writer's seat taken. A float count passed the layout check and failed
the save after its step id was issued. A policy's deferred keys given as one string became one-letter keys,
and ``materialize(step, "req-1")`` asked for five one-letter requests. A real committer process serves each.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from manager_helpers import BS, E, K, Part, aborted, build, expect, extended, finished, save, started
from omnishm.client import OmniPrefixCacheManager
from omnishm.client.adapter import PrefixCacheSchedulerAdapter, PrefixCacheWrite, PrefixCacheWriteLayout
from omnishm.interface import ModelCachePolicy, OmniPrefixCacheCommitterError, OmniPrefixCacheUnmatchError


def _recounted(layout: PrefixCacheWriteLayout, conv) -> PrefixCacheWriteLayout:
    return PrefixCacheWriteLayout(tuple(PrefixCacheWrite(w.req_id, conv(w.token_start), conv(w.num_tokens))
                                        for w in layout.writes), layout.slots)


@pytest.mark.parametrize("conv", [np.int64, np.int32, torch.tensor], ids=["int64", "int32", "0-d tensor"])
def test_a_layout_counted_in_numpy_ints_or_tensors_serves_and_keeps_the_link(mgr, committer, conv):
    m = mgr()
    m.new_step_starts([started("a", [0]), started("b", [1])])
    h, mm, layout, n, pad = build([Part("a", 1, [0], 0, 4), Part("b", 2, [1], 0, 3)], BS)
    counted = _recounted(layout, conv)
    assert all(type(w.token_start) is int and type(w.num_tokens) is int for w in counted.writes)
    s = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=counted)
    out = m.materialize(s, ["b", "a"])
    assert torch.equal(out.hidden_states["a"], expect(0, 0, 1, 0, 4))
    assert torch.equal(out.hidden_states["b"], expect(0, 0, 2, 0, 3))
    m.wait_idle()
    # What every heartbeat and the goodbye carry must encode: the I/O thread died on a numpy float here.
    report = m._link._report()
    assert report["rows_served"] == 14  # 7 rows, of hidden and of "feat"
    assert all(type(v) is float for v in report.values())
    msgspec.msgpack.encode(report)
    # A hit on the rows just written, through the same link, then a clean goodbye that frees the seat.
    m.new_step_starts([finished("a"), finished("b"), started("c", [0, 5], hit=4)])
    h2, mm2, layout2, n2, pad2 = build([Part("c", 3, [0, 5], 4, 1)], BS)
    s2 = m.save_outputs(h2, mm2, num_tokens_unpadded=n2, num_tokens_padded=pad2,
                        write_layout=_recounted(layout2, conv))
    assert torch.equal(m.materialize(s2, ["c"]).hidden_states["c"], expect(1, 4, 3, 4, 1))
    assert m._link.dead is None and m._fatal is None
    m.shutdown()
    again = OmniPrefixCacheManager(m.config, cache=committer.name, autostart=False)
    again.shutdown()  # attached as the writer: the goodbye went out and the seat was free


@pytest.mark.parametrize("bad", [4.0, True, "4", None])
def test_a_count_that_is_not_an_int_is_refused_where_the_write_is_made(bad):
    with pytest.raises(ValueError, match="r: num_tokens must be an int"):
        PrefixCacheWrite("r", 0, bad)
    with pytest.raises(ValueError, match="r: token_start must be an int"):
        PrefixCacheWrite("r", bad, 4)
    assert PrefixCacheWrite("r", 0, -1).num_tokens == -1  # a sign is the save's to refuse, by name


def test_deferred_keys_given_as_one_string_are_refused_not_split_into_letters():
    with pytest.raises(TypeError, match=r"deferred_keys must be a collection of tensor names, got the string 'feat'"):
        ModelCachePolicy(deferred_keys="feat")

    class Talker:
        prefix_cache_deferred_mm_keys = "audio_codes"

    with pytest.raises(TypeError, match=r"Talker.prefix_cache_deferred_mm_keys must be a collection"):
        ModelCachePolicy.from_model(Talker())
    Talker.prefix_cache_deferred_mm_keys = ["audio_codes"]
    assert ModelCachePolicy.from_model(Talker()).deferred_keys == frozenset({"audio_codes"})


def test_a_string_of_request_ids_is_refused_and_the_step_kept(mgr):
    m = mgr()
    m.new_step_starts([started("req-1", [0]), started("req-2", [1])])
    s = save(m, [Part("req-1", 1, [0], 0, 4), Part("req-2", 2, [1], 0, 4)], BS)
    with pytest.raises(TypeError, match=r"got the string 'req-1' \(write \['req-1'\]\)"):
        m.materialize(s, "req-1")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="were not in the save-time batch") as one:
        m.materialize(s, ["req-1", "req-9"])
    assert one.value.req_id == "req-9" and one.value.step_id == s
    with pytest.raises(OmniPrefixCacheUnmatchError, match="were not in the save-time batch") as two:
        m.materialize(s, ["req-8", "req-9"])
    assert two.value.req_id is None  # two requests: the message names both
    assert torch.equal(m.materialize(s, ["req-1"]).hidden_states["req-1"], expect(0, 0, 1, 0, 4))


def test_a_key_an_earlier_writer_opened_otherwise_is_refused_naming_tensor_and_step(mgr):
    first = mgr()
    first.new_step_starts([started("a", [0])])
    first.discard_step(save(first, [Part("a", 1, [0], 0, 4)], BS))
    first.wait_idle()
    first.shutdown()
    second = mgr()
    second.new_step_starts([started("b", [1])])
    h, mm, layout, n, pad = build([Part("b", 2, [1], 0, 4)], BS)
    wide = {"feat": torch.cat([mm["feat"], mm["feat"]], 1)}  # the key was opened 3 wide
    with pytest.raises(OmniPrefixCacheCommitterError, match=r"tensor 'feat' \(float32, rows of shape \(6,\)\) "
                                                            r"could not be opened: .*layout_mismatch") as err:
        second.save_outputs(h, wide, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
    assert err.value.key == "feat" and err.value.step_id == 0
    # The refusal took step 0, as every refused save takes its id (so all ranks stay in step); the next serves.
    s = save(second, [Part("b", 2, [1], 0, 4)], BS, mm_key=None)
    assert s == 1 and torch.equal(second.materialize(s, ["b"]).hidden_states["b"], expect(0, 0, 2, 0, 4))


def test_an_id_that_ends_cannot_be_resumed_or_extended_in_the_same_step():
    """The EXTENDED event reopened a deferred write of a request no longer live, and nothing closed it."""
    t = PrefixCacheSchedulerAdapter()
    with pytest.raises(ValueError, match="EXTENDED event for a, which ends in the same step"):
        t.translate_step([extended("a", 4, [1]), finished("a")])
    with pytest.raises(ValueError, match="RESUMED event for a, which ends in the same step"):
        t.translate_step([aborted("a"), E(K.RESUMED, "a", num_computed_tokens=4, block_ids=(0, 1))])
    # A new request may take the ended id (vLLM reuses ids), in any order given.
    step = t.translate_step([started("a", [0, 1]), finished("a"), extended("b", 4, [2])])
    assert [(e.kind.name, e.req_id) for e in step.events] == [("FINISHED", "a"), ("STARTED", "a"), ("EXTENDED", "b")]
