"""geoscale_fx.api.wrapper: ``wrap(model)`` — the model's own keys, signature and attributes, the
output of ``scaling="none"`` equal to eager, and its refusals. aot_eager, explicit attention
(rewritten in place)."""
from __future__ import annotations

import inspect

import pytest
import torch

import geoscale_fx
from geoscale_fx.sites.state import GeoscaleState
from geoscale_fx.api.wrapper import GeoscaleModule, wrap
from tests.analysis_checks import assert_none_scaling_equals_eager
from tests.attention_variants import Block


def _block():
    return Block(attn="explicit").eval()


def test_state_dict_keys_are_the_models_plus_its_state_and_plain_weights_mark_it_cold():
    model, source = _block(), _block()
    plain = set(model.state_dict())
    wrapped = wrap(model, compiler="aot_eager")
    with torch.no_grad():
        wrapped(torch.randn(2, 5, 64))
    keys = set(wrapped.state_dict())
    assert plain < keys and not any(k.startswith("_orig_mod") for k in keys)
    assert {k.split(".")[0] for k in keys - plain} == {"geoscale_state"}
    assert isinstance(wrapped.geoscale_state, GeoscaleState)
    assert wrapped.geoscale_state is model.geoscale_state          # on the model itself
    assert len(wrapped.geoscale.records) == 1 and wrapped.eager_calls == 0
    site = next(iter(model.geoscale_state.sites.values()))
    assert not site.cold
    wrapped.load_state_dict(source.state_dict(), strict=True)       # no geoscale keys: cold
    assert site.cold
    torch.testing.assert_close(model.q.weight, source.q.weight)     # loaded into the model


def test_scaling_none_equals_eager_and_the_forward_signature_is_the_models():
    model = _block()
    wrapped, _ = assert_none_scaling_equals_eager(model, torch.randn(3, 6, 64), wrap,
                                                  compiler="aot_eager", atol=1e-6)
    assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
    assert wrapped.norm is model.norm                               # attributes pass through
    assert wrapped.model is model and isinstance(wrapped, GeoscaleModule)


def test_refusals_name_the_option_or_the_model():
    with pytest.raises(ValueError, match=r"unknown geoscale option\(s\) \['scalling'\]"):
        wrap(_block(), scalling="none")
    converted = geoscale_fx.apply_(_block(), compiler="aot_eager")
    with pytest.raises(ValueError, match="Block was already converted in place"):
        wrap(converted, compiler="aot_eager")
