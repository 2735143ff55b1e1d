"""Maps added to a projection (LoRA): folded into the weight, a side of their own, or refused."""
import torch
import torch.nn.functional as F
from torch import nn

from tests.analysis_checks import analysed_site

B, L, D, H, R = 2, 5, 16, 2, 3
DH = D // H


class Adapted(nn.Module):
    """``q = W h + s·B(A h')``: ``h' = h`` (fold), ``dropout(h)`` (own side) or a biased B."""

    def __init__(self, dropout=0.0, bias=False, scale=0.5):
        super().__init__()
        self.norm = nn.RMSNorm(D)        # no norm bias: dropout may scale x̂ alone
        self.q, self.k = nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.a, self.b = nn.Linear(D, R, bias=False), nn.Linear(R, D, bias=bias)
        self.dropout, self.scale = dropout, scale

    def forward(self, x):
        h = self.norm(x)
        adapter_in = F.dropout(h, self.dropout, training=True) if self.dropout else h
        q = self.q(h) + self.scale * self.b(self.a(adapter_in))
        q, k = (t.view(B, L, H, DH).transpose(1, 2) for t in (q, self.k(h)))
        return F.scaled_dot_product_attention(q, k, k)


def _site(model):
    return analysed_site(model, torch.randn(B, L, D))


def test_an_adapter_on_the_same_source_folds_into_the_weight_with_its_scale():
    site = _site(Adapted(scale=0.5))
    assert site.supported, site.reason
    assert len(site.terms) == 1
    ((inner, outer, ratio),) = site.q.low_rank
    assert ratio == 0.5 and inner is not None and outer != site.q.weight
    assert len(site.q.low_rank_params) == 2 and not site.k.low_rank


def test_an_adapter_reading_dropout_of_the_input_is_a_side_of_its_own():
    site = _site(Adapted(dropout=0.25))
    assert site.supported, site.reason
    assert len(site.terms) == 2                       # (W, k) and (s·B·A, k)
    adapter = site.terms[1].q
    assert adapter.weight_scale == 0.5 and adapter.low_rank == ()
    assert adapter.source.radius_factor > site.terms[0].q.source.radius_factor


def test_an_added_map_with_a_bias_is_refused_naming_it():
    site = _site(Adapted(bias=True))
    assert not site.supported
    assert "the query's added map" in site.reason
    assert site.reason.endswith("has a bias or a dense weight layout")
