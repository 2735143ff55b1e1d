"""Today's attention forms, on Hugging Face configs and hand-written modules: QK-norm (per
head, over the whole projection, LayerNorm with bias, Gemma's ``1 + w``), softcapping, a
hand-written LayerNorm before the projection, ALiBi as a ``baddbmm`` position bias. Every site is found, supported and certified;
the bound holds against adversarial inputs with gains ×4 and q/k biases perturbed; with
``scaling="none"`` the rewritten model equals eager.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import geoscale_fx
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests import analysis_checks as checks
from tests.inductor_platform import skip_where_the_cpu_cannot_fuse

COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
              vocab_size=128, max_position_embeddings=64)

#: family → (config kwargs, attention implementations, (n_q, n_kv, d_h), source width, norm)
FAMILIES = {
    "qwen3": (dict(num_key_value_heads=2, head_dim=16), ("sdpa", "eager"), (4, 2, 16), 16,
              "rmsnorm"),
    "olmo2": (dict(num_key_value_heads=2, pad_token_id=0, eos_token_id=0), ("sdpa",),
              (4, 2, 16), 64, "rmsnorm"),
    "gemma3_text": (dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=4, pad_token_id=0, bos_token_id=0, eos_token_id=0),
                    ("sdpa",), (4, 2, 16), 16, "rmsnorm"),
    "gemma2": (dict(num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0,
                    sliding_window=16), ("eager",), (4, 2, 16), 64, "rmsnorm"),
    "cohere": (dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
               ("sdpa",), (4, 2, 16), 64, "layernorm"),
    # ALiBi through ``alibi.baddbmm(batch1=q, batch2=k)`` and a (B·H) → (B, H) view
    "bloom": (dict(), ("eager",), (4, 4, 16), 64, "layernorm"),
    # sinks joined by ``cat`` + max-subtraction; RoPE in the halves form with YaRN tables
    "gpt_oss": (dict(num_key_value_heads=2, head_dim=16, num_local_experts=2,
                     num_experts_per_tok=1, sliding_window=4), ("eager",), (4, 2, 16), 64,
                "rmsnorm"),
    # MLA: two terms (latent part from q_a/kv_a norms; decoupled RoPE key from the layer
    # input norm), the key assembled by ``new_empty`` + ``copy_``, de-interleaved halves RoPE
    "deepseek_v3": (dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
                         moe_intermediate_size=32, first_k_dense_replace=2,
                         n_shared_experts=1), ("sdpa", "eager"), (4, 4, 16), 16, "rmsnorm"),
    # complex RoPE (view_as_complex) then a weightless L2 QK-norm; layer 1: NoPE with the
    # per-position attention temperature
    "llama4_text": (dict(num_key_value_heads=2, head_dim=16, intermediate_size_mlp=128,
                         num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=4,
                         bos_token_id=0, eos_token_id=0, attn_temperature_tuning=True,
                         floor_scale=4, attn_scale=0.1, no_rope_layers=[1, 0]),
                    ("sdpa",), (4, 2, 16), None, "rmsnorm"),
    # a sinusoid buffer gathered by position ids, interleaved pairs, partial rotary, mp_num=4
    "codegen": (dict(rotary_dim=8, n_ctx=64, bos_token_id=0, eos_token_id=0), ("eager",),
                (4, 4, 16), 64, "layernorm"),
}
CASES = [(f, impl) for f, (_, impls, *_rest) in FAMILIES.items() for impl in impls]


def _build(family: str, impl: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.CONFIG_MAPPING[family](**COMMON, **FAMILIES[family][0],
                                              attn_implementation=impl)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.zoo
@pytest.mark.parametrize("family,impl", CASES)
def test_every_site_is_found_supported_certified_and_its_terms_make_up_the_operands(family, impl):
    """One capture (``find_attention`` is ``analyze_graph`` over each captured graph): both
    sites found, supported and certified, with the family's head shapes, source width and
    norm; each term's sides, recomputed from its own normalized source and head weights, make
    up the graph's own queries and keys (squared norms per head and token add up)."""
    from geoscale_fx.analysis.analyze import analyze_graph
    from geoscale_fx.analysis.capture import capture_graphs

    _, _, heads, width, norm = FAMILIES[family]
    graph, = capture_graphs(_build(family, impl), input_ids=torch.randint(0, 128, (2, 10)))
    sites = analyze_graph(graph.gm, graph.example_inputs)
    assert len(sites) == 2
    for site in sites:
        assert site.supported and site.certified, site.reason
        assert (site.n_q_heads, site.n_kv_heads, site.head_dim) == heads
        q = site.terms[0].q
        assert (q.source.width if width is not None else None, q.source.norm) == (width, norm)
    values = checks.record(graph.gm, graph.example_inputs)
    for site in sites:
        checks.check_term_norms(graph.gm, values, site, batch=2)


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.parametrize("family,impl", CASES)
def test_bound_holds_under_adversarial_inputs(family, impl, capsys):
    model = _build(family, impl)
    checks.scale_up_gains_and_biases(model)
    sites, worst, _ = checks.adversarial(model)
    assert len(sites) == 2 and (worst <= 1 + 1e-6).all(), worst
    assert worst.max() > 0.05, "the optimizer should find sizeable logits"
    with capsys.disabled():
        print(f"\n{family}/{impl}: worst observed/bound per site under ×4 gains: "
              f"{[round(v, 3) for v in worst.tolist()]}")


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.parametrize("family,impl", CASES)
def test_scaling_none_equals_eager_and_geometry_runs(family, impl):
    model = _build(family, impl)
    ids = torch.randint(0, 128, (2, 10))
    # the rewritten graphs run eagerly: the rewrite per family, without the AOT trace (the
    # AOT path has its own tests)
    checks.assert_none_scaling_equals_eager(model, {"input_ids": ids}, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        geometry = geoscale_fx.wrap(model, compiler="eager", audit=True)
        geometry(input_ids=ids)
    records = list(geometry.geoscale.records.values())
    assert len(records) == 2 and not geometry.geoscale.skipped
    assert all(r.state.overflow_steps.item() == 0 for r in records)


# --------------------------------------------------------------------------------------
# QK-norm bounds, exactly
# --------------------------------------------------------------------------------------

class QKNormed(torch.nn.Module):
    """q/k through a per-head norm after the projection (LayerNorm with bias, or RMSNorm)."""

    def __init__(self, norm: str = "layernorm", d: int = 32, heads: int = 4, rope=False):
        super().__init__()
        self.heads, self.dh, self.rope = heads, d // heads, rope
        self.norm, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)
        make = (lambda: torch.nn.LayerNorm(self.dh)) if norm == "layernorm" else \
            (lambda: torch.nn.RMSNorm(self.dh))
        self.q_norm, self.k_norm = make(), make()
        with torch.no_grad():
            for m in (self.q_norm, self.k_norm):
                m.weight.uniform_(-3.0, 3.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, self.dh).unbind(2)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)   # (B, H, L, d_h)
        v = v.transpose(1, 2)
        if self.rope:
            angles = torch.arange(n)[:, None] * torch.linspace(0.1, 1.0, self.dh // 2)
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()

            def rotate(t):
                half = t.shape[-1] // 2
                return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin
            q, k = rotate(q), rotate(k)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("rope", [False, True])
def test_qk_norm_bound_is_the_per_channel_form(norm, rope):
    """Without rotation: |S| ≤ s·(d_h·max_i|g_q,i g_k,i| + offsets); with RoPE, the norm
    product s·(√d_h max|g_q| + ‖β_q‖)(√d_h max|g_k| + ‖β_k‖). No spectral norm of W."""
    model = QKNormed(norm, rope=rope)
    site, = geoscale_fx.find_attention(model, torch.randn(2, 6, 32))
    assert site.supported and site.certified and site.q.weight is None
    assert site.q.source.width == 8 and site.q.source.norm == norm
    gq, gk = model.q_norm.weight.detach().double(), model.k_norm.weight.detach().double()
    bq = getattr(model.q_norm, "bias", None)
    bq = bq.detach() if bq is not None else None
    bk = getattr(model.k_norm, "bias", None)
    bk = bk.detach() if bk is not None else None
    s, dh = 8 ** -0.5, 8
    if rope:
        nq = math.sqrt(dh) * gq.abs().max() + (bq.double().norm() if bq is not None else 0)
        nk = math.sqrt(dh) * gk.abs().max() + (bk.double().norm() if bk is not None else 0)
        expected = s * nq * nk
    else:
        expected = s * dh * (gq * gk).abs().max()
        if bq is not None:
            bq, bk = bq.double(), bk.double()
            expected = s * (dh * (gq * gk).abs().max() + math.sqrt(dh) * (
                (gq * bk).norm() + (gk * bq).norm()) + (bq @ bk).abs())
    torch.testing.assert_close(site_logit_bound(site), torch.full((4,), float(expected),
                                                              dtype=torch.float64),
                               rtol=1e-6, atol=0)


def test_qk_norm_bound_is_attained_without_rotation():
    """RMSNorm can put all of √d_h on one channel: the per-channel bound is tight."""
    model = QKNormed("rmsnorm")
    site, = geoscale_fx.find_attention(model, torch.randn(2, 6, 32))
    gq, gk = model.q_norm.weight.detach(), model.k_norm.weight.detach()
    i = int((gq * gk).abs().argmax())
    e = torch.zeros(8)
    e[i] = math.sqrt(8)
    attained = 8 ** -0.5 * float((gq * e) @ (gk * e)).__abs__()
    assert attained == pytest.approx(float(site_logit_bound(site)[0]), rel=1e-6)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_qk_norm_bound_holds_on_adversarial_inputs(norm):
    """Gradient ascent on the input maximizes max|S|/bound; never above 1."""
    model = QKNormed(norm)
    site, = geoscale_fx.find_attention(model, torch.randn(2, 6, 32))
    bound = site_logit_bound(site).max()
    x = torch.randn(2, 6, 32, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.1)
    best = 0.0
    for _ in range(60):
        b, n, d = x.shape
        q, k, _ = model.qkv(model.norm(x)).view(b, n, 3, 4, 8).unbind(2)
        s = (model.q_norm(q).transpose(1, 2) @ model.k_norm(k).transpose(1, 2).transpose(-1, -2))
        ratio = (s.abs().max() * 8 ** -0.5) / bound
        best = max(best, float(ratio))
        opt.zero_grad()
        (-ratio).backward()
        opt.step()
    assert 0.3 < best <= 1 + 1e-6


def test_qk_norm_site_with_scaling_none_equals_eager_and_geometry_is_exact():
    model = QKNormed("layernorm", rope=True)
    x = torch.randn(2, 6, 32)
    checks.assert_none_scaling_equals_eager(model, x, compiler="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        fp8 = geoscale_fx.wrap(model, compiler="aot_eager", audit=True, estimator="exact")
        fp8(x)
    record, = fp8.geoscale.records.values()
    site, = geoscale_fx.find_attention(model, x)
    torch.testing.assert_close(record.state.bound.double(), site_logit_bound(site), rtol=1e-5,
                               atol=0)
    assert record.state.overflow_steps.item() == 0


@pytest.mark.inductor
def test_qk_norm_model_end_to_end_with_inductor():
    skip_where_the_cpu_cannot_fuse()
    model = QKNormed("rmsnorm", rope=True)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        fp8 = geoscale_fx.wrap(model)
        out = fp8(x)
    record, = fp8.geoscale.records.values()
    assert record.plan.lowering == "fused" and record.state.steps.item() == 1
    assert math.isfinite(float(out.abs().max()))
    torch.testing.assert_close(out, model(x), rtol=0.1, atol=0.1)
