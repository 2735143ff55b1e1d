"""Rotated pairs must stay inside one head and one term; ``rotated_partners``."""
from types import SimpleNamespace

import pytest
import torch

from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import HeadRows
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotation_pairs import (
    check_rotations_whole, check_rotations_within, rotated_partners,
)
from geoscale_fx.sites.terms import Rotary

CAND = SimpleNamespace(node=SimpleNamespace(name="attn"))


def _records(pairs: list[tuple[int, int]], rotaries: int = 1) -> ReplayRecords:
    records = ReplayRecords(lambda node: None)
    features = torch.tensor([f for f, _ in pairs])
    partners = torch.tensor([p for _, p in pairs])
    records.partners.append((features, partners))
    for _ in range(rotaries):
        records.record(Rotary("rotate_half", 1.0, True, (), "cos", "sin"))
    return records


def _rotate_half_pairs(n_heads: int, d_h: int) -> list[tuple[int, int]]:
    half = d_h // 2
    return [(h * d_h + j, h * d_h + (j + half) % d_h) for h in range(n_heads)
            for j in range(d_h)]


def _rows(features):
    return HeadRows(features, torch.arange(len(features)), 1.0, 1.0, False)


def test_partners_per_head_channel_for_rotate_half():
    heads = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rotated_partners(heads, 0, _records(_rotate_half_pairs(2, 4))) == (2, 3, 0, 1)


def test_partners_unknown_for_stacked_rotations():
    assert rotated_partners(((0, 1, 2, 3),), 0, _records(_rotate_half_pairs(1, 4), 2)) == ()


def test_a_pair_split_by_a_slice_after_rope_is_refused():
    records = _records(_rotate_half_pairs(1, 4))
    check_rotations_whole(CAND, "query", _rows(((0, 1, 2, 3),)), records)    # whole: fine
    with pytest.raises(Unsupported, match="`attn`: the query keeps half of a rotated pair"):
        check_rotations_whole(CAND, "query", _rows(((0, 1),)), records)


def test_a_pair_split_between_two_terms_is_refused():
    records = _records([(2, 3), (3, 2)])
    rows = _rows(((0, 1, 2, 3),))
    check_rotations_within(CAND, "key", rows, records, [[0, 1], [2, 3]])     # each pair in one
    with pytest.raises(Unsupported, match="`attn`: the key rotates a channel of one "
                                          "projection with a channel of another"):
        check_rotations_within(CAND, "key", rows, records, [[0, 1, 2], [3]])
