"""Explain a plan from its JSON alone: per layer, where the step time goes, why it won.

Every figure is read or summed from the plan file: each op's `cost`, the collectives, the
`pipeline` section, and the alternatives and baselines the search priced beside it.
Nothing is re-planned or re-imported, so `explain` works on a plan whose model file is
gone (the demo plans a temporary file) or lives on another machine, and in milliseconds
for a 175B plan.

Time accounting. An op-level plan runs every op on every device once per step, so its
step is the sum of its ops' forward and backward times, their collectives, the gradient
synchronisation and the optimizer pass. A pipeline plan's step is set by its busiest
device stage: micro-batches × that stage's time per micro-batch, plus the bubble, the
gradient synchronisation and the optimizer (`planner.stages.Pricer`); its terms here are
that stage's. Whatever the plan does not itemise is reported as "not itemised" rather
than hidden in another term.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.graph import OpNode, PlanningGraph, TensorInfo
from planner.planfile import OpEntry, Plan
from planner.report import MEMORY_ORDER, human_bytes, human_seconds

SAME = 0.005  # step times within 0.5 % of each other count as equal
MAX_GROUPS = 40  # name-prefix groups beyond this are merged into equal chunks
UNTRACKED = 1e-3  # a residual above this share of the step is listed as "not itemised"
WHOLE_KEYS = ("pipeline_s",)  # breakdown totals, not terms: never "the term that differs"


@dataclass(frozen=True)
class Unit:
    """A run of ops explained together: a repeated layer, the prefix, the suffix, ..."""

    name: str
    ranges: tuple[tuple[int, int], ...]  # [first, end) into plan.ops
    is_layer: bool

    def indices(self) -> list[int]:
        return [i for first, end in self.ranges for i in range(first, end)]


@dataclass
class UnitReport:
    """One unit's strategy, time per step on the devices that run it, and memory."""

    name: str
    ops: list[list[int]]
    op_count: int
    stage: int | None  # device stage holding it (pipeline plans)
    split: str  # the dominant split, e.g. "batch over dp + weights over tp"
    split_share: float  # share of the unit's compute time spent in ops split that way
    forward_s: float  # compute, per step
    backward_s: float
    recompute_s: float
    collective_s: float  # forward and backward collectives of its ops (not stage sends)
    gradient_sync_s: float  # reductions of the gradients of the weights it reads first
    parameter_bytes: int  # per device
    saved_bytes: int  # activations kept for the backward, per micro-batch

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.collective_s
                + self.gradient_sync_s)


@dataclass
class Term:
    """One term of the step time, with its share of the step."""

    name: str
    time_s: float
    share: float


@dataclass
class TopItem:
    """An op (or collective) class: the same position in every layer counts as one."""

    name: str
    count: int
    time_s: float  # per step, on the devices of the critical stage
    share: float


@dataclass
class Rival:
    """A plan the search priced beside this one, and what separates them."""

    name: str
    source: str  # "alternative" or "baseline"
    step_time_s: float | None
    ratio: float | None  # rival step time / this plan's
    fits: bool | None
    peak_memory_bytes: int | None
    verdict: str
    term: str | None = None  # the term that differs most
    this_s: float | None = None
    other_s: float | None = None


@dataclass
class Explanation:
    """What `shardplan explain --json` prints (its keys are JSON_KEYS, plus `plots`).

    source, model, cluster, mesh, parallel (with schedule, virtual_stages, global_batch),
    solver: what was planned and how. step_time_s; micro_batches; critical_stage: the
    device stage whose time sets the step (null without a pipeline). terms: the step time
    as named parts that add up to it. top_ops, top_collectives: classes by time per step.
    grouping: how the units were found; units: per unit its split, per-step times,
    weights and saved activations. stages: the pipeline stages' own figures. memory,
    memory_limit_bytes, fits: per device. rivals: alternatives and baselines with ratio,
    verdict and the term that differs most. communication: collective seconds per step by
    mesh-axis set × phase. notes: warnings and facts worth knowing.
    """

    source: str
    model: dict[str, Any]
    cluster: dict[str, Any]
    mesh: dict[str, Any]
    parallel: dict[str, Any]
    solver: dict[str, Any]
    step_time_s: float
    micro_batches: int
    critical_stage: int | None
    grouping: str
    terms: list[Term]
    top_ops: list[TopItem]
    top_collectives: list[TopItem]
    units: list[UnitReport]
    stages: list[dict[str, Any]]
    memory: dict[str, int]
    memory_limit_bytes: int
    fits: bool
    rivals: list[Rival]
    communication: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["units"] = [{**asdict(u), "total_s": u.total_s} for u in self.units]
        return data


