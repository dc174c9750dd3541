"""Step contexts: what ``save_outputs`` snapshots for ``materialize``.

A ``StepCtx`` lives from the save that created its step id until that id is
consumed; while it lives it pins its hit slots (copy-on-write rescue keeps
the planned rows if the writer re-claims them) and, on the writer, holds its
staging page. Owned by the manager; mutated under the manager's state lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from omnishm.client.writes import RowSource
from omnishm.interface import ReqId, StepId, TensorName


@dataclass
class HitSpan:
    """One request's prefix hit: its slots and, per key, the claim versions it must read."""

    slots: torch.Tensor
    cvs: dict[TensorName, torch.Tensor]


@dataclass
class StepCtx:
    step_id: StepId
    req_ids: tuple[ReqId, ...]
    spans: dict[ReqId, tuple[int, int]]
    leftover: dict[TensorName, Any]
    step_rows: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    row_shapes: dict[TensorName, tuple[int, ...]] = field(default_factory=dict)
    hits: dict[ReqId, HitSpan] = field(default_factory=dict)
    """Hit requests; a step with hits is in the manager's ``_pinned`` until consumed."""
    rescue: dict[TensorName, dict[int, torch.Tensor]] = field(default_factory=dict)
    sources: dict[TensorName, RowSource] = field(default_factory=dict)
    """Writer: the step source of each immediate key (also in the manager's ``_step_sources``)."""
    page: int | None = None
    freeze_event: Any = None
    d2h_event: Any = None
    pending_send: Any = None
    """CUDA writer: the step's ``PendingSend`` (``client/device.py``); materialize sends it if still unsent."""
    leftover_events: list[Any] = field(default_factory=list)
    prefetched: dict[tuple[ReqId, TensorName], torch.Tensor] = field(default_factory=dict)
    prefetch_done: threading.Event | None = None
