"""Scaling state through ``torch.distributed.checkpoint`` (DCP), with the model.

``wrap`` and ``compile_blocks`` register the state on the model (``geoscale_state``), so the
model's ``state_dict()`` carries it and ``dcp.save(model.state_dict(), checkpoint_id=path)``
saves it with the weights. Its tensors are plain (not DTensor):

* data parallel (FSDP2): every replica holds the same state under the same keys, DCP writes
  it once, and any number of processes (one included) can load it;
* tensor parallel: a site's state covers the rank's heads and its key names the rank's
  shard (``…attn_tp1``), so each rank saves and loads its own; resuming needs the same TP
  degree (another degree finds no state under its keys and cold-starts, logged).

Sites (and their state) appear at the first compile, so a fresh process has no geoscale
keys in ``model.state_dict()`` yet. :func:`load_scaling_state` reads them from the
checkpoint's metadata and stashes them; each site picks its own up when it is created, and
the first step runs warm (no cold start)::

    geoscale_fx.compile_blocks(model, model.layers)          # or wrap(model)
    load_scaling_state(model, checkpoint_id=path)            # before the first forward
    sd = model.state_dict(); dcp.load(sd, checkpoint_id=path); model.load_state_dict(sd)
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from geoscale_fx.sites.state import STATE_ATTR, GeoscaleState

__all__ = ["load_scaling_state"]

log = logging.getLogger("geoscale_fx")


def _state_of(model: nn.Module) -> tuple[str, GeoscaleState]:
    inner = getattr(model, "model", model)      # a GeoscaleModule holds the model
    state = getattr(inner, STATE_ATTR, None)
    if not isinstance(state, GeoscaleState):
        raise ValueError(f"{type(model).__name__} has no geoscale scaling state: compile it "
                         "with geoscale_fx.wrap or geoscale_fx.compile_blocks first")
    return f"{STATE_ATTR}.", state


def load_scaling_state(model: nn.Module, checkpoint_id: Any = None, *,
                       storage_reader=None, process_group=None) -> int:
    """Load the scaling state saved with ``model`` in a DCP checkpoint; returns how many
    tensors were read. Collective when a process group is initialized (every rank calls it).
    Sites that exist take their values now; the others when they are created."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix, state = _state_of(model)
    if storage_reader is None:
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    metadata = storage_reader.read_metadata()
    wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in metadata.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not wanted:
        log.warning("geoscale: checkpoint %s holds no scaling state (keys %s*): every site "
                    "cold-starts from the loaded weights", checkpoint_id, prefix)
        return 0
    dcp.load(wanted, storage_reader=storage_reader, process_group=process_group)
    state.load_state_dict({k[len(prefix):]: v for k, v in wanted.items()}, strict=False)
    return len(wanted)
