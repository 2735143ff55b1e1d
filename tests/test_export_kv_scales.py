"""``export_kv_scales``: FP8 KV-cache scales from the weights, in compressed-tensors' layout.

The layout is checked against the packages that read it, not against our own constants:
compressed-tensors' ``apply_quantization_config`` (0.20.0) registers the parameters the
checkpoint must hold (names, shapes, dtypes), its pydantic ``QuantizationConfig`` validates the
config, and Hugging Face with compressed-tensors loads the merged checkpoint into those
parameters. vLLM's loader is re-implemented from its source (``maybe_remap_kv_scale_name``
in ``vllm/model_executor/model_loader/weight_utils.py``). The values are checked against the
float64 bounds of ``WeightKVScales``: scale = bound / R_max, rounded up to float32.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.cli import main
from geoscale_fx.export.compressed_tensors import quantization_config
from geoscale_fx.export.kv_scales import KVExportOptions, export_kv_scales
from geoscale_fx.kv_cache.weight_scales import WeightKVScales
from tests.hf_models import build_hf

pytestmark = pytest.mark.zoo

SITES = [f"model.layers.{i}.self_attn" for i in range(2)]      # llama-sdpa: 2 layers
N_Q, N_KV = 4, 2


def _ids() -> torch.Tensor:
    return torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def model():
    return build_hf("llama-sdpa")


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """strategy -> (export, out_dir); one trace each."""
    out = {}
    for strategy in ("tensor", "head"):
        d = tmp_path_factory.mktemp(strategy)
        out[strategy] = (export_kv_scales(model, d, _ids(), strategy=strategy), d)
    return out


def test_names_shapes_dtypes(exports):
    """``<attention path>.{k,v,q}_scale``, float32, ``(1,)`` per tensor, ``(heads, 1, 1)``
    per head (k/v: kv heads, q: query heads)."""
    expected = {"tensor": {"k": (1,), "v": (1,), "q": (1,)},
                "head": {"k": (N_KV, 1, 1), "v": (N_KV, 1, 1), "q": (N_Q, 1, 1)}}
    for strategy, (export, _) in exports.items():
        assert sorted(export.tensors) == sorted(f"{s}.{k}_scale" for s in SITES
                                                for k in "kvq")
        for name, t in export.tensors.items():
            assert t.dtype == torch.float32, name
            assert tuple(t.shape) == expected[strategy][name[-7]], (strategy, name)


def test_scales_are_bound_over_r_max_rounded_up(model, exports):
    """Each scale is the smallest float32 ≥ B / 448 (per head, or max over heads), B the
    float64 bound of ``WeightKVScales``; so ``|x| ≤ B`` gives ``|x / s| ≤ 448``."""
    layers = WeightKVScales(model).capture(_ids()).layers()
    limit = fp8_max("e4m3")
    assert limit == 448.0
    checked = 0
    for layer in layers:
        for kind, bound in (("k", layer.k_bound), ("v", layer.v_bound), ("q", layer.q_bound)):
            ideal = {"head": bound / limit, "tensor": bound.max().reshape(1) / limit}
            for strategy, (export, _) in exports.items():
                s = export.tensors[f"{layer.site}.{kind}_scale"].flatten()
                assert (s.double() >= ideal[strategy]).all()
                below = torch.nextafter(s, torch.zeros_like(s)).double()
                assert (below < ideal[strategy]).all()
                checked += s.numel()
        # the rounded-to-nearest scales of the FP8 cache differ by at most one ulp
        k_cache, _ = layer.scales("e4m3")
        head_k = exports["head"][0].tensors[f"{layer.site}.k_scale"].flatten()
        assert ((head_k - k_cache).abs() <= torch.finfo(torch.float32).eps * head_k).all()
    assert checked == 2 * 3 + 2 * (N_KV + N_KV + N_Q)


def test_safetensors_and_config_round_trip(exports):
    from safetensors.torch import load_file

    for strategy, (export, out) in exports.items():
        loaded = load_file(str(out / "kv_scales.safetensors"))
        assert loaded.keys() == export.tensors.keys()
        for name, t in export.tensors.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
        fragment = json.loads((out / "quantization_config.json").read_text())
        assert fragment == {"quantization_config": export.quantization_config}
        scheme = fragment["quantization_config"]["kv_cache_scheme"]
        assert scheme == {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                          "strategy": {"tensor": "tensor", "head": "attn_head"}[strategy],
                          "dynamic": False}
        assert fragment["quantization_config"]["quant_method"] == "compressed-tensors"
        assert not export.merged


def test_config_validates_with_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.quantization")
    for strategy, ct_strategy in (("tensor", "tensor"), ("head", "attn_head")):
        config = quantization_config(KVExportOptions(strategy=strategy))
        parsed = ct.QuantizationConfig.model_validate(config)
        assert parsed.kv_cache_scheme.strategy == ct_strategy
        assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.num_bits == 8
        assert parsed.kv_cache_scheme.symmetric and parsed.kv_cache_scheme.dynamic is False
        assert parsed.config_groups == {} and parsed.quant_method == "compressed-tensors"
        # the JSON round trip gives the same object (no field we write is dropped or renamed)
        assert ct.QuantizationConfig.model_validate(
            json.loads(json.dumps(config))).model_dump() == parsed.model_dump()


def _skip_reference_without_scales():
    """The reference registers no attention scale at all (compressed-tensors 0.20 with
    transformers 5.24: neither ``apply_quantization_config`` nor ``from_pretrained`` adds
    k/v/q scale parameters): it cannot judge our layout, so the comparison is skipped, loudly
    naming the versions (with transformers 5.23 it runs and passes)."""
    import compressed_tensors
    import transformers

    pytest.skip(f"compressed-tensors {compressed_tensors.__version__} registers no attention "
                f"scale parameters with transformers {transformers.__version__}")


def test_layout_equals_what_compressed_tensors_registers(exports):
    """compressed-tensors' own ``apply_quantization_config`` on the same model registers
    exactly our k/v (kv_cache_scheme) and q (attention scheme) parameters."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    for strategy, (export, _) in exports.items():
        fresh = build_hf("llama-sdpa")
        before = set(fresh.state_dict())
        kv_args = ct.QuantizationConfig.model_validate(export.quantization_config)
        attention = ct.QuantizationScheme(targets=["LlamaAttention"],
                                          input_activations=kv_args.kv_cache_scheme)
        config = ct.QuantizationConfig(config_groups={"attention": attention},
                                       kv_cache_scheme=kv_args.kv_cache_scheme,
                                       quantization_status="frozen")
        ct.apply_quantization_config(fresh, config)
        registered = {k: v for k, v in fresh.state_dict().items()
                      if k not in before and k.endswith("_scale")}
        if not registered:
            _skip_reference_without_scales()
        assert registered.keys() == export.tensors.keys()
        for name, param in registered.items():
            assert param.shape == export.tensors[name].shape, (strategy, name)
            assert param.dtype == export.tensors[name].dtype, (strategy, name)


