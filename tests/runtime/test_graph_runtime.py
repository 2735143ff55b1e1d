"""``geoscale_fx.runtime.graph_runtime``: what runs on the host around a compiled graph.

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
from geoscale_fx.runtime.graph_runtime import GraphRuntime, NonFiniteWeights
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


@pytest.mark.slow
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


def test_repeated_calls_skip_the_host_checks_until_a_weight_changes():
    """The fast path: while the record of the last call holds (same weights, same versions),
    the runtime checks nothing else and refreshes nothing; an in-place weight write between
    two calls is seen at once, and the bound follows it."""
    wrapped = geoscale_fx.wrap(_model(), compiler="aot_eager")
    with torch.no_grad():
        wrapped(_ids())
        full, _, fast = _counts(wrapped)
        for _ in range(3):
            wrapped(_ids())
        assert _counts(wrapped)[0] == full and _counts(wrapped)[2] == fast + 3   # fast path
        before = _bounds(wrapped)
        wrapped.transformer.h[0].attn.c_attn.weight.mul_(2.0)
        wrapped(_ids())
    assert _counts(wrapped)[0] == full + 1 and _counts(wrapped)[2] == fast + 3   # refreshed
    after = _bounds(wrapped)
    assert torch.all(after[0] > before[0] * 1.5)   # σ of the layer's (2W_q)(2W_k)ᵀ: ×4
    torch.testing.assert_close(after[1], before[1], rtol=1e-3, atol=0)   # layer 1 unchanged


def _counts(wrapped) -> tuple[int, int, int]:
    """(calls that refreshed the bound, calls that did not, those of them on the fast path)"""
    runtime, = _runtimes(wrapped)
    return runtime.full_steps, runtime.reused_steps, runtime.fast_steps


def _fresh_bounds(model) -> list[torch.Tensor]:
    """The bounds a new wrapper computes from ``model``'s weights as they are now."""
    plain = _model()
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("geoscale_state.")})
    fresh = geoscale_fx.wrap(plain, estimator="exact", compiler="eager")
    with torch.no_grad():
        fresh(_ids())
    return _bounds(fresh)


def _scale_in_place(attn):
    attn.c_attn.weight.mul_(2.0)


def _swap_storage(attn):               # ``.data =``: new storage, the version unchanged
    attn.c_attn.weight.data = attn.c_attn.weight.data * 2.0


def _new_parameter(attn):              # another tensor object in the module
    attn.c_attn.weight = torch.nn.Parameter(attn.c_attn.weight * 2.0)


def _fused_adamw_step(attn):          # one kernel writes it: no version bump of its own
    weight = attn.c_attn.weight
    optimizer = torch.optim.AdamW([weight], lr=0.5, fused=True)
    weight.grad = -torch.ones_like(weight)
    optimizer.step()
    weight.grad = None


def _new_layernorm_weight(attn_block):  # a weight the bound reads before c_attn
    attn_block.ln_1.weight.mul_(3.0)


@pytest.mark.parametrize("change", [_scale_in_place, _swap_storage, _new_parameter,
                                    _fused_adamw_step, "ln"])
def test_every_weight_change_between_calls_leaves_the_fast_path(change):
    """After a change of a weight the bound reads, the next call is a full one and its bound
    is the one a new wrapper computes from the changed weights; the call after it is fast
    again (the fast path is live, so a change it missed would leave a stale bound)."""
    model = _model()
    wrapped = geoscale_fx.wrap(model, estimator="exact", compiler="eager")
    with torch.no_grad():
        wrapped(_ids())
        wrapped(_ids())
        assert _counts(wrapped) == (1, 1, 1)
        block = model.transformer.h[1]
        _new_layernorm_weight(block) if change == "ln" else change(block.attn)
        stale = _bounds(wrapped)
        wrapped(_ids())
        assert _counts(wrapped) == (2, 1, 1)
        wrapped(_ids())
        assert _counts(wrapped) == (2, 2, 2)
    after = _bounds(wrapped)
    for a, f in zip(after, _fresh_bounds(model)):
        torch.testing.assert_close(a, f, rtol=1e-5, atol=0)
    assert not torch.allclose(after[1], stale[1], rtol=0.05)
    torch.testing.assert_close(after[0], stale[0], rtol=1e-5, atol=0)


def test_a_cold_state_leaves_the_fast_path():
    """``mark_cold`` (weights loaded without their scaling state): the next call starts the
    sites again from the weights, whatever the records hold."""
    wrapped = geoscale_fx.wrap(_model(), compiler="aot_eager")
    with torch.no_grad():
        wrapped(_ids())
        wrapped(_ids())
        cold = counters["geoscale"]["cold_starts"]
        wrapped.geoscale.state.mark_cold()
        wrapped(_ids())
        assert counters["geoscale"]["cold_starts"] - cold == 2       # both sites
        assert _counts(wrapped) == (2, 1, 1)
        wrapped(_ids())
    assert _counts(wrapped) == (2, 2, 2)


