"""The compressed-tensors writer of ``export_kv_scales``: what vLLM and SGLang load.

Serving engines read static FP8 KV-cache scales from a checkpoint whose ``config.json``
carries a compressed-tensors ``quantization_config`` with a ``kv_cache_scheme``. Given the
scale tensors by checkpoint name (format-neutral: ``kv_scales.scale_tensors``), ``write``

* saves them to ``kv_scales.safetensors`` and the ``quantization_config`` to
  ``quantization_config.json`` in ``out``;
* into a saved Hugging Face checkpoint (``out/config.json`` exists): merges the
  ``quantization_config`` into ``config.json`` (refused when another ``quant_method`` is
  there) and the tensor names into the weight index (a single-file checkpoint becomes an
  indexed one: Hugging Face reads ``model.safetensors`` alone when it exists, and vLLM
  keeps only the files an index lists). Every refusal comes before the first file.

A writer module holds ``NAME``, ``check(options)`` (what of ``KVExportOptions`` it cannot
write: a ``ValueError``) and ``write(tensors, options, out) -> (config, files, merged)``,
and is listed in ``kv_scales.WRITERS`` (docs/extending.md).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from geoscale_fx.export.safetensors_reader import INDEX_FILE, SINGLE_WEIGHTS_FILE

if TYPE_CHECKING:
    from geoscale_fx.export.kv_scales import KVExportOptions

__all__ = ["NAME", "STRATEGIES", "check", "write", "kv_cache_scheme", "quantization_config"]

log = logging.getLogger("geoscale_fx")

NAME = "compressed-tensors"
#: ``strategy=`` value -> compressed-tensors ``QuantizationStrategy`` of the kv_cache_scheme
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}
#: compressed-tensors' 8-bit float is E4M3 (``FP8_E4M3_DATA``); E5M2 has no such scheme
FORMATS = ("e4m3",)
SCALES_FILE = "kv_scales.safetensors"
CONFIG_FRAGMENT_FILE = "quantization_config.json"
SINGLE_SHARD_FILE = "model-00001-of-00001.safetensors"


def check(options: KVExportOptions) -> None:
    """What compressed-tensors cannot write, refused before anything is traced."""
    if options.fmt not in FORMATS:
        raise ValueError(f"fmt={options.fmt!r}: a compressed-tensors FP8 kv_cache_scheme is "
                         f"{' or '.join(FORMATS)}")
    if options.strategy not in STRATEGIES:
        raise ValueError(f"strategy={options.strategy!r}; compressed-tensors writes "
                         f"{sorted(STRATEGIES)}")


def kv_cache_scheme(options: KVExportOptions) -> dict:
    """The compressed-tensors ``QuantizationArgs`` of the KV cache, as JSON."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
            "strategy": STRATEGIES[options.strategy], "dynamic": False}


def quantization_config(options: KVExportOptions) -> dict:
    """``config.json``'s ``quantization_config`` for a checkpoint whose only quantization is
    the KV cache (weights unquantized: ``format="dense"``, no ``config_groups``)."""
    return {"config_groups": {}, "quant_method": "compressed-tensors",
            "kv_cache_scheme": kv_cache_scheme(options), "format": "dense",
            "quantization_status": "frozen", "global_compression_ratio": None, "ignore": []}


def _merged_config(config_path: Path, qconfig: dict) -> dict:
    """``config.json`` with the ``quantization_config`` (refused: another method's)."""
    config = json.loads(config_path.read_text())
    existing = config.get("quantization_config")
    if existing is not None:
        if existing.get("quant_method") != "compressed-tensors":
            raise ValueError(f"export_kv_scales: {config_path} already has a "
                             f"quantization_config with quant_method="
                             f"{existing.get('quant_method')!r}; only a compressed-tensors "
                             "one can take a kv_cache_scheme")
        qconfig = {**existing, "kv_cache_scheme": qconfig["kv_cache_scheme"]}
    config["quantization_config"] = qconfig
    return config


def _merged_index(out_dir: Path, names: list[str]) -> dict:
    """The weight index with ``names`` -> ``kv_scales.safetensors`` added. A single-file
    checkpoint becomes a sharded one (``_write_index`` renames ``model.safetensors`` to a
    shard): Hugging Face reads ``model.safetensors`` alone when it exists, ignoring any
    index, and vLLM keeps only the files an index lists."""
    index_path = out_dir / INDEX_FILE
    single = out_dir / SINGLE_WEIGHTS_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
    elif single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            keys = list(f.keys())
        index = {"metadata": {}, "weight_map": {k: SINGLE_SHARD_FILE for k in keys}}
    else:
        raise ValueError(f"export_kv_scales: {out_dir} has config.json but neither "
                         f"{INDEX_FILE} nor {SINGLE_WEIGHTS_FILE} (save with "
                         "save_pretrained(..., safe_serialization=True))")
    clash = [n for n in names if index["weight_map"].get(n, SCALES_FILE) != SCALES_FILE]
    if clash:
        raise ValueError(f"export_kv_scales: the checkpoint already holds {clash[:3]} in "
                         "another file; remove them first")
    index["weight_map"].update({n: SCALES_FILE for n in names})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    return index


def _write_index(out_dir: Path, index: dict) -> Path:
    index_path, single = out_dir / INDEX_FILE, out_dir / SINGLE_WEIGHTS_FILE
    if not index_path.exists():
        single.rename(out_dir / SINGLE_SHARD_FILE)
        log.info("geoscale: export_kv_scales: %s renamed to %s (now indexed)", single.name,
                 SINGLE_SHARD_FILE)
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return index_path


def write(tensors: dict[str, torch.Tensor], options: KVExportOptions, out: Path
          ) -> tuple[dict, list[Path], bool]:
    """Write ``tensors`` and the ``quantization_config`` into ``out`` (merged into a saved
    checkpoint there): the config, the files written, whether it was merged."""
    from safetensors.torch import save_file

    qconfig = quantization_config(options)
    merged = (out / "config.json").exists()
    if merged:             # refusals first: nothing is written unless all of it can be
        index = _merged_index(out, sorted(tensors))
        config = _merged_config(out / "config.json", qconfig)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SCALES_FILE), metadata={"format": "pt"})
    fragment = out / CONFIG_FRAGMENT_FILE
    fragment.write_text(json.dumps({"quantization_config": qconfig}, indent=2) + "\n")
    files = [out / SCALES_FILE, fragment]
    if merged:
        index_path = _write_index(out, index)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        files += [out / "config.json", index_path]
    return qconfig, files, merged
