"""``geoscale_fx.testing.hf_config_shrinker``: the generic shrinker of Hugging Face configs, checked on
the invariants it promises (GQA ratio, d = n_q·d_h, per-layer kinds, sums of head widths, token
ids inside the vocabulary) rather than on a list of expected numbers per family."""
from __future__ import annotations

import pytest

from geoscale_fx.testing import hf_config_shrinker as shrinker
from geoscale_fx.testing.hf_config_shrinker import shrink_config

pytestmark = pytest.mark.zoo
transformers = pytest.importorskip("transformers")


def _default(model_type: str):
    return transformers.AutoConfig.for_model(model_type)


def test_gqa_ratio_width_and_head_dim_are_kept_consistent():
    """Llama-2-70B's shape (64 q heads over 8 kv heads, d = 8192): 8 q heads over 1, d_h = 16,
    d = 128; everything else small."""
    big = transformers.LlamaConfig(hidden_size=8192, num_attention_heads=64,
                                   num_key_value_heads=8, num_hidden_layers=80,
                                   intermediate_size=28672, vocab_size=32000,
                                   max_position_embeddings=4096)
    small = shrink_config(big)
    assert (small.num_attention_heads, small.num_key_value_heads) == (8, 1)
    assert small.head_dim == shrinker.HEAD_DIM
    assert small.hidden_size == small.num_attention_heads * small.head_dim
    assert small.num_hidden_layers == shrinker.LAYERS
    assert small.intermediate_size <= shrinker.WIDTH
    assert small.vocab_size <= shrinker.WIDTH
    assert big.num_hidden_layers == 80            # the input is not modified


def test_aliases_are_read_from_the_attribute_map():
    """GPT-2 stores n_embd / n_head / n_layer / n_positions; its eos id 50256 moves inside
    the new vocabulary."""
    small = shrink_config(transformers.GPT2Config())
    assert (small.n_embd, small.n_head, small.n_layer) == (64, 4, 2)
    assert small.n_positions <= shrinker.WIDTH
    assert small.eos_token_id < small.vocab_size and small.bos_token_id == small.eos_token_id


def test_special_token_ids_move_to_the_top_and_stay_distinct():
    """Ids beyond the new vocabulary take its top ids in order, equal ids stay equal (bos is
    one of the eos list) and an id already inside is kept."""
    big = transformers.LlamaConfig(vocab_size=32000, bos_token_id=31998,
                                   eos_token_id=[31999, 31998], pad_token_id=5)
    small = shrink_config(big)
    vocab = small.vocab_size
    assert vocab == shrinker.WIDTH
    assert (small.bos_token_id, small.eos_token_id) == (vocab - 1, [vocab - 2, vocab - 1])
    assert small.pad_token_id == 5


def test_every_kind_of_layer_is_kept():
    """Per-layer kinds survive: Gemma-2 alternates sliding and full attention, Qwen3-Next
    has linear attention in three layers of four; a cycled pattern shorter than the model
    (RecurrentGemma's block_types) keeps enough layers to hold each kind."""
    gemma2 = shrink_config(_default("gemma2"))
    assert sorted(set(gemma2.layer_types)) == ["full_attention", "sliding_attention"]
    assert len(gemma2.layer_types) == gemma2.num_hidden_layers == 2
    nxt = shrink_config(_default("qwen3_next"))
    assert set(nxt.layer_types) == {"full_attention", "linear_attention"}
    recurrent = shrink_config(_default("recurrent_gemma"))
    assert recurrent.num_hidden_layers == 3 and "attention" in recurrent.block_types


def test_period_and_offset_pairs_still_select_a_kept_layer():
    """Jamba puts attention in layers i % 8 == 4 of 32 and experts in i % 2 == 1: among the
    layers kept, some are attention and some not, some MoE and some not."""
    big = _default("jamba")
    small = shrink_config(big)
    layers = range(small.num_hidden_layers)
    assert small.num_hidden_layers < big.num_hidden_layers
    for kind in ("attn_layer", "expert_layer"):
        period, offset = getattr(small, f"{kind}_period"), getattr(small, f"{kind}_offset")
        chosen = [i % period == offset for i in layers]
        assert any(chosen) and not all(chosen), (kind, period, offset)


