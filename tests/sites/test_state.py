"""Per-site scaling state: buffers from specs, in-place restore, checkpoint stash, site keys."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from geoscale_fx.sites.state import GeoscaleState, SiteState, StateSpec, site_key

LOGGER = "geoscale_fx"


def _specs(n: int = 3, d: int = 4) -> list[StateSpec]:
    """A site's layout in a deliberately non-alphabetical order, two warm tensors."""
    return [StateSpec("steps", ()), StateSpec("scale", (n,), 1.0),
            StateSpec("u", (n, d), warm=True), StateSpec("v", (n, d), warm=True),
            StateSpec("alpha", (n,), 0.5), StateSpec("count", (), dtype=torch.int64)]


def _values(specs: list[StateSpec], offset: float = 1.0) -> dict[str, torch.Tensor]:
    """Distinct non-default values for every spec (for restore / load round trips)."""
    out = {}
    for i, s in enumerate(specs):
        n = max(1, int(torch.tensor(s.shape).prod()))
        out[s.name] = (torch.arange(n, dtype=torch.float64) + offset + 10 * i).reshape(
            s.shape).to(s.dtype)
    return out


# --------------------------------------------------------------------------------------
# SiteState
# --------------------------------------------------------------------------------------

def test_buffers_take_shape_dtype_and_fill_from_their_specs():
    """Each spec becomes a buffer of its shape and dtype, filled with its constant."""
    state = SiteState(_specs(3, 4) + [StateSpec("h", (5,), 2.5, dtype=torch.float64)], "cpu")
    assert tuple(state.steps.shape) == () and state.steps.item() == 0.0
    assert torch.equal(state.scale, torch.ones(3))
    assert torch.equal(state.u, torch.zeros(3, 4)) and state.u.dtype == torch.float32
    assert torch.equal(state.alpha, torch.full((3,), 0.5))
    assert state.count.dtype == torch.int64 and state.count.item() == 0
    assert state.h.dtype == torch.float64 and torch.equal(state.h, torch.full((5,), 2.5,
                                                                             dtype=torch.float64))
    assert set(dict(state.named_buffers())) == set(state.names)


def test_callable_fill_is_called_and_cast_to_the_spec_dtype():
    """A callable fill provides the initial tensor (cast to the spec's dtype)."""
    calls = []

    def fill():
        calls.append(1)
        return torch.arange(6, dtype=torch.float64).reshape(2, 3)

    state = SiteState([StateSpec("w", (2, 3), fill, dtype=torch.float32)], "cpu")
    assert len(calls) == 1
    assert state.w.dtype == torch.float32
    assert torch.equal(state.w, torch.arange(6.0).reshape(2, 3))


def test_tensors_and_as_dict_follow_spec_order():
    """tensors() and as_dict() list the buffers in spec order (the graph's input order)."""
    specs = _specs()
    state = SiteState(specs, "cpu")
    names = [s.name for s in specs]
    assert list(state.names) == names
    assert list(state.as_dict()) == names
    assert [id(t) for t in state.tensors()] == [id(getattr(state, n)) for n in names]
    assert [id(t) for t in state.as_dict().values()] == [id(t) for t in state.tensors()]
    assert state.warm_names == {"u", "v"}


def test_restore_copies_in_place_keeping_the_tensor_objects():
    """restore() writes into the very tensors the compiled graph holds."""
    specs = _specs()
    state = SiteState(specs, "cpu")
    before = [(id(t), t.data_ptr()) for t in state.tensors()]
    saved = _values(specs)
    state.restore(saved)
    assert [(id(t), t.data_ptr()) for t in state.tensors()] == before
    for name, value in saved.items():
        assert torch.equal(getattr(state, name), value), name


def test_restore_ignores_unknown_names():
    """Entries the site does not have are skipped (no error, no new buffer)."""
    state = SiteState(_specs(), "cpu")
    state.restore({"not_a_state": torch.ones(2), "scale": torch.full((3,), 7.0)})
    assert "not_a_state" not in state.names
    assert not hasattr(state, "not_a_state")
    assert torch.equal(state.scale, torch.full((3,), 7.0))


