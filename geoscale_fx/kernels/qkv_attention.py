"""FP8 Q/K/V attention: FlashAttention-3's FP8 forward on CUDA, and its emulation elsewhere.

Semantics (FA3's FP8 forward: ``hopper/softmax.h``, and torch 2.13's
``torch.nn.attention.experimental._scaled_dot_product_attention_quantized``). Query head
``h`` reads kv head ``g = h // G`` (``G = H_q / H_kv``); the descales ``δ`` are one per
(batch, kv head), q's included (the max over the query heads of the group)::

    q₈ = Q(q / δ_q,g),   k₈ = Q(k / δ_k,g),   v₈ = Q(v / δ_v,g)       Q: saturating FP8 round
    S  = s · δ_q,g δ_k,g · (q₈ k₈ᵀ)                                     FP32 accumulation
    m  = max_j S_ij (after the mask),   P̃ = 2⁸ · exp(S − m) ∈ [0, 256],   ℓ = Σ_j P̃_ij  (FP32)
    O  = δ_v,g · (Q(P̃) v₈) / ℓ                                          (ℓ = 0: O = 0)

P is quantized with no scale of its own: FA3 subtracts ``Max_offset = 8`` (base 2) from the
row maximum for FP8, which moves P̃ from [0, 1] to [0, 256] so that small probabilities do
not underflow (256 < R_max of both formats), and it sums ℓ from the unquantized P̃.
FA3 runs an online softmax over key blocks with the running maximum; the emulation uses
the row's final maximum (one key block), so the two can round an entry of P differently
where a block's running maximum is not the row's.

The emulation's backward is the straight-through estimator of every cast (the gradient of
attention at the quantized point), as for the logits (``fp8.fake_quantize_logits``); the
CUDA kernel has no backward. Masks (bool or additive, broadcastable) and dropout on P are
emulated beyond what the kernel takes (``fa3_available`` says when the kernel is used).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from geoscale_fx.core.fp8 import quantize_dequantize, saturating_cast

__all__ = ["P_OFFSET", "emulated_fp8_attention", "fa3_fp8_attention", "fa3_available",
           "group_descale", "operand_scaled_max"]

#: FA3's FP8 softmax computes ``exp2(x·log₂e − (max·log₂e − 8))``: P̃ = 2⁸ · exp(S − m)
P_OFFSET = 256.0


def _fake_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``Q(x)`` (values on the FP8 grid, in x's dtype) with a straight-through gradient."""
    return quantize_dequantize(x.detach(), fmt) + (x - x.detach())


