"""Contracts the seed (the in-process omni prefix cache) states that no other test pinned on their own.

A contract audit against the seed (2026-12-06) listed every contract it states and the test that pins
each; these are the ones it found unpinned, each against a real committer where the manager is involved.
omnishm's deliberate differences from the seed are in docs/CLIENT.md, section 2.2.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from manager_helpers import BS, E, K, Part, aborted, build, expect, extended, finished, rows, save, started
from omnishm.interface import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheStagingTimeoutError,
                               OmniPrefixCacheUnmatchError, PrefixCacheConfig, WriteSchedule)

# --- the policy and the errors (the seed's interface) ---


def test_the_policys_values_keys_and_schedules():
    """``deferred_keys`` is a frozenset, empty by default; ``hidden_key`` is ``HIDDEN_KEY``, None when the model
    opts out; ``get_hit_keys`` puts hidden first (if cached), then the mm keys, each once;
    ``skip_immediate_mm`` is true for hidden and deferred keys; ``schedule`` is ``JOIN_ON_FINISH`` for a
    deferred key, else ``JOIN_NEXT_STEP``."""
    p = ModelCachePolicy()
    assert p.deferred_keys == frozenset() and isinstance(p.deferred_keys, frozenset)
    assert p.hidden_key == HIDDEN_KEY == "__hidden_states__"
    assert ModelCachePolicy(cache_hidden=False).hidden_key is None
    assert p.get_hit_keys(["b", HIDDEN_KEY, "a", "a"]) == [HIDDEN_KEY, "a", "b"]
    assert ModelCachePolicy(cache_hidden=False).get_hit_keys(["b", HIDDEN_KEY, "a"]) == ["a", "b"]
    d = ModelCachePolicy(deferred_keys=frozenset({"feat"}))
    assert d.skip_immediate_mm(HIDDEN_KEY) and d.skip_immediate_mm("feat") and not d.skip_immediate_mm("x")
    assert d.schedule("feat") is WriteSchedule.JOIN_ON_FINISH and d.schedule("x") is WriteSchedule.JOIN_NEXT_STEP


def test_from_model_reads_the_legacy_attributes_or_takes_the_models_policy():
    """``ModelCachePolicy.from_model``, the shim over per-model attributes: it reads them, gives the default
    policy for a model with none, and returns a model's own ``omni_prefix_cache_policy`` as it is."""
    class Legacy:
        cache_hidden_states = False
        prefix_cache_deferred_mm_keys = ("talk",)

    p = ModelCachePolicy.from_model(Legacy())
    assert p.hidden_key is None and p.deferred_keys == frozenset({"talk"})
    assert ModelCachePolicy.from_model(object()) == ModelCachePolicy()
    explicit = ModelCachePolicy(deferred_keys=frozenset({"z"}))

    class Own:
        omni_prefix_cache_policy = explicit

    assert ModelCachePolicy.from_model(Own()) is explicit


def test_the_error_hierarchy():
    """A staging timeout is an unmatch error, and an unmatch error a ``RuntimeError`` (what callers catch)."""
    assert issubclass(OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError)
    assert issubclass(OmniPrefixCacheUnmatchError, RuntimeError)


def test_config_defaults_and_sizing_from_vllm():
    """``staging_depth`` is 4 by default; the staging page holds ``max_num_batched_tokens`` rows, else the
    model's ``max_model_len``."""
    c = PrefixCacheConfig(num_blocks=2, block_size=16)
    assert c.staging_depth == 4 and c.num_slots == 32
    sc = SimpleNamespace(max_num_batched_tokens=2048, max_model_len=4096)
    assert PrefixCacheConfig.from_vllm_config(num_blocks=2, block_size=16,
                                              scheduler_config=sc).staging_capacity_tokens == 2048
    assert PrefixCacheConfig.from_vllm_config(num_blocks=2, block_size=16,
                                              scheduler_config=SimpleNamespace(max_num_batched_tokens=None),
                                              model_config=SimpleNamespace(max_model_len=777)
                                              ).staging_capacity_tokens == 777
    assert PrefixCacheConfig.from_vllm_config(num_blocks=2, block_size=16).staging_depth == 4


# --- the manager, against a real committer ---


def test_a_model_that_opts_out_of_hidden_gets_none_and_its_hits_still_merge_mm(mgr):
    """With hidden states not cached, ``materialize`` gives None for them, and a hit still merges the mm
    rows of its prefix."""
    m = mgr(policy=ModelCachePolicy(cache_hidden=False))
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([started("b", [0, 5], hit=4)])
    out = m.materialize(save(m, [Part("b", 2, [0, 5], 4, 2)], BS), ["b"])
    assert out.hidden_states["b"] is None and out.num_hit_tokens["b"] == 4
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 2, 4, 2, mm=True))


