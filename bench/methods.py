"""The FP8 scaling methods compared side by side in every scenario."""
from __future__ import annotations

import geoscale_fx

__all__ = ["METHODS", "TRANSIENT_METHODS", "wrap_with"]

#: name -> GeoscaleOptions. "geometry/head" is this project's default (certified, α = 1);
#: "geometry/layer" is the paper's method (per-layer norm, α = α_min from Eq. 8).
METHODS = {
    "geometry/head": dict(scaling="geometry", granularity="head"),
    "geometry/layer": dict(scaling="geometry", granularity="layer", alpha="theory"),
    "delayed/paper": dict(scaling="delayed", delayed_recipe="paper"),
    "delayed/TE": dict(scaling="delayed", delayed_recipe="te"),
    "current": dict(scaling="current"),
}

TRANSIENT_METHODS = tuple(METHODS)


def wrap_with(model, method: str, *, compiler: str = "aot_eager", **overrides):
    """``model`` wrapped with a named method (audits on unless overridden; an override
    ``scaling="none"``, the unquantized reference, has nothing to audit)."""
    options = {**METHODS[method], "compiler": compiler, **overrides}
    if options.get("scaling", "geometry") != "none":
        options = {"audit": True, **options}
    return geoscale_fx.wrap(model, **options)
