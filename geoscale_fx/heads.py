"""Canonical per-head weights of an attention site and its certified logit bound.

The analysis (``geoscale_fx.passes``) describes each side of a site as a ``Projection``:
which weight columns form each head, which per-channel gains and offsets follow the
normalization, which bias is added. The functions here turn that description plus the
current parameter tensors into ``(A, c)`` with ``q_h = A_hᵀ x̂ + c_h`` and into the per-head
bound on ``|S|``. They are pure and traceable: the backend calls the same code inside the
compiled graph, with ``resolve`` returning graph values instead of eager tensors.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from geoscale_fx import bounds, spectral
from geoscale_fx.passes.site_model import AttentionSite, HeadWeights, Projection

__all__ = ["gather_heads", "gather_bias", "fold_channel_ops", "projection_heads",
           "site_head_weights", "site_logit_bound", "site_bound_terms", "rotation_gain",
           "norm_product_bound"]

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
    if offset is not None:
        offset = (offset if isinstance(offset, torch.Tensor)
                  else torch.tensor(float(offset))).expand(model_dim)
    return gain, offset


def projection_heads(projection: Projection, resolve: Resolve
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(A, c)`` of one side: ``A: (n, d, d_h)``, ``c: (n, d_h)`` or None."""
    weight = resolve(projection.weight)
    w_heads = gather_heads(weight, projection.layout, projection.features)
    bias = resolve(projection.bias) if projection.bias is not None else None
    bias_heads = gather_bias(bias, projection.features, projection.bias_offset)
    gain, offset = fold_channel_ops(projection.channel_ops, resolve, projection.model_dim)
    if gain is not None:
        gain = gain.to(device=w_heads.device, dtype=w_heads.dtype)
    if offset is not None:
        offset = offset.to(device=w_heads.device, dtype=w_heads.dtype)
    return spectral.fold_affine(w_heads, gain, offset, bias_heads)


def site_head_weights(site: AttentionSite, resolve: Resolve) -> HeadWeights:
    a_q, c_q = projection_heads(site.q, resolve)
    a_k, c_k = projection_heads(site.k, resolve)
    return HeadWeights(a_q, c_q, a_k, c_k)


def rotation_gain(site: AttentionSite) -> float:
    """Bound on how much the rotary embeddings scale ``|qᵀk|`` (1.0 for plain RoPE)."""
    fq = site.q.rotary.factor if site.q.rotary is not None else 1.0
    fk = site.k.rotary.factor if site.k.rotary is not None else 1.0
    return max(fq, 1.0) * max(fk, 1.0)


def site_bound_terms(site: AttentionSite, head_weights: HeadWeights,
                     sigma: Optional[torch.Tensor] = None) -> dict:
    """The pieces of the bound: σ per head and the offset terms (float64, ``(n_q,)``)."""
    a_q, c_q, a_k, c_k = head_weights
    if sigma is None:
        sigma = spectral.per_head_sigma_exact(a_q, a_k)
    aq_ck, ak_cq, cq_ck = spectral.bias_terms(a_q, c_q, a_k, c_k)
    return {"sigma": sigma, "aq_ck": aq_ck, "ak_cq": ak_cq, "cq_ck": cq_ck}


def site_logit_bound(site: AttentionSite, head_weights: HeadWeights,
                     rope_bound: Optional[str] = None,
                     sigma: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-head bound on ``|S|`` for the site's softmax scale, ``(n_q,)`` float64.

    Without RoPE (or with the paper's ``"interaction"`` option) this is
    ``bounds.affine_logit_bound`` with ``σ_h = ‖A_q,h A_k,g(h)ᵀ‖₂`` (``sigma`` may be passed in,
    e.g. a power-iteration estimate). With RoPE the default is the certified
    ``bounds.norm_product_logit_bound``; ``"relative"`` maximizes over relative positions.
    """
    rope_bound = rope_bound or site.rope_bound
    scale = abs(site.softmax_scale)
    if site.rope and rope_bound == "norm_product":
        return norm_product_bound(site, head_weights,
                                  spectral.head_spectral_norms(head_weights.a_q),
                                  spectral.head_spectral_norms(head_weights.a_k))
    if site.rope and rope_bound == "relative":
        from geoscale_fx import rope

        return rope.relative_logit_bound(site, head_weights)
    terms = site_bound_terms(site, head_weights, sigma)
    bound = bounds.affine_logit_bound(terms["sigma"], terms["aq_ck"], terms["ak_cq"],
                                      terms["cq_ck"], radius_q=site.q.radius,
                                      radius_k=site.k.radius, softmax_scale=scale)
    return bound * rotation_gain(site) if site.rope else bound


def norm_product_bound(site: AttentionSite, head_weights: HeadWeights, aq_norm: torch.Tensor,
                       ak_norm: torch.Tensor) -> torch.Tensor:
    """Certified RoPE bound from per-head ``‖A_q,h‖`` (n_q,) and ``‖A_k,g‖`` (n_kv,)."""
    _, c_q, _, c_k = head_weights
    group = aq_norm.shape[0] // ak_norm.shape[0]
    ak_norm = ak_norm.repeat_interleave(group)
    zeros = aq_norm.new_zeros(aq_norm.shape, dtype=torch.float64)
    cq_norm = zeros if c_q is None else torch.linalg.vector_norm(c_q.double(), dim=-1)
    ck_norm = zeros if c_k is None else torch.linalg.vector_norm(
        c_k.double(), dim=-1).repeat_interleave(group)
    return bounds.norm_product_logit_bound(aq_norm, ak_norm, cq_norm, ck_norm,
                                           radius_q=site.q.radius, radius_k=site.k.radius,
                                           softmax_scale=abs(site.softmax_scale),
                                           rotation_gain=rotation_gain(site))
