"""What replaying a query/key path records besides its tracks, for the analysis to read.

``index_replay.replay`` follows the ops from a projection to an attention operand; some of them
are not data movement and leave a record here, each read by one step of the analysis:

- ``rotaries`` / ``partners``: every rotary embedding proven a rotation (``analysis.rotary.rotary_replay``),
  and the (feature, partner) pairs it rotates together — side assembly and the rotation
  checks read them;
- ``norms``: QK-norm units (a normalization after the projection), ``unit → (width,
  position of each projection feature)`` — a side made of such a unit reads them;
- ``multipliers``: per-position scalar multipliers of the query (Llama-4's attention
  temperature), ``(max |t|, features multiplied)`` — the side's ``position_gain``;
- ``sums``: a second map of the projection's features added to it (a LoRA adapter's
  ``s·B(A x)`` added to ``W x``), ``(features kept, features added, s)`` — the adapter fold.

Example::

    records = ReplayRecords(lambda node: None)      # nothing evaluable
    records.record_norm(0, 64, {3: 0})
    assert records.norms == {0: (64, {3: 0})}
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.index.index_track import Track
from geoscale_fx.sites.terms import Rotary

__all__ = ["ReplayRecords"]


class ReplayRecords:
    """The records of one operand's replay; ``evaluate`` gives a node's value from the
    parameters, buffers and constants (None when it cannot)."""

    def __init__(self, evaluate: Callable[[Node], torch.Tensor | None],
                 is_constant: Callable[[Node], bool] | None = None):
        self._evaluate = evaluate
        kinds = getattr(evaluate, "kinds", None)
        self._is_constant = is_constant or (kinds.is_constant if kinds is not None
                                            else (lambda node: False))
        self.reset()

    def reset(self) -> None:
        """Forget every record (a replay that was refused is not the operand's trace)."""
        self.rotaries: list[Rotary] = []
        self.norms: dict[int, tuple[int, dict[int, int]]] = {}   # unit → (width, positions)
        #: (feature, the feature it rotates with) of every rotated element, as index tensors
        self.partners: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: (bound on |t|, features it multiplied) of each per-position scalar multiplier
        self.multipliers: list[tuple[float, torch.Tensor]] = []
        #: (features kept, features added to them, ratio of gains): a sum of two maps of
        #: the projections' outputs (a LoRA adapter's ``B A x`` added to ``W x``)
        self.sums: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def record(self, rotary: Rotary) -> None:
        self.rotaries.append(rotary)

    def record_norm(self, unit: int, width: int, positions: dict[int, int]) -> None:
        self.norms[unit] = (width, positions)

    def evaluate(self, node: Node) -> Optional[torch.Tensor]:
        value = self._evaluate(node)
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return None
        return value

    def multiplier(self, table: Node, track: Track) -> Optional[float]:
        """``max |t|`` if ``table`` is a table of constants equal along the last dim (one
        scalar per position or head), else None; a found one is recorded."""
        if not self._is_constant(table):
            return None
        values = self.evaluate(table)
        if values is None or values.is_complex() or values.dim() == 0:
            return None
        if values.shape[-1] != 1 and not bool((values == values[..., :1]).all()):
            return None
        bound = float(values.double().abs().max())
        self.multipliers.append((bound, bc.compact(track.feat).reshape(-1).unique()))
        return bound
