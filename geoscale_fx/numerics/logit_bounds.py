"""The certified bound on an attention site's logits, from its per-head weights.

Per term, from the ``HeadWeights`` of ``geoscale_fx.numerics.head_weights``: the affine bound of
``σ_h = ‖A_q,h A_k,g(h)ᵀ‖₂`` (``sigma_bound``), with RoPE the norm product
``‖A_q,h‖‖A_k,g(h)‖`` (``norm_product_bound``) or the maximum over relative positions
(``geoscale_fx.numerics.relative_rope_bound``); for the site, the terms' sum pushed through the score
modifiers::

    bound(S) = modifiers( Σ_t bound_t )

They are pure and traceable: the backend calls the same code inside the compiled graph, with
``resolve`` returning graph values instead of eager tensors.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from geoscale_fx.numerics import relative_rope_bound
from geoscale_fx.numerics.cast_envelope import head_norms, widening
from geoscale_fx.core import bounds, spectral
from geoscale_fx.numerics.head_weights import Resolve, site_term_weights
from geoscale_fx.sites.model import ROPE_BOUNDS, AttentionSite
from geoscale_fx.sites.terms import HeadWeights, Modifier, Term

__all__ = ["sigma_bound", "norm_product_bound", "term_logit_bound", "apply_modifiers",
           "site_logit_bound"]


# --------------------------------------------------------------------------------------
# One term
# --------------------------------------------------------------------------------------

def sigma_bound(term: Term, head_weights: HeadWeights, sigma: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """``bounds.affine_logit_bound`` of a term from ``σ`` per head (or per layer, (1,)).

    With RoPE this is the paper's position-independent interaction bound times the rotation
    gain: an assumption, not a proof (the caller marks the site uncertified). A
    low-precision projection's casts widen the radii (``hw.radii``) and add their
    ``cast_envelope.widening``.
    """
    a_q, c_q, a_k, c_k = head_weights
    rho_q, rho_k = head_weights.radii(term)
    aq_ck, ak_cq, cq_ck = spectral.bias_terms(a_q, c_q, a_k, c_k)
    if sigma.shape[0] == 1 and aq_ck.shape[0] != 1:  # per layer: the worst head's offsets
        offsets = (rho_q * aq_ck + rho_k * ak_cq + cq_ck.abs()).amax()
        bound = abs(softmax_scale) * (rho_q * rho_k * sigma.double() + offsets).reshape(1)
    else:
        bound = bounds.affine_logit_bound(sigma, aq_ck, ak_cq, cq_ck, radius_q=rho_q,
                                          radius_k=rho_k, softmax_scale=abs(softmax_scale))
    if head_weights.cast:
        extra = widening(term, head_weights, softmax_scale)
        bound = bound + (extra.amax().reshape(1) if bound.shape[0] == 1 else extra)
    return bound * term.operand_scale


def norm_product_bound(term: Term, head_weights: HeadWeights, aq_norm: torch.Tensor,
                       ak_norm: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Certified RoPE bound from per-head ``‖A_q,h‖`` (n_q,) and ``‖A_k,g‖`` (n_kv,). A
    low-precision projection's ball ``R_h`` around ``c_h`` adds to ``‖c_h‖``
    (``cast_envelope``: the product is then ``(N_q + R_q)(N_k + R_k)``)."""
    _, c_q, _, c_k = head_weights
    rho_q, rho_k = head_weights.radii(term)
    group = aq_norm.shape[0] // ak_norm.shape[0]
    cq_norm = aq_norm.new_zeros(aq_norm.shape, dtype=torch.float64) if c_q is None else \
        torch.linalg.vector_norm(c_q.double(), dim=-1)
    ck_norm = ak_norm.new_zeros(ak_norm.shape, dtype=torch.float64) if c_k is None else \
        torch.linalg.vector_norm(c_k.double(), dim=-1)
    if head_weights.cast_q is not None:
        cq_norm = cq_norm + head_weights.cast_q.deviation
    if head_weights.cast_k is not None:
        ck_norm = ck_norm + head_weights.cast_k.deviation
    ak_norm, ck_norm = ak_norm.repeat_interleave(group), ck_norm.repeat_interleave(group)
    return bounds.norm_product_logit_bound(aq_norm, ak_norm, cq_norm, ck_norm,
                                           radius_q=rho_q, radius_k=rho_k,
                                           softmax_scale=abs(softmax_scale),
                                           rotation_gain=term.operand_scale)