def test_restore_warns_and_ignores_a_shape_mismatch(caplog):
    """A checkpointed tensor of another shape is logged and left out; the rest is restored."""
    state = SiteState(_specs(3, 4), "cpu")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        state.restore({"scale": torch.full((5,), 9.0), "alpha": torch.full((3,), 2.0)})
    assert torch.equal(state.scale, torch.ones(3))          # untouched
    assert torch.equal(state.alpha, torch.full((3,), 2.0))  # restored
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(records) == 1
    assert "scale" in records[0].getMessage() and "(5,)" in records[0].getMessage()


@pytest.mark.parametrize("restored, cold", [
    ({"u", "v"}, False),
    ({"u", "v", "scale", "steps"}, False),
    ({"u"}, True),
    ({"scale", "steps"}, True),
    (set(), True),
])
def test_restore_makes_the_site_warm_only_with_every_warm_tensor(restored, cold):
    """cold flips to False only when every warm spec came back."""
    specs = _specs()
    state = SiteState(specs, "cpu")
    values = _values(specs)
    state.restore({n: values[n] for n in restored})
    assert state.cold is cold


def test_restore_with_a_mismatched_warm_tensor_stays_cold():
    """A warm tensor ignored for its shape does not make the site warm."""
    state = SiteState(_specs(3, 4), "cpu")
    state.restore({"u": torch.ones(2, 4), "v": torch.ones(3, 4)})
    assert torch.equal(state.u, torch.zeros(3, 4))
    assert state.cold is True


def test_site_without_warm_specs_is_warm_once_its_state_came_back():
    """A site with no warm tensors (the exact estimator carries nothing between steps) is
    warm when its state came back, and stays cold when nothing of it did."""
    state = SiteState([StateSpec("scale", (2,), 1.0)], "cpu")
    state.restore({"other": torch.zeros(2)})
    assert state.cold is True
    state.restore({"scale": torch.full((2,), 3.0)})
    assert state.cold is False


def test_restore_resets_calib_seen():
    """The host mirror of the calibration count is re-read after a restore."""
    state = SiteState(_specs(), "cpu")
    state.calib_seen = 17
    state.restore({})
    assert state.calib_seen is None


# --------------------------------------------------------------------------------------
# GeoscaleState
# --------------------------------------------------------------------------------------

def test_get_or_create_returns_the_same_site_for_the_same_layout():
    """Same key and specs: the existing SiteState (and its tensors) come back."""
    gs = GeoscaleState()
    a = gs.get_or_create("blk", _specs(), "cpu")
    a.scale.fill_(3.0)
    b = gs.get_or_create("blk", _specs(), "cpu")
    assert b is a
    assert torch.equal(b.scale, torch.full((3,), 3.0))
    assert list(gs.sites) == ["blk"]


def test_get_or_create_shares_one_state_between_graphs_of_a_site():
    """Another graph of the same site (decode after prefill) gets the same SiteState: a
    subset of its buffers as they are, new buffers added (and the site marked cold, so that
    they are initialised from the weights)."""
    gs = GeoscaleState()
    a = gs.get_or_create("blk", _specs(), "cpu")
    a.scale.fill_(3.0)
    a.cold = False
    assert gs.get_or_create("blk", _specs()[:-1], "cpu") is a and not a.cold
    extra = StateSpec("w_extra", (2,), 5.0, warm=True)
    b = gs.get_or_create("blk", _specs() + [extra], "cpu")
    assert b is a and b.cold and b.names[-1] == "w_extra"
    assert torch.equal(b.w_extra, torch.full((2,), 5.0))
    assert torch.equal(b.scale, torch.full((3,), 3.0))          # kept
    assert [t.shape for t in b.tensors(("w_extra", "scale"))] == [(2,), (3,)]


