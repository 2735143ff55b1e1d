"""FP8 weights stored with their block scales, read as the values a model computes with.

Checkpoints made for FP8 serving (DeepSeek-V3, Qwen3-FP8 and others; transformers'
fine-grained FP8 integration saves them so) store a linear's ``weight`` in
``float8_e4m3fn`` and beside it ``weight_scale_inv``: one float32 per block of
``weight_block_size = [b₀, b₁]`` (``config.json``'s ``quantization_config``; 128×128 as a
rule), the last blocks of a row or column cut short. The weight the model computes with is

    W[i, j] = float32(bits[i, j]) · scale_inv[i // b₀, j // b₁]

(a per-tensor checkpoint stores one scale), then cast to the parameter's dtype — what
``from_pretrained`` does when it dequantizes them (``Fp8Dequantize``: the same float32
products, so the same bits where the blocks divide the weight, as they must there).

``dequantize(bits, scale_inv, block)`` computes it; ``scale_name(name)`` is the scale's key;
``block_size(config)`` reads the block from a model's config (None: infer it from the shapes,
as transformers does).

    >>> bits = torch.tensor([[1.0, 2.0, 3.0]]).to(torch.float8_e4m3fn)
    >>> dequantize(bits, torch.tensor([[0.5, 4.0]]), (1, 2))
    tensor([[ 0.5000,  1.0000, 12.0000]])
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["SCALE_SUFFIX", "FP8_WEIGHT_DTYPES", "scale_name", "block_size", "dequantize"]

SCALE_SUFFIX = "_scale_inv"
FP8_WEIGHT_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def scale_name(name: str) -> str:
    """``"…q_proj.weight"`` -> ``"…q_proj.weight_scale_inv"``."""
    return name + SCALE_SUFFIX


def block_size(config: Any) -> Optional[tuple[int, int]]:
    """``quantization_config["weight_block_size"]`` of a model config, or None."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else \
        getattr(quant, "weight_block_size", None)
    return (int(block[0]), int(block[1])) if block else None


def dequantize(bits: torch.Tensor, scale_inv: torch.Tensor,
               block: Optional[tuple[int, int]] = None, name: str = "weight") -> torch.Tensor:
    """``float32(bits) · scale_inv`` per block (module docstring), float32. A grid of scales
    that does not tile the weight with ``block`` is a ValueError naming ``name``."""
    values = bits.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    rows, cols = values.shape[-2:]
    grid = tuple(scale.shape[-2:])
    if block is None:                   # transformers' rule: the grid divides the weight
        if rows % grid[0] or cols % grid[1]:
            raise ValueError(f"checkpoint tensor {name!r}: its shape {(rows, cols)} is not "
                             f"divisible by the grid of its scales {grid} (and config.json "
                             "names no weight_block_size)")
        block = (rows // grid[0], cols // grid[1])
    if grid != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        raise ValueError(f"checkpoint tensor {name!r} of shape {(rows, cols)} has scales "
                         f"{scale_name(name)!r} on a {grid} grid; blocks of {list(block)} "
                         f"make a {(math.ceil(rows / block[0]), math.ceil(cols / block[1]))} "
                         "grid")
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    full = full.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values * full
