"""The joint search over data, tensor and pipeline parallelism, micro-batches, ZeRO and
recompute, and the pipeline plan it returns.

The space is (pp, dp, tp, micro-batches, ZeRO stage, schedule) with a recompute mode per
stage. Three observations make it fast enough for thousands of devices:

1. The op-level plan of one stage depends only on the tensor-parallel degree and the
   per-device micro-batch: dp splits the batch alone (the pinned meaning of dp), so each
   device computes the same local shapes whatever dp is. One op-level solve per
   (tp, local micro-batch) prices every stage of every configuration using it; dp enters
   only through the gradient reductions, priced per configuration on its own mesh.
2. Stage boundaries fall between units (layers); a `UnitProfile` holds each unit's prices,
   and the partition DP (`planner.stages.partition`) runs on prefix sums in numpy.
3. Configurations are tried in order of a lower bound on their step time (the busiest
   device's share of the work), and the search stops when the bound passes the best plan
   found.

The finalists are then planned exactly: the op-level plan is solved on the real stage mesh
at the real micro-batch, assembled on the (pp, dp, tp) mesh, and partitioned again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from costmodels.profile import HardwareProfile
from costmodels.schedule import bubble_fraction, pipeline_time
from planner.assemble import TrainingOptions, assemble, op_labels
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.onnx_import import import_model
from planner.ops import DimLabels
from planner.planfile import Collective, ParallelConfig, Plan, Predicted, SolverRecord
from planner.search.data_parallel import data_parallel_strategies, dp_splits_exactly
from planner.search.layers import find_repeats, tie_classes
from planner.search.problem import build_problem, prune_dominated, restrict_candidates
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy
from planner.stages import (
    PIPELINE_AXIS,
    RECOMPUTE_MODES,
    Partition,
    PipelineConfig,
    PipelinePrice,
    Pricer,
    UnitProfile,
    Units,
    find_units,
    op_ranges,
    partition,
    recompute_segments,
    stage_table,
    summary_mode,
    unit_profile,
)

UNLIMITED = 1 << 62
MAX_LOCAL_MICRO_BATCH = 16  # per device; GEMMs are near their peak efficiency by then
SCHEDULES_SEARCHED = ("1f1b", "interleaved")  # GPipe takes 1F1B's time with more memory
INTERLEAVE_CHUNKS = 2


@dataclass(frozen=True)
class Choice:
    """One point of the joint space (recompute is chosen per stage by the partition)."""

    pp: int
    dp: int
    tp: int
    micro_batches: int
    zero: int
    schedule: str = "1f1b"
    virtual_stages: int = 1

    def describe(self) -> str:
        sched = self.schedule + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"pp={self.pp} dp={self.dp} tp={self.tp} mb={self.micro_batches} "
                f"zero={self.zero} {sched}")


@dataclass
class Scored:
    choice: Choice
    partition: Partition
    units: Units

    @property
    def step_time_s(self) -> float:
        return self.partition.price.step_time_s


@dataclass
class JointResult:
    ranked: list[Scored]  # fitting configurations by predicted step time (surrogate prices)
    tried: int
    smallest_memory: float  # the least peak memory any configuration tried needs
    smallest_where: str
    considered: int = 0  # configurations the pins allow
    unformed: dict[str, int] = field(default_factory=dict)  # why configurations had no price
    smallest_memory_by_category: dict[str, int] = field(default_factory=dict)


def stage_mesh(dp: int, tp: int, per_node: int, pp: int = 1) -> DeviceMesh:
    """(pp, dp, tp) with axes of size 1 dropped (at least one axis kept)."""
    axes = {name: size for name, size in ((PIPELINE_AXIS, pp), ("dp", dp), ("tp", tp))
            if size > 1}
    return DeviceMesh.build(axes or {"dp": 1}, per_node)


def batch_labels(graph: PlanningGraph,
                 labels: Mapping[str, DimLabels | None]) -> dict[str, set[str]]:
    """Per op, the labels that carry the batch (traced from the batch inputs)."""
    if not graph.batch:
        return {}
    tracer = data_parallel_strategies(graph, DeviceMesh.build({"dp": graph.batch}, 1), labels)
    return {name: {label for label, _ in strategy.assignment}
            for name, strategy in tracer.items()}


def model_parallel_strategies(graph: PlanningGraph, mesh: DeviceMesh, hardware: HardwareProfile,
                              training: TrainingOptions, labels: Mapping[str, DimLabels | None],
                              batch: Mapping[str, set[str]], time_limit: float,
                              fixed: Mapping[str, OpStrategy] | None = None,
                              ) -> dict[str, OpStrategy]:
    """The fastest op-level plan on `mesh` where "dp" splits exactly the batch and "tp"
    never does (memory is the stage search's business: unlimited here)."""
    from planner.search.auto import SearchOptions, _solve

    if mesh.size == 1:
        return {}
    unlimited = replace(training, memory_limit_bytes=UNLIMITED)
    problem = build_problem(graph, mesh, hardware, labels, unlimited, fixed,
                            tie_classes(graph, find_repeats(graph)))
    dp = mesh.axis_size("dp") if "dp" in mesh.axis_names else 1
    for index, group in enumerate(problem.groups):
        wanted = batch.get(group.ops[0], set()) if dp > 1 else set()
        keep = []
        for position, candidate in enumerate(group.candidates):
            assigned = dict(candidate.strategy.assignment)
            tp_on_batch = any("tp" in axes and label in batch.get(group.ops[0], set())
                              for label, axes in assigned.items())
            if dp_splits_exactly(assigned, wanted) and not tp_on_batch:
                keep.append(position)
        if keep:
            restrict_candidates(problem, index, keep)
    prune_dominated(problem)
    solution = _solve(problem, SearchOptions(solver="auto", time_limit=time_limit))
    if not solution.choice:
        raise ShardplanError(f"{graph.path}: no op-level plan on mesh {mesh.shape} "
                             f"({solution.status})")
    return problem.strategies(solution.choice)


class _Graphs:
    """The model imported at each micro-batch size it is priced at (import is cheap)."""

    def __init__(self, graph: PlanningGraph) -> None:
        self.graph = graph
        self.cache: dict[int, PlanningGraph] = {graph.batch: graph} if graph.batch else {}

    def at(self, batch: int) -> PlanningGraph:
        if batch not in self.cache:
            dims = {k: v for k, v in self.graph.bound_dims.items()
                    if k != self.graph.batch_symbol}
            self.cache[batch] = import_model(self.graph.path, batch=batch, dims=dims)
        return self.cache[batch]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_sizes(per_rank: int) -> list[int]:
    """Local micro-batch sizes worth trying: powers of two and the whole per-rank batch."""
    sizes = {b for b in (1 << k for k in range(5)) if per_rank % b == 0}
    if per_rank <= MAX_LOCAL_MICRO_BATCH:
        sizes.add(per_rank)
    return sorted(s for s in sizes if s <= MAX_LOCAL_MICRO_BATCH) or [1]


def enumerate_choices(devices: int, batch: int, layers: int, per_node: int,
                      pins: Mapping[str, int | str]) -> list[Choice]:
    """Every configuration the pins allow: tp a power of two inside a node, dp dividing the
    batch, pp up to the number of layers, at least pp micro-batches when pipelined."""
    choices = []
    tps = [t for t in (1 << k for k in range(12)) if t <= per_node and devices % t == 0]
    if "tp" in pins:
        tps = [int(pins["tp"])]
    for pp in _divisors(devices):
        if pp > max(1, layers) or ("pp" in pins and pp != int(pins["pp"])):
            continue
        for tp in tps:
            if devices % (pp * tp):
                continue
            dp = devices // (pp * tp)
            if ("dp" in pins and dp != int(pins["dp"])) or batch % dp:
                continue
            per_rank = batch // dp
            for local in _micro_sizes(per_rank):
                m = per_rank // local
                if "micro_batches" in pins:
                    m = int(pins["micro_batches"])
                    if per_rank % m:
                        continue
                elif pp > 1 and m < pp:
                    continue
                zeros = [int(pins["zero"])] if "zero" in pins else ([0, 1, 2, 3] if dp > 1
                                                                    else [0])
                schedules = [str(pins["schedule"])] if "schedule" in pins else (
                    list(SCHEDULES_SEARCHED) if pp > 1 else ["1f1b"])
                for zero in zeros:
                    for schedule in schedules:
                        chunks = INTERLEAVE_CHUNKS if schedule == "interleaved" else 1
                        if schedule == "interleaved" and (pp == 1 or m % pp):
                            continue
                        choices.append(Choice(pp, dp, tp, m, zero, schedule, chunks))
    return sorted(set(choices), key=lambda c: (c.pp, c.tp, c.dp, c.micro_batches, c.zero,
                                               c.schedule))


def joint_search(graph: PlanningGraph, hardware: HardwareProfile, devices: int,
                 training: TrainingOptions, pins: Mapping[str, int | str],
                 time_limit: float = 60.0, top_k: int = 3,
                 progress: Callable[[str], None] | None = None) -> JointResult:
    """Rank the configurations that fit, by the surrogate prices (see the module doc)."""
    if not graph.batch:
        raise ShardplanError(f"{graph.path}: the joint search needs a batch dimension "
                             "(--batch) to split into data-parallel ranks and micro-batches")
    per_node = int(hardware.devices_per_node.value)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    units = find_units(graph)
    layers = len(units.layer_units) or units.count
    choices = enumerate_choices(devices, graph.batch, layers, per_node, pins)
    modes = [str(pins["recompute"])] if "recompute" in pins else list(RECOMPUTE_MODES)
    if not choices:
        raise ShardplanError(f"--parallel {dict(pins)}: no configuration of {devices} devices "
                             f"and batch {graph.batch} matches these pins")
    graphs = _Graphs(graph)
    labels = op_labels(graph)
    batch = batch_labels(graph, labels)
    profiles: dict[tuple[int, int], tuple[UnitProfile, Units]] = {}

    def profile_of(tp: int, local: int) -> tuple[UnitProfile, Units]:
        key = (tp, local)
        if key not in profiles:
            small = graphs.at(local)
            mesh = stage_mesh(1, tp, per_node)
            small_labels = op_labels(small)
            strategies = model_parallel_strategies(small, mesh, hardware, training,
                                                   small_labels, batch, time_limit)
            plan = assemble(small, mesh, strategies, hardware, ParallelConfig(tp=tp),
                            SolverRecord("surrogate", "fixed", 0, 0, 0, 0), training,
                            small_labels)
            small_units = find_units(small)
            profiles[key] = (unit_profile(small, plan, small_units), small_units)
        return profiles[key]

    # Cheapest-first by a lower bound: perfectly balanced stages (the slowest stage takes
    # at least the mean) through the schedule, with no recompute and no gradient sync.
    bounds = []
    for choice in choices:
        local = graph.batch // (choice.dp * choice.micro_batches)
        profile, _ = profile_of(choice.tp, local)
        mean = float((profile.forward + profile.backward).sum()) / choice.pp
        bound = pipeline_time([mean] * choice.pp, choice.micro_batches, choice.schedule,
                              choice.virtual_stages)
        bounds.append((bound, choice))
    bounds.sort(key=lambda item: item[0])
    ranked: list[Scored] = []
    smallest, where = math.inf, ""
    tried = 0
    with_dp: dict[tuple[int, int, bool], UnitProfile] = {}
    unformed: dict[str, int] = {}
    categories: dict[str, int] = {}
    for bound, choice in bounds:
        if len(ranked) >= top_k and bound > ranked[top_k - 1].step_time_s:
            break
        local = graph.batch // (choice.dp * choice.micro_batches)
        profile, small_units = profile_of(choice.tp, local)
        key = (choice.tp, local, choice.dp > 1)
        if key not in with_dp:
            with_dp[key] = _with_data_axis(profile, choice.dp)
        profile = with_dp[key]
        mesh = stage_mesh(choice.dp, choice.tp, per_node, choice.pp)
        pricer = Pricer(profile, _config(choice, training), hardware, mesh)
        tried += 1
        found = partition(pricer, limit, modes)
        if found is None:
            least = partition(pricer, math.inf, ["full"])
            if least is None:
                reason = _unformed(choice, small_units)
                unformed[reason] = unformed.get(reason, 0) + 1
            elif least.price.peak_memory < smallest:
                smallest, where = least.price.peak_memory, choice.describe()
                categories = _peak_stage_memory(least.price)
            continue
        if found.price.peak_memory < smallest:
            smallest, where = found.price.peak_memory, choice.describe()
            categories = _peak_stage_memory(found.price)
        ranked.append(Scored(choice, found, small_units))
        ranked.sort(key=lambda s: s.step_time_s)
    if progress is not None:
        progress(f"joint search: {tried} of {len(choices)} configurations priced, "
                 f"{len(ranked)} fit")
    return JointResult(ranked, tried, smallest, where, len(choices), unformed, categories)


def _peak_stage_memory(price: PipelinePrice) -> dict[str, int]:
    return max(price.stages, key=lambda s: s.memory.peak).memory.to_json()


def _unformed(choice: Choice, units: Units) -> str:
    """Why a configuration cannot be laid on the model's units at all."""
    layers = len(units.layer_units)
    if choice.schedule == "interleaved":
        return (f"interleaving pp={choice.pp} × {choice.virtual_stages} chunks needs a layer "
                f"count divisible by {choice.pp * choice.virtual_stages}; the model has "
                f"{layers} repeated layers")
    return (f"pp={choice.pp} needs at least as many units as stages; the model has "
            f"{units.count} (prefix, {layers} layers, suffix)")


def _with_data_axis(profile: UnitProfile, dp: int) -> UnitProfile:
    """The surrogate profile on the real mesh: every gradient is also summed over dp."""
    if dp <= 1:
        return profile
    params = [replace(p, axes=("dp", *p.axes)) for p in profile.params]
    return replace(profile, params=params)


def _config(choice: Choice, training: TrainingOptions) -> PipelineConfig:
    return PipelineConfig(pp=choice.pp, micro_batches=choice.micro_batches, zero=choice.zero,
                          schedule=choice.schedule, virtual_stages=choice.virtual_stages,
                          optimizer=training.optimizer, overlap=training.overlap)


def pipeline_plan(graph: PlanningGraph, hardware: HardwareProfile, choice: Choice,
                  training: TrainingOptions, modes: list[str] | None = None,
                  time_limit: float = 60.0, graphs: _Graphs | None = None,
                  record: SolverRecord | None = None) -> Plan | None:
    """The exact plan of one configuration: op-level plan on the stage mesh at the real
    micro-batch, assembled on (pp, dp, tp), partitioned; None when it does not fit."""
    if not graph.batch or graph.batch % (choice.dp * choice.micro_batches):
        raise ShardplanError(f"{graph.path}: batch {graph.batch} does not split into "
                             f"{choice.dp} data-parallel ranks × {choice.micro_batches} "
                             "micro-batches")
    per_node = int(hardware.devices_per_node.value)
    graphs = graphs or _Graphs(graph)
    micro = graphs.at(graph.batch // choice.micro_batches)
    labels = op_labels(micro)
    inner = stage_mesh(choice.dp, choice.tp, per_node)
    strategies = model_parallel_strategies(micro, inner, hardware, training, labels,
                                           batch_labels(micro, labels), time_limit)
    mesh = stage_mesh(choice.dp, choice.tp, per_node, choice.pp)
    parallel = ParallelConfig(dp=choice.dp, tp=choice.tp, pp=choice.pp,
                              micro_batches=choice.micro_batches, zero=choice.zero,
                              optimizer=training.optimizer)
    record = record or SolverRecord("joint", "optimal", 0.0, 0.0, 0.0, 0.0)
    plan = assemble(micro, mesh, strategies, hardware, parallel, record, training, labels)
    if choice.tp > 1 and not any("tp" in s.used_axes for s in strategies.values()):
        # Nothing splits over tp: its ranks repeat the same work (replication), which is
        # what `parallel.tp` = 1 says; the mesh keeps the axis, the ranks exist.
        plan.parallel.tp = 1
        plan.warnings.append(
            f"mesh axis tp={choice.tp}: no op of this model is worth splitting over it on "
            f"{hardware.name} (its tensors are too small), so those {choice.tp} ranks repeat "
            "the same work")
    units = find_units(micro)
    profile = unit_profile(micro, plan, units)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    config = _config(choice, training)
    found = partition(Pricer(profile, config, hardware, mesh), limit,
                      modes or list(RECOMPUTE_MODES))
    if found is None:
        return None
    finish_pipeline(plan, micro, units, profile, found, choice, graph.batch, hardware)
    return plan


def finish_pipeline(plan: Plan, graph: PlanningGraph, units: Units, profile: UnitProfile,
                    found: Partition, choice: Choice, global_batch: int,
                    hardware: HardwareProfile) -> None:
    """Write the partition into `plan`: stages, sends, collectives, predicted cost."""
    price = found.price
    config = price.config
    mesh = plan.mesh
    stage_size = mesh.size // choice.pp
    plan.parallel.recompute = summary_mode(found.recompute)
    rows = stage_table(price, units)
    stage_of_unit = {}
    for d, ranges in enumerate(found.devices):
        for a, b in ranges:
            for u in range(a, b):
                stage_of_unit[u] = d
    for row, ranges, ops, mode in zip(rows, found.devices, op_ranges(units, found.devices),
                                      found.recompute, strict=True):
        row["ops"] = ops
        row["ranks"] = list(range(row["device_stage"] * stage_size,
                                  (row["device_stage"] + 1) * stage_size))
        row["recompute_segments"] = recompute_segments(graph, units, ranges, mode)
    sends = []
    for crossing in profile.crossings:
        source = stage_of_unit[crossing.producer]
        targets = sorted({stage_of_unit[u] for u in crossing.consumers} - {source})
        for target in targets:
            sends.append({"tensor": crossing.tensor, "from_stage": source, "to_stage": target,
                          "bytes": round(crossing.bytes), "grad": crossing.grad})
    plan.pipeline = {
        "schedule": config.schedule, "micro_batches": config.micro_batches,
        "micro_batch_size": graph.batch, "global_batch": global_batch,
        "virtual_stages": config.virtual_stages,
        "bubble_fraction": bubble_fraction(choice.pp, config.micro_batches, config.schedule,
                                           config.virtual_stages),
        "units": [{"name": name, "ops": [units.bounds[k], units.bounds[k + 1]]}
                  for k, name in enumerate(units.names)],
        "stages": rows, "sends": sends,
    }
    plan.collectives = _collectives(plan, profile, sends, choice, hardware)
    plan.predicted = predicted_from(price, plan.predicted.memory_limit_bytes)


#: Per ZeRO stage, the collectives of one weight: (kind, phase). Forward and backward
#: entries run once per micro-batch, gradient entries once per step (as priced by
#: `planner.stages._WeightTables`).
ZERO_COLLECTIVES = {
    0: (("all_reduce", "gradient"),),
    1: (("reduce_scatter", "gradient"), ("all_gather", "gradient")),
    2: (("reduce_scatter", "backward"), ("all_gather", "gradient")),
    3: (("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")),
}


def _collectives(plan: Plan, profile: UnitProfile, sends: list[dict], choice: Choice,
                 hardware: HardwareProfile) -> list[Collective]:
    """Op-level collectives as assembled; the weights' collectives as ZeRO runs them, once
    per pipeline stage holding the weight, plus the sum between the holders of a weight
    read in two stages (a tied embedding); the point-to-point transfers between stages."""
    from planner.pricing import collective_seconds

    mesh = plan.mesh
    result = [c for c in plan.collectives if c.phase != "gradient"]
    stage_of_op = _stage_of_op(plan)
    holders: dict[str, set[int]] = {}
    for index, op in enumerate(plan.ops):
        for binding in op.inputs:
            if binding and binding.tensor in plan.tensors and \
                    plan.tensors[binding.tensor].kind == "parameter":
                holders.setdefault(binding.tensor, set()).add(stage_of_op[index])
    for param in profile.params:
        axes = [a for a in param.axes if a in mesh.axis_names and mesh.axis_size(a) > 1]
        stages = sorted(holders.get(param.name, {0}))
        for _ in stages:
            for kind, phase in ZERO_COLLECTIVES[choice.zero] if axes else ():
                seconds = collective_seconds(hardware, kind, param.bytes, axes, mesh)
                result.append(Collective(kind, param.name, axes, round(param.bytes), phase,
                                         "optimizer", seconds))
            if len(stages) > 1:  # priced as one exchange with the other holder
                seconds = collective_seconds(hardware, "send_recv", param.bytes,
                                             [PIPELINE_AXIS], mesh)
                result.append(Collective("all_reduce", param.name, [PIPELINE_AXIS],
                                         round(param.bytes), "gradient", "optimizer", seconds))
    first_reader: dict[tuple[str, int], str] = {}
    for index, op in enumerate(plan.ops):
        for binding in op.inputs:
            if binding:
                first_reader.setdefault((binding.tensor, stage_of_op[index]), op.name)
    for send in sends:
        seconds = collective_seconds(hardware, "send_recv", send["bytes"], [PIPELINE_AXIS],
                                     mesh) if PIPELINE_AXIS in mesh.axis_names else 0.0
        op = first_reader.get((send["tensor"], send["to_stage"]), "pipeline")
        result.append(Collective("send_recv", send["tensor"], [PIPELINE_AXIS], send["bytes"],
                                 "forward", op, seconds))
        if send["grad"]:
            result.append(Collective("send_recv", send["tensor"], [PIPELINE_AXIS],
                                     send["bytes"], "backward", op, seconds))
    return result


def _stage_of_op(plan: Plan) -> list[int]:
    """The pipeline device stage of every op (0 without a pipeline section)."""
    stage = [0] * len(plan.ops)
    for row in (plan.pipeline or {}).get("stages", []):
        for a, b in row["ops"]:
            stage[a:b] = [row["device_stage"]] * (b - a)
    return stage


def predicted_from(price: PipelinePrice, limit: int) -> Predicted:
    """The plan's figures: the busiest device's compute and communication over the step,
    and the pipeline bubble as the rest."""
    config = price.config
    m = config.micro_batches
    busiest = price.busiest
    forward = busiest.forward_s - busiest.forward_communication_s
    backward = busiest.backward_s - busiest.backward_communication_s
    compute = m * (forward + backward + busiest.recompute_s) + busiest.optimizer_s
    communication = m * (busiest.forward_communication_s + busiest.backward_communication_s
                         + busiest.p2p_s + busiest.zero_s) + busiest.sync_s
    peak_stage = max(price.stages, key=lambda s: s.memory.peak)
    memory = peak_stage.memory.to_json()
    return Predicted(
        step_time_s=price.step_time_s, compute_s=compute, communication_s=communication,
        memory=memory, memory_limit_bytes=int(limit), fits=memory["peak"] <= limit,
        breakdown={
            "pipeline_s": price.pipeline_s,
            "bubble_s": max(0.0, price.step_time_s - compute - communication),
            "forward_s": m * forward, "backward_s": m * backward,
            "forward_communication_s": m * busiest.forward_communication_s,
            "backward_communication_s": m * busiest.backward_communication_s,
            "recompute_s": m * busiest.recompute_s, "p2p_s": m * busiest.p2p_s,
            "zero_s": m * busiest.zero_s, "gradient_communication_s": busiest.sync_s,
            "optimizer_s": busiest.optimizer_s,
        },
    )


def plan_joint(graph: PlanningGraph, hardware: HardwareProfile, devices: int,
               training: TrainingOptions, pins: Mapping[str, int | str],
               time_limit: float = 60.0, top_k: int = 3,
               progress: Callable[[str], None] | None = None) -> tuple[list[Plan], JointResult]:
    """Exact plans of the top-k configurations, cheapest first."""
    started = time.perf_counter()
    result = joint_search(graph, hardware, devices, training, pins, time_limit, top_k,
                          progress)
    modes = [str(pins["recompute"])] if "recompute" in pins else None
    graphs = _Graphs(graph)
    plans = []
    for scored in result.ranked[:top_k]:
        record = SolverRecord(
            name="joint", status="optimal", objective=scored.step_time_s,
            bound=scored.step_time_s, gap=0.0, time_s=0.0,
            detail={"configurations": result.considered, "priced": result.tried,
                    "surrogate_step_time_s": scored.step_time_s,
                    "stages": "partition DP over units (layers), recompute per stage"},
        )
        plan = pipeline_plan(graph, hardware, scored.choice, training, modes, time_limit,
                             graphs, record)
        if plan is not None:
            if "tp" in pins:  # the user's pin names the mesh axis: report it as given
                plan.parallel.tp = int(pins["tp"])
            plan.solver.time_s = time.perf_counter() - started
            plans.append(plan)
    plans.sort(key=lambda p: p.predicted.step_time_s)
    return plans, result
