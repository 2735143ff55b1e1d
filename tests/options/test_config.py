"""Options: an option set away from its default takes effect or is a ValueError naming it.

Generated from ``VALUES`` (every value of each enum, the default and one other value of each
number, alpha 1.0 / 0.5 / "theory" / "auto", every ``kv_cache`` format that
``fp8.KV_CACHE_FORMATS`` lists):

* construction, over every combination of up to five changed options and over the full
  product of the options that constrain one another (``_CORE``): each constructs, or raises a
  ``ValueError`` naming an option the combination changed. The full product of all twenty
  options (~10⁸) is out of reach; every rule of ``GeoscaleOptions`` involves at most three.
* the recipe spelling, over the same combinations: an accepted one spelled as a recipe
  (``tests.options.test_recipes.recipe_spelling``: recipe, quantize / kernel for lowering, the other
  keywords beside) gives equal options, and ``.recipe`` / ``.quantize`` / ``.kernel`` give the
  spelling back; a refused one is refused in the recipe spelling too, naming an option it set,
  or cannot be written (it sets an option of another strategy).
* effect, over every accepted combination of up to two changed options: the backend runs a
  small RoPE block (three prefill steps with weight updates between them, auto-α frozen, then
  a one-query step) and every changed option must change its fingerprint (plans, state,
  counters, outputs, the compiler that ran) against the same combination without it. The
  graphs are captured by Dynamo once and handed to the backend as ``torch.compile`` would
  (a Dynamo trace per combination would cost minutes); the compilers are spies that record
  which one was asked for and run the graph as is.
"""
from __future__ import annotations

import copy
import itertools
import re
from dataclasses import fields

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.core.fp8 import KV_CACHE_FORMATS
from tests.attention_variants import DH, D, H, Block
from tests.hf_models import build_hf
from tests.options.test_recipes import SPELLED_AS, recipe_spelling

DEFAULTS = {f.name: f.default for f in fields(GeoscaleOptions)}

#: option -> representative values, the default first
VALUES = {
    "scaling": ("geometry", "delayed", "current", "none"),
    "granularity": ("head", "layer"),
    "estimator": ("schatten", "exact", "power"),
    "alpha": (1.0, 0.5, "theory", "auto"),
    "eta": (0.8, 0.5),
    "fp8_format": ("e4m3", "e5m2"),
    "delta": (1e-6, 1e-3),
    "cold_start_iters": (5, 20),
    "power_iters": (1, 3),
    "audit": (False, True),
    "delayed_recipe": ("paper", "te"),
    "history_len": (None, 4),
    "rope_bound": ("norm_product", "interaction", "relative"),
    "lowering": ("auto", "fused", "explicit", "fp8_qkv"),
    "compiler": ("inductor", "aot_eager", "eager"),
    "calib_steps": (100, 2),
    "quantile": (0.9999, 0.5),
    "kappa": (1.0, 2.0),
    "alpha0": ("theory", 0.5),
    "kv_cache": (None, *sorted(KV_CACHE_FORMATS)),
}

#: options that appear in another option's rule: their full product is checked
_CORE = ("scaling", "granularity", "estimator", "alpha", "eta", "fp8_format", "delta",
         "power_iters", "audit", "rope_bound", "lowering", "alpha0")

#: (option, value) whose effect another option of the combination already has: observed-max
#: scaling and audits force the explicit lowering, and every explicit lowering records what
#: it saw of the materialized scores (an audit's counts)
#: (option, value) -> when it changes nothing the others have not changed already (auto
#: lowers explicitly under a compiler that does not fuse flex_attention)
_IMPLIED = {
    ("lowering", "explicit"): lambda c: c.get("scaling") in ("delayed", "current")
    or c.get("audit") is True or c.get("compiler") in ("aot_eager", "eager"),
    ("audit", True): lambda c: c.get("scaling") in ("delayed", "current")
    or c.get("lowering") == "explicit" or c.get("compiler") in ("aot_eager", "eager"),
}


def _changes(n: int):
    """Every combination of exactly ``n`` options set away from their defaults."""
    for names in itertools.combinations(VALUES, n):
        for values in itertools.product(*(VALUES[k][1:] for k in names)):
            yield dict(zip(names, values))


def _refusal(kwargs: dict) -> ValueError | None:
    try:
        GeoscaleOptions(**kwargs)
    except ValueError as error:
        return error
    return None


