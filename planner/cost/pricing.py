"""Prices of the pieces of a plan: one op's compute, one collective, one edge, the optimizer.

The op-level search tabulates these for every candidate (`planner.search.problem`), the
op-level and pipeline prices add them up (`planner.cost.oplevel`, `planner.cost.pipeline`),
so the search optimises exactly what the plan reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from costmodels.communication import ALGORITHMS, CommGroup, best_algorithm
from costmodels.compute import op_time
from costmodels.profile import HardwareProfile
from planner.graph import OpNode, TensorInfo
from planner.kinds import CollectiveKind, Phase
from planner.records import Collective
from planner.sharding.derive import OPTIMIZER_OP, CollectiveSpec, edge_steps, fraction_of_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

#: What torch.distributed's NCCL and gloo back ends run: ring and tree (the executor issues
#: plain collectives), so the planner does not price algorithms nothing would run.
RUN_ALGORITHMS = ("ring", "tree", "pairwise", "direct")


def op_seconds(node: OpNode, tensors: Mapping[str, TensorInfo], fraction: float,
               profile: HardwareProfile) -> float:
    """One device's share `fraction` of one op's forward pass."""
    if node.is_view:
        return 0.0
    dtype = next((tensors[o].dtype for o in node.outputs if o), "float32")
    nbytes = (node.bytes_read + node.bytes_written) * fraction
    return op_time(profile, node.op_type, node.flops * fraction, nbytes, dtype)


def collective_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                       axes: Sequence[str], mesh: DeviceMesh) -> float:
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


def bucketed_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                     axes: Sequence[str], mesh: DeviceMesh, bucket: float) -> float:
    """One weight collective's share of the bucket of `bucket` bytes it is issued in
    (`planner.cost.buckets`): t(bucket) · nbytes / bucket, its own t(nbytes) when it is no
    smaller than a bucket or bucketing is off (`bucket` 0)."""
    if bucket <= 0 or nbytes >= bucket:
        return collective_seconds(profile, kind, nbytes, axes, mesh)
    if nbytes <= 0:
        return 0.0
    return collective_seconds(profile, kind, bucket, axes, mesh) * (nbytes / bucket)


def _collective_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                        axes: Sequence[str], mesh: DeviceMesh) -> float:
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


def price(spec: CollectiveSpec, mesh: DeviceMesh, profile: HardwareProfile) -> Collective:
    """The collective `spec` with its time on `mesh`."""
    seconds = collective_seconds(profile, spec.kind, spec.nbytes, spec.axes, mesh)
    return Collective(spec.kind, spec.tensor, spec.axes, int(spec.nbytes), spec.phase,
                      spec.op, seconds)


def exposed(seconds: float, overlap: float) -> tuple[float, float]:
    """(exposed, hidden) parts of a gradient synchronisation when `overlap` of it runs
    behind the backward pass."""
    return seconds * (1.0 - overlap), seconds * overlap


def edge_seconds(info: TensorInfo, src: Layout, dst: Layout, consumer: str,
                 mesh: DeviceMesh, profile: HardwareProfile, requires_grad: bool,
                 partial_axes: tuple[str, ...], weight_derived: bool,
                 overlap: float, bucket: float = 0.0) -> tuple[float, float]:
    """Seconds of reading `info` in `dst` when stored in `src` (forward and backward moves,
    and the exposed part of a deferred weight-gradient sum, in buckets of `bucket` bytes),
    and the largest collective buffer the move needs."""
    found, deferred = edge_steps(info, src, dst, consumer, mesh, requires_grad, partial_axes,
                                 weight_derived)
    priced = [price(spec, mesh, profile) for spec in found]
    seconds = sum(c.time_s for c in priced)
    buffer = max([0.0, *(float(c.bytes) for c in priced)])
    if deferred:
        local = info.nbytes * fraction_of_layout(src, mesh)
        gradient = CollectiveSpec(CollectiveKind.ALL_REDUCE, info.name, tuple(sorted(deferred)),
                                  local, Phase.GRADIENT, OPTIMIZER_OP)
        seconds += exposed(bucketed_seconds(profile, gradient.kind, gradient.nbytes,
                                            gradient.axes, mesh, bucket), overlap)[0]
    return seconds, buffer


def optimizer_seconds(profile: HardwareProfile, param_bytes: float, state_bytes: float) -> float:
    """The optimizer step streams weights (read+write), gradients and states (read+write).

    One fused, memory-bound pass over all local weights: no per-kernel floor.
    """
    bandwidth = profile.memory_bandwidth_Bps.value * profile.memory_efficiency.value
    return (3.0 * param_bytes + 2.0 * state_bytes) / bandwidth
