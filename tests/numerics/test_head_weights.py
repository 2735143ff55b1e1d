"""geoscale_fx.numerics.head_weights: per-head weights against explicit slicing of W, on hand-built
sites (no tracing)."""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from geoscale_fx.numerics import head_weights
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.terms import Side, Source, Term

D, DH = 6, 2
# interleaved features: head h of q reads rows 4h, 4h+1 of a fused (F, d) weight
Q_FEATURES = ((0, 1), (4, 5), (8, 9))
K_FEATURES = ((2, 3), (6, 7), (10, 11))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(12, D, generator=g, dtype=torch.float64),     # (F, d), "linear"
            "b": torch.randn(12, generator=g, dtype=torch.float64),
            "gain": torch.rand(D, generator=g, dtype=torch.float64) + 0.5,
            "shift": torch.randn(D, generator=g, dtype=torch.float64)}


def _side(features, with_affine: bool) -> Side:
    ops = (("mul", "gain"), ("add", "shift")) if with_affine else ()
    return Side(Source("layernorm", "ln", D, ops), "w", "linear", features,
                bias="b" if with_affine else None)


def _site(tensors, with_affine: bool, scale: float = 0.5, **kw) -> AttentionSite:
    term = Term(_side(Q_FEATURES, with_affine), _side(K_FEATURES, with_affine))
    return AttentionSite(name="attn", index=0, kind="explicit", node="softmax", supported=True,
                         n_q_heads=3, n_kv_heads=3, head_dim=DH, softmax_scale=scale,
                         terms=(term,), _resolve=tensors.__getitem__, **kw)


def test_side_heads_is_the_explicit_slice_of_w_with_gain_offset_and_bias():
    t = _tensors(0)
    a, c = head_weights.side_heads(_side(Q_FEATURES, True), t.__getitem__)
    assert a.shape == (3, D, DH) and c.shape == (3, DH)
    for h, rows in enumerate(Q_FEATURES):
        w_h = t["w"][list(rows)]                                    # (d_h, d)
        # q_h = W_h (gain ⊙ x̂ + shift) + b_h = (diag(gain) W_hᵀ)ᵀ x̂ + (W_h shift + b_h)
        torch.testing.assert_close(a[h], torch.diag(t["gain"]) @ w_h.T, rtol=1e-12, atol=0)
        torch.testing.assert_close(c[h], w_h @ t["shift"] + t["b"][list(rows)],
                                   rtol=1e-12, atol=1e-12)


def test_gather_heads_and_bias_for_a_dense_contiguous_layout():
    w = torch.arange(4 * 8, dtype=torch.float64).reshape(4, 8)         # (d, F), "dense"
    a = head_weights.gather_heads(w, "dense", ((2, 3), (4, 5)))
    torch.testing.assert_close(a, torch.stack([w[:, 2:4], w[:, 4:6]]))
    bias = torch.arange(10, dtype=torch.float64)
    # offset: bias index = feature + offset (MHA's separate q/k/v rows of one bias)
    assert head_weights.gather_bias(bias, ((2, 3), (4, 5)), offset=3).tolist() == [[5, 6], [7, 8]]
    assert head_weights.gather_bias(None, ((0, 1),)) is None


def test_fold_channel_ops_composes_gains_and_offsets_in_order():
    g1, b1, g2 = torch.tensor([2.0, 3.0]), torch.tensor([1.0, -1.0]), torch.tensor([5.0, 7.0])
    # ((x̂·g1) + b1)·g2 + 4 = x̂·(g1 g2) + (b1 g2 + 4)
    gain, offset = head_weights.fold_channel_ops(
        (("mul", g1), ("add", b1), ("mul", g2), ("add", 4.0)), lambda n: None, 2)
    assert gain.tolist() == [10.0, 21.0]
    assert offset.tolist() == [9.0, -3.0]
    # a scalar gain
    gain, offset = head_weights.fold_channel_ops((("mul", 0.5),), lambda n: None, 3)
    assert gain.tolist() == [0.5, 0.5, 0.5] and offset is None


def test_refusals_name_the_problem():
    t = _tensors(3)
    unsupported = AttentionSite(name="attn", index=0, kind="sdpa", node="sdpa_1",
                                reason="no normalization before `q_proj`")
    with pytest.raises(ValueError, match="sdpa_1.*not supported: no normalization"):
        head_weights.site_head_weights(unsupported)
    one = _site(t, False)
    two = replace(one, terms=one.terms * 2)
    with pytest.raises(ValueError, match="has 2 terms; use head_weights.site_term_weights"):
        head_weights.site_head_weights(two)
    assert len(head_weights.site_term_weights(two)) == 2


def test_key_head_norms_is_the_max_norm_per_head():
    keys = torch.randn(2, 7, 3, 4, dtype=torch.float64)          # (B, L, H, d_h): heads axis 2
    norms = head_weights.key_head_norms(keys, (2, 3))
    expected = [max(float(keys[b, j, h].norm()) for b in range(2) for j in range(7))
                for h in range(3)]
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, torch.tensor(expected, dtype=torch.float32))


def test_key_head_norms_of_a_symbolic_length_leaves_no_shape_environment_behind():
    """Traced with a symbolic cache length (as a decode step's compile traces it), the norms
    keep nothing of the trace's ``ShapeEnv`` once the trace is gone: torch 2.11's ``reshape``
    of a viewable tensor with a symbolic stride kept a reference to it from C++, so every
    such compile of a model stayed alive after the model (``tests/test_memory.py``)."""
    def trace() -> weakref.ref:
        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env)
        length = StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
        keys = mode.from_tensor(torch.randn(1, 2, 8, 16), symbolic_context=length,
                                source=ConstantSource("keys"))       # (B, H, L, d_h)
        with mode:
            norms = head_weights.key_head_norms(keys, (1, 3))
        assert tuple(norms.shape) == (2,)
        return weakref.ref(env)

    env = trace()
    for method in vars(ShapeEnv).values():   # its memoized methods hold every ShapeEnv
        for cached in (method, getattr(method, "__wrapped__", None)):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    gc.collect()
    assert env() is None
