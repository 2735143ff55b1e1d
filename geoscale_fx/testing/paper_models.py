"""The four architectures of the paper and the numbers it prints for them.

Shapes come from Table 10 (Appendix F); ``printed_*`` are Tables 2 and 3 as printed, kept so
that reports can show the paper next to what the formulas give. The paper's γ for
Llama-2-13B (2.28) and Llama-2-70B (2.32) do not solve its own Eq. (7); the formula gives
2.270 and 2.302 (the improvement and α_min columns agree with the formula either way).
"""
from __future__ import annotations

from dataclasses import dataclass

from geoscale_fx.core import bounds

__all__ = ["PaperModel", "PAPER_MODELS", "PAPER_SEQ_LEN", "PAPER_DELTA", "calibration_row"]

#: Sequence length and target failure probability of the paper's Tables 2-3.
PAPER_SEQ_LEN = 1024
PAPER_DELTA = 1e-6


@dataclass(frozen=True)
class PaperModel:
    name: str
    model_dim: int
    head_dim: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    printed_gamma: float
    printed_improvement: int
    printed_alpha_min: float

    @property
    def n_heads_total(self) -> int:
        """``N = n_layers × n_q_heads``, the number of heads in the union bound."""
        return self.n_layers * self.n_q_heads


PAPER_MODELS = (
    PaperModel("GPT-2 XL", 1600, 64, 48, 25, 25, 2.98, 8, 0.074),
    PaperModel("Mistral-7B", 4096, 128, 32, 32, 8, 2.26, 14, 0.035),
    PaperModel("Llama-2-13B", 5120, 128, 40, 40, 40, 2.28, 18, 0.028),
    PaperModel("Llama-2-70B", 8192, 128, 80, 64, 8, 2.32, 28, 0.018),
)


def calibration_row(name: str, model_dim: int, head_dim: int, n_heads_total: int,
                    seq_len: int = PAPER_SEQ_LEN, delta: float = PAPER_DELTA) -> dict:
    """γ, rank-aware improvement and α_min for one architecture, as a table row."""
    gamma = bounds.select_gamma(head_dim, n_heads_total, seq_len, delta)
    alpha = bounds.alpha_min(model_dim, head_dim, n_heads_total, seq_len, delta)
    return {
        "model": name,
        "d": model_dim,
        "d_h": head_dim,
        "N": n_heads_total,
        "L": seq_len,
        "delta": delta,
        "gamma": gamma,
        "improvement": bounds.rank_aware_improvement(model_dim, head_dim, gamma),
        "alpha_min": alpha,
        "overflow_prob_bound": bounds.overflow_probability_bound(
            alpha, model_dim, head_dim, n_heads_total, seq_len, gamma=gamma),
    }
