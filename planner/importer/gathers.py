"""Index gathers that only lay a tensor out again become Reshapes.

Exporters expand a padding mask `[batch, seq]` to `[batch, 1, 1, seq]` by gathering it at
a grid of every position in order: dynamo as `GatherND` at the `(b, s)` pairs, TorchScript
as a `Gather` of the flattened mask at `b * seq + s`. Read as a gather, the batch dim is
an index whose value the planner does not know, so nothing can split it and every device
would build the whole `[batch, 1, seq, seq]` mask; read as what it is, a Reshape, the
mask splits with the batch like the activations it is added to.

The grids are integer tensors affine in their position (`value[p] = offset + coefs · p`),
built from arange constants by Unsqueeze, Expand, Add, Mul, Cast and Concat; they are
recognised by following those ops symbolically, so a grid too large to be folded into a
constant is recognised as well. A gather is rewritten only when its flat index visits
every element of the gathered dims once, in row-major order: then it is exactly a Reshape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx
from onnx import numpy_helper

Shapes = Mapping[str, tuple[tuple[int, ...] | None, int]]
INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


@dataclass(frozen=True)
class Affine:
    """`value[p] = offset + sum(coefs[d] * p[d])` over a tensor of `shape` (coefficients of
    size-1 dims are 0: there p[d] is always 0)."""

    offset: int
    coefs: tuple[int, ...]

    def scaled(self, factor: int) -> Affine:
        return Affine(self.offset * factor, tuple(c * factor for c in self.coefs))


def _fit(value: np.ndarray) -> Affine | None:
    """The affine form of a constant integer array, if it has one."""
    if value.dtype.kind not in "iu" or value.size == 0:
        return None
    value = value.astype(np.int64)
    origin = int(value.reshape(-1)[0])
    coefs = tuple(int(value[tuple(1 if d == axis else 0 for d in range(value.ndim))]) - origin
                  if size > 1 else 0 for axis, size in enumerate(value.shape))
    grid = np.full(value.shape, origin, dtype=np.int64)
    for axis, (coef, size) in enumerate(zip(coefs, value.shape, strict=True)):
        if coef:
            grid = grid + coef * np.arange(size).reshape(
                [size if d == axis else 1 for d in range(value.ndim)])
    return Affine(origin, coefs) if np.array_equal(grid, value) else None


def _broadcast(form: Affine, shape: tuple[int, ...], out: tuple[int, ...]) -> Affine | None:
    """`form` over `shape` broadcast to `out` (numpy rules, right-aligned)."""
    if len(shape) > len(out):
        return None
    pad = len(out) - len(shape)
    coefs = [0] * pad
    for size, target, coef in zip(shape, out[pad:], form.coefs, strict=True):
        if size not in (1, target):
            return None
        coefs.append(coef if size == target else 0)
    return Affine(form.offset, tuple(coefs))


class _Forms:
    """Affine forms of the integer tensors of one model, each derived once on demand."""

    def __init__(self, model: onnx.ModelProto, shapes: Shapes,
                 known: Mapping[str, np.ndarray]) -> None:
        self.model = model
        self.shapes, self.known = shapes, known
        self.memo: dict[str, Affine | tuple[Affine, ...] | None] = {}

    @cached_property  # at the first gather asked about: most models have none to re-lay
    def producers(self) -> dict[str, onnx.NodeProto]:
        return {out: node for node in self.model.graph.node for out in node.output if out}

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name, (None, 0))[0]

    def of(self, name: str) -> Affine | None:
        form = self._derive(name)
        return form if isinstance(form, Affine) else None

    def components(self, name: str) -> tuple[Affine, ...] | None:
        """A tensor of index tuples (last dim): each component's form over the rest."""
        form = self._derive(name)
        if isinstance(form, tuple):
            return form
        shape = self.shape(name)
        if isinstance(form, Affine) and shape and shape[-1] == 1:
            return (Affine(form.offset, form.coefs[:-1]),)
        value = self.known.get(name)
        if value is None or value.ndim == 0:
            return None
        parts = [_fit(value[..., j]) for j in range(value.shape[-1])]
        fitted = tuple(p for p in parts if p is not None)
        return fitted if len(fitted) == len(parts) else None

    def _derive(self, name: str) -> Affine | tuple[Affine, ...] | None:
        if name not in self.memo:
            self.memo[name] = None  # a cycle (never in a sorted graph) derives nothing
            self.memo[name] = self._compute(name)
        return self.memo[name]

    def _compute(self, name: str) -> Affine | tuple[Affine, ...] | None:
        value = self.known.get(name)
        if value is not None:
            return _fit(np.asarray(value))
        node = self.producers.get(name)
        out = self.shape(name)
        if node is None or out is None or node.domain not in ("", "ai.onnx"):
            return None
        inputs = list(node.input)
        if node.op_type in ("Cast", "Identity"):
            if node.op_type == "Cast" and not _casts_to_integer(node):
                return None
            return self._derive(inputs[0])
        if node.op_type in ("Expand", "Unsqueeze", "Reshape"):
            source, shape = self.of(inputs[0]), self.shape(inputs[0])
            if source is None or shape is None:
                return None
            if node.op_type == "Expand":
                return _broadcast(source, shape, out)
            # Unsqueeze, or a Reshape that only adds or drops size-1 dims: same order
            if [d for d in shape if d != 1] != [d for d in out if d != 1]:
                return None
            kept = iter(c for c, d in zip(source.coefs, shape, strict=True) if d != 1)
            return Affine(source.offset, tuple(next(kept) if d != 1 else 0 for d in out))
        if node.op_type in ("Add", "Sub", "Mul") and len(inputs) == 2:
            return self._arithmetic(node.op_type, inputs, out)
        if node.op_type == "Concat":
            return self._concat(node, inputs, out)
        return None

    def _arithmetic(self, op: str, inputs: list[str], out: tuple[int, ...]) -> Affine | None:
        forms = []
        for name in inputs:
            form, shape = self.of(name), self.shape(name)
            if form is None or shape is None:
                return None
            wide = _broadcast(form, shape, out)
            if wide is None:
                return None
            forms.append(wide)
        a, b = forms
        if op == "Add":
            return Affine(a.offset + b.offset, tuple(x + y for x, y in zip(a.coefs, b.coefs,
                                                                            strict=True)))
        if op == "Sub":
            return Affine(a.offset - b.offset, tuple(x - y for x, y in zip(a.coefs, b.coefs,
                                                                            strict=True)))
        if not any(b.coefs):
            return a.scaled(b.offset)
        if not any(a.coefs):
            return b.scaled(a.offset)
        return None  # a product of two varying grids is not affine

    def _concat(self, node: onnx.NodeProto, inputs: list[str],
                out: tuple[int, ...]) -> tuple[Affine, ...] | None:
        axis = next((int(onnx.helper.get_attribute_value(a)) for a in node.attribute
                     if a.name == "axis"), 0) % len(out)
        if axis != len(out) - 1:
            return None
        parts: list[Affine] = []
        for name in inputs:
            found = self.components(name)
            if found is None:
                return None
            parts.extend(found)
        return tuple(parts) if len(parts) == out[-1] else None


