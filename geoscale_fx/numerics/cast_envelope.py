"""The certified bound through a low-precision projection: what its casts can change.

A side whose projection is an FP8 linear (``Side.cast``, ``sites.linear_casts``) computes,
per head ``h`` (``W̃_h``: the dequantized weight's columns, ``d × d_h``)::

    q_h = (I + Δ)·W̃_hᵀ x̃ + b_h,     x̃ = D x + η,     x = g ⊙ x̂ + β,  ‖x̂‖ ≤ ρ

with the input cast's ``D = diag(λ)``, ``|λ_i − 1| ≤ κ`` (``κ = u'`` when no group is
scaled past the clip, else 1) and ``λ_i ≤ 1 + u'``, ``|η_i| ≤ τ``, and the output's rounding
``|Δ_ii| ≤ u_o`` (``DynamicCast``; ``core.rounding``).

**Proof.** ``D`` is diagonal, so it commutes with ``diag(g)``::

    x̃ = g ⊙ (D x̂) + β + ((D − I) β + η)

and ``x̂' = D x̂`` has ``‖x̂'‖ ≤ (1 + u') ρ``. With ``A_h = diag(g) W̃_h`` and
``c_h = W̃_hᵀ β + b_h`` (the usual fold, of the dequantized weight)::

    q_h = A_hᵀ x̂' + c_h + e_h,   e_h = W̃_hᵀ((D − I) β + η) + Δ W̃_hᵀ x̃

    ‖e_h‖ ≤ r_h + u_o·P_h,        r_h = ‖W̃_h‖_F (κ‖β‖ + √d·τ)  (≥ ‖W̃_h‖₂ (…)),
                                  P_h = (1 + u')ρ‖A_h‖₂ + ‖W̃_hᵀ β‖ + r_h ≥ ‖W̃_hᵀ x̃‖

``τ`` needs a bound on every entry of the tensor the cast scales (its groups' amax):
``|x_i| ≤ |g_i| ρ + |β_i| ≤ M``. So a side is ``A_hᵀ x̂' + c_h`` (the form every bound
already takes, with ``ρ' = (1 + u')ρ``) plus a vector in the ball of radius
``R_h = r_h + u_o P_h`` (``CastEnvelope``). For a query head ``h`` and key head ``g``, with
``N = ρ'‖A‖₂ + ‖c‖`` bounding ``‖A ᵀx̂' + c‖``, rotations ``‖R v‖ ≤ m‖v‖`` between::

    |q_h·k_g| ≤ |(A_qᵀx̂' + c_q)·(A_kᵀx̂' + c_k)| + R_q N_k + N_q R_k + R_q R_k

so every bound of the affine form (σ, norm product, relative RoPE) holds with ``ρ'`` and
gains ``s·m·(R_q N_k + N_q R_k + R_q R_k)`` (``widening``); the norm product is exactly
``(N_q + R_q)(N_k + R_k)``. An entry gains ``R_h`` (``|e_h,i| ≤ ‖e_h‖``).

The product's accumulation is taken as exact (float32, as every matmul the bounds read):
the casts are what make a low-precision linear differ from ``x Wᵀ`` by percents.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from geoscale_fx.core import spectral
from geoscale_fx.sites.linear_casts import CastEnvelope, LinearCast
from geoscale_fx.sites.terms import HeadWeights, Term

__all__ = ["side_envelope", "entry_bound", "head_norms", "widening"]


def entry_bound(gain: Optional[torch.Tensor], offset: Optional[torch.Tensor], rho
                ) -> torch.Tensor:
    """``M = max_i |g_i| ρ + |β_i|``: every entry of ``x = g ⊙ x̂ + β`` with ``‖x̂‖ ≤ ρ``
    (float64, 0-dim)."""
    rho = torch.as_tensor(rho, dtype=torch.float64)
    g = torch.ones((), dtype=torch.float64) if gain is None else gain.detach().double().abs()
    b = torch.zeros((), dtype=torch.float64) if offset is None else offset.detach().double().abs()
    return (g * rho.to(g.device) + b).amax()


def side_envelope(cast: LinearCast, w_heads: torch.Tensor, a: torch.Tensor,
                  gain: Optional[torch.Tensor], offset: Optional[torch.Tensor], rho
                  ) -> CastEnvelope:
    """The ``CastEnvelope`` of one side (module docstring): ``w_heads`` the dequantized
    weight's heads ``(n, d, d_h)``, ``a`` the folded ``A``, ``gain``/``offset`` the source's
    channel ops, ``rho`` its radius."""
    u, kappa = cast.input.relative(), cast.input.offset_factor()
    width = w_heads.shape[1]
    tau = cast.input.absolute(entry_bound(gain, offset, rho))
    w = w_heads.detach().double()
    # ‖W̃_h‖₂ ≤ ‖W̃_h‖_F: r is float32 subnormals' (and κ‖β‖'s) scale, a Gram would cost
    # as much as the bound itself
    w_norm = torch.linalg.vector_norm(w, dim=(-2, -1))                           # (n,)
    a_norms = spectral.head_spectral_norms(a.detach())
    beta_norm = torch.zeros((), dtype=torch.float64, device=w_norm.device)
    product_offset = torch.zeros_like(w_norm)
    if offset is not None:
        beta = offset.detach().double().to(w_norm.device)
        beta_norm = torch.linalg.vector_norm(beta)
        product_offset = torch.linalg.vector_norm(torch.einsum("ndj,d->nj", w, beta), dim=-1)
    r = w_norm * (kappa * beta_norm + math.sqrt(width) * tau.to(w_norm.device))
    deviation = r
    if cast.output_rounding > 0:
        rho_t = torch.as_tensor(rho, dtype=torch.float64).to(w_norm.device)
        product = (1.0 + u) * rho_t * a_norms + product_offset + r
        deviation = r + cast.output_rounding * product
    return CastEnvelope(1.0 + u, deviation, a_norms)


def head_norms(a: torch.Tensor, envelope: Optional[CastEnvelope]) -> torch.Tensor:
    """``‖A_h‖₂`` per head (float64, exact): the envelope's, else computed."""
    if envelope is not None and envelope.a_norms is not None:
        return envelope.a_norms
    return spectral.head_spectral_norms(a.detach())


