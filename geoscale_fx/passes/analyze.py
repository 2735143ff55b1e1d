"""The analysis pass: every attention site of a GraphModule, traced back to its weights.

``analyze_graph(gm, example_inputs)`` is what both ``geoscale_fx.find_attention`` and the
backend run on the graph Dynamo captured. It never modifies ``gm``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx.passes.dtensor import dtensor_of, localize_term, to_local
from geoscale_fx.passes.evaluate import ParamEvaluator
from geoscale_fx.passes.find_sites import Candidate, find_candidates
from geoscale_fx.passes.graph_ops import ValueKinds, arg, module_path, op_of, shape_of
from geoscale_fx.passes.provenance import (
    HeadRows, NormalizedInput, OperandTrace, ProjectionOp, head_rows, parameter_names,
    trace_normalized_input, trace_operand,
)
from geoscale_fx.passes.site_model import (
    ROPE_BOUNDS, AttentionSite, Modifier, Side, Source, Term,
)
from geoscale_fx.passes.tracking import AngleChecker, Unsupported

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
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}

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


# --------------------------------------------------------------------------------------

def _source(norm: NormalizedInput, channel_index: tuple[int, ...] = ()) -> Source:
    channel_ops = tuple((kind, v.name if isinstance(v, Node) else float(v))
                        for kind, v in norm.channel_ops)
    return Source(norm=norm.norm, node=norm.node.name, width=norm.model_dim,
                  channel_ops=channel_ops, radius_factor=norm.radius_factor,
                  channel_index=channel_index)


def _side_of(trace: OperandTrace, rows: HeadRows, checker: AngleChecker, kinds: ValueKinds,
             features=None) -> Side:
    """A side from its operand's trace: the projection's normalized input, or the QK-norm
    the operand is made of (then the side has no weight of its own)."""
    unit = trace.norm_unit
    if unit is None:
        norm = trace_normalized_input(trace.projection.x, kinds, trace.projection.root)
        return _side(trace.projection, rows, norm, checker.rotaries, features=features)
    width, position = checker.norms[unit.id]
    n_features = (shape_of(trace.projection.root) or (0,))[-1]
    index = tuple(position.get(f, -1) for f in range(n_features))
    rotary = _rotary(rows, checker.rotaries)
    return Side(source=_source(unit.norm, index), weight=None, layout="identity",
                features=features if features is not None else rows.features, rotary=rotary,
                operand_gain=rows.gain)


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
    k_trace = trace_operand(cand.key, kinds, checkers["key"], "key", order)
    q_track, k_track = q_trace.track, k_trace.track
    if cand.query_perm is not None:
        q_track = q_track.map(lambda t: t.permute(cand.query_perm))
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
    q_proj = _side_of(q_trace, q_rows, checkers["query"], kinds)
    k_proj = _side_of(k_trace, k_rows, checkers["key"], kinds, features=k_features)
    by_name = {n.name: n for n in cand.node.graph.nodes}
    q_proj, k_proj, shard = localize_term(q_proj, k_proj, by_name, q_track.shape[-1])
    return dict(_fields(cand, q_proj, k_proj, q_rows.gain * k_rows.gain, q_track.shape[-2],
                        k_track.shape[-2], q_rows.head_of_row), shard=shard)


def _check_rotations_whole(cand: Candidate, role: str, rows: HeadRows,
                           checker: AngleChecker) -> None:
    """Each rotated pair must stay inside one head vector: a slice after RoPE keeps values
    that mix in a dropped partner, and the rotation bound would not hold for what is left."""
    if not checker.partners:
        return
    feature = torch.cat([f for f, _ in checker.partners])
    partner = torch.cat([p for _, p in checker.partners])
    heads = torch.tensor(rows.features, dtype=torch.long)                  # (n, d_h)
    head_of = torch.full((int(max(feature.max(), partner.max(), heads.max())) + 1,), -1)
    head_of[heads] = torch.arange(heads.shape[0])[:, None].expand_as(heads)
    kept = head_of[feature] >= 0
    if not bool((head_of[partner][kept] == head_of[feature][kept]).all()):
        raise Unsupported(f"`{cand.node.name}`: the {role} keeps half of a rotated pair "
                          "(a slice after the rotary embedding)")


def _fields(cand, q_side: Side, k_side: Side, gain, q_len, kv_len, head_of_row) -> dict:
    if not math.isfinite(cand.scale):
        raise Unsupported(f"`{cand.node.name}`: the softmax scale is not a compile-time constant")
    score_heads, score_lead = score_head_period(head_of_row)
    return dict(
        n_q_heads=q_side.n_heads, n_kv_heads=k_side.n_heads, head_dim=q_side.head_dim,
        softmax_scale=cand.scale * gain, score_scale=cand.scale, is_causal=cand.is_causal,
        has_mask=cand.has_mask, dropout_p=cand.dropout_p, q_len=q_len, kv_len=kv_len,
        terms=(Term(q_side, k_side),),
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
    return _fields(cand, q_proj, k_proj, 1.0, q_len, kv_len, torch.arange(n_heads))


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
    return _fields(cand, q_proj, k_proj, 1.0, shape[-2], shape[-2], torch.arange(n_heads))


_ANALYZERS = {
    "sdpa": _analyze_operands,
    "explicit": _analyze_operands,
    "mha": _analyze_mha,
    "encoder_layer": _analyze_encoder_layer,
}
