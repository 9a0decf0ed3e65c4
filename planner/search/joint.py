"""The joint search over data, tensor and pipeline parallelism, micro-batches, ZeRO and
recompute: it returns the best configurations as pipeline decisions.

The space is (pp, dp, tp, micro-batches, ZeRO stage, schedule, replicas) with a recompute
mode per stage, and under Megatron's layout (`layout=megatron`) whether tp runs its
sequence parallelism (`Pins.sequence_parallel_choices`: a layout of its own per
configuration, priced as any other). Three observations make it fast enough for thousands
of devices:

1. The op-level plan of one stage depends only on the tensor-parallel degree and the
   per-device micro-batch: dp splits the batch alone (the pinned meaning of dp), so each
   device computes the same local shapes whatever dp is. One op-level solve per
   (tp, local micro-batch) prices every stage of every configuration using it; dp enters
   only through the gradient reductions, priced per configuration on its own mesh.
2. Stage boundaries fall between units (layers); a `UnitProfile` holds each unit's prices,
   and the partition DP (`planner.search.stages`) runs on prefix sums in numpy.
3. Configurations are tried in order of a lower bound on their step time (the busiest
   device's share of the work), and the search stops when the bound passes the best plan
   found. A bound starts from a floor that needs no op-level solve; the solve comes
   only when its configuration is first in line.

Each configuration the surrogate finds fitting is then decided exactly before it counts
among the finalists: the op-level choice is solved on the real stage mesh at the real
micro-batch, priced on the (pp, dp, tp) mesh, and partitioned again; one whose exact
layout does not fit is passed over, and the search goes on.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, partial
from typing import NamedTuple

import numpy as np

from costmodels.cluster import Cluster
from costmodels.orders import chunks_per_device
from costmodels.profile import HardwareProfile
from costmodels.schedule import pipeline_time
from planner.cost.oplevel import (
    ComputeFloor,
    compute_floor,
    optimizer_floor_s,
    priced_on_kinds,
)
from planner.cost.step import PipelineConfig, StepPrice, TrainingOptions
from planner.cost.units import UnitProfile, unit_profile
from planner.errors import ModelError, ShardplanError
from planner.kinds import RECOMPUTE_MODES, AxisRole, ContextKind, Recompute, Schedule
from planner.layers import Units
from planner.records import SolverDetail, SolverRecord
from planner.search.decisions import Choice, PipelineDecision
from planner.search.layers import tie_classes
from planner.search.megatron import megatron_strategies
from planner.search.options import PIPELINED_ONLY, Pins
from planner.search.problem import (
    StrategyProblem,
    build_problem,
    prune_dominated,
)
from planner.search.solve import Engine, solve
from planner.search.stages import (
    MAX_PIPELINE_UNITS,
    OrderedPartitioner,
    Partition,
    Partitioner,
    partitioner_for,
)
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.batch import dp_splits_exactly, rows_meet_reason
from planner.sharding.candidates import Candidate
from planner.sharding.context import context_allows, head_labels, whole_allowed
from planner.sharding.experts import Experts, expert_allows
from planner.sharding.mesh import MAX_MESH_AXES, DeviceMesh
from planner.sharding.strategy import OpStrategy

UNLIMITED = 1 << 62
MAX_MEMORY_AWARE = 8  # configurations per search given a memory-aware layout
MEMORY_AWARE_ROUNDS = 3  # budgets tried per configuration
MAX_LOCAL_MICRO_BATCH = 16  # per device; GEMMs are near their peak efficiency by then
SCHEDULES_SEARCHED = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZB_H1,
                      Schedule.ZBV)  # GPipe: 1F1B's time, more memory.
# Interleaved chunks per device searched: 2 up to this, while every chunk
# keeps at least one layer (Megatron-LM SC'21 ran up to 4; more adds sends, little bubble).
MAX_INTERLEAVE_CHUNKS = 8
#: Context parallelism is searched only while every rank keeps a block of at least this
#: many tokens of each sequence (pinned cp is not bound by it). Below it a block's
#: attention no longer dominates its layer and splitting the batch (dp, no K/V traffic)
#: or the heads (tp) serves as well: Llama 3 (Dubey et al. 2024, Table 4) trained 8k-token
#: sequences with cp=1 and 128k-token ones with cp=16, blocks of 8k tokens. It keeps the
#: search of ordinary sequence lengths as it was (no cp configurations at all below 16k).
MIN_CONTEXT_BLOCK = 8192


@dataclass(frozen=True)
class MemoryBudget:
    """The memory-aware op-level solve: each choice's memory counted as `weights`·(its
    weights, gradients and states) + `activations`·(its saved activations), within
    `limit` bytes (with the workspace)."""

    limit: float
    weights: float
    activations: float


@dataclass
class Scored:
    choice: Choice
    partition: Partition
    units: Units
    budget: MemoryBudget | None = None  # the memory-aware layout's budget, if any

    @property
    def step_time_s(self) -> float:
        return self.partition.price.step_time_s


class Verdict(NamedTuple):
    """Whether a configuration's exact layout fits; where not, its least-memory
    partition (all recompute), if it has one."""

    fits: bool
    least: Partition | None = None


@dataclass
class JointResult:
    ranked: list[Scored]  # fitting configurations by predicted step time (surrogate prices)
    tried: int
    smallest_memory: float  # the least peak memory any configuration tried needs
    smallest_where: str
    considered: int = 0  # configurations the pins allow
    unformed: dict[str, int] = field(default_factory=dict)  # why configurations had no price
    smallest_memory_by_category: dict[str, int] = field(default_factory=dict)
    #: micro-batch sizes (rows per device) the graph cannot be bound at -> why: their
    #: configurations were skipped (a token-major batch reshaped into whole sequences)
    skipped_sizes: dict[int, str] = field(default_factory=dict)
    #: units of a graph with more than MAX_PIPELINE_UNITS: no pipeline was considered
    too_many_units: int = 0
    #: why no configuration of several micro-batches was considered: rows of the batch
    #: meet (`planner.sharding.batch.rows_meet_reason`); "" where they stay apart
    rows_meet: str = ""

    def warnings(self) -> tuple[str, ...]:
        """What the plan says of the micro-batch sizes and pipelines this search could not
        consider."""
        found = []
        if self.skipped_sizes:
            sizes = sorted(self.skipped_sizes)
            shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
            found.append(f"micro-batches of {shown} rows were not considered: the graph does "
                         f"not bind its batch dim at those sizes "
                         f"({self.skipped_sizes[sizes[0]]})")
        if self.too_many_units:
            found.append(f"pipelines were not considered: the graph has {self.too_many_units} "
                         f"units (layers), more than the stage search's {MAX_PIPELINE_UNITS}")
        if self.rows_meet:
            found.append("micro-batches (and so pipelines) were not considered: "
                         + self.rows_meet)
        return tuple(found)


def stage_mesh(dp: int, tp: int, per_node: int, pp: int = 1, replicas: int = 1,
               cp: int = 1, ep: int = 1) -> DeviceMesh:
    """(pp, rep, dp, ep, cp, tp) with axes of size 1 dropped (at least one axis kept). pp
    stays outermost, so a stage's ranks are one block of the mesh (the plan's pipeline
    section says so); the replica axis comes next, so dp, cp and tp keep the fastest
    links; cp sits inside dp (its K/V traffic runs every layer, dp's once a step) and
    outside tp (tp's all-reduces are the largest and most frequent); ep sits inside dp,
    as Megatron-LM's expert-data-parallel groups do (its all-to-alls run every expert
    layer, on links faster than dp's)."""
    axes = {str(name): size for name, size in (
        (AxisRole.PIPELINE, pp), (AxisRole.REPLICA, replicas), (AxisRole.DATA, dp),
        (AxisRole.EXPERT, ep), (AxisRole.CONTEXT, cp), (AxisRole.TENSOR, tp)) if size > 1}
    return DeviceMesh.build(axes or {str(AxisRole.DATA): 1}, per_node)


def choice_mesh(choice: Choice, per_node: int) -> DeviceMesh:
    """The whole mesh a configuration runs on, its replicas included."""
    return stage_mesh(choice.dp, choice.tp, per_node, choice.pp, choice.replicas, choice.cp,
                      choice.ep)


def model_parallel_strategies(analysis: GraphAnalysis, mesh: DeviceMesh,
                              hardware: HardwareProfile, training: TrainingOptions,
                              batch: Mapping[str, frozenset[str]], time_limit: float,
                              fixed: Mapping[str, OpStrategy] | None = None,
                              budget: MemoryBudget | None = None,
                              layout: str | None = None, sequence_parallel: bool = False,
                              micro_batches: int = 1,
                              context_kind: ContextKind | None = None,
                              ) -> tuple[dict[str, OpStrategy], SolverRecord,
                                         tuple[float, float] | None]:
    """The fastest op-level plan on `mesh` where "dp" splits exactly the batch and "tp"
    never does, and its memory as the op-level problem counts it (weights with their
    gradients and states, saved activations, workspace). Without a `budget` memory is the
    stage search's business (unlimited); with one, the layout is the fastest whose memory,
    weighed as the configuration holds it, stays within the budget (the memory-aware
    layout of a configuration the fastest layout does not fit). `layout="megatron"` (the
    `--parallel layout=megatron` pin) takes Megatron-LM's split instead of searching one
    (`planner.search.megatron`), with its sequence parallelism when `sequence_parallel`
    (`sp=1`); no budget can change it. `micro_batches`: how many the step runs, so the
    op-level problem weighs per-step costs against per-micro-batch ones as the step does.
    A "cp" axis splits exactly the sequence (`context_allows`; `context_kind` pins how
    attention runs over it); an "ep" axis splits the batch with "dp" or the experts
    (`expert_allows`)."""
    from planner.search.oplevel import record_of

    if mesh.size == 1:
        return {}, SolverRecord("none", "optimal", 0.0, 0.0, 0.0), (0.0, 0.0)
    unlimited = replace(training, memory_limit_bytes=int(budget.limit) if budget else UNLIMITED)
    dp = mesh.axis_size(AxisRole.DATA) if AxisRole.DATA in mesh.axis_names else 1
    context = AxisRole.CONTEXT in mesh.axis_names
    heads = head_labels(analysis) if context else {}
    expert = AxisRole.EXPERT in mesh.axis_names

    @cache
    def writes_weights_only(op: str) -> bool:  # once per op, not per candidate
        return all(name in analysis.weight_roots for name in analysis.graph.op(op).outputs
                   if name)

    def allowed(op: str, candidate: Candidate) -> bool:
        """dp splits exactly the batch, tp never does, cp the sequence, ep the batch with
        dp or the experts."""
        assigned = dict(candidate.strategy.assignment)
        wanted = batch.get(op, frozenset()) if dp > 1 else frozenset()
        tp_on_batch = any(AxisRole.TENSOR in axes and label in batch.get(op, ())
                          for label, axes in assigned.items())
        if tp_on_batch:
            return False
        if expert:
            splits = expert_allows(assigned, batch.get(op, frozenset()),
                                   analysis.experts.labels.get(op, frozenset()),
                                   writes_weights_only(op), dp > 1,
                                   op in analysis.experts.gemms)
        else:
            splits = dp_splits_exactly(assigned, wanted)
        return splits and (not context or context_allows(
            assigned, analysis.sequence_labels.get(op, frozenset()),
            heads.get(op, frozenset()), context_kind, whole_allowed(analysis, op)))

    problem = build_problem(analysis, mesh, hardware, unlimited, fixed,
                            tie_classes(analysis.graph, analysis.blocks), micro_batches,
                            allowed)
    if layout is not None:
        if budget is not None:
            return {}, SolverRecord(layout, "infeasible", 0.0, 0.0, 0.0), None
        pinned = megatron_strategies(analysis.graph, mesh, analysis.labels,
                                     sequence_parallel=sequence_parallel,
                                     weight_roots=analysis.weight_roots)
        choice = _pinned_layout(problem, pinned, analysis)
        return (problem.strategies(choice), SolverRecord(layout, "optimal", 0.0, 0.0, 0.0),
                problem.memory_parts(choice))
    if budget is not None:
        problem.weigh_memory(budget.weights, budget.activations)
    prune_dominated(problem)
    solution = solve(problem, Engine("auto", time_limit))
    if not solution.choice or (budget and solution.status not in ("optimal", "feasible")):
        if budget:
            return {}, record_of(solution), None
        raise ShardplanError(f"{analysis.graph.path}: no op-level plan on mesh {mesh.shape} "
                             f"({solution.status})")
    return (problem.strategies(solution.choice), record_of(solution),
            problem.memory_parts(solution.choice))


def _pinned_layout(problem: StrategyProblem, wanted: Mapping[str, OpStrategy],
                   analysis: GraphAnalysis) -> list[int]:
    """The candidate index of each group that is `wanted`'s strategy for its ops."""
    choice = []
    for group in problem.groups:
        strategies = {wanted[op] for op in group.ops}
        found = [k for k, c in enumerate(group.candidates) if c.strategy in strategies]
        if len(strategies) != 1 or not found:
            raise ShardplanError(
                f"{analysis.graph.path}: --parallel layout=megatron: op {group.ops[0]} has "
                "no Megatron-LM split on this mesh; drop the layout pin to search one")
        choice.append(found[0])
    return choice


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (in O(sqrt n): batches can be large)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def _micro_sizes(per_rank: int, granule: int = 1) -> list[int]:
    """Local micro-batch sizes worth trying: powers of two and the whole per-rank batch, in
    units of `granule` rows (the least the graph binds at: a token-major batch reshaped
    into sequences of 128 binds in multiples of 128 rows)."""
    most = MAX_LOCAL_MICRO_BATCH * granule
    sizes = {b for b in (granule << k for k in range(5)) if per_rank % b == 0}
    if per_rank <= most:
        sizes.add(per_rank)
    return sorted(s for s in sizes if s <= most) or [granule]


def context_degrees(sequence: int | None, pins: Pins) -> list[int]:
    """The context-parallel degrees searched: the pinned one, else 1 and every power of
    two that leaves each rank a block of at least MIN_CONTEXT_BLOCK tokens of a sequence
    of `sequence` tokens (None: the graph has no sequence input, so 1)."""
    if pins.cp is not None:
        return [pins.cp]
    if pins.cp_kind is None and not pins.runnable.context_parallel:
        return [1]  # (the executor the plan is for does not run it)
    found = [c for c in (1 << k for k in range(1, 12))
             if sequence and sequence % c == 0 and sequence // c >= MIN_CONTEXT_BLOCK]
    return found if pins.cp_kind is not None else [1, *found]


def expert_degrees(experts: Experts, devices: int, pins: Pins) -> list[int]:
    """The expert-parallel degrees searched: the pinned one, else 1 and every power of two
    up to `devices` that divides the graph's expert count (none without experts)."""
    if pins.ep is not None:
        return [pins.ep]
    if not pins.runnable.expert_parallel:
        return [1]  # (the executor the plan is for does not run it)
    return [1, *experts.degrees(devices)]


def enumerate_choices(devices: int, batch: int, layers: int, per_node: int,
                      pins: Pins, granule: int = 1,
                      context: Sequence[int] = (1,),
                      experts: Sequence[int] = (1,)) -> list[Choice]:
    """Every configuration the pins allow: tp a power of two inside a node, dp dividing the
    batch, pp up to the number of layers, at least pp micro-batches when pipelined; local
    micro-batches of `granule` rows or multiples of it. dp may leave devices over, which
    repeat the configuration (`Choice.replicas`): more data-parallel ranks cost gradient
    traffic, and a small model can be faster on fewer of them. Such configurations cost
    little to consider: their lower bound (their compute over fewer devices) is higher,
    so the search prices them only when they could win. A replica axis takes one of the
    mesh's MAX_MESH_AXES, so pp, dp and tp cannot all be above 1 beside it. `context`:
    the context-parallel degrees (`context_degrees`), each an axis of its own between dp
    and tp, within the same MAX_MESH_AXES. `experts`: the expert-parallel degrees
    (`expert_degrees`), an axis inside dp that splits the batch with it (dp·ep divides the
    batch); not combined with cp above 1."""
    choices = []
    tps = [t for t in (1 << k for k in range(12)) if t <= per_node and devices % t == 0]
    if pins.tp is not None:
        tps = [pins.tp]
    for pp in _divisors(devices):
        if pp > max(1, layers) or (pins.pp is not None and pp != pins.pp):
            continue
        for tp in tps:
            for cp, ep in ((c, e) for c in context for e in experts if c == 1 or e == 1):
                if devices % (pp * tp * cp * ep):
                    continue
                rest = devices // (pp * tp * cp * ep)
                for dp in [pins.dp] if pins.dp is not None else _divisors(rest):
                    replicas = rest // dp if rest % dp == 0 else 0
                    axes = sum(size > 1 for size in (pp, replicas, dp, ep, cp, tp))
                    if not replicas or batch % (dp * ep) or (batch // (dp * ep)) % granule \
                            or axes > MAX_MESH_AXES:
                        continue
                    choices += [replace(c, cp=cp, ep=ep) for c in _configurations(
                        pp, dp, tp, replicas, batch // (dp * ep), layers, pins, granule)]
    return sorted(set(choices), key=lambda c: (c.pp, c.tp, c.dp, c.micro_batches, c.zero,
                                               c.schedule, c.replicas, c.sequence_parallel,
                                               c.cp, c.ep))


def _configurations(pp: int, dp: int, tp: int, replicas: int, per_rank: int, layers: int,
                    pins: Pins, granule: int) -> list[Choice]:
    """The micro-batch counts, ZeRO stages, schedules, chunk counts and (under Megatron's
    layout) sequence parallelism of one (pp, dp, tp)."""
    choices = []
    for local in _micro_sizes(per_rank, granule):
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
            [Schedule.INTERLEAVED] if pins.vpp is not None else
            [s for s in SCHEDULES_SEARCHED
             if pins.runnable.schedules is None or s in pins.runnable.schedules]
            if pp > 1 else [Schedule.ONE_F_ONE_B])
        for zero in zeros:
            for schedule in schedules:
                if (schedule in PIPELINED_ONLY and pp == 1) or (
                        schedule == Schedule.INTERLEAVED and m % pp):
                    continue
                for chunks in chunk_counts(schedule, pp, layers, pins):
                    choices += [Choice(pp, dp, tp, m, zero, schedule, chunks, replicas, sp)
                                for sp in pins.sequence_parallel_choices(tp)]
    return choices


def chunk_counts(schedule: Schedule, pp: int, layers: int, pins: Pins) -> list[int]:
    """Model chunks per device: 2 for ZB-V's V, 1 for the other schedules but interleaved;
    then the pinned vpp, or every v from 2 while each of the pp·v chunks keeps at least
    one layer (at most MAX_INTERLEAVE_CHUNKS)."""
    if schedule != Schedule.INTERLEAVED:
        return [chunks_per_device(schedule)]
    if pins.vpp is not None:
        return [pins.vpp]
    return list(range(2, min(MAX_INTERLEAVE_CHUNKS, max(1, layers) // pp) + 1))


def pipeline_config(choice: Choice, training: TrainingOptions) -> PipelineConfig:
    return PipelineConfig(pp=choice.pp, micro_batches=choice.micro_batches, zero=choice.zero,
                          schedule=choice.schedule, virtual_stages=choice.virtual_stages,
                          optimizer=training.optimizer, overlap=training.overlap,
                          precision=training.precision, fusion=training.fusion,
                          accumulation=training.accumulation,
                          bucket_mb=training.bucket_mb,
                          overlap_grad_reduce=training.overlap_grad_reduce)


def kinds_of(hardware: HardwareProfile, cluster: Cluster | None) -> tuple[HardwareProfile, ...]:
    """The device kinds configurations are priced on: each group's of a mixed cluster (by
    group index), else `hardware` alone."""
    if cluster is None or not cluster.mixed:
        return (hardware,)
    return tuple(group.profile for group in cluster.groups)


def recompute_modes(pins: Pins) -> list[Recompute]:
    return [pins.recompute] if pins.recompute is not None else list(RECOMPUTE_MODES)


def joint_search(graphs: Analyses, hardware: HardwareProfile, devices: int,
                 training: TrainingOptions, pins: Pins,
                 time_limit: float = 60.0, top_k: int = 3,
                 progress: Callable[[str], None] | None = None,
                 cluster: Cluster | None = None,
                 verify: Callable[[Scored], Verdict] | None = None) -> JointResult:
    """Rank the configurations that fit, by the surrogate prices (see the module doc).

    `verify(scored)` (the exact decision: `joint_decisions`) is asked of the top k the
    surrogate fits when the search would stop: one that does not fit is dropped and the
    search goes on, its exact layout's least memory (`Verdict.least`) the one the failure
    message reports. The surrogate prices one
    micro-batch per device as its own graph; the exact layout runs the whole micro-batch
    on the stage mesh, where a tensor no op splits over dp (a causal mask expanded to the
    batch from a folded shape) is whole on every rank.

    On a mixed `cluster` (`hardware` its lead kind, `devices` all of its devices) each
    layout is solved once on the lead kind and priced on every kind; each configuration is
    partitioned over every order of the groups on the ranks (`partitioner_for`), and its
    bound weighs each kind's work by its devices (`stage_floor`)."""
    kinds = kinds_of(hardware, cluster)
    uniform = training.memory_limit_bytes is not None  # a --memory-limit holds for all kinds
    root = graphs.root
    graph = root.graph
    if not graph.batch:
        raise ShardplanError(f"{graph.path}: the joint search needs a batch dimension "
                             "(--batch) to split into data-parallel ranks and micro-batches")
    per_node = int(hardware.devices_per_node.value)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    units = root.units
    layers = len(units.layer_units) or units.count
    too_many = units.count if units.count > MAX_PIPELINE_UNITS else 0
    if too_many and pins.pp is not None and pins.pp > 1:
        raise ShardplanError(
            f"{graph.path}: --parallel pp={pins.pp}: the graph has {too_many} units (layers), "
            f"more than the stage search takes ({MAX_PIPELINE_UNITS}: its tables grow with "
            f"the square of the units); plan it with pp=1")
    if pins.ep not in (None, 1) and pins.cp not in (None, 1):
        raise ShardplanError(f"{graph.path}: --parallel ep={pins.ep} cp={pins.cp}: expert and "
                             "context parallelism are not planned together; pin one of them")
    if pins.cp is not None and pins.cp > 1 and (not graph.sequence or graph.sequence % pins.cp):
        what = (f"the sequence of {graph.sequence} tokens does not split into {pins.cp} equal "
                "blocks; pin a cp that divides it" if graph.sequence else
                "the model has no sequence input to split (a batch input whose next dim is "
                "symbolic: [batch, seq] token ids); drop the cp pin")
        raise ShardplanError(f"{graph.path}: --parallel cp={pins.cp}: {what}")
    experts = root.experts
    if pins.ep is not None and pins.ep > 1 and (not experts.count or experts.count % pins.ep):
        what = (f"its {experts.count} experts do not split into {pins.ep} equal groups; pin "
                "an ep that divides them" if experts.count else
                "the model has no experts to split (stacked expert weights [E, in, out] read "
                "by a batched MatMul); drop the ep pin")
        raise ShardplanError(f"{graph.path}: --parallel ep={pins.ep}: {what}")
    skipped: dict[int, str] = {}
    bindable: dict[int, bool] = {}

    def binds(size: int) -> bool:
        """Whether the graph binds at `size` rows (a Reshape(-1, 128, ...) of a token-major
        batch does not at every size); the reason is kept for the plan's warnings."""
        if size not in bindable:
            try:
                graphs.at(size)
                bindable[size] = True
            except ModelError as exc:
                bindable[size] = False
                skipped[size] = str(exc).split(": ", 1)[-1].split(". ")[0]
        return bindable[size]

    # rows of the batch that meet (attention over a sequence-first input's dim 0) cannot
    # be cut into micro-batches: one of the whole batch per step, and so no pipeline
    meets = rows_meet_reason(graph, root.rows_meet) if root.rows_meet is not None else ""
    if meets and ((pins.micro_batches or 1) > 1 or (pins.pp or 1) > 1):
        raise ShardplanError(f"{graph.path}: --parallel {pins.spelled()}: {meets}; or pin "
                             "micro_batches=1 and pp=1")
    granule = next(d for d in _divisors(graph.batch) if binds(d))
    # where rows meet, one micro-batch of the whole per-rank batch, as if pinned (a
    # per-rank batch above the largest local micro-batch has no such configuration else)
    enumerated = replace(pins, micro_batches=1) if meets else pins
    choices = [c for c in enumerate_choices(devices, graph.batch, layers, per_node,
                                            enumerated, granule,
                                            context_degrees(graph.sequence, pins),
                                            expert_degrees(experts, devices, pins))
               if binds(graph.batch // (c.dp * c.micro_batches))
               and binds(graph.batch // c.micro_batches) and not (too_many and c.pp > 1)]
    modes = recompute_modes(pins)
    if not choices:  # the op-level plans may still stand; the message if none does
        binding = f" at {granule} rows or multiples of them (the least it binds at)" \
            if granule > 1 else ""
        return JointResult([], 0, math.inf, "", 0, {
            f"--parallel {pins.spelled()}: no configuration of {devices} devices and batch "
            f"{graph.batch}{binding} matches these pins": 0}, skipped_sizes=skipped,
            rows_meet=meets)
    #: (tp, local micro-batch, cp, ep) -> why Megatron's sequence parallelism, not
    #: pinned, has no layout there
    inexpressible: dict[tuple[int, int, int, int], ShardplanError] = {}
    Layout = tuple[tuple[UnitProfile, ...] | None, Units, tuple[float, float] | None]
    profiles: dict[tuple[int, int, bool, MemoryBudget | None, int, int], Layout] = {}

    def layout_of(tp: int, cp: int, ep: int, local: int, sp: bool,
                  budget: MemoryBudget | None = None) -> Layout:
        """The unit profile of the fastest layout (within `budget`, when given) at tp and
        the local micro-batch (Megatron's, with sequence parallelism when `sp`, under the
        layout pin), its units and its op-level memory; None: no layout fits."""
        key = (tp, local, sp, budget, cp, ep)
        if key not in profiles:
            small = graphs.at(local)
            mesh = stage_mesh(1, tp, per_node, cp=cp, ep=ep)
            try:
                strategies, _, memory = model_parallel_strategies(
                    small, mesh, hardware, training, small.batch_labels, time_limit,
                    budget=budget,
                    layout=pins.layout, sequence_parallel=sp, context_kind=pins.cp_kind)
            except ShardplanError as exc:
                if not (sp and pins.sp is None):
                    raise
                # Megatron's sequence parallelism, tried beside the pinned layout, has no
                # split here (GPT-2's Conv1D GEMMs read the sequence merged with the batch,
                # which tp never splits): its configurations are out, the rest stand
                inexpressible[(tp, local, cp, ep)] = exc
                profiles[key] = (None, small.units, None)
                return profiles[key]
            if memory is None:
                profiles[key] = (None, small.units, memory)
            else:
                profiles[key] = (tuple(
                    unit_profile(priced, small.units) for priced in
                    priced_on_kinds(small, mesh, strategies, kinds, training)),
                    small.units, memory)
        return profiles[key]

    def refusal(choice: Choice, local: int) -> ShardplanError | None:
        """Why Megatron's sequence parallelism has no split for the configuration (found
        when its layout is first asked for); None where it has one, or does not run."""
        if not choice.sequence_parallel:
            return None
        layout_of(choice.tp, choice.cp, choice.ep, local, True)
        return inexpressible.get((choice.tp, local, choice.cp, choice.ep))

    def profile_of(tp: int, cp: int, ep: int, local: int,
                   sp: bool) -> tuple[tuple[UnitProfile, ...], Units, tuple[float, float]]:
        found, units, memory = layout_of(tp, cp, ep, local, sp)
        assert found is not None and memory is not None  # unbudgeted: it raises instead
        return found, units, memory

    with_dp: dict[tuple[int, bool], list[UnitProfile]] = {}  # the profiles stay alive

    def partitioner_of(choice: Choice,
                       found: Sequence[UnitProfile]) -> Partitioner | OrderedPartitioner:
        key = (id(found), choice.dp > 1)
        if key not in with_dp:
            axes = (str(AxisRole.DATA),) if choice.dp > 1 else ()
            with_dp[key] = [p.with_gradient_axes(axes) for p in found]
        return partitioner_for(with_dp[key], pipeline_config(choice, training), hardware,
                               choice_mesh(choice, per_node), cluster, uniform,
                               rows // choice.micro_batches, pins.shares)

    # Cheapest-first by a lower bound: perfectly balanced stages (the slowest stage takes
    # at least the mean) through the schedule, with no recompute and no gradient sync. The
    # mean is the layout's compute where (tp, local micro-batch) has been solved, else the
    # GEMMs' FLOPs at their peak split tp ways, or every op's launches where they weigh
    # more (`planner.cost.oplevel.compute_floor`); such a bound is made
    # exact when it comes first, so a layout is solved only for configurations that could
    # still win.
    floors: dict[int, list[ComputeFloor]] = {}
    rows = graph.batch
    counts = [g.devices for g in cluster.groups] if cluster is not None and len(kinds) > 1 \
        else [devices]
    shares: dict[int, tuple[float, ...]] = {}  # per layout (by id): its work per kind

    def stage_floor(works: Sequence[float], share: float, pp: int) -> float:
        """The least time of a stage's share of the work when the stages are balanced:
        with W_g the work on kind g and n_g its devices, each stage of S = devices / pp
        ranks holds at least `share` · S / Σ n_g / W_g (W / pp on one kind); `share` is
        the least fraction of its own kind's work the units add up to (1 on one kind, or
        for work that scales alike on every kind)."""
        if len(works) == 1:
            return works[0] / pp
        speed = sum(n / w for n, w in zip(counts, works, strict=True) if w > 0)
        return share * (devices / pp) / speed if speed > 0 else 0.0

    def profile_share(found: Sequence[UnitProfile]) -> tuple[float, ...]:
        if id(found) not in shares:
            per_unit = [p.forward + p.backward for p in found]
            totals = [float(w.sum()) for w in per_unit]
            fractions = np.array([w / t if t > 0 else w * 0 for w, t in
                                  zip(per_unit, totals, strict=True)])
            shares[id(found)] = (*totals, float(fractions.min(axis=0).sum())
                                 if len(found) > 1 else 1.0)
        return shares[id(found)]

    def bound_of(choice: Choice, solve: bool) -> tuple[float, bool]:
        """The configuration's bound, and whether it is the layout's (exact) or the floor."""
        local = rows // (choice.dp * choice.micro_batches)
        exact = solve or (choice.tp, local, choice.sequence_parallel, None,
                          choice.cp, choice.ep) in profiles
        if exact:
            if refusal(choice, local) is not None:
                return math.inf, True
            found, _, _ = profile_of(choice.tp, choice.cp, choice.ep, local,
                                     choice.sequence_parallel)
            *works, share = profile_share(found)
            stage = stage_floor(works, share, choice.pp)
        else:
            if local not in floors:
                floors[local] = [compute_floor(graphs.at(local), kind, training)
                                 for kind in kinds]
            split = choice.tp * choice.cp * choice.ep
            # each floor balanced on its own: on a mixed cluster the kinds' FLOPs and
            # launches need not fall on the same stages
            stage = max(stage_floor([f.split_s(split) for f in floors[local]], 1.0,
                                    choice.pp),
                        stage_floor([f.per_op_s for f in floors[local]], 1.0, choice.pp))
        bound = pipeline_time([stage] * choice.pp, choice.micro_batches,
                              choice.schedule, choice.virtual_stages)
        return bound + tail_floor(choice), exact

    optimizer_floors = [optimizer_floor_s(root, kind, training) for kind in kinds]

    def tail_floor(choice: Choice) -> float:
        """The least end of a step: the optimizer pass of the busiest stage, which updates
        at least an even share of the weights (split over tp, cp and ep, and under ZeRO
        sharded over dp too), and the host's time per step; on a mixed cluster at the
        fastest kind's pace."""
        shares = choice.pp * choice.tp * choice.cp * choice.ep * (
            choice.dp if choice.zero >= 1 else 1)
        return min(total / shares + kind.step_host_seconds
                   for total, kind in zip(optimizer_floors, kinds, strict=True))

    position = {choice: index for index, choice in enumerate(choices)}
    queue = []
    for index, choice in enumerate(choices):
        bound, exact = bound_of(choice, solve=False)
        queue.append((bound, index, exact))
    heapq.heapify(queue)  # ties in the order of `choices`, as a stable sort would keep
    ranked: list[Scored] = []
    smallest, where = math.inf, ""
    tried = 0
    unformed: dict[str, int] = {}
    categories: dict[str, int] = {}
    retries = 0
    verified: set[Choice] = set()

    def settle() -> None:
        """Decide the top k exactly (`verify`), dropping each whose exact layout does
        not fit, until k that fit lead the list or none is left to decide: only the
        configurations still in the top k when the search would stop are decided, as
        they were after it."""
        nonlocal smallest, where, categories
        k = 0
        while verify is not None and k < min(top_k, len(ranked)):
            scored = ranked[k]
            if scored.choice in verified:
                k += 1
                continue
            verdict = verify(scored)
            memory = verdict.least if not verdict.fits else scored.partition
            if memory is not None and memory.price.peak_memory < smallest:
                smallest, where = memory.price.peak_memory, scored.choice.describe()
                categories = _peak_stage_memory(memory.price)
            if verdict.fits:
                verified.add(scored.choice)
                k += 1
            else:
                ranked.pop(k)

    while queue:
        bound, index, exact = heapq.heappop(queue)
        if len(ranked) >= top_k and bound > ranked[top_k - 1].step_time_s:
            settle()
            if len(ranked) >= top_k and bound > ranked[top_k - 1].step_time_s:
                break
        choice = choices[index]
        if not exact:  # solve its layout; it comes back in the order of its exact bound
            heapq.heappush(queue, (*bound_of(choice, solve=True)[:1], index, True))
            continue
        local = graph.batch // (choice.dp * choice.micro_batches)
        sp = choice.sequence_parallel
        refused = refusal(choice, local)
        if refused is not None:
            what = str(refused).split("layout=megatron: ", 1)[-1].split(";")[0]
            reason = f"sp=1 under layout=megatron at tp={choice.tp}: {what}"
            unformed[reason] = unformed.get(reason, 0) + 1
            continue
        found_profiles, small_units, layout_memory = profile_of(
            choice.tp, choice.cp, choice.ep, local, sp)
        partitioner = partitioner_of(choice, found_profiles)
        tried += 1
        found = partitioner.solve(limit, modes)
        budget = None
        if found is None and retries < MAX_MEMORY_AWARE and choice.tp * choice.cp * choice.ep > 1:
            retries += 1
            found, budget = _memory_aware(choice, limit, modes, layout_memory,
                                          partitioner.solve(math.inf, [Recompute.FULL]),
                                          partial(layout_of, choice.tp, choice.cp, choice.ep, local,
                                                  sp),
                                          partitioner_of)
        if found is None:
            least = partitioner.solve(math.inf, [Recompute.FULL])
            if least is None:
                reason = _unformed(choice, small_units)
                unformed[reason] = unformed.get(reason, 0) + 1
            elif least.price.peak_memory < smallest:
                smallest, where = least.price.peak_memory, choice.describe()
                categories = _peak_stage_memory(least.price)
            continue
        if verify is None and found.price.peak_memory < smallest:  # else once decided
            smallest, where = found.price.peak_memory, choice.describe()
            categories = _peak_stage_memory(found.price)
        ranked.append(Scored(choice, found, small_units, budget))
        # equal prices in the configurations' own order (fewer stages, less tp first),
        # not in the order the bounds had them solved
        ranked.sort(key=lambda s: (s.step_time_s, position[s.choice]))
    settle()
    if progress is not None:
        progress(f"joint search: {tried} of {len(choices)} configurations priced, "
                 f"{len(ranked)} fit")
    return JointResult(ranked, tried, smallest, where, len(choices), unformed, categories,
                       skipped, too_many, meets)


def _memory_aware(choice: Choice, limit: float, modes: list[Recompute],
                  layout_memory: tuple[float, float], least: Partition | None,
                  profile_at: Callable[[MemoryBudget],
                                       tuple[tuple[UnitProfile, ...] | None, Units,
                                             tuple[float, float] | None]],
                  partitioner_of: Callable[[Choice, Sequence[UnitProfile]],
                                           Partitioner | OrderedPartitioner],
                  ) -> tuple[Partition | None, MemoryBudget | None]:
    """A configuration the fastest layout does not fit: re-solve the op-level layout with
    the memory constraint of this configuration, and partition again.

    The configuration's least-memory partition says how its fullest device holds the
    fastest layout's memory: weights, gradients and states scaled by `weights` = (its
    parameters + gradients + optimizer) / (the layout's), saved activations by
    `activations` = its activations / the layout's saved activations (pipeline stages,
    ZeRO shards, micro-batches in flight and recompute all show in these two ratios). The
    op-level ILP then finds the fastest layout whose memory, so weighed, fits the limit;
    the limit tightens by each new overshoot (at most MEMORY_AWARE_ROUNDS solves). The
    partition is priced exactly, as any other."""
    owned, saved = layout_memory
    if least is None or owned <= 0:
        return None, None
    memory = least.price.fullest.memory
    weights = float(memory.parameters + memory.gradients + memory.optimizer) / owned
    activations = float(memory.activations) / saved if saved > 0 else 1.0
    budget_limit, peak = limit, float(least.price.peak_memory)
    for _ in range(MEMORY_AWARE_ROUNDS):
        budget = MemoryBudget(0.97 * budget_limit, weights, activations)
        profile, _, _ = profile_at(budget)
        if profile is None:
            return None, None
        partitioner = partitioner_of(choice, profile)
        found = partitioner.solve(limit, modes)
        if found is not None:
            return found, budget
        smallest = partitioner.solve(math.inf, [Recompute.FULL])
        if smallest is None or smallest.price.peak_memory >= peak:
            return None, None
        budget_limit *= limit / float(smallest.price.peak_memory)
        peak = float(smallest.price.peak_memory)
    return None, None


def _peak_stage_memory(price: StepPrice) -> dict[str, int]:
    return price.fullest.memory.to_json()


def _unformed(choice: Choice, units: Units) -> str:
    """Why a configuration cannot be laid on the model's units at all."""
    layers = len(units.layer_units)
    if choice.schedule in (Schedule.INTERLEAVED, Schedule.ZBV):
        what = "interleaving" if choice.schedule == Schedule.INTERLEAVED else "zbv's V"
        return (f"{what} pp={choice.pp} × {choice.virtual_stages} chunks needs at least "
                f"{choice.pp * choice.virtual_stages} repeated layers (one per chunk); the "
                f"model has {layers}")
    return (f"pp={choice.pp} needs at least as many units as stages; the model has "
            f"{units.count} (prefix, {layers} layers, suffix)")


@dataclass(frozen=True)
class ExactLayout:
    """A finalist's op-level layout on its stage mesh and its unit profiles per device
    kind (None: no layout fits)."""

    strategies: dict[str, OpStrategy]
    profiles: tuple[UnitProfile, ...] | None


def exact_outcome(graphs: Analyses, hardware: HardwareProfile, choice: Choice,
                  training: TrainingOptions, modes: list[Recompute], time_limit: float,
                  tp_pinned: bool, record: SolverRecord,
                  budget: MemoryBudget | None = None,
                  layout: str | None = None,
                  context_kind: ContextKind | None = None,
                  cluster: Cluster | None = None,
                  dp_shares: str | None = None,
                  layouts: dict[Hashable, ExactLayout] | None = None
                  ) -> tuple[PipelineDecision | None, Partition | None]:
    """The exact decision of one configuration: the op-level choice on the stage mesh
    at the real micro-batch (Megatron's split, with the configuration's sequence
    parallelism, under `layout="megatron"`), priced on (pp, dp, tp), partitioned; None
    when it does not fit, with the least-memory partition (full recompute, no limit) of
    its layouts.

    The op-level layout is solved twice when the step runs several micro-batches: with
    per-step weight costs weighed as the step pays them (1 / micro-batches of a
    micro-batch's cost, `build_problem`) and as one micro-batch (the layout the surrogate
    ranked the configuration with). The first can replicate weights the second splits
    (their reduction looks cheap once per step) and outgrow memory the op-level problem
    does not see; the faster of the two that fits is kept. On a mixed cluster the
    data-parallel replicas' shares of the batch are even or by speed as `dp_shares` pins
    them (None: the faster). `layouts` keeps each solved layout for the next finalist on
    the same meshes (configurations that differ in ZeRO alone share theirs)."""
    graph = graphs.root.graph
    if not graph.batch or graph.batch % (choice.dp * choice.micro_batches):
        raise ShardplanError(f"{graph.path}: batch {graph.batch} does not split into "
                             f"{choice.dp} data-parallel ranks × {choice.micro_batches} "
                             "micro-batches")
    per_node = int(hardware.devices_per_node.value)
    micro_size = graph.batch // choice.micro_batches
    micro = graphs.at(micro_size)
    inner = stage_mesh(choice.dp, choice.tp, per_node, cp=choice.cp, ep=choice.ep)
    mesh = choice_mesh(choice, per_node)
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    best: tuple[dict[str, OpStrategy], Partition] | None = None
    least: Partition | None = None
    seen: list[dict[str, OpStrategy]] = []
    kept = {} if layouts is None else layouts
    for weighed in dict.fromkeys((choice.micro_batches, 1)):
        key = (micro_size, inner, mesh, budget, layout, choice.sequence_parallel, weighed,
               context_kind)
        if key not in kept:
            strategies, _, memory = model_parallel_strategies(
                micro, inner, hardware, training, micro.batch_labels, time_limit,
                budget=budget, layout=layout, sequence_parallel=choice.sequence_parallel,
                micro_batches=weighed, context_kind=context_kind)
            kept[key] = ExactLayout(strategies, None if memory is None else tuple(
                unit_profile(priced, micro.units) for priced in priced_on_kinds(
                    micro, mesh, strategies, kinds_of(hardware, cluster), training)))
        strategies, profiles = kept[key].strategies, kept[key].profiles
        if profiles is None or strategies in seen:
            continue
        seen.append(strategies)
        partitioner = partitioner_for(
            list(profiles), pipeline_config(choice, training),
            hardware, mesh, cluster, training.memory_limit_bytes is not None, micro_size,
            dp_shares)
        found = partitioner.solve(limit, modes)
        if found is not None and (best is None or found.price.step_time_s
                                  < best[1].price.step_time_s):
            best = (strategies, found)
        if best is None:
            smallest = partitioner.solve(math.inf, [Recompute.FULL])
            if smallest is not None and (least is None or smallest.price.peak_memory
                                         < least.price.peak_memory):
                least = smallest
    if best is None:
        return None, least
    strategies, found = best
    step = found.price.step_time_s
    return PipelineDecision(choice, micro_size, strategies,
                            tuple(tuple(ranges) for ranges in found.devices),
                            tuple(found.recompute), replace(record, objective=step, bound=step),
                            tp_pinned, found.order, found.rows), None


def joint_decisions(graphs: Analyses, hardware: HardwareProfile, devices: int,
                    training: TrainingOptions, pins: Pins,
                    time_limit: float = 60.0, top_k: int = 3,
                    progress: Callable[[str], None] | None = None,
                    cluster: Cluster | None = None,
                    ) -> tuple[list[PipelineDecision], JointResult]:
    """Exact decisions of the top-k configurations, in the surrogate's order."""
    modes = recompute_modes(pins)
    layouts: dict[Hashable, ExactLayout] = {}
    decided: dict[Choice, PipelineDecision] = {}

    def verify(scored: Scored) -> Verdict:
        decision, least = exact_outcome(
            graphs, hardware, scored.choice, training, modes, time_limit,
            pins.tp is not None, SolverRecord("joint", "optimal", 0.0, 0.0, 0.0),
            scored.budget, pins.layout, pins.cp_kind, cluster, pins.shares, layouts)
        if decision is not None:
            decided[scored.choice] = decision
        return Verdict(decision is not None, least)

    result = joint_search(graphs, hardware, devices, training, pins, time_limit, top_k,
                          progress, cluster, verify)
    decisions = []
    for scored in result.ranked[:top_k]:
        record = SolverRecord(
            "joint", "optimal", scored.step_time_s, scored.step_time_s, 0.0,
            detail=SolverDetail(configurations=result.considered, priced=result.tried,
                                surrogate_step_time_s=scored.step_time_s,
                                stages="partition DP over units (layers), recompute per "
                                       "stage"))
        decision = decided[scored.choice]
        step = decision.solver.objective
        decisions.append(replace(decision, solver=replace(record, objective=step, bound=step)))
    return decisions, result
