"""``analysis.fx.module_names``: parameters, modules and attention sites named by their path in the
user's model, found by identity, however the compiled frame reached the model.

Each way of reaching a forward that clients use is built here by hand (a bound method's
``__self__`` as TRL's forward wrappers, ``functools.partial``, an autocast wrapper as
accelerate's, a ``*args`` wrapper as transformers 5.24's, a global module in a compiled
function), and the names are checked against ``named_modules``/``named_parameters``.
"""
from __future__ import annotations

import functools
import gc
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import geoscale_fx
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.fx.graph_ops import op_of, parameter_name
from geoscale_fx.analysis.fx.module_names import MODULE_META, ModelNames, graph_names

B, L, D, H = 2, 6, 16, 2


class Core(nn.Module):
    """Attention without parameters of its own (called by ``Attention``)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, core: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        self.core = Core() if core else None

    def forward(self, x):
        h = self.norm(x)
        q, k, v = (p(h).view(B, L, H, D // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = self.core(q, k, v) if self.core is not None else \
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + out.transpose(1, 2).reshape(B, L, D)


class Block(nn.Module):
    def __init__(self, core: bool = False):
        super().__init__()
        self.self_attn = Attention(core)
        self.cross_attn = Attention(core)      # a sibling of the same class

    def forward(self, x):
        return self.cross_attn(self.self_attn(x))


class Model(nn.Module):
    def __init__(self, core: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Block(core) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


EXPECTED = ["layers.0.self_attn", "layers.0.cross_attn", "layers.1.self_attn",
            "layers.1.cross_attn"]


def _site_names(fn, *args) -> list[str]:
    return [s.name for s in geoscale_fx.find_attention(fn, *args)]


def _bound_method_wrapper(model: nn.Module) -> nn.Module:
    """TRL's forward patch: an instance ``forward`` that calls the original bound method
    (Dynamo reaches the model as ``L[...].__self__``)."""
    original = model.forward

    @functools.wraps(type(model).forward)
    def fused_forward(self, *args, **kwargs):
        return original(*args, **kwargs)

    model.forward = types.MethodType(fused_forward, model)
    return model


def _autocast_wrapper(model: nn.Module) -> nn.Module:
    """accelerate's mixed precision: ``forward`` rebound to an autocast-decorated function."""
    forward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)(model.forward.__func__)
    model.forward = types.MethodType(forward, model)
    return model


def _args_wrapper(model: nn.Module) -> nn.Module:
    """transformers ≥ 5.24: a ``*args`` decorator between ``__call__`` and ``forward``."""
    forward = model.forward

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    model.forward = wrapper
    return model


def test_sites_are_named_by_their_module_path_however_the_model_is_reached():
    x = torch.randn(B, L, D)
    assert _site_names(Model(), x) == EXPECTED
    for wrap in (_bound_method_wrapper, _autocast_wrapper, _args_wrapper):
        assert _site_names(wrap(Model()), x) == EXPECTED, wrap.__name__
    model = Model()
    assert _site_names(functools.partial(model.forward), x) == EXPECTED
    assert _site_names(lambda y: model(y), x) == EXPECTED        # a closure over the model


_GLOBAL_MODEL = Model()


def _call_global(x):
    return _GLOBAL_MODEL(x)


def test_a_module_reached_as_a_global_is_named_from_itself():
    assert _site_names(_call_global, torch.randn(B, L, D)) == EXPECTED


def test_a_module_without_parameters_is_found_below_its_caller():
    """The attention runs in ``Core`` (no parameters): found as the only ``Core`` below the
    ``Attention`` its projections tie to the model."""
    names = _site_names(Model(core=True), torch.randn(B, L, D))
    assert names == [f"{n}.core" for n in EXPECTED]


def test_parameter_names_are_the_models_by_identity():
    model = _bound_method_wrapper(Model())
    graph = capture_graphs(model, torch.randn(B, L, D))[0]
    names = graph_names(graph.gm, graph.example_inputs)
    names.annotate(graph.gm)
    by_identity = {id(p): n for n, p in model.named_parameters()}
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    named = {parameter_name(n): v for n, v in zip(placeholders, graph.example_inputs)
             if isinstance(v, nn.Parameter)}
    assert named and all(by_identity[id(v)] == name for name, v in named.items())
    linear = next(n for n in graph.gm.graph.nodes if op_of(n) == "linear")
    assert names.module(linear) == "layers.0.self_attn.norm" or \
        names.module(linear) == "layers.0.self_attn.q"


def test_a_graph_without_a_model_names_sites_by_their_node():
    graph = capture_graphs(Model(), torch.randn(B, L, D))[0]
    graph.gm.meta.clear()          # no model recorded, and not inside a compile
    for node in graph.gm.graph.nodes:      # nor the paths written while it was alive
        node.meta.pop(MODULE_META, None)
    sdpa = next(n for n in graph.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert graph_names(graph.gm, graph.example_inputs).module(sdpa) is None


def test_model_names_tie_shared_tensors_and_read_again_on_a_miss():
    model = Attention()
    model.register_buffer("scale", torch.ones(1))
    model.tied = model.q                            # the same module under a second name
    names = ModelNames(model)
    assert names.tensor_names(model.q.weight) == ("q.weight", "tied.weight")
    assert names.tensor(model.scale) == "scale"
    assert names.tensor(torch.ones(1)) is None and names.tensor("q.weight") is None
    model.extra = nn.Linear(D, D)                   # registered after the first lookup
    assert names.tensor(model.extra.bias) == "extra.bias"


def test_a_graph_captured_from_a_model_since_freed_keeps_its_names():
    """The paths are written into the graph while the model is alive (``annotate``)."""
    graph = capture_graphs(Model(), torch.randn(B, L, D))[0]       # the model is freed
    sites = analyze_graph(graph.gm, graph.example_inputs)
    assert [s.name for s in sites] == EXPECTED


def test_model_names_do_not_keep_the_model_alive():
    model = Attention()
    names, alive = ModelNames(model), weakref.ref(model)
    weight = model.k.weight
    assert names.tensor(weight) == "k.weight"
    del model
    gc.collect()
    assert alive() is None
    assert names.tensor(torch.ones(1)) is None and names.module("q") is None


def test_backend_names_the_bound_block_of_a_graph_serving_several():
    """``compile_blocks``: one graph serves every block; each block's sites are named by
    that block's path, found from the parameters bound at the call."""
    model = Model()
    backend = geoscale_fx.compile_blocks(model, model.layers, compiler="aot_eager")
    model(torch.randn(B, L, D))
    assert sorted(r.name for r in backend.records.values()) == sorted(EXPECTED)


def test_converted_model_reached_through_a_bound_method_keeps_its_names():
    """``apply_`` and then a client's forward patch (TRL): the report names the model's
    paths, with no ``__self__`` prefix."""
    model = geoscale_fx.apply_(Model(), compiler="aot_eager")
    _bound_method_wrapper(model)
    model(torch.randn(B, L, D))
    rows = geoscale_fx.report(model).rows
    assert [r["site"] for r in rows] == EXPECTED
