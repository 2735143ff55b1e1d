"""nn.MultiheadAttention and TransformerEncoderLayer's fast path: sides from the packed weight."""
import math

import pytest
import torch
from torch import nn

from tests.analysis_checks import analysed_site

B, L, D, H = 2, 5, 16, 4
DH = D // H


class NormedMHA(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True, **kwargs)

    def forward(self, x, mask=None):
        h = self.norm(x)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]


def test_mha_sides_are_the_packed_rows_of_each_head():
    site = analysed_site(NormedMHA(), torch.randn(B, L, D), torch.zeros(L, L))
    assert site.supported, site.reason
    assert (site.kind, site.n_q_heads, site.n_kv_heads, site.head_dim) == ("mha", H, H, DH)
    assert site.softmax_scale == pytest.approx(1 / math.sqrt(DH))
    assert site.has_mask and not site.is_causal
    assert site.q.features[1] == tuple(range(DH, 2 * DH))
    assert site.k.features[0] == tuple(range(D, D + DH))           # keys: rows D.. of in_proj
    assert site.q.weight == site.k.weight and site.q.source.norm == "layernorm"


def test_a_learned_bias_k_is_refused_with_its_reason():
    site = analysed_site(NormedMHA(add_bias_kv=True), torch.randn(B, L, D))
    assert not site.supported
    assert site.reason.endswith("keys include a learned bias_k / static_k that is not a "
                                "projection of the input")


def test_the_encoder_layer_fast_path_is_one_term_on_its_own_layernorm():
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, batch_first=True, norm_first=True).eval()
    with torch.no_grad():
        site = analysed_site(layer, torch.randn(B, L, D))
    assert site.supported, site.reason
    assert (site.kind, site.n_q_heads, site.head_dim, site.q_len) == ("encoder_layer", H, DH, L)
    assert site.softmax_scale == pytest.approx(1 / math.sqrt(DH))
    assert site.q.source.norm == "layernorm" and not site.has_mask
    assert site.k.features[-1] == tuple(range(D + (H - 1) * DH, 2 * D))
