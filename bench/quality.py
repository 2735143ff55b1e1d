"""Decode quality against a reference model: teacher-forced logit metrics, greedy divergence.

Free-running greedy tokens are chaotic: after one early disagreement every later token is
conditioned on a different prefix, so "share of tokens equal to the reference" says where the
first flip happened, not how close the logits are. These metrics instead compare the logits
of both models at the same positions of one fixed token sequence (teacher forcing: both read
the reference model's own greedy tokens), and report the first flip of free-running decoding
on its own.

For reference logits R and a method's logits L, both ``(..., V)``, over N positions
(every leading index is a position) and p = softmax, all in float64:

* relative L2:       ‖L − R‖₂ / ‖R‖₂ over all positions and the vocabulary;
* KL per token:      (1/N) Σ_n Σ_v p_R(v) (log p_R(v) − log p_L(v)), i.e. KL(R ‖ L);
* top-1 agreement:   (1/N) Σ_n [argmax_v L_n = argmax_v R_n].

Example::

    >>> import torch
    >>> r = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.0, 0.0]])
    >>> logit_metrics(r, r)
    {'rel_l2': 0.0, 'kl': 0.0, 'top1': 1.0}
    >>> first_divergence(torch.tensor([4, 2, 7, 1]), torch.tensor([4, 2, 9, 1]))
    2
    >>> str(spread([3, None, 5]))
    '5 [3–—]'
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["logit_metrics", "first_divergence", "Spread", "spread"]


def logit_metrics(reference_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """``{"rel_l2", "kl", "top1"}`` of ``logits`` against ``reference_logits``, both
    ``(..., V)`` with the same shape (see the module docstring for the formulas).

    Edge cases: ‖R‖ = 0 gives a relative error of 0 if L = R too, else inf; a token to which
    R gives probability 0 adds nothing to the KL (0 · log 0 = 0), one to which R gives mass
    and L none makes it inf; per-position KL is floored at 0 (it is ≥ 0, Gibbs' inequality;
    a negative value is float64 rounding)."""
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} against reference logits of "
                         f"shape {tuple(reference_logits.shape)}")
    if reference_logits.dim() == 0 or reference_logits.numel() == 0:
        raise ValueError("logit_metrics needs at least one position of at least one logit")
    vocab = reference_logits.shape[-1]
    ref = reference_logits.detach().double().reshape(-1, vocab)       # (N, V)
    out = logits.detach().double().reshape(-1, vocab)                 # (N, V)
    ref_norm = float(torch.linalg.vector_norm(ref))
    diff_norm = float(torch.linalg.vector_norm(out - ref))
    if ref_norm > 0:
        rel = diff_norm / ref_norm
    else:
        rel = 0.0 if diff_norm == 0 else math.inf
    log_p, log_q = ref.log_softmax(dim=-1), out.log_softmax(dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    kl = terms.sum(dim=-1).clamp_min(0.0)                               # (N,)
    top1 = (out.argmax(dim=-1) == ref.argmax(dim=-1)).double()          # (N,)
    return {"rel_l2": rel, "kl": float(kl.mean()), "top1": float(top1.mean())}


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first position where the token sequences ``a`` and ``b`` (``(T,)``)
    differ; None if they are identical."""
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"first_divergence compares two (T,) sequences, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    differ = (a != b).nonzero()
    return int(differ[0, 0]) if len(differ) else None


@dataclass(frozen=True)
class Spread:
    """Median and range of values that may be None ("never happened", e.g. a sequence that
    never diverged), None ranking after every number: ``median`` is the lower median (the
    ⌈n/2⌉-th smallest value, so one of the values and defined even with Nones), ``low`` and
    ``high`` the smallest and largest; ``none`` counts the Nones among the ``n`` values."""
    median: float | None
    low: float | None
    high: float | None
    n: int
    none: int = 0

    def __str__(self) -> str:
        return f"{_fmt(self.median)} [{_fmt(self.low)}–{_fmt(self.high)}]"


def spread(values) -> Spread:
    """The Spread of ``values`` (numbers and Nones, at least one)."""
    values = list(values)
    if not values:
        raise ValueError("spread of no values")
    ranked = sorted(values, key=lambda v: (v is None, 0 if v is None else v))
    return Spread(ranked[(len(ranked) - 1) // 2], ranked[0], ranked[-1], len(ranked),
                  sum(v is None for v in ranked))


def _fmt(value) -> str:
    if value is None:
        return "—"
    return str(value) if isinstance(value, int) else f"{value:.3g}"
