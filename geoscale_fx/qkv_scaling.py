"""Per-step FP8 descales of q, k and v for ``lowering="fp8_qkv"``, predicted from the weights.

Per kv head ``g`` (the kernel's layout, FA3's ``(batch, n_kv_heads)`` descales)::

    δ_k,g = B_k,g / (η · R_max),   δ_v,g = B_v,g / (η · R_max),
    δ_q,g = max_{h ∈ group(g)} B_q,h / (η · R_max)

with ``B`` the certified bounds on ``max |entry|`` of each head (``geoscale_fx.amax``:
``|q_h,i| ≤ ρ‖a_i‖ + |c_i|``, pair norms under RoPE). Every entry then satisfies
``|x / δ| ≤ η · R_max``: the cast never saturates, whatever the input. The bounds are
recomputed inside the compiled graph from the weight nodes at every full step (so they are
right after every optimizer step or checkpoint load); a step whose weights did not change
(inference, decode) reuses the last descales. ``granularity="layer"`` takes one descale per
tensor (the max over kv heads). α does not apply: it scales the logit bound only.

Each step also records what the casts saw: ``{q,k,v}_max_scaled`` = ``max |x| / δ`` per kv
head (and the largest ever), and ``overflow_steps`` (steps where one exceeded R_max).
"""
from __future__ import annotations

import torch

from geoscale_fx import amax, bounds
from geoscale_fx.fp8 import overflowed
from geoscale_fx.passes.site_model import AttentionSite
from geoscale_fx.qkv_attention import group_descale, operand_scaled_max
from geoscale_fx.scaling import NON_FINITE_TAG, ScalingPolicy
from geoscale_fx.state import StateSpec

__all__ = ["OperandScaling", "OPERANDS"]

OPERANDS = ("q", "k", "v")


class OperandScaling(ScalingPolicy):
    """Descales of an fp8_qkv site (state: bounds per head, descales per kv head, the last
    and largest scaled maxima, overflow steps)."""

    observes = False

    def __init__(self, site: AttentionSite, options):
        super().__init__(site, options, site.n_kv_heads)

    def specs(self) -> list[StateSpec]:
        n_q, n_kv = self.site.n_q_heads, self.site.n_kv_heads
        specs = [StateSpec("steps", ()), StateSpec("cached_steps", ()),
                 StateSpec("overflow_steps", ())]
        for role in OPERANDS:
            specs += [StateSpec(f"{role}_bound", (n_q if role == "q" else n_kv,)),
                      StateSpec(f"{role}_scale", (n_kv,), 1.0),
                      StateSpec(f"{role}_max_scaled", (n_kv,)),
                      StateSpec(f"{role}_max_scaled_ever", (n_kv,))]
        return specs

    def descales(self, weights: dict, state: dict, reuse: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(δ_q, δ_k, δ_v)``, each ``(n_kv,)`` float32 (traceable)."""
        if not reuse:
            resolve = {k: v.detach() if isinstance(v, torch.Tensor) else v
                       for k, v in weights.items()}.__getitem__
            found = amax.site_amax_bounds(self.site, resolve)
            torch._assert_async(
                torch.isfinite(torch.cat([found[r] for r in OPERANDS])).all(),
                f"{NON_FINITE_TAG} in attention site '{self.site.name}' (parameters of its "
                "q, k, v projections)")
            for role in OPERANDS:
                state[f"{role}_bound"].copy_(found[role])
                state[f"{role}_scale"].copy_(self._descale(found[role]))
        return tuple(state[f"{role}_scale"] for role in OPERANDS)

    def _descale(self, bound: torch.Tensor) -> torch.Tensor:
        n_kv = self.site.n_kv_heads
        per_kv = group_descale(bound, n_kv)                   # q: max over each GQA group
        if self.options.granularity == "layer":
            per_kv = per_kv.amax().expand(n_kv)
        return bounds.scale_factor(per_kv, eta=self.options.eta,
                                   fmt=self.options.fp8_format).float()

    def record(self, operands: tuple[torch.Tensor, ...], descales: tuple[torch.Tensor, ...],
               state: dict) -> None:
        """What the casts of this step saw: ``max |x| / δ`` per kv head, and overflows."""
        over = torch.zeros((), dtype=torch.bool, device=descales[0].device)
        for role, x, descale in zip(OPERANDS, operands, descales):
            scaled = operand_scaled_max(x, descale)
            state[f"{role}_max_scaled"].copy_(scaled)
            ever = state[f"{role}_max_scaled_ever"]
            ever.copy_(torch.maximum(ever, scaled))
            over = over | overflowed(scaled, self.options.fp8_format).any()
        state["overflow_steps"].add_(over.float())
