"""``graph_cache``: the ATen trace of a rewritten graph, on disk, keyed by value.

The key must change with everything the trace is a function of (graph code, constants by
value, input layouts, plans) and be refused (None) where something has no value to key by;
a stored graph must load into another fake mode and compute what the traced one did; and a
second compile of the same model must skip the trace and compute the same outputs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import geoscale_fx
from geoscale_fx.compile import dynamo_backend, graph_cache
from geoscale_fx.compile.backend_registry import BACKENDS
from geoscale_fx.compile.graph_cache import describe, graph_key
from models_zoo.nanogpt import GPT, GPTConfig


@dataclass(frozen=True)
class _Plan:
    lowering: str
    n_scale: int
    hidden: object = field(default=None, repr=False)


class _Policy:
    def __init__(self, alpha):
        self.alpha = alpha


def test_a_description_is_by_value_and_changes_with_any_shown_field():
    assert describe(_Plan("fused", 4)) == describe(_Plan("fused", 4))
    assert describe(_Plan("fused", 4)) != describe(_Plan("explicit", 4))
    assert describe(_Plan("fused", 4)) != describe(_Plan("fused", 1))
    # a hidden field (AttentionSite._resolve reads the graph, which the key holds by value)
    assert describe(_Plan("fused", 4, hidden=lambda n: n)) == describe(_Plan("fused", 4))
    assert describe(_Policy(2.0)) != describe(_Policy(3.0))
    assert describe({"b": 1, "a": (2, [3.5])}) == describe({"a": (2, [3.5]), "b": 1})
    assert describe(torch.ones(3)) != describe(torch.ones(3) * 2)
    assert describe(torch.ones(3)) != describe(torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("unkeyable", [lambda x: x, print, _Policy, object(),
                                       torch.fx.Graph().placeholder("x")])
def test_what_has_no_value_to_key_by_is_refused(unkeyable):
    assert describe(unkeyable) is None
    assert describe((1, {"k": [unkeyable]})) is None
    assert describe(_Policy(unkeyable)) is None


def test_a_description_gives_up_on_unbounded_nesting():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    assert describe(deep) is None


def _scaled_tanh(x, w):
    return torch.tanh(x @ w) * 2


class _WithConstant(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.register_buffer("table", torch.full((4,), value))

    def forward(self, x):
        return x + self.table


def test_the_key_changes_with_code_constants_inputs_and_material():
    gm = torch.fx.symbolic_trace(_WithConstant(1.0))
    x = torch.randn(2, 4)
    key = graph_key(gm, [x], ("plan", 1))
    assert key == graph_key(torch.fx.symbolic_trace(_WithConstant(1.0)), [x], ("plan", 1))
    assert key != graph_key(torch.fx.symbolic_trace(_WithConstant(2.0)), [x], ("plan", 1))
    assert key != graph_key(gm, [torch.randn(3, 4)], ("plan", 1))
    assert key != graph_key(gm, [torch.randn(4, 2).t()], ("plan", 1))      # strides
    assert key != graph_key(gm, [x.double()], ("plan", 1))
    assert key != graph_key(gm, [x], ("plan", 2))
    assert key != graph_key(torch.fx.symbolic_trace(lambda x: x * self_free(x)), [x],
                            ("plan", 1))
    assert graph_key(gm, [x], ("plan", lambda: 1)) is None
    with torch.no_grad():          # what the programs trace under (tensors they create)
        assert graph_key(gm, [x], ("plan", 1)) != key
    with torch.inference_mode():
        assert graph_key(gm, [x], ("plan", 1)) != key
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert graph_key(gm, [x], ("plan", 1)) != key
    finally:
        torch.set_default_dtype(default)
    # a submodule that is not a graph has no code to key by
    assert graph_key(torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4))),
                     [x], ()) is None


def self_free(x):
    return x + 1


def _fake_trace(fn, *inputs):
    mode = FakeTensorMode()
    with mode:
        return make_fx(fn, tracing_mode="fake")(*[mode.from_tensor(t) for t in inputs])


def test_a_stored_graph_loads_into_another_fake_mode_and_computes_the_same(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    traced = _fake_trace(_scaled_tanh, x, w)
    key = graph_key(traced, [x, w], "material")
    assert graph_cache.load(key, FakeTensorMode()) is None
    graph_cache.store(key, traced)
    loaded = graph_cache.load(key, FakeTensorMode())
    assert loaded is not None and loaded.code == traced.code
    torch.testing.assert_close(loaded(x, w), _scaled_tanh(x, w))


def test_an_unreadable_entry_is_ignored_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    key = "ab" + "0" * 62
    path = tmp_path / "geoscale" / "ab" / f"{key}.graph"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a graph")
    counters.clear()
    assert graph_cache.load(key, FakeTensorMode()) is None
    assert counters["geoscale"]["graph_cache_unreadable"] == 1


def test_off_where_inductors_fx_graph_cache_is_off():
    from torch._inductor import config

    assert graph_cache.enabled()
    with config.patch(fx_graph_cache=False):
        assert not graph_cache.enabled()
    with config.patch(force_disable_caches=True):
        assert not graph_cache.enabled()


def test_the_source_hash_follows_every_file_of_the_package(tmp_path, monkeypatch):
    """A changed, added or renamed source file is another hash (a changed program or
    estimator must not read a graph traced from the old one)."""
    (tmp_path / "passes").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "passes" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(graph_cache, "_PACKAGE", tmp_path)

    def fresh():
        monkeypatch.setattr(graph_cache, "_SOURCE_HASH", None)
        return graph_cache.source_hash()

    first = fresh()
    assert fresh() == first and len(first) == 64
    (tmp_path / "passes" / "b.py").write_text("y = 3\n")
    changed = fresh()
    (tmp_path / "c.py").write_text("")
    added = fresh()
    (tmp_path / "c.py").rename(tmp_path / "d.py")
    renamed = fresh()
    assert len({first, changed, added, renamed}) == 4


# --- through the backend: Inductor's compile_fx stood in for by aot_eager (fast) -------------

def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)).eval()


@pytest.fixture
def cheap_inductor(tmp_path, monkeypatch):
    """``compiler="inductor"`` with compile_fx replaced by aot_eager, a fresh cache
    directory, and a count of the ATen traces run."""
    from torch._inductor import compile_fx as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor, "compile_fx",
                        lambda gm, inputs, config_patches=None: aot_eager(gm, inputs))
    traces = []
    real = dynamo_backend.aten_graph

    def counted(gm, inputs, training=False):
        traces.append(gm)
        return real(gm, inputs, training)

    monkeypatch.setattr(dynamo_backend, "aten_graph", counted)
    return traces


def _forward(**options):
    torch._dynamo.reset()
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return geoscale_fx.wrap(_model(), compiler="inductor", **options)(ids)[0]


@pytest.mark.slow
def test_a_second_compile_reads_the_trace_and_computes_the_same(cheap_inductor):
    counters.clear()
    first = _forward()
    assert counters["geoscale"]["graph_cache_miss"] == 1 and len(cheap_inductor) == 1
    second = _forward()
    assert counters["geoscale"]["graph_cache_hit"] == 1 and len(cheap_inductor) == 1
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    third = _forward(fp8_format="e5m2")            # other plans: another key, traced
    assert counters["geoscale"]["graph_cache_miss"] == 2 and len(cheap_inductor) == 2
    assert not torch.equal(third, first)


def test_real_plans_have_a_description(cheap_inductor):
    torch._dynamo.reset()
    wrapped = geoscale_fx.wrap(_model(), compiler="inductor")   # alive: its backend too
    with torch.no_grad():
        wrapped(torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0)))
    records = [r for b in BACKENDS.live() for r in b.records.values()]
    assert records
    for record in records:
        text = describe(record.plan)
        assert text is not None and " at 0x" not in text
        assert describe(dataclasses.replace(record.plan, n_scale=record.plan.n_scale + 1)) \
            != text
