"""Per-block compile: one compiled graph serves every block, each block has its own state."""
import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx

models_zoo = pytest.importorskip("models_zoo")
from models_zoo.nanogpt import GPT, GPTConfig  # noqa: E402

KEYS = [f"transformer_h_{b}_attn" for b in range(3)]


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)).eval()


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def _whole_model_scales(**options) -> dict:
    wrapped = geoscale_fx.wrap(_gpt(), compiler="aot_eager", **options)
    with torch.no_grad():
        wrapped(_x())
        wrapped(_x())
    return {k: r.state for k, r in wrapped.geoscale.records.items()}


def test_compile_blocks_one_graph_a_state_per_block_named_by_the_model():
    model = _gpt()
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                         fullgraph=True)
    with torch.no_grad():
        model(_x())
        model(_x())
    assert backend.compiles == 1
    assert sorted(backend.records) == KEYS
    assert [r.name for r in backend.records.values()] == [f"transformer.h.{b}.attn"
                                                          for b in range(3)]
    whole = _whole_model_scales()
    for key in KEYS:          # exact: each block's graph runs the whole model's ops on it
        state = backend.records[key].state
        assert int(state.steps) == 2
        torch.testing.assert_close(state.scale, whole[key].scale, rtol=0, atol=0)
    state_keys = [k for k in model.state_dict() if k.startswith("geoscale_state.")]
    assert {k.split(".")[2] for k in state_keys} == set(KEYS)
    rows = geoscale_fx.report(model).rows
    assert [r["site"] for r in rows] == ["transformer.h.0.attn", "transformer.h.1.attn",
                                         "transformer.h.2.attn"]


def test_one_backend_compiling_each_block_keeps_the_blocks_apart():
    """``blk.compile(backend=geoscale_fx.backend())`` per block: Dynamo reuses the graph,
    which used to share block 0's state (power vectors, one cold start) with every block."""
    model = _gpt()
    backend = geoscale_fx.backend(compiler="aot_eager", estimator="exact")
    for block in model.transformer.h:
        block.compile(backend=backend)
    cold = counters["geoscale"]["cold_starts"]
    with torch.no_grad():
        model(_x())
        model(_x())
    assert backend.compiles == 1 and len(backend.records) == 3
    assert counters["geoscale"]["cold_starts"] - cold == 3
    whole = _whole_model_scales(estimator="exact")
    for record, key in zip(backend.records.values(), KEYS):
        assert int(record.state.steps) == 2
        torch.testing.assert_close(record.state.scale, whole[key].scale, rtol=0, atol=0)


def test_alpha_theory_counts_the_heads_of_every_block():
    model = _gpt()
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                         alpha="theory")
    with torch.no_grad():
        model(_x())
    whole = _whole_model_scales(alpha="theory")    # one graph: N = 3 blocks x 2 heads
    for key in KEYS:
        torch.testing.assert_close(backend.records[key].state.alpha, whole[key].alpha)


def test_resume_from_state_dict_is_warm():
    model = _gpt()
    geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager")
    with torch.no_grad():
        model(_x())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():   # a full step (as after loading), not a weight-reusing one
            p.add_(0.0)
        model(_x(2))
    expected = {k: model.geoscale_state.sites[k].scale.clone() for k in KEYS}
    torch._dynamo.reset()
    fresh = _gpt(seed=5)
    backend = geoscale_fx.compile_blocks(fresh, fresh.transformer.h, compiler="aot_eager")
    fresh.load_state_dict(saved)          # before any site exists: stashed, picked up later
    cold = counters["geoscale"]["cold_starts"]
    with torch.no_grad():
        fresh(_x(2))
    assert counters["geoscale"]["cold_starts"] == cold
    for key in KEYS:
        assert torch.equal(backend.records[key].state.scale, expected[key])


def test_compile_blocks_needs_blocks():
    with pytest.raises(ValueError, match="no blocks"):
        geoscale_fx.compile_blocks(_gpt(), [])
