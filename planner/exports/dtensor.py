"""The plan's parameters as DTensor placements (`shardplan export --format dtensor`)."""

from __future__ import annotations

from planner.plans.model import Plan
from planner.plans.stagemesh import refuse_stage_meshes
from planner.sharding.convert import to_placements


def to_dtensor_placements(plan: Plan) -> dict[str, list[str]]:
    """Placements of every parameter of `plan`, keyed and laid out as the module holds it
    (for `shardplan export --format dtensor`): where the exporter renamed a weight
    (`val_41`, the transpose of `q_proj.weight`) its module name and layout."""
    refuse_stage_meshes(plan.mesh, plan.pipeline, "the DTensor export")
    return {entry.module_name(name):
            list(to_placements(entry.module_layout, plan.mesh, f"parameter {name}"))
            for name, entry in plan.tensors.items() if entry.kind == "parameter"}
