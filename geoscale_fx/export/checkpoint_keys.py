"""Which checkpoint tensors make each parameter of a model, as transformers loads them.

transformers 5.x does not load a checkpoint key into the parameter of the same name: it
passes every key through the model's list of key transforms
(``conversion_mapping.get_model_conversion_mapping(model)``: the ``WeightRenaming``\\ s and
``WeightConverter``\\ s registered for the model's class or ``model_type`` and for each of
its sub-models, scoped to them, then the legacy ones) with
``core_model_loading.rename_source_key``; a renamed key is the parameter it loads into, and a
``WeightConverter``'s operations (``Chunk``, ``Concatenate``, ``MergeModulelist`` …) build
one or several parameters from the stored tensors it collects. ``save_pretrained`` applies
the reverse, so a model built from a config and saved holds some tensors under another name:
Gemma 3's parameter ``model.language_model.layers.0.input_layernorm.weight`` is stored as
``language_model.model.layers.0.input_layernorm.weight``.

``CheckpointKeys(model, reader)`` runs the same renaming on the checkpoint's key names (no
tensor is read; the model may be on the meta device), exactly as
``core_model_loading.convert_and_load_state_dict_in_model`` does it, with transformers' own
functions. ``read(names)`` reads the tensors behind model parameter names: a renamed tensor
as stored, a converted one by running its converter's operations on the stored tensors it
collects, each cast first to the dtype of the parameter it loads into (as loading does).
A name with no source is looked up under its own name, so that the reader's refusal names
it (``CheckpointReader``: missing, or not finite). A stored FP8 tensor with a
``<name>_scale_inv`` beside it (an FP8-weight checkpoint) is read as its dequantized values
(``fp8_weights.dequantize``, blocks of the config's ``weight_block_size``), as
``from_pretrained`` dequantizes it.

Example::

    keys = CheckpointKeys(meta_model, CheckpointReader("ckpt"))
    keys.stored_names("model.language_model.layers.0.self_attn.k_proj.weight")
    # ['language_model.model.layers.0.self_attn.k_proj.weight']
    tensors = keys.read(["model.language_model.layers.0.self_attn.k_proj.weight"])
"""
from __future__ import annotations

import copy
import logging
from typing import Iterable

import torch
from torch import nn

from geoscale_fx.export.fp8_weights import (
    FP8_WEIGHT_DTYPES, block_size, dequantize, scale_name,
)
from geoscale_fx.export.safetensors_reader import CheckpointReader

__all__ = ["CheckpointKeys"]

log = logging.getLogger("geoscale_fx")


