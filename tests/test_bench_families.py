"""bench/families.py: its spies against explicit computations, and rows of real families."""
import math

import pytest
import torch
import torch.nn.functional as F

from bench.families import (
    Spy, _reasons, backend_sites, family_row, sites_per_forward, summary,
)

pytest.importorskip("transformers")


def test_sdpa_spy_recomputes_gqa_logits_per_query_head():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)                  # (B, n_q, T, d_h)
    k = torch.randn(2, 2, 5, 8, generator=g)                  # (B, n_kv, S, d_h)
    v = torch.randn(2, 2, 5, 8, generator=g)
    original, spy = F.scaled_dot_product_attention, Spy()
    with spy.watching():
        assert F.scaled_dot_product_attention is not original
        out = F.scaled_dot_product_attention(q, k, value=v, enable_gqa=True)
    assert F.scaled_dot_product_attention is original          # restored on exit
    torch.testing.assert_close(out, original(q, k, v, enable_gqa=True))
    [call] = spy.calls
    expected = [max(abs(sum(q[b, h, t, i].item() * k[b, h // 2, s, i].item() for i in range(8)))
                    for b in range(2) for t in range(5) for s in range(5)) / math.sqrt(8)
                for h in range(4)]
    assert call.kind == "sdpa"
    torch.testing.assert_close(call.amax, torch.tensor(expected, dtype=torch.float64))


def test_softmax_spy_counts_key_axis_softmaxes_once():
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    originals = (torch.softmax, F.softmax, torch.Tensor.softmax)
    spy = Spy()
    with spy.watching():
        x = q @ k.transpose(-1, -2)      # (2, 3, 4, 4) logits, a product of two activations
        F.softmax(x, dim=-1)             # calls Tensor.softmax inside: one call, not two
        torch.softmax(x, 3)
        x.softmax(-1)
        x.softmax(1)                     # not over the key axis
        torch.softmax(x[0, 0], -1)       # 2-D: a router, not attention
    assert [c.kind for c in spy.calls] == ["softmax"] * 3
    assert (torch.softmax, F.softmax, torch.Tensor.softmax) == originals


class _RouterAndGate(torch.nn.Module):
    """An MoE router's softmax over linear(x) (3-D, zaya) and hyper-connection stream weights
    (4-D, (B, T, hc, hc), deepseek_v4): softmaxes over the last axis of ≥3-D tensors that are no
    attention over keys; then two attentions (counted): logits through casts, a scale, a mask
    and a concatenated sink, and ALiBi's ``bias.baddbmm(batch1=q, batch2=kᵀ)`` (Bloom)."""

    def __init__(self, d=16, hc=4, experts=5):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.router = torch.nn.Linear(d, experts)
        self.fn = torch.nn.Parameter(torch.randn(hc * hc, d))
        self.base = torch.nn.Parameter(torch.zeros(hc * hc))
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.register_buffer("causal", torch.ones(8, 8, dtype=torch.bool).tril())
        self.hc = hc

    def forward(self, x):                                          # (B, T, d)
        h = self.norm(x)
        probs = torch.softmax(self.router(h), dim=-1)              # (B, T, experts)
        comb_w = F.linear(h, self.fn.float()) + self.base
        comb = torch.softmax(comb_w.view(*x.shape[:2], self.hc, self.hc), dim=-1)
        q, k, v = self.qkv(h).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        s = (q.float() @ k.float().transpose(-1, -2) * 8 ** -0.5).masked_fill(~self.causal, -1e9)
        s = torch.cat([s, torch.zeros_like(s[..., :1])], dim=-1)   # a sink column
        p = F.softmax(s, dim=-1)[..., :-1]
        q, k = q.flatten(0, 1), k.flatten(0, 1)                    # (B·H, T, d_h)
        alibi = torch.zeros(q.shape[0], 1, q.shape[1])
        s = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=8 ** -0.5)
        return p @ v + (s.softmax(-1) @ v.flatten(0, 1)).view_as(v), probs, comb


def test_softmax_spy_counts_only_softmaxes_over_a_product_of_activations():
    model = _RouterAndGate()
    x, spy = torch.randn(2, 8, 16), Spy(state=tuple(model.buffers()))
    with spy.watching(), torch.no_grad():
        out = model(x)
    with torch.no_grad():
        for got, expected in zip(out, model(x)):    # the spy changes nothing it watches
            torch.testing.assert_close(got, expected)
    assert [c.kind for c in spy.calls] == ["softmax", "softmax"]
    assert spy.not_attention == 2                  # the router and the stream weights


@pytest.mark.parametrize("model_type,layers", [("deepseek_v4", 3), ("zaya", 2)])
def test_router_and_stream_softmaxes_are_not_silent_misses(model_type, layers):
    """deepseek_v4's hyper-connection softmax (B, T, hc, hc) and zaya's MoE router softmax
    (B, T, experts) were counted as attention calls: 6 and 2 silent misses. (The rewritten
    graphs run eagerly: the count does not need the AOT trace, which the supported
    families' rows keep.)"""
    row = family_row(model_type, timeout=120, compiler="eager")
    if not row["built"]:
        pytest.skip(row["error"])
    assert row["error"] == ""
    assert row["calls"] == row["sites"] == layers and row["silent"] == 0
    assert sum(row["reasons"].values()) == layers - row["supported"]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_supported_families_are_covered_and_certified(model_type):
    row = family_row(model_type, timeout=120)
    assert row["error"] == "" and row["built"]
    assert row["calls"] == row["sites"] == row["supported"] == 2     # 2 layers
    assert row["silent"] == 0 and row["reasons"] == {}
    spy_checks, audit_checks = map(int, row["checks spy/audit"].split("/"))
    assert spy_checks == 2 * 2 * 4         # inputs × sites × heads
    assert audit_checks == 2 * 4             # sites × heads (both inputs in one batch)
    assert 0 < row["max obs/bound"] <= 1 and row["violations"] == 0
    assert row["none==eager"] is True and row["overflows"] == 0


def test_summary_counts_supported_calls_and_silent_misses():
    rows = [{"built": True, "calls": 4, "sites": 3, "supported": 2, "silent": 1,
             "violations": 0, "none==eager": True, "overflows": 0, "error": ""},
            {"built": False, "calls": None, "sites": None, "supported": None, "silent": None,
             "violations": None, "none==eager": None, "overflows": None, "error": "not built"}]
    s = summary(rows)
    assert (s["built"], s["calls"], s["supported"], s["silent misses"]) == (1, 4, 2, 1)
    assert s["supported %"] == 50.0


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "cpmant"])
def test_backend_sites_are_the_sites_find_attention_finds(model_type):
    import geoscale_fx
    from geoscale_fx.testing import hf_configs

    model = hf_configs.tiny_model(model_type)
    inputs = hf_configs.token_inputs(model, seq_len=32)
    wrapped = geoscale_fx.wrap(model, scaling="none", compiler="aot_eager")
    with torch.no_grad():
        wrapped(**inputs)
    expected = [(s.name, s.node, s.supported, s.reason)
                for s in geoscale_fx.find_attention(model, **inputs)]
    assert [(s.name, s.node, s.supported, s.reason) for s in backend_sites(wrapped)] == expected
    assert len(expected) == 2


