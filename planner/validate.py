"""`shardplan validate`: is a plan file one that runs, and (given the model) this model's?

Loading a plan already checks its JSON against the schema and its layouts against its
mesh (`planner.plans.schema`, `planner.plans.checks`). Validation goes further, and lists
every problem it finds:

- without the model: the parallel section states the mesh's degrees, and `parallel.sp`
  the sequence split the plan's layouts have (`planner.plans.sequence`), cp the mesh's
  context axis with its kind, and ep 1 (nothing plans it yet); the pipeline section
  partitions the ops and the ranks; every tensor an op reads in another layout than
  the one it is stored in has the forward collectives of that move listed (the
  redistribution the planner prices);
- with the model: the plan is this file's (digest, dims, every op, every shape); every
  op's layouts are the ones its assignment implies under the op's sharding rule, and the
  assignment is valid; re-deriving the op-level collectives from the assignments
  (`planner.sharding.derive`, no prices needed) gives the plan's (forward, backward and the
  weights whose gradients are summed).

The executor validates against the model before any rank starts. Validation is a reader:
it re-derives from the sharding layer, never from the search or the pricing.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from costmodels.orders import chunks_per_device, misplaced
from planner.errors import PlanFileError, ShardplanError
from planner.graph import PlanningGraph, dtype_itemsize
from planner.kinds import AxisRole, CollectiveKind, Phase, StepKind
from planner.ops import replicated_labels
from planner.plans.model import Plan
from planner.plans.sections import OpEntry, PipelineSection
from planner.plans.sequence import sequence_split
from planner.plans.stagemesh import (
    arrival_layouts,
    expected_blocks,
    op_meshes,
    resharded,
    stage_mesh,
    stage_sizes,
    tensor_meshes,
)
from planner.records import Collective
from planner.sharding.analysis import GraphAnalysis, backward_read_weights
from planner.sharding.batch import rows_meet_reason
from planner.sharding.context import context_kind
from planner.sharding.derive import OPTIMIZER_OP, ShardedGraph, derive
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.pipeline import (
    OpNames,
    chunk_of_units,
    recompute_reads,
    send_routes,
    send_steps,
    stage_holds,
    unit_crossings,
)
from planner.sharding.redistribute import redistribute
from planner.sharding.sends import SEND_OP, SendSplit, send_split
from planner.sharding.strategy import OpStrategy, input_layouts, is_valid, output_layouts
from planner.sharding.weights import synced_axes, weight_steps

MAX_LISTED = 20


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def to_json(self) -> dict:
        return {"valid": self.ok, "problems": self.problems, "checked": self.checked}


def validate(plan: Plan, graph: PlanningGraph | None = None) -> Report:
    """Every problem found in `plan` (and against `graph`, the model imported at the plan's
    dims, when given)."""
    report = Report()
    meshes = _Meshes.of(plan)
    analysis = functools.cache(lambda: GraphAnalysis.of(graph)) if graph is not None \
        else None  # the model's, found once for the checks that read it
    _parallel(plan, report)
    _costs(plan, report)
    before = len(report.problems)
    _pipeline(plan, report)
    if plan.pipeline is not None and len(report.problems) == before:
        matched = graph if graph is not None and _matches(plan, graph) else None
        _stage_holds(plan, matched, report)
        _sends(plan, analysis if matched is not None else None, report, meshes)
    _send_collectives(plan, report)
    _edges(plan, report, meshes)
    if graph is not None:
        assert analysis is not None
        _model(plan, graph, analysis, report, meshes)
    return report


def refuse_invalid(plan: Plan, graph: PlanningGraph | None, against: str) -> None:
    """Raise PlanFileError with the first problem `validate` finds (a runner's check
    before any rank starts; `against`: what the plan was checked against, for the line)."""
    report = validate(plan, graph)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more: shardplan validate)" \
            if len(report.problems) > 1 else ""
        raise PlanFileError(f"the plan does not validate{against}: {report.problems[0]}{more}")


def _matches(plan: Plan, graph: PlanningGraph) -> bool:
    try:
        check_plan_matches(plan, graph)
    except ShardplanError:
        return False  # `_model` reports why
    return True


def _parallel(plan: Plan, report: Report) -> None:
    """The parallel section states the mesh's degrees: pp the pipeline axis, dp and tp
    (and pp) groups of its devices; a pipeline plan's dp is its data axis and its tp its
    tensor axis or 1 (nothing split over it); sp what its layouts do; cp the mesh's
    context axis (1 without one), with a kind only when above 1 (which kind, the model's
    check: `_context_kind`); ep the mesh's expert axis (1 without one)."""
    parallel, mesh = plan.parallel, plan.mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    axes = ", ".join(f"{a}={n}" for a, n in sizes.items())
    pp = sizes.get(str(AxisRole.PIPELINE), 1)
    if parallel.pp != pp:
        report.add(f"parallel.pp is {parallel.pp} but the mesh ({axes}) has {pp} pipeline "
                   "stages")
    for role, given in ((AxisRole.CONTEXT, parallel.cp), (AxisRole.EXPERT, parallel.ep)):
        size = sizes.get(str(role), 1)
        if given != size:
            report.add(f"parallel.{role} is {given} but the mesh ({axes}) has {role}={size}")
    if parallel.cp_kind is not None and parallel.cp == 1:
        report.add(f"parallel.cp_kind is {parallel.cp_kind} with cp=1: a plan names how "
                   "attention runs over cp (ring or ulysses) only when cp is above 1")
    degrees = parallel.dp * parallel.tp * parallel.pp * parallel.cp * parallel.ep
    if degrees < 1 or mesh.size % degrees:
        cp_part = "".join(f" {key}={getattr(parallel, key)}" for key in ("ep", "cp")
                          if getattr(parallel, key) != 1)
        report.add(f"parallel dp={parallel.dp}{cp_part} tp={parallel.tp} pp={parallel.pp} is "
                   f"{degrees} devices, not a grouping of the mesh's {mesh.size} ({axes}; "
                   f"cluster.devices {plan.cluster.devices})")
    elif plan.pipeline is not None:
        dp, tp = sizes.get(str(AxisRole.DATA), 1), sizes.get(str(AxisRole.TENSOR), 1)
        if parallel.dp != dp:
            report.add(f"parallel.dp is {parallel.dp} but the mesh ({axes}) has dp={dp}")
        if parallel.tp not in (1, tp):
            report.add(f"parallel.tp is {parallel.tp} but the mesh ({axes}) has tp={tp}")
    _shares(plan, report)
    _sequence(plan, report)


