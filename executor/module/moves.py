"""A split moved from one tensor dim to another as one all-to-all, as the plan prices it.

DTensor runs `Shard(a) -> Shard(b)` on one mesh dim with an all-to-all where the process
group has one, but on a CPU (gloo) group it falls back to an all-gather and a local chunk
("CPU process group does not support alltoall yet"), in both passes: twice the bytes of
the all-to-all, and collectives the plan does not list. gloo itself has
`all_to_all_single`, so the executor makes this move itself: each rank cuts its block
into one piece per peer along dim b, the pieces are exchanged in one all-to-all, and the
received pieces are joined along dim a. The backward pass makes the reverse move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor, Placement, Shard


def tensor_dim(placement: Shard, ndim: int) -> int:
    """The tensor dim a `Shard` splits, counted from 0."""
    return placement.dim if placement.dim >= 0 else placement.dim + ndim


def changed_axis(value: DTensor, wanted: Sequence[Placement]) -> int | None:
    """The one mesh dim whose placement `wanted` changes; None for none or several."""
    changed = [i for i, (have, want) in enumerate(zip(value.placements, wanted, strict=True))
               if have != want]
    return changed[0] if len(changed) == 1 else None


def cut_elsewhere(placements: Sequence[Placement], axis: int, dims: set[int],
                  ndim: int) -> bool:
    """Whether a mesh dim other than `axis` splits one of the tensor `dims`."""
    return any(isinstance(p, Shard) and tensor_dim(p, ndim) in dims
               for i, p in enumerate(placements) if i != axis)


def all_to_all_axis(value: DTensor, wanted: Sequence[Placement]) -> int | None:
    """The one mesh dim on which `wanted` moves `value`'s split from one tensor dim to
    another, both evenly divisible and split by no other mesh dim; else None."""
    axis = changed_axis(value, wanted)
    if axis is None:
        return None
    have, want = value.placements[axis], wanted[axis]
    if not (isinstance(have, Shard) and isinstance(want, Shard)):
        return None
    dims = {tensor_dim(have, value.ndim), tensor_dim(want, value.ndim)}
    if cut_elsewhere(wanted, axis, dims, value.ndim):  # (the rest of wanted is value's)
        return None
    size = value.device_mesh.size(axis)
    return axis if all(value.shape[d] % size == 0 for d in dims) else None


def _exchange(local: torch.Tensor, mesh: TorchMesh, axis: int, joined: int,
              cut: int) -> torch.Tensor:
    """This rank's block split along `joined` becomes its block split along `cut`."""
    size = mesh.size(axis)
    pieces = [p.contiguous() for p in local.chunk(size, dim=cut)]
    sent = torch.cat([p.reshape(-1) for p in pieces])
    received = funcol.all_to_all_single(sent, None, None, group=(mesh, axis))
    received = funcol.wait_tensor(received)
    parts = received.chunk(size)
    return torch.cat([part.view(pieces[0].shape) for part in parts], dim=joined)


class AllToAll(torch.autograd.Function):
    """`value` with its split on mesh dim `axis` moved to `wanted`'s tensor dim, by one
    all-to-all; its gradient moved back by another."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, wanted: tuple[Placement, ...],
                axis: int) -> DTensor:
        mesh = value.device_mesh
        have, want = value.placements[axis], wanted[axis]
        assert isinstance(have, Shard) and isinstance(want, Shard)
        joined, cut = tensor_dim(have, value.ndim), tensor_dim(want, value.ndim)
        ctx.axis, ctx.placements, ctx.dims = axis, value.placements, (joined, cut)
        ctx.shape, ctx.stride = value.shape, value.stride()
        local = _exchange(value.to_local(), mesh, axis, joined, cut)
        return DTensor.from_local(local, mesh, wanted, shape=value.shape,
                                  stride=value.stride(), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None]:
        joined, cut = ctx.dims
        mesh = grad.device_mesh
        local = _exchange(grad.to_local(), mesh, ctx.axis, cut, joined)
        return DTensor.from_local(local, mesh, ctx.placements, shape=ctx.shape,
                                  stride=ctx.stride, run_check=False), None, None


def redistribute(value: DTensor, mesh: TorchMesh, wanted: Sequence[Placement]) -> DTensor:
    """`value` in `wanted`: by one all-to-all where only a split moves between tensor
    dims (`AllToAll`), else by DTensor's own steps."""
    axis = all_to_all_axis(value, wanted)
    if axis is None:
        return value.redistribute(mesh, tuple(wanted))
    moved: DTensor = AllToAll.apply(value, tuple(wanted), axis)
    return moved
