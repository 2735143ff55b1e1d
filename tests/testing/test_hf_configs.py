"""``geoscale_fx.testing.hf_configs``: a family's default config shrunk, its random-weight model built
(or refused by name), the ``Auto`` class of a config and the token inputs of one call. The
shrinking itself: tests/testing/test_hf_config_shrinker.py."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.testing import hf_config_shrinker, hf_configs

pytestmark = pytest.mark.zoo
transformers = pytest.importorskip("transformers")


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


def test_a_model_with_language_adapters_answers_in_its_first_language():
    """X-MOD routes each token through the adapter of an input language and refuses a call
    without one: the tiny model is set to the config's first language and answers."""
    model = hf_configs.tiny_model("xmod")
    assert model.config.default_language == model.config.languages[0]
    logits = model(**hf_configs.token_inputs(model, seq_len=8)).logits
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()


def test_tiny_config_is_the_shrunk_default_with_the_overrides_set_after():
    """Overrides win over the shrunk values; everything else is what shrinking the family's
    default config gives."""
    small = hf_configs.tiny_config("llama", num_hidden_layers=3, vocab_size=1000)
    expected = hf_config_shrinker.shrink_config(transformers.AutoConfig.for_model("llama"))
    assert (small.num_hidden_layers, small.vocab_size) == (3, 1000)
    assert (expected.num_hidden_layers, expected.vocab_size) == (2, 128)
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings"):
        assert getattr(small, field) == getattr(expected, field), field


def test_an_unknown_or_unbuildable_family_is_named(monkeypatch):
    with pytest.raises(ValueError, match=r"model type 'no-such-family': not a transformers "
                                         r"model type"):
        hf_configs.tiny_config("no-such-family")

    def refuse(config, **kwargs):
        raise RuntimeError("the constructor says no")

    with monkeypatch.context() as patch:
        patch.setattr(hf_configs, "shrink_config", refuse)
        with pytest.raises(ValueError, match=r"model type 'llama': its shrunk config is "
                                             r"refused \(RuntimeError: the constructor says no\)"):
            hf_configs.tiny_config("llama")
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


def test_causal_lm_class_is_the_auto_class_else_the_saved_architecture():
    """Emu3's and Mllama's causal LMs are saved with text configs (``emu3_text_model``,
    ``mllama_text_model``) that ``AutoModelForCausalLM`` does not map: their
    ``architectures`` name the class. Neither: a ValueError naming the model type."""
    assert hf_configs.causal_lm_class(transformers.LlamaConfig()) is \
        transformers.AutoModelForCausalLM
    text = transformers.Emu3TextConfig(architectures=["Emu3ForCausalLM"])
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_config(text)
    assert hf_configs.causal_lm_class(text) is transformers.Emu3ForCausalLM
    text.architectures = ["NoSuchModel"]
    with pytest.raises(ValueError, match=r"'emu3_text_model' \(Emu3TextConfig\): "
                                         r"AutoModelForCausalLM has no class for it"):
        hf_configs.causal_lm_class(text)


def test_causal_lm_types_name_the_causal_lm_classes():
    types = hf_configs.causal_lm_types()
    assert types["llama"] == "LlamaForCausalLM" and types["gpt2"] == "GPT2LMHeadModel"
    assert "t5" not in types and len(types) > 50


def test_model_from_config_is_seeded_and_leaves_the_global_rng_alone():
    config = hf_configs.tiny_config("llama")
    state = torch.random.get_rng_state()
    first, again = (hf_configs.model_from_config(config, seed=3) for _ in range(2))
    other = hf_configs.model_from_config(config, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first.state_dict()[weight], again.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])
    assert not first.training


def test_token_inputs_stay_below_the_vocabulary_and_turn_the_cache_off():
    """Ids below the input embedding's rows (not config.vocab_size), the same
    ids on every call, and ``use_cache=False``: a forward that takes no cache gets no flag."""
    model = hf_configs.tiny_model("llama")
    model.resize_token_embeddings(50)
    model.config.vocab_size = 10_000                    # the embedding's rows decide
    inputs = hf_configs.token_inputs(model, batch=3, seq_len=7)
    assert set(inputs) == {"input_ids", "use_cache"} and inputs["use_cache"] is False
    ids = inputs["input_ids"]
    assert ids.shape == (3, 7) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 50
    assert torch.equal(hf_configs.token_inputs(model, batch=3, seq_len=7)["input_ids"], ids)

    class NoCache(torch.nn.Module):
        config = model.config

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            return input_ids

    assert set(hf_configs.token_inputs(NoCache())) == {"input_ids"}


def test_a_model_tying_a_layer_to_another_of_its_kind_is_built_from_two_of_each():
    """Zamba ties every hybrid layer's shared transformer to the first one's and refuses a
    model with one hybrid layer: the tiny model is retried with two layers of each kind."""
    model = hf_configs.tiny_model("zamba")
    assert model.config.layers_block_type.count("hybrid") == 2
    logits = model(**hf_configs.token_inputs(model, seq_len=8)).logits
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()


def test_the_cache_is_turned_off_through_a_forward_that_passes_its_kwargs_on():
    """GraniteMoeHybrid's causal LM takes ``**kwargs`` and hands them to its base model,
    which takes ``use_cache``: with a cache on, its default (Mamba layers only, no attention)
    fails asking the cache its length, so the flag goes through the kwargs."""
    model = hf_configs.tiny_model("granitemoehybrid")
    inputs = hf_configs.token_inputs(model, seq_len=8)
    assert inputs["use_cache"] is False
    logits = model(**inputs).logits
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()
