"""ONNX op semantics (opset 13+) as differentiable torch functions.

The executor runs the same local ONNX programs the numpy simulator checks, so every op
here follows the ONNX spec, not torch's conventions (negative indices, clamped slices,
asymmetric pads, ...), and builds on autograd-aware torch ops so training works.

Each entry of `TORCH_OPS` takes `(inputs, attrs)`: inputs in node order, `None` for an
omitted optional input (trailing omitted inputs may be absent), and attrs decoded by the
interpreter (strings as `str`, tensors as `torch.Tensor`). The interpreter adds
`attrs["_outputs"]`, the node's output count, which Split needs. Ops return their
outputs in order; extra trailing outputs the node does not name are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from executor.dropout import keep_mask
from planner.errors import ShardplanError

Tensor = torch.Tensor
Inputs = list[Tensor | None]
Attrs = dict[str, Any]
Op = Callable[[Inputs, Attrs], list[Tensor]]

#: ONNX TensorProto data type codes -> torch dtypes (float8/int4/string have no torch twin).
ONNX_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 4: torch.uint16, 5: torch.int16,
    6: torch.int32, 7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64,
    12: torch.uint32, 13: torch.uint64, 14: torch.complex64, 15: torch.complex128,
    16: torch.bfloat16,
}

TORCH_OPS: dict[str, Op] = {}


def op(*names: str) -> Callable[[Op], Op]:
    """Register one function under one or more ONNX op types."""
    def register(fn: Op) -> Op:
        for name in names:
            TORCH_OPS[name] = fn
        return fn
    return register


def torch_dtype(code: int) -> torch.dtype:
    """Torch dtype for an ONNX dtype code; unsupported codes are a user-facing error."""
    if code not in ONNX_DTYPES:
        raise ShardplanError(f"ONNX data type {code} has no torch equivalent in the executor")
    return ONNX_DTYPES[code]


def _opt(inputs: Inputs, i: int) -> Tensor | None:
    return inputs[i] if i < len(inputs) else None


def _ints(t: Tensor | None) -> list[int] | None:
    """Shape/axes inputs arrive as tensors; they are data, never differentiated."""
    return None if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# ------------------------------------------------------------------ elementwise


def _unary(fn: Callable[[Tensor], Tensor]) -> Op:
    def run(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
        assert inputs[0] is not None
        return [fn(inputs[0])]
    return run


_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Neg": torch.neg, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Exp": torch.exp,
    "Log": torch.log, "Tanh": torch.tanh, "Erf": torch.erf, "Sigmoid": torch.sigmoid,
    "Relu": torch.relu, "Cos": torch.cos, "Sin": torch.sin, "Abs": torch.abs,
    "Floor": torch.floor, "Ceil": torch.ceil, "Not": torch.logical_not, "IsNaN": torch.isnan,
    "Sign": torch.sign, "Identity": lambda x: x, "Softplus": F.softplus,
    "HardSwish": F.hardswish, "Mish": F.mish,
    "Round": torch.round,  # halves to even, as ONNX
}
for _name, _unary_fn in _UNARY.items():
    TORCH_OPS[_name] = _unary(_unary_fn)


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> Op:
    def run(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [fn(a, b)]
    return run


_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Equal": torch.eq,
    "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt,
    "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or,
    "Xor": torch.logical_xor, "MatMul": torch.matmul,
}
for _name, _binary_fn in _BINARY.items():
    TORCH_OPS[_name] = _binary(_binary_fn)


@op("Div")
def _div(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Integer Div truncates in ONNX; torch's `/` would promote to float."""
    a, b = inputs[0], inputs[1]
    assert a is not None and b is not None
    if a.is_floating_point():
        return [a / b]
    return [torch.div(a, b, rounding_mode="trunc")]


