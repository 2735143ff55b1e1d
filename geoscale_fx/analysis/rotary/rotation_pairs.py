"""Where the pairs a rotary embedding rotates together sit: inside one head, inside one term.

``index_replay.replay`` records every rotated element as ``(feature, partner)`` (projection
features, ``ReplayRecords.partners``). A rotation's bound ``‖R q‖ ≤ rot·‖q‖`` holds for a
head vector only if each pair is whole in it: a slice after RoPE that keeps one element of
a pair, or a pair split between two terms of the logits (MLA), is refused with a reason
naming the attention node. ``rotated_partners`` gives ``Side.pairs``: per head channel, the
channel it is rotated with.
"""
from __future__ import annotations

import functools

import torch

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import HeadRows
from geoscale_fx.analysis.index.replay_records import ReplayRecords

__all__ = ["rotated_partners", "check_rotations_whole", "check_rotations_within",
           "partners_within", "index_table"]


def rotated_partners(features, offset: int, records: ReplayRecords) -> tuple[int, ...]:
    """Per head channel, the channel it is rotated with (-1: not rotated), the same in every
    head; () when not known (stacked rotations, or heads that differ)."""
    if len(records.rotaries) != 1 or not features:
        return ()
    if len({len(head) for head in features}) != 1:
        return ()
    heads = index_table(tuple(tuple(head) for head in features)) + offset
    partner = _partner_table(records, int(heads.max()) + 1)          # feature -> partner
    width = partner.numel()
    # position of every feature inside its own head (-1: not in that head)
    position = torch.full((heads.shape[0], width), -1, dtype=torch.long)
    position.scatter_(1, heads, torch.arange(heads.shape[1]).expand_as(heads).contiguous())
    partners = partner[heads]                                         # (heads, head_dim)
    rotated = partners >= 0
    rows = torch.where(rotated, position.gather(1, partners.clamp(min=0)), -1)
    if bool((rotated & (rows < 0)).any()):
        return ()      # a partner outside the head (checked elsewhere) or another term
    if bool((rows != rows[0]).any()):
        return ()
    return tuple(rows[0].tolist())


@functools.lru_cache(maxsize=256)
def index_table(rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``rows`` (equal lengths) as a long tensor, built once per distinct table: the heads'
    feature tables of a model's layers repeat, and each is checked several times. Read-only
    (callers derive new tensors from it)."""
    return torch.tensor(rows, dtype=torch.long)


def _partner_table(records: ReplayRecords, width: int) -> torch.Tensor:
    """``table[f]``: the feature rotated with feature ``f`` (-1: none), over at least
    ``width`` features (the last recorded pairing of a feature wins)."""
    width = max([width] + [int(t.max()) + 1 for pair in records.partners for t in pair
                           if t.numel()])
    table = torch.full((width,), -1, dtype=torch.long)
    for feature, partner in records.partners:
        table[feature.long()] = partner.long()
    return table


def check_rotations_whole(cand: Candidate, role: str, rows: HeadRows,
                          records: ReplayRecords) -> None:
    """Each rotated pair must stay inside one head vector: a slice after RoPE keeps values
    that mix in a dropped partner, and the rotation bound would not hold for what is left."""
    partners_within(records, rows.features, f"`{cand.node.name}`: the {role} keeps half of "
                    "a rotated pair (a slice after the rotary embedding)")


def check_rotations_within(cand: Candidate, role: str, rows: HeadRows,
                           records: ReplayRecords, terms) -> None:
    """A rotation pair split between two terms would mix them: each term's bound would not
    hold for its rotated channels."""
    groups = [[head[c] for head in rows.features for c in channels] for channels in terms]
    partners_within(records, groups, f"`{cand.node.name}`: the {role} rotates a channel of "
                    "one projection with a channel of another")


def partners_within(records: ReplayRecords, groups, message: str) -> None:
    """Every rotated element whose feature is in one of ``groups`` has its partner in the
    same group, else ``Unsupported(message)``."""
    if not records.partners:
        return
    groups = tuple(tuple(features) for features in groups)
    if not any(groups):
        return
    if len({len(g) for g in groups}) == 1:      # equal heads: one cached (n, d_h) table
        table = index_table(groups)
        features = table.reshape(-1)
        members = torch.arange(len(groups)).repeat_interleave(table.shape[1])
    else:
        features = torch.tensor([f for group in groups for f in group], dtype=torch.long)
        members = torch.repeat_interleave(torch.arange(len(groups)),
                                          torch.tensor([len(g) for g in groups]))
    width = max([int(features.max())] + [int(t.max()) for pair in records.partners
                                         for t in pair if t.numel()]) + 1
    group_of = torch.full((width,), -1, dtype=torch.long)        # -1: in no group
    group_of[features] = members
    for feature, partner in records.partners:
        own = group_of[feature.long()]
        if bool(((own >= 0) & (group_of[partner.long()] != own)).any()):
            raise Unsupported(message)
