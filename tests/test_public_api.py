"""The public surface of ``geoscale_fx``: every exported name stays what ``__all__`` promises."""
import importlib
import pkgutil
import types

import torch

import geoscale_fx

#: exported names that are submodules on purpose
_MODULES = {"bounds", "spectral"}


def _import_every_submodule() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(geoscale_fx.__path__, prefix="geoscale_fx."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def test_exported_names_survive_importing_every_submodule():
    """Importing a submodule must never replace an exported function of the same name
    (``geoscale_fx.backend`` was shadowed by the module ``geoscale_fx/backend.py``)."""
    imported = _import_every_submodule()
    assert len(imported) > 10
    for name in geoscale_fx.__all__:
        value = getattr(geoscale_fx, name)
        if name in _MODULES:
            assert isinstance(value, types.ModuleType), name
        else:
            assert not isinstance(value, types.ModuleType), f"geoscale_fx.{name} is a module"
            assert callable(value), name


def test_readme_order_entry_point_then_configured_backend():
    """docs/usage.md's order: the registered backend first, then ``geoscale_fx.backend(...)``."""
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True,
                                             norm_first=True).eval()
    torch._dynamo.lookup_backend("geoscale")  # loads the entry point's module
    configured = geoscale_fx.backend(alpha="theory", compiler="eager")
    assert isinstance(configured, geoscale_fx.GeoscaleBackend)
    assert configured.options.alpha == "theory"
    out = torch.compile(layer, backend=configured)(torch.randn(2, 5, 16))
    assert out.shape == (2, 5, 16)


def test_no_submodule_shadows_the_standard_library():
    """``geoscale_fx.inspect`` shadowed ``inspect`` for code run from inside the package."""
    import sys

    stdlib = set(sys.stdlib_module_names)
    clashes = [n for n in _import_every_submodule() if n.rsplit(".", 1)[-1] in stdlib]
    assert clashes == []


def test_in_place_and_wrapper_forms_are_exported():
    """``apply_`` (in place, same object) and ``wrap`` (a wrapper module) are both public, with
    the state file helpers; the in-place form returns the very module it was given."""
    from geoscale_fx.api import conversion, serialization, wrapper

    assert {"apply_", "wrap", "save_state", "load_state"} <= set(geoscale_fx.__all__)
    assert geoscale_fx.apply_ is conversion.apply_ and geoscale_fx.wrap is wrapper.wrap
    assert geoscale_fx.load_state is serialization.load_state
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True,
                                             norm_first=True).eval()
    assert geoscale_fx.apply_(layer, compiler="eager") is layer
    assert type(layer) is torch.nn.TransformerEncoderLayer
    assert isinstance(geoscale_fx.wrap(torch.nn.Linear(2, 2)), geoscale_fx.GeoscaleModule)


def test_the_site_bounds_are_public_names():
    """``site_logit_bound`` and ``site_amax_bounds``, taught in the docs, are reached from the
    package, not through the folder that holds them."""
    from geoscale_fx.numerics import amax, logit_bounds

    assert {"site_logit_bound", "site_amax_bounds"} <= set(geoscale_fx.__all__)
    assert geoscale_fx.site_logit_bound is logit_bounds.site_logit_bound
    assert geoscale_fx.site_amax_bounds is amax.site_amax_bounds
