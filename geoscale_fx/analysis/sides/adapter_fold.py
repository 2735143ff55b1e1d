"""Maps added to a side's projection output (LoRA adapters): folded into its weight, or
sides of their own.

A LoRA adapter adds ``s·B(A x)`` to ``W x`` (feature f of the sum is feature f of each map;
``ReplayRecords.sums`` holds ``(features kept, features added, s)``). When both maps read
the same normalized source the side's weight is ``W + s·B·A`` (``Side.low_rank``); when the
adapter reads its own input (adapter dropout in training: ``A`` reads ``dropout(x)``) it is
a side of its own, and ``q·k`` is the sum over every pair of query and key sides, one term
each. A sum that is not a second map of the same features (a mix of two projections), or an
added map with a bias or a dense layout, or a map added to (or made by) a low-precision
linear, is refused naming the attention node.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, parameter_name
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.operand_sides import input_source
from geoscale_fx.analysis.sides.provenance import HeadRows, OperandTrace
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.sites.terms import Side

__all__ = ["fold_added_maps"]


def fold_added_maps(cand: Candidate, role: str, trace: OperandTrace, root: int, rows: HeadRows,
                    side: Side, records: ReplayRecords, kinds: ValueKinds) -> list[Side]:
    """``[side with W + s·B·A folded in] + [one side per adapter with its own input]``;
    ``[side]`` when nothing was added to its projection (``root``: its index in ``trace``)."""
    if not records.sums or side.weight is None:
        return [side]
    offset = trace.projections[root][1]
    mine = torch.tensor(sorted({f for head in rows.features for f in head}))
    extras, params, separate = [], [], []
    for kept, added, ratio in records.sums:
        inside = torch.isin(kept.long(), mine)
        if not bool(inside.any()):
            continue
        mix = Unsupported(f"`{cand.node.name}`: the {role} adds to its projection a map that "
                          "is not a second map of the same features (a mix of two projections)")
        kept, added = kept[inside], added[inside]    # a fused QKV: this side's features only
        other = trace.root_of(added)
        if not bool((other == other[0]).all()) or not bool(torch.isin(mine, kept.long()).all()):
            raise mix
        projection, other_offset = trace.projections[int(other[0])]
        if int(other[0]) == root or not bool(((added - other_offset) == (kept - offset)).all()):
            raise mix
        if projection.bias is not None or projection.layout != "linear":
            raise Unsupported(f"`{cand.node.name}`: the {role}'s added map "
                              f"`{projection.root.name}` has a bias or a dense weight layout")
        if side.cast is not None or projection.cast is not None:
            raise Unsupported(f"`{cand.node.name}`: the {role}'s projection adds a map "
                              f"`{projection.root.name}` to a low-precision linear's output "
                              "(an adapter on an FP8 linear): not supported")
        source = input_source(projection.x, kinds, projection.root)
        inner = projection.inner.name if projection.inner is not None else None
        names = tuple(parameter_name(n) for n in (projection.inner, projection.weight)
                      if n is not None and n.op == "placeholder")
        if source == side.source:      # one source, two maps: W + s·B·A
            extras.append((inner, projection.weight.name, ratio))
            params += names
        else:                          # adapter dropout: its own input, a term of its own
            separate.append(replace(side, source=source, weight=projection.weight.name,
                                    layout="linear", inner=inner, weight_scale=ratio, bias=None,
                                    weight_param=names[-1], bias_param="",
                                    low_rank=(), low_rank_params=names[:-1]))
    main = replace(side, low_rank=tuple(extras), low_rank_params=tuple(params))
    return [main] + separate
