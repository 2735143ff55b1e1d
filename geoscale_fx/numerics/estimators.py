"""Estimators: one term's per-step bound on ``|S_t|``, from its current head weights.

An estimator owns the state it needs (``specs``), initialises it on the host at a cold start
(``cold_start``: the certified exact value goes into a floor for the first step, and the
power vectors are iterated until they reproduce it), and computes the bound inside the
compiled graph every step (``bound``: traceable, updates its state in place). The one place
that picks an estimator for a term is :func:`make_estimator`.

============================  ==============================  =========================
estimator                      bound of term t                 state
============================  ==============================  =========================
``SchattenSigma`` (default)    ‖M_h‖_{S_256} ≥ σ_h, matmuls     sigma
``ExactSigma``                 σ_h = ‖A_q,h A_k,g(h)ᵀ‖₂ exact   sigma
``PowerSigma``                 one warm power step per call     u, v (warm), floor, sigma
``SchattenNormProduct``        Schatten bounds of ‖A_q,h‖,      norm_product
                               ‖A_k,g(h)‖ (RoPE, default)
``ExactNormProduct`` (RoPE)    ‖A_q,h‖‖A_k,g(h)‖ exact          norm_product
``PowerNormProduct`` (RoPE)    power steps on ‖A‖ per head      w_q, w_k (warm), floors
``*ObservedKeys`` (KV cache)   ‖A_q,h‖ · max_j ‖k_j‖ (actual)    norm_product (+ w_q, floor_q)
============================  ==============================  =========================

The Schatten estimators are the default: certified at every step without an eigensolver
(``schatten.per_head_sigma``: repeated squarings of d_h×d_h matrices, never below
the exact value and at most ``rank^{1/256}`` above it), stateless, so a weight jump, a resume
or a plain ``load_state_dict`` needs no cold start. Per layer (the paper's granularity) the σ
estimators use the concatenated heads, (1,). State names of term ``t > 0`` carry the prefix
``t{t}_``; the float32 copies of a bound in the state are rounded up (``round_up_f32``).

Example::

    >>> import torch
    >>> from geoscale_fx.numerics.estimators import ExactSigma
    >>> from geoscale_fx.sites.terms import HeadWeights, Side, Source, Term
    >>> side = Side(Source("rmsnorm", "norm", 4), "w", "linear", ((0, 1),))
    >>> est = ExactSigma(Term(side, side), prefix="", softmax_scale=0.5, per_layer=False)
    >>> hw = HeadWeights(torch.eye(4)[None, :, :2], None, torch.eye(4)[None, :, :2], None)
    >>> state = {"sigma": torch.zeros(1)}
    >>> est.bound(hw, state)            # s · ρ² · σ = 0.5 · 4 · 1
    tensor([2.], dtype=torch.float64)
"""
from __future__ import annotations

import torch

from geoscale_fx.numerics import head_weights, logit_bounds
from geoscale_fx.numerics.cast_envelope import head_norms
from geoscale_fx.core import schatten, spectral
from geoscale_fx.core.bounds import round_up_f32
from geoscale_fx.sites.terms import HeadWeights, Term
from geoscale_fx.sites.state import StateSpec

__all__ = ["Estimator", "ExactSigma", "SchattenSigma", "PowerSigma", "ExactNormProduct",
           "SchattenNormProduct", "PowerNormProduct", "ExactObservedKeys",
           "SchattenObservedKeys", "PowerObservedKeys", "MeasuredOperands", "make_estimator"]

_COLD_TOLERANCE = 1e-4
_COLD_MAX_ITERS = 1000


def _converge(step, exact: torch.Tensor, minimum: int) -> int:
    """Run ``step()`` (one power iteration, returns estimates) at least ``minimum`` times and
    until every estimate is within ``_COLD_TOLERANCE`` of the known exact value."""
    for i in range(1, _COLD_MAX_ITERS + 1):
        estimate = step().double()
        if i >= minimum and bool((estimate >= exact * (1 - _COLD_TOLERANCE)).all()):
            return i
    return _COLD_MAX_ITERS