def _shares(plan: Plan, report: Report) -> None:
    """`parallel.dp_shares`, where given, is a mixed cluster's pipeline of one stage
    whose dp replicas take each micro-batch's rows between them: one share per replica,
    adding up to the micro-batch."""
    shares = plan.parallel.dp_shares
    if not shares:
        return
    if not plan.cluster.groups:
        report.add("parallel.dp_shares is given, but the plan is for one kind of device: "
                   "replicas share the batch by speed only on a mixed cluster (--cluster)")
    if len(shares) != plan.parallel.dp:
        report.add(f"parallel.dp_shares has {len(shares)} shares for dp={plan.parallel.dp} "
                   "replicas: give one per replica")
    pipe = plan.pipeline
    if pipe is None or len(pipe.stages) != 1:
        report.add("parallel.dp_shares is given for a plan that is not one pipeline stage: "
                   "shares by speed are planned for one stage only")
    elif sum(shares) != pipe.micro_batch_size:
        report.add(f"parallel.dp_shares add up to {sum(shares)} rows, not the micro-batch's "
                   f"{pipe.micro_batch_size}")


def _sequence(plan: Plan, report: Report) -> None:
    """`parallel.sp` says what the plan's layouts do: 1 exactly when an activation a layer
    hands on is stored split along the sequence (`planner.plans.sequence`)."""
    found = sequence_split(plan.ops, plan.tensors, plan.units)
    sp = plan.parallel.sp
    if sp == 1 and found is None:
        report.add("parallel.sp is 1 but no activation between the plan's layers is stored "
                   "split along the sequence (sequence parallelism splits them); it is 0")
    elif sp != 1 and found is not None:
        report.add(f"parallel.sp is {sp} but the plan runs sequence parallelism: {found}, "
                   "which a layer hands on, is stored split along the sequence; it is 1")


#: The sections holding predicted costs: every number in them is finite and at least 0.
COST_SECTIONS = ("predicted", "collectives", "ops", "alternatives", "baselines")


def _costs(plan: Plan, report: Report) -> None:
    """Every predicted cost (step, breakdown, memory, each collective, op and stage) is a
    finite number, at least 0: an inf or NaN would order plans or size buffers wrongly."""
    found: list[tuple[str, float]] = []
    for key in COST_SECTIONS:
        if key == "ops":  # read off the entries: written out, they took most of the time
            _op_numbers(plan.ops, found)
            continue
        _numbers(plan.section_json(key), key, found)
    if plan.pipeline is not None:
        data = plan.section_json("pipeline")
        _numbers(data["stages"], "pipeline.stages", found)
        _numbers(data["bubble_fraction"], "pipeline.bubble_fraction", found)
    for path, value in found[:MAX_LISTED]:
        report.add(f"{path} is {value}: a predicted cost must be a finite number, 0 or more; "
                   "re-plan")
    if len(found) > MAX_LISTED:
        report.add(f"and {len(found) - MAX_LISTED} more costs that are not finite numbers ≥ 0")


