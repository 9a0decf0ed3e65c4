"""Import an ONNX file into a PlanningGraph without reading weight data.

Steps: load the proto (external data left on disk, or absent), bind symbolic dims, then
alternate ONNX shape inference with constant folding until the shape arithmetic that
exporters emit (Shape → Gather → Concat → Reshape chains) has become constants. What is
left are tensor ops with static shapes, which are costed by `planner.ops.cost_op`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import onnx
from google.protobuf.message import DecodeError, Message
from onnx import numpy_helper, shape_inference

from planner.errors import ModelError
from planner.graph import FLOAT_DTYPES, OpNode, PlanningGraph, TensorInfo
from planner.ops import cost_op
from planner.reference import run_node

#: Folded constants larger than this stay ops: they are data, not shape arithmetic.
FOLD_LIMIT_ELEMENTS = 1 << 16
MAX_FOLD_ROUNDS = 12
#: Largest element count of one tensor: beyond 2**53, float64 sizes and FLOPs are inexact.
MAX_TENSOR_ELEMENTS = 1 << 53
#: Op semantics changed up to opset 13 (Softmax axis, Split/Unsqueeze/Reduce axes as inputs).
MIN_OPSET = 13
UNSUPPORTED_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})
NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)
#: Batch-norm running statistics are state, not trainable parameters.
BUFFER_INPUT_SLOTS = {"BatchNormalization": (3, 4)}
#: Names torch gives registered buffers that exporters store as float initializers.
BUFFER_NAME = re.compile(r"(running_(mean|var)|num_batches_tracked|inv_freq|_cached)$")

_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.BOOL: "bool",
}


@dataclass(frozen=True)
class DimBinding:
    """What the user bound: the batch size and named symbolic dims."""

    batch: int | None = None
    dims: Mapping[str, int] | None = None


def load_onnx(path: str | os.PathLike) -> tuple[onnx.ModelProto, str]:
    """Read the graph proto (never the external weight data) and its sha256."""
    file = Path(path)
    if not file.exists():
        raise ModelError(f"{file}: no such file; give the path of an .onnx model")
    if not file.is_file():
        raise ModelError(f"{file}: not a regular file; give the path of an .onnx model")
    data = file.read_bytes()
    if not data:
        raise ModelError(f"{file}: the file is empty; re-export the model")
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{file}: not a readable ONNX model ({exc}); the file may be truncated or of "
            "another format; re-export it with torch.onnx.export or onnx.save"
        ) from None
    if not model.graph.node:
        raise ModelError(
            f"{file}: the ONNX graph has no nodes (truncated or not an ONNX model); re-export it"
        )
    _check_text(model, file)
    _check_external_data(model, file)
    _check_definitions(model, file)
    return model, hashlib.sha256(data).hexdigest()


def _check_text(model: onnx.ModelProto, file: Path) -> None:
    """Refuse string fields that are not UTF-8: protobuf hands them over as bytes, which
    fail far from here (as a name, a path, a dict key) with a TypeError or decode error."""
    bad = _non_utf8_string(model)
    if bad is not None:
        field, raw = bad
        raise ModelError(
            f"{file}: the {field} {raw[:40]!r} is not UTF-8 text; the file is corrupt: "
            "re-export it"
        )


def _non_utf8_string(root: Message) -> tuple[str, bytes] | None:
    """(field name, raw value) of the first string field holding undecodable bytes."""
    stack = [root]
    while stack:
        message = stack.pop()
        for descriptor, value in message.ListFields():
            if descriptor.type == descriptor.TYPE_MESSAGE:
                stack.extend([value] if isinstance(value, Message) else value)
            elif descriptor.type == descriptor.TYPE_STRING:
                for text in [value] if isinstance(value, str | bytes) else value:
                    if isinstance(text, bytes):
                        return f"{message.DESCRIPTOR.name}.{descriptor.name}", text
    return None


def _check_external_data(model: onnx.ModelProto, file: Path) -> None:
    """Refuse external-data entries that point outside the model's folder.

    shardplan never reads weight data, but the executor and ONNX's own loader do: a
    `location` that is absolute, has a `..` component or resolves through a symlink to
    outside the folder would make them read (or, when saving, write) any file.
    """
    folder = file.resolve().parent
    problems: dict[str | None, str] = {}  # most tensors share one location: resolve it once
    for tensor in _all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location")
        if location not in problems:
            problems[location] = _location_problem(location, folder)
        problem = problems[location]
        if problem:
            raise ModelError(
                f"{file}: tensor {tensor.name} keeps its data at location {location!r}, "
                f"which {problem}; external data must be a relative path inside the model's "
                "folder: move the weights file next to the model and re-save it"
            )
        for key in ("offset", "length"):
            if key in entries and not (entries[key].isascii() and entries[key].isdigit()):
                raise ModelError(
                    f"{file}: tensor {tensor.name}: external data {key} {entries[key]!r} is "
                    "not a non-negative integer; re-save the model with onnx.save"
                )


def _location_problem(location: str | None, folder: Path) -> str:
    """Why `location` may not be read relative to `folder`; "" when it may."""
    if not location:
        return "is missing or empty"
    if "\x00" in location:
        return "contains a NUL byte"
    posix = PurePosixPath(location.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(location).drive:
        return "is an absolute path"
    if ".." in posix.parts:
        return "has a '..' component"
    try:
        resolved = (folder / posix).resolve()
    except (OSError, RuntimeError):
        return "cannot be resolved (a symlink loop?)"
    if not resolved.is_relative_to(folder):
        return f"resolves (through a symlink) to {resolved}, outside the model's folder"
    return ""


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: initializers, attribute tensors, subgraphs, functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [*attr.sparse_tensors, *([attr.sparse_tensor]
                                                   if attr.HasField("sparse_tensor") else [])]:
                yield from (sparse.values, sparse.indices)
            for graph in [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]:
                yield from _graph_tensors(graph)


def _check_definitions(model: onnx.ModelProto, file: Path) -> None:
    """Every tensor of the main graph is defined once (SSA) and every output is defined.

    Two producers of one name would make shapes, consumers and costs depend on which
    definition the importer happened to see last.
    """
    graph = model.graph
    defined: dict[str, str] = {}
    for init in graph.initializer:
        _define(defined, init.name, "an initializer", file)
    listed: dict[str, str] = {}
    for value in graph.input:
        _define(listed, value.name, "a graph input", file)
        if defined.get(value.name) != "an initializer":  # old exporters list weights as inputs
            _define(defined, value.name, "a graph input", file)
    for node in graph.node:
        for output in node.output:
            if output:
                _define(defined, output, f"node {node.name or node.op_type}", file)
    if not graph.output:
        raise ModelError(f"{file}: the graph declares no outputs, so no op contributes to a "
                         "result; re-export the model with its outputs (logits or loss)")
    for value in graph.output:
        if value.name not in defined:
            raise ModelError(f"{file}: graph output {value.name!r} is produced by no node, "
                             "input or initializer; re-export the model")


def _define(defined: dict[str, str], name: str, what: str, file: Path) -> None:
    if name in defined:
        raise ModelError(f"{file}: tensor {name!r} is defined twice (by {defined[name]} and "
                         f"by {what}); each tensor name must have one producer: re-export "
                         "the model")
    defined[name] = what


def import_model(
    path: str | os.PathLike,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
) -> PlanningGraph:
    """Load `path` and return its planning graph with every dim bound and folded."""
    model, digest = load_onnx(path)
    name = str(path)
    opset = _default_opset(model, name)
    model = _inline_functions(model, name)
    _reject_control_flow(model, name)
    _name_nodes(model)
    batch_symbol = _batch_axis(_data_inputs(model))[0]
    bound, batch_size, batch_inputs = _bind_dims(model, name, batch, dict(dims or {}))
    model, shapes, known = _fold_until_stable(model, opset, name)
    graph = _build_graph(model, shapes, known, name, digest, opset, bound, batch_size,
                         batch_inputs)
    graph.batch_symbol = batch_symbol
    return graph


# --------------------------------------------------------------------------- loading


def _default_opset(model: onnx.ModelProto, name: str) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            if entry.version < MIN_OPSET:
                raise ModelError(
                    f"{name}: opset {entry.version} is older than shardplan plans "
                    f"(>= {MIN_OPSET}); re-export with opset_version={MIN_OPSET} or newer"
                )
            newest = onnx.defs.onnx_opset_version()
            if entry.version > newest:
                raise ModelError(
                    f"{name}: opset {entry.version} is newer than the installed onnx package "
                    f"knows ({newest}); upgrade onnx or re-export with opset_version={newest} "
                    "or older"
                )
            return int(entry.version)
    raise ModelError(f"{name}: the model imports no default ONNX opset; re-export it")


def _inline_functions(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Dynamo exports may wrap ops in local functions; plan the ops inside them."""
    if not model.functions:
        return model
    try:
        import onnx.inliner

        return onnx.inliner.inline_local_functions(model)
    except Exception as exc:
        raise ModelError(f"{name}: cannot inline the model's local functions ({exc})") from None


