"""Keys read from a KV cache: recognised (``reads_cache``), bounded by their observed norms."""
import torch
import torch.nn.functional as F
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.forms.cached_key_sites import reads_cache
from geoscale_fx.analysis.fx.graph_ops import op_of

B, L, P, D, H = 2, 3, 4, 16, 2
DH = D // H


class Cached(nn.Module):
    """``k = cat([past, W_k h])``; ``merged`` folds heads into the batch (3-D keys)."""

    def __init__(self, merged=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.merged = merged

    def forward(self, x, past):
        h = self.norm(x)
        q, k = (p(h).view(B, L, H, DH).transpose(1, 2) for p in (self.q, self.k))
        k = torch.cat([past, k], dim=-2)                                # (B, H, P + L, dh)
        if self.merged:
            q, k = q.reshape(B * H, L, DH), k.reshape(B * H, P + L, DH)
            return torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)), -1), k)
        return F.scaled_dot_product_attention(q, k, k)


def _captured(model):
    (graph,) = capture_graphs(model, torch.randn(B, L, D), torch.randn(B, H, P, DH))
    return graph


def test_a_concatenated_cache_is_read_and_bounded_by_observed_norms():
    graph = _captured(Cached())
    attention = next(n for n in graph.gm.graph.nodes if op_of(n) == "sdpa")
    assert reads_cache(attention.args[1]) and not reads_cache(attention.args[0])
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    assert site.supported and site.cached_keys, site.reason
    assert (site.k.layout, site.k.observed_axes, site.kv_len) == ("observed", (-3, -1), P + L)
    assert site.k.features == ((0,), (1,))
    assert site.q.weight is not None and site.q.features[1] == tuple(range(DH, D))
    assert len(site.k.observed_past) == 1 and len(site.k.observed_fresh) == 1


def test_a_cached_key_with_heads_merged_into_the_batch_is_refused_with_its_layout():
    graph = _captured(Cached(merged=True))
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    assert not site.supported
    # the operand is kᵀ of the bmm: (B·H, d_h, P + L)
    assert "which does not come from the projection (e.g. a KV cache)" in site.reason
    assert site.reason.endswith(f"(shape {(B * H, DH, P + L)}) is not laid out "
                                "(batch, heads, positions, d_h)")