def _op_numbers(ops: Sequence[OpEntry], found: list[tuple[str, float]]) -> None:
    """`_numbers` of the `ops` section, from each entry's own list of the numbers it
    writes (`OpEntry.numbers`): written out, the entries took most of the check's time."""
    for k, op in enumerate(ops):
        for parts, value in op.numbers():
            if not isinstance(value, bool) and (not math.isfinite(value) or value < 0):
                where: Where = ("ops", True, k)
                for part in parts:
                    where = (where, isinstance(part, int), part)
                found.append((_spelled(where), value))


def _numbers(value: Any, path: str, found: list[tuple[str, float]]) -> None:
    """Collect the numbers under `value` that are not finite or are negative, with their
    JSON paths (spelled only for those: a 200,000-op plan holds millions of numbers)."""
    def walk(value: Any, where: Where) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, (where, False, key))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, (where, True, index))
        elif isinstance(value, int | float) and not isinstance(value, bool) \
                and (not math.isfinite(value) or value < 0):
            found.append((_spelled(where), value))

    walk(value, path)


#: a JSON path as `_numbers` keeps it: the path's start, or (parent, is an index, key)
Where = str | tuple[Any, bool, Any]


def _spelled(where: Where) -> str:
    """`where` as text: `ops[3].cost.forward_s`."""
    parts = []
    while isinstance(where, tuple):
        where, index, key = where
        parts.append(f"[{key}]" if index else f".{key}")
    return where + "".join(reversed(parts))


def _pipeline(plan: Plan, report: Report) -> None:
    pipe = plan.pipeline
    parallel = plan.parallel
    if pipe is None:
        if parallel.pp > 1 or parallel.micro_batches > 1 or parallel.zero:
            report.add(f"parallel says pp={parallel.pp}, micro_batches="
                       f"{parallel.micro_batches}, zero={parallel.zero} but the plan has no "
                       "pipeline section")
        return
    stages = pipe.stages
    n = len(plan.ops)
    if len(stages) != parallel.pp:
        report.add(f"parallel.pp is {parallel.pp} but the pipeline has {len(stages)} stages")
    if pipe.micro_batches != parallel.micro_batches:
        report.add(f"pipeline.micro_batches {pipe.micro_batches} differs from "
                   f"parallel.micro_batches {parallel.micro_batches}")
    size, batch = pipe.micro_batch_size, pipe.global_batch
    if size and batch and size * pipe.micro_batches != batch:
        report.add(f"pipeline: {pipe.micro_batches} micro-batches of {size} are not the "
                   f"global batch {batch}")
    if size and plan.model.batch and size != plan.model.batch:
        report.add(f"pipeline.micro_batch_size {size} differs from model.batch "
                   f"{plan.model.batch} (the plan's shapes are per micro-batch)")
    covered = [0] * n
    for stage in stages:
        for first, end in stage.ops:
            if not 0 <= first < end <= n:
                report.add(f"stage {stage.device_stage}: op range [{first}, {end}) is "
                           f"outside the plan's {n} ops")
                continue
            for k in range(first, end):
                covered[k] += 1
        ranges = sorted(stage.ops)  # disjoint (the loader refuses overlaps)
        for first, end in stage.recompute_segments:
            at = bisect.bisect_right(ranges, (first, math.inf)) - 1
            if not (at >= 0 and ranges[at][0] <= first < end <= ranges[at][1]):
                report.add(f"stage {stage.device_stage}: recompute segment [{first}, "
                           f"{end}) is not inside the stage's ops")
    wrong = [k for k, count in enumerate(covered) if count != 1]
    if wrong:
        report.add(f"pipeline stages must hold every op exactly once: op {wrong[0]} "
                   f"({plan.ops[wrong[0]].name}) is held {covered[wrong[0]]} times")
    try:
        blocks = expected_blocks(plan.mesh, pipe)
    except ValueError:
        report.add("pipeline stages hold device counts "
                   f"{stage_sizes(plan.mesh, pipe)} that do not lie on the cluster as aligned "
                   "blocks (a power-of-two part of a node or whole nodes each)")
        blocks = [range(len(stage.ranks)) for stage in stages]
    why = "pp is the outermost axis" if len({len(b) for b in blocks}) < 2 else \
        "the stages hold submeshes of their own sizes"
    for index, (stage, block) in enumerate(zip(stages, blocks, strict=True)):
        if stage.device_stage != index or tuple(stage.ranks) != tuple(block):
            report.add(f"stage {index}: ranks {list(stage.ranks[:4])}… are not the block "
                       f"{block.start}..{block.stop - 1} its mesh holds ({why})")
    chunks = pipe.chunks()
    _check_placement(pipe, chunks, report)
    for send in pipe.sends:
        if send.tensor not in plan.tensors:
            report.add(f"pipeline send of unknown tensor {send.tensor!r}")
        entry = plan.tensors.get(send.tensor)
        if send.scatter_axes and entry is not None and resharded(plan.mesh, pipe, send):
            report.add(f"pipeline send of {send.tensor}: scattered over "
                       f"{list(send.scatter_axes)}, but it crosses to a stage of another "
                       "mesh shape, which receives it whole")
        elif send.scatter_axes and entry is not None:
            split = send_split(entry.layout, entry.shape,
                               stage_mesh(plan.mesh, pipe, send.to_stage))
            if split is None or split.axes != send.scatter_axes \
                    or split.dim != send.scatter_dim:
                report.add(f"pipeline send of {send.tensor}: scattered over "
                           f"{list(send.scatter_axes)} along dim {send.scatter_dim}, but its "
                           f"layout allows {'no scatter' if split is None else split}")
        if send.from_stage == send.to_stage or not all(
                0 <= stage < len(stages) for stage in (send.from_stage, send.to_stage)):
            report.add(f"pipeline send of {send.tensor}: stages {send.from_stage} → "
                       f"{send.to_stage} are not two of the {len(stages)} stages")
        elif not (0 <= send.from_chunk < len(chunks) and 0 <= send.to_chunk < len(chunks)
                  and chunks[send.from_chunk][1] == send.from_stage
                  and chunks[send.to_chunk][1] == send.to_stage):
            report.add(f"pipeline send of {send.tensor}: chunks {send.from_chunk} → "
                       f"{send.to_chunk} are not op ranges of stages {send.from_stage} → "
                       f"{send.to_stage}")
    report.checked["stages"] = len(stages)