def _reject_control_flow(model: onnx.ModelProto, name: str) -> None:
    found = sorted({n.op_type for n in model.graph.node if n.op_type in UNSUPPORTED_CONTROL_FLOW})
    if found:
        raise ModelError(
            f"{name}: control-flow ops {', '.join(found)} cannot be planned (their trip counts "
            "and branches are data-dependent); export the model without them, e.g. unroll loops"
        )


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique, stable name: plans and errors refer to ops by name.

    The k-th repeat of a name gets the first free suffix `_k`; the next suffix to try is
    kept per name, so a graph whose 100k nodes share one name stays linear, not quadratic.
    """
    seen: set[str] = set()
    next_suffix: dict[str, int] = {}
    for index, node in enumerate(model.graph.node):
        base = node.name or f"{node.op_type}_{index}"
        unique = base
        if unique in seen:
            suffix = next_suffix.get(base, 1)
            while f"{base}_{suffix}" in seen:
                suffix += 1
            unique = f"{base}_{suffix}"
            next_suffix[base] = suffix + 1
        node.name = unique
        seen.add(unique)


# --------------------------------------------------------------------------- binding


def _data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def _bind_dims(
    model: onnx.ModelProto, name: str, batch: int | None, dims: dict[str, int]
) -> tuple[dict[str, int], int | None, dict[str, int]]:
    """Replace symbolic input dims by the user's values; error listing every unbound one."""
    for key, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise ModelError(f"{name}: --dim {key}={value}: a dim must be a positive integer")
    if batch is not None and batch < 1:
        raise ModelError(f"{name}: --batch {batch}: the batch size must be a positive integer")
    inputs = _data_inputs(model)
    batch_symbol, static_batch = _batch_axis(inputs)
    used = {d.dim_param for v in inputs for d in _shape_dims(v) if not d.HasField("dim_value")}
    batch_inputs = {v.name: 0 for v in inputs if _leading_dim(v) in (batch_symbol, static_batch)
                    and _leading_dim(v) is not None}
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
        raise ModelError(f"{name}: unbound symbolic dims: " + "; ".join(unbound))
    extra = sorted(k for k in dims if k not in used)
    if extra:
        raise ModelError(f"{name}: --dim names no input dim: {', '.join(extra)}")
    batch_size = bound.get(batch_symbol) if batch_symbol is not None else static_batch
    for value in list(model.graph.output) + list(model.graph.value_info):
        _forget_symbolic_dims(value)
    del model.graph.value_info[:]
    return {k: v for k, v in bound.items() if k in used}, batch_size, batch_inputs


