"""Run ONNX graphs and local programs node by node with torch ops.

Interpreting the graph (rather than converting it to a torch module once) lets the
executor run exactly the per-device programs the planner emitted, collectives included,
and keeps autograd intact: parameters passed in with requires_grad get gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import AttributeProto, helper, numpy_helper

from executor.ops import TORCH_OPS
from planner.errors import ModelError, ShardplanError
from planner.ops import SHARDPLAN_DOMAIN

Collective = Callable[[onnx.NodeProto, dict[str, torch.Tensor]], None]


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """Own a copy: numpy arrays from protobufs are read-only, torch wants writable memory.
    numpy has no bfloat16; ONNX's ml_dtypes one goes through float32 exactly."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def _no_collective(node: onnx.NodeProto, env: dict[str, torch.Tensor]) -> None:
    raise ShardplanError(f"node {node.name or node.output[0]!r} is a {node.domain} "
                         f"{node.op_type} collective; single-process run_nodes has no mesh "
                         f"to run it on: pass a `collective` callback")


def node_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """Attributes as Python values: strings decoded, tensors converted to torch."""
    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        if attr.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
            raise ShardplanError(f"node {node.name or node.output[0]!r} ({node.op_type}) has "
                                 f"a subgraph attribute; control flow is not supported")
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, onnx.TensorProto):
            value = to_tensor(numpy_helper.to_array(value))
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        attrs[attr.name] = value
    attrs["_outputs"] = len(node.output)
    return attrs


def run_nodes(nodes: list[onnx.NodeProto], env: dict[str, torch.Tensor],
              collective: Collective = _no_collective,
              extra_attrs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Execute nodes in order, reading inputs from and writing outputs into env.

    `extra_attrs` adds attributes by op type, for what the run knows and the node does not
    (a Dropout's `_site`: where its mask is drawn, `executor.dropout`)."""
    for node in nodes:
        if node.domain == SHARDPLAN_DOMAIN:
            collective(node, env)
            continue
        label = f"{node.name or node.output[0]!r} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            raise ShardplanError(f"node {label}: domain {node.domain!r} is not supported by "
                                 f"the torch executor")
        fn = TORCH_OPS.get(node.op_type)
        if fn is None:
            raise ShardplanError(f"node {label}: op type {node.op_type!r} is not supported by "
                                 f"the torch executor")
        inputs: list[torch.Tensor | None] = []
        for name in node.input:
            if not name:
                inputs.append(None)
            elif name in env:
                inputs.append(env[name])
            else:
                raise ShardplanError(f"node {label}: input {name!r} has no value (not fed, "
                                     f"not an initializer, not computed earlier)")
        try:
            attrs = node_attrs(node)
            if extra_attrs and node.op_type in extra_attrs:
                attrs.update(extra_attrs[node.op_type])
            outputs = fn(inputs, attrs)
        except ShardplanError as err:
            raise ShardplanError(f"node {label}: {err}") from err
        for name, value in zip(node.output, outputs, strict=False):
            if name:
                env[name] = value
        missing = [n for n in node.output[len(outputs):] if n]
        if missing:
            raise ShardplanError(f"node {label}: outputs {missing} are not produced by the "
                                 f"torch executor")


def _load(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        return onnx.load(str(model))
    except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError) as err:  # type: ignore[attr-defined]
        raise ModelError(f"cannot read ONNX model {model}: {err}") from err


def run_graph(model: onnx.ModelProto | str | Path, feeds: Mapping[str, torch.Tensor],
              params: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Run a whole graph; `params` override initializers (e.g. tensors with requires_grad)
    and supply those stored as never-written external data."""
    proto = _load(model)
    graph = proto.graph
    params = params or {}
    env: dict[str, torch.Tensor] = {}
    for init in graph.initializer:
        if init.name in params:
            env[init.name] = params[init.name]
        elif init.data_location == onnx.TensorProto.EXTERNAL:
            raise ModelError(f"initializer {init.name!r} is external data that was not loaded; "
                             f"pass it in `params`")
        else:
            env[init.name] = to_tensor(numpy_helper.to_array(init))
    for name, value in params.items():
        env.setdefault(name, value)
    for value_info in graph.input:
        if value_info.name in feeds:
            env[value_info.name] = feeds[value_info.name]
        elif value_info.name not in env:
            raise ShardplanError(f"graph input {value_info.name!r} is not in feeds")
    run_nodes(list(graph.node), env)
    return {out.name: env[out.name] for out in graph.output}
