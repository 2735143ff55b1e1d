"""Provenance: from an attention operand back to a projection and a normalized input.

``trace_operand`` finds the single projection ``P = x W (+ b)`` feeding a query or key operand
and replays the path in between (``index_replay.replay``), a normalization after the projection
(QK-norm) included as one unit; an L2 clip bounds its output whatever it reads, so the walk
stops there: its features are numbered from the tensor the clip's input is a view of; ``normalization.trace_normalized_input`` walks from ``x`` back
to the normalization that bounds it; ``head_rows`` turns the operand's index tensors into
per-head feature lists. All failures raise ``Unsupported`` naming the node.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.norms.assembled_writes import assembled_writes
from geoscale_fx.analysis.fx.graph_ops import (
    VALUE_CASTS, ValueKinds, arg, op_of, parameter_name, shape_of,
)
from geoscale_fx.analysis.index.index_replay import (
    RotaryTerm, Track, Unsupported, replay, trig_origin,
)
from geoscale_fx.analysis.norms.normalization import (
    VIEWS, NormalizedInput, keeps_last_dim, norm_input, strip_casts, trace_normalized_input,
)
from geoscale_fx.analysis.norms.bounded_operand import bounded_root
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.linears.registry import low_precision_linear, unrecognized_cast
from geoscale_fx.analysis.linears.subclass_weights import subclass_weight
from geoscale_fx.sites.linear_casts import LinearCast

__all__ = ["ProjectionOp", "NormalizedInput", "NormUnit", "OperandTrace", "trace_operand",
           "trace_normalized_input", "head_rows", "HeadRows", "projection_at"]


@dataclass(frozen=True)
class ProjectionOp:
    """``root = x @ W (+ bias)``: the node whose output features the trackers index."""
    root: Node
    x: Node
    weight: Optional[Node]
    #: "linear": W (F, d);  "dense": W (d, F);  "identity": no weight — ``root`` is what an
    #: L2 clip reads (through views), numbered as a projection's output would be;
    #: "bounded": no weight — the operand is a view of ``root``, whose token vectors are
    #: bounded by value (``bounded_root``)
    layout: str
    bias: Optional[Node]
    #: a low-rank chain ``linear(linear(x, A), B)`` (a LoRA adapter): W = B·A, ``inner`` = A
    inner: Optional[Node] = None
    #: a low-precision linear (an FP8 training linear, ``analysis.linears``): how it casts
    cast: Optional[LinearCast] = None


@dataclass
class OperandTrace:
    projection: ProjectionOp
    track: Track
    norm_unit: Optional["NormUnit"] = None    # the QK-norm the operand is made of, if any
    #: every projection the operand is made of (MLA's key: the latent up-projection and the
    #: decoupled RoPE key), with the offset of its features in ``track.feat``
    projections: tuple[tuple[ProjectionOp, int], ...] = ()
    units: tuple["NormUnit", ...] = ()

    def part(self, root: int, track: Track) -> "OperandTrace":
        """The trace of one projection's channels (``track``: those channels, global ids)."""
        projection, offset = self.projections[root]
        src = bc.compact(track.src)
        if not bool((src == src.reshape(-1)[0]).all()):
            raise Unsupported(f"the operand mixes normalized and unnormalized channels of "
                              f"`{projection.root.name}`")
        unit_id = int(src.reshape(-1)[0])
        unit = next((u for u in self.units if u.id == unit_id), None)
        return OperandTrace(projection, track, unit, ((projection, offset),), self.units)

    def root_of(self, features: torch.Tensor) -> torch.Tensor:
        """Which projection each (global) feature id comes from."""
        bounds = torch.tensor([offset for _, offset in self.projections[1:]], dtype=torch.long)
        return torch.bucketize(features.long(), bounds, right=True)


