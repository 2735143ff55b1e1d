"""Scenario 14 (RL rollouts with an FP8 KV cache) on a tiny byte-level Llama: the engine's
scales under the policy's names, one forward through the FP8 cache against a token-by-token
decode, and a two-step run of the scenario through TRL's GRPO on both models."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from bench.lms import BenchLM  # noqa: E402
from bench.runner import Context  # noqa: E402
from bench.scenarios import rl, rl_sources  # noqa: E402
from bench.scenarios.kv_cache import _cache, _teacher_forced  # noqa: E402

import geoscale_fx  # noqa: E402


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=256, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_engine_takes_the_scales_under_the_policys_names():
    policy, engine = _llama(), _llama()
    geoscale_fx.apply_(policy, kv_cache="fp8", compiler="aot_eager")
    scales = geoscale_fx.attention_scales(policy, torch.arange(1, 9).reshape(1, 8))
    layers = rl_sources.engine_layer_scales(engine, scales)
    assert [float(s.scales("e4m3")[0]) for s in layers] == [
        float(scales[f"model.layers.{i}.self_attn.k_scale"]) for i in range(2)]
    foreign = {f"__self__.{k}": v for k, v in scales.items()}
    with pytest.raises(AttributeError):
        rl_sources.engine_layer_scales(engine, foreign)


def test_one_forward_through_the_cache_reads_what_a_decode_reads():
    engine = _llama()
    tokens = torch.randint(1, 256, (3, rl.PROMPT_LEN + 10),
                           generator=torch.Generator().manual_seed(0))
    kv = rl_sources.observed_kv(engine, tokens)
    scales = rl_sources.percentile_scales(kv, q=0.99)          # some entries saturate
    once = rl.rollout_logits(engine, tokens, _cache(engine, scales)[0])
    decode_cache, decode_saturated = _cache(engine, scales)
    decoded = _teacher_forced(engine, tokens, rl.PROMPT_LEN, decode_cache).transpose(0, 1)
    assert once.shape == decoded.shape == (3, 10, 256)
    assert float((once - decoded).abs().max()) < 1e-4 * float(decoded.abs().max())
    # the same entries stored and clamped (a decode never writes the last token)
    cache, saturated = _cache(engine, scales)
    rl.rollout_logits(engine, tokens[:, :-1], cache)
    assert [int(c.sum()) for c in saturated] == [int(c.sum()) for c in decode_saturated]
    assert sum(int(c.sum()) for c in saturated) > 0
    for layer, decode_layer in zip(cache.layers, decode_cache.layers):
        assert torch.equal(layer.keys, decode_layer.keys)
    plain = rl.rollout_logits(engine, tokens, None)
    assert float((once - plain).abs().max()) > 1e-3       # the FP8 cache is in the path


def test_two_grpo_steps_report_every_source_on_both_models(tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "COMPLETION_LEN", 8)
    monkeypatch.setattr(rl, "KEY_FACTOR", 4096.0)   # random weights' keys are small
    state = _llama().state_dict()

    def build():
        model = _llama()
        model.load_state_dict(state)
        return model

    def batch(gen, size, seq, split="train"):
        ids = torch.randint(32, 127, (size, seq), generator=gen)
        return {"input_ids": ids, "labels": ids}

    lm = BenchLM("tiny-llama", build, batch)
    ctx = Context(out_dir=tmp_path, lms={"tiny-llama": lambda: lm}, models=("tiny-llama",),
                  compiler="eager", step_scale=0.25, progress=False)
    result = rl.rl_rollouts(ctx)
    big = "tiny-llama, keys ×4096"
    assert [(r["model"], r["source"]) for r in result.rows] == [
        (m, s) for m in ("tiny-llama", big) for s in (*rl.SOURCES, rl.BAND_ROW)]
    rows = {(r["model"], r["source"]): r for r in result.rows}
    low, high = map(float, rows[big, rl.BAND_ROW]["mean |Δ log p|"].split("–"))
    assert low <= rows[big, rl.SOURCES[0]]["mean |Δ log p|"] <= high and low < high
    runs = result.data["runs"]
    assert [s["sync"] for s in runs["tiny-llama"]["per_sync"]] == [1]
    for model in ("tiny-llama", big):
        for source in rl.SOURCES[:2]:       # certified, fresh or frozen: nothing clamped
            assert rows[model, source]["saturated (syncs)"] == "0 (0/1)"
        geo, none = rows[model, rl.SOURCES[0]], rows[model, "no FP8"]
        assert none["max |Δ log p|"] < 1e-4 < geo["mean |Δ log p|"]
        assert geo["7B GFLOP / sync"] < 1e-5 * rows[model, rl.SOURCES[2]]["7B GFLOP / sync"]
        last = runs[model]["per_sync"][-1]
        assert last["key drift"] > 0 and last["value drift"] > 0
        # fresh scales follow the weights; the frozen ones stay where step 0 put them
        assert last[rl.SOURCES[0]]["max k scale"] != last[rl.SOURCES[1]]["max k scale"]
    unit = rows[big, "unit (1.0)"]
    assert rows["tiny-llama", "unit (1.0)"]["saturated (syncs)"] == "0 (0/1)"
    assert unit["saturated (syncs)"] != "0 (0/1)" and unit["range used"] == 1.0
    # the same pretrained weights at step 0: certified scales ×4096 exactly, the same range
    frozen = [runs[m]["per_sync"][0][rl.SOURCES[1]] for m in ("tiny-llama", big)]
    assert frozen[1]["max k scale"] == 4096 * frozen[0]["max k scale"]
    assert (tmp_path / "rl_rollouts.png").exists()
