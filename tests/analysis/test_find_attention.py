import math

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics.amax import site_amax_bounds
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.numerics.head_weights import site_head_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.analysis.analyze import analyze_graph
from tests import analysis_checks as checks
from tests.attention_variants import (
    D, DH, H, VARIANTS, KVCache, LoRAQuery, RawQueryIsInput, SoftmaxClassifier, Unnormalized,
)
from tests.hf_models import HF_MODELS, build_hf

B, L = 2, 12


def _analyse(model, *args, **kwargs):
    graphs = capture_graphs(model, *args, **kwargs)
    out = []
    for i, g in enumerate(graphs):
        sites = analyze_graph(g.gm, g.example_inputs, graph_index=i)
        out.append((g, sites, checks.record(g.gm, g.example_inputs)))
    return out


# --------------------------------------------------------------------------------------
# Coverage: Hugging Face models, nn modules, hand-written variants
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(HF_MODELS))
def test_hf_models_are_found_and_match_real_queries_and_keys(key):
    spec = HF_MODELS[key]
    model = build_hf(key)
    ids = torch.randint(0, 128, (B, L))
    found = _analyse(model, input_ids=ids)
    sites = [s for _, ss, _ in found for s in ss]
    assert [s.name for s in sites] == [spec["name"].format(i) for i in range(2)]
    for s in sites:
        assert s.supported and s.certified, s.reason
        assert s.kind == spec["kind"]
        assert (s.n_q_heads, s.n_kv_heads, s.head_dim, s.model_dim) == spec["heads"]
        assert s.norm == spec["norm"] and s.rope == spec["rope"]
        assert s.softmax_scale == pytest.approx(1 / math.sqrt(spec["heads"][2]))
        assert s.q_len == L and s.kv_len == L
        assert s.q.weight_param.endswith(spec["q_param"])
    for graph, ss, values in found:
        for s in ss:
            checks.check_projection_matches(graph.gm, values, s, B)


@pytest.mark.parametrize("name, kind", [("nanogpt", "sdpa"), ("nanogpt-explicit", "explicit")])
def test_our_nanogpt_fused_c_attn_both_paths(name, kind):
    models_zoo = pytest.importorskip("models_zoo")
    zoo = models_zoo.get(name)
    found = _analyse(zoo.model, **zoo.example_inputs(batch=B, seq_len=L))
    sites = [s for _, ss, _ in found for s in ss]
    assert [s.name for s in sites] == [f"transformer.h.{i}.attn" for i in range(zoo.n_layers)]
    d = zoo.model_dim
    for s in sites:
        assert s.supported and s.kind == kind and s.norm == "layernorm"
        assert (s.n_q_heads, s.head_dim, s.model_dim) == (zoo.n_q_heads, zoo.head_dim, d)
        assert s.q.weight == s.k.weight and s.q.layout == "linear"   # one fused c_attn
        assert s.k.features[0][0] == d                                # keys follow queries
        assert s.softmax_scale == pytest.approx(zoo.head_dim ** -0.5)
    for graph, ss, values in found:
        for s in ss:
            checks.check_projection_matches(graph.gm, values, s, B)


