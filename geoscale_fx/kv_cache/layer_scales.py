"""A cache layer's certified q/k/v bounds, and the k/v scales rounded up from them.

For a layer whose keys (values) obey ``max |entry| ≤ B_h`` on kv head h (float64, from the
weights: ``geoscale_fx.kv_cache.weight_scales``, or a checkpoint: ``geoscale_fx.export.streamed_scales``)
the FP8 scale is the divisor

    s_h = ⌈B_h / R_max⌉_f32          the smallest float32 ≥ B_h / R_max

so ``|x / s_h| ≤ R_max`` for every entry: rounding to nearest could land one ulp under
``B_h / R_max`` and let an entry at the bound saturate. For NVFP4 the scale is the global
scale s_g ≥ B_h / (6 · 448) of ``nvfp4.global_scale``. Both are floored at the smallest normal
float32 (a zero bound gives a finite, positive divisor)::

    >>> layer = LayerScales(0, "model.layers.0.self_attn", torch.ones(2),
    ...                     torch.tensor([448.0], dtype=torch.float64), torch.zeros(1))
    >>> layer.scales("e4m3")[0]
    tensor([1.])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from geoscale_fx.core import nvfp4
from geoscale_fx.core.bounds import fp8_max, round_up_f32
from geoscale_fx.core.fp8 import NVFP4

__all__ = ["LayerScales", "scale_from_bound"]


@dataclass(frozen=True)
class LayerScales:
    """One cache layer: the attention module that reads it, and its certified bounds.

    ``k_bound``/``v_bound`` bound what the layer stores, per stored head: the attention's
    keys and values, or, for a ``latent`` layer (MLA), the compressed latent it expands
    after the read (keys slot: ``kv_c`` after its RMSNorm, values slot: the rotated
    ``k_pe``; one head each)."""
    layer: int                     # cache layer index (the ``layer_idx`` the model writes)
    site: str                      # attention site (module path)
    q_bound: torch.Tensor          # (n_q,) float64: max |q entry| per query head
    k_bound: torch.Tensor          # (n_kv,): per stored head
    v_bound: torch.Tensor          # (n_kv,)
    latent: bool = False           # the cache holds a latent the attention expands (MLA)
    #: attentions reading this layer's cache without writing one (KV sharing), with their
    #: queries' bound ``(n_q,)``: an engine dequantizes what they read with their own k/v
    #: scales, which must be this layer's
    readers: tuple[tuple[str, torch.Tensor], ...] = ()

    def scales(self, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` float32 ``(n_kv,)``: bound / R_max (a divisor); for
        NVFP4 the global scales bound / (6 · 448)."""
        if fmt == NVFP4:
            return nvfp4.global_scale(self.k_bound), nvfp4.global_scale(self.v_bound)
        return scale_from_bound(self.k_bound, fmt), scale_from_bound(self.v_bound, fmt)


def scale_from_bound(bound: torch.Tensor, fmt: str) -> torch.Tensor:
    """``bound / R_max`` as the smallest float32 ``≥`` it (floored at the smallest normal):
    rounding to nearest could land one ulp under and let an entry at the bound saturate."""
    return round_up_f32(bound.detach().double() / fp8_max(fmt))
