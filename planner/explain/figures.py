"""The plan's figures as explain reports them: the step's terms, the top op and
collective classes, the communication matrix, and per-unit and per-stage figures.

Time accounting. An op-level plan runs every op on every device once per step, so its
step is the sum of its ops' forward and backward times, their collectives, the gradient
synchronisation and the optimizer pass. A pipeline plan's step is set by its busiest
device stage: micro-batches × that stage's time per micro-batch, plus the bubble, the
gradient synchronisation and the optimizer; its terms here are that stage's. Whatever the
plan does not itemise is reported as "not itemised" rather than hidden in another term.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from planner.explain.model import StageRow, Term, TopItem, UnitReport
from planner.explain.units import Unit, op_classes, op_split, template
from planner.kinds import CollectiveKind, Phase
from planner.plans.model import Plan
from planner.plans.sections import OpEntry, StageEntry
from planner.plans.stagemesh import op_meshes
from planner.sharding.derive import LOSS_OP

UNTRACKED = 1e-3  # a residual above this share of the step is listed as "not itemised"


@dataclass
class PlanIndex:
    """Lookups every section needs: op positions, stages, collectives per op, and the
    critical stage with its ops (None: an op-level plan, every op on every device)."""

    plan: Plan
    units: list[Unit]
    micro_batches: int
    op_index: dict[str, int]
    unit_of: list[int]
    stage_of: list[int | None]
    first_reader: dict[str, int]  # parameter -> first op reading it
    op_class: list[tuple]  # same position in every layer -> same class
    writer: dict[str, int]  # tensor -> the op writing it (where the loss reads an output)
    critical: StageEntry | None
    critical_ops: list[int] | None

    @classmethod
    def build(cls, plan: Plan, units: list[Unit]) -> PlanIndex:
        n = len(plan.ops)
        unit_of = [0] * n
        for k, unit in enumerate(units):
            for i in unit.indices():
                unit_of[i] = k
        stage_of: list[int | None] = [None] * n
        for stage in _stages(plan):
            for i in stage.op_indices():
                stage_of[i] = stage.device_stage
        first_reader: dict[str, int] = {}
        for i, op in enumerate(plan.ops):
            for binding in op.inputs:
                if binding and plan.tensors[binding.tensor].kind == "parameter":
                    first_reader.setdefault(binding.tensor, i)
        writer = {b.tensor: i for i, op in enumerate(plan.ops) for b in op.outputs if b}
        critical = critical_stage(plan)
        return cls(plan, units, plan.micro_batches,
                   {op.name: i for i, op in enumerate(plan.ops)}, unit_of, stage_of,
                   first_reader, op_classes(units, n), writer, critical,
                   list(critical.op_indices()) if critical is not None else None)

    def op_of(self, collective_op: str, tensor: str) -> int | None:
        """The op a collective belongs to: its consumer, a weight's first reader, or for
        the loss's read of an output (`LOSS_OP`) the op writing it."""
        if collective_op == LOSS_OP:
            return self.writer.get(tensor)
        index = self.op_index.get(collective_op)
        return index if index is not None else self.first_reader.get(tensor)

    def members(self) -> range | list[int]:
        """The ops whose devices the step's terms are about: the critical stage's."""
        return range(len(self.plan.ops)) if self.critical_ops is None else self.critical_ops


def degrees(plan: Plan) -> dict[str, Any]:
    """The plan's `parallel` section with its pipeline's schedule and chunks (None when it
    has no pipeline section)."""
    pipe = plan.pipeline
    return {**plan.parallel.to_json(),
            "schedule": str(pipe.schedule) if pipe is not None else None,
            "virtual_stages": pipe.virtual_stages if pipe is not None else None}


def _stages(plan: Plan) -> tuple[StageEntry, ...]:
    return plan.pipeline.stages if plan.pipeline is not None else ()


def _forward(op: OpEntry) -> float:
    return op.cost.forward_s if op.cost is not None else 0.0


def _backward(op: OpEntry) -> float:
    return op.cost.backward_s if op.cost is not None else 0.0


def _saved(op: OpEntry) -> float:
    return op.cost.saved_bytes if op.cost is not None else 0.0


def critical_stage(plan: Plan) -> StageEntry | None:
    """The stage whose time per micro-batch sets the pipeline's pace (as the step model)."""
    stages = _stages(plan)
    return max(stages, key=lambda s: s.per_micro_batch_s) if stages else None


