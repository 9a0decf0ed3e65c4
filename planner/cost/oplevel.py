"""The price of one op-level choice: every op's compute, every collective, and the step.

`price_graph` prices a derivation (`planner.sharding.derive`): each op's forward and
backward time on its share of the work, the activations it saves for the backward pass,
its local outputs, and every collective. Added up, they are one pipeline stage running
one micro-batch (`StagePrice`), which the one step model turns into the step
(`planner.cost.step`). Forward-only steps keep, instead of saved activations, the largest
set of activations alive at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from costmodels.gemm import has_shape_terms, least_gemm_seconds
from costmodels.memory import training_memory
from costmodels.profile import HardwareProfile
from costmodels.rates import launch_floor_s, matmul_ramp_s, peak_flops
from planner.cost.buckets import (
    Issue,
    assign_buckets,
    bucket_bytes,
    bucketed_seconds,
    schedule_overlap,
)
from planner.cost.kernels import KernelPlan, kernel_plan, policy_for
from planner.cost.pricing import (
    accumulation_seconds,
    input_batch_axes,
    op_dtype,
    op_times,
    optimizer_seconds,
    price,
    runs_locally,
    saved_bytes,
    synced_bytes,
)
from planner.cost.step import (
    PipelineConfig,
    StagePrice,
    StepPrice,
    TrainingOptions,
    step_price,
)
from planner.graph import OpNode, PlanningGraph
from planner.kinds import Phase, Precision, Recompute
from planner.ops import is_matrix_op
from planner.ops.work import gemm_dims
from planner.records import Collective, MemoryBreakdown, OpCost
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.derive import ShardedGraph, derive, fraction_of_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy


@dataclass(frozen=True)
class PricedGraph:
    """A derivation with its prices: per op, every collective, and the one-stage step."""

    sharded: ShardedGraph
    costs: tuple[OpCost, ...]  # per op, in order
    collectives: tuple[Collective, ...]  # the derivation's, in the same order, priced
    stage: StagePrice  # the whole graph as one stage running one micro-batch
    options: TrainingOptions
    kernels: KernelPlan  # the kernels the ops run as, and what autograd keeps
    overlap_share: float = 1.0  # the profile's compute_overlap (`behind_compute`)
    #: per units, this choice's `planner.cost.units.unit_profile` (the search, the exact
    #: decision and the plan builder all ask for the same choice's)
    profiles: dict = field(default_factory=dict, compare=False, repr=False)
    #: the plan sections built from this choice (`planner.plans.build`: its op and tensor
    #: entries), the same for every decision on it: a pipeline's finalists differing in
    #: ZeRO or micro-batches share one layout, and each built them again
    sections: dict = field(default_factory=dict, compare=False, repr=False)

    def step(self) -> StepPrice:
        """The op-level plan's step: a pipeline of one stage and one micro-batch."""
        options = self.options
        return step_price([self.stage], PipelineConfig(
            optimizer=options.optimizer, overlap=options.overlap,
            precision=options.precision, fusion=options.fusion,
            accumulation=options.accumulation, bucket_mb=options.bucket_mb,
            overlap_grad_reduce=options.overlap_grad_reduce))


def priced_choice(analysis: GraphAnalysis, mesh: DeviceMesh,
                  strategies: Mapping[str, OpStrategy], profile: HardwareProfile,
                  options: TrainingOptions, foreign: frozenset[str] = frozenset()
                  ) -> PricedGraph:
    """`strategies` on `mesh` derived (`planner.sharding.derive`) and priced, once per graph:
    the joint search prices a finalist's exact choice and the plan builder builds the same
    choice from the same derivation (kept on the analysis; one per device kind, so the
    kinds of a mixed cluster do not evict each other's)."""
    key = (mesh, frozenset(strategies.items()), options, profile, foreign)
    kept = analysis.memo.setdefault(DERIVATIONS, {})
    found = kept.get(key)
    if found is not None and found[0] is profile:
        return found[1]
    priced = price_graph(derive(analysis, mesh, strategies, training=not options.inference,
                                loss_reads=options.loss_reads, foreign=foreign),
                         profile, options)
    limit = memo_limit(len(analysis.graph.ops))
    while len(kept) >= limit:  # the oldest goes (dicts keep their insertion order)
        del kept[next(iter(kept))]
    kept[key] = (profile, priced)
    return priced