def term_logit_bound(site: AttentionSite, term: Term, head_weights: HeadWeights,
                     rope_bound: str) -> torch.Tensor:
    """Exact per-head bound on one term's contribution to ``|S|``, ``(n_q,)`` float64.

    Without RoPE (or with the paper's ``"interaction"``): ``σ_h = ‖A_q,h A_k,g(h)ᵀ‖₂``
    exactly. With RoPE the default is the certified norm-product bound; ``"relative"``
    maximizes over relative positions.
    """
    if term.rope and rope_bound == "norm_product":
        return norm_product_bound(term, head_weights,
                                  head_norms(head_weights.a_q, head_weights.cast_q),
                                  head_norms(head_weights.a_k, head_weights.cast_k),
                                  site.softmax_scale)
    if term.rope and rope_bound == "relative":
        return relative_rope_bound.relative_logit_bound(site, term, head_weights)
    sigma = spectral.per_head_sigma_exact(head_weights.a_q, head_weights.a_k)
    return sigma_bound(term, head_weights, sigma, site.softmax_scale)


# --------------------------------------------------------------------------------------
# The site: sum of terms, then modifiers
# --------------------------------------------------------------------------------------

def apply_modifiers(bound: torch.Tensor, modifiers: Sequence[Modifier],
                    resolve: Optional[Resolve] = None) -> torch.Tensor:
    """Push a bound on ``|Σ_t S_t|`` through the ops before the softmax (graph order): each
    modifier's ``transform`` (its kind's module in ``geoscale_fx.analysis.modifiers``), e.g.

    * mask, position bias: applied after the quantization, so they leave the bound as is —
      unless a softcap follows, which then sees ``S + bias`` (unbounded) and caps it;
    * softcap ``c·tanh(S/c)``: odd and increasing, ``|c·tanh(S/c)| ≤ min(|S|, c)``;
    * sink: the softmax also receives the sink logits: ``max(bound, max|sink|)`` — for a
      sink computed from the activations, ``max_f ρ‖A_f‖ + |c_f|`` of its ``Side``.
    """
    for i, modifier in enumerate(modifiers):
        bound = modifier.transform(bound, modifiers[i + 1:], resolve)
    return bound


def site_logit_bound(site: AttentionSite, rope_bound: Optional[str] = None,
                     term_weights: Optional[Sequence[HeadWeights]] = None) -> torch.Tensor:
    """Per-head bound on what the softmax receives, ``(n_q,)`` float64 (exact routes), from
    the site's current parameter values (``term_weights``: already computed ones).
    ``rope_bound`` overrides the site's (``site_model.ROPE_BOUNDS``)."""
    rope_bound = rope_bound or site.rope_bound
    if rope_bound not in ROPE_BOUNDS:
        raise ValueError(f"rope_bound must be one of {ROPE_BOUNDS}, got {rope_bound!r}")
    site.require_values()
    if site.bound_by == "measured":
        raise ValueError(f"attention site {site.name!r} is bounded by its q and k measured at "
                         "every call (the weights cannot bound it: "
                         f"{site.unbounded_reason}); it has no bound before the call")
    if term_weights is None:
        term_weights = site_term_weights(site)
    total = sum(term_logit_bound(site, term, hw, rope_bound)
                for term, hw in zip(site.terms, term_weights))
    return apply_modifiers(total, site.modifiers, site._resolve)
