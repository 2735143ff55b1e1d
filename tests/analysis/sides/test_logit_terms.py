"""Head vectors drawn from several projections (MLA): one logit term per projection pair."""
import torch
import torch.nn.functional as F
from torch import nn

from tests.analysis_checks import analysed_site

B, L, D, H, NOPE, ROPE = 2, 5, 16, 2, 6, 2


class Split(nn.Module):
    """``q_h = [A x | B x]_h`` and ``k_h = [C x | E x]_h`` (``per_head``: head 0 from one
    projection, head 1 from another — not the MLA layout)."""

    def __init__(self, per_head=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qa, self.qb = nn.Linear(D, H * NOPE), nn.Linear(D, H * ROPE)
        self.ka, self.kb = nn.Linear(D, H * NOPE), nn.Linear(D, H * ROPE)
        self.per_head = per_head

    def _heads(self, a, b):
        if self.per_head:                              # (B, L, 2, 4): head 0 from a, 1 from b
            return torch.cat([a[..., :4].view(B, L, 1, 4), b.view(B, L, 1, 4)], dim=2)
        return torch.cat([a.view(B, L, H, NOPE), b.view(B, L, H, ROPE)], dim=-1)

    def forward(self, x):
        h = self.norm(x)
        q = self._heads(self.qa(h), self.qb(h)).transpose(1, 2)
        k = self._heads(self.ka(h), self.kb(h)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, k)


def _site(model):
    return analysed_site(model, torch.randn(B, L, D))


def test_each_projection_pair_is_a_term_over_its_channels():
    site = _site(Split())
    assert site.supported, site.reason
    assert len(site.terms) == 2 and site.head_dim == NOPE + ROPE
    first, second = site.terms
    assert first.q.features == tuple(tuple(range(h * NOPE, (h + 1) * NOPE)) for h in range(H))
    assert second.k.features == tuple(tuple(range(h * ROPE, (h + 1) * ROPE)) for h in range(H))
    assert {first.q.weight, second.q.weight} != {first.k.weight, second.k.weight}


def test_heads_that_draw_a_channel_from_different_projections_are_refused():
    site = _site(Split(per_head=True))
    assert not site.supported
    assert "the query's heads draw the same channel from different projections" in site.reason
