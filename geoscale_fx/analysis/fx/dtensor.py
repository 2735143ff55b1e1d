"""DTensor on the query/key path: tensor-parallel projections, read as local shards.

Under tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` q/k/v projections)
Dynamo's graph holds the projection weights as DTensor placeholders (global shape, e.g.
``Shard(0)`` of ``W (F, d)``) and the parallel style's hooks as graph ops::

    x = from_local(h, mesh, (Replicate(),))      # the replicated normalized input
    P = linear(x, W, b)                          # a DTensor, global shape (B, T, F)
    P = redistribute(P, (Shard(-1),))            # global values unchanged
    q = to_local(P).view(B, T, -1, d_h)          # this rank's heads

The index tracker (``index_replay.replay``) keeps working in the *global* index space of ``P``:
``redistribute`` and ``full_tensor`` change no global value, and ``to_local`` keeps this
rank's block of every index tensor (``compute_local_shape_and_global_offset``). The operand's
features are then global output features of ``W``; :func:`localize_term` maps them onto the
rank's local shard, so the spectral nodes read ``W.to_local()`` and bound the rank's own heads
with no communication. A weight sharded on the model dimension ``d`` (rowwise q/k), a partial
sum, a strided shard, or heads whose features live on another rank are ``Unsupported`` with a
reason naming the node and the placement: never a bound computed from part of a head.

Example (what a 2-rank colwise q projection gives rank 1)::

    global W (32, 32), Shard(0)      → local rows 16..31
    operand features (global)          ((16..23), (24..31))   heads 2 and 3 of 4
    localized features                 ((0..7), (8..15))      rows of W.to_local()
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, example_value, op_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.sites.terms import Side

__all__ = ["HeadShard", "dtensor_of", "local_region", "replay_dtensor",
           "token_vector_split", "localize_term", "to_local"]

def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:       # a build without torch.distributed
        return None
    return DTensor


def dtensor_of(value: Any):
    """``value`` (a node's example value, or a tensor) if it is a DTensor, else None."""
    value = example_value(value) if isinstance(value, Node) else value
    cls = _dtensor_type()
    return value if cls is not None and isinstance(value, cls) else None


def to_local(value: Any) -> Any:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return value.to_local() if dtensor_of(value) is not None else value


@dataclass(frozen=True)
class HeadShard:
    """Which query heads of a site this rank holds (tensor parallelism).

    ``mesh_dims`` are the mesh dimensions along which the heads are split (a per-layer
    scale is reduced over them), ``coordinate`` this rank's position on them, ``q_heads``
    the global index of each local query head (-1 where the layout does not say).
    """
    mesh_dims: tuple[int, ...]
    coordinate: tuple[int, ...]
    degree: int
    q_heads: tuple[int, ...]
    n_q_heads: int                   # global query heads of the site
    mesh: Any = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """``"tp 1/2: heads 2-3 of 4"``: for reports and state keys."""
        rank = "x".join(str(c) for c in self.coordinate)
        heads = self.q_heads
        if heads and min(heads) >= 0 and list(heads) == list(range(heads[0],
                                                                    heads[0] + len(heads))):
            held = f"{heads[0]}-{heads[-1]}" if len(heads) > 1 else f"{heads[0]}"
        else:
            held = ",".join(str(h) for h in heads)
        return f"tp {rank}/{self.degree}: heads {held} of {self.n_q_heads}"


def _placements_supported(value, node_name: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for p in value.placements:
        if type(p) is Shard or isinstance(p, Replicate):
            continue
        kind = "a partial sum" if p.is_partial() else f"placement {p}"
        raise Unsupported(f"`{node_name}` is a DTensor with {kind} ({tuple(value.placements)}): "
                          "its local tensor is not a block of its global value")


def local_region(value, node_name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offset, local shape)`` of this rank's shard of a DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _placements_supported(value, node_name)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                          value.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _sharded_dims(value, tensor_dim: int) -> tuple[int, ...]:
    """Mesh dims whose placement shards tensor dim ``tensor_dim`` (negative dims allowed)."""
    ndim = len(value.shape)
    return tuple(i for i, p in enumerate(value.placements)
                 if p.is_shard() and p.dim % ndim == tensor_dim % ndim)


# --------------------------------------------------------------------------------------
# Index tracking through DTensor ops
# --------------------------------------------------------------------------------------

def replay_dtensor(node: Node, op: str, track):
    """A DTensor op applied to a ``index_replay.Track`` (index tensors in the global view)."""
    if op in ("redistribute", "full_tensor"):
        return track                  # the global value is unchanged
    if op == "to_local":
        value = dtensor_of(node.args[0])
        if value is None:
            raise Unsupported(f"`{node.name}`: to_local of a value with no DTensor metadata")
        offset, shape = local_region(value, node.args[0].name)

        def local(t: torch.Tensor) -> torch.Tensor:
            for dim, (o, s) in enumerate(zip(offset, shape)):
                if t.shape[dim] != 1:     # size-1 dims are broadcast (compact) tracks
                    t = t.narrow(dim, o, s)
            return t
        return track.map(local)
    if op == "from_local":
        placements = _from_local_placements(node)
        if placements is not None and all(p.is_replicate() for p in placements):
            return track              # every rank holds the whole value
        raise Unsupported(f"`{node.name}`: from_local of a value derived from the projection "
                          f"with placements {placements} (other ranks hold the rest of it)")
    raise Unsupported(f"`{node.name}` ({op}): DTensor op not understood on the query/key path")


def _from_local_placements(node: Node):
    """The placements a ``from_local`` node gives its DTensor: its argument, or (where Dynamo
    keeps them in the function it recorded: ``compat.traced_dtensor_method``) its value's."""
    placements = node.args[2] if len(node.args) > 2 else node.kwargs.get("placements")
    if placements is None and dtensor_of(node) is not None:
        placements = tuple(dtensor_of(node).placements)
    return placements


def token_vector_split(node: Node) -> Optional[str]:
    """Why a DTensor op on the way back to a normalization does not keep each token's whole
    feature vector (a placement on either side shards or partially sums the last dim), or
    None when it does."""
    if op_of(node) == "from_local":
        placements = _from_local_placements(node)
        sides = [(len(getattr(example_value(node), "shape", ())), tuple(placements or ()))]
    else:
        sides = [(len(v.shape), tuple(v.placements))
                 for v in (dtensor_of(node), dtensor_of(node.args[0])) if v is not None]
    for ndim, placements in sides:
        for p in placements:
            if p.is_partial() or (p.is_shard() and p.dim % ndim == ndim - 1):
                return (f"its placements {placements} split each token's feature vector across "
                        "ranks (a projection sharded on the model dimension d, e.g. rowwise "
                        "q/k): no rank holds the normalized input")
    return None


# --------------------------------------------------------------------------------------
# Global features → the rank's local shard
# --------------------------------------------------------------------------------------

def _check_replicated(side: Side, by_name: dict[str, Node]) -> None:
    """Per-channel gains/offsets of the normalized input must be whole on every rank."""
    for _, v in side.source.channel_ops:
        value = dtensor_of(by_name[v]) if isinstance(v, str) and v in by_name else None
        if value is not None and any(not p.is_replicate() for p in value.placements):
            raise Unsupported(f"`{v}` (a normalization gain/offset) is a DTensor with "
                              f"{tuple(value.placements)}: the bound needs all of it on "
                              "every rank")


def _sharded_source(node: Node):
    """``(DTensor value, already local)`` behind a weight node: the node itself, or a
    ``to_local`` of one (up to casts: Hugging Face's tensor parallelism computes with
    ``W.to_local()``), else ``(None, False)``."""
    value = dtensor_of(node)
    if value is not None:
        return value, False
    while op_of(node) in VALUE_CASTS:
        node = node.args[0]
    if op_of(node) == "to_local" and dtensor_of(node.args[0]) is not None:
        return dtensor_of(node.args[0]), True
    return None, False


def _localize_side(side: Side, by_name: dict[str, Node]):
    """``(side on local features, sharded mesh dims, mesh, global features)``."""
    _check_replicated(side, by_name)
    value, local = (_sharded_source(by_name[side.weight]) if side.weight is not None
                    else (None, False))
    if value is None:
        for name in (side.bias,):
            if name is not None and _sharded_source(by_name[name])[0] is not None:
                raise Unsupported(f"the bias `{name}` is a DTensor but the weight "
                                  f"`{side.weight}` is not")
        return side, (), None, side.features
    f_dim = 0 if side.layout == "linear" else 1
    offset, shape = local_region(value, side.weight)
    label = side.weight_param or side.weight
    if shape[1 - f_dim] != value.shape[1 - f_dim]:
        raise Unsupported(f"the projection weight `{label}` is sharded on the model dimension "
                          f"d ({tuple(value.placements)}): every rank holds part of every "
                          "head's weights (rowwise q/k), so no rank can bound a head; shard "
                          "q/k by output features (ColwiseParallel)")
    lo, n = offset[f_dim], shape[f_dim]
    dims, mesh = _sharded_dims(value, f_dim), value.device_mesh
    if local:   # the graph already computes with the local shard: features index it
        return side, dims, mesh, tuple(tuple(f + lo for f in row) for row in side.features)
    flat = [f for row in side.features for f in row]
    if flat and (min(flat) < lo or max(flat) >= lo + n):
        raise Unsupported(f"the heads read by the attention use features {min(flat)}-"
                          f"{max(flat)} of `{label}`, but this rank holds {lo}-{lo + n - 1} "
                          f"({tuple(value.placements)})")
    bias_offset = side.bias_offset + lo
    if side.bias is not None:
        bias = dtensor_of(by_name[side.bias])
        if bias is not None:
            b_offset, b_shape = local_region(bias, side.bias)
            bias_offset -= b_offset[0]
            picked = [f - lo + bias_offset for f in flat]
            if picked and (min(picked) < 0 or max(picked) >= b_shape[0]):
                raise Unsupported(f"the bias `{side.bias_param or side.bias}` is not sharded "
                                  f"like its weight ({tuple(bias.placements)})")
    global_features = side.features
    local_features = tuple(tuple(f - lo for f in row) for row in side.features)
    side = replace(side, features=local_features, bias_offset=bias_offset if side.bias else 0)
    return side, dims, mesh, global_features


def localize_term(q: Side, k: Side, by_name: dict[str, Node], head_dim: int
                  ) -> tuple[Side, Side, Optional[HeadShard]]:
    """Map both sides' features onto local weight shards; the site's ``HeadShard``."""
    q, q_dims, q_mesh, global_q = _localize_side(q, by_name)
    k, k_dims, k_mesh, _ = _localize_side(k, by_name)
    if q_mesh is not None and k_mesh is not None and q_mesh != k_mesh:
        raise Unsupported("the query and key projections live on different device meshes")
    mesh = q_mesh if q_mesh is not None else k_mesh
    dims = tuple(sorted(set(q_dims) | set(k_dims)))
    if mesh is None or not dims:
        return q, k, None
    coordinate = mesh.get_coordinate() or ()
    degree = math.prod(mesh.size(d) for d in dims)
    heads = tuple(row[0] // head_dim if list(row) == list(range(row[0], row[0] + head_dim))
                  and row[0] % head_dim == 0 else -1 for row in global_q)
    n_global = len(global_q) * (math.prod(mesh.size(d) for d in q_dims) if q_dims else 1)
    shard = HeadShard(mesh_dims=dims, coordinate=tuple(coordinate[d] for d in dims),
                      degree=degree, q_heads=heads, n_q_heads=n_global, mesh=mesh)
    return q, k, shard