JSON_KEYS = tuple(Explanation.__dataclass_fields__)


# ---------------------------------------------------------------- units


def find_units(plan: Plan) -> tuple[list[Unit], str]:
    """The units to explain, and how they were found.

    1. A pipeline plan lists its units: the cut points its stages respect. Use them.
    2. Otherwise run the planner's own repeated-layer detection (`find_repeats`) on a view
       of the plan: the plan records each op's type and every tensor's shape, dtype and
       role, which is what `op_signature` reads except attributes and folded constant
       values. So op-level plans are grouped as the search grouped them, without the model
       file (often gone, or on another machine) and without seconds of import.
    3. No repeated block covering half the ops (a small or irregular graph, or a run of
       a few alike ops): consecutive ops sharing the first segment of their names, which
       exporters and the zoo set from the module path.
    """
    from planner.search.layers import find_repeats

    if plan.pipeline and plan.pipeline.get("units"):
        units = [Unit(u["name"], ((int(u["ops"][0]), int(u["ops"][1])),),
                      u["name"].startswith("layer ")) for u in plan.pipeline["units"]]
        return units, "the plan's pipeline units (the cut points its stages respect)"
    from planner.stages import MIN_LAYER_SHARE

    repeats = find_repeats(_graph_view(plan)) if len(plan.ops) >= 4 else None
    if repeats is not None and repeats.covered >= MIN_LAYER_SHARE * len(plan.ops):
        return (_layer_units(repeats.start, repeats.period, repeats.count, len(plan.ops)),
                f"repeated layers found in the plan's op sequence ({repeats.count} layers "
                f"of {repeats.period} ops)")
    return _name_units(plan), "consecutive ops sharing a name prefix (no repeated layer)"


def _graph_view(plan: Plan) -> PlanningGraph:
    """A PlanningGraph with what `op_signature` reads, rebuilt from the plan file."""
    tensors = {name: TensorInfo(name, tuple(t.shape), t.dtype, t.kind)  # type: ignore[arg-type]
               for name, t in plan.tensors.items()}
    ops = [OpNode(op.name, op.op_type, "", tuple(b.tensor if b else "" for b in op.inputs),
                  tuple(b.tensor if b else "" for b in op.outputs), {}) for op in plan.ops]
    return PlanningGraph(plan.model.path, plan.model.sha256, plan.model.opset,
                         dict(plan.model.bound_dims), plan.model.batch, {}, ops, tensors,
                         [], [])


def _layer_units(start: int, period: int, count: int, total: int) -> list[Unit]:
    units = [Unit("prefix", ((0, start),), False)] if start > 0 else []
    units += [Unit(f"layer {k}", ((start + k * period, start + (k + 1) * period),), True)
              for k in range(count)]
    end = start + count * period
    if end < total:
        units.append(Unit("suffix", ((end, total),), False))
    return units


