"""The values' side of a site, for their amax bound; or why it could not be traced.

Never makes a site unsupported: the logits do not depend on the values. The value operand is
SDPA's third argument, or the right operand of the explicit form's probabilities · V
product; it is traced to its projection as a query or key is (a LoRA adapter on it folds
into its weight), and returned as ``{"value": Side}`` or ``{"value_reason": why}``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, arg, matmul_operands, op_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.logit_terms import term_sides
from geoscale_fx.analysis.sides.operand_sides import side_of
from geoscale_fx.analysis.sides.provenance import head_rows, trace_operand
from geoscale_fx.analysis.index.replay_records import ReplayRecords

__all__ = ["value_side", "value_operand"]


def value_operand(cand: Candidate) -> Optional[Node]:
    """SDPA's third argument, or the right operand of the explicit form's probabilities · V
    product; None when there is no such node (an opaque attention)."""
    if cand.kind == "sdpa":
        value = arg(cand.node, 2, "value")
    else:
        pv = cand.roles.get("pv")
        value = matmul_operands(pv)[1] if pv is not None and op_of(pv) in (
            "matmul", "bmm") else None
    return value if isinstance(value, Node) else None


def value_side(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    """``{"value": Side}``, or ``{"value_reason": str}`` saying why there is none."""
    value = value_operand(cand)
    if value is None:
        return {"value_reason": "no value operand found"}
    records = ReplayRecords(evaluator)
    try:
        trace = trace_operand(value, kinds, records, "value", order)
        rows = head_rows(trace.track, value, "value")
        if len(trace.projections) == 1:
            return {"value": side_of(trace, rows, records, kinds)}
        # several projections: a map added to the values' projection (LoRA on v) folds
        # into its weight as for q and k; anything else is not one side
        channels = list(range(trace.track.shape[-1]))
        sides = term_sides(cand, "value", trace, trace.track, rows, channels, records, kinds)
        if len(sides) != 1:
            raise Unsupported(f"the value `{value.name}` comes from several inputs (an "
                              "adapter with dropout): no single side bounds it")
        return {"value": replace(sides[0], position_gain=1.0)}
    except Unsupported as exc:
        return {"value_reason": str(exc)}
