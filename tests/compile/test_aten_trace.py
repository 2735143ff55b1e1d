"""``compile.aten_trace``: rewritten graphs reach AOTAutograd as ATen operators, so its cache
keys them (it used to refuse them: "Unsupported call_function target geoscale_…"), and the
traced graph computes what the untraced one does — for a training graph its gradients and
the scaling state's updates too."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import geoscale_fx
from geoscale_fx.compile.aten_trace import aten_graph
from models_zoo.nanogpt import GPT, GPTConfig


def _model(training: bool = False) -> GPT:
    """One block: every test's graph has one site, and Inductor compiles little."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4,
                         n_embd=64)).train(training)


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


def _scaled(x, w):
    with torch.no_grad():          # a scale the gradient must not flow through
        scale = (x @ w).abs().amax()
    return (x @ w) / scale


@pytest.mark.parametrize("training", [True, False])
def test_a_training_trace_keeps_a_no_grad_region_and_its_gradient(training):
    """Above autograd (``training``) the ``no_grad`` region is recorded as grad-mode nodes
    and the gradient is the untraced one; below it (the inference trace) it is lost."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(_scaled, (x, w)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    w0 = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        traced = aten_graph(gm, [x0, w0.requires_grad_()], training=training)
    grad_modes = [n for n in traced.graph.nodes if n.target is torch._C._set_grad_enabled]
    assert len(grad_modes) == (2 if training else 0)
    grads = []
    for f in (gm, traced):
        w = w0.detach().clone().requires_grad_()
        f(x0, w).sum().backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1]) == training


def _train_steps(compiler: str, steps: int = 2):
    """Gradients and scaling state after each of ``steps`` training steps of a fresh model."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    model = _model(training=True)
    wrapped = geoscale_fx.wrap(model, compiler=compiler)
    out = []
    for _ in range(steps):
        wrapped(ids, ids)[1].backward()
        out.append(({n: p.grad.clone() for n, p in model.named_parameters()},
                    {k: v.clone() for k, v in wrapped.state_dict().items()
                     if k.startswith("geoscale_state.")}))
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.inductor
def test_a_training_graph_is_cached_by_aotautograd_with_the_untraced_gradients_and_state():
    reference = _train_steps("aot_eager")      # the rewritten graph as it is, not traced
    assert counters["geoscale"]["rewrite_explicit"] == 1
    for run in range(2):        # the second compile finds the first's entry
        steps = _train_steps("inductor")
        aot = counters["aot_autograd"]
        assert aot["autograd_cache_bypass"] == 0
        assert aot["autograd_cache_hit"] + aot["autograd_cache_miss"] == 1
        assert counters["geoscale"]["aten_trace_fallbacks"] == 0
        for (grads, state), (ref_grads, ref_state) in zip(steps, reference):
            assert grads.keys() == ref_grads.keys() and len(state) == len(ref_state) > 10
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)
            for name, value in state.items():   # bounds, scales, amax, power iterates …
                torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-7)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def _unfit(x):
    raise RuntimeError("an operator the trace got wrong")


@pytest.mark.inductor
def test_a_trace_that_does_not_compile_falls_back_to_the_rewritten_graph(monkeypatch):
    """The trace only saves compile time: if its graph fails to compile, the rewritten
    graph is compiled as it is (same outputs), and the fallback is counted."""
    from geoscale_fx.compile import dynamo_backend

    def broken(gm, inputs, training=False):
        graph = torch.fx.Graph()
        args = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
        graph.output(graph.call_function(_unfit, (args[0],)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    monkeypatch.setattr(dynamo_backend, "aten_graph", broken)
    # not the trace an earlier test kept in geoscale's cache (graph_cache): this one's
    monkeypatch.setattr(dynamo_backend.graph_cache, "enabled", lambda: False)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = geoscale_fx.wrap(_model(), compiler="inductor")(ids)[0]
        reference = geoscale_fx.wrap(_model(), compiler="aot_eager")(ids)[0]
    assert counters["geoscale"]["aten_trace_fallbacks"] == 1
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
