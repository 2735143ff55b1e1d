"""``attention_scales``: FP8 q/k/v scales from the live weights, for RL and fine-tuning loops.

Checked against independent references: the q, k and v tensors the attention really receives
(recorded at ``torch.nn.functional.scaled_dot_product_attention``, i.e. after RoPE) during a
loop of AdamW steps never exceed ``scale · 448``; a doubled ``W_K`` (and k bias) gives exactly
twice the float32 k_scale; the tensors equal what ``export_kv_scales`` writes; the rotary
pair bound equals explicit float64 spectral norms of ``[a_i a_p]`` (``torch.linalg``). The
model is traced once: ``capture_graphs`` is counted."""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.kv_cache import weight_scales as weight_kv_scales
from geoscale_fx.export.kv_scales import export_kv_scales
from tests.analysis_checks import scale_up_gains_and_biases
from tests.hf_models import build_hf
from tests.float_checks import assert_certified

pytestmark = pytest.mark.zoo

FAMILIES = ["llama-sdpa", "qwen2-sdpa", "gpt2-sdpa"]
R_MAX = 448.0


def _ids(batch: int = 2, length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _sites(model) -> list[str]:
    return [name for name, m in model.named_modules()
            if name.endswith(("self_attn", ".attn")) and hasattr(m, "layer_idx")]


@pytest.fixture
def sdpa_operands(monkeypatch):
    """Every (q, k, v) given to scaled_dot_product_attention, in call order."""
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def _per_head_amax(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """max |entry| per head of a (B, H, L, D) operand; GQA-repeated kv heads (H a multiple
    of n_heads, ``repeat_kv``'s layout) folded onto their kv head."""
    amax = t.abs().amax(dim=(0, 2, 3)).double()                               # (H,)
    return amax.reshape(n_heads, -1).amax(dim=-1)


def _ratios(scales: dict, sites: list[str], operands: list) -> dict[str, float]:
    """Per role, the largest ``max |entry| / (scale · 448)`` over layers and heads."""
    assert len(operands) == len(sites)
    worst = {"q": 0.0, "k": 0.0, "v": 0.0}
    for site, qkv in zip(sites, operands):
        for kind, t in zip("qkv", qkv):
            limit = scales[f"{site}.{kind}_scale"].flatten().double() * R_MAX
            amax = _per_head_amax(t, limit.numel())
            worst[kind] = max(worst[kind], float((amax / limit).max()))
    return worst


def _check_entries(scales: dict, sites: list[str], operands: list, worst: dict) -> None:
    """Every recorded operand within its layer's per-head ``scale · 448``."""
    for kind, ratio in _ratios(scales, sites, operands).items():
        assert ratio <= 1.0, (kind, ratio)
        worst[kind] = max(worst[kind], ratio)


@pytest.mark.parametrize("key", FAMILIES)
def test_rl_loop_scales_bound_every_entry_the_model_produces(key, traces, sdpa_operands):
    """Five AdamW steps (lr 0.05: the weights move a lot); at each weight sync the refreshed
    per-head scales bound the q/k/v of that step's training forward and of an eval forward
    on other prompts; the scales follow the weights; one trace in all. The negative twin:
    the first sync's scales, kept, would have saturated by the last step."""
    model = build_hf(key).train()
    scale_up_gains_and_biases(model)
    sites = _sites(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    worst, history = {"q": 0.0, "k": 0.0, "v": 0.0}, []
    for step in range(5):
        scales = geoscale_fx.attention_scales(model, _ids(1, 8), strategy="head")
        first = scales if step == 0 else first
        history.append(scales[f"{sites[0]}.k_scale"].clone())
        sdpa_operands.clear()
        ids = _ids(seed=step)
        loss = model(input_ids=ids, labels=ids).loss
        _check_entries(scales, sites, sdpa_operands, worst)
        stale = _ratios(first, sites, sdpa_operands) if step else None
        model.eval()
        sdpa_operands.clear()
        with torch.no_grad():
            model(input_ids=_ids(3, 12, seed=100 + step))
        _check_entries(scales, sites, sdpa_operands, worst)
        model.train()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"\n{key}: worst observed |entry| / (scale·448): {worst}; with the first "
          f"sync's scales at the last step: {stale}")
    assert max(stale.values()) > 1.0
    assert len(traces) == 1
    assert all(not torch.equal(history[0], h) for h in history[1:])     # followed the weights
    assert min(worst.values()) > 0.05                                     # not vacuous


@pytest.mark.parametrize("key", ["llama-sdpa", "qwen2-sdpa"])
def test_doubling_w_k_doubles_k_scale_exactly(key, traces):
    """Layer 0's ``k_proj`` weight (and bias: Qwen2 has one) ×2: its k_scale is exactly 2×
    (×2 is exact in binary floating point, in the float64 bound and in its rounding up to
    float32); every other scale is unchanged, bit for bit; no second trace."""
    model = build_hf(key)
    before = geoscale_fx.attention_scales(model, _ids(), strategy="head")
    k_proj = model.model.layers[0].self_attn.k_proj
    with torch.no_grad():
        for p in k_proj.parameters():
            p.mul_(2.0)
    after = geoscale_fx.attention_scales(model, _ids(), strategy="head")
    assert (k_proj.bias is not None) == (key == "qwen2-sdpa")
    doubled = "model.layers.0.self_attn.k_scale"
    # exact: a power of two scales every float64 step and the round-up to float32 exactly
    assert torch.equal(after[doubled], 2.0 * before[doubled])
    assert all(torch.equal(after[n], before[n]) for n in before if n != doubled)
    assert len(traces) == 1


@pytest.mark.parametrize("convert", ["plain", "apply_"])
@pytest.mark.parametrize("strategy, include_q", [("tensor", True), ("head", True),
                                                 ("tensor", False)])
def test_values_equal_export_kv_scales(convert, strategy, include_q, tmp_path):
    """The same names, shapes and float32 values as ``export_kv_scales`` writes, on a plain
    model and on one converted by ``apply_`` (called compiled first), before and after an
    optimizer step."""
    model = build_hf("llama-sdpa")
    if convert == "apply_":
        geoscale_fx.apply_(model, compiler="eager")      # the rewritten graph, run eagerly
        model(_ids())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(2):
        live = geoscale_fx.attention_scales(model, _ids(), strategy=strategy,
                                            include_q=include_q)
        written = export_kv_scales(model, tmp_path / f"{step}", _ids(), strategy=strategy,
                                   include_q=include_q).tensors
        assert sorted(live) == sorted(written)
        assert all(n.startswith("model.layers.") for n in live)
        for name in written:
            assert live[name].dtype == written[name].dtype == torch.float32
            assert torch.equal(live[name], written[name]), name
        ids = _ids(seed=step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


def test_a_replaced_parameter_is_followed_without_a_trace(traces):
    """``load_state_dict(..., assign=True)`` puts new tensors in place of the parameters:
    the scales follow them (found by name), with no forward pass."""
    model = build_hf("llama-sdpa")
    before = geoscale_fx.attention_scales(model, _ids())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.1.self_attn.v_proj.weight"] *= 4.0
    model.load_state_dict(state, assign=True)
    after = geoscale_fx.attention_scales(model, _ids())
    name = "model.layers.1.self_attn.v_scale"
    assert torch.equal(after[name], 4.0 * before[name])       # exact: a power of two, as above
    assert len(traces) == 1


def test_rotary_pair_bound_equals_explicit_spectral_norms():
    """Llama's k bound (RoPE, rotate_half pairs ``(i, i + d_h/2)``) against ``torch.linalg``:
    ``√d · max_i ‖diag(g) [w_i w_p]‖₂`` per kv head, in float64, from the parameters: never
    below it and within 1e-12 relative (the library folds ``g·W`` in float64 and takes the
    2×2 Gram matrix's largest eigenvalue in closed form, torch.linalg an SVD; float32
    folding came out up to 2⁻²⁴ under); a wrong pairing or norm would be off by far more."""
    model = build_hf("llama-sdpa")
    scale_up_gains_and_biases(model)
    source = weight_kv_scales.WeightKVScales(model).capture(_ids(1, 8))
    layer = source.layers()[1]
    block = model.model.layers[1]
    gain = block.input_layernorm.weight.detach().double()                       # (d,)
    w = block.self_attn.k_proj.weight.detach().double()                         # (n_kv·d_h, d)
    n_kv, d_h, d = 2, 16, w.shape[1]
    a = (w * gain).reshape(n_kv, d_h, d)                                        # rows a_iᵀ
    half = d_h // 2
    pairs = torch.stack([a[:, :half], a[:, half:]], dim=-1)                     # (n, m, d, 2)
    expected = d ** 0.5 * torch.linalg.matrix_norm(pairs, ord=2).amax(dim=-1)   # (n_kv,)
    assert_certified(layer.k_bound, expected, rtol=1e-12)


@pytest.mark.parametrize("key, parameter", [
    ("llama-sdpa", "model.layers.1.self_attn.k_proj.weight"),
    ("llama-sdpa", "model.layers.0.input_layernorm.weight"),
    ("gpt2-sdpa", "transformer.h.1.attn.c_attn.weight"),
])
def test_non_finite_parameter_is_refused_naming_site_and_parameter(key, parameter, tmp_path):
    """One NaN (or inf) in a parameter the bounds read: a ValueError naming the attention
    site and the parameter, before any bound is computed; export writes nothing."""
    model = build_hf(key)
    with torch.no_grad():
        model.get_parameter(parameter).view(-1)[5] = float("nan")
    site = parameter.split(".k_proj")[0].split(".c_attn")[0]
    if "layernorm" in parameter:
        site = "model.layers.0.self_attn"
    out = tmp_path / "out"
    message = rf"'{site}'.*'{parameter}' is not finite \(1 inf/nan"
    with pytest.raises(ValueError, match=message):
        export_kv_scales(model, out, _ids())
    assert not out.exists()
    with pytest.raises(ValueError, match=rf"'{site}'.*'{parameter}'"):
        geoscale_fx.attention_scales(model, _ids())
    with torch.no_grad():
        model.get_parameter(parameter).view(-1)[5] = 0.0
    scales = geoscale_fx.attention_scales(model, _ids())      # finite again: scales
    assert all(bool(torch.isfinite(s).all()) for s in scales.values())


def test_options_and_first_call_errors():
    model = build_hf("llama-sdpa")
    with pytest.raises(ValueError, match="strategy='channel'; allowed values"):
        geoscale_fx.attention_scales(model, _ids(), strategy="channel")
    with pytest.raises(ValueError, match="fmt='e5m2'"):
        geoscale_fx.attention_scales(model, _ids(), fmt="e5m2")
    with pytest.raises(ValueError, match="first call .* needs one call's inputs"):
        geoscale_fx.attention_scales(model)
    assert geoscale_fx.attention_scales(model, _ids())      # then: no inputs needed
    assert geoscale_fx.attention_scales(model)
