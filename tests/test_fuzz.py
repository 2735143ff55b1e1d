"""Random attention blocks (``tests/fuzz_forms.py``): every one found, supported or refused as
its form says (a refusal names its reason), its certified logit and q/k/v bounds never beaten
by adversarial inputs, ``scaling="none"`` equal to eager, no overflow under audit.

A fast, derandomized profile for CI; ``python -m bench.fuzz --examples 5000`` runs thousands.
"""
from __future__ import annotations

import collections

from hypothesis import HealthCheck, given, settings

from tests import fuzz_forms as ff
from tests.fuzz_forms import NO_NORMALIZATION, Form, check_example, forms

#: examples per run: the file takes about a minute on 2 shared CPU cores
FAST = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

BASE = dict(d_model=32, n_heads=4, n_kv_heads=4, seq=6, norm="layernorm", spread=0.5,
            qkv_bias=True, projection="separate", repeat="repeat_interleave", rank=4,
            rope="none", partial_rope=False, qk_norm="none", scaling="default",
            custom_scale=0.3, attention="eager", mask="masked_fill", alibi=False, softcap=0.0,
            sinks=False, floor=False, seed=3)


def _failure(result) -> str:
    return (f"{result.form}\nmismatch={result.mismatch!r} violations={result.violations} "
            f"none_equals_eager={result.none_equals_eager} ({result.none_max_diff:.3g}) "
            f"overflows={result.overflows} error={result.error!r} reason={result.reason!r}")


@FAST
@given(forms())
def test_random_attention_blocks_are_found_bounded_and_unchanged(form):
    result = check_example(form, steps=8, compiler="eager")    # the forms, not the AOT trace
    assert not result.error, _failure(result)
    assert not result.silent_miss, _failure(result)
    assert result.found == 1 and not result.mismatch, _failure(result)
    assert not result.violations, _failure(result)
    assert not result.gap, _failure(result) + result.gap     # v bounded where it should be
    assert result.none_equals_eager, _failure(result)
    if result.supported:
        assert result.overflows == 0, _failure(result)
        assert max(result.worst.values()) > 0.05, "the search should find sizeable values"


def test_an_unnormalized_block_is_refused_with_the_reason():
    result = check_example(Form(**{**BASE, "norm": "none"}), audit=False)
    assert result.found == 1 and result.supported is False
    assert NO_NORMALIZATION in result.reason and not result.silent_miss
    assert result.ok and result.none_equals_eager


def test_the_checker_reports_a_bound_that_is_too_small():
    """Bounds ×0.05 must be beaten by the search: the check can fail."""
    result = check_example(Form(**BASE), steps=4, audit=False, bound_factor=0.05)
    assert result.supported and not result.ok
    assert {v.split(":")[0] for v in result.violations} >= {"logits", "q", "k", "v"}


def test_the_strategy_draws_every_surface_form():
    """Over a few hundred draws every option of every field appears (no dead branch)."""
    drawn = ff.draw_forms(400, seed=0)
    seen = collections.defaultdict(set)
    for f in drawn:
        for name in ("norm", "projection", "rope", "qk_norm", "scaling", "attention", "dtype"):
            seen[name].add(getattr(f, name))
        seen["mask"].add((f.attention, f.mask))
        seen["repeat"].add(f.repeat if f.n_kv_heads < f.n_heads else None)
        seen["modifier"].update(m for m in ("alibi", "sinks", "floor") if getattr(f, m))
        seen["modifier"].update(["softcap"] if f.softcap else [])
    assert seen["norm"] == set(ff.NORMS) and seen["projection"] == set(ff.PROJECTIONS)
    assert seen["rope"] == set(ff.ROPES) and seen["qk_norm"] == set(ff.QK_NORMS)
    assert seen["scaling"] == set(ff.SCALINGS) and seen["repeat"] >= set(ff.REPEATS)
    assert seen["mask"] == {("eager", m) for m in ff.EAGER_MASKS} | {
        ("sdpa", m) for m in ff.SDPA_MASKS}
    assert seen["modifier"] == {"alibi", "sinks", "floor", "softcap"}
    assert seen["dtype"] == {"float32", "bfloat16"}
    assert all(f.attention == "eager" or not (f.softcap or f.sinks or f.floor) for f in drawn)

