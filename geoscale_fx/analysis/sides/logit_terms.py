"""The logit terms of a site whose head vectors are drawn from several projections (MLA).

``S = s · Σ_t ⟨q-side_t, k-side_t⟩``: one term per (query projection, key projection) pair
that the channels of a head vector come from — MLA's latent part and its decoupled RoPE
part are two. ``term_channels`` groups the head channels by that pair (every head must draw
each channel from the same projections, and no rotated pair may straddle two groups);
``term_sides`` describes the sides of one group, maps added to a projection (LoRA) folded in.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.sides.adapter_fold import fold_added_maps
from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.index.index_track import Track, Unsupported
from geoscale_fx.analysis.sides.operand_sides import position_gain, side_of
from geoscale_fx.analysis.sides.provenance import HeadRows, OperandTrace, head_rows
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import check_rotations_within
from geoscale_fx.sites.terms import Side

__all__ = ["term_channels", "term_sides"]


def term_channels(cand: Candidate, q, k, records) -> list[list[int]]:
    """The head channels of each term: one term per (query projection, key projection)
    pair that the channels of a head vector come from (MLA: the latent part and the
    decoupled RoPE part). Every head must draw each channel from the same projections.

    ``q``, ``k``: ``(OperandTrace, HeadRows)``; ``records``: ``{role: ReplayRecords}``."""
    if len(q[0].projections) == 1 and len(k[0].projections) == 1:
        return [list(range(len(q[1].features[0])))]
    roots = []
    for (trace, rows), role in ((q, "query"), (k, "key")):
        features = torch.tensor(rows.features, dtype=torch.long)          # (n, d_h)
        root = trace.root_of(features)
        if not bool((root == root[:1]).all()):
            raise Unsupported(f"`{cand.node.name}`: the {role}'s heads draw the same channel "
                              "from different projections")
        roots.append(root[0].tolist())
    groups: dict[tuple[int, int], list[int]] = {}
    for channel, pair in enumerate(zip(*roots)):
        groups.setdefault(pair, []).append(channel)
    if len(groups) > 1:
        for (trace, rows), role in ((q, "query"), (k, "key")):
            check_rotations_within(cand, role, rows, records[role], list(groups.values()))
    return list(groups.values())


def term_sides(cand: Candidate, role: str, trace: OperandTrace, track: Track, rows: HeadRows,
               channels, records: ReplayRecords, kinds: ValueKinds) -> list[Side]:
    """The sides of the head channels ``channels`` of the operand (one, or one per map
    added to the projection with an input of its own)."""
    if len(trace.projections) == 1 and len(channels) == track.shape[-1]:
        side = side_of(trace, rows, records, kinds, features=rows.features)
        sides = fold_added_maps(cand, role, trace, 0, rows, side, records, kinds)
    else:
        index = torch.tensor(channels)
        sub = Track(*(bc.take_last(t, index) for t in track.fields()))
        sub_rows = head_rows(sub, cand.node, role)
        root = int(trace.root_of(torch.tensor(rows.features[0][channels[0]])))
        part = trace.part(root, sub)
        offset = trace.projections[root][1]
        features = tuple(tuple(head[c] - offset for c in channels) for head in rows.features)
        rows = replace(sub_rows, features=tuple(tuple(head[c] for c in channels)
                                                for head in rows.features))
        side = side_of(part, replace(rows, features=features), records, kinds,
                       features=features, offset=offset)
        sides = fold_added_maps(cand, role, trace, root, rows, side, records, kinds)
    gain = position_gain(cand, role, rows, records)
    return [replace(side, position_gain=gain) for side in sides]
