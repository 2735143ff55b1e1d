"""Scaling policies and estimators, against independent references (torch.linalg, float64)."""
from __future__ import annotations

import math

import pytest
import torch

import geoscale_fx
import models_zoo
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.position_bias import PositionBias
from geoscale_fx.analysis.modifiers.sink import Sink
from geoscale_fx.analysis.modifiers.softcap import Softcap
from geoscale_fx.core import bounds
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.numerics.estimators import (
    ExactNormProduct, ExactSigma, PowerNormProduct, PowerSigma, SchattenNormProduct,
    SchattenSigma, make_estimator,
)
from geoscale_fx.numerics.logit_bounds import apply_modifiers
from geoscale_fx.planning.scaling import (
    CurrentScaling, DelayedScaling, GeometryScaling, NoScaling, make_policy,
)
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.terms import HeadWeights, Rotary, Side, Source, Term

D, DH, NQ, NKV = 24, 6, 4, 2


def _side(n_heads: int, offset: int = 0, rotary=None, width: int = D) -> Side:
    features = tuple(tuple(range(offset + h * DH, offset + (h + 1) * DH)) for h in range(n_heads))
    return Side(Source("rmsnorm", "norm", width), "w", "dense", features, rotary=rotary)


def _term(rope: bool = False, width: int = D) -> Term:
    rot = Rotary("rotate_half", 1.0, True, tuple((j + DH // 2) % DH for j in range(DH)),
                 "cos", "sin") if rope else None
    return Term(_side(NQ, 0, rot, width), _side(NKV, NQ * DH, rot, width))


def _site(terms, modifiers=(), scale=DH ** -0.5) -> AttentionSite:
    return AttentionSite(name="attn", index=0, kind="sdpa", node="sdpa", supported=True,
                         n_q_heads=NQ, n_kv_heads=NKV, head_dim=DH, softmax_scale=scale,
                         score_scale=scale, terms=tuple(terms), modifiers=tuple(modifiers))


def _weights(seed: int, width: int = D) -> HeadWeights:
    g = torch.Generator().manual_seed(seed)
    return HeadWeights(torch.randn(NQ, width, DH, generator=g), None,
                       torch.randn(NKV, width, DH, generator=g), None)


def _sigma_reference(hw: HeadWeights) -> torch.Tensor:
    """‖A_q,h A_k,g(h)ᵀ‖₂ by forming each matrix (float64)."""
    group = NQ // NKV
    return torch.stack([torch.linalg.matrix_norm(
        hw.a_q[h].double() @ hw.a_k[h // group].double().T, ord=2) for h in range(NQ)])


def _state(estimator) -> dict:
    return {s.name: torch.full(s.shape, float(s.fill) if not callable(s.fill) else 0.0)
            for s in estimator.specs()}


def test_exact_sigma_bound_is_s_rho_squared_sigma():
    term, hw = _term(), _weights(0)
    est = ExactSigma(term, "", DH ** -0.5)
    state = _state(est)
    bound = est.bound(hw, state)
    expected = DH ** -0.5 * D * _sigma_reference(hw)           # ρ_q ρ_k = √d·√d
    torch.testing.assert_close(bound, expected, rtol=1e-10, atol=0)
    torch.testing.assert_close(state["sigma"].double(), _sigma_reference(hw), rtol=1e-6, atol=0)


def test_power_sigma_is_exact_at_cold_start_then_a_lower_bound_that_converges():
    term, hw = _term(), _weights(1)
    est = PowerSigma(term, "", 1.0, iters=1, cold_iters=5)
    state = _state(est)
    used = est.cold_start(hw, state, torch.Generator().manual_seed(0))
    assert used >= 5
    exact = _sigma_reference(hw)
    first = est.bound(hw, state) / D                          # s = 1
    assert bool((first >= exact * (1 - 1e-6)).all())          # the exact floor
    assert state["floor"].abs().sum() == 0                    # used once
    warm = est.bound(hw, state) / D
    assert bool((warm <= exact * (1 + 1e-5)).all())           # power: never above σ
    torch.testing.assert_close(warm, exact, rtol=1e-3, atol=0)


def test_norm_product_estimators_bound_rope_terms_by_spectral_norms():
    term, hw = _term(rope=True), _weights(2)
    nq = torch.linalg.matrix_norm(hw.a_q.double(), ord=2)
    nk = torch.linalg.matrix_norm(hw.a_k.double(), ord=2).repeat_interleave(NQ // NKV)
    for cls in (ExactNormProduct, PowerNormProduct):
        est = cls(term, "", 0.5)
        state = _state(est)
        est.cold_start(hw, state, torch.Generator().manual_seed(0))
        bound = est.bound(hw, state)
        torch.testing.assert_close(bound, 0.5 * D * nq * nk, rtol=1e-5, atol=0)
        torch.testing.assert_close(state["norm_product"].double(), nq * nk, rtol=1e-5, atol=0)


@pytest.mark.parametrize("rope,granularity,estimator,expected", [
    (False, "head", "power", PowerSigma), (False, "head", "exact", ExactSigma),
    (True, "head", "power", PowerNormProduct), (True, "head", "exact", ExactNormProduct),
    (True, "layer", "power", PowerSigma), (False, "layer", "exact", ExactSigma),
    (False, "head", "schatten", SchattenSigma), (True, "head", "schatten", SchattenNormProduct),
    (True, "layer", "schatten", SchattenSigma),
])
def test_make_estimator_is_the_one_decision(rope, granularity, estimator, expected):
    est = make_estimator(_term(rope), 1, 1.0, granularity=granularity, estimator=estimator,
                         rope_bound="norm_product")
    assert type(est) is expected
    assert est.n_scale == (1 if granularity == "layer" else NQ)
    assert all(s.name.startswith("t1_") for s in est.specs())   # term 1's state is prefixed


def test_a_two_term_site_is_bounded_by_the_sum_of_its_terms():
    """MLA-shaped: two terms with different sources (widths 24 and 16); the certified bound
    is the sum of the parts' bounds and holds against logits of adversarial unit inputs."""
    t0, t1 = _term(width=D), _term(width=16)
    hw0, hw1 = _weights(3, D), _weights(4, 16)
    site = _site([t0, t1])
    policy = GeometryScaling(site, GeoscaleOptions(estimator="exact"), NQ, NQ)
    state = {s.name: torch.full(s.shape, float(s.fill)) for s in
             __import__("geoscale_fx.planning.scaling", fromlist=["x"]).common_specs(NQ) + policy.specs()}
    weights = {"w": None}
    policy._term_weights = lambda _: [hw0, hw1]           # the two terms' weights
    divisor = policy.predict(weights, state, seq_len=8)
    s = DH ** -0.5
    expected = s * (D * _sigma_reference(hw0) + 16 * _sigma_reference(hw1))
    torch.testing.assert_close(state["bound"].double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(divisor.double(), expected / (0.8 * 448), rtol=1e-6, atol=0)
    # the top singular pairs of each term, at radius √width, reach each term's bound: the
    # sum is attained only when both align, so observed ≤ bound with equality per term
    for hw, width in ((hw0, D), (hw1, 16)):
        m = hw.a_q[0].double() @ hw.a_k[0].double().T
        u, sv, vh = torch.linalg.svd(m)
        x, y = u[:, 0] * width ** 0.5, vh[0] * width ** 0.5
        assert float(x @ m @ y) * s == pytest.approx(s * width * float(sv[0]), rel=1e-9)
    assert "t1_sigma" in state and "sigma" in state


def test_softcap_modifier_caps_the_bound():
    bound = torch.tensor([3.0, 80.0], dtype=torch.float64)
    capped = apply_modifiers(bound, [Softcap("c", 50.0), Mask("m")])
    assert capped.tolist() == [3.0, 50.0]
    assert apply_modifiers(bound, [Mask("m")]).tolist() == [3.0, 80.0]
    # a mask or position bias *before* the cap is inside it: only c bounds c·tanh(S + bias)
    for inner in (Mask, PositionBias):
        inside = apply_modifiers(bound, [inner("m"), Softcap("c", 50.0)])
        assert inside.tolist() == [50.0, 50.0]


def test_sink_modifier_raises_the_bound_to_the_largest_sink():
    bound = torch.tensor([3.0, 80.0], dtype=torch.float64)
    sinks = {"sinks": torch.tensor([-10.0, 2.0, 0.5])}
    out = apply_modifiers(bound, [Sink("s", param="sinks")], sinks.__getitem__)
    assert out.tolist() == [10.0, 80.0]


@pytest.mark.parametrize("scaling,cls", [
    ("geometry", GeometryScaling), ("delayed", DelayedScaling),
    ("current", CurrentScaling), ("none", NoScaling),
])
def test_make_policy(scaling, cls):
    policy = make_policy(_site([_term()]), GeoscaleOptions(scaling=scaling), 1, NQ)
    assert type(policy) is cls
    assert policy.observes is (scaling in ("delayed", "current"))


def test_delayed_te_keeps_its_multiplier_when_amax_is_zero_or_not_finite():
    policy = make_policy(_site([_term()]), GeoscaleOptions(scaling="delayed",
                                                           delayed_recipe="te"), 1, NQ)
    state = {s.name: torch.full(s.shape, float(s.fill)) for s in policy.specs()}
    policy.learn(torch.tensor([4.0]), state)
    assert state["te_multiplier"].item() == pytest.approx(448 / 4)
    for bad in (0.0, float("nan")):
        fresh = {k: v.clone() for k, v in state.items()}
        fresh["history"].zero_()
        fresh["te_multiplier"].fill_(7.0)
        policy.learn(torch.tensor([bad]), fresh)
        assert fresh["te_multiplier"].item() == 7.0
    assert policy.predict({}, state, 8).item() == pytest.approx(4 / 448)   # a divisor


@pytest.mark.parametrize("length", [1, 24, 64, 1024, 10 ** 6])
def test_alpha_min_traced_equals_the_host_solution(length):
    for d, dh, n in ((4096, 128, 1024), (128, 32, 8), (1600, 64, 1200)):
        host = bounds.alpha_min(d, dh, n, length, 1e-6)
        traced = bounds.alpha_min_traced(d, dh, n, torch.tensor(float(length)), 1e-6)
        assert float(traced) == pytest.approx(host, rel=1e-12)


@pytest.mark.slow   # an end-to-end run of tens of seconds
def test_theory_alpha_follows_the_sequence_length_under_dynamic_shapes():
    """Compiled with dynamic=True, α = α_min(L) of the length of *this* call (was frozen at
    the compile-time length: 1.675 after L=64 where α_min(64) = 1.776)."""
    zoo = models_zoo.get("nanogpt")
    be = geoscale_fx.backend(alpha="theory", compiler="aot_eager")
    model = torch.compile(zoo.model, backend=be, dynamic=True)
    compiles = []
    with torch.no_grad():
        for length in (24, 64, 40):
            model(**zoo.example_inputs(batch=2, seq_len=length))
            compiles.append(be.compiles)
            record = next(iter(be.records.values()))
            n_total = sum(r.site.n_q_heads for r in be.records.values())
            expected = bounds.alpha_min(record.site.model_dim, record.site.head_dim, n_total,
                                        length, 1e-6)
            assert float(record.state.alpha[0]) == pytest.approx(expected, rel=1e-6)
    assert compiles[0] == compiles[-1]     # one symbolic-length graph served every length


@pytest.mark.slow   # an end-to-end run of tens of seconds
def test_checkpointed_constant_alpha_is_not_overwritten_at_compile():
    """A state tensor has one writer per phase: a compile never refills α."""
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager", alpha=2.0)
    with torch.no_grad():
        wrapped(**zoo.example_inputs(batch=2, seq_len=16))
        for record in wrapped.geoscale.records.values():
            record.state.alpha.fill_(3.0)     # e.g. restored from elsewhere
        wrapped(**zoo.example_inputs(batch=2, seq_len=32))   # a recompile
    assert all(float(r.state.alpha.max()) == 3.0 for r in wrapped.geoscale.records.values())
    assert math.isfinite(float(next(iter(wrapped.geoscale.records.values())).state.scale[0]))