def _casts_to_integer(node: onnx.NodeProto) -> bool:
    return any(a.name == "to" and a.i in INTEGER_TYPES for a in node.attribute)


def _enumerates(form: Affine, shape: tuple[int, ...], total: int) -> bool:
    """Whether `form` over `shape` visits 0 .. total-1 once each, in row-major order."""
    stride = 1
    for size, coef in reversed(list(zip(shape, form.coefs, strict=True))):
        if size == 1:
            continue
        if coef != stride:
            return False
        stride *= size
    return form.offset == 0 and stride == total


def _gather_target(node: onnx.NodeProto, forms: _Forms) -> tuple[int, ...] | None:
    """The shape a gather is a Reshape to, or None when it gathers anything else."""
    data, out = forms.shape(node.input[0]), forms.shape(node.output[0])
    index = forms.shape(node.input[1])
    if data is None or out is None or index is None:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gather":
        axis = int(attrs.get("axis", 0)) % len(data)
        form = forms.of(node.input[1])
        if axis != 0 or form is None or not _enumerates(form, index, data[0]):
            return None
        return out
    if int(attrs.get("batch_dims", 0)) != 0:
        return None
    parts = forms.components(node.input[1])
    depth = index[-1]
    if parts is None or len(parts) != depth or depth > len(data):
        return None
    strides = [math.prod(data[j + 1:depth]) for j in range(depth)]
    flat = Affine(sum(p.offset * s for p, s in zip(parts, strides, strict=True)),
                  tuple(sum(p.coefs[d] * s for p, s in zip(parts, strides, strict=True))
                        for d in range(len(index) - 1)))
    return out if _enumerates(flat, index[:-1], math.prod(data[:depth])) else None


def reshape_layout_gathers(model: onnx.ModelProto, shapes: Shapes,
                           known: dict[str, np.ndarray]) -> int:
    """Replace each Gather/GatherND that re-lays its data out in order by a Reshape (in
    place); return how many were replaced. The index grids left unread fall to dead-node
    removal."""
    forms = _Forms(model, shapes, known)
    weights: set[str] | None = None  # found at the first gather
    replaced = 0
    nodes = list(model.graph.node)
    for position, node in enumerate(nodes):
        if node.op_type not in ("Gather", "GatherND") or node.domain not in ("", "ai.onnx"):
            continue
        if weights is None:
            weights = {init.name for init in model.graph.initializer}
        if len(node.input) < 2 or node.input[0] in known or node.input[0] in weights:
            continue  # a table lookup (positions), not a layout
        target = _gather_target(node, forms)
        if target is None:
            continue
        shape_name = f"{node.output[0]}__layout"
        value = np.array(target, dtype=np.int64)
        model.graph.initializer.append(numpy_helper.from_array(value, shape_name))
        known[shape_name] = value
        reshape = onnx.helper.make_node("Reshape", [node.input[0], shape_name],
                                        list(node.output), name=node.name)
        nodes[position] = reshape
        replaced += 1
    if replaced:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return replaced