def _vllm_remap(name: str, params: set[str]) -> str | None:
    """vLLM's ``maybe_remap_kv_scale_name`` (weight_utils.py, after PR #30141), the rules a
    ``self_attn.{q,k,v}_scale`` name can reach: the llm-compressor rule
    ``\\.self_attn\\.([qkv])_scale$ -> .self_attn.attn.\\1_scale``, then the default
    ``\\.([qkv])_scale$ -> .attn.\\1_scale``; a target not among the parameters -> None."""
    if not name.endswith((".k_scale", ".v_scale", ".q_scale")):
        return name
    for pattern, repl in ((r"\.self_attn\.([qkv])_scale$", r".self_attn.attn.\1_scale"),
                          (r"\.([qkv])_scale$", r".attn.\1_scale")):
        if re.search(pattern, name):
            target = re.sub(pattern, repl, name)
            return target if target in params else None
    return name


def _vllm_remap_before_q(name: str, params: set[str]) -> str | None:
    """The older rule (vLLM 0a1ee72, SGLang 57003be): ``.k_scale``/``.v_scale`` only,
    ``name.replace(".k_scale", ".attn.k_scale")``."""
    for suffix in (".k_scale", ".v_scale"):
        if name.endswith(suffix):
            target = name.replace(suffix, ".attn" + suffix)
            return target if target in params else None
    return name


