"""Prices of the pieces of a plan: one op's compute, one collective, one edge, the optimizer.

The op-level search tabulates these for every candidate (`planner.search.problem`), the
op-level and pipeline prices add them up (`planner.cost.oplevel`, `planner.cost.pipeline`),
so the search optimises exactly what the plan reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from costmodels.communication import ALGORITHMS, CommGroup, best_algorithm
from costmodels.compute import op_time
from costmodels.gemm import GemmShape
from costmodels.precision import accumulation_bytes, optimizer_step_bytes, policy, resolve
from costmodels.profile import HardwareProfile
from planner.cost.kernels import KernelPlan, OpKernel, accumulation_for, policy_for
from planner.graph import OpNode, TensorInfo
from planner.kinds import CollectiveKind, Fusion, GradAccumulation, Precision
from planner.ops.work import gemm_dims
from planner.records import Collective, OpCost
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.batch import runs_as_data_parallel
from planner.sharding.derive import CollectiveSpec, edge_steps, fraction_of_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

#: What torch.distributed's NCCL and gloo back ends run: ring and tree (the executor issues
#: plain collectives), so the planner does not price algorithms nothing would run.
RUN_ALGORITHMS = ("ring", "tree", "pairwise", "direct")


def op_seconds(node: OpNode, kernel: OpKernel, dtype: str, fraction: float,
               profile: HardwareProfile, shape: GemmShape | None = None) -> float:
    """One device's share `fraction` of one op's forward pass, as its share of the kernel
    it runs in (`planner.cost.kernels`); a GEMM's local `shape` prices its tiles and
    waves (`costmodels.gemm`)."""
    if kernel.flops <= 0 and kernel.bytes <= 0:
        return 0.0
    return op_time(profile, node.op_type, kernel.flops * fraction, kernel.bytes * fraction,
                   dtype, launches=kernel.launches, shape=shape)


def local_gemm_shape(node: OpNode, kernel: OpKernel, tensors: Mapping[str, TensorInfo],
                     inputs: Sequence[Layout | None], mesh: DeviceMesh) -> GemmShape | None:
    """The (batch, m, n, k) one device's GEMM runs: the op's operands as its input layouts
    cut them; None for ops that are not a GEMM kernel of their own, and for a flash
    attention core (its s² scores never leave the chip: no m × n epilogue, no s² bytes)."""
    if not kernel.matrix or not kernel.launches or not kernel.shaped:
        return None
    local: dict[str, TensorInfo] = {}
    for name, layout in zip(node.inputs[:2], inputs, strict=False):
        if name:
            info = tensors[name]
            local[name] = info if layout is None else replace(
                info, shape=layout.local_shape(info.shape, mesh))
    dims = gemm_dims(node, local)
    return None if dims is None else GemmShape(m=dims[1], n=dims[2], k=dims[3], batch=dims[0])


def op_dtype(node: OpNode, kernel: OpKernel, tensors: Mapping[str, TensorInfo],
             precision: Precision | None) -> str:
    """The dtype whose peak the op runs at: a GEMM at its precision's (tf32, fp8), every
    other op at its output's."""
    if kernel.matrix and precision is not None:
        return policy(precision).matmul_dtype
    return next((tensors[o].dtype for o in node.outputs if o), "float32")


def op_times(node: OpNode, kernels: KernelPlan, tensors: Mapping[str, TensorInfo],
             inputs: Sequence[Layout | None], fraction: float, mesh: DeviceMesh,
             profile: HardwareProfile, precision: Precision | None,
             differentiated: bool, local: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one device's share `fraction` of one op that reads
    its inputs in `inputs`, the backward when a gradient flows: a memory-bound kernel's
    as kernels of their own (the bytes they move, their launches:
    `OpKernel.backward_bytes`), a GEMM's as its kernel's multiple of the forward. Where
    the profile states the host's time per op run (`device.host_op_s`: a CPU rank runs
    each op itself), each pass adds it, as the op runs on plain tensors (`local`:
    `runs_locally`) or through DTensor."""
    kernel = kernels.ops[node.name]
    shape = local_gemm_shape(node, kernel, tensors, inputs, mesh)
    dtype = op_dtype(node, kernel, tensors, precision)
    forward = op_seconds(node, kernel, dtype, fraction, profile, shape)
    host_forward = profile.host_seconds(False, local)
    if not differentiated:
        return forward + host_forward, 0.0
    if kernel.backward_bytes is None:
        backward = kernel.backward_ratio * forward
    elif kernel.backward_bytes <= 0 and not kernel.backward_launches:
        backward = 0.0
    else:
        flops = kernel.flops * fraction if kernel.backward_bytes > 0 else 0.0
        backward = op_time(profile, node.op_type, flops, kernel.backward_bytes * fraction,
                           dtype, launches=kernel.backward_launches)
    return forward + host_forward, backward + profile.host_seconds(True, local)


class _Unknown:
    """The batch's axes before a layout is chosen (`runs_locally` in the search)."""


