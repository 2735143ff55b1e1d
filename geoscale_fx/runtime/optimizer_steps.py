"""Optimizer steps that write the parameters without bumping their version counters.

``VersionRecord`` answers "did these weights change" from each tensor's in-place version
counter. The fused optimizers of ``torch.optim`` (``Adam``/``AdamW``/``SGD``/``Adagrad`` with
``fused=True``, and transformers' default ``optim="adamw_torch_fused"``) write the parameters
from one kernel that leaves those counters as they were (torch 2.11 to 2.15, CPU and CUDA):
after such a step every record still holds, and the runtime's weight refresh, the KV-cache
bounds and ``attention_scales`` would keep the previous step's bounds.

``follow_optimizer_steps`` registers, once per process, a global step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``: it runs after the ``step`` of
every ``torch.optim.Optimizer`` and subclass, whenever it was created) that increments the
version counter of every parameter of the stepped optimizer's groups, as an unfused step
does. A step that already bumped them (foreach, for-loop) only bumps them once more; the
hook costs one call into the autograd engine per step. A step traced by ``torch.compile``
writes its parameters back with ``copy_`` (versions bumped) and the hook does nothing there.
Optimizers that are not ``torch.optim.Optimizer`` subclasses, and writes through ``p.data``,
stay unseen (``VersionRecord``).

    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    >>> follow_optimizer_steps()
    >>> before = p._version
    >>> p.sum().backward(); opt.step()
    >>> p._version > before
    True
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["follow_optimizer_steps"]

_lock = threading.Lock()
_handle: Any = None


def follow_optimizer_steps() -> None:
    """Make every later optimizer step visible to version counters (idempotent)."""
    global _handle
    if _handle is not None:
        return
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_bump_parameter_versions)


def _bump_parameter_versions(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return
    params = [p for group in optimizer.param_groups for p in group["params"]
              if isinstance(p, torch.Tensor) and not p.is_inference()]
    if params:
        increment_version(params)
