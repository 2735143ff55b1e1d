"""Tensors of a saved Hugging Face safetensors checkpoint, read by name, a few at a time.

A checkpoint directory as ``save_pretrained`` writes it holds ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).
``CheckpointReader.read(names)`` opens each shard that holds one of ``names`` with
``safetensors.safe_open`` (a memory map), copies those tensors out and closes the shard, so
what stays resident is the tensors asked for, never a shard.

Contract: a tensor that the index does not list, or that its shard does not hold, and a
floating tensor with a NaN or ±inf entry, is a ``ValueError`` naming the tensor (its
checkpoint name, e.g. ``model.layers.3.self_attn.k_proj.weight``) and the file. Only the
tensors read are checked for values. What makes the checkpoint unreadable is a
``CheckpointError`` (a ``ValueError``) naming the file, when the reader is made: a directory
that does not exist, an index that is not valid JSON or has no ``weight_map``, and a file
it lists (or ``model.safetensors``) that is missing, truncated or whose header is corrupt
(every file's header is parsed, no data read).

Example::

    reader = CheckpointReader("ckpt")
    tensors = reader.read(["model.layers.0.self_attn.k_proj.weight"])
"""
from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Union

import torch

from geoscale_fx.core.errors import CheckpointError, non_finite_entries

__all__ = ["CheckpointReader", "INDEX_FILE", "SINGLE_WEIGHTS_FILE", "open_safetensors",
           "read_index", "read_json_object", "stored_names"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"


class CheckpointReader:
    """The tensor names of a safetensors checkpoint directory and where each one lives."""

    def __init__(self, directory: Union[str, os.PathLike]):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            what = "is not a directory" if self.directory.exists() else "does not exist"
            raise CheckpointError(f"checkpoint {self.directory} {what} (a saved Hugging Face "
                                  "model directory is needed)")
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_WEIGHTS_FILE
        if single.exists():          # Hugging Face reads model.safetensors alone if present
            self.weight_map = {name: single.name for name in stored_names(single)}
            self.listing = single.name
        elif index.exists():
            self.weight_map = read_index(index)["weight_map"]
            self.listing = index.name
            for file in sorted(set(self.weight_map.values())):
                stored_names(self.directory / file, listed_in=index)
        else:
            raise CheckpointError(f"checkpoint {self.directory}: neither {SINGLE_WEIGHTS_FILE} "
                                  f"nor {INDEX_FILE} (save with save_pretrained(..., "
                                  "safe_serialization=True))")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.directory}: tensor {name!r} is "
                                  f"missing ({self.listing} does not list it)") from None

    def floating_dtype(self) -> torch.dtype:
        """The dtype of the first floating tensor of the first file, FP8 ones passed over
        (what ``from_pretrained(dtype="auto")`` takes when ``config.json`` names none; FP8
        weights are dequantized to it)."""
        first = sorted(set(self.weight_map.values()))[0]
        with open_safetensors(self.directory / first) as f:
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
        out = {}
        for file, file_names in self._by_file(names):
            path = self.directory / file
            with open_safetensors(path) as f:
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
        out = {}
        for file, file_names in self._by_file(names):
            path = self.directory / file
            if not path.exists():
                raise CheckpointError(f"checkpoint {self.directory}: tensor {file_names[0]!r} "
                                      f"is listed in {file}, which does not exist")
            with open_safetensors(path) as f:
                held = set(f.keys())
                for name in file_names:
                    if name not in held:
                        raise CheckpointError(f"checkpoint {self.directory}: tensor "
                                              f"{name!r} is missing from {file} (the index "
                                              "lists it there)")
                    tensor = f.get_tensor(name)
                    out[name] = _finite(tensor, name, path) if finite else tensor
        return out


@contextlib.contextmanager
def open_safetensors(path: Path):
    """``safetensors.safe_open(path)`` (a memory map), or a ``CheckpointError`` naming the
    file and what is wrong (missing, truncated, corrupt header)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        what = "is a dangling symlink" if path.is_symlink() else "does not exist"
        raise CheckpointError(f"checkpoint file {path} {what}")
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not a readable safetensors file "
                              f"(truncated or corrupt: {_first_line(exc)})") from exc
    with handle as f:
        yield f


def stored_names(path: Path, listed_in: Path | None = None) -> list[str]:
    """The tensor names a safetensors file's header holds (its data is not read; a header
    whose offsets do not cover the file exactly, as after a truncated copy, is refused)."""
    if listed_in is not None and not path.is_file():
        raise CheckpointError(f"checkpoint file {path} (listed in {listed_in.name}) does not "
                              "exist")
    with open_safetensors(path) as f:
        return list(f.keys())


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``, or a ``CheckpointError`` naming it and what is wrong:
    missing (or a dangling symlink), not valid JSON (a truncated write), not an object."""
    try:
        parsed = json.loads(path.read_bytes())
    except FileNotFoundError:
        what = "is a dangling symlink" if path.is_symlink() else "does not exist"
        raise CheckpointError(f"{path} {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({_first_line(exc)})") from exc
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path} holds a JSON {type(parsed).__name__}, not an object")
    return parsed


def read_index(path: Path) -> dict:
    """A ``model.safetensors.index.json``: ``{"metadata": ..., "weight_map": {name: file}}``,
    or a ``CheckpointError`` naming what is wrong with it."""
    index = read_json_object(path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{path} has no \"weight_map\" of tensor names to file names")
    return index


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


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
