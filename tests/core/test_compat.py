"""geoscale_fx.core.compat: each release-dependent feature behaves the same on every torch
the package admits (the suite runs under 2.11 to 2.15: tools/torch-release)."""
from __future__ import annotations


import torch

from geoscale_fx.analysis.dynamo_code import fresh_function, release_codes
from geoscale_fx.core import compat


def _counting(calls: list):
    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward
    return backend


def test_a_compiled_region_counts_its_own_entries_under_its_own_limit():
    """Two compiles of fresh copies of one function: each region holds only its own entries,
    and a region's limit (3) is what bounds it, whatever Dynamo's global limit (1)."""
    def f(x):
        return x * 2

    calls: list = []
    one = compat.compile_isolated(fresh_function(f), backend=_counting(calls), dynamic=False,
                                  recompile_limit=3)
    two = compat.compile_isolated(fresh_function(f), backend=_counting(calls), dynamic=False,
                                  recompile_limit=3)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (1, 2, 3):                           # a new shape each call: a recompile
            assert torch.equal(one(torch.ones(n)), torch.full((n,), 2.0))
        two(torch.ones(1))
    assert (compat.region_entries(one), compat.region_entries(two)) == (3, 1)
    assert len(calls) == 4                            # no call ran eagerly
    release_codes([one._torchdynamo_orig_callable.__code__,
                   two._torchdynamo_orig_callable.__code__])
    assert compat.region_entries(one) == 0


def _shared(x):
    """A function every region reaches after a graph break (a library's decorator wrapper,
    shared by every model): its frame is compiled on its own code object."""
    y = x.sin()
    torch._dynamo.graph_break()
    return y + 1


def test_shared_code_after_a_graph_break_counts_only_the_regions_own_entries():
    """A region reaching shared code after a graph break compiles it under its own limit,
    whatever entries earlier regions left there (torch 2.11, 2.12 counted them all: the
    shared frame then ran eagerly, and its graphs never reached the backend)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def f(x):
        return _shared(x * 2)

    first: list = []
    one = compat.compile_isolated(fresh_function(f), backend=_counting(first), dynamic=False,
                                  recompile_limit=3)
    with torch._dynamo.config.patch(recompile_limit=3):
        for n in (1, 2, 3):                           # three entries on _shared's code
            one(torch.ones(n))
    assert len(_debug_get_cache_entry_list(_shared.__code__)) >= 3
    second: list = []
    two = compat.compile_isolated(fresh_function(f), backend=_counting(second), dynamic=False,
                                  recompile_limit=3)
    assert torch.allclose(two(torch.ones(4)), torch.ones(4).mul(2).sin().add(1))
    # f's graph, _shared's two graphs (before and after its break): none ran eagerly
    assert len(second) == 3, [gm.code for gm in second]
    release_codes([one._torchdynamo_orig_callable.__code__,
                   two._torchdynamo_orig_callable.__code__])


def test_a_source_resolves_to_the_frame_value_it_names():
    """While Dynamo compiles, a graph input's source evaluates to the live tensor it reads."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    weight = torch.nn.Parameter(torch.randn(3))
    module = torch.nn.Module()
    module.weight = weight
    seen = []

    def backend(gm, example_inputs):
        output = InstructionTranslator.current_tx().output
        for node in gm.graph.nodes:
            source = getattr(node, "_dynamo_source", None)
            if node.op == "placeholder" and source is not None:
                seen.append(compat.resolve_source_value(output, source))
        return gm.forward

    torch.compile(fresh_function(lambda x: x * module.weight), backend=backend)(torch.ones(3))
    assert any(value is weight for value in seen)


def test_dtensor_functions_are_named_by_the_call_they_stand_for():
    """torch 2.11's closures for DTensor calls are read by their names; other functions and
    targets without a name are not DTensor calls."""
    def closure(x):
        return x

    for name, op in (("prim_redistribute", "redistribute"), ("prim_to_local", "to_local"),
                     ("prim from_local", "from_local")):
        closure.__name__ = name
        assert compat.traced_dtensor_method(closure) == op
    assert compat.traced_dtensor_method(torch.add) is None
    assert compat.traced_dtensor_method(object()) is None
