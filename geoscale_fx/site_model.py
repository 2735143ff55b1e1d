"""What the analysis knows about an attention: plain data, consumed by reports, plans, rewrites.

A site's logits are a **sum of bilinear terms followed by score modifiers**::

    S = s · Σ_t ⟨q-side_t, k-side_t⟩        then mask / softcap / sink / position bias

Each side of a term is a normalized ``Source`` (``‖x̂‖ ≤ radius``) mapped by weights:
``q_h = R(A_hᵀ x̂ + c_h)`` with ``A_h = diag(gain) · W[:, features[h]]``, ``c_h`` from the
offset and bias, and ``R`` an optional rotation (RoPE). Today's sites are one term; a
multi-term logit (MLA's latent part plus its decoupled RoPE part) is several, and its bound
is the sum of the terms' bounds, pushed through the modifiers (``geoscale_fx.logit_bounds``).

Graph nodes are referred to by name (names are unique within a graph and survive
``copy.deepcopy`` of the GraphModule), so a site can be matched against the graph the backend
rewrites. This module is data only (it imports no numerics): tensor-valued questions are
answered from the current parameter values, through the resolver bound at analysis time, by
functions of the numerics modules — ``head_weights.site_term_weights(site)``,
``head_weights.site_head_weights(site)``, ``logit_bounds.site_logit_bound(site)``,
``amax.site_amax_bounds(site)``. Whether a bound is a proof is decided here, once:
``is_certified``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from geoscale_fx.config import GeoscaleOptions

__all__ = ["Rotary", "Source", "Side", "Term", "Modifier", "HeadWeights", "AttentionSite",
           "ROPE_BOUNDS", "MODIFIER_KINDS", "is_certified"]

#: How a RoPE site's logits are bounded: "norm_product" (certified, default),
#: "relative" (certified, exact max over relative positions) or "interaction" (the paper's
#: position-independent ‖A_q A_kᵀ‖, empirical only: marks the site certified=False).
ROPE_BOUNDS = ("norm_product", "relative", "interaction")

#: What may happen to the summed logits before the softmax (in graph order):
#: "mask" (additive / boolean / causal) and "position_bias" (an additive bias such as ALiBi,
#: ``baddbmm``'s β·bias) are applied after the quantization and never widen its range
#: (before a softcap they make the capped value's bound just ``c``);
#: "softcap" (``c · tanh(S / c)``: the softmax input is bounded by ``c``);
#: "sink" (a learned per-head logit joined to the scores: the bound covers ``|sink|``).
MODIFIER_KINDS = ("mask", "position_bias", "softcap", "sink")


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
    """
    norm: str                        # "layernorm" | "rmsnorm"
    node: str                        # the normalization node
    width: int                       # d: the normalized vector's length
    channel_ops: tuple[tuple[str, object], ...] = ()
    radius_factor: float = 1.0
    #: QK-norm sources (a normalization after the projection): where projection feature f
    #: sits in its normalized row (the index of its per-channel gain); () before a projection
    channel_index: tuple[int, ...] = ()

    @property
    def radius(self) -> float:
        """``ρ``: the bound on ``‖x̂‖``."""
        return self.radius_factor * math.sqrt(self.width)


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
    #: this call's keys (``observed_fresh``), per ``passes.cached_keys``: only the fresh ones
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
        names += [v for _, v in self.source.channel_ops if isinstance(v, str)]
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
    """An op between the summed logits and the softmax (``MODIFIER_KINDS``)."""
    kind: str
    node: str
    value: float = float("nan")      # softcap: c; position_bias: β
    param: Optional[str] = None      # sink: the node holding the sink logits (parameters)


@dataclass(frozen=True)
class HeadWeights:
    """Canonical per-head tensors of one term (see ``geoscale_fx.spectral``)."""
    a_q: torch.Tensor                 # (n_q, d, d_h)
    c_q: Optional[torch.Tensor]       # (n_q, d_h) or None
    a_k: torch.Tensor                 # (n_kv, d, d_h)
    c_k: Optional[torch.Tensor]       # (n_kv, d_h) or None

    def __iter__(self):
        return iter((self.a_q, self.c_q, self.a_k, self.c_k))


