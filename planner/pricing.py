"""Prices of the pieces of a plan: one op's compute, one edge's collectives, one gradient.

`planner.assemble` adds them up for a chosen plan; `planner.search.problem` tabulates them
for every candidate, so the search optimises exactly what the plan reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodels.communication import ALGORITHMS, CommGroup, best_algorithm
from costmodels.compute import op_time
from costmodels.profile import HardwareProfile
from planner.graph import OpNode, PlanningGraph, TensorInfo
from planner.planfile import Collective
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.redistribute import backward_steps, redistribute


@dataclass
class Edge:
    tensor: str
    src: Layout
    dst: Layout


def fraction_of_layout(layout: Layout, mesh: DeviceMesh) -> float:
    """Share of a tensor one device holds."""
    share = 1.0
    for factor in layout.split_factors(mesh):
        share /= factor
    return share


def requires_grad_map(graph: PlanningGraph) -> dict[str, bool]:
    """Float tensors that depend on a parameter carry gradients in the backward pass."""
    flag = {t.name: t.kind == "parameter" for t in graph.tensors.values()}
    for node in graph.ops:
        needs = any(flag.get(i, False) for i in node.inputs if i)
        for output in node.outputs:
            if output:
                flag[output] = needs and graph.tensors[output].is_float
    return flag


def weight_roots_map(graph: PlanningGraph) -> dict[str, frozenset[str]]:
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


def op_seconds(node: OpNode, tensors: Mapping[str, TensorInfo], fraction: float,
                profile: HardwareProfile) -> float:
    if node.is_view:
        return 0.0
    dtype = next((tensors[o].dtype for o in node.outputs if o), "float32")
    nbytes = (node.bytes_read + node.bytes_written) * fraction
    return op_time(profile, node.op_type, node.flops * fraction, nbytes, dtype)


#: What torch.distributed's NCCL and gloo back ends run: ring and tree (the executor issues
#: plain collectives), so the planner does not price algorithms nothing would run.
RUN_ALGORITHMS = ("ring", "tree", "pairwise", "direct")


def collective_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                       axes: tuple[str, ...] | list[str], mesh: DeviceMesh) -> float:
    """Time of one collective over the mesh axes, by the cheapest algorithm that runs.

    Memoised per profile object: a large plan prices the same few groups and sizes
    hundreds of thousands of times.
    """
    cache = profile.__dict__.setdefault("_collective_seconds", {})
    key = (kind, float(nbytes), tuple(axes), mesh)
    found = cache.get(key)
    if found is None:
        if len(cache) > 500_000:
            cache.clear()
        found = cache[key] = _collective_seconds(profile, kind, nbytes, axes, mesh)
    return found


def _collective_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                        axes: tuple[str, ...] | list[str], mesh: DeviceMesh) -> float:
    size, per_node, extent, node_extent = mesh.placement(axes)
    if size <= 1 or nbytes <= 0:
        return 0.0
    group = CommGroup(size, per_node, extent, node_extent if per_node == size else 0)
    found = []
    for algorithm in ALGORITHMS[kind]:
        if algorithm in RUN_ALGORITHMS:
            try:
                found.append(best_algorithm(profile, kind, nbytes, group, algorithm)[1])
            except ValueError:
                continue
    return min(found)


def price_collective(kind: str, tensor: str, axes: tuple[str, ...] | list[str], nbytes: float,
                     phase: str, op: str, mesh: DeviceMesh,
                     profile: HardwareProfile) -> Collective:
    seconds = collective_seconds(profile, kind, nbytes, axes, mesh)
    return Collective(kind, tensor, list(axes), int(nbytes), phase, op, seconds)


def edge_collectives(edge: Edge, info: TensorInfo, consumer: OpNode, mesh: DeviceMesh,
                      profile: HardwareProfile, requires_grad: bool,
                      partial_axes: tuple[str, ...],
                      weight_derived: bool) -> tuple[list[Collective], set[str]]:
    """Collectives of one tensor edge, and the gradient axes deferred to its weights.

    A weight-derived tensor (a parameter, or computed from parameters alone) is the same
    on every device, so its gradient need not be reduced here: a partial gradient, or the
    zero-padded gradient of a local slice, is summed once at the parameter instead.
    """
    forward = redistribute(edge.src, edge.dst, info.shape, info.itemsize, mesh)
    result = [price_collective(s.kind, edge.tensor, s.axes, s.nbytes, "forward", consumer.name,
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
    result += [price_collective(s.kind, edge.tensor, s.axes, s.nbytes, "backward", consumer.name,
                           mesh, profile) for s in steps if s.communicates]
    return result, deferred


def optimizer_seconds(profile: HardwareProfile, param_bytes: float, state_bytes: float) -> float:
    """The optimizer step streams weights (read+write), gradients and states (read+write).

    One fused, memory-bound pass over all local weights: no per-kernel floor.
    """
    bandwidth = profile.memory_bandwidth_Bps.value * profile.memory_efficiency.value
    return (3.0 * param_bytes + 2.0 * state_bytes) / bandwidth
