"""bench/profile_step.py: the model shapes it profiles (the zoo's, or a wider one with the
head size kept), and the breakdown rows it derives from interleaved timings."""
from __future__ import annotations

import pytest

from bench import profile_step

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sorted(profile_step.SHAPES))
def test_a_wider_model_keeps_the_head_size_and_the_grouping(family):
    zoo = profile_step._config(family, 256)
    wide = profile_step._config(family, 256, width=512)
    assert wide.hidden_size == 512 and zoo.hidden_size == 128
    head = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert head(wide) == head(zoo)
    assert wide.num_attention_heads == 4 * zoo.num_attention_heads
    if family == "llama":
        assert wide.num_attention_heads // wide.num_key_value_heads == \
            zoo.num_attention_heads // zoo.num_key_value_heads
        assert wide.intermediate_size == 4 * zoo.intermediate_size


class _Timings:
    def __init__(self, ms):
        self.ms = ms

    def median_ms(self, program):
        return self.ms[program]

    def ratio(self, program):
        r = self.ms[program] / self.ms["plain"]
        return type("R", (), {"median": r, "lo": r, "hi": r})()


def test_the_breakdown_splits_the_kernels_share_from_geoscales():
    rows = profile_step.breakdown_rows("decode", _Timings(
        {"plain": 1.0, "none": 1.2, "no-fp8": 1.21, "geometry": 1.25, "current": 1.4}),
        "b1 cache 256")
    by = {r["program"]: r for r in rows}
    assert by["kernel + runtime (none - plain)"]["ratio to plain"] == pytest.approx(0.2)
    assert by["bound + FP8 (geometry - none)"]["ratio to plain"] == pytest.approx(0.05)
    assert by["bound (no-fp8 - none)"]["ratio to plain"] == pytest.approx(0.01)
    assert by["FP8 round trip (geometry - no-fp8)"]["ratio to plain"] == pytest.approx(0.04)


def test_no_fp8_compiles_without_the_round_trip_and_without_the_graph_cache():
    import torch

    from geoscale_fx.compile import graph_cache
    from geoscale_fx.core import fp8

    s = torch.tensor([0.1234567, 1000.0, -3.3])      # not FP8 values; 1000 saturates
    divisor = torch.tensor(1.0)
    assert not torch.equal(fp8.fake_quantize_logits(s, divisor), s)
    with profile_step.compiling("no-fp8"):
        assert torch.equal(fp8.fake_quantize_logits(s, divisor), s)
        assert torch.equal(fp8.quantize_dequantize(s, "e4m3"), s)     # both lowerings' cast
        assert not graph_cache.enabled()
    assert not torch.equal(fp8.fake_quantize_logits(s, divisor), s)
    assert graph_cache.enabled()
    with profile_step.compiling("geometry"):
        assert not torch.equal(fp8.quantize_dequantize(s), s)


@pytest.mark.parametrize("family", sorted(profile_step.SHAPES))
def test_its_models_name_their_loss_and_a_training_step_compiles_one_graph(family):
    """transformers 5 finds no loss type for GPT2LMHeadModel and warns at every loss: a graph
    break, the forward compiled twice. The models it times have theirs named
    (``bench.lms.with_named_loss``), and with it a training step is one graph."""
    import torch
    import transformers
    from torch._dynamo.utils import counters

    from bench.lms import with_named_loss

    config = profile_step._config(family, 16)
    assert profile_step._model(config, "plain", training=True).loss_type is not None
    # the same model compiled with backend="eager": _model's plain program compiles Inductor
    torch.manual_seed(0)
    model = with_named_loss(transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa")).train()
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 256, (1, 16))
    loss = torch.compile(model, backend="eager")(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
