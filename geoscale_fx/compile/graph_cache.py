"""geoscale's compile cache: the ATen trace of a rewritten graph, kept on disk.

Inductor's FX-graph and AOTAutograd caches key the graph they are handed. geoscale hands them
the ATen trace of its rewritten graph (``compile.aten_trace``), and that trace — of the whole
graph, flex_attention's ``score_mod`` and block mask included — ran on every compile, warm
or not: about 0.5 s of a small GPT-2 forward's 3 s warm compile. This module keeps the
trace, keyed by everything it is a function of:

* the Dynamo graph: its code, the code of its graph submodules, its tensor attributes by
  value;
* every compile input: type, shape, stride, storage offset, dtype, device, ``requires_grad``
  (the scaling state's included);
* the plans and anything else the caller passes (``material``): described by value,
  recursively (dataclasses by their shown fields, other objects by their attributes);
* grad and inference mode, the default dtype, the torch and Python versions, and the source
  of ``geoscale_fx`` itself.

Anything the description cannot name by value — a function, a closure, an ``fx.Node``, an
object without attributes — makes the graph uncached (``graph_cache_bypass``): a key that
missed something would give a wrong graph, never only a slower one. The cache lives in
Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``), under ``geoscale/``; it is off
where Inductor's FX-graph cache is off (``torch._inductor.config.fx_graph_cache``,
``force_disable_caches``) and under ``torch.distributed`` (process-group names in a graph).
The graph is stored with ``torch.fx``'s ``GraphPickler`` (node metadata as fake tensors,
subgraphs of higher-order operators kept) and loaded into the compile's fake mode.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule
from torch.fx._graph_pickler import GraphPickler

__all__ = ["describe", "graph_key", "enabled", "load", "store", "source_hash"]

log = logging.getLogger("geoscale_fx")

_PACKAGE = Path(__file__).resolve().parent.parent      # the whole geoscale_fx package
_DEPTH = 24         # nesting a description goes to before it gives up (no cycles in plans)
_SOURCE_HASH: Optional[str] = None


def source_hash() -> str:
    """SHA-256 of every ``.py`` file of ``geoscale_fx`` (path and content): a changed
    rewrite, program or estimator is a different key."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        digest = hashlib.sha256()
        for path in sorted(_PACKAGE.rglob("*.py")):
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
        _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH


def _tensor(t: torch.Tensor, with_values: bool) -> str:
    meta = (f"{type(t).__name__ if isinstance(t, torch.nn.Parameter) else 'tensor'}"
            f"{tuple(t.shape)}/{t.stride()}+{t.storage_offset()}:{t.dtype}@{t.device}"
            f"/grad={t.requires_grad}")
    if not with_values:
        return meta
    data = t.detach().cpu().contiguous()
    if data.dtype.is_complex:
        data = torch.view_as_real(data)
    return f"{meta}#{hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy()).hexdigest()}"


def describe(obj: Any, depth: int = 0) -> Optional[str]:
    """A deterministic description of ``obj`` by value, or None where it has none (a
    function, a node, an address): see the module docstring."""
    if depth > _DEPTH:
        return None
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return f"{type(obj).__name__}:{obj}"
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return None        # a subclass (DTensor, a fake): no value to hash
        return _tensor(obj, with_values=True)
    if isinstance(obj, (tuple, list)):
        parts = [describe(x, depth + 1) for x in obj]
        return None if None in parts else f"{type(obj).__name__}[{','.join(parts)}]"
    if isinstance(obj, (set, frozenset)):
        parts = [describe(x, depth + 1) for x in obj]
        return None if None in parts else f"set[{','.join(sorted(parts))}]"
    if isinstance(obj, dict):
        items = [(describe(k, depth + 1), describe(v, depth + 1)) for k, v in obj.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "dict{" + ",".join(sorted(f"{k}:{v}" for k, v in items)) + "}"
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # the fields it shows: a hidden one (``AttentionSite._resolve``) reads the graph,
        # which the key holds by value
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.repr}
    elif _plain_object(obj):
        fields = vars(obj)
    else:
        return None    # functions, closures, classes, modules, fx nodes, slotted objects
    inner = describe(fields, depth + 1)
    return None if inner is None else f"{kind}{inner}"


