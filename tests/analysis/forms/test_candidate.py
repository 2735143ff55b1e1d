"""``Candidate`` is complete and read-only when find_sites returns it."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.forms.candidate import Candidate, CandidateDraft
from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.modifiers.draft import ModifierDraft
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.softcap import Softcap


def _found(fn, *args):
    (graph,) = capture_graphs(fn, *args)
    return find_candidates(graph.gm.graph, ValueKinds(graph.gm.graph, graph.example_inputs))


def test_a_found_candidate_cannot_be_changed_in_place():
    q = torch.randn(2, 3, 5, 8)
    (cand,) = _found(lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) * 0.5 + 1.0, -1) @ v,
                     q, q.clone(), q.clone())
    assert (cand.kind, cand.scale, cand.has_mask) == ("explicit", 0.5, True)
    (mask,) = cand.modifiers
    assert (type(mask), mask.modifier, mask.kind, mask.node.name) == (ModifierDraft, Mask, "mask",
                                                                       "add")
    assert isinstance(cand.modifiers, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cand.scale = 1.0
    with pytest.raises(TypeError):
        cand.roles["scores"] = cand.node
    assert set(cand.roles) == {"scores", "softmax", "pv", "logits"}


def test_replace_derives_a_new_candidate_and_leaves_the_old_one():
    cand = Candidate("mha", "node", roles={"attention": "node"})
    wider = dataclasses.replace(cand, has_mask=True, scale=0.125)
    assert (wider.has_mask, wider.scale, dict(wider.roles)) == (True, 0.125,
                                                                {"attention": "node"})
    assert (cand.has_mask, cand.scale) == (False, 1.0)


def test_a_draft_freezes_into_a_candidate_with_every_value_and_default():
    draft = CandidateDraft("explicit", "softmax", scale=2.0)
    draft.scale *= 0.5
    draft.modifiers.insert(0, ModifierDraft(Softcap, "mul", 30.0))
    draft.roles["scores"] = "mm"
    cand = draft.freeze()
    assert cand == Candidate("explicit", "softmax", scale=1.0, roles={"scores": "mm"},
                             modifiers=(ModifierDraft(Softcap, "mul", 30.0),))
    assert (cand.key_layout, cand.gqa, cand.failure) == ("kd", False, "")
    draft.roles["pv"] = "mm2"                       # the draft stays separate
    assert "pv" not in cand.roles
