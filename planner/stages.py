"""Pipeline stages: units of the op sequence, their prices, and the partition into stages.

A *unit* is a run of consecutive ops (in topological order) that a stage boundary may not
cut: the embedding prefix, each repeated layer, the head suffix (or, in a graph without
repeats, chunks of equal FLOPs). A `UnitProfile` holds what one micro-batch costs per
unit on one device under an op-level plan: forward and backward time (compute and the
op-level collectives), the activations kept under each recompute mode, the weights each
unit owns and how their gradients are reduced, and the tensors crossing unit boundaries.

`price_pipeline` adds a profile up for one partition (stages of units, a recompute mode
per stage) under a `PipelineConfig` (micro-batches, schedule, ZeRO stage): the plan and
the search use it alike. `partition` is the dynamic programme over unit boundaries, in the
style of Alpa's inter-op pass (Zheng et al., OSDI 2022): it minimises the bottleneck stage
load under the memory limit, choosing each stage's recompute mode, vectorised with numpy.

Recompute modes (Korthikanti et al. 2022, "Reducing Activation Recomputation"):
"none" keeps every activation; "selective" keeps the outputs of ops that read weights and
those leaving the unit, and re-runs the weight-free ops (attention core, activations,
norms' arithmetic) in the backward pass; "full" keeps only what leaves each unit and
re-runs the unit's forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from costmodels.memory import MemoryBreakdown, optimizer_state_bytes, training_memory
from costmodels.profile import HardwareProfile
from costmodels.schedule import in_flight, pipeline_time
from planner.graph import PlanningGraph
from planner.planfile import Plan
from planner.pricing import (
    collective_seconds,
    fraction_of_layout,
    optimizer_seconds,
    requires_grad_map,
)
from planner.search.layers import find_repeats
from planner.sharding.mesh import DeviceMesh

RECOMPUTE_MODES = ("none", "selective", "full")
PIPELINE_AXIS = "pp"
MAX_PLAIN_UNITS = 32  # a graph without repeated layers is cut into this many FLOP-equal units
# Repeats covering less of the graph than this are not its layers (a run of small ops, or
# layers whose ops an exporter emitted in a different order each time): cut by FLOPs.
MIN_LAYER_SHARE = 0.5


@dataclass(frozen=True)
class Units:
    """Unit k covers graph.ops[bounds[k]:bounds[k + 1]]."""

    bounds: tuple[int, ...]
    names: tuple[str, ...]
    layer_units: tuple[int, ...]  # indices of the repeated-layer units

    @property
    def count(self) -> int:
        return len(self.names)

    def unit_of_ops(self) -> np.ndarray:
        """Unit index of every op."""
        sizes = np.diff(np.asarray(self.bounds))
        return np.repeat(np.arange(self.count), sizes)


def find_units(graph: PlanningGraph) -> Units:
    """Prefix, one unit per repeated layer, suffix; FLOP-equal chunks when no repeated
    block covers at least half the graph."""
    n = len(graph.ops)
    repeats = find_repeats(graph)
    if repeats is not None and repeats.count >= 2 and repeats.covered >= MIN_LAYER_SHARE * n:
        bounds, names = [0], []
        if repeats.start > 0:
            bounds.append(repeats.start)
            names.append("prefix")
        first_layer = len(names)
        for layer in range(repeats.count):
            bounds.append(repeats.start + (layer + 1) * repeats.period)
            names.append(f"layer {layer}")
        layers = tuple(range(first_layer, first_layer + repeats.count))
        if bounds[-1] < n:
            bounds.append(n)
            names.append("suffix")
        return Units(tuple(bounds), tuple(names), layers)
    flops = np.array([max(node.flops, 1.0) for node in graph.ops])
    chunks = min(n, MAX_PLAIN_UNITS)
    edges = np.searchsorted(np.cumsum(flops), np.linspace(0, flops.sum(), chunks + 1)[1:-1])
    bounds = sorted({0, n, *(int(e) + 1 for e in edges if 0 < int(e) + 1 < n)})
    return Units(tuple(bounds), tuple(f"part {k}" for k in range(len(bounds) - 1)), ())


@dataclass(frozen=True)
class ParamShare:
    """One parameter as a device holds it: local size and how its gradient is reduced."""

    name: str
    bytes: float
    elements: float
    itemsize: int
    axes: tuple[str, ...]  # mesh axes its gradient is summed (and ZeRO shards it) over
    units: tuple[int, ...]  # units whose ops read it


@dataclass(frozen=True)
class Crossing:
    """An activation read by later units than the one producing it (sent between stages)."""

    tensor: str
    bytes: float  # local to one device
    producer: int  # unit
    consumers: tuple[int, ...]  # units, ascending
    grad: bool  # a gradient flows back


@dataclass
class UnitProfile:
    units: Units
    forward: np.ndarray  # seconds per micro-batch: compute + forward collectives
    backward: np.ndarray  # seconds: compute + backward collectives
    forward_communication: np.ndarray  # the op-level collectives' share of forward
    backward_communication: np.ndarray  # and of backward
    selective_extra: np.ndarray  # seconds re-run by selective recompute
    saved: dict[str, np.ndarray]  # recompute mode -> bytes kept per micro-batch
    transient: dict[str, np.ndarray]  # mode -> bytes rebuilt while the unit's backward runs
    workspace: np.ndarray  # largest output or collective buffer
    params: list[ParamShare]
    crossings: list[Crossing]

    @property
    def count(self) -> int:
        return self.units.count


def unit_profile(graph: PlanningGraph, plan: Plan, units: Units,
                 extra_axes: Sequence[str] = ()) -> UnitProfile:
    """Per-unit prices of an assembled op-level plan (`OpEntry.cost`, its collectives).

    `extra_axes` are mesh axes every weight gradient is also summed over (the data-parallel
    axis when `plan` is priced on a model-parallel group alone, as the search does).
    """
    count = units.count
    unit_of = units.unit_of_ops()
    index_of = {op.name: k for k, op in enumerate(plan.ops)}
    forward, backward = np.zeros(count), np.zeros(count)
    forward_comm, backward_comm = np.zeros(count), np.zeros(count)
    selective = np.zeros(count)
    saved_all, saved_weights = np.zeros(count), np.zeros(count)
    workspace = np.zeros(count)
    params_in = {p.name for p in graph.parameters}
    reads_weight = np.array([any(i in params_in for i in node.inputs if i)
                             for node in graph.ops])
    for k, (node, entry) in enumerate(zip(graph.ops, plan.ops, strict=True)):
        u = unit_of[k]
        cost = entry.cost
        forward[u] += cost.get("forward_s", 0.0)
        backward[u] += cost.get("backward_s", 0.0)
        saved_all[u] += cost.get("saved_bytes", 0.0)
        workspace[u] = max(workspace[u], cost.get("output_bytes", 0.0))
        if reads_weight[k]:
            saved_weights[u] += cost.get("saved_bytes", 0.0)
        elif not node.is_view:
            selective[u] += cost.get("forward_s", 0.0)
    for collective in plan.collectives:
        k = index_of.get(collective.op)
        if k is None or collective.phase == "gradient":
            continue
        u = unit_of[k]
        if collective.phase == "forward":
            forward[u] += collective.time_s
            forward_comm[u] += collective.time_s
            if not reads_weight[k]:
                selective[u] += collective.time_s
        else:
            backward[u] += collective.time_s
            backward_comm[u] += collective.time_s
        workspace[u] = max(workspace[u], float(collective.bytes))
    crossings, leaving = _crossings(graph, plan, unit_of)
    keep_full = leaving
    keep_selective = np.minimum(saved_all, saved_weights + leaving)
    saved = {"none": saved_all, "selective": keep_selective, "full": np.minimum(saved_all,
                                                                                 keep_full)}
    transient = {"none": np.zeros(count), "selective": saved_all - saved["selective"],
                 "full": saved_all - saved["full"]}
    return UnitProfile(units, forward, backward, forward_comm, backward_comm, selective, saved,
                       transient,
                       workspace, _params(graph, plan, unit_of, extra_axes), crossings)


def _crossings(graph: PlanningGraph, plan: Plan,
               unit_of: np.ndarray) -> tuple[list[Crossing], np.ndarray]:
    """Activations consumed outside their producing unit, and the saved bytes leaving each
    unit (kept under every recompute mode: the next unit, or a recompute, needs them)."""
    needs_grad = requires_grad_map(graph)
    producer_unit: dict[str, int] = {}
    consumers: dict[str, set[int]] = {}
    for k, node in enumerate(graph.ops):
        for name in node.outputs:
            if name:
                producer_unit[name] = int(unit_of[k])
        for name in node.inputs:
            if name and graph.tensors[name].producer is not None:
                consumers.setdefault(name, set()).add(int(unit_of[k]))
    leaving = np.zeros(int(unit_of.max()) + 1 if len(unit_of) else 0)
    result = []
    for name, units in consumers.items():
        source = producer_unit[name]
        later = sorted(u for u in units if u != source)
        if not later:
            continue
        info = graph.tensors[name]
        local = info.nbytes * fraction_of_layout(plan.tensors[name].layout, plan.mesh)
        grad = needs_grad.get(name, False)
        result.append(Crossing(name, local, source, tuple(later), grad))
        if grad:
            leaving[source] += local
    return result, leaving


def _params(graph: PlanningGraph, plan: Plan, unit_of: np.ndarray,
            extra_axes: Sequence[str]) -> list[ParamShare]:
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(graph.ops):
        for name in node.inputs:
            if name and graph.tensors[name].kind == "parameter":
                readers.setdefault(name, set()).add(int(unit_of[k]))
    reduce_axes: dict[str, set[str]] = {}
    for collective in plan.collectives:
        if collective.phase == "gradient":
            reduce_axes.setdefault(collective.tensor, set()).update(collective.axes)
    axis_order = plan.mesh.axis_names
    result = []
    for name in sorted(readers):
        info = graph.tensors[name]
        share = fraction_of_layout(plan.tensors[name].layout, plan.mesh)
        axes = reduce_axes.get(name, set()) | set(extra_axes)
        ordered = tuple(a for a in axis_order if a in axes) + tuple(
            sorted(a for a in axes if a not in axis_order))
        result.append(ParamShare(name, info.nbytes * share, info.numel * share, info.itemsize,
                                 ordered, tuple(sorted(readers[name]))))
    return result


@dataclass(frozen=True)
class PipelineConfig:
    pp: int = 1
    micro_batches: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per device (interleaved schedule)
    optimizer: str = "adam"
    overlap: float = 0.0


@dataclass
class StagePrice:
    """One pipeline device's share: its unit ranges, recompute mode, times and memory."""

    ranges: list[tuple[int, int]]  # [first unit, end unit) per chunk
    recompute: str
    forward_s: float  # per micro-batch, with the op-level collectives
    backward_s: float
    forward_communication_s: float  # the op-level collectives' share of forward_s
    backward_communication_s: float  # and of backward_s
    recompute_s: float
    p2p_s: float
    zero_s: float  # per micro-batch ZeRO-2/3 collectives
    sync_s: float  # once per step: gradient reduction (not hidden) and parameter gathers
    optimizer_s: float
    in_flight: float
    memory: MemoryBreakdown

    @property
    def per_micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.p2p_s + self.zero_s


