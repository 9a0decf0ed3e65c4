"""Labellings of ops that move data without arithmetic: Transpose, Reshape and friends,
Concat, Split, Slice, Tile."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import (
    DimLabels,
    Namer,
    attr_axis,
    const_ints,
    output_shape,
    shape_of,
)


def transpose(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    perm = node.attrs.get("perm") or list(reversed(range(rank)))
    labels = tuple(f"d{i}" for i in range(rank))
    return DimLabels((labels,), (tuple(labels[p] for p in perm),))


def reshape(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Group dims whose products match; the leading dims of a group share a label."""
    source, target = shape_of(tensors, node.inputs[0]), output_shape(node, tensors)
    namer = Namer()
    in_labels = [namer.fresh("w") for _ in source]
    out_labels = [namer.fresh("w") for _ in target]
    whole = set(in_labels) | set(out_labels)
    for in_group, out_group in reshape_groups(source, target):
        label = namer.fresh()
        in_labels[in_group[0]] = label
        out_labels[out_group[0]] = label
    whole -= set(in_labels) & set(out_labels)
    extra = [None] * (len(node.inputs) - 1)
    return DimLabels((tuple(in_labels), *extra), (tuple(out_labels),),
                     whole_labels=frozenset(whole))


def reshape_groups(
    source: Sequence[int], target: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Pairs of (input dims, output dims) with equal products, size-1 dims left out."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) and j < len(target):
        if source[i] == 1:
            i += 1
            continue
        if target[j] == 1:
            j += 1
            continue
        in_group, out_group = [i], [j]
        in_prod, out_prod = source[i], target[j]
        while in_prod != out_prod:
            if in_prod < out_prod:
                i += 1
                if i >= len(source):
                    return groups
                in_group.append(i)
                in_prod *= source[i]
            else:
                j += 1
                if j >= len(target):
                    return groups
                out_group.append(j)
                out_prod *= target[j]
        groups.append((in_group, out_group))
        i += 1
        j += 1
    return groups


def concat(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(output_shape(node, tensors))
    axis = attr_axis(node, "axis", rank, 0)
    labels = tuple(f"d{i}" for i in range(rank))
    inputs = []
    for index, _ in enumerate(node.inputs):
        inputs.append(tuple(f"c{index}" if i == axis else labels[i] for i in range(rank)))
    out = tuple("c_out" if i == axis else labels[i] for i in range(rank))
    whole = {f"c{index}" for index in range(len(node.inputs))} | {"c_out"}
    return DimLabels(tuple(inputs), (out,), whole_labels=frozenset(whole))


def split(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    axis = attr_axis(node, "axis", rank, 0)
    labels = tuple(f"d{i}" for i in range(rank))
    source = tuple("s_in" if i == axis else labels[i] for i in range(rank))
    outputs = tuple(tuple(f"s{j}" if i == axis else labels[i] for i in range(rank)) if name
                    else None for j, name in enumerate(node.outputs))
    whole = {"s_in"} | {f"s{j}" for j in range(len(node.outputs))}
    return DimLabels((source, *[None] * (len(node.inputs) - 1)), outputs,
                     whole_labels=frozenset(whole))


def slice_(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    return unchanged_dims_pass(node, tensors,
                               lambda i: _slice_untouched(node, tensors, i, rank))


def tile(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Dims repeated once pass through; a repeated dim is a new, whole dim."""
    return unchanged_dims_pass(node, tensors, lambda _: True)


def unchanged_dims_pass(node: OpNode, tensors: Mapping[str, TensorInfo],
                        untouched: Callable[[int], bool]) -> DimLabels:
    """Dims of equal size that the op leaves alone pass through; the others stay whole."""
    source, out = shape_of(tensors, node.inputs[0]), output_shape(node, tensors)
    labels_in, labels_out, whole = [], [], set()
    for i, (a, b) in enumerate(zip(source, out, strict=True)):
        if a == b and untouched(i):
            labels_in.append(f"d{i}")
            labels_out.append(f"d{i}")
        else:
            labels_in.append(f"w{i}")
            labels_out.append(f"v{i}")
            whole.update({f"w{i}", f"v{i}"})
    return DimLabels((tuple(labels_in), *[None] * (len(node.inputs) - 1)),
                     (tuple(labels_out),), whole_labels=frozenset(whole))


def _slice_untouched(node: OpNode, tensors: Mapping[str, TensorInfo], dim: int,
                     rank: int) -> bool:
    """A dim of unchanged size may still be reversed by a negative step."""
    axes = const_ints(tensors, node.inputs[3]) if len(node.inputs) > 3 else None
    steps = const_ints(tensors, node.inputs[4]) if len(node.inputs) > 4 else None
    if axes is None:
        axes = list(range(len(const_ints(tensors, node.inputs[1]) or [])))
    axes = [a + rank if a < 0 else a for a in axes]
    if steps is None or dim not in axes:
        return True
    return steps[axes.index(dim)] > 0
