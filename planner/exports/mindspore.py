"""The plan as MindSpore's strategy checkpoint (`shardplan export --format mindspore`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.plans.model import Plan
from planner.plans.sections import OpEntry
from planner.plans.stagemesh import refuse_stage_meshes
from planner.sharding.convert import flat_form, to_mindspore_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


def _nested_tensor_map(layout: Layout, mesh: DeviceMesh, what: str) -> list[list[int]]:
    """Layout-object form of a tensor map: one list per dim ([-1] when not split)."""
    flat = to_mindspore_layout(layout, mesh, what).tensor_map
    return [list(e) if isinstance(e, tuple) else [e] for e in flat]


#: MindSpore's primitive for an ONNX op type, where the names differ (its strategy keys
#: begin with the primitive's name)
MINDSPORE_PRIMITIVES = {
    "Relu": "ReLU", "Gemm": "MatMul", "Conv": "Conv2D", "LayerNormalization": "LayerNorm",
    "BatchNormalization": "BatchNorm", "Gelu": "GeLU", "Erf": "Erf", "Tanh": "Tanh",
    "ReduceMean": "ReduceMean", "ReduceSum": "ReduceSum", "Concat": "Concat",
    "Transpose": "Transpose", "Softmax": "Softmax", "Cast": "Cast", "Where": "Select",
}
#: ops a weight passes through unchanged in kind before the op that splits it (MindSpore
#: looks through its Cast and Load the same way)
_WEIGHT_VIEWS = frozenset({"Cast", "Identity", "Transpose"})


def strategy_key(op_type: str, rank: int, parameter: str) -> str:
    """MindSpore's key for an op's strategy: primitive name, "_", the first parameter the
    op reads (`ExtractStrategyAndInit` in mindspore/ccsrc/frontend/parallel/step_parallel.cc:
    `strategy_key_name = prim->name() + "_" + param_names[0].first`). A MatMul over more
    than two dims is MindSpore's BatchMatMul."""
    name = MINDSPORE_PRIMITIVES.get(op_type, op_type)
    if op_type == "MatMul" and rank > 2:
        name = "BatchMatMul"
    return f"{name}_{parameter}"


def _parameter_read(plan: Plan, op: OpEntry, producers: Mapping[str, OpEntry]) -> str | None:
    """The first parameter `op` reads, directly or through a Cast/Transpose of it, by the
    module's name where the exporter renamed it."""
    for binding in op.inputs:
        tensor = binding.tensor if binding else None
        while tensor is not None:
            entry = plan.tensors.get(tensor)
            if entry is not None and entry.kind == "parameter":
                return entry.module_name(tensor)
            view = producers.get(tensor)
            if view is None or view.op_type not in _WEIGHT_VIEWS or not view.inputs \
                    or view.inputs[0] is None:
                break
            tensor = view.inputs[0].tensor
    return None


def to_mindspore_checkpoint(plan: Plan, name_prefix: str = "") -> dict[str, Any]:
    """The plan as the JSON form of MindSpore's strategy checkpoint, for tools that read it.

    Keys follow MindSpore's `StrategyCheckpointInfo::to_json` (frontend/parallel/
    strategy_checkpoint): "current_stage"; "parallel_strategy_item" {op: {"stage",
    "parallel_strategy"}}; "parallel_layout_item" {parameter: {"dev_matrix", "tensor_map",
    "tensor_shape", "field", "opt_weight_shard_step", "opt_weight_shard_size"}};
    "parallel_layout_value_item" {op: {"0": {"dev_matrix", "tensor_map" (one list per dim),
    "interleaved_parallel", "alias_name"}, ...}}.

    Ops are keyed as MindSpore keys them (`strategy_key`: "MatMul_w1", the primitive and
    the first weight it reads), so MindSpore loads the strategies into the same network;
    ops that read no weight have no key in MindSpore's checkpoint and none here.
    Parameters are keyed by their names (the module's, where the exporter renamed them),
    after `name_prefix`: MindSpore names a parameter by its cell path, so a network that
    holds the planned one as `self.net` knows `w1` as `net.w1` (prefix "net."), and its
    checkpoint keys `MatMul_net.w1`.
    Differences from a file MindSpore wrote, by necessity: each op's strategy lists its
    present ONNX inputs in order (non-data inputs such as a Reshape's shape as all-ones);
    there is one pipeline stage, no optimizer (ZeRO) weight sharding and no field split, so
    "field", "opt_weight_shard_*" are 0 and "param_split_shape"/"indices_offset" are absent.
    A parameter whose dim is split by mesh axes that are not neighbours in mesh order has no
    flat tensor map: its "tensor_map" is then the nested, one-list-per-dim form.
    """
    refuse_stage_meshes(plan.mesh, plan.pipeline, "the MindSpore export")
    mesh = plan.mesh
    producers = {b.tensor: op for op in plan.ops for b in op.outputs if b is not None}
    strategies: dict[str, Any] = {}
    layout_values: dict[str, Any] = {}
    for op in plan.ops:
        bound = [(i, b) for i, b in enumerate(op.inputs) if b is not None]
        parameter = _parameter_read(plan, op, producers)
        if not bound or parameter is None:
            continue
        rank = max(len(plan.tensors[b.tensor].shape) for _, b in bound)
        key = strategy_key(op.op_type, rank, name_prefix + parameter)
        if key in strategies:  # a second reader of one weight: MindSpore keeps the first
            continue
        strategies[key] = {
            "stage": 0,
            "parallel_strategy": [list(b.layout.split_factors(mesh)) for _, b in bound],
        }
        if any(not b.layout.is_replicated for _, b in bound):
            layout_values[key] = {
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
        parameters[name_prefix + entry.module_name(name)] = {
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