@dataclass(frozen=True)
class AttentionSite:
    """One attention found in a traced graph, and what produces its logits."""
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
    softmax_scale: float = float("nan")   # logits S = softmax_scale · Σ_t (q_t,h · k_t,g)
    score_scale: float = float("nan")     # factor the site applies to its operands' product
    is_causal: bool = False
    has_mask: bool = False
    dropout_p: float = 0.0
    q_len: int = 0
    kv_len: int = 0
    terms: tuple[Term, ...] = ()
    modifiers: tuple[Modifier, ...] = ()
    rope_bound: str = "norm_product"
    nodes: tuple[tuple[str, str], ...] = ()   # named nodes of the site ("scores", "pv", …)
    score_op: str = ""               # explicit sites: the op of QKᵀ (matmul, bmm, baddbmm …)
    #: explicit sites: the query head of the score slice at flattened leading index i is
    #: ``score_heads[i % len(score_heads)]`` (one period, so any batch size fits)
    score_heads: tuple[int, ...] = ()
    score_lead: tuple[int, ...] = ()   # () unless the heads are outside the batch (see analyze)
    #: the values' side (``P·V``'s right operand), for their amax bound; None when it could not
    #: be traced (``value_reason`` says why)
    value: Optional[Side] = None
    value_reason: str = ""
    #: tensor parallel: the query heads this rank holds (``passes.dtensor.HeadShard``); the
    #: features above index the local weight shards
    shard: Optional[object] = None
    _resolve: Optional[Callable[[str], torch.Tensor]] = field(default=None, repr=False,
                                                              compare=False)

    # ---- derived views ------------------------------------------------------------------
    @property
    def q(self) -> Side:
        """The query side of a one-term site."""
        return self._single_term().q

    @property
    def k(self) -> Side:
        """The key side of a one-term site."""
        return self._single_term().k

    @property
    def rope(self) -> bool:
        return any(t.rope for t in self.terms)

    @property
    def norm(self) -> Optional[str]:
        return self.terms[0].q.source.norm if self.terms else None

    @property
    def model_dim(self) -> int:
        return self.terms[0].q.source.width if self.terms else 0

    @property
    def certified(self) -> bool:
        """Whether ``logit_bounds.site_logit_bound(site)`` is a proof (False: an
        assumption): ``is_certified(site)``."""
        return is_certified(self)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for t in self.terms for s in (t.q, t.k)
                                   for n in s.param_names))

    @property
    def weight_nodes(self) -> tuple[str, ...]:
        """Every graph node the bound reads (weights, biases, gains), in a stable order."""
        terms = [n for t in self.terms for n in t.node_names]
        return tuple(dict.fromkeys(terms + [m.param for m in self.modifiers if m.param]))

    @property
    def operand_nodes(self) -> tuple[str, ...]:
        """Every graph node the q, k and v amax bounds read (``amax_bounds``): the terms'
        weights, biases and gains, and the values' projection."""
        names = [n for t in self.terms for n in t.node_names]
        names += list(self.value.node_names) if self.value is not None else []
        return tuple(dict.fromkeys(names))

    @property
    def cached_keys(self) -> bool:
        """Some keys are read from a cache (a decode step), bounded by their actual norms."""
        return any(t.k.observed for t in self.terms)

    @property
    def parameter_nodes(self) -> tuple[str, ...]:
        """``weight_nodes`` without the observed keys (activations): what the site's
        parameters are computed from."""
        observed = {n for t in self.terms if t.k.observed
                    for n in (t.k.source.node, *(f for f, _ in t.k.observed_fresh))}
        return tuple(n for n in self.weight_nodes if n not in observed)

    def modifier(self, kind: str) -> Optional[Modifier]:
        return next((m for m in self.modifiers if m.kind == kind), None)

    def node_name(self, role: str) -> Optional[str]:
        return dict(self.nodes).get(role)

    def with_rope_bound(self, rope_bound: str) -> "AttentionSite":
        if rope_bound not in ROPE_BOUNDS:
            raise ValueError(f"rope_bound must be one of {ROPE_BOUNDS}, got {rope_bound!r}")
        return replace(self, rope_bound=rope_bound)

    def _single_term(self) -> Term:
        if len(self.terms) != 1:
            raise ValueError(f"attention site {self.name!r} has {len(self.terms)} terms; "
                             "use site.terms")
        return self.terms[0]

    def require_values(self) -> None:
        """Raise ``ValueError`` unless the site is supported and bound to parameter values
        (what the numerics — ``logit_bounds.site_logit_bound``, ``amax.site_amax_bounds`` —
        need)."""
        if not self.supported:
            raise ValueError(f"attention site {self.name!r} ({self.node}) is not supported: "
                             f"{self.reason}")
        if self._resolve is None:
            raise ValueError(f"attention site {self.name!r} is not bound to parameter values")


def is_certified(site: AttentionSite, options: Optional["GeoscaleOptions"] = None,
                 lowering: str = "", steps: Optional[object] = None) -> bool:
    """Whether a bound, or the scale derived from it, is a proof (False: an assumption).

    The one definition of "certified"; each caller passes the facts it has, and each fact
    given can only withdraw the claim:

    * the site (``AttentionSite.certified``): supported, and its logit bound not the paper's
      position-independent RoPE bound (``site.rope_bound == "interaction"``);
    * the plan (``SitePlan.certified``: ``options`` and the plan's ``lowering``): with
      ``"fp8_qkv"`` the q/k/v amax bounds are exact and α does not apply, so a supported site
      is certified whatever else holds; otherwise the scaling's RoPE bound is not
      ``"interaction"`` either, and the scale is the bound itself, per head: geometry
      scaling, ``granularity="head"``, a numeric ``α ≥ 1``;
    * the step (``report``: ``steps``, the site's step counter): the exact route ran —
      ``estimator="exact"``, or the cold-start step (``steps ≤ 1``).

    >>> site = AttentionSite(name="a", index=0, kind="sdpa", node="n", supported=True)
    >>> is_certified(site), is_certified(replace(site, supported=False))
    (True, False)
    """
    if not site.supported:
        return False
    if options is not None and lowering == "fp8_qkv":
        return True
    if site.rope and site.rope_bound == "interaction":
        return False
    if options is None:
        return True
    if site.rope and options.rope_bound == "interaction":
        return False
    per_head_proof = (options.scaling == "geometry" and options.granularity == "head"
                      and isinstance(options.alpha, (int, float)) and options.alpha >= 1.0)
    if not per_head_proof:
        return False
    return steps is None or options.estimator == "exact" or float(steps) <= 1
