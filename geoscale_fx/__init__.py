"""geoscale-fx: predictive FP8 scaling of attention logits from the weights' geometry.

Public surface (imported lazily, so ``import geoscale_fx`` stays cheap)::

    torch.compile(model, backend="geoscale")      # the backend, default options
    geoscale_fx.backend(**options)                # a configured backend
    geoscale_fx.apply_(model, **options)          # in place: same object, compiled, state in it
    geoscale_fx.wrap(model, **options)            # the wrapper form; state in state_dict
    geoscale_fx.save_state(model, dir)            # dir/geoscale_state.safetensors
    geoscale_fx.load_state(model, dir)            # restore it (warm), False if absent/stale
    geoscale_fx.compile_blocks(model, blocks, **options)  # per-block compile (TP, FSDP2)
    geoscale_fx.load_scaling_state(model, checkpoint_id)  # DCP resume, warm
    geoscale_fx.report(model)                     # per-site σ, bound, α, scale, overflows
    geoscale_fx.calibrate(model, batches)         # auto-α on a data loader, then frozen
    geoscale_fx.export_kv_scales(model, dir, ids)  # FP8 k/v/q scales for vLLM/SGLang
    geoscale_fx.attention_scales(model, ids)      # the same scales, live weights (RL sync)
    geoscale_fx.restore_(model)                   # undo apply_: the plain model again
    geoscale_fx.plain_state_dict(model)           # the model's own keys, no geoscale state
    geoscale_fx.GeoscaleOptions                   # the options (validated)
    geoscale_fx.GeometryRecipe(alpha=Alpha(...))  # the options as a recipe per strategy:
    geoscale_fx.DelayedRecipe / CurrentRecipe / NoScalingRecipe   # wrap(model, recipe=...)
    geoscale_fx.find_attention(model, *args, **kwargs) -> list[AttentionSite]
    geoscale_fx.AttentionSite
    geoscale_fx.NonFiniteWeights                  # raised when a parameter holds inf/nan
    geoscale_fx.CheckpointError                   # a checkpoint the export cannot read or write
    geoscale_fx.site_logit_bound(site)            # certified per-head bound on |S|, current weights
    geoscale_fx.site_amax_bounds(site)            # certified per-head bounds on q/k/v entries
    geoscale_fx.bounds      bounds on |S| and the paper's α/γ calibration rule
    geoscale_fx.spectral    per-head and per-layer spectral norms of W^Q W^Kᵀ
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "bounds": ("geoscale_fx.core.bounds", None),
    "spectral": ("geoscale_fx.core.spectral", None),
    "find_attention": ("geoscale_fx.analysis.capture", "find_attention"),
    "backend": ("geoscale_fx.compile.dynamo_backend", "backend"),
    "GeoscaleBackend": ("geoscale_fx.compile.dynamo_backend", "GeoscaleBackend"),
    "GeoscaleOptions": ("geoscale_fx.options.config", "GeoscaleOptions"),
    "Alpha": ("geoscale_fx.options.recipes", "Alpha"),
    "GeometryRecipe": ("geoscale_fx.options.recipes", "GeometryRecipe"),
    "DelayedRecipe": ("geoscale_fx.options.recipes", "DelayedRecipe"),
    "CurrentRecipe": ("geoscale_fx.options.recipes", "CurrentRecipe"),
    "NoScalingRecipe": ("geoscale_fx.options.recipes", "NoScalingRecipe"),
    "wrap": ("geoscale_fx.api.wrapper", "wrap"),
    "apply_": ("geoscale_fx.api.conversion", "apply_"),
    "save_state": ("geoscale_fx.api.serialization", "save_state"),
    "load_state": ("geoscale_fx.api.serialization", "load_state"),
    "GeoscaleModule": ("geoscale_fx.api.wrapper", "GeoscaleModule"),
    "compile_blocks": ("geoscale_fx.api.blocks", "compile_blocks"),
    "load_scaling_state": ("geoscale_fx.api.dcp_state", "load_scaling_state"),
    "report": ("geoscale_fx.api.reporting", "report"),
    "calibrate": ("geoscale_fx.api.calibration", "calibrate"),
    "export_kv_scales": ("geoscale_fx.export.kv_scales", "export_kv_scales"),
    "attention_scales": ("geoscale_fx.export.serving_scales", "attention_scales"),
    "restore_": ("geoscale_fx.api.conversion", "restore_"),
    "plain_state_dict": ("geoscale_fx.api.conversion", "plain_state_dict"),
    "AttentionSite": ("geoscale_fx.sites.model", "AttentionSite"),
    "NonFiniteWeights": ("geoscale_fx.core.errors", "NonFiniteWeights"),
    "CheckpointError": ("geoscale_fx.core.errors", "CheckpointError"),
    "site_logit_bound": ("geoscale_fx.numerics.logit_bounds", "site_logit_bound"),
    "site_amax_bounds": ("geoscale_fx.numerics.amax", "site_amax_bounds"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'geoscale_fx' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