def _head_view(descale: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """``(B or 1, H, 1, 1)`` float32 from a ``(H_kv,)`` or ``(B, H_kv)`` descale, each kv
    head's entry repeated for the ``repeat`` query heads of its group."""
    d = descale.detach().float()
    d = d.reshape(1, -1) if d.dim() == 1 else d
    if repeat > 1:
        d = d.repeat_interleave(repeat, dim=-1)
    return d[:, :, None, None]


def group_descale(per_head: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``(n_kv,)``: the max of a per-query-head ``(n_q,)`` tensor over each GQA group."""
    return per_head.reshape(n_kv, -1).amax(dim=-1)


def operand_scaled_max(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``max |x| / δ`` per kv head, ``(H_kv,)`` float32: what the FP8 cast must represent
    (``x``: ``(B, H, L, E)`` with ``H`` a multiple of ``H_kv``; ``descale``: ``(H_kv,)``)."""
    per_head = x.detach().abs().float().amax(dim=(0, 2, 3))                 # (H,)
    return group_descale(per_head, descale.shape[-1]) / descale.detach().float()


def _masked(logits, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    if attn_mask is not None:
        logits = (logits.masked_fill(~attn_mask, -float("inf")) if attn_mask.dtype == torch.bool
                  else logits + attn_mask.float())
    if is_causal:   # top-left, as F.scaled_dot_product_attention
        keep = torch.ones(logits.shape[-2], logits.shape[-1], dtype=torch.bool,
                          device=logits.device).tril()
        logits = logits.masked_fill(~keep, -float("inf"))
    return logits


def emulated_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           descale_q: torch.Tensor, descale_k: torch.Tensor,
                           descale_v: torch.Tensor, *, softmax_scale: float, is_causal: bool,
                           attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                           fmt: str = "e4m3") -> torch.Tensor:
    """The module docstring's semantics in FP32, on any device; output in ``q``'s dtype.

    ``q``: (B, H_q, L, E); ``k``: (B, H_kv, S, E); ``v``: (B, H_kv, S, E_v); descales
    ``(H_kv,)`` or ``(B, H_kv)`` (the kernel's layout), positive.
    """
    group = q.shape[-3] // k.shape[-3]
    dq, dk, dv = _head_view(descale_q, group), _head_view(descale_k), _head_view(descale_v)
    q8 = _fake_fp8(q.float() / dq, fmt)                                    # (B, H_q, L, E)
    k8 = _fake_fp8(k.float() / dk, fmt).repeat_interleave(group, dim=-3)   # (B, H_q, S, E)
    v8 = _fake_fp8(v.float() / dv, fmt).repeat_interleave(group, dim=-3)   # (B, H_q, S, E_v)
    dk, dv = dk.repeat_interleave(group, dim=1), dv.repeat_interleave(group, dim=1)
    logits = (q8 @ k8.transpose(-2, -1)) * (softmax_scale * dq * dk)       # (B, H_q, L, S)
    logits = _masked(logits, attn_mask, is_causal)
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == -float("inf"), 0.0, row_max)   # a fully masked row
    p = torch.exp(logits - row_max) * P_OFFSET                              # P̃ ∈ [0, 256]
    row_sum = p.sum(dim=-1, keepdim=True)                                   # ℓ ∈ {0} ∪ [256, ∞)
    p8 = _fake_fp8(p, fmt)
    if dropout_p > 0:
        p8 = F.dropout(p8, p=dropout_p, training=True)
    inverse = torch.where(row_sum > 0, 1.0 / row_sum.clamp_min(1.0), 0.0)
    return ((p8 @ v8) * (dv * inverse)).to(q.dtype)


def fa3_available(device: str) -> bool:
    """Whether torch's FP8 FlashAttention-3 kernel can run here: a CUDA device, torch's
    experimental entry point, and FA3 activated as the flash implementation
    (``torch.nn.attention.activate_flash_attention_impl("FA3")``)."""
    if device != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention import current_flash_attention_impl
        from torch.nn.attention.experimental import (  # noqa: F401
            _scaled_dot_product_attention_quantized,
        )
    except ImportError:
        return False
    return current_flash_attention_impl() == "FA3"


def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      descale_q: torch.Tensor, descale_k: torch.Tensor,
                      descale_v: torch.Tensor, *, softmax_scale: float,
                      is_causal: bool) -> torch.Tensor:
    """FA3's FP8 forward (CUDA, e4m3, no mask, no dropout, forward only) on q, k, v cast
    with the descales (``(H_kv,)``); output in ``q``'s dtype. Untested in this project
    (no GPU was available to it)."""
    from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
        _scaled_dot_product_attention_quantized,
    )

    group = q.shape[-3] // k.shape[-3]

    def cast(x, descale, repeat=1):
        scaled = x.float() / _head_view(descale, repeat)
        return saturating_cast(scaled, "e4m3").contiguous()

    def kernel_descale(descale):                                   # (B, H_kv) float32
        return descale.detach().float().reshape(1, -1).expand(q.shape[0], -1).contiguous()

    out = _scaled_dot_product_attention_quantized(
        cast(q, descale_q, group), cast(k, descale_k), cast(v, descale_v),
        is_causal=is_causal, scale=softmax_scale, q_descale=kernel_descale(descale_q),
        k_descale=kernel_descale(descale_k), v_descale=kernel_descale(descale_v))
    return out.to(q.dtype)
