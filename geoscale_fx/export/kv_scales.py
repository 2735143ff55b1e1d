"""FP8 KV-cache scales from the weights, written as a compressed-tensors checkpoint holds them.

The scales are format-neutral (``scale_tensors``: checkpoint name -> float32 tensor); a
writer module per format (``WRITERS``, chosen by ``format=``) writes them: compressed-tensors
(``geoscale_fx.export.compressed_tensors``) is the first and the default.

Serving engines (vLLM, SGLang) read static FP8 KV-cache scales from a checkpoint whose
``config.json`` carries a compressed-tensors ``quantization_config`` with a
``kv_cache_scheme``. ``export_kv_scales`` writes the certified bounds of
``geoscale_fx.kv_cache.weight_scales.WeightKVScales`` in that form:

* per layer, on the attention module (its module path, e.g. ``model.layers.0.self_attn``):
  ``<path>.k_scale``, ``<path>.v_scale`` and ``<path>.q_scale``, float32;
* ``strategy="tensor"``: shape ``(1,)``, ``s = max_h B_h / R_max``;
  ``strategy="head"`` (compressed-tensors ``"attn_head"``): shape ``(n_kv, 1, 1)`` for k/v and
  ``(n_q, 1, 1)`` for q, ``s_h = B_h / R_max``;

with ``B_h`` the bound on ``max |entry|`` of stored head ``h`` of what the layer's cache holds
(float64, from the weights alone; ``geoscale_fx.kv_cache.layer_map``) and ``R_max = 448`` (E4M3).

What a layer's cache holds decides the bound and the layout:

* the attention's keys and values: as above;
* a latent (MLA: DeepSeek-V2/V3, Kimi …, ``LayerScales.latent``): the keys slot holds
  ``kv_c`` after its RMSNorm, the values slot the rotated ``k_pe``, one head each. vLLM's
  MLA cache stores both as one entry quantized with the layer's ``k_scale``
  (``concat_and_cache_mla(kv_c, k_pe, …, scale=k_scale)``; ``<path>.k_scale`` is remapped
  to the ``MLAAttention`` at ``<path>.attn`` as for any attention), so ``k_scale`` and
  ``v_scale`` are both ``max(B_kv_c, B_k_pe) / R_max``, one per layer (``(1,)``, or
  ``(1, 1, 1)`` per head), and no ``q_scale`` is written: what an MLA kernel quantizes as
  its query is the latent query absorbed through ``kv_b_proj``, which the q bound does not
  bound;
* an attention that writes several cache layers (a shared block called by several
  layers): one set of scales, the max over them;
* nothing (a hybrid's linear-attention and SSM layers, a layer reading another's cache):
  no scale; ``KVScaleExport.not_cached`` names these cache layers. An attention that reads
  another layer's cache (KV sharing, ``KVScaleExport.shared``) gets that layer's k/v scales
  under its own name (an engine dequantizes what it reads with its own scales) and its own
  q scale;
* something the weights do not bound (``kv_refusals``: an unnormalized projection input, a
  term from the caller's inputs, a convolution over tokens …): the layer is refused, from
  the trace alone, and left out of the file — engines load k/v scales per layer and use
  their default for a missing one (1.0 in vLLM) — while the other layers keep their scales
  under their own names and indices. A warning names each such layer, its attention, why,
  and what would make it bounded, and ``KVScaleExport.left_at_default`` lists them.
  ``all_or_nothing=True`` (``--all-or-nothing``) makes any refusal a ``ValueError``; with
  no layer left it is one anyway.

A scale is a divisor, as in compressed-tensors
(``scale = amax / (bit_range / 2)``, then ``x / scale``) and in vLLM's cache write
(``fp8(x / k_scale)``), so ``|x / s| ≤ R_max`` for every entry whatever the input. The
float32 value is rounded *up* from float64: rounding to nearest could land one ulp under
``B / R_max`` and saturate the largest entry.

Files in ``out_dir``: ``kv_scales.safetensors`` (the tensors) and
``quantization_config.json`` (``{"quantization_config": {...}}``, validated against
compressed-tensors' pydantic ``QuantizationConfig`` in the tests). If ``out_dir`` holds a saved
Hugging Face model (``config.json``), the scales are merged into that checkpoint: the
``quantization_config`` goes into ``config.json`` and ``kv_scales.safetensors`` into the
weight index ``model.safetensors.index.json``: vLLM reads only the files an index lists. A
single-file checkpoint becomes a sharded one (``model.safetensors`` renamed to
``model-00001-of-00001.safetensors``), since Hugging Face reads ``model.safetensors`` alone
whenever it exists. Loading the merged checkpoint with Hugging Face then needs the
``compressed-tensors`` package (transformers builds its quantizer from the config).

Two routes to the same bounds:

* **An in-memory model** (``export_kv_scales(model, out_dir, *example_inputs)``): traced once
  with the example call, bounded from its parameters (``WeightKVScales``).
* **A checkpoint directory** (``export_kv_scales("ckpt")``, what ``geoscale
  export-kv-scales ckpt`` runs): for checkpoints bigger than memory. The model is built from
  ``config.json`` on the meta device and traced with its weights standing in as one stored
  zero each (``geoscale_fx.export.weightless``); each attention's q/k/v projections, biases and
  norm gains — the tensors its analysis names, nothing found by name — are read with
  ``safetensors.safe_open``, under the names transformers loads them from, one layer at a
  time, and dropped after (``geoscale_fx.export.streamed_scales``). A tensor among them that is missing or not finite is a
  ``ValueError`` naming it and its file, and nothing is written. The scales are
  bit-identical to the first route on ``from_pretrained("ckpt")``.

Every refusal (above, another ``quant_method`` in ``config.json``, a scale name held by
another file; a refused layer under ``all_or_nothing``) comes before the first file is
written. A checkpoint that cannot be read (a directory that does not exist, a truncated or
corrupt safetensors file, a ``config.json`` that is not valid JSON or names a family the
installed transformers cannot build) or an output that cannot be written is a
``geoscale_fx.CheckpointError`` (a ``ValueError``) naming the file, raised before the
trace; nothing is written. The writes themselves never harm the checkpoint: each file
atomically replaced, never written through a symlink (a hub cache's blobs keep their
content), in an order that leaves it loadable at every moment
(``geoscale_fx.export.safe_writes``, ``compressed_tensors._merge``).

Example::

    import geoscale_fx, torch
    model.save_pretrained("ckpt")
    geoscale_fx.export_kv_scales(model, "ckpt", torch.randint(0, 100, (1, 8)))
    geoscale_fx.export_kv_scales("ckpt")      # the same, without loading the model
    # vllm serve ckpt --kv-cache-dtype fp8
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Union

import torch
from torch import nn

from geoscale_fx.export import compressed_tensors
from geoscale_fx.export.safe_writes import check_writable
from geoscale_fx.export.streamed_scales import checkpoint_layer_scales
from geoscale_fx.kv_cache.layers import cache_layer_classes
from geoscale_fx.kv_cache.refusals import LayerRefusal
from geoscale_fx.kv_cache.layer_scales import LayerScales, scale_from_bound
from geoscale_fx.kv_cache.weight_scales import WeightKVScales

__all__ = ["KV_STRATEGIES", "WRITERS", "KVExportOptions", "KVScaleExport", "export_kv_scales",
           "scale_tensors"]

log = logging.getLogger("geoscale_fx")

#: ``strategy=`` values: one scale per layer, or one per head
KV_STRATEGIES = ("tensor", "head")
#: FP8 format of the cached entries
KV_FORMATS = ("e4m3",)
#: ``format=`` -> the writer module (``NAME``, ``check(options)``, ``write(tensors, options,
#: out)``): a new export format is one module here (docs/extending.md)
WRITERS = {compressed_tensors.NAME: compressed_tensors}

@dataclass(frozen=True)
class KVExportOptions:
    """What ``export_kv_scales`` writes, whatever the format."""
    strategy: str = "tensor"       # "tensor" (a scalar per layer) or "head" (one per head)
    fmt: str = "e4m3"
    include_q: bool = True         # also q_scale (FP8 attention kernels read it)

    def __post_init__(self):
        if self.strategy not in KV_STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}; allowed values: "
                             f"{sorted(KV_STRATEGIES)}")
        if self.fmt not in KV_FORMATS:
            raise ValueError(f"fmt={self.fmt!r}; allowed values: {list(KV_FORMATS)}")


@dataclass(frozen=True)
class KVScaleExport:
    """What was written: the tensors by checkpoint name, the config, the files; and the
    report: which cache layer each attention's scales bound, which cache layers hold no keys
    and values, which were refused (left at the engine's default scale) and why, which
    attentions' caches hold a latent."""
    tensors: dict[str, torch.Tensor]
    quantization_config: dict      # what the format's config holds (compressed-tensors': its
                                   # quantization_config)
    files: tuple[Path, ...]
    merged: bool                   # into a saved Hugging Face checkpoint in out_dir
    cache_layers: dict[int, str] = field(default_factory=dict)   # cache layer -> attention
    not_cached: dict[int, str] = field(default_factory=dict)     # cache layer -> why no scale
    latent: tuple[str, ...] = ()   # attentions whose cache holds a latent (one k/v scale)
    shared: dict[str, int] = field(default_factory=dict)   # attention -> the layer it reuses
    #: cache layer (a KV-sharing reader: its name) -> why its scales are not in the file:
    #: refused by the analysis, left at the engine's default scale (1.0 in vLLM)
    left_at_default: dict[Union[int, str], LayerRefusal] = field(default_factory=dict)


def scale_tensors(layers: list[LayerScales], options: KVExportOptions
                  ) -> dict[str, torch.Tensor]:
    """``{"<site>.k_scale": ..., "<site>.v_scale": ..., "<site>.q_scale": ...}``: per
    attention, the max over the cache layers it writes; a latent cache's k and v scales are
    one scale for the whole entry, and it has no q scale (see the module doc)."""
    by_site: dict[str, list[LayerScales]] = {}
    for layer in layers:
        by_site.setdefault(layer.site, []).append(layer)
        for name, q_bound in layer.readers:      # KV sharing: the layer's k/v, their own q
            by_site.setdefault(name, []).append(replace(layer, site=name, q_bound=q_bound,
                                                        readers=()))
    out = {}
    for site, group in by_site.items():
        bounds = {kind: _max_bound([getattr(l, f"{kind}_bound") for l in group])
                  for kind in "kvq"}
        latent = any(l.latent for l in group)
        if latent:                    # one entry, one scale: the larger part's bound
            bounds["k"] = bounds["v"] = torch.maximum(bounds["k"].max(), bounds["v"].max())
        kinds = "kvq" if options.include_q and not latent else "kv"
        for kind in kinds:
            scale = scale_from_bound(bounds[kind].cpu().reshape(-1), options.fmt)  # (heads,)
            if options.strategy == "tensor":
                scale = scale.max().reshape(1)                             # (1,)
            else:
                scale = scale.reshape(-1, 1, 1)                            # (heads, 1, 1)
            out[f"{site}.{kind}_scale"] = scale.contiguous()
    return out


def _max_bound(bounds: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise max of same-shaped bounds (one attention's layers), else the max of all."""
    if len({tuple(b.shape) for b in bounds}) > 1:
        return torch.stack([b.max() for b in bounds]).max().reshape(1)
    out = bounds[0]
    for b in bounds[1:]:
        out = torch.maximum(out, b)
    return out


def _report(model: nn.Module, layers: list[LayerScales], refused: tuple[LayerRefusal, ...]
            ) -> tuple[dict, dict, tuple, dict, dict]:
    """``(cache layer -> attention, cache layer -> why no scale, latent attentions,
    attention -> the cache layer it reuses, cache layer -> its refusal)``; the cache layers
    no attention writes are named with the class of the layer the model's cache has there
    (``LinearAttentionLayer``: a recurrent state, no keys or values; ``DummyLayer``: a layer
    reusing another's). A refused layer is named among the refusals only."""
    written = {l.layer: l.site for l in layers}
    left = {r.layer: r for r in refused if r.layer is not None}
    shared = {name: l.layer for l in layers for name, _ in l.readers}
    for name, layer in shared.items():
        log.info("geoscale: export_kv_scales: %s reuses cache layer %d (KV sharing): its k/v "
                 "scales are that layer's", name, layer)
    classes = cache_layer_classes(getattr(model, "config", None)) or []
    not_cached = {i: f"{cls}: written by no attention (holds no keys and values, or "
                     "another layer's)" for i, cls in enumerate(classes)
                  if i not in written and i not in left}
    latent = tuple(dict.fromkeys(l.site for l in layers if l.latent))
    for i, why in not_cached.items():
        log.info("geoscale: export_kv_scales: cache layer %d has no scale (%s)", i, why)
    if latent:
        log.info("geoscale: export_kv_scales: %s cache a latent: one k/v scale for the whole "
                 "entry, no q_scale", ", ".join(latent))
    return written, not_cached, latent, shared, left


def _check_module_paths(model: nn.Module, layers: list[LayerScales]) -> None:
    for site in (name for l in layers for name in (l.site, *(n for n, _ in l.readers))):
        try:
            model.get_submodule(site)
        except AttributeError:
            raise ValueError(f"export_kv_scales: attention site {site!r} is not a module "
                             f"path of {type(model).__name__}, so it names no checkpoint entry "
                             "(pass the plain Hugging Face model, not a wrapper)") from None


def export_kv_scales(model: Union[nn.Module, str, os.PathLike],
                     out_dir: Union[str, os.PathLike, None] = None, *example_inputs,
                     strategy: str = "tensor", fmt: str = "e4m3", include_q: bool = True,
                     all_or_nothing: bool = False, format: str = "compressed-tensors",
                     **example_kwargs) -> KVScaleExport:
    """Write the k/v (and q) scales, bound / R_max, in ``format`` (``WRITERS``; the first
    and default: a compressed-tensors checkpoint, what vLLM and SGLang load).

    ``model`` is either

    * an ``nn.Module``: ``example_inputs``/``example_kwargs`` are one call of it, traced once
      to find its attention (the scales do not depend on them); ``out_dir`` is required;
    * a saved Hugging Face checkpoint directory (safetensors, sharded or not): the model is
      traced without its weights and only the tensors the bounds read are read, one layer
      at a time (``geoscale_fx.export.streamed_scales``), so a checkpoint bigger than memory
      works; no example inputs; ``out_dir`` defaults to the directory (merged into it). A
      missing or non-finite tensor among those read is a ``ValueError`` naming it.

    A cache layer that cannot be bounded from the weights is left out of the file (engines
    load it at their default scale, 1.0 in vLLM), with a warning naming it, its attention,
    why and what would make it bounded, and listed in ``KVScaleExport.left_at_default``;
    the others keep their scales under their own names. ``all_or_nothing=True``: any refused
    layer is a ``ValueError``. With no layer left, a ``ValueError`` either way. Every check
    runs before the first file is written: a refusal writes nothing.
    """
    options = KVExportOptions(strategy=strategy, fmt=fmt, include_q=include_q)
    if format not in WRITERS:
        raise ValueError(f"export_kv_scales: format={format!r}; allowed values: "
                         f"{sorted(WRITERS)}")
    writer = WRITERS[format]
    writer.check(options)
    partial = not all_or_nothing
    if isinstance(model, (str, os.PathLike)):
        if example_inputs or example_kwargs:
            raise ValueError("export_kv_scales: a checkpoint directory is traced without its "
                             "weights on its own example ids; example inputs are for an "
                             "in-memory model")
        out_dir = model if out_dir is None else out_dir
        if Path(model).is_dir():           # else the reader names what is wrong with it
            check_writable(Path(out_dir))  # before the trace, not after it
        scales = checkpoint_layer_scales(model, partial=partial)
        model, layers, refused = scales.model, scales.layers, scales.refused
    else:
        if out_dir is None:
            raise ValueError("export_kv_scales: out_dir is needed for an in-memory model")
        check_writable(Path(out_dir))
        source = WeightKVScales(model, partial=partial, who="export_kv_scales")
        with torch.no_grad():
            layers = source.capture(*example_inputs, **example_kwargs).layers()
        refused = source.refused
    _check_module_paths(model, layers)
    return _write(writer, layers, options, Path(out_dir), _report(model, layers, refused))


def _write(writer, layers: list[LayerScales], options: KVExportOptions, out: Path,
           report: tuple) -> KVScaleExport:
    tensors = scale_tensors(layers, options)
    config, files, merged = writer.write(tensors, options, out)
    log.info("geoscale: export_kv_scales: %d cache layers, strategy=%s, %d tensors -> %s (%s)%s",
             len(layers), options.strategy, len(tensors), files[0], writer.NAME,
             " (merged into the checkpoint)" if merged else "")
    return KVScaleExport(tensors, config, tuple(files), merged, *report)
