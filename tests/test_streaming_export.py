"""``export_kv_scales(<checkpoint directory>)``: traced without weights, weights streamed.

The reference is the in-memory route on the same checkpoint loaded by Hugging Face
(``from_pretrained``): the streamed scales and config must equal it bit for bit, on sharded
checkpoints of five families (Llama; Qwen2, q/k/v biases; Qwen3 and Gemma3, QK-norm, Gemma's
``1 + w`` gains; GPT-2, no rotary, a fused Conv1D projection) in float32 and bfloat16. What
is read is checked against the tensors each family's attention reads, written out by hand
here; refusals (a NaN, an inf, a missing tensor) must name the tensor and its file and leave
every file as it was.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geoscale_fx.export.safetensors_reader import CheckpointReader
from geoscale_fx.export import streamed_scales as checkpoint_scales
from geoscale_fx.export.streamed_scales import meta_model
from geoscale_fx.cli import main
from geoscale_fx.export.kv_scales import export_kv_scales
from tests.float_checks import SCALE_ULPS, assert_tensors_close_ulps

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.zoo

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=0)
L = "model.layers.{i}."
QKV = [L + f"self_attn.{p}_proj.weight" for p in "qkv"]
#: family -> (config, what layer i's q/k/v bounds read). After a QK-norm, q and k are
#: bounded by the norm's gain alone (``A_h = diag(g)``), so q_proj/k_proj are not read.
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(**SMALL), [L + "input_layernorm.weight", *QKV]),
    "qwen2": (lambda: transformers.Qwen2Config(**SMALL),
              [L + "input_layernorm.weight", *QKV,
               *[L + f"self_attn.{p}_proj.bias" for p in "qkv"]]),
    "qwen3": (lambda: transformers.Qwen3Config(head_dim=16, **SMALL),
              [L + n for n in ("input_layernorm.weight", "self_attn.v_proj.weight",
                               "self_attn.q_norm.weight", "self_attn.k_norm.weight")]),
    "gemma3": (lambda: transformers.Gemma3TextConfig(head_dim=16, sliding_window=4, **SMALL),
               [L + n for n in ("input_layernorm.weight", "self_attn.v_proj.weight",
                                "self_attn.q_norm.weight", "self_attn.k_norm.weight")]),
    # no rotary, a fused (d, 3d) Conv1D projection with its bias, LayerNorm gain and bias
    "gpt2": (lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                             n_positions=64, bos_token_id=0, eos_token_id=0),
             ["transformer.h.{i}." + n for n in ("ln_1.weight", "ln_1.bias",
                                                 "attn.c_attn.weight", "attn.c_attn.bias")]),
}
K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def _save(family: str, path: Path, dtype=torch.float32) -> Path:
    """A sharded checkpoint (save_pretrained, 20 KB shards) of a seeded tiny model."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).to(dtype)
    model.save_pretrained(path, max_shard_size="20KB")
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())
                 ["weight_map"].values())
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    return path


def _in_memory(path: Path, out: Path, strategy: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    return export_kv_scales(model, out, input_ids=ids, strategy=strategy)


def _record_reads(monkeypatch) -> list[list[str]]:
    """The names of every weight read (buffers, read with ``finite=False``, left out)."""
    calls: list[list[str]] = []
    read = CheckpointReader.read

    def recording(self, names, finite=True):
        names = list(names)
        if finite:
            calls.append(names)
        return read(self, names, finite)

    monkeypatch.setattr(CheckpointReader, "read", recording)
    return calls


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def in_memory_exports(tmp_path_factory):
    """``(family, dtype)`` -> the saved checkpoint and its in-memory exports per strategy
    (output directory, export), made once for the module: the in-memory route does not chunk
    heads (``HEAD_CHUNK_BYTES`` is the streamed route's), so both chunkings compare with the
    same export."""
    made: dict = {}

    def get(family: str, dtype) -> tuple[Path, dict]:
        if (family, dtype) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{str(dtype).split('.')[-1]}")
            ckpt = _save(family, root / "ckpt", dtype)
            made[family, dtype] = ckpt, {
                strategy: (root / f"ref-{strategy}",
                           _in_memory(ckpt, root / f"ref-{strategy}", strategy))
                for strategy in ("tensor", "head")}
        return made[family, dtype]

    return get


@pytest.mark.parametrize("chunk", ["whole", "one head"])      # a family's two runs adjacent
@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                          ("qwen2", torch.float32), ("qwen3", torch.bfloat16),
                                          ("gemma3", torch.float32), ("gpt2", torch.float32)])
def test_streamed_equals_in_memory(family, dtype, chunk, tmp_path, monkeypatch,
                                   in_memory_exports):
    """Also with the query heads bounded one at a time (what a 70B layer's 64 heads get in
    chunks of 16): the per-head math gives the same bits."""
    ckpt, refs = in_memory_exports(family, dtype)
    if chunk == "one head":
        monkeypatch.setattr(checkpoint_scales, "HEAD_CHUNK_BYTES", 1)
    for strategy in ("tensor", "head"):
        ref_dir, ref = refs[strategy]
        got = export_kv_scales(ckpt, tmp_path / f"got-{strategy}", strategy=strategy)
        assert len(got.tensors) == 2 * 3
        # both routes round up float64 bounds of the same per-head math: a float64 sum in
        # another order (other head batches, other kernels) can move a round-up by one ulp
        assert_tensors_close_ulps(got.tensors, ref.tensors, ulps=SCALE_ULPS, msg=strategy)
        assert got.quantization_config == ref.quantization_config
        assert (_files(tmp_path / f"got-{strategy}") == _files(ref_dir))


