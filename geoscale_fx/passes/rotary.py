"""Rotary position embeddings on the query/key path, recognised as units and proven rotations.

Every form ends as a ``Track`` whose ``rot`` holds a bound on the embedding's gain
(``‖R q‖ ≤ rot · ‖q‖``):

- **rotate-half / interleaved**: ``x·cos + rot(x)·sin`` where ``rot(x)`` is a signed pairwise
  swap of ``x``'s elements (``cat(-x2, x1)``, ``stack(-x[1::2], x[::2]).flatten``);
- **halves**: ``cat(x1·cos − x2·sin, x2·cos + x1·sin)`` with half-width tables (gpt-oss,
  DeepSeek's de-interleaved form): joined at the ``cat`` into the rotate-half form;
- **complex**: ``view_as_real(view_as_complex(x) · z)`` (Llama-4): multiplying by ``z`` is a
  rotation scaled by ``|z|``, so the gain is ``max |z|`` (1 for ``polar(ones, θ)``);
- **tables known only by their values** (CodeGen's sinusoid buffer gathered by position):
  the gain is *measured*: per position the map is block-diagonal with 2×2 blocks
  ``[[a_j, b_j], [b_p, a_p]]`` over each rotated pair ``(j, p)``, and ``‖R‖₂`` is the largest
  block's spectral norm, computed in float64 from the tables the graph evaluates.

A structural proof (``m·cos(E)``/``m·sin(E)`` of one angle per pair) gives ``m``; where the
pairing of angles cannot be shown, the certified fallbacks are ``√2·m`` (one angle per
element) and ``2m`` (cos and sin of different angles). A per-position scalar multiplier of the
query (Llama-4's attention temperature) is not a rotation: ``AngleChecker.multipliers`` keeps
its bound, ``max |t|`` over a table of constants.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch.fx import Node

from geoscale_fx.passes import broadcast as bc
from geoscale_fx.passes.graph_ops import VALUE_CASTS, arg, op_of, scalar_constant, shape_of
from geoscale_fx.passes.track import Track, Unsupported
from geoscale_fx.site_model import Rotary

__all__ = ["RotaryTerm", "RotaryHalf", "ComplexValue", "AngleChecker", "trig_origin",
           "table_term", "combine", "join_halves", "to_complex", "complex_mul",
           "from_complex"]


@dataclass
class RotaryTerm:
    """``track * table``: half of a rotary embedding, waiting for the ``add`` that completes it.

    ``trig`` is "cos"/"sin" when the table is ``m·cos(E)``/``m·sin(E)`` up to views, None
    when it is known only by its values (evaluated from parameters, buffers and constants).
    """
    track: Track
    trig: Optional[str]
    angles: Optional[Node]   # E
    factor: float            # m
    chain: tuple             # the view ops from cos/sin(E) to the table, to compare both
    keeps_last: bool         # every node from E to the table keeps E's last dim
    table: Node
    via: str = ""            # the ``mul`` node


@dataclass
class RotaryHalf:
    """``x1·c ∓ x2·s``: one half of the halves form; ``swapped``'s gain carries the sign."""
    direct: RotaryTerm
    swapped: RotaryTerm


@dataclass
class ComplexValue:
    """``view_as_complex`` of a track (last dim: real, imaginary), possibly times ``z``."""
    track: Track
    factor: float = 0.0              # max |z| once multiplied (0: not multiplied)
    table: Optional[Node] = None


