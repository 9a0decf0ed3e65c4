"""Bind the symbolic input dims of a prepared model: the batch axis and named dims.

Every unbound dim is listed in one error; the bound values are written into the inputs'
shapes, and the exporters' symbolic output labels are dropped so that shape inference
recomputes them from the bound inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import onnx

from planner.errors import ModelError
from planner.humanize import first_listed

#: What identifies one binding of a model: each bound dim's name, value type and value
#: (the type too, so that a dim of True is not taken for a dim of 1).
BindingKey = tuple[tuple[str, str, int], ...]


class Bound(NamedTuple):
    """What binding fixed: the dims bound (those the inputs use), the batch size (None
    without a batch axis), each batch input's batch dim, the batch dim's symbol, and each
    sequence input's sequence dim (`sequence_dims`)."""

    dims: dict[str, int]
    batch: int | None
    batch_inputs: dict[str, int]
    batch_symbol: str | None
    sequence_inputs: dict[str, int]

    @property
    def key(self) -> BindingKey:
        """The bound dims alone fix the bound model, so they identify the binding."""
        return binding_key(self.dims)


def binding_key(dims: Mapping[str, int]) -> BindingKey:
    return tuple(sorted((name, type(value).__name__, value) for name, value in dims.items()))


def check_binding(name: str, batch: int | None, dims: Mapping[str, int]) -> None:
    """Refuse dim values and a batch size that are not positive integers."""
    for key, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise ModelError(f"{name}: --dim {key}={value}: a dim must be a positive integer")
    if batch is not None and batch < 1:
        raise ModelError(f"{name}: --batch {batch}: the batch size must be a positive integer")


#: Capacity factors outside this range are typos: below 1 drops most routed tokens by
#: design, above 64 sizes every expert for more tokens than a batch has.
CAPACITY_FACTOR_RANGE = (0.01, 64.0)


def check_capacity_factor(name: str, factor: float) -> None:
    low, high = CAPACITY_FACTOR_RANGE
    if not (isinstance(factor, int | float) and low <= factor <= high):
        raise ModelError(f"{name}: --capacity-factor {factor}: give a multiple of an "
                         f"expert's even share of tokens between {low} and {high:g} "
                         "(1.25 is the usual)")


def data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def bind_dims(
    model: onnx.ModelProto, name: str, batch: int | None, dims: Mapping[str, int]
) -> Bound:
    """Replace symbolic input dims by the user's values (in place); error listing every
    unbound one."""
    check_binding(name, batch, dims)
    inputs = data_inputs(model)
    batch_symbol, static_batch = _batch_axis(inputs)
    used = {d.dim_param for v in inputs for d in _shape_dims(v) if not d.HasField("dim_value")}
    batch_inputs = _batch_dims(inputs, batch_symbol, static_batch)
    sequence_inputs = sequence_dims(inputs, batch_inputs, batch_symbol)
    bound = dict(dims)
    if batch is not None:
        if batch_symbol is not None:
            if batch_symbol in bound and bound[batch_symbol] != batch:
                raise ModelError(
                    f"{name}: --batch {batch} and --dim {batch_symbol}={bound[batch_symbol]} "
                    "disagree; give one of them"
                )
            bound[batch_symbol] = batch
        elif static_batch is not None and static_batch != batch:
            raise ModelError(
                f"{name}: the model was exported with a static batch of {static_batch}; "
                f"--batch {batch} cannot change it: re-export with a dynamic batch axis "
                "or omit --batch"
            )
    unbound: list[str] = []
    for value in inputs:
        for axis, dim in enumerate(_shape_dims(value)):
            if dim.HasField("dim_value"):
                if dim.dim_value < 1:
                    raise ModelError(
                        f"{name}: input {value.name} dim {axis} is {dim.dim_value}; a training "
                        "step needs positive input dims: re-export with the real size or a "
                        "symbolic dim")
                continue
            symbol = dim.dim_param
            if symbol and symbol in bound:
                dim.Clear()
                dim.dim_value = bound[symbol]
            else:
                hint = "--batch N" if symbol and symbol == batch_symbol else f"--dim {symbol}=N"
                label = symbol or "(unnamed)"
                unbound.append(f"{label} (input {value.name} dim {axis}; bind with {hint})")
    if unbound:
        raise ModelError(f"{name}: unbound symbolic dims: " + first_listed(unbound, 8, "; "))
    extra = sorted(k for k in dims if k not in used)
    if extra:
        raise ModelError(f"{name}: --dim names no input dim: {first_listed(extra, 8)}")
    batch_size = bound.get(batch_symbol) if batch_symbol is not None else static_batch
    for value in list(model.graph.output) + list(model.graph.value_info):
        _forget_symbolic_dims(value)
    del model.graph.value_info[:]
    return Bound({k: v for k, v in bound.items() if k in used}, batch_size, batch_inputs,
                 batch_symbol, sequence_inputs)


