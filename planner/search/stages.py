"""Where to cut the pipeline: the partition of units into stages, and their recompute.

`partition` is the dynamic programme over unit boundaries, in the style of Alpa's
inter-op pass (Zheng et al., OSDI 2022): it minimises the bottleneck stage load
m·t_s + e_s under the memory limit, choosing each stage's recompute mode, vectorised over
every contiguous range with numpy (`StageTables`); ZB-H1 takes 1F1B's cut (its bubble is
1F1B's less the deferred weight passes, the same load decides it) and is priced exactly.
Interleaved schedules use Megatron's round-robin chunking instead, with v chunks per
device of equal layer counts or, where the layers do not divide or the embedding and head
make the end chunks heavier, the end chunks a layer lighter (`chunk_layer_counts`); ZB-V
the same counts over 2·pp chunks laid in its V (`costmodels.orders.chunk_device`); the
exact price picks the counts. The
result is a decision (unit ranges and a recompute mode per device) with its exact price
from `planner.cost.pipeline.Pricer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from costmodels.cluster import Cluster, Placement, balanced_rows
from costmodels.memory import training_memory
from costmodels.orders import chunk_device, chunks_per_device
from costmodels.profile import HardwareProfile
from costmodels.schedule import in_flight
from planner.cost.pipeline import AnyPricer, PlacedPricer, Pricer, WeightTerms, kind_seconds
from planner.cost.step import PipelineConfig, StagePrice, StepPrice, step_price
from planner.cost.units import UnitProfile
from planner.kinds import RECOMPUTE_MODES, AxisRole, Recompute, Schedule
from planner.layers import Units
from planner.sharding.mesh import DeviceMesh

# The stage DP's tables of a pipeline hold (units + 1)² entries each, some thirty of them:
# at 1,024 units about 250 MiB in all, at 20,000 units more than any machine has. Graphs
# with more units (layers) than this are planned without pipeline stages.
MAX_PIPELINE_UNITS = 1024

def contiguous(bounds: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Stages of consecutive units from cut points [0, c1, ..., units]."""
    return [[(bounds[k], bounds[k + 1])] for k in range(len(bounds) - 1)]


