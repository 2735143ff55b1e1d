"""Sources bounded by value (``analysis.norms.parameter_bound``): no normalization before the projection,
``‖x‖`` bounded by the parameters' values — the walk, the refusals it keeps, and the bound
against adversaries (the largest table row everywhere, gradient ascent with inflated gains)
and in a training step (the in-graph radius follows the weights)."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import geoscale_fx
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.numerics.head_weights import side_radius
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of
from geoscale_fx.analysis.index.index_replay import Unsupported
from geoscale_fx.analysis.norms.normalization import trace_normalized_input
from geoscale_fx.analysis.norms.parameter_bound import trace_value_bound
from tests import analysis_checks as checks
from tests.attention_variants import (
    D, DH, H, Block, EmbeddedTokens, EmbeddingProjection, LearnedQueryPooling, PaddingMasked,
    Unnormalized,
)

B, L = 2, 12


def _site(model, x):
    (graph,) = capture_graphs(model, x)
    site, = analyze_graph(graph.gm, graph.example_inputs)
    return graph, site


def _input_position(graph, x) -> int:
    return next(i for i, v in enumerate(graph.example_inputs)
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                and v.shape == x.shape and v.is_floating_point())


def _observed(graph, site, x) -> torch.Tensor:
    inputs = list(graph.example_inputs)
    inputs[_input_position(graph, x)] = x
    return checks.observed_logits(graph.gm, checks.record(graph.gm, inputs), site, x.shape[0])


def _head_sigma(block: Block) -> torch.Tensor:
    """σ_h = ‖W_q,hᵀ W_k,h‖₂ per head, from the module's own weights (float64)."""
    wq = block.q.weight.detach().double().reshape(H, DH, D)
    wk = block.k.weight.detach().double().reshape(H, DH, D)
    return torch.linalg.matrix_norm(wq.transpose(1, 2) @ wk, ord=2)


# --------------------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------------------

def test_the_module_example():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(10, 8), nn.Embedding(4, 8)
            self.q = nn.Linear(8, 8)

        def forward(self, ids):
            return self.q(self.tok(ids) + self.pos(torch.arange(ids.shape[-1])))

    (g,) = capture_graphs(Embed(), torch.zeros(1, 4, dtype=torch.long))
    q = next(n for n in g.gm.graph.nodes if op_of(n) == "linear")
    expr = trace_value_bound(q.args[0], ValueKinds(g.gm.graph, g.example_inputs))
    table = next(n.name for n in g.gm.graph.nodes if n.op == "placeholder" and "tok" in n.name)
    gather = next(n.name for n in g.gm.graph.nodes if n.op == "call_function"
                  and "pos" in str(n.args[1:2]))
    assert expr == ("sum", ("rows", table, 8), ("rows", gather, 8))


def test_the_embedding_radius_is_the_largest_rows_of_the_two_tables():
    model = EmbeddedTokens().eval()
    graph, site = _site(model, torch.randn(B, L, D))
    assert site.supported and site.certified and site.norm == "bounded"
    source = site.q.source
    assert source.bounded and source.channel_ops == () and source.width == D
    with pytest.raises(ValueError, match="bounded by parameter values"):
        source.radius
    tok = torch.linalg.vector_norm(model.tok.weight.detach().double(), dim=-1).max()
    pos = torch.linalg.vector_norm(model.pos.weight[:L].detach().double(), dim=-1).max()
    rho = side_radius(site.q, site._resolve)
    torch.testing.assert_close(rho, tok + pos, rtol=1e-12, atol=0)
    # the in-graph programs and the host refresh read the token table
    table = next(n.name for n in graph.gm.graph.nodes if n.op == "placeholder"
                 and "tok" in n.name)
    assert table in site.weight_nodes and table in site.parameter_nodes
    bound = site_logit_bound(site)
    torch.testing.assert_close(bound, DH ** -0.5 * rho ** 2 * _head_sigma(model.block),
                               rtol=1e-9, atol=0)


def test_an_embedding_projection_is_bounded_by_its_exact_spectral_norm():
    model = EmbeddingProjection().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 3.0)
        model.norm.bias.normal_()
    _, site = _site(model, torch.randn(B, L, D))
    assert site.supported and site.norm == "bounded"
    e = EmbeddingProjection.E
    norm = math.sqrt(e) * model.norm.weight.detach().double().abs().max() + \
        torch.linalg.vector_norm(model.norm.bias.detach().double())
    sigma = torch.linalg.svdvals(model.project.weight.detach().double())[0]
    expected = sigma * norm + torch.linalg.vector_norm(model.project.bias.detach().double())
    torch.testing.assert_close(side_radius(site.k, site._resolve), expected, rtol=1e-12,
                               atol=0)


def test_a_padding_mask_keeps_the_normalized_radius():
    model = PaddingMasked().eval()
    _, site = _site(model, torch.randn(B, L, D))
    assert site.supported and site.norm == "bounded"
    g, b = model.norm.weight.detach().double(), model.norm.bias.detach().double()
    expected = math.sqrt(D) * g.abs().max() + torch.linalg.vector_norm(b)
    torch.testing.assert_close(side_radius(site.q, site._resolve), expected, rtol=1e-12,
                               atol=0)


class _Twin(nn.Module):
    """The same block on something no parameter value bounds."""

    def __init__(self, form):
        super().__init__()
        self.form, self.norm, self.block = form, nn.LayerNorm(D), Block(norm="none")

    def forward(self, x):
        if self.form == "activation_product":        # LN(x) · x: a product of activations
            return self.block(self.norm(x) * x)
        if self.form == "residual":                  # x + LN(x): the raw input is in the sum
            return self.block(x + self.norm(x))
        return self.block(F.gelu(self.norm(x)))      # an op the walk does not know