def _name_units(plan: Plan) -> list[Unit]:
    """Runs of ops with the same first name segment; equal chunks when there are many."""
    keys = [_first_segment(op.name) for op in plan.ops]
    units: list[Unit] = []
    first = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[first]:
            units.append(Unit(keys[first], ((first, i),), False))
            first = i
    if len(units) <= MAX_GROUPS:
        return units
    size = -(-len(plan.ops) // MAX_GROUPS)
    return [Unit(f"ops {a}-{min(a + size, len(plan.ops)) - 1}",
                 ((a, min(a + size, len(plan.ops))),), False)
            for a in range(0, len(plan.ops), size)]


def _first_segment(name: str) -> str:
    parts = [p for p in re.split(r"[./:]", name) if p]
    return parts[0] if parts else name


# ---------------------------------------------------------------- splits


def op_split(op: OpEntry, plan: Plan) -> str:
    """How an op is split, by the role of each mesh axis it uses: batch, weights, dim d."""
    used = {a for axes in op.assignment.values() for a in axes}
    axes = [a for a in plan.mesh.axis_names if a in used] + sorted(
        used - set(plan.mesh.axis_names))
    if not axes:
        return "replicated"
    return " + ".join(f"{_axis_role(op, axis, plan)} over {axis}" for axis in axes)


def _axis_role(op: OpEntry, axis: str, plan: Plan) -> str:
    bindings = [b for b in op.inputs if b]
    for binding in bindings:
        info = plan.tensors.get(binding.tensor)
        if info is not None and info.kind == "parameter" and any(
                axis in dim for dim in binding.layout.dims):
            return "weights"
    batch = plan.model.batch
    slots = [("input", b) for b in bindings] + [("output", b) for b in op.outputs if b]
    for slot, binding in slots:
        info = plan.tensors.get(binding.tensor)
        if info is None or info.kind == "parameter":
            continue
        for dim, dim_axes in enumerate(binding.layout.dims):
            if axis in dim_axes:
                is_batch = dim == 0 and batch and info.shape and info.shape[0] == batch
                return "batch" if is_batch else f"{slot} dim {dim}"
    return "reduction"


# ---------------------------------------------------------------- the plan's figures


@dataclass
class _Index:
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
    def build(cls, plan: Plan, units: list[Unit]) -> _Index:
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
                   unit_of, stage_of, first_reader, _op_classes(units, n))

    def op_of(self, collective_op: str, tensor: str) -> int | None:
        """The op a collective belongs to: its consumer, or a weight's first reader."""
        index = self.op_index.get(collective_op)
        return index if index is not None else self.first_reader.get(tensor)


def _op_classes(units: list[Unit], n: int) -> list[tuple]:
    classes: list[tuple] = [("op", i) for i in range(n)]
    layers = [u for u in units if u.is_layer and len(u.ranges) == 1]
    sizes = {u.ranges[0][1] - u.ranges[0][0] for u in layers}
    if len(layers) >= 2 and len(sizes) == 1:
        for unit in layers:
            first = unit.ranges[0][0]
            for i in unit.indices():
                classes[i] = ("layer", i - first)
    return classes


def _template(names: Sequence[str]) -> str:
    """`h.0.mlp.fc`, `h.1.mlp.fc` -> `h.*.mlp.fc`: number runs that differ become `*`."""
    split = [re.split(r"(\d+)", name) for name in names]
    if len({len(parts) for parts in split}) != 1:
        return f"{names[0]} …"
    out = []
    for position, tokens in enumerate(zip(*split, strict=True)):
        if len(set(tokens)) == 1:
            out.append(tokens[0])
        elif position % 2 == 1:  # a digit run
            out.append("*")
        else:
            return f"{names[0]} …"
    return "".join(out)


def _cost(op: OpEntry, key: str) -> float:
    return float(op.cost.get(key, 0.0))


def _critical_stage(plan: Plan) -> dict[str, Any] | None:
    """The stage whose time per micro-batch sets the pipeline's pace (as the Pricer)."""
    stages = (plan.pipeline or {}).get("stages") or []
    if not stages:
        return None
    return max(stages, key=_per_micro_batch)


def _per_micro_batch(stage: dict[str, Any]) -> float:
    return sum(float(stage.get(k, 0.0)) for k in
               ("forward_s", "backward_s", "recompute_s", "p2p_s", "zero_s"))


def step_terms(plan: Plan, index: _Index) -> list[Term]:
    """The step time as a sum of terms; a residual is reported, not spread."""
    stage = _critical_stage(plan)
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


def top_ops(plan: Plan, index: _Index, count: int) -> list[TopItem]:
    """The op classes that take most of the critical devices' compute time."""
    stage = _critical_stage(plan)
    members = (range(len(plan.ops)) if stage is None else
               [i for first, end in stage["ops"] for i in range(first, end)])
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in members:
        groups[index.op_class[i]].append(i)
    items = []
    for ops in groups.values():
        time = index.micro_batches * sum(_cost(plan.ops[i], "forward_s")
                                         + _cost(plan.ops[i], "backward_s") for i in ops)
        items.append((time, _template([plan.ops[i].name for i in ops]), len(ops)))
    return _top(items, plan.predicted.step_time_s, count)


