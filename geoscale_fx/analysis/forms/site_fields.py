"""The fields every analyzer fills in an ``AttentionSite``: heads, scales, terms, modifiers.

``softmax_scale = s · gain`` (``s``: the score scale read off the graph; ``gain``: scalar
factors on the operands, ``Side.operand_gain``), the query/key lengths, the terms of the
logits, the score modifiers in graph order (each draft's ``site_modifier``,
``analysis.modifiers``) and the query head of each score slice
(``head_mapping.score_head_period``). A softmax scale that is not a compile-time constant is
refused naming the attention node.
"""
from __future__ import annotations

import math

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.sides.head_mapping import score_head_period
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.sites.terms import Term

__all__ = ["site_fields"]


def site_fields(cand: Candidate, terms: list[Term], gain, q_len, kv_len, head_of_row,
                head_dim: int | None = None, kinds: ValueKinds | None = None) -> dict:
    """Keyword arguments of ``AttentionSite`` for a supported site (``head_of_row``: the
    query head of each leading index of the scores; ``kinds``: to bound a sink computed
    from the activations)."""
    if not math.isfinite(cand.scale):
        raise Unsupported(f"`{cand.node.name}`: the softmax scale is not a compile-time constant")
    score_heads, score_lead = score_head_period(head_of_row)
    return dict(
        n_q_heads=terms[0].q.n_heads, n_kv_heads=terms[0].k.n_heads,
        head_dim=head_dim or terms[0].q.head_dim,
        softmax_scale=cand.scale * gain, score_scale=cand.scale, is_causal=cand.is_causal,
        has_mask=cand.has_mask, dropout_p=cand.dropout_p, q_len=q_len, kv_len=kv_len,
        terms=tuple(terms),
        modifiers=tuple(draft.site_modifier(cand, kinds) for draft in cand.modifiers),
        score_heads=score_heads, score_lead=score_lead)

