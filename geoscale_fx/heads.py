"""Canonical per-head weights of an attention site's terms and its certified logit bound.

The analysis (``geoscale_fx.passes``) describes each side of a term as a ``Side``: which
weight columns form each head, which per-channel gains and offsets follow the normalization,
which bias is added. The functions here turn that description plus the current parameter
tensors into ``(A, c)`` with ``q_h = A_hᵀ x̂ + c_h`` and into per-head bounds on ``|S|``:

    bound(S) = modifiers( Σ_t bound_t )

They are pure and traceable: the backend calls the same code inside the compiled graph, with
``resolve`` returning graph values instead of eager tensors.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from geoscale_fx import bounds, rope, spectral
from geoscale_fx.site_model import (
    ROPE_BOUNDS, AttentionSite, HeadWeights, Modifier, Side, Term,
)

__all__ = ["gather_heads", "gather_bias", "fold_channel_ops", "side_heads", "key_head_norms",
           "term_head_weights", "site_term_weights", "site_head_weights", "sigma_bound",
           "norm_product_bound", "term_logit_bound", "apply_modifiers", "site_logit_bound"]

Resolve = Callable[[str], torch.Tensor]


def _flat_features(features: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    flat = [f for row in features for f in row]
    contiguous = flat == list(range(flat[0], flat[0] + len(flat)))
    return flat, contiguous


def gather_heads(weight: torch.Tensor, layout: str,
                 features: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(n_heads, d, d_h)`` columns ``features[h]`` of the (d, F)-oriented weight.

    A contiguous block of features (the usual layout) is a view; any other layout (per-head
    interleaved fused QKV, …) is an ``index_select``.
    """
    n = len(features)
    flat, contiguous = _flat_features(features)
    dim = 0 if layout == "linear" else 1
    if contiguous:
        block = weight.narrow(dim, flat[0], len(flat))
    else:
        block = weight.index_select(dim, torch.tensor(flat, device=weight.device))
    return spectral.split_heads(block, n, layout)


def gather_bias(bias: Optional[torch.Tensor], features: Sequence[Sequence[int]],
                offset: int = 0) -> Optional[torch.Tensor]:
    """``(n_heads, d_h)`` entries of a (F,) bias, or None."""
    if bias is None:
        return None
    n = len(features)
    flat, contiguous = _flat_features(features)
    if contiguous:
        picked = bias.narrow(0, flat[0] + offset, len(flat))
    else:
        picked = bias.index_select(0, torch.tensor([f + offset for f in flat],
                                                   device=bias.device))
    return picked.reshape(n, -1)


