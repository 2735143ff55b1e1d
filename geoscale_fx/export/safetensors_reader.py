"""Tensors of a saved Hugging Face safetensors checkpoint, read by name, a few at a time.

A checkpoint directory as ``save_pretrained`` writes it holds ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).
``CheckpointReader.read(names)`` opens each shard that holds one of ``names`` with
``safetensors.safe_open`` (a memory map), copies those tensors out and closes the shard, so
what stays resident is the tensors asked for, never a shard.

Contract: a tensor that the index does not list, or that its shard does not hold, and a
floating tensor with a NaN or ±inf entry, is a ``ValueError`` naming the tensor (its
checkpoint name, e.g. ``model.layers.3.self_attn.k_proj.weight``) and the file. Only the
tensors read are checked.

Example::

    reader = CheckpointReader("ckpt")
    tensors = reader.read(["model.layers.0.self_attn.k_proj.weight"])
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Union

import torch

from geoscale_fx.core.errors import non_finite_entries

__all__ = ["CheckpointReader", "INDEX_FILE", "SINGLE_WEIGHTS_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"


class CheckpointReader:
    """The tensor names of a safetensors checkpoint directory and where each one lives."""

    def __init__(self, directory: Union[str, os.PathLike]):
        from safetensors import safe_open

        self.directory = Path(directory)
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_WEIGHTS_FILE
        if single.exists():          # Hugging Face reads model.safetensors alone if present
            with safe_open(str(single), framework="pt") as f:
                self.weight_map = {name: single.name for name in f.keys()}
            self.listing = single.name
        elif index.exists():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
            self.listing = index.name
        else:
            raise ValueError(f"checkpoint {self.directory}: neither {SINGLE_WEIGHTS_FILE} nor "
                             f"{INDEX_FILE} (save with save_pretrained(..., "
                             "safe_serialization=True))")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise ValueError(f"checkpoint {self.directory}: tensor {name!r} is missing "
                             f"({self.listing} does not list it)") from None

    def floating_dtype(self) -> torch.dtype:
        """The dtype of the first floating tensor of the first file, FP8 ones passed over
        (what ``from_pretrained(dtype="auto")`` takes when ``config.json`` names none; FP8
        weights are dequantized to it)."""
        from safetensors import safe_open

        first = sorted(set(self.weight_map.values()))[0]
        with safe_open(str(self.directory / first), framework="pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                value = getattr(torch, _TORCH_DTYPES.get(dtype, ""), None)
                if isinstance(value, torch.dtype) and value.is_floating_point and \
                        value.itemsize > 1:     # FP8 weights are dequantized on load
                    return value
        return torch.get_default_dtype()

    def _by_file(self, names: Iterable[str]) -> list[tuple[str, list[str]]]:
        """``names`` (each once, in order) grouped by the file holding them, files sorted."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in dict.fromkeys(names):
            by_file[self.file_of(name)].append(name)
        return sorted(by_file.items())

    def metas(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """``{name: meta tensor of its stored shape and dtype}`` from the files' headers (no
        data); each file opened once."""
        from safetensors import safe_open

        out = {}
        for file, file_names in self._by_file(names):
            path = self.directory / file
            with safe_open(str(path), framework="pt") as f:
                for name in file_names:
                    stored = f.get_slice(name)
                    dtype = getattr(torch, _TORCH_DTYPES.get(stored.get_dtype(), ""), None)
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"checkpoint tensor {name!r} in {path} has dtype "
                                         f"{stored.get_dtype()}, which torch does not know")
                    out[name] = torch.empty(stored.get_shape(), dtype=dtype, device="meta")
        return out

    def read(self, names: Iterable[str], finite: bool = True) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` on the CPU, in the stored dtype; each shard opened once.
        ``finite=False`` skips the NaN/inf check (buffers such as masks hold -inf)."""
        from safetensors import safe_open

        out = {}
        for file, file_names in self._by_file(names):
            path = self.directory / file
            if not path.exists():
                raise ValueError(f"checkpoint {self.directory}: tensor {file_names[0]!r} is "
                                 f"listed in {file}, which does not exist")
            with safe_open(str(path), framework="pt") as f:
                held = set(f.keys())
                for name in file_names:
                    if name not in held:
                        raise ValueError(f"checkpoint {self.directory}: tensor {name!r} is "
                                         f"missing from {file} (the index lists it there)")
                    tensor = f.get_tensor(name)
                    out[name] = _finite(tensor, name, path) if finite else tensor
        return out


def _finite(tensor: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    bad = non_finite_entries(tensor)
    if bad:
        raise ValueError(f"checkpoint tensor {name!r} in {path} has {bad} non-finite "
                         "entries (NaN or ±inf); no certified scale can come from it")
    return tensor


#: safetensors dtype names -> torch attribute names
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                 "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
