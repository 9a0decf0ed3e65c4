"""An op-level plan's prices added up per unit: what each layer costs one device.

A *unit* is a run of consecutive ops a stage boundary may not cut (`planner.layers`). A
`UnitProfile` holds what one micro-batch costs per unit on one device under an op-level
choice: forward and backward compute and collectives, the activations kept under each
recompute mode, the weights each unit reads and how their gradients are reduced, and the
tensors crossing unit boundaries. The pipeline price (`planner.cost.pipeline`) sums it
over any partition into stages.

Recompute modes (Korthikanti et al. 2022, "Reducing Activation Recomputation"):
"none" keeps every activation autograd saves (`planner.cost.kernels`); "selective" drops
what the attention cores keep (the s² scores, probabilities and dropout masks) and re-runs
the cores in the backward pass (§4.2: the same as Megatron-LM's selective recompute; a
model without attention cores has nothing to drop); "full" keeps only what leaves each
unit, in the layout its producer wrote it, and re-runs the unit's forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from costmodels.communication import ring_overlap_exposed_s
from planner.cost.oplevel import PricedGraph
from planner.cost.pricing import saved_bytes, weight_gradient_seconds
from planner.kinds import AxisRole, CollectiveKind, Phase, Recompute
from planner.layers import Units
from planner.sharding.derive import fraction_of_layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.pipeline import unit_crossings
from planner.sharding.sends import SendSplit, send_split
from planner.sharding.weights import synced_axes


@dataclass(frozen=True)
class ParamShare:
    """One parameter as a device holds it: local size and how its gradient is reduced."""

    name: str
    bytes: float
    elements: float
    itemsize: int
    axes: tuple[str, ...]  # mesh axes its gradient is summed (and ZeRO shards it) over
    units: tuple[int, ...]  # units whose ops read it

    def synced_axes(self, mesh: DeviceMesh) -> tuple[str, ...]:
        """The axes of `axes` this mesh has more than one device on: the group its
        gradient synchronisation really runs over (empty: nothing to synchronise)."""
        return synced_axes(self.axes, mesh)


@dataclass(frozen=True)
class Crossing:
    """An activation read by later units than the one producing it (sent between stages)."""

    tensor: str
    bytes: float  # local to one device
    producer: int  # unit
    consumers: tuple[int, ...]  # units, ascending
    grad: bool  # a gradient flows back
    split: SendSplit | None = None  # how its layout lets a send scatter it


@dataclass(frozen=True)
class UnitProfile:
    units: Units
    forward_compute: np.ndarray  # seconds per micro-batch
    backward_compute: np.ndarray
    forward_communication: np.ndarray  # the op-level collectives of the forward pass
    backward_communication: np.ndarray
    selective_extra: np.ndarray  # seconds re-run by selective recompute
    saved: dict[Recompute, np.ndarray]  # recompute mode -> bytes kept per micro-batch
    transient: dict[Recompute, np.ndarray]  # bytes rebuilt while the unit's backward runs
    workspace: np.ndarray  # largest output or collective buffer
    params: tuple[ParamShare, ...]
    crossings: tuple[Crossing, ...]
    #: of `backward_compute`, the seconds of the weights' gradients (W, run apart by the
    #: zero-bubble schedules; `planner.cost.pricing.weight_gradient_seconds`)
    weight_compute: np.ndarray

    @property
    def count(self) -> int:
        return self.units.count

    @property
    def forward(self) -> np.ndarray:
        """Seconds per micro-batch of each unit's forward pass, collectives included."""
        return self.forward_compute + self.forward_communication

    @property
    def backward(self) -> np.ndarray:
        return self.backward_compute + self.backward_communication

    def with_gradient_axes(self, axes: Sequence[str]) -> UnitProfile:
        """The same units where every weight's gradient is also summed over `axes` (the
        data-parallel axis of a profile priced on a model-parallel group alone)."""
        if not axes:
            return self
        return replace(self, params=tuple(replace(p, axes=(*axes, *p.axes))
                                          for p in self.params))


def unit_profile(priced: PricedGraph, units: Units) -> UnitProfile:
    """Per-unit prices of one op-level choice."""
    sharded = priced.sharded
    analysis = sharded.analysis
    graph = analysis.graph
    count = units.count
    unit_of = units.unit_of_ops()
    index_of = {node.name: k for k, node in enumerate(graph.ops)}
    forward, backward, weight = np.zeros(count), np.zeros(count), np.zeros(count)
    forward_comm, backward_comm = np.zeros(count), np.zeros(count)
    selective = np.zeros(count)
    saved_all, dropped = np.zeros(count), np.zeros(count)
    workspace = np.zeros(count)
    core_ops = priced.kernels.core_ops
    recomputed = priced.kernels.dropped_by_selective
    for k, (node, cost) in enumerate(zip(graph.ops, priced.costs, strict=True)):
        u = unit_of[k]
        forward[u] += cost.forward_s
        backward[u] += cost.backward_s
        weight[u] += weight_gradient_seconds(node, priced.kernels, cost)
        saved_all[u] += cost.saved_bytes
        workspace[u] = max(workspace[u], cost.output_bytes)
        if node.name in core_ops:
            selective[u] += cost.forward_s
        dropped[u] += saved_bytes(node, priced.kernels, graph.tensors,
                                  [sharded.layouts.get(o) if o else None
                                   for o in node.outputs], sharded.mesh, recomputed)
    exposed = _ring_exposure(priced)
    for collective in priced.collectives:
        op_index = index_of.get(collective.op)
        if op_index is None or collective.phase == Phase.GRADIENT:
            continue
        u = unit_of[op_index]
        ring = exposed.get((collective.op, collective.phase))
        seconds = collective.time_s * (1.0 if ring is None else ring[0])
        held = 1.0 if ring is None else ring[1]
        if collective.phase == Phase.FORWARD:
            forward_comm[u] += seconds
            if collective.op in core_ops:
                selective[u] += seconds
        else:
            backward_comm[u] += seconds
        workspace[u] = max(workspace[u], float(collective.bytes) * held)
    crossings, leaving = _crossings(priced, unit_of)
    keep_selective = saved_all - dropped
    saved = {Recompute.NONE: saved_all, Recompute.SELECTIVE: keep_selective,
             Recompute.FULL: np.minimum(saved_all, leaving)}
    transient = {Recompute.NONE: np.zeros(count),
                 Recompute.SELECTIVE: saved_all - saved[Recompute.SELECTIVE],
                 Recompute.FULL: saved_all - saved[Recompute.FULL]}
    return UnitProfile(units, forward, backward, forward_comm, backward_comm, selective, saved,
                       transient, workspace, _params(priced, unit_of), crossings, weight)