class Estimator:
    """Base: a term, the prefix of its state names, the site's softmax scale."""

    #: name of the reported norm (σ, or the norm product ‖A_q‖‖A_k‖ at RoPE sites)
    reports = "sigma"

    def __init__(self, term: Term, prefix: str, softmax_scale: float, per_layer: bool = False,
                 iters: int = 1, cold_iters: int = 5):
        self.term, self.prefix, self.softmax_scale = term, prefix, softmax_scale
        self.per_layer, self.iters, self.cold_iters = per_layer, iters, cold_iters

    def name(self, base: str) -> str:
        return f"{self.prefix}{base}"

    @property
    def n_scale(self) -> int:
        return 1 if self.per_layer else self.term.q.n_heads

    def specs(self) -> list[StateSpec]:
        return [StateSpec(self.name(self.reports), (self.n_scale,)),
                StateSpec(self.name("weight_bound"), (self.n_scale,))]

    def bound(self, hw: HeadWeights, state: dict) -> torch.Tensor:
        raise NotImplementedError

    def full_step(self, hw: HeadWeights, state: dict) -> torch.Tensor:
        """``bound`` from the current weights, keeping what depends on weights only."""
        bound = self.bound(hw, state)
        state[self.name("weight_bound")].copy_(round_up_f32(bound))
        return bound

    def refresh(self, hw: HeadWeights, state: dict) -> None:
        """Host side, once per change of the weights (inference): keep in the state what
        ``reuse`` reads (the bound's part that depends on the weights only)."""
        self.full_step(hw, state)

    def reuse(self, values: dict, state: dict) -> torch.Tensor:
        """The bound from what the last ``full_step``/``refresh`` kept (the weights did not
        change since): nothing is recomputed from them."""
        return state[self.name("weight_bound")].double()

    def cold_start(self, hw: HeadWeights, state: dict,
                   generator: torch.Generator | None = None) -> int:
        """Host side, before the first step: returns the power iterations used (0: none)."""
        return 0


class ExactSigma(Estimator):
    """σ by the exact Gram route every step (certified)."""

    def _sigma(self, hw: HeadWeights) -> torch.Tensor:
        if self.per_layer:
            return spectral.per_layer_sigma_exact(hw.a_q, hw.a_k).reshape(1)
        return spectral.per_head_sigma_exact(hw.a_q, hw.a_k)

    def bound(self, hw, state):
        sigma = self._sigma(hw)
        state[self.name("sigma")].copy_(round_up_f32(sigma))
        return logit_bounds.sigma_bound(self.term, hw, sigma, self.softmax_scale)


class SchattenSigma(ExactSigma):
    """σ bounded above every step by the Schatten norm ``tr((G_Q G_K)^p)^{1/2p}``, p = 128
    (certified, matmuls only; at most ``rank^{1/256}`` above the exact σ)."""

    def _sigma(self, hw: HeadWeights) -> torch.Tensor:
        if self.per_layer:
            return schatten.per_layer_sigma(hw.a_q, hw.a_k).reshape(1)
        return schatten.per_head_sigma(hw.a_q, hw.a_k)