def test_vllm_name_remapping_reaches_the_attention_parameters(exports):
    """vLLM's Attention layer ``<path>.attn`` has ``k_scale``/``v_scale``/``q_scale``; every
    exported name maps onto one of them, one to one. vLLM's per-head loader flattens
    ``(heads, 1, 1)`` and groups q heads by ``n_q / n_kv``."""
    params = {f"{s}.attn.{k}_scale" for s in SITES for k in "kvq"}
    for strategy, (export, _) in exports.items():
        mapped = {name: _vllm_remap(name, params) for name in export.tensors}
        assert set(mapped.values()) == params
        assert all(v == k.replace(".self_attn.", ".self_attn.attn.") for k, v in mapped.items())
        # no stacked-parameter rewrite (".q_proj" -> ".qkv_proj") touches our names
        assert not any(p in n for n in mapped.values() for p in (".q_proj", ".k_proj",
                                                                 ".v_proj"))
        older = {name: _vllm_remap_before_q(name, params) for name in export.tensors}
        assert {n for n, v in older.items() if v in params} == {
            n for n in export.tensors if not n.endswith(".q_scale")}
        for name, t in export.tensors.items():
            if strategy == "tensor":
                assert t.numel() == 1        # default_weight_loader: fill_ from one value
            else:
                heads = N_Q if name.endswith(".q_scale") else N_KV
                assert t.flatten().shape == (heads,) and heads % N_KV == 0


def test_merge_into_saved_checkpoint(model, tmp_path):
    """``out_dir`` holding ``save_pretrained``: config.json gets the quantization_config, the
    index lists every original weight and every scale; Hugging Face with compressed-tensors
    loads our k/v scales into its own parameters bit for bit."""
    from safetensors import safe_open

    model.save_pretrained(tmp_path)
    original = set(safe_open(str(tmp_path / "model.safetensors"), framework="pt").keys())
    export = export_kv_scales(model, tmp_path, _ids(), strategy="head")
    assert export.merged
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == export.quantization_config
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == original | set(export.tensors)
    assert not (tmp_path / "model.safetensors").exists()
    for name, file in index.items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert name in f.keys()

    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    if not any(name in loaded for name in export.tensors):
        _skip_reference_without_scales()
    for name, t in export.tensors.items():
        if not name.endswith(".q_scale"):   # q needs an attention scheme, not a KV-cache one
            assert torch.equal(loaded[name], t), name
    assert torch.equal(loaded["model.layers.1.mlp.up_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.up_proj.weight"])


def test_merge_refuses_another_quantization_method(model, tmp_path):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        export_kv_scales(model, tmp_path, _ids())
    assert json.loads((tmp_path / "config.json").read_text()) == config


def test_options_are_validated():
    with pytest.raises(ValueError, match=r"strategy='channel'; allowed values: \['head', "
                                         r"'tensor'\]"):
        KVExportOptions(strategy="channel")
    with pytest.raises(ValueError, match=r"fmt='e5m2'; allowed values: \['e4m3'\]"):
        KVExportOptions(fmt="e5m2")


def test_cli_on_a_saved_model(model, tmp_path, capsys):
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "scales"
    assert main(["export-kv-scales", str(tmp_path / "ckpt"), "--out", str(out),
                 "--strategy", "head", "--no-q"]) == 0
    printed = capsys.readouterr().out
    tensors = load_file(str(out / "kv_scales.safetensors"))
    assert sorted(tensors) == sorted(f"{s}.{k}_scale" for s in SITES for k in "kv")
    rows = [line for line in printed.splitlines() if line.startswith("model.layers.")]
    assert [r.split()[0] for r in rows] == SITES
    for row, site in zip(rows, SITES):
        k = tensors[f"{site}.k_scale"]
        assert f"{float(k.min()):.4g}..{float(k.max()):.4g} ({N_KV})" in row
    assert not (tmp_path / "ckpt" / "model.safetensors.index.json").exists()   # --out elsewhere
