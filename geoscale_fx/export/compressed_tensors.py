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

Every file is written by ``safe_writes`` (a temporary file moved over the old one: never
half written, never written through a symlink, so a hub cache's blobs keep their content),
in an order that leaves a checkpoint that loads at every moment (``_merge``): killed at any
step, the checkpoint loads, without the scales or with all of them, and running the export
again completes it. A second export changes only what the scales are (the same options:
only ``kv_scales.safetensors``); a file whose content stays is not written.

A writer module holds ``NAME``, ``check(options)`` (what of ``KVExportOptions`` it cannot
write: a ``ValueError``) and ``write(tensors, options, out) -> (config, files, merged)``,
and is listed in ``kv_scales.WRITERS`` (docs/extending.md).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export.safe_writes import (
    add_name, make_directory, remove_name, replace_file, same_file,
)
from geoscale_fx.export.safetensors_reader import (
    INDEX_FILE, SINGLE_WEIGHTS_FILE, read_index, read_json_object, stored_names,
)

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
    config = read_json_object(config_path)
    existing = config.get("quantization_config")
    if existing is not None:
        if not isinstance(existing, dict) or existing.get("quant_method") != NAME:
            method = existing.get("quant_method") if isinstance(existing, dict) else existing
            raise ValueError(f"export_kv_scales: {config_path} already has a "
                             f"quantization_config with quant_method={method!r}; only a "
                             "compressed-tensors one can take a kv_cache_scheme")
        qconfig = {**existing, "kv_cache_scheme": qconfig["kv_cache_scheme"]}
    config["quantization_config"] = qconfig
    return config


def _merged_index(out_dir: Path, names: list[str]) -> tuple[dict, bool]:
    """The weight index with exactly ``names`` -> ``kv_scales.safetensors`` (the scales of
    an earlier export replaced), and whether the checkpoint is a single file
    (``model.safetensors``, which ``_merge`` gives its shard name: Hugging Face reads it
    alone when it exists, ignoring any index, and vLLM keeps only the files an index
    lists). Every file the index lists must be a readable safetensors file."""
    index_path, single = out_dir / INDEX_FILE, out_dir / SINGLE_WEIGHTS_FILE
    if single.exists():
        _check_single(out_dir)
        index = {"metadata": {}, "weight_map": dict.fromkeys(stored_names(single),
                                                             SINGLE_SHARD_FILE)}
    elif index_path.exists():
        index = read_index(index_path)
        for file in sorted(set(index["weight_map"].values()) - {SCALES_FILE}):
            stored_names(out_dir / file, listed_in=index_path)
    else:
        raise CheckpointError(f"export_kv_scales: {out_dir} has config.json but neither "
                              f"{INDEX_FILE} nor {SINGLE_WEIGHTS_FILE} (save with "
                              "save_pretrained(..., safe_serialization=True))")
    weight_map = {k: v for k, v in index["weight_map"].items() if v != SCALES_FILE}
    clash = [n for n in names if n in weight_map]
    if clash:
        raise ValueError(f"export_kv_scales: the checkpoint already holds {clash[:3]} in "
                         "another file; remove them first")
    weight_map.update(dict.fromkeys(names, SCALES_FILE))
    return {**index, "weight_map": dict(sorted(weight_map.items()))}, single.exists()


def _check_single(out_dir: Path) -> None:
    """Beside ``model.safetensors``, an index or a shard is only what an interrupted export
    leaves (an index of the shard and the scales; the shard: the same file); anything else
    is refused: which file is the checkpoint is not for the export to guess."""
    index_path, shard = out_dir / INDEX_FILE, out_dir / SINGLE_SHARD_FILE
    if index_path.exists():
        files = set(read_index(index_path)["weight_map"].values())
        if files - {SINGLE_SHARD_FILE, SCALES_FILE}:
            raise CheckpointError(f"export_kv_scales: {out_dir} holds both "
                                  f"{SINGLE_WEIGHTS_FILE} and {INDEX_FILE} naming "
                                  f"{sorted(files)[:3]}; Hugging Face reads "
                                  f"{SINGLE_WEIGHTS_FILE} alone: remove the one that is not "
                                  "the checkpoint")
    if os.path.lexists(shard) and not same_file(out_dir / SINGLE_WEIGHTS_FILE, shard):
        raise CheckpointError(f"export_kv_scales: {out_dir} holds both {SINGLE_WEIGHTS_FILE} "
                              f"and a different {SINGLE_SHARD_FILE}: remove the one that is "
                              "not the checkpoint")


def _merge(out_dir: Path, index: dict, config: dict, single: bool) -> list[Path]:
    """Index and config written, in an order that leaves a checkpoint that loads at every
    moment, without the scales until the last step and with all of them after it:

    1. a single file gets its shard name beside its own (``add_name``: a link, nothing
       copied; a hub-cache symlink gets a twin pointing to the same blob);
    2. the index, listing the shard and ``kv_scales.safetensors``, both there already;
    3. ``model.safetensors`` removed: loaders now read the index;
    4. ``config.json`` with the ``quantization_config``: what makes loaders expect the
       scales, written last.
    """
    index_path, config_path = out_dir / INDEX_FILE, out_dir / "config.json"
    single_path = out_dir / SINGLE_WEIGHTS_FILE
    if single:
        add_name(single_path, out_dir / SINGLE_SHARD_FILE)
    replace_file(index_path, (json.dumps(index, indent=2) + "\n").encode())
    if single:
        remove_name(single_path)
        log.info("geoscale: export_kv_scales: %s renamed to %s (now indexed)",
                 SINGLE_WEIGHTS_FILE, SINGLE_SHARD_FILE)
    replace_file(config_path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return [config_path, index_path]


def write(tensors: dict[str, torch.Tensor], options: KVExportOptions, out: Path
          ) -> tuple[dict, list[Path], bool]:
    """Write ``tensors`` and the ``quantization_config`` into ``out`` (merged into a saved
    checkpoint there): the config, the files written, whether it was merged. Every file goes
    through ``safe_writes`` (atomic, never through a symlink); see ``_merge`` for the order."""
    from safetensors.torch import save

    qconfig = quantization_config(options)
    config_path = out / "config.json"
    merged = config_path.exists() or config_path.is_symlink()
    if merged:             # refusals first: nothing is written unless all of it can be
        config = _merged_config(config_path, qconfig)
        index, single = _merged_index(out, sorted(tensors))
    make_directory(out)
    replace_file(out / SCALES_FILE, save(tensors, metadata={"format": "pt"}))
    fragment = out / CONFIG_FRAGMENT_FILE
    replace_file(fragment, (json.dumps({"quantization_config": qconfig}, indent=2)
                            + "\n").encode())
    files = [out / SCALES_FILE, fragment]
    if merged:
        files += _merge(out, index, config, single)
    return qconfig, files, merged