class _Meshes(NamedTuple):
    """Each op's mesh, each tensor's, and how tensors arrive on the meshes of other
    stages reading them (`planner.plans.stagemesh`): found once per `validate`."""

    on_op: list[DeviceMesh]
    on_tensor: dict[str, DeviceMesh]
    arrivals: dict[tuple[DeviceMesh, str], Layout]

    @classmethod
    def of(cls, plan: Plan) -> _Meshes:
        on_op = op_meshes(plan.mesh, plan.pipeline, len(plan.ops))
        on_tensor = tensor_meshes(plan.mesh, plan.pipeline, _op_names(plan, None))
        return cls(on_op, on_tensor, arrival_layouts(plan.ops, on_op, on_tensor))


def _check_placement(pipe: PipelineSection, chunks: Sequence[tuple[tuple[int, int], int]],
                     report: Report) -> None:
    """Each chunk on the device its schedule runs it on (`costmodels.orders`: one per
    device, Megatron's round robin, ZB-V's V), as many per device as the schedule runs."""
    p = len(pipe.stages)
    wanted = chunks_per_device(pipe.schedule, pipe.virtual_stages)
    if len(chunks) != p * wanted or pipe.virtual_stages != wanted:
        report.add(f"pipeline schedule {pipe.schedule} runs {wanted} chunk(s) per device: "
                   f"{p * wanted} op ranges and virtual_stages {wanted}, not {len(chunks)} "
                   f"and {pipe.virtual_stages}")
        return
    if wanted > 1 and (problem := misplaced(pipe.schedule, p,
                                            [device for _, device in chunks])):
        report.add(f"pipeline schedule {problem}")


def _op_names(plan: Plan, graph: PlanningGraph | None) -> list[OpNames]:
    """Each op's input and output names: the model's when given (it matches the plan),
    else the plan's bindings."""
    if graph is not None:
        return [(tuple(node.inputs), tuple(node.outputs)) for node in graph.ops]
    return [(tuple(b.tensor if b else None for b in op.inputs),
             tuple(b.tensor if b else None for b in op.outputs)) for op in plan.ops]


def _stage_holds(plan: Plan, graph: PlanningGraph | None, report: Report) -> None:
    """Each stage holds the parameters and buffers its ops read (`stage_holds`)."""
    assert plan.pipeline is not None
    ops = _op_names(plan, graph)
    for stage in plan.pipeline.stages:
        wanted = stage_holds(ops, stage.ops, lambda name: plan.tensors[name].kind)
        if tuple(sorted(stage.holds)) != wanted:
            odd = sorted(set(stage.holds) ^ set(wanted))
            report.add(f"stage {stage.device_stage}: holds {len(stage.holds)} weights, its ops "
                       f"read {len(wanted)} (first difference: {odd[0]})")


