"""Graph-building helper shared by every zoo family.

Every family needs the same bookkeeping (unique node names, parameters declared with or
without data, shared Constant nodes, opset quirks) and the same few layers (linear, norms,
multi-head attention), so they live here once and the family modules only wire them up.

Conventions the planner relies on:
  * every float initializer is a trainable parameter, except the BatchNorm running
    statistics, whose names end in one of ``BUFFER_SUFFIXES``;
  * non-trainable tensors (eps, scales, masks, rotary frequencies, shape targets) are
    ``Constant`` nodes, never initializers;
  * symbolic batch/seq dims never need a ``Shape`` op: reshapes use 0 / -1 targets and
    positions come from a CumSum over the token ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import onnx
from numpy.typing import ArrayLike
from onnx import TensorProto, helper, numpy_helper

from planner.errors import ModelError

DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}
ITEMSIZE: dict[int, int] = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2}
MIN_OPSET = 17  # LayerNormalization
BUFFER_SUFFIXES = ("running_mean", "running_var")
INLINE_LIMIT = 2**31 - 2**26  # protobuf cannot serialise a message of 2 GiB or more
# Added to masked attention scores: far below any real score, yet finite in the dtype.
MASK_VALUE = {"float32": -1e9, "float16": -65504.0, "bfloat16": -1e9}


# ----------------------------------------------------------------------------------------
# Config validation helpers
# ----------------------------------------------------------------------------------------


def require(ok: bool, field: str, message: str) -> None:
    """Raise ModelError naming the config field, so the CLI can print one clear line."""
    if not ok:
        raise ModelError(f"model config field '{field}': {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(config: Any, *names: str) -> None:
    """Every named field must be a positive int."""
    for name in names:
        value = getattr(config, name)
        require(_is_int(value) and value > 0, name, f"must be a positive integer, got {value!r}")


def check_optional_positive(config: Any, *names: str) -> None:
    """Every named field must be None (derived default) or a positive int."""
    for name in names:
        value = getattr(config, name)
        ok = value is None or (_is_int(value) and value > 0)
        require(ok, name, f"must be a positive integer or None, got {value!r}")


def check_positive_number(config: Any, *names: str) -> None:
    """Every named field must be a positive int or float (eps, theta, factors)."""
    for name in names:
        value = getattr(config, name)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        require(ok, name, f"must be a positive number, got {value!r}")


def check_common(config: Any) -> None:
    """dtype and opset are shared by all families."""
    require(config.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}, got "
            f"{config.dtype!r}")
    top = onnx.defs.onnx_opset_version()
    opset = config.opset
    require(_is_int(opset) and MIN_OPSET <= opset <= top, "opset",
            f"must be an integer in [{MIN_OPSET}, {top}], got {opset!r}")


def check_divisible(config: Any, field: str, by_field: str) -> None:
    value, by = getattr(config, field), getattr(config, by_field)
    require(value % by == 0, field, f"{value} is not divisible by {by_field}={by}")


def config_items(config: Any) -> dict[str, object]:
    """Plain field -> value mapping (tuples become lists) for the model's metadata."""
    out: dict[str, object] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# ----------------------------------------------------------------------------------------
# Tensor helpers
# ----------------------------------------------------------------------------------------


def to_tensor(name: str, array: np.ndarray, elem_type: int) -> TensorProto:
    """Numpy -> TensorProto in elem_type; bfloat16 is rounded to nearest-even by hand."""
    if elem_type == TensorProto.BFLOAT16:
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tensor = TensorProto(name=name, data_type=elem_type, dims=list(array.shape))
        tensor.raw_data = rounded.astype("<u2").tobytes()
        return tensor
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)
    return numpy_helper.from_array(np.asarray(array, dtype=np_type), name)


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


