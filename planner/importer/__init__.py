"""Import an ONNX file into a PlanningGraph without reading weight data, and bind other
dims of an imported graph without the file.

One job per module, in the order they run: `load` reads the proto (external data left on
disk, or absent) and refuses unsafe or inconsistent files; `prepare` checks the opset,
inlines local functions, refuses control flow and names the nodes; `source` keeps the
prepared model (`ModelSource`, the graph's `source`); `bind` binds the symbolic dims;
`fold` alternates ONNX shape inference with constant folding until the exporters' shape
arithmetic has become constants; `build` makes the PlanningGraph of what is left, tensor
ops with static shapes costed by the op registry (`planner.ops.cost_op`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import onnx

from planner.errors import ModelError
from planner.graph import DEFAULT_CAPACITY_FACTOR, PlanningGraph
from planner.importer.bind import bind_dims, binding_key, check_binding, check_capacity_factor
from planner.importer.build import build_graph
from planner.importer.fold import fold_until_stable
from planner.importer.load import load_onnx
from planner.importer.prepare import prepare
from planner.importer.source import ModelSource
from planner.ops import cost_op

__all__ = ["ModelSource", "import_model", "rebind", "retyped"]


def import_model(
    path: str | os.PathLike,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> PlanningGraph:
    """Load `path` and return its planning graph with every dim bound and folded;
    `capacity_factor` sizes the token selections of mixture-of-experts routers."""
    check_capacity_factor(str(path), capacity_factor)
    model, digest = load_onnx(path)
    name = str(path)
    model, opset = prepare(model, name)
    source = ModelSource.retain(model, name, digest, opset)
    return _bound_graph(source, model, batch, dims or {}, capacity_factor)


def rebind(
    graph: PlanningGraph,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    capacity_factor: float | None = None,
) -> PlanningGraph:
    """`graph`'s model with other dims bound, from its retained source (no file access).

    Dims not given keep `graph`'s values, except its batch symbol when `batch` is given;
    the capacity factor, unless given, too.
    The result, or the error, is what `import_model(graph.path, batch=batch, dims=...)`
    with those dims gives; each binding is folded once per source, and binding `graph`'s
    own dims returns `graph`.
    """
    given = dict(dims or {})
    kept = {name: value for name, value in graph.bound_dims.items() if name not in given
            and not (batch is not None and name == graph.batch_symbol)}
    wanted = {**given, **kept}
    check_binding(graph.path, batch, wanted)
    factor = graph.capacity_factor if capacity_factor is None else capacity_factor
    check_capacity_factor(graph.path, factor)
    if _binds_as(graph, batch, wanted) and factor == graph.capacity_factor:
        return graph
    if not isinstance(graph.source, ModelSource):
        raise ModelError(
            f"{graph.path}: this planning graph keeps no model to bind other dims with (it "
            "was not made by import_model); import the model file with the dims wanted"
        )
    source = graph.source
    bound = _bound_graph(source, source.model(), batch, wanted, factor)
    return retyped(bound, graph.float_dtype) if graph.float_dtype else bound


def retyped(graph: PlanningGraph, float_dtype: str) -> PlanningGraph:
    """`graph` as a training precision stores it: every float tensor in `float_dtype`,
    FLOPs and bytes counted again (an fp32 export trained in bf16 moves half the bytes).
    Returns `graph` itself when nothing changes."""
    if all(t.dtype == float_dtype for t in graph.tensors.values() if t.is_float):
        return graph if graph.float_dtype == float_dtype or graph.float_dtype is None \
            else replace(graph, float_dtype=float_dtype)
    tensors = {name: replace(t, dtype=float_dtype, consumers=list(t.consumers))
               if t.is_float else t for name, t in graph.tensors.items()}
    ops = [replace(node, attrs=dict(node.attrs)) for node in graph.ops]
    for node in ops:
        cost_op(node, tensors)
    return replace(graph, ops=ops, tensors=tensors, float_dtype=float_dtype)


def _bound_graph(source: ModelSource, model: onnx.ModelProto, batch: int | None,
                 dims: Mapping[str, int], capacity_factor: float) -> PlanningGraph:
    """Bind `model` (a fresh copy of `source`'s) and fold and build it, unless `source`
    has its graph at that binding already."""
    bound = bind_dims(model, source.path, batch, dims)
    key = (bound.key, capacity_factor)
    graph = source.graphs.get(key)
    if graph is None:
        folded = fold_until_stable(model, source.opset, source.path, capacity_factor)
        graph = build_graph(folded, source, bound, capacity_factor)
        source.graphs[key] = graph
    return graph


def _binds_as(graph: PlanningGraph, batch: int | None, dims: Mapping[str, int]) -> bool:
    """Whether `batch` and `dims` are the binding `graph` has."""
    if batch is not None and graph.batch_symbol is not None:
        dims = {graph.batch_symbol: batch, **dims}
    return ((batch is None or batch == graph.batch)
            and binding_key(dims) == binding_key(graph.bound_dims))
