"""geoscale_fx.testing.paper_models: the paper's architectures and ``calibration_row``.

tests/core/test_bounds.py checks the rows against the printed Tables 2-3; here: the shapes of
Table 10, the row's own consistency (each column from its formula, in float64 by hand),
its defaults, and a refused architecture.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from geoscale_fx.testing.paper_models import (
    PAPER_DELTA, PAPER_MODELS, PAPER_SEQ_LEN, PaperModel, calibration_row,
)


def test_table10_shapes_and_head_counts():
    shapes = {m.name: (m.model_dim, m.head_dim, m.n_layers, m.n_q_heads, m.n_kv_heads,
                       m.n_heads_total) for m in PAPER_MODELS}
    assert shapes == {"GPT-2 XL": (1600, 64, 48, 25, 25, 1200),
                      "Mistral-7B": (4096, 128, 32, 32, 8, 1024),
                      "Llama-2-13B": (5120, 128, 40, 40, 40, 1600),
                      "Llama-2-70B": (8192, 128, 80, 64, 8, 5120)}
    for m in PAPER_MODELS:                      # d = heads · d_h in all four
        assert m.model_dim == m.n_q_heads * m.head_dim
    with pytest.raises(dataclasses.FrozenInstanceError):
        PAPER_MODELS[0].head_dim = 1


def test_row_columns_follow_their_formulas():
    row = calibration_row("x", 1024, 64, 96, seq_len=512, delta=1e-4)
    assert (row["model"], row["d"], row["d_h"], row["N"], row["L"], row["delta"]) == \
        ("x", 1024, 64, 96, 512, 1e-4)
    g = row["gamma"]
    # Eq. (7): γ − 1 − ln γ = (2/d_h)·ln(2 N L / δ)
    assert g - 1 - math.log(g) == pytest.approx(2 / 64 * math.log(2 * 96 * 512 / 1e-4),
                                                rel=1e-12)
    assert row["improvement"] == pytest.approx(1024 / (g * 64), rel=1e-12)
    # at α_min the union bound N(T1 + T2) is the target δ (to solver accuracy)
    assert row["overflow_prob_bound"] == pytest.approx(1e-4, rel=1e-6)
    a = row["alpha_min"]
    t1 = 512 * math.exp(-(64 / 2) * (g - 1 - math.log(g)))
    t2 = 2 * 512 ** 2 * math.exp(-(1024 ** 2) * a ** 2 / (2 * g * 64))
    assert row["overflow_prob_bound"] == pytest.approx(96 * (t1 + t2), rel=1e-12)


def test_defaults_are_the_papers_length_and_delta():
    m = PAPER_MODELS[1]
    assert (PAPER_SEQ_LEN, PAPER_DELTA) == (1024, 1e-6)
    default = calibration_row(m.name, m.model_dim, m.head_dim, m.n_heads_total)
    explicit = calibration_row(m.name, m.model_dim, m.head_dim, m.n_heads_total, 1024, 1e-6)
    assert default == explicit
    longer = calibration_row(m.name, m.model_dim, m.head_dim, m.n_heads_total, seq_len=8192)
    assert longer["alpha_min"] > default["alpha_min"]       # more positions, wider α_min


def test_invalid_architecture_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="head_dim must be smaller than model_dim"):
        calibration_row("bad", 64, 64, 4)
    with pytest.raises(ValueError, match="delta must be in"):
        calibration_row("bad", 64, 16, 4, delta=2.0)
    assert isinstance(PaperModel("y", 8, 2, 1, 4, 4, 2.0, 1, 0.1).n_heads_total, int)
