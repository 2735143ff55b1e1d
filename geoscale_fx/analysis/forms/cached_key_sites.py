"""Sites whose keys are read from a KV cache: recognised, and bounded by the keys' norms.

When the keys are not all a projection of this call (``cat([past, k])``, a static cache
written by ``index_copy_``, keys passed in, or an FP8 cache dequantized as ``bits.view(float8)
· scale``), the query side is bound by its weights and the keys by their actual norms, every
step (``Side.observed``)::

    |S| = s·|q_h·k_j| ≤ s·‖q_h‖·max_j‖k_j‖,   ‖q_h‖ ≤ ρ‖A_q,h‖ + ‖c_q,h‖

(times rotary and position gains): certified whoever wrote the cache, whatever weights wrote
it. The key must be laid out ``(batch, heads, positions, d_h)`` and the query heads must map
onto its heads in contiguous groups; the refusal names the cached key and says which failed.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.fx import Node

from geoscale_fx.core.fp8 import FP8_DTYPES
from geoscale_fx.analysis.forms.cached_keys import key_sources
from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.dtensor import localize_term
from geoscale_fx.analysis.fx.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, ValueKinds, example_value, op_of, shape_of, upstream,
)
from geoscale_fx.analysis.index.index_track import Track, Unsupported
from geoscale_fx.analysis.sides.operand_sides import position_gain, side_of
from geoscale_fx.analysis.sides.provenance import OperandTrace, head_rows
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import check_rotations_whole
from geoscale_fx.analysis.forms.site_fields import site_fields
from geoscale_fx.sites.terms import Side, Source, Term

__all__ = ["reads_cache", "analyze_cached_keys"]


_FACTORIES = (torch.zeros, torch.empty, torch.full, torch.ones)


def reads_cache(key: Node) -> bool:
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


def analyze_cached_keys(cand: Candidate, kinds: ValueKinds, q_trace: OperandTrace,
                        q_track: Track, records: ReplayRecords, why: Unsupported) -> dict:
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
    check_rotations_whole(cand, "query", q_rows, records)
    n_q = len(q_rows.features)
    q_map = q_rows.head_of_row
    if q_map.dim() < 1 or q_map.shape[-1] != n_q or \
            not bool((q_map == torch.arange(n_q)).all()) or n_q % n_k:
        raise Unsupported(f"`{cand.node.name}`: query heads {tuple(q_map.shape)} do not map "
                          f"onto the {n_k} heads of the cached key `{cand.key.name}`")
    q_side = side_of(q_trace, q_rows, records, kinds)
    q_side = replace(q_side, position_gain=position_gain(cand, "query", q_rows, records))
    by_name = {n.name: n for n in cand.node.graph.nodes}
    if localize_term(q_side, q_side, by_name, q_track.shape[-1])[2] is not None:
        raise Unsupported(f"{why} — and the query is sharded (tensor parallel): a cached key "
                          "under tensor parallelism is not supported yet")
    sources = key_sources(cand.key, cand.node, kinds) if cand.key_layout != "dk" else None
    k_side = Side(source=Source(norm="observed", node=cand.key.name, width=1), weight=None,
                  layout="observed", features=tuple((g,) for g in range(n_k)),
                  observed_axes=axes, observed_past=sources.past if sources else (),
                  observed_fresh=sources.fresh if sources else ())
    return site_fields(cand, [Term(q_side, k_side)], q_rows.gain, q_track.shape[-2], length,
                       q_rows.head_of_row, kinds=kinds)