@dataclass
class PipelinePrice:
    config: PipelineConfig
    stages: list[StagePrice]
    step_time_s: float
    pipeline_s: float

    @property
    def peak_memory(self) -> int:
        return max(s.memory.peak for s in self.stages)

    @property
    def busiest(self) -> StagePrice:
        return max(self.stages, key=lambda s: s.per_micro_batch_s)


class _Prices:
    """Collective times on one mesh (`collective_seconds` memoises them per profile)."""

    def __init__(self, hardware: HardwareProfile, mesh: DeviceMesh) -> None:
        self.hardware, self.mesh = hardware, mesh

    def __call__(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> float:
        return collective_seconds(self.hardware, kind, nbytes, axes, self.mesh)

    def p2p(self, nbytes: float) -> float:
        if PIPELINE_AXIS not in self.mesh.axis_names or nbytes <= 0:
            return 0.0
        return self("send_recv", nbytes, (PIPELINE_AXIS,))


WEIGHT_TERMS = ("bytes", "elements", "sbytes", "selements", "micro", "end", "opt", "largest")


class _WeightTables:
    """What the weights cost, summed per unit, under one configuration and mesh.

    Per weight: local bytes and elements, their ZeRO-sharded share, the per-micro-batch
    ZeRO collectives, the end-of-step reduction and the optimizer pass. A weight read by
    one unit is summed into that unit; one read by several (a tied embedding and head) is
    kept apart so that a stage holding it twice counts it once, and two stages holding it
    exchange its gradient.
    """

    def __init__(self, profile: UnitProfile, config: PipelineConfig, hardware: HardwareProfile,
                 mesh: DeviceMesh, prices: _Prices) -> None:
        n = profile.count
        self.own = {key: np.zeros(n) for key in WEIGHT_TERMS}
        self.shared: list[tuple[ParamShare, dict[str, float], float]] = []
        self.itemsize = profile.params[0].itemsize if profile.params else 4
        memo: dict[tuple, dict[str, float]] = {}  # the same weight in every layer
        for param in profile.params:
            key = (param.bytes, param.elements, param.itemsize, param.axes)
            values = memo.get(key)
            if values is None:
                values = memo[key] = self._terms(param, config, hardware, mesh, prices)
            if len(param.units) == 1:
                u = param.units[0]
                for key, value in values.items():
                    if key == "largest":
                        self.own[key][u] = max(self.own[key][u], value)
                    else:
                        self.own[key][u] += value
            else:
                self.shared.append((param, values, prices.p2p(param.bytes)))

    @staticmethod
    def _terms(param: ParamShare, config: PipelineConfig, hardware: HardwareProfile,
               mesh: DeviceMesh, prices: _Prices) -> dict[str, float]:
        axes = tuple(a for a in param.axes if a in mesh.axis_names and mesh.axis_size(a) > 1)
        shards = mesh.group_size(axes)
        micro = end = 0.0
        if axes:
            if config.zero == 0:
                end = prices("all_reduce", param.bytes, axes) * (1.0 - config.overlap)
            else:
                scatter = prices("reduce_scatter", param.bytes, axes)
                gather = prices("all_gather", param.bytes, axes)
                if config.zero == 1:
                    end = (scatter + gather) * (1.0 - config.overlap)
                elif config.zero == 2:
                    micro, end = scatter, gather * (1.0 - config.overlap)
                else:
                    micro = scatter + 2.0 * gather
        divide = shards if config.zero >= 1 else 1
        states = optimizer_state_bytes(param.elements, param.itemsize, config.optimizer)
        return {"bytes": param.bytes, "elements": param.elements,
                "sbytes": param.bytes / shards, "selements": param.elements / shards,
                "micro": micro, "end": end,
                "opt": optimizer_seconds(hardware, param.bytes / divide, states / divide),
                "largest": param.bytes}

    def over(self, chosen: np.ndarray) -> dict[str, float]:
        """Totals for the units marked in `chosen` (shared weights once)."""
        totals = {key: float(values[chosen].sum()) for key, values in self.own.items()}
        totals["largest"] = float(self.own["largest"][chosen].max()) if chosen.any() else 0.0
        for param, values, _ in self.shared:
            if chosen[list(param.units)].any():
                for key, value in values.items():
                    if key == "largest":
                        totals[key] = max(totals[key], value)
                    else:
                        totals[key] += value
        return totals


def _received(profile: UnitProfile, ranges: Sequence[tuple[int, int]],
              prices: _Prices) -> tuple[float, float]:
    """(bytes kept, seconds) of a device's inputs from earlier units: received in the
    forward pass, their gradients sent back in the backward pass."""
    kept = seconds = 0.0
    for a, b in ranges:
        for crossing in profile.crossings:
            if crossing.producer < a and any(a <= u < b for u in crossing.consumers):
                kept += crossing.bytes
                seconds += prices.p2p(crossing.bytes) * (2.0 if crossing.grad else 1.0)
    return kept, seconds


class Pricer:
    """Prices devices of a pipeline (one configuration on one mesh)."""

    def __init__(self, profile: UnitProfile, config: PipelineConfig, hardware: HardwareProfile,
                 mesh: DeviceMesh) -> None:
        self.profile, self.config, self.hardware, self.mesh = profile, config, hardware, mesh
        self.prices = _Prices(hardware, mesh)
        self.weights = _WeightTables(profile, config, hardware, mesh, self.prices)

    @cached_property
    def tables(self) -> _StageTables:
        """Every contiguous range's prices, for the partition DP (built on first use)."""
        return _StageTables(self)

    def device(self, index: int, devices: Sequence[Sequence[tuple[int, int]]],
               mode: str) -> StagePrice:
        profile, config = self.profile, self.config
        ranges = devices[index]
        chosen = np.zeros(profile.count, dtype=bool)
        for a, b in ranges:
            chosen[a:b] = True
        forward = float(profile.forward[chosen].sum())
        backward = float(profile.backward[chosen].sum())
        forward_comm = float(profile.forward_communication[chosen].sum())
        backward_comm = float(profile.backward_communication[chosen].sum())
        extra = {"none": 0.0, "selective": float(profile.selective_extra[chosen].sum()),
                 "full": forward}[mode]
        kept, p2p = _received(profile, ranges, self.prices)
        weights = self.weights.over(chosen)
        end = weights["end"]
        for param, _, exchange in self.weights.shared:
            mine = chosen[list(param.units)].any()
            if mine and any(any(a <= u < b for a, b in other for u in param.units)
                            for k, other in enumerate(devices) if k != index):
                end += exchange
        flight = in_flight(index, len(devices), config.micro_batches, config.schedule,
                           config.virtual_stages)
        any_unit = bool(chosen.any())
        workspace = float(profile.workspace[chosen].max()) if any_unit else 0.0
        if config.zero >= 3:
            workspace = max(workspace, weights["largest"])
        transient = float(profile.transient[mode][chosen].max()) if any_unit else 0.0
        memory = training_memory(
            parameter_bytes=weights["bytes"], parameter_elements=weights["elements"],
            parameter_itemsize=self.weights.itemsize,
            activation_bytes=flight * (float(profile.saved[mode][chosen].sum()) + kept)
            + transient,
            workspace_bytes=workspace, optimizer=config.optimizer, zero=config.zero,
            sharded_bytes=weights["sbytes"], sharded_elements=weights["selements"],
        )
        return StagePrice(list(ranges), mode, forward, backward, forward_comm, backward_comm,
                          extra, p2p,
                          weights["micro"], end, weights["opt"], flight, memory)

    def price(self, devices: Sequence[Sequence[tuple[int, int]]],
              recompute: Sequence[str]) -> PipelinePrice:
        stages = [self.device(d, devices, mode) for d, mode in enumerate(recompute)]
        return combine(stages, self.config)


def combine(stages: list[StagePrice], config: PipelineConfig) -> PipelinePrice:
    """The step: the pipeline's time for every micro-batch, then (on every device at once)
    the end-of-step gradient reduction and optimizer pass."""
    pipeline = pipeline_time([s.per_micro_batch_s for s in stages], config.micro_batches,
                             config.schedule, config.virtual_stages)
    tail = max(s.sync_s + s.optimizer_s for s in stages)
    return PipelinePrice(config, stages, pipeline + tail, pipeline)


def price_pipeline(profile: UnitProfile, devices: Sequence[Sequence[tuple[int, int]]],
                   recompute: Sequence[str], config: PipelineConfig, hardware: HardwareProfile,
                   mesh: DeviceMesh) -> PipelinePrice:
    """Step time and per-device memory of `devices[d]` (unit ranges) with recompute modes."""
    return Pricer(profile, config, hardware, mesh).price(devices, recompute)


def contiguous(bounds: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Stages of consecutive units from cut points [0, c1, ..., units]."""
    return [[(bounds[k], bounds[k + 1])] for k in range(len(bounds) - 1)]


def interleaved(units: Units, pp: int, chunks: int) -> list[list[tuple[int, int]]] | None:
    """Megatron's interleaved assignment: the layers in pp·chunks equal chunks, chunk c on
    device c mod pp; the prefix joins the first chunk and the suffix the last. None when
    the layers do not divide evenly."""
    layers = units.layer_units
    pieces = pp * chunks
    if not layers or len(layers) % pieces:
        return None
    size = len(layers) // pieces
    starts = [layers[0] + k * size for k in range(pieces)] + [layers[-1] + 1]
    starts[0], starts[-1] = 0, units.count
    devices: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    for c in range(pieces):
        devices[c % pp].append((starts[c], starts[c + 1]))
    return devices


@dataclass
class Partition:
    devices: list[list[tuple[int, int]]]
    recompute: list[str]
    price: PipelinePrice


def partition(pricer: Pricer, limit: float,
              modes: Sequence[str] = RECOMPUTE_MODES) -> Partition | None:
    """The cheapest partition that fits `limit` bytes per device, or None.

    Interleaved schedules use the even chunking; otherwise a DP over cut points minimises
    the largest stage load m·t_s + e_s (its time through the pipeline), choosing each
    stage's recompute mode, and the result is priced exactly by `pricer`. One pricer
    serves several calls (other limits or modes) without rebuilding its tables.
    """
    profile, config = pricer.profile, pricer.config
    if config.schedule == "interleaved":
        devices = interleaved(profile.units, config.pp, config.virtual_stages)
        if devices is None:
            return None
        return _best_modes(pricer, devices, limit, modes)
    if config.pp > profile.count:
        return None
    found = pricer.tables.solve(limit, modes)
    if found is None:
        return None
    cuts, chosen = found
    devices = contiguous(cuts)
    return Partition(devices, list(chosen), pricer.price(devices, chosen))


def _best_modes(pricer: Pricer, devices: list[list[tuple[int, int]]], limit: float,
                modes: Sequence[str]) -> Partition | None:
    """Per device, the fastest recompute mode that fits (devices are priced apart)."""
    stages = []
    for d in range(len(devices)):
        fitting = [stage for stage in (pricer.device(d, devices, mode) for mode in modes)
                   if stage.memory.peak <= limit]
        if not fitting:
            return None
        stages.append(min(fitting, key=lambda s: s.per_micro_batch_s))
    return Partition(devices, [s.recompute for s in stages], combine(stages, pricer.config))


class _StageTables:
    """Every contiguous range's time and memory as (units+1)² matrices, for the DP."""

    def __init__(self, pricer: Pricer) -> None:
        profile, config = pricer.profile, pricer.config
        self.config = config
        n = profile.count
        self.n = n

        def span(values: np.ndarray) -> np.ndarray:  # [j, i]: sum of values[j:i]
            prefix = np.concatenate(([0.0], np.cumsum(values)))
            return prefix[None, :] - prefix[:, None]

        def running_max(values: np.ndarray) -> np.ndarray:
            table = np.zeros((n + 1, n + 1))
            for j in range(n):
                table[j, j + 1:] = np.maximum.accumulate(values[j:])
            return table

        base = span(profile.forward + profile.backward)
        self.time = {"none": base, "selective": base + span(profile.selective_extra),
                     "full": base + span(profile.forward)}
        self.saved = {mode: span(profile.saved[mode]) for mode in RECOMPUTE_MODES}
        self.transient = {mode: running_max(profile.transient[mode]) for mode in RECOMPUTE_MODES}
        # A crossing enters range [j, i) when produced before j and read by a unit in it.
        received = np.zeros((n + 1, n + 1))
        p2p = np.zeros((n + 1, n + 1))
        for crossing in profile.crossings:
            seconds = pricer.prices.p2p(crossing.bytes) * (2.0 if crossing.grad else 1.0)
            for j in range(crossing.producer + 1, crossing.consumers[-1] + 1):
                first = next(u for u in crossing.consumers if u >= j)
                received[j, first + 1:] += crossing.bytes
                p2p[j, first + 1:] += seconds
        self.received, self.p2p = received, p2p
        weights = pricer.weights
        totals = {key: span(values) for key, values in weights.own.items() if key != "largest"}
        largest = running_max(weights.own["largest"])
        for param, values, exchange in weights.shared:
            inside = np.zeros((n + 1, n + 1), dtype=bool)
            for u in param.units:
                inside[: u + 1, u + 1:] = True
            for key, value in values.items():
                if key == "largest":
                    largest = np.where(inside, np.maximum(largest, value), largest)
                else:
                    totals[key] += inside * value
            # Held by more than one stage: the holders exchange its gradient at the end.
            holds_all = np.zeros((n + 1, n + 1), dtype=bool)
            holds_all[: param.units[0] + 1, param.units[-1] + 1:] = True
            totals["end"] += (inside & ~holds_all) * exchange
        self.totals = totals
        workspace = running_max(profile.workspace)
        self.workspace = np.maximum(workspace, largest) if config.zero >= 3 else workspace
        self.itemsize = weights.itemsize

    def memory(self, mode: str, stage: int) -> np.ndarray:
        config, t = self.config, self.totals
        flight = in_flight(stage, config.pp, config.micro_batches, config.schedule,
                           config.virtual_stages)
        memory = training_memory(
            parameter_bytes=t["bytes"], parameter_elements=t["elements"],
            parameter_itemsize=self.itemsize,
            activation_bytes=flight * (self.saved[mode] + self.received)
            + self.transient[mode], workspace_bytes=self.workspace,
            optimizer=config.optimizer, zero=config.zero, sharded_bytes=t["sbytes"],
            sharded_elements=t["selements"], rounded=False)
        return memory.peak

    def solve(self, limit: float, modes: Sequence[str]) -> tuple[list[int], list[str]] | None:
        config, n = self.config, self.n
        m = config.micro_batches
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        back: list[tuple[np.ndarray, np.ndarray]] = []
        for stage in range(config.pp):
            load = np.full((n + 1, n + 1), np.inf)
            mode_of = np.zeros((n + 1, n + 1), dtype=np.int64)
            for index, mode in enumerate(RECOMPUTE_MODES):
                if mode not in modes:
                    continue
                per_micro = self.time[mode] + self.p2p + self.totals["micro"]
                cost = m * per_micro + self.totals["end"] + self.totals["opt"]
                fits = valid & (self.memory(mode, stage) <= limit)
                better = fits & (cost < load)
                load = np.where(better, cost, load)
                mode_of = np.where(better, index, mode_of)
            through = np.maximum(best[:, None], load)
            choice = np.argmin(through, axis=0)
            best = through[choice, np.arange(n + 1)]
            back.append((choice, mode_of[choice, np.arange(n + 1)]))
        if not np.isfinite(best[n]):
            return None
        cuts, chosen = [n], []
        end = n
        for choice, mode_index in reversed(back):
            start = int(choice[end])
            chosen.append(RECOMPUTE_MODES[int(mode_index[end])])
            cuts.append(start)
            end = start
        return cuts[::-1], chosen[::-1]


def op_ranges(units: Units, devices: Sequence[Sequence[tuple[int, int]]]) -> list[list[list[int]]]:
    """Unit ranges as op index ranges [first op, end op)."""
    return [[[units.bounds[a], units.bounds[b]] for a, b in ranges] for ranges in devices]


def recompute_segments(graph: PlanningGraph, units: Units, ranges: Sequence[tuple[int, int]],
                       mode: str) -> list[list[int]]:
    """Op index ranges the executor runs under activation checkpointing: each unit (full),
    or each maximal run of weight-free ops inside a unit (selective)."""
    if mode == "none":
        return []
    params = {p.name for p in graph.parameters}
    segments: list[list[int]] = []
    for a, b in ranges:
        for u in range(a, b):
            first, end = units.bounds[u], units.bounds[u + 1]
            if mode == "full":
                segments.append([first, end])
                continue
            run_start = None
            for k in range(first, end + 1):
                free = k < end and not any(i in params for i in graph.ops[k].inputs if i)
                if free and run_start is None:
                    run_start = k
                elif not free and run_start is not None:
                    segments.append([run_start, k])
                    run_start = None
    return segments


def summary_mode(modes: Sequence[str]) -> str:
    """One word for the plan's `parallel.recompute`: the mode, or "per-stage" when mixed."""
    distinct = set(modes)
    return modes[0] if len(distinct) == 1 else "per-stage"


def stage_table(price: PipelinePrice, units: Units) -> list[dict]:
    """The JSON rows of `pipeline.stages`."""
    rows = []
    for index, stage in enumerate(price.stages):
        rows.append({
            "device_stage": index,
            "units": [[units.names[a], units.names[b - 1]] for a, b in stage.ranges],
            "recompute": stage.recompute,
            "forward_s": stage.forward_s, "backward_s": stage.backward_s,
            "recompute_s": stage.recompute_s, "p2p_s": stage.p2p_s, "zero_s": stage.zero_s,
            "gradient_sync_s": stage.sync_s, "optimizer_s": stage.optimizer_s,
            "in_flight": stage.in_flight, "memory": stage.memory.to_json(),
        })
    return rows
