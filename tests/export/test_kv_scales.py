"""geoscale_fx.export.kv_scales: ``scale_tensors`` on hand-made bounds (B / 448 rounded up to float32),
the compressed-tensors config dicts, and the refusals of ``export_kv_scales`` that leave the
output directory untouched. tests/test_export_kv_scales.py covers Hugging Face models."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from geoscale_fx.export import kv_scales as export
from geoscale_fx.export.compressed_tensors import kv_cache_scheme, quantization_config
from geoscale_fx.export.kv_scales import WRITERS, KVExportOptions, export_kv_scales, scale_tensors
from tests.attention_variants import Block


def _layers():
    b = lambda *v: torch.tensor(v, dtype=torch.float64)                    # noqa: E731
    return [export.LayerScales(0, "m.0.attn", b(1.0, 2.0, 3.0, 4.0), b(448.0, 0.1), b(0.0, 0.0)),
            export.LayerScales(1, "m.1.attn", b(5.0, 6.0, 7.0, 8.0), b(9.0, 10.0), b(1.0, 3.0))]


def _smallest_f32_at_least(x: float) -> float:
    """float64 reference: the float32 nearest x, stepped up once if it fell below."""
    f = torch.tensor(x, dtype=torch.float32)
    if f.double() < x:
        f = torch.nextafter(f, torch.tensor(float("inf")))
    return float(f)


def test_per_tensor_scales_are_the_max_bound_over_r_max_rounded_up():
    out = scale_tensors(_layers(), KVExportOptions())
    assert sorted(out) == ["m.0.attn.k_scale", "m.0.attn.q_scale", "m.0.attn.v_scale",
                           "m.1.attn.k_scale", "m.1.attn.q_scale", "m.1.attn.v_scale"]
    assert all(t.dtype == torch.float32 and t.shape == (1,) for t in out.values())
    assert float(out["m.0.attn.k_scale"]) == 1.0                             # 448 / 448
    assert float(out["m.1.attn.q_scale"]) == _smallest_f32_at_least(8.0 / 448)
    assert float(out["m.1.attn.v_scale"]) == _smallest_f32_at_least(3.0 / 448)
    assert float(out["m.0.attn.v_scale"]) > 0                                # B = 0: floored


def test_per_head_scales_and_without_q():
    out = scale_tensors(_layers(), KVExportOptions(strategy="head", include_q=False))
    assert sorted(out) == ["m.0.attn.k_scale", "m.0.attn.v_scale", "m.1.attn.k_scale",
                           "m.1.attn.v_scale"]
    k = out["m.1.attn.k_scale"]
    assert k.shape == (2, 1, 1)
    assert k.flatten().tolist() == [_smallest_f32_at_least(9 / 448),
                                    _smallest_f32_at_least(10 / 448)]
    assert bool((k.flatten().double() * 448 >= torch.tensor([9.0, 10.0])).all())


def test_a_latent_cache_takes_one_scale_for_the_whole_entry_and_no_q_scale():
    """MLA: the keys slot holds kv_c (bound 11.3), the values slot k_pe (bound 1.5); vLLM's
    MLA cache stores both in one entry under ``k_scale``: k and v scales are both
    max(11.3, 1.5) / 448, one per layer, whatever the strategy; no q_scale."""
    b = lambda *v: torch.tensor(v, dtype=torch.float64)                    # noqa: E731
    latent = export.LayerScales(0, "m.0.attn", b(1.0, 2.0), b(11.3), b(1.5), latent=True)
    for strategy, shape in (("tensor", (1,)), ("head", (1, 1, 1))):
        out = scale_tensors([latent], KVExportOptions(strategy=strategy))
        assert sorted(out) == ["m.0.attn.k_scale", "m.0.attn.v_scale"]
        ref = _smallest_f32_at_least(11.3 / 448)
        assert all(t.shape == shape and float(t) == ref for t in out.values())


def test_an_attention_writing_several_layers_takes_their_max():
    """A shared block called at two layers (Zamba): one set of scales bounding both."""
    b = lambda *v: torch.tensor(v, dtype=torch.float64)                    # noqa: E731
    layers = [export.LayerScales(1, "shared.attn", b(1.0), b(4.0, 1.0), b(1.0, 2.0)),
              export.LayerScales(3, "shared.attn", b(1.0), b(2.0, 3.0), b(5.0, 1.0))]
    out = scale_tensors(layers, KVExportOptions(strategy="head"))
    assert sorted(out) == ["shared.attn.k_scale", "shared.attn.q_scale", "shared.attn.v_scale"]
    assert out["shared.attn.k_scale"].flatten().tolist() == [
        _smallest_f32_at_least(4 / 448), _smallest_f32_at_least(3 / 448)]
    assert out["shared.attn.v_scale"].flatten().tolist() == [
        _smallest_f32_at_least(5 / 448), _smallest_f32_at_least(2 / 448)]


def test_an_attention_reusing_a_layers_cache_gets_its_kv_scales_and_its_own_q():
    """KV sharing (Gemma 3n): an engine dequantizes what ``m.3.attn`` reads from layer 1's
    cache with m.3's own k/v scales: they must be layer 1's."""
    b = lambda *v: torch.tensor(v, dtype=torch.float64)                    # noqa: E731
    layer = export.LayerScales(1, "m.1.attn", b(1.0), b(9.0), b(3.0),
                               readers=(("m.3.attn", b(448.0)),))
    out = scale_tensors([layer], KVExportOptions())
    assert sorted(out) == [f"m.{i}.attn.{k}_scale" for i in (1, 3) for k in "kqv"]
    for kind in "kv":
        assert torch.equal(out[f"m.3.attn.{kind}_scale"], out[f"m.1.attn.{kind}_scale"])
    assert float(out["m.3.attn.q_scale"]) == 1.0 and float(out["m.1.attn.q_scale"]) < 1.0


def test_quantization_config_is_a_kv_cache_only_compressed_tensors_config():
    config = quantization_config(KVExportOptions(strategy="head"))
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "dense"
    assert config["config_groups"] == {} and config["quantization_status"] == "frozen"
    assert config["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True,
                                         "group_size": None, "strategy": "attn_head",
                                         "dynamic": False}
    assert kv_cache_scheme(KVExportOptions())["strategy"] == "tensor"


def test_in_memory_export_writes_scales_and_config_fragment(tmp_path):
    model = nn.Sequential()
    model.add_module("attn", Block().eval())
    result = export_kv_scales(model, tmp_path, torch.randn(1, 4, 64))
    assert not result.merged and sorted(p.name for p in tmp_path.iterdir()) == [
        "kv_scales.safetensors", "quantization_config.json"]
    assert sorted(result.tensors) == ["attn.k_scale", "attn.q_scale", "attn.v_scale"]
    fragment = json.loads((tmp_path / "quantization_config.json").read_text())
    assert fragment == {"quantization_config": quantization_config(KVExportOptions())}


def test_refusals_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="out_dir is needed for an in-memory model"):
        export_kv_scales(Block(), None, torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="is not a module path of Block, so it names no"):
        export_kv_scales(Block().eval(), tmp_path, torch.randn(1, 4, 64))   # the root module
    with pytest.raises(ValueError, match=r"strategy='layer'; allowed values"):
        export_kv_scales(Block(), tmp_path, torch.randn(1, 4, 64), strategy="layer")
    with pytest.raises(ValueError, match=r"format='gguf'; allowed values: \['compressed-tensors'\]"):
        export_kv_scales(Block(), tmp_path, torch.randn(1, 4, 64), format="gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_format_is_one_writer_module_chosen_by_name(tmp_path):
    """``format=`` picks a writer from ``WRITERS``; a writer gets the format-neutral tensors
    and decides the files (here a stand-in that writes nothing and says so)."""
    written = {}

    class Recording:
        NAME = "recording"

        @staticmethod
        def check(options):
            if options.strategy != "tensor":
                raise ValueError("recording writes per-tensor scales only")

        @staticmethod
        def write(tensors, options, out):
            written.update(tensors)
            return {"format": "recording"}, [out / "nothing"], False

    model = nn.Sequential()
    model.add_module("attn", Block().eval())
    WRITERS["recording"] = Recording
    try:
        with pytest.raises(ValueError, match="per-tensor scales only"):
            export_kv_scales(model, tmp_path, torch.randn(1, 4, 64), format="recording",
                             strategy="head")
        result = export_kv_scales(model, tmp_path, torch.randn(1, 4, 64), format="recording")
    finally:
        del WRITERS["recording"]
    reference = export_kv_scales(model, tmp_path / "ct", torch.randn(1, 4, 64))
    assert result.quantization_config == {"format": "recording"} and list(tmp_path.iterdir()) == [tmp_path / "ct"]
    assert sorted(written) == sorted(reference.tensors)
    assert all(torch.equal(written[k], reference.tensors[k]) for k in written)
