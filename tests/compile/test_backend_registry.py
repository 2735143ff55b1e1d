"""geoscale_fx.compile.backend_registry: a weak set of live backends (what ``report`` reads)."""
from __future__ import annotations

import gc

from geoscale_fx.compile.backend_registry import BACKENDS, BackendRegistry
from geoscale_fx.compile.dynamo_backend import GeoscaleBackend


class _Backend:
    """Any weakly referenceable object stands in for a backend."""


def test_registered_backends_are_live_once_each():
    registry = BackendRegistry()
    a, b = _Backend(), _Backend()
    registry.register(a)
    registry.register(b)
    registry.register(a)                         # a set: registering again adds nothing
    live = registry.live()
    assert len(live) == 2 and {id(x) for x in live} == {id(a), id(b)}
    assert BackendRegistry().live() == []        # registries do not share backends


def test_a_collected_backend_disappears():
    registry = BackendRegistry()
    kept, dropped = _Backend(), _Backend()
    registry.register(kept)
    registry.register(dropped)
    del dropped
    gc.collect()
    assert registry.live() == [kept]


def test_every_geoscale_backend_registers_and_is_not_kept_alive():
    backend = GeoscaleBackend()
    assert any(b is backend for b in BACKENDS.live())
    ident = id(backend)
    del backend
    gc.collect()
    assert all(id(b) != ident for b in BACKENDS.live())
