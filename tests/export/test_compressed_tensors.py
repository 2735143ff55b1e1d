"""geoscale_fx.export.compressed_tensors: what ``write`` does to a saved checkpoint's files.

The export killed before every file-system step it takes (a fault injected at each call of
``os.replace``/``link``/``symlink``/``unlink``/``rename``/``fsync``, not timing luck) leaves
a checkpoint that ``from_pretrained`` loads with its weights, without the scales or with
all of them, whose index names only files that hold what it says; running the export again
completes it. In a hub-cache snapshot no blob changes. A second export changes only what
changed. The scales here are hand-made (the writer does not look at their values); the
streamed route end to end is in tests/test_export_safety.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
import torch

from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export import compressed_tensors
from geoscale_fx.export.kv_scales import KVExportOptions
from geoscale_fx.export.safe_writes import TEMP_MARK
from geoscale_fx.export.safetensors_reader import INDEX_FILE, stored_names
from tests.checkpoint_files import (
    blobs_intact, contents, hub_cache, save_tiny_llama, snapshot_reads, tree_state,
)

pytestmark = pytest.mark.zoo

SCALES = {f"model.layers.0.self_attn.{k}_scale": torch.tensor([v], dtype=torch.float32)
          for k, v in (("k", 0.02), ("v", 0.01), ("q", 0.03))}
#: every call that changes a directory or makes a change durable
STEPS = ("replace", "rename", "link", "symlink", "unlink", "fsync")
REV, OTHER_REV = "a" * 40, "b" * 40


class Killed(BaseException):
    """The process died here: nothing after it runs, no cleanup either."""


@contextlib.contextmanager
def faults(kill_at: int | None, log: list):
    """Every ``STEPS`` call logged as ``(name, paths)``; the one numbered ``kill_at`` (from
    0) and every later one raise ``Killed`` instead of running."""
    with pytest.MonkeyPatch.context() as patch:
        for name in STEPS:
            real = getattr(os, name)

            def step(*args, _name=name, _real=real, **kwargs):
                if kill_at is not None and len(log) >= kill_at:
                    raise Killed(_name)
                log.append((_name, tuple(str(a) for a in args if isinstance(a, (str,
                                                                                os.PathLike)))))
                return _real(*args, **kwargs)

            patch.setattr(os, name, step)
        yield


def _write(directory, scales=SCALES, kill_at=None, strategy="tensor"):
    log = []
    with faults(kill_at, log):
        compressed_tensors.write(scales, KVExportOptions(strategy=strategy), directory)
    return log


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Llama saved once, its state dict, and a hub cache of it: revision ``a…``
    and revision ``b…`` sharing every blob but generation_config.json's."""
    root = tmp_path_factory.mktemp("saved")
    model = save_tiny_llama(root / "plain")
    gen = json.loads((root / "plain" / "generation_config.json").read_text())
    other = (json.dumps({**gen, "max_length": 7}, indent=2) + "\n").encode()
    repo = hub_cache(root / "plain", root / "cache", {REV: {}, OTHER_REV: {
        "generation_config.json": other}})
    return root, {k: v.clone() for k, v in model.state_dict().items()}, repo


def _fresh(saved, tmp_path, layout):
    """A copy of the plain checkpoint or of the whole hub cache (links kept); the
    directory to export into."""
    root, _, repo = saved
    if layout == "plain":
        return shutil.copytree(root / "plain", tmp_path / "ckpt")
    copied = shutil.copytree(repo, tmp_path / repo.name, symlinks=True)
    return copied / "snapshots" / REV


