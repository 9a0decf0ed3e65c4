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

from planner.explain.model import Term, TopItem, UnitReport
from planner.explain.units import Unit, op_classes, op_split, template
from planner.graph import TensorInfo
from planner.planfile import OpEntry, Plan

UNTRACKED = 1e-3  # a residual above this share of the step is listed as "not itemised"


@dataclass
class PlanIndex:
    """Lookups every section needs: op positions, stages, collectives per op."""

    plan: Plan
    units: list[Unit]
    micro_batches: int
    op_index: dict[str, int]
    unit_of: list[int]
    stage_of: list[int | None]
    first_reader: dict[str, int]  # parameter -> first op reading it
    op_class: list[tuple]  # same position in every layer -> same class

    @classmethod
    def build(cls, plan: Plan, units: list[Unit]) -> PlanIndex:
        n = len(plan.ops)
        unit_of = [0] * n
        for k, unit in enumerate(units):
            for i in unit.indices():
                unit_of[i] = k
        stage_of: list[int | None] = [None] * n
        for stage in (plan.pipeline or {}).get("stages", []):
            for first, end in stage["ops"]:
                for i in range(first, end):
                    stage_of[i] = int(stage["device_stage"])
        first_reader: dict[str, int] = {}
        for i, op in enumerate(plan.ops):
            for binding in op.inputs:
                if binding and plan.tensors[binding.tensor].kind == "parameter":
                    first_reader.setdefault(binding.tensor, i)
        micro = int((plan.pipeline or {}).get("micro_batches", 1) or 1)
        return cls(plan, units, micro, {op.name: i for i, op in enumerate(plan.ops)},
                   unit_of, stage_of, first_reader, op_classes(units, n))

    def op_of(self, collective_op: str, tensor: str) -> int | None:
        """The op a collective belongs to: its consumer, or a weight's first reader."""
        index = self.op_index.get(collective_op)
        return index if index is not None else self.first_reader.get(tensor)


def _cost(op: OpEntry, key: str) -> float:
    return float(op.cost.get(key, 0.0))


def critical_stage(plan: Plan) -> dict[str, Any] | None:
    """The stage whose time per micro-batch sets the pipeline's pace (as the Pricer)."""
    stages = (plan.pipeline or {}).get("stages") or []
    if not stages:
        return None
    return max(stages, key=_per_micro_batch)


def _per_micro_batch(stage: dict[str, Any]) -> float:
    return sum(float(stage.get(k, 0.0)) for k in
               ("forward_s", "backward_s", "recompute_s", "p2p_s", "zero_s"))


