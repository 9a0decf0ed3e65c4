"""FLOPs and bytes of one forward op, for the whole (unsharded) op.

Conventions (documented in docs/cost-model.md): a multiply-add is 2 FLOPs; elementwise
ops cost their per-element weight times the output size; data-movement ops cost no FLOPs
but move bytes; view ops (Reshape and friends) move nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo

#: Ops that only relabel a buffer: no FLOPs, no memory traffic.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})

#: Ops that move or select data without arithmetic.
DATA_MOVEMENT_OPS = frozenset(
    {"Transpose", "Gather", "GatherElements", "GatherND", "Concat", "Split", "Slice", "Expand",
     "Tile", "Cast", "CastLike", "Pad", "Where", "ScatterND", "ScatterElements", "OneHot",
     "ConstantOfShape", "Range", "Trilu", "DepthToSpace", "SpaceToDepth", "Resize", "TopK",
     "Shape", "Size", "Constant", "NonZero", "ArgMax", "ArgMin"}
)

#: FLOPs per output element of elementwise ops (transcendentals count as several).
ELEMENTWISE_FLOPS: dict[str, float] = {
    "Add": 1, "Sub": 1, "Mul": 1, "Div": 1, "Neg": 1, "Abs": 1, "Relu": 1, "LeakyRelu": 2,
    "Max": 1, "Min": 1, "Equal": 1, "Less": 1, "Greater": 1, "LessOrEqual": 1,
    "GreaterOrEqual": 1, "Not": 1, "And": 1, "Or": 1, "Xor": 1, "Sign": 1, "Floor": 1,
    "Ceil": 1, "Round": 1, "Clip": 2, "Mod": 2, "Reciprocal": 1, "Sqrt": 4, "Pow": 4,
    "Exp": 4, "Log": 4, "Tanh": 6, "Erf": 6, "Sigmoid": 5, "Softplus": 6, "Gelu": 10,
    "HardSigmoid": 3, "HardSwish": 4, "Selu": 5, "Elu": 5, "Celu": 5, "Mish": 12,
    "Sin": 4, "Cos": 4, "IsNaN": 1, "IsInf": 1, "BitShift": 1, "PRelu": 2, "Dropout": 2,
    "Sum": 1, "Mean": 1,
}

#: FLOPs per input element of normalisations and reductions.
PER_INPUT_ELEMENT_FLOPS: dict[str, float] = {
    "Softmax": 5, "LogSoftmax": 6, "LayerNormalization": 8, "BatchNormalization": 6,
    "InstanceNormalization": 8, "GroupNormalization": 8, "SimplifiedLayerNormalization": 6,
    "RMSNormalization": 6, "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1, "ReduceMin": 1,
    "ReduceProd": 1, "ReduceL2": 2, "ReduceL1": 2, "ReduceSumSquare": 2, "ReduceLogSumExp": 5,
    "GlobalAveragePool": 1, "GlobalMaxPool": 1, "CumSum": 1,
}


def cost_op(node: OpNode, tensors: Mapping[str, TensorInfo]) -> None:
    """Fill in `node.flops`, `bytes_read`, `bytes_written` and `is_view`."""
    inputs = [tensors[name] if name else None for name in node.inputs]
    outputs = [tensors[name] for name in node.outputs if name]
    node.is_view = node.op_type in VIEW_OPS
    node.flops = float(_flops(node, inputs, outputs))
    if node.is_view:
        node.bytes_read = node.bytes_written = 0.0
        return
    node.bytes_written = float(sum(t.nbytes for t in outputs))
    if node.op_type == "Gather" and inputs and inputs[0] is not None:
        # An embedding lookup reads the rows it returns, not the whole table.
        node.bytes_read = float(node.bytes_written + (inputs[1].nbytes if inputs[1] else 0))
    else:
        node.bytes_read = float(sum(t.nbytes for t in inputs if t is not None))


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _flops(node: OpNode, inputs: list[TensorInfo | None], outputs: list[TensorInfo]) -> float:
    op = node.op_type
    if not outputs or op in VIEW_OPS or op in DATA_MOVEMENT_OPS:
        return 0.0
    out = outputs[0]
    if op in ("MatMul", "MatMulInteger", "FusedMatMul"):
        assert inputs[0] is not None
        k = inputs[0].shape[-1] if inputs[0].shape else 1
        return 2.0 * out.numel * k
    if op == "Gemm":
        a = inputs[0]
        assert a is not None
        k = a.shape[0] if node.attrs.get("transA", 0) else a.shape[-1]
        bias = out.numel if len(inputs) > 2 and inputs[2] is not None else 0
        return 2.0 * out.numel * k + bias
    if op in ("Conv", "ConvTranspose"):
        return _conv_flops(node, inputs, out)
    if op == "Einsum":
        return _einsum_flops(node, inputs)
    if op in ("MaxPool", "AveragePool", "LpPool"):
        kernel = node.attrs.get("kernel_shape", [1])
        return float(out.numel * _numel(tuple(kernel)))
    if op in ELEMENTWISE_FLOPS:
        return ELEMENTWISE_FLOPS[op] * out.numel
    if op in PER_INPUT_ELEMENT_FLOPS:
        source = inputs[0]
        return PER_INPUT_ELEMENT_FLOPS[op] * (source.numel if source is not None else out.numel)
    return float(out.numel)  # unknown op: one FLOP per output element, a floor


def _conv_flops(node: OpNode, inputs: list[TensorInfo | None], out: TensorInfo) -> float:
    weight = inputs[1]
    assert weight is not None
    # Conv weight [C_out, C_in/group, *kernel]: each output element needs C_in/group * kernel MACs.
    macs_per_output = _numel(weight.shape[1:])
    if node.op_type == "ConvTranspose":
        source = inputs[0]
        assert source is not None
        return 2.0 * source.numel * _numel(weight.shape[1:])
    bias = out.numel if len(inputs) > 2 and inputs[2] is not None else 0
    return 2.0 * out.numel * macs_per_output + bias


def _einsum_flops(node: OpNode, inputs: list[TensorInfo | None]) -> float:
    equation = str(node.attrs.get("equation", "")).replace(" ", "")
    lhs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, tensor in zip(lhs, inputs, strict=False):
        if tensor is None or "..." in term:
            continue
        for label, size in zip(term, tensor.shape, strict=False):
            sizes[label] = max(sizes.get(label, 1), size)
    operands = max(len(lhs) - 1, 1)
    return 2.0 * operands * _numel(tuple(sizes.values()))
