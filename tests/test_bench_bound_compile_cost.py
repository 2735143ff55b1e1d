"""bench.bound_compile_cost on two blocks of the zoo's GPT-2 shape, one round."""
import math

import pytest

pytest.importorskip("transformers")

from bench import bound_compile_cost  # noqa: E402


@pytest.mark.slow
def test_one_round_times_each_program_and_the_bound_alone_per_site():
    rows = bound_compile_cost.run(("gpt2",), layers=2, rounds=1)
    assert [r["program"] for r in rows] == ["none", "delayed", "geometry", "bound alone"]
    assert all(r["family"] == "gpt2" and r["sites"] == 2 for r in rows)   # one a block
    assert all(math.isfinite(r["compile s"]) and r["compile s"] > 0 for r in rows)
    assert rows[0]["ratio to none"] == 1.0
    assert [r["bound nodes"] is None for r in rows] == [True, True, True, False]
    # two sites' scale programs: ~260 ATen nodes each on torch 2.13
    assert 2 * 100 < rows[-1]["bound nodes"] < 2 * 1000
