"""Labellings of contractions whose form an attribute decides: Gemm, Einsum, Conv.

(MatMul is regular enough for annotations: see the registry.)
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import (
    DimLabels,
    Labels,
    Namer,
    NoRule,
    broadcast_labels,
    output_shape,
    shape_of,
)


def gemm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """A (m, k) times B (k, n), either transposed by transA/transB; C broadcasts to (m, n)."""
    m, k, n = "m", "k", "n"
    a_labels = (k, m) if node.attrs.get("transA", 0) else (m, k)
    b_labels = (n, k) if node.attrs.get("transB", 0) else (k, n)
    inputs: list[Labels | None] = [a_labels, b_labels]
    whole: set[str] = set()
    if len(node.inputs) > 2 and node.inputs[2]:
        namer = Namer()
        labelled, _, whole = broadcast_labels([shape_of(tensors, node.inputs[2])],
                                              output_shape(node, tensors), namer)
        out_dims = output_shape(node, tensors)
        c_shape = shape_of(tensors, node.inputs[2])
        offset = len(out_dims) - len(c_shape)
        c_labels = tuple(
            (m, n)[offset + axis] if label not in whole else label
            for axis, label in enumerate(labelled[0])
        )
        inputs.append(c_labels)
    return DimLabels(tuple(inputs), ((m, n),), sum_labels=frozenset({k}),
                     whole_labels=frozenset(whole))


def einsum(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Letters are labels; `...` dims are right-aligned, broadcast ones stay whole."""
    equation = str(node.attrs.get("equation", "")).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    shapes = [shape_of(tensors, name) for name in node.inputs]
    if len(terms) != len(shapes):
        raise NoRule
    spans = [len(shape) - (len(term) - 3) if "..." in term else 0
             for term, shape in zip(terms, shapes, strict=True)]
    width = max(spans, default=0)
    ellipsis_sizes = [1] * width
    for span, shape, term in zip(spans, shapes, terms, strict=True):
        start = term.index("...") if "..." in term else 0
        for j, size in enumerate(shape[start:start + span]):
            if size != 1:
                ellipsis_sizes[width - span + j] = size
    namer = Namer()
    whole: set[str] = set()
    inputs = []
    for span, shape, term in zip(spans, shapes, terms, strict=True):
        before, _, after = term.partition("...")
        labels = [f"e{c}" for c in before]
        start = len(before)
        for j in range(span):
            if shape[start + j] == ellipsis_sizes[width - span + j]:
                labels.append(f"E{width - span + j}")
            else:  # broadcast from size 1 against a larger dim
                labels.append(namer.fresh("w"))
                whole.add(labels[-1])
        labels += [f"e{c}" for c in after]
        inputs.append(tuple(labels))
    ellipsis = tuple(f"E{j}" for j in range(width))
    if rhs or "->" in equation:
        before, _, after = rhs.partition("...")
        out = (*[f"e{c}" for c in before], *(ellipsis if "..." in rhs else ()),
               *[f"e{c}" for c in after])
    else:  # implicit output: the ellipsis, then letters used exactly once, alphabetically
        letters = [c for term in terms for c in term.replace("...", "")]
        out = (*ellipsis, *[f"e{c}" for c in sorted(set(letters)) if letters.count(c) == 1])
    contracted = {label for term in inputs for label in term} - set(out)
    repeated = {label for term in inputs for label in term if term.count(label) > 1}
    return DimLabels(tuple(inputs), (out,), sum_labels=frozenset(contracted - repeated - whole),
                     whole_labels=frozenset(repeated | whole))


def conv(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Batch and output channels split freely; input channels give partial sums."""
    source = shape_of(tensors, node.inputs[0])
    spatial = len(source) - 2
    groups = int(node.attrs.get("group", 1))
    cin = "cin" if groups == 1 else "cin_g"
    x = ("n", cin, *[f"x{i}" for i in range(spatial)])
    w = ("cout", "cin_w" if groups != 1 else cin, *[f"k{i}" for i in range(spatial)])
    y = ("n", "cout", *[f"y{i}" for i in range(spatial)])
    inputs: list[Labels | None] = [x, w]
    if len(node.inputs) > 2 and node.inputs[2]:
        inputs.append(("cout",))
    whole = {f"x{i}" for i in range(spatial)} | {f"k{i}" for i in range(spatial)}
    whole |= {f"y{i}" for i in range(spatial)}
    if groups != 1:
        whole |= {"cin_g", "cin_w", "cout"}
    return DimLabels(tuple(inputs), (y,), sum_labels=frozenset({"cin"} if groups == 1 else ()),
                     whole_labels=frozenset(whole))