def _weight_of(node: Node, kinds: ValueKinds) -> Optional[ProjectionOp]:
    op = op_of(node)
    if subclass_weight(node) is not None:      # what runs is not x·Wᵀ (MX training weights)
        return None
    if op == "linear":
        x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
        if kinds.is_activation(x) and kinds.is_param(w) and (b is None or kinds.is_param(b)):
            if b is None and op_of(x) == "linear" and len(x.users) == 1 and \
                    arg(x, 2, "bias") is None and kinds.is_param(x.args[1]) and \
                    kinds.is_activation(x.args[0]):
                return ProjectionOp(node, x.args[0], w, "linear", None, inner=x.args[1])
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
                    return replace(inner, root=node, bias=b)
    elif op is None:   # an opaque call: a low-precision linear (``analysis.linears``)?
        found = low_precision_linear(node, kinds)
        if found is not None:
            return ProjectionOp(node, found.x, found.weight, "dense", None, cast=found.cast)
    return None


def projection_at(node: Node, kinds: ValueKinds) -> Optional[ProjectionOp]:
    """``node`` as a projection ``x W (+ b)`` of an activation by parameters, or None."""
    return _weight_of(node, kinds)


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
    if op_of(node) not in ("mul", "div", "add", "sub", "layer_norm", "rms_norm"):
        return None     # the unit ends at the norm or at its last gain, not at a view of it
    try:
        norm = trace_normalized_input(node, kinds, node)
    except Unsupported:
        return None
    if any(isinstance(v, Node) and _trig_table(v) for _, v in norm.channel_ops):
        return None
    source = norm_input(norm.node, kinds)
    if source is None or not kinds.is_activation(source):
        return None
    return NormUnit(unit_id, node, source, norm)


def _trig_table(node: Node) -> bool:
    return trig_origin(node) is not None


def find_projection(operand: Node, kinds: ValueKinds, role: str
                    ) -> tuple[list[ProjectionOp], set, dict[Node, NormUnit], dict]:
    """The projections feeding ``operand`` (in graph order), the nodes visited on the way
    back, the normalizations after a projection (QK-norm) keyed by their last node, and the
    buffers assembled by in-place writes (``assembled_writes``)."""
    frontier: dict[Node, ProjectionOp] = {}
    units: dict[Node, NormUnit] = {}
    assembled: dict[Node, list] = {}
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
        refusal = unrecognized_cast(node, kinds) if op_of(node) is None else \
            subclass_weight(node)
        if refusal is not None:   # a low-precision product the bounds cannot see through
            raise Unsupported(f"the {role} `{operand.name}` comes through {refusal}")
        unit = _norm_unit(node, kinds, len(units) + 1)
        if unit is not None:   # jump over the normalization's internals
            units[node] = unit
            if unit.norm.norm == "l2clip":   # ‖clip‖ ≤ t whatever it reads: stop here
                root = _view_chain_start(unit.input, visited)
                frontier[root] = ProjectionOp(root, root, None, "identity", None)
            else:
                stack.append(unit.input)
            continue
        writes = assembled_writes(node)
        if writes is not None:  # ``new_empty`` + ``copy_`` into slices: what was written
            assembled[node] = writes
            stack.extend(src for _, _, src, _ in writes)
            continue
        inputs = [n for n in node.all_input_nodes if kinds.is_activation(n)]
        if node.op == "placeholder":
            sources.append(node)
        stack.extend(inputs)
    if not frontier:
        names = list(dict.fromkeys(n.name for n in sources))
        where = ("graph input" + ("s " if len(names) > 1 else " ")
                 + ", ".join(f"`{n}`" for n in names[:4]) + (" …" if len(names) > 4 else "")
                 + " (the caller's tensors, or values from before a graph break, which no "
                 "weight bounds)") if names else "no parameterised projection"
        raise Unsupported(f"the {role} `{operand.name}` is not a projection of a normalized "
                          f"input: it comes from {where}")
    return list(frontier.values()), visited, units, assembled


def _view_chain_start(node: Node, visited: set) -> Node:
    """The first tensor behind ``node`` through casts and views only (each added to
    ``visited``): the heads of a clipped ``(B, L, H, d_h)`` tensor are told apart by the
    features of the ``(B, L, H·d_h)`` tensor it is a view of."""
    for _ in range(32):
        visited.add(node)
        op = op_of(node)
        src = node.args[0] if node.args else None
        through = op in VALUE_CASTS or op in ("view", "reshape", "flatten") or \
            (op in VIEWS and keeps_last_dim(node, op))      # never tokens into the features
        if not isinstance(src, Node) or not through or not isinstance(shape_of(src), tuple):
            return node
        node = src
    return node