def _batch_axis(inputs: list[onnx.ValueInfoProto]) -> tuple[str | None, int | None]:
    """The batch is dim 0 of the first data input: its symbol, or its static size."""
    for value in inputs:
        shape = _shape_dims(value)
        if shape:
            first = shape[0]
            if first.HasField("dim_value"):
                return None, int(first.dim_value)
            return first.dim_param or None, None
    return None, None


def _leading_dim(value: onnx.ValueInfoProto) -> str | int | None:
    shape = _shape_dims(value)
    if not shape:
        return None
    return int(shape[0].dim_value) if shape[0].HasField("dim_value") else shape[0].dim_param


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


# --------------------------------------------------------------------------- folding


def _fold_until_stable(
    model: onnx.ModelProto, opset: int, name: str
) -> tuple[onnx.ModelProto, dict[str, tuple[tuple[int, ...] | None, int]], dict[str, np.ndarray]]:
    """Alternate shape inference and folding: each fold can make more shapes static.

    Returns the folded model, every tensor's shape and the known constant values.
    """
    known = _known_initializer_values(model)
    shapes: dict[str, tuple[tuple[int, ...] | None, int]] = {}
    for _ in range(MAX_FOLD_ROUNDS):
        model = _infer(model, name)
        shapes = _collect_shapes(model)
        folded = _fold_once(model, known, shapes, opset)
        lowered = _lower_sequences(model, known, shapes)
        if not (folded or lowered):
            break
    _remove_dead_nodes(model)
    return model, shapes, known


