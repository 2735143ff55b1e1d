"""Tiny Hugging Face models built from configs (no hub), and the generations with a quantized
KV cache that the cache tests compare (tests/test_kv_cache.py, tests/core/test_nvfp4.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import geoscale_fx
from geoscale_fx.core.fp8 import kv_format
from geoscale_fx.kv_cache.layers import cache_nbytes, fp8_cache
from geoscale_fx.kv_cache.layer_scales import LayerScales

HF_MODELS = {
    "gpt2-sdpa": dict(kind="sdpa", name="transformer.h.{}.attn", heads=(4, 4, 16, 64),
                      norm="layernorm", rope=False, q_param="c_attn.weight"),
    "gpt2-eager": dict(kind="explicit", name="transformer.h.{}.attn", heads=(4, 4, 16, 64),
                       norm="layernorm", rope=False, q_param="c_attn.weight"),
    "llama-sdpa": dict(kind="sdpa", name="model.layers.{}.self_attn", heads=(4, 2, 16, 64),
                       norm="rmsnorm", rope=True, q_param="q_proj.weight"),
    "llama-eager": dict(kind="explicit", name="model.layers.{}.self_attn", heads=(4, 2, 16, 64),
                        norm="rmsnorm", rope=True, q_param="q_proj.weight"),
    "mistral-sdpa": dict(kind="sdpa", name="model.layers.{}.self_attn", heads=(8, 2, 8, 64),
                         norm="rmsnorm", rope=True, q_param="q_proj.weight"),
}


def build_hf(key: str, seed: int = 0, layers: int = 2):
    transformers = pytest.importorskip("transformers")
    family, impl = key.split("-")
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128,
                                      n_positions=64, attn_implementation=impl,
                                      bos_token_id=0, eos_token_id=0)
    elif family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=128,
                                       max_position_embeddings=64, attn_implementation=impl,
                                       bos_token_id=0, eos_token_id=0)
    elif family == "qwen2":   # GQA with q/k/v biases (not in HF_MODELS: tests/test_decode.py)
        cfg = transformers.Qwen2Config(num_hidden_layers=layers, hidden_size=64,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=128,
                                       max_position_embeddings=64, attn_implementation=impl,
                                       bos_token_id=0, eos_token_id=0)
    else:
        cfg = transformers.MistralConfig(num_hidden_layers=layers, hidden_size=64,
                                         num_attention_heads=8, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=128, vocab_size=128,
                                         max_position_embeddings=64, attn_implementation=impl,
                                         bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


# --- generation with a quantized KV cache ----------------------------------------------

#: tokens each generation of the KV-cache tests adds to its prompt
NEW_TOKENS = 6


def prompt(batch: int = 2, length: int = 8, seed: int = 5) -> torch.Tensor:
    """Token ids ``(batch, length)`` in [1, 128), the same for a seed."""
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate_with_logits(model, ids, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``NEW_TOKENS`` tokens: the sequences ``(B, T + NEW_TOKENS)`` and the logits of
    each new token ``(NEW_TOKENS, B, vocab)``."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits)


def plain_cache(model, ids):
    """The unquantized ``DynamicCache`` that a generation from ``ids`` fills."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    generate_with_logits(model, ids, past_key_values=cache)
    return cache


def observed_amax_cache(model, ids, kv_cache: str, static: bool):
    """A ``kv_cache`` ("fp8", "nvfp4" …) cache whose per-kv-head scales come from each head's
    actual max |entry| over the whole unquantized generation: the ideal scales, known only
    from the very data (what an engine calibrates on it)."""
    layers = [LayerScales(i, "", torch.ones(1), c.keys.abs().amax(dim=(0, 2, 3)).double(),
                          c.values.abs().amax(dim=(0, 2, 3)).double())
              for i, c in enumerate(plain_cache(model, ids).layers)]
    counters = [torch.zeros(2, dtype=torch.int64) for _ in layers]
    return fp8_cache(model.config, layers, kv_format(kv_cache), counters, static=static,
                     max_cache_len=ids.shape[1] + NEW_TOKENS)


def cache_bytes(model, kv_cache: str) -> tuple[int, int, torch.Tensor]:
    """After one generation from ``prompt()``: the bytes of the ``kv_cache`` cache that
    ``wrap(model, kv_cache=...)`` makes, the bytes of the model's own (unquantized) cache, and
    the logits of the wrapped generation."""
    ids = prompt()
    plain = plain_cache(model, ids)
    # the rewritten graphs run eagerly: the cache's formats and scales, not the AOT trace
    wrapped = geoscale_fx.wrap(model, kv_cache=kv_cache, scaling="none", compiler="eager")
    cache = model._geoscale_kv_cache.new_cache(ids)
    _, logits = generate_with_logits(wrapped, ids, past_key_values=cache)
    return cache_nbytes(cache), cache_nbytes(plain), logits


@dataclass
class CacheRuns:
    """Greedy generations of one prompt (``generate_with_logits``): the unquantized model's,
    the same model's with the observed-amax cache, and ``wrapped``'s (``kv_cache`` with the
    scales it certifies from the weights)."""
    reference_tokens: torch.Tensor
    reference: torch.Tensor
    observed: torch.Tensor
    tokens: torch.Tensor
    certified: torch.Tensor
    wrapped: torch.nn.Module


def kv_cache_runs(model, ids, kv_cache: str, static: bool) -> CacheRuns:
    """The three generations of :class:`CacheRuns`; ``static``: StaticCaches throughout."""
    kw = {"cache_implementation": "static"} if static else {}
    reference_tokens, reference = generate_with_logits(model, ids, **kw)
    _, observed = generate_with_logits(
        model, ids, past_key_values=observed_amax_cache(model, ids, kv_cache, static))
    # the rewritten graphs run eagerly: the cache's formats and scales, not the AOT trace
    wrapped = geoscale_fx.wrap(model, kv_cache=kv_cache, scaling="none", compiler="eager")
    tokens, certified = generate_with_logits(wrapped, ids, **kw)
    return CacheRuns(reference_tokens, reference, observed, tokens, certified, wrapped)
