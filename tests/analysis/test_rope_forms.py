"""RoPE forms and multi-term keys written by hand (not only as Hugging Face writes them):
the complex multiply of Meta's reference Llama, the halves form, per-position temperature,
and a key assembled from two projections by ``new_empty`` + ``copy_`` (MLA's shape).

Each site must be supported with the expected rotary record, its bound must hold on the
logits the module itself computes, and ``scaling="none"`` must equal eager.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import geoscale_fx
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests.analysis_checks import assert_none_scaling_equals_eager

B, L, D, H = 2, 8, 32, 4
DH = D // H


def _freqs(length=L, width=DH):
    inv = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
    return torch.outer(torch.arange(length).float(), inv)            # (L, DH/2)


class ComplexRope(nn.Module):
    """Meta's reference Llama: ``view_as_real(view_as_complex(q) · polar(1, θ))``."""

    def __init__(self, modulus: float = 1.0):
        super().__init__()
        self.norm, self.qkv = nn.RMSNorm(D), nn.Linear(D, 3 * D, bias=False)
        self.register_buffer("freqs_cis", torch.polar(torch.full((L, DH // 2), modulus),
                                                      _freqs()))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, H, DH).unbind(2)

        def rotate(t):
            z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(z * self.freqs_cis[:, None, :]).flatten(3)
        q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)


