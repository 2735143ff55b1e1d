"""Provenance: from an attention operand back to a projection and a normalized input.

``trace_operand`` finds the single projection ``P = x W (+ b)`` feeding a query or key operand
and replays the path in between (``tracking.replay``); ``trace_normalized_input`` walks from
``x`` back to the normalization that bounds it (LayerNorm, RMSNorm fused or decomposed),
collecting per-channel gains/offsets; ``head_rows`` turns the operand's index tensors into
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


@dataclass(frozen=True)
class NormalizedInput:
    norm: str                     # "layernorm" | "rmsnorm"
    node: Node
    model_dim: int
    channel_ops: tuple            # (("mul" | "add", Node | float), ...) applied to x̂ in order
    radius_factor: float


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


#: ops that keep each token's feature vector (walked through on the way to a normalization)
_VIEWS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute",
          "contiguous", "getitem", "expand")


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
    if op_of(node) in VALUE_CASTS or op_of(node) in _VIEWS:
        return None     # the unit ends at the norm or at its last gain, not at a view of it
    try:
        norm = trace_normalized_input(node, kinds, node)
    except Unsupported:
        return None
    if any(isinstance(v, Node) and _trig_table(v) for _, v in norm.channel_ops):
        return None
    source = _norm_input(norm.node)
    if source is None or not kinds.is_activation(source):
        return None
    return NormUnit(unit_id, node, source, norm)


def _trig_table(node: Node) -> bool:
    from geoscale_fx.passes.tracking import _trig_origin

    return _trig_origin(node) is not None


def _norm_input(norm: Node) -> Optional[Node]:
    """The tensor a normalization node normalizes (for a hand-written LayerNorm: x, not
    x − mean(x), whose elements are not x's)."""
    op = op_of(norm)
    if op in ("layer_norm", "rms_norm"):
        return norm.args[0]
    source = _decomposed_rms(norm)
    if source is None:
        return None
    centered = _centered_source(source)
    return centered if centered is not None else source


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
# Normalized input
# --------------------------------------------------------------------------------------

def _strip_casts(node):
    while isinstance(node, Node) and op_of(node) in VALUE_CASTS:
        node = node.args[0]
    return node


def _is_last_dim(dim, ndim) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _is_last_dim(dim[0], ndim)
    return dim in (-1, ndim - 1)


def _mean_square_source(node: Node) -> Optional[Node]:
    """``a`` if ``node`` is ``mean(a², dim=-1, keepdim=True)`` (up to casts), else None."""
    node = _strip_casts(node)
    if op_of(node) != "mean":
        return None
    dim, keepdim = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    square = _strip_casts(node.args[0])
    ndim = len(shape_of(square) or ())
    if not keepdim or not _is_last_dim(dim, ndim):
        return None
    if op_of(square) == "pow" and scalar_constant(square.args[1]) == 2.0:
        return _strip_casts(square.args[0])
    if op_of(square) == "mul" and square.args[0] is square.args[1]:
        return _strip_casts(square.args[0])
    return None


def _rms_denominator_source(node: Node, invert: bool) -> Optional[Node]:
    """``a`` if ``node`` is ``rsqrt(mean(a²)+eps)`` (or ``sqrt(...)`` when ``invert``)."""
    node = _strip_casts(node)
    if op_of(node) != ("sqrt" if invert else "rsqrt"):
        return None
    inner = _strip_casts(node.args[0])
    if op_of(inner) == "add":
        for ms, eps in ((inner.args[0], inner.args[1]), (inner.args[1], inner.args[0])):
            value = scalar_constant(eps)
            if value is not None and value >= 0 and isinstance(ms, Node):
                return _mean_square_source(ms)
        return None
    return _mean_square_source(inner)


def _decomposed_rms(node: Node) -> Optional[Node]:
    """``a`` if ``node`` is ``a * rsqrt(mean(a²)+eps)`` or ``a / sqrt(mean(a²)+eps)``."""
    op = op_of(node)
    if op == "mul":
        pairs = ((node.args[0], node.args[1]), (node.args[1], node.args[0]))
        invert = False
    elif op == "div":
        pairs = ((node.args[0], node.args[1]),)
        invert = True
    else:
        return None
    for a, r in pairs:
        if isinstance(a, Node) and isinstance(r, Node):
            source = _rms_denominator_source(r, invert)
            if source is not None and same_value(source, _strip_casts(a)):
                return source
    return None


def same_value(a, b, depth: int = 4) -> bool:
    """Whether two graph values are the same computation: one node, or the same op on the
    same arguments (a hand-written LayerNorm computes ``x − mean(x)`` twice)."""
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
        return not isinstance(a, Node) and not isinstance(b, Node) and a == b
    if (a.op, a.target) != (b.op, b.target) or len(a.args) != len(b.args) or \
            a.kwargs != b.kwargs or a.op not in ("call_function", "call_method"):
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))


def _centered_source(node: Node) -> Optional[Node]:
    """``x`` if ``node`` is ``x − mean(x, -1, keepdim=True)`` (up to casts), else None."""
    node = _strip_casts(node)
    if op_of(node) != "sub" or not isinstance(node.args[1], Node):
        return None
    mean = _strip_casts(node.args[1])
    if op_of(mean) != "mean" or not arg(mean, 2, "keepdim", False):
        return None
    x = node.args[0]
    ndim = len(shape_of(x) or ())
    return x if _is_last_dim(arg(mean, 1, "dim"), ndim) and same_value(
        _strip_casts(mean.args[0]), _strip_casts(x)) else None


