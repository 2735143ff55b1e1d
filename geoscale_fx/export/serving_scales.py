"""``attention_scales(model, ids)``: the FP8 q/k/v scales of the current weights, for RL loops.

An RL or fine-tuning loop that serves its policy with an FP8 KV cache (vLLM, SGLang) must
hand the engine ``k_scale``/``v_scale`` (and ``q_scale``) that fit the weights it syncs, at
every sync: scales calibrated on the first checkpoint saturate as soon as an update grows
``W_K``. ``attention_scales`` returns them from the live parameters, per attention layer::

    s = max_h B_h / R_max  (strategy="tensor", shape (1,))    s_h = B_h / R_max  ("head")

with ``B_h`` the certified bound on ``max |entry|`` of head ``h`` (``amax.site_amax_bounds``,
float64) and the float32 scale rounded up, keyed by the checkpoint names engines load
(``model.layers.3.self_attn.k_scale``): the tensors ``export_kv_scales`` writes, bit for bit
(same ``WeightKVScales`` bounds, same ``export.scale_tensors``).

Contract. The first call traces ``model`` once (``example_inputs``/``example_kwargs`` are
one call of it, in eval mode and without gradients; the scales do not depend on them) and
keeps the trace on the model; later calls run no forward pass and no trace: the bounds are
re-evaluated from the parameters when one changed (optimizer step, ``load_state_dict``,
``module.to``), read back otherwise. A write through ``p.data`` in place is not seen
(``WeightKVScales``). A model converted by ``apply_`` is traced as its plain self, a
``wrap`` wrapper as the model it wraps (whose names its ``state_dict`` has), a model whose
``forward`` a client replaced (TRL's fused LM head) through its class's ``forward``. Parameters
with inf/nan raise a ``ValueError`` naming the site and the parameter.

Example::

    >>> import torch, transformers, geoscale_fx
    >>> cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
    ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=128)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> ids = torch.randint(0, 128, (1, 8))
    >>> scales = geoscale_fx.attention_scales(model, ids)        # traces once
    >>> sorted(scales)[:2]
    ['model.layers.0.self_attn.k_scale', 'model.layers.0.self_attn.q_scale']
    >>> with torch.no_grad():
    ...     _ = model.model.layers[0].self_attn.k_proj.weight.mul_(2)
    >>> after = geoscale_fx.attention_scales(model, ids)         # no trace: live weights
    >>> bool(after["model.layers.0.self_attn.k_scale"] > scales["model.layers.0.self_attn.k_scale"])
    True
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from geoscale_fx.export.kv_scales import KVExportOptions, scale_tensors
from geoscale_fx.kv_cache.weight_scales import WeightKVScales
from geoscale_fx.api.wrapper import GeoscaleModule

__all__ = ["attention_scales"]

log = logging.getLogger("geoscale_fx")

#: the model's attribute that keeps its trace between calls (dies with the model)
_TRACE_ATTR = "_geoscale_attention_scales"


def attention_scales(model: nn.Module, *example_inputs, strategy: str = "tensor",
                     fmt: str = "e4m3", include_q: bool = True, **example_kwargs
                     ) -> dict[str, torch.Tensor]:
    """``{"<attention path>.k_scale": ..., ".v_scale": ..., ".q_scale": ...}`` float32 on the
    CPU, ``(1,)`` (``strategy="tensor"``) or ``(heads, 1, 1)`` (``"head"``), from the live
    parameters. Options as in ``export_kv_scales``; the example inputs are read on the first
    call only (the trace), see the module docstring."""
    options = KVExportOptions(strategy=strategy, fmt=fmt, include_q=include_q)
    if isinstance(model, GeoscaleModule):     # its state_dict names are the model's
        model = model.model
    source = _trace(model, example_inputs, example_kwargs)
    with torch.no_grad():
        layers = source.layers()
    return scale_tensors(layers, options)


def _trace(model: nn.Module, example_inputs: tuple, example_kwargs: dict) -> WeightKVScales:
    source = model.__dict__.get(_TRACE_ATTR)
    if isinstance(source, WeightKVScales) and source.captured:
        return source
    if not example_inputs and not example_kwargs:
        raise ValueError(f"attention_scales: the first call for this "
                         f"{type(model).__name__} traces it and needs one call's inputs "
                         "(e.g. attention_scales(model, input_ids))")
    source = WeightKVScales(model)
    with torch.no_grad(), _eval_mode(model):
        source.capture(*example_inputs, **example_kwargs)
    model.__dict__[_TRACE_ATTR] = source
    log.info("geoscale: attention_scales: %s traced once; later calls re-evaluate the "
             "bounds from its live parameters", type(model).__name__)
    return source


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Serving scales: trace the model as it serves (dropout off), then restore each
    module's own ``training`` flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training