@pytest.mark.parametrize("changed", [_specs(n=5), _specs(d=7)])
def test_get_or_create_reinitialises_when_the_layout_changes(changed):
    """Another shape under a key replaces the site with a fresh one."""
    gs = GeoscaleState()
    a = gs.get_or_create("blk", _specs(), "cpu")
    a.scale.fill_(3.0)
    b = gs.get_or_create("blk", changed, "cpu")
    assert b is not a and gs.sites["blk"] is b
    assert b.names == tuple(s.name for s in changed)
    for s in changed:
        assert tuple(getattr(b, s.name).shape) == s.shape
    assert torch.equal(b.scale, torch.ones_like(b.scale))


def test_state_dict_keys_are_sites_key_name():
    """Keys: sites.<key>.<name>, every site and every tensor, with their values."""
    gs = GeoscaleState()
    specs = _specs()
    s0 = gs.get_or_create("h_0", specs, "cpu")
    gs.get_or_create("h_1", specs[:2], "cpu")
    s0.scale.fill_(4.0)
    sd = gs.state_dict()
    expected = {f"sites.h_0.{s.name}" for s in specs} | {f"sites.h_1.{s.name}"
                                                          for s in specs[:2]}
    assert set(sd) == expected
    assert torch.equal(sd["sites.h_0.scale"], torch.full((3,), 4.0))


def _saved(specs, names=None, offset=1.0, prefix="sites.blk."):
    values = _values(specs, offset)
    return {f"{prefix}{n}": v for n, v in values.items() if names is None or n in names}


def test_load_before_the_site_exists_is_stashed_without_unexpected_keys():
    """A fresh state accepts a checkpoint strictly; nothing is created until the site is."""
    gs = GeoscaleState()
    result = gs.load_state_dict(_saved(_specs()), strict=True)
    assert result.unexpected_keys == [] and result.missing_keys == []
    assert len(gs.sites) == 0
    assert set(gs.sites.pending) == {"blk"}
    assert set(gs.sites.pending["blk"]) == {s.name for s in _specs()}


def test_a_stashed_entry_is_restored_when_its_site_is_created():
    """get_or_create picks up its stashed values (and is warm with its warm tensors)."""
    specs = _specs()
    saved = _saved(specs, offset=3.0)
    gs = GeoscaleState()
    gs.load_state_dict(saved, strict=True)
    for value in saved.values():
        value.add_(100)   # the stash is a copy, not a view of the caller's tensors
    site = gs.get_or_create("blk", specs, "cpu")
    for name, value in _values(specs, 3.0).items():
        assert torch.equal(getattr(site, name), value), name
    assert site.cold is False
    assert "blk" not in gs.sites.pending
    other = gs.get_or_create("other", specs, "cpu")   # no stash: defaults, cold
    assert other.cold is True and torch.equal(other.scale, torch.ones(3))


def test_a_stashed_entry_without_warm_tensors_leaves_the_site_cold():
    """Stashed values without every warm tensor restore what they have; the site stays cold."""
    specs = _specs()
    gs = GeoscaleState()
    gs.load_state_dict(_saved(specs, names={"scale", "u"}, offset=2.0), strict=True)
    site = gs.get_or_create("blk", specs, "cpu")
    assert torch.equal(site.scale, _values(specs, 2.0)["scale"])
    assert torch.equal(site.v, torch.zeros(3, 4))
    assert site.cold is True


def test_round_trip_through_a_parent_module_prefix():
    """Registered on a model (keys carry its prefix): save, load into a fresh model, warm."""
    specs = _specs()
    src = nn.Module()
    src.geoscale = GeoscaleState()
    s = src.geoscale.get_or_create("blk", specs, "cpu")
    s.restore(_values(specs, 5.0))
    sd = src.state_dict()
    assert "geoscale.sites.blk.u" in sd
    dst = nn.Module()
    dst.geoscale = GeoscaleState()
    result = dst.load_state_dict(sd, strict=True)
    assert result.unexpected_keys == []
    site = dst.geoscale.get_or_create("blk", specs, "cpu")
    assert site.cold is False
    for name in s.names:
        assert torch.equal(getattr(site, name), getattr(s, name)), name