class PowerSigma(ExactSigma):
    """σ by warm power iteration (a lower bound), floored by the exact value at cold start."""

    def specs(self):
        d_q, d_k = self.term.q.model_dim, self.term.k.model_dim
        return super().specs() + [StateSpec(self.name("u"), (self.n_scale, d_q), warm=True),
                                  StateSpec(self.name("v"), (self.n_scale, d_k), warm=True),
                                  StateSpec(self.name("floor"), (self.n_scale,))]

    def _step(self, hw, state, iters: int) -> torch.Tensor:
        step = spectral.per_layer_power_step if self.per_layer else spectral.per_head_power_step
        return step(hw.a_q, hw.a_k, state[self.name("u")], state[self.name("v")],
                    iters).reshape(-1)

    def bound(self, hw, state):
        floor = state[self.name("floor")]
        sigma = torch.maximum(self._step(hw, state, self.iters).double(), floor.double())
        floor.zero_()  # the exact floor holds for the cold-start step only
        state[self.name("sigma")].copy_(sigma)    # an estimate, not a bound: not rounded up
        return logit_bounds.sigma_bound(self.term, hw, sigma, self.softmax_scale)

    def cold_start(self, hw, state, generator=None):
        u, v = state[self.name("u")], state[self.name("v")]
        u0, v0 = spectral.init_power_state(u.shape[0], u.shape[1], v.shape[1],
                                           generator=generator)
        u.copy_(u0)
        v.copy_(v0)
        exact = self._sigma(hw)
        used = _converge(lambda: self._step(hw, state, 1), exact, self.cold_iters)
        state[self.name("floor")].copy_(exact)
        return used


class ExactNormProduct(Estimator):
    """RoPE, certified: ``‖A_q,h‖‖A_k,g(h)‖`` (exact per-head spectral norms) every step."""

    reports = "norm_product"

    def _bound(self, nq: torch.Tensor, nk: torch.Tensor, hw, state) -> torch.Tensor:
        group = nq.shape[0] // nk.shape[0]
        state[self.name("norm_product")].copy_(round_up_f32(nq * nk.repeat_interleave(group)))
        return logit_bounds.norm_product_bound(self.term, hw, nq, nk, self.softmax_scale)

    def _norms(self, a: torch.Tensor, envelope) -> torch.Tensor:
        return head_norms(a, envelope)

    def bound(self, hw, state):
        return self._bound(self._norms(hw.a_q, hw.cast_q), self._norms(hw.a_k, hw.cast_k), hw,
                           state)


def _schatten_norms(a: torch.Tensor, envelope) -> torch.Tensor:
    """Upper bounds of ``‖A_h‖₂``: a low-precision projection's envelope's own (exact)
    norms, else the Schatten bound (``schatten.head_norms``: matmuls only)."""
    if envelope is not None and envelope.a_norms is not None:
        return envelope.a_norms
    return schatten.head_norms(a)


class SchattenNormProduct(ExactNormProduct):
    """RoPE, certified: Schatten upper bounds of ``‖A_q,h‖`` and ``‖A_k,g(h)‖`` every step
    (``_schatten_norms``)."""

    def _norms(self, a, envelope):
        return _schatten_norms(a, envelope)


class PowerNormProduct(ExactNormProduct):
    """RoPE: per-head ``‖A‖`` by warm power iteration, floored by the exact value at cold start."""

    def specs(self):
        n_q, n_kv, d_h = self.term.q.n_heads, self.term.k.n_heads, self.term.q.head_dim
        return super().specs() + [StateSpec(self.name("w_q"), (n_q, d_h), warm=True),
                                  StateSpec(self.name("w_k"), (n_kv, d_h), warm=True),
                                  StateSpec(self.name("floor_q"), (n_q,)),
                                  StateSpec(self.name("floor_k"), (n_kv,))]

    def bound(self, hw, state):
        norms = []
        for side, a in (("q", hw.a_q), ("k", hw.a_k)):
            floor = state[self.name(f"floor_{side}")]
            est = spectral.head_norm_power_step(a, state[self.name(f"w_{side}")], self.iters)
            norms.append(torch.maximum(est.double(), floor.double()))
            floor.zero_()
        return self._bound(norms[0], norms[1], hw, state)

    def cold_start(self, hw, state, generator=None):
        used = 0
        for side, a in (("q", hw.a_q), ("k", hw.a_k)):
            w = state[self.name(f"w_{side}")]
            w.copy_(torch.nn.functional.normalize(torch.randn(w.shape, generator=generator),
                                                  dim=-1))
            exact = spectral.head_spectral_norms(a)
            used += _converge(lambda: spectral.head_norm_power_step(a, w), exact,
                              self.cold_iters)
            state[self.name(f"floor_{side}")].copy_(exact)
        return used


