"""geoscale_fx.core.schatten: never below the spectral norm (torch.linalg on the explicit
matrices, float64), at most rank^(1/256) above it, through rank deficiency, zero weights,
ill-conditioning and a failed factorization; traceable."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.core import schatten, spectral

#: (n_q, n_kv, d, d_h): MHA, GQA, MQA, cross-attention widths
SHAPES = [(4, 4, 128, 16), (8, 2, 256, 32), (6, 1, 192, 64), (2, 2, 384, 128)]


def _explicit(a_q, a_k):
    """‖a_q[h] a_k[h//g]ᵀ‖₂ of every head, by forming the d×d matrix."""
    g = a_q.shape[0] // a_k.shape[0]
    return torch.stack([torch.linalg.matrix_norm(a_q[h].double() @ a_k[h // g].double().T,
                                                 ord=2) for h in range(a_q.shape[0])])


def _heads(n, d, dh, kind, gen):
    if kind == "random":
        return torch.randn(n, d, dh, generator=gen)
    if kind == "low_rank":          # rank 2: G_K singular, the Cholesky needs its jitter
        return torch.randn(n, d, 2, generator=gen) @ torch.randn(n, 2, dh, generator=gen)
    if kind == "flat":              # every singular value equal: the worst case of the bound
        return torch.linalg.qr(torch.randn(n, d, dh, generator=gen))[0] * 3.0
    u = torch.linalg.qr(torch.randn(n, d, dh, generator=gen))[0]        # trained-like decay
    return (u * torch.logspace(1, -1, dh)) @ torch.linalg.qr(torch.randn(n, dh, dh,
                                                                          generator=gen))[0]


@pytest.mark.parametrize("n_q, n_kv, d, dh", SHAPES)
@pytest.mark.parametrize("kind", ["random", "low_rank", "flat", "decaying"])
def test_per_head_sigma_is_never_below_and_at_most_rank_to_the_1_256_above(n_q, n_kv, d, dh,
                                                                            kind):
    gen = torch.Generator().manual_seed(n_q * dh)
    a_q, a_k = _heads(n_q, d, dh, kind, gen), _heads(n_kv, d, dh, kind, gen)
    exact = _explicit(a_q, a_k)
    upper = schatten.per_head_sigma(a_q, a_k)
    assert upper.dtype == torch.float64 and upper.shape == (n_q,)
    assert bool((upper >= exact).all()), (upper / exact).min()
    rank = 2 if kind == "low_rank" else dh
    assert bool((upper <= exact * rank ** (1 / 256) * (1 + 1e-9)).all()), (upper / exact).max()
    if kind == "flat":             # equal singular values reach the worst case exactly
        torch.testing.assert_close(upper / exact, torch.full_like(exact, dh ** (1 / 256)),
                                   rtol=1e-6, atol=0)


def test_cross_attention_widths_and_the_per_layer_norm():
    gen = torch.Generator().manual_seed(1)
    a_q, a_k = torch.randn(4, 96, 16, generator=gen), torch.randn(2, 64, 16, generator=gen)
    exact = _explicit(a_q, a_k)
    assert bool((schatten.per_head_sigma(a_q, a_k) >= exact).all())
    layer = torch.linalg.matrix_norm(sum(a_q[h].double() @ a_k[h // 2].double().T
                                         for h in range(4)), ord=2)
    upper = schatten.per_layer_sigma(a_q, a_k)
    assert upper.shape == () and layer <= upper <= layer * 32 ** (1 / 256)


def test_head_norms_bound_the_spectral_norm_of_each_head():
    a = _heads(6, 200, 48, "decaying", torch.Generator().manual_seed(2))
    exact = torch.linalg.matrix_norm(a.double(), ord=2)
    upper = schatten.head_norms(a)
    assert bool((upper >= exact).all()) and bool((upper <= exact * 48 ** (1 / 256)).all())


def test_zero_weights_give_zero_not_nan():
    zeros = torch.zeros(2, 16, 8)
    assert schatten.per_head_sigma(zeros, zeros).tolist() == [0.0, 0.0]
    assert schatten.head_norms(zeros).tolist() == [0.0, 0.0]
    one_side = schatten.per_head_sigma(torch.randn(2, 16, 8), zeros)
    assert bool(torch.isfinite(one_side).all()) and float(one_side.max()) < 1e-100


def _ill_conditioned(big: float):
    """Integer heads whose product is exact in float64: ‖a_q‖‖a_k‖ / σ ≈ big."""
    d, m = 64, 8
    gen = torch.Generator().manual_seed(3)
    a_q, a_k = torch.zeros(1, d, m, dtype=torch.float64), torch.zeros(1, d, m, dtype=torch.float64)
    for j in range(m):
        a_q[0, j, j], a_k[0, m + j, j] = 1.0, 1.0
    a_q[0, 0, 0], a_k[0, m + 1, 1] = big, big                   # large on different channels
    a_q[0, 2 * m:3 * m] += torch.randint(-2, 3, (m, m), generator=gen).double()
    a_k[0, 2 * m:3 * m] += torch.randint(-2, 3, (m, m), generator=gen).double()
    return a_q, a_k


@pytest.mark.parametrize("big", [1e3, 1e5, 1e7])
def test_rounding_allowance_keeps_ill_conditioned_heads_covered(big):
    """σ ≈ ‖a_q‖‖a_k‖ / big: the Grams' float64 rounding is of order u·big⁴ in σ², far above
    u·σ²; the allowance (∝ tr G_Q · tr G_K) keeps the bound above the explicit σ."""
    a_q, a_k = _ill_conditioned(big)
    exact = torch.linalg.matrix_norm(a_q[0] @ a_k[0].T, ord=2)    # integer entries: exact
    product = torch.linalg.matrix_norm(a_q[0], ord=2) * torch.linalg.matrix_norm(a_k[0], ord=2)
    assert float(product / exact) > big / 10
    upper = schatten.per_head_sigma(a_q, a_k)
    assert float(upper) >= float(exact)
    assert float(upper) <= float(product)            # never worse than the norm product


def test_a_failed_factorization_falls_back_to_the_frobenius_product(monkeypatch):
    """cholesky_ex reports failure in a tensor (no host sync): the bound is then
    ‖a_q‖_F‖a_k‖_F, certified and loose, selected in the graph."""
    gen = torch.Generator().manual_seed(4)
    a_q, a_k = torch.randn(4, 32, 8, generator=gen), torch.randn(2, 32, 8, generator=gen)
    monkeypatch.setattr(schatten, "_JITTER", -1.0)        # G_K − tr(G_K)·I: not positive
    upper = schatten.per_head_sigma(a_q, a_k)
    frobenius = (torch.linalg.vector_norm(a_q.double(), dim=(1, 2)) *
                 torch.linalg.vector_norm(a_k.double(), dim=(1, 2)).repeat_interleave(2))
    torch.testing.assert_close(upper, frobenius, rtol=1e-12, atol=0)
    assert bool((upper >= _explicit(a_q, a_k)).all())


def test_traces_in_one_graph_and_matches_eager():
    gen = torch.Generator().manual_seed(5)
    a_q, a_k = torch.randn(8, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen)
    compiled = torch.compile(schatten.per_head_sigma, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(a_q, a_k), schatten.per_head_sigma(a_q, a_k),
                               rtol=1e-12, atol=0)


def test_agrees_with_the_exact_route_where_that_is_well_conditioned():
    gen = torch.Generator().manual_seed(6)
    a_q, a_k = torch.randn(8, 256, 32, generator=gen), torch.randn(8, 256, 32, generator=gen)
    exact = spectral.per_head_sigma_exact(a_q, a_k)
    upper = schatten.per_head_sigma(a_q, a_k)
    assert bool((upper >= exact).all()) and bool((upper <= exact * (1 + 1e-3)).all())
