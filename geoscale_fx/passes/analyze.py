"""The analysis pass: every attention site of a GraphModule, traced back to its weights.

``analyze_graph(gm, example_inputs)`` is what both ``geoscale_fx.find_attention`` and the
backend run on the graph Dynamo captured. It never modifies ``gm``.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx.fp8 import FP8_DTYPES
from geoscale_fx.passes import broadcast as bc
from geoscale_fx.passes.cached_keys import key_sources
from geoscale_fx.passes.dtensor import dtensor_of, localize_term, to_local
from geoscale_fx.passes.evaluate import ParamEvaluator
from geoscale_fx.passes.find_sites import Candidate, find_candidates
from geoscale_fx.passes.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, ValueKinds, arg, example_value, matmul_operands, module_path,
    op_of,
    parameter_name, shape_of, upstream,
)
from geoscale_fx.passes.provenance import (
    HeadRows, NormalizedInput, OperandTrace, ProjectionOp, head_rows, parameter_names,
    trace_normalized_input, trace_operand,
)
from geoscale_fx.passes.tracking import AngleChecker, Track, Unsupported
from geoscale_fx.site_model import (
    ROPE_BOUNDS, AttentionSite, Modifier, Side, Source, Term,
)

__all__ = ["analyze_graph"]

log = logging.getLogger("geoscale_fx")


def analyze_graph(gm: GraphModule, example_inputs: Sequence[Any], *, graph_index: int = 0,
                  first_index: int = 0, rope_bound: str = "norm_product"
                  ) -> list[AttentionSite]:
    """Find and analyse every attention in ``gm`` (a Dynamo graph: params are placeholders)."""
    if rope_bound not in ROPE_BOUNDS:
        raise ValueError(f"rope_bound must be one of {ROPE_BOUNDS}, got {rope_bound!r}")
    kinds = ValueKinds(gm.graph, example_inputs)
    evaluator = ParamEvaluator(gm, example_inputs, kinds)
    order = NodeOrder(gm.graph)
    by_name = order.by_name

    def resolve(name: str) -> torch.Tensor:
        value = evaluator.evaluate(by_name[name])
        if value is None:
            raise ValueError(f"graph node {name!r} is not a function of the parameters")
        return to_local(value)   # tensor parallel: sites index the rank's local shards

    sites = []
    for i, cand in enumerate(find_candidates(gm.graph, kinds)):
        base = dict(name=module_path(cand.node) or cand.node.name, index=first_index + i,
                    kind=cand.kind, node=cand.node.name, graph=graph_index,
                    rope_bound=rope_bound,
                    nodes=tuple((role, n.name) for role, n in cand.roles.items()),
                    score_op=op_of(cand.roles["scores"]) if "scores" in cand.roles else "")
        try:
            if cand.failure:
                raise Unsupported(cand.failure)
            fields = _ANALYZERS[cand.kind](cand, kinds, evaluator, order)
            site = AttentionSite(**base, supported=True, _resolve=resolve, **fields)
        except Unsupported as exc:
            site = AttentionSite(**base, supported=False, reason=str(exc),
                                 is_causal=cand.is_causal, has_mask=cand.has_mask)
            log.info("geoscale: attention %s (%s) left as is: %s", site.name, site.node,
                     site.reason)
        sites.append(site)
    return sites


class NodeOrder(dict):
    """Position of every node of a graph, and its nodes by name (built once per graph)."""

    def __init__(self, graph):
        super().__init__((n, i) for i, n in enumerate(graph.nodes))
        self.by_name = {n.name: n for n in self}


# --------------------------------------------------------------------------------------

def _source(norm: NormalizedInput, channel_index: tuple[int, ...] = ()) -> Source:
    channel_ops = tuple((kind, v.name if isinstance(v, Node) else float(v))
                        for kind, v in norm.channel_ops)
    return Source(norm=norm.norm, node=norm.node.name, width=norm.model_dim,
                  channel_ops=channel_ops, radius_factor=norm.radius_factor,
                  channel_index=channel_index)


def _side_of(trace: OperandTrace, rows: HeadRows, checker: AngleChecker, kinds: ValueKinds,
             features=None, offset: int = 0) -> Side:
    """A side from its operand's trace: the projection's normalized input, or the QK-norm
    the operand is made of (then the side has no weight of its own)."""
    unit = trace.norm_unit
    if unit is None:
        norm = trace_normalized_input(trace.projection.x, kinds, trace.projection.root)
        side = _side(trace.projection, rows, norm, checker.rotaries, features=features)
    else:
        width, position = checker.norms[unit.id]
        n_features = (shape_of(trace.projection.root) or (0,))[-1]
        index = tuple(position.get(f + offset, -1) for f in range(n_features))
        rotary = _rotary(rows, checker.rotaries)
        side = Side(source=_source(unit.norm, index), weight=None, layout="identity",
                    features=features if features is not None else rows.features,
                    rotary=rotary, operand_gain=rows.gain)
    if side.rotary is None:
        return side
    return replace(side, pairs=_pairs(side.features, offset, checker))


def _pairs(features, offset: int, checker: AngleChecker) -> tuple[int, ...]:
    """Per head channel, the channel it is rotated with (-1: not rotated), the same in every
    head; () when not known (stacked rotations, or heads that differ)."""
    if len(checker.rotaries) != 1 or not features:
        return ()
    if len({len(head) for head in features}) != 1:
        return ()
    heads = _index_table(tuple(tuple(head) for head in features)) + offset
    partner = _partner_table(checker, int(heads.max()) + 1)          # feature -> partner
    width = partner.numel()
    # position of every feature inside its own head (-1: not in that head)
    position = torch.full((heads.shape[0], width), -1, dtype=torch.long)
    position.scatter_(1, heads, torch.arange(heads.shape[1]).expand_as(heads).contiguous())
    partners = partner[heads]                                         # (heads, head_dim)
    rotated = partners >= 0
    rows = torch.where(rotated, position.gather(1, partners.clamp(min=0)), -1)
    if bool((rotated & (rows < 0)).any()):
        return ()      # a partner outside the head (checked elsewhere) or another term
    if bool((rows != rows[0]).any()):
        return ()
    return tuple(rows[0].tolist())


@functools.lru_cache(maxsize=256)
def _index_table(rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``rows`` (equal lengths) as a long tensor, built once per distinct table: the heads'
    feature tables of a model's layers repeat, and each is checked several times. Read-only
    (callers derive new tensors from it)."""
    return torch.tensor(rows, dtype=torch.long)


