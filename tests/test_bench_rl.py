"""Scenario 14 (RL rollouts with an FP8 KV cache) on a tiny byte-level Llama: its measures
against direct computations, the engine's scales under the policy's names, and a two-step
run of the scenario through TRL's GRPO."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from bench.lms import BenchLM  # noqa: E402
from bench.runner import Context  # noqa: E402
from bench.scenarios import rl  # noqa: E402

import geoscale_fx  # noqa: E402


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=256, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_mismatch_is_the_log_prob_gap_and_kl_per_token():
    gen = torch.Generator().manual_seed(0)
    trainer, rollout = torch.randn(5, 3, 11, generator=gen), torch.randn(5, 3, 11, generator=gen)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    delta, kl = rl.mismatch(trainer, rollout, tokens)
    lt, lr = F.log_softmax(trainer.double(), -1), F.log_softmax(rollout.double(), -1)
    expected = [abs(float(lt[s, b, tokens[b, s]] - lr[s, b, tokens[b, s]]))
                for s in range(5) for b in range(3)]
    assert delta == pytest.approx(sum(expected) / len(expected), rel=1e-12)
    assert kl == pytest.approx(float(F.kl_div(lr, lt, log_target=True,
                                              reduction="sum")) / 15, rel=1e-9)
    assert rl.mismatch(trainer, trainer, tokens) == (0.0, 0.0)


def test_engine_takes_the_scales_under_the_policys_names():
    policy, engine = _llama(), _llama()
    geoscale_fx.apply_(policy, kv_cache="fp8", compiler="aot_eager")
    scales = geoscale_fx.attention_scales(policy, torch.arange(1, 9).reshape(1, 8))
    layers = rl.engine_layer_scales(engine, scales)
    assert [float(s.scales("e4m3")[0]) for s in layers] == [
        float(scales[f"model.layers.{i}.self_attn.k_scale"]) for i in range(2)]
    foreign = {f"__self__.{k}": v for k, v in scales.items()}
    with pytest.raises(AttributeError):
        rl.engine_layer_scales(engine, foreign)


def test_two_grpo_steps_report_every_source(tmp_path):
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
    assert [r["source"] for r in result.rows] == list(rl.SOURCES)
    per_step = result.data["per_step"]
    assert [s["step"] for s in per_step] == [1, 2]
    assert all(s["geoscale"]["saturated"] == 0 for s in per_step)
    assert all(s["no FP8"]["dlogp"] < 1e-4 < s["unit (1.0)"]["dlogp"] for s in per_step)
    assert per_step[-1]["k/v projection change"] > 0
    assert (tmp_path / "rl_rollouts.png").exists()
