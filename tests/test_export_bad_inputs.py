"""``geoscale export-kv-scales`` on input it cannot use: one line on stderr naming the file
and what is wrong, exit status 2, and the checkpoint exactly as it was (every file's bytes,
every link's target); ``export_kv_scales`` raises ``CheckpointError`` with the same words.
Each case fails before the model is traced (no case here runs a trace), so the module is
fast; tests/test_export_safety.py runs the same cases as separate command-line processes.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from geoscale_fx import cli
from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export.kv_scales import export_kv_scales
from tests.checkpoint_files import save_tiny_llama, tree_state

pytestmark = pytest.mark.zoo


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _config(ckpt, **fields):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))


#: case -> (what is done to a copy of the saved checkpoint, the arguments after its path,
#: the path the command gets (relative to the copy's parent), what stderr must say)
CASES = {
    "missing path": (lambda c: None, [], "nope", r"nope does not exist"),
    "a file, not a directory": (lambda c: None, [], "ckpt/config.json",
                                r"config.json is not a directory"),
    "corrupt safetensors": (
        lambda c: (c / "model.safetensors").write_bytes(b"\x00" * 64), [], "ckpt",
        r"checkpoint file \S*ckpt/model.safetensors is not a readable safetensors file "
        r"\(truncated or corrupt: Error while deserializing header"),
    "truncated safetensors": (
        lambda c: _truncate(c / "model.safetensors"), [], "ckpt",
        r"ckpt/model.safetensors is not a readable safetensors file \(truncated or corrupt: "
        r".*incomplete metadata, file not fully covered\)"),
    "invalid config.json": (
        lambda c: _truncate(c / "config.json"), [], "ckpt",
        r"ckpt/config.json is not valid JSON \(.*line \d+ column \d+"),
    "config.json not an object": (
        lambda c: (c / "config.json").write_text("[]"), [], "ckpt",
        r"ckpt/config.json holds a JSON list, not an object"),
    "unknown family": (
        lambda c: _config(c, model_type="not-a-family"), [], "ckpt",
        r"ckpt/config.json: transformers \S+ cannot read it \(model_type 'not-a-family'\)"),
    "no causal LM": (
        lambda c: (c / "config.json").write_text(json.dumps({"model_type": "vit"})), [], "ckpt",
        r"ckpt/config.json: transformers cannot build a causal LM of model_type 'vit'"),
    "output under a file": (
        lambda c: None, ["--out", "{root}/ckpt/config.json/out"], "ckpt",
        r"cannot write to \S*config.json/out: \S*config.json is not a directory"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    save_tiny_llama(directory)
    return directory


def _prepared(saved, tmp_path, case):
    prepare, extra, target, _ = CASES[case]
    prepare(shutil.copytree(saved, tmp_path / "ckpt"))
    return str(tmp_path / target), [a.format(root=tmp_path) for a in extra]


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_line_exit_2_and_the_checkpoint_untouched(saved, tmp_path, case, capsys):
    path, extra = _prepared(saved, tmp_path, case)
    before = tree_state(tmp_path)
    capsys.readouterr()
    assert cli.main(["export-kv-scales", path, *extra]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("geoscale export-kv-scales: ")
    assert re.search(CASES[case][3], lines[0]), lines[0]
    assert captured.out == ""
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize("case", sorted(set(CASES) - {"a file, not a directory",
                                                      "missing path"}))
def test_the_python_api_raises_checkpoint_error_with_the_same_words(saved, tmp_path, case):
    path, extra = _prepared(saved, tmp_path, case)
    before = tree_state(tmp_path)
    out = extra[1] if extra else None
    with pytest.raises(CheckpointError, match=CASES[case][3]):
        export_kv_scales(path, out)
    assert tree_state(tmp_path) == before


def test_the_python_api_names_a_missing_or_non_directory_checkpoint(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpoint \S*nope does not exist \(a saved "
                                              "Hugging Face model directory is needed\\)"):
        export_kv_scales(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=r"checkpoint \S*file is not a directory"):
        export_kv_scales(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_truncated_shard_of_an_indexed_checkpoint_is_named(tmp_path, capsys):
    """Sharded (an index and two shards): the shard that was cut short is named, though the
    attention's tensors are in the other one."""
    from transformers import AutoModelForCausalLM

    save_tiny_llama(tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    attention = index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    cut = next(s for s in shards if s != attention)
    _truncate(tmp_path / "ckpt" / cut)
    before = tree_state(tmp_path / "ckpt")
    capsys.readouterr()                                     # what saving printed
    assert cli.main(["export-kv-scales", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"geoscale export-kv-scales: checkpoint file {tmp_path / 'ckpt' / cut} is "
                   "not a readable safetensors file (truncated or corrupt: Error while "
                   "deserializing header: incomplete metadata, file not fully covered)")
    assert tree_state(tmp_path / "ckpt") == before
