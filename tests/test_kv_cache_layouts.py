"""KV-cache scales for caches that do not hold the attention's keys per layer 0..n-1.

* **MLA** (``deepseek_v3``): transformers caches the compressed latent — keys slot ``kv_c``
  after ``kv_a_layernorm`` ``(B, 1, L, r)``, values slot the rotated ``k_pe`` ``(B, 1, L,
  d_rope)`` — and expands it by ``kv_b_proj`` after the read. The scales bound the latent:
  one per layer, k and v equal (vLLM's MLA cache stores both in one entry under
  ``k_scale``), no ``q_scale``.
* **A hybrid** (``qwen3_next``: ``layer_types`` linear, full): only cache layer 1 holds keys
  and values; layer 0 (a ``LinearAttentionLayer``) gets no scale and the export names it.

Each family's tiny model is saved; the streamed export must equal the in-memory one bit for
bit, and the scales must bound what the model itself caches on random prompts and the
adversarial one (the token of largest embedding norm, repeated): per cache layer, the layer's
writer found by watching ``Cache.update`` (``bench.export_families``), independently of
geoscale's mapping. ``kv_cache="fp8"`` generation on the MLA model stays close to the
unquantized greedy output. Layers reusing another layer's cache (Gemma 3n) take its k/v scales.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import geoscale_fx
from bench.export_families import _prompts, cached_amax, compare_with_cache
from geoscale_fx import hf_configs
from geoscale_fx.export import export_kv_scales

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

#: model type -> (cache layers holding keys, cache layers holding none, latent)
LAYOUTS = {"deepseek_v3": ([0, 1], [], True), "qwen3_next": ([1], [0], False)}


def _saved(model_type: str, path: Path) -> Path:
    torch.manual_seed(0)
    hf_configs.tiny_model(model_type).save_pretrained(path)
    return path


def _loaded(path: Path, **kwargs):
    config = transformers.AutoConfig.from_pretrained(path)
    return hf_configs.causal_lm_class(config).from_pretrained(path, **kwargs).eval()


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_both_routes_bound_what_the_model_caches(model_type, tmp_path):
    written, unwritten, latent = LAYOUTS[model_type]
    ckpt = _saved(model_type, tmp_path / "ckpt")
    got = export_kv_scales(ckpt, tmp_path / "streamed", strategy="head")
    model = _loaded(ckpt)
    ids = hf_configs.token_inputs(model, seq_len=8)["input_ids"]
    ref = export_kv_scales(model, tmp_path / "in-memory", input_ids=ids, strategy="head")
    assert got.tensors.keys() == ref.tensors.keys()
    assert all(torch.equal(got.tensors[n], t) for n, t in ref.tensors.items())
    sites = [f"model.layers.{i}.self_attn" for i in written]
    assert got.cache_layers == dict(zip(written, sites)) and sorted(got.not_cached) == unwritten
    assert got.latent == (tuple(sites) if latent else ())
    kinds = "kv" if latent else "kvq"
    assert sorted(got.tensors) == sorted(f"{s}.{k}_scale" for s in sites for k in kinds)
    if latent:              # one scale per layer for the whole latent entry
        for site in sites:
            k, v = got.tensors[f"{site}.k_scale"], got.tensors[f"{site}.v_scale"]
            assert k.shape == (1, 1, 1) and torch.equal(k, v)
    else:
        assert "LinearAttentionLayer" in got.not_cached[0]
    eager = _loaded(ckpt, attn_implementation="eager")
    layers, notes = cached_amax(eager, sites, _prompts(eager))
    assert sorted(i for i, e in layers.items() if e["k"] is not None) == written
    ratios, violations, more = compare_with_cache(got.tensors, layers)
    assert not notes and violations == 0 and not more, more
    assert ratios and max(ratios) <= 1 and min(ratios) > 0.01


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