def _side_norms(a: torch.Tensor, c: Optional[torch.Tensor], rho,
                envelope: Optional[CastEnvelope]) -> torch.Tensor:
    """``N_h = ρ'‖A_h‖₂ + ‖c_h‖`` per head (float64)."""
    norms = torch.as_tensor(rho, dtype=torch.float64) * head_norms(a, envelope)
    if c is not None:
        norms = norms + torch.linalg.vector_norm(c.detach().double(), dim=-1)
    return norms


def widening(term: Term, hw: HeadWeights, softmax_scale: float) -> torch.Tensor:
    """``s·(R_q N_k + N_q R_k + R_q R_k)`` per query head ``(n_q,)`` float64 (0 when
    neither side is a low-precision projection): what the casts add to any affine bound
    computed with the widened radii ``hw.radii(term)``, before the rotations' and
    per-position gains ``m`` (``term.operand_scale``) multiply it."""
    if not hw.cast:
        return torch.zeros((), dtype=torch.float64)
    rho_q, rho_k = hw.radii(term)
    n_q = _side_norms(hw.a_q, hw.c_q, rho_q, hw.cast_q)
    n_k = _side_norms(hw.a_k, hw.c_k, rho_k, hw.cast_k)
    group = n_q.shape[0] // n_k.shape[0]
    n_k = n_k.repeat_interleave(group)
    r_q = hw.cast_q.deviation if hw.cast_q is not None else torch.zeros_like(n_q)
    r_k = (hw.cast_k.deviation.repeat_interleave(group) if hw.cast_k is not None
           else torch.zeros_like(n_k))
    return abs(softmax_scale) * (r_q * n_k + n_q * r_k + r_q * r_k)