@pytest.mark.slow
def test_auto_alpha_burn_in_never_takes_the_fast_path():
    """Every burn-in call runs the burn-in graph (it counts the step); the main graph after
    it starts with a full call; a burn-in that starts again (a host mirror reset, as after
    loading an uncalibrated checkpoint) is seen by the very next call."""
    wrapped = geoscale_fx.wrap(_model(), compiler="aot_eager", alpha="auto", calib_steps=3)
    with torch.no_grad():
        for _ in range(3):
            wrapped(_ids())
        assert _counts(wrapped) == (3, 0, 0)
        wrapped(_ids())
        wrapped(_ids())
        assert _counts(wrapped) == (4, 1, 1)
        state = next(iter(wrapped.geoscale.records.values())).state
        state.calib_seen = 1                    # two burn-in steps to go
        wrapped(_ids())
        assert state.calib_seen == 2 and _counts(wrapped) == (5, 1, 1)


def test_a_graph_serving_several_blocks_checks_each_blocks_weights():
    """One graph, three blocks (``compile_blocks``): each block's weights have their own
    record; an in-place write to block 1 makes only block 1's next call a full one. A block
    that dies takes its cached binding with it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)).eval()
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                         estimator="exact")
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)
        model(x)
        runtime, = backend.runtimes
        assert (runtime.full_steps, runtime.reused_steps, runtime.fast_steps) == (3, 3, 3)
        bounds = [r.state.bound.clone() for r in backend.records.values()]
        model.transformer.h[1].attn.c_attn.weight.mul_(2.0)
        model(x)
        assert (runtime.full_steps, runtime.reused_steps, runtime.fast_steps) == (4, 5, 5)
    after = [r.state.bound for r in backend.records.values()]
    assert torch.equal(after[0], bounds[0]) and torch.equal(after[2], bounds[2])
    assert bool((after[1] > 3 * bounds[1]).all())
    assert len(runtime._by_id) == 3
    del model.transformer.h[2]
    gc.collect()
    assert len(runtime._by_id) == 2


def _tensor_parallel_model(mesh) -> GPT:
    """The nanoGPT of ``_model`` with separate q/k/v, colwise on ``mesh`` (DTensor weights)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64,
                          qkv="separate", bias=False)).eval()
    plan = {"attn.c_q": ColwiseParallel(), "attn.c_k": ColwiseParallel(),
            "attn.c_v": ColwiseParallel(), "attn.c_proj": RowwiseParallel()}
    for block in model.transformer.h:
        parallelize_module(block, mesh, plan)
    return model


def test_tensor_parallel_weights_are_followed_through_their_local_shards(one_rank_mesh,
                                                                         tmp_path):
    """DTensor weights (tensor parallelism on one rank): unchanged, the calls take the fast
    path. ``dcp.load`` writes into the local shards (the DTensor's own version counter stays
    as it was) and a new local shard may be put in place (``fully_shard``'s reset): each
    makes the next call refresh the bound, which follows the weights (σ is linear in W_k)."""
    import torch.distributed.checkpoint as dcp

    model = _tensor_parallel_model(one_rank_mesh)
    wrapped = geoscale_fx.wrap(model, estimator="exact", compiler="eager")
    k = model.transformer.h[1].attn.c_k.weight
    assert k.data_ptr() == 0                       # a DTensor: no storage of its own
    dcp.save({"k": k}, checkpoint_id=tmp_path / "k")
    with torch.no_grad():
        wrapped(_ids())
        wrapped(_ids())
        assert _counts(wrapped) == (1, 1, 1)
        before = _bounds(wrapped)
        k.mul_(2.0)
        wrapped(_ids())
        assert _counts(wrapped) == (2, 1, 1)
        version = k._version
        dcp.load({"k": k}, checkpoint_id=tmp_path / "k")      # the saved W_k, back in place
        assert k._version == version
        wrapped(_ids())
        assert _counts(wrapped) == (3, 1, 1)
        torch.testing.assert_close(_bounds(wrapped), before, rtol=1e-6, atol=0)
        k._local_tensor = k._local_tensor * 4.0
        wrapped(_ids())
        wrapped(_ids())
        assert _counts(wrapped) == (4, 2, 2)
    after = _bounds(wrapped)
    torch.testing.assert_close(after[1], 4.0 * before[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(after[0], before[0], rtol=1e-6, atol=0)
