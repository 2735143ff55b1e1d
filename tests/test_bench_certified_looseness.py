"""bench/certified_looseness.py on one fine-tuning step of the zoo's GPT-2: the default
bounds are never below the exact σ and norms, and at most d_h^(1/256) above them."""
from __future__ import annotations

import pytest

from bench import certified_looseness

pytestmark = [pytest.mark.zoo, pytest.mark.slow]


def test_one_step_of_the_zoo_gpt2_is_covered_and_tight():
    pytest.importorskip("transformers")
    rows = certified_looseness.measure("gpt2", steps=1, lr=3e-4)
    assert {(r["weights"], r["bound of"]) for r in rows} == {
        (w, b) for w in ("random", "fine-tuned, 1 steps") for b in ("σ", "‖A‖ (RoPE norm product)")}
    for row in rows:
        assert row["below exact"] == 0
        assert 0 <= row["excess median"] <= row["excess worst"] <= 32 ** (1 / 256) - 1
    slack = next(r for r in rows if r["weights"] != "random" and r["bound of"] == "σ")
    assert slack["Weyl slack / step (median, worst)"].endswith("%")
