"""What one device runs for one op under a strategy: a small ONNX program.

Most ops run unchanged on their local shards. Ops whose attributes or constant inputs
carry sizes, or whose split leaves a partial sum that must not count a term twice, are
rewritten here, once, for every consumer: the numpy simulator runs these programs with
ONNX's reference evaluator, and the torch executor runs the same programs. Collectives an
op needs inside itself (the statistics of a split training batch norm) appear as nodes of
the `shardplan` domain: `AllReduce(x) {axes}` sums x over the listed mesh axes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from planner.graph import OpNode, TensorInfo
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.rules import DimLabels
from planner.sharding.strategy import OpStrategy, input_layouts, output_layouts

SHARDPLAN_DOMAIN = "shardplan"


@dataclass
class LocalProgram:
    """Nodes to run in order on one device; `constants` feed extra inputs they name."""

    nodes: list[onnx.NodeProto]
    constants: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalContext:
    node: OpNode
    labels: DimLabels
    strategy: OpStrategy
    tensors: Mapping[str, TensorInfo]
    mesh: DeviceMesh
    coord: tuple[int, ...]  # this device's coordinate on the mesh

    def layouts(self) -> tuple[list[Layout | None], list[Layout | None]]:
        ranks_in = [len(self.tensors[t].shape) if t else -1 for t in self.node.inputs]
        ranks_out = [len(self.tensors[t].shape) if t else -1 for t in self.node.outputs]
        return (input_layouts(self.labels, self.strategy, ranks_in),
                output_layouts(self.labels, self.strategy, ranks_out))

    def local_shape(self, tensor: str, layout: Layout) -> tuple[int, ...]:
        return layout.local_shape(self.tensors[tensor].shape, self.mesh)

    def axis_index(self, axes: tuple[str, ...]) -> int:
        """This device's position within a group over `axes` (major axis first)."""
        index = 0
        for axis in axes:
            index = index * self.mesh.axis_size(axis) + self.coord[
                self.mesh.axis_names.index(axis)]
        return index

    def split_axes(self, label: str) -> tuple[str, ...]:
        return self.strategy.axes_of(label)

    def holds_partial_term(self) -> bool:
        """Of the devices sharing one partial sum, exactly one adds constant terms."""
        axes = [a for label in self.labels.sum_labels for a in self.strategy.axes_of(label)]
        return all(self.coord[self.mesh.axis_names.index(a)] == 0 for a in axes)


Rewrite = Callable[[LocalContext], LocalProgram]
LOCAL_REWRITES: dict[str, Rewrite] = {}


def rewrite(*op_types: str) -> Callable[[Rewrite], Rewrite]:
    def register(fn: Rewrite) -> Rewrite:
        for op_type in op_types:
            LOCAL_REWRITES[op_type] = fn
        return fn

    return register


def node_proto(node: OpNode) -> onnx.NodeProto:
    attrs = {k: v for k, v in node.attrs.items() if v is not None}
    return helper.make_node(node.op_type, list(node.inputs), list(node.outputs), name=node.name,
                            domain=node.domain or None, **attrs)


def local_program(node: OpNode, labels: DimLabels, strategy: OpStrategy,
                  tensors: Mapping[str, TensorInfo], mesh: DeviceMesh,
                  coord: tuple[int, ...]) -> LocalProgram:
    """The program device `coord` runs for `node` under `strategy`."""
    context = LocalContext(node, labels, strategy, tensors, mesh, coord)
    fn = LOCAL_REWRITES.get(node.op_type)
    if fn is None or not strategy.assignment:
        return LocalProgram([node_proto(node)])
    return fn(context)


def _name(context: LocalContext, suffix: str) -> str:
    return f"{context.node.name}/{suffix}"


@rewrite("Reshape", "Expand")
def _local_target_shape(context: LocalContext) -> LocalProgram:
    """The target shape input becomes the local output shape."""
    _, outputs = context.layouts()
    node = context.node
    layout = outputs[0]
    assert layout is not None
    shape_name = _name(context, "local_shape")
    local = np.array(context.local_shape(node.outputs[0], layout), dtype=np.int64)
    proto = node_proto(node)
    proto.input[1] = shape_name
    if node.op_type == "Reshape":
        del proto.attribute[:]  # the explicit local shape has no 0 or -1 entries
    return LocalProgram([proto], {shape_name: local})


