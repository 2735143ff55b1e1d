"""Scale-out: what geoscale communicates under tensor parallelism, and nothing else.

Under tensor parallelism each rank holds some query heads of every attention
(``analysis.fx.dtensor.HeadShard``) and bounds them from its local weight shards:

* per-head scales (``granularity="head"``, the default) need **no communication**: head h's
  bound reads only head h's columns of W_q, W_k, which live on the rank that computes h;
* a per-layer scale (``granularity="layer"``, the paper's, or any scaling with one scale per
  layer: delayed, current) is shared by heads on several ranks, so its bound, and the
  observed ``max|S|`` where the policy observes it, are reduced with one ``all_reduce(MAX)``
  of one float over the tensor-parallel mesh dims (a traceable functional collective inside
  the compiled graph; it has no backward, the scale math is detached). Per layer the bound is
  then ``max_r B_r``, where ``B_r`` is the paper's per-layer bound of rank r's heads
  (``‖Σ_{h∈r} A_q,h A_k,hᵀ‖``): the paper's concatenation over *all* heads would need the
  sum of d×d matrices across ranks, and is no bound on any head either.

Data parallelism (FSDP2) adds nothing: its hooks run outside the compiled graph, so every
replica sees the same unsharded weights, cold-starts from the same key-seeded power vectors
(``runtime._generator``) and computes bit-identical state with no collective.
"""
from __future__ import annotations

import torch

__all__ = ["reduce_max", "per_layer_reduced"]


def per_layer_reduced(site, n_scale: int) -> bool:
    """Whether a site's scale is shared by heads that live on several ranks."""
    return n_scale == 1 and getattr(site, "shard", None) is not None


def reduce_max(value: torch.Tensor, shard) -> torch.Tensor:
    """``max`` of ``value`` over the ranks that share the site's heads (traceable)."""
    from torch.distributed import _functional_collectives as funcol

    dtype = value.dtype
    for dim in shard.mesh_dims:
        value = funcol.wait_tensor(funcol.all_reduce(value, "max", (shard.mesh, dim)))
    return value.to(dtype)