class CheckpointKeys:
    """Model parameter name -> the checkpoint tensors it loads from (see the module doc)."""

    def __init__(self, model: nn.Module, reader: CheckpointReader):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter, WeightRenaming, dot_natural_key, rename_source_key,
        )

        self.reader = reader
        self._model = model
        self._block = block_size(getattr(model, "config", None))
        self._dtypes = {n: t.dtype for n, t in model.state_dict(keep_vars=True).items()}
        transforms = get_model_conversion_mapping(model) if hasattr(
            model, "base_model_prefix") else []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        #: parameter -> the one stored key it is renamed from
        self._renamed: dict[str, str] = {}
        #: first target -> (a fresh converter, [(stored key, source pattern)])
        self._converted: dict[str, tuple[WeightConverter, list[tuple[str, str]]]] = {}
        for key in sorted(reader.weight_map, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, self._dtypes)
            if target not in self._dtypes and key in self._dtypes:
                target, pattern = rename_source_key(key, [], [], prefix, self._dtypes)
            if target not in self._dtypes:
                continue                     # a key the model does not load (unexpected)
            if pattern is None:
                self._renamed.setdefault(target, key)
            else:
                entry = self._converted.setdefault(
                    target, (copy.deepcopy(by_pattern[pattern]), []))
                entry[1].append((key, pattern))
        self._targets: dict[str, str] | None = None     # produced name -> first target
        moved = sum(k != t for t, k in self._renamed.items())
        if moved or self._converted:
            log.info("geoscale: checkpoint %s: %d tensors stored under another name and %d "
                     "parameters built by transformers' converters on load", reader.directory,
                     moved, len(self._converted))

    def __contains__(self, name: str) -> bool:
        return name in self._renamed or self._producer(name) is not None

    def stored_names(self, name: str) -> list[str]:
        """The checkpoint keys parameter ``name`` loads from (its own name if none)."""
        if name in self._renamed:
            return [self._renamed[name]]
        first = self._producer(name)
        if first is None:
            return [name]
        return [key for key, _ in self._converted[first][1]]

    def describe(self, name: str) -> str:
        """``'stored' in file`` for error messages (several for a converted parameter)."""
        stored = self.stored_names(name)
        return ", ".join(f"{k!r} in {self.reader.weight_map.get(k, '(not listed)')}"
                         for k in stored)

    def read(self, names: Iterable[str], finite: bool = True) -> dict[str, torch.Tensor]:
        """``{parameter name: tensor}``, on the CPU; a renamed tensor in its stored dtype, a
        converted one in its parameter's dtype (see the module doc). Refusals are
        ``CheckpointReader.read``'s (missing or, with ``finite``, non-finite stored tensors,
        by stored name)."""
        names = list(dict.fromkeys(names))
        direct = {n: self._renamed.get(n, n) for n in names if self._producer(n) is None}
        stored = self._stored(direct.values(), finite)
        out = {n: stored[k] for n, k in direct.items()}
        for first in dict.fromkeys(self._producer(n) for n in names if n not in direct):
            built = self._convert(first, finite)
            out.update({n: built[n] for n in names if n in built})
        return out

    def _stored(self, keys: Iterable[str], finite: bool = True) -> dict[str, torch.Tensor]:
        """``reader.read(keys)``, an FP8 tensor with a stored ``_scale_inv`` dequantized
        (float32; the module doc)."""
        keys = list(dict.fromkeys(keys))
        scales = [scale_name(k) for k in keys if scale_name(k) in self.reader]
        tensors = self.reader.read(keys + scales, finite)
        for key in keys:
            if tensors[key].dtype in FP8_WEIGHT_DTYPES and scale_name(key) in tensors:
                tensors[key] = dequantize(tensors[key], tensors[scale_name(key)], self._block,
                                          key)
        return {k: tensors[k] for k in keys}

    def _producer(self, name: str) -> str | None:
        """The first target of the converter that builds ``name``, if one does."""
        if name in self._renamed or not self._converted:
            return None
        if self._targets is None:
            self._targets = self._converter_targets()
        return self._targets.get(name)

    def _converter_targets(self) -> dict[str, str]:
        """Every parameter a converter builds -> its first target. Named as ``convert``
        names them (its first target with the first target pattern replaced by each of
        the others); a converter whose first pattern is not in its first target's name
        (a regex, a count read from the config) is run on meta tensors of the stored
        shapes instead, all such converters' headers read at once."""
        out, unplaced = {}, []
        for first, (converter, _) in self._converted.items():
            patterns = converter.target_patterns
            if patterns[0] in first:
                prefix, _, suffix = first.partition(patterns[0])
                out.update({prefix + p + suffix: first for p in patterns})
            else:
                unplaced.append(first)
        stored = [k for first in unplaced for k, _ in self._converted[first][1]]
        metas = self.reader.metas(stored) if stored else {}
        for first in unplaced:
            try:
                built = self._convert(first, tensors=metas)
            except Exception as exc:  # noqa: BLE001 — its targets stay unknown, said why
                log.info("geoscale: checkpoint: transformers' converter for %s does not run "
                         "on the meta device (%s: %s); only %s is read through it", first,
                         type(exc).__name__, exc, first)
                built = {first: None}
            out.update({t: first for t in built})
        return {t: first for t, first in out.items() if t not in self._renamed}

    def _convert(self, first: str, finite: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run the converter collected under ``first`` on its stored tensors (read here,
        or ``tensors``: meta ones, to learn which parameters it builds)."""
        template, sources = self._converted[first]
        converter = copy.deepcopy(template)
        dtype = self._dtypes[first]
        keys = [k for k, _ in sources]
        tensors = self._stored(keys, finite) if tensors is None else tensors
        for key, pattern in sources:
            converter.add_tensor(first, key, pattern, tensors[key].to(dtype))
        with torch.no_grad():
            built = converter.convert(first, model=self._model, config=getattr(
                self._model, "config", None))
        return {n: (t[0] if isinstance(t, list) else t) for n, t in built.items()}
