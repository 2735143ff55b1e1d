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
from typing import Any

import torch
from torch.fx import Node

from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.rotary import rotary_replay
from geoscale_fx.analysis.fx.dtensor import replay_dtensor
from geoscale_fx.analysis.fx.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, arg, example_value, op_of, scalar_constant, shape_of,
    static_int,
)
from geoscale_fx.analysis.index.index_track import Track, Unsupported
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotary_terms import ComplexValue, RotaryHalf, RotaryTerm, trig_origin

__all__ = ["Unsupported", "Track", "RotaryTerm", "replay", "normalize",
           "trig_origin"]


def replay(path: list[Node], roots: Node | dict[Node, int], records: ReplayRecords,
           units: dict[Node, tuple[Node, int]] | None = None,
           assembled: dict[Node, list] | None = None) -> dict[Node, Any]:
    """Replay ``path`` (topologically ordered nodes between the roots and an operand).

    ``roots``: a projection, or several with the offset their features are numbered from.
    ``units`` maps the last node of a normalization chain after the projection (QK-norm:
    the norm and its per-channel gains) to ``(the norm's input, unit id)``; the chain is
    replayed as one op (:func:`normalize`), its inner nodes are not on ``path``.
    ``assembled`` maps a buffer written by ``copy_`` into slices of its last dim to its
    writes ``(start, stop, source, copy)``: it is replayed as the concatenation.
    """
    roots = roots if isinstance(roots, dict) else {roots: 0}
    env: dict[Node, Any] = {}
    for root, offset in roots.items():
        shape = shape_of(root)
        if shape is None:
            raise Unsupported(f"projection `{root.name}` has no recorded shape")
        env[root] = Track.root(shape, offset)
    units, assembled = units or {}, assembled or {}
    for node in path:
        if node in roots:
            continue
        if node in units:
            source, unit = units[node]
            env[node] = normalize(node, env[source], unit, records)
        elif node in assembled:
            env[node] = _replay_writes(node, assembled[node], env)
        else:
            env[node] = _replay_node(node, env, records)
    return env


def _replay_writes(node: Node, writes: list, env: dict[Node, Any]) -> Track:
    """A buffer filled slice by slice along its last dim: the writes concatenated (each
    source broadcast to its slice, as ``copy_`` does)."""
    shape = shape_of(node)
    parts = []
    for start, stop, source, _ in writes:
        value = env.get(source) if isinstance(source, Node) else None
        if not isinstance(value, Track):
            name = source.name if isinstance(source, Node) else repr(source)
            raise Unsupported(f"`{node.name}`: slice [{start}:{stop}] is written with `{name}`, "
                              "which does not come from a projection")
        target = (*shape[:-1], stop - start)
        parts.append(value.map(lambda t: t.expand(target)))
    return Track(*(bc.concat([getattr(p, f) for p in parts], -1) for f in Track.FIELDS))


def normalize(node: Node, value: Any, unit: int, records: ReplayRecords) -> Track:
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
    records.record_norm(unit, width, position)
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
    if op in ("expand_as", "view_as"):
        shape = shape_of(node.args[1])    # the other tensor (tracked or not) lends a shape
        fn = (lambda t: t.expand(shape)) if op == "expand_as" else (lambda t: t.reshape(shape))
        return env[tracked].map(fn)
    args = [None if a is tracked else _static(a, env) for a in node.args]
    kwargs = {k: _static(v, env) for k, v in node.kwargs.items()}
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


def _replay_node(node: Node, env: dict[Node, Any], records: ReplayRecords) -> Any:
    op = op_of(node)
    if op in ("cat", "stack"):
        return _replay_concat(node, env, op, records)
    if op in ("add", "sub"):
        terms = [env.get(a) if isinstance(a, Node) else None for a in node.args[:2]]
        if all(isinstance(t, Track) for t in terms):
            return _replay_sum(node, *terms, records, negate=op == "sub")
        return rotary_replay.combine(node, terms, records, negate=op == "sub")
    if op in VALUE_CASTS and isinstance(node.args[0], Node) and node.args[0] in env:
        return env[node.args[0]]   # ``x.type_as(y)``: y (even if tracked) only lends a dtype
    if op in ("expand_as", "view_as") and node.args[0] in env:
        tracked = node.args[0]     # ``x.reshape_as(y)``: y (even if tracked) lends a shape
    else:
        tracked = _single_tracked(node, env)
    value = env[tracked]
    if isinstance(value, (RotaryTerm, RotaryHalf)):
        term = value if isinstance(value, RotaryTerm) else value.direct
        if term.trig is None:
            raise Unsupported(f"`{term.via}`: mul of the query/key by `{term.table.name}`, "
                              "which is neither a constant nor a rotary cos/sin table")
        raise Unsupported(f"`{node.name}` ({op}) uses half of a rotary embedding on its own")
    if node.op == "call_function" and node.target is torch.view_as_complex:
        return rotary_replay.to_complex(node, value)
    if isinstance(value, ComplexValue):
        if node.op == "call_function" and node.target is torch.view_as_real:
            return rotary_replay.from_complex(node, value, records)
        if op == "mul":
            other = node.args[1] if node.args[0] is tracked else node.args[0]
            return rotary_replay.complex_mul(node, value, other, records)
        raise Unsupported(f"`{node.name}` ({op or node.target}) on a complex view of the "
                          "query/key is not a multiply by a rotation table")
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
        return _replay_scale(node, tracked, env, op, records)
    if op in ("from_local", "to_local", "redistribute", "full_tensor"):  # tensor parallel
        return replay_dtensor(node, op, value)
    if op in DATA_MOVEMENT:
        return _apply(node, tracked, env, op)
    raise Unsupported(f"`{node.name}` ({op or node.target}) on the path from the projection "
                      "is not a reshape, slice, cast, scalar scale or rotary embedding")


