"""geoscale_fx.analysis.fx.dtensor, single process: ``HeadShard`` labels, plain tensors passing
through, and a one-rank gloo mesh (conftest's ``one_rank_mesh``) for ``local_region`` and the
refusal of a partial sum."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from geoscale_fx.analysis.fx.dtensor import (
    HeadShard, dtensor_of, local_region, replay_dtensor, to_local,
)
from geoscale_fx.analysis.index.index_track import Track, Unsupported

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


class _Node:
    """A stand-in graph node: replay reads only its name and arguments for these ops."""
    name, args, kwargs = "redistribute_1", (), {}


def test_head_shard_labels():
    assert HeadShard((0,), (1,), 2, (2, 3), 4).label == "tp 1/2: heads 2-3 of 4"
    assert HeadShard((0,), (0,), 4, (0,), 4).label == "tp 0/4: heads 0 of 4"
    assert HeadShard((0, 1), (1, 0), 4, (5, 1), 8).label == "tp 1x0/4: heads 5,1 of 8"
    assert HeadShard((0,), (0,), 2, (-1, -1), 4).label == "tp 0/2: heads -1,-1 of 4"


def test_plain_tensors_are_no_dtensors_and_pass_through():
    t = torch.randn(3)
    assert dtensor_of(t) is None and to_local(t) is t and to_local(3) == 3
    track = Track.root((2, 4))
    assert replay_dtensor(_Node(), "redistribute", track) is track
    with pytest.raises(Unsupported, match=r"`redistribute_1` \(scatter\): DTensor op not "
                                          "understood"):
        replay_dtensor(_Node(), "scatter", track)


def test_local_region_of_a_one_rank_shard_and_a_partial_sum_refused(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Partial, Shard

    w = torch.randn(8, 4)
    sharded = DTensor.from_local(w, one_rank_mesh, [Shard(0)])
    assert dtensor_of(sharded) is sharded and torch.equal(to_local(sharded), w)
    assert local_region(sharded, "w") == ((0, 0), (8, 4))
    partial = DTensor.from_local(w, one_rank_mesh, [Partial()])
    with pytest.raises(Unsupported, match="`w` is a DTensor with a partial sum"):
        local_region(partial, "w")