class AngleChecker:
    """Proves rotary embeddings are rotations and records what it saw.

    ``paired`` proves that paired elements share their angle (``E[j] == E[pairing[j]]``):
    structurally (``E = cat((f, f), -1)`` for rotate-half, ``repeat_interleave`` by 2 for
    interleaved), else numerically when ``E`` depends only on constants and buffers
    (``evaluate`` returns None when it cannot).
    """

    def __init__(self, evaluate: Callable[[Node], torch.Tensor | None],
                 is_constant: Callable[[Node], bool] | None = None):
        self._evaluate = evaluate
        kinds = getattr(evaluate, "kinds", None)
        self._is_constant = is_constant or (kinds.is_constant if kinds is not None
                                            else (lambda node: False))
        self.rotaries: list[Rotary] = []
        self.norms: dict[int, tuple[int, dict[int, int]]] = {}   # unit → (width, positions)
        #: (feature, the feature it rotates with) of every rotated element, as index tensors
        self.partners: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: (bound on |t|, features it multiplied) of each per-position scalar multiplier
        self.multipliers: list[tuple[float, torch.Tensor]] = []
        #: (features kept, features added to them, ratio of gains): a sum of two maps of
        #: the projections' outputs (a LoRA adapter's ``B A x`` added to ``W x``)
        self.sums: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def record(self, rotary: Rotary) -> None:
        self.rotaries.append(rotary)

    def record_norm(self, unit: int, width: int, positions: dict[int, int]) -> None:
        self.norms[unit] = (width, positions)

    def evaluate(self, node: Node) -> Optional[torch.Tensor]:
        value = self._evaluate(node)
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return None
        return value

    def paired(self, angles: Node, pairing: list[int]) -> bool:
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
        values = self.evaluate(angles)
        if values is None or values.shape[-1] != width:
            return False
        return bool((values == values[..., pairing]).all())

    def multiplier(self, table: Node, track: Track) -> Optional[float]:
        """``max |t|`` if ``table`` is a table of constants equal along the last dim (one
        scalar per position or head), else None."""
        if not self._is_constant(table):
            return None
        values = self.evaluate(table)
        if values is None or values.is_complex() or values.dim() == 0:
            return None
        if values.shape[-1] != 1 and not bool((values == values[..., :1]).all()):
            return None
        bound = float(values.double().abs().max())
        self.multipliers.append((bound, bc.compact(track.feat).reshape(-1).unique()))
        return bound


# --------------------------------------------------------------------------------------
# Tables

_TABLE_VIEWS = frozenset({"unsqueeze", "view", "reshape", "getitem", "expand", "squeeze",
                          "transpose", "permute", "flatten"})


def trig_origin(table: Node):
    """``(trig, E, m, chain, keeps_last)`` if ``table`` is ``m·cos(E)`` or ``m·sin(E)`` up to
    views; ``keeps_last``: no node between E and the table changes or moves the last dim."""
    factor, chain, node = 1.0, [], table
    width = (shape_of(table) or (None,))[-1]
    keeps_last = True
    for _ in range(32):
        op = op_of(node)
        keeps_last = keeps_last and (shape_of(node) or (None,))[-1] == width and \
            op not in ("transpose", "permute")
        if op in ("cos", "sin"):
            angles = node.args[0]
            keeps_last = keeps_last and (shape_of(angles) or (None,))[-1] == width
            return op, angles, factor, tuple(reversed(chain)), keeps_last
        if op in VALUE_CASTS:
            node = node.args[0]
        elif op == "mul" and isinstance(node.args[0], Node) and \
                scalar_constant(node.args[1]) is not None:
            factor *= scalar_constant(node.args[1])
            node = node.args[0]
        elif op == "mul" and isinstance(node.args[1], Node) and \
                scalar_constant(node.args[0]) is not None:
            factor *= scalar_constant(node.args[0])
            node = node.args[1]
        elif op in _TABLE_VIEWS and isinstance(node.args[0], Node):
            chain.append((op, tuple(a.name if isinstance(a, Node) else a for a in node.args[1:])))
            node = node.args[0]
        else:
            return None
    return None


def table_term(node: Node, track: Track, table: Node, checker: AngleChecker
               ) -> Optional[RotaryTerm]:
    """``track * table`` as half of a rotary embedding, or None if the table is neither a
    cos/sin table nor evaluable."""
    trig = trig_origin(table)
    if trig is not None:
        return RotaryTerm(track, *trig, table=table, via=node.name)
    if checker.evaluate(table) is not None:
        return RotaryTerm(track, None, None, 1.0, (), False, table=table, via=node.name)
    return None


def _table_values(term: RotaryTerm, checker: AngleChecker, width: int
                  ) -> Optional[torch.Tensor]:
    values = checker.evaluate(term.table)
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


# --------------------------------------------------------------------------------------
# x·cos + rot(x)·sin, and its halves form