class GraphBuilder:
    """Accumulates nodes, parameters and constants for one ONNX graph.

    Parameters are declared with real random data when ``with_weights`` is true, else as
    external data pointing into ``<name>.weights`` at consecutive offsets (the file itself
    is never written: the planner reads shapes only).
    """

    def __init__(self, name: str, *, dtype: str, opset: int, with_weights: bool,
                 seed: int = 0) -> None:
        self.name = name
        self.dtype = dtype
        self.elem = DTYPES[dtype]
        self.opset = opset
        self.with_weights = with_weights
        self.location = f"{name}.weights"
        self._rng = np.random.default_rng(seed)
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: list[TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._offset = 0

    # -- bookkeeping -------------------------------------------------------------------

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise RuntimeError(f"zoo bug: name {name!r} used twice")
        self._names.add(name)
        return name

    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self._inputs.append(helper.make_tensor_value_info(self._claim(name), elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[int | str]) -> None:
        self._outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def op(self, op_type: str, name: str, *inputs: str, out: str | None = None,
           **attrs: Any) -> str:
        """Add one single-output node; its output tensor is named after the node."""
        return self.op_n(op_type, name, 1, *inputs, outs=[out or name], **attrs)[0]

    def op_n(self, op_type: str, name: str, n: int, *inputs: str,
             outs: Sequence[str] | None = None, **attrs: Any) -> list[str]:
        """Add one node with n outputs (named ``<node>.0`` ... unless given)."""
        self._claim(name)
        outputs = list(outs) if outs else [f"{name}.{i}" for i in range(n)]
        for o in outputs:
            if o != name:
                self._claim(o)
        self._nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs

    # -- constants ---------------------------------------------------------------------

    def const(self, array: np.ndarray, hint: str, elem_type: int | None = None) -> str:
        """A Constant node holding array, shared between all users of the same value."""
        array = np.asarray(array)
        if elem_type is None:
            elem_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        key = (elem_type, array.shape, array.tobytes())
        if key in self._consts:
            return self._consts[key]
        name = f"const.{hint}"
        if name in self._names:
            name = f"const.{hint}.{len(self._consts)}"
        tensor = to_tensor(name, array, elem_type)
        self.op("Constant", name, value=tensor)
        self._consts[key] = name
        return name

    def ints(self, values: Sequence[int] | int, hint: str) -> str:
        """int64 constant (shape targets, axes, indices); a bare int gives a scalar."""
        return self.const(np.array(values, dtype=np.int64), hint)

    def scalar(self, value: float, hint: str) -> str:
        """Scalar in the model's float dtype (eps, scales, mask fill)."""
        return self.const(np.array(value, dtype=np.float32), hint, self.elem)

    def f32(self, array: ArrayLike, hint: str) -> str:
        """float32 constant regardless of the model dtype (e.g. rotary frequencies)."""
        return self.const(np.asarray(array, dtype=np.float32), hint)

    # -- parameters --------------------------------------------------------------------

    def param(self, name: str, shape: Sequence[int], init: str = "normal",
              std: float = 0.02) -> str:
        """Declare a trainable parameter (or a buffer, by name suffix) as an initializer."""
        dims = [int(d) for d in shape]
        nbytes = numel(dims) * ITEMSIZE[self.elem]
        if self.with_weights:
            if self._offset + nbytes > INLINE_LIMIT:
                raise ModelError(
                    "with_weights=True stores weights inline, but this model needs over "
                    f"{INLINE_LIMIT / 2**30:.1f} GiB (protobuf limit): build it with "
                    "with_weights=False")
            tensor = to_tensor(name, self._init_array(dims, init, std), self.elem)
        else:
            tensor = TensorProto(name=name, data_type=self.elem, dims=dims,
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", self.location), ("offset", str(self._offset)),
                               ("length", str(nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        self._offset += nbytes
        self._claim(name)
        self._initializers.append(tensor)
        return name

    def _init_array(self, dims: list[int], init: str, std: float) -> np.ndarray:
        if init == "zeros":
            return np.zeros(dims, dtype=np.float32)
        if init == "ones":
            return np.ones(dims, dtype=np.float32)
        return self._rng.normal(0.0, std, size=dims).astype(np.float32)

    # -- opset-dependent ops -----------------------------------------------------------

    def reduce(self, op_type: str, x: str, name: str, axes: Sequence[int],
               keepdims: bool = True) -> str:
        """Reduce* ops: axes moved from attribute to input in opset 18 (ReduceSum in 13)."""
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, name, x, self.ints(list(axes), "axes"),
                           keepdims=int(keepdims))
        return self.op(op_type, name, x, axes=list(axes), keepdims=int(keepdims))

    def unsqueeze(self, x: str, name: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", name, x, self.ints(list(axes), "axes"))

    def reshape(self, x: str, name: str, shape: Sequence[int]) -> str:
        return self.op("Reshape", name, x, self.ints(list(shape), "shape"))

    # -- layers ------------------------------------------------------------------------

    def linear(self, x: str, module: str, node: str, n_in: int, n_out: int,
               bias: bool = True) -> str:
        """x @ W (+ b) with W stored [in, out] so MatMul needs no Transpose."""
        y = self.op("MatMul", f"{node}.matmul", x, self.param(f"{module}.weight", [n_in, n_out]))
        if bias:
            b = self.param(f"{module}.bias", [n_out], init="zeros")
            y = self.op("Add", f"{node}.bias_add", y, b)
        return y

    def layer_norm(self, x: str, module: str, node: str, dim: int, eps: float) -> str:
        scale = self.param(f"{module}.weight", [dim], init="ones")
        bias = self.param(f"{module}.bias", [dim], init="zeros")
        return self.op("LayerNormalization", node, x, scale, bias, axis=-1, epsilon=eps)

    def rms_norm(self, x: str, module: str, node: str, dim: int, eps: float) -> str:
        """RMSNorm decomposed into primitive ops, as LLaMA exports show it."""
        sq = self.op("Pow", f"{node}.pow", x, self.scalar(2.0, "two"))
        mean = self.reduce("ReduceMean", sq, f"{node}.mean", [-1])
        var = self.op("Add", f"{node}.add_eps", mean, self.scalar(eps, "rms_eps"))
        inv = self.op("Reciprocal", f"{node}.rsqrt", self.op("Sqrt", f"{node}.sqrt", var))
        normed = self.op("Mul", f"{node}.normalize", x, inv)
        weight = self.param(f"{module}.weight", [dim], init="ones")
        return self.op("Mul", f"{node}.scale", normed, weight)

    def gelu(self, x: str, node: str, approximate: bool) -> str:
        """GELU as primitive ops: tanh approximation (GPT-2) or exact Erf form (BERT)."""
        half = self.op("Mul", f"{node}.half", x, self.scalar(0.5, "half"))
        if approximate:
            cube = self.op("Pow", f"{node}.cube", x, self.scalar(3.0, "three"))
            inner = self.op("Mul", f"{node}.cube_scale", cube, self.scalar(0.044715, "gelu_c"))
            inner = self.op("Add", f"{node}.inner_add", x, inner)
            inner = self.op("Mul", f"{node}.inner_scale", inner,
                            self.scalar(math.sqrt(2.0 / math.pi), "sqrt_2_over_pi"))
            t = self.op("Tanh", f"{node}.tanh", inner)
        else:
            scaled = self.op("Mul", f"{node}.scale", x, self.scalar(1 / math.sqrt(2), "rsqrt2"))
            t = self.op("Erf", f"{node}.erf", scaled)
        one_plus = self.op("Add", f"{node}.one_plus", t, self.scalar(1.0, "one"))
        return self.op("Mul", f"{node}.mul", half, one_plus)

    def dropout(self, x: str, node: str, ratio: float) -> str:
        """Training-mode Dropout (its mask is the second output), or x when ratio is 0."""
        if ratio == 0:
            return x
        train = self.const(np.array(True), "training_mode")
        outputs = self.op_n("Dropout", node, 2, x, self.scalar(ratio, f"dropout_{ratio}"),
                            train, outs=[node, f"{node}.mask"])
        return outputs[0]

    def silu(self, x: str, node: str) -> str:
        return self.op("Mul", f"{node}.mul", x, self.op("Sigmoid", f"{node}.sigmoid", x))

    def positions(self, ids: str, node: str) -> tuple[str, str]:
        """Zeros and 0..S-1 positions shaped like ids [B, S], with no Shape op."""
        zeros = self.op("Mul", f"{node}.zeros", ids, self.ints(0, "zero"))
        ones = self.op("Add", f"{node}.ones", zeros, self.ints(1, "one"))
        pos = self.op("CumSum", f"{node}.cumsum", ones, self.ints(1, "axis1"), exclusive=1)
        return zeros, pos

    def causal_mask(self, pos: str, node: str) -> str:
        """bool [B, 1, S, S]: key position <= query position."""
        q = self.unsqueeze(pos, f"{node}.query_pos", [2])
        k = self.unsqueeze(pos, f"{node}.key_pos", [1])
        allowed = self.op("LessOrEqual", f"{node}.less_equal", k, q)
        return self.unsqueeze(allowed, f"{node}.unsqueeze", [1])

    def heads(self, x: str, node: str, heads: int, head_dim: int,
              perm: Sequence[int] | None = (0, 2, 1, 3)) -> str:
        """[B, S, heads*hd] -> [B, S, heads, hd], then optionally transposed."""
        y = self.reshape(x, f"{node}.split_heads", [0, 0, heads, head_dim])
        if perm is None:
            return y
        return self.op("Transpose", f"{node}.transpose", y, perm=list(perm))

    def attention(self, q: str, k_t: str, v: str, node: str, head_dim: int,
                  causal: str | None = None, additive: str | None = None,
                  dropout: float = 0.0) -> str:
        """softmax(q k^T / sqrt(d) [masked]) v for q [B,h,S,d], k_t [B,h,d,S]; -> [B,S,h*d]."""
        scores = self.op("MatMul", f"{node}.qk_matmul", q, k_t)
        scores = self.op("Mul", f"{node}.scale", scores,
                         self.scalar(1 / math.sqrt(head_dim), f"attn_scale_{head_dim}"))
        if causal is not None:
            fill = self.scalar(MASK_VALUE[self.dtype], "mask_fill")
            scores = self.op("Where", f"{node}.causal_mask", causal, scores, fill)
        if additive is not None:
            scores = self.op("Add", f"{node}.add_mask", scores, additive)
        probs = self.op("Softmax", f"{node}.softmax", scores, axis=-1)
        probs = self.dropout(probs, f"{node}.dropout", dropout)
        ctx = self.op("MatMul", f"{node}.pv_matmul", probs, v)
        ctx = self.op("Transpose", f"{node}.merge_transpose", ctx, perm=[0, 2, 1, 3])
        return self.reshape(ctx, f"{node}.merge_heads", [0, 0, -1])

    # -- output ------------------------------------------------------------------------

    def model(self, family: str, config: Any) -> onnx.ModelProto:
        """The finished model; family and config go into metadata_props for provenance."""
        graph = helper.make_graph(self._nodes, self.name, self._inputs, self._outputs,
                                  initializer=self._initializers)
        opsets = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="shardplan.zoo",
                                  ir_version=helper.find_min_ir_version_for(opsets))
        model.doc_string = f"shardplan zoo '{family}' model"
        helper.set_model_props(model, {"shardplan.zoo.family": family,
                                       "shardplan.zoo.config": json.dumps(config_items(config))})
        return model