def _infer(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    del model.graph.value_info[:]
    try:
        return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"{name}: ONNX shape inference failed: {message}; check the bound dims "
            "(--batch, --dim) and that the file is a valid export"
        ) from None


def _collect_shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """name -> (static shape or None when any dim is unknown, onnx elem type)."""
    shapes: dict[str, tuple[tuple[int, ...] | None, int]] = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(
        model.graph.output
    ):
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        shape: tuple[int, ...] | None = None
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                shape = tuple(int(d.dim_value) for d in dims)
        previous = shapes.get(value.name)
        if previous is None or previous[0] is None:
            shapes[value.name] = (shape, tensor_type.elem_type)
    for init in model.graph.initializer:
        shapes[init.name] = (tuple(int(d) for d in init.dims), init.data_type)
    return shapes


def _has_inline_data(tensor: onnx.TensorProto) -> bool:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    numel = math.prod(tensor.dims)  # exact: int64 products of corrupt dims wrap around
    return numel == 0 or bool(
        tensor.raw_data or tensor.float_data or tensor.int32_data or tensor.int64_data
        or tensor.double_data or tensor.uint64_data or tensor.string_data
    )


def _known_initializer_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Values the folder may use: integer/bool initializers and float scalars.

    Float tensors with more than one element are parameters: folding through them would
    turn a weight into a constant, so they are never treated as known.
    """
    known: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        numel = math.prod(init.dims)
        dtype = _ONNX_TO_NUMPY.get(init.data_type, "")
        if numel > FOLD_LIMIT_ELEMENTS or not _has_inline_data(init):
            continue
        if dtype in FLOAT_DTYPES and numel > 1:
            continue
        try:
            known[init.name] = numpy_helper.to_array(init)
        except Exception:
            continue
    return known


def _fold_once(
    model: onnx.ModelProto,
    known: dict[str, np.ndarray],
    shapes: dict[str, tuple[tuple[int, ...] | None, int]],
    opset: int,
) -> bool:
    """Evaluate every node whose inputs are known; return whether anything folded."""
    folded_any = False
    kept: list[onnx.NodeProto] = []
    new_initializers: list[onnx.TensorProto] = []
    for node in model.graph.node:
        values = _try_fold(node, known, shapes, opset)
        if values is None:
            kept.append(node)
            continue
        folded_any = True
        for output, value in zip(node.output, values, strict=False):
            if output:
                known[output] = value
                new_initializers.append(numpy_helper.from_array(value, output))
    if folded_any:
        del model.graph.node[:]
        model.graph.node.extend(kept)
        model.graph.initializer.extend(new_initializers)
    return folded_any


def _try_fold(
    node: onnx.NodeProto,
    known: dict[str, np.ndarray],
    shapes: dict[str, tuple[tuple[int, ...] | None, int]],
    opset: int,
) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC_OPS:
        return None
    if node.op_type in ("Shape", "Size"):
        return _fold_shape_query(node, shapes)
    if any(name and name not in known for name in node.input):
        return None
    if node.op_type == "Constant":  # its value is in the proto already, whatever its size
        return _evaluate(node, {}, opset)
    for output in node.output:
        shape = shapes.get(output, (None, 0))[0]
        if shape is not None and math.prod(shape) > FOLD_LIMIT_ELEMENTS:
            return None
    arrays = _evaluate(node, {name: known[name] for name in node.input if name}, opset)
    if arrays is None or any(a.size > FOLD_LIMIT_ELEMENTS for a in arrays):
        return None
    return arrays


def _evaluate(
    node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int
) -> list[np.ndarray] | None:
    """Run one node with ONNX's reference evaluator; None when it cannot."""
    try:
        results = run_node(node, feeds, opset)
    except Exception:
        return None
    arrays = [np.asarray(r) for r in results]
    return None if any(a.dtype == object for a in arrays) else arrays


