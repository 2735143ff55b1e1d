"""One side of a logit term (``site_terms.Side``) from what the analysis traced.

A side is ``q_h = R(A_hᵀ x̂ + c_h)``: the normalized ``Source`` ``x̂`` the projection reads
(or the QK-norm unit the operand is made of, or the tensor bounded by value that the operand
is a view of: then the side has no weight of its own), the
projection's weight and bias, the features of each head, the rotary embedding ``R`` replay
recorded and the scalar gains on the way (``operand_gain``; ``position_gain``: per-position
multipliers such as Llama-4's attention temperature, ``max |t|``).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.fx import Node

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, shape_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import (
    HeadRows, NormalizedInput, OperandTrace, ProjectionOp, parameter_names,
    trace_normalized_input,
)
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import rotated_partners
from geoscale_fx.analysis.norms.parameter_bound import trace_value_bound
from geoscale_fx.sites.terms import Side, Source

__all__ = ["source_of", "input_source", "side_of", "bounded_side", "projection_side",
           "side_rotary", "position_gain"]


def source_of(norm: NormalizedInput, channel_index: tuple[int, ...] = ()) -> Source:
    """The site's ``Source`` for a traced normalized input (graph nodes by name)."""
    channel_ops = tuple((kind, v.name if isinstance(v, Node) else float(v))
                        for kind, v in norm.channel_ops)
    return Source(norm=norm.norm, node=norm.node.name, width=norm.model_dim,
                  channel_ops=channel_ops, radius_factor=norm.radius_factor,
                  channel_index=channel_index)


def input_source(x: Node, kinds: ValueKinds, projection: Node) -> Source:
    """The ``Source`` a projection reads: its normalized input, else (no normalization
    before it) a source bounded by the values of the parameters it is computed from
    (``analysis.norms.parameter_bound``: ``‖x‖ ≤ ρ``, no channel ops). Raises the normalization walk's
    ``Unsupported`` (its reason) when neither bounds ``x``."""
    try:
        return source_of(trace_normalized_input(x, kinds, projection))
    except Unsupported as refusal:
        expr = trace_value_bound(x, kinds)
        if expr is None:
            raise refusal
        return Source(norm="bounded", node=x.name, width=(shape_of(x) or (0,))[-1],
                      radius_expr=expr)


def side_of(trace: OperandTrace, rows: HeadRows, records: ReplayRecords, kinds: ValueKinds,
            features=None, offset: int = 0) -> Side:
    """A side from its operand's trace: the projection's normalized input, or the QK-norm
    the operand is made of (then the side has no weight of its own)."""
    unit = trace.norm_unit
    if trace.projection.layout == "bounded":
        return bounded_side(trace, rows, kinds, features)
    if unit is None:
        source = input_source(trace.projection.x, kinds, trace.projection.root)
        side = projection_side(trace.projection, rows, source, records.rotaries,
                               features=features)
    else:
        width, position = records.norms[unit.id]
        n_features = (shape_of(trace.projection.root) or (0,))[-1]
        index = tuple(position.get(f + offset, -1) for f in range(n_features))
        rotary = side_rotary(rows, records.rotaries)
        side = Side(source=source_of(unit.norm, index), weight=None, layout="identity",
                    features=features if features is not None else rows.features,
                    rotary=rotary, operand_gain=rows.gain)
    if side.rotary is None:
        return side
    return replace(side, pairs=rotated_partners(side.features, offset, records))


def bounded_side(trace: OperandTrace, rows: HeadRows, kinds: ValueKinds,
                 features=None) -> Side:
    """The side of an operand that is a view of a tensor ``x`` bounded by value
    (``provenance.bounded_root``): no weight, ``A_h`` the identity on the head's channels
    of ``x`` (``diag(g)`` of a normalization's gain). Each head vector is a slice of one of
    ``x``'s token vectors (``head_rows`` refused mixed tokens), so ``‖x̂_h‖ ≤ ‖x̂‖ ≤ ρ`` —
    provided no channel appears twice in a head (an ``expand`` along the features)."""
    x = trace.projection.root
    features = features if features is not None else rows.features
    for head in features:
        if len(set(head)) != len(head):
            raise Unsupported(f"a head vector repeats channels of `{x.name}` (broadcast along "
                              "the features): its norm may exceed the bound on one vector")
    source = replace(input_source(x, kinds, x), channel_index=tuple(range(shape_of(x)[-1])))
    return Side(source=source, weight=None, layout="identity", features=features,
                operand_gain=rows.gain)


def side_rotary(rows: HeadRows, rotaries):
    """The side's ``Rotary`` (None when nothing reaching the operand was rotated)."""
    if rows.rotation <= 0:
        return None
    if not rotaries:
        raise Unsupported("internal: rotation without a recorded rotary embedding")
    # stacked rotations: the factor is their product (rows.rotation), verified only if all are
    return replace(rotaries[-1], factor=rows.rotation, partial=rows.partial_rotation,
                   pairing_verified=all(r.pairing_verified for r in rotaries))


def projection_side(trace_proj: ProjectionOp, rows: HeadRows, source: Source, rotaries,
                    features=None, bias_offset: int = 0) -> Side:
    """The site-facing description of one side (``rows``: what reached the operand,
    ``source``: what the projection reads)."""
    rotary = side_rotary(rows, rotaries)
    weight_param, bias_param = parameter_names(trace_proj)
    return Side(
        source=source, weight=trace_proj.weight.name, layout=trace_proj.layout,
        features=features if features is not None else rows.features,
        bias=trace_proj.bias.name if trace_proj.bias is not None else None, rotary=rotary,
        weight_param=weight_param, bias_param=bias_param, bias_offset=bias_offset,
        operand_gain=rows.gain, cast=trace_proj.cast)


def position_gain(cand: Candidate, role: str, rows: HeadRows, records: ReplayRecords
                  ) -> float:
    """The product of the per-position multipliers' bounds applied to the whole operand (a
    multiplier of part of a head vector is not a scalar on it: refused)."""
    gain = 1.0
    if not records.multipliers:
        return gain
    features = torch.tensor([f for head in rows.features for f in head]).unique()
    for bound, covered in records.multipliers:
        inside = torch.isin(features, covered.long())
        if not bool(inside.any()):
            continue
        if not bool(inside.all()):
            raise Unsupported(f"`{cand.node.name}`: a per-position multiplier scales part of "
                              f"the {role}'s head vectors")
        gain *= bound
    return gain
