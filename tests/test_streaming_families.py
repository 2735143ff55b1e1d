"""The streamed export on families whose trace or key layout the streamed route got wrong.

Each family's shrunk default config (``hf_configs.tiny_model``) is saved with
``save_pretrained``. The streamed route (``export_kv_scales(ckpt)``) must write the scales the
in-memory route writes on the loaded model, bit for bit, and they must bound what the model
itself caches: per cache layer and kv head, ``max |entry| ≤ scale·448`` on random prompts and
an adversarial one (``bench.export_families``: the layer's writer found by watching
``Cache.update``, independently of geoscale's layer mapping). One family per mechanism:

* ``gemma3``: a legacy key layout (parameter ``model.language_model.layers.0…`` stored as
  ``language_model.model.layers.0…``), read through transformers' renamings;
* ``sarvam_moe``: q/k/v built on load by a converter's ``Split`` of a fused
  ``query_key_value`` (tests/export/test_checkpoint_keys.py: the rows read);
* ``gptj``: a non-persistent sinusoid table indexed by the positions (on the meta device:
  "Tensor device mismatch … meta and cpu");
* ``helium``: an interleaved rotary table the analysis evaluates (on the meta device:
  "cannot be bounded from the weights … neither a constant nor a rotary cos/sin table");
* ``roformer``: sinusoid positions held by a parameter that does not require grad (a fixed
  table the analysis evaluates: read before the trace, as buffers are);
* ``xlm``: ``.item()`` on lengths computed from the ids (on meta: no value);
* ``gemma3n_text``: buffers of a sub-model initialized by that sub-model's ``_init_weights``;
* ``emu3``: a text config ``AutoModelForCausalLM`` does not map (built from its
  ``architectures``).

Refusals must be the in-memory route's (``jetmoe``: its MoE router's ``tolist`` crashed
on meta; now it reaches the analysis, which refuses it as in memory), and a forward that does
not run on token ids alone is a ``ValueError`` naming the model and the failure.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench.export_families import _prompts, cached_amax, compare_with_cache
from geoscale_fx.testing import hf_configs
from geoscale_fx.export.kv_scales import export_kv_scales
from tests.float_checks import SCALE_ULPS, assert_tensors_close_ulps

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

FAMILIES = ["gemma3", "sarvam_moe", "gptj", "helium", "roformer", "xlm", "gemma3n_text",
            "emu3"]


def _saved(model_type: str, path: Path) -> Path:
    hf_configs.tiny_model(model_type).save_pretrained(path)
    return path


def _loaded(path: Path, **kwargs):
    config = transformers.AutoConfig.from_pretrained(path)
    return hf_configs.causal_lm_class(config).from_pretrained(path, **kwargs).eval()


def _in_memory(path: Path, out: Path):
    model = _loaded(path)
    ids = hf_configs.token_inputs(model, seq_len=8)["input_ids"]
    return export_kv_scales(model, out, input_ids=ids, strategy="head")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_equals_in_memory_and_bounds_the_cache(model_type, tmp_path):
    ckpt = _saved(model_type, tmp_path / "ckpt")
    got = export_kv_scales(ckpt, tmp_path / "streamed", strategy="head")
    ref = _in_memory(ckpt, tmp_path / "in-memory")
    assert len(got.tensors) >= 6
    # both routes round up float64 bounds of the same per-head math: a float64 sum in another
    # order (other head batches, other kernels) can move a round-up by one float32 ulp
    assert_tensors_close_ulps(got.tensors, ref.tensors, ulps=SCALE_ULPS, msg=model_type)
    model = _loaded(ckpt, attn_implementation="eager")
    sites = sorted({n.rsplit(".", 1)[0] for n in got.tensors})
    layers, notes = cached_amax(model, sites, _prompts(model))
    ratios, violations, more = compare_with_cache(got.tensors, layers)
    assert not notes and violations == 0, more
    assert ratios and max(ratios) <= 1 and min(ratios) > 0


def test_refusals_are_the_in_memory_routes(tmp_path):
    """jetmoe crashed on the meta device ("Cannot copy out of meta tensor": its router's
    expert counts); traced with values it reaches the analysis, which refuses it as the
    in-memory route does: word for word, every cache layer refused (its query takes a term
    from the caller's position embeddings), so nothing is left to export."""
    ckpt = _saved("jetmoe", tmp_path / "ckpt")
    with pytest.raises(ValueError) as streamed:
        export_kv_scales(ckpt, tmp_path / "streamed")
    with pytest.raises(ValueError) as in_memory:
        _in_memory(ckpt, tmp_path / "in-memory")
    said = (r"^export_kv_scales: cache layer 0 \(`.+`\): the attention cannot be bounded from "
            r"the weights \(.+ comes from graph inputs .+\)\. A term of the query or key is "
            r"computed outside the traced graph .+ No cache layer can be bounded \(2 refused\)")
    assert re.search(said, str(streamed.value)), str(streamed.value)
    assert str(streamed.value) == str(in_memory.value)
    assert not (tmp_path / "streamed").exists()


def test_a_forward_that_needs_more_than_token_ids_is_refused_by_name(tmp_path):
    ckpt = _saved("gemma4_unified_assistant", tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"Gemma4UnifiedAssistantForCausalLM fails on token "
                                         r"ids alone \(input_ids \(1, 8\)\).*ValueError: "
                                         "inputs_embeds and shared_kv_states cannot be None"):
        export_kv_scales(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
