"""``compile.inductor.compile_fx`` leaves no geoscale program in Inductor's process-wide
``call_function`` target memo (its pre-grad ``NumpyCompatNormalization``), and only those."""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph, GraphModule

from geoscale_fx.compile.inductor import forget_programs

misc_patterns = pytest.importorskip("torch._inductor.fx_passes.misc_patterns")


def _program(x):
    return x * 2


_program.__module__ = "geoscale_fx.compile.rewrite"     # as rewrite.make_program's are


def _graph() -> GraphModule:
    graph = Graph()
    x = graph.placeholder("x")
    y = graph.call_function(_program, (x,))
    graph.output(graph.call_function(operator.add, (y, x)))
    return GraphModule(torch.nn.Module(), graph)


def test_a_geoscale_program_is_dropped_from_the_memo_and_torchs_targets_stay():
    gm = _graph()
    normalize = misc_patterns.numpy_compat_normalization
    normalize(gm.graph)                       # what Inductor's pre-grad passes run
    assert _program in normalize.cache and operator.add in normalize.cache
    assert forget_programs(gm) == 1
    assert _program not in normalize.cache
    assert operator.add in normalize.cache
    assert forget_programs(gm) == 0


@pytest.mark.inductor
def test_compile_fx_compiles_and_forgets():
    from geoscale_fx.compile.inductor import compile_fx

    gm = _graph()
    x = torch.randn(4)
    compiled = compile_fx(gm, [x], config_patches={})
    assert torch.allclose(compiled(x)[0] if isinstance(compiled(x), (list, tuple))
                          else compiled(x), x * 3)
    assert _program not in misc_patterns.numpy_compat_normalization.cache
