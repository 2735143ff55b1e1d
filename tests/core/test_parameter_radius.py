"""``value_radius``: the radius of a source bounded by value, against float64 references."""
from __future__ import annotations

import doctest
import math

import pytest
import torch

from geoscale_fx.core import parameter_radius as value_radius
from geoscale_fx.core.parameter_radius import FORMS, evaluate_radius, radius_nodes


def _max_row_norm(table: torch.Tensor) -> float:
    """Largest row norm by an explicit loop over rows, in Python floats."""
    best = 0.0
    for row in table.double().reshape(-1, table.shape[-1]).tolist():
        best = max(best, math.sqrt(sum(v * v for v in row)))
    return best


def _forms(expr) -> set:
    subs = [e for e in expr[1:] if isinstance(e, tuple) and e and e[0] in FORMS]
    return {expr[0]}.union(*(_forms(e) for e in subs))


@pytest.fixture
def values():
    gen = torch.Generator().manual_seed(0)
    return {
        "tok": torch.randn(50, 16, generator=gen),
        "pos": torch.randn(3, 8, 16, generator=gen),        # any leading dims: token vectors
        "gain": 1.0 + torch.rand(16, generator=gen),
        "beta": torch.randn(16, generator=gen),
        "proj": torch.randn(24, 16, generator=gen),          # (F, d), as nn.Linear stores it
        "bias": torch.randn(24, generator=gen),
        "scalar": torch.tensor([0.5]),
    }


def test_each_form_matches_an_independent_float64_reference(values):
    resolve = values.__getitem__
    tok, pos = _max_row_norm(values["tok"]), _max_row_norm(values["pos"])
    sigma = float(torch.linalg.svdvals(values["proj"].double())[0])
    gain_max = float(values["gain"].double().abs().max())
    beta = float(torch.linalg.vector_norm(values["beta"].double()))
    bias = float(torch.linalg.vector_norm(values["bias"].double()))
    norm = ("norm", 2.0 * math.sqrt(16), 16, (("mul", "gain"), ("add", "beta"), ("mul", 3.0),
                                               ("add", -0.25)))
    norm_ref = (2.0 * 4.0 * gain_max + beta) * 3.0 + 0.25 * 4.0
    cases = {
        ("rows", "tok", 16): tok,
        ("rows", "scalar", 16): 0.5 * 4.0,               # width 1 broadcast over 16 features
        ("const", -2.0): 2.0,
        ("sum", ("rows", "tok", 16), ("rows", "pos", 16)): tok + pos,
        ("scale", ("rows", "tok", 16), -1 / 0.9): tok / 0.9,
        ("gain", ("rows", "tok", 16), "gain"): gain_max * tok,
        ("sum", ("linear", ("rows", "tok", 16), "proj"), ("rows", "bias", 24)): sigma * tok + bias,
        ("cat", ("rows", "tok", 16), ("rows", "pos", 16)): math.sqrt(tok ** 2 + pos ** 2),
        ("max", ("rows", "tok", 16), ("rows", "pos", 16)): max(tok, pos),
        norm: norm_ref,
    }
    assert set().union(*(_forms(expr) for expr in cases)) == set(FORMS)
    for expr, expected in cases.items():
        got = evaluate_radius(expr, resolve)
        assert got.dtype == torch.float64 and got.dim() == 0
        assert float(got) == pytest.approx(expected, rel=1e-12), expr


def test_the_radius_bounds_every_vector_it_describes(values):
    """Sampled vectors of each described set: none exceeds the evaluated radius."""
    resolve = values.__getitem__
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (1000,), generator=gen)
    pos_rows = values["pos"].reshape(-1, 16)
    x = values["tok"][ids] + pos_rows[torch.randint(0, 24, (1000,), generator=gen)]
    y = torch.nn.functional.linear(x / 0.9, values["proj"], values["bias"])
    expr = ("sum", ("linear", ("scale", ("sum", ("rows", "tok", 16), ("rows", "pos", 16)),
                               1 / 0.9), "proj"), ("rows", "bias", 24))
    radius = float(evaluate_radius(expr, resolve))
    norms = torch.linalg.vector_norm(y.double(), dim=-1)
    assert float(norms.max()) <= radius
    assert float(norms.max()) > 0.2 * radius              # and it is not vacuous


def test_the_radius_is_detached_and_follows_the_values(values):
    table = values["tok"].clone().requires_grad_(True)
    resolve = {"tok": table}.__getitem__
    first = evaluate_radius(("rows", "tok", 16), resolve)
    assert not first.requires_grad
    with torch.no_grad():
        table.mul_(4.0)
    assert float(evaluate_radius(("rows", "tok", 16), resolve)) == pytest.approx(4 * float(first))


def test_radius_nodes_lists_every_name_once_in_order():
    expr = ("sum", ("linear", ("norm", 4.0, 16, (("mul", "g"), ("add", 1.0))), "w"),
            ("rows", "b", 24), ("gain", ("rows", "tok", 16), "g"), ("const", 1.0))
    assert radius_nodes(expr) == ("g", "w", "b", "tok")
    with pytest.raises(ValueError, match="unknown radius expression form"):
        evaluate_radius(("made-up", 1.0), {}.__getitem__)


def test_the_module_example_runs():
    assert doctest.testmod(value_radius).failed == 0
