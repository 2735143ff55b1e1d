"""The analyzer of ``sdpa`` and ``explicit`` sites: query and key traced to their weights.

Found by ``find_sites`` (``F.scaled_dot_product_attention``, or the explicit normal form
``softmax(M(c·QKᵀ)) @ V``) with the query and key operands named. Each operand is replayed
back to its projection(s) (``provenance.trace_operand``); the head of every row is read off
the replay, query heads are paired with key heads (GQA), the head channels are split into
logit terms (MLA) and each term's sides are described (LoRA folded in). Returns the
``AttentionSite`` fields (``site_fields``, the values' side, the tensor-parallel shard).
Keys read from a cache go to ``cached_key_sites``. Refused — ``Unsupported`` naming a node —
for DTensor operands, head widths that differ, a slice that splits a rotated pair, a head
grouping that is not contiguous, terms sharded differently across ranks.
"""
from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from geoscale_fx.analysis.forms.cached_key_sites import analyze_cached_keys, reads_cache
from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.dtensor import dtensor_of, localize_term
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.sides.head_mapping import pair_heads
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.logit_terms import term_channels, term_sides
from geoscale_fx.analysis.sides.provenance import head_rows, trace_operand
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import check_rotations_whole
from geoscale_fx.analysis.forms.site_fields import site_fields
from geoscale_fx.analysis.sides.value_side import value_side
from geoscale_fx.sites.terms import Term

__all__ = ["analyze_operands"]


def analyze_operands(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    """``AttentionSite`` fields of an ``sdpa`` / ``explicit`` candidate (see the module)."""
    for role, operand in (("query", cand.query), ("key", cand.key)):
        if dtensor_of(operand) is not None:
            raise Unsupported(f"the {role} `{operand.name}` is a DTensor (global view, "
                              f"{tuple(dtensor_of(operand).placements)}): geoscale rewrites "
                              "attention on local tensors (use_local_output=True)")
    records = {role: ReplayRecords(evaluator) for role in ("query", "key")}
    q_trace = trace_operand(cand.query, kinds, records["query"], "query", order)
    q_track = q_trace.track
    if cand.query_perm is not None:
        q_track = q_track.map(lambda t: t.permute(cand.query_perm))
    try:
        k_trace = trace_operand(cand.key, kinds, records["key"], "key", order)
    except Unsupported as exc:
        if not reads_cache(cand.key):
            raise
        return analyze_cached_keys(cand, kinds, q_trace, q_track, records["query"], exc)
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
        check_rotations_whole(cand, role, rows, records[role])
    _mapping, k_features = pair_heads(cand, q_rows, k_rows)
    k_rows = replace(k_rows, features=k_features)
    terms = []
    for channels in term_channels(cand, (q_trace, q_rows), (k_trace, k_rows), records):
        q_sides, k_sides = (
            term_sides(cand, role, trace, track, rows, channels, records[role], kinds)
            for role, trace, track, rows in (("query", q_trace, q_track, q_rows),
                                             ("key", k_trace, k_track, k_rows)))
        terms += [Term(q, k) for q in q_sides for k in k_sides]
    terms, shard = _localize(cand, terms, q_track.shape[-1], order.by_name)
    fields = site_fields(cand, terms, q_rows.gain * k_rows.gain, q_track.shape[-2],
                         k_track.shape[-2], q_rows.head_of_row, head_dim=q_track.shape[-1],
                         kinds=kinds)
    value = value_side(cand, kinds, evaluator, order) if shard is None else \
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