def sequence_dims(inputs: list[onnx.ValueInfoProto], batch_inputs: Mapping[str, int],
                  batch_symbol: str | None) -> dict[str, int]:
    """The sequence dim of each batch input that has one: the dim right after the batch
    dim when it is symbolic (token ids `[batch, seq]`, a padding mask `[batch, seq]`), or
    right before it in a sequence-first input (`[seq, batch]`), the symbol of the first
    such input standing for all (a `[batch, seq]` mask and `[batch, seq]` ids share it;
    an image's channels are static and have none). What context parallelism splits."""
    symbol = None
    found: dict[str, int] = {}
    for value in inputs:
        dim = batch_inputs.get(value.name)
        shape = _shape_dims(value)
        if dim is None:
            continue
        for index in (dim + 1, dim - 1):
            if not 0 <= index < len(shape):
                continue
            beside = shape[index]
            if beside.HasField("dim_value") or not beside.dim_param or \
                    beside.dim_param == batch_symbol:
                continue
            symbol = symbol or beside.dim_param
            if beside.dim_param == symbol:
                found[value.name] = index
            break
    return found


def _batch_axis(inputs: list[onnx.ValueInfoProto]) -> tuple[str | None, int | None]:
    """The batch dim's symbol, or its static size: the symbol that names the batch
    (`BATCH_SYMBOLS`, as `torch.export.Dim("batch")` or `dynamic_axes={1: "batch"}` name
    it) where some data input has one, so that a sequence-first input `[seq, batch]`
    keeps its batch; else dim 0 of the first data input."""
    for value in inputs:
        for dim in _shape_dims(value):
            if not dim.HasField("dim_value") and dim.dim_param.lower() in BATCH_SYMBOLS:
                return dim.dim_param, None
    for value in inputs:
        shape = _shape_dims(value)
        if shape:
            first = shape[0]
            if first.HasField("dim_value"):
                return None, int(first.dim_value)
            return first.dim_param or None, None
    return None, None


#: The symbols taken to name the batch dim wherever it stands (any case); a symbol that
#: only holds the word (`batch_len`, `sub_batch`) names something else
BATCH_SYMBOLS = frozenset({"batch", "batch_size", "batchsize", "bsz"})


def _batch_dims(inputs: list[onnx.ValueInfoProto], symbol: str | None,
                static: int | None) -> dict[str, int]:
    """Each batch input's batch dim: the dim the batch symbol names (the first such), or
    dim 0 where the batch is static and dim 0 has its size."""
    found: dict[str, int] = {}
    for value in inputs:
        for index, dim in enumerate(_shape_dims(value)):
            if symbol is not None and not dim.HasField("dim_value") and dim.dim_param == symbol:
                found[value.name] = index
                break
            if symbol is None and static is not None and index == 0 and \
                    dim.HasField("dim_value") and dim.dim_value == static:
                found[value.name] = 0
                break
    return found


def _shape_dims(value: onnx.ValueInfoProto):
    if not value.type.HasField("tensor_type"):
        return []
    return value.type.tensor_type.shape.dim


def _forget_symbolic_dims(value: onnx.ValueInfoProto) -> None:
    """Exporters label outputs with expressions like 's0*s1'; inference recomputes them."""
    tensor_type = value.type.tensor_type
    if (value.type.HasField("tensor_type") and tensor_type.HasField("shape")
            and any(not d.HasField("dim_value") for d in tensor_type.shape.dim)):
        tensor_type.ClearField("shape")
