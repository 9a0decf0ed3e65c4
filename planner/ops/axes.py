"""Labellings of ops that couple entries along axes their attributes or inputs name:
softmax, normalisations, reductions, CumSum, TopK, Trilu, pools."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import (
    DimLabels,
    Labels,
    NoRule,
    attr_axis,
    const_ints,
    shape_of,
)

#: Reductions whose shard results sum to the whole result (float ReduceMean once scaled).
REDUCTIONS_SUM = ("ReduceSum", "ReduceMean")
#: Reductions whose reduced axes must stay whole.
REDUCTIONS_OTHER = ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                    "ReduceSumSquare", "ReduceLogSumExp", "ArgMax", "ArgMin")


def softmax(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    axis = attr_axis(node, "axis", rank, -1)  # opset >= 13: one axis, default the last
    labels = tuple(f"d{i}" for i in range(rank))
    return DimLabels((labels,), (labels,), whole_labels=frozenset({labels[axis]}))


def layer_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = shape_of(tensors, node.inputs[0])
    rank = len(shape)
    axis = attr_axis(node, "axis", rank, -1)
    labels = tuple(f"d{i}" for i in range(rank))
    normalised = labels[axis:]
    inputs: list[Labels | None] = [labels]
    for name in node.inputs[1:]:
        inputs.append(normalised[len(normalised) - len(shape_of(tensors, name)):]
                      if name else None)
    stats = labels[:axis] + tuple(f"w{i}" for i in range(axis, rank))
    outputs = [labels] + [stats if name else None for name in node.outputs[1:]]
    return DimLabels(tuple(inputs), tuple(outputs),
                     whole_labels=frozenset(normalised) | frozenset(stats[axis:]))


def batch_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = shape_of(tensors, node.inputs[0])
    labels = tuple(f"d{i}" for i in range(len(shape)))
    channel = labels[1:2]
    inputs = (labels, *[channel if name else None for name in node.inputs[1:]])
    outputs = [labels] + [channel if name else None for name in node.outputs[1:]]
    training = bool(node.attrs.get("training_mode", 0))
    stats = frozenset(labels[:1] + labels[2:])
    return DimLabels(inputs, tuple(outputs), sync_labels=stats if training else frozenset())


def instance_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = shape_of(tensors, node.inputs[0])
    labels = tuple(f"d{i}" for i in range(len(shape)))
    inputs = (labels, *[None for _ in node.inputs[1:]])
    return DimLabels(inputs, (labels,), whole_labels=frozenset(labels[1:]))


def reduce(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = shape_of(tensors, node.inputs[0])
    rank = len(shape)
    axes = _reduce_axes(node, tensors, rank)
    keep = bool(node.attrs.get("keepdims", 1))
    labels = tuple(f"d{i}" for i in range(rank))
    out = tuple(f"w{i}" if i in axes else labels[i] for i in range(rank) if keep or i not in axes)
    reduced = frozenset(labels[i] for i in axes)
    kept_ones = frozenset(label for label in out if label.startswith("w"))
    # An integer mean truncates: shard means cannot be summed into it, so the axes stay whole.
    exact = node.op_type == "ReduceSum" or tensors[node.inputs[0]].is_float
    if node.op_type in REDUCTIONS_SUM and exact:
        return DimLabels((labels, *[None] * (len(node.inputs) - 1)), (out,),
                         sum_labels=reduced, whole_labels=kept_ones)
    return DimLabels((labels, *[None] * (len(node.inputs) - 1)), (out,),
                     whole_labels=reduced | kept_ones)


def _reduce_axes(node: OpNode, tensors: Mapping[str, TensorInfo], rank: int) -> set[int]:
    axes = node.attrs.get("axes")
    if axes is None and node.op_type in ("ArgMax", "ArgMin"):
        axes = [node.attrs.get("axis", 0)]
    if axes is None and len(node.inputs) > 1:
        axes = const_ints(tensors, node.inputs[1])
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return set()
        return set(range(rank))
    return {int(a) + rank if int(a) < 0 else int(a) for a in axes}


def _coupled_axes(node: OpNode, tensors: Mapping[str, TensorInfo],
                  axes: Sequence[int]) -> DimLabels:
    """Output shaped like input 0; work couples entries along `axes`, which stay whole."""
    labels = tuple(f"d{i}" for i in range(len(shape_of(tensors, node.inputs[0]))))
    extra = [None] * (len(node.inputs) - 1)
    return DimLabels((labels, *extra), (labels,),
                     whole_labels=frozenset(labels[a] for a in axes))


def recurrent(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """ONNX's RNN, GRU and LSTM: the batch splits (each row runs its own recurrence), and
    nothing else does: the steps are a scan, the hidden units feed every gate of the next
    step, the weights are read whole. Inputs X, W, R, B, sequence_lens, initial_h,
    initial_c, P; outputs Y, Y_h, Y_c. `layout` 0: X [steps, batch, input], Y [steps,
    directions, batch, hidden], the states [directions, batch, hidden]; 1: X [batch, steps,
    input], Y [batch, steps, directions, hidden], the states [batch, directions, hidden]."""
    batch_first = bool(node.attrs.get("layout", 0))
    batch = "d0"
    steps, features, directions, hidden = "w0", "w1", "w2", "w3"
    source = (batch, steps, features) if batch_first else (steps, batch, features)
    state = (batch, directions, hidden) if batch_first else (directions, batch, hidden)
    output = (batch, steps, directions, hidden) if batch_first else \
        (steps, directions, batch, hidden)
    whole = {steps, features, directions, hidden}

    def weights(name: str, slot: int) -> Labels | None:
        if not name:
            return None
        labels = tuple(f"w{4 + slot}_{i}" for i in range(len(shape_of(tensors, name))))
        whole.update(labels)
        return labels

    shapes = {0: source, 4: (batch,), 5: state, 6: state}
    inputs = tuple(None if not name else shapes[slot] if slot in shapes else
                   weights(name, slot) for slot, name in enumerate(node.inputs))
    outputs = tuple(None if not name else output if slot == 0 else state
                    for slot, name in enumerate(node.outputs))
    for name, labels in zip((*node.inputs, *node.outputs), (*inputs, *outputs),
                            strict=True):
        if name and labels is not None and len(labels) != len(shape_of(tensors, name)):
            raise NoRule(f"{node.op_type} {node.name}: {name} is not shaped as its layout "
                         "says")
    return DimLabels(inputs, outputs, whole_labels=frozenset(whole))


def pad(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Pad: a dim padded at either end stays whole (its edge is the whole tensor's); every
    other dim splits, output and input alike, whatever the mode. Inputs: data, pads
    (constant), constant_value, axes (opset 18: the dims `pads` names)."""
    rank = len(shape_of(tensors, node.inputs[0]))
    pads = const_ints(tensors, node.inputs[1]) if len(node.inputs) > 1 else None
    if pads is None:
        raise NoRule(f"Pad {node.name}: its pads are computed at run time")
    named = const_ints(tensors, node.inputs[3]) if len(node.inputs) > 3 and \
        node.inputs[3] else list(range(rank))
    if named is None or len(pads) != 2 * len(named):
        raise NoRule(f"Pad {node.name}: its pads or axes are not known")
    padded = {(axis + rank if axis < 0 else axis) for k, axis in enumerate(named)
              if pads[k] or pads[k + len(named)]}
    labels = tuple(f"w{i}" if i in padded else f"d{i}" for i in range(rank))
    extra = [None] * (len(node.inputs) - 1)
    return DimLabels((labels, *extra), (labels,),
                     whole_labels=frozenset(labels[i] for i in padded))


