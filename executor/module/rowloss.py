"""The loss on this rank's rows, as DDP computes it, once DTensor showed that is exact.

`loss_fn` on the parallelized output runs as DTensor ops (`ParallelModule.loss`): some
150 µs of host Python per op, and a mean's backward pass sums its row count over the
batch's ranks, a collective that makes every rank wait for the slowest mid-step. On a
data-parallel step of a small model that is a quarter of the step (llama_medium: 7–10 ms
of 90). Where the loss is a sum or mean over rows, each rank can compute it on its own
rows, as DDP's ranks do, and the ranks' values combine as the DTensor result says.

The first call runs `loss_fn` on DTensors and reads the answer off DTensor's own
propagation (`RowLoss.probe`): the loss is local when every output is split along its
rows over the batch's mesh axes only, the loss issued no collective in its forward pass
(but the kept targets' weight sum, which the rows' loss repeats),
and it came out a pending sum or mean (`Partial("sum" | "avg")`) over exactly those axes
and replicated elsewhere: DTensor proved it a linear combination of per-rank terms,
and `loss_fn` on each rank's rows gives that rank's term (a mean written `x.sum() /
x.shape[0]` does not: its terms divide by the whole batch's rows;
`ParallelModule._local_loss_agrees` asks every rank once). Later calls run `loss_fn` on
the local rows and divide a mean by the ranks, whose sum
of gradients the plan's weight collectives then take (`RowLoss.local`). A
cross-entropy or NLL mean divides by the kept targets' weight over all the batch's ranks
(`executor.module.lossops.KeptTargetsOverRanks`, as on DTensors), so targets ignored
unevenly or class weights give one process's loss and gradient too.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import _pytree as pytree

from executor.module.counting import CollectiveCount, group_axes
from executor.module.lossops import KeptTargetsOverRanks, kept_weight_sums, one_loss_call
from executor.module.moves import redistribute, tensor_dim


@dataclass(frozen=True)
class RowLoss:
    """How a step's loss combines over the batch's ranks: `placements` of the DTensor
    result (pending "sum" or "avg" over the batch axes), `ranks` in those axes."""

    placements: tuple[Placement, ...]
    ranks: int

    @property
    def mean(self) -> bool:
        return any(isinstance(p, Partial) and p.reduce_op == "avg" for p in self.placements)

    @classmethod
    def probe(cls, output: Any, batch: Sequence[Any], mesh: TorchMesh,
              batch_dims: Sequence[int], run: Callable[[], torch.Tensor]
              ) -> tuple[torch.Tensor, RowLoss | None]:
        """The loss `run()` computes on DTensors, and whether later ones can be local."""
        leaves = pytree.tree_leaves(output)
        counts: Counter = Counter()
        with CollectiveCount(counts, group_axes(mesh), "loss"), kept_weight_sums() as kept:
            loss = run()
            repeated = kept()  # (on the rows too: `KeptTargetsOverRanks`)
        rows = _rows(leaves, batch, mesh, batch_dims)
        if sum(counts.values()) > repeated or rows is None \
                or not isinstance(loss, DTensor) or not _placed(
                loss.placements, batch_dims,
                lambda p: isinstance(p, Partial) and p.reduce_op in ("sum", "avg")):
            return loss, None
        ranks = 1
        for dim in batch_dims:
            ranks *= mesh.size(dim)
        return loss, cls(tuple(loss.placements), ranks)

    def local(self, loss_fn: Callable[..., torch.Tensor], output: Any,
              batch: Sequence[Any], mesh: TorchMesh, batch_dims: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this rank's term of the loss, to back-propagate; the loss as the DTensor
        result it is a term of, to report), or None where the output is not split as the
        probe saw it."""
        leaves = pytree.tree_leaves(output)
        rows = _rows(leaves, batch, mesh, batch_dims)
        if rows is None:
            return None
        local_output = pytree.tree_map(
            lambda v: v.to_local() if isinstance(v, DTensor) else v, output)
        return self._of_rows(loss_fn, local_output, batch, rows, mesh)

    def on_rows(self, loss_fn: Callable[..., torch.Tensor], rows_output: Any,
                batch: Sequence[Any], mesh: TorchMesh, batch_dims: Sequence[int]
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`local`'s answer from outputs that are this rank's rows already, as the run
        computed them (`executor.module.run.PlannedRun.rows_out`): no DTensor made of
        them and taken apart again, in either pass. None where the rows do not match the
        batch's."""
        leaves = [v for v in pytree.tree_leaves(rows_output) if isinstance(v, torch.Tensor)]
        tensors = [v for v in pytree.tree_leaves(list(batch)) if isinstance(v, torch.Tensor)]
        if not leaves or not tensors or not batch_dims or any(
                v.dim() == 0 for v in (*leaves, *tensors)):
            return None
        whole = int(tensors[0].shape[0])
        rows = block_rows(whole, mesh, tuple(batch_dims))
        if any(v.shape[0] != whole for v in tensors) or any(
                v.shape[0] != rows[1] for v in leaves):
            return None
        return self._of_rows(loss_fn, rows_output, batch, rows, mesh)

    def _of_rows(self, loss_fn: Callable[..., torch.Tensor], local_output: Any,
                 batch: Sequence[Any], rows: tuple[int, int], mesh: TorchMesh
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        start, size = rows
        local_batch = pytree.tree_map(
            lambda v: v.narrow(0, start, size) if isinstance(v, torch.Tensor) else v,
            list(batch))
        # (a mean over kept targets divided by their weight on all the batch's ranks)
        groups = [mesh.get_group(dim) for dim, p in enumerate(self.placements)
                  if isinstance(p, Partial)]
        with KeptTargetsOverRanks(groups), one_loss_call():
            value = loss_fn(local_output, *local_batch)
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor) \
                or value.dim() != 0:
            return None
        term = value / self.ranks if self.mean else value
        # the reported value as the DTensor it is a term of: built by DTensor's own
        # constructor (`from_local` is an autograd function, a tenth of the speed)
        reported = DTensor(value.detach(), DTensorSpec(
            mesh, self.placements, TensorMeta(value.shape, value.stride(), value.dtype)),
            requires_grad=False)
        return term, reported


def loss_layout(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """What a loss reads of a graph output placed as `placements`: its rows split as they
    are (`Shard` of dim 0), every other dim whole (`planner.sharding.outputs.loss_layout`
    in DTensor's placements)."""
    return tuple(p if isinstance(p, Shard) and tensor_dim(p, ndim) == 0 else Replicate()
                 for p in placements)


def for_the_loss(output: Any) -> Any:
    """`output` with each DTensor in its `loss_layout`, moved in the open: as the ONNX
    executor's `Runtime.loss` does, the loss reads whole rows (a vocabulary-split logit's
    row gathered once, one all-gather whose backward pass is a local slice), and the move
    happens where the caller counts it (the loss's phase), not inside `loss_fn`'s DTensor
    ops, whose own propagation gathered the split again in the backward pass, four
    collectives the plan does not list on a vocabulary-split head."""
    def moved(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        wanted = loss_layout(value.placements, value.ndim)
        if wanted == tuple(value.placements):
            return value
        return redistribute(value, value.device_mesh, wanted)
    return pytree.tree_map(moved, output)


def _rows(leaves: Sequence[Any], batch: Sequence[Any], mesh: TorchMesh,
          batch_dims: Sequence[int]) -> tuple[int, int] | None:
    """(first row, rows) of this rank's block when every output is a DTensor split along
    dim 0 over exactly `batch_dims` (in mesh order), each alike, and every batch tensor
    has the outputs' rows; else None."""
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not tensors or not batch_dims or not all(isinstance(v, DTensor) for v in tensors):
        return None
    first = tensors[0]
    assert isinstance(first, DTensor)
    if not _placed(first.placements, batch_dims,
                   lambda p: isinstance(p, Shard) and tensor_dim(p, first.ndim) == 0):
        return None
    for value in tensors:
        assert isinstance(value, DTensor)
        if value.dim() == 0 or value.shape[0] != first.shape[0] or \
                value.placements != first.placements:
            return None
    for value in pytree.tree_leaves(list(batch)):
        if isinstance(value, torch.Tensor) and (
                value.dim() == 0 or value.shape[0] != first.shape[0]):
            return None
    shape, offset = compute_local_shape_and_global_offset(first.shape, mesh,
                                                          first.placements)
    return int(offset[0]), int(shape[0])


def row_placements(mesh: TorchMesh, batch_dims: Sequence[int]) -> tuple[Placement, ...]:
    """A tensor split along its rows (dim 0) over the mesh dims `batch_dims` and whole
    over the others, as DTensor places it."""
    return tuple(Shard(0) if dim in batch_dims else Replicate() for dim in range(mesh.ndim))


@functools.lru_cache(maxsize=64)
def block_rows(whole: int, mesh: TorchMesh, batch_dims: tuple[int, ...]) -> tuple[int, int]:
    """(first row, rows) of this rank's block of `whole` rows split over `batch_dims`."""
    shape, offset = compute_local_shape_and_global_offset(
        (whole,), mesh, row_placements(mesh, batch_dims))
    return int(offset[0]), int(shape[0])


def _placed(placements: Sequence[Placement], batch_dims: Sequence[int],
            on_batch: Callable[[Placement], bool]) -> bool:
    """Whether each of `placements` on a batch mesh dim is `on_batch` and every other is
    replicated."""
    return all(on_batch(p) if dim in batch_dims else isinstance(p, Replicate)
               for dim, p in enumerate(placements))


def batch_mesh_dims(mesh: TorchMesh, batch_axes: Sequence[str]) -> tuple[int, ...]:
    """The mesh dims of the plan's batch axes, in mesh order."""
    names = mesh.mesh_dim_names or ()
    return tuple(k for k, name in enumerate(names) if name in batch_axes)