def test_merged_into_the_checkpoint_by_default(tmp_path):
    ckpt = _save("qwen2", tmp_path / "ckpt")
    weights = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    export = export_kv_scales(ckpt, strategy="head")
    assert export.merged
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {**weights, **{n: "kv_scales.safetensors" for n in export.tensors}}
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"] == export.quantization_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reads_only_the_attention_tensors_one_layer_at_a_time(family, tmp_path, monkeypatch):
    """Each ``read`` is one layer's tensors that its q/k/v bounds read (projections, biases,
    input-norm and QK-norm gains), each once; no MLP, embedding or other layer."""
    ckpt = _save(family, tmp_path / "ckpt")
    calls = _record_reads(monkeypatch)
    export_kv_scales(ckpt, tmp_path / "out")
    expected = [sorted(n.format(i=i) for n in FAMILIES[family][1]) for i in range(2)]
    assert [sorted(c) for c in calls] == expected


def test_meta_model_has_the_loaded_buffers_and_no_parameter_storage(tmp_path):
    ckpt = _save("llama", tmp_path / "ckpt", torch.bfloat16)
    model = meta_model(ckpt, CheckpointReader(ckpt))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    buffers = dict(loaded.named_buffers())
    assert sorted(dict(model.named_buffers())) == sorted(buffers) != []
    for name, b in model.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, buffers[name]), name


def _shard_of(ckpt: Path, name: str) -> Path:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return ckpt / index["weight_map"][name]


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
def test_nan_in_one_k_proj_is_refused_by_name_and_nothing_is_written(bad, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    ckpt = _save("llama", tmp_path / "ckpt")
    shard = _shard_of(ckpt, K_PROJ)
    tensors = load_file(str(shard))
    tensors[K_PROJ][3, 5] = bad
    save_file(tensors, str(shard), metadata={"format": "pt"})
    before = _files(ckpt)
    with pytest.raises(ValueError, match=rf"'{K_PROJ}' in .*{shard.name} has 1 non-finite"):
        export_kv_scales(ckpt)
    assert main(["export-kv-scales", str(ckpt)]) == 2
    assert K_PROJ in capsys.readouterr().err
    assert _files(ckpt) == before
    with pytest.raises(ValueError, match=K_PROJ):
        export_kv_scales(ckpt, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()


def test_tensor_missing_from_the_index_is_refused(tmp_path):
    ckpt = _save("qwen2", tmp_path / "ckpt")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][K_PROJ]
    index_path.write_text(json.dumps(index))
    before = _files(ckpt)
    with pytest.raises(ValueError, match=rf"'{K_PROJ}' is missing \(model.safetensors."
                                         r"index.json does not list it\)"):
        export_kv_scales(ckpt)
    assert _files(ckpt) == before


def test_tensor_missing_from_its_shard_is_refused(tmp_path):
    """Qwen3's k bound reads the QK-norm gain (not k_proj): remove that."""
    from safetensors.torch import load_file, save_file

    ckpt = _save("qwen3", tmp_path / "ckpt")
    k_norm = "model.layers.1.self_attn.k_norm.weight"
    shard = _shard_of(ckpt, k_norm)
    tensors = load_file(str(shard))
    del tensors[k_norm]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    before = _files(ckpt)
    with pytest.raises(ValueError, match=rf"'{k_norm}' is missing from {shard.name} \(the "
                                         "index lists it there\)"):
        export_kv_scales(ckpt)
    assert _files(ckpt) == before


def test_cli_never_loads_a_saved_directory(tmp_path, monkeypatch):
    """``geoscale export-kv-scales DIR`` streams: ``from_pretrained`` is never called."""
    from safetensors.torch import load_file

    ckpt = _save("llama", tmp_path / "ckpt")
    reference = _in_memory(ckpt, tmp_path / "ref", "head")

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained called")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    assert main(["export-kv-scales", str(ckpt), "--strategy", "head"]) == 0
    written = load_file(str(ckpt / "kv_scales.safetensors"))
    assert_tensors_close_ulps(written, reference.tensors, ulps=SCALE_ULPS)   # as above


def test_arguments_of_the_other_route_are_refused(tmp_path):
    ckpt = _save("llama", tmp_path / "ckpt")
    with pytest.raises(ValueError, match="example inputs are for an in-memory model"):
        export_kv_scales(ckpt, None, torch.zeros(1, 8, dtype=torch.long))
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    with pytest.raises(ValueError, match="out_dir is needed for an in-memory model"):
        export_kv_scales(model, input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_unbounded_attention_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """OLMo2 normalizes after the projections: its values read the residual stream, which is
    bounded only by value (the embedding table plus every block's output norm,
    ``analysis/norms/parameter_bound.py``). Without that bound the values the cache stores have none (as
    in memory), and the refusal, naming the cache layer, comes from the trace alone."""
    import geoscale_fx.analysis.norms.bounded_operand as bounded_operand
    import geoscale_fx.analysis.sides.operand_sides as operand_sides

    for module in (operand_sides, bounded_operand):
        monkeypatch.setattr(module, "trace_value_bound", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Olmo2Config(**SMALL))
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    calls = _record_reads(monkeypatch)
    before = _files(tmp_path / "ckpt")
    said = (r"cache layer 0 \(`model.layers.0.self_attn`\): the stored values `\w+` cannot be "
            r"bounded from the weights \(no normalization before the projection .+\)\. The "
            r"projection's input is neither normalized")
    with pytest.raises(ValueError, match=said + r".* No cache layer can be bounded \(2 "
                                                 r"refused\): there is nothing to export\.$"):
        export_kv_scales(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=said + r".* \(1 more refused\.\)$"):
        export_kv_scales(tmp_path / "ckpt", all_or_nothing=True)
    assert calls == [] and _files(tmp_path / "ckpt") == before
