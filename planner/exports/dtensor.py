"""The plan's parameters as DTensor placements (`shardplan export --format dtensor`)."""

from __future__ import annotations

from planner.plans.model import Plan
from planner.sharding.convert import to_placements


def to_dtensor_placements(plan: Plan) -> dict[str, list[str]]:
    """Placements of every parameter of `plan` (for `shardplan export --format dtensor`)."""
    return {name: list(to_placements(entry.layout, plan.mesh, f"parameter {name}"))
            for name, entry in plan.tensors.items() if entry.kind == "parameter"}
