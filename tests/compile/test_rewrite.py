"""The rewrite pass on captured Dynamo graphs: structure, placeholders, counters, values."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from geoscale_fx.core.bounds import FP8_MAX
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.compile.rewrite import make_program, rewrite, sdpa_call_options
from geoscale_fx.planning.plan import GraphContext, SitePlan, plan_site
from geoscale_fx.sites.state import GeoscaleState, site_key

B, L, D, H = 2, 5, 16, 2
CPU = GraphContext(device="cpu", training=False, symbolic=False)


class SdpaBlock(nn.Module):
    """LayerNorm -> fused qkv Linear -> SDPA (causal, or with the given additive mask)."""

    def __init__(self):
        super().__init__()
        self.ln, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(self.ln(x)).split(D, dim=-1)
        q, k, v = [t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return x + o.transpose(1, 2).reshape(B, L, D)


class SdpaNet(nn.Module):
    """Two SDPA sites: one causal, one with an additive mask input."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([SdpaBlock(), SdpaBlock()])

    def forward(self, x, mask):
        return self.blocks[1](self.blocks[0](x), mask)


class ExplicitNet(nn.Module):
    """LayerNorm -> qkv -> softmax(q @ kᵀ · s) @ v written out."""

    def __init__(self):
        super().__init__()
        self.ln, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).split(D, dim=-1)
        q, k, v = [t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v)]
        a = torch.softmax(q @ k.transpose(-2, -1) * (D // H) ** -0.5, dim=-1)
        return (a @ v).transpose(1, 2).reshape(B, L, D)


def _capture(model, *args):
    torch.manual_seed(0)
    (graph,) = capture_graphs(model, *args)
    return graph


@pytest.fixture(scope="module")
def sdpa_graph():
    torch.manual_seed(0)
    return _capture(SdpaNet(), torch.randn(B, L, D), torch.randn(L, L))


@pytest.fixture(scope="module")
def explicit_graph():
    torch.manual_seed(0)
    return _capture(ExplicitNet(), torch.randn(B, L, D))


@pytest.fixture(params=["sdpa", "explicit"])
def graph(request, sdpa_graph, explicit_graph):
    return {"sdpa": sdpa_graph, "explicit": explicit_graph}[request.param]


def _build(graph, **options):
    """Sites, plans and their state, as the backend builds them."""
    sites = analyze_graph(graph.gm, graph.example_inputs)
    taken: set[str] = set()
    plans = []
    for site in sites:
        key = site_key(site.name, taken)
        taken.add(key)
        plan = plan_site(site, GeoscaleOptions(**options), key, CPU)
        assert isinstance(plan, SitePlan), plan
        plans.append(plan)
    gs = GeoscaleState()
    states = [gs.get_or_create(p.key, p.state_specs(), "cpu") for p in plans]
    return sites, plans, states


def _run(gm, graph, states=()):
    with torch.no_grad():   # flex_attention has no CPU backward; inference as planned
        return gm(*graph.example_inputs, *[t for s in states for t in s.tensors()])


def _snapshot(gm):
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]


def _calls(gm, predicate):
    return [n for n in gm.graph.nodes if n.op == "call_function" and predicate(n.target)]


def _is_sdpa(target):
    return target is F.scaled_dot_product_attention


def _placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


# --------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------

def test_the_captured_graphs_have_the_expected_sites(sdpa_graph, explicit_graph):
    """Sanity of the fixtures: two SDPA sites, one explicit site, all supported."""
    sites = analyze_graph(sdpa_graph.gm, sdpa_graph.example_inputs)
    assert [(s.kind, s.supported, s.has_mask) for s in sites] == [("sdpa", True, False),
                                                                  ("sdpa", True, True)]
    assert len(_calls(sdpa_graph.gm, _is_sdpa)) == 2
    (site,) = analyze_graph(explicit_graph.gm, explicit_graph.example_inputs)
    assert (site.kind, site.supported, site.score_op) == ("explicit", True, "matmul")


@pytest.mark.parametrize("options", [{}, {"scaling": "none"}, {"lowering": "explicit"}])
def test_rewrite_leaves_the_original_graph_module_unchanged(graph, options):
    """rewrite() works on a copy: the original's nodes and code stay as they were."""
    before, code = _snapshot(graph.gm), graph.gm.code
    _, plans, states = _build(graph, **options)
    new = rewrite(graph.gm, plans, [s.names for s in states])
    assert new is not graph.gm and new.graph is not graph.gm.graph
    assert _snapshot(graph.gm) == before
    assert graph.gm.code == code


@pytest.mark.parametrize("options", [{}, {"scaling": "none"}, {"lowering": "explicit"},
                                     {"scaling": "delayed"}])
def test_every_sdpa_call_is_replaced_by_one_program_per_site(sdpa_graph, options):
    """No SDPA call is left; each site is one call of ``geoscale_<key>``."""
    _, plans, states = _build(sdpa_graph, **options)
    new = rewrite(sdpa_graph.gm, plans, [s.names for s in states])
    assert _calls(new, _is_sdpa) == []
    for plan in plans:
        calls = _calls(new, lambda t, k=plan.key: getattr(t, "__name__", "") == f"geoscale_{k}")
        assert len(calls) == 1, plan.key
    programs = _calls(new, lambda t: getattr(t, "__name__", "").startswith("geoscale_"))
    assert len(programs) == len(plans) == 2


def test_inplace_site_routes_its_logits_through_one_program(explicit_graph):
    """The explicit attention keeps softmax and ·V; its scores node feeds the program."""
    (site,), plans, states = _build(explicit_graph)
    new = rewrite(explicit_graph.gm, plans, [s.names for s in states])
    (call,) = _calls(new, lambda t: getattr(t, "__name__", "") == f"geoscale_{plans[0].key}")
    assert call.args[0].name == site.node_name("logits")
    assert len(_calls(new, lambda t: t is torch.softmax)) == 1
    assert [u.name for u in call.args[0].users] == [call.name]   # the rest reads the program


@pytest.mark.parametrize("options", [{}, {"scaling": "none"}, {"scaling": "current"}])
def test_state_placeholders_are_appended_in_order(graph, options):
    """New placeholders ``geoscale_<key>_<name>`` follow the originals, site by site."""
    _, plans, states = _build(graph, **options)
    new = rewrite(graph.gm, plans, [s.names for s in states])
    expected = _placeholders(graph.gm) + [f"geoscale_{p.key}_{n}" for p, s in zip(plans, states)
                                          for n in s.names]
    assert _placeholders(new) == expected
    nodes = [n for n in new.graph.nodes]
    last_placeholder = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    assert all(n.op == "placeholder" for n in nodes[:last_placeholder + 1])


@pytest.mark.parametrize("options", [{}, {"scaling": "none"}, {"scaling": "delayed"}])
def test_program_arguments_are_weights_then_state(sdpa_graph, options):
    """An SDPA program takes q, k, v, mask, the plan's weight nodes, then its state."""
    _, plans, states = _build(sdpa_graph, **options)
    new = rewrite(sdpa_graph.gm, plans, [s.names for s in states])
    for plan, state, has_mask in zip(plans, states, (False, True)):
        (call,) = _calls(new, lambda t, k=plan.key: getattr(t, "__name__", "") == f"geoscale_{k}")
        args = [a.name if isinstance(a, torch.fx.Node) else a for a in call.args]
        n_w = len(plan.weight_names)
        assert (args[3] is not None) is has_mask
        assert tuple(args[4:4 + n_w]) == plan.weight_names
        assert args[4 + n_w:] == [f"geoscale_{plan.key}_{n}" for n in state.names]
    if options.get("scaling") == "delayed":
        assert all(p.weight_names == () for p in plans)


@pytest.mark.parametrize("graph_name, options, lowering, n", [
    ("sdpa", {"lowering": "fused"}, "fused", 2),
    ("sdpa", {"scaling": "none", "lowering": "fused"}, "fused", 2),
    ("sdpa", {}, "explicit", 2),              # auto: aot_eager does not fuse flex_attention
    ("sdpa", {"lowering": "explicit"}, "explicit", 2),
    ("sdpa", {"audit": True}, "explicit", 2),
    ("explicit", {}, "inplace", 1),
    ("explicit", {"scaling": "none"}, "inplace", 1),
])
def test_rewrite_counters_count_each_site_once(sdpa_graph, explicit_graph, graph_name,
                                              options, lowering, n):
    """counters['geoscale']['rewrite_<lowering>'] grows by the number of sites per compiled
    graph, only it — however many variants of the graph are compiled (predictive, reuse)."""
    from geoscale_fx.compile.dynamo_backend import GeoscaleBackend

    graph = {"sdpa": sdpa_graph, "explicit": explicit_graph}[graph_name]
    backend = GeoscaleBackend(GeoscaleOptions.from_kwargs(compiler="aot_eager", **options))
    counters.clear()
    with torch.no_grad():
        backend(graph.gm, graph.example_inputs)
    rewrites = {k: v for k, v in counters["geoscale"].items() if k.startswith("rewrite_")}
    assert rewrites == {f"rewrite_{lowering}": n}
    with torch.no_grad():
        backend(graph.gm, graph.example_inputs)
    assert counters["geoscale"][f"rewrite_{lowering}"] == 2 * n


def test_mask_modifier_is_counted(sdpa_graph):
    """Sites with a mask count their modifier next to the rewrite."""
    from geoscale_fx.compile.dynamo_backend import GeoscaleBackend

    sites = analyze_graph(sdpa_graph.gm, sdpa_graph.example_inputs)
    counters.clear()
    with torch.no_grad():
        GeoscaleBackend(GeoscaleOptions.from_kwargs(compiler="aot_eager"))(
            sdpa_graph.gm, sdpa_graph.example_inputs)
    expected = {}
    for site in sites:
        for m in site.modifiers:
            expected[f"modifier_{m.kind}"] = expected.get(f"modifier_{m.kind}", 0) + 1
    assert {k: v for k, v in counters["geoscale"].items() if k.startswith("modifier_")} == \
        expected


# --------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{"scaling": "none"},
                                     {"scaling": "none", "lowering": "explicit"}])
