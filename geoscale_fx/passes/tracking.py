"""Index tracking: replay the ops between a projection and an attention operand on indices.

Instead of one hand-written pattern per layout (split vs chunk vs slicing, per-head interleaved
fused QKV, GQA ``expand`` + ``reshape`` …), the chain of data-movement ops between a projection
output ``P`` (shape ``(..., F)``) and an attention operand is *executed* on integer tensors
shaped like ``P``: ``feat`` holds each element's output feature ``f``, ``tok`` its token row.
Whatever the ops do, the operand's ``feat`` then says exactly which column of ``W`` produced
each element — the normal form the analysis needs. Scalar multiplications and sign flips are
tracked in ``gain``; a rotary embedding (``x·cos + rot(x)·sin``) is recognised as a unit and
verified to be a rotation, its norm factor kept in ``rot``.

Anything else on the path raises :class:`Unsupported` naming the node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import Node

from geoscale_fx.passes import broadcast as bc
from geoscale_fx.passes.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, arg, example_value, op_of, scalar_constant, shape_of,
    static_int,
)
from geoscale_fx.passes.site_model import Rotary

__all__ = ["Unsupported", "Track", "RotaryTerm", "replay", "normalize"]


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
    def root(cls, shape: tuple[int, ...]) -> "Track":
        n_rows, n_feat = math.prod(shape[:-1]), shape[-1]
        feat = torch.arange(n_feat, dtype=torch.int32).expand(shape)
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


@dataclass
class RotaryTerm:
    """``track * table`` where the table is ``m · cos(E)`` or ``m · sin(E)`` (half of RoPE)."""
    track: Track
    trig: str            # "cos" | "sin"
    angles: Node         # E
    factor: float        # m
    chain: tuple         # the view ops from cos/sin(E) to the table, to compare both halves
    keeps_last: bool     # every node from E to the table keeps E's last dim (no slicing)
    table: Node


def replay(path: list[Node], root: Node, resolver: "AngleChecker",
           units: dict[Node, tuple[Node, int]] | None = None) -> dict[Node, Any]:
    """Replay ``path`` (topologically ordered nodes between ``root`` and an operand).

    ``units`` maps the last node of a normalization chain after the projection (QK-norm:
    the norm and its per-channel gains) to ``(the norm's input, unit id)``; the chain is
    replayed as one op (:func:`normalize`), its inner nodes are not on ``path``.
    """
    shape = shape_of(root)
    if shape is None:
        raise Unsupported(f"projection `{root.name}` has no recorded shape")
    env: dict[Node, Any] = {root: Track.root(shape)}
    units = units or {}
    for node in path:
        if node is root:
            continue
        if node in units:
            source, unit = units[node]
            env[node] = normalize(node, env[source], unit, resolver)
        else:
            env[node] = _replay_node(node, env, resolver)
    return env


def normalize(node: Node, value: Any, unit: int, checker: "AngleChecker") -> Track:
    """A normalization over the last dim (and its per-channel gains) applied to a track.

    Each last-dim row must be one token's vector; its elements keep their feature index, so
    the output is ``x̂`` indexed by projection feature, with ``‖row‖ ≤ √width``. Scalar gains
    and rotations before the norm do not survive it. Records where each feature sits in its
    row (the index of its per-channel gain).
    """
    if not isinstance(value, Track):
        raise Unsupported(f"`{node.name}` normalizes half of a rotary embedding")
    tok = bc.compact(value.tok)
    if not bool((tok == tok[..., :1]).all()):
        raise Unsupported(f"`{node.name}` normalizes across tokens")
    width = value.shape[-1]
    feat = bc.compact(value.feat)
    rows = feat.expand(*feat.shape[:-1], width).reshape(-1, width)
    position: dict[int, int] = {}
    for row in rows.tolist():
        if len(set(row)) != len(row):
            raise Unsupported(f"`{node.name}` normalizes a row holding a feature twice")
        for j, f in enumerate(row):
            if position.setdefault(f, j) != j:
                raise Unsupported(f"`{node.name}`: feature {f} sits at different positions "
                                  "of the normalized rows")
    checker.record_norm(unit, width, position)
    return value.with_(gain=torch.ones((), dtype=torch.float32).expand(value.shape),
                       rot=torch.zeros((), dtype=torch.float32).expand(value.shape),
                       src=torch.full((), unit, dtype=torch.int32).expand(value.shape))


# --------------------------------------------------------------------------------------

def _static(value: Any, env: dict[Node, Any]) -> Any:
    """Resolve a non-tracked argument to a static Python value (sizes, dims, slices)."""
    if isinstance(value, Node):
        if value in env:
            raise Unsupported(f"`{value.name}` is used as a size or index")
        ev = example_value(value)
        if isinstance(ev, (int, float, bool, torch.SymInt, torch.SymFloat)):
            return static_int(ev) if isinstance(ev, (int, torch.SymInt)) else ev
        if isinstance(ev, torch.Size):
            return tuple(static_int(s) for s in ev)
        raise Unsupported(f"`{value.name}` ({op_of(value) or value.op}) is a tensor used as "
                          "an index or size on the query/key path")
    if isinstance(value, slice):
        return slice(_static(value.start, env), _static(value.stop, env),
                     _static(value.step, env))
    if isinstance(value, (tuple, list)):
        return type(value)(_static(v, env) for v in value)
    if isinstance(value, torch.SymInt):
        return static_int(value)
    return value


def _apply(node: Node, tracked: Node, env: dict[Node, Any], op: str) -> Any:
    """Run ``node``'s op with each index tensor of ``tracked`` in its place."""
    args = [None if a is tracked else _static(a, env) for a in node.args]
    kwargs = {k: _static(v, env) for k, v in node.kwargs.items()}
    if op in ("expand_as", "view_as"):
        other = node.args[1]
        if other is tracked:
            raise Unsupported(f"`{node.name}`: {op} of the query/key with itself")
        shape = shape_of(other)
        fn = (lambda t: t.expand(shape)) if op == "expand_as" else (lambda t: t.reshape(shape))
        return env[tracked].map(fn)
    if op in ("view", "reshape"):
        sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if any(isinstance(a, torch.dtype) for a in sizes):
            raise Unsupported(f"`{node.name}`: view as another dtype reinterprets bits")
        sizes = kwargs.get("shape", sizes)

        def fn(t):
            return bc.reshape(t, [int(x) for x in sizes])
    elif node.op == "call_method":
        def fn(t):
            return getattr(t, node.target)(*args[1:], **kwargs)
    else:
        position = node.args.index(tracked)

        def fn(t):
            call = list(args)
            call[position] = t
            return node.target(*call, **kwargs)
    track = env[tracked]
    parts = [fn(t) for t in track.fields()]
    if isinstance(parts[0], (tuple, list)):  # split / chunk / unbind
        return tuple(Track(*p) for p in zip(*parts))
    return Track(*parts)


def _single_tracked(node: Node, env: dict[Node, Any]) -> Node:
    tracked = [n for n in node.all_input_nodes if n in env]
    if len(tracked) != 1:
        raise Unsupported(f"`{node.name}` ({op_of(node) or node.target}) combines "
                          f"{len(tracked)} values derived from the projection")
    return tracked[0]


def _replay_node(node: Node, env: dict[Node, Any], checker: "AngleChecker") -> Any:
    op = op_of(node)
    if op in ("cat", "stack"):
        return _replay_concat(node, env, op)
    if op == "add":
        return _replay_add(node, env, checker)
    if op in VALUE_CASTS and isinstance(node.args[0], Node) and node.args[0] in env:
        return env[node.args[0]]   # ``x.type_as(y)``: y (even if tracked) only lends a dtype
    tracked = _single_tracked(node, env)
    value = env[tracked]
    if isinstance(value, RotaryTerm):
        raise Unsupported(f"`{node.name}` ({op}) uses half of a rotary embedding on its own")
    if op == "getitem" and isinstance(value, tuple):
        return value[_static(node.args[1], env)]
    if op in VALUE_CASTS:
        if node.args[0] is not tracked:
            raise Unsupported(f"`{node.name}` ({op}) takes the query/key only as a dtype "
                              "reference; its value comes from elsewhere")
        return value
    if op == "dropout":
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
        if not training or p == 0:
            return value
        raise Unsupported(f"`{node.name}`: dropout (training) applied to queries/keys")
    if op == "neg":
        return value.with_(gain=bc.elementwise(torch.neg, value.gain))
    if op in ("mul", "div"):
        return _replay_scale(node, tracked, env, op)
    if op in ("from_local", "to_local", "redistribute", "full_tensor"):  # tensor parallel
        from geoscale_fx.passes.dtensor import replay_dtensor

        return replay_dtensor(node, op, value)
    if op in DATA_MOVEMENT:
        return _apply(node, tracked, env, op)
    raise Unsupported(f"`{node.name}` ({op or node.target}) on the path from the projection "
                      "is not a reshape, slice, cast, scalar scale or rotary embedding")


def _replay_concat(node: Node, env: dict[Node, Any], op: str) -> Track:
    tensors = arg(node, 0, "tensors")
    dim = _static(arg(node, 1, "dim", 0), env)
    parts = []
    for t in tensors:
        if isinstance(t, Node) and t in env:
            if not isinstance(env[t], Track):
                raise Unsupported(f"`{node.name}`: {op} of a partial rotary term")
            parts.append(env[t])
            continue
        shape = shape_of(t)
        if shape is not None and math.prod(shape) == 0:
            continue  # torch.cat([torch.tensor([]), k]): an empty (KV-cache) prefix
        name = t.name if isinstance(t, Node) else repr(t)
        raise Unsupported(f"`{node.name}`: {op} with `{name}`, which does not come from the "
                          "projection (e.g. a KV cache); its logits cannot be bounded")
    if op == "cat" and len(parts) == 1:
        return parts[0]
    return Track(*(bc.concat([getattr(p, f) for p in parts], dim, stack=op == "stack")
                   for f in Track.FIELDS))


def _replay_scale(node: Node, tracked: Node, env: dict[Node, Any], op: str) -> Any:
    other = node.args[1] if node.args[0] is tracked else node.args[0]
    if op == "div" and node.args[0] is not tracked:
        raise Unsupported(f"`{node.name}`: divides by the query/key")
    value = scalar_constant(other)
    if value is not None and op == "div" and value == 0:
        raise Unsupported(f"`{node.name}`: divides the query/key by zero")
    if value is not None:
        factor = 1.0 / value if op == "div" else value
        track = env[tracked]
        return track.with_(gain=bc.elementwise(lambda g: g * factor, track.gain))
    if op == "mul" and isinstance(other, Node):
        trig = _trig_origin(other)
        if trig is not None:
            return RotaryTerm(env[tracked], *trig, table=other)
    name = other.name if isinstance(other, Node) else repr(other)
    raise Unsupported(f"`{node.name}`: {op} of the query/key by `{name}`, which is neither a "
                      "constant nor a rotary cos/sin table")


_TABLE_VIEWS = frozenset({"unsqueeze", "view", "reshape", "getitem", "expand", "squeeze",
                          "transpose", "permute", "flatten"})


def _trig_origin(table: Node):
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


def _replay_add(node: Node, env: dict[Node, Any], checker: "AngleChecker") -> Track:
    terms = [env.get(a) if isinstance(a, Node) else None for a in node.args[:2]]
    if not all(isinstance(t, RotaryTerm) for t in terms):
        raise Unsupported(f"`{node.name}` adds to the query/key something other than a rotary "
                          "embedding's second half (e.g. a bias after reshaping, or a mix of "
                          "two projections)")
    cos_terms = [t for t in terms if t.trig == "cos"]
    sin_terms = [t for t in terms if t.trig == "sin"]
    if len(cos_terms) != 1 or len(sin_terms) != 1:
        raise Unsupported(f"`{node.name}`: a rotary embedding needs one cos and one sin term")
    return _rotate(node, cos_terms[0], sin_terms[0], checker)


def _rotate(node: Node, c: RotaryTerm, s: RotaryTerm, checker: "AngleChecker") -> Track:
    a, r = c.track, s.track
    if a.shape != r.shape:
        raise Unsupported(f"`{node.name}`: rotary halves have shapes {a.shape} and {r.shape}")
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
    factor = max(abs(c.factor), abs(s.factor))
    same_angle = c.angles is s.angles and c.chain == s.chain   # element j: cos E_j, sin E_j
    verified = (same_angle and c.factor == s.factor and c.keeps_last and s.keeps_last
                and checker.paired(c.angles, pairing))
    if not verified:
        # each 2×2 block [[m·cos a, ∓m·sin a], [±m·sin b, m·cos b]]: with one angle per
        # element its rows have norm ≤ m, so ‖block‖₂ ≤ √2·m; with cos and sin of different
        # angles only its entries are ≤ m, and ‖block‖₂ ≤ ‖block‖_F ≤ 2m
        factor *= math.sqrt(2.0) if same_angle else 2.0
    half = width // 2
    style = ("rotate_half" if pairing == [(j + half) % width for j in range(width)] else
             "interleaved" if pairing == [j ^ 1 for j in range(width)] else "other")
    checker.record(Rotary(style=style, factor=factor, pairing_verified=verified,
                          pairing=tuple(pairing), cos_node=c.table.name, sin_node=s.table.name,
                          signs=tuple(float(v) for v in sign[0].tolist())))
    rows = bc.compact(a.feat).reshape(-1, width).long()
    checker.partners.append((rows.reshape(-1), rows[:, index].reshape(-1)))
    # a rotation of an already rotated value: the gains multiply
    rot = bc.elementwise(lambda r: torch.where(r > 0, r, 1.0) * factor, a.rot)
    return a.with_(rot=rot)


class AngleChecker:
    """Verifies that paired rotary elements share their angle (``E[j] == E[pairing[j]]``).

    Structural proof first (``E = cat((f, f), -1)`` for rotate-half, ``repeat_interleave``
    by 2 for interleaved); otherwise numerically, when ``E`` depends only on constants and
    buffers (``evaluate`` returns None when it cannot). Records the rotaries it saw.
    """

    def __init__(self, evaluate: Callable[[Node], torch.Tensor | None]):
        self._evaluate = evaluate
        self.rotaries: list[Rotary] = []
        self.norms: dict[int, tuple[int, dict[int, int]]] = {}   # unit → (width, positions)
        #: (feature, the feature it rotates with) of every rotated element, as index tensors
        self.partners: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, rotary: Rotary) -> None:
        self.rotaries.append(rotary)

    def record_norm(self, unit: int, width: int, positions: dict[int, int]) -> None:
        self.norms[unit] = (width, positions)

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
        values = self._evaluate(angles)
        if values is None or values.shape[-1] != width or values.device.type == "meta":
            return False
        return bool((values == values[..., pairing]).all())
