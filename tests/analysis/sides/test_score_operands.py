"""geoscale_fx.analysis.sides.score_operands: query and key of a scores product, with their layout and
(einsum) the permutations to (batch…, L, D) — checked by applying them to the operands and
recomputing the scores with a plain matmul."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.forms.candidate import CandidateDraft
from geoscale_fx.analysis.fx.graph_ops import op_of
from geoscale_fx.analysis.sides.score_operands import set_operands

B, H, L, D = 2, 3, 5, 4

EQUATIONS = ["bhld,bhmd->bhlm", "lbhd,mbhd->bhlm", "ibnd,jbnd->bnij", "bld,bmd->blm"]


def _scores_node(fn, *args):
    (graph,) = capture_graphs(fn, *args)
    node = next(n for n in graph.gm.graph.nodes if op_of(n) in ("einsum", "matmul", "bmm"))
    return graph, node


def _operand(equation: str, term: int) -> torch.Tensor:
    sizes = {"b": B, "h": H, "n": H, "l": L, "m": L, "i": L, "j": L, "d": D}
    return torch.randn(*(sizes[c] for c in equation.split("->")[0].split(",")[term]))


@pytest.mark.parametrize("equation", EQUATIONS)
def test_einsum_operands_and_permutations_recompute_the_scores(equation):
    q, k = _operand(equation, 0), _operand(equation, 1)
    _, node = _scores_node(lambda a, b: torch.einsum(equation, a, b), q, k)
    cand = CandidateDraft("explicit", node)
    assert set_operands(node, cand) and cand.key_layout == "kd"
    assert (cand.query.name, cand.key.name) == ("l_a_", "l_b_")
    qp, kp = q.permute(cand.query_perm), k.permute(cand.key_perm)
    torch.testing.assert_close(qp @ kp.transpose(-1, -2), torch.einsum(equation, q, k))


def test_matmul_reads_q_and_a_transposed_key():
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    _, node = _scores_node(lambda a, b: a @ b.transpose(-1, -2), q, k)
    cand = CandidateDraft("explicit", node)
    assert set_operands(node, cand) and cand.key_layout == "dk"
    assert cand.query.name == "l_a_" and op_of(cand.key) == "transpose"
    assert cand.query_perm is None and cand.key_perm is None


@pytest.mark.parametrize("equation", ["bhld,bhmd->bhml", "bhld,bhld->bhl", "...ld,...md->...lm"])
def test_an_einsum_that_is_not_q_kt_is_refused(equation):
    """Output axes swapped, no key-only axis, or an ellipsis: not the scores' form."""
    q = torch.randn(B, H, L, D)
    k = torch.randn(B, H, L, D)
    _, node = _scores_node(lambda a, b: torch.einsum(equation, a, b), q, k)
    assert not set_operands(node, CandidateDraft("explicit", node))
