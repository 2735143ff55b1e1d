"""Attention with FP8-quantized logits: fused (flex_attention) or explicit.

Both compute ``softmax(M(Q(S / scale) · scale)) V`` with ``S = s · q kᵀ``, ``Q`` the saturating
FP8 round trip and ``M`` the site's mask, with the semantics of
``F.scaled_dot_product_attention`` (``attn_mask`` bool or additive, top-left ``is_causal``,
``enable_gqa``). ``fused_attention`` never materializes the L×L scores (flex_attention with a
``score_mod``; Inductor lowers it to one kernel); ``explicit_attention`` does, and so can report
``max |S|`` — needed by audits, delayed/current scaling and auto-α calibration, and for CPU
training (flex_attention has no CPU backward).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental import proxy_tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from geoscale_fx.core.fp8 import fake_quantize_logits

__all__ = ["fused_attention", "explicit_attention", "head_divisor",
           "inductor_cpu_fused_unsupported"]


def head_divisor(divisor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``(H, 1, 1)`` divisor for logits shaped ``(..., H, L, L')`` (one scale, or one per head)."""
    return divisor.expand(n_heads).reshape(n_heads, 1, 1)


def _mask_reader(mask: torch.Tensor):
    """Index a (broadcastable) SDPA mask inside a score_mod: ``read(b, h, q, k)``."""
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    m = mask.reshape(shape)

    def read(b, h, q_idx, kv_idx):
        zero = torch.zeros_like(q_idx)
        return m[b if shape[0] > 1 else zero, h if shape[1] > 1 else zero,
                 q_idx if shape[2] > 1 else zero, kv_idx if shape[3] > 1 else zero]
    return read


def _realized(t: torch.Tensor) -> torch.Tensor:
    """The same values, produced by a concatenation.

    Inductor's CPU flex_attention template only accepts captured tensors that are realized
    buffers (graph inputs, extern or concat outputs); a pointwise result it would inline fails
    with "NoValidChoicesError". Concatenating forces a buffer; the extra element is dropped.
    """
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(1)])[: flat.numel()].view(t.shape)