def test_without_scaling_the_rewritten_graph_computes_the_same(graph, options):
    """scaling='none': the program reproduces the original attention exactly (fp32)."""
    _, plans, states = _build(graph, **options)
    new = rewrite(graph.gm, plans, [s.names for s in states])
    (expected,) = _run(graph.gm, graph)
    (out,) = _run(new, graph, states)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for state in states:
        assert state.steps.item() == 1.0


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_geometry_scale_is_the_bound_over_eta_rmax_after_one_call(graph, granularity):
    """One call: bound = the site's logit bound, scale = bound / (0.8 · 448), steps = 1."""
    sites, plans, states = _build(graph, estimator="exact", granularity=granularity)
    new = rewrite(graph.gm, plans, [s.names for s in states])
    (expected,) = _run(graph.gm, graph)
    (out,) = _run(new, graph, states)
    for site, plan, state in zip(sites, plans, states):
        assert state.steps.item() == 1.0
        bound = state.bound.double()
        assert bound.shape == (plan.n_scale,) and bool((bound > 0).all())
        reference = site_logit_bound(site)
        if granularity == "head":
            torch.testing.assert_close(bound, reference, rtol=1e-5, atol=0)
        else:
            assert bound.item() >= reference.max().item() * (1 - 1e-6)
        torch.testing.assert_close(state.scale.double(), bound / (0.8 * FP8_MAX["e4m3"]),
                                   rtol=1e-6, atol=0)
        assert state.overflow_steps.item() == 0
    diff = (out - expected).abs().max().item()
    assert 0 < diff < 5e-2     # FP8 logits: close to, not equal to, the original


