"""A converted model the user deletes is freed, as a compiled one is: through every entry
point (``apply_``, ``wrap``, the backend given to ``torch.compile``, ``compile_blocks``, an
FP8 KV cache after ``generate``), no parameter stays alive, nor the graphs compiled for it;
``restore_`` frees the graphs of the model it gives back. Checked with weak references after
a full garbage collection; plain ``torch.compile`` is the reference."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import geoscale_fx
from geoscale_fx.compile.attach import geoscale_call

transformers = pytest.importorskip("transformers")
#: full collections walk only what each test makes (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("earlier_objects_set_aside")


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=128, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


IDS = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))


def _plain(model):
    model.compile(backend="aot_eager")
    return model


def _backend(model):
    return torch.compile(model, backend=geoscale_fx.backend(compiler="aot_eager"))


def _blocks(model):
    geoscale_fx.compile_blocks(model, model.model.layers, compiler="aot_eager")
    return model


ENTRY_POINTS = {
    "plain torch.compile": _plain,
    "apply_": lambda m: geoscale_fx.apply_(m, compiler="aot_eager"),
    "wrap": lambda m: geoscale_fx.wrap(m, compiler="aot_eager"),
    "torch.compile with the backend": _backend,
    "compile_blocks": _blocks,
}


def _round(convert, generate: bool = False) -> tuple[weakref.ref, weakref.ref]:
    model = _llama()
    parameter = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    converted = convert(model)
    with torch.no_grad():
        if generate:
            converted.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3,
                               do_sample=False, pad_token_id=0)
        else:
            converted(IDS)
    module = weakref.ref(model)
    del model, converted
    return parameter, module


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_deleted_model_is_freed(entry):
    parameter, module = _round(ENTRY_POINTS[entry])
    gc.collect()
    assert (parameter() is None, module() is None) == (True, True)


def _flex_entries() -> int:
    """Dynamo's entries on flex_attention's inner compile (the code of its operator's
    wrapper), which a fused site's trace outside Dynamo compiles."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    code, = [c for c in flex_attention.__code__.co_consts
             if getattr(c, "co_name", "") == "_flex_attention_hop_wrapper"]
    return len(_debug_get_cache_entry_list(code))


def test_restore_frees_the_graphs_compiled_for_the_model():
    model = _llama()
    for _ in range(2):
        geoscale_fx.apply_(model, compiler="aot_eager")
        with torch.no_grad():
            model(IDS)
        runtimes = [weakref.ref(r) for r in geoscale_call(model).backend.runtimes]
        assert runtimes
        geoscale_fx.restore_(model)
        gc.collect()
        assert all(r() is None for r in runtimes)
    assert geoscale_fx.report(model).rows == []


def _dynamo_objects() -> dict[str, int]:
    """Shape environments and guard trees alive, once collections free nothing more (a
    collection's callbacks — the model's finalizer releasing its codes — let go of more)."""
    from torch._dynamo.guards import CheckFunctionManager
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for _ in range(5):
        if gc.collect() == 0:
            break
    alive = gc.get_objects()
    return {"shape environments": sum(type(o) is ShapeEnv for o in alive),
            "guard trees": sum(type(o) is CheckFunctionManager for o in alive)}


def test_deleted_models_leave_no_shape_environment_or_guard_tree():
    """Each converted model compiles fresh code; once it is deleted, Dynamo's guard trees
    (kept by finalizers on the traced code's globals) and shape environments (kept by a
    fake-tensor cycle through C++ and torch's memos) go with it: none piles up per model.
    torch keeps its latest environment a while (bounded memos), so one more may be alive."""
    convert = ENTRY_POINTS["apply_"]
    _round(convert)
    before = _dynamo_objects()
    for _ in range(2):
        _round(convert)
    after = _dynamo_objects()
    assert after["guard trees"] == before["guard trees"]
    assert after["shape environments"] - before["shape environments"] <= 1


def test_a_deleted_model_with_an_fp8_cache_is_freed_after_generate():
    """... and later models of the same shapes leave nothing compiled behind them: no guard
    tree and no shape environment per model (before the fix, each left three), and no
    entry of their own on flex_attention's inner compile: the fused sites' inner compiles
    are shared, not one per site and model (the second model's prefill is traced with a
    symbolic length: one entry more)."""
    convert = lambda m: geoscale_fx.apply_(m, kv_cache="fp8", compiler="aot_eager",  # noqa: E731
                                           lowering="fused")
    parameter, module = _round(convert, generate=True)
    gc.collect()
    assert (parameter() is None, module() is None) == (True, True)
    assert _flex_entries() >= 1          # the fused sites were traced through it
    _round(convert, generate=True)
    entries, before = _flex_entries(), _dynamo_objects()
    _round(convert, generate=True)
    after = _dynamo_objects()
    assert _flex_entries() == entries
    assert after["guard trees"] == before["guard trees"]
    assert after["shape environments"] - before["shape environments"] <= 1