@pytest.mark.parametrize("names, cold", [
    (None, False),                               # everything
    ({"u", "v"}, False),                         # the warm tensors alone
    ({"u", "scale", "steps"}, True),             # v missing
    ({"scale"}, True),
])
def test_load_into_an_existing_site_marks_it_cold_iff_warm_tensors_are_missing(names, cold):
    """Existing sites load in place and are warm iff every warm tensor was in the checkpoint."""
    specs = _specs()
    gs = GeoscaleState()
    site = gs.get_or_create("blk", specs, "cpu")
    site.cold = not cold      # start from the opposite, so the load must set it
    site.calib_seen = 3
    tensors = [id(t) for t in site.tensors()]
    result = gs.load_state_dict(_saved(specs, names, offset=7.0), strict=False)
    assert site.cold is cold
    assert site.calib_seen is None
    assert [id(t) for t in site.tensors()] == tensors
    loaded = set(site.names) if names is None else names
    for name in loaded:
        assert torch.equal(getattr(site, name), _values(specs, 7.0)[name]), name
    assert sorted(result.missing_keys) == sorted(f"sites.blk.{n}" for n in site.names
                                                 if n not in loaded)


def test_load_with_unknown_and_known_sites_together():
    """Existing sites load in place, unknown ones are stashed; strict load passes."""
    specs = _specs()
    gs = GeoscaleState()
    site = gs.get_or_create("blk", specs, "cpu")
    sd = {**_saved(specs, offset=2.0), **_saved(specs, offset=4.0, prefix="sites.later.")}
    result = gs.load_state_dict(sd, strict=True)
    assert result.unexpected_keys == [] and result.missing_keys == []
    assert torch.equal(site.u, _values(specs, 2.0)["u"]) and site.cold is False
    assert set(gs.sites.pending) == {"later"}
    later = gs.get_or_create("later", specs, "cpu")
    assert torch.equal(later.u, _values(specs, 4.0)["u"]) and later.cold is False


def test_mark_cold_marks_every_site():
    """mark_cold(): every site re-initialises from the weights at its next call."""
    gs = GeoscaleState()
    sites = [gs.get_or_create(k, _specs(), "cpu") for k in ("a", "b")]
    for s in sites:
        s.restore(_values(_specs()))
    assert [s.cold for s in sites] == [False, False]
    gs.mark_cold()
    assert [s.cold for s in sites] == [True, True]


# --------------------------------------------------------------------------------------
# site_key
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, key", [
    ("transformer.h.0.attn", "transformer_h_0_attn"),
    ("model.layers.11.self_attn", "model_layers_11_self_attn"),
    ("blocks[0]/attn@3", "blocks_0__attn_3"),
    ("plain_name", "plain_name"),
    ("", "site"),
])
def test_site_key_sanitizes_module_paths(name, key):
    """Every character outside [0-9A-Za-z_] becomes '_' (empty: 'site')."""
    assert site_key(name, set()) == key


def test_site_key_deduplicates_against_taken_keys():
    """A taken key gets the first free suffix _2, _3, ..."""
    taken = {"transformer_h_0_attn"}
    assert site_key("transformer.h.0.attn", taken) == "transformer_h_0_attn_2"
    taken.add("transformer_h_0_attn_2")
    assert site_key("transformer.h.0.attn", taken) == "transformer_h_0_attn_3"
    assert site_key("transformer.h.1.attn", taken) == "transformer_h_1_attn"
    keys: set[str] = set()
    for _ in range(4):
        keys.add(site_key("a.b", keys))
    assert keys == {"a_b", "a_b_2", "a_b_3", "a_b_4"}
