"""torchao's FP8 training linears (``convert_to_float8_training``) under geoscale.

Hugging Face models converted by torchao (every ``nn.Linear`` a ``Float8Linear``) have every
attention bounded from the weights and certified: Llama (no bias), Qwen2 (q/k/v biases) and
Phi-3 (a fused QKV projection), under the tensorwise, rowwise and rowwise-with-gw-hp recipes.
What the FP8 linears compute is checked against a float64 recomputation from torchao's own
casts, the weight program against torchao's dequantized weight bit for bit, the bound
against adversarially optimized inputs, and a training run with a weight jump stays
certified with no overflow. All on the CPU: torchao's FP8 forward runs there
(``torch._scaled_mm`` on CPU), for every recipe.
"""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests import analysis_checks as checks
from tests.float8_linears import ROWWISE

torchao_float8 = pytest.importorskip(
    "torchao.float8", reason="torchao is not installed (the [float8] extra: "
    "pip install -e '.[float8]'); its FP8 training linears are what this module tests")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

from torchao.float8.float8_scaling_utils import (  # noqa: E402
    get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic,
)
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "phi3": "Phi3Config"}
def _case(family: str, recipe: str):
    """A (family, recipe) parameter, skipped where a rowwise ``_scaled_mm`` cannot run."""
    return pytest.param(family, recipe, marks=[ROWWISE] if recipe != "tensorwise" else [])


CASES = [_case("llama", "tensorwise"), _case("llama", "rowwise"),
         _case("llama", "rowwise_with_gw_hp"), _case("qwen2", "tensorwise"),
         _case("qwen2", "rowwise"), _case("phi3", "rowwise")]


def _converted(family: str, recipe: str, seed: int = 0, gains: bool = False):
    torch.manual_seed(seed)
    config = getattr(transformers, FAMILIES[family])(**SMALL)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if gains:
        checks.scale_up_gains_and_biases(model)
    torchao_float8.convert_to_float8_training(
        model, config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))
    return model


def _ids(seed: int = 0, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,recipe", CASES)
def test_every_attention_is_bounded_from_the_weights(family, recipe):
    model = _converted(family, recipe).eval()
    sites = geoscale_fx.find_attention(model, input_ids=_ids())
    assert len(sites) == 2
    rows = recipe != "tensorwise"
    for site in sites:
        assert site.supported and site.bound_by == "weights" and site.certified, site.reason
        for side in (site.terms[0].q, site.terms[0].k, site.value):
            assert side.cast is not None and side.cast.kind == "float8"
            assert side.cast.input.groups == ("rows" if rows else "tensor")
            assert side.cast.input.scale_floor == (224.0 if rows else 448.0)   # powers of 2
            assert side.cast.output_rounding == (2 ** -8 if rows else 0.0)     # bf16 product
        assert (site.terms[0].q.bias is not None) == (family == "qwen2")


def _torchao_dequantized(t: torch.Tensor, config, role: str) -> torch.Tensor:
    """``data · scale⁻¹`` as torchao casts ``t`` (the input: per token row; the weight
    operand ``Wᵀ``: per output feature), float32 — what its ``_scaled_mm`` multiplies."""
    cast = config.cast_config_input if role == "input" else config.cast_config_weight
    fp8 = hp_tensor_to_float8_dynamic(
        t, cast.target_dtype, LinearMMConfig(),
        gemm_input_role=GemmInputRole.INPUT if role == "input" else GemmInputRole.WEIGHT,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(-1 if role == "input" else 0,
                                            cast.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    return fp8._data, fp8._scale


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=ROWWISE)])
def test_the_fp8_linears_compute_the_product_of_the_dequantized_operands(recipe):
    """The model the bound rests on: ``y = x̃ W̃ᵀ (+ b)``, checked against float64 from
    torchao's own casts; and the program's ``W̃`` is torchao's, bit for bit."""
    model = _converted("qwen2", recipe).eval()
    site = geoscale_fx.find_attention(model, input_ids=_ids())[0]
    layer = model.model.layers[0].self_attn
    seen = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(layer, name).register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, (inp[0], out)))
    with torch.no_grad():
        model(input_ids=_ids(1))
    rounding = site.terms[0].q.cast.output_rounding
    for name in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(layer, name)
        x, y = seen[name]
        x_bits, x_scale = _torchao_dequantized(x, linear.config, "input")
        w_bits, w_scale = _torchao_dequantized(linear.weight.t(), linear.config, "weight")
        x64, w64 = x_bits.double() / x_scale.double(), w_bits.double() / w_scale.double()
        product = x64 @ w64
        slack = 2 ** -20 * (x64.abs() @ w64.abs())              # float32 accumulation
        err = (y.double() - linear.bias.double() - product).abs()
        assert bool((err <= rounding * product.abs() + slack + 1e-12).all()), name
        side = {"q_proj": site.terms[0].q, "k_proj": site.terms[0].k,
                "v_proj": site.value}[name]
        replayed = side.cast.weight(linear.weight.detach().t())
        assert torch.equal(replayed, w_bits.float() * w_scale.reciprocal()), name


