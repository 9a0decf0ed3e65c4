"""Turn per-op strategies into a full Plan: layouts, collectives and predicted cost.

Every search (data parallel, ILP, DP, propagation) only chooses an OpStrategy per op;
this module derives the rest the same way for all of them, so their plans are priced by
one model and can be compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodels.communication import collective_time
from costmodels.compute import op_time
from costmodels.memory import training_memory
from costmodels.profile import HardwareProfile
from planner.graph import OpNode, PlanningGraph, TensorInfo
from planner.planfile import (
    ClusterRef,
    Collective,
    ModelRef,
    OpEntry,
    ParallelConfig,
    Plan,
    Predicted,
    SolverRecord,
    TensorBinding,
    TensorEntry,
)
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.redistribute import backward_steps, redistribute
from planner.sharding.rules import DimLabels, safe_labels
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    grad_partial_axes,
    input_layouts,
    output_layouts,
    sync_axes,
    work_fraction,
)

BACKWARD_FLOP_RATIO = 2.0  # backward ≈ 2 × forward: gradients of inputs and of weights


@dataclass(frozen=True)
class TrainingOptions:
    optimizer: str = "adam"
    zero: int = 0
    memory_limit_bytes: int | None = None  # None: the profile's device memory


@dataclass
class _Edge:
    tensor: str
    src: Layout
    dst: Layout


def op_labels(graph: PlanningGraph) -> dict[str, DimLabels | None]:
    return {node.name: safe_labels(node, graph.tensors) for node in graph.ops}


def assemble(
    graph: PlanningGraph,
    mesh: DeviceMesh,
    strategies: Mapping[str, OpStrategy],
    profile: HardwareProfile,
    parallel: ParallelConfig,
    solver: SolverRecord,
    options: TrainingOptions = TrainingOptions(),
    labels: Mapping[str, DimLabels | None] | None = None,
) -> Plan:
    """Build the plan of `strategies` (missing ops run replicated) and price it."""
    labels = dict(labels) if labels is not None else op_labels(graph)
    tensors = graph.tensors
    requires_grad = _requires_grad(graph)
    weight_roots = _weight_roots(graph)
    layout_of: dict[str, Layout] = {}
    op_entries: list[OpEntry] = []
    collectives: list[Collective] = []
    parameter_partial: dict[str, set[str]] = {}
    compute_forward = compute_backward = 0.0
    saved_activation_bytes = 0.0
    workspace = 0.0
    no_rule: list[str] = []

    for node in graph.ops:
        op_labels_ = labels.get(node.name)
        strategy = strategies.get(node.name, REPLICATED) if op_labels_ is not None else REPLICATED
        if op_labels_ is None:
            no_rule.append(node.qualified_type)
            op_labels_ = _replicated_labels(node, tensors)
        in_ranks = [len(tensors[t].shape) if t else -1 for t in node.inputs]
        out_ranks = [len(tensors[t].shape) if t else -1 for t in node.outputs]
        wanted = input_layouts(op_labels_, strategy, in_ranks)
        produced = output_layouts(op_labels_, strategy, out_ranks)
        bindings: list[TensorBinding | None] = []
        for index, (name, want) in enumerate(zip(node.inputs, wanted, strict=True)):
            if not name or want is None:
                bindings.append(None)
                continue
            info = tensors[name]
            if name not in layout_of:  # inputs and weights are placed as first consumed
                layout_of[name] = want
            edge = _Edge(name, layout_of[name], want)
            partial_axes = grad_partial_axes(op_labels_, strategy, index)
            roots = weight_roots.get(name)
            found, deferred = _edge_collectives(edge, info, node, mesh, profile,
                                                requires_grad.get(name, False), partial_axes,
                                                weight_derived=roots is not None)
            collectives += found
            for root in roots or ():
                if deferred:
                    parameter_partial.setdefault(root, set()).update(deferred)
            bindings.append(TensorBinding(name, want))
        for axes in [sync_axes(op_labels_, strategy)]:
            if axes:
                stats = _batch_norm_stat_bytes(node, tensors)
                for phase in ("forward", "backward"):
                    collectives.append(_collective("all_reduce", node.outputs[0], axes, stats,
                                                   phase, node.name, mesh, profile))
        out_bindings: list[TensorBinding | None] = []
        for name, layout in zip(node.outputs, produced, strict=True):
            if not name or layout is None:
                out_bindings.append(None)
                continue
            layout_of[name] = layout
            out_bindings.append(TensorBinding(name, layout))
        fraction = work_fraction(strategy, mesh)
        forward = _op_seconds(node, tensors, fraction, profile)
        compute_forward += forward
        if any(requires_grad.get(o, False) for o in node.outputs if o):
            compute_backward += BACKWARD_FLOP_RATIO * forward
            if not node.is_view:
                saved_activation_bytes += sum(
                    tensors[o].nbytes * fraction_of_layout(layout_of[o], mesh)
                    for o in node.outputs if o and tensors[o].is_float
                )
        workspace = max(workspace, sum(tensors[o].nbytes * fraction_of_layout(layout_of[o], mesh)
                                       for o in node.outputs if o))
        op_entries.append(OpEntry(
            name=node.name, op_type=node.qualified_type,
            strategy=[list(b.layout.split_factors(mesh)) if b else [] for b in bindings],
            inputs=bindings, outputs=out_bindings,
            assignment={label: list(axes) for label, axes in strategy.assignment},
            note="no sharding rule: runs replicated" if labels.get(node.name) is None else "",
        ))

    collectives += _gradient_collectives(graph, parameter_partial, layout_of, mesh, profile,
                                         options)
    predicted = _predict(graph, mesh, layout_of, profile, options, parallel, collectives,
                         compute_forward, compute_backward, saved_activation_bytes, workspace)
    warnings = list(graph.warnings)
    if no_rule:
        kinds = sorted(set(no_rule))
        warnings.append(
            f"{len(no_rule)} op(s) of type {', '.join(kinds)} have no sharding rule; "
            "they are kept and planned replicated (their inputs are gathered)"
        )
    tensors_json = {
        name: TensorEntry(list(info.shape), info.dtype, info.kind,
                          layout_of.get(name, Layout.replicated(len(info.shape))))
        for name, info in tensors.items()
    }
    nodes = max(1, mesh.size // mesh.devices_per_node) if mesh.size > mesh.devices_per_node else 1
    return Plan(
        model=ModelRef(graph.path, graph.sha256, dict(graph.bound_dims), graph.batch, graph.opset,
                       graph.parameter_count),
        cluster=ClusterRef(profile.name, mesh.size, nodes, int(profile.devices_per_node.value)),
        mesh=mesh, parallel=parallel, ops=op_entries, tensors=tensors_json,
        collectives=collectives, predicted=predicted, solver=solver, warnings=warnings,
    )


def fraction_of_layout(layout: Layout, mesh: DeviceMesh) -> float:
    """Share of a tensor one device holds."""
    share = 1.0
    for factor in layout.split_factors(mesh):
        share /= factor
    return share


def _replicated_labels(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    return DimLabels(
        tuple(None for _ in node.inputs),
        tuple(None for _ in node.outputs),
    )


def _requires_grad(graph: PlanningGraph) -> dict[str, bool]:
    """Float tensors that depend on a parameter carry gradients in the backward pass."""
    flag = {t.name: t.kind == "parameter" for t in graph.tensors.values()}
    for node in graph.ops:
        needs = any(flag.get(i, False) for i in node.inputs if i)
        for output in node.outputs:
            if output:
                flag[output] = needs and graph.tensors[output].is_float
    return flag


def _weight_roots(graph: PlanningGraph) -> dict[str, frozenset[str]]:
    """Tensors computed from parameters alone (a tied head's transposed table), by root.

    Their partial gradients need no reduction of their own: backward ops are linear in the
    incoming gradient, so summing once at the parameters gives the same result.
    """
    roots: dict[str, frozenset[str]] = {
        t.name: frozenset({t.name}) for t in graph.tensors.values() if t.kind == "parameter"
    }
    constant = {t.name for t in graph.tensors.values() if t.kind in ("constant", "buffer")}
    for node in graph.ops:
        sources = [i for i in node.inputs if i]
        if not sources or not all(i in roots or i in constant for i in sources):
            continue
        found = frozenset().union(*(roots.get(i, frozenset()) for i in sources))
        if not found:
            continue
        for output in node.outputs:
            if output and graph.tensors[output].is_float:
                roots[output] = found
    return roots


def _op_seconds(node: OpNode, tensors: Mapping[str, TensorInfo], fraction: float,
                profile: HardwareProfile) -> float:
    if node.is_view:
        return 0.0
    dtype = next((tensors[o].dtype for o in node.outputs if o), "float32")
    nbytes = (node.bytes_read + node.bytes_written) * fraction
    return op_time(profile, node.op_type, node.flops * fraction, nbytes, dtype)


def _collective(kind: str, tensor: str, axes: tuple[str, ...] | list[str], nbytes: float,
                phase: str, op: str, mesh: DeviceMesh, profile: HardwareProfile) -> Collective:
    group = mesh.group_size(axes)
    seconds = collective_time(profile, kind, nbytes, group, mesh.group_extent(axes))
    return Collective(kind, tensor, list(axes), int(nbytes), phase, op, seconds)


def _edge_collectives(edge: _Edge, info: TensorInfo, consumer: OpNode, mesh: DeviceMesh,
                      profile: HardwareProfile, requires_grad: bool,
                      partial_axes: tuple[str, ...],
                      weight_derived: bool) -> tuple[list[Collective], set[str]]:
    """Collectives of one tensor edge, and the gradient axes deferred to its weights.

    A weight-derived tensor (a parameter, or computed from parameters alone) is the same
    on every device, so its gradient need not be reduced here: a partial gradient, or the
    zero-padded gradient of a local slice, is summed once at the parameter instead.
    """
    forward = redistribute(edge.src, edge.dst, info.shape, info.itemsize, mesh)
    result = [_collective(s.kind, edge.tensor, s.axes, s.nbytes, "forward", consumer.name,
                          mesh, profile) for s in forward if s.communicates]
    if not requires_grad:
        return result, set()
    deferred: set[str] = set()
    if weight_derived:
        deferred = set(partial_axes) | {a for s in forward if s.kind == "slice" for a in s.axes}
        forward = [s for s in forward if s.kind != "slice"]
        partial_axes = ()
    src_bytes = int(info.nbytes * fraction_of_layout(edge.src, mesh))
    steps = backward_steps(forward, partial_axes, src_bytes)
    result += [_collective(s.kind, edge.tensor, s.axes, s.nbytes, "backward", consumer.name,
                           mesh, profile) for s in steps if s.communicates]
    return result, deferred


def _gradient_collectives(graph: PlanningGraph, parameter_partial: Mapping[str, set[str]],
                          layout_of: Mapping[str, Layout], mesh: DeviceMesh,
                          profile: HardwareProfile,
                          options: TrainingOptions) -> list[Collective]:
    """Each parameter's gradient is summed over the axes its consumers split work on."""
    result = []
    kind = "reduce_scatter" if options.zero >= 2 else "all_reduce"
    for name in sorted(parameter_partial):
        info = graph.tensors[name]
        axes = tuple(a for a in mesh.axis_names if a in parameter_partial[name])
        local = info.nbytes * fraction_of_layout(layout_of[name], mesh)
        result.append(_collective(kind, name, axes, local, "gradient", "optimizer", mesh,
                                  profile))
    return result


def _batch_norm_stat_bytes(node: OpNode, tensors: Mapping[str, TensorInfo]) -> float:
    x = tensors[node.inputs[0]]
    channels = x.shape[1] if len(x.shape) > 1 else 1
    return 2.0 * channels * 4  # per-channel sum and sum of squares, fp32


def _predict(graph: PlanningGraph, mesh: DeviceMesh, layout_of: Mapping[str, Layout],
             profile: HardwareProfile, options: TrainingOptions, parallel: ParallelConfig,
             collectives: list[Collective], compute_forward: float, compute_backward: float,
             saved_activation_bytes: float, workspace: float) -> Predicted:
    parameters = graph.parameters
    local_param_bytes = sum(p.nbytes * fraction_of_layout(layout_of.get(p.name, Layout(())),
                                                          mesh)
                            if p.name in layout_of else p.nbytes for p in parameters)
    local_param_elements = sum(p.numel * fraction_of_layout(layout_of[p.name], mesh)
                               if p.name in layout_of else p.numel for p in parameters)
    itemsize = parameters[0].itemsize if parameters else 4
    memory = training_memory(
        parameter_bytes=local_param_bytes, parameter_elements=local_param_elements,
        parameter_itemsize=itemsize, activation_bytes=saved_activation_bytes,
        workspace_bytes=workspace, optimizer=options.optimizer, zero=options.zero,
        dp=parallel.dp,
    )
    optimizer_s = op_time(profile, "Optimizer", 0.0,
                          2.0 * memory.parameters + memory.gradients + 2.0 * memory.optimizer,
                          "float32")
    communication = sum(c.time_s for c in collectives)
    compute = compute_forward + compute_backward + optimizer_s
    limit = options.memory_limit_bytes or int(profile.memory_bytes.value)
    return Predicted(
        step_time_s=compute + communication,
        compute_s=compute,
        communication_s=communication,
        memory=memory.to_json(),
        memory_limit_bytes=int(limit),
        fits=memory.peak <= limit,
        breakdown={
            "forward_s": compute_forward,
            "backward_s": compute_backward,
            "optimizer_s": optimizer_s,
            "forward_communication_s": sum(c.time_s for c in collectives
                                           if c.phase == "forward"),
            "backward_communication_s": sum(c.time_s for c in collectives
                                            if c.phase == "backward"),
            "gradient_communication_s": sum(c.time_s for c in collectives
                                            if c.phase == "gradient"),
        },
    )