def top_collectives(plan: Plan, index: _Index, count: int) -> list[TopItem]:
    """Collective classes by time per step on the critical devices."""
    stage = _critical_stage(plan)
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
        what = _template([label for label, _ in members])
        name = f"{kind} over {'+'.join(axes)} ({phase}) of {what}"
        items.append((sum(t for _, t in members), name, len(members)))
    return _top(items, plan.predicted.step_time_s, count)


PHASES = ("forward", "backward", "gradient")


def communication_matrix(plan: Plan, index: _Index) -> dict[str, Any]:
    """Collective seconds per step on the critical devices, by mesh-axis set and phase."""
    stage = _critical_stage(plan)
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


def unit_reports(plan: Plan, index: _Index) -> list[UnitReport]:
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


def _unit_recompute(plan: Plan, index: _Index) -> list[float]:
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


# ---------------------------------------------------------------- rivals


def rivals(plan: Plan) -> list[Rival]:
    """The alternatives (minus this plan itself) and the baselines, each with its verdict."""
    result = [_alternative(plan, alt) for alt in plan.alternatives if not _is_self(plan, alt)]
    result += [_baseline(plan, name, brief) for name, brief in plan.baselines.items()]
    return result


def _is_self(plan: Plan, alt: dict[str, Any]) -> bool:
    step = plan.predicted.step_time_s
    same_mesh = (list(alt.get("mesh", [])) == list(plan.mesh.shape)
                 and list(alt.get("axes", plan.mesh.axis_names)) == list(plan.mesh.axis_names))
    same_parallel = "parallel" not in alt or alt["parallel"] == asdict(plan.parallel)
    objective = alt.get("objective")
    close = isinstance(objective, int | float) and abs(objective - step) <= 1e-9 * max(step, 1e-30)
    return same_mesh and same_parallel and close


def alternative_name(alt: dict[str, Any]) -> str:
    if "parallel" in alt:
        p = alt["parallel"]
        return (f"pp={p['pp']} dp={p['dp']} tp={p['tp']} mb={p['micro_batches']} "
                f"zero={p['zero']} recompute={p['recompute']}")
    axes = ",".join(alt.get("axes", []))
    return f"mesh {'x'.join(map(str, alt.get('mesh', [])))} ({axes}, op-level)"


def _alternative(plan: Plan, alt: dict[str, Any]) -> Rival:
    name = alternative_name(alt)
    objective = alt.get("objective")
    peak = alt.get("peak_memory_bytes")
    fits = alt.get("fits")
    if not isinstance(objective, int | float) or objective == float("inf") or alt.get(
            "status") in ("infeasible", "unknown"):
        why = alt.get("reason") or alt.get("status") or "no plan"
        return Rival(name, "alternative", None, None, fits, peak, f"no plan: {why}")
    ratio = objective / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    if fits is False and peak is not None:
        return Rival(name, "alternative", objective, ratio, False, peak,
                     f"does not fit: {_over_limit(peak, plan)}")
    term = _largest_difference(plan.predicted.breakdown, alt.get("breakdown") or {})
    verdict = _ratio_text(ratio)
    if term is not None:
        key, mine, theirs = term
        verdict += (f": {_term_name(key)} {human_seconds(theirs)} vs {human_seconds(mine)} "
                    "in this plan")
    elif "breakdown" not in alt:
        verdict += " (the op-level search records its objective only, no breakdown)"
    if peak is not None and human_bytes(peak) != human_bytes(plan.predicted.memory["peak"]):
        verdict += (f"; peak memory {human_bytes(peak)} vs "
                    f"{human_bytes(plan.predicted.memory['peak'])}")
    return Rival(name, "alternative", objective, ratio, fits, peak, verdict,
                 *(term if term else (None, None, None)))


