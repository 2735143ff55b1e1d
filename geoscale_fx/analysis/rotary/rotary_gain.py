"""The gain of a rotary embedding: ``‖R q‖ ≤ rot · ‖q‖``, proven from the graph or measured.

- **structural**: cos and sin tables ``m·cos(E)`` / ``m·sin(E)`` of one angle per rotated
  pair (``angles_paired`` shows ``E[j] == E[pairing[j]]``) give ``m``; where the pairing
  cannot be shown, the certified fallbacks are ``√2·m`` (one angle per element) and ``2m``
  (cos and sin of different angles);
- **measured**: tables known only by their values (CodeGen's sinusoid buffer gathered by
  position): per position the map is block-diagonal with 2×2 blocks ``[[a_j, b_j], [b_p,
  a_p]]`` over each rotated pair ``(j, p)``, and ``‖R‖₂`` is the largest block's spectral
  norm, computed in float64 from the tables the graph evaluates;
- **complex**: multiplying ``view_as_complex(x)`` by ``z`` scales each pair by ``|z|``: the
  gain is ``max |z|`` (1 for ``polar(ones, θ)``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, arg, op_of, scalar_constant, shape_of
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotary_terms import TABLE_VIEWS, RotaryTerm

__all__ = ["angles_paired", "structural_gain", "measured_gain", "modulus_bound",
           "node_is_ones"]


def angles_paired(records: ReplayRecords, angles: Node, pairing: list[int]) -> bool:
    """Whether paired elements share their angle (``E[j] == E[pairing[j]]``): structurally
    (``E = cat((f, f), -1)`` for rotate-half, ``repeat_interleave`` by 2 for interleaved),
    else numerically when ``E`` depends only on constants and buffers
    (``records.evaluate`` returns None when it cannot)."""
    width = len(pairing)
    op = op_of(angles)
    shape = shape_of(angles) or ()
    if not shape or shape[-1] != width:
        return False
    if op == "cat":
        parts, dim = arg(angles, 0, "tensors"), arg(angles, 1, "dim", 0)
        last = dim in (-1, len(shape) - 1)
        if last and len(parts) == 2 and parts[0] is parts[1] and \
                pairing == [(j + width // 2) % width for j in range(width)]:
            return True
    if op == "repeat_interleave" and arg(angles, 1, "repeats") == 2 and \
            arg(angles, 2, "dim") in (-1, len(shape) - 1) and \
            pairing == [j ^ 1 for j in range(width)]:
        return True
    values = records.evaluate(angles)
    if values is None or values.shape[-1] != width:
        return False
    return bool((values == values[..., pairing]).all())


def _table_values(term: RotaryTerm, records: ReplayRecords, width: int
                  ) -> Optional[torch.Tensor]:
    values = records.evaluate(term.table)
    if values is None or values.is_complex() or values.dim() == 0 or \
            values.shape[-1] not in (width, 1):
        return None
    values = values.double()
    return values.expand(*values.shape[:-1], width)


def _joint(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Broadcast tables over their leading dims (each keeps its own last dim)."""
    lead = torch.broadcast_shapes(*(v.shape[:-1] for v in values))
    return [v.expand(*lead, v.shape[-1]) for v in values]


def _block_norm(direct: torch.Tensor, swapped: torch.Tensor, index: torch.Tensor,
                sign: torch.Tensor) -> float:
    """``max ‖[[a_j, b_j], [b_p, a_p]]‖₂`` over positions and pairs ``p = index[j]``, where
    element ``j`` of the output is ``a_j x_j + b_j x_p`` (``b = swapped table · sign``)."""
    a, b = direct, swapped * sign.double()
    a_p, b_p = a.index_select(-1, index), b.index_select(-1, index)
    fro2 = a ** 2 + b ** 2 + a_p ** 2 + b_p ** 2
    det = a * a_p - b * b_p
    disc = torch.clamp(fro2 ** 2 - 4 * det ** 2, min=0.0)
    return float(torch.sqrt((fro2 + torch.sqrt(disc)) / 2).max())


