"""The sdpa / explicit analyzer: query and key traced to their projections."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.analysis_checks import analysed_site

B, L, D, H, KV = 2, 5, 16, 4, 2
DH = D // H


class Attention(nn.Module):
    """GQA self-attention; ``kv_order`` reorders the key heads before they are repeated."""

    def __init__(self, kv_order=(0, 1), explicit=False):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, KV * DH), nn.Linear(D, KV * DH)
        self.kv_order, self.explicit = list(kv_order), explicit

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h).view(B, L, H, DH).transpose(1, 2)                      # (B, H, L, dh)
        k = self.k(h).view(B, L, KV, DH).transpose(1, 2)[:, self.kv_order]   # (B, KV, L, dh)
        v = self.v(h).view(B, L, KV, DH).transpose(1, 2)
        k = k.repeat(1, H // KV, 1, 1) if self.kv_order == [1, 0] else \
            k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        if self.explicit:
            return F.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _site(model):
    return analysed_site(model, torch.randn(B, L, D))


def test_gqa_sdpa_heads_features_and_value_side():
    site = _site(Attention())
    assert site.supported and site.certified, site.reason
    assert (site.kind, site.n_q_heads, site.n_kv_heads, site.head_dim) == ("sdpa", H, KV, DH)
    assert site.softmax_scale == pytest.approx(1 / math.sqrt(DH)) and site.is_causal
    assert site.q.features[3] == tuple(range(3 * DH, 4 * DH))
    assert site.k.features == (tuple(range(DH)), tuple(range(DH, 2 * DH)))
    assert site.q.source.norm == "rmsnorm" and len(site.terms) == 1
    assert site.value is not None and site.value.features == site.k.features


def test_explicit_form_reads_its_scale():
    site = _site(Attention(explicit=True))
    assert site.supported, site.reason
    assert site.kind == "explicit" and site.softmax_scale == pytest.approx(0.3)


def test_key_heads_shared_in_a_non_contiguous_grouping_are_refused():
    site = _site(Attention(kv_order=(1, 0)))       # query heads 0..3 read keys 1, 0, 1, 0
    assert not site.supported
    assert "query heads share key heads in a non-contiguous grouping [0, 1, 0, 1]" in \
        site.reason