def interleaved(units: Units, pp: int, chunks: int, counts: Sequence[int] | None = None,
                schedule: Schedule = Schedule.INTERLEAVED
                ) -> list[list[tuple[int, int]]] | None:
    """Megatron's interleaved assignment: the layers in pp·chunks chunks of `counts` layers
    (default: equal), chunk c on device c mod pp (or where `schedule` places it: ZB-V's
    V); the prefix joins the first chunk and the suffix the last. None when the layers do
    not divide evenly (default counts) or the counts do not add up to the layers, or a
    chunk would hold no layer."""
    layers = units.layer_units
    pieces = pp * chunks
    if not layers or pp < 1 or chunks < 1:
        return None
    if counts is None:
        if len(layers) % pieces:
            return None
        counts = [len(layers) // pieces] * pieces
    if len(counts) != pieces or sum(counts) != len(layers) or min(counts) < 1:
        return None
    starts = [layers[0]]
    for count in counts:
        starts.append(starts[-1] + count)
    starts[0], starts[-1] = 0, units.count
    devices: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    for c in range(pieces):
        devices[chunk_device(schedule, pp, c)].append((starts[c], starts[c + 1]))
    return devices


def chunk_layer_counts(layers: int, pieces: int) -> list[tuple[int, ...]]:
    """Layer counts worth trying for `pieces` interleaved chunks of `layers` layers (each
    at least one): the first and last chunks each at q − 1, q or q + 1 layers
    (q = layers // pieces), the rest spread evenly over the middle chunks; kept when all
    chunks are within one layer of each other, or the end chunks are the lightest.
    Lighter end chunks are what Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers`` set, since those chunks also hold the
    embedding and the head; the exact price picks among the counts."""
    if pieces < 1 or layers < pieces:
        return []
    if pieces == 1:
        return [(layers,)]
    q = layers // pieces
    found: list[tuple[int, ...]] = []
    for first in (q, q - 1, q + 1):
        for last in (q, q - 1, q + 1):
            middle, rest = pieces - 2, layers - first - last
            if min(first, last) < 1 or rest < middle or (middle == 0 and rest):
                continue
            inner: list[int] = []
            if middle:
                even, extra = divmod(rest, middle)
                inner = [even] * middle
                for k in sorted(range(middle), key=lambda k: (abs(2 * k - (middle - 1)), k))[
                        :extra]:
                    inner[k] += 1
            counts = (first, *inner, last)
            balanced = max(counts) - min(counts) <= 1
            lighter_ends = max(counts) - min(counts) <= 2 and max(first, last) <= min(
                inner or [first])
            if (balanced or lighter_ends) and counts not in found:
                found.append(counts)
    return found


@dataclass
class Partition:
    devices: list[list[tuple[int, int]]]
    recompute: list[Recompute]
    price: StepPrice
    #: on a mixed cluster, the order its device groups take on the ranks (`Placement`)
    order: tuple[int, ...] = ()
    #: on a mixed cluster, the data-parallel replicas' rows of each micro-batch where
    #: they are shared by speed (`balanced_rows`); empty: even shares
    rows: tuple[int, ...] = ()


class Partitioner:
    """Partitions of one configuration (one pricer) under any limit and modes; the DP's
    tables are built on first use and serve every later call. A mixed cluster's pricer
    (`PlacedPricer`) prices each stage on its own kind: the DP takes each stage's tables
    and memory limit from it."""

    def __init__(self, pricer: AnyPricer) -> None:
        self.pricer = pricer
        self._tables: dict[int, StageTables] = {}

    def tables(self, stage: int) -> StageTables:
        """The DP's tables of stage `stage`'s pricer (one set per distinct pricer)."""
        pricer = self.pricer.stage_pricer(stage)
        found = self._tables.get(id(pricer))
        if found is None:
            found = self._tables[id(pricer)] = StageTables(pricer)
        return found

    def solve(self, limit: float,
              modes: Sequence[Recompute] = RECOMPUTE_MODES) -> Partition | None:
        """The cheapest partition that fits `limit` bytes per device (scaled per stage by
        its kind's memory on a mixed cluster), or None.

        Interleaved and ZB-V schedules use the even chunking; otherwise a DP over cut points
        minimises the largest stage load m·t_s + e_s (its time through the pipeline),
        choosing each stage's recompute mode, and the result is priced exactly by the
        pricer.
        """
        pricer = self.pricer
        profile, config = pricer.profile, pricer.config
        limits = [limit * pricer.limit_ratio(stage) for stage in range(config.pp)]
        if config.schedule in (Schedule.INTERLEAVED, Schedule.ZBV):
            best: Partition | None = None
            v = chunks_per_device(config.schedule, config.virtual_stages)
            for counts in chunk_layer_counts(len(profile.units.layer_units), config.pp * v):
                devices = interleaved(profile.units, config.pp, v, counts, config.schedule)
                laid = _best_modes(pricer, devices, limits, modes) if devices else None
                if laid is not None and (best is None or laid.price.step_time_s
                                         < best.price.step_time_s):
                    best = laid
            return best
        if config.pp > profile.count:
            return None
        found = solve_stages([self.tables(stage) for stage in range(config.pp)], limits,
                             modes)
        if found is None:
            return None
        cuts, chosen = found
        devices = contiguous(cuts)
        return Partition(devices, list(chosen), pricer.price(devices, chosen))


class OrderedPartitioner:
    """A mixed cluster's partitions: every order of its device groups on the ranks
    (Metis-style: which kind runs the first stages, whose activations stay longest in
    flight, and which the last), each partitioned on its own, with even data-parallel
    shares and, where replicas run on different kinds, shares by speed; the fastest is
    kept (the first of equals: even shares before shares by speed)."""

    def __init__(self, partitioners: Sequence[tuple[tuple[int, ...], tuple[int, ...],
                                                    Partitioner]]) -> None:
        self.partitioners = list(partitioners)

    def solve(self, limit: float,
              modes: Sequence[Recompute] = RECOMPUTE_MODES) -> Partition | None:
        best: Partition | None = None
        for order, rows, partitioner in self.partitioners:
            found = partitioner.solve(limit, modes)
            if found is not None and (best is None or found.price.step_time_s
                                      < best.price.step_time_s):
                best = replace(found, order=order, rows=rows)
        return best


def partitioner_for(profiles: Sequence[UnitProfile], config: PipelineConfig,
                    hardware: HardwareProfile, mesh: DeviceMesh,
                    cluster: Cluster | None = None,
                    uniform_limit: bool = True, micro_rows: int = 0,
                    dp_shares: str | None = None) -> Partitioner | OrderedPartitioner:
    """The partitioner of one configuration: on `hardware` (`profiles[0]`), or on a mixed
    `cluster` with `profiles[g]` priced by group g's hardware, over every order of its
    groups whose stages fit on them (`uniform_limit`: one memory limit for every kind,
    the user's `--memory-limit`). `micro_rows`, the rows of one micro-batch, lets it try
    data-parallel shares by speed (`speed_rows`) as the `dp_shares` pin allows: "even"
    never, "speed" in place of even shares wherever they apply, None beside them."""
    if cluster is None or not cluster.mixed:
        return Partitioner(Pricer(profiles[0], config, hardware, mesh))
    stage_size = mesh.size // config.pp
    found: list[tuple[tuple[int, ...], tuple[int, ...], Partitioner]] = []
    for order in cluster.orders():
        placement = Placement(cluster, order, stage_size)
        rows = () if dp_shares == "even" else speed_rows(profiles, placement, mesh,
                                                          config.pp, micro_rows)
        if dp_shares != "speed" or not rows:
            found.append((order, (), Partitioner(PlacedPricer(profiles, config, placement,
                                                              mesh, uniform_limit))))
        if rows:
            found.append((order, rows, Partitioner(PlacedPricer(
                profiles, config, placement, mesh, uniform_limit, rows))))
    return OrderedPartitioner(found)


def speed_rows(profiles: Sequence[UnitProfile], placement: Placement, mesh: DeviceMesh,
               pp: int, micro_rows: int) -> tuple[int, ...]:
    """The data-parallel replicas' rows of a micro-batch of `micro_rows` in proportion to
    each one's speed (`balanced_rows`; a replica on several kinds at its slowest one's),
    or () where even shares are all there is: a pipeline of more than one stage (each
    stage's layers already balance its kind: shares would have to suit every stage at
    once), replicas all on one kind, replica or expert axes (the first repeats the work,
    the second splits the batch with the experts), rows that do not split evenly to
    start from."""
    dp = mesh.axis_size(AxisRole.DATA) if AxisRole.DATA in mesh.axis_names else 1
    others = any(mesh.axis_size(axis) > 1 for axis in (AxisRole.REPLICA, AxisRole.EXPERT)
                 if axis in mesh.axis_names)
    if pp != 1 or dp < 2 or others or micro_rows < dp or micro_rows % dp:
        return ()
    work = kind_seconds(profiles)
    slowest = placement.replica_kinds(0, dp, work)
    if len(set(slowest)) < 2 or any(work[g] <= 0.0 for g in slowest):
        return ()
    even = micro_rows // dp
    rows = balanced_rows(micro_rows, [work[g] / even for g in slowest])
    return () if rows == (even,) * dp else rows


def partition(pricer: AnyPricer, limit: float,
              modes: Sequence[Recompute] = RECOMPUTE_MODES) -> Partition | None:
    """`Partitioner(pricer).solve(limit, modes)`: one partition of one configuration."""
    return Partitioner(pricer).solve(limit, modes)


def _best_modes(pricer: AnyPricer, devices: list[list[tuple[int, int]]],
                limits: Sequence[float], modes: Sequence[Recompute]) -> Partition | None:
    """Per device, the fastest recompute mode that fits (devices are priced apart)."""
    found = best_per_device([pricer], devices, limits, modes)
    if found is None:
        return None
    stages = found[1]
    return Partition(devices, [s.recompute for s in stages], step_price(stages, pricer.config))


def best_per_device(options: Sequence[AnyPricer], devices: Sequence[Sequence[tuple[int, int]]],
                    limits: Sequence[float], modes: Sequence[Recompute]
                    ) -> tuple[list[int], list[StagePrice]] | None:
    """Per device of a fixed assignment (interleaved or V chunks), the option (a pricer:
    a mesh shape, for per-stage meshes) and recompute mode of least time per micro-batch
    that fit, the first of equals; devices are priced apart. None when a device fits
    under none."""
    picks, stages = [], []
    for d in range(len(devices)):
        fitting = [(stage, k) for k, pricer in enumerate(options)
                   for stage in (pricer.device(d, devices, mode) for mode in modes)
                   if stage.memory.peak <= limits[d]]
        if not fitting:
            return None
        stage, k = min(fitting, key=lambda found: found[0].per_micro_batch_s)
        picks.append(k)
        stages.append(stage)
    return picks, stages


class StageTables:
    """Every contiguous range's time and memory, for the DP: [r, i] is the range from unit
    `starts[r]` to unit i. A pipeline of one stage starts only at unit 0, so its tables
    are one row (linear in the units); deeper pipelines need every start, (units+1)²
    (`MAX_PIPELINE_UNITS` bounds them)."""

    def __init__(self, pricer: Pricer) -> None:
        profile, config = pricer.profile, pricer.config
        self.config = config
        n = profile.count
        self.n = n
        starts = np.arange(1) if config.pp == 1 else np.arange(n + 1)
        self.starts = starts
        rows = len(starts)

        def span(values: np.ndarray) -> np.ndarray:  # [r, i]: sum of values[starts[r]:i]
            prefix = np.concatenate(([0.0], np.cumsum(values)))
            return prefix[None, :] - prefix[starts, None]

        def running_max(values: np.ndarray) -> np.ndarray:
            table = np.zeros((rows, n + 1))
            for r, j in enumerate(starts.tolist()):
                if j < n:
                    table[r, j + 1:] = np.maximum.accumulate(values[j:])
            return table

        def covering(first: int, last: int) -> np.ndarray:  # [r, i]: j <= first, last < i
            table = np.zeros((rows, n + 1), dtype=bool)
            table[: int(np.searchsorted(starts, first, side="right")), last + 1:] = True
            return table

        base = span(profile.forward + profile.backward)
        self.time = {Recompute.NONE: base,
                     Recompute.SELECTIVE: base + span(profile.selective_extra),
                     Recompute.FULL: base + span(profile.forward - profile.loss_read)}
        self.saved = {mode: span(profile.saved[mode]) for mode in RECOMPUTE_MODES}
        self.transient = {mode: running_max(profile.transient[mode]) for mode in RECOMPUTE_MODES}
        # A crossing enters range [j, i) when produced before j and read by a unit in it.
        received = np.zeros((rows, n + 1))
        p2p = np.zeros((rows, n + 1))
        for crossing in profile.crossings:
            seconds = pricer.prices.p2p(crossing.bytes) * (2.0 if crossing.grad else 1.0)
            low = int(np.searchsorted(starts, crossing.producer + 1))
            high = int(np.searchsorted(starts, crossing.consumers[-1] + 1))
            for r in range(low, high):
                j = int(starts[r])
                first = next(u for u in crossing.consumers if u >= j)
                received[r, first + 1:] += crossing.bytes
                p2p[r, first + 1:] += seconds
        self.received, self.p2p = received, p2p
        weights = pricer.weights
        totals = weights.own.apply(lambda name, values: running_max(values)
                                   if name == "largest" else span(values))
        for param, terms, exchange, _ in weights.shared:
            inside = np.zeros((rows, n + 1), dtype=bool)
            for u in param.units:
                inside |= covering(u, u)

            def add(name: str, table: Any, terms: WeightTerms = terms,
                    inside: np.ndarray = inside) -> Any:
                return np.where(inside, np.maximum(table, getattr(terms, name)), table) \
                    if name == "largest" else table + inside * getattr(terms, name)

            totals = totals.apply(add)
            # Held by more than one stage: the holders exchange its gradient at the end.
            holds_all = covering(param.units[0], param.units[-1])
            totals = replace(totals, end=totals.end + (inside & ~holds_all) * exchange)
        self.totals = totals
        workspace = running_max(profile.workspace)
        self.workspace = np.maximum(workspace, totals.largest) if config.zero >= 3 \
            else workspace
        self.itemsize = weights.itemsize

    def memory(self, mode: Recompute, stage: int) -> np.ndarray:
        config, t = self.config, self.totals
        flight = in_flight(stage, config.pp, config.micro_batches, config.schedule,
                           config.virtual_stages)
        memory = training_memory(
            parameter_bytes=t.bytes, parameter_elements=t.elements,
            parameter_itemsize=self.itemsize,
            activation_bytes=flight * (self.saved[mode] + self.received)
            + self.transient[mode], workspace_bytes=self.workspace,
            optimizer=config.optimizer, zero=config.zero, sharded_bytes=t.sharded_bytes,
            sharded_elements=t.sharded_elements, rounded=False, precision=config.precision)
        return memory.peak

    def solve(self, limit: float,
              modes: Sequence[Recompute]) -> tuple[list[int], list[Recompute]] | None:
        """`solve_stages` with every stage on these tables and within `limit`."""
        return solve_stages([self] * self.config.pp, [limit] * self.config.pp, modes)


def solve_stages(tables: Sequence[StageTables], limits: Sequence[float],
                 modes: Sequence[Recompute]) -> tuple[list[int], list[Recompute]] | None:
    """The DP over cut points: stage k takes its times and memory from `tables[k]` and
    fits `limits[k]`; the cuts and each stage's recompute mode that minimise the largest
    stage load, or None when no partition fits."""
    found = solve_shaped([[table] for table in tables], limits, modes)
    return None if found is None else (found[0], found[1])


def solve_shaped(options: Sequence[Sequence[StageTables]], limits: Sequence[float],
                 modes: Sequence[Recompute]
                 ) -> tuple[list[int], list[Recompute], list[int]] | None:
    """`solve_stages` where stage k may take any of `options[k]` (the tables of its
    mesh shapes, over the same units): for each range the option and recompute mode of
    least load that fits. Returns the cuts, each stage's mode and the index of its
    option, or None when no partition fits."""
    first = options[0][0]
    config, n = first.config, first.n
    m = config.micro_batches
    starts, rows = first.starts, len(first.starts)
    valid = starts[:, None] < np.arange(n + 1)[None, :]
    best = np.full(rows, np.inf)
    best[0] = 0.0
    back: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    ending = np.full(n + 1, np.inf)
    for stage in range(config.pp):
        load = np.full((rows, n + 1), np.inf)
        mode_of = np.zeros((rows, n + 1), dtype=np.int64)
        option_of = np.zeros((rows, n + 1), dtype=np.int64)
        for option, table in enumerate(options[stage]):
            for index, mode in enumerate(RECOMPUTE_MODES):
                if mode not in modes:
                    continue
                per_micro = table.time[mode] + table.p2p + table.totals.micro + (
                    table.totals.micro_regather if mode == Recompute.FULL else 0.0)
                cost = m * per_micro + table.totals.end + table.totals.optimizer
                fits = valid & (table.memory(mode, stage) <= limits[stage])
                better = fits & (cost < load)
                load = np.where(better, cost, load)
                mode_of = np.where(better, index, mode_of)
                option_of = np.where(better, option, option_of)
        through = np.maximum(best[:, None], load)
        choice = np.argmin(through, axis=0)
        ending = through[choice, np.arange(n + 1)]  # the best load of units [0, i)
        best = ending[starts]
        columns = np.arange(n + 1)
        back.append((starts[choice], mode_of[choice, columns], option_of[choice, columns]))
    if not np.isfinite(ending[n]):
        return None
    cuts, chosen, picked = [n], [], []
    end = n
    for choice, mode_index, option_index in reversed(back):
        start = int(choice[end])
        chosen.append(RECOMPUTE_MODES[int(mode_index[end])])
        picked.append(int(option_index[end]))
        cuts.append(start)
        end = start
    return cuts[::-1], chosen[::-1], picked[::-1]