def _names_a_changed_option(error: ValueError, kwargs: dict) -> bool:
    changed = [k for k, v in kwargs.items() if v != DEFAULTS[k]]
    return any(re.search(rf"\b{name}\b", str(error)) for name in changed)


# --------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------

def test_values_cover_every_option_default_first():
    assert set(VALUES) == set(DEFAULTS)
    assert all(values[0] == DEFAULTS[name] for name, values in VALUES.items())


def _check_all(combinations) -> tuple[int, int]:
    accepted = refused = 0
    for kwargs in combinations:
        error = _refusal(kwargs)
        if error is None:
            accepted += 1
        else:
            assert _names_a_changed_option(error, kwargs), (kwargs, str(error))
            refused += 1
    return accepted, refused


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5])
def test_every_combination_of_changed_options_constructs_or_names_one(n):
    accepted, refused = _check_all(_changes(n))
    assert accepted > 0 and (refused > 0 or n == 0)


def test_full_product_of_the_interacting_options():
    combos = (dict(zip(_CORE, values))
              for values in itertools.product(*(VALUES[k] for k in _CORE)))
    accepted, refused = _check_all(combos)
    assert accepted > 100 and refused > 10_000


def _recipe_names(kwargs: dict) -> list[str]:
    """The names a refusal of ``kwargs``' recipe spelling may give: what it changed."""
    names = []
    for k, v in kwargs.items():
        if v == DEFAULTS[k]:
            continue
        spelled = {"scaling": ["recipe"], "lowering": ["quantize", "kernel", "lowering"]}
        names += spelled[k] if k in spelled else [SPELLED_AS[k][1]]
    return names


def _check_recipe_spelling(combinations) -> dict:
    """For each flat combination: its recipe spelling is accepted exactly when it is, with
    equal options that read the spelling back, or it cannot be written as a recipe."""
    seen = {"accepted": 0, "refused": 0, "unwritable": 0}
    for kwargs in combinations:
        error = _refusal(kwargs)
        try:
            spelled = recipe_spelling(kwargs)
            if spelled is not None:
                options = GeoscaleOptions.from_kwargs(**spelled)
        except ValueError as recipe_error:
            assert error is not None, (kwargs, str(recipe_error))
            names = "|".join(_recipe_names(kwargs))
            assert re.search(rf"\b({names})\b", str(recipe_error)), (kwargs, str(recipe_error))
            seen["refused"] += 1
            continue
        if spelled is None:
            assert error is not None, kwargs
            seen["unwritable"] += 1
            continue
        assert error is None, (kwargs, spelled, str(error))
        assert options == GeoscaleOptions(**kwargs), (kwargs, spelled)
        assert options.recipe == spelled["recipe"]
        assert (options.quantize, options.kernel) == (spelled.get("quantize", "scores"),
                                                      spelled.get("kernel", "auto"))
        seen["accepted"] += 1
    return seen


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5])
def test_every_combination_spelled_as_a_recipe_is_equal_or_refused(n):
    seen = _check_recipe_spelling(_changes(n))
    assert seen["accepted"] > 0 and (seen["refused"] + seen["unwritable"] > 0 or n == 0)


def test_full_product_spelled_as_a_recipe():
    combos = (dict(zip(_CORE, values))
              for values in itertools.product(*(VALUES[k] for k in _CORE)))
    seen = _check_recipe_spelling(combos)
    assert seen["accepted"] > 100 and seen["refused"] > 1000 and seen["unwritable"] > 1000


