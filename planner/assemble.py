"""Turn per-op strategies into a full Plan: layouts, collectives and predicted cost.

Every search (data parallel, ILP, DP, propagation) only chooses an OpStrategy per op;
this module derives the rest the same way for all of them, so their plans are priced by
one model and can be compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodels.memory import MemoryBreakdown, optimizer_state_bytes, training_memory
from costmodels.profile import HardwareProfile
from planner.graph import OpNode, PlanningGraph
from planner.ops import DimLabels, replicated_labels, safe_labels
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
from planner.pricing import (
    Edge,
    edge_collectives,
    fraction_of_layout,
    op_seconds,
    optimizer_seconds,
    price_collective,
    requires_grad_map,
    weight_roots_map,
)
from planner.sharding.candidates import describe
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    grad_partial_axes,
    input_layouts,
    output_layouts,
    work_fraction,
)

BACKWARD_FLOP_RATIO = 2.0  # backward ≈ 2 × forward: gradients of inputs and of weights


@dataclass(frozen=True)
class TrainingOptions:
    """What one step is: a training step (default) or a forward pass, and its settings."""

    optimizer: str = "adam"
    zero: int = 0
    memory_limit_bytes: int | None = None  # None: the profile's device memory
    inference: bool = False  # forward only: no gradients, optimizer or saved activations
    overlap: float = 0.0  # share of gradient synchronisation hidden behind backward compute


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
    requires_grad = {} if options.inference else requires_grad_map(graph)
    live_peak = _LivePeak(graph) if options.inference else None
    weight_roots = weight_roots_map(graph)
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
            op_labels_ = replicated_labels(node)
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
            edge = Edge(name, layout_of[name], want)
            partial_axes = grad_partial_axes(op_labels_, strategy, index)
            roots = weight_roots.get(name)
            found, deferred = edge_collectives(edge, info, node, mesh, profile,
                                                requires_grad.get(name, False), partial_axes,
                                                weight_derived=roots is not None)
            collectives += found
            for root in roots or ():
                if deferred:
                    parameter_partial.setdefault(root, set()).update(deferred)
            bindings.append(TensorBinding(name, want))
        own = describe(node, op_labels_, strategy, tensors, mesh)
        for phase, steps in (("forward", own.forward_collectives),
                             ("backward", own.backward_collectives)):
            for kind, axes, nbytes in steps:
                collectives.append(price_collective(kind, node.outputs[0], axes, nbytes, phase,
                                                    node.name, mesh, profile))
        out_bindings: list[TensorBinding | None] = []
        for name, layout in zip(node.outputs, produced, strict=True):
            if not name or layout is None:
                out_bindings.append(None)
                continue
            layout_of[name] = layout
            out_bindings.append(TensorBinding(name, layout))
        fraction = work_fraction(strategy, mesh)
        forward = op_seconds(node, tensors, fraction, profile)
        backward = saved = 0.0
        compute_forward += forward
        if any(requires_grad.get(o, False) for o in node.outputs if o):
            backward = BACKWARD_FLOP_RATIO * forward
            if not node.is_view:
                saved = sum(tensors[o].nbytes * fraction_of_layout(layout_of[o], mesh)
                            for o in node.outputs if o and tensors[o].is_float)
        compute_backward += backward
        saved_activation_bytes += saved
        output_bytes = sum(tensors[o].nbytes * fraction_of_layout(layout_of[o], mesh)
                           for o in node.outputs if o)
        workspace = max(workspace, output_bytes)
        if live_peak is not None:
            live_peak.step(node, layout_of, mesh)
        op_entries.append(OpEntry(
            name=node.name, op_type=node.qualified_type,
            strategy=[list(b.layout.split_factors(mesh)) if b else [] for b in bindings],
            inputs=bindings, outputs=out_bindings,
            assignment={label: list(axes) for label, axes in strategy.assignment},
            note="no sharding rule: runs replicated" if labels.get(node.name) is None else "",
            cost={"forward_s": forward, "backward_s": backward, "saved_bytes": saved,
                  "output_bytes": output_bytes},
        ))

    collectives += _gradient_collectives(graph, parameter_partial, layout_of, mesh, profile,
                                         options)
    activations = live_peak.peak if live_peak is not None else saved_activation_bytes
    # Activation collectives need their own buffer (the gathered or unreduced tensor);
    # gradient reductions run in place on the gradient buffers.
    workspace = max([workspace, *(c.bytes for c in collectives if c.phase != "gradient")])
    predicted = _predict(graph, mesh, layout_of, profile, options, parallel, collectives,
                         compute_forward, compute_backward, activations, workspace)
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
        step={"kind": "inference" if options.inference else "training",
              "overlap": options.overlap},
    )


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
        result.append(price_collective(kind, name, axes, local, "gradient", "optimizer", mesh,
                                  profile))
    return result


def _predict(graph: PlanningGraph, mesh: DeviceMesh, layout_of: Mapping[str, Layout],
             profile: HardwareProfile, options: TrainingOptions, parallel: ParallelConfig,
             collectives: list[Collective], compute_forward: float, compute_backward: float,
             activation_bytes: float, workspace: float) -> Predicted:
    parameters = graph.parameters
    local_param_bytes = sum(p.nbytes * fraction_of_layout(layout_of[p.name], mesh)
                            if p.name in layout_of else p.nbytes for p in parameters)
    local_param_elements = sum(p.numel * fraction_of_layout(layout_of[p.name], mesh)
                               if p.name in layout_of else p.numel for p in parameters)
    itemsize = parameters[0].itemsize if parameters else 4
    if options.inference:
        memory = MemoryBreakdown(parameters=round(local_param_bytes), gradients=0, optimizer=0,
                                 activations=round(activation_bytes),
                                 workspace=round(workspace))
        optimizer_s = 0.0
    else:
        memory = training_memory(
            parameter_bytes=local_param_bytes, parameter_elements=local_param_elements,
            parameter_itemsize=itemsize, activation_bytes=activation_bytes,
            workspace_bytes=workspace, optimizer=options.optimizer, zero=options.zero,
            dp=parallel.dp,
        )
        optimizer_s = optimizer_seconds(profile, local_param_bytes,
                                        optimizer_state_bytes(local_param_elements, itemsize,
                                                              options.optimizer))
    by_phase = {phase: sum(c.time_s for c in collectives if c.phase == phase)
                for phase in ("forward", "backward", "gradient")}
    hidden = by_phase["gradient"] * options.overlap
    communication = sum(by_phase.values()) - hidden
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
            "forward_communication_s": by_phase["forward"],
            "backward_communication_s": by_phase["backward"],
            "gradient_communication_s": by_phase["gradient"],
            "hidden_communication_s": hidden,
        },
    )


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
