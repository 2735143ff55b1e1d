import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from geoscale_fx.core import bounds, spectral

SHAPES = [  # (n_q, n_kv, d, d_h): MHA, GQA, MQA over head widths 16 … 128
    (4, 4, 128, 16), (8, 2, 256, 32), (6, 1, 192, 32), (4, 4, 256, 64), (8, 2, 512, 64),
    (2, 2, 512, 128), (4, 1, 384, 128),
]


def _explicit_per_head(a_q, a_k):
    """Reference: form every head's d×d interaction and take torch.linalg.matrix_norm."""
    g = a_q.shape[0] // a_k.shape[0]
    return torch.stack([torch.linalg.matrix_norm(a_q[h].double() @ a_k[h // g].double().T, ord=2)
                        for h in range(a_q.shape[0])])


def _explicit_per_layer(a_q, a_k):
    g = a_q.shape[0] // a_k.shape[0]
    m = sum(a_q[h].double() @ a_k[h // g].double().T for h in range(a_q.shape[0]))
    return torch.linalg.matrix_norm(m, ord=2)


def _structured(n, d, dh, kind):
    if kind == "random":
        return torch.randn(n, d, dh)
    if kind == "low_rank":  # rank-2 heads: repeated top singular values
        return torch.randn(n, d, 2) @ torch.randn(n, 2, dh)
    if kind == "orthogonal":  # all singular values equal: the hardest case for power iteration
        return torch.linalg.qr(torch.randn(n, d, dh))[0] * 3.0
    if kind == "decaying":  # trained-weight-like spectrum with a gap
        u = torch.linalg.qr(torch.randn(n, d, dh))[0]
        vt = torch.linalg.qr(torch.randn(n, dh, dh))[0]
        s = torch.logspace(1, -1, dh)
        return (u * s) @ vt
    raise AssertionError(kind)


def _gapped_pair(n_q, n_kv, d, dh):
    """Heads whose interaction spectrum is known and has a gap σ1/σ2 = 4, as trained weights do.

    a_q[h] = U_h diag(s) R_g and a_k[g] = V_g diag(s) R_g (R_g orthogonal), so
    a_q[h] a_k[g]ᵀ = U_h diag(s²) V_gᵀ with s = (2, 1, 0.95, …).
    """
    s = torch.cat([torch.tensor([2.0]), torch.linspace(1.0, 0.1, dh - 1)])
    r = torch.linalg.qr(torch.randn(n_kv, dh, dh))[0]
    u = torch.linalg.qr(torch.randn(n_q, d, dh))[0]
    v = torch.linalg.qr(torch.randn(n_kv, d, dh))[0]
    g = n_q // n_kv
    a_q = (u * s) @ r.repeat_interleave(g, dim=0)
    a_k = (v * s) @ r
    return a_q, a_k


@pytest.mark.parametrize("n_q, n_kv, d, dh", SHAPES)
@pytest.mark.parametrize("kind", ["random", "low_rank", "orthogonal", "decaying"])
def test_exact_per_head_matches_matrix_norm(n_q, n_kv, d, dh, kind):
    a_q, a_k = _structured(n_q, d, dh, kind), _structured(n_kv, d, dh, kind)
    exact = spectral.per_head_sigma_exact(a_q, a_k)
    torch.testing.assert_close(exact, _explicit_per_head(a_q, a_k), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("n_q, n_kv, d, dh", SHAPES[:4])
def test_exact_per_layer_matches_matrix_norm(n_q, n_kv, d, dh):
    a_q, a_k = torch.randn(n_q, d, dh), torch.randn(n_kv, d, dh)
    exact = spectral.per_layer_sigma_exact(a_q, a_k)
    torch.testing.assert_close(exact, _explicit_per_layer(a_q, a_k), rtol=1e-5, atol=0)


def test_exact_accepts_bf16_weights_with_float64_accumulation():
    a_q, a_k = torch.randn(8, 256, 64).bfloat16(), torch.randn(2, 256, 64).bfloat16()
    exact = spectral.per_head_sigma_exact(a_q, a_k)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, _explicit_per_head(a_q, a_k), rtol=1e-5, atol=0)


def test_cross_attention_widths_may_differ():
    a_q, a_k = torch.randn(4, 96, 16), torch.randn(4, 160, 16)
    torch.testing.assert_close(spectral.per_head_sigma_exact(a_q, a_k),
                               _explicit_per_head(a_q, a_k), rtol=1e-5, atol=0)


@pytest.mark.parametrize("n_q, n_kv, d, dh", [(8, 8, 256, 32), (8, 2, 256, 64), (4, 1, 128, 16)])
def test_power_converges_from_cold_start_and_stays_below(n_q, n_kv, d, dh):
    a_q, a_k = _gapped_pair(n_q, n_kv, d, dh)
    exact = spectral.per_head_sigma_exact(a_q, a_k)
    torch.testing.assert_close(exact, torch.full((n_q,), 4.0, dtype=torch.float64), rtol=1e-5, atol=0)
    u, v = spectral.init_power_state(n_q, d, d, generator=torch.Generator().manual_seed(1))
    estimates = [spectral.per_head_power_step(a_q, a_k, u, v, iters=1) for _ in range(30)]
    for est in estimates:  # every estimate is a lower bound (up to float32 rounding)
        assert (est.double() <= exact * (1 + 1e-6)).all()
    rel = (exact - estimates[4].double()) / exact
    assert rel.max() < 1e-2, "5 cold-start iterations (the paper's) should be within 1%"
    rel = (exact - estimates[-1].double()) / exact
    assert rel.max() < 1e-5
    # state vectors are unit vectors of the right shape, updated in place
    assert u.shape == (n_q, d) and v.shape == (n_q, d)
    torch.testing.assert_close(u.norm(dim=-1), torch.ones(n_q))


def test_power_tracks_drifting_weights_with_one_iteration_per_step():
    n_q, n_kv, d, dh = 8, 2, 256, 32
    a_q, a_k = _gapped_pair(n_q, n_kv, d, dh)
    u, v = spectral.init_power_state(n_q, d, d)
    spectral.per_head_power_step(a_q, a_k, u, v, iters=5)  # the paper's cold start
    worst = 0.0
    for _ in range(100):  # SGD-like drift: 0.2% relative change per step
        a_q = a_q + 2e-3 * a_q.norm() / math.sqrt(a_q.numel()) * torch.randn_like(a_q)
        a_k = a_k + 2e-3 * a_k.norm() / math.sqrt(a_k.numel()) * torch.randn_like(a_k)
        est = spectral.per_head_power_step(a_q, a_k, u, v, iters=1).double()
        exact = spectral.per_head_sigma_exact(a_q, a_k)
        worst = max(worst, ((exact - est) / exact).abs().max().item())
    assert worst < 1e-2


def test_per_layer_power_is_the_papers_algorithm():
    n_q, n_kv, d, dh = 8, 2, 128, 16
    a_q, a_k = _gapped_pair(n_q, n_kv, d, dh)
    u, v = spectral.init_power_state(1, d, d)
    for _ in range(200):
        est = spectral.per_layer_power_step(a_q, a_k, u, v)
    ref = _explicit_per_layer(a_q, a_k)
    assert est.double().item() == pytest.approx(ref.item(), rel=1e-5)
    assert est.double().item() <= ref.item() * (1 + 1e-6)


class _AllocationRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.nbytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("step", [spectral.per_head_power_step, spectral.per_layer_power_step])
def test_gqa_never_allocates_an_expanded_key_matrix(step):
    n_q, n_kv, d, dh = 32, 4, 512, 64
    a_q, a_k = torch.randn(n_q, d, dh), torch.randn(n_kv, d, dh)
    n_vec = n_q if step is spectral.per_head_power_step else 1
    u, v = spectral.init_power_state(n_vec, d, d)
    recorder = _AllocationRecorder()
    with recorder:
        step(a_q, a_k, u, v, iters=2)
    expanded_k_bytes = n_q * d * dh * 4
    assert recorder.nbytes, "the recorder saw no allocation at all"
    assert max(recorder.nbytes) < a_k.numel() * 4 < expanded_k_bytes


def test_heads_that_cancel_break_the_per_layer_bound_not_the_per_head_one():
    d, dh = 64, 8
    x_dir = torch.linalg.qr(torch.randn(d, dh, dtype=torch.float64))[0]
    y_dir = torch.linalg.qr(torch.randn(d, dh, dtype=torch.float64))[0]
    core = torch.diag(torch.linspace(4.0, 1.0, dh, dtype=torch.float64))
    # head 0 and head 1 nearly cancel in the concatenated W^Q W^Kᵀ = Σ_h A_q,h A_k,hᵀ
    a_q = torch.stack([x_dir @ core, -0.95 * x_dir @ core])
    a_k = torch.stack([y_dir, y_dir])
    per_head = spectral.per_head_sigma_exact(a_q, a_k)
    per_layer = spectral.per_layer_sigma_exact(a_q, a_k)
    assert per_layer < 0.1 * per_head.max()
    # inputs on the sphere of radius √d aligned with head 0's top singular pair
    m0 = a_q[0] @ a_k[0].T
    U, _, Vh = torch.linalg.svd(m0)
    xq, xk = math.sqrt(d) * U[:, 0], math.sqrt(d) * Vh[0]
    logit0 = (xq @ a_q[0]) @ (xk @ a_k[0]) / math.sqrt(dh)
    layer_bound = bounds.worst_case_bound(per_layer, d, dh)
    head_bound = bounds.worst_case_bound(per_head, d, dh)
    assert logit0.abs() > layer_bound, "the paper's per-layer B_max is exceeded by a real logit"
    assert logit0.abs() <= head_bound[0] * (1 + 1e-9)


def test_fold_affine_and_bias_terms_against_explicit_projection():
    n, d, dh = 4, 48, 8
    w = torch.randn(n * dh, d, dtype=torch.float64)           # nn.Linear layout
    b = torch.randn(n * dh, dtype=torch.float64)
    gain, offset = torch.rand(d, dtype=torch.float64) + 0.5, torch.randn(d, dtype=torch.float64)
    x_hat = torch.randn(10, d, dtype=torch.float64)
    q = (gain * x_hat + offset) @ w.T + b                      # what the model computes
    a, c = spectral.fold_affine(spectral.split_heads(w, n), gain, offset, b.view(n, dh))
    q_heads = torch.einsum("td,ndj->tnj", x_hat, a) + c
    torch.testing.assert_close(q_heads.reshape(10, -1), q)
    # dense (Conv1D) layout is the transpose
    torch.testing.assert_close(spectral.split_heads(w.T.contiguous(), n, "dense"),
                               spectral.split_heads(w, n))
    # bias terms with GQA
    a_q, a_k = torch.randn(4, d, dh), torch.randn(2, d, dh)
    c_q, c_k = torch.randn(4, dh), torch.randn(2, dh)
    aq_ck, ak_cq, cq_ck = spectral.bias_terms(a_q, c_q, a_k, c_k)
    for h in range(4):
        g = h // 2
        assert aq_ck[h].item() == pytest.approx((a_q[h] @ c_k[g]).norm().item(), rel=1e-5)
        assert ak_cq[h].item() == pytest.approx((a_k[g] @ c_q[h]).norm().item(), rel=1e-5)
        assert cq_ck[h].item() == pytest.approx((c_q[h] @ c_k[g]).item(), rel=1e-5, abs=1e-6)
    zeros = spectral.bias_terms(a_q, None, a_k, None)
    assert all((t == 0).all() for t in zeros)


def test_head_spectral_norms_match_matrix_norm():
    a = torch.randn(5, 64, 16)
    ref = torch.stack([torch.linalg.matrix_norm(a[i].double(), ord=2) for i in range(5)])
    torch.testing.assert_close(spectral.head_spectral_norms(a), ref, rtol=1e-6, atol=0)


def test_estimators_trace_with_fullgraph_and_update_state_in_place():
    a_q, a_k = _gapped_pair(8, 2, 64, 16)
    u, v = spectral.init_power_state(8, 64, 64)
    u_ref, v_ref = u.clone(), v.clone()
    eager = spectral.per_head_power_step(a_q, a_k, u_ref, v_ref, iters=2)
    compiled = torch.compile(spectral.per_head_power_step, fullgraph=True, backend="aot_eager")
    got = compiled(a_q, a_k, u, v, iters=2)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(u, u_ref)
    torch.testing.assert_close(v, v_ref)
    exact = torch.compile(spectral.per_head_sigma_exact, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(exact(a_q, a_k), spectral.per_head_sigma_exact(a_q, a_k))


def test_weights_that_require_grad_leave_state_out_of_autograd():
    a_q = torch.randn(4, 32, 8, requires_grad=True)
    a_k = torch.randn(4, 32, 8, requires_grad=True)
    u, v = spectral.init_power_state(4, 32, 32)
    sigma = spectral.per_head_power_step(a_q, a_k, u, v)
    assert not sigma.requires_grad and not u.requires_grad and u.grad_fn is None
    with torch.no_grad():
        assert torch.isfinite(spectral.per_head_sigma_exact(a_q, a_k)).all()


def test_zero_weights_give_zero_sigma_not_nan():
    a = torch.zeros(2, 16, 4)
    u, v = spectral.init_power_state(2, 16, 16)
    assert (spectral.per_head_power_step(a, a, u, v) == 0).all()
    assert torch.isfinite(u).all() and torch.isfinite(v).all()
    assert (spectral.per_head_sigma_exact(a, a) == 0).all()


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="n_q=6 .* n_kv=4"):
        spectral.per_head_sigma_exact(torch.randn(6, 16, 4), torch.randn(4, 16, 4))
    with pytest.raises(ValueError, match="head_dim"):
        spectral.per_head_sigma_exact(torch.randn(4, 16, 4), torch.randn(4, 16, 8))
    with pytest.raises(ValueError, match="layout"):
        spectral.split_heads(torch.randn(8, 8), 2, layout="conv")


def test_real_minilm_per_head_vs_per_layer(minilm, capsys):
    from tabulate import tabulate

    rows = []
    for i, layer in enumerate(minilm.encoder.layer):
        attn = layer.attention.self
        n = attn.num_attention_heads
        a_q = spectral.split_heads(attn.query.weight.detach(), n)
        a_k = spectral.split_heads(attn.key.weight.detach(), n)
        per_head = spectral.per_head_sigma_exact(a_q, a_k)
        per_layer = spectral.per_layer_sigma_exact(a_q, a_k)
        torch.testing.assert_close(per_head, _explicit_per_head(a_q, a_k), rtol=1e-5, atol=0)
        rows.append((i, per_head.max().item(), per_head.median().item(), per_layer.item()))
    with capsys.disabled():
        print("\nall-MiniLM-L6-v2  ‖W^Q_h W^K_hᵀ‖₂ per head vs the paper's per-layer norm")
        print(tabulate(rows, headers=["layer", "max head", "median head", "per layer"],
                       floatfmt=".2f"))
    # DESIGN.md: layer 4's largest head exceeds the concatenated norm (18.6 > 17.4)
    assert rows[4][1] == pytest.approx(18.6, abs=0.05)
    assert rows[4][3] == pytest.approx(17.4, abs=0.05)
    assert rows[4][1] > rows[4][3]
