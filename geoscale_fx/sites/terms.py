"""The parts of an attention site's logits: sources, sides, terms, score modifiers — plain data.

The logits are a sum of bilinear terms followed by score modifiers::

    S = s · Σ_t ⟨q-side_t, k-side_t⟩        then mask / softcap / sink / position bias

A ``Term`` pairs a query ``Side`` and a key ``Side``; each side maps a normalized ``Source``
(``‖x̂‖ ≤ radius``) by weights, per head: ``q_h = R(A_hᵀ x̂ + c_h)`` with
``A_h = diag(gain) · W[:, features[h]]`` and ``R`` an optional ``Rotary``. A ``Modifier`` is
an op between the summed logits and the softmax. ``HeadWeights`` holds a term's canonical
per-head tensors. The site that holds them is ``geoscale_fx.sites.model.AttentionSite``.

    >>> src = Source(norm="rmsnorm", node="norm", width=16)
    >>> side = Side(source=src, weight="w", layout="linear", features=((0, 1), (2, 3)))
    >>> side.n_heads, side.head_dim, src.radius
    (2, 2, 4.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch

from geoscale_fx.core.parameter_radius import radius_nodes
from geoscale_fx.sites.linear_casts import CastEnvelope, LinearCast

__all__ = ["Rotary", "Source", "Side", "Term", "Modifier", "HeadWeights"]


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
    #: "tables": full-width cos/sin tables (``x·cos + rot(x)·sin``); "halves":
    #: ``cat(x1·cos − x2·sin, x2·cos + x1·sin)``; "complex": ``view_as_complex(x) · z``
    form: str = "tables"


@dataclass(frozen=True)
class Source:
    """A normalized input ``x = gain ⊙ x̂ + offset`` with ``‖x̂‖ ≤ radius``.

    ``channel_ops`` are the per-channel ``("mul" | "add", node name or constant)`` applied to
    ``x̂`` in order (the norm's own gain and bias first); ``radius = radius_factor · √width``
    (LayerNorm and RMSNorm give ``‖x̂‖ ≤ √width``; training-mode dropout widens it).

    A source *bounded by value* (``norm == "bounded"``: no normalization before the
    projection) is the projection's input ``x̂ = x`` itself, with no channel ops, and
    ``‖x‖ ≤ ρ`` where ``ρ`` is computed from parameter values by ``radius_expr``
    (``geoscale_fx.core.parameter_radius``): it has no fixed ``radius``; the numerics evaluate it
    (``head_weights.side_radius``) whenever they evaluate the weights.
    """
    norm: str                        # "layernorm" | "rmsnorm" | "bounded" (by value)
    node: str                        # the normalization node
    width: int                       # d: the normalized vector's length
    channel_ops: tuple[tuple[str, object], ...] = ()
    radius_factor: float = 1.0
    #: QK-norm sources (a normalization after the projection): where projection feature f
    #: sits in its normalized row (the index of its per-channel gain); () before a projection
    channel_index: tuple[int, ...] = ()
    #: a source bounded by value: the expression of ``ρ`` over graph node names
    radius_expr: tuple = ()

    @property
    def bounded(self) -> bool:
        """``‖x‖ ≤ ρ`` from parameter values (``radius_expr``), not from a normalization."""
        return bool(self.radius_expr)

    @property
    def radius(self) -> float:
        """``ρ``: the bound on ``‖x̂‖`` (a normalized source's; a source bounded by value has
        none fixed: ``head_weights.side_radius`` evaluates it)."""
        if self.bounded:
            raise ValueError(f"source `{self.node}` is bounded by parameter values: evaluate "
                             "its radius with head_weights.side_radius(side, resolve)")
        return self.radius_factor * math.sqrt(self.width)

    @property
    def node_names(self) -> tuple[str, ...]:
        """Graph nodes the source's radius and channel ops read."""
        ops = tuple(v for _, v in self.channel_ops if isinstance(v, str))
        return ops + (radius_nodes(self.radius_expr) if self.radius_expr else ())


@dataclass(frozen=True)
class Side:
    """One side (queries or keys) of a term: a source mapped by a weight, per head.

    Per head ``h``: ``q_h = A_hᵀ x̂ + c_h`` where ``A_h = diag(gain) · W[:, features[h]]``
    (``W`` oriented (d, F)) and ``c_h = W[:, features[h]]ᵀ offset + bias[features[h]]``.
    A side whose source is a normalization *after* the projection (QK-norm) has no weight
    (``weight=None``): ``q_h = gain_h ⊙ x̂_h + offset_h`` on the head's own ``d_h`` channels,
    i.e. ``A_h = diag(gain[features[h]])`` and ``‖x̂_h‖ ≤ ‖x̂‖ ≤ radius``.
    """
    source: Source
    weight: Optional[str]            # node name of the weight (a parameter expression)
    layout: str                      # "linear": weight (F, d); "dense": weight (d, F); "identity"
    features: tuple[tuple[int, ...], ...]   # channel map: (n_heads, d_h) output features
    bias: Optional[str] = None       # node name of a (F,) bias, or None
    rotary: Optional[Rotary] = None
    weight_param: str = ""           # e.g. "transformer.h.0.attn.c_attn.weight"
    bias_param: str = ""
    bias_offset: int = 0             # bias index = feature + bias_offset (MHA separate weights)
    operand_gain: float = 1.0        # scalar applied between projection and attention operand
    #: bound on a per-position scalar multiplier of the operand (Llama-4's attention
    #: temperature): ``q_m = t_m · (A_hᵀ x̂_m + c_h)`` with ``|t_m| ≤ position_gain``
    position_gain: float = 1.0
    #: ``layout == "observed"`` (keys from a KV cache, not a projection of this call): the
    #: (head axis, channel axis) of the key tensor ``source.node`` whose actual norms bound
    #: the keys every step; ``features[g] == (g,)`` names key head g
    observed_axes: tuple[int, int] = ()
    #: observed keys moved from earlier cache tensors (``observed_past``: placeholders) and
    #: this call's keys (``observed_fresh``), per ``analysis.forms.cached_keys``: only the fresh ones
    #: are measured each step; the past ones are covered by a running maximum (``() ()``:
    #: the whole key is measured every step)
    #: Both are ``(node name, r)``: key head ``h`` holds that node's head ``h // r``.
    observed_past: tuple[tuple[str, int], ...] = ()
    observed_fresh: tuple[tuple[str, int], ...] = ()
    #: maps of the same source added to the weight's output (LoRA adapters): the effective
    #: weight is ``W + Σ ratio · B·A`` (``A`` None: a full second weight ``B``), node names
    low_rank: tuple[tuple[Optional[str], str, float], ...] = ()
    low_rank_params: tuple[str, ...] = ()
    #: the weight is ``weight_scale · weight · inner`` (an adapter ``s·B·A`` whose input is
    #: not its base projection's, e.g. under adapter dropout: a term of its own)
    inner: Optional[str] = None
    weight_scale: float = 1.0
    #: per head channel, the channel it is rotated with (-1: none); () when unknown
    #: (stacked rotations): then only the whole head vector's norm bounds an entry
    pairs: tuple[int, ...] = ()
    #: the projection computes in low precision (an FP8 training linear): its input's cast
    #: and the program of its dequantized weight (``sites.linear_casts``)
    cast: Optional[LinearCast] = None

    @property
    def n_heads(self) -> int:
        return len(self.features)

    @property
    def head_dim(self) -> int:
        return len(self.features[0]) if self.features else 0

    @property
    def radius(self) -> float:
        return self.source.radius

    @property
    def model_dim(self) -> int:
        """The width of the vector ``A_h`` maps (its rows)."""
        if self.observed:
            return 1
        return self.head_dim if self.weight is None else self.source.width

    @property
    def node_names(self) -> tuple[str, ...]:
        """Graph nodes whose values this side's weights are computed from."""
        if self.layout == "observed":
            return (tuple(n for n, _ in self.observed_fresh) if self.incremental
                    else (self.source.node,))
        names = [self.weight] if self.weight is not None else []
        names += [self.inner] if self.inner is not None else []
        names += [n for a, b, _ in self.low_rank for n in (a, b) if n is not None]
        names += [self.bias] if self.bias is not None else []
        names += self.source.node_names
        return tuple(names)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight_param, self.bias_param) if n) + \
            self.low_rank_params

    @property
    def observed(self) -> bool:
        """Keys bounded by their actual norms (a cache), not by weights."""
        return self.layout == "observed"

    @property
    def incremental(self) -> bool:
        """Observed keys whose past entries are covered by a running maximum."""
        return self.observed and bool(self.observed_past)