def fold_channel_ops(channel_ops, resolve: Resolve, model_dim: int
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Compose per-channel ``("mul" | "add", value)`` ops on x̂ into ``x = gain ⊙ x̂ + offset``."""
    gain = offset = None
    for kind, value in channel_ops:
        t = resolve(value) if isinstance(value, str) else value
        if isinstance(t, torch.Tensor):
            t = t.reshape(-1)
        if kind == "mul":
            gain = t if gain is None else gain * t
            offset = None if offset is None else offset * t
        else:
            offset = t if offset is None else offset + t
    if gain is not None and not isinstance(gain, torch.Tensor):
        gain = torch.full((model_dim,), float(gain))
    elif gain is not None and gain.numel() == 1:
        gain = gain.expand(model_dim)
    if offset is not None:
        offset = (offset if isinstance(offset, torch.Tensor)
                  else torch.tensor(float(offset))).expand(model_dim)
    return gain, offset


def _normalized_heads(side: Side, resolve: Resolve
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(A, c)`` of a side made of a QK-norm: ``A_h = diag(gain_h)`` (n, d_h, d_h).

    Why this is a certified bound. The norm's output row ``x̂`` (width W: d_h per head, or
    the whole projection) has ``‖x̂‖ ≤ √W`` (RMSNorm: ``√W·x/√(‖x‖² + Wε)``; LayerNorm: the
    same for the centered vector), so head h's channels ``x̂_h`` satisfy ``‖x̂_h‖ ≤ √W``. The
    operand is ``q_h = g_h ⊙ x̂_h + β_h = A_hᵀ x̂_h + c_h``. For query head h and key head g:

        |S| = s·|q_hᵀ k_g| ≤ s·(|x̂_qᵀ A_q A_kᵀ x̂_k| + |x̂_qᵀ A_q c_k| + |c_qᵀ A_kᵀ x̂_k| + |c_q·c_k|)
            ≤ s·(ρ_q ρ_k ‖A_q A_kᵀ‖₂ + ρ_q ‖A_q c_k‖ + ρ_k ‖A_k c_q‖ + |c_q·c_k|)

    (Cauchy–Schwarz), which is ``bounds.affine_logit_bound`` with
    ``‖A_q A_kᵀ‖₂ = ‖diag(g_q ⊙ g_k)‖₂ = max_i |g_q,i g_k,i|``: without offsets,
    ``s·W·max_i|g_q,i g_k,i|``, attained by an RMSNorm output concentrated on the channel
    that maximizes it (``x = e_i``), so it is tight. A rotation R after the norm (RoPE)
    keeps ``‖R(g ⊙ x̂ + β)‖ = ‖g ⊙ x̂ + β‖ ≤ ρ·max|g| + ‖β‖``, and the norm-product bound
    ``s·(ρ max|g_q| + ‖β_q‖)(ρ max|g_k| + ‖β_k‖)`` follows (``‖A_h‖₂ = max|g_h|``).
    """
    index = torch.tensor([[side.source.channel_index[f] for f in row] for row in side.features])
    gain, offset = fold_channel_ops(side.source.channel_ops, resolve, side.source.width)
    if gain is None:
        a = torch.eye(side.head_dim).expand(side.n_heads, -1, -1)
    else:
        a = torch.diag_embed(gain.index_select(0, index.reshape(-1).to(gain.device))
                             .reshape(index.shape))
    c = None
    if offset is not None:
        c = offset.index_select(0, index.reshape(-1).to(offset.device)).reshape(index.shape)
        c = c.to(a.dtype)
    return a, c


def observed_heads(side: Side, resolve: Resolve) -> tuple[torch.Tensor, None]:
    """``A: (n, 1, 1)`` holding ``max_j ‖k_g,j‖`` per key head g of the observed keys (over
    batch and positions), so that ``‖A_g‖₂`` is that norm and ``ρ = 1``: every key the
    attention reads, cached or new, satisfies ``‖k‖ ≤ ‖A_g‖``. For incremental keys
    (``Side.incremental``) only this call's new keys are measured (the estimator adds the
    running maximum of the earlier ones). Zeros before the keys exist (a cold start on the
    host evaluates parameters only) or when no new key is written."""
    n = side.n_heads
    sources = side.observed_fresh if side.incremental else ((side.source.node, 1),)
    out = torch.zeros(n)
    for name, repeat in sources:
        keys = resolve(name)
        if not isinstance(keys, torch.Tensor):
            return torch.zeros(n, 1, 1), None
        norms = key_head_norms(keys, side.observed_axes)
        norms = norms.repeat_interleave(repeat) if repeat > 1 else norms
        out = torch.maximum(out.to(keys.device), norms)
    return out.reshape(n, 1, 1), None


def key_head_norms(keys: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
    """``(H,)`` float32: ``max ‖k‖`` per head of ``keys`` over every other axis (``axes``:
    the head axis and the channel axis)."""
    head_axis, channel_axis = axes
    norms = torch.linalg.vector_norm(keys.detach().float(), dim=channel_axis)
    head_axis = head_axis % keys.dim()
    head_axis = head_axis - 1 if head_axis > channel_axis % keys.dim() else head_axis
    return norms.movedim(head_axis, -1).reshape(-1, norms.shape[head_axis]).amax(dim=0)


def side_heads(side: Side, resolve: Resolve) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(A, c)`` of one side: ``A: (n, d, d_h)``, ``c: (n, d_h)`` or None."""
    if side.observed:
        return observed_heads(side, resolve)
    if side.weight is None:
        return _normalized_heads(side, resolve)
    weight = resolve(side.weight)
    if side.inner is not None:           # s·B·A
        weight = side.weight_scale * (weight @ resolve(side.inner))
    for a, b, ratio in side.low_rank:   # W + ratio·B·A (LoRA), both oriented like W
        extra = resolve(b) if a is None else resolve(b) @ resolve(a)
        weight = weight + ratio * (extra if side.layout == "linear" else extra.t())
    w_heads = gather_heads(weight, side.layout, side.features)
    bias = resolve(side.bias) if side.bias is not None else None
    bias_heads = gather_bias(bias, side.features, side.bias_offset)
    gain, offset = fold_channel_ops(side.source.channel_ops, resolve, side.source.width)
    if gain is not None:
        gain = gain.to(device=w_heads.device, dtype=w_heads.dtype)
    if offset is not None:
        offset = offset.to(device=w_heads.device, dtype=w_heads.dtype)
    return spectral.fold_affine(w_heads, gain, offset, bias_heads)


def term_head_weights(term: Term, resolve: Resolve) -> HeadWeights:
    a_q, c_q = side_heads(term.q, resolve)
    a_k, c_k = side_heads(term.k, resolve)
    return HeadWeights(a_q, c_q, a_k, c_k)


def site_term_weights(site: AttentionSite) -> list[HeadWeights]:
    """``HeadWeights`` of every term of ``site``, from its current parameter values."""
    site.require_values()
    return [term_head_weights(t, site._resolve) for t in site.terms]


def site_head_weights(site: AttentionSite) -> HeadWeights:
    """``(A_q, c_q, A_k, c_k)`` of a one-term site (gain/offset folded in)."""
    site.require_values()
    if len(site.terms) != 1:
        raise ValueError(f"attention site {site.name!r} has {len(site.terms)} terms; "
                         "use heads.site_term_weights(site)")
    return site_term_weights(site)[0]


# --------------------------------------------------------------------------------------
# One term
# --------------------------------------------------------------------------------------

def sigma_bound(term: Term, head_weights: HeadWeights, sigma: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """``bounds.affine_logit_bound`` of a term from ``σ`` per head (or per layer, (1,)).

    With RoPE this is the paper's position-independent interaction bound times the rotation
    gain: an assumption, not a proof (the caller marks the site uncertified).
    """
    a_q, c_q, a_k, c_k = head_weights
    aq_ck, ak_cq, cq_ck = spectral.bias_terms(a_q, c_q, a_k, c_k)
    if sigma.shape[0] == 1 and aq_ck.shape[0] != 1:  # per layer: the worst head's offsets
        offsets = (term.q.radius * aq_ck + term.k.radius * ak_cq + cq_ck.abs()).amax()
        bound = abs(softmax_scale) * (term.q.radius * term.k.radius * sigma.double()
                                      + offsets).reshape(1)
    else:
        bound = bounds.affine_logit_bound(sigma, aq_ck, ak_cq, cq_ck, radius_q=term.q.radius,
                                          radius_k=term.k.radius,
                                          softmax_scale=abs(softmax_scale))
    return bound * term.operand_scale


def norm_product_bound(term: Term, head_weights: HeadWeights, aq_norm: torch.Tensor,
                       ak_norm: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Certified RoPE bound from per-head ``‖A_q,h‖`` (n_q,) and ``‖A_k,g‖`` (n_kv,)."""
    _, c_q, _, c_k = head_weights
    group = aq_norm.shape[0] // ak_norm.shape[0]
    ak_norm = ak_norm.repeat_interleave(group)
    zeros = aq_norm.new_zeros(aq_norm.shape, dtype=torch.float64)
    cq_norm = zeros if c_q is None else torch.linalg.vector_norm(c_q.double(), dim=-1)
    ck_norm = zeros if c_k is None else torch.linalg.vector_norm(
        c_k.double(), dim=-1).repeat_interleave(group)
    return bounds.norm_product_logit_bound(aq_norm, ak_norm, cq_norm, ck_norm,
                                           radius_q=term.q.radius, radius_k=term.k.radius,
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
                                  spectral.head_spectral_norms(head_weights.a_q),
                                  spectral.head_spectral_norms(head_weights.a_k),
                                  site.softmax_scale)
    if term.rope and rope_bound == "relative":
        return rope.relative_logit_bound(site, term, head_weights)
    sigma = spectral.per_head_sigma_exact(head_weights.a_q, head_weights.a_k)
    return sigma_bound(term, head_weights, sigma, site.softmax_scale)


# --------------------------------------------------------------------------------------
# The site: sum of terms, then modifiers
# --------------------------------------------------------------------------------------

def apply_modifiers(bound: torch.Tensor, modifiers: Sequence[Modifier],
                    resolve: Optional[Resolve] = None) -> torch.Tensor:
    """Push a bound on ``|Σ_t S_t|`` through the ops before the softmax (graph order).

    * mask, position bias: applied after the quantization, so they leave the bound as is —
      unless a softcap follows, which then sees ``S + bias`` (unbounded) and caps it;
    * softcap ``c·tanh(S/c)``: odd and increasing, ``|c·tanh(S/c)| ≤ min(|S|, c)``;
    * sink: the softmax also receives the sink logits: ``max(bound, max|sink|)``.
    """
    kinds = [m.kind for m in modifiers]
    for i, modifier in enumerate(modifiers):
        if modifier.kind in ("mask", "position_bias") and "softcap" in kinds[i + 1:]:
            bound = torch.full_like(bound, float("inf"))
        elif modifier.kind == "softcap":
            bound = torch.clamp(bound, max=abs(modifier.value))
        elif modifier.kind == "sink":
            sink = resolve(modifier.param).detach().abs().amax().to(bound.dtype)
            bound = torch.maximum(bound, sink.to(bound.device))
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
    if term_weights is None:
        term_weights = site_term_weights(site)
    total = sum(term_logit_bound(site, term, hw, rope_bound)
                for term, hw in zip(site.terms, term_weights))
    return apply_modifiers(total, site.modifiers, site._resolve)
