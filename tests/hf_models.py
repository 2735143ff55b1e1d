"""Tiny Hugging Face models built from configs (no hub), shared by the tests."""
from __future__ import annotations

import pytest
import torch

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


def build_hf(key: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    family, impl = key.split("-")
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                      n_positions=64, attn_implementation=impl,
                                      bos_token_id=0, eos_token_id=0)
    elif family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=128,
                                       max_position_embeddings=64, attn_implementation=impl,
                                       bos_token_id=0, eos_token_id=0)
    elif family == "qwen2":   # GQA with q/k/v biases (not in HF_MODELS: tests/test_decode.py)
        cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=128,
                                       max_position_embeddings=64, attn_implementation=impl,
                                       bos_token_id=0, eos_token_id=0)
    else:
        cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=64,
                                         num_attention_heads=8, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=128, vocab_size=128,
                                         max_position_embeddings=64, attn_implementation=impl,
                                         bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()
