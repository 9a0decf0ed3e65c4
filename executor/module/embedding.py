"""An embedding lookup in a table split by rows (the vocabulary), as the plan lays it out.

Megatron's layout splits a token embedding's table by rows over tp: each rank looks up
the ids that fall in its own rows and zeroes the others, the result is a pending sum over
tp (the plan's all-reduce makes it whole), and the table's gradient is each rank's own
rows', summed over nothing but the batch's axes (Megatron-LM's VocabParallelEmbedding).
DTensor's own rule gives a `_MaskPartial` result, which it refuses to move to the plan's
`Partial` ("redistributing to Partial is for internal use only"), and it has no backward
rule for a row-split table, so the executor runs this lookup itself (`row_split_dims`
says when). A padding index (BERT's `pad_token_id`) keeps its row's gradient zero, as
torch's lookup does: the rank holding that row skips it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from executor.module.moves import tensor_dim

EMBEDDING = torch.ops.aten.embedding.default


def lookup_options(args: Sequence[Any], kwargs: Mapping[str, Any]
                   ) -> tuple[Any, Any, Any]:
    """`aten.embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False,
    sparse=False)`'s last three arguments, given by position or by name."""
    defaults = (kwargs.get("padding_idx", -1), kwargs.get("scale_grad_by_freq", False),
                kwargs.get("sparse", False))
    given = tuple(args[2:5])
    padding, scaled, sparse = (*given, *defaults[len(given):])
    return padding, scaled, sparse


