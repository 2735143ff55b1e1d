"""Hand-written FP8 training linears (no torchao): the arithmetic torchao's ``Float8Linear``
computes, spelled out, with variants the recognizer must read and twins it must refuse.

``ToyFloat8Linear(d_in, d_out, recipe=Recipe(...))`` is an ``nn.Linear`` whose forward is one
``allow_in_graph`` autograd function (as torchao's): per recipe, both operands are cast to
FP8 E4M3 with scales from their own values (per tensor, or per row of the input and per
output feature of the weight; optionally rounded down to a power of two), multiplied by
``torch._scaled_mm`` (or, emulated, by ``mm`` of the dequantized operands), the product
rounded to ``out_dtype``. The twins change one thing the bound relies on:

* ``input_scale="static"``: the input's scale is a constant, not from its values (a large
  input saturates: no certified relative error);
* ``input_scale="weight"``: the input's scale comes from the weight's amax;
* ``dequant="other"``: the product is dequantized by a scale other than the cast's.

``dequantized_weight(weight, recipe)`` is an independent float64 reference of ``W̃``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
R = 448.0
EPS = 1e-12


def _rowwise_scaled_mm_runs() -> bool:
    """``torch._scaled_mm`` with per-row scales runs on the CPU (torch 2.11's CPU kernel
    takes per-tensor scales only: a rowwise FP8 linear does not run there, emulated aside)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


#: a test or case that runs a rowwise ``_scaled_mm`` on the CPU
ROWWISE = pytest.mark.skipif(not _rowwise_scaled_mm_runs(),
                             reason="this torch's CPU _scaled_mm takes per-tensor scales only "
                                    "(torch 2.11): a rowwise FP8 linear does not run here")


def case(recipe: "Recipe"):
    """``recipe`` as a pytest parameter, skipped where its ``_scaled_mm`` cannot run."""
    needs_rows = recipe.rows and not recipe.emulate
    return pytest.param(recipe, marks=[ROWWISE] if needs_rows else [], id=str(recipe))


@dataclass(frozen=True)
class Recipe:
    rows: bool = False              # per row of x / per output feature of W, else per tensor
    pow2: bool = False
    emulate: bool = False
    out_dtype: torch.dtype = torch.float32
    input_scale: str = "dynamic"    # "dynamic" | "static" | "weight"
    dequant: str = "same"           # "same" | "other"


def _scale(t: torch.Tensor, dim, pow2: bool) -> torch.Tensor:
    amax = t.abs().amax(dim=dim, keepdim=True) if dim is not None else t.abs().max()
    s = (R / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def _cast(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (t.float() * s).clamp(-R, R).to(E4M3)


def float8_matmul(x: torch.Tensor, w_t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """``x̃ W̃ᵀ`` as the recipe computes it (``w_t``: the weight transposed, ``(d, F)``)."""
    s_w = _scale(w_t, 0 if recipe.rows else None, recipe.pow2)
    if recipe.input_scale == "static":
        s_x = torch.full((), 64.0)
    elif recipe.input_scale == "weight":
        s_x = _scale(w_t, None, recipe.pow2)
    else:
        s_x = _scale(x, -1 if recipe.rows else None, recipe.pow2)
    x8, w8 = _cast(x, s_x), _cast(w_t, s_w)
    deq_x = s_x * 2.0 if recipe.dequant == "other" else s_x
    a = x8.reshape(-1, x.shape[-1])
    sa = deq_x.reshape(-1, 1) if deq_x.dim() > 0 else deq_x
    if recipe.emulate:
        out = torch.mm(a.float() / sa, w8.float() / s_w).to(recipe.out_dtype)
    else:
        out = torch._scaled_mm(a, w8, scale_a=sa.reciprocal(), scale_b=s_w.reciprocal(),
                               out_dtype=recipe.out_dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@torch._dynamo.allow_in_graph
class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t, recipe):
        ctx.save_for_backward(x, w_t)
        return float8_matmul(x, w_t, recipe)

    @staticmethod
    def backward(ctx, grad):
        x, w_t = ctx.saved_tensors
        grad = grad.to(x.dtype)
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        return grad @ w_t.t(), flat_x.t() @ flat_g, None


class ToyFloat8Linear(nn.Linear):
    def __init__(self, d_in: int, d_out: int, bias: bool = False, recipe: Recipe = Recipe()):
        super().__init__(d_in, d_out, bias=bias)
        self.recipe = recipe

    def forward(self, x):
        out = _Float8Matmul.apply(x, self.weight.t(), self.recipe)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def dequantized_weight(weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """``W̃`` (as ``weight``, ``(F, d)``) in float64: each row's (or the tensor's) scale from
    its amax, the E4M3 value of ``W·s`` divided by ``s`` — the float64 reference."""
    w = weight.detach().double()
    amax = w.abs().amax(dim=1, keepdim=True) if recipe.rows else w.abs().max()
    s = (R / amax.clamp(min=EPS)).float().double()
    if recipe.pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    scaled = (weight.detach().float() * s.float()).clamp(-R, R)
    return scaled.to(E4M3).double() / s


class FP8Attention(nn.Module):
    """RMSNorm (``affine``: then a gain and an offset) → FP8 q/k/v projections → explicit
    single-scale attention; the ``q·k`` logits are exactly what the bound covers (no RoPE).
    ``normalized(x)`` is what the projections read."""

    def __init__(self, d: int = 16, heads: int = 1, recipe: Recipe = Recipe(),
                 bias: bool = False, affine: bool = False):
        super().__init__()
        self.heads, self.d_h = heads, d // heads
        self.q = ToyFloat8Linear(d, d, bias, recipe)
        self.k = ToyFloat8Linear(d, d, bias, recipe)
        self.v = ToyFloat8Linear(d, d, bias, recipe)
        self.gain = nn.Parameter(1 + 0.5 * torch.randn(d)) if affine else None
        self.offset = nn.Parameter(0.5 * torch.randn(d)) if affine else None

    def normalized(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x if self.gain is None else x * self.gain + self.offset

    def forward(self, x):
        b, n, d = x.shape
        x = self.normalized(x)
        q = self.q(x).view(b, n, self.heads, self.d_h).transpose(1, 2)   # (B, H, L, d_h)
        k = self.k(x).view(b, n, self.heads, self.d_h).transpose(1, 2)
        v = self.v(x).view(b, n, self.heads, self.d_h).transpose(1, 2)
        s = q @ k.transpose(-1, -2) * self.d_h ** -0.5
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, n, d)


class Projected(nn.Module):
    """One FP8 linear after an RMSNorm: the captured graph holds one opaque call."""

    def __init__(self, d_in: int = 16, d_out: int = 8, recipe: Recipe = Recipe()):
        super().__init__()
        self.lin = ToyFloat8Linear(d_in, d_out, recipe=recipe)

    def forward(self, x):
        return self.lin(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def captured_call(recipe: Recipe = Recipe(), d_in: int = 16, d_out: int = 8,
                  dtype: torch.dtype = torch.float32):
    """``(graph, kinds, node)``: the captured graph of ``Projected``, its value kinds and its
    one opaque call (the FP8 linear)."""
    from geoscale_fx.analysis.capture import capture_graphs
    from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of

    torch.manual_seed(0)
    model = Projected(d_in, d_out, recipe).to(dtype)
    (graph,) = capture_graphs(model, torch.randn(2, 4, d_in, dtype=dtype))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    node, = [n for n in graph.gm.graph.nodes if n.op == "call_function"
             and op_of(n) is None and callable(n.target)
             and "trampoline" in getattr(n.target, "__name__", "")]
    return graph, kinds, node