#: `runs_locally`'s `batch_axes` where no layout of the graph's inputs is chosen yet
UNKNOWN_BATCH_AXES = _Unknown()


def input_batch_axes(layouts: Iterable[Layout]) -> tuple[str, ...] | None:
    """The mesh axes the graph's inputs are split over, along their first (batch) dim, as
    the module executor reads them (`executor.module.local`); None where the inputs are
    split otherwise or over different axes: the executor then runs every op through
    DTensor."""
    found: set[tuple[str, ...]] = set()
    for layout in layouts:
        if not layout.dims:
            continue
        if any(layout.dims[1:]) or layout.partial:
            return None
        found.add(layout.dims[0])
    if len(found) > 1:
        return None
    return next(iter(found), ())


def runs_locally(node: OpNode, assigned: Mapping[str, tuple[str, ...]],
                 outputs: Sequence[Layout | None], analysis: GraphAnalysis,
                 batch_axes: tuple[str, ...] | _Unknown | None = UNKNOWN_BATCH_AXES) -> bool:
    """Whether the host runs `node` as a plain op (`device.host_op_s`'s local time) under
    the assignment `assigned` writing `outputs`: it computes from weights alone (a
    weight's transpose or cast, which the module executor computes with the weight's
    read: the exporter's Transpose of an `nn.Linear` weight is inside the traced linear
    call), or it runs as data parallelism would (`planner.sharding.batch.
    runs_as_data_parallel`) over the graph's `batch_axes` (`input_batch_axes`), a
    replicated op only where it holds no batch or the batch is not split. In the search,
    before the inputs' layout is known, any axes splitting exactly the batch count."""
    if all(name in analysis.weight_roots for name in node.outputs if name):
        return True
    if batch_axes is None:
        return False
    batch = analysis.batch_labels.get(node.name, frozenset())
    if not runs_as_data_parallel(assigned, batch, outputs):
        return False
    if isinstance(batch_axes, _Unknown):
        return True
    if not assigned:
        return not batch or not batch_axes
    return set(assigned.values()) == {batch_axes}


def weight_gradient_seconds(node: OpNode, kernels: KernelPlan, cost: OpCost) -> float:
    """Of `cost.backward_s`, the seconds of `node`'s weights' gradients (its kernel's
    `weight_ratio` forward passes, `planner.cost.kernels.weight_gradient_ratio`); the rest
    is its inputs' gradients."""
    if cost.backward_s <= 0.0:
        return 0.0
    return min(cost.backward_s, kernels.ops[node.name].weight_ratio * cost.forward_s)


def saved_bytes(node: OpNode, kernels: KernelPlan, tensors: Mapping[str, TensorInfo],
                layouts: Sequence[Layout | None], mesh: DeviceMesh,
                among: AbstractSet[str] | None = None) -> float:
    """Bytes of `node`'s outputs (in `layouts`) that autograd keeps for the backward pass
    (of those in `among`, when given)."""
    total = 0.0
    for name, layout in zip(node.outputs, layouts, strict=True):
        if among is not None and name not in among:
            continue
        share = kernels.saved.get(name, 0.0) if name else 0.0
        if share and layout is not None:
            total += share * tensors[name].nbytes * fraction_of_layout(layout, mesh)
    return total


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
    return group_seconds(profile, kind, nbytes, CommGroup(
        size, per_node, extent, node_extent if per_node == size else 0))