def test_geometry_steps_count_every_call(explicit_graph):
    """State is updated in place: steps counts calls, the scale stays the bound's."""
    _, plans, states = _build(explicit_graph, estimator="exact")
    new = rewrite(explicit_graph.gm, plans, [s.names for s in states])
    for _ in range(3):
        _run(new, explicit_graph, states)
    assert states[0].steps.item() == 3.0
    torch.testing.assert_close(states[0].scale.double(),
                               states[0].bound.double() / (0.8 * 448.0), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------
# Observed maximum (explicit lowering)
# --------------------------------------------------------------------------------------

def _amax_reference(logits: torch.Tensor, n_scale: int) -> torch.Tensor:
    """max |S| per scale by loops: slice i of the flattened leading dims belongs to scale
    ``i % n_scale`` (heads on dim -3; one scale: everything)."""
    slices = logits.reshape(-1, *logits.shape[-2:])
    out = [float("-inf")] * n_scale
    for i, s in enumerate(slices):
        value = s.abs().max().item()
        j = i % n_scale
        out[j] = value if math.isnan(value) or math.isnan(out[j]) else max(out[j], value)
    return torch.tensor(out)


@pytest.mark.parametrize("shape, n_scale", [((2, 4, 3, 5), 4), ((2, 4, 3, 5), 2),
                                            ((2, 4, 3, 5), 1), ((4, 1, 7), 4)])
def test_per_scale_amax_is_the_max_abs_logit_of_each_scale(shape, n_scale):
    """One value per scale, against loops over the slices; a NaN stays in its own scale."""
    from types import SimpleNamespace

    from geoscale_fx.compile.rewrite import _per_scale_amax
    torch.manual_seed(0)
    logits = torch.randn(shape) * 10
    plan = SimpleNamespace(n_scale=n_scale)
    assert torch.equal(_per_scale_amax(plan, logits), _amax_reference(logits, n_scale))
    logits.reshape(-1, *shape[-2:])[-1, 0, 0] = float("nan")   # the last slice's scale
    amax = _per_scale_amax(plan, logits)
    assert torch.equal(amax.isnan(), torch.arange(n_scale) == n_scale - 1)
    assert torch.equal(amax[:-1], _amax_reference(logits, n_scale)[:-1])


def test_per_scale_amax_is_one_reduction():
    """A single amax (Inductor: one (n_scale,) buffer, no second reduction over groups)."""
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    from geoscale_fx.compile.rewrite import _per_scale_amax
    plan = SimpleNamespace(n_scale=4)
    gm = make_fx(lambda s: _per_scale_amax(plan, s))(torch.randn(2, 4, 1, 9))
    reductions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.amax.default]
    assert len(reductions) == 1
    assert tuple(reductions[0].meta["val"].shape) == (4,)


