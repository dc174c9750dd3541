"""Claim versions: the per-slot seqlock word of the claim and commit tables.

A claim version names one claim of a slot by one write, and is never reused
within a cache::

    cv = epoch << 48 | step << 16 | seq

``epoch`` is handed to a writer by the committer at attach (a new writer, a
new epoch), ``step`` is the writer's step id in which the slot was claimed,
``seq`` numbers the claims of that step. So a claim word alone tells whether
the row a reader planned at step N is still the one it needs: a claim of a
later step (or of another epoch) means the slot was reused after the plan.

The claim table (``int64[num_slots]``) is written only by the writer client;
the commit table only by the committer, after the row landed. A row is
``ABSENT`` when claim == 0, ``COMMITTED`` when commit == claim, ``IN_TRANSIT``
otherwise.
"""

from __future__ import annotations

import logging
import platform

EPOCH_BITS = 15
STEP_BITS = 32
SEQ_BITS = 16
MAX_EPOCH = (1 << EPOCH_BITS) - 1
MAX_STEP = (1 << STEP_BITS) - 1
MAX_SEQ = (1 << SEQ_BITS) - 1

ABSENT = 0


def make_cv(epoch: int, step: int, seq: int) -> int:
    if not (0 < epoch <= MAX_EPOCH and 0 <= step <= MAX_STEP and 0 <= seq <= MAX_SEQ):
        raise ValueError(f"claim version out of range: epoch={epoch} step={step} seq={seq}")
    return (epoch << (STEP_BITS + SEQ_BITS)) | (step << SEQ_BITS) | seq


def cv_epoch(cv: int) -> int:
    return cv >> (STEP_BITS + SEQ_BITS)


def cv_step(cv: int) -> int:
    return (cv >> SEQ_BITS) & MAX_STEP


_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
"""Machines whose stores and loads reach other processes in program order (x86's TSO): the seqlock's
only guard, since Python has no memory fence (README, "Platform")."""
_warned = False


def warn_if_weakly_ordered(log: logging.Logger) -> bool:
    """Log once per process, on a machine outside ``_ORDERED_MACHINES``, that the seqlock is not
    guaranteed there; returns whether this machine is one. Any thread (a lost race logs twice)."""
    global _warned
    machine = platform.machine().lower()
    if machine in _ORDERED_MACHINES:
        return False
    if not _warned:
        _warned = True
        log.warning("omnishm: this %s machine may reorder memory accesses between processes; the row "
                    "checks rely on x86-64's store order, and without a memory fence a reader could in "
                    "principle see a commit word before its row (README, \"Platform\")", machine)
    return True
