"""geoscale_fx.numerics.estimators: each estimator's bound against torch.linalg on explicit matrices.

tests/planning/test_scaling.py covers the per-head σ estimators and ``make_estimator``'s choice for
weight terms; here: the per-layer σ, the power estimates staying ≤ the exact σ, the cold-start
floors of the RoPE norm product, the observed-keys estimators, the inference ``reuse``, and
the Schatten estimators (the default) against the exact ones and adversarial updates.
"""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.numerics import head_weights
from geoscale_fx.numerics.estimators import (
    ExactNormProduct, ExactObservedKeys, ExactSigma, PowerNormProduct, PowerObservedKeys,
    PowerSigma, SchattenNormProduct, SchattenObservedKeys, SchattenSigma, make_estimator,
)
from geoscale_fx.sites.terms import HeadWeights, Side, Source, Term

D, DH, NQ, NKV = 12, 3, 4, 2
GROUP = NQ // NKV


def _side(n_heads: int, offset: int = 0) -> Side:
    features = tuple(tuple(range(offset + h * DH, offset + (h + 1) * DH)) for h in range(n_heads))
    return Side(Source("layernorm", "norm", D), "w", "dense", features)


def _observed(past=(), fresh=()) -> Side:
    return Side(Source("rmsnorm", "keys", DH), None, "observed",
                tuple((g,) for g in range(NKV)), observed_axes=(1, 3),
                observed_past=past, observed_fresh=fresh)


def _weights(seed: int) -> HeadWeights:
    g = torch.Generator().manual_seed(seed)
    return HeadWeights(torch.randn(NQ, D, DH, generator=g, dtype=torch.float64), None,
                       torch.randn(NKV, D, DH, generator=g, dtype=torch.float64), None)


def _state(est) -> dict:
    return {s.name: torch.zeros(s.shape, dtype=torch.float64) for s in est.specs()}


