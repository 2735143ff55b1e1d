"""A projection computed in low precision (an FP8 training linear), as plain data.

torchao's ``Float8Linear`` (and any linear of its kind) does not compute ``x Wᵀ``: it casts
both operands to FP8, each with a scale computed from its own values, and multiplies the
dequantized values::

    y = x̃ W̃ᵀ,    x̃ = Q(x ⊙ s_x) ⊘ s_x,    W̃ = Q(W ⊙ s_W) ⊘ s_W       (then rounded to the
                                                                     output dtype)

``W̃`` is a function of the weight alone: the analysis keeps the operations the linear
computes it with (``WeightProgram``, ATen operators as data) and the numerics replay them
on the current weight, so the bound reads the very ``W̃`` the linear multiplies by. ``x̃``
depends on the activations: ``DynamicCast`` states what its cast can change (the proof is
in ``geoscale_fx.numerics.cast_envelope``)::

    x̃_i = λ_i x_i + η_i,   |λ_i − 1| ≤ u' (no group scaled past the clip),   |η_i| ≤ τ

``LinearCast`` is what a side holds (``Side.cast``); ``CastEnvelope`` is its evaluated
effect on one side's head vectors (``HeadWeights.cast_q``/``cast_k``).

    >>> cast = DynamicCast("float8_e4m3fn", clip=448.0, scaled_max=448.0, scale_floor=224.0,
    ...                    eps=1e-12, groups="rows")
    >>> cast.relative() > 2 ** -4, cast.offset_factor() == cast.relative()
    (True, True)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from geoscale_fx.core.rounding import (
    F32_SLACK, dtype_by_name, subnormal_half_spacing, unit_roundoff,
)

__all__ = ["DynamicCast", "Ref", "WeightProgram", "LinearCast", "CastEnvelope"]


@dataclass(frozen=True)
class DynamicCast:
    """An operand cast with scales from its own values: per group ``g`` of entries sharing
    a scale, ``s_g`` with ``amax_g·s_g ≤ scaled_max`` and ``s_g ≥ scale_floor/max(amax_g,
    eps)``; ``v·s`` clamped to ``±clip``, then rounded to ``dtype`` (an FP8 format)."""
    dtype: str
    clip: float
    scaled_max: float
    scale_floor: float
    eps: float
    groups: str = "tensor"       # what shares one scale: "tensor", "rows", "blocks of 32", …

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_by_name(self.dtype)

    @property
    def saturates(self) -> bool:
        """A group can be scaled past the clip (then ``λ`` may be anywhere in ``[0, 1]``);
        a clip at ``scaled_max`` cuts float32 roundings only, inside ``relative()``."""
        return self.scaled_max > self.clip

    def relative(self) -> float:
        """``u'``: ``λ_i ≤ 1 + u'`` always, and ``λ_i ≥ 1 − u'`` unless the cast saturates
        (the format's rounding and a few float32 roundings around it)."""
        return unit_roundoff(self.torch_dtype) + 2.0 * F32_SLACK

    def offset_factor(self) -> float:
        """``κ ≥ max_i |λ_i − 1|``: ``u'``, or 1 where the clip can cut a group."""
        return 1.0 if self.saturates else self.relative()

    def absolute(self, entry_bound: Any) -> Any:
        """``τ ≥ |η_i|`` when every entry of the cast tensor is at most ``entry_bound``:
        a subnormal's half spacing ``h`` in the scaled domain, ``h / s_g`` back, with
        ``1/s_g ≤ max(amax_g, eps) / scale_floor``."""
        h = subnormal_half_spacing(self.torch_dtype) * (1.0 + F32_SLACK)
        if isinstance(entry_bound, torch.Tensor):
            return h * entry_bound.clamp_min(self.eps) / self.scale_floor
        return h * max(float(entry_bound), self.eps) / self.scale_floor


@dataclass(frozen=True)
class Ref:
    """An argument of a ``WeightProgram`` operation: the result of operation ``index``
    (-1: the program's input, the weight as the side reads it)."""
    index: int


@functools.lru_cache(maxsize=None)
def _operator(name: str):
    """``"aten.abs.default"`` -> ``torch.ops.aten.abs.default``."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


@dataclass(frozen=True)
class WeightProgram:
    """ATen operations computing the dequantized weight ``W̃`` from the weight ``W`` (as
    the side reads it, in the side's layout), each ``(operator, args, kwargs)`` with
    ``Ref``\\ s to earlier results; the last result is ``W̃``, in the same layout.

    Replayed on the current weight (``program(weight)``): the same operators on the same
    values give the same ``W̃`` the linear computes, bit for bit. Traceable."""
    ops: tuple[tuple[str, tuple, tuple], ...]

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        results: list = []

        def value(a):
            if isinstance(a, Ref):
                return weight if a.index < 0 else results[a.index]
            if isinstance(a, (tuple, list)):
                return type(a)(value(x) for x in a)
            return a

        for name, args, kwargs in self.ops:
            results.append(_operator(name)(*value(args), **dict(value(kwargs))))
        return results[-1] if results else weight


@dataclass(frozen=True)
class LinearCast:
    """How a low-precision linear computes its output (see the module docstring): the cast
    of its input, the program of its dequantized weight, and the relative rounding of the
    product to its output dtype before anything is added (0: none counted; a bias added
    after it is exact)."""
    kind: str                    # the recognizer that found it (``analysis.linears``)
    input: DynamicCast
    weight: WeightProgram
    output_rounding: float = 0.0


@dataclass(frozen=True)
class CastEnvelope:
    """The effect of a side's casts on its head vectors, evaluated on the current weights:
    ``q_h = A_hᵀ x̂' + c_h + e_h`` with ``‖x̂'‖ ≤ radius_factor·ρ`` and ``‖e_h‖ ≤
    deviation[h]`` (``A``, ``c`` from the dequantized weight; ``numerics.cast_envelope``)."""
    radius_factor: float
    deviation: torch.Tensor           # (n_heads,) float64
    #: ``‖A_h‖₂`` per head (float64, exact), computed once for the envelope: the bounds
    #: that need it read it here (``head_weights.head_norms``)
    a_norms: Optional[torch.Tensor] = None