def _sends(plan: Plan, model: Callable[[], GraphAnalysis] | None, report: Report,
           meshes: _Meshes) -> None:
    """The pipeline's sends are the ones its partition implies (`send_routes`): each
    activation crossing to another device stage, chunk to chunk, with its gradient when it
    carries one (known from the model; without it, as the plan's sends say), of its
    layout's local size."""
    pipe = plan.pipeline
    assert pipe is not None
    chunks = pipe.chunks()
    units = pipe.units
    bounds = [u.ops[0] for u in units] + ([units[-1].ops[1]] if units else [])
    at_bounds = set(bounds)
    if not all(first in at_bounds and end in at_bounds for (first, end), _ in chunks):
        report.add("pipeline: a stage's op range does not start and end at unit bounds "
                   f"{bounds[:8]}…; re-plan")
        return
    ops = _op_names(plan, model().graph if model is not None else None)
    unit_of = [0] * len(ops)
    for k, unit in enumerate(units):
        for index in range(*unit.ops):
            unit_of[index] = k
    needs_grad = model().needs_grad if model is not None else \
        {send.tensor: True for send in pipe.sends if send.grad}
    chunk_of_unit = chunk_of_units(bounds, chunks)
    wanted: Counter = Counter()
    for crossing in unit_crossings(ops, unit_of) if len(chunks) > 1 else ():  # (in one
        # chunk nothing crosses)
        grad = needs_grad.get(crossing.tensor, False)
        for source, target in send_routes(crossing, grad, chunk_of_unit, chunks):
            wanted[(crossing.tensor, chunks[source][1], chunks[target][1], source, target,
                    grad)] += 1
    listed = Counter((s.tensor, s.from_stage, s.to_stage, s.from_chunk, s.to_chunk, s.grad)
                     for s in pipe.sends)
    for (tensor, a, b, ca, cb, grad), count in sorted((wanted - listed).items())[:MAX_LISTED]:
        report.add(f"pipeline: stage {a} must send {tensor} to stage {b} (chunk {ca} → {cb}"
                   f"{', its gradient back' if grad else ''}) but the plan lacks that send "
                   f"({count}×)")
    for (tensor, a, b, ca, cb, grad), count in sorted((listed - wanted).items())[:MAX_LISTED]:
        report.add(f"pipeline: the send of {tensor} from stage {a} to stage {b} (chunk {ca} "
                   f"→ {cb}{', gradient back' if grad else ''}) is not one the stages' ops "
                   f"need ({count}× too many)")
    for send in pipe.sends:
        entry = plan.tensors.get(send.tensor)
        if entry is None:
            continue
        mesh = stage_mesh(plan.mesh, pipe, send.to_stage)
        arriving = meshes.arrivals.get((mesh, send.tensor)) \
            if resharded(plan.mesh, pipe, send) else None
        size = round((replace(entry, layout=arriving) if arriving is not None else entry)
                     .local_bytes(mesh))
        if send.bytes != size:
            report.add(f"pipeline send of {send.tensor}: {send.bytes} bytes, but its layout "
                       f"holds {size} per rank")
    report.checked["sends"] = len(pipe.sends)


def _send_collectives(plan: Plan, report: Report) -> None:
    """The plan lists each send's transfer every micro-batch (its gradient's too) at the
    first op of the receiving chunk reading it, and the all-gather of a scattered one
    (`send_steps`), each once; an op-level plan lists none."""
    wanted: Counter = Counter()
    pipe = plan.pipeline
    if pipe is not None:
        chunks = pipe.chunks()
        ops = _op_names(plan, None)
        names = [op.name for op in plan.ops]
        for send in pipe.sends:
            if not 0 <= send.to_chunk < len(chunks):
                continue  # `_pipeline` reports it
            (first, end), _ = chunks[send.to_chunk]
            split = SendSplit(send.scatter_axes, send.scatter_dim) if send.scatter_axes \
                else None
            for step in send_steps(send.tensor, send.grad, split, ops[first:end],
                                   names[first:end]):
                wanted[(str(step.kind), send.tensor, step.axes, str(step.phase), step.op)] += 1
    listed = Counter(_key(c) for c in plan.collectives
                     if c.kind == CollectiveKind.SEND_RECV or c.op == SEND_OP)
    _differences(report, wanted, listed,
                 "pipeline send of {tensor}: the plan lacks its {phase} {kind} over {axes} at "
                 "op {op} ({count}×)",
                 "extra {phase} {kind} of {tensor} over {axes} at op {op} ({count}×): no "
                 "pipeline send needs it")


def _key(c: Collective) -> tuple[str, str, tuple[str, ...], str, str]:
    """What makes two listed collectives the same one: kind, tensor, axes, phase, op."""
    return str(c.kind), c.tensor, tuple(c.axes), str(c.phase), c.op


def _differences(report: Report, wanted: Counter, listed: Counter, lacking: str,
                 extra: str) -> None:
    """Report each collective `wanted` more often than `listed` (and the reverse), at most
    MAX_LISTED of each, with the messages' fields kind, tensor, axes, phase, op, count."""
    for template, difference in ((lacking, wanted - listed), (extra, listed - wanted)):
        for (kind, tensor, axes, phase, op), count in sorted(difference.items())[:MAX_LISTED]:
            report.add(template.format(kind=kind, tensor=tensor, axes=list(axes),
                                       phase=phase, op=op, count=count))


