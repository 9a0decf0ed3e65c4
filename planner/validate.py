"""`shardplan validate`: is a plan file one that runs, and (given the model) this model's?

Loading a plan already checks its JSON against the schema and its layouts against its
mesh (`planner.plans.schema`, `planner.plans.checks`). Validation goes further, and lists
every problem it finds:

- without the model: the pipeline section partitions the ops and the ranks; every tensor
  an op reads in another layout than the one it is stored in has the forward collectives
  of that move listed (the redistribution the planner prices);
- with the model: the plan is this file's (digest, dims, every op, every shape); every
  op's layouts are the ones its assignment implies under the op's sharding rule, and the
  assignment is valid; re-deriving the op-level collectives from the assignments
  (`planner.sharding.derive`, no prices needed) gives the plan's (forward, backward and the
  weights whose gradients are summed).

The executor validates against the model before any rank starts. Validation is a reader:
it re-derives from the sharding layer, never from the search or the pricing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from planner.errors import PlanFileError, ShardplanError
from planner.graph import PlanningGraph, dtype_itemsize
from planner.kinds import AxisRole, CollectiveKind, Phase, StepKind
from planner.ops import replicated_labels
from planner.plans.model import Plan
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.derive import OPTIMIZER_OP, derive
from planner.sharding.layout import Layout
from planner.sharding.redistribute import redistribute
from planner.sharding.sends import SEND_OP, send_split
from planner.sharding.strategy import OpStrategy, input_layouts, is_valid, output_layouts

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
    _pipeline(plan, report)
    _edges(plan, report)
    if graph is not None:
        _model(plan, graph, report)
    return report


def _pipeline(plan: Plan, report: Report) -> None:
    pipe = plan.pipeline
    parallel = plan.parallel
    if pipe is None:
        if parallel.pp > 1 or parallel.micro_batches > 1:
            report.add(f"parallel says pp={parallel.pp}, micro_batches="
                       f"{parallel.micro_batches} but the plan has no pipeline section")
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
        for first, end in stage.recompute_segments:
            if not any(a <= first < end <= b for a, b in stage.ops):
                report.add(f"stage {stage.device_stage}: recompute segment [{first}, "
                           f"{end}) is not inside the stage's ops")
    wrong = [k for k, count in enumerate(covered) if count != 1]
    if wrong:
        report.add(f"pipeline stages must hold every op exactly once: op {wrong[0]} "
                   f"({plan.ops[wrong[0]].name}) is held {covered[wrong[0]]} times")
    per_stage = plan.mesh.size // max(1, len(stages))
    for index, stage in enumerate(stages):
        expected = list(range(index * per_stage, (index + 1) * per_stage))
        if stage.device_stage != index or list(stage.ranks) != expected:
            report.add(f"stage {index}: ranks {list(stage.ranks[:4])}… are not the mesh's "
                       f"block {expected[0]}..{expected[-1]} (pp is the outermost axis)")
    chunks = pipe.chunks()
    for send in pipe.sends:
        if send.tensor not in plan.tensors:
            report.add(f"pipeline send of unknown tensor {send.tensor!r}")
        entry = plan.tensors.get(send.tensor)
        if send.scatter_axes and entry is not None:
            split = send_split(entry.layout, entry.shape, plan.mesh)
            if split is None or split.axes != send.scatter_axes \
                    or split.dim != send.scatter_dim:
                report.add(f"pipeline send of {send.tensor}: scattered over "
                           f"{list(send.scatter_axes)} along dim {send.scatter_dim}, but its "
                           f"layout allows {'no scatter' if split is None else split}")
            gathers = sum(1 for c in plan.collectives if c.op == SEND_OP
                          and c.tensor == send.tensor and tuple(c.axes) == send.scatter_axes)
            if not gathers:
                report.add(f"pipeline send of {send.tensor}: scattered, but the plan lists "
                           "no all-gather to reassemble it")
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


def _edges(plan: Plan, report: Report) -> None:
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
    for op in plan.ops:
        for binding in op.inputs:
            if binding is None:
                continue
            entry = plan.tensors[binding.tensor]
            if entry.layout == binding.layout:
                continue
            try:
                itemsize = dtype_itemsize(entry.dtype)
            except TypeError:  # a dtype numpy does not know: price the move as fp32
                itemsize = 4
            try:
                steps = redistribute(entry.layout, binding.layout, entry.shape, itemsize,
                                     plan.mesh)
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
    missing = [n.name for n in graph.ops if n.name not in {op.name for op in plan.ops}]
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


def _model(plan: Plan, graph: PlanningGraph, report: Report) -> None:

    try:
        check_plan_matches(plan, graph)
    except ShardplanError as exc:
        report.add(str(exc))
        return
    analysis = GraphAnalysis.of(graph)
    entries = {op.name: op for op in plan.ops}
    strategies: dict[str, OpStrategy] = {}
    before = len(report.problems)
    cosmetic = 0  # strategy tuples out of step with layouts: the collectives still follow
    for node in graph.ops:
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
        if not is_valid(node, labels, strategy, graph.tensors, plan.mesh):
            report.add(f"op {node.name} ({node.op_type}): assignment "
                       f"{_assignment_text(entry.assignment)} is not a valid strategy of its "
                       "sharding rule on this mesh")
            continue
        tuples = [list(b.layout.split_factors(plan.mesh)) if b else [] for b in entry.inputs]
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
    if len(report.problems) - before > cosmetic:
        return  # layouts or assignments are wrong: re-deriving collectives would mislead
    again = derive(analysis, plan.mesh, strategies,
                   training=plan.step.kind == StepKind.TRAINING)

    def op_level(collectives) -> Counter:
        return Counter((str(c.kind), c.tensor, tuple(c.axes), str(c.phase), c.op)
                       for c in collectives
                       if c.phase in (Phase.FORWARD, Phase.BACKWARD) and c.op != OPTIMIZER_OP
                       and c.kind != CollectiveKind.SEND_RECV and c.op != SEND_OP)

    expected, got = op_level(again.collectives), op_level(plan.collectives)
    for (kind, tensor, axes, phase, op), count in sorted((expected - got).items())[:MAX_LISTED]:
        report.add(f"missing {phase} {kind} of {tensor} over {list(axes)} at op {op} "
                   f"({count}×): the assignments need it")
    for (kind, tensor, axes, phase, op), count in sorted((got - expected).items())[:MAX_LISTED]:
        report.add(f"extra {phase} {kind} of {tensor} over {list(axes)} at op {op} "
                   f"({count}×): no assignment needs it")
    needed_axes = {name: set(axes) for name, axes in again.gradient_axes.items()}
    listed_axes: dict[str, set[str]] = {}
    for c in plan.collectives:
        if c.op == OPTIMIZER_OP and AxisRole.PIPELINE not in c.axes:
            listed_axes.setdefault(c.tensor, set()).update(c.axes)
    for name in sorted(set(needed_axes) - set(listed_axes))[:MAX_LISTED]:
        report.add(f"weight {name}: its gradient must be summed over "
                   f"{list(again.gradient_axes[name])} but the plan lists no such collective")
    for name, axes in sorted(listed_axes.items())[:MAX_LISTED]:
        if name not in needed_axes:
            report.add(f"weight {name}: the plan sums its gradient over {sorted(axes)}, but no "
                       "op splits work on it there (the sum would multiply it)")
        elif axes != needed_axes[name]:
            report.add(f"weight {name}: the plan sums its gradient over {sorted(axes)}, the "
                       f"assignments need {sorted(needed_axes[name])}")
    report.checked["collectives"] = sum(expected.values()) + len(needed_axes)


def _assignment_text(assignment) -> dict[str, list[str]]:
    """An assignment as the plan file spells it (what the user reads and edits)."""
    return {label: list(axes) for label, axes in assignment.items()}
