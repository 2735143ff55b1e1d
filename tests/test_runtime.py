"""``geoscale_fx.runtime``: what runs on the host around a compiled graph.

Inference graphs are compiled once (the ``reuse`` variant: the weights' part of the bound is
read from the state) and the runtime refreshes that part on the host whenever the weights
change; training graphs compute it in the graph (``predict``). Checked against the in-graph
computation of a training step on the same weights, and by counting AOTAutograd compiles.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.runtime import GraphRuntime, NonFiniteWeights
from models_zoo.nanogpt import GPT, GPTConfig


def _model(impl: str = "sdpa") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64,
                         attn_impl=impl)).eval()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def _runtimes(wrapped) -> list[GraphRuntime]:
    states = {id(r.state) for r in wrapped.geoscale.records.values()}
    return [o for o in gc.get_objects() if type(o) is GraphRuntime
            and any(id(s) in states for s in o.states)]


def _bounds(wrapped) -> list[torch.Tensor]:
    return [r.state.bound.clone() for r in wrapped.geoscale.records.values()]


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_an_inference_graph_is_compiled_once_however_often_it_runs(impl):
    """One AOTAutograd compile per Dynamo graph: the first call and every later one run the
    same compiled graph (there used to be a second, weight-reusing variant)."""
    wrapped = geoscale_fx.wrap(_model(impl), compiler="aot_eager")
    counters.clear()
    with torch.no_grad():
        for _ in range(3):
            wrapped(_ids())
    assert wrapped.geoscale.compiles == 1
    assert counters["aot_autograd"]["total"] == 1
    runtime, = _runtimes(wrapped)
    assert (runtime.full_steps, runtime.reused_steps) == (1, 2)
    assert set(runtime.variants) == {"reuse"}


def test_the_host_refresh_gives_the_bound_a_training_step_computes_in_its_graph():
    """After an in-place weight change, the next inference call refreshes the bound on the
    host; it equals the bound the training graph (``predict``: computed in the graph)
    gives on the same weights (exact σ: no warm power-iteration state to differ by)."""
    model = _model()
    wrapped = geoscale_fx.wrap(model, estimator="exact", compiler="aot_eager")
    with torch.no_grad():
        wrapped(_ids())
        before = _bounds(wrapped)
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(3.0)       # bumps the version counter
        wrapped(_ids(1))
    after = _bounds(wrapped)
    runtime, = _runtimes(wrapped)
    assert runtime.full_steps == 2                  # the change was seen: refreshed

    copy = _model()
    copy.load_state_dict({k: v for k, v in model.state_dict().items()
                          if not k.startswith("geoscale_state.")})
    trained = geoscale_fx.wrap(copy.train(), estimator="exact", compiler="aot_eager")
    trained(_ids(1))                                 # grad enabled: the predict graph
    assert set(_runtimes(trained)[0].variants) == {"predict"}
    for b, a, t in zip(before, after, _bounds(trained)):
        torch.testing.assert_close(a, t, rtol=1e-5, atol=0)
        assert bool((a > 4 * b).all())               # c_attn ×3: q·k ×9, biases aside


def test_non_finite_weights_are_named_before_the_inference_graph_runs():
    model = _model()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    with torch.no_grad():
        wrapped(_ids())
        model.transformer.h[1].attn.c_attn.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteWeights, match=r"transformer\.h\.1\.attn\.c_attn\.weight"):
            wrapped(_ids())


def test_repeated_calls_skip_the_host_checks_until_a_weight_changes(monkeypatch):
    """The fast path: while the record of the last call holds (same weights, same versions),
    the runtime reads no weights signature and refreshes nothing; an in-place weight write
    between two calls is seen at once, and the bound follows it."""
    wrapped = geoscale_fx.wrap(_model(), compiler="aot_eager")
    signatures = []
    original = GraphRuntime.weights_signature
    monkeypatch.setattr(GraphRuntime, "weights_signature",
                        lambda self, args: signatures.append(1) or original(self, args))
    with torch.no_grad():
        wrapped(_ids())
        first = len(signatures)
        for _ in range(3):
            wrapped(_ids())
        assert len(signatures) == first           # three calls on the fast path
        before = _bounds(wrapped)
        wrapped.transformer.h[0].attn.c_attn.weight.mul_(2.0)
        wrapped(_ids())
    assert len(signatures) == first + 1
    after = _bounds(wrapped)
    assert torch.all(after[0] > before[0] * 1.5)   # σ of the layer's (2W_q)(2W_k)ᵀ: ×4
    torch.testing.assert_close(after[1], before[1], rtol=1e-3, atol=0)   # layer 1 unchanged
