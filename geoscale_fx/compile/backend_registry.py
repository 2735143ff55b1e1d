"""Every live geoscale backend: how ``report`` finds the sites of a model it holds no backend of.

``torch.compile(model, backend="geoscale")`` keeps the backend it creates to itself, so each
``GeoscaleBackend`` registers itself here when it is created, and ``report`` (through
``reporting.site_records``) asks every live one which of its sites read the model's
parameters. The registry holds backends weakly: it never keeps a backend, or the graphs and
scaling state it holds, alive.

    registry = BackendRegistry()
    registry.register(backend)
    assert registry.live() == [backend]      # until ``backend`` is garbage collected
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geoscale_fx.compile.dynamo_backend import GeoscaleBackend

__all__ = ["BackendRegistry", "BACKENDS"]


class BackendRegistry:
    """A weak set of backends: ``register`` one, ``live()`` lists those still alive."""

    def __init__(self) -> None:
        self._backends: "weakref.WeakSet[GeoscaleBackend]" = weakref.WeakSet()

    def register(self, backend: "GeoscaleBackend") -> None:
        self._backends.add(backend)

    def live(self) -> list["GeoscaleBackend"]:
        """The registered backends not yet collected, in no particular order (a copy: safe
        to iterate while backends are created or collected)."""
        return list(self._backends)


#: The registry every ``GeoscaleBackend`` registers into (``dynamo_backend``) and ``report``
#: reads (``reporting``).
BACKENDS = BackendRegistry()
