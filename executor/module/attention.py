"""Attention on the batch rows and heads each rank holds, as the plan splits it.

A plan that splits attention over heads (Megatron's tensor parallelism) or the batch
prices the attention core as local work: each head attends over its own keys, so a rank
holding some heads of the queries and the matching heads (or all) of the keys and values
needs nothing from the others. DTensor's rules do not see that. Where the plan gathered
the keys whole before grouped-query attention repeats them (transformers' LLaMA), the
attention's matmul of head-split queries with whole keys all-gathers the queries rather
than cut the keys, and then the values: two all-gathers per layer forward and two
backward that the plan never priced. So where the queries are split over the batch and
heads only, evenly, and the keys and values alike or whole, the attention runs on the
local blocks, and its output is the block of the result in the queries' placements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from executor.dropout import DropoutSite
from executor.module.kernels import Shift, attention_math, dropout
from executor.module.moves import redistribute

_BATCH, _HEADS = 0, 1


def local_placements(args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[Placement, ...] | None:
    """The placements of the queries where attention can run on each rank's blocks
    (SDPA's arguments, its mask resolved): the keys and values split alike or whole
    (their block then cut out locally); None where it cannot: another split (the
    sequence, the head dim), different splits, heads that do not divide evenly (a rank's
    query heads would not match its key/value heads), or a mask left."""
    if len(args) < 3 or not all(isinstance(t, DTensor) and t.ndim == 4 for t in args[:3]):
        return None
    query, key, value = args[:3]
    placements = tuple(query.placements)
    for other in (key, value):
        if not all(theirs == ours or isinstance(theirs, Replicate)
                   for theirs, ours in zip(other.placements, placements, strict=True)):
            return None
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not None:
        return None
    mesh = query.device_mesh
    for dim in (_BATCH, _HEADS):
        ways = math.prod(mesh.size(axis) for axis, p in enumerate(placements)
                         if isinstance(p, Shard) and p.dim == dim)
        if any(int(t.shape[dim]) % ways for t in (query, key, value)):
            return None
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (_BATCH, _HEADS))
               for p in placements):
        return None
    return placements


def run_local(target: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], placements: tuple[Placement, ...], site: DropoutSite,
              micro: int) -> DTensor:
    """SDPA (`target`) on the local blocks of `args` (split as `placements` say), as a
    DTensor in those placements. Attention dropout draws, for each block, the mask one
    device draws at the block's place in the step's probabilities ([batch, heads, queries,
    keys]): `site`'s offsets are filled in here, and micro-batch `micro`'s rows start
    `micro` micro-batches into the step."""
    query = args[0]
    assert isinstance(query, DTensor)
    mesh = query.device_mesh
    # a whole key or value is cut to the query's block (no communication; its gradient,
    # this rank's block of it, is gathered whole in the backward pass, as the plan prices
    # a split op's read of a replicated tensor)
    blocks: list[Any] = [(t if tuple(t.placements) == placements else
               redistribute(t, mesh, placements)).to_local() for t in args[:3]]
    p = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
    if p:
        _, offset = compute_local_shape_and_global_offset(query.shape, mesh, placements)
        at = DropoutSite(site.seed, site.step, site.op, (offset[_BATCH], offset[_HEADS], 0, 0))
        shift = Shift(_BATCH, micro, int(query.shape[_BATCH])) if micro else None
        out = attention_math(*blocks, *args[3:], **kwargs,
                             drop=lambda t: dropout(t, p, at, shift)[0])
    else:
        out = target(*blocks, *args[3:], **kwargs)
    return DTensor.from_local(out, mesh, placements, run_check=False)
