"""Attention masks the export made from shapes alone, run as what they are.

Eagerly, transformers' SDPA attention passes `is_causal=True` and no mask, so torch runs
its flash kernel. Under `torch.export` it materialises the causal mask instead (a
`[batch, 1, s, s]` boolean tensor built from `arange`), and SDPA given a mask runs a
masked kernel: on an H200 the trace's attention took 2.7× eager's (docs/benchmarks.md,
"On a GPU"). A mask that depends on no input's values, only on shapes, is the same at
every step; it is looked at once per shape, and where it is the causal mask (or keeps
every position) SDPA runs with `is_causal=True` (or no mask): the same attention, by the
kernel eager runs.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx import Node

from executor.module.constants import constant_values

_aten = torch.ops.aten
SDPA = _aten.scaled_dot_product_attention.default

#: An additive float mask hides a position with a value at least this negative
#: (transformers uses the dtype's lowest value, others -inf).
_HIDDEN = -1e4

_SHAPE_ONLY = "shardplan.shape_only"
_VERDICTS = "shardplan.mask"


class MaskKind(enum.Enum):
    CAUSAL = "causal"  # each query sees the keys up to its own position
    NONE = "none"  # every position is kept: no mask
    OTHER = "other"  # anything else: run as given


def shape_only(node: Node) -> bool:
    """Whether `node`'s value depends on no input's values (only on shapes), so that it is
    the same at every step (`executor.module.constants`, the graph's weights counted as
    fixed); found for every node of its graph at once, remembered on each."""
    if _SHAPE_ONLY not in node.meta:
        found = constant_values(node.graph.nodes, ())
        for each in node.graph.nodes:
            each.meta[_SHAPE_ONLY] = each in found
    return bool(node.meta[_SHAPE_ONLY])


def mask_kind(mask: torch.Tensor) -> MaskKind:
    """What a materialised attention mask (boolean: True keeps; float: added to the
    scores) is, over its last two dims (queries, keys), the same for every leading index."""
    if mask.dim() < 2:
        return MaskKind.OTHER
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        if not bool(torch.all(keep | (mask <= _HIDDEN))):
            return MaskKind.OTHER  # a bias (ALiBi, relative positions), not a mask
    else:
        return MaskKind.OTHER
    if bool(torch.all(keep)):
        return MaskKind.NONE
    queries, keys = keep.shape[-2:]
    if queries != keys:
        return MaskKind.OTHER
    causal = torch.ones(queries, keys, dtype=torch.bool, device=keep.device).tril()
    return MaskKind.CAUSAL if torch.equal(keep, causal.expand_as(keep)) else MaskKind.OTHER


def _block(mask: Any) -> torch.Tensor | None:
    """The mask as this rank holds it, when every rank's block is a whole mask of its rows
    (split at most along the batch); None otherwise."""
    if isinstance(mask, DTensor):
        if all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
               for p in mask.placements):
            return mask.to_local()
        return None
    return mask if isinstance(mask, torch.Tensor) else None


def _split_sequence(query: Any) -> bool:
    """Whether the queries are split along their sequence (dim -2): is_causal would then
    mean each block's own diagonal."""
    return isinstance(query, DTensor) and any(
        isinstance(p, Shard) and p.dim % query.ndim == query.ndim - 2
        for p in query.placements)


def resolved(node: Node, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """SDPA's arguments with a shape-only causal (or keep-all) mask replaced by
    `is_causal=True` (or no mask); anything else unchanged."""
    mask_node = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if not isinstance(mask_node, Node) or not shape_only(mask_node):
        return args, kwargs
    positional = len(args) > 3
    mask = args[3] if positional else kwargs.get("attn_mask")
    causal_given = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    block = _block(mask)
    if block is None or causal_given or _split_sequence(args[0]):
        return args, kwargs
    verdicts = node.meta.setdefault(_VERDICTS, {})
    key = (tuple(block.shape), block.dtype)
    if key not in verdicts:
        verdicts[key] = mask_kind(block)
    kind = verdicts[key]
    if kind is MaskKind.OTHER:
        return args, kwargs
    new_args, new_kwargs = list(args), dict(kwargs)
    if positional:
        new_args[3] = None
    else:
        new_kwargs["attn_mask"] = None
    if kind is MaskKind.CAUSAL:
        if len(new_args) > 5:
            new_args[5] = True
        else:
            new_kwargs["is_causal"] = True
    return tuple(new_args), new_kwargs
