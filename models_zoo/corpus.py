"""Byte-level text that ships with every Python: the standard library's own sources.

The corpus is the top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]`` (no
``site-packages``, no sub-packages, so no test suites or codec tables), read in sorted
order up to a byte budget. Every ``val_every``-th file is held out for validation, so the
split is by file, deterministic, and never cuts a file in two. Each byte is one token
(vocabulary 256). The content differs between Python versions, so callers key caches on
:attr:`ByteCorpus.sha256`.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "ByteTokenizer", "load_stdlib_corpus", "random_windows",
           "strided_windows"]


@dataclass(frozen=True)
class ByteCorpus:
    train: torch.Tensor  # (n_train_bytes,) uint8
    val: torch.Tensor  # (n_val_bytes,) uint8
    n_train_files: int
    n_val_files: int
    sha256: str  # of the (train, val) bytes, to key caches


class ByteTokenizer:
    """Text ↔ byte ids (UTF-8, vocabulary 256), for the byte-level models of the zoo."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __call__(self, text: str, return_tensors: str = "pt") -> dict:
        """``{"input_ids": (1, n_bytes) long}``, like a transformers tokenizer."""
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}; allowed values: ('pt',)")
        return {"input_ids": torch.tensor([self.encode(text)], dtype=torch.long)}


def _stdlib_modules() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"), key=lambda path: path.name)


def load_stdlib_corpus(budget_bytes: int, val_every: int = 10) -> ByteCorpus:
    """The first ``budget_bytes`` of stdlib sources (whole files), split by file."""
    if budget_bytes <= 0 or val_every < 2:
        raise ValueError(f"budget_bytes={budget_bytes} must be > 0, val_every={val_every} ≥ 2")
    train_parts, val_parts, total = [], [], 0
    for index, path in enumerate(_stdlib_modules()):
        data = path.read_bytes()
        if total + len(data) > budget_bytes and train_parts:
            break
        total += len(data)
        (val_parts if index % val_every == val_every - 1 else train_parts).append(data)
    if not val_parts:
        raise ValueError(f"budget_bytes={budget_bytes} is too small to hold out a file")
    train, val = b"".join(train_parts), b"".join(val_parts)
    digest = hashlib.sha256(train + b"\0--val--\0" + val).hexdigest()
    return ByteCorpus(train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
                      val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
                      n_train_files=len(train_parts), n_val_files=len(val_parts),
                      sha256=digest)


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len`` bytes at random offsets, as ``(B, T)`` long."""
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(seq_len)  # (B, T)
    return data[offsets].long()


def strided_windows(data: torch.Tensor, n_windows: int, seq_len: int) -> torch.Tensor:
    """``n_windows`` windows of ``seq_len`` bytes evenly spread over ``data``: ``(N, T)`` long."""
    starts = torch.linspace(0, data.numel() - seq_len, n_windows).long()  # (N,)
    offsets = starts[:, None] + torch.arange(seq_len)  # (N, T)
    return data[offsets].long()
