"""``pair_heads`` (query head → key head) and ``score_head_period``."""
from types import SimpleNamespace

import pytest
import torch

from geoscale_fx.analysis.sides.head_mapping import pair_heads, score_head_period
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import HeadRows


def _rows(head_of_row, width=2):
    heads = sorted(set(torch.as_tensor(head_of_row).reshape(-1).tolist()))
    features = tuple(tuple(range(h * width, (h + 1) * width)) for h in heads)
    return HeadRows(features, torch.as_tensor(head_of_row), 1.0, 0.0, False)


def _cand(gqa=False):
    return SimpleNamespace(gqa=gqa, node=SimpleNamespace(name="attn"))


def test_grouped_key_heads_map_contiguously_and_are_reordered_by_first_use():
    q = _rows(torch.arange(4))
    k = _rows(torch.tensor([1, 1, 0, 0]))            # key head 1 serves query heads 0 and 1
    mapping, k_features = pair_heads(_cand(), q, k)
    assert mapping == [0, 0, 1, 1]
    assert k_features == ((2, 3), (0, 1))


def test_enable_gqa_repeats_key_heads():
    mapping, k_features = pair_heads(_cand(gqa=True), _rows(torch.arange(4)),
                                     _rows(torch.arange(2)))
    assert mapping == [0, 0, 1, 1] and k_features == ((0, 1), (2, 3))


def test_a_non_contiguous_grouping_is_refused_with_the_mapping():
    with pytest.raises(Unsupported, match=r"`attn`: query heads share key heads in a "
                                          r"non-contiguous grouping \[0, 1, 0, 1\]"):
        pair_heads(_cand(), _rows(torch.arange(4)), _rows(torch.tensor([0, 1, 0, 1])))


def test_a_query_head_reading_different_keys_per_batch_entry_is_refused():
    q = _rows(torch.tensor([[0, 1], [0, 1]]))
    k = _rows(torch.tensor([[0, 1], [1, 0]]))
    with pytest.raises(Unsupported, match="query head 0 reads different key heads"):
        pair_heads(_cand(), q, k)


def test_score_head_period_over_batch_and_heads():
    assert score_head_period(torch.arange(4).repeat(2, 1)) == ((0, 1, 2, 3), ())
    assert score_head_period(torch.zeros(1, 3, dtype=torch.long)) == ((0,), ())


def test_heads_along_the_outer_dim_have_no_period_and_fix_the_lead():
    heads = torch.arange(3).unsqueeze(1).expand(3, 2)     # heads outside the batch
    assert score_head_period(heads) == ((0, 0, 1, 1, 2, 2), (3, 2))
