"""Keys and values an attention reads from an FP8 KV cache: their storage scale, from the graph.

An FP8 KV cache (``geoscale_fx.kv_cache.layers``, or any cache of the same form) hands the
attention its entries dequantized::

    k = cast( bits.view(float8) · cast · s.view(1, H, 1, 1) )      then whole-vector slices

``bits`` holds FP8 values (finite, so ``|bits| ≤ R_cache``, the storage format's largest
value) and ``s`` one scale per kv head (or one per tensor), whatever wrote the cache — this
call's keys or any earlier ones, under the current weights or others. So every entry obeys
``|k_g,j,i| ≤ R_cache · |s_g|`` (times the rounding of the product and the cast), and an FP8
q/k/v attention that divides by ``δ_g = |s_g| · R_cache / R_attn`` sees every cached entry
inside its range — exactly the stored FP8 value when both formats are the same. The scale
is read from the graph every call (a new cache brings its own); its cost does not grow with
the cache.

``fp8_cache_read(node)`` recognizes that form on a 4-D ``(batch, heads, positions, d_h)``
operand: value casts, ``getitem`` slices that keep heads and channels whole, ``contiguous``,
GQA's ``repeat_kv`` (whole heads repeated), then the ``mul`` of an FP8 tensor (through
casts) by a ``(1, H or 1, 1, 1)`` scale. Anything else gives None (the caller bounds the
operand otherwise).

Example (a decode step of ``wrap(model, kv_cache="fp8")``: ``keys`` a cache placeholder of
uint8 bits)::

    k = (cat([keys, bits]).view(torch.float8_e4m3fn).float() * k_scale.view(1, -1, 1, 1))
    fp8_cache_read(sdpa.args[1])  # FP8CacheRead(scale="view_8", fmt="e4m3", repeat=1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.core.fp8 import FP8_DTYPES
from geoscale_fx.analysis.forms.cached_keys import repeated_kv_heads, whole_vector_slices
from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, example_value, op_of

__all__ = ["FP8CacheRead", "fp8_cache_read", "FP8_STORAGE"]

#: FP8 storage dtypes -> format names (``geoscale_fx.core.fp8``'s table, inverted)
FP8_STORAGE = {dtype: fmt for fmt, dtype in FP8_DTYPES.items()}


@dataclass(frozen=True)
class FP8CacheRead:
    """An operand dequantized from FP8 storage: ``scale`` (a node holding ``(1, H', 1, 1)``,
    ``H'`` the stored heads or 1), the storage format ``fmt``, and ``repeat``: operand head
    ``h`` holds stored head ``h // repeat`` (GQA's ``repeat_kv`` after the dequantization)."""
    scale: str
    fmt: str
    repeat: int = 1


def _float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and \
        value.dtype not in FP8_STORAGE


def _strip(node, keep_shape: bool = True):
    """Follow value casts (and, with ``keep_shape`` False, whole-vector slices) upwards."""
    while isinstance(node, Node):
        op = op_of(node)
        source = node.args[0] if node.args else None
        if not isinstance(source, Node):
            return node
        if op in VALUE_CASTS and _float(example_value(node)) and _float(example_value(source)):
            node = source
        elif not keep_shape and op == "getitem" and whole_vector_slices(node.args[1]):
            node = source
        else:
            return node
    return node


def _fp8_source(node) -> Optional[str]:
    """The storage format when ``node`` is an FP8 tensor cast up to a float (else None)."""
    if not isinstance(node, Node) or op_of(node) != "cast":
        return None
    inner = node.args[0] if node.args else None
    value = example_value(inner)
    if isinstance(inner, Node) and isinstance(value, torch.Tensor) and \
            value.dtype in FP8_STORAGE and _float(example_value(node)):
        return FP8_STORAGE[value.dtype]
    return None


def fp8_cache_read(operand: Node) -> Optional[FP8CacheRead]:
    """The FP8 storage an attention operand (``(B, H, L, d_h)``) is dequantized from, or
    None when it is not of the module docstring's form."""
    value = example_value(operand)
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return None
    product, repeat = _strip(operand, keep_shape=False), 1
    repeated = repeated_kv_heads(product) if isinstance(product, Node) else None
    if repeated is not None:
        product, repeat = _strip(repeated[0], keep_shape=False), repeated[1]
    if op_of(product) != "mul" or len(product.args) != 2 or \
            not all(isinstance(a, Node) for a in product.args):
        return None
    out = example_value(product)
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or \
            out.shape[1] * repeat != value.shape[1]:
        return None
    for stored, scale in (product.args, product.args[::-1]):
        fmt = _fp8_source(_strip(stored))
        bits, factor = example_value(stored), example_value(scale)
        if fmt is None or tuple(bits.shape) != tuple(out.shape) or \
                not isinstance(factor, torch.Tensor) or factor.dim() != 4 or \
                tuple(factor.shape[i] for i in (0, 2, 3)) != (1, 1, 1) or \
                factor.shape[1] not in (1, out.shape[1]) or not _float(factor):
            continue
        return FP8CacheRead(scale.name, fmt, repeat)
    return None
