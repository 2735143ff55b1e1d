"""The index tracker: where each element of a value on the query/key path comes from.

``Track`` holds, for every element of a tensor derived from a projection output ``P`` (shape
``(..., F)``), the output feature and token row of ``P`` it is, the scalar gain and rotation
factor applied since, and which normalization (if any) it passed through. ``Unsupported`` is
the one error the analysis raises: its message names the graph node and the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Unsupported", "Track"]


class Unsupported(Exception):
    """The analysis cannot certify a site; the message names the graph node and the reason."""


@dataclass
class Track:
    """Index tensors shaped like a value on the path from a projection ``P`` (..., F)."""
    feat: torch.Tensor   # int32: output feature of P that this element is
    tok: torch.Tensor    # int32: flat row (token) of P it comes from
    gain: torch.Tensor   # float32: product of scalar factors and signs since P
    rot: torch.Tensor    # float32: norm factor of a rotation applied (0 = none)
    src: torch.Tensor    # int32: 0 = P itself, k = the k-th normalization after P (QK-norm)

    FIELDS = ("feat", "tok", "gain", "rot", "src")

    @classmethod
    def root(cls, shape: tuple[int, ...], offset: int = 0) -> "Track":
        """The projection output itself; its features are numbered from ``offset``."""
        n_rows, n_feat = math.prod(shape[:-1]), shape[-1]
        feat = torch.arange(offset, offset + n_feat, dtype=torch.int32).expand(shape)
        tok = torch.arange(n_rows, dtype=torch.int32).view(*shape[:-1], 1).expand(shape)
        gain = torch.ones((), dtype=torch.float32).expand(shape)
        rot = torch.zeros((), dtype=torch.float32).expand(shape)
        src = torch.zeros((), dtype=torch.int32).expand(shape)
        return cls(feat, tok, gain, rot, src)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def map(self, fn: Callable[[torch.Tensor], Any]) -> "Track":
        return Track(*(fn(t) for t in self.fields()))

    def with_(self, **changes) -> "Track":
        return Track(**{f: changes.get(f, getattr(self, f)) for f in self.FIELDS})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.feat.shape)