class ExactObservedKeys(ExactNormProduct):
    """Keys from a cache: ``s·m·(ρ_q‖A_q,h‖ + ‖c_q,h‖)·max_j‖k_g(h),j‖`` with the keys' actual
    norms (computed in the graph every step: O(cache), as one decode step's ``q·Kᵀ``) and
    the query side's exact spectral norms. The query factor is kept (``query_factor``, per
    query head), so a step with unchanged weights costs the key norms only.

    Incremental keys (``Side.incremental``: the cache is only moved, ``analysis.forms.cached_keys``):
    only this call's new keys are measured, and ``key_norm_max`` (per key head) carries the
    maximum over everything written before — O(new tokens) per step. The runtime trusts it
    only for cache tensors the graph wrote itself, and re-measures any other cache on the
    host first (``geoscale_fx.runtime.key_norm_trust``)."""

    #: the running per-key-head maximum of the cached keys' norms (incremental keys)
    RUNNING = "key_norm_max"
    #: the query factor is kept for ``reuse`` (from the weights, refreshed on the host)
    KEEPS_QUERY_FACTOR = True

    def specs(self):
        specs = [StateSpec(self.name(self.reports), (self.n_scale,))]
        if self.KEEPS_QUERY_FACTOR:
            specs.append(StateSpec(self.name("query_factor"), (self.term.q.n_heads,)))
        if self.term.k.incremental:
            specs.append(StateSpec(self.name(self.RUNNING), (self.term.k.n_heads,)))
        return specs

    @property
    def running_state(self) -> str | None:
        """The state name of the running key-norm maximum (None: whole keys every step)."""
        return self.name(self.RUNNING) if self.term.k.incremental else None

    def _key_norms(self, measured: torch.Tensor, state) -> torch.Tensor:
        """``max_j ‖k_g,j‖`` per key head g: the measured keys, with the running maximum of
        the earlier ones for incremental keys (and the maximum kept)."""
        if not self.term.k.incremental:
            return measured
        running = state[self.name(self.RUNNING)]
        norms = torch.maximum(running, measured.to(running))
        running.copy_(norms)
        return norms

    def _query_factor(self, nq, hw) -> torch.Tensor:
        cq = (torch.zeros_like(nq) if hw.c_q is None
              else torch.linalg.vector_norm(hw.c_q.double(), dim=-1))
        if hw.cast_q is not None:     # a low-precision query projection's ball around c
            cq = cq + hw.cast_q.deviation
        return (abs(self.softmax_scale) * self.term.operand_scale
                * (hw.radii(self.term)[0] * nq.double() + cq))

    def _with_keys(self, query_factor, nk, state) -> torch.Tensor:
        group = query_factor.shape[0] // nk.shape[0]
        bound = query_factor * nk.double().repeat_interleave(group)
        if self.per_layer:
            bound = bound.amax().reshape(1)
        state[self.name("norm_product")].copy_(round_up_f32(bound / abs(self.softmax_scale)))
        return bound

    def _query_norms(self, hw, state) -> torch.Tensor:
        return head_norms(hw.a_q, hw.cast_q)

    def bound(self, hw, state):
        factor = self._query_factor(self._query_norms(hw, state), hw)
        if self.KEEPS_QUERY_FACTOR:
            state[self.name("query_factor")].copy_(round_up_f32(factor))
        return self._with_keys(factor, self._key_norms(hw.a_k.detach().reshape(-1), state),
                               state)

    def full_step(self, hw, state):
        return self.bound(hw, state)

    def refresh(self, hw, state):
        """The query factor only: the keys are values, measured in the graph by ``reuse``."""
        state[self.name("query_factor")].copy_(
            round_up_f32(self._query_factor(self._query_norms(hw, state), hw)))

    def reuse(self, values, state):
        keys, _ = head_weights.observed_heads(self.term.k, values.__getitem__)
        return self._with_keys(state[self.name("query_factor")].double(),
                               self._key_norms(keys.reshape(-1), state), state)