def _check_loads(ckpt, state) -> bool:
    """``from_pretrained`` loads the weights as saved; the index (if any) names files that
    hold what it maps to them (what vLLM reads); with a quantization_config, every scale is
    listed and stored, and loaded where this transformers/compressed-tensors pair registers
    scale parameters. Whether the scales are there."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    index = ckpt / INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    for file in set(weight_map.values()):
        assert set(stored_names(ckpt / file)) >= {n for n, f in weight_map.items() if f == file}
    if "quantization_config" not in json.loads((ckpt / "config.json").read_text()):
        return False
    assert {n for n, f in weight_map.items() if f == "kv_scales.safetensors"} == set(SCALES)
    stored = load_file(str(ckpt / "kv_scales.safetensors"))
    assert stored.keys() == SCALES.keys()
    assert all(torch.equal(stored[n], t) for n, t in SCALES.items())
    assert all(torch.equal(loaded[n], t) for n, t in SCALES.items() if n in loaded)
    return True


@pytest.mark.parametrize("layout", ["plain", "hub"])
def test_killed_at_every_step_the_checkpoint_loads_and_a_rerun_completes_it(saved, tmp_path,
                                                                            layout):
    pytest.importorskip("compressed_tensors")
    root, state, repo = saved
    done = _fresh(saved, tmp_path / "reference", layout)
    steps = _write(done)
    assert "replace" in {name for name, _ in steps}
    assert _check_loads(done, state)
    final, seen = contents(done), []
    for kill_at in range(len(steps) + 1):
        ckpt = _fresh(saved, tmp_path / f"kill{kill_at}", layout)
        context = pytest.raises(Killed) if kill_at < len(steps) else contextlib.nullcontext()
        with context:
            _write(ckpt, kill_at=kill_at)
        seen.append(_check_loads(ckpt, state))
        assert all(TEMP_MARK in p.name and p.name.startswith(".") for p in ckpt.iterdir()
                   if p.name not in final and p.name != "model.safetensors"), kill_at
        if layout == "hub":
            cache = ckpt.parent.parent
            assert blobs_intact(cache) == []
            assert snapshot_reads(cache / "snapshots" / OTHER_REV) == snapshot_reads(
                repo / "snapshots" / OTHER_REV)
        _write(ckpt)                                             # run again: completed
        assert contents(ckpt) == final, kill_at
    # the scales appear at one step, config.json's replacement (the last), and stay
    last = max(i for i, (name, paths) in enumerate(steps) if name == "replace")
    assert steps[last][1][-1] == str(done / "config.json")
    assert seen == [False] * (last + 1) + [True] * (len(seen) - last - 1)


def test_into_a_hub_snapshot_no_blob_changes_and_the_shard_stays_a_link(saved, tmp_path):
    root, state, repo = saved
    ckpt = _fresh(saved, tmp_path, "hub")
    cache = ckpt.parent.parent
    before = tree_state(ckpt)
    _write(ckpt)
    after = tree_state(ckpt)
    assert blobs_intact(cache) == [] and sorted(p.name for p in (cache / "blobs").iterdir()) \
        == sorted(p.name for p in (repo / "blobs").iterdir())
    assert snapshot_reads(cache / "snapshots" / OTHER_REV) == snapshot_reads(
        repo / "snapshots" / OTHER_REV)
    assert after["model-00001-of-00001.safetensors"] == before["model.safetensors"]   # a link
    assert "model.safetensors" not in after
    assert after["config.json"][0] == "file" and after[INDEX_FILE][0] == "file"
    assert after["generation_config.json"] == before["generation_config.json"]         # a link
    assert _check_loads(ckpt, state)


def test_a_second_export_rewrites_only_what_changed(saved, tmp_path):
    """The same scales: nothing is written at all. Other values: only kv_scales.safetensors.
    Fewer names (``--no-q``): the index and the file lose the old names."""
    ckpt = _fresh(saved, tmp_path, "plain")
    _write(ckpt)
    first = tree_state(ckpt)
    steps = _write(ckpt)
    assert [s for s in steps if not any(TEMP_MARK in p for p in s[1])] == []
    assert tree_state(ckpt) == first
    _write(ckpt, {n: t * 2 for n, t in SCALES.items()})
    changed = {k for k, v in tree_state(ckpt).items() if first.get(k) != v}
    assert changed == {"kv_scales.safetensors"}
    kv_only = {n: t for n, t in SCALES.items() if not n.endswith("q_scale")}
    _write(ckpt, kv_only)
    listed = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    assert sorted(n for n, f in listed.items() if f == "kv_scales.safetensors") == sorted(kv_only)
    assert sorted(stored_names(ckpt / "kv_scales.safetensors")) == sorted(kv_only)


def test_ambiguous_or_broken_checkpoints_are_refused_before_any_write(saved, tmp_path):
    ckpt = _fresh(saved, tmp_path, "plain")
    weights = tree_state(ckpt)["model.safetensors"]

    def refused(match):
        with pytest.raises(CheckpointError, match=match):
            _write(ckpt)
        after = tree_state(ckpt)
        assert after["model.safetensors"] == weights
        assert not {"kv_scales.safetensors", "quantization_config.json"} & set(after)

    (ckpt / "model-00001-of-00001.safetensors").write_bytes(b"another file")
    refused("holds both model.safetensors and a different model-00001-of-00001.safetensors")
    (ckpt / "model-00001-of-00001.safetensors").unlink()
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "other.safetensors"}}))
    refused(r"holds both model.safetensors and model.safetensors.index.json naming "
            r"\['other")
    (ckpt / INDEX_FILE).unlink()
    (ckpt / "config.json").write_text('{"model_type": "llama", ')
    refused(r"config.json is not valid JSON \(Expecting")
    (ckpt / "config.json").unlink()
    os.symlink("../gone/blob", ckpt / "config.json")
    refused(r"config.json is a dangling symlink")