@dataclass(frozen=True)
class Term:
    """One bilinear part of the logits: ``⟨q-side, k-side⟩`` per (query head, key head)."""
    q: Side
    k: Side

    @property
    def rope(self) -> bool:
        return self.q.rotary is not None or self.k.rotary is not None

    @property
    def rotation_gain(self) -> float:
        """Bound on how much the rotations scale ``|qᵀk|`` (1.0 for plain RoPE)."""
        fq = self.q.rotary.factor if self.q.rotary is not None else 1.0
        fk = self.k.rotary.factor if self.k.rotary is not None else 1.0
        return max(fq, 1.0) * max(fk, 1.0)

    @property
    def operand_scale(self) -> float:
        """Bound on how much rotations and per-position multipliers scale ``|qᵀk|``: both
        are scalar per token vector (``‖R q‖ ≤ factor·‖q‖``, ``t_m q_m``), so the bilinear
        form's bound is multiplied by their product."""
        gain = self.rotation_gain if self.rope else 1.0
        return gain * self.q.position_gain * self.k.position_gain

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.q.node_names + self.k.node_names))


@dataclass(frozen=True)
class Modifier:
    """An op between the summed logits and the softmax, as the site holds it.

    Each kind is a subclass (``geoscale_fx.analysis.modifiers``: "mask", "position_bias",
    "softcap", "sink", in graph order on the site) that says how it changes the bound on
    what the softmax receives (``transform``) and whether the FP8 q/k/v kernel can take it
    (``fp8_qkv``); the numerics and planning ask the object, never its ``kind``.
    """
    #: the kind's name (counters ``modifier_<kind>``, ``AttentionSite.modifier(kind)``)
    kind: ClassVar[str] = ""
    #: ``lowering="fp8_qkv"`` can take it: the FP8 q/k/v kernel applies it itself (else the
    #: site keeps a logit lowering, ``plan.qkv_fallback_reason`` naming the kind)
    fp8_qkv: ClassVar[bool] = False
    #: it bounds its output whatever it receives (a softcap ``c·tanh(S/c)``): an op before
    #: it is inside the cap
    caps: ClassVar[bool] = False

    node: str
    value: float = float("nan")      # softcap: c; position_bias: β
    param: Optional[str] = None      # sink: the node holding the sink logits (parameters)
    #: a sink computed from the activations: a projection of a bounded source, one width-1
    #: head per output feature, ``|sink_f| ≤ ρ‖A_f‖ + |c_f|`` (``analysis.sides.sink_bound``)
    side: Optional[Side] = None

    def transform(self, bound: torch.Tensor, later: Sequence["Modifier"],
                  resolve: Optional[Callable[[str], torch.Tensor]]) -> torch.Tensor:
        """The bound on what leaves the op, from ``bound`` on what enters it, ``(n_q,)`` or
        ``(1,)`` float64; ``later``: the modifiers after it (graph order); ``resolve``: a
        graph node's value (traceable: the backend runs it inside the compiled graph)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.kind or 'no kind'}) does "
                                  "not say how it transforms the bound")


@dataclass(frozen=True)
class HeadWeights:
    """Canonical per-head tensors of one term (see ``geoscale_fx.core.spectral``)."""
    a_q: torch.Tensor                 # (n_q, d, d_h)
    c_q: Optional[torch.Tensor]       # (n_q, d_h) or None
    a_k: torch.Tensor                 # (n_kv, d, d_h)
    c_k: Optional[torch.Tensor]       # (n_kv, d_h) or None
    #: ``ρ`` of a side whose source is bounded by value, evaluated with the weights
    #: (float64, 0-dim); None: the side's own fixed ``radius``
    rho_q: Optional[torch.Tensor] = None
    rho_k: Optional[torch.Tensor] = None
    #: a low-precision projection's effect on the side (``A``, ``c`` are then of the
    #: dequantized weight): its source's radius widened, a ball around ``c``
    cast_q: Optional[CastEnvelope] = None
    cast_k: Optional[CastEnvelope] = None

    def __iter__(self):
        return iter((self.a_q, self.c_q, self.a_k, self.c_k))

    def radii(self, term: "Term") -> tuple:
        """``(ρ_q, ρ_k)``: the evaluated radius of a side bounded by value, else its own
        (a float: the numbers of normalized sources are unchanged), times the widening of
        a low-precision projection's input cast."""
        rho_q = term.q.radius if self.rho_q is None else self.rho_q
        rho_k = term.k.radius if self.rho_k is None else self.rho_k
        if self.cast_q is not None:
            rho_q = rho_q * self.cast_q.radius_factor
        if self.cast_k is not None:
            rho_k = rho_k * self.cast_k.radius_factor
        return rho_q, rho_k

    @property
    def cast(self) -> bool:
        """Either side is a low-precision projection."""
        return self.cast_q is not None or self.cast_k is not None
