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
from functools import lru_cache

import numpy as np

from costmodels.communication import ring_overlap_exposed_s
from planner.cost.oplevel import PricedGraph, op_index
from planner.cost.pricing import saved_bytes
from planner.kinds import AxisRole, CollectiveKind, Phase, Recompute
from planner.layers import Units
from planner.sharding.analysis import GraphAnalysis, backward_read_weights
from planner.sharding.derive import LOSS_OP, fraction_of_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.pipeline import UnitCrossing, unit_crossings
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
    #: the backward pass reads it (`planner.sharding.analysis.backward_read_weights`): ZeRO 3
    #: gathers it again before the backward pass, else only where recompute re-reads it
    backward_read: bool = True

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
    #: of `forward_communication`, the loss's read of the outputs (`LOSS_OP`): after the
    #: forward pass, which a recompute does not re-run
    loss_read: np.ndarray

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

    def with_rows(self, factor: float, held: float | None = None) -> UnitProfile:
        """The same units on a device whose micro-batch holds `factor` times the rows it
        was priced at (a data-parallel replica's uneven share of the batch): what runs per
        micro-batch (compute, the op-level collectives of activations, the sends) scales
        with the rows, the weights and their gradients' reductions do not. What is saved
        scales by `held` instead where given (a stage holding its largest replica's
        activations while it runs at its slowest one's pace). Linear: a GEMM's efficiency
        at the other row count is not priced again."""
        kept = factor if held is None else held
        if factor == 1.0 and kept == 1.0:
            return self
        return replace(
            self, forward_compute=self.forward_compute * factor,
            backward_compute=self.backward_compute * factor,
            forward_communication=self.forward_communication * factor,
            backward_communication=self.backward_communication * factor,
            selective_extra=self.selective_extra * factor,
            saved={mode: saved * kept for mode, saved in self.saved.items()},
            transient={mode: rebuilt * kept for mode, rebuilt in self.transient.items()},
            workspace=self.workspace * kept,
            crossings=tuple(replace(c, bytes=c.bytes * factor) for c in self.crossings),
            weight_compute=self.weight_compute * factor, loss_read=self.loss_read * factor)


def unit_profile(priced: PricedGraph, units: Units) -> UnitProfile:
    """Per-unit prices of one op-level choice.

    Each unit's figures are added up in op order, as floats, exactly as the per-op costs
    say; what depends on the graph and the units alone (which ops read which weight, the
    tensors crossing units) is found once per graph (`GraphAnalysis.memo`), not once per
    choice priced; the profile itself once per choice and units (`PricedGraph.profiles`)."""
    found = priced.profiles.get(units)
    if found is None:
        found = priced.profiles[units] = _unit_profile(priced, units)
    return found


def _unit_profile(priced: PricedGraph, units: Units) -> UnitProfile:
    sharded = priced.sharded
    analysis = sharded.analysis
    graph = analysis.graph
    count = units.count
    unit_of = _unit_list(analysis, units)
    index_of = op_index(analysis)
    forward, backward, weight = [0.0] * count, [0.0] * count, [0.0] * count
    selective = [0.0] * count
    saved_all, dropped = [0.0] * count, [0.0] * count
    workspace = [0.0] * count
    kernels = priced.kernels
    core_ops = kernels.core_ops
    recomputed = kernels.dropped_by_selective
    kernel_of = kernels.ops
    for k, (node, cost) in enumerate(zip(graph.ops, priced.costs, strict=True)):
        u = unit_of[k]
        forward_s, backward_s = cost.forward_s, cost.backward_s
        forward[u] += forward_s
        backward[u] += backward_s
        if not backward_s <= 0.0:  # `weight_gradient_seconds` inlined: it runs per op
            weight[u] += min(backward_s, kernel_of[node.name].weight_ratio * forward_s)
        saved_all[u] += cost.saved_bytes
        if cost.output_bytes > workspace[u]:
            workspace[u] = cost.output_bytes
        if core_ops and node.name in core_ops:
            selective[u] += forward_s
        if recomputed and not recomputed.isdisjoint(node.outputs):
            dropped[u] += saved_bytes(node, kernels, graph.tensors,
                                      [sharded.layouts.get(o) if o else None
                                       for o in node.outputs], sharded.mesh, recomputed)
    forward_comm, backward_comm = [0.0] * count, [0.0] * count
    loss_read = [0.0] * count
    exposed = _ring_exposure(priced)
    for collective in priced.collectives:
        # the loss's read of an output counts on the unit writing it, and is not re-run
        read = collective.op == LOSS_OP
        op = graph.tensors[collective.tensor].producer if read else collective.op
        op_index_ = index_of.get(op) if op is not None else None
        if op_index_ is None or collective.phase == Phase.GRADIENT:
            continue
        u = unit_of[op_index_]
        ring = exposed.get((collective.op, collective.phase))
        seconds = collective.time_s * (1.0 if ring is None else ring[0])
        held = 1.0 if ring is None else ring[1]
        if collective.phase == Phase.FORWARD:
            forward_comm[u] += seconds
            if read:
                loss_read[u] += seconds
            if collective.op in core_ops:
                selective[u] += seconds
        else:
            backward_comm[u] += seconds
        workspace[u] = max(workspace[u], float(collective.bytes) * held)
    crossings, leaving = _crossings(priced, units)
    saved_array = _floats(saved_all)
    keep_selective = saved_array - _floats(dropped)
    saved = {Recompute.NONE: saved_array, Recompute.SELECTIVE: keep_selective,
             Recompute.FULL: np.minimum(saved_array, leaving)}
    transient = {Recompute.NONE: np.zeros(count),
                 Recompute.SELECTIVE: saved_array - saved[Recompute.SELECTIVE],
                 Recompute.FULL: saved_array - saved[Recompute.FULL]}
    return UnitProfile(units, _floats(forward), _floats(backward), _floats(forward_comm),
                       _floats(backward_comm), _floats(selective), saved, transient,
                       _floats(workspace), _params(priced, units), crossings, _floats(weight),
                       _floats(loss_read))


