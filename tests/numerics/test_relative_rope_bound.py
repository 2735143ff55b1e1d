"""geoscale_fx.numerics.relative_rope_bound (``rope_bound="relative"``): the exact maximum over position
pairs, with biases against a brute force, and its refusals."""

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics import relative_rope_bound
from geoscale_fx.numerics.head_weights import site_head_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests.attention_variants import D, DH, VARIANTS, _rope_tables, _rotate_every_two, _rotate_half

L = 10


def _brute_force(site, turn, interleaved):
    """max over (m, n) (n ≤ m if causal) of the affine bound with A_q G_m G_nᵀ A_kᵀ."""
    cos, sin = _rope_tables(L, DH, interleaved=interleaved)
    swap = turn(torch.eye(DH))                         # rot(a) = a @ swap (row vectors)
    g = (torch.diag_embed(cos) + swap @ torch.diag_embed(sin)).double()    # (L, d_h, d_h)
    pairs = [(m, n) for m in range(L) for n in range(m + 1 if site.is_causal else L)]
    t = torch.stack([g[m] @ g[n].T for m, n in pairs])                     # (P, d_h, d_h)
    a_q, c_q, a_k, c_k = site_head_weights(site)
    group = a_q.shape[0] // a_k.shape[0]
    aq = a_q.double()[:, None]                                             # (n, 1, d, d_h)
    ak = a_k.double().repeat_interleave(group, 0)[:, None]
    zeros = torch.zeros(a_q.shape[0], DH, dtype=torch.float64)
    cq = (c_q.double() if c_q is not None else zeros)[:, None, :, None]
    ck = (c_k.double().repeat_interleave(group, 0) if c_k is not None else zeros)[:, None, :, None]
    rho, s = site.q.radius, abs(site.softmax_scale)
    val = (rho * rho * torch.linalg.matrix_norm(aq @ t @ ak.transpose(-1, -2), ord=2)
           + rho * torch.linalg.vector_norm(aq @ t @ ck, dim=(-2, -1))
           + rho * torch.linalg.vector_norm(ak @ t.transpose(-1, -2) @ cq, dim=(-2, -1))
           + (cq.transpose(-1, -2) @ t @ ck).abs()[..., 0, 0])
    return s * val.amax(dim=1)


@pytest.mark.parametrize("name, turn, interleaved", [
    ("rope_rotate_half_gqa", _rotate_half, False),
    ("rope_interleaved", _rotate_every_two, True),
])
def test_relative_bound_is_the_exact_max_over_position_pairs(name, turn, interleaved):
    model = VARIANTS[name][0]().eval()
    site, = geoscale_fx.find_attention(model, torch.randn(2, L, D))
    relative = site_logit_bound(site, rope_bound="relative")
    torch.testing.assert_close(relative, _brute_force(site, turn, interleaved), rtol=1e-6,
                               atol=1e-9)
    assert (relative <= site_logit_bound(site, rope_bound="norm_product") * (1 + 1e-9)).all()
    assert (relative >= site_logit_bound(site, rope_bound="interaction") * (1 - 1e-9)).all()



def test_an_unknown_rope_bound_is_a_value_error_naming_it():
    model = VARIANTS["rope_interleaved"][0]().eval()
    site, = geoscale_fx.find_attention(model, torch.randn(2, L, D))
    with pytest.raises(ValueError, match="rope_bound must be one of .* got 'exact'"):
        site_logit_bound(site, rope_bound="exact")

def test_relative_bound_with_biases_matches_brute_force():
    from tests.attention_variants import Block

    model = Block(rope="half", qk_bias=True, norm="rmsnorm").eval()
    with torch.no_grad():
        model.q.bias.normal_(0, 2.0)
        model.k.bias.normal_(0, 2.0)
    site, = geoscale_fx.find_attention(model, torch.randn(2, L, D))
    torch.testing.assert_close(site_logit_bound(site, rope_bound="relative"),
                               _brute_force(site, _rotate_half, False), rtol=1e-6, atol=1e-9)


def test_rotary_frequencies_reject_nonlinear_angles():
    cos, sin = _rope_tables(8, 8)
    pairing = [(j + 4) % 8 for j in range(8)]
    omega = relative_rope_bound.rotary_frequencies(cos, sin, pairing, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    torch.testing.assert_close(omega, torch.cat([inv_freq, inv_freq]))
    bent = cos.clone()
    bent[5] = torch.cos(torch.arange(8) * 0.3)   # position 5 breaks θ(p) = p·ω
    with pytest.raises(ValueError, match="not linear"):
        relative_rope_bound.rotary_frequencies(bent, sin, pairing, 8)