def _baseline(plan: Plan, name: str, brief: dict[str, Any]) -> Rival:
    step = float(brief["step_time_s"])
    ratio = step / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    peak = int(brief["peak_memory_bytes"])
    mine = _coarse_terms(plan.predicted.step_time_s, plan.predicted.compute_s,
                         plan.predicted.communication_s)
    theirs = _coarse_terms(step, float(brief["compute_s"]), float(brief["communication_s"]))
    term = _largest_difference(mine, theirs)
    detail = (f"{term[0]} {human_seconds(term[2])} vs {human_seconds(term[1])} in this plan"
              if term else "")
    if not brief["fits"]:
        verdict = f"does not fit: {_over_limit(peak, plan)}; {_ratio_text(ratio)}"
    else:
        verdict = _ratio_text(ratio) + (f": {detail}" if detail else "")
    return Rival(name, "baseline", step, ratio, bool(brief["fits"]), peak, verdict,
                 *(term if term else (None, None, None)))


def _coarse_terms(step: float, compute: float, communication: float) -> dict[str, float]:
    """The three figures every plan brief carries; idle is what the step adds to them."""
    return {"compute": compute, "communication": communication,
            "idle (pipeline bubble)": max(0.0, step - compute - communication)}


def _largest_difference(mine: dict[str, float],
                        theirs: dict[str, float]) -> tuple[str, float, float] | None:
    keys = [k for k in mine.keys() & theirs.keys() if k not in WHOLE_KEYS]
    if not keys:
        return None
    key = max(sorted(keys), key=lambda k: abs(float(theirs[k]) - float(mine[k])))
    if theirs[key] == mine[key]:
        return None
    return key, float(mine[key]), float(theirs[key])


def _term_name(key: str) -> str:
    return key.removesuffix("_s").replace("_", " ")


def _ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "no step time"
    if abs(ratio - 1.0) < SAME:
        return f"same step time ({ratio:.3f}×)"
    return f"{ratio:.2f}× slower" if ratio > 1 else f"{1 / ratio:.2f}× faster"


def _over_limit(peak: float, plan: Plan) -> str:
    return f"{human_bytes(peak)} > {human_bytes(plan.predicted.memory_limit_bytes)}"


# ---------------------------------------------------------------- the explanation


def explain(plan: Plan, source: str = "plan", top: int = 5) -> Explanation:
    """Everything `shardplan explain` says about one plan."""
    units, grouping = find_units(plan)
    index = _Index.build(plan, units)
    pipe = plan.pipeline or {}
    parallel = {**asdict(plan.parallel), "schedule": pipe.get("schedule"),
                "virtual_stages": pipe.get("virtual_stages"),
                "global_batch": pipe.get("global_batch", plan.model.batch)}
    stage = _critical_stage(plan)
    return Explanation(
        source=source,
        model={"path": plan.model.path, "sha256": plan.model.sha256,
               "parameters": plan.model.parameters, "batch": plan.model.batch,
               "bound_dims": dict(plan.model.bound_dims)},
        cluster=asdict(plan.cluster),
        mesh={"shape": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names),
              "intra_node": [plan.mesh.intra_node(a) for a in plan.mesh.axis_names]},
        parallel=parallel,
        solver={"name": plan.solver.name, "status": plan.solver.status,
                "gap": plan.solver.gap, "chosen": plan.solver.detail.get("chosen")},
        step_time_s=plan.predicted.step_time_s,
        micro_batches=index.micro_batches,
        critical_stage=int(stage["device_stage"]) if stage and len(pipe["stages"]) > 1
        else None,
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
        notes.append(f"{', '.join(faster)}: faster and fits, so this plan was not chosen on "
                     "step time alone; the plan file does not record why (pins given with "
                     "--parallel, --mesh or --strategies are not stored)")
    if plan.mesh.size > 1 and all(not op.assignment for op in plan.ops):
        notes.append(f"every op is replicated: each of the {plan.mesh.size} devices computes "
                     "the whole step (splitting cost more than it saved)")
    if any("parallel" not in alt for alt in plan.alternatives):
        notes.append("op-level alternatives carry the solver's objective, priced before "
                     "assembly (a tied weight's gradient is charged once per use there)")
    if plan.solver.detail.get("chosen"):
        notes.append(f"chosen: {plan.solver.detail['chosen']}")
    return notes


