"""What a modifier's recognizer returns: the ways the scores come through an op (``Route``)
and what the op is then (``ModifierDraft``, the graph node before it is a site's
``Modifier``).

The walk from a softmax back to ``Q Kᵀ`` (``analysis.forms.find_sites``) asks every
registered kind about each op it meets (``registry.routes_through``); a kind that
recognises the op answers with routes, each an operand the scores may come through and the
draft the op becomes when they do. The walk goes on from the first operand that leads to
``Q Kᵀ`` and records the draft, in graph order, in ``Candidate.modifiers``; the analyzer
turns each draft into the site's ``Modifier`` (``ModifierDraft.site_modifier``).

Example::

    Route(scores, ModifierDraft(Softcap, mul, 30.0), factor=30.0, logits=True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch.fx import Node

from geoscale_fx.sites.terms import Modifier

if TYPE_CHECKING:
    from geoscale_fx.analysis.fx.graph_ops import ValueKinds

__all__ = ["ModifierDraft", "Route"]


@dataclass(frozen=True)
class ModifierDraft:
    """A score modifier the walk found: its kind's class, the graph node, its value."""
    modifier: type[Modifier]
    node: Node                       # the op (a sink: the node of the sink logits)
    value: float = float("nan")      # softcap: |c|; position bias: β

    @property
    def kind(self) -> str:
        return self.modifier.kind

    def site_modifier(self, cand, kinds: Optional[ValueKinds]) -> Modifier:
        """The site's ``Modifier`` (``cand``: the ``Candidate``, named by a refusal;
        ``kinds``: the graph's value kinds, None where the form has no graph to read)."""
        return self.modifier(self.node.name, self.value)


@dataclass(frozen=True)
class Route:
    """One way the scores may come through a recognised op, and what the op then is.

    ``operand`` is the op's input the walk goes on from towards ``Q Kᵀ``; a route of
    ``in_product`` names the product op itself (it computes ``Q Kᵀ`` and adds ``draft`` to
    it: baddbmm's β·bias, an SDPA's mask), where the walk ends.
    """
    operand: object                  # a Node, or a constant the walk cannot follow
    draft: ModifierDraft
    #: scalar factor on ``Q Kᵀ`` through this route: S's scale is the walk's below times it
    #: (a softcap's c, baddbmm's α)
    factor: float = 1.0
    #: the op masks or biases the scores (``Candidate.has_mask``)
    masks: bool = False
    #: the op's output is what the softmax input is made of (the ``logits`` role, quantized):
    #: scalar factors between it and the softmax do not scale S
    logits: bool = False
    #: when the scores do not come through ``operand``, the op that stopped the walk below
    #: it is the one a refusal names
    names_blocker: bool = False