def test_lists_of_layer_indices_are_renumbered_not_cut():
    """Llama-4 names its MoE layers by index (all 48) next to per-layer lists: two layers
    hold its two kinds (chunked with RoPE, full without), and both stay MoE layers."""
    big = _default("llama4_text")
    assert big.moe_layers == list(range(big.num_hidden_layers))
    small = shrink_config(big)
    assert small.num_hidden_layers == 2 and small.moe_layers == [0, 1]
    assert set(small.layer_types) == set(big.layer_types)
    assert sorted(small.no_rope_layers) == [0, 1]


def test_head_widths_are_scaled_by_one_factor():
    """DeepSeek-V3's MLA: q·k runs over nope + rope dims, so qk_head_dim = qk_nope_head_dim +
    qk_rope_head_dim must hold after the shrinking too."""
    big = _default("deepseek_v3")
    assert big.qk_head_dim == big.qk_nope_head_dim + big.qk_rope_head_dim
    small = shrink_config(big)
    assert small.qk_head_dim == small.qk_nope_head_dim + small.qk_rope_head_dim
    assert small.qk_head_dim < big.qk_head_dim
    # experts: two per group of the router's n_group groups (at most COUNT)
    assert small.num_experts_per_tok <= small.n_routed_experts
    assert small.n_routed_experts <= 2 * shrinker.COUNT < big.n_routed_experts


def test_groups_of_experts_keep_two_experts_each():
    """DeepSeek-V3's router takes the top 2 experts of each of n_group groups, then the best
    topk_group groups: 256 experts in 8 groups shrink to 4 groups of 2 experts (not 4 groups
    of 1, where top-2 within a group is out of range), top-k ≤ experts of the groups chosen."""
    small = shrink_config(transformers.DeepseekV3Config(n_routed_experts=256, n_group=8,
                                                       topk_group=4, num_experts_per_tok=8))
    experts, groups = small.n_routed_experts, small.n_group
    assert experts % groups == 0 and experts // groups >= 2
    assert small.topk_group <= groups
    assert small.num_experts_per_tok <= small.topk_group * experts // groups


def test_a_list_of_layer_indices_is_known_by_its_name_and_renumbered():
    """LFM2 names its attention layers ``full_attn_idxs`` (all 32 by default): a list of
    layer indices, not 32 kinds of layer, so the model shrinks to 2 layers, both attention."""
    small = shrink_config(transformers.Lfm2Config(num_hidden_layers=32))
    assert small.num_hidden_layers == shrinker.LAYERS
    assert small.full_attn_idxs == [0, 1] and small.layer_types == ["full_attention"] * 2


def test_a_count_of_some_layers_keeps_its_share():
    """Gemma-3n shares the keys of its last 15 of 35 layers: shrunk, some layers still make
    keys and some reuse them (not all shared); per-layer widths and per-layer vocabularies
    are shrunk as single ones are."""
    big = _default("gemma3n_text")
    small = shrink_config(big)
    assert 0 < small.num_kv_shared_layers < small.num_hidden_layers
    assert max(small.intermediate_size) <= shrinker.WIDTH
    assert len(small.intermediate_size) == small.num_hidden_layers
    assert small.vocab_size_per_layer_input <= shrinker.WIDTH


def test_a_top_k_of_experts_left_none_is_set_where_experts_are_counted():
    """DeepSeek-V2's default leaves num_experts_per_tok None (its router calls topk(k=None)):
    shrunk, it is a top-k within the experts kept; a config that counts no experts keeps
    its None."""
    big = transformers.DeepseekV2Config()
    assert big.num_experts_per_tok is None
    small = shrink_config(big)
    assert 1 <= small.num_experts_per_tok <= small.n_routed_experts

    class NoExperts(transformers.PreTrainedConfig):
        model_type = "test-no-experts"

        def __init__(self, hidden_size=512, num_experts_per_tok=None, **kwargs):
            self.hidden_size, self.num_experts_per_tok = hidden_size, num_experts_per_tok
            super().__init__(**kwargs)

    assert shrink_config(NoExperts()).num_experts_per_tok is None


