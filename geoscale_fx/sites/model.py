"""What the analysis knows about an attention: plain data, consumed by reports, plans, rewrites.

A site's logits are a **sum of bilinear terms followed by score modifiers**::

    S = s · Σ_t ⟨q-side_t, k-side_t⟩        then mask / softcap / sink / position bias

Each side of a term is a normalized ``Source`` (``‖x̂‖ ≤ radius``) mapped by weights:
``q_h = R(A_hᵀ x̂ + c_h)`` with ``A_h = diag(gain) · W[:, features[h]]``, ``c_h`` from the
offset and bias, and ``R`` an optional rotation (RoPE). Today's sites are one term; a
multi-term logit (MLA's latent part plus its decoupled RoPE part) is several, and its bound
is the sum of the terms' bounds, pushed through the modifiers (``geoscale_fx.numerics.logit_bounds``).

Graph nodes are referred to by name (names are unique within a graph and survive
``copy.deepcopy`` of the GraphModule), so a site can be matched against the graph the backend
rewrites. This module is data only (it imports no numerics): tensor-valued questions are
answered from the current parameter values, through the resolver bound at analysis time, by
functions of the numerics modules — ``head_weights.site_term_weights(site)``,
``head_weights.site_head_weights(site)``, ``logit_bounds.site_logit_bound(site)``,
``amax.site_amax_bounds(site)``. Whether a bound is a proof is decided here, once:
``is_certified``.

The parts a site is built from (``Rotary``, ``Source``, ``Side``, ``Term``, ``Modifier``,
``HeadWeights``) live in ``geoscale_fx.sites.terms``.

What a forward stores in its KV cache is described the same way, per write
(``CacheWrite``, found by ``analysis.forms.cache_writes``): the stored keys and values are sides too,
bounded by ``amax.cache_write_bounds``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from geoscale_fx.sites.terms import Modifier, Side, Term

if TYPE_CHECKING:
    from geoscale_fx.options.config import GeoscaleOptions

__all__ = ["AttentionSite", "CacheWrite", "ROPE_BOUNDS", "is_certified"]

#: How a RoPE site's logits are bounded: "norm_product" (certified, default),
#: "relative" (certified, exact max over relative positions) or "interaction" (the paper's
#: position-independent ‖A_q A_kᵀ‖, empirical only: marks the site certified=False).
ROPE_BOUNDS = ("norm_product", "relative", "interaction")

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
    #: tensor parallel: the query heads this rank holds (``analysis.fx.dtensor.HeadShard``); the
    #: features above index the local weight shards
    shard: Optional[object] = None
    #: "weights": the bound is computed from the parameters (the method); "measured": the
    #: weights cannot bound q or k (``unbounded_reason`` says why), so both are bounded by
    #: their norms measured in the graph at every call (``analysis.forms.measured_sites``)
    bound_by: str = "weights"
    unbounded_reason: str = ""
    #: a site the weights cannot bound (``supported=False``): the same site bounded by its
    #: measured operands, which planning runs instead (None: not even that applies)
    measured: Optional["AttentionSite"] = None
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
        sides = [s for t in self.terms for s in (t.q, t.k)]
        sides += [m.side for m in self.modifiers if m.side is not None]
        return tuple(dict.fromkeys(n for s in sides for n in s.param_names))

    @property
    def weight_nodes(self) -> tuple[str, ...]:
        """Every graph node the bound reads (weights, biases, gains), in a stable order."""
        terms = [n for t in self.terms for n in t.node_names]
        sinks = [n for m in self.modifiers if m.side is not None for n in m.side.node_names]
        return tuple(dict.fromkeys(terms + [m.param for m in self.modifiers if m.param]
                                   + sinks))

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
        return self.bound_by == "weights" and any(t.k.observed for t in self.terms)

    @property
    def parameter_nodes(self) -> tuple[str, ...]:
        """``weight_nodes`` without the observed operands (activations): what the site's
        parameters are computed from."""
        observed = {n for t in self.terms for side in (t.q, t.k) if side.observed
                    for n in (side.source.node, *(f for f, _ in side.observed_fresh))}
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


@dataclass(frozen=True)
class CacheWrite:
    """One ``cache.update(keys, values, layer)`` of a traced forward: what the cache stores.

    ``keys``/``values`` are the sides of the stored tensors ``(B, H, L, d)`` (one side per
    projection their channels come from: ``amax`` takes the max over different channels and
    adds maps of the same channels), ``key_heads[h]`` the side head that stored head ``h``
    holds. For most models the stored tensors are the attention's keys and values; for MLA
    they are the compressed latent the attention expands after the read (``latent``:
    ``kv_c`` after its RMSNorm in the keys slot, the rotated ``k_pe`` in the values slot).
    ``site`` names the attention that reads the layer (its module path: the scales' name);
    ``reason`` says why the write cannot be bounded or named (then ``site`` or the sides are
    missing).
    """
    layer: int                       # the cache layer written (``update``'s ``layer_idx``)
    node: str                        # the write's graph node
    graph: int = 0
    module: str = ""                 # path of the module whose forward wrote it
    site: Optional[str] = None       # the attention reading it (its sites' name)
    keys: tuple[Side, ...] = ()
    values: tuple[Side, ...] = ()
    key_heads: tuple[int, ...] = ()  # per stored key head: its index among the sides' heads
    value_heads: tuple[int, ...] = ()
    #: the stored tensors are not the attention's keys and values (moved, never computed):
    #: the attention computes them from what it reads (MLA's ``kv_b_proj``)
    latent: bool = False
    #: other attentions reading the stored keys and values moved without writing them (KV
    #: sharing: Gemma 3n's later layers reuse an earlier layer's cache)
    readers: tuple[str, ...] = ()
    reason: str = ""
    _resolve: Optional[Callable[[str], torch.Tensor]] = field(default=None, repr=False,
                                                              compare=False)

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every graph node the stored tensors' bounds read (weights, biases, gains)."""
        return tuple(dict.fromkeys(n for side in (*self.keys, *self.values)
                                   for n in side.node_names))

    def require_values(self) -> None:
        """Raise ``ValueError`` unless the write is bounded and bound to parameter values."""
        if self.reason:
            raise ValueError(f"cache layer {self.layer} ({self.node}): {self.reason}")
        if self._resolve is None:
            raise ValueError(f"cache layer {self.layer} ({self.node}) is not bound to "
                             "parameter values")


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
    * the step (``report``: ``steps``, the site's step counter): a certified route ran —
      ``estimator="schatten"`` or ``"exact"``, or the power iteration's cold-start step
      (``steps ≤ 1``).

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
    # measured operands: the exact norms every call, whatever the estimator
    return steps is None or options.estimator != "power" or float(steps) <= 1 or \
        site.bound_by == "measured"
