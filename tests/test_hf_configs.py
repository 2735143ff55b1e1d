"""``geoscale_fx.hf_configs``: the generic shrinker of Hugging Face configs, checked on the
invariants it promises (GQA ratio, d = n_q·d_h, per-layer kinds, sums of head widths, token ids
inside the vocabulary) rather than on a list of expected numbers per family."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx import hf_configs

pytestmark = pytest.mark.zoo
transformers = pytest.importorskip("transformers")


def test_gqa_ratio_width_and_head_dim_are_kept_consistent():
    """Llama-2-70B's shape (64 q heads over 8 kv heads, d = 8192): 8 q heads over 1, d_h = 16,
    d = 128; everything else small."""
    big = transformers.LlamaConfig(hidden_size=8192, num_attention_heads=64,
                                   num_key_value_heads=8, num_hidden_layers=80,
                                   intermediate_size=28672, vocab_size=32000,
                                   max_position_embeddings=4096)
    small = hf_configs.shrink_config(big)
    assert (small.num_attention_heads, small.num_key_value_heads) == (8, 1)
    assert small.head_dim == hf_configs.HEAD_DIM
    assert small.hidden_size == small.num_attention_heads * small.head_dim
    assert small.num_hidden_layers == hf_configs.LAYERS
    assert small.intermediate_size <= hf_configs.WIDTH
    assert small.vocab_size <= hf_configs.WIDTH
    assert big.num_hidden_layers == 80            # the input is not modified


def test_aliases_are_read_from_the_attribute_map():
    """GPT-2 stores n_embd / n_head / n_layer / n_positions; its eos id 50256 moves inside
    the new vocabulary."""
    small = hf_configs.tiny_config("gpt2")
    assert (small.n_embd, small.n_head, small.n_layer) == (64, 4, 2)
    assert small.n_positions <= hf_configs.WIDTH
    assert small.eos_token_id < small.vocab_size and small.bos_token_id == small.eos_token_id


def test_every_kind_of_layer_is_kept():
    """Per-layer kinds survive: Gemma-2 alternates sliding and full attention, Qwen3-Next
    has linear attention in three layers of four; a cycled pattern shorter than the model
    (RecurrentGemma's block_types) keeps enough layers to hold each kind."""
    gemma2 = hf_configs.tiny_config("gemma2")
    assert sorted(set(gemma2.layer_types)) == ["full_attention", "sliding_attention"]
    assert len(gemma2.layer_types) == gemma2.num_hidden_layers == 2
    nxt = hf_configs.tiny_config("qwen3_next")
    assert set(nxt.layer_types) == {"full_attention", "linear_attention"}
    recurrent = hf_configs.tiny_config("recurrent_gemma")
    assert recurrent.num_hidden_layers == 3 and "attention" in recurrent.block_types


def test_lists_of_layer_indices_are_renumbered_not_cut():
    """Llama-4 names its MoE layers by index (all 48) next to per-layer lists: two layers
    hold its two kinds (chunked with RoPE, full without), and both stay MoE layers."""
    big = transformers.AutoConfig.for_model("llama4_text")
    assert big.moe_layers == list(range(big.num_hidden_layers))
    small = hf_configs.shrink_config(big)
    assert small.num_hidden_layers == 2 and small.moe_layers == [0, 1]
    assert set(small.layer_types) == set(big.layer_types)
    assert sorted(small.no_rope_layers) == [0, 1]


def test_head_widths_are_scaled_by_one_factor():
    """DeepSeek-V3's MLA: q·k runs over nope + rope dims, so qk_head_dim = qk_nope_head_dim +
    qk_rope_head_dim must hold after the shrinking too."""
    big = transformers.AutoConfig.for_model("deepseek_v3")
    assert big.qk_head_dim == big.qk_nope_head_dim + big.qk_rope_head_dim
    small = hf_configs.shrink_config(big)
    assert small.qk_head_dim == small.qk_nope_head_dim + small.qk_rope_head_dim
    assert small.qk_head_dim < big.qk_head_dim
    assert small.num_experts_per_tok <= small.n_routed_experts <= hf_configs.COUNT


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "gemma2"])
def test_tiny_models_build_and_run(model_type):
    """A shrunk family builds with random weights (a few hundred thousand parameters) and
    answers a forward; on the meta device it allocates nothing."""
    model = hf_configs.tiny_model(model_type)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    logits = model(input_ids=torch.randint(0, 100, (1, 8))).logits
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()
    meta = hf_configs.tiny_model(model_type, device="meta")
    assert all(p.is_meta for p in meta.parameters())


def test_an_unknown_or_unbuildable_family_is_named(monkeypatch):
    with pytest.raises(ValueError, match=r"model type 'no-such-family': not a transformers "
                                         r"model type"):
        hf_configs.tiny_config("no-such-family")

    def refuse(config, **kwargs):
        raise RuntimeError("the constructor says no")

    monkeypatch.setattr(hf_configs, "model_from_config", refuse)
    with pytest.raises(ValueError, match=r"model type 'llama': its shrunk config does not "
                                         r"build \(RuntimeError: the constructor says no\); "
                                         r"its default config does not build either"):
        hf_configs.tiny_model("llama")


def test_auto_model_class_follows_the_saved_architecture():
    """A saved BertModel loads as AutoModel although BERT has a causal-LM head class; a
    config without architectures goes by its model type."""
    bert = transformers.BertConfig(architectures=["BertModel"])
    assert hf_configs.auto_model_class(bert) is transformers.AutoModel
    assert hf_configs.auto_model_class(transformers.LlamaConfig()) \
        is transformers.AutoModelForCausalLM
    assert hf_configs.auto_model_class(transformers.T5Config()) is transformers.AutoModel
