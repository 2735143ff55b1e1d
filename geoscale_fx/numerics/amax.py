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

What a KV cache stores is bounded the same way (``cache_write_bounds``), from the sides of
the tensors handed to ``cache.update``. An MLA layer stores ``kv_c`` after its RMSNorm,
``g ⊙ x̂`` with ``‖x̂‖ ≤ √r``: a side with ``A = diag(g)``, so every entry is at most
``|g_i|·√r ≤ ‖g‖_∞·√r`` (reached by a one-hot ``x̂``); and the rotated ``k_pe``, a pair
of projection rows per rotated pair: ``ρ‖[a_i a_p]‖₂`` as for any rotated key.
"""
from __future__ import annotations

from typing import Optional

import torch

from geoscale_fx.numerics import head_weights
from geoscale_fx.core import spectral
from geoscale_fx.sites.model import AttentionSite, CacheWrite
from geoscale_fx.sites.terms import Side

__all__ = ["side_amax", "site_amax_bounds", "cache_write_bounds"]


def side_amax(side: Side, resolve) -> torch.Tensor:
    """``(n_heads,)`` float64: bound on ``max_i |entry i|`` of each head of ``side``. A
    low-precision projection (``Side.cast``) widens ``ρ`` and adds its ball ``R_h``
    (``numerics.cast_envelope``: ``|e_h,i| ≤ ‖e_h‖ ≤ R_h``, before any rotation)."""
    if side.observed:
        raise ValueError("keys read from a cache are bounded by their actual values when the "
                         "graph runs, not from the weights")
    a, c, envelope = head_weights.side_heads_envelope(side, resolve,
                                                      dtype=torch.float64)   # exact fold
    c = None if c is None else c.detach().double()
    rho = head_weights.side_radius(side, resolve)
    extra = 0.0
    if envelope is not None:
        rho, extra = rho * envelope.radius_factor, envelope.deviation
    if side.rotary is not None and not side.pairs:     # stacked rotations: the head's norm
        norms = spectral.head_spectral_norms(a.detach().double())
        cn = torch.zeros_like(norms) if c is None else torch.linalg.vector_norm(c, dim=-1)
        bound = side.rotary.factor * (rho * norms + cn + extra)
        return bound * abs(side.operand_gain) * side.position_gain
    rows = _rows(a)                                                          # (n, d_h, d)
    if side.rotary is None:
        bound = _channel_bound(rows, c, rho).amax(dim=-1) + extra
    elif all(p >= 0 for p in side.pairs):
        bound = (_pair_bound(rows, c, rho, side.pairs) + extra) * side.rotary.factor
    else:                        # a partial rotation: rotated pairs and plain channels
        rotated = [i for i, p in enumerate(side.pairs) if p >= 0]
        plain = torch.tensor([i for i, p in enumerate(side.pairs) if p < 0], device=a.device)
        pairs = (_pair_bound(rows, c, rho, side.pairs, rotated) + extra) * side.rotary.factor
        entry = _channel_bound(rows.index_select(-2, plain),
                               None if c is None else c.index_select(-1, plain), rho)
        bound = torch.maximum(pairs, entry.amax(dim=-1) + extra)
    return bound * abs(side.operand_gain) * side.position_gain


def _rows(a: torch.Tensor) -> torch.Tensor:
    """``(n, d_h, d)`` float64: column ``a_i`` of each head as a row, a view of the float64
    fold (``side_heads(..., dtype=torch.float64)``: ``g ⊙ w`` of two float32 factors is exact
    there, and ``c`` a float64 sum), so the only roundings below are float64's (2⁻⁵³ relative
    each), far under the float32 ulp a scale is rounded up to. The fold's copy keeps the
    weight's memory order (rows are contiguous for ``nn.Linear``, strided for a
    ``Conv1D``): a transposing copy would cost more than the reductions it feeds."""
    return a.detach().transpose(-1, -2).double()


def _channel_bound(rows: torch.Tensor, c, rho: float) -> torch.Tensor:
    """``(n, d_h)``: ``ρ‖a_i‖ + |c_i|`` per channel (no rotation mixes channels)."""
    entry = rho * (rows * rows).sum(dim=-1).sqrt()      # vector_norm is slow on strided rows
    return entry if c is None else entry + c.abs()


def _pair_bound(rows, c, rho, pairs, channels: Optional[list] = None) -> torch.Tensor:
    """``(n,)``: ``max`` over the rotated pairs ``(i, p)`` of ``ρ‖[a_i a_p]‖₂ + ‖(c_i, c_p)‖``.

    ``‖[a_i a_p]‖₂² = λ_max`` of the 2×2 Gram matrix ``[[x, z], [z, y]]`` (``x = ‖a_i‖²``,
    ``y = ‖a_p‖²``, ``z = a_i·a_p``): ``(x + y)/2 + √(((x − y)/2)² + z²)``, a sum of two
    non-negative terms (no cancellation). O(n·d·d_h) and no SVD; a pair listed both ways,
    ``(i, p)`` and ``(p, i)``, is evaluated once."""
    channels = range(len(pairs)) if channels is None else channels
    listed = set(channels)
    first = [i for i in channels if not (pairs[i] < i and pairs[i] in listed
                                         and pairs[pairs[i]] == i)]
    i = torch.tensor(first, device=rows.device)
    p = torch.tensor([pairs[j] for j in first], device=rows.device)
    squares = (rows * rows).sum(dim=-1)                                      # (n, d_h)
    x, y = squares.index_select(-1, i), squares.index_select(-1, p)         # (n, m)
    z = (rows.index_select(-2, i) * rows.index_select(-2, p)).sum(dim=-1)
    norms = rho * ((x + y) / 2 + torch.sqrt(((x - y) / 2) ** 2 + z * z)).sqrt()
    if c is not None:
        norms = norms + torch.sqrt(c.index_select(-1, i) ** 2 + c.index_select(-1, p) ** 2)
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
    (``geoscale_fx.planning.qkv_scaling``). A role without a bound raises a ``ValueError`` naming the
    site and the reason (values of a post-norm block read the raw residual stream)."""
    if resolve is None:
        site.require_values()
        resolve = site._resolve
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


def cache_write_bounds(write: CacheWrite, resolve=None) -> dict[str, torch.Tensor]:
    """``{"k": (H_k,), "v": (H_v,)}`` float64 bounds on ``max |entry|`` of each stored head
    of what ``write`` stores (``H`` the stored tensors' axis 1: one for an MLA latent).
    ``resolve`` as in ``site_amax_bounds`` (default: the write's own resolver)."""
    if resolve is None:
        write.require_values()
        resolve = write._resolve
    out = {}
    for role, sides, heads in (("k", write.keys, write.key_heads),
                               ("v", write.values, write.value_heads)):
        bound = _combined(list(sides), resolve)                       # (side heads,)
        out[role] = bound.index_select(0, torch.tensor(heads, device=bound.device))
    return out
