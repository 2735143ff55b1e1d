"""What an RL engineer reads of a rollout–trainer mismatch: log-ratios per token and per sequence.

For the tokens ``y_t`` a rollout sampled, ``Δ_t = log π_trainer(y_t) − log π_rollout(y_t)``
is the log of the importance weight ``w_t = π_trainer / π_rollout`` that off-policy
corrections act on (float64). Over every token (and sequence) of every sync:

* per token: mean, 99.9th percentile and max of ``|Δ_t|``;
* per sequence: the 99th percentile and max of ``|Σ_t Δ_t|``, the log of the sequence's
  weight;
* the share of tokens that token-level truncated IS would truncate: ``w_t > 2``
  (TIS; verl's ``rollout_is_threshold`` default 2.0, ``TIS_CAP``);
* the share of sequences that sequence-level masked IS would mask: ``Π_t w_t ∉ [1/2, 2]``
  (``SEQUENCE_BAND``);
* the share of sequences a geometric-mean rejection would drop:
  ``exp(mean_t Δ_t) ∉ [0.999, 1.001]`` (verl's ``rollout_rs="geometric"`` band of its
  recipes, ``GEOMETRIC_BAND``).

Example::

    >>> import torch
    >>> d = torch.tensor([[0.0, 0.8], [0.1, -0.1]], dtype=torch.float64)
    >>> t = log_ratio_tails([d])
    >>> t["max"], t["tokens w > 2"], t["seqs w outside [1/2, 2]"]
    (0.8, 0.25, 0.5)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["TIS_CAP", "SEQUENCE_BAND", "GEOMETRIC_BAND", "token_log_ratios",
           "log_ratio_tails"]

TIS_CAP = 2.0
SEQUENCE_BAND = (0.5, 2.0)
GEOMETRIC_BAND = (0.999, 1.001)


def token_log_ratios(trainer_logits: torch.Tensor, rollout_logits: torch.Tensor,
                     tokens: torch.Tensor) -> torch.Tensor:
    """``Δ`` ``(B, T)`` float64 for logits ``(B, T, V)`` predicting ``tokens`` ``(B, T)``."""
    index = tokens.unsqueeze(-1)
    log_t = F.log_softmax(trainer_logits.double(), dim=-1).gather(-1, index)
    log_r = F.log_softmax(rollout_logits.double(), dim=-1).gather(-1, index)
    return (log_t - log_r).squeeze(-1)


def _quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x, q)) if x.numel() > 1 else float(x.reshape(-1)[0])


def log_ratio_tails(deltas: list[torch.Tensor]) -> dict[str, float]:
    """The module docstring's statistics over ``deltas``, a list of ``(B, T)`` log-ratios
    (one per sync; sequences may differ in count but not within one tensor)."""
    tokens = torch.cat([d.reshape(-1) for d in deltas]).abs()
    sums = torch.cat([d.sum(dim=-1) for d in deltas])
    means = torch.cat([d.mean(dim=-1) for d in deltas])
    lo, hi = (math.log(b) for b in SEQUENCE_BAND)
    g_lo, g_hi = (math.log(b) for b in GEOMETRIC_BAND)
    signed = torch.cat([d.reshape(-1) for d in deltas])
    return {
        "mean": float(tokens.mean()), "p99.9": _quantile(tokens, 0.999),
        "max": float(tokens.max()),
        "seq p99": _quantile(sums.abs(), 0.99), "seq max": float(sums.abs().max()),
        "tokens w > 2": float((signed > math.log(TIS_CAP)).double().mean()),
        "seqs w outside [1/2, 2]": float(((sums < lo) | (sums > hi)).double().mean()),
        "seqs outside geometric band": float(((means < g_lo) | (means > g_hi)).double().mean()),
    }