@pytest.mark.parametrize("kwargs, names", [
    (dict(scaling="delayed", alpha="auto"), ("alpha", "scaling")),
    (dict(scaling="current", granularity="layer"), ("granularity", "scaling")),
    (dict(scaling="none", estimator="power"), ("estimator", "scaling")),
    (dict(scaling="delayed", rope_bound="interaction"), ("rope_bound", "scaling")),
    (dict(scaling="geometry", delayed_recipe="te"), ("delayed_recipe", "scaling")),
    (dict(history_len=8), ("history_len", "scaling")),
    (dict(kappa=2.0), ("kappa", "alpha")),
    (dict(calib_steps=10), ("calib_steps", "alpha")),
    (dict(rope_bound="relative"), ("rope_bound", "norm_product", "interaction")),
    (dict(lowering="fused", audit=True), ("lowering", "audit")),
    (dict(lowering="fused", scaling="current"), ("lowering", "scaling")),
    # issue 20: each of these was accepted and had no effect
    (dict(scaling="delayed", eta=0.5), ("eta", "scaling")),
    (dict(scaling="current", eta=0.5), ("eta", "scaling")),
    (dict(scaling="none", fp8_format="e5m2"), ("fp8_format", "scaling")),
    (dict(scaling="none", audit=True), ("audit", "scaling")),
    (dict(alpha=0.5, delta=1e-3), ("delta", "alpha")),
    (dict(delta=1e-3), ("delta", "alpha")),
    (dict(alpha="auto", alpha0=0.5, delta=1e-3), ("delta", "alpha0")),
    (dict(estimator="exact", power_iters=2), ("power_iters", "estimator")),
    (dict(estimator="exact", cold_start_iters=9), ("cold_start_iters", "estimator")),
    (dict(granularity="layer", rope_bound="interaction"), ("rope_bound", "granularity")),
    (dict(lowering="fp8_qkv", alpha=0.5), ("alpha", "lowering")),
    (dict(lowering="fp8_qkv", alpha="theory"), ("alpha", "lowering")),
    (dict(lowering="fp8_qkv", estimator="power"), ("estimator", "lowering")),
    (dict(lowering="fp8_qkv", rope_bound="interaction"), ("rope_bound", "lowering")),
    (dict(lowering="fp8_qkv", power_iters=2), ("power_iters", "lowering")),
    (dict(kv_cache="int8"), ("kv_cache",)),
])
def test_refusals_name_the_options(kwargs, names):
    error = _refusal(kwargs)
    assert error is not None
    assert all(name in str(error) for name in names), str(error)


@pytest.mark.parametrize("kwargs", [
    dict(lowering="fp8_qkv", granularity="layer", eta=0.5, fp8_format="e5m2"),
    dict(alpha="auto", delta=1e-3),                    # alpha0="theory" reads δ*
    dict(scaling="delayed", audit=True),               # observed anyway: implied, not ignored
    dict(scaling="current", lowering="explicit"),
])
def test_options_that_take_effect_are_accepted(kwargs):
    assert _refusal(kwargs) is None


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="unknown geoscale option.*'alhpa'"):
        GeoscaleOptions.from_kwargs(alhpa=1.0)


# --------------------------------------------------------------------------------------
# kv_cache: an option, read by wrap and apply_
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["wrap", "apply_"])
@pytest.mark.parametrize("kv_cache", sorted(KV_CACHE_FORMATS))
def test_kv_cache_keyword_reaches_the_cache(entry, kv_cache):
    model = build_hf("llama-sdpa")
    out = getattr(geoscale_fx, entry)(model, kv_cache=kv_cache, compiler="aot_eager")
    call = out._geoscale_call if entry == "wrap" else out._compiled_call_impl
    assert call.options.kv_cache == kv_cache
    manager = model._geoscale_kv_cache
    assert (manager.kv_cache, manager.fmt) == (kv_cache, KV_CACHE_FORMATS[kv_cache])


@pytest.mark.parametrize("entry", ["wrap", "apply_"])
def test_kv_cache_on_a_model_without_generate_names_the_option(entry):
    with pytest.raises(ValueError, match="kv_cache='fp8'"):
        getattr(geoscale_fx, entry)(Block(), kv_cache="fp8", compiler="aot_eager")


def test_backend_refuses_kv_cache_it_cannot_use():
    with pytest.raises(ValueError, match="kv_cache='fp8'.*geoscale_fx.backend"):
        geoscale_fx.backend(kv_cache="fp8")
    with pytest.raises(ValueError, match="kv_cache='nvfp4'.*compile_blocks"):
        geoscale_fx.compile_blocks(nn.Linear(2, 2), [], kv_cache="nvfp4")


# --------------------------------------------------------------------------------------
# Effect: every changed option changes what the backend does
# --------------------------------------------------------------------------------------

B, L = 2, 8


def _model() -> Block:
    """A RoPE SDPA block whose q/k heads have a dominant direction (power iteration
    converges in a few steps, so the cold start's minimum iterations decide its vectors)."""
    torch.manual_seed(0)
    model = Block(rope="half", norm="rmsnorm").eval()
    with torch.no_grad():
        for linear in (model.q, model.k):
            u = torch.randn(H, DH, 1)
            v = torch.randn(H, 1, D)
            linear.weight.add_((u @ v).reshape(D, D) * 0.3)   # a rank-one spike per head
    return model


