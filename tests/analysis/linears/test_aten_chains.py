"""analysis.linears.aten_chains: the FP8 cast of an operand with scales from its own values.

Each recipe of ``tests.float8_linears`` is traced to ATen; the input's cast must read as a
``DynamicCast`` with the right groups, target and floor, and each twin that changes what
the scale is computed from (a constant, the weight's amax) must not."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.analysis.linears.aten_chains import (
    A, downcast_rounding, dynamic_cast, is_op, strip_views, upcast_source,
)
from geoscale_fx.analysis.linears.opaque_calls import call_signature, traced_call
from tests.float8_linears import ROWWISE, Recipe, captured_call


def _traced(recipe: Recipe, dtype=torch.float32):
    _, kinds, node = captured_call(recipe, dtype=dtype)
    graph = traced_call(call_signature(node, kinds)).graph.graph
    x, w = [n for n in graph.nodes if n.op == "placeholder"]
    casts = [n for n in graph.nodes if is_op(n, A._to_copy.default)
             and n.kwargs.get("dtype") is torch.float8_e4m3fn]
    return x, w, casts


@pytest.mark.parametrize("recipe,groups,floor", [
    (Recipe(), "tensor", 448.0),
    pytest.param(Recipe(rows=True), "rows", 448.0, marks=ROWWISE),
    pytest.param(Recipe(rows=True, pow2=True), "rows", 224.0, marks=ROWWISE),
    (Recipe(rows=True, emulate=True), "rows", 448.0),
    (Recipe(pow2=True, emulate=True), "tensor", 224.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_cast_is_read(recipe, groups, floor, dtype):
    x, w, casts = _traced(recipe, dtype)
    found = [dynamic_cast(c, x) for c in casts]
    (cast, scale), = [f for f in found if f is not None]           # the input's, not W's
    assert (cast.groups, cast.scale_floor, cast.scaled_max, cast.clip, cast.eps) == \
        (groups, floor, 448.0, 448.0, 1e-12)
    assert cast.dtype == "float8_e4m3fn" and not cast.saturates
    assert scale.meta["val"].dtype is torch.float32
    # the weight's cast has its own groups (per output feature: the columns of Wᵀ)
    (w_cast, _), = [f for f in (dynamic_cast(c, w) for c in casts) if f is not None]
    assert w_cast.groups == ("groups over dims [0]" if recipe.rows else "tensor")


@pytest.mark.parametrize("twin", [Recipe(input_scale="static"), Recipe(input_scale="weight")])
def test_a_scale_not_from_the_input_is_not_read(twin):
    x, _, casts = _traced(twin)
    assert all(dynamic_cast(c, x) is None for c in casts)


def test_views_upcasts_and_roundings():
    x, _, casts = _traced(Recipe(), torch.bfloat16)
    mul = strip_views(casts[0].args[0]).args[0]          # clamp -> mul(f32(x), s)
    assert upcast_source(mul.args[0]) is x               # the upcast to float32 is exact
    assert downcast_rounding(torch.float32, torch.bfloat16) == 2 ** -8
    assert downcast_rounding(torch.bfloat16, torch.float32) == 0.0