def _edges(plan: Plan, report: Report, meshes: _Meshes) -> None:
    """Each read in another layout than the stored one has its forward moves listed, at
    its op or at another op reading the tensor in the same layout (reads in one layout
    may share one move: `planner.sharding.derive.shared_read_key`; which ones exactly is
    checked against the model, `_model`)."""
    listed = Counter((c.kind, c.tensor, tuple(c.axes), c.op) for c in plan.collectives
                     if c.phase == Phase.FORWARD)
    readers: dict[tuple[str, Layout], list[str]] = {}
    for op in plan.ops:
        for binding in op.inputs:
            if binding is not None:
                readers.setdefault((binding.tensor, binding.layout), []).append(op.name)
    needed: Counter = Counter()
    moves = 0
    on_op, on_tensor, arrivals = meshes
    for index, op in enumerate(plan.ops):
        mesh = on_op[index]
        for binding in op.inputs:
            if binding is None:
                continue
            entry = plan.tensors[binding.tensor]
            stored = entry.layout if on_tensor.get(binding.tensor, plan.mesh) == mesh \
                else arrivals[(mesh, binding.tensor)]  # resharded from another mesh
            if stored == binding.layout:
                continue
            itemsize = dtype_itemsize(entry.dtype)  # the importer's: the schema refuses others
            try:
                steps = redistribute(stored, binding.layout, entry.shape, itemsize, mesh)
            except Exception as exc:
                report.add(f"op {op.name} reads {binding.tensor} in a layout no "
                           f"redistribution reaches from its stored one ({exc})")
                continue
            shared = readers[(binding.tensor, binding.layout)]
            for step in [s for s in steps if s.communicates]:
                moves += 1
                key = (CollectiveKind(step.kind), binding.tensor, tuple(step.axes))
                if not any(listed[(*key, other)] for other in shared):
                    needed[(*key, op.name)] += 1
    missing = needed
    for (kind, tensor, axes, op), count in sorted(missing.items())[:MAX_LISTED]:
        report.add(f"op {op} reads {tensor} after a {kind} over {list(axes)} that the plan's "
                   f"collectives do not list ({count}×)")
    report.checked["redistributions"] = moves


def check_plan_matches(plan: Plan, graph: PlanningGraph) -> None:
    """Refuse a plan made for another model or other dims before anything runs."""
    check_model_digest(plan, graph.sha256, graph.path)
    if dict(plan.model.bound_dims) != dict(graph.bound_dims):
        raise PlanFileError(f"the plan bound dims {plan.model.bound_dims}, the run binds "
                            f"{graph.bound_dims}; use the same --batch and --dim values")
    planned = {op.name for op in plan.ops}  # once: per op, it took minutes at 50,000 ops
    missing = [n.name for n in graph.ops if n.name not in planned]
    if missing:
        raise PlanFileError(f"the plan has no entry for op {missing[0]} of {graph.path}")
    # The dims could be edited by hand: the shapes the plan splits must be the model's.
    for name, info in graph.tensors.items():
        entry = plan.tensors.get(name)
        if entry is not None and list(entry.shape) != list(info.shape):
            raise PlanFileError(
                f"tensor {name} has shape {list(info.shape)} in {graph.path} but "
                f"{list(entry.shape)} in the plan; re-plan with the dims you run with")


def check_model_digest(plan: Plan, sha256: str, path: str) -> None:
    """Refuse a plan made for another model file (full digests: a prefix can collide)."""
    if plan.model.sha256 != sha256:
        raise PlanFileError(
            f"the plan was made for a model with sha256 {plan.model.sha256}, but {path} has "
            f"{sha256}; re-plan this model")


def _context_kind(plan: Plan, analysis: GraphAnalysis, strategies: Mapping[str, OpStrategy],
                  report: Report) -> None:
    """`parallel.cp_kind` is what the builder writes: how the plan's attention cores split
    over cp (`planner.sharding.context.context_kind`), absent when none does (a cp axis
    no core splits over: the cores run whole on every context rank)."""
    derived = context_kind(analysis, strategies) if plan.parallel.cp > 1 else None
    if plan.parallel.cp_kind != derived:
        runs = derived or "no attention core split over it"
        report.add(f"parallel.cp_kind is {plan.parallel.cp_kind or 'absent'} but the plan's "
                   f"layouts run attention over cp as {runs}")


