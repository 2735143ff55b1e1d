"""geoscale_fx.api.dcp_state: ``load_scaling_state`` from a DCP checkpoint, single process.
The state is built with ``attach_state`` (no compile)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402

from geoscale_fx.compile.attach import attach_state  # noqa: E402
from geoscale_fx.api.dcp_state import load_scaling_state  # noqa: E402
from geoscale_fx.sites.state import StateSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")

SPECS = [StateSpec("v", (4,), warm=True), StateSpec("scale", (2,))]


def _model_with_state(fill: float):
    model = nn.Linear(4, 4)
    site = attach_state(model).get_or_create("layers_0_attn", SPECS, "cpu")
    site.v.fill_(fill)
    site.scale.copy_(torch.tensor([fill, -fill]))
    return model, site


def test_state_comes_back_warm_into_existing_and_later_sites(tmp_path):
    saved, _ = _model_with_state(0.5)
    dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path))
    existing, site = _model_with_state(0.0)
    assert site.cold
    assert load_scaling_state(existing, checkpoint_id=str(tmp_path)) == 2
    assert site.v.tolist() == [0.5] * 4 and site.scale.tolist() == [0.5, -0.5]
    assert not site.cold
    fresh = nn.Linear(4, 4)                        # a fresh process: no site yet
    attach_state(fresh)
    assert load_scaling_state(fresh, checkpoint_id=str(tmp_path)) == 2
    later = fresh.geoscale_state.get_or_create("layers_0_attn", SPECS, "cpu")
    assert later.v.tolist() == [0.5] * 4 and not later.cold
    holder = nn.Module()                            # a wrapper holding the model as .model
    holder.model = existing
    assert load_scaling_state(holder, checkpoint_id=str(tmp_path)) == 2


def test_a_checkpoint_without_state_loads_nothing_and_says_so(tmp_path, caplog):
    dcp.save(nn.Linear(4, 4).state_dict(), checkpoint_id=str(tmp_path))
    model, site = _model_with_state(0.25)
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        assert load_scaling_state(model, checkpoint_id=str(tmp_path)) == 0
    assert site.v.tolist() == [0.25] * 4
    assert any("holds no scaling state (keys geoscale_state.*)" in r.getMessage()
               for r in caplog.records)


def test_a_model_without_state_is_refused():
    with pytest.raises(ValueError, match="Linear has no geoscale scaling state"):
        load_scaling_state(nn.Linear(2, 2), checkpoint_id="unused")
