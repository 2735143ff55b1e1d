"""geoscale_fx.analysis.modifiers.draft: what a recognizer returns, and the site modifier a
draft becomes."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.analysis.modifiers.softcap import Softcap


def test_a_draft_is_its_kinds_modifier_named_by_the_node():
    draft = ModifierDraft(Softcap, SimpleNamespace(name="mul_3"), 30.0)
    assert draft.kind == "softcap"
    modifier = draft.site_modifier(cand=None, kinds=None)
    assert modifier == Softcap("mul_3", 30.0) and type(modifier) is Softcap
    with pytest.raises(dataclasses.FrozenInstanceError):
        draft.value = 1.0


def test_a_route_by_default_carries_the_scale_and_flags_nothing():
    route = Route("add", ModifierDraft(Softcap, "mul"))
    assert (route.factor, route.masks, route.logits, route.names_blocker) == \
        (1.0, False, False, False)
    assert math.isnan(route.draft.value)
