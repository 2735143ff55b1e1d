"""Spectral norms of the query–key interaction, without forming any d×d matrix.

Canonical orientation (what the FX analysis produces for every site)::

    a_q : (n_q, d_q, d_h)    per query head, q_h = a_q[h]ᵀ x̂ + c_q[h]
    a_k : (n_kv, d_k, d_h)   per key head,   k_g = a_k[g]ᵀ x̂ + c_k[g]

Query head ``h`` reads key head ``h // (n_q // n_kv)`` (MHA: n_kv = n_q, MQA: n_kv = 1).
``σ_h = ‖a_q[h] a_k[h // g]ᵀ‖₂`` is the per-head interaction norm (our default: it bounds
each head's logits); ``σ_layer = ‖Σ_h a_q[h] a_k[h // g]ᵀ‖₂`` is the paper's per-layer
norm of the concatenated ``W^Q W^Kᵀ`` (kept for reproduction; it is not a bound on any
head, heads can cancel).

Estimators:

* ``*_power_step``: power iteration on persistent vectors ``u`` (left) and ``v`` (right),
  updated in place, ``iters`` steps, O(n · d · d_h) each. The estimate is a *lower* bound.
* ``per_head_sigma_exact``: ``σ² = λ_max(G_Q G_K)`` with the d_h×d_h Gram matrices
  ``G = aᵀa``, evaluated as the largest eigenvalue of ``G_K^½ G_Q G_K^½`` in float64;
  O(n · d · d_h²), certified up to float64 rounding.

The default estimator's certified *upper* bounds without an eigensolver (Schatten norms by
repeated squaring) are in ``geoscale_fx.core.schatten``.

GQA never expands ``a_k``: key-side products are einsums whose group axis is a free axis.
Everything here is traceable (no ``.item()``, no branching on values), detaches its weight
inputs (scales are not differentiated) and accumulates in float32 or float64.

Example::

    >>> import torch
    >>> from geoscale_fx import spectral
    >>> a_q, a_k = torch.randn(8, 256, 32), torch.randn(2, 256, 32)     # GQA 4:1
    >>> exact = spectral.per_head_sigma_exact(a_q, a_k)                  # (8,)
    >>> u, v = spectral.init_power_state(8, 256, 256)
    >>> approx = spectral.per_head_power_step(a_q, a_k, u, v, iters=30)  # u, v updated
    >>> bool(((approx - exact).abs() / exact).max() < 1e-3)
    True
"""
from __future__ import annotations

import torch

__all__ = [
    "split_heads",
    "fold_affine",
    "init_power_state",
    "per_head_power_step",
    "per_head_sigma_exact",
    "per_layer_power_step",
    "per_layer_sigma_exact",
    "head_spectral_norms",
    "head_norm_power_step",
    "bias_terms",
]

_NORM_FLOOR = 1e-30


def _group_size(a_q: torch.Tensor, a_k: torch.Tensor) -> int:
    n_q, n_kv = a_q.shape[0], a_k.shape[0]
    if a_q.dim() != 3 or a_k.dim() != 3:
        raise ValueError(f"a_q and a_k must be (n_heads, d, d_h), got {tuple(a_q.shape)} and "
                         f"{tuple(a_k.shape)}")
    if n_q % n_kv != 0:
        raise ValueError(f"n_q={n_q} query heads cannot share n_kv={n_kv} key heads evenly")
    if a_q.shape[-1] != a_k.shape[-1]:
        raise ValueError(f"head_dim differs: a_q has {a_q.shape[-1]}, a_k has {a_k.shape[-1]}")
    return n_q // n_kv


def _accumulate(a: torch.Tensor) -> torch.Tensor:
    a = a.detach()
    return a if a.dtype in (torch.float32, torch.float64) else a.float()


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(_NORM_FLOOR)


# --------------------------------------------------------------------------------------
# Orientation helpers
# --------------------------------------------------------------------------------------

