"""bench.scenarios.batched_fp8_cache against geoscale's FP8 cache, one source at a time: the
same logits per group, the same entries clamped, the same range used."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.scenarios import rl_sources  # noqa: E402
from bench.scenarios.batched_fp8_cache import batched_fp8_cache, range_used  # noqa: E402
from bench.scenarios.kv_cache import _cache, _utilization  # noqa: E402
from geoscale_fx.kv_cache.manager import cache_argument  # noqa: E402


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_each_group_is_what_geoscales_fp8_cache_gives_its_scales():
    model = _llama()
    tokens = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    kv = rl_sources.observed_kv(model, tokens)
    groups = [rl_sources.max_abs_scales(kv), rl_sources.percentile_scales(kv, q=0.9),
              rl_sources.unit_scales(2)]
    cache = batched_fp8_cache(model.config, groups, rows=3)
    with torch.no_grad():
        batched = model(tokens.repeat(3, 1), use_cache=True,
                        **{cache_argument(): cache}).logits.split(3)
    used = range_used(cache)
    for g, scales in enumerate(groups):
        single, counters = _cache(model, scales)
        with torch.no_grad():
            alone = model(tokens, use_cache=True, **{cache_argument(): single}).logits
        assert float((batched[g] - alone).abs().max()) <= 1e-5 * float(alone.abs().max())
        assert cache.saturated[g].tolist() == torch.stack(counters).sum(0).tolist()
        assert float(used[g]) == pytest.approx(_utilization(single, scales), rel=1e-6)
    # max-abs puts each layer's largest entries on 448 exactly; the 90th percentile clips
    assert cache.saturated[1].sum() > 10 * cache.saturated[0].sum() > 0
    with torch.no_grad():
        plain = model(tokens).logits
    assert float((batched[2] - plain).abs().max()) > 0                 # FP8 is in the path


def test_groups_need_one_per_tensor_scale_per_layer():
    config = _llama().config
    with pytest.raises(ValueError, match="every group needs 2"):
        batched_fp8_cache(config, [rl_sources.unit_scales(1)], rows=1)
