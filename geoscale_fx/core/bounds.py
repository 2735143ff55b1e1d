"""Bounds on attention logits and the paper's calibration rule, as pure functions.

Symbols follow ``rank-aware-spectral-bounds.tex``: an attention logit is
``S_ij = x_iᵀ W^Q W^Kᵀ x_j / √d_h`` with model width ``d``, head width ``d_h``,
``σ = ‖W^Q W^Kᵀ‖₂`` and inputs bounded by ``‖x‖ ≤ B_X`` (``√d`` after LayerNorm/RMSNorm).

Two kinds of functions live here:

* per-step bounds (``naive_bound`` … ``scale_factor``) accept Python numbers or tensors
  of any shape (one entry per head or per layer), compute in float64 and return a float64
  tensor. They have no data-dependent branches, so ``torch.compile`` can trace them;
* calibration rules (``select_gamma``, ``alpha_min``, ``overflow_probability_bound``,
  ``rank_aware_improvement``) take plain sizes, validate them and return Python floats.

Example::

    >>> from geoscale_fx import bounds
    >>> round(bounds.alpha_min(model_dim=4096, head_dim=128, n_heads_total=1024,
    ...                        seq_len=1024, delta=1e-6), 4)
    0.0352
"""
from __future__ import annotations

import math
from typing import Union

import torch

__all__ = [
    "FP8_MAX",
    "fp8_max",
    "round_up_f32",
    "naive_bound",
    "interaction_bound",
    "worst_case_bound",
    "calibrated_bound",
    "affine_logit_bound",
    "norm_product_logit_bound",
    "scale_factor",
    "utilization",
    "select_gamma",
    "alpha_min",
    "alpha_min_traced",
    "overflow_probability_bound",
    "rank_aware_improvement",
]

Number = Union[int, float]
TensorLike = Union[Number, torch.Tensor]

#: Largest finite magnitude of each FP8 format (OCP FP8 spec; torch.finfo agrees).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# Scales never go below this, so that a zero bound (all-zero weights) gives a finite
# divisor instead of 0/0; logits are then exactly zero and any positive scale is exact.
_SCALE_FLOOR = torch.finfo(torch.float32).tiny


def fp8_max(fmt: str) -> float:
    """Largest finite value of FP8 format ``fmt`` ("e4m3" or "e5m2")."""
    try:
        return FP8_MAX[fmt]
    except KeyError:
        raise ValueError(f"fmt must be one of {sorted(FP8_MAX)}, got {fmt!r}") from None


