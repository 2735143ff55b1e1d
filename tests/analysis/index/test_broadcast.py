"""geoscale_fx.analysis.index.broadcast: each op equals its torch counterpart on the materialized
tensors, and keeps broadcast (stride-0) dimensions broadcast."""
from __future__ import annotations

import torch

from geoscale_fx.analysis.index import broadcast as bc


def _feat(shape=(2, 5, 6)):
    """Feature indices of a (B, L, F) projection output: constant along B and L."""
    return torch.arange(shape[-1]).expand(shape)


def _tok(shape=(2, 5, 6)):
    return torch.arange(shape[0] * shape[1]).view(shape[0], shape[1], 1).expand(shape)


def test_compact_narrows_only_broadcast_dims():
    t = _feat()
    c = bc.compact(t)
    assert c.shape == (1, 1, 6) and torch.equal(c.expand(t.shape), t)
    dense = torch.randn(2, 3)
    assert bc.compact(dense) is not dense and torch.equal(bc.compact(dense), dense)


def test_elementwise_and_take_last_equal_torch_and_stay_broadcast():
    f, t = _feat(), _tok()
    out = bc.elementwise(lambda a, b: a * 100 + b, f, t)
    assert torch.equal(out, f * 100 + t)
    gain = torch.full((), 3).expand(f.shape)            # a scalar gain, broadcast everywhere
    scaled = bc.elementwise(torch.mul, f, gain)
    assert torch.equal(scaled, f * 3) and scaled.stride() == (0, 0, 1)
    index = torch.tensor([5, 0, 3])
    picked = bc.take_last(f, index)                     # compact: broadcasts to t[..., index]
    assert picked.shape == (1, 1, 3)
    assert torch.equal(picked.expand(2, 5, 3), f[..., index])
    assert torch.equal(bc.take_last(_tok(), index), _tok()[..., index])
    assert bc.all_equal(f, f.clone()) and not bc.all_equal(f, f.flip(-1))


def test_concat_and_stack_equal_torch_and_keep_shared_broadcast_dims():
    a, b = _feat((2, 5, 6)), torch.arange(6, 12).expand(2, 5, 6)
    for dim in (-1, 1):
        out = bc.concat([a, b], dim)
        assert torch.equal(out, torch.cat([a, b], dim))
        assert out.stride()[0] == 0                 # batch stays broadcast
    stacked = bc.concat([a, b], 0, stack=True)
    assert torch.equal(stacked, torch.stack([a, b], 0))


def test_reshape_equals_torch_and_keeps_merged_broadcast_groups():
    t = _tok((2, 5, 6))                                  # broadcast along F only
    out = bc.reshape(t, (10, 2, 3))                      # (B·L) merged, F split
    assert torch.equal(out, t.reshape(10, 2, 3))
    assert out.stride()[1:] == (0, 0)                    # the split F stays broadcast
    f = _feat((2, 5, 6))
    split = bc.reshape(f, (2, 5, 2, 3))                  # heads: F → (H, d_h)
    assert torch.equal(split, f.reshape(2, 5, 2, 3)) and split.stride()[:2] == (0, 0)
    assert torch.equal(bc.reshape(f, (-1, 6)), f.reshape(-1, 6))
