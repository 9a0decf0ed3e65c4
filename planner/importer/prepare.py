"""Prepare a loaded model for binding: check its opset, inline its local functions and
ONNX's loss functions (`functions.py`), refuse control flow and give every node a unique
name. What comes out is what a `ModelSource`
keeps: everything that does not depend on the bound dims."""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from planner.errors import ModelError
from planner.importer.functions import expand_losses
from planner.importer.order import sort_nodes

#: Op semantics changed up to opset 13 (Softmax axis, Split/Unsqueeze/Reduce axes as inputs).
MIN_OPSET = 13
UNSUPPORTED_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def prepare(model: onnx.ModelProto, name: str) -> tuple[onnx.ModelProto, int]:
    """The prepared model (nodes renamed in place, or a new model when functions were
    inlined) and its default-domain opset."""
    opset = _default_opset(model, name)
    model = _inline_functions(model, name)
    model = expand_losses(model, opset, name)
    _reject_control_flow(model, name)
    _name_nodes(model)
    sort_nodes(model, name)
    return model, opset


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


#: Nodes the local functions may expand to: four times the ops the planner plans
#: (`planner.api.MAX_PLANNED_OPS`), room for what folding removes. A function calling
#: another twice, forty deep, is a 3 KB file of 2^40 nodes: counted first, not inlined.
MAX_INLINED_NODES = 1_000_000

FunctionKey = tuple[str, str, str]  # domain, name, overload


def _inline_functions(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Dynamo exports may wrap ops in local functions; plan the ops inside them, once
    their expanded size is known to be bounded (`inlined_nodes`)."""
    if not model.functions:
        return model
    inlined_nodes(model, name)
    try:
        import onnx.inliner

        return onnx.inliner.inline_local_functions(model)
    except Exception as exc:
        raise ModelError(f"{name}: cannot inline the model's local functions ({exc})") from None


def inlined_nodes(model: onnx.ModelProto, name: str) -> int:
    """How many nodes the graph has with its local functions inlined (subgraphs
    included), counted per function once; a function that calls itself, or an expansion
    past MAX_INLINED_NODES, is refused naming the function."""
    functions = {_function_key(f): f for f in model.functions}
    sizes: dict[FunctionKey, int] = {}
    calling: list[FunctionKey] = []

    def spelled(key: FunctionKey) -> str:
        return ".".join(part for part in key[:2] if part) + (f" ({key[2]})" if key[2] else "")

    def size_of(key: FunctionKey) -> int:
        if key not in sizes:
            if key in calling:
                cycle = " -> ".join(spelled(k) for k in calling[calling.index(key):])
                raise ModelError(f"{name}: local function {spelled(key)} calls itself "
                                 f"({cycle} -> {spelled(key)}); ONNX functions cannot recurse: "
                                 "re-export the model")
            calling.append(key)
            sizes[key] = nodes_in(functions[key].node)
            calling.pop()
            if sizes[key] > MAX_INLINED_NODES:
                raise ModelError(
                    f"{name}: local function {spelled(key)} expands to {sizes[key]:,} nodes "
                    f"once inlined, more than shardplan plans ({MAX_INLINED_NODES:,}); "
                    "check the file, or plan a model with fewer layers")
        return sizes[key]

    def nodes_in(nodes: Sequence[onnx.NodeProto]) -> int:
        total = 0
        for node in nodes:
            key = _call_key(node)
            total += size_of(key) if key in functions else 1
            for attribute in node.attribute:
                for graph in (*((attribute.g,) if attribute.HasField("g") else ()),
                              *attribute.graphs):
                    total += nodes_in(graph.node)
            if total > MAX_INLINED_NODES:
                return total  # past the bound: the sum is not needed exactly
        return total

    total = nodes_in(model.graph.node)
    if total > MAX_INLINED_NODES:
        raise ModelError(f"{name}: its local functions expand the graph to more than "
                         f"{MAX_INLINED_NODES:,} nodes once inlined; check the file, or plan "
                         "a model with fewer layers")
    return total


def _function_key(function: onnx.FunctionProto) -> FunctionKey:
    return function.domain, function.name, getattr(function, "overload", "")


def _call_key(node: onnx.NodeProto) -> FunctionKey:
    return node.domain, node.op_type, getattr(node, "overload", "")


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
