"""`explain`: the Explanation of one plan, every section read from the plan alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from planner.explain.figures import (
    PlanIndex,
    communication_matrix,
    degrees,
    stage_rows,
    step_terms,
    top_collectives,
    top_ops,
    unit_reports,
)
from planner.explain.model import SAME, Explanation, Rival
from planner.explain.rivals import rivals
from planner.explain.units import find_units
from planner.plans.model import Plan
from planner.plans.stagemesh import describe_stage_meshes, per_stage_meshes


def explain(plan: Plan, source: str = "plan", top: int = 5) -> Explanation:
    """Everything `shardplan explain` says about one plan."""
    units, grouping = find_units(plan)
    index = PlanIndex.build(plan, units)
    stage = index.critical
    return Explanation(
        source=source,
        model={"path": plan.model.path, "sha256": plan.model.sha256,
               "parameters": plan.model.parameters, "batch": plan.model.batch,
               "bound_dims": dict(plan.model.bound_dims)},
        cluster={**asdict(plan.cluster), "described": plan.cluster.describe()},
        mesh={"shape": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names),
              "intra_node": [plan.mesh.intra_node(a) for a in plan.mesh.axis_names],
              **({"stages": describe_stage_meshes(plan.mesh, plan.pipeline)}
                 if plan.pipeline is not None and per_stage_meshes(plan.pipeline) else {})},
        parallel={**degrees(plan), "global_batch": plan.global_batch},
        solver={"name": plan.solver.name, "status": plan.solver.status,
                "gap": plan.solver.gap, "chosen": plan.solver.detail.chosen},
        step_time_s=plan.predicted.step_time_s,
        micro_batches=index.micro_batches,
        critical_stage=stage.device_stage if stage is not None and plan.pipeline is not None
        and len(plan.pipeline.stages) > 1 else None,
        grouping=grouping,
        terms=step_terms(plan, index),
        top_ops=top_ops(plan, index, top),
        top_collectives=top_collectives(plan, index, top),
        units=unit_reports(plan, index),
        stages=stage_rows(plan),
        memory=dict(plan.predicted.memory),
        memory_limit_bytes=plan.predicted.memory_limit_bytes,
        fits=plan.predicted.fits,
        rivals=(others := rivals(plan)),
        communication=communication_matrix(plan, index),
        notes=_notes(plan, others),
    )


def _notes(plan: Plan, others: Sequence[Rival]) -> list[str]:
    notes = list(plan.warnings)
    faster = [r.name for r in others
              if r.fits and r.ratio is not None and r.ratio < 1 - SAME]
    if faster:
        pins = plan.solver.detail.pins or {}
        why = (f"it was planned under --parallel "
               f"{','.join(f'{key}={value}' for key, value in pins.items())}" if pins else
               "the plan file does not record why (a --mesh or --strategies given is not "
               "stored)")
        notes.append(f"{', '.join(faster)}: faster and fits, so this plan was not chosen on "
                     f"step time alone; {why}")
    if plan.cluster.devices > 1 and all(not op.assignment for op in plan.ops):
        notes.append(f"every op is replicated: each of the {plan.cluster.devices} devices "
                     "computes the whole step (splitting cost more than it saved)")
    if any(alt.brief is None for alt in plan.alternatives):
        notes.append("op-level alternatives carry the solver's objective, priced before "
                     "assembly (a tied weight's gradient is charged once per use there)")
    if plan.solver.detail.chosen:
        notes.append(f"chosen: {plan.solver.detail.chosen}")
    return notes
