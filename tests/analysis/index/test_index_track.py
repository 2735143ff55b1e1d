"""geoscale_fx.analysis.index.index_track: the index tracker's root, its broadcast storage, and ``map`` /
``with_`` (tests/analysis/index/test_index_replay.py replays graphs with it)."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.analysis.index.index_track import Track, Unsupported


def test_root_numbers_features_from_the_offset_and_rows_in_order():
    t = Track.root((2, 3, 4), offset=8)
    assert t.shape == (2, 3, 4)
    for b in range(2):
        for j in range(3):
            assert t.feat[b, j].tolist() == [8, 9, 10, 11]
            assert t.tok[b, j].tolist() == [b * 3 + j] * 4          # flat row of P
    assert bool((t.gain == 1).all()) and bool((t.rot == 0).all()) and bool((t.src == 0).all())
    assert (t.feat.dtype, t.tok.dtype, t.gain.dtype, t.src.dtype) == (
        torch.int32, torch.int32, torch.float32, torch.int32)
    # O(F + rows) storage: broadcast along what an index does not depend on
    assert t.feat.stride()[:2] == (0, 0) and t.tok.stride()[-1] == 0
    assert t.gain.stride() == (0, 0, 0)


def test_map_applies_to_every_field_and_with_replaces_some():
    t = Track.root((2, 6))
    heads = t.map(lambda x: x.reshape(2, 3, 2).transpose(0, 1))        # (H, rows, d_h)
    assert heads.shape == (3, 2, 2)
    assert heads.feat[1].tolist() == [[2, 3], [2, 3]] and heads.tok[1].tolist() == [[0, 0],
                                                                                    [1, 1]]
    negated = t.with_(gain=-t.gain)
    assert bool((negated.gain == -1).all()) and negated.feat is t.feat
    assert [f for f in Track.FIELDS] == ["feat", "tok", "gain", "rot", "src"]
    assert len(t.fields()) == 5


def test_unsupported_is_the_one_error_of_the_analysis():
    from geoscale_fx.analysis.fx import dtensor
    from geoscale_fx.analysis.index import index_replay
    from geoscale_fx.analysis.norms import normalization

    # every pass raises this very class, so one ``except Unsupported`` catches them all
    assert index_replay.Unsupported is Unsupported and dtensor.Unsupported is Unsupported
    assert normalization.Unsupported is Unsupported
    with pytest.raises(Unsupported, match="`q_proj`: reason"):
        raise Unsupported("`q_proj`: reason")
