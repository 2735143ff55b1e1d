"""Random-weight Llama models of a run's shapes, and the attention inputs of one layer.

No checkpoint can be brought to the GPU machine (no network, ≤ 64 MiB of files): the models
have the Llama-3-8B geometry and random weights (transformers' own initialisation), which is
what the speed, memory and saturation figures need. The full-depth model is built once per run
(``shared_llama``) and shared by the checks that use it; ``release`` frees it.
"""
from __future__ import annotations

import contextlib

import torch

from bench.gpu.harness import Setting, Shapes

__all__ = ["llama_config", "build_llama", "shared_llama", "release", "attention_inputs",
           "bf16_sdpa", "float32_attention"]

_SHARED: dict = {}
#: whether torch's flash kernel takes ``enable_gqa`` here (decided by the first CUDA call)
_FLASH_GQA: dict = {}


def llama_config(shapes: Shapes, layers: int, vocab: int):
    """A ``LlamaConfig`` of ``shapes`` (SDPA attention) with ``layers`` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shapes.d, num_attention_heads=shapes.n_q,
                       num_key_value_heads=shapes.n_kv, head_dim=shapes.d_h,
                       intermediate_size=shapes.mlp, vocab_size=vocab,
                       num_hidden_layers=layers, max_position_embeddings=16384,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_llama(setting: Setting, layers: int, vocab: int, seed: int = 0):
    """``LlamaForCausalLM`` with random weights, made on the device in the setting's dtype
    (no float32 copy of an 8B model on the way; the rotary frequencies stay float32, as
    transformers makes them), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(setting.device), _default_dtype(setting.dtype):
        model = LlamaForCausalLM(llama_config(setting.shapes, layers, vocab))
    return model.eval()


def shared_llama(setting: Setting):
    """The run's full-depth model (``shapes.layers`` layers, the full vocabulary)."""
    key = (setting.device, setting.shapes.name)
    if key not in _SHARED:
        _SHARED.clear()
        _SHARED[key] = build_llama(setting, setting.shapes.layers, setting.shapes.vocab)
    return _SHARED[key]


def release() -> None:
    """Forget the shared model (and return its memory to the device)."""
    _SHARED.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attention_inputs(setting: Setting, batch: int, length: int, requires_grad: bool = False,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (B, H_q, L, d_h)``, ``k, v (B, H_kv, L, d_h)`` of the setting's dtype, unit normal."""
    s = setting.shapes
    gen = torch.Generator(setting.device).manual_seed(seed)

    def make(heads):
        x = torch.randn(batch, heads, length, s.d_h, generator=gen, device=setting.device,
                        dtype=torch.float32).to(setting.dtype)
        return x.requires_grad_(requires_grad)
    return make(s.n_q), make(s.n_kv), make(s.n_kv)


def bf16_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA as users call it (``enable_gqa=True``); on CUDA pinned to the flash
    backend, so that a case flash refuses fails loudly instead of timing the O(L²) math
    kernel. Where flash refuses ``enable_gqa``, k and v are repeated to the query heads (the
    MHA-equivalent call; the repeat is timed with it)."""
    import torch.nn.functional as F

    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if _FLASH_GQA.get("ok", True):
            try:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=True)
                _FLASH_GQA["ok"] = True
                return out
            except RuntimeError:
                _FLASH_GQA["ok"] = False
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                              v.repeat_interleave(group, dim=1),
                                              is_causal=True, scale=scale)


def float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """The float32 reference: causal SDPA on float32 copies, k and v repeated to the query
    heads (so that CUDA's memory-efficient kernel takes it: O(L) memory at any length)."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, dim=1),
        v.float().repeat_interleave(group, dim=1), is_causal=True, scale=scale)
