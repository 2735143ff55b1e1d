"""geoscale_fx.export.safetensors_reader: ``CheckpointReader`` on hand-written safetensors directories
(tests/test_streaming_export.py exercises it through ``export_kv_scales``)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export.safetensors_reader import INDEX_FILE, SINGLE_WEIGHTS_FILE, CheckpointReader


def _sharded(path, shards: dict[str, dict[str, torch.Tensor]], listed=None):
    for file, tensors in shards.items():
        save_file(tensors, str(path / file))
    weight_map = listed or {name: file for file, ts in shards.items() for name in ts}
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_reads_the_named_tensors_from_their_shards_in_the_stored_dtype(tmp_path):
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b, c = torch.ones(4, dtype=torch.float64), torch.tensor([1, 2], dtype=torch.int64)
    _sharded(tmp_path, {"s1.safetensors": {"a": a, "ids": c}, "s2.safetensors": {"b": b}})
    reader = CheckpointReader(tmp_path)
    assert reader.listing == INDEX_FILE and "b" in reader and "zz" not in reader
    assert reader.file_of("b") == "s2.safetensors"
    out = reader.read(["b", "a", "a"])                       # duplicates read once
    assert list(out) == ["a", "b"]
    assert out["a"].dtype == torch.bfloat16 and torch.equal(out["a"], a)
    assert torch.equal(out["b"], b)
    # first floating tensor of the first file: "a" (bf16), the int tensor skipped
    assert reader.floating_dtype() == torch.bfloat16


def test_a_single_file_is_read_alone_even_beside_an_index(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / SINGLE_WEIGHTS_FILE))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"other": "x.safetensors"}}))
    reader = CheckpointReader(tmp_path)
    assert reader.listing == SINGLE_WEIGHTS_FILE and reader.weight_map == {
        "w": SINGLE_WEIGHTS_FILE}


def test_non_finite_tensors_are_refused_naming_tensor_file_and_count(tmp_path):
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    save_file({"model.k.weight": bad, "mask": torch.tensor([0.0, -float("inf")])},
              str(tmp_path / SINGLE_WEIGHTS_FILE))
    reader = CheckpointReader(tmp_path)
    with pytest.raises(ValueError, match=r"'model.k.weight' in .*model.safetensors has 3 "
                                         r"non-finite entries"):
        reader.read(["model.k.weight"])
    assert reader.read(["mask"], finite=False)["mask"][1] == -float("inf")   # buffers may


def test_missing_tensors_and_files_are_refused_by_name(tmp_path):
    _sharded(tmp_path, {"s1.safetensors": {"a": torch.zeros(1)}},
             listed={"a": "s1.safetensors", "b": "s1.safetensors"})
    reader = CheckpointReader(tmp_path)
    with pytest.raises(ValueError, match=r"tensor 'zz' is missing \(model.safetensors.index"):
        reader.read(["zz"])
    with pytest.raises(ValueError, match="'b' is missing from s1.safetensors"):
        reader.read(["a", "b"])
    (tmp_path / "s1.safetensors").unlink()             # gone after the reader was made
    with pytest.raises(CheckpointError, match="'a' is listed in s1.safetensors, which does"):
        reader.read(["a"])
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint .*missing does not exist \(a saved"):
        CheckpointReader(tmp_path / "missing")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpoint .*a_file is not a directory"):
        CheckpointReader(tmp_path / "a_file")


def test_every_listed_file_is_checked_when_the_reader_is_made(tmp_path):
    """A file the index lists that is missing, truncated or not safetensors at all is a
    ``CheckpointError`` naming it before any tensor is read; so is an index that is not
    JSON or has no weight map. Only headers are parsed."""
    _sharded(tmp_path, {"s1.safetensors": {"a": torch.zeros(4)}},
             listed={"a": "s1.safetensors", "c": "gone.safetensors"})
    with pytest.raises(CheckpointError, match=r"gone.safetensors \(listed in model.safetensors"
                                              r".index.json\) does not exist"):
        CheckpointReader(tmp_path)
    _sharded(tmp_path, {"s1.safetensors": {"a": torch.zeros(4)},
                        "s2.safetensors": {"b": torch.zeros(4)}})
    data = (tmp_path / "s2.safetensors").read_bytes()
    for bad, why in ((data[:-3], "incomplete metadata"), (b"not safetensors", "header"),
                     (b"", "header too small")):
        (tmp_path / "s2.safetensors").write_bytes(bad)
        with pytest.raises(CheckpointError, match=r"s2.safetensors is not a readable "
                                                  rf"safetensors file \(truncated or corrupt: .*{why}"):
            CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text('{"weight_map": {"a": "s1.safe')
    with pytest.raises(CheckpointError, match=r"index.json is not valid JSON \(Unterminated"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r'has no "weight_map" of tensor names'):
        CheckpointReader(tmp_path)