def _runs_here(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether this module may run the lookup itself: a 2-D table and ids, both DTensors,
    an integer padding index, no frequency scaling or sparse gradient."""
    if len(args) < 2 or not isinstance(args[0], DTensor) or not isinstance(args[1], DTensor):
        return False
    padding, scaled, sparse = lookup_options(args, kwargs)
    return isinstance(padding, int) and not scaled and not sparse and args[0].ndim == 2


def _table_padding(padding: int, rows: int) -> int:
    """The padding row's index in a table of `rows` rows (-1: none)."""
    return padding % rows if padding != -1 else -1


def row_split_dims(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
                   ) -> tuple[int, ...]:
    """The mesh dims over which `aten.embedding(weight, ids, ...)` looks ids up in a
    table split by rows, where this module runs it: the table split along rows only, the
    ids whole on those dims, no frequency scaling or sparse gradient. Empty: DTensor's own
    rule runs it."""
    if not _runs_here(args, kwargs or {}):
        return ()
    weight, ids = args[0], args[1]
    dims = tuple(k for k, p in enumerate(weight.placements)
                 if isinstance(p, Shard) and tensor_dim(p, weight.ndim) == 0)  # its rows
    if not dims or any(not isinstance(p, Replicate) for k, p in enumerate(weight.placements)
                       if k not in dims):
        return ()
    if any(not isinstance(ids.placements[k], Replicate) for k in dims):
        return ()
    return dims


def _output_placements(ids: DTensor, dims: tuple[int, ...]) -> tuple[Placement, ...]:
    """The result's: a pending sum over the table's split dims, the ids' split elsewhere."""
    return tuple(Partial() if k in dims else p for k, p in enumerate(ids.placements))


def _looked_up(found: torch.Tensor, weight: DTensor, ids: DTensor,
               placements: tuple[Placement, ...]) -> DTensor:
    """A lookup's local rows as the DTensor of the whole result: one row of the table's
    width per id, contiguous as the lookup writes it."""
    shape = torch.Size((*ids.shape, weight.shape[1]))
    return DTensor.from_local(found, weight.device_mesh, placements, shape=shape,
                              stride=make_contiguous_strides_for(shape), run_check=False)


def _table_gradient(ctx: Any, table: torch.Tensor, grad: DTensor,
                    placements: tuple[Placement, ...]) -> DTensor:
    """This rank's block of the table's gradient as a DTensor of the table's shape."""
    return DTensor.from_local(table, grad.device_mesh, placements, shape=ctx.weight_shape,
                              stride=ctx.weight_stride, run_check=False)


class RowSplitEmbedding(torch.autograd.Function):
    """`embedding(weight, ids)` for a table split by rows over `dims` (`row_split_dims`):
    a pending sum over them forward, the own rows' gradient backward."""

    @staticmethod
    def forward(ctx: Any, weight: DTensor, ids: DTensor, dims: tuple[int, ...],
                padding: int = -1) -> DTensor:
        mesh = weight.device_mesh
        rows = weight._local_tensor.shape[0]
        _, offset = compute_local_shape_and_global_offset(weight.shape, mesh,
                                                          weight.placements)
        start = int(offset[0])
        local_ids = ids._local_tensor
        outside = (local_ids < start) | (local_ids >= start + rows)
        shifted = (local_ids - start).masked_fill(outside, 0)
        found = torch.nn.functional.embedding(shifted, weight._local_tensor)
        found = found.masked_fill(outside.unsqueeze(-1), 0)
        placements = _output_placements(ids, dims)
        ctx.save_for_backward(shifted, outside)
        ctx.rows, ctx.dims, ctx.placements = rows, dims, placements
        # the padding row's index among this rank's rows (-1: another rank holds it)
        padding = _table_padding(padding, weight.shape[0])
        ctx.padding = padding - start if start <= padding < start + rows else -1
        ctx.weight_shape, ctx.weight_stride = weight.shape, weight.stride()
        ctx.weight_placements = weight.placements
        ctx.batch = tuple(k for k, p in enumerate(ids.placements) if isinstance(p, Shard))
        return _looked_up(found, weight, ids, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        shifted, outside = ctx.saved_tensors
        # each rank's share of a sum has the whole sum's gradient: whole over the table's
        # split dims, split as the result was elsewhere
        wanted = tuple(Replicate() if k in ctx.dims else p
                       for k, p in enumerate(ctx.placements))
        if tuple(grad.placements) != wanted:
            grad = grad.redistribute(grad.device_mesh, wanted)
        local = grad._local_tensor.masked_fill(outside.unsqueeze(-1), 0)
        table = torch.ops.aten.embedding_dense_backward(local, shifted, ctx.rows,
                                                        ctx.padding, False)
        # this rank's rows, a pending sum over the axes the ids' rows are split over
        placements = tuple(Partial() if k in ctx.batch else p
                           for k, p in enumerate(ctx.weight_placements))
        return _table_gradient(ctx, table, grad, placements), None, None, None


def split_ids_dims(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
                   ) -> tuple[int, ...]:
    """The mesh dims along which `aten.embedding(weight, ids, ...)` looks split ids up in
    a whole (replicated) table, where this module runs it; empty: DTensor's own rule runs
    it. DTensor's rule for the lookup's backward may gather the gradient and the ids to
    make the table's gradient whole: moves the plan does not list, where the plan sums
    each rank's share at the table instead (the positions of a sequence-parallel run)."""
    if not _runs_here(args, kwargs or {}):
        return ()
    weight, ids = args[0], args[1]
    if not weight.requires_grad or any(not isinstance(p, Replicate)
                                       for p in weight.placements):
        return ()
    if any(not isinstance(p, (Shard, Replicate)) for p in ids.placements):
        return ()
    return tuple(k for k, p in enumerate(ids.placements) if isinstance(p, Shard))


class SplitIdsEmbedding(torch.autograd.Function):
    """`embedding(weight, ids)` of a whole table at ids split over `dims`
    (`split_ids_dims`): each rank looks its own ids up; the table's gradient is each
    rank's share, a pending sum over `dims` for the plan to reduce."""

    @staticmethod
    def forward(ctx: Any, weight: DTensor, ids: DTensor, dims: tuple[int, ...],
                padding: int = -1) -> DTensor:
        local_ids = ids._local_tensor
        found = torch.nn.functional.embedding(local_ids, weight._local_tensor)
        ctx.save_for_backward(local_ids)
        ctx.rows, ctx.dims = weight.shape[0], dims
        ctx.padding = _table_padding(padding, weight.shape[0])
        ctx.weight_shape, ctx.weight_stride = weight.shape, weight.stride()
        ctx.placements = tuple(ids.placements)
        return _looked_up(found, weight, ids, ctx.placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        (local_ids,) = ctx.saved_tensors
        if tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        table = torch.ops.aten.embedding_dense_backward(grad._local_tensor, local_ids,
                                                        ctx.rows, ctx.padding, False)
        placements = tuple(Partial() if k in ctx.dims else Replicate()
                           for k in range(grad.device_mesh.ndim))
        return _table_gradient(ctx, table, grad, placements), None, None, None
