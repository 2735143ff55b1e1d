"""geoscale_fx.api.conversion: ``apply_`` in place (same object, class and output with
``scaling="none"``), its idempotence and refusals; ``plain_state_dict``'s keys.
tests/test_restore.py covers ``restore_`` on Hugging Face models."""
from __future__ import annotations

import logging

import pytest
import torch

from geoscale_fx.api.conversion import apply_, plain_state_dict, restore_
from geoscale_fx.api.wrapper import wrap
from tests.analysis_checks import assert_none_scaling_equals_eager
from tests.attention_variants import Block


def _block():
    return Block(attn="explicit").eval()


def test_apply_converts_in_place_and_none_scaling_equals_eager():
    model = _block()
    converted, _ = assert_none_scaling_equals_eager(model, torch.randn(2, 5, 64), apply_,
                                                    compiler="aot_eager", atol=1e-6)
    assert converted is model and type(model) is Block
    assert len(model._compiled_call_impl.backend.records) == 1


def test_apply_again_same_options_is_a_no_op_other_options_are_named(caplog):
    model = apply_(_block(), compiler="aot_eager", scaling="none")
    call = model._compiled_call_impl
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        assert apply_(model, compiler="aot_eager", scaling="none") is model
    assert model._compiled_call_impl is call
    assert any("converted already, with the same options" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match=r"scaling='geometry' \(converted with 'none'\)"):
        apply_(model, compiler="aot_eager")


@pytest.mark.parametrize("prepare, message", [
    (lambda m: torch.compile(m), "already compiled by torch.compile"),
    (lambda m: (m.compile(), m)[1], r"already compiled with Block.compile\(\)"),
    (lambda m: (wrap(m, compiler="aot_eager"), m)[1], "wrapped by geoscale_fx.wrap already"),
])
def test_already_compiled_or_wrapped_models_are_refused(prepare, message):
    with pytest.raises(ValueError, match=message):
        apply_(prepare(_block()), compiler="aot_eager")


def test_a_converted_model_called_inside_another_compile_keeps_geoscale():
    """accelerate's ``torch.compile(model)`` (``TrainingArguments(torch_compile=True)``) or a
    user's compiled step around a converted model: Dynamo stops at geoscale's call instead
    of inlining it (which ran the attention without FP8, an eager call each time); the
    outputs are the converted model's."""
    model = apply_(_block(), compiler="eager")
    call = model._compiled_call_impl
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        expected = model(x)
        step = torch.compile(lambda m, x: m(x) * 2, backend="eager")
        outer = torch.compile(model, backend="eager")(x), step(model, x)
    assert (call.calls, call.eager_calls, call.backend.graph_calls) == (3, 0, 3)
    torch.testing.assert_close(outer[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(outer[1], 2 * expected, rtol=0, atol=0)


def test_non_module_and_unknown_option_are_refused():
    with pytest.raises(TypeError, match="expected an nn.Module, got function"):
        apply_(lambda x: x, compiler="aot_eager")
    with pytest.raises(ValueError, match=r"unknown geoscale option\(s\) \['estimater'\]"):
        apply_(_block(), estimater="exact")


def test_plain_state_dict_and_restore_give_the_models_own_keys():
    model = _block()
    keys = set(model.state_dict())
    apply_(model, compiler="aot_eager", scaling="none")
    with torch.no_grad():
        model(torch.randn(1, 4, 64))
    assert set(model.state_dict()) > keys
    assert set(plain_state_dict(model)) == keys
    with pytest.raises(ValueError, match="pass the model, not its geoscale_state"):
        plain_state_dict(model.geoscale_state)
    assert restore_(model) is model
    assert set(model.state_dict()) == keys and model._compiled_call_impl is None
    with pytest.raises(ValueError, match="was not converted by geoscale_fx.apply_"):
        restore_(model)
