"""The values' side: traced to their projection, or a reason; never makes a site unsupported."""
import torch
import torch.nn.functional as F
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph

B, L, D, H = 2, 5, 16, 2
DH = D // H


class Attention(nn.Module):
    def __init__(self, raw_values=False, explicit=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.raw_values, self.explicit = raw_values, explicit

    def forward(self, x):
        h = self.norm(x)
        q, k, v = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.raw_values:                       # values straight from the residual stream
            v = x.view(B, L, H, DH).transpose(1, 2)
        if self.explicit:
            return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        return F.scaled_dot_product_attention(q, k, v)


def _site(model):
    (graph,) = capture_graphs(model, torch.randn(B, L, D))
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    return site, graph


def test_values_of_sdpa_and_of_the_explicit_form_are_their_projection():
    for explicit in (False, True):
        site, graph = _site(Attention(explicit=explicit))
        assert site.supported and site.value is not None, site.value_reason
        assert site.value.weight != site.q.weight and site.value.weight != site.k.weight
        assert site.value.features == site.k.features and site.value_reason == ""
        assert site.value.position_gain == 1.0


def test_values_without_a_projection_give_a_reason_and_the_site_stays_supported():
    site, _ = _site(Attention(raw_values=True))
    assert site.supported, site.reason
    assert site.value is None and site.value_reason
    assert site.value_reason != site.reason