def combine(node: Node, terms: list, checker: AngleChecker, negate: bool):
    """``add``/``sub`` of two rotary terms: a whole rotation, or one half of the halves form."""
    if not all(isinstance(t, RotaryTerm) for t in terms):
        raise Unsupported(f"`{node.name}` adds to the query/key something other than a rotary "
                          "embedding's second half (e.g. a bias after reshaping, or a mix of "
                          "two projections)")
    first, second = terms
    if negate:
        second = replace(second, track=second.track.with_(
            gain=bc.elementwise(torch.neg, second.track.gain)))
    if first.trig is not None and second.trig is not None:
        cos_terms = [t for t in (first, second) if t.trig == "cos"]
        sin_terms = [t for t in (first, second) if t.trig == "sin"]
        if len(cos_terms) != 1 or len(sin_terms) != 1:
            raise Unsupported(f"`{node.name}`: a rotary embedding needs one cos and one sin "
                              "term")
        first, second = cos_terms[0], sin_terms[0]
    if first.track.shape != second.track.shape:
        raise Unsupported(f"`{node.name}`: rotary halves have shapes {first.track.shape} and "
                          f"{second.track.shape}")
    width = first.track.shape[-1]
    own = bc.compact(first.track.feat).reshape(-1, width)[0].tolist()
    other = bc.compact(second.track.feat).reshape(-1, width)[0].tolist()
    if sorted(own) == sorted(other):
        return _rotate(node, first, second, checker)
    return RotaryHalf(first, second)


def join_halves(node: Node, halves: list[RotaryHalf], dim: int, checker: AngleChecker
                ) -> Track:
    """``cat((x1·c − x2·s, x2·c + x1·s), -1)``: the rotate-half form on the joined tracks."""
    ndim = len(halves[0].direct.track.shape)
    if len(halves) != 2 or dim not in (-1, ndim - 1):
        raise Unsupported(f"`{node.name}`: joins {len(halves)} rotary halves along dim {dim}")
    direct = Track(*(bc.concat([getattr(h.direct.track, f) for h in halves], -1)
                     for f in Track.FIELDS))
    swapped = Track(*(bc.concat([getattr(h.swapped.track, f) for h in halves], -1)
                      for f in Track.FIELDS))
    first, second = halves[0], halves[1]
    return _rotate(node, replace(first.direct, track=direct),
                   replace(first.swapped, track=swapped), checker, halves=(first, second))


def _pairing(node: Node, a: Track, r: Track) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``r`` as a signed pairwise swap of ``a``'s elements: (pairing, index, signs)."""
    width = a.shape[-1]
    first_row = bc.compact(a.feat).reshape(-1, width)[0]
    position = {int(f): j for j, f in enumerate(first_row.tolist())}
    pairing = [position.get(int(f), -1) for f in bc.compact(r.feat).reshape(-1, width)[0]
               .tolist()]
    index = torch.tensor(pairing)
    ok = (sorted(pairing) == list(range(width))
          and all(pairing[p] == j and p != j for j, p in enumerate(pairing))
          and bc.all_equal(r.feat, bc.take_last(a.feat, index).expand(a.shape))
          and bc.all_equal(r.tok, a.tok))
    if not ok:
        raise Unsupported(f"`{node.name}`: the sin term is not a pairwise swap of the cos "
                          "term's elements, so this is not a rotation")
    sign = bc.compact(r.gain) / bc.take_last(a.gain, index)
    sign = sign.reshape(-1, sign.shape[-1]).expand(-1, width)
    if not bool((sign.abs() == 1).all()) or not bool((sign == sign[:1]).all()) or \
            not bool((sign[0] == -sign[0, index]).all()):
        raise Unsupported(f"`{node.name}`: the rotary swap has the wrong signs for a rotation")
    return pairing, index, sign[0]


def _rotate(node: Node, c: RotaryTerm, s: RotaryTerm, checker: AngleChecker,
            halves: tuple[RotaryHalf, RotaryHalf] | None = None) -> Track:
    a, r = c.track, s.track
    width = a.shape[-1]
    pairing, index, sign = _pairing(node, a, r)
    half = width // 2
    rotate_half = pairing == [(j + half) % width for j in range(width)]
    factor, verified = _structural_gain(c, s, checker, pairing, rotate_half, halves)
    if not verified:
        measured = _measured_gain(c, s, checker, index, sign, width, halves)
        if measured is not None:
            factor, verified = measured, True
        elif c.trig is None or s.trig is None:
            raise Unsupported(f"`{node.name}`: the rotary tables `{c.table.name}`, "
                              f"`{s.table.name}` could not be evaluated")
    style = ("rotate_half" if rotate_half else
             "interleaved" if pairing == [j ^ 1 for j in range(width)] else "other")
    checker.record(Rotary(style=style, factor=factor, pairing_verified=verified,
                          pairing=tuple(pairing), cos_node=c.table.name, sin_node=s.table.name,
                          signs=tuple(float(v) for v in sign.tolist()),
                          form="halves" if halves else "tables"))
    rows = bc.compact(a.feat).reshape(-1, width).long()
    checker.partners.append((rows.reshape(-1), rows[:, index].reshape(-1)))
    # a rotation of an already rotated value: the gains multiply
    rot = bc.elementwise(lambda v: torch.where(v > 0, v, 1.0) * factor, a.rot)
    return a.with_(rot=rot)