def _partner_table(checker: AngleChecker, width: int) -> torch.Tensor:
    """``table[f]``: the feature rotated with feature ``f`` (-1: none), over at least
    ``width`` features (the last recorded pairing of a feature wins)."""
    width = max([width] + [int(t.max()) + 1 for pair in checker.partners for t in pair
                           if t.numel()])
    table = torch.full((width,), -1, dtype=torch.long)
    for feature, partner in checker.partners:
        table[feature.long()] = partner.long()
    return table


def _rotary(rows: HeadRows, rotaries):
    if rows.rotation <= 0:
        return None
    if not rotaries:
        raise Unsupported("internal: rotation without a recorded rotary embedding")
    # stacked rotations: the factor is their product (rows.rotation), verified only if all are
    return replace(rotaries[-1], factor=rows.rotation, partial=rows.partial_rotation,
                   pairing_verified=all(r.pairing_verified for r in rotaries))


def _side(trace_proj: ProjectionOp, rows: HeadRows, norm: NormalizedInput, rotaries,
          features=None, bias_offset: int = 0) -> Side:
    """The site-facing description of one side (``rows``: what reached the operand)."""
    rotary = _rotary(rows, rotaries)
    weight_param, bias_param = parameter_names(trace_proj)
    return Side(
        source=_source(norm), weight=trace_proj.weight.name, layout=trace_proj.layout,
        features=features if features is not None else rows.features,
        bias=trace_proj.bias.name if trace_proj.bias is not None else None, rotary=rotary,
        weight_param=weight_param, bias_param=bias_param, bias_offset=bias_offset,
        operand_gain=rows.gain)


