"""What one forward op costs, whole (unsharded): its FLOP/byte work class.

Conventions (documented in docs/cost-model.md): a multiply-add is 2 FLOPs; elementwise
ops cost their per-element weight times the output size; data-movement ops cost no FLOPs
but move bytes; view ops (Reshape and friends) move nothing. An op of unknown work costs
one FLOP per output element, a floor.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.graph import OpNode, TensorInfo


class WorkKind(enum.Enum):
    VIEW = "view"  # relabels a buffer: no FLOPs, no memory traffic
    DATA_MOVEMENT = "data movement"  # moves or selects data: bytes, no FLOPs
    LOOKUP = "lookup"  # data movement that reads only the rows it returns (an embedding)
    PER_OUTPUT = "per output element"  # `flops` per output element (elementwise ops)
    PER_INPUT = "per input element"  # `flops` per element of input 0 (norms, reductions)
    MATMUL = "matmul"  # 2 * output elements * k (k: input 0's last dim)
    GEMM = "gemm"  # matmul with transA, plus the bias
    CONV = "conv"  # 2 * output elements * (C_in/group * kernel), plus the bias
    CONV_TRANSPOSE = "conv transpose"  # 2 * input elements * (C_out/group * kernel)
    EINSUM = "einsum"  # 2 * (operands - 1) * product of every letter's size
    POOL = "pool"  # output elements * kernel elements
    ATTENTION = "attention"  # both GEMMs of softmax(q kᵀ) v: 2 * S_kv * (q + output elements)
    RECURRENT = "recurrent"  # RNN, GRU, LSTM: each step's two GEMMs and its gates' elementwise
    FLOOR = "floor"  # unknown: one FLOP per output element


@dataclass(frozen=True)
class Work:
    """An op's work class; `flops` is the per-element weight of PER_OUTPUT and PER_INPUT."""

    kind: WorkKind
    flops: float = 0


VIEW = Work(WorkKind.VIEW)
DATA_MOVEMENT = Work(WorkKind.DATA_MOVEMENT)
LOOKUP = Work(WorkKind.LOOKUP)
MATMUL = Work(WorkKind.MATMUL)
GEMM = Work(WorkKind.GEMM)
CONV = Work(WorkKind.CONV)
CONV_TRANSPOSE = Work(WorkKind.CONV_TRANSPOSE)
EINSUM = Work(WorkKind.EINSUM)
POOL = Work(WorkKind.POOL)
ATTENTION = Work(WorkKind.ATTENTION)
RECURRENT = Work(WorkKind.RECURRENT)
FLOOR = Work(WorkKind.FLOOR)


def per_output(flops: float) -> Work:
    """Elementwise: `flops` per output element (transcendentals count as several)."""
    return Work(WorkKind.PER_OUTPUT, flops)


def per_input(flops: float) -> Work:
    """Normalisations and reductions: `flops` per element of input 0."""
    return Work(WorkKind.PER_INPUT, flops)


def count(work: Work, node: OpNode, tensors: Mapping[str, TensorInfo]) -> None:
    """Fill in `node.flops`, `bytes_read`, `bytes_written` and `is_view` for `work`."""
    inputs = [tensors[name] if name else None for name in node.inputs]
    outputs = [tensors[name] for name in node.outputs if name]
    node.is_view = work.kind is WorkKind.VIEW
    node.flops = float(_flops(work, node, inputs, outputs))
    if node.is_view:
        node.bytes_read = node.bytes_written = 0.0
        return
    node.bytes_written = float(sum(t.nbytes for t in outputs))
    if work.kind is WorkKind.LOOKUP and inputs and inputs[0] is not None:
        # An embedding lookup reads the rows it returns, not the whole table.
        node.bytes_read = float(node.bytes_written + (inputs[1].nbytes if inputs[1] else 0))
    else:
        node.bytes_read = float(sum(t.nbytes for t in inputs if t is not None))


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _flops(work: Work, node: OpNode, inputs: list[TensorInfo | None],
           outputs: list[TensorInfo]) -> float:
    kind = work.kind
    if not outputs or kind in (WorkKind.VIEW, WorkKind.DATA_MOVEMENT, WorkKind.LOOKUP):
        return 0.0
    out = outputs[0]
    if kind is WorkKind.MATMUL:
        assert inputs[0] is not None
        k = inputs[0].shape[-1] if inputs[0].shape else 1
        return 2.0 * out.numel * k
    if kind is WorkKind.GEMM:
        a = inputs[0]
        assert a is not None
        k = a.shape[0] if node.attrs.get("transA", 0) else a.shape[-1]
        bias = out.numel if len(inputs) > 2 and inputs[2] is not None else 0
        return 2.0 * out.numel * k + bias
    if kind in (WorkKind.CONV, WorkKind.CONV_TRANSPOSE):
        return _conv_flops(kind, inputs, out)
    if kind is WorkKind.EINSUM:
        return _einsum_flops(node, inputs)
    if kind is WorkKind.ATTENTION:
        return _attention_flops(inputs, out)
    if kind is WorkKind.RECURRENT:
        return _recurrent_flops(inputs, out)
    if kind is WorkKind.POOL:
        kernel = node.attrs.get("kernel_shape", [1])
        return float(out.numel * _numel(tuple(kernel)))
    if kind is WorkKind.PER_OUTPUT:
        return work.flops * out.numel
    if kind is WorkKind.PER_INPUT:
        source = inputs[0]
        return work.flops * (source.numel if source is not None else out.numel)
    return float(out.numel)  # unknown work: one FLOP per output element, a floor