def group_seconds(profile: HardwareProfile, kind: str, nbytes: float,
                  group: CommGroup) -> float:
    """Time of one collective on a placed group (mesh axes' or, between pipeline stages
    of their own device counts, a pair's: `planner.cost.pipeline.send_group`): a measured
    curve of its level first where the group is inside one node, else the cheapest
    algorithm the executors run."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if group.per_node == group.size:
        measured = profile.level_for_group(group.extent).measured_seconds(kind, group.size,
                                                                          nbytes)
        if measured is not None:
            return measured
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
                 overlap: float, bucket: float = 0.0,
                 once: float = 1.0, precision: Precision | None = None
                 ) -> tuple[float, float]:
    """Seconds of reading `info` in `dst` when stored in `src` (forward and backward moves,
    and `once` times the exposed part of a deferred weight-gradient sum of the gradient
    `precision` keeps, in buckets of `bucket` bytes), and the largest collective buffer
    the move needs."""
    found, deferred = edge_steps(info, src, dst, consumer, mesh, requires_grad, partial_axes,
                                 weight_derived)
    priced = [price(spec, mesh, profile) for spec in found]
    seconds = sum(c.time_s for c in priced)
    buffer = max([0.0, *(float(c.bytes) for c in priced)])
    if deferred:  # the plan files a derived weight's reduction with the last bucket
        seconds += once * exposed(reduction_seconds(
            profile, info.nbytes * fraction_of_layout(src, mesh), info.itemsize,
            tuple(sorted(deferred)), mesh, bucket, precision), overlap)[0]
    return seconds, buffer


def reduction_seconds(profile: HardwareProfile, weight_bytes: float, itemsize: int,
                      axes: tuple[str, ...], mesh: DeviceMesh, bucket: float,
                      precision: Precision | None) -> float:
    """Seconds of a weight's gradient all-reduce over `axes`, as the plan prices it
    (`planner.cost.oplevel.gradient_collectives`): the gradient the precision keeps
    (`synced_bytes`: under bf16-mixed fp32, twice a bf16 weight's `weight_bytes`), as its
    share of its bucket of `bucket` bytes."""
    moved = synced_bytes(CollectiveKind.ALL_REDUCE, weight_bytes, itemsize, precision)
    return bucketed_seconds(profile, CollectiveKind.ALL_REDUCE, moved, axes, mesh, bucket)


def synced_bytes(kind: CollectiveKind, weight_bytes: float, itemsize: int,
                 precision: Precision | None) -> float:
    """Bytes one collective synchronising a weight of `weight_bytes` (elements of
    `itemsize` bytes) moves: a gather moves the weights as stored; a reduction (all-reduce,
    reduce-scatter, the sum between two stages holding a tied weight) moves the gradient
    the precision keeps (`PrecisionPolicy.gradient_bytes`: under bf16-mixed fp32, as
    Megatron-LM reduces it for bf16, NeMo's `grad_reduce_in_fp32` and FSDP's fp32
    `reduce_dtype` do; under fp16-mixed the 16-bit gradient, as Megatron-LM's fp16 runs).
    A float64 weight, which no precision describes, reduces a gradient as wide as itself."""
    if kind == CollectiveKind.ALL_GATHER or itemsize > 4:
        return weight_bytes
    return weight_bytes * resolve(precision, itemsize).gradient_bytes / itemsize


def optimizer_seconds(profile: HardwareProfile, elements: float, itemsize: int,
                      optimizer: str, precision: Precision | None,
                      fusion: Fusion | None) -> float:
    """The optimizer step of `elements` local parameter elements (weights of `itemsize`
    bytes, trained in `precision`; None: their default) streams weights, gradients and
    states (`costmodels.precision.optimizer_step_bytes`): one memory-bound pass where
    kernels are fused (`fusion`, None: the profile's), else the passes torch.optim's
    kernels make one after another. No per-kernel floor: a step's kernels each cover a
    whole weight."""
    bandwidth = profile.memory_bandwidth_Bps.value * profile.memory_efficiency.value
    fused = policy_for(profile, fusion=fusion).fusion.fuses
    return elements * optimizer_step_bytes(resolve(precision, itemsize), optimizer,
                                           fused) / bandwidth


def accumulation_seconds(profile: HardwareProfile, elements: float, itemsize: int,
                         precision: Precision | None, fusion: Fusion | None,
                         accumulation: GradAccumulation | None, micro_batches: int) -> float:
    """One step's accumulation of `elements` local gradient elements over its
    `micro_batches` (`costmodels.precision.accumulation_bytes`), memory-bound; nothing
    where the weight-gradient GEMMs accumulate (`accumulation_for`). Paid per step with
    the optimizer pass: it is what readies the gradient that pass reads."""
    if accumulation_for(profile, fusion, accumulation) is GradAccumulation.FUSED:
        return 0.0
    bandwidth = profile.memory_bandwidth_Bps.value * profile.memory_efficiency.value
    return elements * accumulation_bytes(resolve(precision, itemsize), micro_batches) \
        / bandwidth
