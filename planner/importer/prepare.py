"""Prepare a loaded model for binding: check its opset, inline its local functions and
ONNX's loss functions (`functions.py`), refuse control flow and give every node a unique
name. What comes out is what a `ModelSource`
keeps: everything that does not depend on the bound dims."""

from __future__ import annotations

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
