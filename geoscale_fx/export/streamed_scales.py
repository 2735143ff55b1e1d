"""Per-layer q/k/v bounds of a saved checkpoint, traced without weights, weights streamed.

``export_kv_scales("ckpt")`` must work for checkpoints bigger than memory, so the model is
never loaded:

1. **Build on meta.** ``AutoModelForCausalLM.from_config(config.json)`` (or the class
   its ``architectures`` name, ``hf_configs.causal_lm_class``) under
   ``torch.device("meta")`` (parameters without storage, in the dtype ``from_pretrained``
   would pick: ``config.json``'s, else the stored one). Buffers and parameters that do
   not require grad (fixed tables) are made real as ``from_pretrained`` makes them: read
   from the checkpoint where it holds them, else by the model's own ``_init_weights``
   (rotary ``inv_freq``).
2. **Trace on the CPU, weights 0** (``traced_graphs``). Every parameter (and a buffer
   without an initializer) stands in as one stored zero of its shape and dtype
   (``weightless``), and the model is traced once by ``capture_graphs`` on token ids, as
   an in-memory model is: same device for everything, values for what the forward reads
   (``.item()``, ``nonzero``, an MoE router), and CPU rotary tables and masks for the
   analysis to evaluate. The graphs' weight inputs are then put back to the meta
   parameters, and ``analyze_graph`` runs on them: no weight value is seen before it is
   read below.
   The trace uses the model's cache with its writes marked
   (``kv_cache_map.traced_with_writes``), as the in-memory route does, so the cache
   layers — what each stores, which attention reads it — are found as there
   (``analysis.forms.cache_writes``, ``kv_cache_map.cache_layers``).
3. **Read what each bound reads.** Per cache layer, the graph nodes its bounds read (the
   reading attention's query side and the stored tensors' sides: projection weights,
   biases, input-norm and QK-norm gains) are followed back to the graph's parameter
   placeholders; each placeholder's example value *is* a model parameter. Those tensors
   alone are read, under the names the checkpoint holds them by (``CheckpointKeys``:
   transformers' own load-time renamings and converters; a missing or non-finite one is a
   ``ValueError`` naming it and its file), substituted for the meta parameters, the bounds
   evaluated (``amax.site_amax_bounds`` for the queries, a chunk of heads at a time, see
   ``_q_by_head_chunks``; ``amax.cache_write_bounds`` for what is stored), and the tensors
   dropped before the next layer. A cache layer refused by the analysis
   (``kv_cache_map.plan_cache_layers``) is refused before this step: its tensors are never
   read (``partial=True`` leaves it out, as ``export_kv_scales`` does by default).

Peak memory is the trace (about 0.5 GB with torch and transformers) plus one layer's
q/k/v tensors and their float64 per-head copies: 0.9 to 1.3 GB measured for Llama-3.1-8B and
-70B shapes (``python -m bench.export_scale``). The bounds are bit-identical to those of
``WeightKVScales`` on ``from_pretrained(ckpt)``: same graph, same tensors (cast to the
parameter dtype, as ``from_pretrained`` casts), same functions.

Example::

    scales = checkpoint_layer_scales("ckpt")       # scales.model: on meta
    [(s.site, s.k_bound.shape) for s in scales.layers]
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

import torch
from torch import nn

from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.numerics.amax import cache_write_bounds, site_amax_bounds
from geoscale_fx.analysis.capture import CapturedGraph, capture_graphs
from geoscale_fx.export.checkpoint_keys import CheckpointKeys
from geoscale_fx.export.safetensors_reader import CheckpointReader, read_json_object
from geoscale_fx.testing.hf_configs import causal_lm_class, token_inputs
from geoscale_fx.kv_cache.layer_map import (
    CacheLayer, layer_scales, plan_cache_layers, traced_with_writes,
)
from geoscale_fx.kv_cache.refusals import LayerRefusal, remedy, with_remedy
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.analysis.forms.cache_writes import sites_and_cache_writes
from geoscale_fx.analysis.fx.dtensor import to_local
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, upstream
from geoscale_fx.sites.model import AttentionSite, CacheWrite
from geoscale_fx.export.weightless import ConstantProducts, weightless

__all__ = ["CheckpointScales", "checkpoint_layer_scales", "meta_model", "traced_graphs"]

log = logging.getLogger("geoscale_fx")

#: tokens of the trace (static shapes; the bounds do not depend on it)
TRACE_LEN = 8
#: float64 bytes of one chunk of query heads' ``A_h`` (see ``_q_by_head_chunks``)
HEAD_CHUNK_BYTES = 128 << 20


def meta_model(directory: Union[str, os.PathLike], reader: CheckpointReader) -> nn.Module:
    """The checkpoint's model on the meta device, its buffers and fixed tables real (see the
    module doc)."""
    return _meta_model(directory, reader)[0]


def _meta_model(directory: Union[str, os.PathLike], reader: CheckpointReader
                ) -> tuple[nn.Module, CheckpointKeys]:
    config = _checkpoint_config(Path(directory))
    dtype = getattr(config, "dtype", None) or reader.floating_dtype()
    model = _build_on_meta(config, dtype, Path(directory) / "config.json")
    keys = CheckpointKeys(model, reader)
    _materialize_state(model, keys)
    return model, keys


def _checkpoint_config(directory: Path):
    """``AutoConfig.from_pretrained(directory)``, or a ``CheckpointError`` naming
    ``config.json`` and what is wrong: missing, not a JSON object, a model type the installed
    transformers does not know."""
    import transformers

    path = directory / "config.json"
    parsed = read_json_object(path)
    try:
        return transformers.AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{path}: transformers {transformers.__version__} cannot read "
                              f"it (model_type {parsed.get('model_type')!r}): "
                              f"{_first_line(exc)}") from exc


def _build_on_meta(config, dtype: torch.dtype, path: Path) -> nn.Module:
    """The model class the checkpoint is loaded with, built from ``config`` on the meta
    device, or a ``CheckpointError`` naming ``path`` and why transformers cannot build it."""
    try:
        cls = causal_lm_class(config)
        build = getattr(cls, "from_config", None) or cls._from_config     # Auto class or not
        with torch.device("meta"):
            return build(config, dtype=dtype).eval()
    except Exception as exc:       # the family's own constructor: any error it raises
        raise CheckpointError(f"{path}: transformers cannot build a causal LM of model_type "
                              f"{config.model_type!r} from it: {type(exc).__name__}: "
                              f"{_first_line(exc)}") from exc


def _materialize_state(model: nn.Module, keys: CheckpointKeys) -> None:
    """The model's state that is no trained weight made real, as ``from_pretrained`` makes
    it: buffers, and parameters that do not require grad (fixed tables: RoFormer's
    sinusoid positions), each read from the checkpoint where it holds it (then flagged
    ``_is_hf_initialized``, as loading flags it, so that no initializer overwrites it), else
    made by the model's own ``_init_weights`` (rotary ``inv_freq``). One that neither gives
    stays on the meta device: the trace stands it in with zeros and the analysis treats it
    as unknown. Tied tensors are made once and stay tied."""
    names = _parameter_names(model)
    holders: dict[int, list[tuple[nn.Module, dict, str]]] = {}
    for module in model.modules():
        for table in (module._buffers, module._parameters):
            for attr, value in table.items():
                if isinstance(value, torch.Tensor) and value.device.type == "meta" and not (
                        table is module._parameters and value.requires_grad):
                    holders.setdefault(id(value), []).append((module, table, attr))
    pending = []                                     # (tensor id, meta tensor)
    for key, held in holders.items():
        module, table, attr = held[0]
        meta = table[attr]
        stored = next((n for n in names[key] if n in keys), None)
        if stored is not None:
            real = keys.read([stored], finite=False)[stored].to(meta.dtype)
            real._is_hf_initialized = True
        else:
            fill = math.nan if meta.is_floating_point() else 0
            real = torch.full(meta.shape, fill, dtype=meta.dtype)
            pending.append((key, meta))
        _put(held, nn.Parameter(real, requires_grad=False)
             if isinstance(meta, nn.Parameter) else real)
    inits = _initializers(model)
    for module in dict.fromkeys(m for key, _ in pending for m, *_ in holders[key]):
        if inits.get(module) is not None:
            inits[module](module)  # what from_pretrained runs on state the checkpoint lacks
    for key, meta in pending:
        module, table, attr = holders[key][0]
        if table[attr].is_floating_point() and bool(table[attr].isnan().any()):
            _put(holders[key], meta)
            log.info("geoscale: export_kv_scales: %s has no initializer and is not in the "
                     "checkpoint; left on the meta device (an analysis that needs its "
                     "values treats it as unknown)", names[key][0])


def _put(holders: list[tuple[nn.Module, dict, str]], value: torch.Tensor) -> None:
    for _, table, attr in holders:
        table[attr] = value


def _initializers(model: nn.Module) -> dict[nn.Module, object]:
    """Module -> the ``_init_weights`` that ``from_pretrained`` runs on it: that of the
    innermost Hugging Face model holding it, itself included (a composite model's parts are
    initialized by their own class: Gemma3n's text model reads its own ``hidden_size``)."""
    from transformers import PreTrainedModel

    out: dict[nn.Module, object] = {}

    def visit(module: nn.Module, init) -> None:
        if isinstance(module, PreTrainedModel):
            init = module._init_weights
        out[module] = init
        for child in module.children():
            visit(child, init)

    visit(model, None)
    return out


def traced_graphs(model: nn.Module) -> list[CapturedGraph]:
    """The model's graphs, traced on the CPU with its weights 0 (``weightless``) on token
    ids as ``hf_configs.token_inputs`` makes them, their weight inputs then put back to the
    meta tensors: the analysis sees real ids, real buffers and the constants the forward
    makes (rotary tables, masks) on the CPU, as on an in-memory model, and no weight value
    (none is read before ``_resolver`` reads it). A forward that fails so (it needs more
    than token ids, or writes into its weights) is a ``ValueError`` naming the model and
    the failure."""
    with weightless(model) as originals, torch.no_grad():
        inputs = token_inputs(model, seq_len=TRACE_LEN)
        try:
            graphs = traced_with_writes(
                lambda kw: capture_graphs(model, graph_mode=ConstantProducts, **kw), model,
                inputs, "export_kv_scales")
        except Exception as exc:
            shape = tuple(inputs["input_ids"].shape)
            said = (f"export_kv_scales: {type(model).__name__} fails on token ids alone "
                    f"(input_ids {shape}) with its weights standing in as zeros, so its "
                    "attention cannot be traced without loading it")
            raise ValueError(f"{said}: {type(exc).__name__}: {_first_line(exc).rstrip('.')}. "
                             f"{remedy(said)}") from exc
    for graph in graphs:
        graph.example_inputs = [originals.get(id(v), v) for v in graph.example_inputs]
    return graphs


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else ""


@dataclass(frozen=True)
class CheckpointScales:
    """A checkpoint's bounds: its model (on meta), per bounded cache layer its bounds in
    layer order, and the cache layers refused from the trace (none were read)."""
    model: nn.Module
    layers: list[LayerScales]
    refused: tuple[LayerRefusal, ...] = ()


def checkpoint_layer_scales(directory: Union[str, os.PathLike], *, partial: bool = False
                            ) -> CheckpointScales:
    """The bounds of every cache layer a saved checkpoint writes, its weights streamed.

    Every refusal is decided from the trace, before the first tensor is read: strict
    (default), any refusal is a ``ValueError``; ``partial=True``, a refused cache layer is
    left out, named in ``refused`` and in a warning, and its tensors are never read
    (``kv_cache_map.CachePlan.settle``)."""
    reader = CheckpointReader(directory)
    model, keys = _meta_model(directory, reader)
    graphs = traced_graphs(model)
    sites, writes = sites_and_cache_writes(graphs)
    if not sites:
        raise ValueError(with_remedy(f"export_kv_scales: no attention found in "
                                     f"{type(model).__name__} ({directory})"))
    plan = plan_cache_layers(model, sites, writes, "export_kv_scales")
    plan.settle("export_kv_scales", partial)
    names = _parameter_names(model)
    kinds: dict[int, ValueKinds] = {}
    out = []
    for layer in plan.layers:
        resolvers = _layer_resolvers(layer, graphs, kinds, names, keys)

        def q_of(site: AttentionSite, resolvers=resolvers) -> torch.Tensor:
            return _q_by_head_chunks(site, resolvers[site.graph])

        def kv_of(part, resolvers=resolvers) -> dict:
            if isinstance(part, CacheWrite):
                return cache_write_bounds(part, resolvers[part.graph])
            return site_amax_bounds(part, resolvers[part.graph], roles="kv")

        out.append(layer_scales(layer, q_of, kv_of, "export_kv_scales"))
    log.info("geoscale: export_kv_scales: %d cache layers of %s bounded from %s", len(out),
             type(model).__name__, directory)
    return CheckpointScales(model, out, plan.refused)


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> every name it has`` (a tied parameter has several)."""
    out: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(t), []).append(name)
    return out


def _layer_resolvers(layer: CacheLayer, graphs: list[CapturedGraph],
                     kinds: dict[int, ValueKinds], names: dict[int, list[str]],
                     keys: CheckpointKeys) -> dict:
    """Per graph the layer's parts are in: a resolver of graph nodes to values, its
    parameters read from the checkpoint (what the layer's bounds read, nothing else)."""
    wanted: dict[int, list[str]] = {}
    for site in layer.sites + layer.readers:
        wanted.setdefault(site.graph, []).extend(
            n for t in site.terms for n in t.q.node_names)
    for site in layer.sites if not layer.writes else ():
        wanted[site.graph].extend(site.operand_nodes)
    for write in layer.writes:
        wanted.setdefault(write.graph, []).extend(write.node_names)
    out = {}
    for index, nodes in wanted.items():
        graph = graphs[index]
        if index not in kinds:
            kinds[index] = ValueKinds(graph.gm.graph, graph.example_inputs)
        out[index] = _resolver(graph, kinds[index], names, keys, dict.fromkeys(nodes))
    return out


def _resolver(graph: CapturedGraph, kinds: ValueKinds, names: dict[int, list[str]],
              keys: CheckpointKeys, node_names):
    """Graph node name -> value, the parameters ``node_names`` are computed from read from
    the checkpoint (and dropped with the resolver)."""
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    reads = [by_name[name] for name in node_names]
    inputs = list(graph.example_inputs)
    wanted = {}                                  # placeholder index -> checkpoint name
    for node in upstream(reads):
        value = inputs[position[node]] if node in position else None
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            wanted[position[node]] = _checkpoint_name(value, names, keys, node.name)
    tensors = keys.read(wanted.values())
    for i, name in wanted.items():
        inputs[i] = _as_parameter(tensors[name], inputs[i], name, keys)
    evaluator = ParamEvaluator(graph.gm, inputs, kinds)

    def resolve(node_name: str) -> torch.Tensor:
        value = evaluator.evaluate(by_name[node_name])
        if value is None:
            raise ValueError(f"graph node {node_name!r} is not a function of the parameters")
        return to_local(value)

    return resolve


def _q_by_head_chunks(site: AttentionSite, resolve) -> torch.Tensor:
    """``site_amax_bounds(site, resolve, roles="q")["q"]``, the query heads a chunk at a time.

    Each head's bound reads only that head's columns (``features[h]``) and the shared gains,
    and ``amax`` reduces within a head (its channels' norms, its pairs' 2×2 Gram matrices,
    its spectral norm), so a chunk of heads gives those heads' bounds bit for bit (tested
    down to one head at a time). It caps the float64 copies ``amax`` holds of
    ``A: (n, d, d_h)`` at once: measured, +1.57 GB for a 70B layer's 64 query heads at once,
    +0.39 GB 16 at a time.
    """
    n_q = {t.q.n_heads for t in site.terms}
    width = max(t.q.model_dim * t.q.head_dim for t in site.terms)
    step = max(1, HEAD_CHUNK_BYTES // (8 * max(width, 1)))
    if len(n_q) != 1 or step >= min(n_q):
        return site_amax_bounds(site, resolve, roles="q")["q"]
    parts = []
    for start in range(0, n_q.pop(), step):
        terms = tuple(replace(t, q=replace(t.q, features=t.q.features[start:start + step]))
                      for t in site.terms)
        parts.append(site_amax_bounds(replace(site, terms=terms), resolve, roles="q")["q"])
    return torch.cat(parts)


def _checkpoint_name(value: torch.Tensor, names: dict[int, list[str]],
                     keys: CheckpointKeys, node: str) -> str:
    candidates = names.get(id(value))
    if not candidates:
        raise ValueError(f"export_kv_scales: graph input {node!r} is on the meta device but "
                         "is no parameter or buffer of the model")
    return next((n for n in candidates if n in keys), candidates[0])


def _as_parameter(tensor: torch.Tensor, meta: torch.Tensor, name: str,
                  keys: CheckpointKeys) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(meta.shape):
        loaded_as = "" if keys.stored_names(name) == [name] else f" (loaded as {name!r})"
        raise ValueError(f"checkpoint tensor {keys.describe(name)}{loaded_as} has shape "
                         f"{tuple(tensor.shape)}; the model built from config.json expects "
                         f"{tuple(meta.shape)}")
    return tensor.to(meta.dtype)          # from_pretrained casts to the model's dtype