def test_a_step_id_may_be_consumed_on_another_thread_and_its_write_lands(mgr):
    """``discard_step`` and ``materialize`` may run on any thread: the id is consumed once, and the step's
    rows land all the same (a later hit on them is exact)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    sid = save(m, [Part("a", 1, [0, 1], 0, 8)], BS)
    t = threading.Thread(target=m.discard_step, args=(sid,))
    t.start()
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="already consumed"):
        m.discard_step(sid)
    m.new_step_starts([started("b", [0, 1, 6], hit=8)])
    sid = save(m, [Part("b", 3, [0, 1, 6], 8, 1)], BS)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", m.materialize(sid, ["b"])))
    t.start()
    t.join(10)
    assert torch.equal(box["out"].hidden_states["b"], expect(1, 8, 3, 8, 1))


def test_padded_rows_never_land_and_materialize_returns_the_unpadded_rows(mgr):
    """Rows past ``num_tokens_unpadded`` are the forward's padding: ``materialize`` returns the unpadded rows,
    and the slots the padding would have named hold no row (a hit there is absent, a hit before is exact)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    sid = save(m, [Part("a", 1, [0, 1], 0, 5)], BS, padded=12)
    assert torch.equal(m.materialize(sid, ["a"]).hidden_states["a"], rows(1, range(5)))
    m.new_step_starts([started("b", [0, 7], hit=4)])
    sid = save(m, [Part("b", 2, [0, 7], 4, 1)], BS)
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(1, 4, 2, 4, 1))


def test_a_preempted_request_resumed_on_a_kept_block_gets_its_prefix(mgr):
    """A RESUMED request carries its whole new block list and its computed tokens: they are a hit like a new
    request's (docs/CLIENT.md, section 4)."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([E(K.RESUMED, "a", num_computed_tokens=4, block_ids=(0, 9))])
    out = m.materialize(save(m, [Part("a", 1, [0, 9], 4, 4)], BS), ["a"])
    assert out.num_hit_tokens["a"] == 4
    assert torch.equal(out.hidden_states["a"], expect(1, 4, 1, 4, 4))


def test_an_aborted_requests_rows_of_its_last_step_still_land(mgr):
    """Rows that entered the batch land in the cache, abort included: a later hit on them is exact."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    sid = save(m, [Part("a", 1, [0, 1], 0, 8)], BS)
    m.new_step_starts([aborted("a")])
    m.discard_step(sid)
    m.new_step_starts([started("b", [0, 1, 3], hit=8)])
    sid = save(m, [Part("b", 4, [0, 1, 3], 8, 1)], BS)
    assert torch.equal(m.materialize(sid, ["b"]).hidden_states["b"], expect(1, 8, 4, 8, 1))


def test_an_id_finished_and_added_again_in_one_step_is_a_new_request_with_its_hit(mgr):
    """The adapter's ordering rule: a finish precedes a re-add of the same id in one step, whatever order the
    events come in; the re-added request is a new one, and its hit is served."""
    m = mgr()
    m.new_step_starts([started("a", [0, 1])])
    m.discard_step(save(m, [Part("a", 1, [0, 1], 0, 8)], BS))
    m.new_step_starts([started("a", [0, 4], hit=4), finished("a")])  # out of order on purpose
    out = m.materialize(save(m, [Part("a", 2, [0, 4], 4, 3)], BS), ["a"])
    assert out.num_hit_tokens["a"] == 4
    assert torch.equal(out.hidden_states["a"], expect(1, 4, 2, 4, 3))


def test_buffers_rewritten_after_save_change_neither_materialize_nor_the_pool(mgr):
    """``save_outputs`` takes everything ``materialize`` and the pool need: the forward's buffers, rewritten by
    the next step, change neither the step's result nor the rows a later hit serves (an immediate key and a
    deferred one)."""
    m = mgr(policy=ModelCachePolicy(deferred_keys=frozenset({"feat"})))
    m.new_step_starts([started("a", [0, 1])])
    h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8)], BS)
    sid = m.save_outputs(h, mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)
    h.fill_(-9.0)
    mm["feat"].fill_(-9.0)
    out = m.materialize(sid, ["a"])
    assert torch.equal(out.hidden_states["a"], rows(1, range(8)))
    assert torch.equal(out.mm_outputs["a"]["feat"], expect(0, 0, 1, 0, 8, mm=True))
    m.new_step_starts([finished("a")])  # the deferred write lands
    m.new_step_starts([started("b", [0, 1, 5], hit=8)])
    out = m.materialize(save(m, [Part("b", 2, [0, 1, 5], 8, 1)], BS), ["b"])
    assert torch.equal(out.hidden_states["b"], expect(1, 8, 2, 8, 1))
    assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 8, 2, 8, 1, mm=True))


