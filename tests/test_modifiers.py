"""Score modifiers: softcapping ``c·tanh(S/c)`` found, bounded by ``min(B, c)``, quantized."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.numerics.head_weights import site_term_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests.analysis_checks import assert_none_scaling_equals_eager, audited_record


class Softcapped(torch.nn.Module):
    """Explicit attention with Gemma-2's softcap; ``cap`` may be large (a no-op) or small."""

    def __init__(self, cap: float, d: int = 32, heads: int = 4):
        super().__init__()
        self.cap, self.heads = cap, heads
        self.norm, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)                                                   # (B, H, L, d_h)
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        scores = torch.tanh(scores / self.cap) * self.cap
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def _inflated(cap: float) -> Softcapped:
    model = Softcapped(cap)
    with torch.no_grad():
        model.qkv.weight.mul_(6.0)     # logits in the hundreds: FP8 scaling matters
    return model


def test_softcap_is_a_modifier_and_caps_the_bound():
    model = _inflated(cap=5.0)
    site, = geoscale_fx.find_attention(model, torch.randn(2, 8, 32))
    assert site.supported and site.kind == "explicit"
    assert [m.kind for m in site.modifiers] == ["softcap", "mask"]
    assert site.modifiers[0].value == 5.0
    assert site.softmax_scale == pytest.approx(8 ** -0.5)
    uncapped = site.with_rope_bound("norm_product")      # same site, exact bound
    from geoscale_fx.numerics import logit_bounds

    raw = sum(logit_bounds.term_logit_bound(site, t, hw, "norm_product")
              for t, hw in zip(site.terms, site_term_weights(site)))
    assert bool((raw > 5.0).all())                        # the cap is what binds
    assert torch.equal(site_logit_bound(uncapped), torch.full((4,), 5.0, dtype=torch.float64))


def test_softcap_site_with_scaling_none_equals_eager():
    assert_none_scaling_equals_eager(_inflated(cap=30.0), torch.randn(2, 8, 32),
                                     compiler="aot_eager")


@pytest.mark.parametrize("cap", [5.0, 1e4])
def test_softcap_site_is_quantized_after_the_cap_without_overflow(cap):
    """What the softmax receives is quantized: ``|c·tanh(S/c)| ≤ min(B, c)``, so a small cap
    gives a small scale (fine resolution) and never an overflow."""
    counters.clear()
    model = _inflated(cap)
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager", audit=True)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        out = wrapped(x)
        expected = model(x)
    record, = wrapped.geoscale.records.values()
    assert record.plan.lowering == "inplace"
    assert record.site.node_name("logits") != record.site.node_name("scores")
    assert counters["geoscale"]["modifier_softcap"] == 1
    assert record.state.overflow_steps.item() == 0
    assert float(record.state.bound.max()) <= cap + 1e-9
    assert 0 < float(record.state.max_scaled.max()) <= 0.8 * 448 * (1 + 1e-5)
    # the observed softmax input: |c·tanh(S/c)| over every head
    assert float(record.state.amax.max()) <= min(cap, float(record.state.bound.max())) + 1e-4
    torch.testing.assert_close(out, _quantized_reference(model, x, record.state.scale),
                               rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out, expected, rtol=1e-4, atol=1e-4)   # FP8 did something