def step_terms(plan: Plan, index: PlanIndex) -> list[Term]:
    """The step time as a sum of terms; a residual is reported, not spread."""
    stage = index.critical
    m = index.micro_batches
    fwd = m * sum(_forward(plan.ops[i]) for i in index.members())
    bwd = m * sum(_backward(plan.ops[i]) for i in index.members())
    breakdown = plan.predicted.breakdown
    if stage is not None:
        values = [
            ("forward compute", fwd),
            ("forward collectives", m * stage.forward_s - fwd),
            ("backward compute", bwd),
            ("backward collectives", m * stage.backward_s - bwd),
            ("recompute", m * stage.recompute_s),
            ("stage-to-stage sends", m * stage.p2p_s),
            ("ZeRO gathers per micro-batch", m * stage.zero_s),
            ("pipeline bubble", breakdown.bubble_s),
        ]
    else:
        values = [
            ("forward compute", fwd),
            ("forward collectives", breakdown.forward_communication_s),
            ("backward compute", bwd),
            ("backward collectives", breakdown.backward_communication_s),
            ("recompute", breakdown.recompute_s),
        ]
    values += [
        ("gradient synchronisation", breakdown.gradient_communication_s),
        ("hidden behind backward (overlap)", -breakdown.hidden_communication_s),
        ("optimizer and gradient accumulation"
         if plan.step.grad_accumulation == "separate" else "optimizer", breakdown.optimizer_s),
    ]
    step = plan.predicted.step_time_s
    residual = step - sum(v for _, v in values)
    if step > 0 and abs(residual) > UNTRACKED * step:
        values.append(("not itemised in the plan", residual))
    scale = step if step > 0 else 1.0
    return [Term(name, value, value / scale) for name, value in values
            if abs(value) > 1e-9 * scale]