class SchattenObservedKeys(ExactObservedKeys):
    """As ``ExactObservedKeys``, the query side's norms bounded by their Schatten norms."""

    def _query_norms(self, hw, state):
        return _schatten_norms(hw.a_q, hw.cast_q)


class PowerObservedKeys(ExactObservedKeys):
    """As ``ExactObservedKeys``, the query side's norms by warm power iteration (the same
    state names as ``PowerNormProduct``'s query side, so prefill and decode share it)."""

    def specs(self):
        n_q, d_h = self.term.q.n_heads, self.term.q.head_dim
        return super().specs() + [StateSpec(self.name("w_q"), (n_q, d_h), warm=True),
                                  StateSpec(self.name("floor_q"), (n_q,))]

    def _query_norms(self, hw, state):
        floor = state[self.name("floor_q")]
        est = spectral.head_norm_power_step(hw.a_q, state[self.name("w_q")], self.iters)
        norms = torch.maximum(est.double(), floor.double())
        floor.zero_()
        return norms

    def cold_start(self, hw, state, generator=None):
        w = state[self.name("w_q")]
        w.copy_(torch.nn.functional.normalize(torch.randn(w.shape, generator=generator), dim=-1))
        exact = spectral.head_spectral_norms(hw.a_q)
        state[self.name("floor_q")].copy_(exact)
        return _converge(lambda: spectral.head_norm_power_step(hw.a_q, w), exact,
                         self.cold_iters)


class MeasuredOperands(ExactObservedKeys):
    """Both sides observed (``analysis.forms.measured_sites``: the weights cannot bound q or k):
    ``s·max_i‖q_h,i‖·max_j‖k_g(h),j‖``, both norms measured in the graph at every call
    (``head_weights.observed_heads``). Nothing depends on the weights alone: no host refresh,
    no cold start, and ``reuse`` measures again: no query factor is kept."""

    KEEPS_QUERY_FACTOR = False

    def refresh(self, hw, state):
        pass

    def cold_start(self, hw, state, generator=None):
        return 0

    def reuse(self, values, state):
        return self.bound(head_weights.term_head_weights(self.term, values.__getitem__), state)


def make_estimator(term: Term, index: int, softmax_scale: float, *, granularity: str,
                   estimator: str, rope_bound: str, power_iters: int = 1,
                   cold_start_iters: int = 5) -> Estimator:
    """The estimator of term ``index`` for these options (the only place this is decided).

    RoPE terms with the certified ``"norm_product"`` bound bound ‖A_q‖‖A_k‖ per head; every
    other term (and every term per layer) bounds σ. ``estimator`` picks the route
    (``ROUTES``: "schatten", "exact" or "power").
    """
    if estimator not in ROUTES:
        raise ValueError(f"estimator must be one of {tuple(ROUTES)}, got {estimator!r}")
    prefix = "" if index == 0 else f"t{index}_"
    observed_keys, norm_product, sigma = ROUTES[estimator]
    kwargs = dict(iters=power_iters, cold_iters=cold_start_iters)
    if term.q.observed:
        return MeasuredOperands(term, prefix, softmax_scale, per_layer=granularity == "layer",
                                **kwargs)
    if term.k.observed:
        return observed_keys(term, prefix, softmax_scale, per_layer=granularity == "layer",
                             **kwargs)
    if term.rope and rope_bound == "norm_product" and granularity == "head":
        return norm_product(term, prefix, softmax_scale, **kwargs)
    return sigma(term, prefix, softmax_scale, per_layer=granularity == "layer", **kwargs)


#: estimator option → its classes for (keys from a cache, the RoPE norm product, σ)
ROUTES = {
    "schatten": (SchattenObservedKeys, SchattenNormProduct, SchattenSigma),
    "exact": (ExactObservedKeys, ExactNormProduct, ExactSigma),
    "power": (PowerObservedKeys, PowerNormProduct, PowerSigma),
}