@rewrite("Gather")
def _vocab_split_gather(context: LocalContext) -> LocalProgram:
    """A table split along the gathered axis: look up local rows, zero the others.

    The output is then a partial sum: exactly one device holds each row.
    """
    node = context.node
    table_labels = context.labels.inputs[0]
    assert table_labels is not None
    axis = int(node.attrs.get("axis", 0))
    axis = axis + len(table_labels) if axis < 0 else axis
    axes = context.split_axes(table_labels[axis])
    if not axes:
        return LocalProgram([node_proto(node)])
    inputs, _ = context.layouts()
    table = inputs[0]
    assert table is not None
    rows = context.local_shape(node.inputs[0], table)[axis]
    offset = context.axis_index(axes) * rows
    n = lambda s: _name(context, s)  # noqa: E731 - a short local namer
    indices = node.inputs[1]
    index_dtype = np.dtype(context.tensors[indices].dtype)
    constants = {
        n("offset"): np.array(offset, dtype=index_dtype),
        n("rows"): np.array(rows, dtype=index_dtype),
        n("zero"): np.array(0, dtype=index_dtype),
        n("zero_value"): np.array(0, dtype=np.dtype(context.tensors[node.outputs[0]].dtype)
                                  if context.tensors[node.outputs[0]].dtype != "bfloat16"
                                  else np.float32),
    }
    nodes = [
        helper.make_node("Sub", [indices, n("offset")], [n("shifted")]),
        helper.make_node("GreaterOrEqual", [n("shifted"), n("zero")], [n("above")]),
        helper.make_node("Less", [n("shifted"), n("rows")], [n("below")]),
        helper.make_node("And", [n("above"), n("below")], [n("mine")]),
        helper.make_node("Where", [n("mine"), n("shifted"), n("zero")], [n("safe")]),
        helper.make_node("Gather", [node.inputs[0], n("safe")], [n("rows_found")], axis=axis),
        helper.make_node("Unsqueeze", [n("mine"), n("mask_axes")], [n("mask")]),
        helper.make_node("Where", [n("mask"), n("rows_found"), n("zero_value")],
                         [node.outputs[0]]),
    ]
    # The mask covers the index dims; the table's trailing dims broadcast.
    trailing = len(table_labels) - axis - 1
    index_rank = len(context.tensors[indices].shape)
    constants[n("mask_axes")] = np.arange(axis + index_rank, axis + index_rank + trailing,
                                          dtype=np.int64)
    if trailing == 0:
        nodes[6] = helper.make_node("Identity", [n("mine")], [n("mask")])
    if axis > 0:
        # Leading table dims come first in the output: move the mask past them.
        lead = np.arange(axis, dtype=np.int64)
        constants[n("lead_axes")] = lead
        nodes.insert(7, helper.make_node("Unsqueeze", [n("mask"), n("lead_axes")],
                                          [n("mask_led")]))
        nodes[-1] = helper.make_node("Where", [n("mask_led"), n("rows_found"), n("zero_value")],
                                     [node.outputs[0]])
    return LocalProgram(nodes, constants)


@rewrite("Gemm", "Conv")
def _bias_once(context: LocalContext) -> LocalProgram:
    """With the contraction split, only one device of each partial group adds the bias."""
    node = context.node
    has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
    if not has_bias or context.holds_partial_term():
        return LocalProgram([node_proto(node)])
    proto = node_proto(node)
    del proto.input[2]
    return LocalProgram([proto])


@rewrite("ReduceMean")
def _mean_of_shards(context: LocalContext) -> LocalProgram:
    """Local means over split reduced dims are scaled so their sum is the global mean."""
    node = context.node
    degree = 1
    for label in context.labels.sum_labels:
        degree *= context.mesh.group_size(context.split_axes(label))
    if degree == 1:
        return LocalProgram([node_proto(node)])
    proto = node_proto(node)
    partial_name = _name(context, "local_mean")
    proto.output[0] = partial_name
    scale = _name(context, "scale")
    dtype = context.tensors[node.outputs[0]].dtype
    value = np.array(1.0 / degree, dtype=np.float32 if dtype == "bfloat16" else dtype)
    return LocalProgram([proto, helper.make_node("Mul", [partial_name, scale],
                                                 [node.outputs[0]])], {scale: value})


