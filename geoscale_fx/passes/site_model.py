"""What the analysis knows about an attention: plain data, consumed by reports and the rewrite.

Graph nodes are referred to by name (names are unique within a graph and survive
``copy.deepcopy`` of the GraphModule), so a site can be matched against the graph the backend
rewrites. Tensor-valued questions (``head_weights()``, ``logit_bound()``) are answered from the
current parameter values through a resolver bound at analysis time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

__all__ = ["Rotary", "Projection", "AttentionSite", "ROPE_BOUNDS"]

#: How a RoPE site's logits are bounded: "norm_product" (certified, default),
#: "relative" (certified, exact max over relative positions) or "interaction" (the paper's
#: position-independent ‖A_q A_kᵀ‖, empirical only: marks the site certified=False).
ROPE_BOUNDS = ("norm_product", "relative", "interaction")


@dataclass(frozen=True)
class Rotary:
    """A rotary position embedding applied to one side after the projection.

    ``factor`` bounds the rotation's gain: ``‖R q‖ ≤ factor · ‖q‖`` (1.0 for plain RoPE; the
    constant that scaled variants multiply cos/sin by; ×√2 when the angle pairing could not be
    verified). ``pairing[j]`` is the element rotated together with element ``j`` of a head.
    """
    style: str                       # "rotate_half" | "interleaved" | "other"
    factor: float
    pairing_verified: bool
    pairing: tuple[int, ...]
    cos_node: str
    sin_node: str
    signs: tuple[float, ...] = ()    # rotated term: element j takes signs[j]·x[pairing[j]]
    partial: bool = False            # only part of each head is rotated


@dataclass(frozen=True)
class Projection:
    """One side (queries or keys) of a site, traced back to weights and a normalized input.

    Per head ``h``: ``q_h = A_hᵀ x̂ + c_h`` with ``‖x̂‖ ≤ radius_factor·√model_dim``, where
    ``A_h = diag(gain) · W[:, features[h]]`` (``W`` oriented (d, F)) and
    ``c_h = W[:, features[h]]ᵀ offset + bias[features[h]]``. ``gain``/``offset`` fold
    ``channel_ops`` (per-channel ``("mul" | "add", node name or constant)`` applied to x̂).
    """
    weight: str                      # node name of the weight (a parameter expression)
    layout: str                      # "linear": weight (F, d); "dense": weight (d, F)
    features: tuple[tuple[int, ...], ...]   # (n_heads, d_h) output-feature indices
    bias: Optional[str]              # node name of a (F,) bias, or None
    norm: str                        # "layernorm" | "rmsnorm"
    norm_node: str
    channel_ops: tuple[tuple[str, object], ...]
    model_dim: int
    radius_factor: float = 1.0
    rotary: Optional[Rotary] = None
    weight_param: str = ""           # e.g. "transformer.h.0.attn.c_attn.weight"
    bias_param: str = ""
    bias_offset: int = 0             # bias index = feature + bias_offset (MHA separate weights)
    operand_gain: float = 1.0        # scalar applied between projection and attention operand

    @property
    def n_heads(self) -> int:
        return len(self.features)

    @property
    def head_dim(self) -> int:
        return len(self.features[0]) if self.features else 0

    @property
    def radius(self) -> float:
        """``ρ``: the bound on ``‖x̂‖`` (``√d`` after LayerNorm/RMSNorm)."""
        return self.radius_factor * math.sqrt(self.model_dim)


@dataclass(frozen=True)
class HeadWeights:
    """Canonical per-head tensors of a site (see ``geoscale_fx.spectral``)."""
    a_q: torch.Tensor                 # (n_q, d, d_h)
    c_q: Optional[torch.Tensor]       # (n_q, d_h) or None
    a_k: torch.Tensor                 # (n_kv, d, d_h)
    c_k: Optional[torch.Tensor]       # (n_kv, d_h) or None

    def __iter__(self):
        return iter((self.a_q, self.c_q, self.a_k, self.c_k))


@dataclass(frozen=True)
class AttentionSite:
    """One attention found in a traced graph, and what produces its queries and keys."""
    name: str                        # module path, e.g. "transformer.h.3.attn"
    index: int                       # order in the forward
    kind: str                        # "sdpa" | "explicit" | "mha" | "encoder_layer"
    node: str                        # the attention node (SDPA call, softmax, MHA op)
    graph: int = 0                   # which captured graph (graph breaks give several)
    supported: bool = False
    reason: str = ""
    n_q_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    model_dim: int = 0
    norm: Optional[str] = None
    rope: bool = False
    softmax_scale: float = float("nan")   # logits S = softmax_scale · (q_h · k_g) from x̂
    score_scale: float = float("nan")     # factor the site applies to its operands' product
    is_causal: bool = False
    has_mask: bool = False
    dropout_p: float = 0.0
    q_len: int = 0
    kv_len: int = 0
    q: Optional[Projection] = None
    k: Optional[Projection] = None
    rope_bound: str = "norm_product"
    nodes: tuple[tuple[str, str], ...] = ()   # named nodes of the site ("scores", "pv", …)
    score_heads: tuple[int, ...] = ()  # query head of each leading (batch×head) score slice
    score_lead: tuple[int, ...] = ()   # leading shape of the scores (all dims but L, L')
    _resolve: Optional[Callable[[str], torch.Tensor]] = field(default=None, repr=False,
                                                              compare=False)

    @property
    def certified(self) -> bool:
        """Whether :meth:`logit_bound` is a proof (False: it rests on an assumption)."""
        return self.supported and not (self.rope and self.rope_bound == "interaction")

    def node_name(self, role: str) -> Optional[str]:
        return dict(self.nodes).get(role)

    def with_rope_bound(self, rope_bound: str) -> "AttentionSite":
        if rope_bound not in ROPE_BOUNDS:
            raise ValueError(f"rope_bound must be one of {ROPE_BOUNDS}, got {rope_bound!r}")
        return replace(self, rope_bound=rope_bound)

    def head_weights(self) -> HeadWeights:
        """``(A_q, c_q, A_k, c_k)`` for the current parameter values (gain/offset folded in)."""
        from geoscale_fx import heads

        self._require_supported()
        return heads.site_head_weights(self, self._resolve)

    def logit_bound(self, **kwargs) -> torch.Tensor:
        """Per-head bound on ``|S|`` (``(n_q,)``, float64) for the current weights (exact)."""
        from geoscale_fx import heads

        self._require_supported()
        return heads.site_logit_bound(self, self.head_weights(), **kwargs)

    def _require_supported(self) -> None:
        if not self.supported:
            raise ValueError(f"attention site {self.name!r} ({self.node}) is not supported: "
                             f"{self.reason}")
        if self._resolve is None:
            raise ValueError(f"attention site {self.name!r} is not bound to parameter values")
