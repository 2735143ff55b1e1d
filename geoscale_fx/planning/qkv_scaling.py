"""Per-step FP8 descales of q, k and v for ``lowering="fp8_qkv"``, predicted from the weights.

Per kv head ``g`` (the kernel's layout, FA3's ``(batch, n_kv_heads)`` descales)::

    δ_k,g = B_k,g / (η · R_max),   δ_v,g = B_v,g / (η · R_max),
    δ_q,g = max_{h ∈ group(g)} B_q,h / (η · R_max)

with ``B`` the certified bounds on ``max |entry|`` of each head (``geoscale_fx.numerics.amax``:
``|q_h,i| ≤ ρ‖a_i‖ + |c_i|``, pair norms under RoPE). Every entry then satisfies
``|x / δ| ≤ η · R_max``: the cast never saturates, whatever the input. The bounds are
recomputed from the weights whenever they change (so they are right after every optimizer
step or checkpoint load): inside the compiled graph of a training step, on the host before
an inference call (whose graph reads the kept descales). ``granularity="layer"`` takes one
descale per tensor (the max over kv heads). α does not apply: it scales the logit bound only.

A site that reads a KV cache (a decode step, or any step of a model with an FP8 cache) has
keys and values that are not this call's projections: q keeps its weight bound, and k and v
(``reads``, found by the rewrite) take, per kv head,

* ``"fp8"`` — operands dequantized from an FP8 cache (``analysis.forms.fp8_cache_reads``): every
  entry is ``bits · s_g`` with ``|bits| ≤ R_cache``, so ``B_g = R_cache · |s_g| · (1 + 2ε)``
  (ε: the operand dtype's epsilon, the rounding of the product and its cast) and
  ``δ_g = B_g / R_max`` — η = 1, since B is the storage's own range, not an estimate: with
  the same format the cast reproduces the stored FP8 values (no second rounding). The scale
  is read from the cache every call (whatever weights filled it), O(1) in its length;
* ``"observed"`` — any other cache: ``B_g = max |entry|`` of the tensor the attention reads
  (over batch, positions, channels), ``δ_g = B_g / R_max``, rounded up to float32: exact
  whatever the cache holds, O(cache) per step (as reading it). In a prefill whose keys are
  written into a cache first (a static cache), the keys of later positions set the scale of
  earlier queries' keys (as TransformerEngine's current scaling: no saturation, a causal
  dependence of the rounding).

Each step also records what the casts saw: ``{q,k,v}_max_scaled`` = ``max |x| / δ`` per kv
head (and the largest ever), and ``overflow_steps`` (steps where one exceeded R_max). The
state stores every per-kv-head value once per query head of the group (``OperandScaling``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from geoscale_fx.numerics import amax
from geoscale_fx.core import bounds
from geoscale_fx.core.bounds import fp8_max, round_up_f32
from geoscale_fx.core.fp8 import overflowed
from geoscale_fx.kernels.qkv_attention import group_descale, operand_scaled_max
from geoscale_fx.planning.scaling import NON_FINITE_TAG, ScalingPolicy
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.state import StateSpec

__all__ = ["OperandScaling", "OPERANDS", "Read"]

OPERANDS = ("q", "k", "v")


@dataclass(frozen=True)
class Read:
    """A k or v operand read from a KV cache: the tensor the attention reads
    (``(B, H_kv, L, d)``) and, when it is dequantized from an FP8 cache, the cache's scale
    (``(1, H or 1, 1, 1)`` over the cache's ``H = H_kv / repeat`` heads) and storage format."""
    x: torch.Tensor
    cache_scale: Optional[torch.Tensor] = None
    cache_fmt: str = ""
    repeat: int = 1             # operand head h holds the cache's head h // repeat

    def bound(self) -> torch.Tensor:
        """``(H_kv,)`` float64: bound on ``max |entry|`` per kv head (module docstring)."""
        n_kv = self.x.shape[-3]
        if self.cache_scale is None:
            return self.x.detach().abs().amax(dim=(0, 2, 3)).double()
        margin = 1.0 + 2.0 * torch.finfo(self.x.dtype).eps
        scale = self.cache_scale.detach().abs().double().reshape(-1)
        scale = scale.repeat_interleave(self.repeat) if scale.numel() > 1 else scale
        scale = scale.expand(n_kv)
        return scale * (fp8_max(self.cache_fmt) * margin)


class OperandScaling(ScalingPolicy):
    """Descales of an fp8_qkv site (state: bounds, descales, the last and largest scaled
    maxima, overflow steps).

    The state holds one entry per *query* head (a kv head's value repeated over its GQA
    group): one graph of a site may read kv heads as they are (``enable_gqa``) and another
    repeated (``repeat_kv``, e.g. where a mask is passed), and both share the state."""

    observes = False

    def __init__(self, site: AttentionSite, options):
        super().__init__(site, options, site.n_kv_heads)

    def specs(self) -> list[StateSpec]:
        n_q = self.site.n_q_heads
        specs = [StateSpec("steps", ()), StateSpec("cached_steps", ()),
                 StateSpec("overflow_steps", ())]
        for role in OPERANDS:
            specs += [StateSpec(f"{role}_bound", (n_q,)),
                      StateSpec(f"{role}_scale", (n_q,), 1.0),
                      StateSpec(f"{role}_max_scaled", (n_q,)),
                      StateSpec(f"{role}_max_scaled_ever", (n_q,))]
        return specs

    def _per_query(self, per_kv: torch.Tensor) -> torch.Tensor:
        """``(n_q,)`` from ``(n_kv,)``: each kv head's value for the query heads reading it."""
        return per_kv.repeat_interleave(self.site.n_q_heads // self.site.n_kv_heads)

    def _per_kv(self, per_query: torch.Tensor) -> torch.Tensor:
        return per_query.reshape(self.site.n_kv_heads, -1)[:, 0]

    @property
    def predicted(self) -> str:
        """The operands whose bounds come from the weights (k and v of a cached site are
        read: ``reads``)."""
        return "q" if self.site.cached_keys else "qkv"

    def descales(self, weights: dict, state: dict, reuse: bool = False,
                 reads: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(δ_q, δ_k, δ_v)``, each ``(n_kv,)`` float32 (traceable). ``reads``: at a site
        reading a KV cache, per role ``"k"``/``"v"`` a ``Read`` (the operand, and the FP8
        cache's scale and format when it is dequantized from one)."""
        roles = self.predicted
        if not reuse:
            found = self._weight_bounds(weights, state)
            torch._assert_async(
                torch.isfinite(torch.cat([found[r] for r in roles])).all(),
                f"{NON_FINITE_TAG} in attention site '{self.site.name}' (parameters of its "
                f"{', '.join(roles)} projections)")
        for role in OPERANDS:
            if role not in roles:
                bound = reads[role].bound()     # per operand head: kv heads maybe repeated
                bound = bound.reshape(self.site.n_kv_heads, -1).amax(dim=-1)
                state[f"{role}_bound"].copy_(self._per_query(bound))
                state[f"{role}_scale"].copy_(self._per_query(self._exact_descale(bound)))
        return tuple(self._per_kv(state[f"{role}_scale"]) for role in OPERANDS)

    def _weight_bounds(self, weights: dict, state: dict) -> dict[str, torch.Tensor]:
        """The bounds and descales of the operands predicted from the weights, kept in the
        state (what a ``reuse`` call reads)."""
        resolve = {k: v.detach() if isinstance(v, torch.Tensor) else v
                   for k, v in weights.items()}.__getitem__
        found = amax.site_amax_bounds(self.site, resolve, roles=self.predicted)
        for role in self.predicted:
            bound = found[role] if role == "q" else self._per_query(found[role])
            state[f"{role}_bound"].copy_(bound)
            state[f"{role}_scale"].copy_(self._per_query(self._descale(found[role])))
        return found

    def refresh(self, weights, state):
        with torch.no_grad():
            self._weight_bounds(weights, state)

    def _exact_descale(self, bound: torch.Tensor) -> torch.Tensor:
        """``B / R_max`` per kv head (η = 1: ``B`` is exact), float32 rounded up."""
        if self.options.granularity == "layer":
            bound = bound.amax().expand(self.site.n_kv_heads)
        return round_up_f32(bound.double() / fp8_max(self.options.fp8_format))

    def _descale(self, bound: torch.Tensor) -> torch.Tensor:
        """``B / (η·R_max)`` per kv head, float32 rounded up (to nearest, half the descales
        fell one ulp under it: with η = 1 an entry at the bound then lands above R_max)."""
        n_kv = self.site.n_kv_heads
        per_kv = group_descale(bound, n_kv)                   # q: max over each GQA group
        if self.options.granularity == "layer":
            per_kv = per_kv.amax().expand(n_kv)
        return round_up_f32(bounds.scale_factor(per_kv, eta=self.options.eta,
                                                fmt=self.options.fp8_format))

    def record(self, operands: tuple[torch.Tensor, ...], descales: tuple[torch.Tensor, ...],
               state: dict) -> None:
        """What the casts of this step saw: ``max |x| / δ`` per kv head, and overflows."""
        over = torch.zeros((), dtype=torch.bool, device=descales[0].device)
        for role, x, descale in zip(OPERANDS, operands, descales):
            scaled = self._per_query(operand_scaled_max(x, descale))
            state[f"{role}_max_scaled"].copy_(scaled)
            ever = state[f"{role}_max_scaled_ever"]
            ever.copy_(torch.maximum(ever, scaled))
            over = over | overflowed(scaled, self.options.fp8_format).any()
        state["overflow_steps"].add_(over.float())