def test_real_minilm_post_ln_with_biases(minilm):
    ids = torch.randint(0, 30000, (B, L))
    found = _analyse(minilm, input_ids=ids, attention_mask=torch.ones(B, L, dtype=torch.long))
    sites = [s for _, ss, _ in found for s in ss]
    assert [s.name for s in sites] == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    for s in sites:
        assert s.supported, s.reason
        assert (s.n_q_heads, s.n_kv_heads, s.head_dim, s.model_dim) == (12, 12, 32, 384)
        assert s.norm == "layernorm" and not s.rope
        hw = site_head_weights(s)
        assert hw.c_q is not None and hw.c_k is not None  # q/k biases + LN offset folded
    # layer 0 reads the embeddings' LayerNorm, later layers the previous block's output LN
    assert "embeddings" in sites[0].q.source.channel_ops[0][1]
    assert "output_modules_layer_norm" in sites[1].q.source.channel_ops[0][1]
    for graph, ss, values in found:
        for s in ss:
            checks.check_projection_matches(graph.gm, values, s, B, atol=2e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hand_written_variants(name):
    factory, expected = VARIANTS[name]
    model = factory().eval()
    found = _analyse(model, torch.randn(B, L, D))
    (graph, sites, values), = found
    site, = sites
    assert site.supported, site.reason
    # a QK-norm is the normalized input of its side: its width is the head's
    expected = {"n_q_heads": H, "head_dim": DH, "model_dim": D, **expected}
    for key, value in expected.items():
        got = getattr(site, key)
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, key
    if site.model_dim == D and site.q.weight is not None:  # linear maps of a normalized input
        checks.check_projection_matches(graph.gm, values, site, B)


def test_interleaved_fused_layout_uses_per_head_features():
    site, = geoscale_fx.find_attention(VARIANTS["interleaved_fused"][0]().eval(),
                                       torch.randn(B, L, D))
    assert site.q.features[1][0] == 3 * DH      # head 1's query starts after [q0 | k0 | v0]
    assert site.k.features[0][0] == DH
    assert site.q.bias is not None


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_transformer_encoder_layers(norm_first, grad):
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(D, H, 2 * D, batch_first=True, norm_first=norm_first),
        num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(B, L, D)
    with torch.set_grad_enabled(grad):
        sites = geoscale_fx.find_attention(enc, x)
    assert len(sites) == 2
    assert {s.kind for s in sites} == {"mha" if grad else "encoder_layer"}
    if norm_first:
        assert all(s.supported for s in sites)
    else:  # post-LN: layer 0 reads the raw input, layer 1 the previous layer's norm2
        assert not sites[0].supported and "no normalization" in sites[0].reason
        assert sites[1].supported
    for i, s in enumerate(sites):
        if not s.supported:
            continue
        layer = enc.layers[i]
        prev = enc.layers[i - 1] if i else None
        with torch.no_grad():
            h = x
            for j in range(i):
                h = enc.layers[j](h)
            norm = layer.norm1 if norm_first else prev.norm2
            x_in = norm(h) if norm_first else h
            ref_q, ref_k = checks.mha_projection_reference(
                layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias, x_in, H)
            x_hat = torch.nn.functional.layer_norm(h if norm_first else
                                                   _pre_norm2(enc, x, i), (D,), eps=norm.eps)
        torch.testing.assert_close(checks.recomputed(s, "q", x_hat), ref_q, atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(checks.recomputed(s, "k", x_hat), ref_k, atol=1e-5,
                                   rtol=1e-4)


def _pre_norm2(enc, x, i):
    """Input of layer (i-1)'s norm2 in a post-LN encoder (what the bound's x̂ normalizes)."""
    h = x
    for j in range(i - 1):
        h = enc.layers[j](h)
    layer = enc.layers[i - 1]
    h = layer.norm1(h + layer._sa_block(h, None, None))
    return h + layer._ff_block(h)


def test_multihead_attention_cross_and_self():
    mha = torch.nn.MultiheadAttention(D, H, batch_first=True)
    ln_q, ln_kv = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)

    class Cross(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_q, self.ln_kv, self.mha = ln_q, ln_kv, mha

        def forward(self, x, memory):
            kv = self.ln_kv(memory)
            return self.mha(self.ln_q(x), kv, kv, need_weights=False)[0]

    x, memory = torch.randn(B, L, D), torch.randn(B, 7, D)
    site, = geoscale_fx.find_attention(Cross(), x, memory)
    assert site.supported and site.kind == "mha" and site.kv_len == 7
    assert site.q.source.node != site.k.source.node
    with torch.no_grad():
        q_ref, _ = checks.mha_projection_reference(mha.in_proj_weight, mha.in_proj_bias,
                                                   ln_q(x), H)
        _, k_ref = checks.mha_projection_reference(mha.in_proj_weight, mha.in_proj_bias,
                                                   ln_kv(memory), H)
        q_hat = torch.nn.functional.layer_norm(x, (D,))
        k_hat = torch.nn.functional.layer_norm(memory, (D,))
    torch.testing.assert_close(checks.recomputed(site, "q", q_hat), q_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(checks.recomputed(site, "k", k_hat), k_ref, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------
# Negative cases: left unsupported (with the reason) or not detected at all
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, args, match", [
    (Unnormalized, (torch.randn(B, L, D),), "no normalization before the projection"),
    (RawQueryIsInput, (torch.randn(B, L, D),), "not a projection of a normalized input"),
])
def test_unanalysable_sites_are_reported_with_a_reason_naming_the_node(model, args, match):
    site, = geoscale_fx.find_attention(model(), *args)
    assert not site.supported and not site.certified
    assert match in site.reason and "`" in site.reason
    for numeric in (site_logit_bound, site_head_weights, site_amax_bounds):
        with pytest.raises(ValueError, match="not supported"):
            numeric(site)


def test_lora_query_is_bounded_on_its_effective_weight():
    """q = W h + B(A h): one source, two maps — the head weights are those of W + B·A."""
    model = LoRAQuery()
    site, = geoscale_fx.find_attention(model, torch.randn(B, L, D))
    assert site.supported and site.certified, site.reason
    effective = model.block.q.weight + model.lora_b.weight @ model.lora_a.weight   # (D, D)
    gain = model.block.norm.weight
    expected = (gain[:, None] * effective.t()).reshape(D, H, DH).permute(1, 0, 2)
    torch.testing.assert_close(site_head_weights(site).a_q, expected, rtol=1e-5, atol=1e-6)


def test_keys_passed_in_are_bounded_by_their_actual_norms():
    """Keys that join a cache passed in (not a projection of this call) are an observed side:
    the bound is s·‖q‖_bound·max‖k‖ from the keys the attention reads."""
    site, = geoscale_fx.find_attention(KVCache(), torch.randn(B, L, D),
                                       torch.randn(B, H, 3, DH))
    assert site.supported and site.certified, site.reason
    assert site.k.observed and site.cached_keys and site.kv_len == L + 3


def test_softmax_and_matmul_that_are_not_attention_are_not_detected():
    assert geoscale_fx.find_attention(SoftmaxClassifier(), torch.randn(B, L, D)) == []


def test_other_sites_still_analysed_next_to_an_unsupported_one():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bad, self.good = Unnormalized(), VARIANTS["layernorm_sdpa"][0]()

        def forward(self, x):
            return self.good(self.bad(x))

    sites = geoscale_fx.find_attention(Two(), torch.randn(B, L, D))
    assert [s.supported for s in sites] == [False, True]
    assert [s.name for s in sites] == ["bad.block", "good"]
    assert [s.index for s in sites] == [0, 1]


# --------------------------------------------------------------------------------------
# The bound
# --------------------------------------------------------------------------------------

def _all_bounds_hold(found, batch):
    ratios = []
    for graph, sites, values in found:
        for s in sites:
            observed = checks.observed_logits(graph.gm, values, s, batch)
            bound = site_logit_bound(s)
            assert (observed <= bound * (1 + 1e-6)).all(), (s.name, observed, bound)
            ratios.append((observed / bound).max().item())
    return ratios


@pytest.mark.parametrize("key", sorted(HF_MODELS))
def test_bound_holds_on_random_inputs(key):
    found = _analyse(build_hf(key), input_ids=torch.randint(0, 128, (4, 32)))
    assert len(_all_bounds_hold(found, 4)) == 2


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bound_holds_on_variants(name):
    found = _analyse(VARIANTS[name][0]().eval(), 3.0 * torch.randn(4, 16, D))
    assert len(_all_bounds_hold(found, 4)) == 1


@pytest.mark.parametrize("key", ["gpt2-sdpa", "llama-sdpa"])
def test_bound_holds_under_adversarial_inputs_with_large_gains_and_biases(key, capsys):
    model = build_hf(key)
    checks.scale_up_gains_and_biases(model)
    sites, worst, logits = checks.adversarial(model)
    assert (worst <= 1 + 1e-6).all(), worst
    assert worst.max() > 0.05, "the optimizer should find sizeable logits"
    # the paper's B_max on the raw weights (no gain, no bias) is broken by the same inputs
    from geoscale_fx.numerics import head_weights
    from geoscale_fx.core import spectral

    broken = 0
    for s, logit in zip(sites, logits):
        a_q = head_weights.gather_heads(s._resolve(s.q.weight), s.q.layout, s.q.features)
        a_k = head_weights.gather_heads(s._resolve(s.k.weight), s.k.layout, s.k.features)
        paper = spectral.per_head_sigma_exact(a_q, a_k) * s.model_dim / math.sqrt(s.head_dim)
        broken += int((logit > paper.max()).item())
    with capsys.disabled():
        print(f"\n{key}: worst observed/bound per site under ×4 gains+biases: "
              f"{[round(v, 3) for v in worst.tolist()]}; paper B_max exceeded in "
              f"{broken}/{len(sites)} sites")
    if key == "gpt2-sdpa":
        assert broken >= 1


def test_rope_bound_options_and_certification():
    model = VARIANTS["rope_rotate_half_gqa"][0]().eval()
    site, = geoscale_fx.find_attention(model, torch.randn(B, L, D))
    assert site.rope and site.certified and site.rope_bound == "norm_product"
    paper = site.with_rope_bound("interaction")
    assert not paper.certified
    assert (site_logit_bound(paper) <= site_logit_bound(site)).all()
    with pytest.raises(ValueError, match="rope_bound"):
        site.with_rope_bound("made-up")


# --------------------------------------------------------------------------------------
# Contract: no change to the model, no graph break, meta models
# --------------------------------------------------------------------------------------

def test_find_attention_changes_nothing_and_adds_no_graph_break():
    model = build_hf("gpt2-sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (B, L))
    n_graphs = []

    def counting(gm, example_inputs):
        n_graphs.append(1)
        return gm.forward

    torch.compile(model, backend=counting)(input_ids=ids)
    captured = capture_graphs(model, input_ids=ids)
    assert len(captured) == len(n_graphs) == 1
    geoscale_fx.find_attention(model, input_ids=ids)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_repeated_captures_do_not_hit_the_recompile_limit():
    x = torch.randn(B, L, D)
    counts = [len(geoscale_fx.find_attention(VARIANTS["layernorm_sdpa"][0](), x))
              for _ in range(12)]
    assert counts == [1] * 12


def test_meta_device_model_is_analysed_without_weights():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_attention_heads=32, num_key_value_heads=32,
                                   num_hidden_layers=2, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        ids = torch.zeros(1, 16, dtype=torch.long)
    # use_cache=False: HF's KV cache builds a real (non-fake) empty tensor on meta
    sites = geoscale_fx.find_attention(model, input_ids=ids, use_cache=False)
    assert len(sites) == 2 and all(s.supported for s in sites)
    assert (sites[0].n_q_heads, sites[0].head_dim, sites[0].model_dim) == (32, 128, 4096)
    assert sites[0].q.rotary.pairing_verified
    assert site_logit_bound(sites[0]).device.type == "meta"
