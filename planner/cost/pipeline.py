"""The price of a pipeline: each device stage's time and memory, from a unit profile.

`Pricer` prices the devices of one configuration (stages, micro-batches, schedule, ZeRO)
on one mesh: per device its units' compute and collectives, the recompute its mode
re-runs, the point-to-point transfers it receives and sends back, the weights it holds
with their synchronisation (`planner.sharding.weights`), and its memory with the
activations of the micro-batches in flight (`costmodels.schedule.in_flight`). The step
follows from the one step model (`planner.cost.step`). The partition search
(`planner.search.stages`) asks it for every contiguous range at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar

import numpy as np

from costmodels.cluster import Placement
from costmodels.communication import CommGroup, level_send_seconds
from costmodels.memory import training_memory
from costmodels.profile import HardwareProfile, LinkLevel
from costmodels.schedule import in_flight
from planner.cost.buckets import (
    backward_prefetch_exposed,
    bucket_bytes,
    bucketed_seconds,
    prefetch_exposed,
    schedule_overlap,
)
from planner.cost.oplevel import mesh_on
from planner.cost.pricing import (
    accumulation_seconds,
    collective_seconds,
    exposed,
    group_seconds,
    optimizer_seconds,
    synced_bytes,
)
from planner.cost.step import PipelineConfig, StagePrice, StepPrice, step_price
from planner.cost.units import ParamShare, UnitProfile
from planner.kinds import AxisRole, CollectiveKind, Phase, Recompute
from planner.sharding.mesh import DeviceMesh
from planner.sharding.sends import SendSplit
from planner.sharding.submeshes import stage_blocks
from planner.sharding.weights import sync_steps

PIPELINE_AXIS: str = AxisRole.PIPELINE
#: what tells per-stage meshes' shapes apart (a (dp, tp) pair)
ShapeKey = TypeVar("ShapeKey", bound=Hashable)


class Prices:
    """Collective times on one mesh (`collective_seconds` memoises them per profile).

    `link`: the link the sends between stages cross instead of the mesh's own (a mixed
    cluster's link between device groups, `costmodels.cluster`); None: the mesh's.
    `resharded`: the activations arrive from a stage of another (dp, tp) shape
    (`ShapedPricer`): each rank receives its own local tensor whole, from whichever ranks
    of the sender hold its rows, never a slice to all-gather (the sender's slices are
    not the receiver's).
    `boundary`: where stages hold different device counts, the pair of ranks one send
    crosses between their blocks and the fan of the receiving stage's sends
    (`Boundary`); None: the mesh's pipeline axis."""

    def __init__(self, hardware: HardwareProfile, mesh: DeviceMesh,
                 bucket_mb: float = 0.0, link: LinkLevel | None = None,
                 resharded: bool = False, boundary: Boundary | None = None) -> None:
        self.hardware, self.mesh, self.link = hardware, mesh, link
        self.resharded = resharded
        self.boundary = boundary
        self.bucket = bucket_bytes(bucket_mb)  # weight collectives' bucket, bytes (0: none)
        self._sends: dict[tuple[float, SendSplit | None], Send] = {}  # layers repeat them

    def __call__(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> float:
        return collective_seconds(self.hardware, kind, nbytes, axes, self.mesh)

    def bucketed(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> float:
        """A weight collective's share of its bucket (`planner.cost.buckets`)."""
        return bucketed_seconds(self.hardware, kind, nbytes, axes, self.mesh, self.bucket)

    def p2p(self, nbytes: float) -> float:
        """One send between neighbouring stages (nothing without a pipeline axis)."""
        if PIPELINE_AXIS not in self.mesh.axis_names or nbytes <= 0:
            return 0.0
        if self.link is not None:
            return level_send_seconds(self.link, nbytes)
        if self.boundary is not None:
            return group_seconds(self.hardware, CollectiveKind.SEND_RECV,
                                 nbytes * self.boundary.fan, self.boundary.group)
        return self(CollectiveKind.SEND_RECV, nbytes, (PIPELINE_AXIS,))

    def send(self, nbytes: float, split: SendSplit | None) -> Send:
        """An activation of `nbytes` (local) between stages, one way: whole, or scattered
        by `split` (each rank sends 1/g, the receivers all-gather it) where that is
        faster (`planner.sharding.sends`)."""
        key = (nbytes, split)
        found = self._sends.get(key)
        if found is None:
            found = self._sends[key] = self._send(nbytes, split)
        return found

    def _send(self, nbytes: float, split: SendSplit | None) -> Send:
        whole = Send(None, nbytes, self.p2p(nbytes), 0.0)
        if (split is None or self.resharded or PIPELINE_AXIS not in self.mesh.axis_names
                or nbytes <= 0):
            return whole
        piece = nbytes / self.mesh.group_size(split.axes)
        scattered = Send(split, piece, self.p2p(piece),
                         self(CollectiveKind.ALL_GATHER, nbytes, split.axes))
        return scattered if scattered.seconds < whole.seconds else whole


@dataclass(frozen=True)
class Boundary:
    """How the sends into a stage cross when the stages hold different device counts
    (`planner.sharding.submeshes`): each of its ranks receives its own local tensor, from
    one rank of the sending block (`group`: where that pair sits); a sender with fewer
    ranks serves `fan` = receivers / senders of them in turn (the gradients go back the
    same way), so one send moves `fan` times the receiver's bytes."""

    group: CommGroup
    fan: float = 1.0


def send_group(sender: range, receiver: range, per_node: int) -> CommGroup:
    """Where one rank of `sender`'s block sends to one of `receiver`'s: a pair inside the
    innermost aligned block holding both blocks (a node's link level, `extent`), or across
    nodes (one member per node)."""
    low, high = min(sender.start, receiver.start), max(sender.stop, receiver.stop) - 1
    if low // per_node != high // per_node:
        nodes = high // per_node - low // per_node + 1
        return CommGroup(2, 1, nodes * per_node)
    extent = next(size for size in range(2, per_node + 1)
                  if per_node % size == 0 and low // size == high // size)
    return CommGroup(2, 2, extent)


def stage_boundaries(sizes: Sequence[int], per_node: int) -> list[Boundary | None]:
    """How the sends into each stage cross, for stages of `sizes` devices each: over the
    pipeline axis of their meshes where every stage holds as many (None), else from the
    block of the stage before (`stage_blocks`), a sender serving as many receivers in
    turn as the fewest ranks of any earlier stage make it (a skip connection from a
    smaller stage sends the same way)."""
    if len(set(sizes)) < 2:
        return [None] * len(sizes)
    blocks = stage_blocks(sizes, per_node)
    return [None, *(Boundary(send_group(blocks[k - 1], blocks[k], per_node),
                             max(1.0, sizes[k] / min(sizes[:k])))
                    for k in range(1, len(sizes)))]


@dataclass(frozen=True)
class Send:
    """How one activation crosses to the next stage, one way: the bytes each rank sends
    (all of its local tensor, or its slice under `split`), and the seconds of the send and
    of the receivers' all-gather."""

    split: SendSplit | None
    bytes: float
    p2p_s: float
    gather_s: float

    @property
    def seconds(self) -> float:
        return self.p2p_s + self.gather_s


@dataclass(frozen=True)
class WeightTerms:
    """What weights cost a device that holds them: of one weight (floats), or summed per
    unit or per range of units (numpy arrays, for the partition search)."""

    bytes: Any
    elements: Any
    sharded_bytes: Any  # the ZeRO shard over each weight's gradient group
    sharded_elements: Any
    micro: Any  # seconds per micro-batch (ZeRO-2/3 collectives), the three below summed
    micro_forward: Any  # of which before the forward pass (ZeRO-3 gathers)
    micro_gather: Any  # before the backward pass (ZeRO-3 gathers)
    micro_reduce: Any  # after the backward pass (ZeRO-2/3 reduce-scatters)
    end: Any  # seconds once per step, exposed (gradient reduction, parameter gathers)
    hidden: Any  # the part of the end-of-step synchronisation overlap hides
    optimizer: Any  # seconds of the optimizer pass and the gradient accumulation it reads
    largest: Any  # the largest single weight: the buffer ZeRO-3 gathers it into
    #: ZeRO-3 gathers before the backward pass of weights only recompute re-reads there
    #: (`ParamShare.backward_read` false: an embedding table): under full recompute only
    micro_regather: Any

    @classmethod
    def zeros(cls, *shape: int) -> WeightTerms:
        return cls(**{name: np.zeros(shape) for name in TERMS})

    def apply(self, fn: Callable[[str, Any], Any]) -> WeightTerms:
        """Each term through `fn(name, value)` (sums combine, `largest` takes a max)."""
        return WeightTerms(**{name: fn(name, getattr(self, name)) for name in TERMS})


TERMS = tuple(f.name for f in fields(WeightTerms))


def weight_terms(param: ParamShare, config: PipelineConfig, hardware: HardwareProfile,
                 mesh: DeviceMesh, prices: Prices) -> WeightTerms:
    """One weight under `config.zero`: its memory, shards, and the collectives of
    `planner.sharding.weights.sync_steps` over its gradient axes."""
    axes = param.synced_axes(mesh)
    shards = mesh.group_size(axes)
    forward = gather = regather = reduce = end = 0.0
    if axes:
        for step in sync_steps(config.zero):
            seconds = prices.bucketed(step.kind, synced_bytes(
                step.kind, param.bytes, param.itemsize, config.precision), axes)
            if step.phase == Phase.FORWARD:
                forward += seconds
            elif step.phase == Phase.BACKWARD and step.kind == CollectiveKind.ALL_GATHER:
                if param.backward_read:
                    gather += seconds
                else:
                    regather += seconds
            elif step.per_micro_batch:
                reduce += seconds
            else:
                end += seconds
    shown, hidden = exposed(end, config.overlap)
    divide = shards if config.zero >= 1 else 1
    kept = shards if config.zero >= 2 else 1  # ZeRO-2/3 keep the gradient's shard
    update = optimizer_seconds(hardware, param.elements / divide, param.itemsize,
                               config.optimizer, config.precision, config.fusion) \
        + accumulation_seconds(hardware, param.elements / kept, param.itemsize,
                               config.precision, config.fusion, config.accumulation,
                               config.micro_batches)
    return WeightTerms(param.bytes, param.elements, param.bytes / shards,
                       param.elements / shards, forward + gather + reduce, forward, gather,
                       reduce, shown, hidden, update, param.bytes, regather)


class SharedWeight(NamedTuple):
    """A weight read by several units: its terms, the price of exchanging its gradient
    between two holders, and its `readers` (its units, sorted: a constant every layer
    reads is read by thousands of units, so which a range holds is two bisections)."""

    param: ParamShare
    terms: WeightTerms
    exchange: float
    readers: np.ndarray

    def read_in(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether a unit of one of the unit ranges [a, b) reads it."""
        return any(np.searchsorted(self.readers, a) < np.searchsorted(self.readers, b)
                   for a, b in ranges)


class WeightTables:
    """What the weights cost, summed per unit, under one configuration and mesh.

    A weight read by one unit is summed into that unit (`own`); one read by several (a
    tied embedding and head) is kept apart (`shared`) so that a stage holding it twice
    counts it once, and two stages holding it exchange its gradient.
    """

    def __init__(self, profile: UnitProfile, config: PipelineConfig, hardware: HardwareProfile,
                 mesh: DeviceMesh, prices: Prices) -> None:
        self.shared: list[SharedWeight] = []
        self.itemsize = profile.params[0].itemsize if profile.params else 4
        memo: dict[tuple, tuple[WeightTerms, tuple[float, ...]]] = {}  # alike in every layer
        rows: list[tuple[float, ...]] = []
        units: list[int] = []
        for param in profile.params:
            key = (param.bytes, param.elements, param.itemsize, param.axes)
            found = memo.get(key)
            if found is None:
                terms = weight_terms(param, config, hardware, mesh, prices)
                found = memo[key] = (terms, tuple(getattr(terms, name) for name in TERMS))
            if len(param.units) == 1:
                rows.append(found[1])
                units.append(param.units[0])
            else:
                self.shared.append(SharedWeight(
                    param, found[0], prices.p2p(param.bytes),
                    np.unique(np.asarray(param.units, dtype=np.int64))))
        # Summed per unit in the weights' order (np.add.at adds one after the other).
        table = np.zeros((len(TERMS), profile.count))
        if rows:
            values, at = np.array(rows).T, np.array(units, dtype=np.int64)
            for k, name in enumerate(TERMS):
                (np.maximum if name == "largest" else np.add).at(table[k], at, values[k])
        self.own = WeightTerms(**{name: table[k] for k, name in enumerate(TERMS)})

    def over(self, chosen: np.ndarray) -> WeightTerms:
        """Totals for the units marked in `chosen` (shared weights once)."""
        any_unit = bool(chosen.any())
        totals = self.own.apply(lambda name, values: (
            float(values[chosen].max()) if any_unit else 0.0) if name == "largest"
            else float(values[chosen].sum()))
        for shared in self.shared:
            if chosen[shared.readers].any():

                def add(name: str, total: Any, terms: WeightTerms = shared.terms) -> Any:
                    return max(total, getattr(terms, name)) if name == "largest" \
                        else total + getattr(terms, name)

                totals = totals.apply(add)
        return totals


class Arrivals:
    """The activations a device receives from other devices, for any of its unit ranges:
    received in the forward pass, their gradients sent back in the backward pass.

    As the plan's sends list them (`planner.plans.build`): a tensor produced on the device
    itself is handed on locally; one with a gradient comes to every chunk (unit range)
    reading it, one without once per device. The crossings are held as arrays, so that
    pricing thousands of devices looks at the few that enter each.
    """

    def __init__(self, profile: UnitProfile, prices: Prices) -> None:
        crossings = profile.crossings
        self.count = len(crossings)
        self.bytes = [c.bytes for c in crossings]
        self.seconds = [prices.send(c.bytes, c.split).seconds * (2.0 if c.grad else 1.0)
                        for c in crossings]
        self.producer = np.array([c.producer for c in crossings], dtype=np.int64)
        self.grad = np.array([c.grad for c in crossings], dtype=bool)
        self.consumer = np.array([u for c in crossings for u in c.consumers], dtype=np.int64)
        self.owner = np.repeat(np.arange(self.count), [len(c.consumers) for c in crossings])

    def of(self, ranges: Sequence[tuple[int, int]]) -> tuple[float, float]:
        """(bytes kept, seconds) of the device holding unit `ranges`."""
        if not self.count:
            return 0.0, 0.0
        reading = np.zeros(self.count, dtype=np.int64)
        produced = np.zeros(self.count, dtype=bool)
        for a, b in ranges:
            inside = (self.consumer >= a) & (self.consumer < b)
            reading += np.bincount(self.owner[inside], minlength=self.count) > 0
            produced |= (self.producer >= a) & (self.producer < b)
        copies = np.where(self.grad, reading, np.minimum(reading, 1))
        copies[produced] = 0
        kept = seconds = 0.0
        for index in np.flatnonzero(copies):  # in crossing order, as they are received
            for _ in range(int(copies[index])):
                kept += self.bytes[index]
                seconds += self.seconds[index]
        return kept, seconds


@dataclass(frozen=True)
class _Held:
    """A device's figures that do not depend on its recompute mode (`Pricer._held`)."""

    chosen: np.ndarray  # its units
    forward_compute: float
    backward_compute: float
    weight: float
    forward_comm: float
    backward_comm: float
    kept: float  # bytes of activations received from other stages
    p2p: float
    weights: WeightTerms
    end: float
    hidden: float
    zero: float
    zero_recomputed: float  # `zero` under full recompute (`WeightTerms.micro_regather`)
    flight: float
    any_unit: bool
    workspace: float


class Pricer:
    """Prices devices of a pipeline (one configuration on one mesh); `link`, `resharded`
    and `boundary`: how the sends into the devices it prices arrive (`Prices`)."""

    def __init__(self, profile: UnitProfile, config: PipelineConfig, hardware: HardwareProfile,
                 mesh: DeviceMesh, link: LinkLevel | None = None,
                 resharded: bool = False, boundary: Boundary | None = None) -> None:
        self.profile, self.config, self.hardware, self.mesh = profile, config, hardware, mesh
        self.prices = Prices(hardware, mesh, config.bucket_mb, link, resharded, boundary)
        self.weights = WeightTables(profile, config, hardware, mesh, self.prices)
        self.arrivals = Arrivals(profile, self.prices)
        # A device's price depends on its own ranges, its place in the pipeline and which
        # shared weights another device also holds: partitions that differ elsewhere (the
        # interleaved search's uneven chunkings) reuse it.
        self._devices: dict[tuple, StagePrice] = {}
        self._helds: dict[tuple, _Held] = {}  # the mode-independent part of each

    def device(self, index: int, devices: Sequence[Sequence[tuple[int, int]]],
               mode: Recompute) -> StagePrice:
        ranges = devices[index]
        shared = tuple(any(weight.read_in(other)
                           for k, other in enumerate(devices) if k != index)
                       for weight in self.weights.shared)
        key = (index, len(devices), tuple(tuple(r) for r in ranges), mode, shared)
        found = self._devices.get(key)
        if found is None:
            found = self._devices[key] = self._device(index, len(devices), ranges, mode,
                                                      shared)
        return found

    def _device(self, index: int, count: int, ranges: Sequence[tuple[int, int]],
                mode: Recompute, shared: tuple[bool, ...]) -> StagePrice:
        """`device` priced: `shared[k]` says whether another device holds a unit of the
        k-th shared weight (then this one pays the exchange)."""
        profile, config = self.profile, self.config
        held = self._held(index, count, tuple((a, b) for a, b in ranges), shared)
        chosen, weights = held.chosen, held.weights
        zero = held.zero_recomputed if mode == Recompute.FULL else held.zero
        extra = {Recompute.NONE: 0.0,
                 Recompute.SELECTIVE: float(profile.selective_extra[chosen].sum()),
                 Recompute.FULL: held.forward_compute + held.forward_comm
                 - float(profile.loss_read[chosen].sum())}[mode]
        transient = float(profile.transient[mode][chosen].max()) if held.any_unit else 0.0
        memory = training_memory(
            parameter_bytes=weights.bytes, parameter_elements=weights.elements,
            parameter_itemsize=self.weights.itemsize,
            activation_bytes=held.flight * (float(profile.saved[mode][chosen].sum())
                                            + held.kept) + transient,
            workspace_bytes=held.workspace, optimizer=config.optimizer, zero=config.zero,
            sharded_bytes=weights.sharded_bytes, sharded_elements=weights.sharded_elements,
            precision=config.precision,
        )
        return StagePrice(tuple(ranges), mode, held.forward_compute, held.backward_compute,
                          held.forward_comm, held.backward_comm, extra, held.p2p, zero,
                          held.end, held.hidden,
                          weights.optimizer + self.hardware.step_host_seconds, held.flight,
                          memory,
                          self._chunks(ranges, mode, held.p2p + zero), held.weight)

    def _held(self, index: int, count: int, ranges: tuple[tuple[int, int], ...],
              shared: tuple[bool, ...]) -> _Held:
        """What a device's price is whatever its recompute mode (its units' compute and
        collectives, arrivals, weights and their synchronisation): worked out once for
        the modes the partition search tries on it."""
        key = (index, count, ranges, shared)
        found = self._helds.get(key)
        if found is not None:
            return found
        profile, config = self.profile, self.config
        chosen = np.zeros(profile.count, dtype=bool)
        for a, b in ranges:
            chosen[a:b] = True
        kept, p2p = self.arrivals.of(ranges)
        weights = self.weights.over(chosen)
        end, hidden, zero, zero_recomputed = self._overlap(chosen, weights)
        for weight, elsewhere in zip(self.weights.shared, shared, strict=True):
            if elsewhere and chosen[weight.readers].any():
                end += weight.exchange
        any_unit = bool(chosen.any())
        workspace = float(profile.workspace[chosen].max()) if any_unit else 0.0
        if config.zero >= 3:
            workspace = max(workspace, weights.largest)
        found = self._helds[key] = _Held(
            chosen, float(profile.forward_compute[chosen].sum()),
            float(profile.backward_compute[chosen].sum()),
            float(profile.weight_compute[chosen].sum()),
            float(profile.forward_communication[chosen].sum()),
            float(profile.backward_communication[chosen].sum()), kept, p2p, weights, end,
            hidden, zero, zero_recomputed,
            in_flight(index, count, config.micro_batches, config.schedule,
                      config.virtual_stages), any_unit, workspace)
        return found

    def _chunks(self, ranges: Sequence[tuple[int, int]], mode: Recompute,
                shared: float) -> tuple[tuple[float, float, float], ...]:
        """Each chunk's (forward, input backward, weight backward) seconds per
        micro-batch: its units' compute and collectives, the input backward with the
        backward collectives and what recompute re-runs (both come before the inputs'
        gradients), the weight backward its weights' gradients (`weight_compute`); and the
        device's sends and ZeRO collectives (`shared`) spread over its chunks by their
        share of that time."""
        profile = self.profile
        own = []
        for a, b in ranges:
            forward = float(profile.forward_compute[a:b].sum()
                            + profile.forward_communication[a:b].sum())
            weight = float(profile.weight_compute[a:b].sum())
            backward = float(profile.backward_compute[a:b].sum()
                             + profile.backward_communication[a:b].sum()) - weight
            backward += {Recompute.NONE: 0.0,
                         Recompute.SELECTIVE: float(profile.selective_extra[a:b].sum()),
                         Recompute.FULL: forward - float(profile.loss_read[a:b].sum())}[mode]
            own.append((forward, backward, weight))
        total = sum(sum(times) for times in own)
        if total <= 0.0:
            return tuple((shared / (2 * len(own)),) * 2 + (0.0,) for _ in own) if own else ()
        scale = 1.0 + shared / total
        return tuple((f * scale, b * scale, w * scale) for f, b, w in own)

    def _overlap(self, chosen: np.ndarray,
                 weights: WeightTerms) -> tuple[float, float, float, float]:
        """(exposed, hidden) seconds of the device's end-of-step synchronisation, and the
        exposed seconds per micro-batch of its ZeRO-2/3 collectives (without recompute,
        and under full recompute, which re-reads every weight), as the schedule hides
        them (`planner.cost.buckets`): the gradient reduction behind the last
        micro-batch's backward pass but for the last bucket (its first unit's weights);
        ZeRO-3 gathers prefetched one unit ahead, reduce-scatters behind the next unit."""
        profile, own = self.profile, self.weights.own
        share = self.hardware.overlap_share
        units = np.flatnonzero(chosen)
        if not len(units):
            return 0.0, 0.0, 0.0, 0.0
        columns = {name: getattr(own, name)[units].copy()
                   for name in ("micro_forward", "micro_gather", "micro_regather",
                                "micro_reduce", "end", "hidden")}
        for weight in self.weights.shared:
            held = weight.readers[chosen[weight.readers]]
            if len(held):  # counted once, at the device's first unit reading it
                first = int(np.searchsorted(units, held[0]))
                for name, column in columns.items():
                    column[first] += getattr(weight.terms, name)
        sync = columns["end"] + columns["hidden"]
        backward = profile.backward_compute[units]
        end, hidden = schedule_overlap(float(sync.sum()), float(sync[0]),
                                       float(backward.sum() - backward[0]),
                                       self.config.overlap,
                                       self.config.overlap_grad_reduce, share)
        ahead = prefetch_exposed(columns["micro_forward"], profile.forward_compute[units],
                                 share)
        zero = ahead + backward_prefetch_exposed(columns["micro_gather"],
                                                 columns["micro_reduce"], backward, share)
        recomputed = ahead + backward_prefetch_exposed(
            columns["micro_gather"] + columns["micro_regather"], columns["micro_reduce"],
            backward, share)
        return end, hidden, min(zero, weights.micro), min(
            recomputed, weights.micro + weights.micro_regather)

    def price(self, devices: Sequence[Sequence[tuple[int, int]]],
              recompute: Sequence[Recompute]) -> StepPrice:
        stages = [self.device(d, devices, mode) for d, mode in enumerate(recompute)]
        return step_price(stages, self.config)

    def stage_pricer(self, stage: int) -> Pricer:
        """The pricer of device stage `stage`: this one, every stage on one kind."""
        return self

    def limit_ratio(self, stage: int) -> float:
        """Stage `stage`'s memory limit over the pipeline's: 1, every device alike."""
        return 1.0


class _StagedPricer:
    """A pipeline priced stage by stage, each device stage by a `Pricer` of its own
    (`_stages`), the step from the one step model."""

    config: PipelineConfig
    _stages: list[Pricer]

    def stage_pricer(self, stage: int) -> Pricer:
        return self._stages[stage]

    def limit_ratio(self, stage: int) -> float:
        """Stage `stage`'s memory limit over the pipeline's."""
        return 1.0

    def device(self, index: int, devices: Sequence[Sequence[tuple[int, int]]],
               mode: Recompute) -> StagePrice:
        return self._stages[index].device(index, devices, mode)

    def price(self, devices: Sequence[Sequence[tuple[int, int]]],
              recompute: Sequence[Recompute]) -> StepPrice:
        stages = [self.device(d, devices, mode) for d, mode in enumerate(recompute)]
        return step_price(stages, self.config)


class PlacedPricer(_StagedPricer):
    """Prices a pipeline whose device stages run on different device kinds (a mixed
    cluster's `Placement`): each stage by the `Pricer` of its kind, with the unit profile
    its hardware prices (`profiles[group]`) and the sends into it over the link between
    groups where they cross it. A stage whose ranks span kinds runs at the slowest one's
    pace, within the smallest one's memory. Memory limits are relative: a stage's limit is
    the pipeline's times its kind's memory over the lead kind's (all 1 under a
    `--memory-limit`, which holds for every device).

    `rows`, when given, are the data-parallel replicas' shares of each micro-batch (one
    per replica of a stage, in mesh order; `balanced_rows`): a replica's work and
    activations scale with its rows (`UnitProfile.with_rows`), so a stage spanning kinds
    runs at the pace of its slowest replica as its rows make it, and holds the
    activations of its largest share."""

    def __init__(self, profiles: Sequence[UnitProfile], config: PipelineConfig,
                 placement: Placement, mesh: DeviceMesh, uniform_limit: bool,
                 rows: Sequence[int] = ()) -> None:
        cluster = placement.cluster
        self.placement, self.config, self.mesh = placement, config, mesh
        self.rows = tuple(rows)
        work = kind_seconds(profiles)
        lead = cluster.lead.memory_bytes
        self._pricers: dict[tuple, Pricer] = {}
        self._stages: list[Pricer] = []
        self._ratios: list[float] = []
        self.groups: list[int] = []  # the kind each stage is priced on
        #: per stage, the factor its time scales by (its slowest replica's rows over the
        #: even share) and its activations (its largest share's): 1 without `rows`
        self.scales: list[tuple[float, float]] = []
        for stage in range(config.pp):
            spanned = placement.stage_groups(stage)
            crosses = placement.crosses_into(stage)
            group, pace, held = placement.slowest(spanned, work), 1.0, 1.0
            if self.rows:
                group, pace, held = self._shares_pace(stage, work)
            key = (group, crosses, pace, held)
            if key not in self._pricers:
                kind = cluster.groups[group].profile
                self._pricers[key] = Pricer(profiles[group].with_rows(pace, held), config,
                                            kind, mesh_on(mesh, kind),
                                            cluster.link if crosses else None)
            self._stages.append(self._pricers[key])
            self.groups.append(group)
            self.scales.append((pace, held))
            self._ratios.append(1.0 if uniform_limit
                                else placement.memory_bytes(spanned) / lead)
        self.profile = self._stages[0].profile

    def _shares_pace(self, stage: int, work: Sequence[float]) -> tuple[int, float, float]:
        """Stage `stage` under `rows`: the kind its slowest replica runs on, that
        replica's rows over the even share (the factor its work scales by), and the
        largest share's factor (the activations the stage must hold)."""
        kinds = self.placement.replica_kinds(stage, len(self.rows), work)
        even = sum(self.rows) / len(self.rows)
        _, group, pace = max(((work[g] * rows / even, g, rows / even)
                              for g, rows in zip(kinds, self.rows, strict=True)),
                             key=lambda found: found[0])
        return group, pace, max(self.rows) / even

    def limit_ratio(self, stage: int) -> float:
        return self._ratios[stage]


def kind_seconds(profiles: Sequence[UnitProfile]) -> list[float]:
    """Each kind's seconds for one micro-batch's forward and backward passes of every
    unit (`profiles[g]` priced on kind g): what says which kind is slower."""
    return [float((p.forward + p.backward).sum()) for p in profiles]


class ShapedPricer(_StagedPricer):
    """Prices a pipeline whose device stages run on meshes of different (dp, tp) shapes
    (Alpa's inter-operator pass gives each stage its own submesh): stage k by the `Pricer`
    of its shape (`pricers[k]`, its unit profile solved and priced on that mesh). A stage
    that an earlier stage of another shape sends to receives its activations resharded
    (`Prices`): every rank receives, and sends back, its own local tensor's bytes; where
    the stages hold different device counts, from its predecessor's block
    (`stage_boundaries`)."""

    def __init__(self, pricers: Sequence[Pricer]) -> None:
        self._stages = list(pricers)
        first = self._stages[0]
        self.config, self.profile, self.mesh = first.config, first.profile, first.mesh

    @classmethod
    def of_shapes(cls, shapes: Sequence[ShapeKey],
                  pricer_of: Callable[[ShapeKey, bool, Boundary | None], Pricer],
                  wraps: bool = False,
                  boundaries: Sequence[Boundary | None] = ()) -> ShapedPricer:
        """The pricer of stages of `shapes` (one per device stage, in order), stage k by
        `pricer_of(shape, resharded, boundaries[k])`: resharded where a stage that may
        send to it has another shape: an earlier one, or with chunks that wrap around the
        devices (interleaved, V) any other."""
        crossing = list(boundaries) or [None] * len(shapes)
        return cls([pricer_of(shape, any(other != shape for other in (
            [*shapes[:k], *shapes[k + 1:]] if wraps else shapes[:k])), crossing[k])
            for k, shape in enumerate(shapes)])


#: What prices a pipeline: one kind of device, a mixed cluster's placement, or stages of
#: several mesh shapes.
AnyPricer = Pricer | PlacedPricer | ShapedPricer
