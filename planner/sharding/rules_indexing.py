"""Rules for index-driven gathers beyond the embedding lookup (GatherElements, GatherND).

The gathered axes of the data stay whole (any output element may read any entry there);
dims the index tensor walks in lockstep with the data share labels.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo
from planner.sharding.rules import DimLabels, _attr_axis, _out_shape, _shape, rule


@rule("GatherElements")
def _gather_elements(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    data, indices = _shape(tensors, node.inputs[0]), _shape(tensors, node.inputs[1])
    axis = _attr_axis(node, "axis", len(data), 0)
    data_labels, index_labels, whole = [], [], set()
    for dim, (d, i) in enumerate(zip(data, indices, strict=True)):
        if dim != axis and d == i:
            data_labels.append(f"d{dim}")
            index_labels.append(f"d{dim}")
        else:
            data_labels.append(f"w{dim}")
            whole.add(f"w{dim}")
            # Along the gather axis the index dim is free to split: each output element
            # reads the whole (replicated) data axis.
            index_labels.append(f"i{dim}")
            if dim != axis:
                whole.add(f"i{dim}")
    return DimLabels((tuple(data_labels), tuple(index_labels)), (tuple(index_labels),),
                     whole_labels=frozenset(whole))


@rule("GatherND")
def _gather_nd(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    data, indices = _shape(tensors, node.inputs[0]), _shape(tensors, node.inputs[1])
    batch = int(node.attrs.get("batch_dims", 0))
    depth = indices[-1]
    shared = tuple(f"b{i}" for i in range(batch))
    index_free = tuple(f"i{i}" for i in range(batch, len(indices) - 1))
    indexed = tuple(f"w{i}" for i in range(batch, batch + depth))
    rest = tuple(f"r{i}" for i in range(batch + depth, len(data)))
    out = shared + index_free + rest
    assert len(out) == len(_out_shape(node, tensors))
    return DimLabels(((*shared, *indexed, *rest), (*shared, *index_free, "k_depth")), (out,),
                     whole_labels=frozenset({*indexed, "k_depth"}))
