"""``amax.site_amax_bounds(site)``: certified per-head bounds on the entries of q, k and v,
checked against the tensors the attention really receives, under inputs optimized to
maximize them (gains ×4, biases perturbed), on today's attention forms."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.numerics.amax import site_amax_bounds
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph
from tests import analysis_checks as checks
from tests.analysis.test_modern_attention import _build
from tests.float_checks import assert_certified

pytestmark = pytest.mark.zoo

FAMILIES = [("gpt2", "sdpa"), ("llama", "sdpa"), ("qwen3", "sdpa"), ("gpt_oss", "eager"),
            ("deepseek_v3", "sdpa"), ("codegen", "eager"), ("cohere", "sdpa"),
            ("olmo2", "sdpa"), ("gemma3_text", "sdpa"), ("gemma2", "eager"), ("bloom", "eager"),
            ("llama4_text", "sdpa")]


def _model(family, impl):
    if family in ("gpt2", "llama"):
        from tests.hf_models import build_hf
        return build_hf(f"{family}-{impl}")
    return _build(family, impl)


def _operands(gm, site):
    q, k, k_transposed = checks.operands(gm, site)
    node = next(n for n in gm.graph.nodes if n.name == site.node)
    if site.kind == "sdpa":
        v = node.args[2]
    else:
        from geoscale_fx.analysis.fx.graph_ops import matmul_operands
        pv = next(n for n in gm.graph.nodes if n.name == site.node_name("pv"))
        v = matmul_operands(pv)[1]
    return {"q": (q, False), "k": (k, k_transposed), "v": (v, False)}


def _per_head_amax(t, n_heads):
    """max |entry| per head of a (B, H, L, D) (or (B, H, D, L)) operand, GQA-repeated heads
    folded onto their ``n_heads`` kv heads; a (B·H, L, D) operand (BLOOM's baddbmm) has
    ``n_heads`` heads."""
    if t.dim() == 3:
        t = t.reshape(-1, n_heads, *t.shape[-2:])
    a = t.abs().amax(dim=(0, -2, -1))                     # (H,)
    return a.reshape(n_heads, -1).amax(dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("family,impl", FAMILIES)
def test_amax_bounds_hold_against_optimized_inputs(family, impl, capsys):
    model = _model(family, impl)
    checks.scale_up_gains_and_biases(model)
    graph = capture_graphs(model, inputs_embeds=torch.randn(2, 12, 64))[0]
    sites = [s for s in analyze_graph(graph.gm, graph.example_inputs)]
    assert sites and all(s.supported for s in sites)
    # post-norm blocks (OLMo2) project v from the raw residual stream: no bound, said so
    post_norm = [s for s in sites if s.value is None]
    assert [s.name for s in post_norm] == ([s.name for s in sites] if family == "olmo2" else [])
    for site in post_norm:
        assert "no normalization" in site.value_reason
        with pytest.raises(ValueError, match="values could not be traced"):
            site_amax_bounds(site)
    bounds = [site_amax_bounds(s, roles="qk" if s.value is None else "qkv") for s in sites]
    worst = {role: 0.0 for role in bounds[0]}

    def ratios(values):
        found = []
        for site, bound in zip(sites, bounds):
            for role, (node, _) in _operands(graph.gm, site).items():
                if role not in bound:
                    continue
                observed = _per_head_amax(values[node.name].double(), bound[role].numel())
                ratio = observed / bound[role]
                assert (ratio <= 1 + 1e-6).all(), (site.name, role, ratio)
                worst[role] = max(worst[role], float(ratio.max()))
                found.append(ratio.max())
        return torch.stack(found).sum()

    checks.ascend_inputs_embeds(graph, ratios, steps=15)
    assert min(worst.values()) > 0.05
    with capsys.disabled():
        print(f"\n{family}/{impl}: worst observed/bound of max|entry|: "
              f"{ {r: round(v, 3) for r, v in worst.items()} }")


def test_amax_of_identity_sides_is_the_radius_times_the_gain():
    """A learned query (rows of w) over RMSNorm'd keys and values: every entry of q is at most
    max_r ‖w_r‖, of k and v at most √D·max_{i∈h}|g_i| (A_h = diag(g) on the head's channels),
    and the tensors SDPA receives stay below."""
    from tests.attention_variants import DH, H, LearnedQueryPooling

    torch.manual_seed(0)
    model = LearnedQueryPooling().eval()
    checks.scale_up_gains_and_biases(model)
    graph = capture_graphs(model, torch.randn(2, 12, 64))[0]
    site, = analyze_graph(graph.gm, graph.example_inputs)
    bound = site_amax_bounds(site)
    rho_q = torch.linalg.vector_norm(model.query.detach().double(), dim=-1).max()
    g = model.norm.weight.detach().double().reshape(H, DH).abs().amax(dim=-1)
    torch.testing.assert_close(bound["q"], rho_q.expand(H), rtol=1e-12, atol=0)
    torch.testing.assert_close(bound["k"], 64 ** 0.5 * g, rtol=1e-12, atol=0)
    torch.testing.assert_close(bound["v"], bound["k"], rtol=0, atol=0)
    inputs = list(graph.example_inputs)
    values = checks.record(graph.gm, inputs)
    for role, (node, _) in _operands(graph.gm, site).items():
        observed = _per_head_amax(values[node.name].double(), H)
        assert (observed <= bound[role] * (1 + 1e-6)).all(), role


def test_entry_bounds_are_never_below_their_float64_recomputation():
    """ρ‖g ⊙ w_i‖ + |w_i·β + b_i| per channel, max per head, against the same formula in
    float64 by hand. The fold ``diag(g)·W`` and ``c = Wβ + b`` used to be float32: 115 of 240
    head bounds of 20 such blocks came out below the float64 value, up to 3.6e-8 relative,
    and 7 of 240 scales rounded up from them under B/448 (``python -m bench.fold_rounding``
    on the commit before)."""
    from tests.attention_variants import Block, D, DH

    torch.manual_seed(0)
    block = Block(layout="separate", qk_bias=True).eval()
    graph = capture_graphs(block, torch.randn(1, 6, D))[0]
    site, = analyze_graph(graph.gm, graph.example_inputs)
    for seed in range(6):                      # the site reads the live parameters
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(generator=generator)
            block.norm.weight.uniform_(0.5, 2.0, generator=generator)
        bound = site_amax_bounds(site)
        g, beta = (block.norm.weight.detach().double(), block.norm.bias.detach().double())
        for role in "qkv":
            w = getattr(block, role).weight.detach().double()                    # (F, D)
            c = w @ beta + getattr(block, role).bias.detach().double()
            entry = D ** 0.5 * torch.linalg.vector_norm(w * g, dim=1) + c.abs()
            # float64 sums over D = 64 terms on both sides: ~64·2⁻⁵³ of the terms'
            # magnitudes apart; 1e-12 leaves room for the cancellation inside Wβ + b
            assert_certified(bound[role], entry.reshape(-1, DH).amax(dim=-1), rtol=1e-12,
                             msg=f"seed {seed}, {role}")
