"""geoscale_fx/export/checkpoint_keys.py: model parameters read under the names a checkpoint that
transformers 5.24 saved holds them by, on checkpoints ``save_pretrained`` wrote. What is read
is checked against the stored tensors, cut here by hand."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geoscale_fx.testing import hf_configs
from geoscale_fx.export.checkpoint_keys import CheckpointKeys
from geoscale_fx.export.safetensors_reader import CheckpointReader
from geoscale_fx.export.streamed_scales import checkpoint_layer_scales, meta_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo


def _saved(model_type: str, path: Path) -> Path:
    hf_configs.tiny_model(model_type).save_pretrained(path)
    return path


def test_legacy_layout_is_read_under_its_stored_names(tmp_path, checkpoint_reads):
    """Gemma 3 saved by transformers 5.x: every tensor the bounds read is read under the
    name the file holds, which is the module path with ``model.language_model`` written
    ``language_model.model``; nothing is read under the module path."""
    ckpt = _saved("gemma3", tmp_path / "ckpt")
    stored = set(CheckpointReader(ckpt).weight_map)
    reads = checkpoint_reads
    layers = checkpoint_layer_scales(ckpt).layers
    assert [s.site for s in layers] == [f"model.language_model.layers.{i}.self_attn"
                                        for i in range(2)]
    assert reads and set(reads) <= stored
    assert {n.split(".layers.")[0] for n in reads} == {"language_model.model"}
    assert "language_model.model.layers.1.self_attn.v_proj.weight" in reads


def _fused(ckpt: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))[name]


def test_converted_parameters_are_the_stored_rows(tmp_path):
    """hrm_text stores ``[gate | q | k | v]`` fused (``attn.gqkv_proj.weight``, 4 equal
    blocks: transformers' ``Chunk``); sarvam_moe ``[q | k | v]`` (``query_key_value``,
    rows by each parameter's size: ``Split``). The parameters read are those rows of the
    stored tensor, cut here by hand."""
    ckpt = _saved("hrm_text", tmp_path / "hrm")
    reader = CheckpointReader(ckpt)
    model = meta_model(ckpt, reader)
    keys = CheckpointKeys(model, reader)
    fused = _fused(ckpt, "model.L_module.layers.0.attn.gqkv_proj.weight")   # (4r, d)
    rows = fused.shape[0] // 4
    names = [f"model.L_module.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert all(keys.stored_names(n) == ["model.L_module.layers.0.attn.gqkv_proj.weight"]
               for n in names)
    got = keys.read(names)
    for i, name in enumerate(names, start=1):
        assert torch.equal(got[name], fused[i * rows:(i + 1) * rows]), name

    ckpt = _saved("sarvam_moe", tmp_path / "sarvam")
    reader = CheckpointReader(ckpt)
    model = meta_model(ckpt, reader)
    keys = CheckpointKeys(model, reader)
    fused = _fused(ckpt, "model.layers.0.attention.query_key_value.weight")
    params = dict(model.named_parameters())
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    got, start = keys.read(names), 0
    for name in names:
        size = params[name].shape[0]
        assert torch.equal(got[name], fused[start:start + size]), name
        start += size
    assert start == fused.shape[0]


def test_a_parameter_stored_under_its_own_name_is_read_as_stored(tmp_path):
    from safetensors.torch import load_file

    ckpt = _saved("llama", tmp_path / "ckpt")
    reader = CheckpointReader(ckpt)
    keys = CheckpointKeys(meta_model(ckpt, reader), reader)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert name in keys and keys.stored_names(name) == [name]
    assert keys.describe(name) == f"{name!r} in model.safetensors"
    stored = load_file(str(ckpt / "model.safetensors"))[name]
    assert torch.equal(keys.read([name])[name], stored)
    assert "model.layers.9.self_attn.k_proj.weight" not in keys
    with pytest.raises(ValueError, match=r"'model.layers.9.self_attn.k_proj.weight' is missing"):
        keys.read(["model.layers.9.self_attn.k_proj.weight"])


def test_converter_targets_named_as_its_run_on_meta_names_them(tmp_path):
    """The parameters a converter builds are found from names (its first target with the
    first pattern replaced by the others); running it on meta tensors of the stored
    shapes (``CheckpointReader.metas``: headers only) names the same parameters, with the
    shapes of the model's parameters."""
    ckpt = _saved("hrm_text", tmp_path / "ckpt")
    reader = CheckpointReader(ckpt)
    model = meta_model(ckpt, reader)
    keys = CheckpointKeys(model, reader)
    params = dict(model.named_parameters())
    stored = "model.L_module.layers.0.attn.gqkv_proj.weight"
    metas = reader.metas([stored])
    assert metas[stored].is_meta and metas[stored].shape == reader.read([stored])[stored].shape
    first = "model.L_module.layers.0.self_attn.gate_proj.weight"
    built = keys._convert(first, tensors=metas)
    prefix = "model.L_module.layers.0.self_attn."
    assert sorted(built) == sorted(prefix + f"{p}_proj.weight" for p in ("gate", "q", "k", "v"))
    for name, t in built.items():
        assert keys.stored_names(name) == [stored] and t.shape == params[name].shape
