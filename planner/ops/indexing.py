"""Labellings of index-driven ops: Gather (embedding lookups), GatherElements, GatherND,
OneHot.

The gathered axes of the data stay whole (any output element may read any entry there),
except Gather's, whose split is a partial sum of masked lookups; dims the index tensor
walks in lockstep with the data share labels.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import DimLabels, Labels, attr_axis, output_shape, shape_of


def gather(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Embedding lookup: a vocabulary-split table gives masked lookups summed over shards.

    Negative indices stay allowed: the local program wraps them against the whole axis first.
    """
    data, indices = shape_of(tensors, node.inputs[0]), shape_of(tensors, node.inputs[1])
    axis = attr_axis(node, "axis", len(data), 0)
    data_labels = tuple(f"t{i}" for i in range(len(data)))
    index_labels = tuple(f"i{i}" for i in range(len(indices)))
    out = data_labels[:axis] + index_labels + data_labels[axis + 1:]
    return DimLabels((data_labels, index_labels), (out,),
                     sum_labels=frozenset({data_labels[axis]}))


def _elementwise_index(data: tuple[int, ...], indices: tuple[int, ...], axis: int,
                       split_index_axis: bool) -> tuple[Labels, Labels, frozenset[str]]:
    """Labels of an op whose indices address `data` element by element along `axis`
    (GatherElements, ScatterElements): off the axis, dims of equal size are one label (an
    index there is the element's own position); the rest are whole, but for the index's
    own dim along the axis when `split_index_axis`."""
    data_labels: list[str] = []
    index_labels: list[str] = []
    whole: set[str] = set()
    for dim, (d, i) in enumerate(zip(data, indices, strict=True)):
        if dim != axis and d == i:
            data_labels.append(f"d{dim}")
            index_labels.append(f"d{dim}")
            continue
        data_labels.append(f"w{dim}")
        index_labels.append(f"i{dim}")
        whole.add(f"w{dim}")
        if dim != axis or not split_index_axis:
            whole.add(f"i{dim}")
    return tuple(data_labels), tuple(index_labels), frozenset(whole)


def gather_elements(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Along the gather axis the index dim is free to split: each output element reads
    the whole (replicated) data axis."""
    data, indices = shape_of(tensors, node.inputs[0]), shape_of(tensors, node.inputs[1])
    axis = attr_axis(node, "axis", len(data), 0)
    data_labels, index_labels, whole = _elementwise_index(data, indices, axis, True)
    return DimLabels((data_labels, index_labels), (index_labels,), whole_labels=whole)


def gather_nd(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    data, indices = shape_of(tensors, node.inputs[0]), shape_of(tensors, node.inputs[1])
    batch = int(node.attrs.get("batch_dims", 0))
    depth = indices[-1]
    shared = tuple(f"b{i}" for i in range(batch))
    index_free = tuple(f"i{i}" for i in range(batch, len(indices) - 1))
    indexed = tuple(f"w{i}" for i in range(batch, batch + depth))
    rest = tuple(f"r{i}" for i in range(batch + depth, len(data)))
    out = shared + index_free + rest
    assert len(out) == len(output_shape(node, tensors))
    return DimLabels(((*shared, *indexed, *rest), (*shared, *index_free, "k_depth")), (out,),
                     whole_labels=frozenset({*indexed, "k_depth"}))


def one_hot(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    labels = tuple(f"d{i}" for i in range(len(shape_of(tensors, node.inputs[0]))))
    axis = attr_axis(node, "axis", len(output_shape(node, tensors)), -1)
    out = (*labels[:axis], "depth", *labels[axis:])
    return DimLabels((labels, None, None), (out,), whole_labels=frozenset({"depth"}))


def scatter_elements(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Data, indices and updates share each dim off the scatter axis where their sizes
    agree (a split scatters its own columns); the scatter axis stays whole in all three,
    for a split source could write any row."""
    data, indices = shape_of(tensors, node.inputs[0]), shape_of(tensors, node.inputs[1])
    axis = attr_axis(node, "axis", len(data), 0)
    data_labels, source_labels, whole = _elementwise_index(data, indices, axis, False)
    return DimLabels((data_labels, source_labels, source_labels), (data_labels,),
                     whole_labels=whole)


def all_whole(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Every dim whole: an op that reads all of its input to place any output element
    (NonZero lists the positions of the whole mask)."""
    def labels(names: tuple[str, ...], prefix: str) -> tuple[tuple[str, ...] | None, ...]:
        return tuple(tuple(f"{prefix}{k}_{d}" for d in range(len(shape_of(tensors, n))))
                     if n else None for k, n in enumerate(names))
    inputs, outputs = labels(node.inputs, "wi"), labels(node.outputs, "wo")
    every = {label for group in (*inputs, *outputs) if group for label in group}
    return DimLabels(inputs, outputs, whole_labels=frozenset(every))