@op("Pow")
def _pow(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """ONNX Pow keeps the base's type whatever the exponent's."""
    a, b = inputs[0], inputs[1]
    assert a is not None and b is not None
    return [torch.pow(a, b).to(a.dtype)]


@op("Mod")
def _mod(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    a, b = inputs[0], inputs[1]
    assert a is not None and b is not None
    return [torch.fmod(a, b) if attrs.get("fmod", 0) else torch.remainder(a, b)]


def _fold(fn: Callable[[Tensor, Tensor], Tensor], mean: bool = False) -> Op:
    def run(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
        xs = [x for x in inputs if x is not None]
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return [out / len(xs) if mean else out]
    return run


TORCH_OPS.update(Max=_fold(torch.maximum), Min=_fold(torch.minimum), Sum=_fold(torch.add),
                 Mean=_fold(torch.add, mean=True))


@op("Gelu")
def _gelu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [F.gelu(inputs[0], approximate=attrs.get("approximate", "none"))]


@op("LeakyRelu")
def _leaky_relu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [F.leaky_relu(inputs[0], attrs.get("alpha", 0.01))]


@op("HardSigmoid")
def _hard_sigmoid(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [torch.clamp(attrs.get("alpha", 0.2) * inputs[0] + attrs.get("beta", 0.5), 0, 1)]


@op("Elu")
def _elu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [F.elu(inputs[0], attrs.get("alpha", 1.0))]


@op("Celu")
def _celu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [F.celu(inputs[0], attrs.get("alpha", 1.0))]


@op("Selu")
def _selu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """ONNX's attributes may differ from torch's fixed constants, so written out."""
    assert inputs[0] is not None
    alpha = attrs.get("alpha", 1.67326319217681884765625)
    return [attrs.get("gamma", 1.05070102214813232421875) * F.elu(inputs[0], alpha)]


@op("PRelu")
def _prelu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, slope = inputs[0], inputs[1]
    assert x is not None and slope is not None
    return [torch.where(x >= 0, x, slope * x)]


@op("IsInf")
def _is_inf(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    positive, negative = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    found = torch.zeros_like(x, dtype=torch.bool)
    if positive:
        found = found | torch.isposinf(x)
    if negative:
        found = found | torch.isneginf(x)
    return [found]


@op("Clip")
def _clip(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, lo, hi = inputs[0], _opt(inputs, 1), _opt(inputs, 2)
    assert x is not None
    if lo is not None:
        x = torch.maximum(x, lo.to(x.dtype))
    if hi is not None:
        x = torch.minimum(x, hi.to(x.dtype))
    return [x]


@op("Where")
def _where(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    c, a, b = inputs[0], inputs[1], inputs[2]
    assert c is not None and a is not None and b is not None
    return [torch.where(c.bool(), a, b)]


@op("Cast")
def _cast(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [inputs[0].to(torch_dtype(attrs["to"]))]


@op("CastLike")
def _cast_like(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None and inputs[1] is not None
    return [inputs[0].to(inputs[1].dtype)]


@op("Gemm")
def _gemm(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    a, b, c = inputs[0], inputs[1], _opt(inputs, 2)
    assert a is not None and b is not None
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    y = a @ b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return [y]


@op("Einsum")
def _einsum(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    return [torch.einsum(attrs["equation"].replace(" ", ""),
                         *[x for x in inputs if x is not None])]


# ------------------------------------------------------------------ shape and data movement


@op("Reshape")
def _reshape(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """0 copies the input dim (unless allowzero); -1 is left for torch to infer."""
    x, shape = inputs[0], _ints(inputs[1])
    assert x is not None and shape is not None
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x.reshape(shape)]


@op("Transpose")
def _transpose(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    perm = attrs.get("perm") or list(range(x.dim()))[::-1]
    return [x.permute(perm)]


@op("Squeeze")
def _squeeze(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    axes = _ints(_opt(inputs, 1)) or attrs.get("axes")
    if axes is None:
        return [x.squeeze()] if x.dim() else [x]
    return [x.squeeze(tuple(_axis(a, x.dim()) for a in axes))]


@op("Unsqueeze")
def _unsqueeze(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Axes index the output, so insert them in ascending order."""
    x = inputs[0]
    assert x is not None
    axes = _ints(_opt(inputs, 1)) or attrs.get("axes") or []
    rank = x.dim() + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        x = x.unsqueeze(a)
    return [x]


@op("Flatten")
def _flatten(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    axis = _axis(attrs.get("axis", 1), x.dim())
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


@op("Concat")
def _concat(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    return [torch.cat([x for x in inputs if x is not None], dim=attrs["axis"])]


@op("Split")
def _split(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Sizes from the `split` input, else `num_outputs` (last part smaller), else equal."""
    x = inputs[0]
    assert x is not None
    axis = _axis(attrs.get("axis", 0), x.dim())
    sizes = _ints(_opt(inputs, 1)) or attrs.get("split")
    if not sizes:
        n = attrs.get("num_outputs") or attrs.get("_outputs", 1)
        dim = x.shape[axis]
        part = -(-dim // n)
        sizes = [min(part, dim - i * part) for i in range(n)]
    return list(torch.split(x, sizes, dim=axis))


@op("Slice")
def _slice(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Python's slice clamping is ONNX's; negative steps gather indices (torch can't)."""
    x = inputs[0]
    assert x is not None
    starts, ends = _ints(inputs[1]), _ints(inputs[2])
    assert starts is not None and ends is not None
    axes = _ints(_opt(inputs, 3)) or list(range(len(starts)))
    steps = _ints(_opt(inputs, 4)) or [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = _axis(axis, x.dim())
        lo, hi, st = slice(start, end, step).indices(x.shape[axis])
        if st > 0:
            index: list[slice] = [slice(None)] * axis + [slice(lo, hi, st)]
            x = x[tuple(index)]
        else:
            x = x.index_select(axis, torch.arange(lo, hi, st, device=x.device))
    return [x]


def _wrap(index: Tensor, dim: int) -> Tensor:
    index = index.long()
    return torch.where(index < 0, index + dim, index)


@op("Gather")
def _gather(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, index = inputs[0], inputs[1]
    assert x is not None and index is not None
    axis = _axis(attrs.get("axis", 0), x.dim())
    flat = x.index_select(axis, _wrap(index, x.shape[axis]).reshape(-1))
    return [flat.reshape((*x.shape[:axis], *index.shape, *x.shape[axis + 1:]))]


@op("GatherND")
def _gather_nd(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Each row of the last indices dim picks one slice of data: out[i..] =
    data[b.., *indices[b.., i.., :]], the first `batch_dims` dims shared by both."""
    x, index = inputs[0], inputs[1]
    assert x is not None and index is not None
    batch = int(attrs.get("batch_dims", 0))
    depth = index.shape[-1]
    lead = x.shape[:batch]
    count = math.prod(lead)
    data = x.reshape((count, *x.shape[batch:]))
    picks = index.reshape((count, -1, depth))
    rows = torch.arange(count, device=x.device).unsqueeze(1).expand(picks.shape[:2])
    axes = [_wrap(picks[..., d], data.shape[1 + d]) for d in range(depth)]
    out = data[(rows, *axes)]
    return [out.reshape((*lead, *index.shape[batch:-1], *x.shape[batch + depth:]))]


@op("GatherElements")
def _gather_elements(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, index = inputs[0], inputs[1]
    assert x is not None and index is not None
    axis = _axis(attrs.get("axis", 0), x.dim())
    return [torch.gather(x, axis, _wrap(index, x.shape[axis]))]


#: ScatterElements' reductions as torch.scatter_reduce names ("none": plain scatter).
_SCATTER_REDUCTIONS = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@op("ScatterElements")
def _scatter_elements(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Out of place, so autograd reaches data and updates (index_add exports as add)."""
    x, index, updates = inputs[0], inputs[1], inputs[2]
    assert x is not None and index is not None and updates is not None
    axis = _axis(attrs.get("axis", 0), x.dim())
    index = _wrap(index, x.shape[axis])
    reduction = attrs.get("reduction", "none")
    if reduction == "none":
        return [torch.scatter(x, axis, index, updates)]
    if reduction not in _SCATTER_REDUCTIONS:
        raise ShardplanError(f"ScatterElements reduction {reduction!r} is not an ONNX one")
    return [torch.scatter_reduce(x, axis, index, updates, _SCATTER_REDUCTIONS[reduction])]


@op("Expand")
def _expand(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Bidirectional broadcast: the target may hold 1 where the input is larger."""
    x, shape = inputs[0], _ints(inputs[1])
    assert x is not None and shape is not None
    return [x.expand(torch.broadcast_shapes(x.shape, tuple(shape)))]


@op("Tile")
def _tile(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, repeats = inputs[0], _ints(inputs[1])
    assert x is not None and repeats is not None
    return [x.repeat(repeats)]


@op("Shape")
def _shape(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    dims = list(x.shape)[slice(attrs.get("start", 0), attrs.get("end"))]
    return [torch.tensor(dims, dtype=torch.int64)]


@op("Size")
def _size(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [torch.tensor(inputs[0].numel(), dtype=torch.int64)]


@op("ConstantOfShape")
def _constant_of_shape(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    shape = _ints(inputs[0])
    assert shape is not None
    value = attrs.get("value")
    if value is None:
        value = torch.zeros(1, dtype=torch.float32)
    return [value.reshape(()).expand(shape).clone()]


@op("Range")
def _range(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    start, limit, delta = inputs[0], inputs[1], inputs[2]
    assert start is not None and limit is not None and delta is not None
    return [torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)]


@op("Constant")
def _constant(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Constant's value may sit in any one of several typed attributes."""
    if "value" in attrs:
        return [attrs["value"]]
    for key, dtype in (("value_float", torch.float32), ("value_floats", torch.float32),
                       ("value_int", torch.int64), ("value_ints", torch.int64)):
        if key in attrs:
            return [torch.tensor(attrs[key], dtype=dtype)]
    raise ShardplanError(f"Constant with attributes {sorted(attrs)} is not supported")


@op("Trilu")
def _trilu(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, k = inputs[0], _opt(inputs, 1)
    assert x is not None
    shift = 0 if k is None else int(k.item())
    return [torch.triu(x, shift) if attrs.get("upper", 1) else torch.tril(x, shift)]


@op("OneHot")
def _one_hot(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    index, depth_t, values = inputs[0], inputs[1], inputs[2]
    assert index is not None and depth_t is not None and values is not None
    depth = int(depth_t.reshape(-1)[0].item())
    axis = _axis(attrs.get("axis", -1), index.dim() + 1)
    index = _wrap(index, depth).unsqueeze(axis)
    classes = torch.arange(depth, device=index.device).reshape(
        [depth if i == axis else 1 for i in range(index.dim())])
    return [torch.where(index == classes, values[1], values[0])]


@op("CumSum")
def _cumsum(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, axis_t = inputs[0], inputs[1]
    assert x is not None and axis_t is not None
    axis = _axis(int(axis_t.item()), x.dim())
    reverse = bool(attrs.get("reverse", 0))
    if reverse:
        x = x.flip(axis)
    y = torch.cumsum(x, axis, dtype=x.dtype)
    if attrs.get("exclusive", 0):
        zero = torch.zeros_like(x.narrow(axis, 0, 1))
        y = torch.cat([zero, y.narrow(axis, 0, x.shape[axis] - 1)], dim=axis)
    return [y.flip(axis) if reverse else y]


@op("TopK")
def _topk(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """A stable sort, because ONNX wants the lower index first among equal values."""
    x, k = inputs[0], inputs[1]
    assert x is not None and k is not None
    axis = attrs.get("axis", -1)
    count = int(k.reshape(-1)[0].item())
    values, indices = torch.sort(x, dim=axis, descending=bool(attrs.get("largest", 1)),
                                 stable=True)
    return [values.narrow(axis, 0, count), indices.narrow(axis, 0, count)]


def _arg(fn: Callable[..., Tensor]) -> Op:
    def run(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        axis = _axis(attrs.get("axis", 0), x.dim())
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):
            flipped = fn(x.flip(axis), dim=axis, keepdim=keep)
            return [x.shape[axis] - 1 - flipped]
        return [fn(x, dim=axis, keepdim=keep)]
    return run


TORCH_OPS.update(ArgMax=_arg(torch.argmax), ArgMin=_arg(torch.argmin))


# ------------------------------------------------------------------ reductions and norms


def _reduction(fn: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> Op:
    """Axes come from the input (ReduceSum 13+, all reductions 18+) or the attribute."""
    def run(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        axes = _ints(_opt(inputs, 1))
        if axes is None:
            axes = attrs.get("axes")
        keep = bool(attrs.get("keepdims", 1))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.dim()))
        if not axes:  # a scalar input: nothing to reduce
            return [fn(x.reshape(1), (0,), False)]
        return [fn(x, tuple(_axis(a, x.dim()) for a in axes), keep)]
    return run


TORCH_OPS.update(
    ReduceMean=_reduction(lambda x, a, k: x.mean(a, keepdim=k)),
    ReduceSum=_reduction(lambda x, a, k: x.sum(a, keepdim=k, dtype=x.dtype)),
    ReduceMax=_reduction(lambda x, a, k: _extreme(x, a, k, largest=True)),
    ReduceMin=_reduction(lambda x, a, k: _extreme(x, a, k, largest=False)),
    ReduceProd=_reduction(lambda x, a, k: _prod(x, a, k)),
    ReduceSumSquare=_reduction(lambda x, a, k: (x * x).sum(a, keepdim=k)),
    ReduceL1=_reduction(lambda x, a, k: x.abs().sum(a, keepdim=k)),
    ReduceL2=_reduction(lambda x, a, k: (x * x).sum(a, keepdim=k).sqrt()),
    ReduceLogSumExp=_reduction(lambda x, a, k: torch.logsumexp(x, a, keepdim=k)),
)


def _extreme(x: Tensor, axes: tuple[int, ...], keep: bool, largest: bool) -> Tensor:
    """Max/min of an empty set is ONNX's identity (-inf/+inf), not torch's error."""
    if x.numel() == 0:
        like = x.sum(axes, keepdim=keep) if x.dtype != torch.bool else x.any(axes, keepdim=keep)
        return torch.full_like(like, _lowest(x.dtype) if largest else _highest(x.dtype))
    return x.amax(axes, keepdim=keep) if largest else x.amin(axes, keepdim=keep)


def _lowest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


def _prod(x: Tensor, axes: tuple[int, ...], keep: bool) -> Tensor:
    for a in sorted(axes, reverse=True):
        x = x.prod(a, keepdim=keep)
    return x


@op("Attention")
def _attention(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Opset 23's fused attention (dynamo's exports at opset 23), as ONNX's reference
    computes it: 3-D [B, S, H*D] or 4-D [B, H, S, D] inputs, grouped KV heads, softcap on
    the raw scores, a boolean or additive mask padded to the keys, causal masking aligned
    after any cached keys; a query row no key may see gives zeros."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v = _opt(inputs, 3), _opt(inputs, 4), _opt(inputs, 5)
    assert q is not None and k is not None and v is not None
    if _opt(inputs, 6) is not None or attrs.get("left_window_size", -1) >= 0 \
            or attrs.get("right_window_size", -1) >= 0:
        raise ShardplanError("Attention with nonpad_kv_seqlen or a sliding window (opset 25) "
                             "is not supported by the executor")
    flat = q.dim() == 3
    if flat:
        q_heads, kv_heads = int(attrs["q_num_heads"]), int(attrs["kv_num_heads"])
        q = q.reshape(q.shape[0], q.shape[1], q_heads, -1).transpose(1, 2)
        k = k.reshape(k.shape[0], k.shape[1], kv_heads, -1).transpose(1, 2)
        v = v.reshape(v.shape[0], v.shape[1], kv_heads, -1).transpose(1, 2)
    past = past_k.shape[2] if past_k is not None else 0
    if past_k is not None and past_v is not None:
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    present_k, present_v = k, v
    rows, cols = q.shape[2], k.shape[2]
    bias = torch.zeros(rows, cols, dtype=q.dtype, device=q.device)
    if mask is not None:
        if mask.shape[-1] < cols:  # a mask over fewer keys: the rest are masked
            mask = F.pad(mask, (0, cols - mask.shape[-1]),
                         value=False if mask.dtype == torch.bool else -math.inf)
        bias = bias + (torch.where(mask, 0.0, -math.inf).to(q.dtype)
                       if mask.dtype == torch.bool else mask)
    if attrs.get("is_causal", 0):
        keys = torch.arange(cols, device=q.device)[None, :]
        allowed = keys <= torch.arange(rows, device=q.device)[:, None] + past
        bias = bias + torch.where(allowed, 0.0, -math.inf).to(q.dtype)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # as fused kernels do: fp32 inside
        q, k, v, bias = q.float(), k.float(), v.float(), bias.float()
    root = math.sqrt(attrs.get("scale", 1.0 / math.sqrt(q.shape[-1])))
    scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
    softcap = attrs.get("softcap", 0.0)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mode = int(attrs.get("qk_matmul_output_mode", 0))
    with_bias = scores + bias
    exposed = with_bias if mode == 2 or (mode == 1 and not softcap) else scores
    precision = attrs.get("softmax_precision")
    logits = with_bias.to(torch_dtype(precision)) if precision else with_bias
    blocked = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    weights = torch.softmax(logits.masked_fill(blocked, 0.0), dim=-1)
    weights = weights.masked_fill(blocked, 0.0)
    if mode == 3:
        exposed = weights
    y = torch.matmul(weights.to(q.dtype), v).to(dtype)
    if flat:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return [y, present_k, present_v, exposed.to(dtype)]


@op("Softmax")
def _softmax(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [torch.softmax(inputs[0], attrs.get("axis", -1))]


@op("LogSoftmax")
def _log_softmax(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    assert inputs[0] is not None
    return [torch.log_softmax(inputs[0], attrs.get("axis", -1))]


@op("LayerNormalization")
def _layer_norm(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Written out (not F.layer_norm) because ONNX also returns Mean and InvStdDev."""
    x, scale, bias = inputs[0], inputs[1], _opt(inputs, 2)
    assert x is not None and scale is not None
    axis = _axis(attrs.get("axis", -1), x.dim())
    dims = tuple(range(axis, x.dim()))
    stash = torch_dtype(attrs.get("stash_type", 1))
    xs = x.to(stash) if x.is_floating_point() and stash != x.dtype else x
    mean = xs.mean(dims, keepdim=True)
    centred = xs - mean
    inv_std = torch.rsqrt((centred * centred).mean(dims, keepdim=True) + attrs.get(
        "epsilon", 1e-5))
    y = (centred * inv_std).to(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return [y, mean, inv_std]


@op("RMSNormalization")
def _rms_norm(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Opset 23's RMSNorm (dynamo's LLaMA): x / sqrt(mean(x^2) + eps) * scale."""
    x, scale = inputs[0], inputs[1]
    assert x is not None and scale is not None
    axis = _axis(attrs.get("axis", -1), x.dim())
    dims = tuple(range(axis, x.dim()))
    stash = torch_dtype(attrs.get("stash_type", 1))
    xs = x.to(stash) if x.is_floating_point() and stash != x.dtype else x
    inv_rms = torch.rsqrt((xs * xs).mean(dims, keepdim=True) + attrs.get("epsilon", 1e-5))
    return [(xs * inv_rms).to(x.dtype) * scale]


@op("BatchNormalization")
def _batch_norm(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Training mode normalises with batch statistics and returns updated running ones."""
    x, scale, bias, mean, var = inputs[:5]
    assert x is not None and scale is not None and bias is not None
    assert mean is not None and var is not None
    shape = [1, -1] + [1] * (x.dim() - 2)
    eps = attrs.get("epsilon", 1e-5)
    if not attrs.get("training_mode", 0):
        inv = torch.rsqrt(var.reshape(shape) + eps)
        return [(x - mean.reshape(shape)) * inv * scale.reshape(shape) + bias.reshape(shape)]
    dims = tuple(i for i in range(x.dim()) if i != 1)
    batch_mean = x.mean(dims)
    batch_var = x.var(dims, unbiased=False)
    inv = torch.rsqrt(batch_var.reshape(shape) + eps)
    y = (x - batch_mean.reshape(shape)) * inv * scale.reshape(shape) + bias.reshape(shape)
    momentum = attrs.get("momentum", 0.9)
    return [y, mean * momentum + batch_mean * (1 - momentum),
            var * momentum + batch_var * (1 - momentum)]


@op("Dropout")
def _dropout(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Identity unless training_mode; the mask output is True where a value is kept.

    In a planned run the runner passes `_site` (`executor.dropout.DropoutSite`): the mask
    is then a hash of the element's global place, the same under any split of the tensor.
    Without it (a graph run outside a plan) it is drawn from torch's generator, seeded by
    the node's `seed` attribute when it has one."""
    x, ratio_t, training = inputs[0], _opt(inputs, 1), _opt(inputs, 2)
    assert x is not None
    ratio = 0.5 if ratio_t is None else float(ratio_t.item())
    if training is None or not bool(training.item()) or ratio == 0.0:
        return [x, torch.ones_like(x, dtype=torch.bool)]
    site = attrs.get("_site")
    if site is not None:
        mask = keep_mask(site, x.shape, ratio).to(x.device)
    else:
        generator = None
        if "seed" in attrs:
            generator = torch.Generator(device=x.device).manual_seed(int(attrs["seed"]))
        mask = torch.rand(x.shape, generator=generator, device=x.device) >= ratio
    return [x * mask / (1.0 - ratio), mask]


# ------------------------------------------------------------------ convolution and pooling


def _spatial(attrs: Attrs, x: Tensor, kernel: Sequence[int]) -> tuple[
        list[int], list[int], list[int], list[int]]:
    """Strides, dilations and (begin, end) pads per spatial dim, auto_pad resolved."""
    n = x.dim() - 2
    strides = list(attrs.get("strides") or [1] * n)
    dilations = list(attrs.get("dilations") or [1] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    begin, end = pads[:n], pads[n:]
    auto = attrs.get("auto_pad", "NOTSET")
    if auto == "VALID":
        begin, end = [0] * n, [0] * n
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(n):
            size = x.shape[2 + i]
            out = -(-size // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
            small, big = total // 2, total - total // 2
            begin[i], end[i] = (small, big) if auto == "SAME_UPPER" else (big, small)
    return strides, dilations, begin, end


def _pad(x: Tensor, begin: list[int], end: list[int], value: float) -> Tensor:
    """F.pad lists the last dim first."""
    if not any(begin) and not any(end):
        return x
    flat: list[int] = []
    for b, e in zip(reversed(begin), reversed(end), strict=True):
        flat += [b, e]
    return F.pad(x, flat, value=value)


def _pool_crop(y: Tensor, x: Tensor, kernel: Sequence[int], strides: list[int],
               dilations: list[int], begin: list[int], end: list[int], ceil: bool) -> Tensor:
    """Drop ceil-mode windows that would start inside the end padding, as ONNX does;
    torch keeps them because it sees the pre-padded input as all data."""
    for i, k in enumerate(kernel):
        size = x.shape[2 + i]
        span = size + begin[i] + end[i] - ((k - 1) * dilations[i] + 1)
        out = (-(-span // strides[i]) if ceil else span // strides[i]) + 1
        if ceil and (out - 1) * strides[i] >= size + begin[i]:
            out -= 1
        y = y.narrow(2 + i, 0, min(out, y.shape[2 + i]))
    return y


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@op("Conv")
def _conv(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, w, b = inputs[0], inputs[1], _opt(inputs, 2)
    assert x is not None and w is not None
    n = x.dim() - 2
    if n not in _CONV:
        raise ShardplanError(f"Conv over {n} spatial dims is not supported by the executor")
    strides, dilations, begin, end = _spatial(attrs, x, w.shape[2:])
    if begin == end:
        return [_CONV[n](x, w, b, strides, begin, dilations, attrs.get("group", 1))]
    return [_CONV[n](_pad(x, begin, end, 0.0), w, b, strides, 0, dilations,
                     attrs.get("group", 1))]


@op("MaxPool")
def _max_pool(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Pads with -inf first (torch caps pads at half the kernel); Indices are then mapped
    back to the unpadded input, flattened over N, C and space as ONNX counts them."""
    x = inputs[0]
    assert x is not None
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    if n not in _MAX_POOL:
        raise ShardplanError(f"MaxPool over {n} spatial dims is not supported by the executor")
    strides, dilations, begin, end = _spatial(attrs, x, kernel)
    ceil = bool(attrs.get("ceil_mode", 0))
    padded = _pad(x, begin, end, _lowest(x.dtype))
    y, idx = _MAX_POOL[n](padded, kernel, strides, 0, dilations, ceil_mode=ceil,
                          return_indices=True)
    y = _pool_crop(y, x, kernel, strides, dilations, begin, end, ceil)
    idx = _pool_crop(idx, x, kernel, strides, dilations, begin, end, ceil)
    spatial, padded_spatial = x.shape[2:], padded.shape[2:]
    coords = []
    rest = idx
    for size in reversed(padded_spatial):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    # storage_order 1 is column-major: the first spatial dim varies fastest
    order = list(range(n)) if attrs.get("storage_order", 0) else list(range(n))[::-1]
    flat = torch.zeros_like(idx)
    stride = 1
    for i in order:
        flat = flat + (coords[i] - begin[i]) * stride
        stride *= spatial[i]
    plane = math.prod(spatial)
    nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(
        x.shape[0], x.shape[1], *[1] * n)
    return [y, flat + nc * plane]


@op("AveragePool")
def _average_pool(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    """Sums windows and divides by a pooled mask, so asymmetric pads and
    count_include_pad both come out right."""
    x = inputs[0]
    assert x is not None
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    strides, dilations, begin, end = _spatial(attrs, x, kernel)
    if any(d != 1 for d in dilations) or n not in (1, 2, 3):
        raise ShardplanError("AveragePool with dilations or over >3 spatial dims is not "
                             "supported by the executor")
    ceil = bool(attrs.get("ceil_mode", 0))
    lift = n == 1  # avg_pool1d lacks divisor_override: run it as 2-D
    xp = _pad(x, begin, end, 0.0)
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    mask = _pad(ones, begin, end, 1.0 if attrs.get("count_include_pad", 0) else 0.0)
    k, s = kernel, strides
    if lift:
        xp, mask, k, s = xp.unsqueeze(-2), mask.unsqueeze(-2), [1, *k], [1, *s]
    pool = F.avg_pool2d if len(k) == 2 else F.avg_pool3d
    total = pool(xp, k, s, 0, ceil, True, 1)
    count = pool(mask, k, s, 0, ceil, True, 1)
    y = total / count
    y = y.squeeze(-2) if lift else y
    return [_pool_crop(y, x, kernel, strides, dilations, begin, end, ceil)]


@op("GlobalAveragePool")
def _global_average_pool(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    return [x.mean(tuple(range(2, x.dim())), keepdim=True)]


@op("GlobalMaxPool")
def _global_max_pool(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x = inputs[0]
    assert x is not None
    return [x.amax(tuple(range(2, x.dim())), keepdim=True)]


@op("Pad")
def _pad_op(inputs: Inputs, attrs: Attrs) -> list[Tensor]:
    x, pads_t, value_t, axes_t = inputs[0], inputs[1], _opt(inputs, 2), _opt(inputs, 3)
    assert x is not None
    pads = _ints(pads_t) or []
    axes = [_axis(a, x.dim()) for a in (_ints(axes_t) or range(x.dim()))]
    begin, end = [0] * x.dim(), [0] * x.dim()
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[len(axes) + i]
    mode = attrs.get("mode", "constant")
    if mode != "constant":
        raise ShardplanError(f"Pad mode {mode!r} is not supported by the executor")
    value = 0.0 if value_t is None or value_t.numel() == 0 else value_t.item()
    flat: list[int] = []
    for b, e in zip(reversed(begin), reversed(end), strict=True):
        flat += [b, e]
    return [F.pad(x, flat, value=value)]