def test_mx_training_weights_are_refused_naming_the_subclass():
    """torchao's MX training (``MXFP8TrainingOpConfig``, emulated: it runs on the CPU) keeps
    ``nn.Linear`` and swaps the weights for a subclass whose dispatch quantizes both operands
    in blocks of 32 with E8M0 scales; Dynamo's graph reads ``linear(x, W)``. Geoscale
    certified ``x·Wᵀ`` for it before; the MX casts are not recognized (module docstring of
    ``analysis.linears.subclass_weights``), so the site is refused with the reason."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    try:
        quantize_(model.model.layers, MXFP8TrainingOpConfig(
            kernel_preference=KernelPreference.EMULATED, out_dtype=torch.float32),
            filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear))
    except AssertionError as refusal:       # torchao refuses MX training on older torch
        if "nightly" not in str(refusal):
            raise
        pytest.skip(f"torchao refuses MX training under torch {torch.__version__}: {refusal}")
    ids = _ids(length=32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()        # runs on the CPU
    for site in geoscale_fx.find_attention(model, input_ids=ids):
        assert not site.supported and not site.certified
        assert "MXFP8TrainingWeightWrapperTensor (a tensor subclass" in site.reason


@pytest.mark.slow
@pytest.mark.parametrize("family,recipe", [_case("llama", "rowwise"),
                                           _case("qwen2", "tensorwise")])
def test_bound_holds_under_adversarial_inputs_with_large_gains_and_biases(family, recipe):
    model = _converted(family, recipe, gains=True).eval()
    sites, worst, _ = checks.adversarial(model)
    assert all(s.terms[0].q.cast is not None for s in sites)
    assert (worst <= 1 + 1e-6).all(), worst
    assert worst.max() > 0.2, "the optimizer should find sizeable logits"


@pytest.mark.slow
@pytest.mark.parametrize("family,recipe", [_case("llama", "tensorwise"),
                                           _case("qwen2", "rowwise")])
def test_training_steps_and_a_weight_jump_stay_certified(family, recipe):
    """AdamW steps (lr 3e-3), then q_proj and k_proj ×8 (an RL weight update, a bad
    resume): after every step ``report()`` says certified, no step overflowed, and the
    bound followed the jump (×64 on q·k) from the weights, before the forward saw it."""
    model = _converted(family, recipe, seed=1)
    geoscale_fx.apply_(model, compiler="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    bounds = []
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_proj.weight.mul_(8)
                    layer.self_attn.k_proj.weight.mul_(8)
        ids = _ids(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        rows = geoscale_fx.report(model).rows
        assert len(rows) == 2 and all(r["certified"] for r in rows), rows
        assert all(r["overflow_steps"] == 0 and r["max_scaled"] <= 0.8 * 448 * (1 + 1e-5)
                   for r in rows), rows
        bounds.append([r["bound"] for r in rows])
    assert all(after > 30 * before for before, after in zip(bounds[2], bounds[3]))
    site = geoscale_fx.find_attention(model, input_ids=_ids())[0]
    assert float(site_logit_bound(site).max()) > 0