def _replay_sum(node: Node, main: Track, extra: Track, records: ReplayRecords,
                negate: bool) -> Track:
    """``main ± extra`` element by element (a LoRA adapter's output added to the base
    projection's): kept as ``main``'s elements, the pairs recorded in ``records.sums`` for
    the analysis to fold ``extra``'s weights into ``main``'s (same source) or make it a term
    of its own."""
    if main.shape != extra.shape or not bc.all_equal(main.tok, extra.tok) or \
            bool((bc.compact(main.rot) > 0).any()) or bool((bc.compact(extra.rot) > 0).any()):
        raise Unsupported(f"`{node.name}` adds to the query/key something other than a rotary "
                          "embedding's second half (e.g. a bias after reshaping, or a mix of "
                          "two projections)")
    ratio = bc.compact(extra.gain) / bc.compact(main.gain)
    ratio = ratio.reshape(-1)
    if not bool((ratio == ratio[0]).all()):
        raise Unsupported(f"`{node.name}` adds two projections scaled non-uniformly")
    # both compacted along the dims broadcast in both, so that elements stay paired
    index = tuple(slice(0, 1) if size > 1 and a == 0 and b == 0 else slice(None)
                  for size, a, b in zip(main.shape, main.feat.stride(), extra.feat.stride()))
    kept, added = main.feat[index].reshape(-1), extra.feat[index].reshape(-1)
    records.sums.append((kept, added, float(-ratio[0] if negate else ratio[0])))
    return main


def _replay_concat(node: Node, env: dict[Node, Any], op: str, records: ReplayRecords
                   ) -> Track:
    tensors = arg(node, 0, "tensors")
    dim = _static(arg(node, 1, "dim", 0), env)
    parts = []
    for t in tensors:
        if isinstance(t, Node) and t in env:
            parts.append(env[t])
            continue
        shape = shape_of(t)
        if shape is not None and math.prod(shape) == 0:
            continue  # torch.cat([torch.tensor([]), k]): an empty (KV-cache) prefix
        name = t.name if isinstance(t, Node) else repr(t)
        raise Unsupported(f"`{node.name}`: {op} with `{name}`, which does not come from the "
                          "projection (e.g. a KV cache); its logits cannot be bounded")
    if op == "cat" and parts and all(isinstance(p, RotaryHalf) for p in parts):
        return rotary_replay.join_halves(node, parts, dim, records)
    if not all(isinstance(p, Track) for p in parts):
        raise Unsupported(f"`{node.name}`: {op} of a partial rotary term")
    if op == "cat" and len(parts) == 1:
        return parts[0]
    return Track(*(bc.concat([getattr(p, f) for p in parts], dim, stack=op == "stack")
                   for f in Track.FIELDS))


def _replay_scale(node: Node, tracked: Node, env: dict[Node, Any], op: str,
                  records: ReplayRecords) -> Any:
    other = node.args[1] if node.args[0] is tracked else node.args[0]
    if op == "div" and node.args[0] is not tracked:
        raise Unsupported(f"`{node.name}`: divides by the query/key")
    value = scalar_constant(other)
    if value is not None and op == "div" and value == 0:
        raise Unsupported(f"`{node.name}`: divides the query/key by zero")
    track = env[tracked]
    if value is not None:
        factor = 1.0 / value if op == "div" else value
        return track.with_(gain=bc.elementwise(lambda g: g * factor, track.gain))
    if op == "mul" and isinstance(other, Node):
        if trig_origin(other) is None and records.multiplier(other, track) is not None:
            return track   # a per-position scalar (attention temperature): bounded by max |t|
        term = rotary_replay.table_term(node, track, other, records)
        if term is not None:
            return term
    name = other.name if isinstance(other, Node) else repr(other)
    raise Unsupported(f"`{node.name}`: {op} of the query/key by `{name}`, which is neither a "
                      "constant nor a rotary cos/sin table")
