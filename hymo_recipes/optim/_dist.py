"""DTensor helpers shared by HyMo's optimizers.

Under FSDP2 (``fully_shard``) every parameter, gradient and optimizer state is a DTensor whose
placements are ``Shard(0)`` on the data-parallel mesh (``Replicate()`` on extra HSDP dims).
The optimizers work on the local shards and only talk to other ranks where the maths needs the
whole tensor (NorMuon's orthogonalisation, the global counts of the cautious masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "local",
    "ShardSpec",
    "shard_spec",
    "rows_of_rank",
    "state_like_rows",
    "all_reduce_sum",
]


def local(t: Tensor | None) -> Tensor | None:
    """The local shard of a DTensor (an alias: in-place ops on it change the DTensor), else t."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter's elements are split over ranks.

    ``groups`` are the process groups of the mesh dims that shard the tensor (summing a local
    count over each of them, in turn, gives the global count). ``row_group`` is set when dim 0 is
    sharded over exactly one mesh dim: then each rank holds a block of rows (``torch.chunk``
    semantics, the last blocks may be short or empty).
    """

    groups: tuple[dist.ProcessGroup, ...] = ()
    row_group: dist.ProcessGroup | None = None
    mesh_key: tuple = ()

    @property
    def sharded(self) -> bool:
        return bool(self.groups)


_UNSHARDED = ShardSpec()


def shard_spec(p: Tensor) -> ShardSpec:
    """Classify ``p``'s sharding. Raises NotImplementedError for layouts the optimizers can't do.

    Supported: plain tensors, DTensors with Replicate placements and at most one Shard(0)
    (FSDP2 / HSDP). Anything else (TP/EP shards of other dims, two mesh dims sharding dim 0)
    would need a different gather and is refused loudly rather than computed wrongly.
    """
    if not isinstance(p, DTensor):
        return _UNSHARDED
    groups = []
    row_group = None
    for mesh_dim, placement in enumerate(p.placements):
        # A mesh dim of one rank splits nothing: treat it as replicated (no collectives).
        if isinstance(placement, Replicate) or p.device_mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Shard) and placement.dim == 0 and row_group is None:
            row_group = p.device_mesh.get_group(mesh_dim)
            groups.append(row_group)
            continue
        raise NotImplementedError(
            f"HyMo optimizers support FSDP2 layouts (Shard(0) over one mesh dim, Replicate "
            f"elsewhere); got placements {p.placements} for a tensor of shape {tuple(p.shape)}"
        )
    if row_group is None:
        return _UNSHARDED
    # Two params can share one gather only if they live on the same ranks in the same order.
    key = (tuple(p.device_mesh.mesh.flatten().tolist()), p.device_mesh.mesh.shape, p.placements)
    return ShardSpec(groups=tuple(groups), row_group=row_group, mesh_key=key)


def rows_of_rank(n_rows: int, world: int, rank: int) -> tuple[int, int, int]:
    """(chunk, start, size) of ``rank``'s rows under torch.chunk semantics (what Shard(0) uses)."""
    chunk = -(-n_rows // world)
    start = min(rank * chunk, n_rows)
    size = max(0, min(n_rows - start, chunk))
    return chunk, start, size


def state_like_rows(p: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Zeros of shape ``p.shape[:-1]`` (one value per output row), sharded like ``p``.

    Shard(0) of p and of p.shape[:-1] split dim 0 identically, so the local shard is just the
    local rows; DCP then saves/reshards it like any other DTensor state.
    """
    if not isinstance(p, DTensor):
        return torch.zeros(p.shape[:-1], dtype=dtype, device=p.device)
    loc = p.to_local()
    zeros = torch.zeros(loc.shape[:-1], dtype=dtype, device=loc.device)
    shape = p.shape[:-1]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        zeros, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride
    )


def all_reduce_sum(t: Tensor, groups: tuple[dist.ProcessGroup, ...]) -> Tensor:
    """Sum ``t`` in place over each group in turn (the product of the groups' ranks)."""
    for g in groups:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
    return t
