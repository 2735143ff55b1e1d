"""Certified logit bound for rotary attention, exact over relative positions.

With RoPE, ``S_mn = s (R_m q_m)ᵀ (R_n k_n)`` and for rotary tables whose angles are linear in
the position, ``R_mᵀ R_n = m² T_δ`` depends only on ``δ = n − m`` (``T_δ`` rotates every pair
of elements by ``δ ω_i``). With thin QR factors ``A = Q R`` (``R``: d_h×d_h) the interaction is
``‖A_q T_δ A_kᵀ‖₂ = ‖R_q T_δ R_kᵀ‖₂``, so the per-δ affine bound costs O(d_h³) and the maximum
over ``δ ∈ (−L, L)`` is certified and tighter than ``‖A_q‖‖A_k‖``
(``logit_bounds.norm_product_bound``). This is ``rope_bound="relative"``.

The tables are evaluated from the graph (they must depend on constants only, as Hugging Face's
``arange`` positions do), and angle linearity ``θ_j(p) = p·θ_j(1) (mod 2π)`` is checked before
it is relied on.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from geoscale_fx.numerics.cast_envelope import widening
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.terms import HeadWeights, Term

__all__ = ["rotary_frequencies", "relative_rotations", "relative_logit_bound"]


def rotary_frequencies(cos: torch.Tensor, sin: torch.Tensor, pairing, positions: int
                       ) -> torch.Tensor:
    """``ω_j`` per element (``ω_j = ω_pairing[j]``) from tables over positions ``0..L-1``.

    Raises ValueError when the angles are not ``p·ω_j``: the relative form would not hold.
    """
    cos = cos.detach().reshape(-1, cos.shape[-1]).double()[:positions]
    sin = sin.detach().reshape(-1, sin.shape[-1]).double()[:positions]
    scale = torch.sqrt(cos ** 2 + sin ** 2)
    theta = torch.atan2(sin, cos)                                   # (L, d_h)
    omega = theta[1] if positions > 1 else torch.zeros_like(theta[0])
    p = torch.arange(cos.shape[0], dtype=torch.float64)[:, None]
    drift = torch.remainder(theta - p * omega + math.pi, 2 * math.pi) - math.pi
    if not torch.allclose(drift, torch.zeros_like(drift), atol=1e-4) or \
            not torch.allclose(scale, scale[:1].expand_as(scale), rtol=1e-5) or \
            not torch.equal(omega, omega[list(pairing)]):
        raise ValueError("rotary angles are not linear in the position (or pairs differ): "
                         "the relative-position bound does not apply")
    return omega


def relative_rotations(omega: torch.Tensor, pairing, signs: torch.Tensor,
                       deltas: torch.Tensor) -> torch.Tensor:
    """``T_δ = diag(cos δω) + diag(sin δω) Π_s`` for every δ: ``(n_δ, d_h, d_h)``.

    ``Π_s[j, pairing[j]] = signs[j]`` is the signed swap of the rotary embedding.
    """
    width = omega.shape[0]
    angles = deltas.double()[:, None] * omega[None, :]              # (n_δ, d_h)
    t = torch.diag_embed(torch.cos(angles))
    swap = torch.zeros(width, width, dtype=torch.float64)
    swap[torch.arange(width), torch.tensor(list(pairing))] = signs.double()
    return t + torch.sin(angles)[:, :, None] * swap[None]


def _upper_factor(a: torch.Tensor) -> torch.Tensor:
    """R of the thin QR of each head: ``‖A x‖ = ‖R x‖`` for all x."""
    return torch.linalg.qr(a.detach().double(), mode="r")[1]


def relative_logit_bound(site: AttentionSite, term: Term, head_weights: HeadWeights,
                         max_distance: Optional[int] = None) -> torch.Tensor:
    """Per-head ``max_δ`` of one term's affine bound with ``A_q T_δ A_kᵀ``; ``(n_q,)`` float64."""
    rq, rk = term.q.rotary, term.k.rotary
    if rq is None or rk is None or rq.partial or rk.partial or not (
            rq.pairing_verified and rk.pairing_verified) or rq.pairing != rk.pairing or \
            rq.form != "tables" or rk.form != "tables":
        raise ValueError(f"site {site.name!r}: the relative RoPE bound needs full, verified "
                         "rotary embeddings with full-width cos/sin tables on both queries and keys "
                         "(rope_bound='norm_product' covers the other forms)")
    try:
        cos, sin = site._resolve(rq.cos_node), site._resolve(rq.sin_node)
    except ValueError:
        raise ValueError(f"site {site.name!r}: the rotary tables depend on a graph input "
                         "(positions passed in), so the relative bound cannot be evaluated")
    length = max_distance or max(site.q_len, site.kv_len)
    omega = rotary_frequencies(cos, sin, rq.pairing, length)
    signs = torch.tensor(rq.signs, dtype=torch.float64)
    low = -(length - 1)
    high = 0 if site.is_causal and site.q_len == site.kv_len and not site.has_mask else length - 1
    t = relative_rotations(omega, rq.pairing, signs, torch.arange(low, high + 1))  # (n_δ,d,d)
    a_q, c_q, a_k, c_k = head_weights
    rho_q, rho_k = head_weights.radii(term)
    group = a_q.shape[0] // a_k.shape[0]
    r_q = _upper_factor(a_q)                                         # (n_q, d_h, d_h)
    r_k = _upper_factor(a_k).repeat_interleave(group, dim=0)
    m = r_q[:, None] @ t[None] @ r_k[:, None].transpose(-1, -2)      # (n_q, n_δ, d_h, d_h)
    total = rho_q * rho_k * torch.linalg.matrix_norm(m, ord=2)
    if c_k is not None:
        ck = c_k.detach().double().repeat_interleave(group, dim=0)
        total = total + rho_q * torch.linalg.vector_norm(
            r_q[:, None] @ t[None] @ ck[:, None, :, None], dim=(-2, -1))
    if c_q is not None:
        cq = c_q.detach().double()
        total = total + rho_k * torch.linalg.vector_norm(
            r_k[:, None] @ t[None].transpose(-1, -2) @ cq[:, None, :, None], dim=(-2, -1))
        if c_k is not None:
            total = total + (cq[:, None, None, :] @ t[None] @ ck[:, None, :, None]).abs()[..., 0, 0]
    gain = rq.factor * rk.factor * term.q.position_gain * term.k.position_gain
    bound = abs(site.softmax_scale) * total.amax(dim=1)
    if head_weights.cast:     # a low-precision projection's casts (``cast_envelope``)
        bound = bound + widening(term, head_weights, site.softmax_scale)
    return gain * bound