def _structural_gain(c: RotaryTerm, s: RotaryTerm, checker: AngleChecker, pairing,
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
                    and checker.paired(c.angles, pairing))
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


def _measured_gain(c: RotaryTerm, s: RotaryTerm, checker: AngleChecker, index, sign,
                   width: int, halves) -> Optional[float]:
    """The largest 2×2 block norm over every position of the evaluated tables, or None."""
    if halves is None:
        tables = [_table_values(c, checker, width), _table_values(s, checker, width)]
        if any(t is None for t in tables):
            return None
        direct, swapped = _joint(tables)
    else:
        half = width // 2
        parts = [_table_values(t, checker, half) for h in halves for t in (h.direct, h.swapped)]
        if any(t is None for t in parts):
            return None
        parts = _joint(parts)
        direct = torch.cat([parts[0], parts[2]], -1)
        swapped = torch.cat([parts[1], parts[3]], -1)
    return _block_norm(direct, swapped, index, sign)


# --------------------------------------------------------------------------------------
# view_as_complex · z · view_as_real

def to_complex(node: Node, value) -> ComplexValue:
    if not isinstance(value, Track) or value.shape[-1] != 2:
        raise Unsupported(f"`{node.name}`: view_as_complex of a value whose last dim is not "
                          "(real, imaginary)")
    return ComplexValue(value)


def complex_mul(node: Node, value: ComplexValue, other, checker: AngleChecker
                ) -> ComplexValue:
    """``x · z``: a rotation of each (real, imaginary) pair scaled by ``|z|``."""
    bound = _modulus_bound(other, checker) if isinstance(other, Node) else None
    if bound is None and isinstance(other, (int, float)):
        bound = abs(float(other))
    if bound is None:
        name = other.name if isinstance(other, Node) else repr(other)
        raise Unsupported(f"`{node.name}`: complex multiply of the query/key by `{name}`, "
                          "whose modulus is not bounded by constants or parameters")
    return ComplexValue(value.track, (value.factor or 1.0) * bound,
                        other if isinstance(other, Node) else value.table)


def from_complex(node: Node, value: ComplexValue, checker: AngleChecker) -> Track:
    track = value.track
    if not value.factor:
        return track
    rows = bc.compact(track.feat).reshape(-1, 2).long()
    checker.partners.append((rows.reshape(-1), rows.flip(-1).reshape(-1)))
    n = track.shape[-2] * 2
    name = value.table.name if value.table is not None else node.name
    checker.record(Rotary(style="interleaved", factor=value.factor, pairing_verified=True,
                          pairing=tuple(j ^ 1 for j in range(n)), cos_node=name,
                          sin_node=name, signs=(-1.0, 1.0) * (n // 2), form="complex"))
    rot = bc.elementwise(lambda v: torch.where(v > 0, v, 1.0) * value.factor, track.rot)
    return track.with_(rot=rot)


def _modulus_bound(table: Node, checker: AngleChecker) -> Optional[float]:
    """``max |z|``: structurally for ``c · polar(ones, θ)`` (views and casts between), else
    from the evaluated table."""
    factor, node = 1.0, table
    for _ in range(32):
        op = op_of(node)
        if node.op == "call_function" and node.target is torch.polar:
            modulus = node.args[0]
            if isinstance(modulus, Node) and node_is_ones(modulus):
                return factor
            values = checker.evaluate(modulus) if isinstance(modulus, Node) else None
            return None if values is None else factor * float(values.abs().max())
        if op in VALUE_CASTS or op in _TABLE_VIEWS:
            node = node.args[0]
        elif op == "mul" and scalar_constant(node.args[1]) is not None and \
                isinstance(node.args[0], Node):
            factor *= abs(scalar_constant(node.args[1]))
            node = node.args[0]
        else:
            break
        if not isinstance(node, Node):
            return None
    values = checker.evaluate(table)
    if values is None:
        return None
    return float(values.abs().max())


def node_is_ones(node: Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ones_like, torch.ones)