def _fold_shape_query(
    node: onnx.NodeProto, shapes: dict[str, tuple[tuple[int, ...] | None, int]]
) -> list[np.ndarray] | None:
    shape = shapes.get(node.input[0], (None, 0))[0]
    if shape is None:
        return None
    if node.op_type == "Size":
        size = math.prod(shape)
        return [np.array(size, dtype=np.int64)] if 0 <= size < 1 << 63 else None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return [np.array(shape[start:end], dtype=np.int64)]


def _lower_sequences(
    model: onnx.ModelProto,
    known: dict[str, np.ndarray],
    shapes: Mapping[str, tuple[tuple[int, ...] | None, int]],
) -> bool:
    """Turn SplitToSequence + SequenceAt (constant positions) into a plain Split.

    Dynamo's train-mode exports split tensors this way; sequences are not tensors and
    cannot be planned, but a split read at constant positions is just a Split.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    changed = False
    replaced: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        readers = consumers.get(node.output[0], [])
        positions = [known.get(r.input[1]) if len(r.input) > 1 else None for r in readers]
        shape = shapes.get(node.input[0], (None, 0))[0]
        split = known.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if (not readers or shape is None or any(r.op_type != "SequenceAt" for r in readers)
                or any(p is None for p in positions)):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        axis = int(attrs.get("axis", 0)) % len(shape)
        sizes = _split_sizes(shape[axis], split)
        if sizes is None:
            continue
        outputs = [f"{node.output[0]}__part{i}" for i in range(len(sizes))]
        for reader, position in zip(readers, positions, strict=True):
            outputs[int(np.asarray(position).reshape(-1)[0]) % len(sizes)] = reader.output[0]
        sizes_name = f"{node.output[0]}__sizes"
        known[sizes_name] = np.array(sizes, dtype=np.int64)
        model.graph.initializer.append(numpy_helper.from_array(known[sizes_name], sizes_name))
        squeeze = split is None and not int(attrs.get("keepdims", 1))
        lowered = onnx.helper.make_node("Split", [node.input[0], sizes_name],
                                        [o + "__kept" if squeeze else o for o in outputs],
                                        name=node.name, axis=axis)
        replaced[node.name] = lowered
        if squeeze:
            axes_name = f"{node.output[0]}__axis"
            known[axes_name] = np.array([axis], dtype=np.int64)
            model.graph.initializer.append(numpy_helper.from_array(known[axes_name], axes_name))
            for out in outputs:
                model.graph.node.append(onnx.helper.make_node(
                    "Squeeze", [out + "__kept", axes_name], [out], name=f"{out}/squeeze"))
        for reader in readers:
            replaced[reader.name] = None  # type: ignore[assignment]
        changed = True
    if changed:
        nodes = []
        for node in model.graph.node:
            if node.name not in replaced:
                nodes.append(node)
            elif replaced[node.name] is not None:
                nodes.append(replaced[node.name])
        del model.graph.node[:]
        model.graph.node.extend(_topological(nodes))
    return changed


def _split_sizes(length: int, split: np.ndarray | None) -> list[int] | None:
    if split is None:
        return [1] * length
    values = np.asarray(split).reshape(-1)
    if np.asarray(split).ndim == 0:
        chunk = int(values[0])
        if chunk <= 0:
            return None
        return [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
    return [int(v) for v in values]


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Order nodes so producers come first (lowering appends nodes at the end)."""
    produced = {o: i for i, n in enumerate(nodes) for o in n.output}
    order: list[onnx.NodeProto] = []
    state: dict[int, int] = {}

    def visit(index: int) -> None:
        stack = [(index, False)]
        while stack:
            current, done = stack.pop()
            if done:
                state[current] = 2
                order.append(nodes[current])
                continue
            if state.get(current):
                continue
            state[current] = 1
            stack.append((current, True))
            for name in nodes[current].input:
                producer = produced.get(name)
                if producer is not None and not state.get(producer):
                    stack.append((producer, False))

    for index in range(len(nodes)):
        if not state.get(index):
            visit(index)
    return order