def _conv_flops(kind: WorkKind, inputs: list[TensorInfo | None], out: TensorInfo) -> float:
    weight = inputs[1]
    assert weight is not None
    # Conv weight [C_out, C_in/group, *kernel]: each output element needs C_in/group * kernel MACs.
    macs_per_output = _numel(weight.shape[1:])
    if kind is WorkKind.CONV_TRANSPOSE:
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


def _attention_flops(inputs: list[TensorInfo | None], out: TensorInfo) -> float:
    """Opset 23 Attention: q kᵀ is 2 * q elements * S_kv FLOPs, the weighted sum of v
    2 * output elements * S_kv, for 4-D [B, heads, S, d] and 3-D [B, S, heads * d] forms."""
    query, key = inputs[0], inputs[1] if len(inputs) > 1 else None
    if query is None or key is None or len(key.shape) < 3:
        return float(out.numel)
    kv_length = key.shape[-2] if len(key.shape) == 4 else key.shape[1]
    return 2.0 * kv_length * (query.numel + out.numel)


#: FLOPs per gate element of one step: the gates' activations and the state's update
#: (sigmoid and tanh counted as 4 each, as `per_output` counts transcendentals)
_GATE_FLOPS = 10


def _recurrent_flops(inputs: list[TensorInfo | None], out: TensorInfo) -> float:
    """ONNX's RNN, GRU and LSTM: every (step, row) multiplies its input by W
    [directions, gates · hidden, input] and the previous state by R [directions, gates ·
    hidden, hidden], then runs its gates' elementwise work."""
    source, weight = inputs[0], inputs[1] if len(inputs) > 1 else None
    recurrence = inputs[2] if len(inputs) > 2 else None
    if source is None or weight is None or recurrence is None or not source.shape:
        return float(out.numel)
    rows = source.numel / max(source.shape[-1], 1)  # steps × batch
    gates = weight.numel / max(weight.shape[-1], 1)  # directions × gates × hidden
    return rows * (2.0 * (weight.numel + recurrence.numel) + _GATE_FLOPS * gates)


def gemm_dims(node: OpNode, tensors: Mapping[str, TensorInfo]) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a MatMul, Gemm or FusedMatMul from its input shapes.

    The cost model prices a GEMM by its tiles (costmodels.gemm), so it needs the problem's
    shape, not only its FLOPs. MatMul and FusedMatMul broadcast leading dims into `batch`
    (a 1-D operand is a vector: m or n is 1); Gemm is 2-D with transA/transB. None for
    other ops and for unknown or empty shapes.
    """
    if node.op_type not in ("MatMul", "Gemm", "FusedMatMul") or len(node.inputs) < 2:
        return None
    a, b = (tensors.get(name) if name else None for name in node.inputs[:2])
    if a is None or b is None or not a.shape or not b.shape:
        return None
    if node.op_type == "Gemm":
        if len(a.shape) != 2 or len(b.shape) != 2:
            return None
        m, k = a.shape[::-1] if node.attrs.get("transA", 0) else a.shape
        k_b, n = b.shape[::-1] if node.attrs.get("transB", 0) else b.shape
        dims = (1, m, n, k)
    else:
        a_shape, b_shape = _fused_transposed(node, a.shape, b.shape)
        m, k = (1, a_shape[0]) if len(a_shape) == 1 else a_shape[-2:]
        k_b, n = (b_shape[0], 1) if len(b_shape) == 1 else b_shape[-2:]
        lead_a, lead_b = a_shape[:-2], b_shape[:-2]
        width = max(len(lead_a), len(lead_b))
        pad_a = (1,) * (width - len(lead_a)) + lead_a
        pad_b = (1,) * (width - len(lead_b)) + lead_b
        batch = math.prod(max(x, y) for x, y in zip(pad_a, pad_b, strict=True))
        dims = (batch, m, n, k)
    if k != k_b or min(dims) < 1:
        return None
    return dims


def _fused_transposed(node: OpNode, a: tuple[int, ...],
                      b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FusedMatMul's transA/transB swap the last two dims of an operand (com.microsoft)."""
    def swap(shape: tuple[int, ...], flag: str) -> tuple[int, ...]:
        if node.op_type != "FusedMatMul" or not node.attrs.get(flag, 0) or len(shape) < 2:
            return shape
        return (*shape[:-2], shape[-1], shape[-2])
    return swap(a, "transA"), swap(b, "transB")