def _model(plan: Plan, graph: PlanningGraph, model: Callable[[], GraphAnalysis],
           report: Report, meshes: _Meshes) -> None:
    """The plan against the model: its entries, layouts and collectives re-derived from
    its assignments (`model`: the graph's analysis, found once per `validate`)."""
    try:
        check_plan_matches(plan, graph)
    except ShardplanError as exc:
        report.add(str(exc))
        return
    analysis = model()
    if plan.parallel.micro_batches > 1 and analysis.rows_meet is not None:
        report.add(f"parallel.micro_batches is {plan.parallel.micro_batches}, but "
                   + rows_meet_reason(graph, analysis.rows_meet))
    entries = {op.name: op for op in plan.ops}
    strategies: dict[str, OpStrategy] = {}
    before = len(report.problems)
    cosmetic = 0  # strategy tuples out of step with layouts: the collectives still follow
    on_op = meshes.on_op
    mesh_of = {op.name: mesh for op, mesh in zip(plan.ops, on_op, strict=True)}
    for node in graph.ops:
        mesh = mesh_of.get(node.name, plan.mesh)
        entry = entries.get(node.name)
        if entry is None:
            report.add(f"op {node.name} of {graph.path} has no entry in the plan")
            continue
        labels = analysis.labels.get(node.name)
        strategy = OpStrategy.of({k: tuple(v) for k, v in entry.assignment.items()})
        strategies[node.name] = strategy
        if labels is None:
            labels = replicated_labels(node)
            if strategy.assignment:
                report.add(f"op {node.name} ({node.op_type}) has no sharding rule but the "
                           f"plan splits it: {_assignment_text(entry.assignment)}")
            continue
        if not is_valid(node, labels, strategy, graph.tensors, mesh):
            report.add(f"op {node.name} ({node.op_type}): assignment "
                       f"{_assignment_text(entry.assignment)} is not a valid strategy of its "
                       "sharding rule on this mesh")
            continue
        tuples = [list(b.layout.split_factors(mesh)) if b else [] for b in entry.inputs]
        if [list(t) for t in entry.strategy] != tuples:
            cosmetic += 1
            report.add(f"op {node.name}: strategy {[list(t) for t in entry.strategy]} does not "
                       f"match its input layouts, which cut the inputs {tuples}")
        in_ranks = [len(graph.tensors[t].shape) if t else -1 for t in node.inputs]
        out_ranks = [len(graph.tensors[t].shape) if t else -1 for t in node.outputs]
        for side, wanted, bindings in (
                ("input", input_layouts(labels, strategy, in_ranks), entry.inputs),
                ("output", output_layouts(labels, strategy, out_ranks), entry.outputs)):
            for slot, (layout, binding) in enumerate(zip(wanted, bindings, strict=False)):
                if layout is not None and binding is not None and layout != binding.layout:
                    report.add(f"op {node.name} {side} {slot} ({binding.tensor}): the plan "
                               f"says {binding.layout.to_json()}, its assignment implies "
                               f"{layout.to_json()}")
    report.checked["ops"] = len(graph.ops)
    _context_kind(plan, analysis, strategies, report)
    if len(report.problems) - before > cosmetic:
        return  # layouts or assignments are wrong: re-deriving collectives would mislead
    # Per-stage meshes: each mesh's stages derived from their own ops' strategies, every
    # other op foreign to it (`planner.search.stagemeshes.stage_layouts`); one mesh: the graph's.
    again: dict[DeviceMesh, ShardedGraph] = {}
    for mesh in dict.fromkeys(on_op):
        again[mesh] = derive(analysis, mesh, {name: strategy for name, strategy
                                              in strategies.items() if mesh_of[name] == mesh},
                             training=plan.step.kind == StepKind.TRAINING,
                             loss_reads=plan.step.loss_reads,
                             foreign=frozenset(name for name, on in mesh_of.items()
                                               if on != mesh))

    def op_level(collectives) -> Counter:
        return Counter(_key(c) for c in collectives
                       if c.phase in (Phase.FORWARD, Phase.BACKWARD) and c.op != OPTIMIZER_OP
                       and c.kind != CollectiveKind.SEND_RECV and c.op != SEND_OP)

    expected = op_level(c for mesh, sharded in again.items() for c in sharded.collectives
                        if mesh_of.get(c.op, plan.mesh) == mesh)
    got = op_level(plan.collectives)
    _differences(report, expected, got,
                 "missing {phase} {kind} of {tensor} over {axes} at op {op} ({count}×): the "
                 "assignments need it",
                 "extra {phase} {kind} of {tensor} over {axes} at op {op} ({count}×): no "
                 "assignment needs it")
    _gradient_shares(plan, again, mesh_of, report)
    needed = _weight_steps(plan, graph, again)
    _weights(plan, needed, report)
    report.checked["collectives"] = sum(expected.values()) + sum(needed.values())


def _gradient_shares(plan: Plan, again: Mapping[DeviceMesh, ShardedGraph],
                     mesh_of: Mapping[str, DeviceMesh], report: Report) -> None:
    """Each read hands back the share of its gradient the derivation gives it (a whole
    read of a weight whose gradient is summed over its axis: `read_gradient_share`)."""
    wrong = []
    for op in plan.ops:
        shares = again[mesh_of.get(op.name, plan.mesh)].shares
        for slot, binding in enumerate(op.inputs):
            if binding is None:
                continue
            wanted = shares.get((op.name, slot), 1.0)
            if not math.isclose(binding.share, wanted, rel_tol=1e-12):
                wrong.append(f"op {op.name} reads {binding.tensor} handing back "
                             f"{binding.share:g} of its gradient, but its layouts give "
                             f"{wanted:g}")
    for problem in wrong[:MAX_LISTED]:
        report.add(problem)


