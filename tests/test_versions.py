"""Claim versions (omnishm/versions.py): every one is above ``ABSENT`` and names one claim.

From the mutation review of stop 51.
"""

from __future__ import annotations

import pytest

from omnishm.versions import ABSENT, MAX_EPOCH, MAX_SEQ, MAX_STEP, cv_epoch, cv_step, make_cv


def test_a_claim_version_of_epoch_zero_is_refused_so_no_claim_reads_as_absent():
    """Contract: every claim version is > 0 (``ABSENT`` is 0, and apply's fast path trusts ``lo > 0``), so
    ``make_cv`` refuses epoch 0: ``make_cv(0, 0, 0)`` would be ``ABSENT`` itself and any other epoch-0 cv
    would pass for no writer's. Kills the mutant that lets epoch 0 through (``0 <= epoch``)."""
    with pytest.raises(ValueError, match="claim version out of range: epoch=0"):
        make_cv(0, 0, 0)
    with pytest.raises(ValueError, match="epoch=0"):
        make_cv(0, 7, 3)
    assert make_cv(1, 0, 0) > ABSENT


def test_a_seq_or_step_past_its_field_is_refused_rather_than_aliasing_another_claim():
    """Contract: a claim version names one claim and is never reused, so a field past its bits raises
    instead of carrying into the next field: seq ``MAX_SEQ + 1`` of step 4 would equal seq 0 of step 5 (a
    reader's check would take a later tenant's row for the one it planned). Kills the mutants that widen the
    seq (or step/epoch) bound by one."""
    with pytest.raises(ValueError, match="out of range"):
        make_cv(1, 4, MAX_SEQ + 1)
    with pytest.raises(ValueError, match="out of range"):
        make_cv(1, MAX_STEP + 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        make_cv(MAX_EPOCH + 1, 0, 0)
    top = make_cv(MAX_EPOCH, MAX_STEP, MAX_SEQ)
    assert 0 < top < 1 << 63 and cv_epoch(top) == MAX_EPOCH and cv_step(top) == MAX_STEP
