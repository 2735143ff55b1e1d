"""FP8 linears: a matmul of two FP8-cast operands, read from the ATen graph of the call.

Two forms, both torchao's ``Float8Linear`` forward (``emulate=False`` / ``True``)::

    _scaled_mm(view(bits_x), bits_W, reciprocal(view(s_x)), reciprocal(s_W), out_dtype=…)
    mm(f32(view(bits_x)) / s_x, f32(bits_W) / s_W)

then views and dtype casts to the output. ``bits_x`` must be the input's cast with scales
from its own values (``aten_chains.dynamic_cast``) and be dequantized by the very scale it
was multiplied by, per row or per tensor (``_scaled_mm``'s ``scale_a`` of shape ``(M, 1)``
or one element): then the product is that of the dequantized operands ``x̃ W̃ᵀ``. The
weight operand may be computed any way from the weight alone: its operations become the
side's ``WeightProgram`` (``weight_program``), replayed on the current weight. Casts to a
narrower dtype between the product and the output (``_scaled_mm``'s bf16 output under the
rowwise recipes, cast back to float32) are the output's rounding. Anything else on the way
— a bias inside the matmul, an output scale, an elementwise op — is not this form (None).

Each recognizer takes a ``TracedCall`` and returns ``Found`` (the call's input and weight
nodes, the ``LinearCast``) or None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.linears.aten_chains import (
    A, downcast_rounding, dynamic_cast, is_op, strip_views, val,
)
from geoscale_fx.analysis.linears.opaque_calls import TracedCall
from geoscale_fx.analysis.linears.weight_program import PREVIOUS, weight_program
from geoscale_fx.core.rounding import unit_roundoff
from geoscale_fx.sites.linear_casts import LinearCast

__all__ = ["Found", "scaled_mm_linear", "dequantized_mm_linear"]


@dataclass(frozen=True)
class Found:
    """A low-precision linear: ``x`` its input, ``weight`` the weight operand as the call
    takes it (``(d, F)``: ``x W``), and how it computes."""
    x: Node
    weight: Node
    cast: LinearCast


def _product(traced: TracedCall) -> Optional[tuple[Node, float]]:
    """The matmul the call returns through views and casts, with the casts' rounding."""
    out = [n for n in traced.graph.graph.nodes if n.op == "output"][0].args[0]
    if not isinstance(out, Node):
        return None
    rounding = 1.0
    node = out
    while True:
        node = strip_views(node)
        if is_op(node, A._to_copy.default) and set(node.kwargs) <= {"dtype"}:
            source = node.args[0]
            rounding *= 1.0 + downcast_rounding(val(source).dtype, node.kwargs["dtype"])
            node = source
            continue
        break
    if not is_op(node, A._scaled_mm.default, A.mm.default):
        return None
    return node, rounding - 1.0


def _placeholders(traced: TracedCall) -> list[Node]:
    return [n for n in traced.graph.graph.nodes if n.op == "placeholder"]


def _input_cast(bits: Node, traced: TracedCall):
    """``(placeholder, DynamicCast, s)`` of the input operand's cast, trying each argument."""
    for ph in _placeholders(traced):
        found = dynamic_cast(strip_views(bits), ph)
        if found is not None:
            return ph, *found
    return None


def _per_row(node: Node, rows: int, groups: str) -> bool:
    """``node`` holds one value per row of the ``rows``-row operand (or one, per tensor)."""
    if groups == "tensor":
        return val(node).numel() == 1
    return groups == "rows" and tuple(val(node).shape) == (rows, 1)


def _row_scale(node: Node, scale: Node, rows: int, groups: str) -> bool:
    """``node`` is ``1/s`` (through views) laid out one per row of the operand (or one)."""
    return is_op(node, A.reciprocal.default) and strip_views(node.args[0]) is scale and \
        _per_row(node, rows, groups)


def _found(traced: TracedCall, x_ph: Node, cast, program, rounding: float) -> Optional[Found]:
    others = [p for p in _placeholders(traced) if p is not x_ph]
    if program is None or len(others) != 1 or len(val(others[0]).shape) != 2:
        return None
    return Found(traced.argument(x_ph), traced.argument(others[0]),
                 LinearCast("float8", cast, program, rounding))


def scaled_mm_linear(traced: TracedCall) -> Optional[Found]:
    """``_scaled_mm`` of the input's cast and a weight operand (module docstring)."""
    found = _product(traced)
    if found is None or found[0].target is not A._scaled_mm.default:
        return None
    mm, rounding = found
    a, b, scale_a, scale_b = mm.args[:4]
    extra = list(mm.args[4:6]) + [mm.kwargs.get("bias"), mm.kwargs.get("scale_result")]
    if any(e is not None for e in extra):
        return None
    out_dtype = val(mm).dtype
    if torch.finfo(out_dtype).eps > torch.finfo(torch.float32).eps:
        rounding = (1.0 + rounding) * (1.0 + unit_roundoff(out_dtype)) - 1.0
    cast = _input_cast(a, traced)
    if cast is None:
        return None
    x_ph, input_cast, s_x = cast
    rows = tuple(val(a).shape)[0]
    if not _row_scale(scale_a, s_x, rows, input_cast.groups):
        return None
    columns = tuple(val(b).shape)[1]
    if val(scale_b).numel() != 1 and tuple(val(scale_b).shape) != (1, columns):
        return None
    weight = [p for p in _placeholders(traced) if p is not x_ph]
    tail = [(A._to_copy.default, (b,), {"dtype": torch.float32}),
            (A.mul.Tensor, (PREVIOUS, scale_b), {})]
    program = weight_program([b, scale_b], weight[0], tail) if len(weight) == 1 else None
    return _found(traced, x_ph, input_cast, program, rounding)


def dequantized_mm_linear(traced: TracedCall) -> Optional[Found]:
    """``mm`` of the dequantized input cast and a weight operand (module docstring)."""
    found = _product(traced)
    if found is None or found[0].target is not A.mm.default:
        return None
    mm, rounding = found
    a, b = mm.args[:2]
    if not is_op(a, A.div.Tensor) or not is_op(a.args[0], A._to_copy.default) or \
            a.args[0].kwargs.get("dtype") is not torch.float32:
        return None
    cast = _input_cast(a.args[0].args[0], traced)
    if cast is None:
        return None
    x_ph, input_cast, s_x = cast
    if not isinstance(a.args[1], Node) or strip_views(a.args[1]) is not s_x or \
            not _per_row(a.args[1], tuple(val(a).shape)[0], input_cast.groups):
        return None
    weight = [p for p in _placeholders(traced) if p is not x_ph]
    program = weight_program([b], weight[0]) if len(weight) == 1 else None
    return _found(traced, x_ph, input_cast, program, rounding)

