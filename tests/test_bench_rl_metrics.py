"""bench.rl_metrics: log-ratios of sampled tokens and their per-token and per-sequence tails,
against log-softmax picked by hand and statistics counted in plain Python."""
from __future__ import annotations

import math

import pytest
import torch

from bench import rl_metrics


def test_token_log_ratios_are_the_sampled_tokens_log_prob_gaps():
    gen = torch.Generator().manual_seed(0)
    trainer, rollout = torch.randn(3, 5, 11, generator=gen), torch.randn(3, 5, 11, generator=gen)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    delta = rl_metrics.token_log_ratios(trainer, rollout, tokens)
    assert delta.shape == (3, 5) and delta.dtype == torch.float64
    for b in range(3):
        for t in range(5):
            lt = trainer[b, t].double() - torch.logsumexp(trainer[b, t].double(), 0)
            lr = rollout[b, t].double() - torch.logsumexp(rollout[b, t].double(), 0)
            assert float(delta[b, t]) == pytest.approx(float(lt[tokens[b, t]] - lr[tokens[b, t]]),
                                                       abs=1e-12)
    assert float(rl_metrics.token_log_ratios(trainer, trainer, tokens).abs().max()) == 0.0


def test_tails_count_what_truncation_masking_and_rejection_would_act_on():
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.4,
              torch.randn(2, 6, generator=gen, dtype=torch.float64) * 0.001]
    tails = rl_metrics.log_ratio_tails(deltas)
    tokens = [float(x) for d in deltas for x in d.reshape(-1)]
    sums = [float(row.sum()) for d in deltas for row in d]
    means = [s / 6 for s in sums]
    assert tails["mean"] == pytest.approx(sum(abs(x) for x in tokens) / len(tokens), rel=1e-12)
    assert tails["max"] == max(abs(x) for x in tokens)
    assert tails["seq max"] == pytest.approx(max(abs(s) for s in sums), rel=1e-12)
    ranked = sorted(abs(x) for x in tokens)
    position = 0.999 * (len(ranked) - 1)
    low = ranked[math.floor(position)]
    expected = low + (position - math.floor(position)) * (ranked[math.ceil(position)] - low)
    assert tails["p99.9"] == pytest.approx(expected, rel=1e-12)
    assert tails["tokens w > 2"] == sum(math.exp(x) > 2 for x in tokens) / len(tokens)
    assert tails["seqs w outside [1/2, 2]"] == sum(
        not 0.5 <= math.exp(s) <= 2 for s in sums) / len(sums)
    assert tails["seqs outside geometric band"] == sum(
        not 0.999 <= math.exp(m) <= 1.001 for m in means) / len(means)
    assert 0 < tails["tokens w > 2"] and 0 < tails["seqs outside geometric band"] < 1


def test_no_mismatch_has_empty_tails():
    tails = rl_metrics.log_ratio_tails([torch.zeros(3, 4, dtype=torch.float64)])
    assert all(value == 0.0 for value in tails.values())