def split_heads(weight: torch.Tensor, n_heads: int, layout: str = "linear") -> torch.Tensor:
    """Per-head ``(n_heads, d, d_h)`` view of a projection weight.

    ``layout="linear"``: ``nn.Linear`` weight ``(n_heads·d_h, d)`` (``q = x Wᵀ``);
    ``layout="dense"``: ``(d, n_heads·d_h)`` (GPT-2 Conv1D, ``q = x W``). No copy is made.
    """
    if layout == "linear":
        out_features, d = weight.shape
        return weight.view(n_heads, out_features // n_heads, d).transpose(1, 2)
    if layout == "dense":
        d, out_features = weight.shape
        return weight.view(d, n_heads, out_features // n_heads).permute(1, 0, 2)
    raise ValueError(f"layout must be 'linear' or 'dense', got {layout!r}")


def fold_affine(w_heads: torch.Tensor, gain: torch.Tensor | None = None,
                offset: torch.Tensor | None = None, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold a normalization's gain/offset and a projection bias into ``(A, c)``.

    With ``x = g ⊙ x̂ + β`` and ``q_h = W_hᵀ x + b_h`` (``W_h``: ``(d, d_h)``)::

        A_h = diag(g) W_h      c_h = W_hᵀ β + b_h       so  q_h = A_hᵀ x̂ + c_h

    ``w_heads``: (n, d, d_h); ``gain``/``offset``: (d,); ``bias``: (n, d_h). ``c`` is None
    when there is neither offset nor bias. Computed in float32 at least: ``g·W`` of two
    bf16 factors is then exact (a bf16 product would round it by up to 2⁻⁸, under
    ``MixedPrecisionPolicy(param_dtype=bfloat16)`` for instance).
    """
    w_heads = _accumulate(w_heads)
    a = w_heads if gain is None else gain.to(w_heads.dtype).reshape(1, -1, 1) * w_heads
    c = None
    if offset is not None:
        c = torch.einsum("ndj,d->nj", w_heads, offset.to(w_heads.dtype))
    if bias is not None:
        bias = bias.to(w_heads.dtype)
        c = bias if c is None else c + bias
    return a, c


# --------------------------------------------------------------------------------------
# Power iteration
# --------------------------------------------------------------------------------------

def init_power_state(n: int, d_q: int, d_k: int, *, generator: torch.Generator | None = None,
                     device: torch.device | str | None = None,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random unit vectors ``u: (n, d_q)`` and ``v: (n, d_k)`` (n = heads, or 1 per layer)."""
    u = torch.randn(n, d_q, generator=generator, dtype=dtype)
    v = torch.randn(n, d_k, generator=generator, dtype=dtype)
    return _unit(u).to(device), _unit(v).to(device)


def per_head_power_step(a_q: torch.Tensor, a_k: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                        iters: int = 1) -> torch.Tensor:
    """``iters`` power iterations per query head; returns ``σ̂: (n_q,)``, a lower bound.

    ``u: (n_q, d_q)`` and ``v: (n_q, d_k)`` are updated in place. Each step computes
    ``u ← M v/‖M v‖``, ``v ← Mᵀu/‖Mᵀu‖`` with ``M_h = a_q[h] a_k[h//g]ᵀ`` applied implicitly,
    and returns ``‖Mᵀu‖`` (≥ the paper's ``‖M v‖`` by Cauchy–Schwarz, and ≤ σ).
    """
    g = _group_size(a_q, a_k)
    n_kv, d_k, d_h = a_k.shape
    aq = _accumulate(a_q).reshape(n_kv, g, a_q.shape[1], d_h)    # (k, g, d_q, d_h)
    ak = _accumulate(a_k)                                         # (k, d_k, d_h)
    uu = u.reshape(n_kv, g, -1).to(aq.dtype)
    vv = v.reshape(n_kv, g, -1).to(aq.dtype)
    sigma = aq.new_zeros(n_kv, g)
    for _ in range(iters):
        z = torch.einsum("kcj,kgc->kgj", ak, vv)                  # a_kᵀ v
        uu = _unit(torch.einsum("kgdj,kgj->kgd", aq, z))          # a_q z
        y = torch.einsum("kgdj,kgd->kgj", aq, uu)                 # a_qᵀ u
        mt_u = torch.einsum("kcj,kgj->kgc", ak, y)                # a_k y = Mᵀu
        sigma = torch.linalg.vector_norm(mt_u, dim=-1)
        vv = _unit(mt_u)
    u.copy_(uu.reshape(u.shape))
    v.copy_(vv.reshape(v.shape))
    return sigma.reshape(-1)


def per_layer_power_step(a_q: torch.Tensor, a_k: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                         iters: int = 1) -> torch.Tensor:
    """The paper's Algorithms 3–4 for the concatenated ``M = W^Q W^K_expᵀ``; returns ``σ̂: ()``.

    ``u: (d_q,)`` or ``(1, d_q)``, ``v: (d_k,)`` or ``(1, d_k)``, updated in place. GQA uses
    RepeatBlocks on ``W^Kᵀv`` and SumGroups on ``W^Qᵀu`` (never an expanded ``W^K``); the
    estimate is ``‖M v‖`` as in Algorithm 3.
    """
    g = _group_size(a_q, a_k)
    aq, ak = _accumulate(a_q), _accumulate(a_k)
    uu = u.reshape(-1).to(aq.dtype)
    vv = v.reshape(-1).to(aq.dtype)
    sigma = aq.new_zeros(())
    # batched mat-vecs over heads (bmm), so neither weight is ever permuted into a copy
    for _ in range(iters):
        z_kv = (vv @ ak).unsqueeze(-1)                            # W^Kᵀ v, (n_kv, d_h, 1)
        z = z_kv.repeat_interleave(g, dim=0)                      # RepeatBlocks
        mv = (aq @ z).sum(dim=0).squeeze(-1)                      # M v, (d_q,)
        sigma = torch.linalg.vector_norm(mv)
        uu = _unit(mv)
        y = uu @ aq                                               # W^Qᵀ u, (n_q, d_h)
        y_kv = y.reshape(ak.shape[0], g, -1).sum(dim=1)           # SumGroups
        vv = _unit((ak @ y_kv.unsqueeze(-1)).sum(dim=0).squeeze(-1))
    u.copy_(uu.reshape(u.shape))
    v.copy_(vv.reshape(v.shape))
    return sigma


# --------------------------------------------------------------------------------------
# Exact (certified) routes
# --------------------------------------------------------------------------------------

def _gram(a: torch.Tensor) -> torch.Tensor:
    a = a.detach().to(torch.float64)
    return a.transpose(-1, -2) @ a


def _psd_sqrt(g: torch.Tensor) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(g)
    return (evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)


def _sigma_from_grams(g_q: torch.Tensor, g_k: torch.Tensor) -> torch.Tensor:
    """``√λ_max(G_Q G_K)`` via the symmetric ``G_K^½ G_Q G_K^½`` (broadcasting batches)."""
    root_k = _psd_sqrt(g_k)
    sym = root_k @ g_q @ root_k
    sym = 0.5 * (sym + sym.transpose(-1, -2))
    return torch.linalg.eigvalsh(sym)[..., -1].clamp_min(0.0).sqrt()


def per_head_sigma_exact(a_q: torch.Tensor, a_k: torch.Tensor) -> torch.Tensor:
    """Certified ``σ_h = ‖a_q[h] a_k[h//g]ᵀ‖₂`` for every query head; ``(n_q,)`` float64."""
    g = _group_size(a_q, a_k)
    n_kv, _, d_h = a_k.shape
    g_q = _gram(a_q).reshape(n_kv, g, d_h, d_h)
    g_k = _gram(a_k).unsqueeze(1)                                 # (n_kv, 1, d_h, d_h)
    return _sigma_from_grams(g_q, g_k).reshape(-1)


def per_layer_sigma_exact(a_q: torch.Tensor, a_k: torch.Tensor) -> torch.Tensor:
    """Exact paper per-layer ``‖Σ_h a_q[h] a_k[h//g]ᵀ‖₂``; O(d·(n d_h)²), for reference.

    ``M = P Qᵀ`` with ``P = [a_q[0] … a_q[n-1]]`` and ``Q`` the key blocks repeated per
    group, so ``σ² = λ_max((PᵀP)(QᵀQ))`` on (n_q d_h)² Gram matrices.
    """
    g = _group_size(a_q, a_k)
    n_q, d_q, d_h = a_q.shape
    p = a_q.detach().to(torch.float64).permute(1, 0, 2).reshape(d_q, n_q * d_h)
    q = a_k.detach().to(torch.float64).repeat_interleave(g, dim=0)
    q = q.permute(1, 0, 2).reshape(a_k.shape[1], n_q * d_h)
    return _sigma_from_grams(p.T @ p, q.T @ q)


def head_spectral_norms(a: torch.Tensor) -> torch.Tensor:
    """``‖a[h]‖₂`` for every head of ``a: (n, d, d_h)``; ``(n,)`` float64, exact."""
    return torch.linalg.eigvalsh(_gram(a))[..., -1].clamp_min(0.0).sqrt()


def head_norm_power_step(a: torch.Tensor, w: torch.Tensor, iters: int = 1) -> torch.Tensor:
    """Power iteration for ``‖a[h]‖₂`` on ``w: (n, d_h)`` (updated in place); a lower bound.

    Each step is ``w ← aᵀa w / ‖aᵀa w‖`` and the estimate is ``‖a w‖`` — O(n·d·d_h), used
    per step by the certified RoPE bound ``(ρ‖A_q‖ + ‖c_q‖)(ρ‖A_k‖ + ‖c_k‖)``.
    """
    aa = _accumulate(a)
    ww = w.to(aa.dtype)
    est = aa.new_zeros(aa.shape[0])
    for _ in range(iters):
        aw = (aa @ ww.unsqueeze(-1)).squeeze(-1)                  # (n, d)
        est = torch.linalg.vector_norm(aw, dim=-1)
        ww = _unit((aw.unsqueeze(-2) @ aa).squeeze(-2))           # aᵀ(a w), (n, d_h)
    w.copy_(ww)
    return est


def bias_terms(a_q: torch.Tensor, c_q: torch.Tensor | None, a_k: torch.Tensor,
               c_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query head ``(‖a_q[h] c_k[g]‖, ‖a_k[g] c_q[h]‖, c_q[h]·c_k[g])`` in float64.

    These are the offset terms of the certified bound (``bounds.affine_logit_bound``);
    missing ``c`` gives zeros. Shapes: ``c_q: (n_q, d_h)``, ``c_k: (n_kv, d_h)``.
    """
    g = _group_size(a_q, a_k)
    n_kv, _, d_h = a_k.shape
    aq = a_q.detach().to(torch.float64).reshape(n_kv, g, a_q.shape[1], d_h)
    ak = a_k.detach().to(torch.float64)
    zeros = aq.new_zeros(a_q.shape[0])
    cq = None if c_q is None else c_q.detach().to(torch.float64).reshape(n_kv, g, d_h)
    ck = None if c_k is None else c_k.detach().to(torch.float64)
    aq_ck = zeros if ck is None else torch.linalg.vector_norm(
        torch.einsum("kgdj,kj->kgd", aq, ck), dim=-1).reshape(-1)
    ak_cq = zeros if cq is None else torch.linalg.vector_norm(
        torch.einsum("kcj,kgj->kgc", ak, cq), dim=-1).reshape(-1)
    cq_ck = zeros if cq is None or ck is None else torch.einsum(
        "kgj,kj->kg", cq, ck).reshape(-1)
    return aq_ck, ak_cq, cq_ck