class HalvesRope(nn.Module):
    """``cat(x1·cos − x2·sin, x2·cos + x1·sin)`` with half-width tables; ``other_tables``:
    the second half uses tables of other angles (not a rotation of one angle per pair)."""

    def __init__(self, other_tables: bool = False, strided: bool = False):
        super().__init__()
        self.other_tables, self.strided = other_tables, strided
        self.norm, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, H, DH).transpose(1, 3).unbind(2)
        angles = _freqs()
        other = angles * 1.7 + 0.3 if self.other_tables else angles

        def rotate(t):
            if self.strided:
                x1, x2 = t[..., 0::2], t[..., 1::2]
            else:
                x1, x2 = torch.chunk(t, 2, dim=-1)
            return torch.cat((x1 * angles.cos() - x2 * angles.sin(),
                              x2 * other.cos() + x1 * other.sin()), dim=-1)
        q, k = rotate(q), rotate(k)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Temperature(nn.Module):
    """Llama-4's NoPE attention temperature: ``q · (log1p(floor((p + 1) / 4)) · 0.1 + 1)``."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv = nn.RMSNorm(D), nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, x.shape[1], 3, H, DH).transpose(1, 3).unbind(2)
        positions = torch.arange(x.shape[1]).float()
        scales = torch.log1p(torch.floor((positions + 1) / 4.0)) * 0.1 + 1.0
        q = q * scales.view(1, 1, -1, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class AssembledKey(nn.Module):
    """A key whose head vector is two parts from two projections of two norms, written into
    ``new_empty`` by ``copy_`` (MLA's shape: a latent part and a shared RoPE part)."""

    def __init__(self, cover: bool = True):
        super().__init__()
        self.cover = cover
        self.norm, self.latent_norm = nn.RMSNorm(D), nn.RMSNorm(16)
        self.q = nn.Linear(D, D, bias=False)
        self.down = nn.Linear(D, 16 + DH // 2, bias=False)
        self.up = nn.Linear(16, H * (DH // 2) + D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h).view(B, L, H, DH).transpose(1, 2)
        latent, shared = self.down(h).split([16, DH // 2], dim=-1)
        up = self.up(self.latent_norm(latent))
        k_part = up[..., :H * (DH // 2)].view(B, L, H, DH // 2).transpose(1, 2)
        v = up[..., H * (DH // 2):].view(B, L, H, DH).transpose(1, 2)
        shared = shared.view(B, 1, L, DH // 2).expand(B, H, L, DH // 2)
        k = k_part.new_empty(B, H, L, DH)
        k[..., :DH // 2].copy_(k_part)
        if self.cover:
            k[..., DH // 2:].copy_(shared)
        else:
            k[..., DH // 2:DH - 1].copy_(shared[..., :-1])
        return F.scaled_dot_product_attention(q, k, v)


def _site(module):
    sites = geoscale_fx.find_attention(module, torch.randn(B, L, D))
    assert len(sites) == 1
    return sites[0]


def _max_logit(module, x):
    """max |S| per head from the module's own q and k (captured at the SDPA call)."""
    seen = {}

    def spy(q, k, v, *args, **kwargs):
        g = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(g, dim=1)
        scale = kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        seen["s"] = (scale * q.double() @ kk.double().transpose(-1, -2)).abs().amax((0, 2, 3))
        return sdpa(q, k, v, *args, **kwargs)

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = spy
    try:
        module(x)
    finally:
        F.scaled_dot_product_attention = sdpa
    return seen["s"]


def _bound_holds(module, site, trials=20):
    bound = site_logit_bound(site)
    worst = 0.0
    for _ in range(trials):
        observed = _max_logit(module, torch.randn(B, L, D) * 10)
        assert (observed <= bound * (1 + 1e-6)).all(), (observed, bound)
        worst = max(worst, float((observed / bound).max()))
    return worst


def _equals_eager_with_scaling_none(module):
    x = torch.randn(B, L, D)
    assert_none_scaling_equals_eager(module, x, compiler="aot_eager", grad=True)
    torch._dynamo.reset()
    geometry = geoscale_fx.wrap(module, compiler="aot_eager")
    geometry(x)
    (record,) = geometry.geoscale.records.values()
    assert record.state.overflow_steps.item() == 0


@pytest.mark.parametrize("modulus", [1.0, 1.5])
def test_complex_rope_is_a_rotation_scaled_by_the_tables_modulus(modulus):
    torch.manual_seed(0)
    module = ComplexRope(modulus)
    site = _site(module)
    assert site.supported and site.certified, site.reason
    rotary = site.q.rotary
    assert (rotary.form, rotary.pairing_verified) == ("complex", True)
    assert rotary.factor == pytest.approx(modulus, rel=1e-6)
    assert _bound_holds(module, site) > 0.05
    _equals_eager_with_scaling_none(module)


@pytest.mark.parametrize("strided", [False, True])
def test_halves_rope_is_joined_into_a_verified_rotation(strided):
    torch.manual_seed(0)
    module = HalvesRope(strided=strided)
    site = _site(module)
    assert site.supported and site.certified, site.reason
    rotary = site.q.rotary
    assert (rotary.form, rotary.style, rotary.pairing_verified) == ("halves", "rotate_half",
                                                                    True)
    assert rotary.factor == pytest.approx(1.0)
    assert _bound_holds(module, site) > 0.05
    _equals_eager_with_scaling_none(module)


def test_halves_with_different_angles_get_their_measured_gain():
    """Each half with its own tables is no rotation of one angle per pair: the tables are
    constants, so the gain is measured — and equals max ‖R_m‖₂ of the dense per-position map
    built here."""
    torch.manual_seed(0)
    module = HalvesRope(other_tables=True)
    site = _site(module)
    assert site.supported, site.reason
    angles = _freqs().double()
    other = angles * 1.7 + 0.3
    half = DH // 2
    dense = torch.zeros(L, DH, DH, dtype=torch.float64)
    j = torch.arange(half)
    dense[:, j, j], dense[:, j, j + half] = angles.cos(), -angles.sin()
    dense[:, j + half, j + half], dense[:, j + half, j] = other.cos(), other.sin()
    expected = float(torch.linalg.matrix_norm(dense, ord=2).max())
    assert expected > 1.05
    assert site.q.rotary.factor == pytest.approx(expected, rel=1e-5)
    _bound_holds(module, site)


def test_per_position_temperature_is_bounded_by_its_table_maximum():
    torch.manual_seed(0)
    module = Temperature()
    site = _site(module)
    assert site.supported and site.certified, site.reason
    positions = torch.arange(L).float()
    table = torch.log1p(torch.floor((positions + 1) / 4.0)) * 0.1 + 1.0
    assert site.q.position_gain == pytest.approx(float(table.max()))
    assert site.k.position_gain == 1.0
    _bound_holds(module, site)
    _equals_eager_with_scaling_none(module)


def test_temperature_under_symbolic_lengths_is_left_as_is_naming_the_node():
    """With dynamic shapes the table depends on the symbolic length: it is not a constant,
    so the site is refused (loudly), never bounded by a stale maximum."""
    from geoscale_fx.analysis.capture import capture_graphs
    from geoscale_fx.analysis.analyze import analyze_graph

    torch._dynamo.reset()
    graphs = capture_graphs(Temperature(), torch.randn(B, L, D), dynamic=True)
    (site,) = analyze_graph(graphs[0].gm, graphs[0].example_inputs)
    assert not site.supported
    assert "neither a constant nor a rotary cos/sin table" in site.reason


def test_key_assembled_from_two_projections_is_two_terms():
    torch.manual_seed(0)
    module = AssembledKey()
    site = _site(module)
    assert site.supported and site.certified, site.reason
    assert (site.n_q_heads, site.n_kv_heads, site.head_dim) == (H, H, DH)
    latent, shared = site.terms
    assert latent.k.weight_param == "up.weight" and shared.k.weight_param == "down.weight"
    assert (latent.k.source.width, shared.k.source.width) == (16, D)
    assert latent.q.weight_param == shared.q.weight_param == "q.weight"
    # the shared part: every key head reads the same rows of ``down``
    assert len(set(shared.k.features)) == 1
    assert _bound_holds(module, site) > 0.05
    _equals_eager_with_scaling_none(module)


def test_key_buffer_not_fully_written_is_left_as_is():
    site = _site(AssembledKey(cover=False))
    assert not site.supported
    assert "new_empty" in site.reason