def test_a_family_the_weights_cannot_bound_runs_on_measured_norms_and_says_why():
    row = family_row("xlnet", timeout=120, compiler="eager")   # a bias on the projected query
    assert row["error"] == "" and row["built"]
    assert (row["calls"], row["sites"], row["supported"], row["measured"], row["silent"]) == \
        (2, 2, 2, 2, 0)
    assert row["reasons"] == {} and sum(row["measured reasons"].values()) == 2
    assert int(row["checks spy/audit"].split("/")[1]) > 0 and row["violations"] == 0
    assert row["none==eager"] is True and row["overflows"] == 0


def test_refused_sites_are_listed_by_reason_with_node_numbers_dropped():
    from geoscale_fx.sites.model import AttentionSite

    why = "`score_{}` is a softmax over `matmul_{}`, but its probabilities never multiply values"
    sites = [AttentionSite(name=f"l{i}", index=i, kind="explicit", node=f"score_{i}",
                           reason=why.format(i, i)) for i in (3, 14)]
    measured = AttentionSite(name="m", index=2, kind="sdpa", node="sdpa", supported=True,
                             bound_by="measured", unbounded_reason="no normalization")
    assert _reasons(sites + [measured]) == {why.replace("_{}", ""): 2}
    assert _reasons(sites + [measured], measured=True) == {"no normalization": 1}


def test_an_unbuildable_family_is_a_row_with_the_reason():
    row = family_row("dbrx", timeout=60)
    assert row["built"] is False and row["error"].startswith("not built: model type 'dbrx'")
    assert row["calls"] is None


class _BrokenLayer(torch.nn.Module):
    """A normalized attention followed by a graph break (X-MOD's language adapter): Dynamo
    resumes in the next layer's frame, compiles that frame once and runs its graph for every
    later layer."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv = torch.nn.LayerNorm(16), torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(1, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.adapter(x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
                            .reshape(1, 6, 16))

    def adapter(self, h):
        torch._dynamo.graph_break()
        return h * 2


class _BrokenLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_BrokenLayer() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_graph_run_for_several_layers_counts_its_sites_once_per_run():
    """Three observed calls, two sites found (the second graph serves layers 1 and 2): one
    forward executes three sites, no silent miss."""
    import geoscale_fx

    torch.manual_seed(0)
    model, x = _BrokenLayers().eval(), torch.randn(1, 6, 16)
    spy = Spy()
    with spy.watching(), torch.no_grad():
        model(x)
    assert len(spy.calls) == 3
    assert len(geoscale_fx.find_attention(model, x)) == 2
    assert sites_per_forward(model, {"x": x}) == (3, 3, 0)