# --------------------------------------------------------------------------------------
# sdpa_call_options / make_program
# --------------------------------------------------------------------------------------

def _sdpa_node(n_kv: int = 2, d_h: int = 8, **kwargs):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    graph = _capture(f, torch.randn(1, 4, L, d_h), torch.randn(1, n_kv, L, d_h),
                     torch.randn(1, n_kv, L, d_h))
    (node,) = _calls(graph.gm, _is_sdpa)
    return node


@pytest.mark.parametrize("d_h", [8, 5])
def test_sdpa_call_options_default_scale_is_one_over_sqrt_head_dim(d_h):
    """scale=None: 1/√d_h from the query's recorded shape; flags off."""
    options = sdpa_call_options(_sdpa_node(n_kv=4, d_h=d_h))
    assert options == {"softmax_scale": pytest.approx(1 / math.sqrt(d_h)), "is_causal": False,
                       "enable_gqa": False, "dropout_p": 0.0}


def test_sdpa_call_options_reads_custom_scale_causal_gqa_and_dropout():
    """Explicit keyword arguments come through as static Python values."""
    options = sdpa_call_options(_sdpa_node(n_kv=2, scale=0.3, is_causal=True,
                                           enable_gqa=True, dropout_p=0.25))
    assert options == {"softmax_scale": pytest.approx(0.3), "is_causal": True,
                       "enable_gqa": True, "dropout_p": pytest.approx(0.25)}
    assert isinstance(options["is_causal"], bool) and isinstance(options["enable_gqa"], bool)


def test_make_program_is_named_after_the_site_key(sdpa_graph, explicit_graph):
    """The program's __name__/__qualname__ is geoscale_<key> for every lowering."""
    for graph, options in ((sdpa_graph, {}), (sdpa_graph, {"lowering": "explicit"}),
                           (explicit_graph, {})):
        _, plans, states = _build(graph, **options)
        for plan, state in zip(plans, states):
            program = make_program(plan, state.names)
            assert program.__name__ == program.__qualname__ == f"geoscale_{plan.key}"
