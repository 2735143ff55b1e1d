"""Certified bounds on the entries of q, k and v: the scales FP8 Q/K/V kernels need.

FlashAttention-3, cuDNN and TransformerEngine quantize Q, K and V (not S), and serving
engines keep the KV cache in FP8 with ``k_scale``/``v_scale``. The same provenance that
bounds the logits bounds every entry of these tensors, from the weights alone.

**Proof.** A side's head vector is ``q_h = A_hᵀ x̂ + c_h`` with ``‖x̂‖ ≤ ρ`` (its normalized
source), so each entry obeys ``|q_h,i| = |a_iᵀ x̂ + c_i| ≤ ρ‖a_i‖ + |c_i|`` (Cauchy–Schwarz,
``a_i`` the i-th column of ``A_h``). A rotary embedding mixes channel pairs ``(i, p)``: the
rotated entry is ``α q_i + β q_p`` with ``α² + β² ≤ m²`` (``m`` the rotation's gain, 1 for
RoPE), so ``|(R q)_i| ≤ m‖(q_i, q_p)‖ ≤ m(ρ‖[a_i a_p]‖₂ + ‖(c_i, c_p)‖)`` — the pair's
spectral norm. When the pairing is not known per channel (stacked rotations), an entry is at
most the vector's norm: ``m(ρ‖A_h‖₂ + ‖c_h‖)``. A per-position multiplier ``t`` scales by
``max|t|``, the operand's scalar gain by ``|g|``. Sides that are maps of different inputs
added together (LoRA under adapter dropout) add their bounds; parts of the head from
different projections (MLA) take each part's own. After a QK-norm ``A_h = diag(g)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from geoscale_fx import heads, spectral
from geoscale_fx.passes.site_model import AttentionSite, Side

__all__ = ["side_amax", "site_amax_bounds"]


def side_amax(side: Side, resolve) -> torch.Tensor:
    """``(n_heads,)`` float64: bound on ``max_i |entry i|`` of each head of ``side``."""
    if side.observed:
        raise ValueError("keys read from a cache are bounded by their actual values when the "
                         "graph runs, not from the weights")
    a, c = heads.side_heads(side, resolve)
    a = a.detach().double()
    c = None if c is None else c.detach().double()
    rho = side.radius
    if side.rotary is None:
        entry = rho * torch.linalg.vector_norm(a, dim=-2)                     # (n, d_h)
        if c is not None:
            entry = entry + c.abs()
        bound = entry.amax(dim=-1)
    elif side.pairs and all(p >= 0 for p in side.pairs):
        bound = _pair_bound(a, c, rho, side.pairs) * side.rotary.factor
    elif side.pairs:             # a partial rotation: rotated pairs and plain channels
        rotated = [i for i, p in enumerate(side.pairs) if p >= 0]
        plain = [i for i, p in enumerate(side.pairs) if p < 0]
        pairs = _pair_bound(a, c, rho, side.pairs, rotated) * side.rotary.factor
        entry = rho * torch.linalg.vector_norm(a[..., plain], dim=-2)
        if c is not None:
            entry = entry + c[..., plain].abs()
        bound = torch.maximum(pairs, entry.amax(dim=-1))
    else:
        norms = spectral.head_spectral_norms(a)
        cn = torch.zeros_like(norms) if c is None else torch.linalg.vector_norm(c, dim=-1)
        bound = side.rotary.factor * (rho * norms + cn)
    return bound * abs(side.operand_gain) * side.position_gain


def _pair_bound(a, c, rho, pairs, channels: Optional[list] = None) -> torch.Tensor:
    channels = range(len(pairs)) if channels is None else channels
    index = torch.tensor([[i, pairs[i]] for i in channels], device=a.device)  # (m, 2)
    block = a[:, :, index]                                                   # (n, d, m, 2)
    norms = torch.linalg.matrix_norm(block.permute(0, 2, 1, 3), ord=2)       # (n, m)
    if c is not None:
        norms = norms * rho + torch.linalg.vector_norm(c[:, index], dim=-1)
    else:
        norms = norms * rho
    return norms.amax(dim=-1)


def _combined(sides: list[Side], resolve) -> torch.Tensor:
    """Sides of one operand: same features add (maps of different inputs), different
    features (parts of the head vector) take the max."""
    groups: dict[tuple, torch.Tensor] = {}
    seen: list[Side] = []
    for side in sides:
        if side in seen:
            continue
        seen.append(side)
        bound = side_amax(side, resolve)
        key = (side.features, side.rotary)
        groups[key] = groups[key] + bound if key in groups else bound
    return torch.stack(list(groups.values())).amax(dim=0)


def site_amax_bounds(site: AttentionSite, resolve=None, roles: str = "qkv"
                     ) -> dict[str, torch.Tensor]:
    """``{"q": (n_q,), "k": (n_kv,), "v": (n_kv,)}`` float64 bounds on ``max |entry|`` per
    head (the ``roles`` asked for). ``resolve`` maps the site's node names to tensors
    (default: the site's own resolver, i.e. the current parameters); the math is traceable,
    so the backend evaluates it inside the compiled graph on the weight nodes
    (``geoscale_fx.qkv_scaling``). A role without a bound raises a ``ValueError`` naming the
    site and the reason (values of a post-norm block read the raw residual stream)."""
    resolve = site._resolve if resolve is None else resolve
    out = {}
    for role in "qk":
        if role in roles:
            out[role] = _combined([t.q if role == "q" else t.k for t in site.terms], resolve)
    if "v" not in roles:
        return out
    if site.value is None:
        raise ValueError(f"attention site {site.name!r}: the values could not be traced to "
                         f"their projection ({site.value_reason}), so v has no bound")
    out["v"] = side_amax(site.value, resolve)
    return out
