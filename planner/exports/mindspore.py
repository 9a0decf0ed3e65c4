"""The plan as MindSpore's strategy checkpoint (`shardplan export --format mindspore`)."""

from __future__ import annotations

from typing import Any

from planner.plans.model import Plan
from planner.sharding.convert import flat_form, to_mindspore_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


def _nested_tensor_map(layout: Layout, mesh: DeviceMesh, what: str) -> list[list[int]]:
    """Layout-object form of a tensor map: one list per dim ([-1] when not split)."""
    flat = to_mindspore_layout(layout, mesh, what).tensor_map
    return [list(e) if isinstance(e, tuple) else [e] for e in flat]


def to_mindspore_checkpoint(plan: Plan) -> dict[str, Any]:
    """The plan as the JSON form of MindSpore's strategy checkpoint, for tools that read it.

    Keys follow MindSpore's `StrategyCheckpointInfo::to_json` (frontend/parallel/
    strategy_checkpoint): "current_stage"; "parallel_strategy_item" {op: {"stage",
    "parallel_strategy"}}; "parallel_layout_item" {parameter: {"dev_matrix", "tensor_map",
    "tensor_shape", "field", "opt_weight_shard_step", "opt_weight_shard_size"}};
    "parallel_layout_value_item" {op: {"0": {"dev_matrix", "tensor_map" (one list per dim),
    "interleaved_parallel", "alias_name"}, ...}}.

    Differences from a file MindSpore wrote, by necessity: ops and parameters are keyed by
    their ONNX names (MindSpore uses its own graph's names); each op's strategy lists its
    present ONNX inputs in order (non-data inputs such as a Reshape's shape as all-ones);
    there is one pipeline stage, no optimizer (ZeRO) weight sharding and no field split, so
    "field", "opt_weight_shard_*" are 0 and "param_split_shape"/"indices_offset" are absent.
    A parameter whose dim is split by mesh axes that are not neighbours in mesh order has no
    flat tensor map: its "tensor_map" is then the nested, one-list-per-dim form.
    """
    mesh = plan.mesh
    strategies: dict[str, Any] = {}
    layout_values: dict[str, Any] = {}
    for op in plan.ops:
        bound = [(i, b) for i, b in enumerate(op.inputs) if b is not None]
        if not bound:
            continue
        strategies[op.name] = {
            "stage": 0,
            "parallel_strategy": [list(b.layout.split_factors(mesh)) for _, b in bound],
        }
        if any(not b.layout.is_replicated for _, b in bound):
            layout_values[op.name] = {
                str(position): {
                    "dev_matrix": list(mesh.shape),
                    "tensor_map": _nested_tensor_map(
                        b.layout, mesh, f"op {op.name} input {b.tensor}"),
                    "interleaved_parallel": False,
                    "alias_name": list(mesh.axis_names),
                }
                for position, (_, b) in enumerate(bound)
            }
    parameters: dict[str, Any] = {}
    for name, entry in plan.tensors.items():
        if entry.kind != "parameter":
            continue
        ms_layout = to_mindspore_layout(entry.layout, mesh, f"parameter {name}")
        flat = flat_form(entry.layout, mesh)
        dev_matrix, tensor_map = flat if flat else (
            list(ms_layout.dev_matrix), _nested_tensor_map(entry.layout, mesh, f"parameter {name}"))
        parameters[name] = {
            "dev_matrix": dev_matrix,
            "tensor_map": tensor_map,
            "tensor_shape": list(entry.shape),
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
        }
    result: dict[str, Any] = {"current_stage": 0, "parallel_strategy_item": strategies,
                              "parallel_layout_item": parameters}
    if layout_values:
        result["parallel_layout_value_item"] = layout_values
    return result