def _plain_object(obj: Any) -> bool:
    """An object whose attributes are all it holds: a ``__dict__`` with something in it, no
    slots beside it (their values would be missed), not callable, not a class or module."""
    if callable(obj) or isinstance(obj, (type, torch.nn.Module)) or not getattr(
            obj, "__dict__", None):
        return False
    return not any("__slots__" in vars(c) for c in type(obj).__mro__[:-1])


def _graph_module(gm: torch.nn.Module) -> Optional[str]:
    """A graph module by value: code, graph submodules, tensor attributes (values)."""
    if not isinstance(gm, GraphModule):
        return None
    parts = [gm.code]
    for name, child in gm.named_children():
        inner = _graph_module(child)
        if inner is None:
            return None
        parts.append(f"{name}:{inner}")
    tensors = dict(gm.named_parameters(recurse=False))
    tensors.update(gm.named_buffers(recurse=False))
    tensors.update({k: v for k, v in vars(gm).items() if isinstance(v, torch.Tensor)})
    for name in sorted(tensors):
        value = describe(tensors[name])
        if value is None:
            return None
        parts.append(f"{name}={value}")
    return "\n".join(parts)


def _inputs(inputs: Sequence[Any]) -> Optional[str]:
    parts = []
    for x in inputs:
        if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))):
            return None   # symbolic shapes are not traced (compile.aten_trace)
        if isinstance(x, torch.Tensor):
            parts.append(_tensor(x, with_values=False))
        else:
            value = describe(x)
            if value is None:
                return None
            parts.append(value)
    return ";".join(parts)


def graph_key(gm: GraphModule, inputs: Sequence[Any], material: Any) -> Optional[str]:
    """The key of ``gm``'s rewritten trace on ``inputs`` for ``material`` (the plans and
    whatever else the rewrite reads), or None where something has no description."""
    parts = [_graph_module(gm), _inputs(inputs), describe(material)]
    if None in parts:
        return None
    salt = (f"torch {torch.__version__} python {sys.version_info[:3]} geoscale "
            f"{source_hash()} grad {torch.is_grad_enabled()} inference "
            f"{torch.is_inference_mode_enabled()} dtype {torch.get_default_dtype()}")
    digest = hashlib.sha256(salt.encode())
    for part in parts:
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


def enabled() -> bool:
    """Where Inductor's own FX-graph cache is on, and not under ``torch.distributed``."""
    from torch._inductor import config

    if config.force_disable_caches or not config.fx_graph_cache:
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "geoscale" / key[:2] / f"{key}.graph"


def load(key: str, fake_mode) -> Optional[GraphModule]:
    """The graph stored under ``key``, its metadata in ``fake_mode``; None if there is none
    or it cannot be read (a cache from another build: it is then traced again)."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        gm = GraphPickler.loads(path.read_bytes(), fake_mode)
        gm.recompile()      # the pickler keeps the graph, not its generated forward
        return gm
    except Exception as exc:    # never fail a compile over a cache file
        log.info("geoscale: the cached graph %s could not be read (%s: %s); tracing again",
                 path, type(exc).__name__, str(exc)[:200])
        counters["geoscale"]["graph_cache_unreadable"] += 1
        return None


def store(key: str, gm: GraphModule) -> None:
    """Keep ``gm`` under ``key`` (written whole, then renamed: readers see all or nothing);
    a graph the pickler refuses is left uncached."""
    path = _path(key)
    try:
        data = GraphPickler.dumps(gm)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(data)
        os.replace(partial, path)
    except Exception as exc:
        log.info("geoscale: the traced graph was not cached (%s: %s)", type(exc).__name__,
                 str(exc)[:200])
        counters["geoscale"]["graph_cache_bypass"] += 1
