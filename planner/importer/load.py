"""Read an ONNX file's graph proto without its weight data, and refuse unsafe or
inconsistent files: string fields that are not text, external-data paths leading out of
the model's folder, tensors defined twice or never."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import onnx
from google.protobuf.message import DecodeError, Message

from planner.errors import ModelError


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
    """Every tensor of the model: initializers, attribute tensors, subgraphs, functions,
    and the graphs of `training_info` (its initialization and algorithm: ONNX's loader
    reads their external data too)."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)
    for info in model.training_info:
        yield from _graph_tensors(info.initialization)
        yield from _graph_tensors(info.algorithm)


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
