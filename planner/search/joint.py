"""The joint search over data, tensor and pipeline parallelism, micro-batches, ZeRO and
recompute: it returns the best configurations as pipeline decisions.

The space is (pp, dp, tp, micro-batches, ZeRO stage, schedule) with a recompute mode per
stage. Three observations make it fast enough for thousands of devices:

1. The op-level plan of one stage depends only on the tensor-parallel degree and the
   per-device micro-batch: dp splits the batch alone (the pinned meaning of dp), so each
   device computes the same local shapes whatever dp is. One op-level solve per
   (tp, local micro-batch) prices every stage of every configuration using it; dp enters
   only through the gradient reductions, priced per configuration on its own mesh.
2. Stage boundaries fall between units (layers); a `UnitProfile` holds each unit's prices,
   and the partition DP (`planner.search.stages`) runs on prefix sums in numpy.
3. Configurations are tried in order of a lower bound on their step time (the busiest
   device's share of the work), and the search stops when the bound passes the best plan
   found.

The finalists are then decided exactly: the op-level choice is solved on the real stage
mesh at the real micro-batch, priced on the (pp, dp, tp) mesh, and partitioned again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from costmodels.profile import HardwareProfile
from costmodels.schedule import pipeline_time
from planner.cost.oplevel import priced_choice
from planner.cost.pipeline import Pricer
from planner.cost.step import PipelineConfig, StepPrice, TrainingOptions
from planner.cost.units import UnitProfile, unit_profile
from planner.errors import ShardplanError
from planner.kinds import RECOMPUTE_MODES, AxisRole, Recompute, Schedule
from planner.layers import Units
from planner.records import SolverDetail, SolverRecord
from planner.search.decisions import Choice, PipelineDecision
from planner.search.layers import tie_classes
from planner.search.options import Pins
from planner.search.problem import build_problem, prune_dominated, restrict_candidates
from planner.search.solve import Engine, solve
from planner.search.stages import Partition, Partitioner
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.batch import dp_splits_exactly
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy

UNLIMITED = 1 << 62
MAX_LOCAL_MICRO_BATCH = 16  # per device; GEMMs are near their peak efficiency by then
SCHEDULES_SEARCHED = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)  # GPipe: 1F1B's time,
INTERLEAVE_CHUNKS = 2  # more memory


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
    axes = {str(name): size for name, size in ((AxisRole.PIPELINE, pp), (AxisRole.DATA, dp),
                                               (AxisRole.TENSOR, tp)) if size > 1}
    return DeviceMesh.build(axes or {str(AxisRole.DATA): 1}, per_node)


def model_parallel_strategies(analysis: GraphAnalysis, mesh: DeviceMesh,
                              hardware: HardwareProfile, training: TrainingOptions,
                              batch: Mapping[str, frozenset[str]], time_limit: float,
                              fixed: Mapping[str, OpStrategy] | None = None,
                              ) -> tuple[dict[str, OpStrategy], SolverRecord]:
    """The fastest op-level plan on `mesh` where "dp" splits exactly the batch and "tp"
    never does (memory is the stage search's business: unlimited here)."""
    from planner.search.oplevel import record_of

    if mesh.size == 1:
        return {}, SolverRecord("none", "optimal", 0.0, 0.0, 0.0)
    unlimited = replace(training, memory_limit_bytes=UNLIMITED)
    problem = build_problem(analysis, mesh, hardware, unlimited, fixed,
                            tie_classes(analysis.graph, analysis.repeats))
    dp = mesh.axis_size(AxisRole.DATA) if AxisRole.DATA in mesh.axis_names else 1
    for index, group in enumerate(problem.groups):
        wanted = batch.get(group.ops[0], frozenset()) if dp > 1 else frozenset()
        keep = []
        for position, candidate in enumerate(group.candidates):
            assigned = dict(candidate.strategy.assignment)
            tp_on_batch = any(AxisRole.TENSOR in axes and label in batch.get(group.ops[0], ())
                              for label, axes in assigned.items())
            if dp_splits_exactly(assigned, wanted) and not tp_on_batch:
                keep.append(position)
        if keep:
            restrict_candidates(problem, index, keep)
    prune_dominated(problem)
    solution = solve(problem, Engine("auto", time_limit))
    if not solution.choice:
        raise ShardplanError(f"{analysis.graph.path}: no op-level plan on mesh {mesh.shape} "
                             f"({solution.status})")
    return problem.strategies(solution.choice), record_of(solution)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_sizes(per_rank: int) -> list[int]:
    """Local micro-batch sizes worth trying: powers of two and the whole per-rank batch."""
    sizes = {b for b in (1 << k for k in range(5)) if per_rank % b == 0}
    if per_rank <= MAX_LOCAL_MICRO_BATCH:
        sizes.add(per_rank)
    return sorted(s for s in sizes if s <= MAX_LOCAL_MICRO_BATCH) or [1]


def enumerate_choices(devices: int, batch: int, layers: int, per_node: int,
                      pins: Pins) -> list[Choice]:
    """Every configuration the pins allow: tp a power of two inside a node, dp dividing the
    batch, pp up to the number of layers, at least pp micro-batches when pipelined."""
    choices = []
    tps = [t for t in (1 << k for k in range(12)) if t <= per_node and devices % t == 0]
    if pins.tp is not None:
        tps = [pins.tp]
    for pp in _divisors(devices):
        if pp > max(1, layers) or (pins.pp is not None and pp != pins.pp):
            continue
        for tp in tps:
            if devices % (pp * tp):
                continue
            dp = devices // (pp * tp)
            if (pins.dp is not None and dp != pins.dp) or batch % dp:
                continue
            per_rank = batch // dp
            for local in _micro_sizes(per_rank):
                m = per_rank // local
                if pins.micro_batches is not None:
                    m = pins.micro_batches
                    if per_rank % m:
                        continue
                elif pp > 1 and m < pp:
                    continue
                zeros = [pins.zero] if pins.zero is not None else ([0, 1, 2, 3] if dp > 1
                                                                   else [0])
                schedules = [pins.schedule] if pins.schedule is not None else (
                    list(SCHEDULES_SEARCHED) if pp > 1 else [Schedule.ONE_F_ONE_B])
                for zero in zeros:
                    for schedule in schedules:
                        chunks = INTERLEAVE_CHUNKS if schedule == Schedule.INTERLEAVED else 1
                        if schedule == Schedule.INTERLEAVED and (pp == 1 or m % pp):
                            continue
                        choices.append(Choice(pp, dp, tp, m, zero, schedule, chunks))
    return sorted(set(choices), key=lambda c: (c.pp, c.tp, c.dp, c.micro_batches, c.zero,
                                               c.schedule))


def pipeline_config(choice: Choice, training: TrainingOptions) -> PipelineConfig:
    return PipelineConfig(pp=choice.pp, micro_batches=choice.micro_batches, zero=choice.zero,
                          schedule=choice.schedule, virtual_stages=choice.virtual_stages,
                          optimizer=training.optimizer, overlap=training.overlap,
                          bucket_mb=training.bucket_mb)


def recompute_modes(pins: Pins) -> list[Recompute]:
    return [pins.recompute] if pins.recompute is not None else list(RECOMPUTE_MODES)


def joint_search(graphs: Analyses, hardware: HardwareProfile, devices: int,
                 training: TrainingOptions, pins: Pins,
                 time_limit: float = 60.0, top_k: int = 3,
                 progress: Callable[[str], None] | None = None) -> JointResult:
    """Rank the configurations that fit, by the surrogate prices (see the module doc)."""
    root = graphs.root
    graph = root.graph
    if not graph.batch:
        raise ShardplanError(f"{graph.path}: the joint search needs a batch dimension "
                             "(--batch) to split into data-parallel ranks and micro-batches")
    per_node = int(hardware.devices_per_node.value)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    units = root.units
    layers = len(units.layer_units) or units.count
    choices = enumerate_choices(devices, graph.batch, layers, per_node, pins)
    modes = recompute_modes(pins)
    if not choices:
        raise ShardplanError(f"--parallel {pins.given()}: no configuration of {devices} devices "
                             f"and batch {graph.batch} matches these pins")
    batch = root.batch_labels
    profiles: dict[tuple[int, int], tuple[UnitProfile, Units]] = {}

    def profile_of(tp: int, local: int) -> tuple[UnitProfile, Units]:
        key = (tp, local)
        if key not in profiles:
            small = graphs.at(local)
            mesh = stage_mesh(1, tp, per_node)
            strategies, _ = model_parallel_strategies(small, mesh, hardware, training, batch,
                                                      time_limit)
            priced = priced_choice(small, mesh, strategies, hardware, training)
            profiles[key] = (unit_profile(priced, small.units), small.units)
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
            with_dp[key] = profile.with_gradient_axes(
                (str(AxisRole.DATA),) if choice.dp > 1 else ())
        profile = with_dp[key]
        mesh = stage_mesh(choice.dp, choice.tp, per_node, choice.pp)
        partitioner = Partitioner(Pricer(profile, pipeline_config(choice, training), hardware,
                                         mesh))
        tried += 1
        found = partitioner.solve(limit, modes)
        if found is None:
            least = partitioner.solve(math.inf, [Recompute.FULL])
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


def _peak_stage_memory(price: StepPrice) -> dict[str, int]:
    return price.fullest.memory.to_json()


def _unformed(choice: Choice, units: Units) -> str:
    """Why a configuration cannot be laid on the model's units at all."""
    layers = len(units.layer_units)
    if choice.schedule == Schedule.INTERLEAVED:
        return (f"interleaving pp={choice.pp} × {choice.virtual_stages} chunks needs a layer "
                f"count divisible by {choice.pp * choice.virtual_stages}; the model has "
                f"{layers} repeated layers")
    return (f"pp={choice.pp} needs at least as many units as stages; the model has "
            f"{units.count} (prefix, {layers} layers, suffix)")


def exact_decision(graphs: Analyses, hardware: HardwareProfile, choice: Choice,
                   training: TrainingOptions, modes: list[Recompute], time_limit: float,
                   tp_pinned: bool, record: SolverRecord) -> PipelineDecision | None:
    """The exact decision of one configuration: the op-level choice on the stage mesh at
    the real micro-batch, priced on (pp, dp, tp), partitioned; None when it does not fit."""
    graph = graphs.root.graph
    if not graph.batch or graph.batch % (choice.dp * choice.micro_batches):
        raise ShardplanError(f"{graph.path}: batch {graph.batch} does not split into "
                             f"{choice.dp} data-parallel ranks × {choice.micro_batches} "
                             "micro-batches")
    per_node = int(hardware.devices_per_node.value)
    micro_size = graph.batch // choice.micro_batches
    micro = graphs.at(micro_size)
    inner = stage_mesh(choice.dp, choice.tp, per_node)
    strategies, _ = model_parallel_strategies(micro, inner, hardware, training,
                                              micro.batch_labels, time_limit)
    mesh = stage_mesh(choice.dp, choice.tp, per_node, choice.pp)
    priced = priced_choice(micro, mesh, strategies, hardware, training)
    pricer = Pricer(unit_profile(priced, micro.units), pipeline_config(choice, training),
                    hardware, mesh)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    found = Partitioner(pricer).solve(limit, modes)
    if found is None:
        return None
    step = found.price.step_time_s
    return PipelineDecision(choice, micro_size, strategies,
                            tuple(tuple(ranges) for ranges in found.devices),
                            tuple(found.recompute), replace(record, objective=step, bound=step),
                            tp_pinned)


def joint_decisions(graphs: Analyses, hardware: HardwareProfile, devices: int,
                    training: TrainingOptions, pins: Pins,
                    time_limit: float = 60.0, top_k: int = 3,
                    progress: Callable[[str], None] | None = None,
                    ) -> tuple[list[PipelineDecision], JointResult]:
    """Exact decisions of the top-k configurations, in the surrogate's order."""
    result = joint_search(graphs, hardware, devices, training, pins, time_limit, top_k,
                          progress)
    modes = recompute_modes(pins)
    decisions = []
    for scored in result.ranked[:top_k]:
        record = SolverRecord(
            "joint", "optimal", scored.step_time_s, scored.step_time_s, 0.0,
            detail=SolverDetail(configurations=result.considered, priced=result.tried,
                                surrogate_step_time_s=scored.step_time_s,
                                stages="partition DP over units (layers), recompute per "
                                       "stage"))
        decision = exact_decision(graphs, hardware, scored.choice, training, modes,
                                  time_limit, pins.tp is not None, record)
        if decision is not None:
            decisions.append(decision)
    return decisions, result
