"""Torch kernels a traced graph calls that DTensor cannot shard on every device, written
in ops it can.

DTensor registers sharding rules for the fused attention kernels of CUDA (flash and
memory-efficient) but not for the CPU one (`_scaled_dot_product_flash_attention_for_cpu`),
so on CPU ranks `scaled_dot_product_attention` runs as its mathematical definition,
softmax(q kᵀ · scale + mask) v, in the fused kernels' memory layout. Its matmuls, softmax
and elementwise ops keep a batch or head split without any communication. Dropout (the
graph's own and attention's) draws its masks by `executor.dropout`, so a split run keeps
the elements one device keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from executor.dropout import DropoutSite, keep_mask
from executor.module.embedding import (
    EMBEDDING,
    RowSplitEmbedding,
    SplitIdsEmbedding,
    lookup_options,
    row_split_dims,
    split_ids_dims,
)
from executor.module.moves import tensor_dim


@dataclass(frozen=True)
class Shift:
    """Where a micro-batch sits in the step's tensor: `micro` blocks of its own size
    along `dim` (the dim that scales with the batch). `size` is the micro-batch's extent
    along `dim` when the tensor is a local block of it (None: the tensor's own, as a
    DTensor's global shape is)."""

    dim: int
    micro: int
    size: int | None = None

    def offset(self, x: torch.Tensor) -> int:
        """How far along `dim` the micro-batch starts in the step's tensor."""
        return self.micro * (self.size if self.size is not None else int(x.shape[self.dim]))


def dropout(x: torch.Tensor, p: float, site: DropoutSite, shift: Shift | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`native_dropout`'s (output, keep mask), the mask a hash of each element's place in
    the step's whole tensor (`executor.dropout`): a DTensor's local block of micro-batch
    `shift.micro` draws what one device training the whole batch draws there.
    A DTensor's `site.offsets` are filled in here from its placements and the shift; a
    plain tensor is the whole tensor, or the block at `site.offsets` when given."""
    if isinstance(x, DTensor):
        _, found = compute_local_shape_and_global_offset(x.shape, x.device_mesh,
                                                         x.placements)
        offsets, local = list(found), x.to_local()
    else:  # a whole tensor, or a local block whose offsets the site gives
        offsets = list(site.offsets) if len(site.offsets) == x.dim() else [0] * x.dim()
        local = x
    if shift is not None:
        offsets[shift.dim] += shift.offset(x)
    keep = keep_mask(DropoutSite(site.seed, site.step, site.op, tuple(offsets)),
                     local.shape, p, local.device)
    if not isinstance(x, DTensor):
        return x * keep / (1.0 - p), keep

    def wrap(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, x.device_mesh, x.placements, shape=x.shape,
                                  stride=x.stride(), run_check=False)

    return wrap(local * keep / (1.0 - p)), wrap(keep)


def attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, *, scale: float | None = None,
                   enable_gqa: bool = False,
                   drop: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`'s result, from its definition;
    `drop` applies the attention dropout to the probabilities (needed when dropout_p>0)."""
    if dropout_p and drop is None:
        raise ValueError("attention dropout needs the run's dropout")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if is_causal:
        length, source = query.shape[-2], key.shape[-2]
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        if isinstance(scores, DTensor):  # the same on every rank
            mesh = scores.device_mesh
            causal = DTensor.from_local(causal, mesh, [Replicate()] * mesh.ndim,
                                        run_check=False)
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probabilities = torch.softmax(scores, dim=-1)
    if dropout_p and drop is not None:
        probabilities = drop(probabilities)
    out = torch.matmul(probabilities, value)
    # The fused kernels return heads innermost in memory ([b, s, h, d] strides), and the
    # traced graph views the transposed result without a copy: keep that layout.
    return out.transpose(-3, -2).contiguous().transpose(-3, -2)


#: Views in a trace assume the strides the export's kernels gave: an attention output in
#: the fused kernel's (b, s, h, d) memory order, say, which a transpose then views as
#: contiguous. A kernel run here may give another order (attention's math form, a
#: head-split block, a redistributed DTensor's fresh local tensor): a view that the
#: strides then forbid raises "view size is not compatible".
VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def runnable(target: Any) -> Any:
    """The op a traced node runs as on plain tensors: a view as a reshape, which is the
    view where the strides allow one and a copy where not (the same values: a traced graph
    mutates nothing through a view); any other op as itself."""
    return torch.ops.aten.reshape.default if target in VIEWS else target


_SLICE = torch.ops.aten.slice.Tensor


class _BlockView(torch.autograd.Function):
    """A view of a DTensor whose gradient is reshaped back from a contiguous copy.
    Autograd's own backward of a view reshapes the incoming gradient by its global
    strides, which DTensor derives for the whole tensor: where the gradient arrives
    permuted (the heads of an eager attention merged back after a transpose) the whole
    tensor's strides allow a view its block's do not, and the block refuses it."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, target: Any, shape: Any) -> DTensor:
        ctx.shape = value.shape
        found: DTensor = target(value, shape)
        return found

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not (grad.is_contiguous() and local.is_contiguous()):
            # a clone, not `contiguous()`: a DTensor whose whole tensor is contiguous
            # returns itself from that, its block as it was
            grad = torch.ops.aten.clone.default(grad, memory_format=torch.contiguous_format)
        return grad.view(ctx.shape), None, None


class _BlockSlice(torch.autograd.Function):
    """`aten.slice` of a DTensor along a dim no mesh dim splits, on each rank's block, in
    both passes. DTensor's rule for the backward op (`slice_backward`) takes only a
    replicated gradient: under DTensor a batch-split gradient was gathered whole and cut
    again, one all-gather the plan does not list per slice (the exporter slices keys and
    values in every attention layer; on llama_medium 4 per step)."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, dim: int, start: int | None, end: int | None,
                step: int) -> DTensor:
        local = x.to_local()
        out = _SLICE(local, dim, start, end, step)
        ctx.mesh, ctx.placements, ctx.shape = x.device_mesh, x.placements, x.shape
        ctx.local_shape, ctx.cut = tuple(local.shape), (dim, start, end, step)
        shape = list(x.shape)
        if out.shape[dim] != local.shape[dim]:  # cut: then the dim is whole on every rank
            shape[dim] = out.shape[dim]
        return DTensor.from_local(out, x.device_mesh, x.placements, shape=torch.Size(shape),
                                  stride=x.stride(), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None, None]:
        if tuple(grad.placements) != tuple(ctx.placements):
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        dim, start, end, step = ctx.cut
        # slice_backward takes concrete bounds: None is the whole dim
        whole = torch.ops.aten.slice_backward.default(
            grad.to_local(), list(ctx.local_shape), dim,
            0 if start is None else start,
            ctx.local_shape[dim] if end is None else end, step)
        # a fresh contiguous block: its global strides are the contiguous ones (DTensor
        # decides later views by them; the input's may be a transpose's)
        return (DTensor.from_local(whole, ctx.mesh, ctx.placements, shape=ctx.shape,
                                   stride=make_contiguous_strides_for(ctx.shape), run_check=False),
                None, None, None, None)


def block_slice(x: DTensor, dim: int = 0, start: int | None = None,
                end: int | None = None, step: int = 1) -> DTensor | None:
    """`x[start:end:step]` along `dim` on the blocks (`_BlockSlice`) where no mesh dim
    splits `dim` or the slice keeps all of it (the exporter's `x[:, ...]` of a batch-split
    tensor), and none holds a pending sum; None where DTensor's own rule must run."""
    dim = dim if dim >= 0 else dim + x.ndim
    whole = start in (None, 0) and (end is None or end >= x.shape[dim]) and step == 1
    for placement in x.placements:
        if isinstance(placement, Shard) and tensor_dim(placement, x.ndim) == dim \
                and not whole:
            return None
        if not isinstance(placement, (Shard, Replicate)):
            return None
    sliced: DTensor = _BlockSlice.apply(x, dim, start, end, step)
    return sliced


def run_op(target: Any, args: Any, kwargs: Any) -> Any:
    """A traced op on its arguments (`runnable`). A view of a DTensor whose local block or
    whole tensor is not contiguous views a contiguous copy: DTensor's own strides are the
    whole tensor's as its sharding rule derives them, so a reshape would choose a view
    from them and the block would refuse it, and its view rule refuses a view the whole
    tensor's strides forbid even where the block allows it (one head per rank: a
    transpose of a size-1 dim leaves the block contiguous); its gradient is viewed back
    from a contiguous copy alike (`_BlockView`). A slice of a DTensor along a
    dim no mesh dim splits runs on the blocks (`block_slice`)."""
    if target is EMBEDDING:
        padding = lookup_options(args, kwargs)[0]
        dims = row_split_dims(args, kwargs)
        if dims:  # a table split by rows: as Megatron looks it up (`executor.module.embedding`)
            found: DTensor = RowSplitEmbedding.apply(args[0], args[1], dims, padding)
            return found
        split = split_ids_dims(args, kwargs)
        if split:  # split ids in a whole table: each rank's share of its gradient pending
            looked: DTensor = SplitIdsEmbedding.apply(args[0], args[1], split, padding)
            return looked
    if target is _SLICE and args and isinstance(args[0], DTensor):
        sliced = block_slice(*args, **kwargs)
        if sliced is not None:
            return sliced
    if target in VIEWS and args and isinstance(args[0], DTensor):
        with torch.no_grad():  # the block's strides, and the whole tensor's DTensor checks
            contiguous = args[0].to_local().is_contiguous() and args[0].is_contiguous()
        if not contiguous:
            args = (torch.ops.aten.clone.default(args[0],
                                                 memory_format=torch.contiguous_format),
                    *args[1:])
        if args[0].requires_grad and len(args) == 2 and not kwargs:
            viewed: DTensor = _BlockView.apply(args[0], target, args[1])
            return viewed
        return target(*args, **kwargs)
    return runnable(target)(*args, **kwargs)
