"""``geoscale inspect``: a saved model directory (weights, bounds), its config.json alone (meta
device, no weights), ``--model-type`` (a shrunk default config), ``package.module:function``,
(the library never importing the repository's tools: ``tests/test_layering.py``).

The σ column is checked against torch.linalg on the explicit per-head matrices of the saved
weights, and the meta run against the weighted run, row by row.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

import geoscale_fx
from geoscale_fx.api import inspection
from geoscale_fx.cli import main
from tests.hf_models import build_hf

SITES = [f"model.layers.{i}.self_attn" for i in range(2)]      # llama-sdpa: 2 layers, 4/2 heads
SHAPE_COLUMNS = ("#", "site", "kind", "supported", "heads q/kv", "d", "d_h", "norm", "rope",
                 "bias", "scale", "reason")


def _table(out: str) -> list[dict]:
    """The rows of the printed table, by column (spans read off tabulate's dashed line)."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    spans, start = [], 0
    for dashes in lines[rule].split("  "):
        if dashes:
            spans.append((start, start + len(dashes)))
        start += len(dashes) + 2
    headers = [lines[rule - 1][a:b].strip() for a, b in spans]
    rows = []
    for line in lines[rule + 1:]:
        if not line.strip():
            break
        rows.append({h: line[a:b if h != headers[-1] else None].strip()
                     for h, (a, b) in zip(headers, spans)})
    return rows


def _sigma_reference(model, layer: int) -> float:
    """max_h ‖A_q,h A_k,g(h)ᵀ‖₂ from the explicit matrices: A = diag(γ) Wᵀ per head, γ the
    RMSNorm gain in front of the attention, float64."""
    attn = model.model.layers[layer].self_attn
    gain = model.model.layers[layer].input_layernorm.weight.detach().double()
    cfg = model.config
    d_h = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    w_q = attn.q_proj.weight.detach().double().reshape(cfg.num_attention_heads, d_h, -1)
    w_k = attn.k_proj.weight.detach().double().reshape(cfg.num_key_value_heads, d_h, -1)
    # w_q: (n_q, d_h, d), w_k: (n_kv, d_h, d)
    sigmas = [torch.linalg.matrix_norm((gain[:, None] * w_q[h].T)
                                       @ (gain[:, None] * w_k[h // group].T).T, ord=2)
              for h in range(cfg.num_attention_heads)]
    return float(max(sigmas))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, directory with config.json + weights, directory with config.json only)."""
    pytest.importorskip("transformers")
    model = build_hf("llama-sdpa")
    root = tmp_path_factory.mktemp("inspect")
    model.save_pretrained(root / "full")
    (root / "config-only").mkdir()
    shutil.copy(root / "full" / "config.json", root / "config-only" / "config.json")
    return model, root / "full", root / "config-only"


def _inspect(capsys, *argv) -> tuple[int, str, str]:
    torch._dynamo.reset()
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.zoo
def test_saved_directory_supported_sites_and_bounds(saved, capsys):
    model, full, _ = saved
    code, out, _ = _inspect(capsys, str(full))
    assert code == 0
    rows = _table(out)
    assert [r["site"] for r in rows] == SITES
    for layer, row in enumerate(rows):
        assert (row["supported"], row["heads q/kv"], row["d"], row["d_h"]) == \
            ("True", "4/2", "64", "16")
        assert (row["norm"], row["rope"], row["certified"]) == ("rmsnorm", "True", "True")
        assert math.isfinite(float(row["bound"])) and float(row["bound"]) > 0
        assert float(row["σ"]) == pytest.approx(_sigma_reference(model, layer), rel=1e-3)
    assert "2 attention sites, 2 supported, 2 with a certified bound" in out


@pytest.mark.zoo
def test_saved_encoder_loads_as_its_own_architecture(tmp_path, capsys):
    """A saved BertModel (no LM head) is loaded as BertModel through AutoModel, not as the
    causal LM class transformers also has for BERT."""
    import transformers

    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=128,
                                  max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    code, out, _ = _inspect(capsys, str(tmp_path))
    assert code == 0 and out.splitlines()[0] == f"{tmp_path} (BertModel, weights loaded)"
    rows = _table(out)
    assert [r["site"] for r in rows] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    assert all(r["supported"] == "True" and r["norm"] == "layernorm" for r in rows)


@pytest.mark.zoo
@pytest.mark.parametrize("form", ["config.json", "config-only directory"])
def test_config_alone_runs_on_meta_without_weights(saved, capsys, monkeypatch, form):
    """Same sites and decisions as with the weights; nothing materialized (every parameter
    and buffer the trace saw is on the meta device, from_pretrained never called); the
    bound columns are "—"."""
    import transformers

    model, full, config_only = saved
    seen = []

    def recording_find_attention(m, *args, **kwargs):
        seen.append(m)
        return geoscale_fx.find_attention(m, *args, **kwargs)

    def no_weights(*args, **kwargs):
        raise AssertionError("from_pretrained called: weights would be read")

    monkeypatch.setattr(inspection, "find_attention", recording_find_attention)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        monkeypatch.setattr(auto, "from_pretrained", no_weights)
    spec = full / "config.json" if form == "config.json" else config_only
    code, out, _ = _inspect(capsys, str(spec))
    assert code == 0
    (meta_model,) = seen
    assert all(p.is_meta for p in meta_model.parameters())
    assert all(b.is_meta for b in meta_model.buffers())
    monkeypatch.undo()
    _, weighted, _ = _inspect(capsys, str(full))
    meta_rows, rows = _table(out), _table(weighted)
    assert [{c: r[c] for c in SHAPE_COLUMNS} for r in meta_rows] == \
        [{c: r[c] for c in SHAPE_COLUMNS} for r in rows]
    assert all((r["σ"], r["bound"], r["certified"]) == ("—",) * 3 for r in meta_rows)
    assert "no weights (meta device)" in out


@pytest.mark.zoo
@pytest.mark.parametrize("model_type, site, heads", [
    ("llama", "model.layers.{}.self_attn", "4/4"),
    ("qwen2", "model.layers.{}.self_attn", "4/4"),
    ("gpt2", "transformer.h.{}.attn", "4/4"),
])
def test_model_type_finds_the_family_sites(capsys, model_type, site, heads):
    code, out, _ = _inspect(capsys, "--model-type", model_type)
    assert code == 0
    assert out.splitlines()[0].startswith(f"--model-type {model_type} (")
    rows = _table(out)
    assert [r["site"] for r in rows] == [site.format(i) for i in range(2)]
    assert all(r["supported"] == "True" and r["heads q/kv"] == heads for r in rows)
    assert all(math.isfinite(float(r["bound"])) for r in rows)


@pytest.mark.zoo
def test_unknown_model_type_is_an_error_naming_it(capsys):
    code, out, err = _inspect(capsys, "--model-type", "llama-9000")
    assert code != 0 and out == ""
    assert "model type 'llama-9000': not a transformers model type" in err


def test_a_name_that_is_no_path_nor_spec_says_what_to_pass(capsys):
    code, _, err = _inspect(capsys, "hf-llama")
    assert code == 2
    assert "'hf-llama': not a saved model directory, a config.json or " \
           "package.module:function" in err
    assert "models_zoo.inspection:hf-llama" in err


def test_a_missing_path_is_named(capsys, tmp_path):
    code, _, err = _inspect(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and f"'{tmp_path / 'nowhere'}': no such directory or config.json" in err
    code, _, err = _inspect(capsys, str(tmp_path))
    assert code == 2 and "no config.json in it" in err


@pytest.mark.zoo
def test_a_forward_that_does_not_run_on_meta_is_said_so(saved, capsys, monkeypatch):
    """A model whose forward needs real values (a data-dependent op) fails its meta trace:
    one line naming the class, the error and what to do instead, exit code 1."""
    def needs_values(model, *args, **kwargs):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors\nmore detail")

    monkeypatch.setattr(inspection, "find_attention", needs_values)
    code, out, err = _inspect(capsys, str(saved[2]))
    assert code == 1 and "on the meta device: no weights read" in out
    assert err.strip() == (
        "geoscale inspect: LlamaForCausalLM does not trace on the meta device (RuntimeError: "
        "Tensor.item() cannot be called on meta tensors); inspect a saved directory with its "
        "weights, or --model-type for random ones")


def _encoder_layer():
    """A ``package.module:function`` target returning ``(model, inputs)``."""
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True,
                                             norm_first=True)
    return layer, {"src": torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))}


def test_package_module_function_with_its_own_inputs(capsys):
    code, out, _ = _inspect(capsys, "tests.api.test_inspection:_encoder_layer")
    assert code == 0
    (row,) = _table(out)
    assert (row["site"], row["kind"], row["supported"], row["heads q/kv"]) == \
        ("self_attn", "mha", "True", "4/4")
    assert math.isfinite(float(row["bound"]))
    code, _, err = _inspect(capsys, "tests.api.test_inspection:_encoder_layer",
                            "--attn-impl", "eager")
    assert code == 2 and "applies to Hugging Face models" in err


@pytest.mark.zoo
def test_zoo_names_from_a_checkout(capsys):
    """The zoo is reached through a spec (``models_zoo.inspection:NAME``) or its own module;
    the library itself never imports it."""
    models_zoo_inspection = pytest.importorskip("models_zoo.inspection")
    code, out, _ = _inspect(capsys, "models_zoo.inspection:hf-llama")
    assert code == 0
    assert [r["site"] for r in _table(out)] == [f"model.layers.{i}.self_attn" for i in range(4)]
    torch._dynamo.reset()
    assert models_zoo_inspection.main(["llama-2-70b", "--seq-len", "8"]) == 0
    rows = _table(capsys.readouterr().out)
    assert len(rows) == 4 and {r["heads q/kv"] for r in rows} == {"8/1"}
    assert all(math.isfinite(float(r["bound"])) for r in rows)



def test_a_site_bounded_by_its_measured_operands_says_so():
    """No norm before the projections: supported, bounded per call, and why."""
    from tests.attention_variants import Unnormalized

    text = inspection.sites_report(Unnormalized().eval(), {"x": torch.randn(2, 8, 64)})
    assert "per call" in text and "measured: no normalization before the projection" in text
    assert "1 attention sites, 1 supported (1 bounded by their q and k measured" in text
