"""sites.linear_casts: what an FP8 input cast can change, and the weight program's replay.

The envelope ``x̃_i = λ_i x_i + η_i`` (``|λ_i − 1| ≤ κ``, ``|η_i| ≤ τ``) is checked against
the cast computed independently (``tests.float8_linears``: torchao's arithmetic written out),
on inputs with entries over 20 binades (subnormals in the scaled domain included).
"""
from __future__ import annotations

import doctest

import pytest
import torch

from geoscale_fx.compile.graph_cache import describe
from geoscale_fx.sites.linear_casts import DynamicCast, Ref, WeightProgram
from tests.float8_linears import _cast, _scale

A = torch.ops.aten


def _cast_of(rows: bool, pow2: bool) -> DynamicCast:
    return DynamicCast("float8_e4m3fn", clip=448.0, scaled_max=448.0,
                       scale_floor=224.0 if pow2 else 448.0, eps=1e-12,
                       groups="rows" if rows else "tensor")


@pytest.mark.parametrize("rows,pow2", [(False, False), (True, True), (True, False)])
def test_the_envelope_holds_for_the_cast_a_linear_computes(rows, pow2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen) * torch.exp2(torch.randint(-20, 1, (64, 32),
                                                                      generator=gen).float())
    s = _scale(x, -1 if rows else None, pow2)
    dequantized = _cast(x, s).double() / s.double()
    cast = _cast_of(rows, pow2)
    err = (dequantized - x.double()).abs()
    allowed = cast.offset_factor() * x.double().abs() + cast.absolute(x.abs().max())
    assert bool((err <= allowed).all())
    # the relative part alone is not enough: entries below the smallest normal need τ
    assert not bool((err <= cast.offset_factor() * x.double().abs()).all())


def test_constants_and_saturation():
    cast = _cast_of(rows=False, pow2=True)
    assert 2 ** -4 < cast.relative() < 2 ** -4 + 1e-5
    assert not cast.saturates and cast.offset_factor() == cast.relative()
    assert cast.absolute(448.0) == pytest.approx(2 ** -10 * 448.0 / 224.0, rel=1e-5)
    assert cast.absolute(0.0) == pytest.approx(2 ** -10 * 1e-12 / 224.0, rel=1e-5)  # ε floor
    past = DynamicCast("float8_e4m3fn", clip=448.0, scaled_max=512.0, scale_floor=256.0,
                       eps=0.0)
    assert past.saturates and past.offset_factor() == 1.0


def test_weight_program_replays_its_operations_on_the_current_weight():
    program = WeightProgram((
        ("aten.abs.default", (Ref(-1),), ()),
        ("aten.amax.default", (Ref(0), (0,), True), ()),
        ("aten.div.Tensor", (Ref(-1), Ref(1)), ()),
        ("aten._to_copy.default", (Ref(2),), (("dtype", torch.float16),)),
    ))
    w = torch.randn(8, 4)
    expected = (w / w.abs().amax(0, keepdim=True)).half()
    assert torch.equal(program(w), expected)
    assert program(2 * w).dtype is torch.float16 and torch.equal(program(2 * w), expected)
    assert WeightProgram(())(w) is w
    # plain data: equal by value, described by value (the compile cache keys it)
    again = WeightProgram(tuple(program.ops))
    assert again == program and hash(again) == hash(program)
    assert describe(program) is not None and describe(program) == describe(again)


def test_docstring_example_runs():
    from geoscale_fx.sites import linear_casts

    assert doctest.testmod(linear_casts).failed == 0