def _remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drop nodes no graph output depends on (e.g. folded shape chains' leftovers).

    One walk back from the outputs, linear in the graph: peeling dead nodes a layer at a
    time would take one pass per node of a dead chain (quadratic, minutes at 100k nodes).
    """
    graph_outputs = {o.name for o in model.graph.output}
    everything = list(model.graph.node)
    producer = {out: i for i, node in enumerate(everything) for out in node.output if out}
    live: set[int] = set()
    stack = [producer[name] for name in graph_outputs if name in producer]
    while stack:
        index = stack.pop()
        if index in live:
            continue
        live.add(index)
        stack.extend(producer[name] for name in everything[index].input
                     if name in producer and producer[name] not in live)
    nodes = [node for i, node in enumerate(everything) if i in live]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input} | graph_outputs
    live_inits = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(live_inits)


# --------------------------------------------------------------------------- building


def _build_graph(
    model: onnx.ModelProto,
    shapes: dict[str, tuple[tuple[int, ...] | None, int]],
    known: dict[str, np.ndarray],
    name: str,
    digest: str,
    opset: int,
    bound: dict[str, int],
    batch: int | None,
    batch_inputs: dict[str, int],
) -> PlanningGraph:
    graph = model.graph
    tensors: dict[str, TensorInfo] = {}
    initializer_kinds = _classify_initializers(model, known)
    for init in graph.initializer:
        value = known.get(init.name)
        tensors[init.name] = TensorInfo(
            name=init.name,
            shape=tuple(int(d) for d in init.dims),
            dtype=_dtype_name(init.data_type, name, init.name),
            kind=initializer_kinds[init.name],
            value=value if value is not None and value.size <= FOLD_LIMIT_ELEMENTS else None,
        )
    for value in _data_inputs(model):
        shape, elem = shapes.get(value.name, (None, 0))
        if shape is None:
            raise ModelError(f"{name}: input {value.name} has no static shape after binding")
        tensors[value.name] = TensorInfo(value.name, shape, _dtype_name(elem, name, value.name),
                                         "input")
    used = {i for node in graph.node for i in node.input if i}
    graph_outputs = [o.name for o in graph.output]
    ops: list[OpNode] = []
    problems: list[str] = []
    for node in graph.node:
        outputs: list[str] = []
        for output in node.output:
            shape, elem = shapes.get(output, (None, 0)) if output else (None, 0)
            if not output or (shape is None and output not in used and output not in graph_outputs):
                outputs.append("")  # an unused optional output (Dropout mask, LN statistics)
                continue
            if shape is None or elem == 0:
                problems.append(f"{output} (output of {node.name}, {node.op_type})")
                continue
            tensors[output] = TensorInfo(output, shape, _dtype_name(elem, name, output),
                                         "activation", producer=node.name)
            outputs.append(output)
        attrs = _node_attributes(node, name, opset)
        ops.append(OpNode(node.name, node.op_type, node.domain, tuple(node.input),
                          tuple(outputs), attrs))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5
                                           else "")
        raise ModelError(
            f"{name}: shapes could not be made static for: {shown}. Bind every symbolic dim "
            "(--batch, --dim) and check for custom ops whose shapes ONNX cannot infer"
        )
    missing = [t for node in ops for t in node.inputs if t and t not in tensors]
    if missing:
        raise ModelError(f"{name}: tensor {missing[0]} is used but never defined (dangling input)")
    if not ops:
        raise ModelError(f"{name}: no op computes the graph's outputs ({', '.join(graph_outputs)}"
                         "): they are inputs or constants, so there is nothing to plan")
    _check_sizes(tensors, name)
    for node in ops:
        for tensor in node.inputs:
            if tensor:
                tensors[tensor].consumers.append(node.name)
        cost_op(node, tensors)
    planning = PlanningGraph(
        path=name, sha256=digest, opset=opset, bound_dims=bound, batch=batch,
        batch_inputs=batch_inputs, ops=ops, tensors=tensors,
        inputs=[v.name for v in _data_inputs(model)], outputs=graph_outputs,
    )
    _check_topological(planning)
    return planning


def _check_sizes(tensors: Mapping[str, TensorInfo], model_name: str) -> None:
    """Refuse negative dims and tensors too large to count exactly (corrupt or mistyped
    dims): sizes, bytes and FLOPs would silently wrap around or lose precision."""
    for tensor in tensors.values():
        if any(d < 0 for d in tensor.shape):
            raise ModelError(f"{model_name}: tensor {tensor.name} has a negative dim (shape "
                             f"{list(tensor.shape)}); the file is corrupt: re-export it")
        if math.prod(tensor.shape) > MAX_TENSOR_ELEMENTS:
            raise ModelError(
                f"{model_name}: tensor {tensor.name} of shape {list(tensor.shape)} has more "
                f"than 2**53 elements, beyond what shardplan counts exactly; check the bound "
                "dims (--batch, --dim) and the shapes stored in the model"
            )


def _classify_initializers(
    model: onnx.ModelProto, known: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """Float initializers consumed by ops are parameters, except state and constants.

    Values the folder produced or could read (integers, scalars, Constant nodes) are
    constants; batch-norm running statistics are buffers: stored, but never trained.
    """
    buffer_uses: set[str] = set()
    for node in model.graph.node:
        for slot in BUFFER_INPUT_SLOTS.get(node.op_type, ()):
            if slot < len(node.input) and node.input[slot]:
                buffer_uses.add(node.input[slot])
    kinds: dict[str, str] = {}
    for init in model.graph.initializer:
        dtype = _ONNX_TO_NUMPY.get(init.data_type, "")
        numel = math.prod(init.dims)
        if dtype not in FLOAT_DTYPES or numel <= 1 or init.name in known:
            kinds[init.name] = "constant"
        elif init.name in buffer_uses or BUFFER_NAME.search(init.name):
            kinds[init.name] = "buffer"
        else:
            kinds[init.name] = "parameter"
    return kinds


def _dtype_name(elem_type: int, model_name: str, tensor: str) -> str:
    dtype = _ONNX_TO_NUMPY.get(elem_type)
    if dtype is None:
        try:
            type_name = onnx.TensorProto.DataType.Name(elem_type) if elem_type else "unknown"
        except ValueError:  # a number no ONNX version defines (a corrupt file)
            type_name = f"number {elem_type} (not an ONNX type)"
        raise ModelError(
            f"{model_name}: tensor {tensor} has element type {type_name}, which shardplan "
            "cannot plan; export with float/int tensors"
        )
    return dtype


def _node_attributes(node: onnx.NodeProto, model_name: str, opset: int) -> dict[str, object]:
    """The node's attributes as Python values; a corrupt one names the node and attribute.

    Types are checked against the op's ONNX schema: the sharding rules read `axis` or
    `perm` as the type ONNX defines, and shape inference does not refuse a wrong one.
    """
    expected = _attribute_types(node.op_type, opset) if node.domain in ("", "ai.onnx") else {}
    attrs: dict[str, object] = {}
    for attribute in node.attribute:
        want = expected.get(attribute.name)
        if want is not None and attribute.type != want:
            raise ModelError(
                f"{model_name}: node {node.name} ({node.op_type}) attribute {attribute.name} "
                f"is {_attribute_type_name(attribute.type)}, but ONNX defines it as "
                f"{_attribute_type_name(want)}; the file is corrupt or hand-edited: re-export it"
            )
        try:
            attrs[attribute.name] = _attribute_value(attribute)
        except Exception as exc:  # onnx raises TypeError/ValueError/RuntimeError for these
            raise ModelError(
                f"{model_name}: node {node.name} ({node.op_type}) attribute {attribute.name} "
                f"cannot be read ({exc}); the file is corrupt or hand-edited: re-export it"
            ) from None
    return attrs


@cache
def _attribute_types(op_type: str, opset: int) -> dict[str, int]:
    """Attribute name -> AttributeProto type of a default-domain op; {} when unknown."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return {}
    return {name: int(attr.type) for name, attr in schema.attributes.items()}


def _attribute_type_name(kind: int) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(kind)
    except ValueError:
        return f"type number {kind}"


def _attribute_value(attribute: onnx.AttributeProto):
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value) if _has_inline_data(value) else None
    if isinstance(value, list | tuple):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    if isinstance(value, onnx.GraphProto | onnx.TypeProto | onnx.SparseTensorProto):
        return None
    return value


def _check_topological(graph: PlanningGraph) -> None:
    defined = set(graph.inputs) | {t.name for t in graph.tensors.values() if t.producer is None}
    for node in graph.ops:
        for tensor in node.inputs:
            if tensor and tensor not in defined:
                raise ModelError(
                    f"{graph.path}: node {node.name} reads {tensor} before it is produced "
                    "(the graph has a cycle or is not topologically sorted)"
                )
        defined.update(o for o in node.outputs if o)
