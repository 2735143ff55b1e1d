"""Canonical per-head weights of an attention site's terms: ``(A, c)`` per head and side.

The analysis (``geoscale_fx.analysis``) describes each side of a term as a ``Side``: which
weight columns form each head, which per-channel gains and offsets follow the normalization,
which bias is added. The functions here turn that description plus the current parameter
tensors into ``(A, c)`` with ``q_h = A_hᵀ x̂ + c_h`` (``A: (n, d, d_h)``, ``c: (n, d_h)``),
the ``HeadWeights`` that the bounds on ``|S|`` (``geoscale_fx.numerics.logit_bounds``) and on q/k/v
entries (``geoscale_fx.numerics.amax``) are computed from.

They are pure and traceable: the backend calls the same code inside the compiled graph, with
``resolve`` returning graph values instead of eager tensors.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from geoscale_fx.core import spectral
from geoscale_fx.numerics.cast_envelope import side_envelope
from geoscale_fx.sites.linear_casts import CastEnvelope
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.terms import HeadWeights, Side, Term
from geoscale_fx.core.parameter_radius import evaluate_radius

__all__ = ["Resolve", "gather_heads", "gather_bias", "fold_channel_ops", "observed_heads",
           "side_heads", "side_heads_envelope", "side_radius",
           "key_head_norms", "term_head_weights",
           "site_term_weights", "site_head_weights"]

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
    the head axis and the channel axis).

    One ``amax`` over the other axes, not ``movedim(head, -1).reshape(-1, H).amax(0)``
    (the same values: a maximum is exact in any order): under torch 2.11, ``reshape`` of a
    fake tensor with a symbolic stride that can be viewed (here the moved norms, strides
    ``(.., 1, S)``) keeps one C++ reference to that stride's ``SymNode`` after the tensor
    is freed, so the ``ShapeEnv`` of every compile that traced it (the region codes'
    prefill and decode) stayed alive (``tests/test_memory.py``)."""
    head_axis, channel_axis = axes
    norms = torch.linalg.vector_norm(keys.detach().float(), dim=channel_axis)
    head_axis = head_axis % keys.dim()
    head_axis = head_axis - 1 if head_axis > channel_axis % keys.dim() else head_axis
    others = [d for d in range(norms.dim()) if d != head_axis]
    return norms.amax(dim=others) if others else norms


def side_heads(side: Side, resolve: Resolve, dtype: Optional[torch.dtype] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(A, c)`` of one side: ``A: (n, d, d_h)``, ``c: (n, d_h)`` or None. A low-precision
    projection's are those of its dequantized weight: its casts' effect is the envelope
    (``side_heads_envelope``), which every bound must add.

    ``dtype=torch.float64`` folds exactly what a certified bound needs: ``diag(g)·W`` and a
    composed weight (LoRA, ``s·B·A``) then carry no float32 rounding, and ``c = Wᵀβ + b`` is a
    float64 sum (a float32 one lands up to ~d·2⁻²⁴ relative under the true value, so a scale
    rounded up from it could still sit below the bound). Default: the weights' own dtype
    (float32 at least), what the per-step estimators iterate on."""
    a, c, _ = side_heads_envelope(side, resolve, dtype)
    return a, c


def side_heads_envelope(side: Side, resolve: Resolve, dtype: Optional[torch.dtype] = None
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[CastEnvelope]]:
    """``(A, c, envelope)``: ``side_heads`` (``dtype`` as there) and, for a side whose
    projection computes in low precision (``Side.cast``), what its casts can change
    (``cast_envelope.side_envelope``; None otherwise)."""
    if side.observed:
        return (*observed_heads(side, resolve), None)
    if side.weight is None:
        return (*_normalized_heads(side, resolve), None)
    if dtype is not None and (side.inner is not None or side.low_rank):
        resolve = _resolving_as(resolve, dtype)          # the composition rounds too
    weight = resolve(side.weight)
    if side.cast is not None:           # the weight the linear multiplies by: W̃
        weight = side.cast.weight(weight)
    if side.inner is not None:           # s·B·A
        weight = side.weight_scale * (weight @ resolve(side.inner))
    for a, b, ratio in side.low_rank:   # W + ratio·B·A (LoRA), both oriented like W
        extra = resolve(b) if a is None else resolve(b) @ resolve(a)
        weight = weight + ratio * (extra if side.layout == "linear" else extra.t())
    w_heads = gather_heads(weight, side.layout, side.features)
    if dtype is not None:                # the side's share of the weight, not all of it
        w_heads = w_heads.detach().to(dtype)
    bias = resolve(side.bias) if side.bias is not None else None
    bias_heads = gather_bias(bias, side.features, side.bias_offset)
    gain, offset = fold_channel_ops(side.source.channel_ops, resolve, side.source.width)
    if gain is not None:
        gain = gain.to(device=w_heads.device, dtype=w_heads.dtype)
    if offset is not None:
        offset = offset.to(device=w_heads.device, dtype=w_heads.dtype)
    a, c = spectral.fold_affine(w_heads, gain, offset, bias_heads)
    if side.cast is None:
        return a, c, None
    envelope = side_envelope(side.cast, w_heads, a, gain, offset, side_radius(side, resolve))
    return a, c, envelope


def _resolving_as(resolve: Resolve, dtype: torch.dtype) -> Resolve:
    def cast(name: str):
        value = resolve(name)
        return value.detach().to(dtype) if isinstance(value, torch.Tensor) else value
    return cast


def side_radius(side: Side, resolve: Resolve):
    """``ρ`` with ``‖x̂‖ ≤ ρ`` for the side's source: the fixed float of a normalized source
    (unchanged numbers), or for a source bounded by value its radius evaluated from the
    current values (float64 0-dim tensor, ``value_radius.evaluate_radius``)."""
    if side.source.bounded:
        return evaluate_radius(side.source.radius_expr, resolve)
    return side.radius


def term_head_weights(term: Term, resolve: Resolve) -> HeadWeights:
    a_q, c_q, cast_q = side_heads_envelope(term.q, resolve)
    a_k, c_k, cast_k = side_heads_envelope(term.k, resolve)
    rho_q = side_radius(term.q, resolve) if term.q.source.bounded else None
    rho_k = side_radius(term.k, resolve) if term.k.source.bounded else None
    return HeadWeights(a_q, c_q, a_k, c_k, rho_q, rho_k, cast_q, cast_k)


def site_term_weights(site: AttentionSite) -> list[HeadWeights]:
    """``HeadWeights`` of every term of ``site``, from its current parameter values."""
    site.require_values()
    return [term_head_weights(t, site._resolve) for t in site.terms]


def site_head_weights(site: AttentionSite) -> HeadWeights:
    """``(A_q, c_q, A_k, c_k)`` of a one-term site (gain/offset folded in)."""
    site.require_values()
    if len(site.terms) != 1:
        raise ValueError(f"attention site {site.name!r} has {len(site.terms)} terms; "
                         "use head_weights.site_term_weights(site)")
    return site_term_weights(site)[0]
