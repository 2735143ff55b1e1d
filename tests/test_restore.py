"""``restore_`` and ``plain_state_dict``: back from ``apply_`` (or ``wrap``) to the plain model.

Checked against a model geoscale never touched: after ``apply_`` and a training step, the
restored model's state dict loads into a fresh instance of its class with ``strict=True``
and both give identical eager outputs; the restored model runs none of geoscale's graphs
(the backend's call counter stays put) and has exactly the instance attributes and hooks
it had before ``apply_``."""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.compile.attach import STATE_ATTR, _mark_cold_without_state
from tests.hf_models import build_hf

pytestmark = pytest.mark.zoo


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


def _train_step(model) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids(1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _geoscale_hooks(model) -> int:
    return sum(h is _mark_cold_without_state for h in model._load_state_dict_post_hooks.values())


def _fresh(model):
    torch.manual_seed(123)                              # other initial weights
    return type(model)(model.config).eval()


@pytest.mark.parametrize("key", ["llama-sdpa", "gpt2-sdpa"])
def test_restore_after_training_gives_a_plain_model(key):
    """apply_(kv_cache="fp8") → a training step → restore_: same object and class, the
    plain attributes back, a strict load into a fresh model, equal eager outputs."""
    model = build_hf(key).train()
    attributes = set(model.__dict__)
    disable_compile = model.generation_config.disable_compile
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = geoscale_fx.apply_(model, kv_cache="fp8", compiler="aot_eager")
    _train_step(converted)
    call = converted._compiled_call_impl
    assert call.backend.graph_calls > 0                  # it trained through geoscale
    with pytest.raises(RuntimeError, match=rf"Unexpected key\(s\) in state_dict: "
                                           rf"\"{STATE_ATTR}\."):
        _fresh(model).load_state_dict(converted.state_dict())    # the error users meet

    restored = geoscale_fx.restore_(converted)
    assert restored is model and type(restored) is type(_fresh(model))
    assert set(model.__dict__) == attributes
    assert STATE_ATTR not in dict(model.named_modules())
    assert model._compiled_call_impl is None and _geoscale_hooks(model) == 0
    assert model.generation_config.disable_compile == disable_compile
    assert model.generate.__func__ is type(model).generate
    state = model.state_dict()
    assert sorted(state) == sorted(before)
    assert any(not torch.equal(state[k], before[k]) for k in state)   # the trained weights

    fresh = _fresh(model)
    fresh.load_state_dict(state, strict=True)
    model.eval()
    calls = call.backend.graph_calls
    with torch.no_grad():
        ours, theirs = model(_ids()).logits, fresh(_ids()).logits
    assert torch.equal(ours, theirs)
    assert call.backend.graph_calls == calls             # the forward ran uncompiled


def test_plain_state_dict_of_a_converted_model_loads_strictly():
    """Without restoring: the model's own keys only, for a plain model's strict load."""
    model = geoscale_fx.apply_(build_hf("llama-sdpa").train(), compiler="aot_eager")
    _train_step(model)
    assert any(k.startswith(f"{STATE_ATTR}.") for k in model.state_dict())
    plain = geoscale_fx.plain_state_dict(model)
    fresh = _fresh(model)
    assert sorted(plain) == sorted(fresh.state_dict())
    fresh.load_state_dict(plain, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain.items())
    assert any(k.startswith(f"{STATE_ATTR}.") for k in model.state_dict())   # unchanged


def test_restore_refuses_a_model_that_was_not_converted():
    model = build_hf("llama-sdpa")
    with pytest.raises(ValueError, match="LlamaForCausalLM was not converted by "
                                         "geoscale_fx.apply_"):
        geoscale_fx.restore_(model)
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    with pytest.raises(ValueError, match="LlamaForCausalLM is wrapped by geoscale_fx.wrap"):
        geoscale_fx.restore_(model)
    assert geoscale_fx.restore_(wrapped) is model          # the wrapper: the model back
    with pytest.raises(ValueError, match="restored already"):
        geoscale_fx.restore_(wrapped)
    assert STATE_ATTR not in dict(model.named_modules()) and _geoscale_hooks(model) == 0
    with pytest.raises(ValueError, match="was not converted"):
        geoscale_fx.restore_(model)                        # twice: nothing left to restore


def test_apply_again_after_restore():
    """The restored model converts again: compiled through geoscale, a fresh state with
    its load hook (one, not two), and restore_ once more gives the plain model."""
    model = geoscale_fx.apply_(build_hf("llama-sdpa"), compiler="aot_eager")
    model(_ids())
    geoscale_fx.restore_(model)
    assert geoscale_fx.apply_(model, compiler="aot_eager", alpha="theory") is model
    with torch.no_grad():
        model(_ids())
    assert model._compiled_call_impl.backend.graph_calls > 0
    assert model._compiled_call_impl.options.alpha == "theory"
    assert isinstance(getattr(model, STATE_ATTR), torch.nn.Module)
    assert _geoscale_hooks(model) == 1
    geoscale_fx.restore_(model)
    assert model._compiled_call_impl is None and _geoscale_hooks(model) == 0