# ---------------------------------------------------------------- text


def render(ex: Explanation) -> str:
    """The explanation for a terminal."""
    lines = _header(ex)
    lines += ["", _terms_title(ex)]
    lines += [f"  {t.name:<34}{human_seconds(t.time_s):>12}  {100 * t.share:5.1f} %"
              for t in ex.terms]
    if ex.top_ops:
        lines += ["", "top ops (same position in every layer counted together)"]
        lines += [_top_line(item) for item in ex.top_ops]
    if ex.top_collectives:
        lines += ["", "top collectives"]
        lines += [_top_line(item) for item in ex.top_collectives]
    lines += ["", f"per unit ({ex.grouping}); times per step"]
    lines += _unit_table(ex)
    fullest = _fullest_stage(ex)
    lines += ["", "memory per device" + (f" (stage {fullest}, the fullest)"
                                          if fullest is not None else "")]
    peak = ex.memory.get("peak", 0) or 1
    for key in MEMORY_ORDER:
        value = ex.memory.get(key, 0)
        lines.append(f"  {key:<34}{human_bytes(value):>12}  {100 * value / peak:5.1f} %")
    lines.append(f"  {'peak':<34}{human_bytes(ex.memory.get('peak', 0)):>12}  of "
                 f"{human_bytes(ex.memory_limit_bytes)}: "
                 f"{'fits' if ex.fits else 'DOES NOT FIT'}")
    if ex.stages and len(ex.stages) > 1:
        lines += ["", "stages (time per micro-batch)"]
        lines += _stage_table(ex)
    if ex.rivals:
        lines += ["", "why this plan: the others the search priced"]
        width = max(len(r.name) for r in ex.rivals) + 2
        lines += [f"  {r.name + ':':<{width + 1}}{r.verdict}" for r in ex.rivals]
    if ex.notes:
        lines += ["", *(f"note: {n}" for n in ex.notes)]
    return "\n".join(lines)


def _header(ex: Explanation) -> list[str]:
    p = ex.parallel
    mesh = " × ".join(f"{a}={s}" for a, s in zip(ex.mesh["axes"], ex.mesh["shape"],
                                                   strict=True))
    pipe = ""
    if p.get("schedule") and p["pp"] > 1:
        pipe = f", schedule {p['schedule']}" + (
            f" ×{p['virtual_stages']} chunks" if (p.get("virtual_stages") or 1) > 1 else "")
    return [
        f"plan       {ex.source}: {ex.model['path']} ({ex.model['parameters'] / 1e6:,.1f} M "
        f"parameters, global batch {p.get('global_batch')})",
        f"cluster    {ex.cluster['devices']} × {ex.cluster['profile']}, mesh {mesh}",
        f"strategy   dp={p['dp']} tp={p['tp']} pp={p['pp']} micro_batches="
        f"{p['micro_batches']} zero={p['zero']} recompute={p['recompute']}{pipe}",
        f"step time  {human_seconds(ex.step_time_s)}; peak memory "
        f"{human_bytes(ex.memory.get('peak', 0))} of {human_bytes(ex.memory_limit_bytes)}"
        f" ({'fits' if ex.fits else 'does not fit'}); solver {ex.solver['name']} "
        f"({ex.solver['status']})",
    ]


def _fullest_stage(ex: Explanation) -> int | None:
    """The stage whose memory the plan reports (its peak is the plan's peak)."""
    if len(ex.stages) < 2:
        return None
    peak = ex.memory.get("peak")
    match = [row["device_stage"] for row in ex.stages if row["memory"].get("peak") == peak]
    return match[0] if match else None


def _terms_title(ex: Explanation) -> str:
    if ex.critical_stage is None:
        return "where the step time goes"
    return (f"where the step time goes (stage {ex.critical_stage}, the busiest, × "
            f"{ex.micro_batches} micro-batches)")


def _top_line(item: TopItem) -> str:
    return (f"  {item.name[:72]:<74}×{item.count:<5}{human_seconds(item.time_s):>12}  "
            f"{100 * item.share:5.1f} %")


