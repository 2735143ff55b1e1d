"""Normalized inputs: from a vector back to the normalization that bounds it, ``‖x̂‖ ≤ √d``.

``trace_normalized_input(x)`` walks from ``x`` back through casts, feature-preserving views,
dropout and per-channel gains/offsets to a LayerNorm or RMSNorm (fused, or written out:
``x·rsqrt(mean(x²)+ε)``, ``(x−μ)·rsqrt(var+ε)``), collecting the per-channel ops applied
after it. An **L2 clip** ``h·min(1, t/(‖h‖+ε))`` (``l2_clip``) bounds its output too,
``‖ĥ‖ ≤ t`` whatever ``h`` is, a gain applied to ``h`` before the norm is taken included. The
same walk recognises a normalization *after* a projection (QK-norm, an L2-clipped q or k, see
``provenance.find_projection``). Failures raise ``Unsupported`` naming the node.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.dtensor import token_vector_split
from geoscale_fx.analysis.fx.graph_ops import (
    DTENSOR_OPS, VALUE_CASTS, ValueKinds, arg, is_last_dim, op_of, same_value, scalar_constant,
    shape_of, strip_casts,
)
from geoscale_fx.analysis.index.index_replay import Unsupported
from geoscale_fx.analysis.norms.l2_clip import l2_clip

__all__ = ["NormalizedInput", "trace_normalized_input", "norm_input", "same_value", "l2_clip",
           "keeps_last_dim", "is_last_dim",
           "strip_casts", "VIEWS"]


@dataclass(frozen=True)
class NormalizedInput:
    norm: str                     # "layernorm" | "rmsnorm" | "l2clip"
    node: Node
    model_dim: int
    channel_ops: tuple            # (("mul" | "add", Node | float), ...) applied to x̂ in order
    radius_factor: float


#: ops that keep each token's feature vector (walked through on the way to a normalization)
VIEWS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute",
          "contiguous", "getitem", "expand")





def _mean_square_source(node: Node) -> Optional[Node]:
    """``a`` if ``node`` is ``mean(a², dim=-1, keepdim=True)`` (up to casts), else None."""
    node = strip_casts(node)
    if op_of(node) != "mean":
        return None
    dim, keepdim = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    square = strip_casts(node.args[0])
    ndim = len(shape_of(square) or ())
    if not keepdim or not is_last_dim(dim, ndim):
        return None
    if op_of(square) == "pow" and scalar_constant(square.args[1]) == 2.0:
        return strip_casts(square.args[0])
    if op_of(square) == "square":
        return strip_casts(square.args[0])
    if op_of(square) == "mul" and square.args[0] is square.args[1]:
        return strip_casts(square.args[0])
    return None


def _rms_denominator_source(node: Node, invert: bool) -> Optional[Node]:
    """``a`` if ``node`` is ``rsqrt(mean(a²)+eps)`` (or ``sqrt(...)`` when ``invert``)."""
    node = strip_casts(node)
    # pow(·, ∓0.5) is how Gemma writes rsqrt/sqrt ("compiler differences with JAX")
    exponent = scalar_constant(node.args[1]) if op_of(node) == "pow" and \
        len(node.args) > 1 else None
    if op_of(node) != ("sqrt" if invert else "rsqrt") and \
            exponent != (0.5 if invert else -0.5):
        return None
    inner = strip_casts(node.args[0])
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
            if source is not None and same_value(source, strip_casts(a)):
                return source
    return None




def _centered_source(node: Node) -> Optional[Node]:
    """``x`` if ``node`` is ``x − mean(x, -1, keepdim=True)`` (up to casts), else None."""
    node = strip_casts(node)
    if op_of(node) != "sub" or not isinstance(node.args[1], Node):
        return None
    mean = strip_casts(node.args[1])
    if op_of(mean) != "mean" or not arg(mean, 2, "keepdim", False):
        return None
    x = node.args[0]
    ndim = len(shape_of(x) or ())
    return x if is_last_dim(arg(mean, 1, "dim"), ndim) and same_value(
        strip_casts(mean.args[0]), strip_casts(x)) else None


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
        clip = l2_clip(node, kinds) if op == "mul" else None
        if clip is not None:   # ‖ĥ‖ ≤ t = (t/√d)·√d
            return NormalizedInput("l2clip", node, d, tuple(ops_after_norm[::-1]),
                                   radius_factor * clip[1] / math.sqrt(d))
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
        if node.op == "placeholder" and not detail:
            detail = (": an input of this graph (the caller's tensor, or a value from before "
                      "a graph break), which no normalization or weight bounds")
        raise Unsupported(f"no normalization before the projection `{projection.name}`: "
                          f"reached `{node.name}` ({op or node.op}){detail}")

    if op in VALUE_CASTS:
        return node.args[0], radius_factor
    if op in DTENSOR_OPS:  # tensor parallel
        reason = token_vector_split(node)
        if reason:
            fail(f": {reason}")
        return node.args[0], radius_factor
    if op in VIEWS:
        src = node.args[0]
        if not isinstance(src, Node) or (shape_of(src) or (0,))[-1] != d or \
                not keeps_last_dim(node, op):
            fail(": it mixes the feature dimension")
        return src, radius_factor
    if op == "cat":  # ``cat([empty cache, x], dim=-2)``: x's rows, unchanged
        parts = [t for t in arg(node, 0, "tensors")
                 if not (isinstance(t, Node) and math.prod(shape_of(t) or (1,)) == 0)]
        ndim = len(shape_of(node) or ())
        if len(parts) == 1 and isinstance(parts[0], Node) and \
                not is_last_dim(arg(node, 1, "dim", 0), ndim):
            return parts[0], radius_factor
        fail(": it concatenates values that do not all come from one normalization")
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


def keeps_last_dim(node: Node, op: str) -> bool:
    ndim = len(shape_of(node) or ())
    if op == "transpose":
        dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")]
        return not any(is_last_dim(dim, ndim) for dim in dims)
    if op == "permute":
        dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
        return is_last_dim(dims[-1], ndim)
    if op == "getitem":
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            return index[-1] == slice(None) or index[-1] is Ellipsis
        return len(index) < ndim or index[-1] == slice(None)
    if op in ("unsqueeze", "squeeze"):
        dim = arg(node, 1, "dim")
        return dim is not None and not is_last_dim(dim, ndim)
    return True




def norm_input(norm: Node, kinds: Optional[ValueKinds] = None) -> Optional[Node]:
    """The tensor a normalization node normalizes (for a hand-written LayerNorm: x, not
    x − mean(x), whose elements are not x's; for an L2 clip: its input before the gain)."""
    op = op_of(norm)
    if op in ("layer_norm", "rms_norm"):
        return norm.args[0]
    clip = l2_clip(norm, kinds) if kinds is not None and op == "mul" else None
    if clip is not None:
        return clip[2]
    source = _decomposed_rms(norm)
    if source is None:
        return None
    centered = _centered_source(source)
    return centered if centered is not None else source
