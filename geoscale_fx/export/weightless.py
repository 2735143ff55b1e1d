"""A model without weights that still runs: each meta tensor replaced by a stored zero.

The streamed export (``checkpoint_scales``) traces the model built from ``config.json``
without reading a weight. Traced on the meta device, its forward differs from an in-memory
model's: a buffer or a constant made on the CPU meets meta activations (GPT-J's sinusoid
table indexed by positions: "device mismatch"), a value the forward reads (``.item()`` on
lengths, ``nonzero`` on language ids, an MoE router's ``tolist``) does not exist, and the
constants the analysis evaluates (rotary tables) are meta. ``weightless(model)`` instead
puts every meta parameter and buffer on the CPU as ``torch.zeros((), dtype).expand(shape)``
— the right shape and dtype, one stored element — so the model runs as in memory, on the
CPU, with all its weights 0.

A matrix product with such a weight would still copy it whole (BLAS needs strides; a 70B
checkpoint's ``lm_head`` is 2 GB) and multiply. ``ConstantProducts`` (a dispatch mode,
entered around each captured graph's run) computes ``mm``/``addmm``/``bmm``/``baddbmm``
with an operand whose every stride is 0 — a matrix ``c·𝟙`` of one repeated value ``c`` —
from the identity ``A·(c𝟙) = c·(A𝟙)`` (row sums), which costs a reduction of the other
operand. Measured, the trace and analysis of Llama-3.1 shapes at full depth (8 tokens, 2
CPUs): 8B 12 s and 1.5 GB peak without it, 4.5 s and 0.50 GB with it; 70B 84 s and 2.6 GB
without, 9.3 s and 0.57 GB with (a trace on the meta device: 4.4 s, 0.51 GB; 10.2 s,
0.57 GB).

Example::

    with weightless(meta_model) as originals, torch.no_grad():
        with ConstantProducts():
            logits = meta_model(input_ids=ids).logits        # runs on the CPU
    # originals: {id(stand-in): the meta tensor it replaced}
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["weightless", "ConstantProducts", "repeated_value"]

aten = torch.ops.aten


@contextlib.contextmanager
def weightless(model: nn.Module):
    """``model`` with every meta parameter and buffer replaced by a CPU tensor of its shape
    and dtype storing one zero; yields ``{id(stand-in): the meta tensor it replaced}``.
    Tied tensors stay tied (one stand-in per tensor); the meta tensors are put back on
    exit."""
    stand_ins: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    swapped = []                                   # (parameter or buffer table, name, meta)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if not isinstance(value, torch.Tensor) or value.device.type != "meta":
                    continue
                if id(value) not in stand_ins:
                    zero = torch.zeros((), dtype=value.dtype).expand(value.shape)
                    stand_in = (nn.Parameter(zero, value.requires_grad)
                                if isinstance(value, nn.Parameter) else zero)
                    stand_ins[id(value)] = stand_in
                    originals[id(stand_in)] = value
                swapped.append((table, name, value))
                table[name] = stand_ins[id(value)]
    try:
        yield originals
    finally:
        for table, name, value in swapped:
            table[name] = value


def repeated_value(t) -> torch.Tensor | None:
    """The one value ``c`` of a tensor of ≥ 2 entries whose every stride is 0 (a 0-dim
    view of it), else None."""
    if not isinstance(t, torch.Tensor) or t.numel() < 2 or t.layout != torch.strided \
            or any(s != 0 for s in t.stride()):
        return None
    return torch.as_strided(t, (), (), t.storage_offset())


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` for ``(…, m, k) @ (…, k, n)`` when ``a`` or ``b`` is ``c·𝟙``, else None."""
    ca, cb = repeated_value(a), repeated_value(b)
    if ca is None and cb is None:
        return None
    shape = (*a.shape[:-1], b.shape[-1])                          # (…, m, n)
    dtype = torch.result_type(a, b)
    if ca is not None and cb is not None:
        out = (ca.to(dtype) * cb.to(dtype) * a.shape[-1]).expand(shape)
    elif cb is not None:
        out = a.to(dtype).sum(-1, keepdim=True) * cb.to(dtype)   # (…, m, 1): A·𝟙 per row
    else:
        out = b.to(dtype).sum(-2, keepdim=True) * ca.to(dtype)   # (…, 1, n)
    return out.expand(shape).contiguous()


class ConstantProducts(TorchDispatchMode):
    """``mm``, ``addmm``, ``bmm``, ``baddbmm`` with a ``c·𝟙`` operand by ``A·(c𝟙) = c·(A𝟙)``
    (see the module doc); every other op, and these without such an operand, as usual.
    Not to be active while Dynamo compiles (it runs a function eagerly under a dispatch
    mode): enter it around the run of a captured graph."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not kwargs and func in (aten.mm.default, aten.bmm.default):
            out = _product(*args)
            if out is not None:
                return out
        if func in (aten.addmm.default, aten.baddbmm.default):
            bias, a, b = args[:3]
            product = _product(a, b)
            if product is not None:
                beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
                if beta == 0:                    # as addmm: the bias is then not read
                    return (alpha * product).to(product.dtype)
                return (beta * bias + alpha * product).to(product.dtype)
        return func(*args, **kwargs)
