"""bench.rl_sources and bench.lms.scale_keys: the field's calibration statistics against
torch.quantile and hand-made caches; keys scaled with the logits bit for bit the same."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.scenarios import rl_sources  # noqa: E402
from bench.lms import scale_keys  # noqa: E402


def _scale(layer, role: str) -> float:
    return float(layer.scales("e4m3")[0 if role == "k" else 1][0])


@pytest.mark.parametrize("n", [1, 2, 1001, 4097])
def test_quantile_is_torch_quantile(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).double()
    for q in (0.0, 0.5, 0.999, 1.0):
        assert float(rl_sources.quantile(x.reshape(1, -1), q)) == pytest.approx(
            float(torch.quantile(x, q)), rel=1e-12, abs=1e-15)


def test_percentile_and_max_abs_scales_per_layer_and_role():
    keys = torch.arange(1, 1001, dtype=torch.float32).reshape(1, 1, 1000, 1)   # |k| = 1..1000
    values = -torch.full((1, 1, 10, 1), 3.0)
    kv = [(keys, values), (keys * 2, values * 2)]
    pct, mx = rl_sources.percentile_scales(kv), rl_sources.max_abs_scales(kv)
    p999 = 1 + 0.999 * 999                                   # torch.quantile of 1..1000
    for i, factor in enumerate((1, 2)):
        assert _scale(pct[i], "k") * 448 == pytest.approx(factor * p999 * 1.05, rel=1e-6)
        assert _scale(pct[i], "v") * 448 == pytest.approx(factor * 3 * 1.05, rel=1e-6)
        assert _scale(mx[i], "k") * 448 == pytest.approx(factor * 1000, rel=1e-6)
        assert _scale(mx[i], "v") * 448 == pytest.approx(factor * 3, rel=1e-6)
    assert [_scale(s, r) for s in rl_sources.unit_scales(2) for r in "kv"] == [1.0] * 4


def test_the_percentile_clips_a_rare_outlier_that_max_abs_keeps():
    keys = torch.ones(1, 1, 2000, 1)
    keys[0, 0, 500, 0] = -1000.0                      # one entry in two thousand
    kv = [(keys, keys)]
    assert _scale(rl_sources.percentile_scales(kv)[0], "k") * 448 == pytest.approx(1.05)
    assert _scale(rl_sources.max_abs_scales(kv)[0], "k") * 448 == pytest.approx(1000)


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64,
                                     n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=64, attention_bias=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_scale_keys_keeps_the_logits_and_multiplies_the_cached_keys(build):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    model, scaled = build(), scale_keys(build(), 256.0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, scaled(ids).logits)
    before, after = rl_sources.observed_kv(model, ids), rl_sources.observed_kv(scaled, ids)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k1, k0 * 256) and torch.equal(v1, v0)
    with pytest.raises(ValueError, match="no attention"):
        scale_keys(torch.nn.Linear(2, 2), 2.0)
