"""What ``find_sites`` found: one attention of a graph and what was read off it, as data.

``Candidate`` is read-only and complete when ``find_sites`` returns it: the operands and
their layout, the softmax scale (the product of the scalar factors on the scores), the
causal / mask / dropout / GQA flags, the graph nodes by role, the score modifiers in graph
order (``analysis.modifiers.draft.ModifierDraft``), and — for a softmax over ``QKᵀ`` that
is not in the normal form — why (``failure``).
``CandidateDraft`` is the mutable form the walk from a softmax fills in before freezing it.

Example::

    cand = Candidate("mha", node, roles={"attention": node})
    wider = dataclasses.replace(cand, has_mask=True)      # cand itself never changes
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional

from torch.fx import Node

if TYPE_CHECKING:
    from geoscale_fx.analysis.modifiers.draft import ModifierDraft

__all__ = ["Candidate", "CandidateDraft"]


@dataclass(frozen=True)
class Candidate:
    """An attention found in a graph and what was read off it, filled completely by
    ``find_sites``.

    Read-only (``roles`` a read-only mapping, ``modifiers`` a tuple): an analyzer that reads
    more off an opaque op derives a new one with ``dataclasses.replace``.
    """
    kind: str                           # "sdpa" | "explicit" | "mha" | "encoder_layer"
    node: Node
    query: Optional[Node] = None
    key: Optional[Node] = None
    key_layout: str = "kd"              # key operand: "kd" (…, L', D) or "dk" (…, D, L')
    query_perm: Optional[tuple] = None  # einsum: permutation of the query to (…, L, D)
    key_perm: Optional[tuple] = None
    scale: float = 1.0                  # scalar factors on the scores (softmax scale)
    is_causal: bool = False
    has_mask: bool = False
    dropout_p: float = 0.0
    gqa: bool = False
    roles: Mapping[str, Node] = field(default_factory=dict)
    modifiers: tuple[ModifierDraft, ...] = ()   # in graph order
    failure: str = ""                   # why a softmax over QKᵀ is not in the normal form

    def __post_init__(self):
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))
        object.__setattr__(self, "modifiers", tuple(self.modifiers))


class CandidateDraft:
    """A candidate while ``find_sites``' walk from one softmax fills it in (mutable);
    ``freeze`` gives the ``Candidate``."""

    def __init__(self, kind: str, node: Node, **values):
        self.kind, self.node = kind, node
        for f in fields(Candidate)[2:]:
            default = f.default_factory() if f.default is MISSING else f.default
            setattr(self, f.name, values.get(f.name, default))
        self.roles, self.modifiers = dict(self.roles), list(self.modifiers)

    def freeze(self) -> Candidate:
        return Candidate(**{f.name: getattr(self, f.name) for f in fields(Candidate)})
