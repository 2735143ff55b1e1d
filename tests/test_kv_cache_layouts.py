"""KV-cache scales for every cache layout: what each layer stores, per layer 0..n-1 or not.

* **MLA** (``deepseek_v3``): transformers caches the compressed latent — keys slot ``kv_c``
  after ``kv_a_layernorm`` ``(B, 1, L, r)``, values slot the rotated ``k_pe`` ``(B, 1, L,
  d_rope)`` — and expands it by ``kv_b_proj`` after the read. The scales bound the latent:
  one per layer, k and v equal (vLLM's MLA cache stores both in one entry under
  ``k_scale``), no ``q_scale``.
* **A hybrid** (``qwen3_next``: ``layer_types`` linear, full): only cache layer 1 holds keys
  and values; layer 0 (a ``LinearAttentionLayer``) gets no scale and the export names it.
* **Dense GQA** (``llama`` with 2 kv heads for 4 query heads): one k/v scale per stored kv
  head, one q scale per query head.
* **Sliding window** (``gemma2``, window 4 under prompts of 32: layer 0 is a sliding-window
  cache layer that drops entries, layer 1 a full one).
* **QK-norm** (``qwen3``: keys bounded by the ``k_norm`` gain alone) and **biased
  projections** (``qwen2``: q/k/v biases), their norm gains and biases drawn at random (a
  fresh model has gains 1 and biases 0, which would not exercise them).

Each family's tiny model is saved; the streamed export must equal the in-memory one bit for
bit, and the scales must bound what the model itself caches on random prompts and the
adversarial one (the token of largest embedding norm, repeated): per cache layer, the layer's
writer found by watching ``Cache.update`` (``bench.export_families``), independently of
geoscale's mapping. ``kv_cache="fp8"`` generation on the MLA model stays close to the
unquantized greedy output. Layers reusing another layer's cache (Gemma 3n) take its k/v scales.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import geoscale_fx
from bench.export_families import _prompts, cached_amax, compare_with_cache
from geoscale_fx.testing import hf_configs
from geoscale_fx.export.kv_scales import export_kv_scales
from geoscale_fx.kv_cache.layers import cache_layer_classes
from tests.float_checks import SCALE_ULPS, assert_tensors_close_ulps

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo


@dataclass(frozen=True)
class Layout:
    """A saved tiny model of ``model_type`` (its shrunk config, ``config`` overriding) and
    what its cache holds: the layers holding keys, those holding none, a latent or not;
    ``has`` checks that the model is what the case claims (a feature of its own)."""
    model_type: str
    written: list[int]
    has: Callable[[torch.nn.Module], bool]
    unwritten: list[int] = field(default_factory=list)
    latent: bool = False
    config: dict = field(default_factory=dict)
    random_vectors: bool = False       # norm gains and biases drawn at random


def _attn(model, i: int = 0):
    return model.model.layers[i].self_attn


def _fewer_kv_heads(model) -> bool:
    return model.config.num_key_value_heads < model.config.num_attention_heads


LAYOUTS = {
    "deepseek_v3": Layout("deepseek_v3", [0, 1], lambda m: _attn(m).kv_a_layernorm is not None,
                          latent=True),
    "qwen3_next": Layout("qwen3_next", [1], lambda m: "LinearAttentionLayer" in
                         cache_layer_classes(m.config)[0], unwritten=[0]),
    "llama_gqa": Layout("llama", [0, 1], _fewer_kv_heads, config={"num_key_value_heads": 2}),
    "gemma2_sliding": Layout("gemma2", [0, 1], lambda m: "Sliding" in cache_layer_classes(
        m.config)[0] and "Sliding" not in cache_layer_classes(m.config)[1],
                             config={"sliding_window": 4}),
    "qwen3_qk_norm": Layout("qwen3", [0, 1], lambda m: _attn(m).k_norm.weight.std() > 0.1,
                            random_vectors=True),
    "qwen2_bias": Layout("qwen2", [0, 1], lambda m: _attn(m).k_proj.bias.abs().min() > 0,
                         random_vectors=True),
}


def _saved(layout: Layout, path: Path) -> Path:
    config = hf_configs.tiny_config(layout.model_type, per_kind=1)
    for name, value in layout.config.items():
        setattr(config, name, value)
    model = hf_configs.model_from_config(config, seed=0)
    if layout.random_vectors:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in (p for p in model.parameters() if p.dim() == 1):
                p.copy_(torch.empty(p.shape).uniform_(-1.5, 1.5, generator=generator))
    assert layout.has(model)
    model.save_pretrained(path)
    return path


def _loaded(path: Path, **kwargs):
    config = transformers.AutoConfig.from_pretrained(path)
    return hf_configs.causal_lm_class(config).from_pretrained(path, **kwargs).eval()


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_both_routes_bound_what_the_model_caches(case, tmp_path):
    layout = LAYOUTS[case]
    written, unwritten, latent = layout.written, layout.unwritten, layout.latent
    ckpt = _saved(layout, tmp_path / "ckpt")
    got = export_kv_scales(ckpt, tmp_path / "streamed", strategy="head")
    model = _loaded(ckpt)
    ids = hf_configs.token_inputs(model, seq_len=8)["input_ids"]
    ref = export_kv_scales(model, tmp_path / "in-memory", input_ids=ids, strategy="head")
    # both routes round up float64 bounds of the same per-head math: a float64 sum in another
    # order (other head batches, other kernels) can move a round-up by one float32 ulp
    assert_tensors_close_ulps(got.tensors, ref.tensors, ulps=SCALE_ULPS, msg=case)
    sites = [f"model.layers.{i}.self_attn" for i in written]
    assert got.cache_layers == dict(zip(written, sites)) and sorted(got.not_cached) == unwritten
    assert got.latent == (tuple(sites) if latent else ())
    kinds = "kv" if latent else "kvq"
    assert sorted(got.tensors) == sorted(f"{s}.{k}_scale" for s in sites for k in kinds)
    assert got.left_at_default == {}
    eager = _loaded(ckpt, attn_implementation="eager")
    if latent:              # one scale per layer for the whole latent entry
        for site in sites:
            k, v = got.tensors[f"{site}.k_scale"], got.tensors[f"{site}.v_scale"]
            assert k.shape == (1, 1, 1) and torch.equal(k, v)
    else:                   # one scale per stored kv head, one per query head
        config = eager.config
        for site in sites:
            assert got.tensors[f"{site}.k_scale"].shape == (config.num_key_value_heads, 1, 1)
            assert got.tensors[f"{site}.q_scale"].shape == (config.num_attention_heads, 1, 1)
    for i in unwritten:
        assert "LinearAttentionLayer" in got.not_cached[i]
    layers, notes = cached_amax(eager, sites, _prompts(eager))
    assert sorted(i for i, e in layers.items() if e["k"] is not None) == written
    ratios, violations, more = compare_with_cache(got.tensors, layers)
    assert not notes and violations == 0 and not more, more
    assert ratios and max(ratios) <= 1 and min(ratios) > 0.01


@pytest.mark.slow
def test_layers_reusing_anothers_cache_get_its_kv_scales(tmp_path):
    """Gemma 3n's last layers reuse the keys and values of the last layer of their type
    (``DummyLayer`` cache layers): no cache layer of their own, but their attentions read
    entries stored with that layer's scales, so their k/v scales are that layer's."""
    torch.manual_seed(0)
    model = hf_configs.tiny_model("gemma3n_text").eval()
    ids = hf_configs.token_inputs(model, seq_len=8)["input_ids"]
    got = export_kv_scales(model, tmp_path, input_ids=ids, strategy="head")
    path = "model.layers.{}.self_attn".format
    assert got.cache_layers == {0: path(0), 1: path(1)} and sorted(got.not_cached) == [2, 3]
    assert got.shared == {path(2): 0, path(3): 1}
    for reader, layer in got.shared.items():
        for kind in "kv":
            assert torch.equal(got.tensors[f"{reader}.{kind}_scale"],
                               got.tensors[f"{path(layer)}.{kind}_scale"])
        assert f"{reader}.q_scale" in got.tensors


@pytest.mark.slow   # end-to-end decoding
def test_fp8_generate_on_mla_stays_close_to_the_unquantized_output():
    """It refused before ("1 key heads, but 4 k scales"); now each layer's FP8 latent cache
    has one k and one v scale, nothing saturates, and the first generated token's logits are
    within FP8's relative precision of the unquantized model's."""
    torch.manual_seed(0)
    model = hf_configs.tiny_model("deepseek_v3").eval()
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(5))

    def generate():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                 do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    ref_tokens, ref = generate()
    geoscale_fx.apply_(model, kv_cache="fp8", scaling="none", compiler="aot_eager")
    tokens, logits = generate()
    manager = model._geoscale_kv_cache
    assert [(l.layer, l.latent, l.k_bound.shape) for l in manager.last_layers] == [
        (0, True, (1,)), (1, True, (1,))]
    assert manager.saturated_total() == 0
    error = float((logits[0] - ref[0]).abs().max() / ref[0].abs().max())
    print(f"\ndeepseek_v3 fp8 latent cache: first-token logit error {error:.4f}")
    assert 0 < error < 0.05, error
    assert torch.equal(tokens[:, : ids.shape[1] + 1], ref_tokens[:, : ids.shape[1] + 1])
