"""bench/quality.py against hand-computed and independently computed references."""
import math

import pytest
import torch

from bench.quality import Spread, first_divergence, logit_metrics, spread


def _kl_by_hand(ref_rows, rows) -> float:
    """KL(softmax(ref) ‖ softmax(row)) per row, averaged: Python floats, no torch."""
    total = 0.0
    for r, x in zip(ref_rows, rows):
        zr = sum(math.exp(v) for v in r)
        zx = sum(math.exp(v) for v in x)
        total += sum(math.exp(a) / zr * math.log((math.exp(a) / zr) / (math.exp(b) / zx))
                     for a, b in zip(r, x))
    return total / len(ref_rows)


def test_identical_logits_give_zero_error_zero_kl_full_agreement():
    ref = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    assert logit_metrics(ref, ref.clone()) == {"rel_l2": 0.0, "kl": 0.0, "top1": 1.0}


def test_metrics_match_a_float64_computation_by_hand():
    ref = [[2.0, 0.0, -1.0, 0.5], [0.1, 0.2, 0.3, -3.0], [1.0, 1.5, -0.5, 0.0]]
    out = [[1.5, 0.3, -1.0, 0.4], [0.4, 0.1, 0.2, -2.0], [1.0, 1.5, -0.5, 0.0]]
    got = logit_metrics(torch.tensor(ref, dtype=torch.float64),
                        torch.tensor(out, dtype=torch.float64))
    diff = math.sqrt(sum((a - b) ** 2 for r, x in zip(ref, out) for a, b in zip(r, x)))
    norm = math.sqrt(sum(a * a for r in ref for a in r))
    assert got["rel_l2"] == pytest.approx(diff / norm, rel=1e-12)
    assert got["kl"] == pytest.approx(_kl_by_hand(ref, out), rel=1e-10)
    # argmax: row 0 both 0; row 1 ref 2, out 0 (a flip); row 2 identical
    assert got["top1"] == pytest.approx(2 / 3)


def test_kl_is_reference_to_method_not_the_reverse():
    ref, out = [[3.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]]
    got = logit_metrics(torch.tensor(ref), torch.tensor(out))["kl"]
    assert got == pytest.approx(_kl_by_hand(ref, out), rel=1e-6)
    assert abs(got - _kl_by_hand(out, ref)) > 0.1


def test_kl_and_agreement_ignore_a_constant_shift_of_the_logits():
    ref = torch.randn(4, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shifted = ref + torch.tensor([[1e4], [-3.0], [0.0], [250.0]], dtype=torch.float64)
    got = logit_metrics(ref, shifted)
    assert got["kl"] == pytest.approx(0.0, abs=1e-9) and got["top1"] == 1.0
    assert got["rel_l2"] > 1


def test_float32_inputs_are_measured_in_float64():
    ref = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float32)
    out = ref + torch.tensor([[0.0, 1e-4, 0.0]])
    got = logit_metrics(ref, out)
    assert got["kl"] > 0
    assert got["kl"] == pytest.approx(_kl_by_hand(ref.tolist(), out.double().tolist()),
                                      rel=1e-3)


def test_edge_cases_zero_probability_zero_reference_and_bad_shapes():
    inf = float("inf")
    ref = torch.tensor([[0.0, -inf, 1.0]])
    # a token the reference never picks adds nothing; one it may pick and L never does: inf
    zr, zx = 1 + math.e, 1 + math.exp(5) + math.e
    by_hand = (1 / zr) * math.log((1 / zr) / (1 / zx)) + (math.e / zr) * math.log(
        (math.e / zr) / (math.e / zx))
    assert logit_metrics(ref, torch.tensor([[0.0, 5.0, 1.0]]))["kl"] == pytest.approx(
        by_hand, rel=1e-6)
    assert logit_metrics(ref, torch.tensor([[-inf, 0.0, 1.0]]))["kl"] == inf
    zero = torch.zeros(2, 3)
    assert logit_metrics(zero, zero)["rel_l2"] == 0.0
    assert logit_metrics(zero, torch.ones(2, 3))["rel_l2"] == inf
    with pytest.raises(ValueError, match="shape"):
        logit_metrics(torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="at least one"):
        logit_metrics(torch.zeros(0, 3), torch.zeros(0, 3))


def test_first_divergence_finds_a_single_flip_and_none_when_identical():
    a = torch.arange(10)
    for index in (0, 4, 9):
        b = a.clone()
        b[index] = 99
        assert first_divergence(a, b) == index
    b = a.clone()
    b[3], b[7] = -1, -1
    assert first_divergence(a, b) == 3
    assert first_divergence(a, a.clone()) is None
    with pytest.raises(ValueError, match=r"\(T,\)"):
        first_divergence(a.reshape(2, 5), a.reshape(2, 5))
    with pytest.raises(ValueError):
        first_divergence(a, a[:5])


def test_spread_median_range_and_nones_ranked_last():
    assert spread([0.3, 0.1, 0.2]) == Spread(0.2, 0.1, 0.3, 3, 0)
    assert spread([4, 2, 8, 6]) == Spread(4, 2, 8, 4, 0)          # the lower median
    assert spread([5, None, 3]) == Spread(5, 3, None, 3, 1)
    assert spread([None, None, 7]) == Spread(None, 7, None, 3, 2)
    assert spread([None]) == Spread(None, None, None, 1, 1)
    assert str(spread([5, None, 3])) == "5 [3–—]"
    assert str(spread([0.012345, 0.5, 2e-5])) == "0.0123 [2e-05–0.5]"
    with pytest.raises(ValueError):
        spread([])