def _layer_sigma_reference(hw: HeadWeights) -> float:
    """‖Σ_h A_q,h A_k,g(h)ᵀ‖₂ by forming the (d, d) matrix, float64."""
    m = sum(hw.a_q[h] @ hw.a_k[h // GROUP].T for h in range(NQ))
    return float(torch.linalg.matrix_norm(m, ord=2))


def test_exact_sigma_per_layer_is_the_norm_of_the_summed_head_products():
    term, hw = Term(_side(NQ), _side(NKV, NQ * DH)), _weights(0)
    est = ExactSigma(term, "", 0.25, per_layer=True)
    state = _state(est)
    bound = est.bound(hw, state)
    sigma = _layer_sigma_reference(hw)
    assert bound.shape == (1,) and state["sigma"].shape == (1,)
    # the state keeps σ as a float32 rounded up: never below, within one float32 ulp
    assert sigma * (1 - 1e-12) <= float(state["sigma"]) <= sigma * (1 + 2 ** -23)
    # s · ρ_q ρ_k · σ with ρ = √d on both sides
    torch.testing.assert_close(bound, torch.tensor([0.25 * D * sigma], dtype=torch.float64),
                               rtol=1e-9, atol=0)


def test_power_sigma_estimates_never_exceed_the_exact_sigma():
    """From a random (not cold-started) state, every warm step is a lower bound on σ, per
    head and per layer, and it converges upwards to σ."""
    term, hw = Term(_side(NQ), _side(NKV, NQ * DH)), _weights(1)
    exact_head = torch.stack([torch.linalg.matrix_norm(hw.a_q[h] @ hw.a_k[h // GROUP].T, ord=2)
                              for h in range(NQ)])
    for per_layer, exact in ((False, exact_head),
                             (True, torch.tensor([_layer_sigma_reference(hw)]))):
        est = PowerSigma(term, "", 1.0, per_layer=per_layer, iters=1)
        state = _state(est)
        gen = torch.Generator().manual_seed(3)    # random unit vectors, as the state holds
        for name in ("u", "v"):
            state[name].copy_(torch.nn.functional.normalize(
                torch.randn(state[name].shape, generator=gen, dtype=torch.float64), dim=-1))
        for _ in range(30):
            est.bound(hw, state)
            assert bool((state["sigma"] <= exact * (1 + 1e-9)).all()), (per_layer, state["sigma"])
        torch.testing.assert_close(state["sigma"], exact.double(), rtol=1e-3, atol=0)


def test_power_norm_product_cold_start_floors_are_the_exact_norms_and_used_once():
    term, hw = Term(_side(NQ), _side(NKV, NQ * DH)), _weights(2)
    nq = torch.linalg.matrix_norm(hw.a_q, ord=2)
    nk = torch.linalg.matrix_norm(hw.a_k, ord=2)
    est = PowerNormProduct(term, "", 0.5, iters=1, cold_iters=3)
    state = _state(est)
    used = est.cold_start(hw, state, torch.Generator().manual_seed(0))
    assert used >= 2 * 3                                   # q and k side, ≥ cold_iters each
    torch.testing.assert_close(state["floor_q"], nq, rtol=1e-9, atol=0)
    torch.testing.assert_close(state["floor_k"], nk, rtol=1e-9, atol=0)
    first = est.bound(hw, state)
    exact = ExactNormProduct(term, "", 0.5).bound(hw, _state(ExactNormProduct(term, "", 0.5)))
    assert bool((first >= exact * (1 - 1e-9)).all())
    torch.testing.assert_close(first, 0.5 * D * nq * nk.repeat_interleave(GROUP),
                               rtol=1e-6, atol=0)
    assert float(state["floor_q"].abs().sum()) == 0 and float(state["floor_k"].abs().sum()) == 0


def test_observed_keys_bound_uses_the_keys_actual_norms_and_keeps_a_running_maximum():
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, NKV, 5, DH, generator=g, dtype=torch.float64)     # (B, H_kv, L, d_h)
    key_max = torch.linalg.vector_norm(keys, dim=-1).amax(dim=(0, 2))      # (H_kv,)
    term = Term(_side(NQ), _observed(past=(("past", 1),), fresh=(("fresh", 1),)))
    est = ExactObservedKeys(term, "", 0.5)
    assert est.running_state == "key_norm_max"
    assert {s.name for s in est.specs()} == {"norm_product", "query_factor", "key_norm_max"}
    hw = _weights(5)
    a_k, _ = head_weights.observed_heads(term.k, {"fresh": keys}.__getitem__)
    hw = HeadWeights(hw.a_q, None, a_k, None)
    state = _state(est)
    bound = est.bound(hw, state)
    nq = torch.linalg.matrix_norm(hw.a_q, ord=2)
    # s·ρ_q‖A_q,h‖·max_j‖k_g(h),j‖
    expected = 0.5 * (D ** 0.5 * nq) * key_max.repeat_interleave(GROUP)
    torch.testing.assert_close(bound, expected, rtol=1e-6, atol=0)
    # a later call with smaller new keys: the running maximum still covers the earlier ones
    small, _ = head_weights.observed_heads(term.k, {"fresh": keys * 0.1}.__getitem__)
    again = est.bound(HeadWeights(hw.a_q, None, small, None), state)
    torch.testing.assert_close(again, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(state["key_norm_max"], key_max, rtol=1e-6, atol=0)


def test_make_estimator_picks_observed_key_estimators_and_reuse_reads_the_weight_bound():
    observed = Term(_side(NQ), _observed())
    for estimator, cls in (("exact", ExactObservedKeys), ("power", PowerObservedKeys)):
        est = make_estimator(observed, 0, 1.0, granularity="head", estimator=estimator,
                             rope_bound="norm_product")
        assert type(est) is cls
        assert est.running_state is None                      # whole keys every step
        assert "key_norm_max" not in {s.name for s in est.specs()}
    # reuse (weights unchanged since the last full step): nothing recomputed from weights
    term, hw = Term(_side(NQ), _side(NKV, NQ * DH)), _weights(6)
    est = ExactSigma(term, "", 0.5)
    state = _state(est)
    full = est.full_step(hw, state)
    torch.testing.assert_close(state["weight_bound"], full)
    torch.testing.assert_close(est.reuse({}, state), full)


def _top_pairs(a_q, a_k):
    """Per query head: σ and the left/right singular vectors of M_h = a_q[h] a_k[g]ᵀ."""
    m = torch.stack([a_q[h] @ a_k[h // GROUP].T for h in range(NQ)])       # (n_q, d, d)
    u, s, vh = torch.linalg.svd(m)
    return s, u, vh.transpose(-1, -2)


def test_schatten_sigma_covers_updates_built_to_raise_sigma_fastest():
    """Steepest ascent of σ (each step moves a_q along u₁ (a_kᵀv₁)ᵀ and a_k along
    v₁ (a_qᵀu₁)ᵀ, by 30% of their norms), then an update that makes the *smallest* singular
    direction the largest: the Schatten bound stays ≥ σ (explicit, float64) and within
    rank^(1/256) of it at every step; the warm power iteration (cold-started on the first
    weights) falls below σ on the way."""
    term, hw = Term(_side(NQ), _side(NKV, NQ * DH)), _weights(7)
    a_q, a_k = hw.a_q.clone(), hw.a_k.clone()
    schatten_est, power_est = SchattenSigma(term, "", 1.0), PowerSigma(term, "", 1.0)
    s_state, p_state = _state(schatten_est), _state(power_est)
    power_est.cold_start(HeadWeights(a_q, None, a_k, None), p_state,
                         torch.Generator().manual_seed(0))
    power_below = []
    for step in range(8):
        sigma, u, v = _top_pairs(a_q, a_k)
        bound = schatten_est.bound(HeadWeights(a_q, None, a_k, None), s_state) / D    # s = 1
        assert bool((bound >= sigma[:, 0]).all()), (step, bound / sigma[:, 0])
        assert bool((bound <= sigma[:, 0] * DH ** (1 / 256) * (1 + 1e-9)).all())
        assert bool((s_state["sigma"] >= sigma[:, 0]).all())    # float32 copy: rounded up
        power = power_est.bound(HeadWeights(a_q, None, a_k, None), p_state) / D
        power_below.append(bool((power < sigma[:, 0] * (1 - 1e-3)).any()))
        if step < 5:        # steepest ascent of σ on every head (GQA: summed over the group)
            for h in range(NQ):
                dq = torch.outer(u[h, :, 0], a_k[h // GROUP].T @ v[h, :, 0])
                a_q[h] += 0.3 * a_q[h].norm() * dq / dq.norm()
            for g in range(NKV):
                dk = sum(torch.outer(v[h, :, 0], a_q[h].T @ u[h, :, 0])
                         for h in range(g * GROUP, (g + 1) * GROUP))
                a_k[g] += 0.3 * a_k[g].norm() * dk / dk.norm()
        else:               # the least direction grows ×3 of σ₁: the top switches
            for h in range(NQ):
                lo = DH - 1
                a_q[h] += 3.0 * sigma[h, 0] * torch.outer(u[h, :, lo], a_k[h // GROUP].T
                                                          @ v[h, :, lo]) / sigma[h, lo] ** 2
    assert not power_below[0] and any(power_below), power_below


def test_schatten_estimators_bound_every_term_kind_from_above():
    """σ, the RoPE norm product and the query factor of cached keys: each Schatten
    estimator's bound is ≥ the exact estimator's, within rank^(1/256); make_estimator
    picks them for estimator="schatten" and names a wrong one."""
    hw = _weights(8)
    weights = Term(_side(NQ), _side(NKV, NQ * DH))
    for exact_cls, schatten_cls in ((ExactSigma, SchattenSigma),
                                    (ExactNormProduct, SchattenNormProduct)):
        exact = exact_cls(weights, "", 0.5).bound(hw, _state(exact_cls(weights, "", 0.5)))
        est = schatten_cls(weights, "", 0.5)
        upper = est.bound(hw, _state(est))
        limit = DH ** (1 / 256) ** (2 if exact_cls is ExactNormProduct else 1)
        assert bool((upper >= exact).all()) and bool((upper <= exact * limit * 1.0001).all())
    observed = Term(_side(NQ), _observed())
    est = make_estimator(observed, 0, 0.5, granularity="head", estimator="schatten",
                         rope_bound="norm_product")
    assert type(est) is SchattenObservedKeys
    exact = ExactObservedKeys(observed, "", 0.5)
    s_state, e_state = _state(est), _state(exact)
    est.refresh(hw, s_state)
    exact.refresh(hw, e_state)
    assert bool((s_state["query_factor"] >= e_state["query_factor"]).all())
    with pytest.raises(ValueError, match="estimator must be one of.*'eigh'"):
        make_estimator(weights, 0, 0.5, granularity="head", estimator="eigh",
                       rope_bound="norm_product")