def _ring_exposure(priced: PricedGraph) -> dict[tuple[str, Phase], tuple[float, float]]:
    """Ring attention over the context axis: of the K/V blocks an attention core gathers
    over "cp" (all-gathers into its ops in the forward pass, the reduce-scatters of their
    gradients in the backward), the share of their time that shows and the share of the
    gathered buffer a rank holds at once (two blocks: the one it computes with and the
    one arriving), per (core op, phase). The core's compute on this device hides them
    step by step (`costmodels.communication.ring_overlap_exposed_s`); a core split by
    heads (Ulysses) gathers nothing over "cp" and pays its all-to-alls whole. A causal
    core is priced as the balanced split (each rank two mirrored blocks, "zig-zag":
    every ring step the same work), which is what its compute share already is."""
    sharded = priced.sharded
    mesh = sharded.mesh
    if AxisRole.CONTEXT not in mesh.axis_names:
        return {}
    steps = mesh.axis_size(AxisRole.CONTEXT) - 1
    ring = {Phase.FORWARD: CollectiveKind.ALL_GATHER,
            Phase.BACKWARD: CollectiveKind.REDUCE_SCATTER}
    graph = sharded.analysis.graph
    index_of = {node.name: k for k, node in enumerate(graph.ops)}
    found: dict[tuple[str, Phase], tuple[float, float]] = {}
    held = min(1.0, 2.0 / (steps + 1))
    for core in priced.kernels.cores:
        ops = (core.first, *core.between, core.last)
        costs = [priced.costs[index_of[op]] for op in ops]
        compute = {Phase.FORWARD: sum(c.forward_s for c in costs),
                   Phase.BACKWARD: sum(c.backward_s for c in costs)}
        for phase, kind in ring.items():
            passes = [c for c in priced.collectives if c.op in ops and c.phase == phase
                      and c.kind == kind and tuple(c.axes) == (str(AxisRole.CONTEXT),)]
            transfer = sum(c.time_s for c in passes)
            if transfer <= 0.0:
                continue
            share = ring_overlap_exposed_s(transfer, compute[phase], steps) / transfer
            for c in passes:
                found[(c.op, phase)] = (share, held)
    return found


def _crossings(priced: PricedGraph,
               unit_of: np.ndarray) -> tuple[tuple[Crossing, ...], np.ndarray]:
    """Activations consumed outside their producing unit, and the saved bytes leaving each
    unit (kept under every recompute mode: the next unit, or a recompute, needs them)."""
    sharded = priced.sharded
    graph = sharded.analysis.graph
    needs_grad = sharded.analysis.needs_grad
    ops = [(node.inputs, node.outputs) for node in graph.ops]
    leaving = np.zeros(int(unit_of.max()) + 1 if len(unit_of) else 0)
    result = []
    for crossing in unit_crossings(ops, [int(u) for u in unit_of]):
        name = crossing.tensor
        info = graph.tensors[name]
        local = info.nbytes * fraction_of_layout(sharded.layouts[name], sharded.mesh)
        grad = needs_grad.get(name, False)
        result.append(Crossing(name, local, crossing.producer, crossing.consumers, grad,
                               send_split(sharded.layouts[name], info.shape, sharded.mesh)))
        if grad:
            leaving[crossing.producer] += local
    return tuple(result), leaving


def _params(priced: PricedGraph, unit_of: np.ndarray) -> tuple[ParamShare, ...]:
    sharded = priced.sharded
    graph, mesh = sharded.analysis.graph, sharded.mesh
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(graph.ops):
        for name in node.inputs:
            if name and graph.tensors[name].kind == "parameter":
                readers.setdefault(name, set()).add(int(unit_of[k]))
    result = []
    for name in sorted(readers):
        info = graph.tensors[name]
        share = fraction_of_layout(sharded.layouts[name], mesh)
        result.append(ParamShare(name, info.nbytes * share, info.numel * share, info.itemsize,
                                 sharded.gradient_axes.get(name, ()),
                                 tuple(sorted(readers[name]))))
    return tuple(result)
