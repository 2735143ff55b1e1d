"""``analysis.forms.cache_writes``: what a traced forward stores in its cache, bounded from the weights.

Toy models write a Hugging Face ``DynamicCache`` as transformers' attentions do
(``cache.update(keys, values, layer)``), traced under ``marked_cache_writes``. The bounds are
checked against explicit formulas on the weights (float64, ``torch.linalg``) and against
what the cache really holds on inputs built to reach them; the negative twins: the keys and
values a plain attention stores are not a latent, a write read by no attention, and a write
two differently named attentions could read, come back with their reasons.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from geoscale_fx.numerics.amax import cache_write_bounds, site_amax_bounds
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.kv_cache.layers import marked_cache_writes
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.forms.cache_writes import cache_writes, is_cache_write
from tests.float_checks import assert_certified

transformers = pytest.importorskip("transformers")

B, L, D, H = 1, 6, 32, 2
R, DR, DN, DV = 16, 8, 8, 8          # latent rank, rope part, nope part, value head dim
DH = 8
LATENT_SCALE = 0.5


def _gains(*norms: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for norm in norms:
        norm.weight.data = torch.rand(norm.weight.shape, generator=g) * 2 + 0.5


class ToyMLA(nn.Module):
    """DeepSeek-V2's layout without rotary: the cache stores ``kv_c`` after its RMSNorm
    ``(B, 1, L, R)`` times ``LATENT_SCALE`` (Dots3's ``kv_lora_scale``, after the view that
    adds the head axis) and ``k_pe`` ``(B, 1, L, DR)``; keys and values are computed from
    them after the read (``kv_b``)."""

    def __init__(self):
        super().__init__()
        self.norm, self.kv_norm = nn.RMSNorm(D), nn.RMSNorm(R)
        self.q = nn.Linear(D, H * (DN + DR), bias=False)
        self.kv_a = nn.Linear(D, R + DR, bias=False)
        self.kv_b = nn.Linear(R, H * (DN + DV), bias=False)
        _gains(self.norm, self.kv_norm)

    def forward(self, x, cache):
        h = self.norm(x)
        q = self.q(h).view(B, L, H, DN + DR).transpose(1, 2)                # (B, H, L, .)
        kv_c, k_pe = self.kv_a(h).split([R, DR], dim=-1)
        kv_c = self.kv_norm(kv_c).view(B, 1, L, R) * LATENT_SCALE           # (B, 1, L, R)
        k_pe = k_pe.view(B, 1, L, DR)                                       # (B, 1, L, DR)
        kv_c, k_pe = cache.update(kv_c, k_pe, 0)
        kv = self.kv_b(kv_c).view(B, -1, H, DN + DV).transpose(1, 2)        # (B, H, L', .)
        k_nope, v = kv.split([DN, DV], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, H, -1, -1)], dim=-1)         # (B, H, L', DN+DR)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Plain(nn.Module):
    """The keys and values an attention multiplies are what it stores (views after)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))
        _gains(self.norm)

    def forward(self, x, cache):
        h = self.norm(x)
        q, k, v = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        k, v = cache.update(k, v, 0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Plain attention writing the cache layer it is told (a shared block's)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))
        self.o = nn.Linear(H * DH, D)

    def forward(self, x, cache, layer: int):
        h = self.norm(x)
        q, k, v = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        k, v = cache.update(k, v, layer)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(B, L, H * DH))


class Shared(nn.Module):
    """One attention module called at two layers (Zamba's shared block): two writes."""

    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, cache):
        return self.attn(self.attn(x, cache, 0), cache, 1)


class Producer(nn.Module):
    """Writes cache layer 0 and hands its keys and values on (Gemma 3n's KV sharing)."""

    def __init__(self):
        super().__init__()
        self.k, self.v, self.reader = nn.Linear(D, H * DH), nn.Linear(D, H * DH), Reader()

    def forward(self, h, cache):
        k, v = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.k, self.v))
        k, v = cache.update(k, v, 0)
        return self.reader(h, k, v), k, v


class Sharing(nn.Module):
    """``later`` reuses the keys and values ``first`` stored, writing nothing."""

    def __init__(self):
        super().__init__()
        self.norm, self.first, self.later = nn.RMSNorm(D), Producer(), Reader()

    def forward(self, x, cache):
        h = self.norm(x)
        out, k, v = self.first(h, cache)
        return out + self.later(h, k, v)


class TwoReaders(nn.Module):
    """One write, two attentions of different names below the module that wrote it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.k, self.v = nn.Linear(D, H * DH), nn.Linear(D, H * DH)
        self.a, self.b = Reader(), Reader()

    def forward(self, x, cache):
        h = self.norm(x)
        k, v = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.k, self.v))
        k, v = cache.update(k, v, 0)
        return self.a(h, k, v) + self.b(h, k, v)


class Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, H * DH)

    def forward(self, h, k, v):
        q = self.q(h).view(B, L, H, DH).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v)


def _writes(model: nn.Module, x: torch.Tensor):
    cache = transformers.DynamicCache()
    with marked_cache_writes(), torch.no_grad():
        graphs = capture_graphs(model, x, cache)
    (graph,) = graphs
    sites = analyze_graph(graph.gm, graph.example_inputs)
    return sites, cache_writes(graph.gm, graph.example_inputs, sites)


def _rows(weight: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``a_i = diag(g) W_i``: row i of the projection on the normalized input, float64."""
    return weight.detach().double() * gain.detach().double()


