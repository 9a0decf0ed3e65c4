"""Transposes the exporter spelled through a merged view, as the one transpose they are.

torch's dynamo exporter decomposes `scaled_dot_product_attention` into ONNX ops and
writes the transpose of K as `Reshape` to [batch * heads, s, d], `Transpose` of the last
two dims, `Reshape` back to [batch, heads, d, s]. Each step alone hides what the three do:
a split of the heads (the tensor-parallel split of every attention) is not a block split
of the merged `batch * heads` dim, so the planner could only gather K whole before it and
split it again after (an all-gather per layer in both passes, which Megatron and torch's
own tensor parallelism never issue). Here the three ops become the one `Transpose` of the
unmerged tensor (the middle op's name kept: the plan and the module executor find it under
it), so that every dim keeps its own label and a split of the heads passes through.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import replace

from planner.graph import OpNode, TensorInfo


def _merges_leading(before: tuple[int, ...], after: tuple[int, ...]) -> int:
    """How many leading dims of `before` the reshape to `after` merges into its first dim
    (the rest unchanged); 0 when it is no such merge."""
    lead = len(before) - len(after) + 1
    if lead < 2 or before[lead:] != after[1:] or math.prod(before[:lead]) != after[0]:
        return 0
    return lead


def merge_view_transposes(ops: list[OpNode], tensors: MutableMapping[str, TensorInfo],
                          outputs: Collection[str]) -> list[OpNode]:
    """`ops` with each Reshape (merging leading dims) → Transpose (keeping the merged dim
    first) → Reshape (unmerging them again), whose two inner tensors nothing else reads,
    replaced by one Transpose (module docstring); `tensors` loses the inner tensors."""
    readers = Counter(name for node in ops for name in node.inputs if name)
    producer = {out: node for node in ops for out in node.outputs if out}
    replaced: dict[str, OpNode | None] = {}  # op name -> its replacement (None: removed)
    for node in ops:
        found = _fused(node, producer, readers, tensors, outputs)
        if found is None:
            continue
        merge, transpose, fused = found
        if any(n.name in replaced for n in (node, transpose, merge)):
            continue
        replaced[merge.name] = None
        replaced[transpose.name] = None
        replaced[node.name] = fused
        for inner in (merge.outputs[0], transpose.outputs[0]):
            del tensors[inner]
        out = node.outputs[0]
        tensors[out] = replace(tensors[out], producer=fused.name)
    if not replaced:
        return ops
    result = []
    for node in ops:
        if node.name not in replaced:
            result.append(node)
        elif replaced[node.name] is not None:
            result.append(replaced[node.name])  # type: ignore[arg-type]
    return result


def _fused(unmerge: OpNode, producer: Mapping[str, OpNode], readers: Mapping[str, int],
           tensors: Mapping[str, TensorInfo], outputs: Collection[str]
           ) -> tuple[OpNode, OpNode, OpNode] | None:
    """(the merge, the transpose, the one Transpose they and `unmerge` are: module
    docstring), or None."""
    if unmerge.op_type != "Reshape" or not unmerge.inputs or not unmerge.outputs[0]:
        return None
    transpose = producer.get(unmerge.inputs[0])
    if transpose is None or transpose.op_type != "Transpose":
        return None
    merge = producer.get(transpose.inputs[0])
    if merge is None or merge.op_type != "Reshape" or not merge.inputs:
        return None
    inner = (merge.outputs[0], transpose.outputs[0])
    if any(readers.get(t, 0) != 1 or t in outputs for t in inner):
        return None
    source = tensors[merge.inputs[0]].shape
    merged = tensors[merge.outputs[0]].shape
    lead = _merges_leading(source, merged)
    perm = transpose.attrs.get("perm")
    if not lead or perm is None or len(perm) != len(merged) or perm[0] != 0:
        return None
    moved = tensors[transpose.outputs[0]].shape
    if tensors[unmerge.outputs[0]].shape != (*source[:lead], *moved[1:]):
        return None
    full = [*range(lead), *(lead - 1 + int(p) for p in perm[1:])]
    return merge, transpose, OpNode(transpose.name, "Transpose", transpose.domain,
                                    (merge.inputs[0],), (unmerge.outputs[0],),
                                    {**transpose.attrs, "perm": full})