MEMO_LIMIT = 64  # derivations kept per graph (each holds every op's layouts and prices)
#: ops of derivations kept per graph, at most: a 200,000-op graph keeps 3 derivations,
#: not 64 (each over 100 MB), and derives a finalist again where it has to
MEMO_OPS = 400_000
#: derivations kept however large the graph: the joint search's finalists, each priced
#: exactly when it is decided (`joint_decisions`' verify) and built right after, the
#: oldest evicted first (clearing them all once 2 were kept derived two of three again)
MEMO_FLOOR = 3
DERIVATIONS = "derivations"  # memo key of the analysis: the kept derivations


def memo_limit(ops: int) -> int:
    """How many derivations of a graph of `ops` ops `priced_choice` keeps."""
    return max(MEMO_FLOOR, min(MEMO_LIMIT, MEMO_OPS // max(1, ops)))


def mesh_on(mesh: DeviceMesh, hardware: HardwareProfile) -> DeviceMesh:
    """The mesh as `hardware`'s nodes hold it: the same axes, its devices per node (a
    mixed cluster's kinds may have 4-device and 8-device nodes: which axes cross nodes,
    and so which links a collective takes, is each kind's own)."""
    per_node = int(hardware.devices_per_node.value)
    if per_node == mesh.devices_per_node:
        return mesh
    return DeviceMesh(mesh.shape, mesh.axis_names, per_node)


def priced_on_kinds(analysis: GraphAnalysis, mesh: DeviceMesh,
                    strategies: Mapping[str, OpStrategy], kinds: Sequence[HardwareProfile],
                    options: TrainingOptions) -> list[PricedGraph]:
    """One layout priced by each device kind, on that kind's nodes (`mesh_on`)."""
    return [priced_choice(analysis, mesh_on(mesh, kind), strategies, kind, options)
            for kind in kinds]


@dataclass(frozen=True)
class ComputeFloor:
    """Floors under any layout's forward and backward compute of a graph, each a sum over
    its ops of what the op costs at least. `per_op_s`: what every op costs however small
    its share (each kernel's launch, a GEMM's ramp and one wave of its smallest tiles,
    the host's time per op), which no split divides: over-split or cut into many
    micro-batches, a model of small ops is bound by its launches, not its FLOPs.
    `gemm_s`: the matrix kernels' FLOPs at peak on one device before a split, which a
    split over d devices divides by d; each GEMM's ramp (`fixed_s`, with the other ops'
    launches and the host's time) comes on top of its share, as `op_time` adds it."""

    gemm_s: float
    per_op_s: float
    fixed_s: float = 0.0

    def split_s(self, split: int) -> float:
        """The FLOPs floor of a layout splitting the GEMMs over `split` devices."""
        return self.fixed_s + self.gemm_s / split


def compute_floor(analysis: GraphAnalysis, profile: HardwareProfile,
                  options: TrainingOptions) -> ComputeFloor:
    """The graph's `ComputeFloor`. Every op is priced at its roofline
    (`costmodels.compute.op_time`): no faster than its FLOPs at peak, and no faster than
    the launch floor for each kernel it starts that does any work, in each pass; a GEMM
    pays its ramp on top of its FLOPs, and a GEMM priced by its shape at least one wave of
    the smallest tiles (`costmodels.gemm.least_gemm_seconds`). Where a gradient flows a
    GEMM's backward is its kernel's multiple of the forward, a memory-bound kernel's
    backward a kernel of its own (`planner.cost.pricing.op_times`). The host's time per op
    run (`device.host_op_s`) is counted at the least of its plain-tensor and DTensor
    times."""
    kernels = kernel_plan(analysis, policy_for(profile, options.attention, options.fusion))
    graph = analysis.graph
    flowing = frozenset() if options.inference else analysis.differentiated
    launch = launch_floor_s(profile)
    shaped_terms = has_shape_terms(profile)
    host = (min(profile.host_seconds(False, True), profile.host_seconds(False, False)),
            min(profile.host_seconds(True, True), profile.host_seconds(True, False)))
    least: dict[str, tuple[float, float]] = {}  # per dtype: (least GEMM, ramp)
    gemm = per_op = fixed = 0.0
    for node in graph.ops:
        kernel = kernels.ops[node.name]
        grad = node.name in flowing
        hosted = host[0] + (host[1] if grad else 0.0)
        per_op += hosted
        fixed += hosted
        if kernel.flops <= 0 and kernel.bytes <= 0:
            continue
        launches = kernel.launches
        matrix = kernel.flops > 0 and is_matrix_op(node.op_type)
        # the backward: the forward's multiple, or kernels of their own at the launch floor
        ratio = kernel.backward_ratio if grad and kernel.backward_bytes is None else 0.0
        own = kernel.backward_launches if grad and kernel.backward_bytes is not None and \
            kernel.backward_bytes > 0 else 0
        if not matrix or not launches:
            seconds = launch * (launches + ratio * launches + own)
            per_op += seconds
            fixed += seconds
            continue
        dtype = op_dtype(node, kernel, graph.tensors, options.precision)
        if dtype not in least:
            least[dtype] = (least_gemm_seconds(profile, dtype), matmul_ramp_s(profile, dtype))
        smallest, ramp = least[dtype]
        if shaped_terms and kernel.shaped and gemm_dims(node, graph.tensors) is not None:
            forward, ramps = max(launch * launches, smallest), ramp  # one kernel: its shape
        else:
            forward, ramps = launches * max(launch, ramp), ramp * launches
        per_op += forward * (1.0 + ratio) + launch * own
        fixed += ramps * (1.0 + ratio) + launch * own
        gemm += kernel.flops / peak_flops(profile, dtype) * (
            1.0 + (kernel.backward_ratio if grad else 0.0))
    return ComputeFloor(gemm, per_op, fixed)


def optimizer_floor_s(analysis: GraphAnalysis, profile: HardwareProfile,
                      options: TrainingOptions) -> float:
    """The optimizer pass over every parameter an op reads, on one device
    (`planner.cost.pricing.optimizer_seconds`): the least a step's end adds, once divided
    by the devices sharing the weights, beside the host's time per step."""
    elements: dict[int, float] = {}
    for info in analysis.graph.parameters:
        if info.consumers:
            elements[info.itemsize] = elements.get(info.itemsize, 0.0) + info.numel
    return sum(optimizer_seconds(profile, count, itemsize, options.optimizer,
                                 options.precision, options.fusion)
               for itemsize, count in elements.items())


def price_graph(sharded: ShardedGraph, profile: HardwareProfile,
                options: TrainingOptions) -> PricedGraph:
    graph = sharded.analysis.graph
    tensors, mesh = graph.tensors, sharded.mesh
    flowing = frozenset() if options.inference else sharded.analysis.differentiated
    # how the host runs each op matters only where the profile prices the host's time
    hosted = profile.host_op_s is not None
    batch_axes = input_batch_axes(sharded.layout(name) for name in graph.inputs
                                  if name in sharded.layouts) if hosted else ()
    live_peak = _LivePeak(graph) if options.inference else None
    kernels = kernel_plan(sharded.analysis, policy_for(profile, options.attention,
                                                       options.fusion))
    costs: list[OpCost] = []
    compute_forward = compute_backward = saved_total = workspace = 0.0
    seconds_of: dict[tuple, tuple[float, float]] = {}
    shared: dict[tuple, OpCost] = {}
    for op in sharded.ops:
        node = op.node
        differentiated = node.name in flowing
        kernel = kernels.ops[node.name]
        local = hosted and runs_locally(node, dict(op.strategy.assignment), op.outputs,
                                        sharded.analysis, batch_axes)
        # Every layer prices the same kernels alike: ask the cost model once per question.
        times_key = (node.op_type, kernel, op.fraction, differentiated, local,
                     *(tensors[o].dtype for o in node.outputs[:1] if o),
                     *((repr(node.attrs), *op.inputs[:2],
                        *(tensors[i].shape if i else None for i in node.inputs[:2]))
                       if kernel.matrix else ()))
        found = seconds_of.get(times_key)
        if found is None:
            found = seconds_of[times_key] = op_times(node, kernels, tensors, op.inputs,
                                                     op.fraction, mesh, profile,
                                                     options.precision, differentiated,
                                                     local)
        forward, backward = found
        saved = 0.0 if options.inference else saved_bytes(
            node, kernels, tensors, [sharded.layouts.get(o) if o else None
                                     for o in node.outputs], mesh)
        compute_forward += forward
        compute_backward += backward
        saved_total += saved
        output_bytes = sum(kernels.written_bytes(
            o, tensors[o].nbytes * fraction_of_layout(sharded.layout(o), mesh))
            for o in node.outputs if o)
        workspace = max(workspace, output_bytes)
        if live_peak is not None:
            live_peak.step(node, sharded.layouts, mesh)
        # every layer's ops cost alike: they share one record (of the same figures, of
        # the same types: an op without outputs writes int 0 bytes)
        cost_key = (id(found), saved, output_bytes, output_bytes.__class__)
        cost = shared.get(cost_key)
        if cost is None:
            cost = shared[cost_key] = OpCost(forward, backward, saved, output_bytes)
        costs.append(cost)
    collectives = (*(price(spec, mesh, profile) for op in sharded.ops
                     for spec in op.collectives),
                   *gradient_collectives(sharded, profile, options.bucket_mb,
                                         options.precision))
    # Activation collectives need their own buffer (the gathered or unreduced tensor);
    # gradient reductions run in place on the gradient buffers.
    workspace = max([workspace, *(c.bytes for c in collectives if c.phase != Phase.GRADIENT)])
    times = {phase: 0.0 for phase in Phase}
    for collective in collectives:
        times[collective.phase] += collective.time_s
    sync, hidden = _gradient_overlap(sharded, collectives, costs, options.overlap,
                                     options.overlap_grad_reduce, profile.overlap_share)
    memory, optimizer_s = _memory(graph, sharded, profile, options,
                                  live_peak.peak if live_peak is not None else saved_total,
                                  workspace)
    stage = StagePrice(
        ranges=((0, sharded.analysis.units.count),), recompute=Recompute.NONE,
        forward_compute_s=compute_forward, backward_compute_s=compute_backward,
        forward_communication_s=times[Phase.FORWARD],
        backward_communication_s=times[Phase.BACKWARD], recompute_s=0.0, p2p_s=0.0,
        zero_s=0.0, sync_s=sync, hidden_s=hidden,
        optimizer_s=optimizer_s + (0.0 if options.inference else profile.step_host_seconds),
        in_flight=1.0,
        memory=memory)
    return PricedGraph(sharded, tuple(costs), collectives, stage, options, kernels,
                       profile.overlap_share)


def gradient_collectives(sharded: ShardedGraph, profile: HardwareProfile,
                         bucket_mb: float, precision: Precision | None
                         ) -> tuple[Collective, ...]:
    """The weights' gradient all-reduces of an op-level plan, each moving the gradient
    the precision keeps (`synced_bytes`), priced as its share of its bucket and numbered
    with it; buckets fill in the order the backward pass issues them (last weight
    first)."""
    mesh = sharded.mesh
    bucket = bucket_bytes(bucket_mb)
    specs = sharded.gradients
    moved = [synced_bytes(spec.kind, spec.nbytes, _itemsize(sharded, spec.tensor), precision)
             for spec in specs]
    issued = sorted(range(len(specs)), key=lambda k: _first_use(sharded, specs[k].tensor),
                    reverse=True)
    numbers = assign_buckets((Issue((specs[k].kind, specs[k].axes), moved[k])
                              for k in issued), bucket)
    bucket_of = dict(zip(issued, numbers, strict=True))
    return tuple(Collective(spec.kind, spec.tensor, spec.axes, int(moved[k]), spec.phase,
                            spec.op, bucketed_seconds(profile, spec.kind, moved[k],
                                                      spec.axes, mesh, bucket), bucket_of[k])
                 for k, spec in enumerate(specs))


def _itemsize(sharded: ShardedGraph, tensor: str) -> int:
    return sharded.analysis.graph.tensors[tensor].itemsize


def _first_use(sharded: ShardedGraph, tensor: str) -> int:
    """Index of the first op reading `tensor` (the order the backward pass reverses)."""
    analysis = sharded.analysis
    first = analysis.first_consumers.get(tensor)
    return op_index(analysis)[first[0]] if first is not None else 0


def op_index(analysis: GraphAnalysis) -> dict[str, int]:
    """Op name -> its index in the graph's ops (found once per graph)."""
    found = analysis.memo.get(OP_INDEX)
    if found is None:
        found = analysis.memo[OP_INDEX] = {node.name: k
                                           for k, node in enumerate(analysis.graph.ops)}
    return found


OP_INDEX = "op index"  # memo key of the analysis: op name -> index
LAST_BUCKET = "last bucket"  # memo key of the analysis: `last_bucket_ops`


def last_bucket_ops(analysis: GraphAnalysis) -> frozenset[str]:
    """The ops of the first unit: the weights they read first (`first_consumers`) have
    their gradients only when the backward pass ends, so their reduction is the last
    bucket and no backward compute hides it (`schedule_overlap`'s `last`). Found once
    per graph: the plan's step and the search's table both ask."""
    found = analysis.memo.get(LAST_BUCKET)
    if found is None:
        ops = analysis.graph.ops
        unit_of = analysis.units.unit_of_ops()
        found = analysis.memo[LAST_BUCKET] = frozenset(
            node.name for node, unit in zip(ops, unit_of.tolist(), strict=True)
            if unit == int(unit_of[0])) if len(ops) else frozenset()
    return found


def _gradient_overlap(sharded: ShardedGraph, collectives: Sequence[Collective],
                      costs: Sequence[OpCost], overlap: float,
                      scheduled: bool, share: float) -> tuple[float, float]:
    """(exposed, hidden) gradient synchronisation: all but the first unit's weights' (the
    last bucket) behind the backward compute of the other units (`schedule_overlap`)."""
    analysis = sharded.analysis
    in_last = last_bucket_ops(analysis)
    ops = analysis.graph.ops
    total = last = 0.0
    for collective in collectives:
        if collective.phase != Phase.GRADIENT:
            continue
        total += collective.time_s
        if ops[_first_use(sharded, collective.tensor)].name in in_last:
            last += collective.time_s
    backward = sum(cost.backward_s for cost in costs)
    first = sum(cost.backward_s for node, cost in zip(ops, costs, strict=True)
                if node.name in in_last)
    return schedule_overlap(total, last, backward - first, overlap, scheduled, share)


def _memory(graph: PlanningGraph, sharded: ShardedGraph, profile: HardwareProfile,
            options: TrainingOptions, activation_bytes: float,
            workspace: float) -> tuple[MemoryBreakdown, float]:
    """Memory per device by category, and the optimizer pass's seconds."""
    parameters = graph.parameters
    mesh, layouts = sharded.mesh, sharded.layouts
    local_bytes = sum(p.nbytes * fraction_of_layout(layouts[p.name], mesh)
                      if p.name in layouts else p.nbytes for p in parameters)
    local_elements = sum(p.numel * fraction_of_layout(layouts[p.name], mesh)
                         if p.name in layouts else p.numel for p in parameters)
    itemsize = parameters[0].itemsize if parameters else 4
    if options.inference:
        return MemoryBreakdown(parameters=round(local_bytes), gradients=0, optimizer=0,
                               activations=round(activation_bytes),
                               workspace=round(workspace)), 0.0
    memory = training_memory(
        parameter_bytes=local_bytes, parameter_elements=local_elements,
        parameter_itemsize=itemsize, activation_bytes=activation_bytes,
        workspace_bytes=workspace, optimizer=options.optimizer, precision=options.precision)
    return memory, optimizer_seconds(profile, local_elements, itemsize, options.optimizer,
                                     options.precision, options.fusion) \
        + accumulation_seconds(profile, local_elements, itemsize, options.precision,
                               options.fusion, options.accumulation, 1)


class _LivePeak:
    """Forward-only memory: the largest set of activations alive at once (liveness)."""

    def __init__(self, graph: PlanningGraph) -> None:
        self.graph = graph
        self.last_use: dict[str, int] = {}
        for index, node in enumerate(graph.ops):
            for name in node.inputs:
                if name:
                    self.last_use[name] = index
        self.keep = set(graph.outputs)
        self.live: dict[str, float] = {}
        self.index = 0
        self.peak = 0.0

    def step(self, node: OpNode, layout_of: Mapping[str, Layout], mesh: DeviceMesh) -> None:
        for name in node.outputs:
            if name and not node.is_view:
                info = self.graph.tensors[name]
                self.live[name] = info.nbytes * fraction_of_layout(layout_of[name], mesh)
        self.peak = max(self.peak, sum(self.live.values()))
        for name in list(self.live):
            if name not in self.keep and self.last_use.get(name, -1) <= self.index:
                del self.live[name]
        self.index += 1
