"""Checkpoints on disk for the export's safety tests: a tiny saved Llama, a Hugging Face hub
cache laid out around it, and a record of every file's bytes to compare before and after.

The hub cache is laid out as ``huggingface_hub`` lays it (``models--<org>--<name>/``):
``blobs/<hash>`` holds each file once, ``snapshots/<rev>/<file>`` is a *relative* symlink
``../../blobs/<hash>``, ``refs/main`` names a revision. Revisions that hold the same content
share its blob. (huggingface_hub names LFS blobs by their SHA-256 and small files by their
git SHA-1; here every blob is named by its SHA-256, so that ``blobs_intact`` can check every
one of them.)
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from geoscale_fx.export.safe_writes import TEMP_MARK


def save_tiny_llama(directory: Path, seed: int = 0):
    """A 1-layer Llama (hidden 32, 2 query heads, 1 kv head) saved with ``save_pretrained``
    (``config.json``, ``generation_config.json``, ``model.safetensors``); the model."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, vocab_size=64)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_state(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under ``root`` by relative path: ``("link", its target)`` for a symlink,
    ``("file", sha256)`` for a regular file (directories are not entries)."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_file():
            out[rel] = ("file", sha256(path))
    return out


def contents(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of what it reads (links followed), temporary files left out."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(Path(root).rglob("*"))
            if p.is_file() and TEMP_MARK not in p.name}


def hub_cache(source: Path, cache: Path, revisions: dict[str, dict[str, bytes]],
              repo: str = "org/tiny") -> Path:
    """``cache/models--org--tiny``: per revision, the files of ``source`` with the
    revision's replacements (file name -> bytes), as blobs and relative links; ``refs/main``
    names the first revision. Returns the repository folder."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    for rev, replaced in revisions.items():
        snapshot = folder / "snapshots" / rev
        snapshot.mkdir(parents=True)
        for file in sorted(p.name for p in source.iterdir()):
            data = replaced.get(file, (source / file).read_bytes())
            digest = hashlib.sha256(data).hexdigest()
            (folder / "blobs" / digest).write_bytes(data)
            os.symlink(f"../../blobs/{digest}", snapshot / file)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(next(iter(revisions)))
    return folder


def blobs_intact(folder: Path) -> list[str]:
    """The blobs whose content no longer has the SHA-256 they are named by (none: [])."""
    return [b.name for b in sorted((folder / "blobs").iterdir()) if sha256(b) != b.name]


def snapshot_reads(snapshot: Path) -> dict[str, bytes]:
    """File name -> the bytes it reads (links followed)."""
    return {p.name: p.read_bytes() for p in sorted(snapshot.iterdir()) if p.is_file()}
