"""A checkpoint with one cache layer refused: the others are exported, the refused one named.

The model is a real family's: OLMo-hybrid (transformers' ``olmo_hybrid``, shrunk config) with
``layer_types = [full, linear, full]``. OLMo normalizes after the projections, so its
attentions' inputs are bounded only by value (the residual stream from the embeddings,
``analysis/norms/parameter_bound.py``): layer 0's is (the embeddings alone), layer 2's is not (the
residual after the linear-attention layer reaches an op no weight bounds). Cache layer 1 is
a ``LinearAttentionLayer`` (no keys or values). So cache layer 0 must be exported under its
own index, layer 1 named as holding none, layer 2 refused — left out of the file, listed
with its reason and remedy, said in a warning — and, in the streamed route, never read.
``all_or_nothing=True`` (``--all-or-nothing``) refuses the whole export and writes nothing;
the FP8 KV cache of ``generate`` stays strict.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from bench.export_families import _prompts, cached_amax, compare_with_cache
from geoscale_fx.testing import hf_configs
from geoscale_fx.cli import main
from geoscale_fx.export.kv_scales import export_kv_scales
from geoscale_fx.kv_cache.manager import KVCacheManager
from geoscale_fx.kv_cache.weight_scales import WeightKVScales
from tests.float_checks import SCALE_ULPS, assert_tensors_close_ulps

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

LAYER_TYPES = ["full_attention", "linear_attention", "full_attention"]
SITE = "model.layers.{}.self_attn".format
EXPORTED = [f"{SITE(0)}.{kind}_scale" for kind in "kvq"]
REFUSED = r"cache layer 2 \(`model.layers.2.self_attn`\): the stored values `\w+` cannot be " \
          r"bounded from the weights \(no normalization before the projection"


def _model():
    config = hf_configs.tiny_config("olmo_hybrid", per_kind=1)
    config.layer_types, config.num_hidden_layers = LAYER_TYPES, len(LAYER_TYPES)
    return hf_configs.model_from_config(config, seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("olmo_hybrid") / "ckpt"
    _model().save_pretrained(path)
    return path


def _loaded(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _ids(model) -> torch.Tensor:
    return hf_configs.token_inputs(model, seq_len=8)["input_ids"]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_the_refused_layer_is_left_out_and_the_others_keep_their_index(ckpt, tmp_path,
                                                                       checkpoint_reads, caplog):
    from safetensors.torch import load_file

    reads = checkpoint_reads
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        got = export_kv_scales(ckpt, tmp_path / "streamed", strategy="head")
    assert sorted(got.tensors) == sorted(EXPORTED)
    assert sorted(load_file(str(tmp_path / "streamed" / "kv_scales.safetensors"))) == \
        sorted(EXPORTED)
    assert got.cache_layers == {0: SITE(0)}
    assert list(got.not_cached) == [1] and "LinearAttentionLayer" in got.not_cached[1]
    assert list(got.left_at_default) == [2]
    refusal = got.left_at_default[2]
    assert refusal.site == SITE(2) and "no normalization before the projection" in \
        refusal.reason and "LayerNorm or RMSNorm precedes the projection" in refusal.remedy
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 2 cache layers left without scales" in warnings[0]
    assert refusal.message("export_kv_scales") in warnings[0]
    # the refusal came from the trace: layer 0's tensors were read, none of layer 2's
    assert any(n.startswith("model.layers.0.") for n in reads)
    assert not any(n.startswith("model.layers.2.") for n in reads), reads


def test_both_routes_agree_and_the_scales_bound_what_layer_0_caches(ckpt, tmp_path):
    got = export_kv_scales(ckpt, tmp_path / "streamed", strategy="head")
    model = _loaded(ckpt)
    ref = export_kv_scales(model, tmp_path / "in-memory", input_ids=_ids(model),
                           strategy="head")
    # both routes round up float64 bounds of the same per-head math: a float64 sum in another
    # order (other head batches, other kernels) can move a round-up by one float32 ulp
    assert_tensors_close_ulps(got.tensors, ref.tensors, ulps=SCALE_ULPS)
    assert got.left_at_default == ref.left_at_default and got.not_cached == ref.not_cached
    eager = _loaded(ckpt, attn_implementation="eager")
    layers, notes = cached_amax(eager, [SITE(0), SITE(2)], _prompts(eager))
    assert not notes and sorted(i for i, e in layers.items() if e["k"] is not None) == [0, 2]
    assert layers[2]["sites"] == {SITE(2)}            # written by the refused attention
    del layers[2]
    ratios, violations, more = compare_with_cache(got.tensors, layers)
    assert violations == 0 and not more, more
    assert len(ratios) == 2 * eager.config.num_key_value_heads and max(ratios) <= 1


def test_all_or_nothing_refuses_and_writes_nothing(ckpt, tmp_path):
    before = _files(ckpt)
    with pytest.raises(ValueError, match=rf"^export_kv_scales: {REFUSED}.*LayerNorm or RMSNorm"):
        export_kv_scales(ckpt, all_or_nothing=True)        # merged into ckpt: refused first
    assert _files(ckpt) == before
    model = _loaded(ckpt)
    with pytest.raises(ValueError, match=rf"^export_kv_scales: {REFUSED}"):
        export_kv_scales(model, tmp_path / "out", input_ids=_ids(model), all_or_nothing=True)
    assert not (tmp_path / "out").exists()


def test_cli_lists_the_layers_left_out_and_refuses_with_the_flag(ckpt, tmp_path, capsys):
    assert main(["export-kv-scales", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "1 left without scales" in out and "--all-or-nothing refuses instead" in out
    assert "  cache layer 2 (`model.layers.2.self_attn`): the stored values" in out
    config = json.loads((tmp_path / "out" / "quantization_config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    assert main(["export-kv-scales", str(ckpt), "--out", str(tmp_path / "refused"),
                 "--all-or-nothing"]) == 2
    assert "cache layer 2 (`model.layers.2.self_attn`)" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_the_fp8_cache_of_generate_stays_strict(ckpt):
    """Only the export leaves layers out: the runtime's scales must cover every layer it
    quantizes, so a refused layer is a ``ValueError`` there, naming it and the fallback."""
    model = _loaded(ckpt)
    with pytest.raises(ValueError, match=rf"^kv_cache: {REFUSED}"):
        WeightKVScales(model).capture(_ids(model))
    with pytest.raises(ValueError, match=rf"^kv_cache: {REFUSED}.*Meanwhile kv_cache=None "
                                         "runs this model"):
        KVCacheManager(model, "fp8").new_cache(_ids(model))
