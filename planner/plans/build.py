"""The one plan builder: a search's decision in, a frozen Plan out, every fact derived once.

`derive` turns a decision (`planner.search.decisions`) into everything the plan file
states: each op's layouts and strategy tuples, every tensor's stored layout, every
collective with its phase (`planner.sharding.derive`, priced by `planner.cost`), and for
pipelines the stages with their op ranges, ranks, recompute segments and the weights each
holds, the sends between them, and each weight's synchronisation as its ZeRO stage issues
it (`planner.sharding.weights`), once per stage holding it, with the sum between two
holders of a tied weight; and the predicted step from the one step model
(`planner.cost.step`). `build` adds the search's own record (solver, alternatives,
baselines) and returns the Plan. Nothing patches a Plan afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property

from costmodels.cluster import Cluster, Placement
from costmodels.profile import HardwareProfile
from costmodels.schedule import bubble_fraction
from planner.cost.buckets import Issue, assign_buckets
from planner.cost.kernels import KernelPlan
from planner.cost.oplevel import PricedGraph, priced_choice, priced_on_kinds
from planner.cost.pipeline import PlacedPricer, Pricer, Prices, ShapedPricer
from planner.cost.pricing import synced_bytes
from planner.cost.step import StagePrice, StepPrice, TrainingOptions, predicted
from planner.cost.units import UnitProfile, unit_profile
from planner.graph import PlanningGraph
from planner.kinds import (
    AxisRole,
    CollectiveKind,
    LossReads,
    Phase,
    Precision,
    Recompute,
    StepKind,
)
from planner.layers import Units
from planner.plans.model import Plan, brief_of
from planner.plans.sections import (
    Alternative,
    Brief,
    ClusterRef,
    GroupRef,
    LinkRef,
    ModelRef,
    OpEntry,
    ParallelConfig,
    PipelineSection,
    SendEntry,
    StageEntry,
    StepSpec,
    TensorBinding,
    TensorEntry,
    UnitEntry,
    chunks_of,
)
from planner.plans.sequence import handed_on_split, sequence_parallel, splits_sequence
from planner.plans.stagemesh import tensor_sites
from planner.records import Collective, OpCost, Predicted, SolverRecord
from planner.search.decisions import Decision, OpLevelDecision, PipelineDecision
from planner.search.joint import choice_mesh, kinds_of, pipeline_config
from planner.search.stagemeshes import shaped_pricer, stage_layouts
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.context import context_kind
from planner.sharding.derive import OPTIMIZER_OP, ShardedGraph
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.pipeline import (
    UnitCrossing,
    chunk_of_units,
    recompute_reads,
    send_routes,
    send_steps,
    stage_holds,
)
from planner.sharding.sends import SendSplit
from planner.sharding.submeshes import stage_ranks
from planner.sharding.weights import weight_steps


@dataclass(frozen=True)
class BuildContext:
    """What every plan of one request shares: the graph (at any batch), the hardware and
    what a step is."""

    graphs: Analyses
    hardware: HardwareProfile  # a mixed cluster's lead kind
    training: TrainingOptions
    cluster: Cluster | None = None  # a mixed cluster (`costmodels.cluster`)

    @property
    def limit(self) -> int:
        return int(self.training.memory_limit_bytes or int(self.hardware.memory_bytes.value))


#: The record of a plan the search has not yet reported on (`build` adds the real one).
UNREPORTED = SolverRecord("", "fixed", 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Derived:
    """A decision priced: the step price it came to (the search's objective), what
    compares it with other finalists (`brief`: mesh, parallel section, predicted step),
    and every section of its plan (`sections`, with the search's record still to come),
    written when first asked for. Only one finalist becomes the plan: writing every
    finalist's op and tensor entries took 5 s of a static 200,000-op Relu chain's 56,
    and this way the others' are never written."""

    decision: Decision
    price: StepPrice = field(repr=False)
    predicted: Predicted
    summary: Brief
    write: Callable[[], Plan] = field(repr=False, compare=False)

    @property
    def parallel(self) -> ParallelConfig:
        return self.summary.parallel

    def brief(self) -> Brief:
        return self.summary

    @cached_property
    def sections(self) -> Plan:
        plan = self.write()
        assert plan.brief() == self.summary and plan.predicted == self.predicted, \
            "a plan's sections disagree with the figures it was compared by"
        return plan


def derive(context: BuildContext, decision: Decision) -> Derived:
    """Every section of the decision's plan, priced."""
    if isinstance(decision, PipelineDecision):
        return _pipeline(context, decision)
    return _op_level(context, decision)


def build(derived: Derived, solver: SolverRecord, alternatives: Sequence[Alternative] = (),
          baselines: Mapping[str, Brief] | None = None,
          search_warnings: Sequence[str] = ()) -> Plan:
    """The plan: the derived sections and the search's record of how it was found (a new
    frozen Plan; the derived one is never handed out), with what the search could not
    consider among the warnings."""
    warnings = tuple(dict.fromkeys((*derived.sections.warnings, *search_warnings)))
    return replace(derived.sections, solver=solver, alternatives=tuple(alternatives),
                   baselines=dict(baselines or {}), warnings=warnings)


# ---------------------------------------------------------------- op-level plans


def _op_level(context: BuildContext, decision: OpLevelDecision) -> Derived:
    analysis = context.graphs.root
    training = context.training
    priced = priced_choice(analysis, decision.mesh, decision.strategies, context.hardware,
                           training)
    sharded = priced.sharded
    price = priced.step()
    dp, tp = decision.degrees or _degrees(analysis, sharded)
    units = _layer_units(analysis.units)
    parallel = ParallelConfig(dp=dp, tp=tp, optimizer=training.optimizer,
                              sp=_sequence_parallel(sharded, units))
    step = predicted(price, context.limit)

    def write() -> Plan:
        return Plan(
            model=_model_ref(analysis.graph),
            cluster=_cluster_ref(context.hardware, decision.mesh), mesh=decision.mesh,
            parallel=parallel, ops=_op_entries(priced), tensors=_stored_tensors(priced),
            collectives=priced.collectives, predicted=step, solver=UNREPORTED,
            warnings=_warnings(analysis.graph, sharded, context.hardware),
            step=_step(training), pipeline=None, units=units)
    return Derived(decision, price, step, brief_of(decision.mesh, parallel, step), write)


def _sequence_parallel(sharded: ShardedGraph, units: Sequence[UnitEntry]) -> int:
    """`parallel.sp` of the plan `sharded` lays out (`planner.plans.sequence`), read off
    the derivation itself: the entries the plan would write bind an op's input or output
    where the op lays it out."""
    tensors = sharded.analysis.graph.tensors
    split = {name for name, layout in sharded.layouts.items()  # (a tensor without one is
             if name in tensors and splits_sequence(  # stored whole)
                 tensors[name].kind, tensors[name].shape, tensors[name].dtype, layout)}
    if not split:  # (most plans: no activation is split along a sequence at all)
        return 0
    reads = [(tuple(name for name, layout in zip(op.node.inputs, op.inputs, strict=True)
                    if name and layout is not None),
              tuple(name for name, layout in zip(op.node.outputs, op.outputs, strict=True)
                    if name and layout is not None)) for op in sharded.ops]
    return int(handed_on_split(reads, split.__contains__, units) is not None)


def _degrees(analysis: GraphAnalysis, sharded: ShardedGraph) -> tuple[int, int]:
    """dp: the axes that split the batch in the ops doing most of the work; tp: the other
    axes in use (an axis no op uses means replicated work, counted in neither).

    The batch labels of each op are the analysis's (the batch split traced through the
    graph); an axis counts as data parallel when it splits that label in ops holding most
    of the FLOPs.
    """
    mesh = sharded.mesh
    flops_on: dict[str, float] = {axis: 0.0 for axis in mesh.axis_names}
    graph = analysis.graph
    total = sum(node.flops for node in graph.ops) or 1.0
    for op in sharded.ops:
        for label in analysis.batch_labels.get(op.node.name, ()):
            for axis in op.strategy.axes_of(label):
                flops_on[axis] += op.node.flops
    data_axes = {axis for axis, flops in flops_on.items() if flops > total / 2}
    used = sharded.used_axes
    dp = tp = 1
    for axis in mesh.axis_names:
        if axis in data_axes:
            dp *= mesh.axis_size(axis)
        elif axis in used:  # an axis splitting weights or other dims; unused ones replicate
            tp *= mesh.axis_size(axis)
    return dp, tp


# ---------------------------------------------------------------- pipeline plans


def _pipeline(context: BuildContext, decision: PipelineDecision) -> Derived:
    choice = decision.choice
    analysis = context.graphs.at(decision.micro_batch_size)
    graph = analysis.graph
    training = context.training
    per_node = int(context.hardware.devices_per_node.value)
    mesh = choice_mesh(choice, per_node)
    config = pipeline_config(choice, training)
    pricer: Pricer | PlacedPricer | ShapedPricer
    placement = None
    stage_meshes: list[DeviceMesh | None] = [None] * choice.pp
    sizes = [mesh.size // choice.pp] * choice.pp
    if decision.shapes:
        # Per-stage meshes: each distinct shape's layout, in the order stages first use
        # them (stage 0's first: the plan's mesh and parallel section are its).
        picked = [(shape.dp, shape.tp) for shape in decision.shapes]
        order = list(dict.fromkeys(picked))
        layouts = stage_layouts(analysis, context.hardware, choice, training,
                                decision.shapes, decision.devices)
        priceds = [layouts[key].priced for key in order]
        profiles = [layouts[key].profile for key in order]
        pricer = shaped_pricer(layouts, picked, config, context.hardware)
        kind_of_stage = [order.index(key) for key in picked]
        stage_meshes = [layouts[key].mesh for key in picked]
        sizes = [dp * tp for dp, tp in picked]
        lead = 0
    else:
        kinds = kinds_of(context.hardware, context.cluster) if decision.order else (
            context.hardware,)
        priceds = list(priced_on_kinds(analysis, mesh, decision.strategies, kinds, training))
        lead = kinds.index(context.hardware)  # the plan's sections are the lead kind's
        profiles = [unit_profile(p, analysis.units) for p in priceds]
        if decision.order:
            assert context.cluster is not None, "a placed decision comes from a mixed cluster"
            placement = Placement(context.cluster, decision.order, mesh.size // choice.pp)
            pricer = PlacedPricer(profiles, config, placement, mesh,
                                  training.memory_limit_bytes is not None, decision.rows)
        else:
            pricer = Pricer(profiles[0], config, context.hardware, mesh)
        kind_of_stage = [pricer.groups[d] if isinstance(pricer, PlacedPricer) else 0
                         for d in range(choice.pp)]
    priced = priceds[lead]
    sharded = priced.sharded
    price = pricer.price(decision.devices, decision.recompute)
    stage_of_op = _stage_of_op(decision, analysis.units, len(graph.ops))

    def prices_of(stage: int) -> Prices:
        return pricer.stage_pricer(stage).prices

    def profile_of(stage: int) -> UnitProfile:
        return pricer.stage_pricer(stage).profile

    warnings = list(_warnings(graph, sharded, context.hardware))
    tp = choice.tp
    if choice.tp > 1 and AxisRole.TENSOR not in sharded.used_axes:
        # Nothing splits over tp: its ranks repeat the same work (replication), which is
        # what `parallel.tp` = 1 says unless the user pinned tp; the mesh keeps the axis.
        tp = choice.tp if decision.tp_pinned else 1
    modes = set(decision.recompute)
    kind_of_op = [kind_of_stage[s] for s in stage_of_op]
    scale_of_op = [pricer.scales[s] if isinstance(pricer, PlacedPricer) else (1.0, 1.0)
                   for s in stage_of_op]
    units = _layer_units(analysis.units)
    shaped: tuple[tuple[OpEntry, ...], Mapping[str, TensorEntry]] | None = None
    if decision.shapes:  # each stage's own layouts: its entries are the sp test's input
        shaped_ops = _op_entries(priced) if len(priceds) == 1 else _placed_op_entries(
            priceds, kind_of_op, scale_of_op)
        shaped = (shaped_ops, _shaped_tensor_entries([p.sharded for p in priceds],
                                                     kind_of_op))
        sp = sequence_parallel(*shaped, units)
    else:  # one layout (priced on each kind of a mixed cluster): read off its derivation
        sp = _sequence_parallel(sharded, units)
    parallel = ParallelConfig(
        dp=choice.dp, tp=tp, pp=choice.pp, micro_batches=choice.micro_batches,
        zero=choice.zero,
        recompute=decision.recompute[0] if len(modes) == 1 else Recompute.PER_STAGE,
        optimizer=training.optimizer, sp=sp,
        cp=choice.cp, ep=choice.ep, cp_kind=context_kind(analysis, decision.strategies)
        if choice.cp > 1 else None, dp_shares=decision.rows)
    limits = None
    if placement is not None:
        limits = [int(context.limit * pricer.limit_ratio(d)) for d in range(choice.pp)]
    step = predicted(price, context.limit, limits)
    blocks = stage_ranks(sizes, per_node)

    def write() -> Plan:
        if shaped is not None:
            ops, tensors = shaped
        else:
            ops = _op_entries(priced) if len(priceds) == 1 else _placed_op_entries(
                priceds, kind_of_op, scale_of_op)
            tensors = _stored_tensors(priced)
        stages = _stage_entries(analysis, sharded, priced.kernels, price, decision, blocks,
                                placement, stage_meshes)
        sends = _sends(analysis, profile_of, stages, prices_of)
        section = PipelineSection(
            schedule=config.schedule, micro_batches=config.micro_batches,
            micro_batch_size=graph.batch,
            global_batch=decision.micro_batch_size * choice.micro_batches,
            virtual_stages=config.virtual_stages,
            bubble_fraction=bubble_fraction(choice.pp, config.micro_batches,
                                            config.schedule, config.virtual_stages,
                                            _split(price.busiest)),
            units=_unit_entries(analysis.units), stages=stages, sends=sends)
        op_collectives = priced.collectives if len(priceds) == 1 else _placed_collectives(
            priceds, {node.name: kind for node, kind in zip(graph.ops, kind_of_op,
                                                            strict=True)})
        collectives = (*(c for c in op_collectives if c.phase != Phase.GRADIENT),
                       *_weight_collectives(profile_of, stages, choice.zero, prices_of,
                                            training.precision, recompute_reads(
                                                _op_names(graph),
                                                [s for stage in stages
                                                 for s in stage.recompute_segments],
                                                lambda n: graph.tensors[n].kind)),
                       *_send_collectives(sends, stages, graph, prices_of))
        return Plan(
            model=_model_ref(graph), cluster=_cluster_ref(context.hardware, mesh, placement,
                                                          sum(sizes)),
            mesh=mesh, parallel=parallel, ops=ops, tensors=tensors,
            collectives=collectives, predicted=step, solver=UNREPORTED,
            warnings=tuple(warnings), step=_step(training), pipeline=section, units=units)

    if shaped is not None:  # per-stage meshes: described from the stages written
        plan = write()
        return Derived(decision, price, step, plan.brief(), lambda: plan)
    return Derived(decision, price, step, brief_of(mesh, parallel, step, config.schedule,
                                                   config.virtual_stages), write)


def _shaped_tensor_entries(shardeds: Sequence[ShardedGraph],
                           kind_of_op: Sequence[int]) -> dict[str, TensorEntry]:
    """Per-stage meshes: each tensor as the layout of its site's stage stores it (the op
    producing it, else the first reading it: `planner.plans.stagemesh.tensor_sites`)."""
    sites = tensor_sites(_op_names(shardeds[0].analysis.graph))
    return _tensor_entries(shardeds[0], lambda name: shardeds[
        kind_of_op[sites[name]] if name in sites else 0].layout(name))


def _stage_of_op(decision: PipelineDecision, units: Units, ops: int) -> list[int]:
    """The device stage running each op (ops outside every unit: the first stage)."""
    found = [0] * ops
    for d, ranges in enumerate(decision.devices):
        for a, b in ranges:
            for k in range(units.bounds[a], units.bounds[b]):
                found[k] = d
    return found


def _placed_op_entries(priceds: Sequence[PricedGraph], kind_of_op: Sequence[int],
                       scale_of_op: Sequence[tuple[float, float]]) -> tuple[OpEntry, ...]:
    """A mixed cluster's op entries: each op's cost as the kind running it prices it (the
    layouts are one: every kind was priced on the same strategies), and where replicas
    share the batch by speed as its stage prices it: its seconds those of the stage's
    slowest replica, its bytes those of its largest share (`PlacedPricer.scales`)."""
    every = [_op_entries(p) for p in priceds]
    found = []
    for k, (kind, (pace, held)) in enumerate(zip(kind_of_op, scale_of_op, strict=True)):
        entry = every[kind][k]
        cost = entry.cost
        if cost is not None and (pace, held) != (1.0, 1.0):
            entry = replace(entry, cost=OpCost(cost.forward_s * pace, cost.backward_s * pace,
                                               cost.saved_bytes * held,
                                               cost.output_bytes * held))
        found.append(entry)
    return tuple(found)


def _placed_collectives(priceds: Sequence[PricedGraph],
                        kind_of: Mapping[str, int]) -> tuple[Collective, ...]:
    """A mixed cluster's op-level collectives, each op's as the kind running it derives and
    prices them (grouped by op, in the order ops first issue one)."""
    by_op: list[dict[str, list[Collective]]] = []
    for priced in priceds:
        grouped: dict[str, list[Collective]] = {}
        for collective in priced.collectives:
            grouped.setdefault(collective.op, []).append(collective)
        by_op.append(grouped)
    ops = dict.fromkeys(c.op for p in priceds for c in p.collectives)
    return tuple(c for op in ops for c in by_op[kind_of.get(op, 0)].get(op, ()))


def _stage_entries(analysis: GraphAnalysis, sharded: ShardedGraph, kernels: KernelPlan,
                   price: StepPrice, decision: PipelineDecision,
                   blocks: Sequence[range], placement: Placement | None,
                   meshes: Sequence[DeviceMesh | None]) -> tuple[StageEntry, ...]:
    units = analysis.units
    rows = []
    for d, (stage, ranges, mode) in enumerate(zip(price.stages, decision.devices,
                                                  decision.recompute, strict=True)):
        ops = tuple((units.bounds[a], units.bounds[b]) for a, b in ranges)
        rows.append(StageEntry(
            device_stage=d, ops=ops, ranks=tuple(blocks[d]),
            recompute=mode,
            recompute_segments=recompute_segments(analysis, kernels, ranges, mode),
            memory=stage.memory, holds=_holds(sharded, ops),
            units=tuple((units.names[a], units.names[b - 1]) for a, b in ranges),
            forward_s=stage.forward_s, backward_s=stage.backward_s,
            recompute_s=stage.recompute_s, p2p_s=stage.p2p_s, zero_s=stage.zero_s,
            gradient_sync_s=stage.sync_s, optimizer_s=stage.optimizer_s,
            in_flight=stage.in_flight, weight_gradient_s=stage.weight_s,
            groups=tuple(placement.cluster.groups[g].name for g in placement.stage_groups(d))
            if placement is not None else (), mesh=meshes[d]))
    return tuple(rows)


def recompute_segments(analysis: GraphAnalysis, kernels: KernelPlan,
                       ranges: Sequence[tuple[int, int]],
                       mode: Recompute) -> tuple[tuple[int, int], ...]:
    """Op index ranges the executor runs under activation checkpointing: each unit (full),
    or each attention core inside the ranges, q kᵀ to · v (selective: what the pricing
    re-runs, `planner.cost.units`)."""
    if mode == Recompute.NONE:
        return ()
    bounds = analysis.units.bounds
    spans = [(bounds[a], bounds[b]) for a, b in ranges]
    if mode == Recompute.FULL:
        return tuple((bounds[u], bounds[u + 1]) for a, b in ranges for u in range(a, b))
    index = {node.name: k for k, node in enumerate(analysis.graph.ops)}
    cores = sorted((index[core.first], index[core.last] + 1) for core in kernels.cores)
    return tuple((first, end) for first, end in cores
                 if any(lo <= first and end <= hi for lo, hi in spans))


def _holds(sharded: ShardedGraph, ops: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """The parameters and buffers the stage's ops read: what its ranks keep."""
    tensors = sharded.analysis.graph.tensors
    return stage_holds(_op_names(sharded.analysis.graph), ops, lambda n: tensors[n].kind)


def _op_names(graph: PlanningGraph) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    return [(tuple(node.inputs), tuple(node.outputs)) for node in graph.ops]


def _sends(analysis: GraphAnalysis, profile_of: Callable[[int], UnitProfile],
           stages: Sequence[StageEntry],
           prices_of: Callable[[int], Prices]) -> tuple[SendEntry, ...]:
    """Every activation a device stage receives from another, chunk to chunk, scattered
    over the axes it is replicated on where that is faster (`Prices.send`), its bytes the
    receiving stage's local tensor (`profile_of(stage)`: under per-stage meshes each
    stage's own layout).

    A tensor that carries a gradient goes to every chunk reading it (each chunk's
    backward pass returns its own gradient); one without reaches a device once, at the
    first of its chunks reading it, which hands it on to the device's later chunks.
    """
    chunks = chunks_of(stages)
    chunk_of_unit = chunk_of_units(analysis.units.bounds, chunks)
    sends = []
    for index, crossing in enumerate(profile_of(0).crossings):
        routes = send_routes(UnitCrossing(crossing.tensor, crossing.producer,
                                          crossing.consumers),
                             crossing.grad, chunk_of_unit, chunks)
        for source, target in routes:
            stage = chunks[target][1]
            arriving = profile_of(stage).crossings[index]
            split = prices_of(stage).send(arriving.bytes, arriving.split).split
            sends.append(SendEntry(crossing.tensor, chunks[source][1], stage,
                                   round(arriving.bytes), crossing.grad, source, target,
                                   split.axes if split else (), split.dim if split else -1))
    return tuple(sends)


def _weight_collectives(profile_of: Callable[[int], UnitProfile],
                        stages: Sequence[StageEntry], zero: int,
                        prices_of: Callable[[int], Prices],
                        precision: Precision | None,
                        recomputed: frozenset[str]) -> list[Collective]:
    """Each weight's synchronisation as its ZeRO stage issues it, once per device stage
    holding it, each priced as its share of its bucket and numbered with it (buckets of
    one stage, kind, phase and group fill in the order the step issues them), and the sum
    between the holders of a weight two stages read (a tied embedding), priced as one
    exchange with the other holder. Each weight as its (first) holder's layout shares
    it over that stage's mesh (`profile_of`). ZeRO 3 gathers a weight again before the
    backward pass where that pass reads it or a recompute segment re-runs an op reading
    it (`recomputed`)."""
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for name in stage.holds:
            holders.setdefault(name, []).append(stage.device_stage)
    # each record's fields (kind, weight, axes, bytes, phase, seconds), built into a
    # Collective once its bucket is known: 100,000 weights' records, each made once
    fields: list[tuple[CollectiveKind, str, tuple[str, ...], int, Phase, float]] = []
    issues: list[tuple[tuple, int, Issue]] = []  # (issue order, record index, bucket key)
    steps_of = cache(weight_steps)  # weights alike in every layer: alike steps and prices
    seconds_of: dict[tuple, float] = {}
    for index, param in enumerate(profile_of(0).params):
        held_by = tuple(holders.get(param.name, [0]))
        param = profile_of(held_by[0]).params[index]
        axes = param.synced_axes(prices_of(held_by[0]).mesh)
        first = param.units[0] if param.units else 0
        for step in steps_of(axes, held_by, zero,
                             param.backward_read or param.name in recomputed):
            moved = synced_bytes(step.kind, param.bytes, param.itemsize, precision)
            key = (step.holder, step.number < 0, step.kind, moved, axes)
            seconds = seconds_of.get(key)
            if seconds is None:
                prices = prices_of(step.holder)
                # the sum between two holders: one exchange with the other
                seconds = seconds_of[key] = prices.p2p(moved) if step.number < 0 \
                    else prices.bucketed(step.kind, moved, axes)
            if step.number >= 0:
                # Forward gathers run in layer order; the rest in the backward pass's order.
                position = first if step.phase == Phase.FORWARD else -first
                issues.append(((step.holder, step.number, position, param.name), len(fields),
                               Issue((step.holder, step.kind, step.phase, axes), moved)))
            fields.append((step.kind, param.name, step.axes, round(moved), step.phase,
                           seconds))
    issues.sort(key=lambda item: item[0])
    buckets = assign_buckets((issue for _, _, issue in issues), prices_of(0).bucket)
    bucket_of = {index: bucket for (_, index, _), bucket in zip(issues, buckets, strict=True)}
    return [Collective(kind, name, axes, moved, phase, OPTIMIZER_OP, seconds,
                       bucket_of.get(index))
            for index, (kind, name, axes, moved, phase, seconds) in enumerate(fields)]


def _send_collectives(sends: Sequence[SendEntry], stages: Sequence[StageEntry],
                      graph: PlanningGraph,
                      prices_of: Callable[[int], Prices]) -> list[Collective]:
    """Each send's point-to-point transfer every micro-batch (its gradient back too), and
    for a scattered send the all-gather of the slices where it arrives; named after the
    first op of the receiving chunk that reads it."""
    chunks = chunks_of(stages)
    names = _op_names(graph)
    result = []
    for send in sends:
        split = SendSplit(send.scatter_axes, send.scatter_dim) if send.scatter_axes else None
        priced = prices_of(send.to_stage).send(send.bytes, split)
        assert priced.split == split, "a send's split is decided by Prices.send alone"
        (first, end), _ = chunks[send.to_chunk]
        for step in send_steps(send.tensor, send.grad, split, names[first:end],
                               [node.name for node in graph.ops[first:end]]):
            if step.gathers:
                result.append(Collective(step.kind, send.tensor, step.axes, send.bytes,
                                         step.phase, step.op, priced.gather_s))
            else:
                result.append(Collective(step.kind, send.tensor, step.axes,
                                         round(priced.bytes), step.phase, step.op,
                                         priced.p2p_s))
    return result


# ---------------------------------------------------------------- shared sections


def _op_entries(priced: PricedGraph) -> tuple[OpEntry, ...]:
    """Every op's entry as `priced` lays it out and prices it, built once per choice
    (`PricedGraph.sections`)."""
    found = priced.sections.get(_OPS)
    if found is None:
        found = priced.sections[_OPS] = _built_op_entries(priced)
    return found


_OPS, _TENSORS = "ops", "tensors"  # keys of `PricedGraph.sections`


def _built_op_entries(priced: PricedGraph) -> tuple[OpEntry, ...]:
    mesh = priced.sharded.mesh
    shares = priced.sharded.shares
    entries = []
    for op, cost in zip(priced.sharded.ops, priced.costs, strict=True):
        node = op.node
        inputs = tuple(TensorBinding(name, layout, shares.get((node.name, slot), 1.0))
                       if name and layout is not None else None
                       for slot, (name, layout) in enumerate(zip(node.inputs, op.inputs,
                                                                 strict=True)))
        outputs = tuple(TensorBinding(name, layout) if name and layout is not None else None
                        for name, layout in zip(node.outputs, op.outputs, strict=True))
        entries.append(OpEntry(
            name=node.name, op_type=node.qualified_type,
            strategy=tuple(b.layout.split_factors(mesh) if b else () for b in inputs),
            inputs=inputs, outputs=outputs,
            assignment={label: tuple(axes) for label, axes in op.strategy.assignment},
            note="" if op.has_rule else "no sharding rule: runs replicated", cost=cost))
    return tuple(entries)


def _stored_tensors(priced: PricedGraph) -> Mapping[str, TensorEntry]:
    """Every tensor as `priced`'s layout stores it, built once per choice (the plans of
    every decision on the choice share it; no reader changes a plan)."""
    found = priced.sections.get(_TENSORS)
    if found is None:
        found = priced.sections[_TENSORS] = _tensor_entries(priced.sharded)
    return found


def _tensor_entries(sharded: ShardedGraph,
                    layout: Callable[[str], Layout] | None = None) -> dict[str, TensorEntry]:
    """Every tensor as stored: in `sharded`'s layout, or `layout(name)` where given."""
    stored = layout or sharded.layout
    return {name: TensorEntry(tuple(info.shape), info.dtype, info.kind, stored(name),
                              info.source)
            for name, info in sharded.analysis.graph.tensors.items()}


def _warnings(graph: PlanningGraph, sharded: ShardedGraph,
              hardware: HardwareProfile) -> tuple[str, ...]:
    warnings = list(graph.warnings)
    used = sharded.used_axes
    mesh = sharded.mesh
    for axis, size in zip(mesh.axis_names, mesh.shape, strict=True):
        if size > 1 and axis != AxisRole.PIPELINE and axis not in used:
            warnings.append(
                f"mesh axis {axis}={size}: no op of this model is worth splitting over it "
                f"on {hardware.name} (splitting further would cost more in communication than "
                f"it saves), so its {size} ranks repeat the same work")
    no_rule = sharded.no_rule
    if no_rule:
        kinds = sorted(set(no_rule))
        warnings.append(
            f"{len(no_rule)} op(s) of type {', '.join(kinds)} have no sharding rule; "
            "they are kept and planned replicated (their inputs are gathered)")
    return tuple(warnings)



def _model_ref(graph: PlanningGraph) -> ModelRef:
    return ModelRef(graph.path, graph.sha256, dict(graph.bound_dims), graph.batch, graph.opset,
                    graph.parameter_count, graph.capacity_factor,
                    tuple(graph.routed.values()))


def _cluster_ref(hardware: HardwareProfile, mesh: DeviceMesh,
                 placement: Placement | None = None, devices: int = 0) -> ClusterRef:
    """The plan's devices (`devices`, else the mesh's: per-stage meshes of their own
    device counts hold more or fewer than stage 0's mesh); on a mixed cluster its groups
    in the order placed on the ranks, their nodes summed, and the link between them."""
    devices = devices or mesh.size
    per_node = mesh.devices_per_node
    nodes = max(1, devices // per_node) if devices > per_node else 1
    if placement is None:
        return ClusterRef(hardware.name, devices, nodes,
                          int(hardware.devices_per_node.value))
    cluster = placement.cluster
    groups = tuple(GroupRef(
        group.name, group.profile.name, group.devices,
        int(group.profile.devices_per_node.value), placement.first_rank(g),
        group.memory_bytes) for g in placement.order for group in [cluster.groups[g]])
    link = LinkRef(cluster.link.name, cluster.link.bus_bandwidth_Bps,
                   float(cluster.link.latency_s.value))
    return ClusterRef(hardware.name, mesh.size,
                      sum(group.profile.check_device_count(group.devices)
                          for group in cluster.groups),
                      int(hardware.devices_per_node.value), groups, link)


def _step(training: TrainingOptions) -> StepSpec:
    return StepSpec(StepKind.INFERENCE if training.inference else StepKind.TRAINING,
                    training.overlap, training.precision, training.attention, training.fusion,
                    training.bucket_mb, training.overlap_grad_reduce,
                    LossReads.AS_IS if training.inference else training.loss_reads,
                    None if training.inference else training.accumulation)


def _unit_entries(units: Units) -> tuple[UnitEntry, ...]:
    return tuple(UnitEntry(name, (units.bounds[k], units.bounds[k + 1]))
                 for k, name in enumerate(units.names))


def _layer_units(units: Units) -> tuple[UnitEntry, ...]:
    """The units as readers group ops: only when they are the model's repeated layers."""
    return _unit_entries(units) if units.layer_units else ()


def _split(stage: StagePrice) -> tuple[float, float, float]:
    """A stage's (forward, input backward, weight backward) seconds: what the zero-bubble
    schedules' bubble depends on."""
    weight = stage.weight_s
    return (stage.forward_s, stage.per_micro_batch_s - stage.forward_s - weight, weight)