@pytest.mark.parametrize("model, reached", [
    (Unnormalized, r"reached `l_x_` \(placeholder\)"),
    (lambda: _Twin("activation_product"), r"reached `\w+` \(mul\)$"),
    (lambda: _Twin("residual"), r"reached `\w+` \(add\)$"),
    (lambda: _Twin("unknown_op"), r"reached `\w+` \(call_function\)$"),
])
def test_what_values_do_not_bound_is_refused_with_the_normalization_walks_reason(model,
                                                                                 reached):
    (graph,) = capture_graphs(model().eval(), torch.randn(B, L, D))
    site, = analyze_graph(graph.gm, graph.example_inputs)
    assert not site.supported and not site.certified
    assert site.reason.startswith("no normalization before the projection `linear`: ")
    assert re.search(reached, site.reason), site.reason
    # exactly the normalization walk's own message
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    linear = next(n for n in graph.gm.graph.nodes if op_of(n) == "linear")
    assert trace_value_bound(linear.args[0], kinds) is None
    with pytest.raises(Unsupported) as refusal:
        trace_normalized_input(linear.args[0], kinds, linear)
    assert str(refusal.value) == site.reason


# --------------------------------------------------------------------------------------
# The bound against adversaries
# --------------------------------------------------------------------------------------

def test_the_bound_holds_when_every_position_reads_the_largest_row():
    """The adversary owns the tables and the ids: every position reads the token row of
    largest norm, and every position row points the same way (‖tok + pos‖ = ‖tok‖ + ‖pos‖,
    the triangle inequality's equality case), along the direction the heads amplify most."""
    torch.manual_seed(0)
    model = EmbeddedTokens().eval()
    wq = model.block.q.weight.detach().double().reshape(H, DH, D)
    wk = model.block.k.weight.detach().double().reshape(H, DH, D)
    m = wq[0].t() @ wk[0]                                          # head 0: xᵀ M x
    top = torch.linalg.eigh((m + m.t()) / 2).eigenvectors[:, -1].float()
    with torch.no_grad():
        model.tok.weight.mul_(4.0)
        norms = torch.linalg.vector_norm(model.tok.weight, dim=-1)
        row = int(norms.argmax())
        model.tok.weight[row] = norms[row] * top                  # still the largest row
        model.pos.weight.copy_(0.5 * top.expand_as(model.pos.weight))
    x = torch.zeros(B, L, D)
    x[..., row] = 1.0                                              # argmax picks `row`
    graph, site = _site(model, torch.randn(B, L, D))
    bound = site_logit_bound(site)
    observed = _observed(graph, site, x).detach()
    assert (observed <= bound * (1 + 1e-6)).all(), (observed, bound)
    # x = ρ·u along the top eigenvector of head 0's symmetric part: S = s·ρ²·λ_max ≤ s·ρ²·σ
    lam = torch.linalg.eigvalsh((m + m.t()) / 2)[-1]
    torch.testing.assert_close(observed[0] / bound[0], lam / _head_sigma(model.block)[0],
                               rtol=1e-4, atol=0)
    # and random ids stay below it too
    assert (_observed(graph, site, torch.randn(B, L, D)) <= bound).all()


@pytest.mark.parametrize("factory", [EmbeddingProjection, PaddingMasked, LearnedQueryPooling])
def test_the_bound_holds_under_gradient_ascent_with_inflated_gains(factory):
    torch.manual_seed(0)
    model = factory().eval()
    checks.scale_up_gains_and_biases(model)          # the LayerNorm's gain ×4 and its bias
    graph, site = _site(model, torch.randn(B, L, D))
    bound = site_logit_bound(site)
    x = torch.randn(B, L, D, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.1)
    worst = 0.0
    for _ in range(30):
        ratio = (_observed(graph, site, x) / bound).max()
        worst = max(worst, float(ratio.detach()))
        opt.zero_grad()
        (-ratio).backward()
        opt.step()
    assert worst <= 1 + 1e-6
    assert worst > 0.05, "the optimizer should find sizeable logits"


# --------------------------------------------------------------------------------------
# Training: the radius is evaluated in the graph, every step
# --------------------------------------------------------------------------------------

def test_the_in_graph_radius_follows_a_changed_embedding_table():
    torch.manual_seed(0)
    model = EmbeddedTokens().train()                 # dropout p = 0.1: ρ / (1 − p)
    wrapped = geoscale_fx.wrap(model, estimator="exact", compiler="aot_eager", audit=True)
    x = torch.randn(B, L, D)

    def step():
        out = wrapped(x)
        out.sum().backward()
        record, = wrapped.geoscale.records.values()
        return record.state.bound.double().clone(), record.state.scale.double().clone()

    def reference():
        tok = torch.linalg.vector_norm(model.tok.weight.detach().double(), dim=-1).max()
        pos = torch.linalg.vector_norm(model.pos.weight[:L].detach().double(), dim=-1).max()
        rho = (tok + pos) / 0.9
        return DH ** -0.5 * rho ** 2 * _head_sigma(model.block)

    bound_1, scale_1 = step()
    torch.testing.assert_close(bound_1, reference(), rtol=1e-6, atol=0)
    assert model.tok.weight.grad is not None and bool(model.tok.weight.grad.abs().sum() > 0)
    with torch.no_grad():
        model.tok.weight.mul_(4.0)
    bound_2, scale_2 = step()
    torch.testing.assert_close(bound_2, reference(), rtol=1e-6, atol=0)
    assert bool((scale_2 > 2.0 * scale_1).all())     # ρ grows ×(4·tok + pos)/(tok + pos)
    record, = wrapped.geoscale.records.values()
    assert record.state.overflow_steps.item() == 0
