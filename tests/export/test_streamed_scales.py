"""geoscale_fx.export.streamed_scales: per-layer q/k/v bounds of a saved checkpoint, traced on the
meta device. A tiny GPT-2 (no rotary: each entry's bound is ``max_i ρ‖a_i‖ + |c_i|``) is
checked against that formula recomputed in float64 from the saved tensors, and against the
q/k/v of an eager forward of the loaded model."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.export.streamed_scales import checkpoint_layer_scales

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

D, H, DH = 64, 4, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=H, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():            # LayerNorm gains/biases away from 1/0: they must count
        for block in model.transformer.h:
            block.ln_1.weight.uniform_(0.5, 2.0)
            block.ln_1.bias.normal_()
            block.attn.c_attn.bias.normal_()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def scales(ckpt):
    return checkpoint_layer_scales(ckpt)


def test_layers_in_order_on_a_meta_model(scales):
    model, layers = scales.model, scales.layers
    assert scales.refused == ()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert [(s.layer, s.site) for s in layers] == [(0, "transformer.h.0.attn"),
                                                   (1, "transformer.h.1.attn")]
    for s in layers:
        assert s.q_bound.shape == s.k_bound.shape == s.v_bound.shape == (H,)
        assert s.k_bound.dtype == torch.float64


def test_bounds_are_the_entry_formula_from_the_saved_tensors(ckpt, scales):
    from safetensors.torch import load_file

    t = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    for s in scales.layers:
        p = f"transformer.h.{s.layer}."
        w, b = t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"]        # (d, 3d) Conv1D
        g, beta = t[p + "ln_1.weight"], t[p + "ln_1.bias"]
        a = g[:, None] * w                              # column i: a_i = g ⊙ W[:, i]
        c = beta @ w + b                                # c_i = W[:, i]·β + b_i
        entry = D ** 0.5 * torch.linalg.vector_norm(a, dim=0) + c.abs()      # (3d,)
        per_head = entry.reshape(3, H, DH).amax(dim=-1)                      # (q|k|v, heads)
        for got, ref in zip((s.q_bound, s.k_bound, s.v_bound), per_head):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_eager_q_k_v_of_the_loaded_model_stay_under_the_bounds(ckpt, scales):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    seen = {}

    def record(i):
        return lambda mod, inp, out: seen.__setitem__(i, out.detach())

    for i, block in enumerate(model.transformer.h):
        block.attn.c_attn.register_forward_hook(record(i))
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    for s in scales.layers:
        qkv = seen[s.layer].reshape(4, 32, 3, H, DH).abs().amax(dim=(0, 1, 4))   # (3, H)
        for observed, bound in zip(qkv, (s.q_bound, s.k_bound, s.v_bound)):
            assert bool((observed.double() <= bound).all())


def test_a_tensor_of_the_wrong_shape_is_refused_by_name(ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in ckpt.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.1.attn.c_attn.bias"] = torch.zeros(10)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'transformer.h.1.attn.c_attn.bias' in "
                                         r"model.safetensors has shape \(10,\); the model "
                                         r"built from config.json expects \(192,\)"):
        checkpoint_layer_scales(tmp_path)
