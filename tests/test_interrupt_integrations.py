"""A signal handler's exception anywhere in an integration's step turns the cache sticky.

REVIEW (stop 58, a sweep of interrupts after every C call of the V1 hooks' ``execute_model``): cut after
``new_step_starts`` and before ``save_outputs``' own ``try`` (the prompt tracking, the runner's forward, the
write layout and its token tags), the step's slots kept their previous tenant's claims while the engine counted
them written, and nothing was sticky: an engine that went on had a later hit refused by the token check, or,
without token ids (prompt embeddings, ``token_check=False``), served the previous tenant's rows. Cut inside
``translate_scheduler_output`` after the adapter committed its live requests, the manager never saw the step.
The integrations now hand such an exception to ``OmniPrefixCacheManager.note_interrupt``, and the adapter
commits last. The hook is the suite's own (``interrupt_after_c_call``, tests/test_interrupt_safety.py).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import torch

from manager_helpers import rows
from omnishm.client import OmniPrefixCacheUnmatchError
from omnishm.integrations.vllm import OmniPrefixCacheRunnerHooks
from test_interrupt_safety import gets_through, interrupt_after_c_call
from test_vllm_hooks import FakeV1Runner

FAMILY = {"A": 1, "B": 2, "C": 2}
"""Each request's rows and token ids: C is B's prompt again."""


def _tokens(req: str, n: int) -> list[int]:
    return [FAMILY[req] * 100 + i for i in range(n)]


def _so(new, finished=()):
    """A scheduler output of new requests only: (req, prompt_len, computed, blocks), each scheduling the rest
    of its prompt."""
    counts = {r: p - c for r, p, c, _ in new}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=_tokens(r, p), prompt_embeds=None,
                                            num_computed_tokens=c, block_ids=(list(b),)) for r, p, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        finished_req_ids=set(finished), preempted_req_ids=set())


class _FamilyRunner(FakeV1Runner):
    """Rows by request family; with ``token_ids`` the batch keeps CPU token ids (vLLM's ``token_ids_cpu``), so
    the writer tags rows with their tokens and checks hits against them."""

    def __init__(self, token_ids: bool):
        super().__init__()
        self.prompt_len: dict[str, int] = {}
        if token_ids:
            self.input_batch.token_ids_cpu = np.zeros((4, 64), dtype=np.int64)
            self.input_batch.num_prompt_tokens = np.zeros(4, dtype=np.int64)

    def _update_states(self, s):
        for new in s.scheduled_new_reqs:
            self.prompt_len[new.req_id] = len(new.prompt_token_ids)
        super()._update_states(s)
        if hasattr(self.input_batch, "token_ids_cpu"):
            for row, r in enumerate(self.input_batch.req_ids):
                t = _tokens(r, self.prompt_len[r])
                self.input_batch.token_ids_cpu[row, :len(t)] = t
                self.input_batch.num_prompt_tokens[row] = len(t)

    def execute_model(self, s, intermediate_tensors=None):
        self._update_states(s)
        if not s.total_num_scheduled_tokens:
            return None
        parts = [rows(FAMILY[r], range(self.state[r][1], self.state[r][1] + s.num_scheduled_tokens[r]))
                 for r in self.input_batch.req_ids]
        self.execute_model_state = SimpleNamespace(hidden_states=torch.cat(parts))
        return None


def _step(runner, s):
    try:
        return runner.execute_model(s)
    finally:
        runner.execute_model_state = None


@pytest.mark.parametrize("token_ids", [False, True], ids=["no-token-ids", "token-ids"])
def test_an_interrupt_after_any_c_call_of_a_hooked_step_turns_the_cache_sticky(committer, monkeypatch, token_ids):
    """A computes blocks 0-1; the cut step ends A and gives B (another prompt) the same blocks; the next step
    ends B and gives C, B's prompt again, a 4-token hit on block 0. Cut after each C call omnishm makes in
    ``execute_model`` (every k): the next step raises the sticky error (never serves A's rows as C's), and
    ``uninstall`` finishes within a few seconds."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    k = 0
    while True:
        k += 1
        runner = _FamilyRunner(token_ids)
        h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
        h.install()
        try:
            _step(runner, _so([("A", 8, 0, [0, 1])]))
            where = interrupt_after_c_call(k, "execute_model", lambda: _step(
                runner, _so([("B", 8, 0, [0, 1])], finished=["A"])))
            if where is None:  # k passed the step's last C call: it ran through; the next step serves B's rows
                _step(runner, _so([("C", 8, 4, [0, 2])], finished=["B"]))
                assert torch.equal(h.take_results()["C"][0], rows(2, range(8)))
                break
            with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\(sticky; "):
                _step(runner, _so([("C", 8, 4, [0, 2])], finished=["B"]))
        finally:
            t0 = time.monotonic()
            assert gets_through(h.uninstall, 20), "uninstall did not finish"
            assert time.monotonic() - t0 < 5
    assert k > 100, k  # it did reach through the step


def test_the_adapter_commits_its_live_requests_last(monkeypatch):
    """An interrupt inside ``translate_scheduler_output`` leaves the adapter as it was: the same output
    translated again gives the same step (its ``FINISHED`` event included). Raised after each C call omnishm
    makes there, and once more as its step is built (a type call, which a profile hook does not see)."""
    from omnishm.client.adapter import PrefixCacheSchedulerAdapter
    import omnishm.client.adapter as adapter_module

    first, second = _so([("A", 8, 0, [0, 1])]), _so([("B", 8, 0, [0, 1])], finished=["A"])
    expected_adapter = PrefixCacheSchedulerAdapter()
    expected_adapter.translate_scheduler_output(first)
    expected = expected_adapter.translate_scheduler_output(second)
    k = 0
    while True:
        k += 1
        adapter = PrefixCacheSchedulerAdapter()
        adapter.translate_scheduler_output(first)
        if interrupt_after_c_call(k, "translate_scheduler_output",
                                  lambda: adapter.translate_scheduler_output(second)) is None:
            break
        assert adapter.translate_scheduler_output(second) == expected, k
    adapter = PrefixCacheSchedulerAdapter()
    adapter.translate_scheduler_output(first)

    class Interrupted(BaseException):
        pass

    def cut(*args, **kwargs):
        raise Interrupted()

    monkeypatch.setattr(adapter_module, "PrefixCacheStep", cut)
    with pytest.raises(Interrupted):
        adapter.translate_scheduler_output(second)
    monkeypatch.undo()
    assert adapter.translate_scheduler_output(second) == expected
    assert k > 5, k


class _FailingForward(_FamilyRunner):
    """Its forward raises (an out-of-memory, say) once ``fail`` is set, after updating its states."""

    fail = False

    def execute_model(self, s, intermediate_tensors=None):
        if self.fail:
            self._update_states(s)
            raise RuntimeError("forward failed")
        return super().execute_model(s, intermediate_tensors)


def test_a_forward_that_raises_in_a_hooked_step_turns_the_cache_sticky(committer, monkeypatch):
    """Any exception between ``new_step_starts`` and ``save_outputs``, not a signal's only: the step's slots keep
    their previous tenant's claims, so the cache turns sticky (``note_unsaved_step``). REVIEW (stop 58): an
    engine that went on after a forward's ``RuntimeError`` was served A's rows as C's (no token ids)."""
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    runner = _FailingForward(token_ids=False)
    h = OmniPrefixCacheRunnerHooks(runner, cache=committer.name)
    h.install()
    try:
        _step(runner, _so([("A", 8, 0, [0, 1])]))
        runner.fail = True
        with pytest.raises(RuntimeError, match="forward failed"):
            _step(runner, _so([("B", 8, 0, [0, 1])], finished=["A"]))
        runner.fail = False
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"step not saved \(sticky; .*execute_model ended in "
                                                              r"RuntimeError after new_step_starts"):
            _step(runner, _so([("C", 8, 4, [0, 2])], finished=["B"]))
    finally:
        h.uninstall()
