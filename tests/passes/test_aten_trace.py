"""``passes.aten_trace``: rewritten inference graphs reach AOTAutograd as ATen operators, so
its cache keys them (it used to refuse them: "Unsupported call_function target geoscale_…"),
and the traced graph computes what the untraced one does."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.passes.aten_trace import aten_graph
from models_zoo.nanogpt import GPT, GPTConfig


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4,
                         n_embd=64)).eval()


def test_outside_a_dynamo_compile_the_graph_is_returned_as_it_is():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert aten_graph(gm, [torch.randn(2, 4)]) is gm


@pytest.mark.inductor
def test_an_inference_graph_is_cached_by_aotautograd_and_computes_the_same():
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = geoscale_fx.wrap(_model(), compiler="aot_eager")(ids)[0]
    outputs = []
    for _ in range(2):          # the second compile finds the first's entry
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            outputs.append(geoscale_fx.wrap(_model(), compiler="inductor")(ids)[0])
        aot = counters["aot_autograd"]
        assert aot["autograd_cache_bypass"] == 0
        assert aot["autograd_cache_hit"] + aot["autograd_cache_miss"] == 1
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    for out in outputs:
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


def _unfit(x):
    raise RuntimeError("an operator the trace got wrong")


@pytest.mark.inductor
def test_a_trace_that_does_not_compile_falls_back_to_the_rewritten_graph(monkeypatch):
    """The trace only saves compile time: if its graph fails to compile, the rewritten
    graph is compiled as it is (same outputs), and the fallback is counted."""
    from geoscale_fx import dynamo_backend

    def broken(gm, inputs):
        graph = torch.fx.Graph()
        args = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
        graph.output(graph.call_function(_unfit, (args[0],)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    monkeypatch.setattr(dynamo_backend, "aten_graph", broken)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = geoscale_fx.wrap(_model(), compiler="inductor")(ids)[0]
        reference = geoscale_fx.wrap(_model(), compiler="aot_eager")(ids)[0]
    assert counters["geoscale"]["aten_trace_fallbacks"] == 1
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