def step_terms(plan: Plan, index: PlanIndex) -> list[Term]:
    """The step time as a sum of terms; a residual is reported, not spread."""
    stage = critical_stage(plan)
    ops = (range(len(plan.ops)) if stage is None else
           [i for first, end in stage["ops"] for i in range(first, end)])
    m = index.micro_batches
    fwd = m * sum(_cost(plan.ops[i], "forward_s") for i in ops)
    bwd = m * sum(_cost(plan.ops[i], "backward_s") for i in ops)
    breakdown = plan.predicted.breakdown
    if stage is not None:
        values = [
            ("forward compute", fwd),
            ("forward collectives", m * float(stage["forward_s"]) - fwd),
            ("backward compute", bwd),
            ("backward collectives", m * float(stage["backward_s"]) - bwd),
            ("recompute", m * float(stage.get("recompute_s", 0.0))),
            ("stage-to-stage sends", m * float(stage.get("p2p_s", 0.0))),
            ("ZeRO gathers per micro-batch", m * float(stage.get("zero_s", 0.0))),
            ("pipeline bubble", float(breakdown.get("bubble_s", 0.0))),
        ]
    else:
        values = [
            ("forward compute", fwd),
            ("forward collectives", float(breakdown.get("forward_communication_s", 0.0))),
            ("backward compute", bwd),
            ("backward collectives", float(breakdown.get("backward_communication_s", 0.0))),
            ("recompute", float(breakdown.get("recompute_s", 0.0))),
        ]
    values += [
        ("gradient synchronisation", float(breakdown.get("gradient_communication_s", 0.0))),
        ("hidden behind backward (overlap)", -float(breakdown.get("hidden_communication_s",
                                                                   0.0))),
        ("optimizer", float(breakdown.get("optimizer_s", 0.0))),
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
    stage = critical_stage(plan)
    members = (range(len(plan.ops)) if stage is None else
               [i for first, end in stage["ops"] for i in range(first, end)])
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in members:
        groups[index.op_class[i]].append(i)
    items = []
    for ops in groups.values():
        time = index.micro_batches * sum(_cost(plan.ops[i], "forward_s")
                                         + _cost(plan.ops[i], "backward_s") for i in ops)
        items.append((time, template([plan.ops[i].name for i in ops]), len(ops)))
    return _top(items, plan.predicted.step_time_s, count)


def top_collectives(plan: Plan, index: PlanIndex, count: int) -> list[TopItem]:
    """Collective classes by time per step on the critical devices."""
    stage = critical_stage(plan)
    wanted = None if stage is None else {
        i for first, end in stage["ops"] for i in range(first, end)}
    groups: dict[tuple, list[tuple[str, float]]] = defaultdict(list)
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if wanted is not None and (at is None or at not in wanted):
            continue
        per_step = c.time_s if c.phase == "gradient" else c.time_s * index.micro_batches
        key = (c.kind, tuple(c.axes), c.phase, index.op_class[at] if at is not None else c.op)
        label = c.tensor if c.phase == "gradient" else c.op
        groups[key].append((label, per_step))
    items = []
    for (kind, axes, phase, _), members in groups.items():
        what = template([label for label, _ in members])
        name = f"{kind} over {'+'.join(axes)} ({phase}) of {what}"
        items.append((sum(t for _, t in members), name, len(members)))
    return _top(items, plan.predicted.step_time_s, count)


PHASES = ("forward", "backward", "gradient")


def communication_matrix(plan: Plan, index: PlanIndex) -> dict[str, Any]:
    """Collective seconds per step on the critical devices, by mesh-axis set and phase."""
    stage = critical_stage(plan)
    wanted = None if stage is None else {
        i for first, end in stage["ops"] for i in range(first, end)}
    seconds: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(PHASES))
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * len(PHASES))
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if wanted is not None and (at is None or at not in wanted):
            continue
        row = "+".join(c.axes) + (" (stage sends)" if c.kind == "send_recv" else "")
        column = PHASES.index(c.phase) if c.phase in PHASES else 0
        seconds[row][column] += c.time_s * (1 if c.phase == "gradient" else index.micro_batches)
        counts[row][column] += 1
    order = {a: i for i, a in enumerate(plan.mesh.axis_names)}
    rows = sorted(seconds, key=lambda r: (r.count("+"), [order.get(a, len(order)) for a in
                                                         r.split(" ")[0].split("+")], r))
    several = len((plan.pipeline or {}).get("stages") or []) > 1
    scope = (f"the devices of stage {stage['device_stage']} (the busiest)"
             if stage is not None and several else "every device")
    return {"scope": scope, "phases": list(PHASES), "axes": rows,
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
        fwd[u] += m * _cost(op, "forward_s")
        bwd[u] += m * _cost(op, "backward_s")
        saved[u] += _cost(op, "saved_bytes")
        splits[u][op_split(op, plan)] += _cost(op, "forward_s") + _cost(op, "backward_s")
    for c in plan.collectives:
        at = index.op_of(c.op, c.tensor)
        if at is None or c.kind == "send_recv":
            continue
        if c.phase == "gradient":
            grad[index.unit_of[at]] += c.time_s
        else:
            coll[index.unit_of[at]] += m * c.time_s
    for name, reader in index.first_reader.items():
        params[index.unit_of[reader]] += _local_bytes(plan, name)
    recompute = _unit_recompute(plan, index)
    reports = []
    for k, unit in enumerate(index.units):
        split, share = _dominant(splits[k])
        stages = {index.stage_of[i] for i in unit.indices()} - {None}
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


def _local_bytes(plan: Plan, tensor: str) -> float:
    info = plan.tensors[tensor]
    whole = TensorInfo(tensor, tuple(info.shape), info.dtype, info.kind).nbytes  # type: ignore[arg-type]
    parts = 1
    for factor in info.layout.split_factors(plan.mesh):
        parts *= factor
    return whole / parts


def _unit_recompute(plan: Plan, index: PlanIndex) -> list[float]:
    """Recompute per unit: the plan gives it per stage only, so each stage's recompute time
    is split over its units in proportion to the forward time of their recompute segments
    (their ops' compute and forward collectives)."""
    result = [0.0] * len(index.units)
    forward_coll: dict[int, float] = defaultdict(float)
    for c in plan.collectives:
        at = index.op_index.get(c.op)
        if at is not None and c.phase == "forward" and c.kind != "send_recv":
            forward_coll[at] += c.time_s
    for stage in (plan.pipeline or {}).get("stages", []):
        total = float(stage.get("recompute_s", 0.0)) * index.micro_batches
        weights: dict[int, float] = defaultdict(float)
        for first, end in stage.get("recompute_segments", []):
            for i in range(first, end):
                weights[index.unit_of[i]] += _cost(plan.ops[i], "forward_s") + forward_coll[i]
        whole = sum(weights.values())
        for u, weight in weights.items():
            result[u] += total * weight / whole if whole > 0 else 0.0
    return result


def stage_rows(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for stage in (plan.pipeline or {}).get("stages", []):
        rows.append({
            "device_stage": stage["device_stage"],
            "units": [list(pair) for pair in stage.get("units", [])],
            "ranks": len(stage.get("ranks", [])),
            "recompute": stage.get("recompute", "none"),
            **{k: float(stage.get(k, 0.0)) for k in (
                "forward_s", "backward_s", "recompute_s", "p2p_s", "zero_s",
                "gradient_sync_s", "optimizer_s")},
            "per_micro_batch_s": _per_micro_batch(stage),
            "in_flight": float(stage.get("in_flight", 0.0)),
            "memory": dict(stage.get("memory", {})),
        })
    return rows