def _unit_table(ex: Explanation) -> list[str]:
    has_stage = len(ex.stages) > 1
    has_recompute = any(u.recompute_s for u in ex.units)
    columns = ["forward", "backward", *(["recompute"] if has_recompute else []),
               "collect.", "grad sync", "total"]
    head = f"  {'unit':<20}{'×':>3}" + (f"{'stage':>6}" if has_stage else "")
    head += f"{'ops':>5}  {'split (share of compute)':<44}"
    head += "".join(f"{c:>10}" for c in columns) + f"{'weights':>11}{'saved/mb':>11}"
    lines = [head]
    for first, last, count in _runs(ex.units):
        u = ex.units[first]
        name = u.name if count == 1 else f"{u.name} … {ex.units[last].name.split()[-1]}"
        times = [u.forward_s, u.backward_s, *([u.recompute_s] if has_recompute else []),
                 u.collective_s, u.gradient_sync_s, u.total_s]
        row = f"  {name[:19]:<20}{count:>3}" + (f"{_stage_text(u):>6}" if has_stage else "")
        row += f"{u.op_count:>5}  {f'{u.split} ({100 * u.split_share:.0f}%)'[:43]:<44}"
        row += "".join(f"{_short_seconds(t):>10}" for t in times)
        row += f"{human_bytes(u.parameter_bytes):>11}{human_bytes(u.saved_bytes):>11}"
        lines.append(row)
    if any(count > 1 for *_, count in _runs(ex.units)):
        lines.append("  (a row of × n units gives the figures of each)")
    return lines


