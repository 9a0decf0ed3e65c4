"""Everything a PlanningGraph says, as plain comparable values (numpy arrays by dtype, shape
and bytes), so that two graphs can be compared field by field with `==`."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.graph import PlanningGraph


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("scalar", str(value.dtype), value.tobytes())
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def graph_facts(graph: PlanningGraph) -> dict[str, Any]:
    """Ops (with attributes, FLOPs and bytes), tensors (with values), dims and batch fields,
    path, digest, opset and warnings: all of `graph` but its retained source."""
    return {
        "path": graph.path, "sha256": graph.sha256, "opset": graph.opset,
        "bound_dims": _plain(graph.bound_dims), "batch": graph.batch,
        "batch_inputs": graph.batch_inputs, "batch_symbol": graph.batch_symbol,
        "inputs": graph.inputs, "outputs": graph.outputs, "warnings": graph.warnings,
        "ops": [(op.name, op.op_type, op.domain, op.inputs, op.outputs, _plain(op.attrs),
                 op.flops, op.bytes_read, op.bytes_written, op.is_view) for op in graph.ops],
        "tensors": [(t.name, t.shape, t.dtype, t.kind, t.producer, t.consumers,
                     _plain(t.value)) for t in graph.tensors.values()],
    }
