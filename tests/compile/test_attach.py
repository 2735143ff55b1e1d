"""geoscale_fx.compile.attach: the state submodule and its load hook, ``GeoscaleCall``'s warnings,
and Hugging Face's auto-compile switch, on plain modules and stub backends (no compile)."""
from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn

from geoscale_fx.compile.attach import (
    STATE_ATTR, GeoscaleCall, attach_state, detach_state, disable_hf_auto_compile,
    enable_hf_auto_compile, geoscale_call,
)
from geoscale_fx.sites.state import GeoscaleState, StateSpec


def _model_with_site() -> tuple[nn.Module, GeoscaleState]:
    model = nn.Linear(4, 4)
    state = attach_state(model)
    site = state.get_or_create("attn", [StateSpec("u", (2,), warm=True),
                                        StateSpec("sigma", (1,))], "cpu")
    site.u.fill_(0.5)
    site.cold = False
    return model, state


def test_state_is_a_submodule_in_the_state_dict_and_attached_once():
    model, state = _model_with_site()
    assert STATE_ATTR == "geoscale_state" and model.geoscale_state is state
    assert attach_state(model) is state                         # idempotent
    assert sorted(model.state_dict()) == ["bias", "geoscale_state.sites.attn.sigma",
                                          "geoscale_state.sites.attn.u", "weight"]


def test_plain_weights_load_strictly_and_mark_sites_cold():
    model, state = _model_with_site()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    plain = {k: v for k, v in full.items() if not k.startswith(STATE_ATTR)}
    result = model.load_state_dict(plain, strict=True)        # the hook drops state keys
    assert result.missing_keys == [] and state.sites["attn"].cold
    state.sites["attn"].cold = False
    model.load_state_dict(full, strict=True)                   # with its state: warm
    assert not state.sites["attn"].cold


def test_detach_state_removes_the_submodule_and_the_hook():
    model, _ = _model_with_site()
    assert detach_state(model) is True
    assert STATE_ATTR not in model._modules and "_geoscale_hooked" not in model.__dict__
    assert sorted(model.state_dict()) == ["bias", "weight"]
    result = model.load_state_dict({"weight": torch.zeros(4, 4)}, strict=False)
    assert result.missing_keys == ["bias"]                     # the hook no longer edits it
    assert detach_state(model) is False


def _backend(records=(), skipped=(), compiles=1):
    return types.SimpleNamespace(graph_calls=0, records=dict(records), skipped=list(skipped),
                                 compiles=compiles, options="opts")


def test_geoscale_call_counts_eager_calls_and_warns_once(caplog):
    backend = _backend()

    def compiled(x):            # a call in which none of the backend's graphs ran
        return x + 1

    call = GeoscaleCall(lambda limit: compiled, backend, "Toy")
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        assert call(1) == 2 and call(2) == 3
    assert call.eager_calls == 2 and call.options == "opts"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("geoscale: Toy ran eagerly, WITHOUT FP8")


def test_first_compiled_call_without_sites_is_warned_about_once(caplog):
    for skipped, expected in (([], "Toy: no attention site found in its first call (1 graph"),
                              (["s0", "s1"], "Toy: all 2 attention site(s) found were left")):
        backend = _backend(skipped=skipped)

        def compiled(x, backend=backend):
            backend.graph_calls += 1
            return x

        call = GeoscaleCall(lambda limit: compiled, backend, "Toy")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
            call(0), call(0)
        assert call.eager_calls == 0
        assert [expected in r.getMessage() for r in caplog.records] == [True]
    quiet = _backend(records={"attn": object()})
    call = GeoscaleCall(lambda limit: lambda x: setattr(quiet, "graph_calls", quiet.graph_calls + 1),
                        quiet, "Ok")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        call(0)
    assert caplog.records == []


def test_hf_auto_compile_is_switched_off_and_back_and_geoscale_call_finds_the_call():
    model = nn.Linear(2, 2)
    model.generation_config = types.SimpleNamespace(disable_compile=False)
    disable_hf_auto_compile(model)
    assert model.generation_config.disable_compile is True
    enable_hf_auto_compile(model)
    assert model.generation_config.disable_compile is False
    user_set = nn.Linear(2, 2)                  # set by the user: left as it is on undo
    user_set.generation_config = types.SimpleNamespace(disable_compile=True)
    disable_hf_auto_compile(user_set)
    enable_hf_auto_compile(user_set)
    assert user_set.generation_config.disable_compile is True
    assert geoscale_call(model) is None and geoscale_call(object()) is None
    call = GeoscaleCall(lambda limit: lambda x: x, _backend(), "Linear")
    model._compiled_call_impl = call
    assert geoscale_call(model) is call


def test_hooks_added_between_compiles_are_named_once(caplog):
    """A hook registered again before each compile (transformers' ``enable_input_require_grads``
    at every gradient-checkpointing enable): said once, naming the module and the hooks'
    count, however many times it grows."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    backend = _backend(records={"attn": types.SimpleNamespace(name="1")}, compiles=0)

    def compiled(x):            # every call compiles a graph and runs it
        backend.compiles += 1
        backend.graph_calls += 1
        return x

    def make_inputs_require_grads(module, args, output):
        return output

    call = GeoscaleCall(lambda limit: compiled, backend, "Toy", model)
    call.region.renew_if_full = lambda name: False      # a stub call: no Dynamo region
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        for _ in range(4):
            model[0].register_forward_hook(make_inputs_require_grads)
            call(0)
    said = [r.getMessage() for r in caplog.records if "hooks were added" in r.getMessage()]
    assert len(said) == 1 and "0 (1 → 2: " in said[0] and "make_inputs_require_grads" in said[0]