def test_a_save_past_the_staging_depth_waits_for_a_discard_on_another_thread(mgr):
    """A save that finds every staging page held by an unconsumed step id waits (up to
    ``staging_claim_timeout_s``) for one to be consumed, on any thread, then goes on."""
    m = mgr(staging_claim_timeout_s=5.0)
    m.new_step_starts([started("a", [0, 1, 2, 3])])
    ids = []
    for i in range(3):
        if i:
            m.new_step_starts([extended("a", i)])
        ids.append(save(m, [Part("a", 1, [0, 1, 2, 3], i, 1)], BS))
    m.new_step_starts([extended("a", 3)])
    later = threading.Timer(0.3, m.discard_step, args=(ids[0],))  # the save below must wait for it
    later.start()
    t0 = time.monotonic()
    sid = save(m, [Part("a", 1, [0, 1, 2, 3], 3, 1)], BS)
    waited = time.monotonic() - t0
    later.join()
    assert 0.25 < waited < 5.0, waited
    for s in (ids[1], ids[2], sid):
        m.discard_step(s)


def test_a_plain_miss_logs_nothing(mgr, caplog):
    """A step with no hit is the common case: it logs nothing at INFO or above."""
    m = mgr()
    with caplog.at_level(logging.DEBUG, logger="omnishm"):
        m.new_step_starts([started("q", [7])])
        out = m.materialize(save(m, [Part("q", 1, [7], 0, 3)], BS), ["q"])
    assert torch.equal(out.hidden_states["q"], rows(1, range(3)))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_contract_errors_carry_the_step_id_and_the_request(mgr):
    """Errors name request, tensor and step id in their attributes as in their message: a step id consumed
    twice or never saved, a step larger than the staging page, a hit whose rows are absent."""
    m = mgr()
    blocks = list(range(10))
    m.new_step_starts([started("a", blocks)])
    s0 = save(m, [Part("a", 1, blocks, 0, 1)], BS)
    m.discard_step(s0)
    with pytest.raises(OmniPrefixCacheUnmatchError) as twice:
        m.discard_step(s0)
    assert twice.value.step_id == s0
    with pytest.raises(OmniPrefixCacheUnmatchError) as never:
        m.materialize(42, ["a"])
    assert never.value.step_id == 42
    m.new_step_starts([extended("a", 1)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="staging_capacity_tokens") as large:
        save(m, [Part("a", 1, blocks, 1, 33)], BS)  # 33 rows, a 32-row page
    assert large.value.step_id == s0 + 1
    m.new_step_starts([finished("a"), started("b", [12, 13], hit=4)])  # block 12 was never written
    sid = save(m, [Part("b", 3, [12, 13], 4, 2)], BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="absent") as absent:
        m.materialize(sid, ["b"])
    assert (absent.value.req_id, absent.value.step_id) == ("b", sid) and absent.value.key is not None


# MUTATION REVIEW (stop 51): PrefixCacheConfig's timeouts and from_vllm_config's overrides.
@pytest.mark.parametrize("name", ["staging_claim_timeout_s", "commit_timeout_s", "reconnect_timeout_s"])
@pytest.mark.parametrize("value", [0, 0.0, -1.0])
def test_a_timeout_of_zero_or_less_is_refused_naming_the_knob(name, value):
    """Contract: a timeout is a number of seconds in (0, MAX_TIMEOUT_S]; a PrefixCacheConfig built directly
    (the manager takes it as given) refuses 0 or less with a ValueError naming the knob, instead of a config
    whose every commit, staging or reconnect wait fails at once. Kills the mutant that lets 0 through
    (``0 <= value``)."""
    with pytest.raises(ValueError, match=rf"PrefixCacheConfig\.{name} must be a number of seconds in \(0, "):
        PrefixCacheConfig(num_blocks=16, block_size=4, **{name: value})


def test_an_explicit_override_beats_the_capacity_sized_from_vllm():
    """Contract (seed ``from_vllm_config(..., **overrides)``): the staging capacity is sized from
    ``max_num_batched_tokens`` unless the caller names ``staging_capacity_tokens`` itself; the caller's value
    wins. Kills the mutant that applies the overrides before the derived capacity (the override was lost)."""
    sc = SimpleNamespace(max_num_batched_tokens=2048, max_model_len=4096)
    cfg = PrefixCacheConfig.from_vllm_config(num_blocks=2, block_size=16, scheduler_config=sc,
                                             staging_capacity_tokens=512, staging_depth=3)
    assert (cfg.staging_capacity_tokens, cfg.staging_depth) == (512, 3)
