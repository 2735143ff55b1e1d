"""Recipes: the options per strategy, equal to the flat keywords they spell.

Generated, not hand-picked:

* every field of every recipe (and ``Alpha``) has values outside its domain in ``BAD``; each
  is a ``ValueError`` naming the field (``BAD`` must cover every field);
* the full product of ``RECIPE_VALUES`` (each recipe's field values, the default first, with
  every valid ``Alpha`` of the product of its values) × quantize × kernel × audit: each
  combination is accepted exactly when its flat spelling (``flat_spelling``, an independent
  table) is, equals it, and reads back through ``.recipe`` / ``.quantize`` / ``.kernel``; a
  refusal names a field or keyword the combination set.

``recipe_spelling`` is the other direction, used by ``test_config`` over its flat products.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import fields

import pytest

import geoscale_fx
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.options.recipes import (Alpha, CurrentRecipe, DelayedRecipe, GeometryRecipe,
                                 NoScalingRecipe)

RECIPES = (GeometryRecipe, DelayedRecipe, CurrentRecipe, NoScalingRecipe)

#: flat option -> (where the recipe spelling keeps it, its name there); "recipe": the
#: strategy's recipe whichever it is, None: a keyword beside the recipe
SPELLED_AS = {
    "granularity": ("GeometryRecipe", "granularity"),
    "estimator": ("GeometryRecipe", "estimator"),
    "eta": ("GeometryRecipe", "eta"),
    "rope_bound": ("GeometryRecipe", "rope_bound"),
    "power_iters": ("GeometryRecipe", "power_iters"),
    "cold_start_iters": ("GeometryRecipe", "cold_start_iters"),
    "alpha": ("Alpha", "value"),
    "delta": ("Alpha", "delta"),
    "calib_steps": ("Alpha", "calib_steps"),
    "quantile": ("Alpha", "quantile"),
    "kappa": ("Alpha", "kappa"),
    "alpha0": ("Alpha", "alpha0"),
    "delayed_recipe": ("DelayedRecipe", "preset"),
    "history_len": ("DelayedRecipe", "history_len"),
    "fp8_format": ("recipe", "fp8_format"),
    "audit": (None, "audit"),
    "compiler": (None, "compiler"),
    "kv_cache": (None, "kv_cache"),
}
_BY_SCALING = {"geometry": GeometryRecipe, "delayed": DelayedRecipe, "current": CurrentRecipe,
               "none": NoScalingRecipe}
_FLAT_DEFAULTS = {f.name: f.default for f in fields(GeoscaleOptions)}
_SPLIT = {"auto": ("scores", "auto"), "fused": ("scores", "fused"),
          "explicit": ("scores", "explicit"), "fp8_qkv": ("qkv", "auto")}


def recipe_spelling(flat: dict) -> dict | None:
    """The ``from_kwargs`` keywords that spell ``flat`` with a recipe, or None where ``flat``
    sets an option of another strategy (it cannot be written as a recipe). A recipe whose
    fields are out of their domain raises (its ValueError)."""
    cls = _BY_SCALING[flat.get("scaling", "geometry")]
    own, alpha, beside = {}, {}, {}
    for name, value in flat.items():
        if name == "scaling":
            continue
        if name == "lowering":
            beside["quantize"], beside["kernel"] = _SPLIT.get(value, (value, value))
            continue
        where, field = SPELLED_AS[name]
        default = value == _FLAT_DEFAULTS[name]
        if where is None:
            beside[field] = value
        elif where == "Alpha" and cls is GeometryRecipe:
            alpha[field] = value
        elif where == "recipe" and cls is not NoScalingRecipe or where == cls.__name__:
            own[field] = value
        elif not default:
            return None
    if alpha:
        own["alpha"] = Alpha(**alpha)
    return dict(recipe=cls(**own), **beside)


def flat_spelling(recipe, **beside) -> dict:
    """The flat keywords of a recipe and the keywords beside it (the inverse table)."""
    inverse = {(w, f): n for n, (w, f) in SPELLED_AS.items()}
    flat = {"scaling": next(s for s, c in _BY_SCALING.items() if isinstance(recipe, c))}
    for f in fields(recipe):
        value = getattr(recipe, f.name)
        if isinstance(value, Alpha):
            flat.update({inverse["Alpha", a.name]: getattr(value, a.name)
                         for a in fields(Alpha)})
        else:
            flat[inverse.get((type(recipe).__name__, f.name),
                             inverse.get(("recipe", f.name)))] = value
    if "quantize" in beside or "kernel" in beside:
        pair = (beside.pop("quantize", "scores"), beside.pop("kernel", "auto"))
        flat["lowering"] = next((k for k, v in _SPLIT.items() if v == pair), "invalid")
    return {**flat, **{inverse[None, k]: v for k, v in beside.items()}}


# --------------------------------------------------------------------------------------
# Domains: each field out of its domain is named
# --------------------------------------------------------------------------------------

#: (class, field) -> values outside the field's domain
BAD = {
    (Alpha, "value"): ("bogus", 0, -1.0, True, None, "relative"),
    (Alpha, "delta"): (0.0, 1.0, -1e-3, "x", True),
    (Alpha, "calib_steps"): (0, -3, 2.5, "10", True),
    (Alpha, "quantile"): (0.0, 1.5, "x"),
    (Alpha, "kappa"): (0.5, -1.0, "x"),
    (Alpha, "alpha0"): ("auto", "bogus", 0, -0.5, True),
    (GeometryRecipe, "granularity"): ("tensor", None, 1),
    (GeometryRecipe, "estimator"): ("svd", None),
    (GeometryRecipe, "alpha"): ("bogus", 0, -1.0, True, None, [1.0]),
    (GeometryRecipe, "eta"): (0.0, 1.2, -0.5, "x", True),
    (GeometryRecipe, "rope_bound"): ("relative", "none", None),
    (GeometryRecipe, "power_iters"): (0, -1, 1.5, True),
    (GeometryRecipe, "cold_start_iters"): (0, 2.0, False),
    (GeometryRecipe, "fp8_format"): ("e3m4", "fp8", None),
    (DelayedRecipe, "preset"): ("nvidia", None),
    (DelayedRecipe, "history_len"): (0, -1, 2.5, True, "16"),
    (DelayedRecipe, "fp8_format"): ("e3m4", None),
    (CurrentRecipe, "fp8_format"): ("e3m4", None),
}


def test_bad_values_cover_every_field():
    assert set(BAD) == {(c, f.name) for c in (Alpha, *RECIPES) for f in fields(c)}


def test_every_value_outside_a_domain_is_named():
    checked = 0
    for (cls, name), values in BAD.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"\b{name}\b") as error:
                cls(**{name: value})
            assert repr(value) in str(error.value) or name == "alpha", str(error.value)
            checked += 1
    assert checked == sum(map(len, BAD.values()))


@pytest.mark.parametrize("kwargs, names", [
    (dict(recipe=GeometryRecipe(), alpha=0.5), ("recipe", "alpha")),
    (dict(recipe=DelayedRecipe(), history_len=4), ("recipe", "history_len")),
    (dict(recipe=CurrentRecipe(), fp8_format="e4m3"), ("recipe", "fp8_format")),
    (dict(recipe=NoScalingRecipe(), scaling="none"), ("recipe", "scaling")),
    (dict(lowering="fp8_qkv", quantize="qkv"), ("lowering", "quantize")),
    (dict(lowering="auto", kernel="auto"), ("lowering", "kernel")),
    (dict(quantize="qkv", kernel="explicit"), ("quantize", "kernel")),
    (dict(quantize="logits"), ("quantize", "scores", "qkv")),
    (dict(kernel="fp8_qkv"), ("kernel", "auto", "fused", "explicit")),
    (dict(recipe=Alpha("theory")), ("recipe", "GeometryRecipe")),
    (dict(recipe="geometry"), ("recipe", "GeometryRecipe")),
    (dict(recipe=GeometryRecipe(), audit="yes"), ("audit",)),
    (dict(recipe=DelayedRecipe(), lowering="fused"), ("lowering", "DelayedRecipe")),
])
def test_a_recipe_and_what_it_sets_name_both(kwargs, names):
    with pytest.raises(ValueError) as error:
        GeoscaleOptions.from_kwargs(**kwargs)
    assert all(n in str(error.value) for n in names), str(error.value)


def test_every_recipe_keyword_clashes_with_a_recipe():
    """Each flat keyword that a recipe spells is refused beside any recipe, even at its
    default value; the keywords beside a recipe are exactly the others."""
    spelled = {n for n, (where, _) in SPELLED_AS.items() if where is not None} | {"scaling"}
    beside = {f.name for f in fields(GeoscaleOptions)} - spelled
    assert beside == {"audit", "lowering", "compiler", "kv_cache"}
    for recipe, name in itertools.product((r() for r in RECIPES), sorted(spelled)):
        with pytest.raises(ValueError, match=rf"recipe=.*\b{name}\b"):
            GeoscaleOptions.from_kwargs(recipe=recipe, **{name: _FLAT_DEFAULTS[name]})


# --------------------------------------------------------------------------------------
# The product of recipe spellings equals the flat spelling
# --------------------------------------------------------------------------------------

#: field -> values, the default first
ALPHA_VALUES = {"value": (1.0, 0.5, "theory", "auto"), "delta": (1e-6, 1e-3),
                "calib_steps": (100, 2), "quantile": (0.9999, 0.5), "kappa": (1.0, 2.0),
                "alpha0": ("theory", 0.5)}
RECIPE_VALUES = {
    GeometryRecipe: {"granularity": ("head", "layer"), "estimator": ("power", "exact"),
                     "eta": (0.8, 0.5), "rope_bound": ("norm_product", "interaction"),
                     "power_iters": (1, 3), "cold_start_iters": (5, 20),
                     "fp8_format": ("e4m3", "e5m2"), "alpha": "ALPHAS"},
    DelayedRecipe: {"preset": ("paper", "te"), "history_len": (None, 4),
                    "fp8_format": ("e4m3", "e5m2")},
    CurrentRecipe: {"fp8_format": ("e4m3", "e5m2")},
    NoScalingRecipe: {},
}
BESIDE = {"quantize": ("scores", "qkv"), "kernel": ("auto", "fused", "explicit"),
          "audit": (False, True)}


def _product(values: dict):
    for combo in itertools.product(*values.values()):
        yield dict(zip(values, combo))


def _built(cls, kwargs: dict):
    try:
        return cls(**kwargs)
    except ValueError as error:
        return error


def _named(error: ValueError, names) -> bool:
    return any(re.search(rf"\b{n}\b", str(error)) for n in names)


def test_alpha_product_constructs_or_names_a_changed_field():
    defaults = {f.name: f.default for f in fields(Alpha)}
    built = [(kw, _built(Alpha, kw)) for kw in _product(ALPHA_VALUES)]
    for kw, alpha in built:
        if isinstance(alpha, ValueError):
            assert _named(alpha, [k for k, v in kw.items() if v != defaults[k]]), (kw, alpha)
    valid = [a for _, a in built if isinstance(a, Alpha)]
    assert len(valid) == 2 + 2 + 24      # numbers; theory × δ; auto × burn-in fields × δ


def _alphas() -> list[Alpha]:
    return [a for kw in _product(ALPHA_VALUES) if isinstance(a := _built(Alpha, kw), Alpha)]


def _recipe_combinations():
    alphas = _alphas()
    for cls, values in RECIPE_VALUES.items():
        values = {k: (alphas if v == "ALPHAS" else v) for k, v in values.items()}
        for own in _product(values):
            for beside in _product(BESIDE):
                yield cls, own, beside


def test_every_recipe_combination_equals_its_flat_spelling():
    accepted = refused = 0
    for cls, own, beside in _recipe_combinations():
        recipe = _built(cls, own)
        defaults = {f.name: f.default for f in fields(cls)}
        changed = [k for k, v in own.items() if v != defaults[k]]
        changed += [k for k, v in beside.items() if v != BESIDE[k][0]]
        if isinstance(recipe, ValueError):           # inside the recipe: named there
            assert _named(recipe, changed), (cls, own, recipe)
            continue
        flat = flat_spelling(recipe, **beside)
        try:
            ours = GeoscaleOptions.from_kwargs(recipe=recipe, **beside)
        except ValueError as error:
            assert _named(error, changed + ["recipe"]), (recipe, beside, str(error))
            with pytest.raises(ValueError):
                GeoscaleOptions(**flat)
            refused += 1
            continue
        assert ours == GeoscaleOptions(**flat), (recipe, beside)
        assert ours.recipe == recipe
        assert (ours.quantize, ours.kernel, ours.audit) == (
            beside["quantize"], beside["kernel"], beside["audit"])
        accepted += 1
    assert accepted > 1000 and refused > 1000, (accepted, refused)


def test_plain_alpha_values_read_as_alpha():
    assert GeometryRecipe(alpha="theory") == GeometryRecipe(alpha=Alpha("theory"))
    assert GeometryRecipe(alpha=0.5).alpha == Alpha(0.5)


# --------------------------------------------------------------------------------------
# The entry points take a recipe
# --------------------------------------------------------------------------------------

def test_entry_points_take_a_recipe():
    from tests.attention_variants import Block

    recipe = GeometryRecipe(granularity="layer", alpha=Alpha("theory", delta=1e-3))
    want = GeoscaleOptions(granularity="layer", alpha="theory", delta=1e-3,
                           lowering="explicit", compiler="aot_eager")
    kwargs = dict(recipe=recipe, kernel="explicit", compiler="aot_eager")
    assert geoscale_fx.backend(**kwargs).options == want
    assert geoscale_fx.wrap(Block(), **kwargs)._geoscale_call.options == want
    assert geoscale_fx.apply_(Block(), **kwargs)._compiled_call_impl.options == want
    assert geoscale_fx.backend(recipe=DelayedRecipe(preset="te")).options == GeoscaleOptions(
        scaling="delayed", delayed_recipe="te")
    with pytest.raises(ValueError, match=r"recipe=GeometryRecipe.*\['alpha'\]"):
        geoscale_fx.wrap(Block(), recipe=recipe, alpha="theory")
