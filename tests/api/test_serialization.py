"""geoscale_fx.api.serialization: ``geoscale_state.safetensors`` beside the weights — round trip,
the weights' fingerprint (‖W‖² float64) and what a mismatch does. The state is built with
``attach_state`` (no compile)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn

from geoscale_fx.compile.attach import attach_state
from geoscale_fx.api.serialization import STATE_FILE, install_save_pretrained, load_state, save_state
from geoscale_fx.sites.state import StateSpec

SPECS = [StateSpec("u", (3,), warm=True), StateSpec("sigma", (1,))]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 6))


def _with_state(model: nn.Module, value: float):
    site = attach_state(model).get_or_create("attn", SPECS, "cpu")
    site.u.fill_(value)
    site.sigma.fill_(2 * value)
    return site


def test_round_trip_restores_values_warm_with_the_weights_fingerprint(tmp_path):
    from safetensors import safe_open

    source = _model()
    _with_state(source, 0.25)
    path = save_state(source, tmp_path)
    assert path == str(tmp_path / STATE_FILE)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["sites.attn.sigma", "sites.attn.u"]
    fingerprint = json.loads(meta["weights"])
    assert meta["producer"] == "geoscale_fx" and set(fingerprint) == {
        "0.weight", "0.bias", "1.weight", "1.bias"}
    w = source[1].weight.detach().double()
    assert fingerprint["1.weight"] == ["torch.float32", pytest.approx(float((w * w).sum()),
                                                                      rel=1e-12)]
    target = _model()                                   # same weights, fresh state
    site = _with_state(target, 0.0)
    assert site.cold and load_state(target, tmp_path) is True
    assert site.u.tolist() == [0.25] * 3 and site.sigma.tolist() == [0.5]
    assert not site.cold


def test_a_site_created_later_picks_its_saved_state_up(tmp_path):
    source = _model()
    _with_state(source, 0.75)
    save_state(source, tmp_path)
    target = _model()
    assert load_state(target, tmp_path) is True        # no site yet: stashed
    site = attach_state(target).get_or_create("attn", SPECS, "cpu")
    assert site.u.tolist() == [0.75] * 3 and not site.cold


def test_other_weights_or_no_file_leave_the_state_cold(tmp_path, caplog):
    source = _model()
    _with_state(source, 0.5)
    save_state(source, tmp_path)
    other = _model()
    with torch.no_grad():
        other[1].weight.mul_(1.001)
    site = _with_state(other, 0.0)
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        assert load_state(other, tmp_path) is False
    assert site.u.tolist() == [0.0] * 3 and site.cold
    assert any("parameter 1.weight changed" in r.getMessage() for r in caplog.records)
    assert load_state(source, tmp_path / "elsewhere") is False


def test_save_state_without_state_is_refused():
    with pytest.raises(ValueError, match="Sequential has no geoscale state"):
        save_state(_model(), "unused")


def test_save_pretrained_also_writes_the_state_file(tmp_path):
    class Pretrained(nn.Linear):
        def save_pretrained(self, directory, **kwargs):
            torch.save(self.weight, f"{directory}/weights.pt")
            return "saved"

    model, untouched = Pretrained(4, 4), Pretrained(4, 4)
    _with_state(model, 1.0)
    install_save_pretrained(model)
    assert "save_pretrained" in model.__dict__ and "save_pretrained" not in untouched.__dict__
    assert model.save_pretrained(str(tmp_path)) == "saved"
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE, "weights.pt"]
