"""What a traced forward stores in its KV cache, traced back to the weights.

A Hugging Face model stores keys and values with ``cache.update(keys, values, layer_idx)``,
and what it stores is not always what its attention multiplies: MLA (DeepSeek-V2/V3, Kimi
Linear …) stores the compressed latent — ``kv_c`` after ``kv_a_layernorm`` in the keys slot
``(B, 1, L, r)``, the rotated ``k_pe`` in the values slot ``(B, 1, L, d_rope)`` — and expands
it by ``kv_b_proj`` after the read; a hybrid model's linear-attention layers store nothing
there. So a cache layer's bounds must be those of the tensors handed to ``update``:

* the model is traced with ``Cache.update`` first calling ``cache_write(keys, values,
  layer)`` (``kv_cache_layers.marked_cache_writes``), an op that does nothing and is kept in
  the graph (declared side-effecting), its arguments the very tensors the cache stores;
* ``cache_writes(gm, example_inputs, sites)`` traces each stored tensor back to its weights
  as an attention operand is (``provenance.trace_operand``): per stored head, one side per
  projection its channels come from (a normalization output stored as it is — MLA's
  ``kv_c`` — is a side with ``A = diag(g)`` on its own channels), and
  ``amax.cache_write_bounds`` bounds every stored entry;
* the write is read by the attention the module that wrote it holds (the innermost module
  on its module stack holding sites of one name: ``model.layers.3.self_attn``, or CPM-Ant's
  attention holding its ``softmax`` site), whose name the layer's scales take and whose key
  or value operand the stored tensors must reach;
* ``readers``: other attentions reading the stored tensors moved without writing them (KV
  sharing), which must dequantize them with this layer's scales;
* ``latent``: the stored tensors are not that attention's key and value operands moved
  (views, copies, concatenation with earlier cache entries): the attention computes from
  them — engines then store both in one latent entry with one scale (vLLM's MLA cache).

Example::

    with marked_cache_writes():
        graphs = capture_graphs(model, ids, use_cache=True)
    sites = analyze_graph(graphs[0].gm, graphs[0].example_inputs)
    for write in cache_writes(graphs[0].gm, graphs[0].example_inputs, sites):
        print(write.layer, write.site, write.latent, amax.cache_write_bounds(write))
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import has_side_effect

from geoscale_fx.analysis.analyze import NodeOrder, analyze_graph
from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.dtensor import to_local
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.fx.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, ValueKinds, example_value, op_of, upstream,
)
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.logit_terms import term_sides
from geoscale_fx.analysis.fx.module_names import graph_names
from geoscale_fx.analysis.sides.provenance import head_rows, trace_operand
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import check_rotations_whole, check_rotations_within
from geoscale_fx.analysis.sides.value_side import value_operand
from geoscale_fx.sites.model import AttentionSite, CacheWrite
from geoscale_fx.sites.terms import Side

__all__ = ["cache_write", "is_cache_write", "cache_writes", "sites_and_cache_writes"]


@torch.library.custom_op("geoscale_fx::cache_write", mutates_args=())
def cache_write(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    """Marks ``cache.update(keys, values, layer)`` in a traced graph; does nothing."""


@cache_write.register_fake
def _cache_write_fake(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    return None


_WRITE_OPS = (torch.ops.geoscale_fx.cache_write, torch.ops.geoscale_fx.cache_write.default)
for _op in _WRITE_OPS:
    has_side_effect(_op)        # returns nothing: dead-code elimination must keep it


def is_cache_write(node: Node) -> bool:
    return node.op == "call_function" and node.target in _WRITE_OPS


def cache_writes(gm: GraphModule, example_inputs: Sequence, sites: Sequence[AttentionSite],
                 graph_index: int = 0) -> list[CacheWrite]:
    """Every cache write of ``gm``, in graph order, its stored tensors traced to their sides
    (``sites``: those ``analyze_graph`` found in ``gm``). A write that cannot be bounded or
    named comes back with its ``reason``; it never raises."""
    nodes = [n for n in gm.graph.nodes if is_cache_write(n)]
    if not nodes:
        return []
    names = graph_names(gm, example_inputs)
    kinds = ValueKinds(gm.graph, example_inputs)
    evaluator = ParamEvaluator(gm, example_inputs, kinds)
    order = NodeOrder(gm.graph)
    candidates = {c.node.name: c for c in find_candidates(gm.graph, kinds)}
    own = [s for s in sites if s.graph == graph_index]

    def resolve(name: str) -> torch.Tensor:
        value = evaluator.evaluate(order.by_name[name])
        if value is None:
            raise ValueError(f"graph node {name!r} is not a function of the parameters")
        return to_local(value)

    out = []
    for node in nodes:
        keys, values, layer = node.args[:3]
        module = names.module(node) or ""
        write = dict(layer=int(layer), node=node.name, graph=graph_index, module=module,
                     _resolve=resolve)
        owners, why = _owners(module, own)
        reasons = [] if owners else [why]
        for role, stored in (("keys", keys), ("values", values)):
            try:
                sides, heads = _stored_sides(stored, role, node, kinds, evaluator, order)
                write[role], write[role[:-1] + "_heads"] = sides, heads
            except Unsupported as exc:
                reasons.append(f"the stored {role} `{stored.name}` cannot be bounded from the "
                               f"weights ({exc})")
        if owners:
            operands = [_operands(candidates.get(s.node)) for s in owners]
            if _read(keys, values, operands):
                write["site"] = owners[0].name
                write["latent"] = _latent(keys, values, operands)
                write["readers"] = _sharing(keys, values, own, owners, candidates)
            else:
                reasons.append(f"the attention {owners[0].name!r} its module holds does not "
                               "read it")
        out.append(CacheWrite(**write, reason="; ".join(reasons)))
    return out


def _owners(module: str, sites: Sequence[AttentionSite]
            ) -> tuple[list[AttentionSite], str]:
    """The sites read by a write made in ``module``: those the innermost module of its path
    holding any site holds (itself or below it), all of one name; else ``([], why)``."""
    parts = module.split(".") if module else []
    for depth in range(len(parts), -1, -1):          # depth 0: the model itself
        prefix = ".".join(parts[:depth])
        held = [s for s in sites if not prefix or s.name == prefix
                or s.name.startswith(prefix + ".")]
        if held:
            if len({s.name for s in held}) > 1:
                return [], (f"`{prefix or 'the model'}` holds the attentions "
                            f"{sorted({s.name for s in held})}: which one reads it is "
                            "ambiguous")
            return held, ""
    return [], "no attention found in the model that wrote it"


def _stored_sides(stored: Node, role: str, write: Node, kinds: ValueKinds, evaluator,
                  order) -> tuple[tuple[Side, ...], tuple[int, ...]]:
    """The sides of a stored ``(B, H, L, d)`` tensor (one per projection its channels come
    from) and, per stored head ``h``, the side head it holds."""
    shape = tuple(getattr(example_value(stored), "shape", ()))
    if len(shape) != 4:
        raise Unsupported(f"`{stored.name}` has shape {shape}, not (batch, heads, positions, "
                          "head dim)")
    records = ReplayRecords(evaluator)
    trace = trace_operand(stored, kinds, records, role, order)
    rows = head_rows(trace.track, stored, role)
    at = Candidate("cache_write", write)          # names the write in refusals
    check_rotations_whole(at, role, rows, records)
    groups = _projection_groups(trace, rows, role, stored)
    if len(groups) > 1:
        check_rotations_within(at, role, rows, records, groups)
    sides = tuple(side for channels in groups for side in term_sides(
        at, role, trace, trace.track, rows, channels, records, kinds))
    try:       # the replay may keep fewer leading axes (a view adding a head axis of 1)
        per_batch = torch.broadcast_to(rows.head_of_row, shape[:2])          # (B, H)
    except RuntimeError:
        raise Unsupported(f"`{stored.name}`: its heads cannot be read off its trace (leading "
                          f"shape {tuple(rows.head_of_row.shape)} for {shape})") from None
    if not bool((per_batch == per_batch[:1]).all()):
        raise Unsupported(f"`{stored.name}`: its heads differ across the batch")
    return sides, tuple(int(h) for h in per_batch[0].tolist())


def _projection_groups(trace, rows, role: str, stored: Node) -> list[list[int]]:
    """The head channels of each projection the stored tensor draws from (every head must
    draw each channel from the same one)."""
    width = len(rows.features[0])
    if len(trace.projections) == 1:
        return [list(range(width))]
    root = trace.root_of(torch.tensor(rows.features, dtype=torch.long))      # (n, d_h)
    if not bool((root == root[:1]).all()):
        raise Unsupported(f"the stored {role} `{stored.name}`: its heads draw the same "
                          "channel from different projections")
    groups: dict[int, list[int]] = {}
    for channel, projection in enumerate(root[0].tolist()):
        groups.setdefault(projection, []).append(channel)
    return list(groups.values())


def _operands(cand: Optional[Candidate]) -> Optional[tuple[Node, Optional[Node]]]:
    """``(key, value)`` operands of an attention; None for one whose operands are not named
    (an opaque op: it reads them as stored, as far as the graph tells)."""
    if cand is None or cand.key is None:
        return None
    return cand.key, value_operand(cand)


def _read(keys: Node, values: Node, operands: list) -> bool:
    """Some owner's key or value operand is computed from what was stored (an owner whose
    operands are not named is taken to read it)."""
    return None in operands or any(
        keys in found or values in found
        for found in (set(upstream([n for n in o if n is not None])) for o in operands))


def _latent(keys: Node, values: Node, operands: list) -> bool:
    """No owner reads the stored keys and values moved: the attention computes its operands
    from them. Several calls of one attention (a shared block) own each other's writes:
    the call that reads this one reads it moved unless the cache holds a latent."""
    return None not in operands and not any(
        keys in _moved(o[0]) and (o[1] is None or values in _moved(o[1])) for o in operands)


def _sharing(keys: Node, values: Node, sites: Sequence[AttentionSite],
             owners: Sequence[AttentionSite], candidates: dict) -> tuple[str, ...]:
    """Names of the other attentions whose key and value operands are the stored tensors
    moved (KV sharing: a later layer reusing this one's cache)."""
    names = {s.name for s in owners}
    out = []
    for site in sites:
        o = _operands(candidates.get(site.node))
        if site.name not in names and o is not None and keys in _moved(o[0]) and (
                o[1] is None or values in _moved(o[1])):
            out.append(site.name)
    return tuple(dict.fromkeys(out))


def _moved(node: Node) -> set[Node]:
    """The nodes whose elements reach ``node`` by data movement alone."""
    def moves(n: Node) -> bool:
        return op_of(n) in DATA_MOVEMENT or op_of(n) in VALUE_CASTS
    return set(upstream([node], moves))


def sites_and_cache_writes(graphs) -> tuple[list[AttentionSite], list[CacheWrite]]:
    """The attention sites of captured ``graphs`` (each with ``gm`` and ``example_inputs``,
    numbered across graphs) and their cache writes, those of graphs holding a refused site
    included: each cache layer is refused or kept on its own (``kv_cache_map``), so the
    layers of a supported attention keep their scales beside a refused one's."""
    sites: list[AttentionSite] = []
    writes: list[CacheWrite] = []
    for index, graph in enumerate(graphs):
        found = analyze_graph(graph.gm, graph.example_inputs, graph_index=index,
                              first_index=len(sites))
        sites += found
        writes += cache_writes(graph.gm, graph.example_inputs, found, index)
    return sites, writes