@rewrite("BatchNormalization")
def _synced_batch_norm(context: LocalContext) -> LocalProgram:
    """Training batch norm over a split batch: AllReduce the sums, then normalise."""
    node = context.node
    axes = tuple(a for label in context.labels.sync_labels for a in context.split_axes(label))
    if not axes:
        return LocalProgram([node_proto(node)])
    x, scale, bias, running_mean, running_var = node.inputs[:5]
    shape = context.tensors[x].shape
    reduce_axes = np.array([0, *range(2, len(shape))], dtype=np.int64)
    count = float(np.prod([shape[i] for i in reduce_axes]))
    eps = float(node.attrs.get("epsilon", 1e-5))
    momentum = float(node.attrs.get("momentum", 0.9))
    dtype = np.dtype(context.tensors[x].dtype)
    n = lambda s: _name(context, s)  # noqa: E731 - a short local namer
    stat_shape = np.array([1, shape[1], *([1] * (len(shape) - 2))], dtype=np.int64)
    constants = {
        n("axes"): reduce_axes, n("count"): np.array(count, dtype=dtype),
        n("eps"): np.array(eps, dtype=dtype), n("stat_shape"): stat_shape,
        n("momentum"): np.array(momentum, dtype=dtype),
        n("one_minus_momentum"): np.array(1.0 - momentum, dtype=dtype),
    }
    collective = {"axes": list(axes)}
    nodes = [
        helper.make_node("ReduceSum", [x, n("axes")], [n("sum_local")], keepdims=0),
        helper.make_node("Mul", [x, x], [n("square")]),
        helper.make_node("ReduceSum", [n("square"), n("axes")], [n("sumsq_local")], keepdims=0),
        helper.make_node("AllReduce", [n("sum_local")], [n("sum")], domain=SHARDPLAN_DOMAIN,
                         **collective),
        helper.make_node("AllReduce", [n("sumsq_local")], [n("sumsq")],
                         domain=SHARDPLAN_DOMAIN, **collective),
        helper.make_node("Div", [n("sum"), n("count")], [n("mean")]),
        helper.make_node("Div", [n("sumsq"), n("count")], [n("mean_sq")]),
        helper.make_node("Mul", [n("mean"), n("mean")], [n("mean_2")]),
        helper.make_node("Sub", [n("mean_sq"), n("mean_2")], [n("var")]),
        helper.make_node("Add", [n("var"), n("eps")], [n("var_eps")]),
        helper.make_node("Sqrt", [n("var_eps")], [n("std")]),
        helper.make_node("Div", [scale, n("std")], [n("gain")]),
        helper.make_node("Mul", [n("mean"), n("gain")], [n("shift_part")]),
        helper.make_node("Sub", [bias, n("shift_part")], [n("shift")]),
        helper.make_node("Reshape", [n("gain"), n("stat_shape")], [n("gain_b")]),
        helper.make_node("Reshape", [n("shift"), n("stat_shape")], [n("shift_b")]),
        helper.make_node("Mul", [x, n("gain_b")], [n("scaled")]),
        helper.make_node("Add", [n("scaled"), n("shift_b")], [node.outputs[0]]),
    ]
    updates = {1: ("mean", running_mean), 2: ("var", running_var)}
    for index, (stat, running) in updates.items():
        if index < len(node.outputs) and node.outputs[index]:
            nodes += [
                helper.make_node("Mul", [running, n("momentum")], [n(f"{stat}_kept")]),
                helper.make_node("Mul", [n(stat), n("one_minus_momentum")], [n(f"{stat}_new")]),
                helper.make_node("Add", [n(f"{stat}_kept"), n(f"{stat}_new")],
                                 [node.outputs[index]]),
            ]
    return LocalProgram(nodes, constants)


def constant_proto(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)
