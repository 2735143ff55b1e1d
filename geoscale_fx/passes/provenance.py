"""Provenance: from an attention operand back to a projection and a normalized input.

``trace_operand`` finds the single projection ``P = x W (+ b)`` feeding a query or key operand
and replays the path in between (``tracking.replay``), a normalization after the projection
(QK-norm) included as one unit; ``normalization.trace_normalized_input`` walks from ``x`` back
to the normalization that bounds it; ``head_rows`` turns the operand's index tensors into
per-head feature lists. All failures raise ``Unsupported`` naming the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.passes import broadcast as bc
from geoscale_fx.passes.graph_ops import (
    VALUE_CASTS, ValueKinds, arg, op_of, parameter_name, scalar_constant, shape_of,
)
from geoscale_fx.passes.normalization import (
    VIEWS, NormalizedInput, norm_input, same_value, strip_casts, trace_normalized_input,
)
from geoscale_fx.passes.tracking import AngleChecker, Track, Unsupported, replay

__all__ = ["ProjectionOp", "NormalizedInput", "NormUnit", "OperandTrace", "trace_operand",
           "trace_normalized_input", "head_rows", "HeadRows"]


@dataclass(frozen=True)
class ProjectionOp:
    """``root = x @ W (+ bias)``: the node whose output features the trackers index."""
    root: Node
    x: Node
    weight: Node
    layout: str                   # "linear": W (F, d);  "dense": W (d, F)
    bias: Optional[Node]


@dataclass
class OperandTrace:
    projection: ProjectionOp
    track: Track
    norm_unit: Optional["NormUnit"] = None    # the QK-norm the operand is made of, if any


def _weight_of(node: Node, kinds: ValueKinds) -> Optional[ProjectionOp]:
    op = op_of(node)
    if op == "linear":
        x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
        if kinds.is_activation(x) and kinds.is_param(w) and (b is None or kinds.is_param(b)):
            return ProjectionOp(node, x, w, "linear", b)
    elif op == "addmm":
        b, x, w = node.args[0], node.args[1], node.args[2]
        if node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1 and \
                kinds.is_param(b) and kinds.is_activation(x) and kinds.is_param(w):
            return ProjectionOp(node, x, w, "dense", b)
    elif op == "matmul":
        x, w = node.args[0], node.args[1]
        if kinds.is_activation(x) and kinds.is_param(w) and len(shape_of(w) or ()) == 2:
            return ProjectionOp(node, x, w, "dense", None)
    elif op == "add":  # ``linear(x, W) + b`` written out
        for p, b in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if isinstance(p, Node) and kinds.is_param(b):
                inner = _weight_of(p, kinds)
                features = (shape_of(p) or (0,))[-1]
                if inner is not None and inner.bias is None and \
                        shape_of(b) == (features,) and len(p.users) == 1:
                    return ProjectionOp(node, inner.x, inner.weight, inner.layout, b)
    return None


@dataclass(frozen=True)
class NormUnit:
    """A normalization after the projection (QK-norm): ``end`` is its last per-channel op."""
    id: int
    end: Node
    input: Node                   # the normalized tensor (its elements map 1:1 to ``end``'s)
    norm: "NormalizedInput"


def _norm_unit(node: Node, kinds: ValueKinds, unit_id: int) -> Optional[NormUnit]:
    """``node`` as the end of a normalization over the last dim of an activation, or None.

    Its per-channel ops must be parameters (never a rotary table, which a length-1 decode
    step would make look per-channel).
    """
    if op_of(node) in VALUE_CASTS or op_of(node) in VIEWS:
        return None     # the unit ends at the norm or at its last gain, not at a view of it
    try:
        norm = trace_normalized_input(node, kinds, node)
    except Unsupported:
        return None
    if any(isinstance(v, Node) and _trig_table(v) for _, v in norm.channel_ops):
        return None
    source = norm_input(norm.node)
    if source is None or not kinds.is_activation(source):
        return None
    return NormUnit(unit_id, node, source, norm)


def _trig_table(node: Node) -> bool:
    from geoscale_fx.passes.tracking import _trig_origin

    return _trig_origin(node) is not None


def find_projection(operand: Node, kinds: ValueKinds, role: str
                    ) -> tuple[ProjectionOp, set, dict[Node, NormUnit]]:
    """The unique projection feeding ``operand``, the nodes visited on the way back, and the
    normalizations after the projection (QK-norm), keyed by their last node."""
    frontier: dict[Node, ProjectionOp] = {}
    units: dict[Node, NormUnit] = {}
    visited, stack, sources = set(), [operand], []
    while stack:
        node = stack.pop()
        if node in visited:
            continue
        visited.add(node)
        found = _weight_of(node, kinds)
        if found is not None:  # an ``add`` root stops the walk before the linear under it
            frontier[found.root] = found
            continue
        unit = _norm_unit(node, kinds, len(units) + 1)
        if unit is not None:   # jump over the normalization's internals
            units[node] = unit
            stack.append(unit.input)
            continue
        inputs = [n for n in node.all_input_nodes if kinds.is_activation(n)]
        if node.op == "placeholder":
            sources.append(node)
        stack.extend(inputs)
    roots = frontier
    if len(roots) == 1:
        return next(iter(roots.values())), visited, units
    if not roots:
        where = f"graph input `{sources[0].name}`" if sources else "no parameterised projection"
        raise Unsupported(f"the {role} `{operand.name}` is not a projection of a normalized "
                          f"input: it comes from {where}")
    names = ", ".join(f"`{r.name}`" for r in roots)
    raise Unsupported(f"the {role} `{operand.name}` mixes {len(roots)} projections ({names})")


def trace_operand(operand: Node, kinds: ValueKinds, checker: AngleChecker, role: str,
                  order: dict[Node, int]) -> OperandTrace:
    projection, visited, units = find_projection(operand, kinds, role)
    jumps: dict[Node, list[Node]] = {}
    for unit in units.values():
        jumps.setdefault(unit.input, []).append(unit.end)
    on_path, stack = set(), [projection.root]
    while stack:  # forward from the root, staying inside the backward-visited set
        node = stack.pop()
        if node in on_path:
            continue
        on_path.add(node)
        stack.extend(u for u in node.users if u in visited)
        stack.extend(jumps.get(node, ()))
    if operand not in on_path:
        raise Unsupported(f"`{operand.name}` is not reachable from `{projection.root.name}`")
    path = sorted(on_path, key=order.__getitem__)
    env = replay(path, projection.root, checker,
                 {u.end: (u.input, u.id) for u in units.values()})
    track = env[operand]
    if not isinstance(track, Track):
        raise Unsupported(f"the {role} `{operand.name}` is half of a rotary embedding")
    src = bc.compact(track.src)
    if not bool((src == src.reshape(-1)[0]).all()):
        raise Unsupported(f"the {role} `{operand.name}` mixes normalized and unnormalized "
                          "channels of its projection")
    unit_id = int(src.reshape(-1)[0])
    unit = next((u for u in units.values() if u.id == unit_id), None)
    return OperandTrace(projection, track, unit)


# --------------------------------------------------------------------------------------
# Heads at the operand
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadRows:
    features: tuple[tuple[int, ...], ...]   # per head, in first-appearance order
    head_of_row: torch.Tensor               # head index per leading position, leading shape
    gain: float
    rotation: float                         # 0: not rotated
    partial_rotation: bool


def head_rows(track: Track, node: Node, role: str) -> HeadRows:
    """Per-head feature lists at an operand shaped ``(*leading, L, d_h)``."""
    if len(track.shape) < 2:
        raise Unsupported(f"the {role} `{node.name}` has shape {track.shape}")
    width = track.shape[-1]
    tok, feat = bc.compact(track.tok), bc.compact(track.feat)
    if not bool((tok == tok[..., :1]).all()):
        raise Unsupported(f"the {role} `{node.name}` mixes tokens within a head vector")
    if not bool((feat == feat[..., :1, :]).all()):
        raise Unsupported(f"the {role} `{node.name}` uses different weights at different "
                          "positions")
    gains = bc.compact(track.gain).reshape(-1)
    if not bool((gains == gains[0]).all()):
        raise Unsupported(f"the {role} `{node.name}` is scaled non-uniformly")
    rows_by_lead = feat[..., 0, :].expand(*feat.shape[:-2], width)      # (compact lead, d_h)
    rows = rows_by_lead.reshape(-1, width).tolist()
    index: dict[tuple, int] = {}
    head_of_row = [index.setdefault(tuple(r), len(index)) for r in rows]
    lead = track.shape[:-2]
    head_map = torch.tensor(head_of_row).view(rows_by_lead.shape[:-1]).expand(lead)
    rot = bc.compact(track.rot)
    rotated = rot > 0
    rotation = float(rot.max()) if bool(rotated.any()) else 0.0
    return HeadRows(tuple(index), head_map, float(gains[0]), rotation,
                    bool(rotated.any() and not rotated.all()))


def parameter_names(projection: ProjectionOp) -> tuple[str, str]:
    weight = strip_casts(projection.weight)
    bias = projection.bias
    return (parameter_name(weight) if weight.op == "placeholder" else weight.name,
            "" if bias is None else parameter_name(bias) if bias.op == "placeholder"
            else bias.name)