def fused_attention(q, k, v, attn_mask: Optional[torch.Tensor], divisor: Optional[torch.Tensor],
                    *, softmax_scale: float, is_causal: bool, enable_gqa: bool,
                    fmt: str) -> torch.Tensor:
    """flex_attention whose score_mod quantizes ``S / scale[h]`` (``divisor``: (1,) or (H,)).

    A block mask is always passed (causal, or full): without one, Inductor's CPU kernel
    allocates O(L²) scratch memory (measured on torch 2.13: 137 MB vs 2 MB at L = 4096).
    """
    divisor = _realized(divisor) if divisor is not None else None
    attn_mask = _realized(attn_mask) if attn_mask is not None else None
    read_mask = _mask_reader(attn_mask) if attn_mask is not None else None
    is_bool = attn_mask is not None and attn_mask.dtype == torch.bool
    per_head = divisor is not None and divisor.numel() > 1

    def score_mod(score, b, h, q_idx, kv_idx):
        if divisor is not None:
            # straight-through, as the explicit lowering: flex_attention's backward (CUDA)
            # differentiates this function, and the cast's own gradient would round dS to
            # FP8 and zero it where S / scale saturates
            score = fake_quantize_logits(score, divisor[h] if per_head else divisor[0], fmt)
        if read_mask is not None:
            m = read_mask(b, h, q_idx, kv_idx)
            score = torch.where(m, score, -float("inf")) if is_bool else score + m.to(
                score.dtype)
        if is_causal:
            score = torch.where(q_idx >= kv_idx, score, -float("inf"))
        return score

    def keep(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if is_causal else q_idx >= 0

    if not enable_gqa and k.shape[-3] == 1 != q.shape[-3]:
        # SDPA broadcasts a single key/value head (multi-query attention written without
        # enable_gqa, e.g. Falcon); flex_attention needs the heads spelled out
        k = k.expand(*k.shape[:-3], q.shape[-3], *k.shape[-2:])
        v = v.expand(*v.shape[:-3], q.shape[-3], *v.shape[-2:])
    block_mask = create_block_mask(keep, None, None, q.shape[-2], k.shape[-2], device=q.device)
    # the CPU template needs contiguous inputs, and reads the query's buffer as 4-D: a decode
    # query (B = L = 1) is "contiguous" as a view of its 2-D projection, so copy it always
    q = q.clone(memory_format=torch.contiguous_format)
    with _without_trace_metadata_mode():
        return flex_attention(q, k.contiguous(), v.contiguous(), score_mod=score_mod,
                              block_mask=block_mask, scale=softmax_scale, enable_gqa=enable_gqa)


def inductor_cpu_fused_unsupported() -> str:
    """Why Inductor cannot compile the fused lowering for the CPU here ("" when it can).

    Inductor lowers flex_attention on the CPU to its C++ template only where torch's own
    check passes (``torch._inductor.kernel.flex.flex_cpu.check_cpu_supported``, torch 2.11
    to 2.15): a CPU with AVX2 whose ATen kernels are vectorized (not
    ``ATEN_CPU_CAPABILITY=default``), not macOS, no XPU. Elsewhere the compile fails
    ("torch.compile on current platform is not supported for CPU")."""
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:     # a torch without the check: Inductor's own error, if any, stands
        return ""
    if check_cpu_supported():
        return ""
    return ("Inductor's CPU flex_attention template does not run on this platform (it needs "
            "AVX2 and vectorized ATen kernels, and neither macOS nor an XPU)")


def _without_trace_metadata_mode():
    """The trace's torch-function metadata mode (``make_fx``'s, which records
    ``node.meta["torch_fn"]``, read by export only) set aside for the call.

    Outside Dynamo — AOTAutograd tracing a rewritten graph — ``flex_attention`` compiles
    its operator with an inner ``torch.compile``; with such a mode active, torch makes a
    new backend for each call (it re-enters the mode around the compiled graph), so every
    call compiled anew (0.7 s each: half of a fused graph's compile) and kept its entry
    and graph for the process's life (the cache limit is lifted for these compiles: 10 MB
    a converted model with an FP8 cache, ``python -m bench.memory_rounds``). Without it,
    the inner compile uses Dynamo's eager backend, and its entries are reused by every
    call with the same shapes, whatever the model."""
    remove = getattr(proxy_tensor, "_temp_remove_metadata_torch_function_mode", None)
    return remove() if remove is not None else contextlib.nullcontext()


def explicit_attention(q, k, v, attn_mask: Optional[torch.Tensor], *, softmax_scale: float,
                       is_causal: bool, enable_gqa: bool, dropout_p: float, fmt: str,
                       divisor_of: Callable[[torch.Tensor], Optional[torch.Tensor]]
                       ) -> torch.Tensor:
    """Materialized attention; ``divisor_of(S)`` sees the logits and returns the divisor (or None).

    Logits are computed in float32 (the statistics and the quantizer see exact values).
    """
    n_q = q.shape[-3]
    if enable_gqa and k.shape[-3] != n_q:
        k = k.repeat_interleave(n_q // k.shape[-3], dim=-3)
        v = v.repeat_interleave(n_q // v.shape[-3], dim=-3)
    logits = (q.float() @ k.float().transpose(-2, -1)) * softmax_scale     # (B, H, L, L')
    divisor = divisor_of(logits)
    if divisor is not None:
        logits = fake_quantize_logits(logits, head_divisor(divisor, n_q), fmt)
    if attn_mask is not None:
        logits = (logits.masked_fill(~attn_mask, -float("inf")) if attn_mask.dtype == torch.bool
                  else logits + attn_mask.float())
    if is_causal:
        causal = torch.ones(logits.shape[-2], logits.shape[-1], dtype=torch.bool,
                            device=logits.device).tril()
        logits = logits.masked_fill(~causal, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    # a query whose keys are all masked out attends to nothing (0), as in SDPA, not NaN
    probs = torch.where(logits.amax(dim=-1, keepdim=True) == -float("inf"), 0.0, probs)
    probs = probs.to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return probs @ v