def top_ops(plan: Plan, index: PlanIndex, count: int) -> list[TopItem]:
    """The op classes that take most of the critical devices' compute time."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in index.members():
        groups[index.op_class[i]].append(i)
    items = []
    for ops in groups.values():
        time = index.micro_batches * sum(_forward(plan.ops[i]) + _backward(plan.ops[i])
                                         for i in ops)
        items.append((time, template([plan.ops[i].name for i in ops]), len(ops)))
    return _top(items, plan.predicted.step_time_s, count)


def top_collectives(plan: Plan, index: PlanIndex, count: int) -> list[TopItem]:
    """Collective classes by time per step on the critical devices."""
    wanted = None if index.critical_ops is None else set(index.critical_ops)
    groups: dict[tuple, list[tuple[str, float]]] = defaultdict(list)
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if wanted is not None and (at is None or at not in wanted):
            continue
        once = c.phase == Phase.GRADIENT
        per_step = c.time_s if once else c.time_s * index.micro_batches
        key = (c.kind, tuple(c.axes), c.phase, index.op_class[at] if at is not None else c.op)
        label = c.tensor if once else f"{c.tensor} (the loss's read)" \
            if c.op == LOSS_OP else c.op
        groups[key].append((label, per_step))
    items = []
    for (kind, axes, phase, _), members in groups.items():
        what = template([label for label, _ in members])
        name = f"{kind} over {'+'.join(axes)} ({phase}) of {what}"
        items.append((sum(t for _, t in members), name, len(members)))
    return _top(items, plan.predicted.step_time_s, count)


PHASES = tuple(Phase)  # the columns of the communication matrix


def communication_matrix(plan: Plan, index: PlanIndex) -> dict[str, Any]:
    """Collective seconds per step on the critical devices, by mesh-axis set and phase."""
    wanted = None if index.critical_ops is None else set(index.critical_ops)
    seconds: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(PHASES))
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * len(PHASES))
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if wanted is not None and (at is None or at not in wanted):
            continue
        row = "+".join(c.axes) + (" (stage sends)" if c.kind == CollectiveKind.SEND_RECV
                                  else "")
        column = PHASES.index(c.phase)
        seconds[row][column] += c.time_s * (1 if c.phase == Phase.GRADIENT
                                            else index.micro_batches)
        counts[row][column] += 1
    order = {a: i for i, a in enumerate(plan.mesh.axis_names)}
    rows = sorted(seconds, key=lambda r: (r.count("+"), [order.get(a, len(order)) for a in
                                                         r.split(" ")[0].split("+")], r))
    stage = index.critical
    scope = (f"the devices of stage {stage.device_stage} (the busiest)"
             if stage is not None and len(_stages(plan)) > 1 else "every device")
    return {"scope": scope, "phases": [str(p) for p in PHASES], "axes": rows,
            "seconds": [seconds[r] for r in rows], "counts": [counts[r] for r in rows]}


def _top(items: list[tuple[float, str, int]], step: float, count: int) -> list[TopItem]:
    items.sort(key=lambda item: -item[0])
    scale = step if step > 0 else 1.0
    return [TopItem(name, n, time, time / scale) for time, name, n in items[:count] if time > 0]


def unit_reports(plan: Plan, index: PlanIndex) -> list[UnitReport]:
    m = index.micro_batches
    n = len(index.units)
    fwd, bwd, coll, grad = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    saved, params = [0.0] * n, [0.0] * n
    splits: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
    for i, op in enumerate(plan.ops):
        u = index.unit_of[i]
        fwd[u] += m * _forward(op)
        bwd[u] += m * _backward(op)
        saved[u] += _saved(op)
        splits[u][op_split(op, plan)] += _forward(op) + _backward(op)
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if at is None or c.kind == CollectiveKind.SEND_RECV:
            continue
        if c.phase == Phase.GRADIENT:
            grad[index.unit_of[at]] += c.time_s
        else:
            coll[index.unit_of[at]] += m * c.time_s
    meshes = op_meshes(plan.mesh, plan.pipeline, len(plan.ops))  # a weight's: its reader's
    for name, reader in index.first_reader.items():
        params[index.unit_of[reader]] += plan.tensors[name].local_bytes(meshes[reader])
    recompute = _unit_recompute(plan, index)
    reports = []
    for k, unit in enumerate(index.units):
        split, share = _dominant(splits[k])
        stages = {s for s in (index.stage_of[i] for i in unit.indices()) if s is not None}
        reports.append(UnitReport(
            unit.name, [list(r) for r in unit.ranges], len(unit.indices()),
            min(stages) if stages else None, split, share, fwd[k], bwd[k], recompute[k],
            coll[k], grad[k], int(params[k]), int(saved[k])))
    return reports


def _dominant(times: dict[str, float]) -> tuple[str, float]:
    if not times:
        return "no ops", 0.0
    total = sum(times.values())
    split = max(times, key=lambda s: (times[s], s != "replicated"))
    return split, (times[split] / total if total > 0 else 1.0)


def _unit_recompute(plan: Plan, index: PlanIndex) -> list[float]:
    """Recompute per unit: the plan gives it per stage only, so each stage's recompute time
    is split over its units in proportion to the forward time of their recompute segments
    (their ops' compute and forward collectives)."""
    result = [0.0] * len(index.units)
    forward_coll: dict[int, float] = defaultdict(float)
    for c in plan.collectives:
        at = index.op_index.get(c.op)
        if at is not None and c.phase == Phase.FORWARD and c.kind != CollectiveKind.SEND_RECV:
            forward_coll[at] += c.time_s
    for stage in _stages(plan):
        total = stage.recompute_s * index.micro_batches
        weights: dict[int, float] = defaultdict(float)
        for first, end in stage.recompute_segments:
            for i in range(first, end):
                weights[index.unit_of[i]] += _forward(plan.ops[i]) + forward_coll[i]
        whole = sum(weights.values())
        for u, weight in weights.items():
            result[u] += total * weight / whole if whole > 0 else 0.0
    return result


def stage_rows(plan: Plan) -> list[StageRow]:
    return [StageRow(
        device_stage=stage.device_stage, units=[list(pair) for pair in stage.units],
        ranks=len(stage.ranks), recompute=str(stage.recompute), forward_s=stage.forward_s,
        backward_s=stage.backward_s, recompute_s=stage.recompute_s, p2p_s=stage.p2p_s,
        zero_s=stage.zero_s, gradient_sync_s=stage.gradient_sync_s,
        optimizer_s=stage.optimizer_s, per_micro_batch_s=stage.per_micro_batch_s,
        in_flight=stage.in_flight, memory=dict(stage.memory), groups=list(stage.groups))
        for stage in _stages(plan)]
