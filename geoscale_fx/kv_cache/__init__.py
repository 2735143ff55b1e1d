"""KV caches with scales from the weights: certified per-layer q/k/v bounds of a model
(``weight_scales``), the format-neutral per-layer scales (``layer_scales``), which cache layer
holds what (``layer_map``), why a layer gets none (``refusals``), the FP8/NVFP4 cache layers
and the cache of ``generate`` (``manager``).

May import ``core`` through ``runtime``.
"""