def _per_channel(value, d: int, kinds: ValueKinds) -> bool:
    if scalar_constant(value) is not None:
        return True
    if not kinds.is_param(value):
        return False
    shape = shape_of(value) or ()
    return all(s == 1 for s in shape[:-1]) and (not shape or shape[-1] in (1, d))


def trace_normalized_input(x: Node, kinds: ValueKinds, projection: Node) -> NormalizedInput:
    """Walk from a projection's input back to the normalization bounding ``‖x̂‖ ≤ √d``."""
    ops_after_norm: list = []        # collected backwards
    radius_factor, node = 1.0, x
    d = (shape_of(x) or (0,))[-1]
    for _ in range(64):
        op = op_of(node)
        if op == "layer_norm":
            shape = arg(node, 1, "normalized_shape")
            if len(tuple(shape)) != 1:
                raise Unsupported(f"`{node.name}`: layer_norm over {tuple(shape)} does not "
                                  "bound each token's vector")
            w, b = arg(node, 2, "weight"), arg(node, 3, "bias")
            _no_offset_under_dropout(node, b, radius_factor)
            head = [("mul", w)] if w is not None else []
            head += [("add", b)] if b is not None else []
            return NormalizedInput("layernorm", node, d, tuple(head + ops_after_norm[::-1]),
                                   radius_factor)
        if op == "rms_norm":
            w = arg(node, 2, "weight")
            head = [("mul", w)] if w is not None else []
            return NormalizedInput("rmsnorm", node, d, tuple(head + ops_after_norm[::-1]),
                                   radius_factor)
        if op == "encoder_layer" and not arg(node, 8, "norm_first"):
            _no_offset_under_dropout(node, node.args[13], radius_factor)
            head = [("mul", node.args[12]), ("add", node.args[13])]
            return NormalizedInput("layernorm", node, d, tuple(head + ops_after_norm[::-1]),
                                   radius_factor)
        if op in ("mul", "div") and _decomposed_rms(node) is not None:
            # RMS-normalizing a centered vector is a (hand-written) LayerNorm
            kind = "layernorm" if _centered_source(_decomposed_rms(node)) is not None \
                else "rmsnorm"
            return NormalizedInput(kind, node, d, tuple(ops_after_norm[::-1]), radius_factor)
        node, radius_factor = _step_back(node, op, d, kinds, ops_after_norm, radius_factor,
                                         projection)
    raise Unsupported(f"no normalization found within 64 ops before `{projection.name}`")


def _no_offset_under_dropout(norm: Node, bias, radius_factor: float) -> None:
    """Training-mode dropout after a norm scales its bias by mask/(1−p) too: ``x̂ + b`` is then
    not ``gain ⊙ x̂' + offset`` with a fixed offset, so the radius argument does not hold."""
    if bias is not None and radius_factor != 1.0:
        raise Unsupported(f"`{norm.name}`: a normalization bias under training-mode dropout "
                          "(the dropout mask scales the bias too)")


def _step_back(node, op, d, kinds, ops_after_norm, radius_factor, projection):
    def fail(detail=""):
        raise Unsupported(f"no normalization before the projection `{projection.name}`: "
                          f"reached `{node.name}` ({op or node.op}){detail}")

    if op in VALUE_CASTS:
        return node.args[0], radius_factor
    if op in _VIEWS:
        src = node.args[0]
        if not isinstance(src, Node) or (shape_of(src) or (0,))[-1] != d or \
                not _keeps_last_dim(node, op):
            fail(": it mixes the feature dimension")
        return src, radius_factor
    if op == "dropout":
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
        if training and p > 0:
            radius_factor /= (1.0 - p)  # dropout(x) = x ⊙ mask/(1−p): ‖·‖ ≤ ‖x‖/(1−p)
        return node.args[0], radius_factor
    if op in ("mul", "add", "div", "sub"):
        a, b = node.args[0], node.args[1]
        for act, other in ((a, b), (b, a)) if op in ("mul", "add") else ((a, b),):
            if isinstance(act, Node) and kinds.is_activation(act) and _per_channel(other, d,
                                                                                   kinds):
                if radius_factor != 1.0 and op in ("add", "sub"):
                    fail(": an offset under training-mode dropout")
                value = scalar_constant(other)
                if op == "div":
                    if value is None or value == 0:
                        fail()
                    ops_after_norm.append(("mul", 1.0 / value))
                elif op == "sub":
                    if value is None:
                        fail()
                    ops_after_norm.append(("add", -value))
                else:
                    ops_after_norm.append((op, value if value is not None else other))
                return act, radius_factor
    fail()


def _keeps_last_dim(node: Node, op: str) -> bool:
    ndim = len(shape_of(node) or ())
    if op == "transpose":
        dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")]
        return not any(_is_last_dim(dim, ndim) for dim in dims)
    if op == "permute":
        dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
        return _is_last_dim(dims[-1], ndim)
    if op == "getitem":
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            return index[-1] == slice(None) or index[-1] is Ellipsis
        return len(index) < ndim or index[-1] == slice(None)
    if op in ("unsqueeze", "squeeze"):
        dim = arg(node, 1, "dim")
        return dim is not None and not _is_last_dim(dim, ndim)
    return True


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
    weight = _strip_casts(projection.weight)
    bias = projection.bias
    return (parameter_name(weight) if weight.op == "placeholder" else weight.name,
            "" if bias is None else parameter_name(bias) if bias.op == "placeholder"
            else bias.name)