def _pair_heads(cand: Candidate, q: HeadRows, k: HeadRows) -> tuple[list[int], tuple]:
    """Key head of every query head; reorders key heads so that query head h reads h // g."""
    q_map, k_map = q.head_of_row, k.head_of_row
    if cand.gqa:
        if q_map.dim() < 1 or k_map.dim() < 1 or q_map.shape[-1] % k_map.shape[-1]:
            raise Unsupported(f"`{cand.node.name}`: enable_gqa with incompatible head counts")
        k_map = k_map.repeat_interleave(q_map.shape[-1] // k_map.shape[-1], dim=-1)
    try:
        lead = torch.broadcast_shapes(q_map.shape, k_map.shape)
    except RuntimeError:
        raise Unsupported(f"`{cand.node.name}`: query and key batch/head shapes "
                          f"{tuple(q_map.shape)} and {tuple(k_map.shape)} do not broadcast")
    pairs = torch.stack([q_map.expand(lead).reshape(-1), k_map.expand(lead).reshape(-1)], 1)
    kv_of_q: dict[int, int] = {}
    for qh, kh in pairs.tolist():
        if kv_of_q.setdefault(qh, kh) != kh:
            raise Unsupported(f"`{cand.node.name}`: query head {qh} reads different key heads "
                              "in different batch entries")
    n_q = len(q.features)
    order: dict[int, int] = {}
    for h in range(n_q):
        order.setdefault(kv_of_q[h], len(order))
    n_kv = len(order)
    mapping = [order[kv_of_q[h]] for h in range(n_q)]
    if n_q % n_kv or mapping != [h // (n_q // n_kv) for h in range(n_q)]:
        raise Unsupported(f"`{cand.node.name}`: query heads share key heads in a "
                          f"non-contiguous grouping {mapping}")
    k_features = tuple(k.features[kh] for kh in sorted(order, key=order.__getitem__))
    return mapping, k_features


def _analyze_operands(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    for role, operand in (("query", cand.query), ("key", cand.key)):
        if dtensor_of(operand) is not None:
            raise Unsupported(f"the {role} `{operand.name}` is a DTensor (global view, "
                              f"{tuple(dtensor_of(operand).placements)}): geoscale rewrites "
                              "attention on local tensors (use_local_output=True)")
    checkers = {role: AngleChecker(evaluator) for role in ("query", "key")}
    q_trace = trace_operand(cand.query, kinds, checkers["query"], "query", order)
    q_track = q_trace.track
    if cand.query_perm is not None:
        q_track = q_track.map(lambda t: t.permute(cand.query_perm))
    try:
        k_trace = trace_operand(cand.key, kinds, checkers["key"], "key", order)
    except Unsupported as exc:
        if not _reads_cache(cand.key):
            raise
        return _analyze_cached_keys(cand, kinds, q_trace, q_track, checkers["query"], exc)
    k_track = k_trace.track
    if cand.key_layout == "dk":
        k_track = k_track.map(lambda t: t.transpose(-1, -2))
    elif cand.key_perm is not None:
        k_track = k_track.map(lambda t: t.permute(cand.key_perm))
    q_rows = head_rows(q_track, cand.query, "query")
    k_rows = head_rows(k_track, cand.key, "key")
    if q_track.shape[-1] != k_track.shape[-1]:
        raise Unsupported(f"`{cand.node.name}`: query and key head widths differ")
    for role, rows in (("query", q_rows), ("key", k_rows)):
        _check_rotations_whole(cand, role, rows, checkers[role])
    _mapping, k_features = _pair_heads(cand, q_rows, k_rows)
    k_rows = replace(k_rows, features=k_features)
    terms = []
    for channels in _term_channels(cand, (q_trace, q_rows), (k_trace, k_rows), checkers):
        q_sides, k_sides = (
            _term_side(cand, role, trace, track, rows, channels, checkers[role], kinds)
            for role, trace, track, rows in (("query", q_trace, q_track, q_rows),
                                             ("key", k_trace, k_track, k_rows)))
        terms += [Term(q, k) for q in q_sides for k in k_sides]
    terms, shard = _localize(cand, terms, q_track.shape[-1], order.by_name)
    fields = _fields(cand, terms, q_rows.gain * k_rows.gain, q_track.shape[-2],
                     k_track.shape[-2], q_rows.head_of_row, head_dim=q_track.shape[-1])
    value = _value_side(cand, kinds, evaluator, order) if shard is None else \
        {"value_reason": "tensor parallel: the values' bound per local shard is not derived"}
    return {**fields, **value, "shard": shard}


def _localize(cand: Candidate, terms: list[Term], head_dim: int, by_name: dict[str, Node]
              ) -> tuple[list[Term], object]:
    """Tensor parallel: every term's sides on the rank's local weight shards, and the one
    ``HeadShard`` they share (None without DTensor weights)."""
    local, shards = [], []
    for term in terms:
        q, k, shard = localize_term(term.q, term.k, by_name, head_dim)
        local.append(Term(q, k))
        shards.append(shard)
    found = [s for s in shards if s is not None]
    if found and (len(found) != len(shards) or any(s != found[0] for s in found)):
        raise Unsupported(f"`{cand.node.name}`: the terms of the logits are sharded "
                          "differently across ranks")
    return local, (found[0] if found else None)


def _value_side(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    """The values' side (for their amax bound), or why it could not be traced. Never makes
    the site unsupported: the logits do not depend on the values."""
    node = cand.node
    if cand.kind == "sdpa":
        value = node.args[2]
    else:
        pv = cand.roles.get("pv")
        value = matmul_operands(pv)[1] if pv is not None and op_of(pv) in (
            "matmul", "bmm") else None
    if not isinstance(value, Node):
        return {"value_reason": "no value operand found"}
    checker = AngleChecker(evaluator)
    try:
        trace = trace_operand(value, kinds, checker, "value", order)
        rows = head_rows(trace.track, value, "value")
        if len(trace.projections) == 1:
            return {"value": _side_of(trace, rows, checker, kinds)}
        # several projections: a map added to the values' projection (LoRA on v) folds
        # into its weight as for q and k; anything else is not one side
        channels = list(range(trace.track.shape[-1]))
        sides = _term_side(cand, "value", trace, trace.track, rows, channels, checker, kinds)
        if len(sides) != 1:
            raise Unsupported(f"the value `{value.name}` comes from several inputs (an "
                              "adapter with dropout): no single side bounds it")
        return {"value": replace(sides[0], position_gain=1.0)}
    except Unsupported as exc:
        return {"value_reason": str(exc)}


_FACTORIES = (torch.zeros, torch.empty, torch.full, torch.ones)


def _reads_cache(key: Node) -> bool:
    """The key reads a graph input or a buffer through data movement only (a KV cache:
    ``cat([past, k])``, a static cache written by ``index_copy_``, keys passed in), or is
    dequantized from FP8 storage (an FP8 KV cache: ``bits.view(float8) · scale``)."""
    if _dequantizes_fp8(key):
        return True
    def moves_data(node: Node) -> bool:
        op = op_of(node)
        return op in DATA_MOVEMENT or op in VALUE_CASTS or op in ("cat", "stack") or (
            node.op == "call_method" and node.target in ("index_copy_", "copy_"))

    for node in upstream([key], moves_data):
        if node.op == "placeholder":
            return True
        if node.op == "call_function" and node.target in _FACTORIES and any(
                u.op == "call_method" and u.target in ("index_copy_", "copy_")
                for u in node.users):
            return True   # a static cache allocated in this graph, then written in place
    return False


def _dequantizes_fp8(key: Node) -> bool:
    """An FP8 value upstream of ``key`` through data movement, casts and scalings only."""
    def follow(node: Node) -> bool:
        op = op_of(node)
        return op in DATA_MOVEMENT or op in VALUE_CASTS or op in ("cat", "stack", "mul",
                                                                  "div") or (
            node.op == "call_method" and node.target in ("index_copy_", "copy_", "view",
                                                         "float", "to"))

    for node in upstream([key], follow):
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dtype in FP8_DTYPES.values():
            return True
    return False



def _analyze_cached_keys(cand: Candidate, kinds: ValueKinds, q_trace: OperandTrace,
                         q_track: Track, checker: AngleChecker, why: Unsupported) -> dict:
    """Keys that are not all a projection of this call (a KV cache): the query side is bound
    by its weights, the keys by their actual norms, every step (``Side.observed``).

    ``|S| = s·|q_h·k_j| ≤ s·‖q_h‖·max_j‖k_j‖`` with ``‖q_h‖ ≤ ρ‖A_q,h‖ + ‖c_q,h‖`` (times
    rotary and position gains): certified whoever wrote the cache, whatever weights wrote it.
    """
    shape = shape_of(cand.key) or ()
    if len(shape) != 4 or cand.key_perm is not None:
        raise Unsupported(f"{why} — and the cached key `{cand.key.name}` (shape {shape}) is "
                          "not laid out (batch, heads, positions, d_h)")
    axes = (-3, -2) if cand.key_layout == "dk" else (-3, -1)
    n_k, length = shape[-3], shape[-1] if cand.key_layout == "dk" else shape[-2]
    q_rows = head_rows(q_track, cand.query, "query")
    _check_rotations_whole(cand, "query", q_rows, checker)
    n_q = len(q_rows.features)
    q_map = q_rows.head_of_row
    if q_map.dim() < 1 or q_map.shape[-1] != n_q or \
            not bool((q_map == torch.arange(n_q)).all()) or n_q % n_k:
        raise Unsupported(f"`{cand.node.name}`: query heads {tuple(q_map.shape)} do not map "
                          f"onto the {n_k} heads of the cached key `{cand.key.name}`")
    q_side = _side_of(q_trace, q_rows, checker, kinds)
    q_side = replace(q_side, position_gain=_position_gain(cand, "query", q_rows, checker))
    by_name = {n.name: n for n in cand.node.graph.nodes}
    if localize_term(q_side, q_side, by_name, q_track.shape[-1])[2] is not None:
        raise Unsupported(f"{why} — and the query is sharded (tensor parallel): a cached key "
                          "under tensor parallelism is not supported yet")
    sources = key_sources(cand.key, cand.node, kinds) if cand.key_layout != "dk" else None
    k_side = Side(source=Source(norm="observed", node=cand.key.name, width=1), weight=None,
                  layout="observed", features=tuple((g,) for g in range(n_k)),
                  observed_axes=axes, observed_past=sources.past if sources else (),
                  observed_fresh=sources.fresh if sources else ())
    return _fields(cand, [Term(q_side, k_side)], q_rows.gain, q_track.shape[-2], length,
                   q_rows.head_of_row)


def _term_channels(cand: Candidate, q, k, checkers) -> list[list[int]]:
    """The head channels of each term: one term per (query projection, key projection)
    pair that the channels of a head vector come from (MLA: the latent part and the
    decoupled RoPE part). Every head must draw each channel from the same projections."""
    if len(q[0].projections) == 1 and len(k[0].projections) == 1:
        return [list(range(len(q[1].features[0])))]
    roots = []
    for (trace, rows), role in ((q, "query"), (k, "key")):
        features = torch.tensor(rows.features, dtype=torch.long)          # (n, d_h)
        root = trace.root_of(features)
        if not bool((root == root[:1]).all()):
            raise Unsupported(f"`{cand.node.name}`: the {role}'s heads draw the same channel "
                              "from different projections")
        roots.append(root[0].tolist())
    groups: dict[tuple[int, int], list[int]] = {}
    for channel, pair in enumerate(zip(*roots)):
        groups.setdefault(pair, []).append(channel)
    if len(groups) > 1:
        for (trace, rows), role in ((q, "query"), (k, "key")):
            _check_rotations_within(cand, role, rows, checkers[role], list(groups.values()))
    return list(groups.values())


def _check_rotations_within(cand, role, rows: HeadRows, checker: AngleChecker, terms) -> None:
    """A rotation pair split between two terms would mix them: each term's bound would not
    hold for its rotated channels."""
    groups = [[head[c] for head in rows.features for c in channels] for channels in terms]
    _partners_within(checker, groups, f"`{cand.node.name}`: the {role} rotates a channel of "
                     "one projection with a channel of another")


def _term_side(cand, role, trace, track, rows: HeadRows, channels, checker, kinds
               ) -> list[Side]:
    """The sides of the head channels ``channels`` of the operand (one, or one per map
    added to the projection with an input of its own)."""
    if len(trace.projections) == 1 and len(channels) == track.shape[-1]:
        side = _side_of(trace, rows, checker, kinds, features=rows.features)
        sides = _fold_sums(cand, role, trace, 0, rows, side, checker, kinds)
    else:
        index = torch.tensor(channels)
        sub = Track(*(bc.take_last(t, index) for t in track.fields()))
        sub_rows = head_rows(sub, cand.node, role)
        root = int(trace.root_of(torch.tensor(rows.features[0][channels[0]])))
        part = trace.part(root, sub)
        offset = trace.projections[root][1]
        features = tuple(tuple(head[c] - offset for c in channels) for head in rows.features)
        rows = replace(sub_rows, features=tuple(tuple(head[c] for c in channels)
                                                for head in rows.features))
        side = _side_of(part, replace(rows, features=features), checker, kinds,
                        features=features, offset=offset)
        sides = _fold_sums(cand, role, trace, root, rows, side, checker, kinds)
    gain = _position_gain(cand, role, rows, checker)
    return [replace(side, position_gain=gain) for side in sides]


def _fold_sums(cand, role, trace, root: int, rows: HeadRows, side: Side, checker,
               kinds) -> list[Side]:
    """Maps added to this side's projection output (a LoRA adapter ``s·B(A x)`` added to
    ``W x``; feature f of the sum is feature f of each map): folded into its weight,
    ``W + s·B·A``, when they read the same normalized source; else (adapter dropout in
    training: ``A`` reads ``dropout(x)``) each is a side of its own — ``q·k`` is then the
    sum over every pair of query and key sides, one term each. Anything else names the
    ``add``."""
    if not checker.sums or side.weight is None:
        return [side]
    offset = trace.projections[root][1]
    mine = torch.tensor(sorted({f for head in rows.features for f in head}))
    extras, params, separate = [], [], []
    for kept, added, ratio in checker.sums:
        inside = torch.isin(kept.long(), mine)
        if not bool(inside.any()):
            continue
        mix = Unsupported(f"`{cand.node.name}`: the {role} adds to its projection a map that "
                          "is not a second map of the same features (a mix of two projections)")
        kept, added = kept[inside], added[inside]    # a fused QKV: this side's features only
        other = trace.root_of(added)
        if not bool((other == other[0]).all()) or not bool(torch.isin(mine, kept.long()).all()):
            raise mix
        projection, other_offset = trace.projections[int(other[0])]
        if int(other[0]) == root or not bool(((added - other_offset) == (kept - offset)).all()):
            raise mix
        if projection.bias is not None or projection.layout != "linear":
            raise Unsupported(f"`{cand.node.name}`: the {role}'s added map "
                              f"`{projection.root.name}` has a bias or a dense weight layout")
        source = _source(trace_normalized_input(projection.x, kinds, projection.root))
        inner = projection.inner.name if projection.inner is not None else None
        names = tuple(parameter_name(n) for n in (projection.inner, projection.weight)
                      if n is not None and n.op == "placeholder")
        if source == side.source:      # one source, two maps: W + s·B·A
            extras.append((inner, projection.weight.name, ratio))
            params += names
        else:                          # adapter dropout: its own input, a term of its own
            separate.append(replace(side, source=source, weight=projection.weight.name,
                                    layout="linear", inner=inner, weight_scale=ratio, bias=None,
                                    weight_param=names[-1], bias_param="",
                                    low_rank=(), low_rank_params=names[:-1]))
    main = replace(side, low_rank=tuple(extras), low_rank_params=tuple(params))
    return [main] + separate


def _position_gain(cand: Candidate, role: str, rows: HeadRows, checker: AngleChecker
                   ) -> float:
    """The product of the per-position multipliers' bounds applied to the whole operand (a
    multiplier of part of a head vector is not a scalar on it: refused)."""
    gain = 1.0
    if not checker.multipliers:
        return gain
    features = torch.tensor([f for head in rows.features for f in head]).unique()
    for bound, covered in checker.multipliers:
        inside = torch.isin(features, covered.long())
        if not bool(inside.any()):
            continue
        if not bool(inside.all()):
            raise Unsupported(f"`{cand.node.name}`: a per-position multiplier scales part of "
                              f"the {role}'s head vectors")
        gain *= bound
    return gain


def _check_rotations_whole(cand: Candidate, role: str, rows: HeadRows,
                           checker: AngleChecker) -> None:
    """Each rotated pair must stay inside one head vector: a slice after RoPE keeps values
    that mix in a dropped partner, and the rotation bound would not hold for what is left."""
    _partners_within(checker, rows.features, f"`{cand.node.name}`: the {role} keeps half of "
                     "a rotated pair (a slice after the rotary embedding)")


def _partners_within(checker: AngleChecker, groups, message: str) -> None:
    """Every rotated element whose feature is in one of ``groups`` has its partner in the
    same group, else ``Unsupported(message)``."""
    if not checker.partners:
        return
    groups = tuple(tuple(features) for features in groups)
    if not any(groups):
        return
    if len({len(g) for g in groups}) == 1:      # equal heads: one cached (n, d_h) table
        table = _index_table(groups)
        features = table.reshape(-1)
        members = torch.arange(len(groups)).repeat_interleave(table.shape[1])
    else:
        features = torch.tensor([f for group in groups for f in group], dtype=torch.long)
        members = torch.repeat_interleave(torch.arange(len(groups)),
                                          torch.tensor([len(g) for g in groups]))
    width = max([int(features.max())] + [int(t.max()) for pair in checker.partners
                                         for t in pair if t.numel()]) + 1
    group_of = torch.full((width,), -1, dtype=torch.long)        # -1: in no group
    group_of[features] = members
    for feature, partner in checker.partners:
        own = group_of[feature.long()]
        if bool(((own >= 0) & (group_of[partner.long()] != own)).any()):
            raise Unsupported(message)


def _fields(cand, terms: list[Term], gain, q_len, kv_len, head_of_row,
            head_dim: int | None = None) -> dict:
    if not math.isfinite(cand.scale):
        raise Unsupported(f"`{cand.node.name}`: the softmax scale is not a compile-time constant")
    score_heads, score_lead = score_head_period(head_of_row)
    return dict(
        n_q_heads=terms[0].q.n_heads, n_kv_heads=terms[0].k.n_heads,
        head_dim=head_dim or terms[0].q.head_dim,
        softmax_scale=cand.scale * gain, score_scale=cand.scale, is_causal=cand.is_causal,
        has_mask=cand.has_mask, dropout_p=cand.dropout_p, q_len=q_len, kv_len=kv_len,
        terms=tuple(terms),
        modifiers=tuple(Modifier(kind, node.name, value,
                                 param=node.name if kind == "sink" else None)
                        for kind, node, value in cand.modifiers),
        score_heads=score_heads, score_lead=score_lead)


def score_head_period(head_of_row: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(period, fixed_lead)``: the query head of each leading score slice.

    The head of flattened leading index ``i`` is ``period[i % len(period)]``; the dims
    outside the period hold batch entries, so any batch size fits. When heads vary along the
    outermost leading dim (heads outside the batch, an unusual layout) no such period exists:
    the whole lead is returned as ``fixed_lead`` and the rewrite specializes on it.
    """
    flat = head_of_row.reshape(-1).tolist()
    lead = list(head_of_row.shape)
    while len(lead) > 1 and lead[0] == 1:
        lead.pop(0)
    inner = math.prod(lead[1:]) if len(lead) > 1 else len(flat)
    for period in range(1, inner + 1):
        if inner % period == 0 and flat == flat[:period] * (len(flat) // period):
            return tuple(flat[:period]), ()
    return tuple(flat), tuple(head_of_row.shape)


def _contiguous_heads(n: int, d_h: int, offset: int) -> tuple:
    return tuple(tuple(range(offset + h * d_h, offset + (h + 1) * d_h)) for h in range(n))


def _opaque_side(node: Node, weight: Node, bias, norm: NormalizedInput, features,
                 bias_offset: int = 0) -> Side:
    op = ProjectionOp(node, node, weight, "linear", bias)
    rows = HeadRows(features, torch.arange(len(features)), 1.0, 0.0, False)
    return _side(op, rows, norm, [], bias_offset=bias_offset)


def _analyze_mha(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    node = cand.node
    query, key = node.args[0], node.args[1]
    embed_dim, n_heads = int(node.args[3]), int(node.args[4])
    if arg(node, 7, "bias_k") is not None or arg(node, 21, "static_k") is not None:
        raise Unsupported(f"`{node.name}`: keys include a learned bias_k / static_k that is "
                          "not a projection of the input")
    d_h = embed_dim // n_heads
    separate = bool(arg(node, 17, "use_separate_proj_weight", False))
    in_w, in_b = arg(node, 5, "in_proj_weight"), arg(node, 6, "in_proj_bias")
    q_w = arg(node, 18, "q_proj_weight") if separate else in_w
    k_w = arg(node, 19, "k_proj_weight") if separate else in_w
    q_norm = trace_normalized_input(query, kinds, node)
    k_norm = q_norm if key is query else trace_normalized_input(key, kinds, node)
    q_proj = _opaque_side(node, q_w, in_b, q_norm, _contiguous_heads(n_heads, d_h, 0))
    k_off = 0 if separate else embed_dim
    k_proj = _opaque_side(node, k_w, in_b, k_norm, _contiguous_heads(n_heads, d_h, k_off),
                                bias_offset=embed_dim if separate else 0)
    cand.scale = 1.0 / math.sqrt(d_h)
    cand.is_causal = bool(arg(node, 24, "is_causal", False))
    cand.has_mask = arg(node, 16, "attn_mask") is not None or \
        arg(node, 14, "key_padding_mask") is not None
    cand.dropout_p = float(arg(node, 10, "dropout_p", 0.0)) if arg(node, 13, "training",
                                                                     True) else 0.0
    q_len = (shape_of(query) or (0,))[0]
    kv_len = (shape_of(key) or (0,))[0]
    return _fields(cand, [Term(q_proj, k_proj)], 1.0, q_len, kv_len, torch.arange(n_heads))


def _analyze_encoder_layer(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    node = cand.node
    src, embed_dim, n_heads = node.args[0], int(node.args[1]), int(node.args[2])
    d_h = embed_dim // n_heads
    if node.args[8]:  # norm_first: the layer normalizes src itself (norm1)
        norm = NormalizedInput("layernorm", node, embed_dim,
                               (("mul", node.args[10]), ("add", node.args[11])), 1.0)
    else:
        norm = trace_normalized_input(src, kinds, node)
    w, b = node.args[3], node.args[4]
    q_proj = _opaque_side(node, w, b, norm, _contiguous_heads(n_heads, d_h, 0))
    k_proj = _opaque_side(node, w, b, norm, _contiguous_heads(n_heads, d_h, embed_dim))
    cand.scale = 1.0 / math.sqrt(d_h)
    cand.has_mask = len(node.args) > 18 and node.args[18] is not None
    shape = shape_of(src) or (0, 0)
    return _fields(cand, [Term(q_proj, k_proj)], 1.0, shape[-2], shape[-2],
                   torch.arange(n_heads))


_ANALYZERS = {
    "sdpa": _analyze_operands,
    "explicit": _analyze_operands,
    "mha": _analyze_mha,
    "encoder_layer": _analyze_encoder_layer,
}