def _floats(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=float)


def _unit_list(analysis: GraphAnalysis, units: Units) -> list[int]:
    """The unit of every op, as Python ints (found once per graph and units)."""
    key = ("unit of ops", units)
    found = analysis.memo.get(key)
    if found is None:
        found = analysis.memo[key] = units.unit_of_ops().tolist()
    return found


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
    index_of = op_index(sharded.analysis)
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
            share = ring_overlap_exposed_s(transfer, compute[phase], steps,
                                           priced.overlap_share) / transfer
            for c in passes:
                found[(c.op, phase)] = (share, held)
    return found


def _crossings(priced: PricedGraph,
               units: Units) -> tuple[tuple[Crossing, ...], np.ndarray]:
    """Activations consumed outside their producing unit, and the saved bytes leaving each
    unit (kept under every recompute mode: the next unit, or a recompute, needs them)."""
    sharded = priced.sharded
    analysis = sharded.analysis
    graph = analysis.graph
    needs_grad = analysis.needs_grad
    leaving = [0.0] * units.count
    result = []
    for crossing in _unit_crossings(analysis, units):
        name = crossing.tensor
        info = graph.tensors[name]
        layout = sharded.layout(name)
        local = info.nbytes * fraction_of_layout(layout, sharded.mesh)
        grad = needs_grad.get(name, False)
        result.append(Crossing(name, local, crossing.producer, crossing.consumers, grad,
                               _send_split(layout, info.shape, sharded.mesh)))
        if grad:
            leaving[crossing.producer] += local
    return tuple(result), _floats(leaving)


def _unit_crossings(analysis: GraphAnalysis, units: Units) -> tuple[UnitCrossing, ...]:
    """`unit_crossings` of the graph's ops: the same for every choice, found once."""
    key = ("unit crossings", units)
    found = analysis.memo.get(key)
    if found is None:
        ops = [(node.inputs, node.outputs) for node in analysis.graph.ops]
        found = analysis.memo[key] = unit_crossings(ops, _unit_list(analysis, units))
    return found


@lru_cache(maxsize=1 << 12)
def _send_split(layout: Layout, shape: tuple[int, ...], mesh: DeviceMesh) -> SendSplit | None:
    """`send_split`, once per layout, shape and mesh (every layer's crossing asks alike)."""
    return send_split(layout, shape, mesh)


def _params(priced: PricedGraph, units: Units) -> tuple[ParamShare, ...]:
    sharded = priced.sharded
    analysis = sharded.analysis
    graph, mesh = analysis.graph, sharded.mesh
    read = backward_read_weights(analysis)
    result = []
    for name, readers in _param_readers(analysis, units):
        info = graph.tensors[name]
        share = fraction_of_layout(sharded.layout(name), mesh)
        result.append(ParamShare(name, info.nbytes * share, info.numel * share, info.itemsize,
                                 sharded.gradient_axes.get(name, ()), readers,
                                 name in read))
    return tuple(result)


def _param_readers(analysis: GraphAnalysis,
                   units: Units) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every parameter some op reads (by name) and the units reading it, ascending: the
    same for every choice, found once per graph and units."""
    key = ("parameter readers", units)
    found = analysis.memo.get(key)
    if found is None:
        graph = analysis.graph
        unit_of = _unit_list(analysis, units)
        readers: dict[str, set[int]] = {}
        for k, node in enumerate(graph.ops):
            for name in node.inputs:
                if name and graph.tensors[name].kind == "parameter":
                    readers.setdefault(name, set()).add(unit_of[k])
        found = analysis.memo[key] = tuple((name, tuple(sorted(readers[name])))
                                           for name in sorted(readers))
    return found
