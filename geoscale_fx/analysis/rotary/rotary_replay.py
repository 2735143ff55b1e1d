"""Rotary position embeddings on the query/key path, recognised as units and proven rotations.

Every form ends as a ``Track`` whose ``rot`` holds a bound on the embedding's gain
(``‖R q‖ ≤ rot · ‖q‖``), and a ``Rotary`` recorded in the replay's ``ReplayRecords``:

- **rotate-half / interleaved**: ``x·cos + rot(x)·sin`` where ``rot(x)`` is a signed pairwise
  swap of ``x``'s elements (``cat(-x2, x1)``, ``stack(-x[1::2], x[::2]).flatten``);
- **halves**: ``cat(x1·cos − x2·sin, x2·cos + x1·sin)`` with half-width tables (gpt-oss,
  DeepSeek's de-interleaved form): joined at the ``cat`` into the rotate-half form;
- **complex**: ``view_as_real(view_as_complex(x) · z)`` (Llama-4): multiplying by ``z`` is a
  rotation scaled by ``|z|``.

The gain itself — proven from one angle per pair, a certified fallback, or measured from the
evaluated tables — is ``analysis.rotary.rotary_gain``'s; the pieces met on the way (``RotaryTerm``,
``RotaryHalf``, ``ComplexValue``) are ``analysis.rotary.rotary_terms``'.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.index.index_track import Track, Unsupported
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotary_gain import (
    measured_gain, modulus_bound, structural_gain,
)
from geoscale_fx.analysis.rotary.rotary_terms import ComplexValue, RotaryHalf, RotaryTerm, trig_origin
from geoscale_fx.sites.terms import Rotary

__all__ = ["table_term", "combine", "join_halves", "to_complex", "complex_mul",
           "from_complex"]


def table_term(node: Node, track: Track, table: Node, records: ReplayRecords
               ) -> Optional[RotaryTerm]:
    """``track * table`` as half of a rotary embedding, or None if the table is neither a
    cos/sin table nor evaluable."""
    trig = trig_origin(table)
    if trig is not None:
        return RotaryTerm(track, *trig, table=table, via=node.name)
    if records.evaluate(table) is not None:
        return RotaryTerm(track, None, None, 1.0, (), False, table=table, via=node.name)
    return None



# --------------------------------------------------------------------------------------
# x·cos + rot(x)·sin, and its halves form

def combine(node: Node, terms: list, records: ReplayRecords, negate: bool):
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
        return _rotate(node, first, second, records)
    return RotaryHalf(first, second)


def join_halves(node: Node, halves: list[RotaryHalf], dim: int, records: ReplayRecords
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
                   replace(first.swapped, track=swapped), records, halves=(first, second))


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


def _rotate(node: Node, c: RotaryTerm, s: RotaryTerm, records: ReplayRecords,
            halves: tuple[RotaryHalf, RotaryHalf] | None = None) -> Track:
    a, r = c.track, s.track
    width = a.shape[-1]
    pairing, index, sign = _pairing(node, a, r)
    half = width // 2
    rotate_half = pairing == [(j + half) % width for j in range(width)]
    factor, verified = structural_gain(c, s, records, pairing, rotate_half, halves)
    if not verified:
        measured = measured_gain(c, s, records, index, sign, width, halves)
        if measured is not None:
            factor, verified = measured, True
        elif c.trig is None or s.trig is None:
            raise Unsupported(f"`{node.name}`: the rotary tables `{c.table.name}`, "
                              f"`{s.table.name}` could not be evaluated")
    style = ("rotate_half" if rotate_half else
             "interleaved" if pairing == [j ^ 1 for j in range(width)] else "other")
    records.record(Rotary(style=style, factor=factor, pairing_verified=verified,
                          pairing=tuple(pairing), cos_node=c.table.name, sin_node=s.table.name,
                          signs=tuple(float(v) for v in sign.tolist()),
                          form="halves" if halves else "tables"))
    rows = bc.compact(a.feat).reshape(-1, width).long()
    records.partners.append((rows.reshape(-1), rows[:, index].reshape(-1)))
    # a rotation of an already rotated value: the gains multiply
    rot = bc.elementwise(lambda v: torch.where(v > 0, v, 1.0) * factor, a.rot)
    return a.with_(rot=rot)


# --------------------------------------------------------------------------------------
# view_as_complex · z · view_as_real

def to_complex(node: Node, value) -> ComplexValue:
    if not isinstance(value, Track) or value.shape[-1] != 2:
        raise Unsupported(f"`{node.name}`: view_as_complex of a value whose last dim is not "
                          "(real, imaginary)")
    return ComplexValue(value)


def complex_mul(node: Node, value: ComplexValue, other, records: ReplayRecords
                ) -> ComplexValue:
    """``x · z``: a rotation of each (real, imaginary) pair scaled by ``|z|``."""
    bound = modulus_bound(other, records) if isinstance(other, Node) else None
    if bound is None and isinstance(other, (int, float)):
        bound = abs(float(other))
    if bound is None:
        name = other.name if isinstance(other, Node) else repr(other)
        raise Unsupported(f"`{node.name}`: complex multiply of the query/key by `{name}`, "
                          "whose modulus is not bounded by constants or parameters")
    return ComplexValue(value.track, (value.factor or 1.0) * bound,
                        other if isinstance(other, Node) else value.table)


def from_complex(node: Node, value: ComplexValue, records: ReplayRecords) -> Track:
    track = value.track
    if not value.factor:
        return track
    rows = bc.compact(track.feat).reshape(-1, 2).long()
    records.partners.append((rows.reshape(-1), rows.flip(-1).reshape(-1)))
    n = track.shape[-2] * 2
    name = value.table.name if value.table is not None else node.name
    records.record(Rotary(style="interleaved", factor=value.factor, pairing_verified=True,
                          pairing=tuple(j ^ 1 for j in range(n)), cos_node=name,
                          sin_node=name, signs=(-1.0, 1.0) * (n // 2), form="complex"))
    rot = bc.elementwise(lambda v: torch.where(v > 0, v, 1.0) * value.factor, track.rot)
    return track.with_(rot=rot)