def _quantized_reference(model: Softcapped, x: torch.Tensor, scale: torch.Tensor):
    """The model with its softcapped logits fake-quantized per head, written independently."""
    b, n, d = x.shape
    with torch.no_grad():
        q, k, v = model.qkv(model.norm(x)).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        capped = torch.tanh((q @ k.transpose(-1, -2)) * 8 ** -0.5 / model.cap) * model.cap
        s = scale.view(1, 4, 1, 1)
        capped = (capped / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.softmax(capped.masked_fill(~causal, float("-inf")), dim=-1) @ v


@pytest.mark.zoo
def test_gemma2_softcapping_is_found_and_rewritten():
    """HF Gemma-2 (eager attention: HF has no SDPA path for softcapping)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=128, max_position_embeddings=64,
        attn_implementation="eager", attn_logit_softcapping=50.0, sliding_window=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (2, 12))
    sites = geoscale_fx.find_attention(model, input_ids=ids)
    assert [(s.supported, s.n_q_heads, s.n_kv_heads, s.head_dim) for s in sites] == \
        [(True, 4, 2, 16)] * 2
    assert all(s.modifier("softcap").value == 50.0 for s in sites)
    counters.clear()
    assert_none_scaling_equals_eager(model, {"input_ids": ids}, compiler="aot_eager")
    assert counters["geoscale"]["modifier_softcap"] == 2


# --------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): softmax over cat([S, sink]) minus its max, sink column dropped
# --------------------------------------------------------------------------------------

class Sinks(torch.nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)
        self.sinks = torch.nn.Parameter(torch.tensor([0.5, -2.0, 30.0, 1.0]))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)                                                   # (B, H, L, d_h)
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return probs @ v


def test_sinks_are_found_and_the_bound_covers_them():
    model = Sinks()
    site, = geoscale_fx.find_attention(model, torch.randn(2, 6, 32))
    assert site.supported, site.reason
    assert [m.kind for m in site.modifiers] == ["mask", "sink", "mask"]
    from geoscale_fx.numerics import logit_bounds

    raw = sum(logit_bounds.term_logit_bound(site, t, hw, "norm_product")
              for t, hw in zip(site.terms, site_term_weights(site)))
    torch.testing.assert_close(site_logit_bound(site), torch.clamp(raw, min=30.0))


def _sink_site_audited(model, x):
    """``scaling="none"`` equals eager; the geometry audit of one call sees one sink modifier
    and no overflow. Returns the site's record."""
    assert_none_scaling_equals_eager(model, x, compiler="aot_eager")
    record = audited_record(model, x)
    assert counters["geoscale"]["modifier_sink"] == 1
    assert record.state.overflow_steps.item() == 0
    return record


def test_sink_site_scaling_none_equals_eager_and_geometry_never_overflows():
    record = _sink_site_audited(Sinks(), torch.randn(2, 6, 32))
    assert float(record.state.bound.min()) >= 30.0         # the largest sink


# --------------------------------------------------------------------------------------
# ALiBi through baddbmm(bias, q, kᵀ, β, α): split, q·kᵀ quantized, the bias added after
# --------------------------------------------------------------------------------------

class Alibi(torch.nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, slope_scale: float = 1.0,
                 beta: float = 1.0):
        super().__init__()
        self.heads, self.slope_scale, self.beta = heads, slope_scale, beta
        self.norm, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)

    def bias(self, b, n):
        slopes = self.slope_scale * torch.tensor([2.0 ** -(i + 1) for i in range(self.heads)])
        return (slopes[:, None, None] * torch.arange(n)[None, None, :]).repeat(b, n, 1)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).reshape(3, b * self.heads, n, d // self.heads)   # (B·H, L, d_h)
        scores = torch.baddbmm(self.bias(b, n), q, k.transpose(1, 2), beta=self.beta,
                               alpha=(d // self.heads) ** -0.5)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.bmm(torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)


def test_alibi_baddbmm_is_a_position_bias_and_is_rewritten():
    model = Alibi(slope_scale=50.0, beta=0.5)
    x = torch.randn(2, 6, 32)
    site, = geoscale_fx.find_attention(model, x)
    assert site.supported and site.score_op == "baddbmm"
    assert site.modifiers[0].kind == "position_bias" and site.modifiers[0].value == 0.5
    assert_none_scaling_equals_eager(model, x, compiler="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        fp8 = geoscale_fx.wrap(model, compiler="aot_eager", audit=True)
        out = fp8(x)
    record, = fp8.geoscale.records.values()
    assert counters["geoscale"]["rewrite_inplace"] == 1
    assert counters["geoscale"]["modifier_position_bias"] == 1
    # the quantized tensor is s·q·kᵀ alone: its max is within the bound although the
    # biased scores (slopes ×50) are far larger
    assert record.state.overflow_steps.item() == 0
    assert float(record.state.amax.max()) <= float(record.state.bound.max()) * (1 + 1e-6)
    assert float(model.bias(2, 6).abs().max()) * 0.5 > 5 * float(record.state.bound.max())
    torch.testing.assert_close(out, _alibi_reference(model, x, record.state.scale),
                               rtol=1e-4, atol=1e-4)


def _alibi_reference(model: Alibi, x, scale):
    """β·bias + Q(s·q·kᵀ / scale_h)·scale_h, then mask, softmax, @ v (independent)."""
    b, n, d = x.shape
    with torch.no_grad():
        q, k, v = model.qkv(model.norm(x)).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) * 8 ** -0.5                           # (B, H, L, L)
        d_h = scale.view(1, 4, 1, 1)
        s = (s / d_h).clamp(-448, 448).to(torch.float8_e4m3fn).float() * d_h
        s = s + model.beta * model.bias(b, n).view(b, 4, n, n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return (torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v).reshape(
            b * 4, n, 8)


# --------------------------------------------------------------------------------------
# No silent misses
# --------------------------------------------------------------------------------------

class SoftmaxOverQueries(torch.nn.Module):
    """Attention-like, but the softmax runs over the query axis: not the normal form."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v


def test_a_softmax_over_qk_outside_the_normal_form_is_reported_by_report():
    model = SoftmaxOverQueries()
    site, = geoscale_fx.find_attention(model, torch.randn(2, 5, 32))
    assert not site.supported and "product of two activations" in site.reason
    compiled = torch.compile(model, backend=geoscale_fx.backend(compiler="aot_eager"))
    with torch.no_grad():
        compiled(torch.randn(2, 5, 32))
    skipped = geoscale_fx.report(compiled).skipped
    assert len(skipped) == 1 and "not over the last dim" in skipped[0]["reason"]


def test_a_router_softmax_over_a_projection_is_not_attention():
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 4)

        def forward(self, h):
            return torch.softmax(self.gate(h), dim=-1)

    assert geoscale_fx.find_attention(Router(), torch.randn(2, 5, 16)) == []


# --------------------------------------------------------------------------------------
# Inkling-2: L2-clipped q/k (a conv on k) and a sink logit projected from the input
# --------------------------------------------------------------------------------------

def _clipped(sink=None, style="clamp", inflate=50.0):
    from tests.attention_variants import ClippedConvKey

    torch.manual_seed(0)
    model = ClippedConvKey(t=3.0, style=style, sink=sink).eval()
    with torch.no_grad():          # gains and weights far past the clip: ‖q_h‖ = ‖k_h‖ = t
        for p in (model.q.weight, model.k.weight, model.conv.weight, model.q_clip.scale):
            p.mul_(inflate)
        if model.sink is not None:
            model.sink.weight.mul_(inflate)
            model.sink.bias.copy_(torch.tensor([0.0, -7.0, 2.0, 40.0]))
    return model


def _observed_logits(model, x):
    """max |s·q·kᵀ| and max |sink| recomputed in float64 from the module's own parts."""
    from tests.attention_variants import DH, H

    with torch.no_grad():
        return _recomputed(model, x, DH, H)


def _recomputed(model, x, DH, H):
    model = model.double()
    x = x.double()
    B, L, _ = x.shape
    h = model.norm(x)
    k = model.conv(model.k(h).transpose(1, 2))[..., :L].transpose(1, 2)
    q = model.q_clip(model.q(h).view(B, L, H, DH)).transpose(1, 2)
    k = model.k_clip(k.view(B, L, H, DH)).transpose(1, 2)
    s = (q @ k.transpose(-1, -2) * DH ** -0.5).abs().amax(dim=(0, 2, 3))
    sink = model.sink(h).abs().amax() if model.sink is not None else None
    model.float()
    return s, sink


def test_l2_clipped_q_and_k_are_sources_of_radius_t_and_the_bound_is_s_t_squared():
    model = _clipped()
    x = 4.0 * torch.randn(2, 10, 64)
    site, = geoscale_fx.find_attention(model, x)
    assert site.supported, site.reason
    assert (site.q.source.norm, site.k.source.norm) == ("l2clip", "l2clip")
    assert site.q.weight is None and site.k.weight is None        # identity sides
    assert site.q.radius == pytest.approx(3.0) and site.k.radius == pytest.approx(3.0)
    bound = site_logit_bound(site)
    torch.testing.assert_close(bound, torch.full((4,), 9.0 / 4, dtype=torch.float64))
    observed, _ = _observed_logits(model, x)
    assert bool((observed <= bound * (1 + 1e-6)).all())
    assert float(observed.max()) > 0.25 * 9.0 / 4          # inflated: q, k sit at radius t


def test_a_clip_with_a_positive_floor_bounds_nothing_and_is_refused():
    site, = geoscale_fx.find_attention(_clipped(style="floored"), torch.randn(2, 6, 64))
    assert not site.supported
    assert "mul of the query/key" in site.reason, site.reason      # names the clip's mul


def test_a_projected_sink_is_bounded_by_rho_times_row_norms_plus_bias():
    model = _clipped(sink="normalized")
    x = 4.0 * torch.randn(2, 10, 64)
    site, = geoscale_fx.find_attention(model, x)
    assert site.supported, site.reason
    sink, = [m for m in site.modifiers if m.kind == "sink"]
    assert sink.param is None and sink.side is not None
    # independent: |w_fᵀ(g ⊙ x̂) + b_f| ≤ √d·‖g ⊙ w_f‖ + |b_f|, ‖x̂‖ ≤ √d (RMSNorm)
    w, b, g = (p.detach().double() for p in (model.sink.weight, model.sink.bias,
                                             model.norm.weight))
    expected = (64 ** 0.5 * torch.linalg.vector_norm(w * g, dim=1) + b.abs()).max()
    bound = site_logit_bound(site)
    torch.testing.assert_close(bound, torch.clamp(torch.full((4,), 9.0 / 4, dtype=torch.float64),
                                                  min=float(expected)))
    _, observed_sink = _observed_logits(model, x)
    assert float(observed_sink) <= float(expected)
    assert "sink_proj" not in site.weight_nodes and any("sink" in n for n in site.param_names)


def test_a_sink_projected_from_an_unnormalized_input_is_refused_naming_it():
    site, = geoscale_fx.find_attention(_clipped(sink="raw"), torch.randn(2, 6, 64))
    assert not site.supported
    assert "sink logits" in site.reason and "unbounded input" in site.reason, site.reason


def test_projected_sink_site_none_equals_eager_and_geometry_never_overflows():
    record = _sink_site_audited(_clipped(sink="normalized"), 4.0 * torch.randn(2, 6, 64))
    assert float(record.state.bound.min()) > 0.0