def test_marked_writes_are_graph_nodes_and_the_marking_ends_with_the_context():
    model, x = Plain(), torch.randn(B, L, D)
    cache = transformers.DynamicCache()
    with marked_cache_writes(), torch.no_grad():
        (graph,) = capture_graphs(model, x, cache)
    writes = [n for n in graph.gm.graph.nodes if is_cache_write(n)]
    assert len(writes) == 1 and writes[0].args[2] == 0
    torch._dynamo.reset()
    with torch.no_grad():
        (graph,) = capture_graphs(model, x, transformers.DynamicCache())
    assert not any(is_cache_write(n) for n in graph.gm.graph.nodes)


def test_a_latent_cache_is_bounded_as_stored_not_as_expanded():
    """``kv_c = c·(g ⊙ x̂)`` with ``‖x̂‖ ≤ √R``: every entry ``≤ |c|·‖g‖_∞·√R``; ``k_pe`` (no
    rotation) channel i: ``≤ √D·‖a_i‖``. Both are reached: the cache holds them for an
    input aligned with the extreme row."""
    model = ToyMLA()
    sites, (write,) = _writes(model, torch.randn(B, L, D))
    assert write.reason == "" and write.site == sites[0].name and write.latent
    assert (write.layer, write.key_heads, write.value_heads) == (0, (0,), (0,))
    bounds = cache_write_bounds(write)
    g = model.kv_norm.weight.detach().double()
    assert torch.equal(bounds["k"], (LATENT_SCALE * g.abs().max() * math.sqrt(R)).reshape(1))
    rope = _rows(model.kv_a.weight[R:], model.norm.weight)                 # (DR, D)
    norms = torch.linalg.vector_norm(rope, dim=-1)
    assert torch.allclose(bounds["v"], (math.sqrt(D) * norms.max()).reshape(1), rtol=1e-6)
    # the cache holds a k_pe entry at the bound: x̂ = √D·x/‖x‖ along a_i (eps aside)
    i = int(norms.argmax())
    x = rope[i].float().expand(B, L, D).contiguous()
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(x, cache)
    assert float(cache.layers[0].values.abs().max()) == pytest.approx(float(bounds["v"]),
                                                                      rel=1e-4)
    assert float(cache.layers[0].keys.abs().max()) <= float(bounds["k"])
    # the expanded keys' bound (the site's) is another quantity entirely
    assert site_amax_bounds(sites[0], roles="kv")["k"].shape == (H,)


def test_stored_keys_and_values_of_a_plain_attention_are_its_operands():
    """Not a latent; per stored head, channel i of head h: ``√D·‖a_i‖ + |b_i|``."""
    model = Plain()
    sites, (write,) = _writes(model, torch.randn(B, L, D))
    assert write.reason == "" and not write.latent and write.key_heads == (0, 1)
    bounds = cache_write_bounds(write)
    for proj, got in ((model.k, bounds["k"]), (model.v, bounds["v"])):
        rows = _rows(proj.weight, model.norm.weight).view(H, DH, D)
        ref = math.sqrt(D) * torch.linalg.vector_norm(rows, dim=-1) + \
            proj.bias.detach().double().abs().view(H, DH)
        # the fold is float64 (numerics.amax): both sides are float64 sums over D terms
        assert_certified(got, ref.amax(dim=-1), rtol=1e-12)
    assert torch.equal(bounds["k"], site_amax_bounds(sites[0], roles="kv")["k"])


def test_a_write_two_attentions_could_read_is_refused_with_both_names():
    sites, (write,) = _writes(TwoReaders(), torch.randn(B, L, D))
    assert sorted(s.name for s in sites) == ["a", "b"]
    assert write.site is None and "holds the attentions ['a', 'b']" in write.reason
    with pytest.raises(ValueError, match="cache layer 0"):
        write.require_values()


def test_a_shared_block_called_twice_writes_two_layers_of_its_keys():
    """Each call's write is read moved by that call's attention: neither is a latent (the
    other call, of the same name, computes from it through the residual stream only)."""
    sites, writes = _writes(Shared(), torch.randn(B, L, D))
    assert [s.name for s in sites] == ["attn", "attn"]
    assert [(w.layer, w.site, w.latent, w.reason) for w in writes] == [
        (0, "attn", False, ""), (1, "attn", False, "")]


def test_an_attention_reusing_anothers_cache_is_its_reader():
    sites, (write,) = _writes(Sharing(), torch.randn(B, L, D))
    assert sorted(s.name for s in sites) == ["first.reader", "later"]
    assert (write.site, write.readers, write.latent) == ("first.reader", ("later",), False)
    assert _writes(Plain(), torch.randn(B, L, D))[1][0].readers == ()