def trace_operand(operand: Node, kinds: ValueKinds, records: ReplayRecords, role: str,
                  order: dict[Node, int]) -> OperandTrace:
    """The operand's trace back to its projection(s); failing that, the operand as a view of
    a tensor bounded by value (``bounded_root``: a learned query vector, unweighted RMSNorm
    keys), with the first walk's refusal when neither holds."""
    try:
        return _trace_projections(operand, kinds, records, role, order)
    except Unsupported as refusal:
        found = bounded_root(operand, kinds)
        if isinstance(found, str):
            raise (Unsupported(f"{refusal}, and {found}") if _NO_PROJECTION in str(refusal)
                   else refusal) from None
        root, path = found
        records.reset()                  # what the refused walk recorded is not this trace's
        track = replay(path, {root: 0}, records)[operand]
        projection = ProjectionOp(root, root, None, "bounded", None)
        return OperandTrace(projection, track, None, ((projection, 0),), ())


_NO_PROJECTION = "no parameterised projection"


def _trace_projections(operand: Node, kinds: ValueKinds, records: ReplayRecords, role: str,
                       order: dict[Node, int]) -> OperandTrace:
    projections, visited, units, assembled = find_projection(operand, kinds, role)
    jumps: dict[Node, list[Node]] = {}
    for unit in units.values():
        jumps.setdefault(unit.input, []).append(unit.end)
    position = dict(order)
    for buffer, writes in assembled.items():
        for *_, src, copy in writes:
            jumps.setdefault(src, []).append(buffer)
        position[buffer] = max(order[copy] for *_, copy in writes)   # after its writes
    on_path, stack = set(), [p.root for p in projections]
    while stack:  # forward from the roots, staying inside the backward-visited set
        node = stack.pop()
        if node in on_path:
            continue
        on_path.add(node)
        stack.extend(u for u in node.users if u in visited)
        stack.extend(jumps.get(node, ()))
    if operand not in on_path:
        raise Unsupported(f"`{operand.name}` is not reachable from its projections")
    path = sorted(on_path, key=position.__getitem__)
    projections.sort(key=lambda p: order[p.root])
    offsets, total = [], 0
    for p in projections:
        offsets.append(total)
        total += (shape_of(p.root) or (0,))[-1]
    env = replay(path, {p.root: off for p, off in zip(projections, offsets)}, records,
                 {u.end: (u.input, u.id) for u in units.values()}, assembled)
    track = env[operand]
    if isinstance(track, RotaryTerm) and track.trig is None:
        raise Unsupported(f"`{track.via}`: mul of the {role} by `{track.table.name}`, which "
                          "is neither a constant nor a rotary cos/sin table")
    if not isinstance(track, Track):
        raise Unsupported(f"the {role} `{operand.name}` is half of a rotary embedding")
    trace = OperandTrace(projections[0], track, None, tuple(zip(projections, offsets)),
                         tuple(units.values()))
    if len(projections) > 1:
        return trace
    src = bc.compact(track.src)
    if not bool((src == src.reshape(-1)[0]).all()):
        raise Unsupported(f"the {role} `{operand.name}` mixes normalized and unnormalized "
                          "channels of its projection")
    return trace.part(0, track)


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
    if op_of(weight) in ("t", "transpose") and isinstance(weight.args[0], Node) and \
            strip_casts(weight.args[0]).op == "placeholder":   # ``W.t()``: name W
        weight = strip_casts(weight.args[0])
    bias = strip_casts(projection.bias)       # ``bias.to(dtype)``: name the bias
    return (parameter_name(weight) if weight.op == "placeholder" else weight.name,
            "" if bias is None else parameter_name(bias) if bias.op == "placeholder"
            else bias.name)