@pytest.mark.parametrize("model_type, heads, head_dim, expand", [
    ("mamba2", "num_heads", "head_dim", "expand"),
    ("bamba", "mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("granitemoehybrid", "mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("zamba2", "n_mamba_heads", "mamba_headdim", "mamba_expand"),
    ("nemotron_h", "mamba_num_heads", "mamba_head_dim", "expand")])
def test_a_mixers_heads_keep_its_inner_width(model_type, heads, head_dim, expand):
    """A Mamba-2 mixer splits its inner width expand·d in n_heads heads of head_dim (the
    config class checks it, or the mixer's reshape fails): the product holds after the
    shrinking, under each family's own field names."""
    big = _default(model_type)
    assert getattr(big, heads) * getattr(big, head_dim) == getattr(big, expand) * big.hidden_size
    small = shrink_config(big)
    assert small.hidden_size < big.hidden_size and getattr(small, heads) <= shrinker.COUNT
    assert getattr(small, heads) * getattr(small, head_dim) \
        == getattr(small, expand) * small.hidden_size


def test_a_mixers_heads_keep_a_width_of_their_name():
    """Falcon-H1 sets its mixer's inner width apart (mamba_d_ssm = n_heads·d_head, not
    expand·d): it is capped and the heads still fill it. Heads and a width of another name
    (an indexer's 16 heads of 128 = 2048 = its top-k) are left alone."""
    big = _default("falcon_h1")
    assert big.mamba_n_heads * big.mamba_d_head == big.mamba_d_ssm != big.mamba_expand * \
        big.hidden_size
    small = shrink_config(big)
    assert small.mamba_n_heads * small.mamba_d_head == small.mamba_d_ssm <= shrinker.WIDTH

    class Indexer(transformers.PreTrainedConfig):
        model_type = "test-indexer"

        def __init__(self, hidden_size=4096, index_n_heads=16, index_head_dim=128,
                     index_topk=2048, **kwargs):
            self.hidden_size, self.index_n_heads = hidden_size, index_n_heads
            self.index_head_dim, self.index_topk = index_head_dim, index_topk
            super().__init__(**kwargs)

    indexer = shrink_config(Indexer())
    assert (indexer.index_head_dim, indexer.index_topk) == (128, 2048)


def test_two_layers_of_each_kind_on_demand():
    """Zamba ties the shared transformer of every hybrid layer to the first one's: with one
    hybrid layer there is nothing to tie (its constructor refuses). ``per_kind=2`` keeps two
    layers of each kind the model has twice or more, one layer of a kind it has once."""
    big = _default("zamba")
    one, two = shrink_config(big), shrink_config(big, per_kind=2)
    assert sorted(one.layers_block_type) == ["hybrid", "linear_attention"]
    assert sorted(two.layers_block_type) == ["hybrid"] * 2 + ["linear_attention"] * 2
    assert two.num_hidden_layers == len(two.layers_block_type) == 4
    axk1 = _default("axk1")           # one dense layer, then MoE layers
    assert shrink_config(axk1, per_kind=2).num_hidden_layers == 3


def test_a_width_named_by_another_sub_config_follows_its_width():
    """BLT's local decoder reads the global transformer's states: its hidden_size_global is
    global_config.hidden_size, before and after shrinking; a width equal to it by chance
    (the patcher's intermediate_size) is not linked. Its hash vocabulary is a vocabulary."""
    big = _default("blt")
    assert big.decoder_config.hidden_size_global == big.global_config.hidden_size \
        == big.patcher_config.intermediate_size
    small = shrink_config(big)
    width = small.global_config.hidden_size
    assert width < big.global_config.hidden_size
    assert small.decoder_config.hidden_size_global == small.encoder_config.hidden_size_global \
        == width
    assert small.patcher_config.intermediate_size == shrinker.WIDTH != width
    assert small.encoder_hash_byte_group_vocab <= shrinker.WIDTH
