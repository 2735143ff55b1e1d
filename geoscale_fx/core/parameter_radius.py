"""The radius of a source bounded by value: ``‖x‖ ≤ ρ`` per token from the parameters' values.

When no normalization precedes a projection (a first layer reading token and position
embeddings, an embedding projection after the embedding LayerNorm, a 0/1 padding mask after the
norm), ``‖x‖`` is still bounded by the *values* of the parameters and buffers it is computed
from. ``analysis.norms.parameter_bound`` writes that computation as a small expression over graph node
names; :func:`evaluate_radius` evaluates it from the current values (a float64 0-dim tensor,
detached: pure and traceable, the in-graph programs and the host refresh call it with their
resolver). Each form and its bound, ``r(e)`` the bound of a sub-expression::

    ("norm", ρ₀, d, ops)        ρ₀ = radius_factor·√d, then per ("mul", v): r·max|v|,
                                per ("add", v): r + ‖v‖   (a LayerNorm/RMSNorm output g ⊙ x̂ + β)
    ("rows", name, d)           max over the last-dim vectors of the value (a table a gather
                                reads: max_r ‖W_r‖); a last dim of 1 broadcast to d: ×√d
    ("const", c)                c
    ("sum", e₁, e₂, …)          Σ r(eᵢ)                    (triangle inequality)
    ("scale", e, c)             |c|·r(e)                   (scalar mul/div, dropout's 1/(1−p))
    ("gain", e, name)           max|v|·r(e)                (‖v ⊙ x‖ ≤ max|v|·‖x‖)
    ("linear", e, name)         σ_max(W)·r(e)              (‖W x‖ ≤ ‖W‖₂‖x‖, exact σ)
    ("cat", e₁, e₂, …)          √Σ r(eᵢ)²                  (features concatenated, or an
                                                            element-wise choice between them)
    ("max", e₁, e₂, …)          max r(eᵢ)                  (tokens concatenated)

>>> import torch
>>> table = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
>>> expr = ("sum", ("rows", "tok", 2), ("scale", ("rows", "tok", 2), 0.5))
>>> float(evaluate_radius(expr, {"tok": table}.__getitem__))
7.5
>>> radius_nodes(expr)
('tok',)
"""
from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["evaluate_radius", "radius_nodes", "FORMS"]

#: the expression forms :func:`evaluate_radius` knows
FORMS = ("norm", "rows", "const", "sum", "scale", "gain", "linear", "cat", "max")

Resolve = Callable[[str], torch.Tensor]


def radius_nodes(expr: tuple) -> tuple[str, ...]:
    """The graph node names ``expr`` reads, each once, in order of appearance."""
    names: list[str] = []
    _collect(expr, names)
    return tuple(dict.fromkeys(names))


def _collect(expr: tuple, names: list) -> None:
    form = expr[0]
    if form == "norm":
        names += [v for _, v in expr[3] if isinstance(v, str)]
    elif form == "rows":
        names.append(expr[1])
    elif form in ("gain", "linear"):
        _collect(expr[1], names)
        names.append(expr[2])
    elif form == "scale":
        _collect(expr[1], names)
    elif form != "const":
        for sub in expr[1:]:
            _collect(sub, names)


def evaluate_radius(expr: tuple, resolve: Resolve) -> torch.Tensor:
    """``ρ`` with ``‖x‖ ≤ ρ`` for every token vector ``x`` of the source: a float64 0-dim
    tensor computed from the values ``resolve`` returns (detached)."""
    form = expr[0]
    if form == "norm":
        return _norm(expr[1], expr[2], expr[3], resolve)
    if form == "rows":
        return _vector_bound(_value(resolve, expr[1]), expr[2])
    if form == "const":
        return torch.tensor(abs(float(expr[1])), dtype=torch.float64)
    if form == "scale":
        return abs(float(expr[2])) * evaluate_radius(expr[1], resolve)
    if form == "gain":
        return _value(resolve, expr[2]).abs().amax() * evaluate_radius(expr[1], resolve)
    if form == "linear":
        weight = _value(resolve, expr[2])
        return torch.linalg.matrix_norm(weight, ord=2) * evaluate_radius(expr[1], resolve)
    if form not in ("sum", "cat", "max"):
        raise ValueError(f"unknown radius expression form {form!r} (one of {FORMS})")
    parts = [evaluate_radius(e, resolve) for e in expr[1:]]
    parts = torch.stack([p.to(parts[0].device) for p in parts])
    if form == "sum":
        return parts.sum()
    return parts.square().sum().sqrt() if form == "cat" else parts.amax()


def _value(resolve: Resolve, name: str) -> torch.Tensor:
    return resolve(name).detach().double()


def _vector_bound(value: torch.Tensor, width: int) -> torch.Tensor:
    """``max ‖v‖`` over the last-dim vectors of ``value``; a last dim of 1 stands for a
    vector of ``width`` equal entries (broadcast): ``√width·|v|``."""
    if value.dim() == 0:
        value = value.reshape(1)
    norms = torch.linalg.vector_norm(value, dim=-1).reshape(-1)
    bound = norms.amax() if norms.numel() else value.new_zeros(())
    return bound * math.sqrt(width) if value.shape[-1] == 1 and width > 1 else bound


def _norm(base: float, width: int, ops, resolve: Resolve) -> torch.Tensor:
    """``‖g ⊙ x̂ + β‖ ≤ max|g|·‖x̂‖ + ‖β‖`` through the per-channel ops, in order."""
    radius = torch.tensor(float(base), dtype=torch.float64)
    for kind, v in ops:
        if isinstance(v, str):
            t = _value(resolve, v)
            radius = radius.to(t.device)
            radius = radius * t.abs().amax() if kind == "mul" else radius + _vector_bound(
                t.reshape(-1) if t.numel() > 1 else t.reshape(1), width)
        else:
            radius = radius * abs(float(v)) if kind == "mul" else radius + abs(float(v)) * \
                math.sqrt(width)
    return radius