def round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 ``≥ x`` (x float64), floored at the smallest normal float32: a
    scale derived from a certified bound must not round one ulp under it (an entry at the
    bound would then saturate), nor be 0 for a zero bound. Traceable."""
    x = x.double()
    y = x.to(torch.float32)
    y = torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp_min(torch.finfo(torch.float32).tiny)


def _f64(x: TensorLike) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return torch.tensor(float(x), dtype=torch.float64)


# --------------------------------------------------------------------------------------
# Per-step bounds (traceable)
# --------------------------------------------------------------------------------------

def naive_bound(wq_norm: TensorLike, wk_norm: TensorLike, input_norm_bound: TensorLike,
                head_dim: Number) -> torch.Tensor:
    """Proposition 3.1: ``max|S| ≤ ‖W^Q‖₂ ‖W^K‖₂ B_X² / √d_h``."""
    return _f64(wq_norm) * _f64(wk_norm) * _f64(input_norm_bound) ** 2 / math.sqrt(head_dim)


def interaction_bound(sigma: TensorLike, input_norm_bound: TensorLike,
                      head_dim: Number) -> torch.Tensor:
    """Proposition 3.2: ``max|S| ≤ σ B_X² / √d_h`` with ``σ = ‖W^Q W^Kᵀ‖₂``."""
    return _f64(sigma) * _f64(input_norm_bound) ** 2 / math.sqrt(head_dim)


def worst_case_bound(sigma: TensorLike, model_dim: Number, head_dim: Number) -> torch.Tensor:
    """Eq. (3): ``B_max = σ · d / √d_h`` (the interaction bound with ``B_X = √d``)."""
    return _f64(sigma) * (model_dim / math.sqrt(head_dim))


def calibrated_bound(alpha: TensorLike, sigma: TensorLike, model_dim: Number,
                     head_dim: Number) -> torch.Tensor:
    """Eq. (4): ``B_α = α · B_max``."""
    return _f64(alpha) * worst_case_bound(sigma, model_dim, head_dim)


def affine_logit_bound(sigma: TensorLike, aq_ck: TensorLike, ak_cq: TensorLike,
                       cq_ck: TensorLike, *, radius_q: TensorLike, radius_k: TensorLike,
                       softmax_scale: TensorLike) -> torch.Tensor:
    """Certified bound on ``|S|`` when queries and keys are affine in normalized inputs.

    With ``q = A_qᵀ x̂_q + c_q`` and ``k = A_kᵀ x̂_k + c_k`` (gain folded into ``A``,
    offset and bias into ``c``, see DESIGN.md) and ``‖x̂_q‖ ≤ ρ_q``, ``‖x̂_k‖ ≤ ρ_k``::

        |S| ≤ s · ( ρ_q ρ_k σ + ρ_q ‖A_q c_k‖ + ρ_k ‖A_k c_q‖ + |c_q · c_k| )

    where ``σ = ‖A_q A_kᵀ‖₂`` and ``s`` is the site's softmax scale. With no gain or bias
    and ``ρ = √d``, ``s = 1/√d_h`` this is exactly ``B_max``. Arguments broadcast (one
    entry per head).
    """
    rq, rk = _f64(radius_q), _f64(radius_k)
    total = rq * rk * _f64(sigma) + rq * _f64(aq_ck) + rk * _f64(ak_cq) + _f64(cq_ck).abs()
    return _f64(softmax_scale) * total


def norm_product_logit_bound(aq_norm: TensorLike, ak_norm: TensorLike, cq_norm: TensorLike,
                             ck_norm: TensorLike, *, radius_q: TensorLike, radius_k: TensorLike,
                             softmax_scale: TensorLike, rotation_gain: TensorLike = 1.0
                             ) -> torch.Tensor:
    """Certified bound for sites whose q and k are rotated (RoPE) before the product.

    ``|S| ≤ s · m · (ρ_q ‖A_q‖₂ + ‖c_q‖)(ρ_k ‖A_k‖₂ + ‖c_k‖)``: Cauchy–Schwarz with
    ``‖R q‖ ≤ m_q ‖q‖`` for every rotation ``R`` (``m = m_q m_k`` is 1 for plain RoPE;
    scaled variants such as YaRN multiply cos and sin by a constant).
    """
    q_norm = _f64(radius_q) * _f64(aq_norm) + _f64(cq_norm)
    k_norm = _f64(radius_k) * _f64(ak_norm) + _f64(ck_norm)
    return _f64(softmax_scale) * _f64(rotation_gain) * q_norm * k_norm


def scale_factor(bound: TensorLike, eta: float = 0.8, fmt: str = "e4m3") -> torch.Tensor:
    """Eq. (6): the divisor ``scale = bound / (η · R_max)`` applied to logits before the cast.

    Edge cases: a zero bound gives a tiny positive scale (the logits are then exactly zero,
    so no value is lost); non-finite bounds propagate unchanged — callers check weights for
    non-finite values before they reach this point (see ``geoscale_fx.compile.dynamo_backend``).
    """
    if not 0.0 < eta <= 1.0:
        raise ValueError(f"eta must be in (0, 1], got {eta!r}")
    return (_f64(bound) / (eta * fp8_max(fmt))).clamp_min(_SCALE_FLOOR)


def utilization(max_abs_logit: TensorLike, scale: TensorLike, fmt: str = "e4m3") -> torch.Tensor:
    """Fraction of the FP8 range used: ``max|S| / (scale · R_max)`` (> 1 means overflow)."""
    return _f64(max_abs_logit) / (_f64(scale) * fp8_max(fmt))


# --------------------------------------------------------------------------------------
# Calibration rule (Section 3.2): plain sizes in, Python floats out
# --------------------------------------------------------------------------------------

def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_delta(delta) -> float:
    if not isinstance(delta, (int, float)) or not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def _check_dims(model_dim, head_dim) -> tuple[int, int]:
    d = _check_positive_int("model_dim", model_dim)
    dh = _check_positive_int("head_dim", head_dim)
    if dh >= d:
        raise ValueError(f"head_dim must be smaller than model_dim, got head_dim={dh} "
                         f">= model_dim={d}")
    return d, dh


def _typicality_gap(gamma: float) -> float:
    """``h(γ) = γ − 1 − ln γ``, increasing on ``γ > 1`` with ``h(1) = 0``."""
    return gamma - 1.0 - math.log(gamma)


def select_gamma(head_dim: int, n_heads_total: int, seq_len: int, delta: float = 1e-6) -> float:
    """Eq. (7): the smallest ``γ > 1`` with ``γ − 1 − ln γ ≥ (2/d_h) ln(2 N L / δ*)``.

    ``N`` is the number of attention heads in the model (layers × query heads), ``L`` the
    sequence length. Solved by bracketing and bisection to float64 precision, so it needs
    no SciPy and never fails to converge (``h`` is continuous and increasing).
    """
    dh = _check_positive_int("head_dim", head_dim)
    n = _check_positive_int("n_heads_total", n_heads_total)
    length = _check_positive_int("seq_len", seq_len)
    dlt = _check_delta(delta)
    # sum of logs: 2NL/δ* overflows a float for tiny δ*
    target = (2.0 / dh) * (math.log(2.0) + math.log(n) + math.log(length) - math.log(dlt))
    lo, hi = 1.0, 2.0
    while _typicality_gap(hi) < target:  # h(γ) ≥ γ/2 − 1 for γ ≥ 2, so this terminates
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _typicality_gap(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return hi


def alpha_min(model_dim: int, head_dim: int, n_heads_total: int, seq_len: int,
              delta: float = 1e-6) -> float:
    """Eq. (8): ``α_min = √(2 γ d_h)/d · √(ln(4 N L² / δ*))`` with γ from :func:`select_gamma`.

    With ``α ≥ α_min`` the union bound over all ``N`` heads and ``L²`` pairs gives
    ``Pr(max|S| ≥ B_α) ≤ δ*`` under the paper's spherical-input assumption.
    """
    d, dh = _check_dims(model_dim, head_dim)
    gamma = select_gamma(dh, n_heads_total, seq_len, delta)
    log_term = (math.log(4.0) + math.log(n_heads_total) + 2.0 * math.log(seq_len)
                - math.log(delta))
    return math.sqrt(2.0 * gamma * dh) / d * math.sqrt(log_term)


def alpha_min_traced(model_dim: int, head_dim: int, n_heads_total: int,
                     seq_len: torch.Tensor, delta: float = 1e-6,
                     newton_steps: int = 4) -> torch.Tensor:
    """:func:`alpha_min` for a sequence length known only at run time (a float64 tensor).

    Traceable (no host sync, no data-dependent branch), so a graph compiled with dynamic
    shapes uses the α_min of the length it is actually called with. Eq. (7) is solved by
    Newton's method on the convex, increasing ``h(γ) = γ − 1 − ln γ`` from
    ``γ₀ = 1 + T + √(2T)``, which lies right of the root (``ln(1 + x) < x``), so the
    iterates decrease monotonically to it and never undershoot it (α is never below α_min).
    Convergence is quadratic: 4 steps reach float64 precision for T in [0.01, 100]
    (T ≈ 75/d_h for real models); few steps also keep the expression small for Inductor,
    which inlines the whole chain into one kernel.
    """
    d, dh = _check_dims(model_dim, head_dim)
    n = _check_positive_int("n_heads_total", n_heads_total)
    dlt = _check_delta(delta)
    log_l = torch.log(seq_len.double().clamp_min(1.0))
    base = math.log(2.0) + math.log(n) - math.log(dlt)
    target = (2.0 / dh) * (base + log_l)
    gamma = 1.0 + target + torch.sqrt(2.0 * target)
    for _ in range(newton_steps):
        excess = gamma - 1.0 - torch.log(gamma) - target
        gamma = gamma - excess / (1.0 - 1.0 / gamma).clamp_min(1e-300)
    log_term = math.log(4.0) + math.log(n) - math.log(dlt) + 2.0 * log_l
    return torch.sqrt(2.0 * gamma * dh) / d * torch.sqrt(log_term)


def overflow_probability_bound(alpha: float, model_dim: int, head_dim: int, n_heads_total: int,
                               seq_len: int, gamma: float | None = None,
                               delta: float = 1e-6) -> float:
    """Proposition 3.4 with the union bound over heads: ``N · (T1 + T2)``.

    ``T1 = L exp(−(d_h/2)(γ − 1 − ln γ))`` and ``T2 = 2 L² exp(−d² α² / (2 γ d_h))``.
    ``gamma`` defaults to :func:`select_gamma` for ``delta``. The value may exceed 1, in
    which case the bound says nothing.
    """
    d, dh = _check_dims(model_dim, head_dim)
    n = _check_positive_int("n_heads_total", n_heads_total)
    length = _check_positive_int("seq_len", seq_len)
    if not isinstance(alpha, (int, float)) or not alpha > 0.0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    if gamma is None:
        gamma = select_gamma(dh, n, length, delta)
    elif not gamma > 1.0:
        raise ValueError(f"gamma must be > 1, got {gamma!r}")
    t1 = length * math.exp(-(dh / 2.0) * _typicality_gap(gamma))
    t2 = 2.0 * length ** 2 * math.exp(-(d ** 2) * alpha ** 2 / (2.0 * gamma * dh))
    return n * (t1 + t2)


def rank_aware_improvement(model_dim: int, head_dim: int, gamma: float) -> float:
    """Appendix B.3: the tail exponent improves over the rank-agnostic one by ``d/(γ d_h)``."""
    d, dh = _check_dims(model_dim, head_dim)
    if not gamma > 1.0:
        raise ValueError(f"gamma must be > 1, got {gamma!r}")
    return d / (gamma * dh)