def structural_gain(c: RotaryTerm, s: RotaryTerm, records: ReplayRecords, pairing,
                    rotate_half: bool, halves) -> tuple[float, bool]:
    """``(m, True)`` when the graph shows one angle per rotated pair, else the certified
    fallback ``(√2·m or 2m, False)`` (``(1, False)`` for tables known only by value)."""
    if c.trig is None or s.trig is None:
        return 1.0, False
    terms = [c, s] if halves is None else [t for h in halves for t in (h.direct, h.swapped)]
    factor = max(abs(t.factor) for t in terms)
    cos_sin = [(h.direct, h.swapped) for h in halves] if halves else [(c, s)]
    same_angle = all(x.angles is y.angles and x.chain == y.chain for x, y in cos_sin)
    same_factor = len({t.factor for t in terms}) == 1
    if halves is None:
        verified = (same_angle and same_factor and c.keeps_last and s.keeps_last
                    and angles_paired(records, c.angles, pairing))
    else:
        # both halves multiply by the same tables, element j of each half by entry j: the
        # pair (j, j + half) shares its angle when the tables are half as wide as the head
        width = len(pairing)
        shared = all(x.table is y.table for x, y in zip((halves[0].direct, halves[0].swapped),
                                                        (halves[1].direct, halves[1].swapped)))
        table_width = (shape_of(c.table) or (None,))[-1]
        verified = (same_angle and same_factor and shared and rotate_half
                    and table_width in (width // 2, 1))
    if verified:
        return factor, True
    # each 2×2 block [[m·cos a, ∓m·sin a], [±m·sin b, m·cos b]]: with one angle per element
    # its rows have norm ≤ m, so ‖block‖₂ ≤ √2·m; with cos and sin of different angles only
    # its entries are ≤ m, and ‖block‖₂ ≤ ‖block‖_F ≤ 2m
    return factor * (math.sqrt(2.0) if same_angle else 2.0), False


def measured_gain(c: RotaryTerm, s: RotaryTerm, records: ReplayRecords, index, sign,
                  width: int, halves) -> Optional[float]:
    """The largest 2×2 block norm over every position of the evaluated tables, or None."""
    if halves is None:
        tables = [_table_values(c, records, width), _table_values(s, records, width)]
        if any(t is None for t in tables):
            return None
        direct, swapped = _joint(tables)
    else:
        half = width // 2
        parts = [_table_values(t, records, half) for h in halves for t in (h.direct, h.swapped)]
        if any(t is None for t in parts):
            return None
        parts = _joint(parts)
        direct = torch.cat([parts[0], parts[2]], -1)
        swapped = torch.cat([parts[1], parts[3]], -1)
    return _block_norm(direct, swapped, index, sign)


def modulus_bound(table: Node, records: ReplayRecords) -> Optional[float]:
    """``max |z|``: structurally for ``c · polar(ones, θ)`` (views and casts between), else
    from the evaluated table."""
    factor, node = 1.0, table
    for _ in range(32):
        op = op_of(node)
        if node.op == "call_function" and node.target is torch.polar:
            modulus = node.args[0]
            if isinstance(modulus, Node) and node_is_ones(modulus):
                return factor
            values = records.evaluate(modulus) if isinstance(modulus, Node) else None
            return None if values is None else factor * float(values.abs().max())
        if op in VALUE_CASTS or op in TABLE_VIEWS:
            node = node.args[0]
        elif op == "mul" and scalar_constant(node.args[1]) is not None and \
                isinstance(node.args[0], Node):
            factor *= abs(scalar_constant(node.args[1]))
            node = node.args[0]
        else:
            break
        if not isinstance(node, Node):
            return None
    values = records.evaluate(table)
    if values is None:
        return None
    return float(values.abs().max())


def node_is_ones(node: Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ones_like, torch.ones)
