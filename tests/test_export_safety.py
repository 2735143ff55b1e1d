"""``geoscale export-kv-scales`` end to end, as a user runs it, on checkpoints it must not
harm: a Hugging Face hub cache snapshot (blobs shared by two revisions), a second export
after the weights changed, and bad input seen from a separate process (what a shell sees:
one line on stderr, exit 2). The file-level steps, killed at each one, are in
tests/export/test_compressed_tensors.py; the bad inputs in process in
tests/test_export_bad_inputs.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geoscale_fx.cli import main
from tests.checkpoint_files import (
    blobs_intact, hub_cache, save_tiny_llama, snapshot_reads, tree_state,
)

pytestmark = pytest.mark.zoo

REV, OTHER_REV = "c" * 40, "d" * 40
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
SCALES = [f"model.layers.0.self_attn.{k}_scale" for k in "kvq"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    model = save_tiny_llama(root / "plain")
    return root / "plain", {k: v.clone() for k, v in model.state_dict().items()}


def _loaded(source, state, **kwargs):
    """``from_pretrained(source)``: the weights as saved (checked); its state dict."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(source, **kwargs).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    return loaded


def test_export_into_a_hub_cache_snapshot_leaves_every_blob_intact(saved, tmp_path):
    from safetensors.torch import load_file

    plain, state = saved
    gen = json.loads((plain / "generation_config.json").read_text())
    repo = hub_cache(plain, tmp_path / "hub", {REV: {}, OTHER_REV: {
        "generation_config.json": json.dumps({**gen, "max_length": 9}).encode()}})
    other_before = snapshot_reads(repo / "snapshots" / OTHER_REV)
    blobs_before = sorted(p.name for p in (repo / "blobs").iterdir())
    links_before = tree_state(repo / "snapshots" / REV)
    assert main(["export-kv-scales", str(repo / "snapshots" / REV)]) == 0
    assert blobs_intact(repo) == [] and sorted(
        p.name for p in (repo / "blobs").iterdir()) == blobs_before
    assert snapshot_reads(repo / "snapshots" / OTHER_REV) == other_before
    after = tree_state(repo / "snapshots" / REV)
    assert after["model-00001-of-00001.safetensors"] == links_before["model.safetensors"]
    assert after["config.json"][0] == "file"
    # transformers finds it as the hub would serve it (offline: refs/main -> the snapshot)
    loaded = _loaded("org/tiny", state, cache_dir=tmp_path / "hub")
    scales = load_file(str(repo / "snapshots" / REV / "kv_scales.safetensors"))
    assert sorted(scales) == sorted(SCALES)
    assert all(torch.equal(loaded[n], t) for n, t in scales.items() if n in loaded)
    config = json.loads((repo / "snapshots" / REV / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    _loaded(repo / "snapshots" / OTHER_REV, state)               # the other revision as it was


def test_a_second_export_changes_only_the_scales(saved, tmp_path):
    """Exported, then ``k_proj`` doubled in the shard (by the test): the second export
    rewrites kv_scales.safetensors alone, its k_scale exactly doubled, v and q the same;
    a third export with nothing changed writes no file."""
    from safetensors.torch import load_file, save_file

    plain, _ = saved
    ckpt = shutil.copytree(plain, tmp_path / "ckpt")
    assert main(["export-kv-scales", str(ckpt)]) == 0
    first = tree_state(ckpt)
    scales = load_file(str(ckpt / "kv_scales.safetensors"))
    shard = ckpt / "model-00001-of-00001.safetensors"
    weights = load_file(str(shard))
    weights[K_PROJ] = weights[K_PROJ] * 2
    save_file(weights, str(shard), metadata={"format": "pt"})
    edited = tree_state(ckpt)
    assert main(["export-kv-scales", str(ckpt)]) == 0
    second = tree_state(ckpt)
    assert {k for k in second if second[k] != edited.get(k)} == {"kv_scales.safetensors"}
    assert set(second) == set(first)
    again = load_file(str(ckpt / "kv_scales.safetensors"))
    k, v, q = SCALES
    assert torch.equal(again[k], scales[k] * 2)
    assert torch.equal(again[v], scales[v]) and torch.equal(again[q], scales[q])
    mtimes = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    assert main(["export-kv-scales", str(ckpt)]) == 0
    assert tree_state(ckpt) == second
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == mtimes


def test_bad_input_from_a_shell_one_line_and_exit_2(saved, tmp_path):
    """The command as a process (its own logging set up, transformers' own warnings): for a
    family transformers does not know, stderr is exactly one line naming config.json (one
    process: a start costs seconds; the other cases run in process)."""
    plain, _ = saved
    ckpt = shutil.copytree(plain, tmp_path / "family")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "not-a-family"}))
    before = tree_state(ckpt)
    run = subprocess.run([sys.executable, "-m", "geoscale_fx", "export-kv-scales", str(ckpt)],
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"geoscale export-kv-scales: {ckpt / 'config.json'}: "
                               "transformers ")
    assert "cannot read it (model_type 'not-a-family'): " in lines[0]
    assert tree_state(ckpt) == before
