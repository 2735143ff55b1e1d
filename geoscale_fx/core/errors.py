"""The errors users catch, and the one check that finds what raises the commonest.

    try:
        model(**batch)
    except geoscale_fx.NonFiniteWeights as e:   # a parameter holds inf/nan: names it
        ...
    try:
        geoscale_fx.export_kv_scales("ckpt")
    except geoscale_fx.CheckpointError as e:    # a file it cannot read or write: names it
        ...

``non_finite_entries`` is the package's one finiteness check: the runtime before a bound
is computed, the KV-cache scales before a refresh and the checkpoint reader on every
tensor it reads all count inf/nan entries with it.
"""
from __future__ import annotations

import torch

__all__ = ["CheckpointError", "NonFiniteWeights", "non_finite_entries", "all_finite"]


class NonFiniteWeights(ValueError):
    """A site's parameters hold inf or nan: its bound (and FP8 scale) would be NaN."""


class CheckpointError(ValueError):
    """A checkpoint directory the export cannot read, or an output it cannot write: the
    message names the file and what is wrong with it (missing, not a directory, corrupt or
    truncated safetensors, invalid ``config.json``, a family transformers cannot build, no
    permission, no space). Raised before anything is written, or — a write that failed —
    with the checkpoint left loadable (``geoscale_fx.export.safe_writes``)."""


#: dtypes ``torch.aminmax`` covers: one pass, since NaN and ±inf reach the min or the max
_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def non_finite_entries(tensor: torch.Tensor) -> int:
    """How many entries of ``tensor`` are inf or nan (0 for integer, empty and meta tensors).

    A finite tensor costs one ``aminmax`` pass and one host sync; only a tensor that is not
    finite is counted entry by entry. A DTensor is counted whole (``isfinite`` and ``sum``
    have sharding rules, so every rank gets the same count)."""
    if not tensor.is_floating_point() or not tensor.numel() or tensor.device.type == "meta":
        return 0
    if tensor.element_size() == 1:          # FP8: no isfinite kernel; its values fit float32
        tensor = tensor.float()
    if tensor.dtype in _MINMAX_DTYPES and type(tensor) is torch.Tensor:   # not a DTensor
        low, high = torch.aminmax(tensor)
        if bool(torch.isfinite(low) & torch.isfinite(high)):       # one host sync
            return 0
    return int((~torch.isfinite(tensor)).sum())


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is finite, screened with one host sync per device: a finite sum
    has no inf/nan terms (a sum that overflowed reads as not finite: look entry by entry
    with ``non_finite_entries`` then)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel() and t.device.type != "meta":
            by_device.setdefault(t.device, []).append(t.sum())
    return all(bool(torch.stack(sums).isfinite().all()) for sums in by_device.values())
