"""shardplan's planner: import an ONNX model, search how to split it, write the plan.

`planner.plan(...)` is the Python API; heavy modules load on first use so that
`planner.errors` and friends stay cheap to import (and the planner never needs torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Plan", "PlanningGraph", "import_model", "plan"]

if TYPE_CHECKING:
    from planner.api import plan
    from planner.graph import PlanningGraph
    from planner.importer import import_model
    from planner.plans.model import Plan


def __getattr__(name: str) -> Any:
    if name == "plan":
        from planner.api import plan

        return plan
    if name == "Plan":
        from planner.plans.model import Plan

        return Plan
    if name == "PlanningGraph":
        from planner.graph import PlanningGraph

        return PlanningGraph
    if name == "import_model":
        from planner.importer import import_model

        return import_model
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
