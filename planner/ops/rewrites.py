"""The local rewrites: what one device runs for ops that cannot run unchanged on shards.

Each function receives a `LocalContext` of an op whose strategy splits something and
returns the device's `LocalProgram`. Every device runs a program of the same shape (a bias
is scaled by zero, not dropped), so autograd walks the same graph everywhere and
collectives stay in step.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from planner.ops.program import (
    SHARDPLAN_DOMAIN,
    LocalContext,
    LocalProgram,
    LocalRewrite,
    node_proto,
)


def _name(context: LocalContext, suffix: str) -> str:
    return f"{context.node.name}/{suffix}"


def _local_target_shape(context: LocalContext) -> LocalProgram:
    """The target shape input becomes the local output shape."""
    node = context.node
    shape_name = _name(context, "local_shape")
    local = np.array(context.local_output_shape(0), dtype=np.int64)
    proto = node_proto(node)
    proto.input[1] = shape_name
    if node.op_type == "Reshape":
        del proto.attribute[:]  # the explicit local shape has no 0 or -1 entries
    return LocalProgram([proto], {shape_name: local})


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
    rows = context.local_input_shape(0)[axis]
    offset = context.axis_index(axes) * rows
    n = lambda s: _name(context, s)  # noqa: E731 - a short local namer
    indices = node.inputs[1]
    index_dtype = np.dtype(context.tensors[indices].dtype)
    constants = {
        n("size"): np.array(context.tensors[node.inputs[0]].shape[axis], dtype=index_dtype),
        n("offset"): np.array(offset, dtype=index_dtype),
        n("rows"): np.array(rows, dtype=index_dtype),
        n("zero"): np.array(0, dtype=index_dtype),
        n("zero_value"): np.array(0, dtype=np.dtype(context.tensors[node.outputs[0]].dtype)
                                  if context.tensors[node.outputs[0]].dtype != "bfloat16"
                                  else np.float32),
    }
    nodes = [
        # Negative indices count from the end of the whole axis: wrap them before shifting.
        helper.make_node("Less", [indices, n("zero")], [n("negative")]),
        helper.make_node("Add", [indices, n("size")], [n("wrapped")]),
        helper.make_node("Where", [n("negative"), n("wrapped"), indices], [n("global")]),
        helper.make_node("Sub", [n("global"), n("offset")], [n("shifted")]),
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
    # Leading table dims need no unsqueeze: Where broadcasts from the right. (Was axis-shifted.)
    constants[n("mask_axes")] = np.arange(index_rank, index_rank + trailing, dtype=np.int64)
    if trailing == 0:
        nodes[-2] = helper.make_node("Identity", [n("mine")], [n("mask")])
    return LocalProgram(nodes, constants)


def _bias_once(context: LocalContext) -> LocalProgram:
    """With the contraction split, only one device of each partial group adds the bias.

    The others scale it by zero rather than drop it, so every device runs the same program
    (autograd then walks the same graph everywhere, and collectives stay in step).
    """
    node = context.node
    has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
    if not has_bias or not any(context.split_axes(label) for label in context.labels.sum_labels):
        return LocalProgram([node_proto(node)])
    keep = _name(context, "bias_share")
    scaled = _name(context, "bias_local")
    dtype = context.tensors[node.inputs[2]].dtype
    share = np.array(1.0 if context.holds_partial_term() else 0.0,
                     dtype=np.float32 if dtype == "bfloat16" else dtype)
    proto = node_proto(node)
    proto.input[2] = scaled
    return LocalProgram([helper.make_node("Mul", [node.inputs[2], keep], [scaled]), proto],
                        {keep: share})


def _mean_of_shards(context: LocalContext) -> LocalProgram:
    """Local means over split reduced dims are scaled so their sum is the global mean."""
    node = context.node
    degree = 1
    for label in context.labels.sum_labels:
        degree *= context.group_size(context.split_axes(label))
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
    # Two passes (mean, then squared deviations) in float32 for 16-bit inputs: the one-pass
    # E[x²] - E[x]² in the input type cancelled catastrophically (fp16, mean 20: error 300).
    dtype_name = context.tensors[x].dtype
    wide = dtype_name in ("float16", "bfloat16")
    dtype = np.dtype(np.float32 if wide else dtype_name)
    n = lambda s: _name(context, s)  # noqa: E731 - a short local namer
    channels = context.local_input_shape(0)[1]  # the channel dim may be split too
    stat_shape = np.array([1, channels, *([1] * (len(shape) - 2))], dtype=np.int64)
    constants = {
        n("axes"): reduce_axes, n("count"): np.array(count, dtype=dtype),
        n("eps"): np.array(eps, dtype=dtype), n("stat_shape"): stat_shape,
        n("flat_shape"): np.array([channels], dtype=np.int64),
        n("momentum"): np.array(momentum, dtype=dtype),
        n("one_minus_momentum"): np.array(1.0 - momentum, dtype=dtype),
    }
    to_wide = onnx.TensorProto.FLOAT
    to_narrow = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype_name)) if wide else 0
    nodes: list[onnx.NodeProto] = []

    def widened(name: str) -> str:
        if not wide:
            return name
        nodes.append(helper.make_node("Cast", [name], [n(f"{name}_wide")], to=to_wide))
        return n(f"{name}_wide")

    def narrowed(value: str, output: str) -> None:
        if wide:
            nodes.append(helper.make_node("Cast", [value], [output], to=to_narrow))
        else:
            nodes.append(helper.make_node("Identity", [value], [output]))

    xs, scale_s, bias_s = widened(x), widened(scale), widened(bias)
    nodes += [
        helper.make_node("ReduceSum", [xs, n("axes")], [n("sum_local")], keepdims=1),
        helper.make_node("AllReduce", [n("sum_local")], [n("sum")], domain=SHARDPLAN_DOMAIN,
                         axes=list(axes)),
        helper.make_node("Div", [n("sum"), n("count")], [n("mean_b")]),
        helper.make_node("Sub", [xs, n("mean_b")], [n("centered")]),
        helper.make_node("Mul", [n("centered"), n("centered")], [n("square")]),
        helper.make_node("ReduceSum", [n("square"), n("axes")], [n("sumsq_local")], keepdims=1),
        helper.make_node("AllReduce", [n("sumsq_local")], [n("sumsq")],
                         domain=SHARDPLAN_DOMAIN, axes=list(axes)),
        helper.make_node("Div", [n("sumsq"), n("count")], [n("var_b")]),
        helper.make_node("Add", [n("var_b"), n("eps")], [n("var_eps")]),
        helper.make_node("Sqrt", [n("var_eps")], [n("std")]),
        helper.make_node("Reshape", [scale_s, n("stat_shape")], [n("scale_b")]),
        helper.make_node("Reshape", [bias_s, n("stat_shape")], [n("bias_b")]),
        helper.make_node("Div", [n("centered"), n("std")], [n("normed")]),
        helper.make_node("Mul", [n("normed"), n("scale_b")], [n("scaled")]),
        helper.make_node("Add", [n("scaled"), n("bias_b")], [n("y_wide")]),
        helper.make_node("Reshape", [n("mean_b"), n("flat_shape")], [n("mean")]),
        helper.make_node("Reshape", [n("var_b"), n("flat_shape")], [n("var")]),
    ]
    narrowed(n("y_wide"), node.outputs[0])
    updates = {1: ("mean", running_mean), 2: ("var", running_var)}
    for index, (stat, running) in updates.items():
        if index < len(node.outputs) and node.outputs[index]:
            nodes += [
                helper.make_node("Mul", [widened(running), n("momentum")], [n(f"{stat}_kept")]),
                helper.make_node("Mul", [n(stat), n("one_minus_momentum")], [n(f"{stat}_new")]),
                helper.make_node("Add", [n(f"{stat}_kept"), n(f"{stat}_new")],
                                 [n(f"{stat}_running")]),
            ]
            narrowed(n(f"{stat}_running"), node.outputs[index])
    return LocalProgram(nodes, constants)


def _global_pool_indices(context: LocalContext) -> LocalProgram:
    """MaxPool's Indices flatten (n, c, spatial) of the whole input: offset local ones.

    A split batch or channel dim shifts every flat index; the spatial part (last H·W
    block, in either storage order) is unchanged. Without this, split indices were local.
    """
    node = context.node
    if len(node.outputs) < 2 or not node.outputs[1]:
        return LocalProgram([node_proto(node)])
    shape = context.tensors[node.inputs[0]].shape
    local = context.local_input_shape(0)
    x_labels = context.labels.inputs[0]
    assert x_labels is not None
    n_axes, c_axes = context.split_axes(x_labels[0]), context.split_axes(x_labels[1])
    n = lambda s: _name(context, s)  # noqa: E731 - a short local namer
    index = np.int64
    constants = {
        n("spatial_size"): np.array(int(np.prod(shape[2:], dtype=np.int64)), dtype=index),
        n("local_channels"): np.array(local[1], dtype=index),
        n("channels"): np.array(shape[1], dtype=index),
        n("batch_offset"): np.array(context.axis_index(n_axes) * local[0], dtype=index),
        n("channel_offset"): np.array(context.axis_index(c_axes) * local[1], dtype=index),
    }
    proto = node_proto(node)
    proto.output[1] = n("local_indices")
    nodes = [
        proto,
        helper.make_node("Mod", [n("local_indices"), n("spatial_size")], [n("spatial")]),
        helper.make_node("Div", [n("local_indices"), n("spatial_size")], [n("plane")]),
        helper.make_node("Div", [n("plane"), n("local_channels")], [n("local_n")]),
        helper.make_node("Mod", [n("plane"), n("local_channels")], [n("local_c")]),
        helper.make_node("Add", [n("local_n"), n("batch_offset")], [n("global_n")]),
        helper.make_node("Add", [n("local_c"), n("channel_offset")], [n("global_c")]),
        helper.make_node("Mul", [n("global_n"), n("channels")], [n("n_planes")]),
        helper.make_node("Add", [n("n_planes"), n("global_c")], [n("global_plane")]),
        helper.make_node("Mul", [n("global_plane"), n("spatial_size")], [n("plane_start")]),
        helper.make_node("Add", [n("plane_start"), n("spatial")], [node.outputs[1]]),
    ]
    return LocalProgram(nodes, constants)


RESHAPE_TARGET = LocalRewrite(_local_target_shape, frozenset({"Reshape"}))
EXPAND_TARGET = LocalRewrite(_local_target_shape, frozenset({"Expand"}))
VOCAB_SPLIT_GATHER = LocalRewrite(_vocab_split_gather, frozenset(
    {"Less", "Add", "Where", "Sub", "GreaterOrEqual", "And", "Gather", "Unsqueeze",
     "Identity"}))
GEMM_BIAS_ONCE = LocalRewrite(_bias_once, frozenset({"Mul", "Gemm"}))
CONV_BIAS_ONCE = LocalRewrite(_bias_once, frozenset({"Mul", "Conv"}))
MEAN_OF_SHARDS = LocalRewrite(_mean_of_shards, frozenset({"ReduceMean", "Mul"}))
SYNCED_BATCH_NORM = LocalRewrite(_synced_batch_norm, frozenset(
    {"BatchNormalization", "Cast", "ReduceSum", f"{SHARDPLAN_DOMAIN}::AllReduce", "Div", "Sub",
     "Mul", "Add", "Sqrt", "Reshape", "Identity"}))
GLOBAL_POOL_INDICES = LocalRewrite(_global_pool_indices, frozenset(
    {"MaxPool", "Mod", "Div", "Add", "Mul"}))
