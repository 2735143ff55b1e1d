"""Options: every invalid value or combination is a ValueError naming the option(s)."""
import pytest

from geoscale_fx.config import GeoscaleOptions


@pytest.mark.parametrize("kwargs,names", [
    (dict(scaling="delayed", alpha="auto"), ("alpha", "scaling")),
    (dict(scaling="current", granularity="layer"), ("granularity", "scaling")),
    (dict(scaling="none", estimator="exact"), ("estimator", "scaling")),
    (dict(scaling="delayed", rope_bound="interaction"), ("rope_bound", "scaling")),
    (dict(scaling="geometry", delayed_recipe="te"), ("delayed_recipe", "scaling")),
    (dict(history_len=8), ("history_len", "scaling")),
    (dict(kappa=2.0), ("kappa", "alpha")),
    (dict(calib_steps=10), ("calib_steps", "alpha")),
    (dict(rope_bound="relative"), ("rope_bound", "scaling")),
    (dict(lowering="fused", audit=True), ("lowering", "audit")),
    (dict(lowering="fused", scaling="current"), ("lowering", "scaling")),
])
def test_invalid_combinations_name_both_options(kwargs, names):
    with pytest.raises(ValueError) as info:
        GeoscaleOptions(**kwargs)
    assert all(name in str(info.value) for name in names), str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(scaling="delayed", delayed_recipe="te", history_len=8),
    dict(alpha="auto", calib_steps=10, kappa=1.5, quantile=0.99),
    dict(scaling="geometry", granularity="layer", alpha="theory", estimator="exact"),
    dict(scaling="current", audit=True),
    dict(lowering="explicit", audit=True),
])
def test_valid_combinations(kwargs):
    options = GeoscaleOptions(**kwargs)
    assert all(getattr(options, k) == v for k, v in kwargs.items())


def test_scores_cast_config_mirrors_the_options():
    cast = GeoscaleOptions(fp8_format="e5m2", eta=0.5, granularity="layer").scores
    assert (cast.target, cast.fp8_format, cast.eta, cast.granularity, cast.scaling) == \
        ("scores", "e5m2", 0.5, "layer", "geometry")


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="unknown geoscale option.*'alhpa'"):
        GeoscaleOptions.from_kwargs(alhpa=1.0)