def _short_seconds(value: float) -> str:
    """Three significant digits: tables of many columns stay narrow."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale or unit == "us":
            number = value / scale
            return f"{number:.3g} {unit}" if abs(number) >= 1 or number == 0 else \
                f"{number:.2f} {unit}"
    raise AssertionError("unreachable")


def _stage_text(unit: UnitReport) -> str:
    return "" if unit.stage is None else str(unit.stage)


def _runs(units: Sequence[UnitReport]) -> Iterable[tuple[int, int, int]]:
    """Consecutive units alike in stage, split and every figure (0.5 %): one row each."""
    first = 0
    for i in range(1, len(units) + 1):
        if i == len(units) or not _alike(units[first], units[i]):
            yield first, i - 1, i - first
            first = i


def _alike(a: UnitReport, b: UnitReport) -> bool:
    if (a.stage, a.split, a.op_count) != (b.stage, b.split, b.op_count):
        return False
    pairs = [(a.forward_s, b.forward_s), (a.backward_s, b.backward_s),
             (a.recompute_s, b.recompute_s), (a.collective_s, b.collective_s),
             (a.gradient_sync_s, b.gradient_sync_s), (a.parameter_bytes, b.parameter_bytes),
             (a.saved_bytes, b.saved_bytes)]
    return all(abs(x - y) <= SAME * max(abs(x), abs(y)) for x, y in pairs)


def _stage_table(ex: Explanation) -> list[str]:
    lines = [f"  {'stage':<7}{'units':<42}{'recompute':<11}{'forward':>11}{'backward':>11}"
             f"{'recompute':>11}{'p2p':>11}{'total':>11}{'peak memory':>13}"]
    for row in ex.stages:
        units = ", ".join(a if a == b else f"{a} … {b}" for a, b in row["units"])
        lines.append(
            f"  {row['device_stage']:<7}{units[:41]:<42}{row['recompute']:<11}"
            f"{human_seconds(row['forward_s']):>11}{human_seconds(row['backward_s']):>11}"
            f"{human_seconds(row['recompute_s']):>11}{human_seconds(row['p2p_s']):>11}"
            f"{human_seconds(row['per_micro_batch_s']):>11}"
            f"{human_bytes(row['memory'].get('peak', 0)):>13}")
    return lines


# ---------------------------------------------------------------- compare


COMPARE_MEMORY = (*MEMORY_ORDER, "peak")


def compare_rows(plans: Sequence[tuple[str, Plan]]) -> dict[str, Any]:
    """Side by side: mesh, degrees, step time and its parts, memory, fit; flags mismatches."""
    first = plans[0][1].predicted.step_time_s or 1.0
    entries = []
    for source, plan in plans:
        pipe = plan.pipeline or {}
        breakdown = plan.predicted.breakdown
        entries.append({
            "source": source,
            "model": {"path": plan.model.path, "sha256": plan.model.sha256,
                      "parameters": plan.model.parameters},
            "cluster": asdict(plan.cluster),
            "mesh": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names),
            "parallel": {**asdict(plan.parallel), "schedule": pipe.get("schedule"),
                         "virtual_stages": pipe.get("virtual_stages")},
            "global_batch": pipe.get("global_batch", plan.model.batch),
            "step_time_s": plan.predicted.step_time_s,
            "ratio": plan.predicted.step_time_s / first,
            "compute_s": plan.predicted.compute_s,
            "communication_s": plan.predicted.communication_s,
            "bubble_s": float(breakdown.get("bubble_s", 0.0)),
            "memory": {k: int(plan.predicted.memory.get(k, 0)) for k in COMPARE_MEMORY},
            "memory_limit_bytes": plan.predicted.memory_limit_bytes,
            "fits": plan.predicted.fits,
        })
    return {"plans": entries, "notes": _compare_notes(entries)}


def _compare_notes(entries: list[dict[str, Any]]) -> list[str]:
    notes = []
    for label, key in (("models", lambda e: e["model"]["sha256"]),
                       ("global batches", lambda e: e["global_batch"]),
                       ("clusters", lambda e: (e["cluster"]["profile"],
                                               e["cluster"]["devices"]))):
        values = {str(key(e)) for e in entries}
        if len(values) > 1:
            listed = ", ".join(f"{e['source']}: {_note_value(label, e)}" for e in entries)
            notes.append(f"different {label} ({listed}): step times are not comparable "
                         "one to one")
    return notes


def _note_value(label: str, entry: dict[str, Any]) -> str:
    if label == "models":
        return f"{entry['model']['path']} ({entry['model']['sha256'][:8]})"
    if label == "global batches":
        return str(entry["global_batch"])
    return f"{entry['cluster']['devices']} × {entry['cluster']['profile']}"


def render_compare(data: dict[str, Any]) -> str:
    entries = data["plans"]
    rows: list[tuple[str, list[str]]] = [
        ("model", [e["model"]["path"].rsplit("/", 1)[-1] for e in entries]),
        ("cluster", [f"{e['cluster']['devices']} × {e['cluster']['profile']}"
                     for e in entries]),
        ("mesh", ["x".join(map(str, e["mesh"])) + f" ({','.join(e['axes'])})"
                  for e in entries]),
        ("global batch", [str(e["global_batch"]) for e in entries]),
    ]
    for key in ("dp", "tp", "pp", "micro_batches", "zero", "recompute", "schedule"):
        rows.append((key, [str(e["parallel"].get(key) if e["parallel"].get(key) is not None
                               else "-") for e in entries]))
    rows += [
        ("step time", [human_seconds(e["step_time_s"]) for e in entries]),
        ("vs first", [f"{e['ratio']:.2f}×" for e in entries]),
        ("  compute", [human_seconds(e["compute_s"]) for e in entries]),
        ("  communication", [human_seconds(e["communication_s"]) for e in entries]),
        ("  bubble", [human_seconds(e["bubble_s"]) for e in entries]),
    ]
    rows += [(f"  {k}" if k != "peak" else "peak memory",
              [human_bytes(e["memory"][k]) for e in entries]) for k in COMPARE_MEMORY]
    rows += [("memory limit", [human_bytes(e["memory_limit_bytes"]) for e in entries]),
             ("fits", ["yes" if e["fits"] else "NO" for e in entries])]
    names = [e["source"].replace("\\", "/").rsplit("/", 1)[-1] for e in entries]
    cells = [*names, *(v for _, values in rows for v in values)]
    width = min(28, max(len(c) for c in cells) + 2)
    lines = [f"{'':<18}" + "".join(f"{n[:width - 2]:>{width}}" for n in names)]
    for label, values in rows:
        lines.append(f"{label:<18}" + "".join(f"{v[:width - 2]:>{width}}" for v in values))
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)
