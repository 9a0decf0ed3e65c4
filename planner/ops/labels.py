"""Einsum-style labels of one op instance, and the helpers every labelling shares.

A labelling names each dim of each input and output of one op instance. A label shared by
several dims is one iteration dimension of the op: splitting it over a mesh axis splits all
those dims the same way and needs no communication. Three kinds of labels are special:

- `sum_labels`: contracted dims (MatMul's k, an embedding's vocabulary, ReduceSum's axes).
  Splitting one leaves every output a pending partial sum over that mesh axis.
- `sync_labels`: dims a training-mode BatchNormalization takes statistics over. Splitting
  one is correct only after an AllReduce of the per-channel statistics.
- `whole_labels`: dims that must stay whole (a softmax axis, a convolution window).

A split degree must divide the size of every dim that carries the label. Inputs that are
not data (a Reshape's target shape, Slice bounds) are labelled None and stay replicated.
The names of labels that can be split are written into plan files (`assignment` keys such
as `d0` or `k0`), so they are fixed: a labelling must keep handing out the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.graph import OpNode, TensorInfo

Labels = tuple[str, ...]


@dataclass(frozen=True)
class DimLabels:
    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels | None, ...]
    sum_labels: frozenset[str] = field(default_factory=frozenset)
    sync_labels: frozenset[str] = field(default_factory=frozenset)
    whole_labels: frozenset[str] = field(default_factory=frozenset)

    def sizes(self, node: OpNode, tensors: Mapping[str, TensorInfo]) -> dict[str, set[int]]:
        """Every size each label takes on (a split degree must divide all of them)."""
        found: dict[str, set[int]] = {}
        for names, labelled in ((node.inputs, self.inputs), (node.outputs, self.outputs)):
            for name, labels in zip(names, labelled, strict=False):
                if not name or labels is None:
                    continue
                for label, size in zip(labels, tensors[name].shape, strict=True):
                    found.setdefault(label, set()).add(size)
        return found


#: A labelling: the DimLabels of one op instance (raises NoRule to decline the instance).
Labeller = Callable[[OpNode, Mapping[str, TensorInfo]], DimLabels]


class NoRule(Exception):
    """Raised by a labelling that cannot label this instance (e.g. a run-time CumSum axis)."""


class Namer:
    """Hands out fresh labels: d0, d1, ... for shared dims, w0, w1, ... for whole ones.

    One counter runs over every prefix, so the names of one op never collide.
    """

    def __init__(self) -> None:
        self.count = 0

    def fresh(self, prefix: str = "d") -> str:
        self.count += 1
        return f"{prefix}{self.count - 1}"


def shape_of(tensors: Mapping[str, TensorInfo], name: str) -> tuple[int, ...]:
    """The tensor's shape; () for an omitted optional tensor ("")."""
    return tensors[name].shape if name else ()


def output_shape(node: OpNode, tensors: Mapping[str, TensorInfo]) -> tuple[int, ...]:
    return shape_of(tensors, node.outputs[0])


def attr_axis(node: OpNode, name: str, rank: int, default: int) -> int:
    """An axis attribute, negative values counted from the end of `rank` dims."""
    axis = int(node.attrs.get(name, default))
    return axis + rank if axis < 0 else axis


def const_ints(tensors: Mapping[str, TensorInfo], name: str) -> list[int] | None:
    """The known integer values of a constant input, or None when it has no known value."""
    if not name or name not in tensors or tensors[name].value is None:
        return None
    return [int(v) for v in np.asarray(tensors[name].value).reshape(-1)]


def broadcast_labels(
    shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...], namer: Namer
) -> tuple[list[Labels], Labels, set[str]]:
    """Numpy broadcasting: right-aligned dims share a label unless broadcast from size 1.

    The output dims get fresh labels first, then each input, left to right, a fresh whole
    label for every dim whose size differs from the output dim it aligns with.
    """
    out = tuple(namer.fresh() for _ in out_shape)
    whole: set[str] = set()
    labelled: list[Labels] = []
    for shape in shapes:
        offset = len(out_shape) - len(shape)
        labels = []
        for axis, size in enumerate(shape):
            target = out_shape[offset + axis]
            if size == target:
                labels.append(out[offset + axis])
            else:
                label = namer.fresh("w")
                whole.add(label)
                labels.append(label)
        labelled.append(tuple(labels))
    return labelled, out, whole
