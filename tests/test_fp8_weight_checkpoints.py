"""KV-cache scales of an FP8-weight checkpoint, by both routes.

The checkpoint is made here (no hub): a seeded tiny Llama in bfloat16 (hidden 256, so the
q/k/v weights span two 128-wide blocks), saved, then every linear's weight replaced by its
``float8_e4m3fn`` values with ``weight_scale_inv`` per 128×128 block and ``config.json``'s
``quantization_config`` set — as transformers' fine-grained FP8 integration saves them.
The streamed route (``export_kv_scales(<directory>)``) must equal the in-memory route on
the model ``from_pretrained`` loads (on the CPU it dequantizes the weights) bit for bit,
and the scales must hold for what that model caches. The streamed route read the FP8
numbers as weights before (scales 5000× off).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from geoscale_fx.export.kv_scales import export_kv_scales

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.zoo

BLOCK = 128
CONFIG = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=384, vocab_size=128,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, scale_inv)``: each 128×128 block of ``w`` scaled so its amax is 448."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    bits = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            bits[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = \
                (block / scale[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return bits, scale


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.to(torch.bfloat16).save_pretrained(path)
    stored = safetensors_torch.load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in stored.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = _fp8_blocks(t)
        else:
            out[name] = t
    safetensors_torch.save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype is torch.bfloat16
    return model


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_streamed_equals_in_memory_and_holds_for_the_cache(checkpoint, loaded, strategy,
                                                           tmp_path):
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = export_kv_scales(loaded, tmp_path / "memory", input_ids=ids, strategy=strategy)
    got = export_kv_scales(checkpoint, tmp_path / "streamed", strategy=strategy)
    assert got.tensors.keys() == ref.tensors.keys() and len(got.tensors) == 2 * 3
    for name, t in ref.tensors.items():
        assert torch.equal(got.tensors[name], t), name
    # certified for what the model caches, on prompts it never saw
    with torch.no_grad():
        out = loaded(input_ids=torch.randint(0, 128, (4, 32),
                                             generator=torch.Generator().manual_seed(3)),
                     use_cache=True)
    for i, layer in enumerate(out.past_key_values.layers):
        for role, cached in (("k", layer.keys), ("v", layer.values)):
            amax = cached.float().abs().amax(dim=(0, 2, 3))                  # per kv head
            scale = got.tensors[f"model.layers.{i}.self_attn.{role}_scale"].float()
            assert bool((amax <= scale * 448.0).all()), (i, role)
            assert float((amax / (scale * 448.0)).max()) > 0.05           # not vacuous


def test_merging_into_the_fp8_checkpoint_is_refused_naming_its_method(checkpoint):
    before = (checkpoint / "config.json").read_text()
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        export_kv_scales(checkpoint)
    assert (checkpoint / "config.json").read_text() == before
