"""analysis.linears.float8_matmul: the FP8 matmul read from the ATen graph of the call.

For every recipe (per tensor, per row, powers of two, emulated, a bf16 product): the kind
that matches it returns the input and weight nodes, the input's cast, the output's rounding
and a weight program that gives the float64 reference ``W̃`` to a float32 rounding; the
other kind and every twin return None."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.analysis.linears.float8_matmul import dequantized_mm_linear, scaled_mm_linear
from geoscale_fx.analysis.linears.opaque_calls import call_signature, traced_call
from tests.float8_linears import Recipe, captured_call, case, dequantized_weight

RECIPES = [Recipe(), Recipe(rows=True, pow2=True), Recipe(rows=True, out_dtype=torch.bfloat16),
           Recipe(emulate=True), Recipe(rows=True, emulate=True, out_dtype=torch.bfloat16)]


def _traced(recipe: Recipe):
    graph, kinds, node = captured_call(recipe)
    return graph, node, traced_call(call_signature(node, kinds))


@pytest.mark.parametrize("recipe", [case(r) for r in RECIPES])
def test_each_recipe_is_read_by_its_kind(recipe):
    graph, node, traced = _traced(recipe)
    mine, other = (dequantized_mm_linear, scaled_mm_linear) if recipe.emulate else \
        (scaled_mm_linear, dequantized_mm_linear)
    assert other(traced) is None
    found = mine(traced)
    assert (found.x, found.weight) == (node.args[0], node.args[1])
    cast = found.cast
    assert cast.kind == "float8"
    assert cast.input.groups == ("rows" if recipe.rows else "tensor")
    assert cast.input.scale_floor == (224.0 if recipe.pow2 else 448.0)
    assert cast.output_rounding == (2 ** -8 if recipe.out_dtype is torch.bfloat16 else 0.0)
    w = graph.example_inputs[[n.name for n in graph.gm.graph.nodes
                              if n.op == "placeholder"].index(node.args[1].args[0].name)]
    replayed = cast.weight(w.detach().t())                        # (d, F), like the call's
    reference = dequantized_weight(w, recipe).t()
    assert replayed.dtype is torch.float32
    torch.testing.assert_close(replayed.double(), reference, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("twin", [Recipe(input_scale="static"), Recipe(input_scale="weight"),
                                  Recipe(dequant="other"),
                                  Recipe(emulate=True, dequant="other")], ids=str)
def test_twins_are_not_read(twin):
    _, _, traced = _traced(twin)
    assert scaled_mm_linear(traced) is None and dequantized_mm_linear(traced) is None