@pytest.fixture(scope="module")
def captured():
    """Dynamo's graphs of a prefill (L queries) and a one-query step, and their inputs."""
    model = _model()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=keep, dynamic=False)
        compiled(torch.randn(B, L, D))
        compiled(torch.randn(B, 1, D))
    torch._dynamo.reset()
    assert len(graphs) == 2
    return model, graphs


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: threads only contend on a shared machine (a run takes 10x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiler_calls():
    """The compilers the backend asks for, recorded; the graph runs as is."""
    calls = {"aot_eager": 0, "inductor": 0}

    def spy(name):
        def compile_(gm, example_inputs, **kwargs):
            calls[name] += 1
            return gm.forward
        return compile_

    import torch._dynamo.backends.debugging as debugging
    import torch._inductor.compile_fx as inductor

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(debugging, "aot_eager", spy("aot_eager"))
        patch.setattr(inductor, "compile_fx", spy("inductor"))
        yield calls


def _flat(value):
    if isinstance(value, torch.Tensor):
        return repr(value.detach().double().flatten().tolist())
    return repr(value)


def _run(kwargs: dict, captured, calls) -> dict:
    """Fingerprint of one run of the backend with these options."""
    model, graphs = captured
    own = copy.deepcopy(model)
    by_id = {id(p): p for p in model.parameters()}
    ours = dict(zip((id(p) for p in model.parameters()), own.parameters()))
    be = geoscale_fx.backend(**kwargs)
    fingerprint = {}
    before = dict(calls)
    counters["geoscale"].clear()
    generator = torch.Generator().manual_seed(1)
    outputs = []
    with torch.no_grad():
        for gm, example in graphs:
            args = [ours[id(a)] if id(a) in by_id else a for a in example]
            run = be(copy.deepcopy(gm), args)
            # the estimators' classes too: on this block the certified routes agree to
            # float32 (one singular value dominates), but the graph computes a different bound
            plans = [(k, r.plan.lowering, r.plan.n_scale, r.plan.qkv_fallback,
                      [type(e).__name__ for e in getattr(r.plan.policy, "estimators", ())])
                     for k, r in be.records.items()]
            x_at = next(i for i, a in enumerate(example) if id(a) not in by_id)
            shape = example[x_at].shape
            fingerprint[f"plans {tuple(shape)}"] = repr(plans)
            steps = 3 if shape[1] == L else 1
            for step in range(steps):
                args[x_at] = torch.randn(shape, generator=generator) * (1 + step)
                outputs.append(run(*args))
                for p in own.parameters():       # a new direction: warm vectors must move
                    p.add_(torch.randn(p.shape, generator=generator) * 0.02)
            if be.options.alpha == "auto":
                be.finalize_calibration()
                outputs.append(run(*args))
    fingerprint.update(out=_flat(outputs), counters=repr(sorted(counters["geoscale"].items())),
                       compilers=repr({k: calls[k] - before[k] for k in calls}))
    for key, record in be.records.items():
        for name, tensor in record.state.as_dict().items():
            fingerprint[f"{key}.{name}"] = _flat(tensor)
    return fingerprint


def _accepted_up_to_two() -> list[dict]:
    return [c for n in (1, 2) for c in _changes(n) if _refusal(c) is None]


_FINGERPRINTS: dict = {}


def _fingerprint(kwargs: dict, captured, calls) -> dict:
    key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = _run(kwargs, captured, calls)
    return _FINGERPRINTS[key]


def _id(kwargs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("combo", [c for c in _accepted_up_to_two() if "kv_cache" not in c],
                         ids=_id)
# where Inductor cannot fuse on the CPU, lowering= changes no plan there (and says why)
@pytest.mark.usefixtures("a_cpu_inductor_fuses_on")
def test_every_changed_option_changes_what_the_backend_does(combo, captured, compiler_calls):
    """Against the same options without it (where those are valid), each changed option
    changes the plans, the state, the counters, the outputs or the compiler asked for."""
    ours = _fingerprint(combo, captured, compiler_calls)
    checked = 0
    for name in combo:
        if _IMPLIED.get((name, combo[name]), lambda c: False)(combo):
            continue
        without = {k: v for k, v in combo.items() if k != name}
        if _refusal(without) is not None:
            continue
        other = _fingerprint(without, captured, compiler_calls)
        same = sorted(k for k in set(ours) | set(other) if ours.get(k) == other.get(k))
        assert ours != other, (f"{name}={combo[name]!r} changed nothing against {without}; "
                               f"equal: {same[:6]}")
        checked += 1
    implied = any(_IMPLIED.get((k, v), lambda c: False)(combo) for k, v in combo.items())
    assert checked or implied or len(combo) > 1