WeightKey = tuple[str, str, tuple[str, ...], str]  # weight, kind, axes, phase


def _weight_steps(plan: Plan, graph: PlanningGraph,
                  again: Mapping[DeviceMesh, ShardedGraph]) -> Counter:
    """The weight collectives the plan must list, as the builder derives them: an op-level
    plan's gradient all-reduces (`derive`), or a pipeline plan's ZeRO steps of every
    weight its ops read over its synced gradient axes, once per stage holding it, with
    the sum between two holders (`weight_steps`)."""
    if plan.pipeline is None:
        return Counter((c.tensor, str(c.kind), tuple(c.axes), str(c.phase))
                       for c in again[plan.mesh].gradients)
    meshes = [stage.mesh or plan.mesh for stage in plan.pipeline.stages]
    ops = _op_names(plan, graph)
    holders: dict[str, list[int]] = {}
    for stage in plan.pipeline.stages:
        for name in stage_holds(ops, stage.ops, lambda n: graph.tensors[n].kind):
            holders.setdefault(name, []).append(stage.device_stage)
    read = {name for node in graph.ops for name in node.inputs
            if name and graph.tensors[name].kind == "parameter"}
    recomputed = recompute_reads(ops, [s for stage in plan.pipeline.stages
                                       for s in stage.recompute_segments],
                                 lambda n: graph.tensors[n].kind)
    found: Counter = Counter()
    for name in sorted(read):
        held_by = tuple(holders.get(name, [0]))
        mesh = meshes[held_by[0]] if held_by[0] < len(meshes) else plan.mesh
        axes = synced_axes(again[mesh].gradient_axes.get(name, ()), mesh)
        backward = name in backward_read_weights(again[mesh].analysis) or name in recomputed
        for step in weight_steps(axes, held_by, plan.parallel.zero, backward):
            found[(name, str(step.kind), step.axes, str(step.phase))] += 1
    return found


def _weights(plan: Plan, needed: Counter, report: Report) -> None:
    """Compare the weight collectives listed with the needed ones, weight by weight: the
    axes its gradient is summed over first, then each collective's kind, phase and count."""
    listed: Counter = Counter((c.tensor, str(c.kind), tuple(c.axes), str(c.phase))
                              for c in plan.collectives if c.op == OPTIMIZER_OP)
    weights = sorted({key[0] for key in (needed | listed)})
    # each weight's entries, found once (per weight, a scan of all of them was quadratic)
    needed_of: dict[str, Counter] = {}
    listed_of: dict[str, Counter] = {}
    for found, of in ((needed, needed_of), (listed, listed_of)):
        for key, n in found.items():
            entries = of.get(key[0])
            if entries is None:
                entries = of[key[0]] = Counter()
            entries[key] = n

    def axes_of(found: Counter) -> set[str]:
        return {a for (_, _, axes, _), n in found.items() if n
                for a in axes if a != AxisRole.PIPELINE}

    shown = 0
    for name in weights:
        if shown >= MAX_LISTED:
            break
        mine, theirs = needed_of.get(name, Counter()), listed_of.get(name, Counter())
        if mine == theirs:
            continue
        want, got = axes_of(mine), axes_of(theirs)
        shown += 1
        if want and not got:
            report.add(f"weight {name}: its gradient must be summed over {sorted(want)} but "
                       "the plan lists no such collective")
        elif got and not want:
            report.add(f"weight {name}: the plan sums its gradient over {sorted(got)}, but no "
                       "op splits work on it there (the sum would multiply it)")
        elif want != got:
            report.add(f"weight {name}: the plan sums its gradient over {sorted(got)}, the "
                       f"assignments need {sorted(want)}")
        else:
            report.add(f"weight {name}: {_steps_text(theirs)} listed, but "
                       f"{_zero_text(plan)} needs {_steps_text(mine)}")


def _steps_text(steps: Counter) -> str:
    if not +steps:
        return "none"
    return ", ".join(f"{n}× {phase} {kind} over {list(axes)}"
                     for (_, kind, axes, phase), n in sorted(steps.items()) if n)


def _zero_text(plan: Plan) -> str:
    if plan.pipeline is None:
        return "its gradient sum"
    return f"ZeRO {plan.parallel.zero} on the stage(s) holding it (planner.sharding.weights)"


def _assignment_text(assignment) -> dict[str, list[str]]:
    """An assignment as the plan file spells it (what the user reads and edits)."""
    return {label: list(axes) for label, axes in assignment.items()}
