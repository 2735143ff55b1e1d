"""Hugging Face configurations: the paper's four architectures, full size and small.

Shapes are plain keyword dictionaries (hashable into a training recipe, independent of the
transformers version); :func:`hf_config` turns one into a ``GPT2Config`` / ``LlamaConfig`` /
``MistralConfig`` with the attention implementation always set explicitly.

Full sizes follow the public ``config.json`` of gpt2-xl, Mistral-7B-v0.1, Llama-2-13b-hf and
Llama-2-70b-hf (Table 10 of the paper gives d, d_h, layers and heads):

    =============  =====  ===  ======  ====  =====  =========
    model          d      d_h  layers  n_q   n_kv   n_q/n_kv
    =============  =====  ===  ======  ====  =====  =========
    GPT-2 XL       1600   64   48      25    25     1 (MHA)
    Mistral-7B     4096   128  32      32    8      4 (GQA)
    Llama-2-13B    5120   128  40      40    40     1 (MHA)
    Llama-2-70B    8192   128  80      64    8      8 (GQA)
    =============  =====  ===  ======  ====  =====  =========

Small variants keep each family class, MHA vs. GQA ratio n_q/n_kv, RoPE, biases, norm type
and the MLP width ratio, at d = 128, d_h = 16, 2-4 layers, a byte vocabulary (256) and
sequences of up to 128 tokens: small enough to train on two CPU cores.
"""
from __future__ import annotations

__all__ = ["ATTN_IMPLEMENTATIONS", "PAPER_FULL", "PAPER_SMALL", "HF_SMALL", "hf_config",
           "head_dim_of"]

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

#: Byte-level vocabulary and context of every small model.
SMALL_VOCAB = 256
SMALL_SEQ_LEN = 128

_SMALL_GPT2_COMMON = dict(vocab_size=SMALL_VOCAB, n_positions=SMALL_SEQ_LEN,
                          layer_norm_epsilon=1e-5, activation_function="gelu_new",
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0)
_SMALL_LLAMA_COMMON = dict(vocab_size=SMALL_VOCAB, max_position_embeddings=SMALL_SEQ_LEN,
                           rope_theta=10000.0, bos_token_id=0, eos_token_id=0)

#: name -> (family, shape kwargs) for the paper's architectures at full size.
PAPER_FULL = {
    "gpt2-xl": ("gpt2", dict(
        vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25,
        layer_norm_epsilon=1e-5, activation_function="gelu_new")),
    "mistral-7b": ("mistral", dict(
        vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14336,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=None)),
    "llama-2-13b": ("llama", dict(
        vocab_size=32000, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, intermediate_size=13824, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama-2-70b": ("llama", dict(
        vocab_size=32000, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=28672, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0)),
}

#: name -> (family, shape kwargs) for the small variants of the paper's architectures.
PAPER_SMALL = {
    "gpt2-xl": ("gpt2", dict(_SMALL_GPT2_COMMON, n_embd=128, n_layer=4, n_head=8)),
    "mistral-7b": ("mistral", dict(
        _SMALL_LLAMA_COMMON, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, intermediate_size=448, rms_norm_eps=1e-5,
        sliding_window=None)),
    "llama-2-13b": ("llama", dict(
        _SMALL_LLAMA_COMMON, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=352, rms_norm_eps=1e-5)),
    "llama-2-70b": ("llama", dict(
        _SMALL_LLAMA_COMMON, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=1, intermediate_size=448, rms_norm_eps=1e-5)),
}

#: name -> (family, shape kwargs) for plain small HF models (also the pretraining shapes).
HF_SMALL = {
    "hf-gpt2": ("gpt2", dict(_SMALL_GPT2_COMMON, n_embd=128, n_layer=4, n_head=4)),
    "hf-llama": ("llama", dict(
        _SMALL_LLAMA_COMMON, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=352, rms_norm_eps=1e-5)),
    # A sliding window shorter than the context: SDPA then gets an explicit mask, not
    # is_causal, which is a distinct site for the graph passes.
    "hf-mistral": ("mistral", dict(
        _SMALL_LLAMA_COMMON, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, intermediate_size=448, rms_norm_eps=1e-5,
        sliding_window=64)),
}


def hf_config(family: str, shape: dict, attn_implementation: str = "sdpa"):
    """A transformers config of ``family`` ("gpt2" | "llama" | "mistral") from ``shape``."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r}; "
                         f"allowed values: {ATTN_IMPLEMENTATIONS}")
    import transformers

    config_classes = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig,
                      "mistral": transformers.MistralConfig}
    if family not in config_classes:
        raise ValueError(f"family={family!r}; allowed values: {tuple(config_classes)}")
    return config_classes[family](**shape, attn_implementation=attn_implementation)


def head_dim_of(config) -> int:
    """d_h of a GPT-2 / Llama / Mistral / BERT config."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim else config.hidden_size // config.num_attention_heads