def trilu(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    return _coupled_axes(node, tensors, (-2, -1))


def cumsum(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    found = const_ints(tensors, node.inputs[1])
    if not found:
        raise NoRule  # the axis is computed at run time
    axis = found[0]
    return _coupled_axes(node, tensors, (axis + rank if axis < 0 else axis,))


def topk(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(shape_of(tensors, node.inputs[0]))
    axis = attr_axis(node, "axis", rank, -1)
    labels = tuple(f"d{i}" for i in range(rank))
    out = tuple("k_out" if i == axis else labels[i] for i in range(rank))
    outputs = tuple(out if name else None for name in node.outputs)
    return DimLabels((labels, None), outputs, whole_labels=frozenset({labels[axis], "k_out"}))


def pool(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Batch and channels split freely; the window's spatial dims stay whole."""
    source = shape_of(tensors, node.inputs[0])
    spatial = len(source) - 2
    x = ("n", "c", *[f"x{i}" for i in range(spatial)])
    y = ("n", "c", *[f"y{i}" for i in range(spatial)])
    outputs = tuple(y if name else None for name in node.outputs)
    whole = {f"x{i}" for i in range(spatial)} | {f"y{i}" for i in range(spatial)}
    return DimLabels((x,), outputs, whole_labels=frozenset(whole))
