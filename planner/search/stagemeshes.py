"""Per-stage meshes (Alpa's inter-operator pass): a pipeline's device stages on (dp, tp)
shapes and device counts of their own, each shape's op-level layout solved for it.

The joint search prices every stage on one shape over an even share of the devices
(`planner.search.joint`). A model whose layers differ (a large vocabulary's head after a
small body) may run faster with the heavy stage on more devices, or split otherwise: this
search takes a shared-shape decision and tries, for each vector of stage device counts
(Alpa's submesh sizes, `planner.sharding.submeshes`), the shape and recompute mode of
least load per range of units (`solve_shaped`), prices the best vectors exactly with the
activations resharded between stages, and returns the fastest where it beats the shared
decision: the planner compares both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from costmodels.orders import chunks_per_device
from costmodels.profile import HardwareProfile
from planner.cost.oplevel import PricedGraph, mesh_on, priced_choice
from planner.cost.pipeline import Boundary, Pricer, ShapedPricer, stage_boundaries
from planner.cost.step import PipelineConfig, StepPrice, TrainingOptions
from planner.cost.units import UnitProfile, unit_profile
from planner.kinds import Recompute, Schedule
from planner.layers import Units
from planner.search.decisions import Choice, PipelineDecision, StageShape
from planner.search.joint import (
    choice_mesh,
    model_parallel_strategies,
    pipeline_config,
    stage_mesh,
)
from planner.search.stages import (
    StageTables,
    best_per_device,
    chunk_layer_counts,
    contiguous,
    interleaved,
    solve_shaped,
)
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy
from planner.sharding.submeshes import stage_blocks, submesh_sizes

#: the device counts a stage may take: submesh sizes from half to twice the even share (a
#: stage holding far more than another's share of the work is one a deeper or shallower
#: pipeline serves better), at most this many, the nearest to the even share first: each
#: count adds op-level solves, one per (dp, tp) shape
MAX_STAGE_SIZES = 4
#: device-count vectors tried per decision (the nearest to the even share first) and
#: the most enumerated to choose them from
MAX_SIZE_VECTORS = 64
MAX_ENUMERATED = 20_000
#: deeper pipelines keep even device counts (their vectors are enumerated stage by stage)
MAX_UNEVEN_DEPTH = 64
#: candidates of uneven device counts priced exactly (stage layouts derived with the
#: other stages' ops foreign), the fastest as their whole-graph layouts price them; the
#: even counts' candidates are all priced exactly
EXACT_VECTORS = 3

Shape = tuple[int, int]  # (dp, tp)


def stage_shapes(size: int, micro_size: int, per_node: int,
                 own: Shape | None = None) -> list[Shape]:
    """The (dp, tp) shapes a stage of `size` devices may take: tp within a node, dp
    dividing the micro-batch; `own` (the shared decision's) first where it is one."""
    found = [(size // tp, tp) for tp in range(1, size + 1)
             if size % tp == 0 and tp <= per_node and micro_size % (size // tp) == 0]
    return [own, *(s for s in found if s != own)] if own in found else found


def size_options(devices: int, pp: int, per_node: int) -> list[int]:
    """The device counts a stage of `pp` over `devices` may take, ascending: the
    `MAX_STAGE_SIZES` submesh sizes (`submesh_sizes`) nearest the even share, within a
    factor 2 of it."""
    even = devices / pp
    near = sorted((s for s in submesh_sizes(devices, per_node) if even / 2 <= s <= even * 2),
                  key=lambda s: (abs(math.log(s / even)), s))
    return sorted(near[:MAX_STAGE_SIZES])


def size_vectors(devices: int, pp: int, per_node: int) -> list[tuple[int, ...]]:
    """Stage device counts over `devices` from `size_options`, that lie on the cluster
    aligned (`stage_blocks`); uneven ones only, nearest to the even share first, at most
    `MAX_SIZE_VECTORS`; none past `MAX_UNEVEN_DEPTH` stages."""
    even = devices / pp
    sizes = size_options(devices, pp, per_node)
    if not sizes or pp > MAX_UNEVEN_DEPTH:
        return []
    found: list[tuple[int, ...]] = []
    for vector in _compositions((), devices, pp, sizes):
        if len(set(vector)) > 1:
            found.append(vector)
        if len(found) >= MAX_ENUMERATED:
            break
    found.sort(key=lambda v: (sum(abs(s - even) for s in v), v))
    placed = []
    for vector in found:
        try:
            stage_blocks(vector, per_node)
        except ValueError:
            continue
        placed.append(vector)
        if len(placed) >= MAX_SIZE_VECTORS:
            break
    return placed


def _compositions(prefix: tuple[int, ...], left: int, stages: int,
                  sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """`prefix` extended by `stages` more of `sizes` (ascending) adding up to `left`."""
    if stages == 0:
        if left == 0:
            yield prefix
        return
    for size in sizes:
        rest = left - size
        if (stages - 1) * sizes[0] <= rest <= (stages - 1) * sizes[-1]:
            yield from _compositions((*prefix, size), rest, stages - 1, sizes)


@dataclass(frozen=True)
class ShapeLayout:
    """One stage shape's op-level layout of the micro-batch's graph: priced on the
    pipeline's mesh of that shape, and its unit profile."""

    priced: PricedGraph
    profile: UnitProfile

    @property
    def mesh(self) -> DeviceMesh:
        return self.priced.sharded.mesh


def shape_layout(micro: GraphAnalysis, hardware: HardwareProfile, choice: Choice,
                 training: TrainingOptions, dp: int, tp: int,
                 strategies: Mapping[str, OpStrategy],
                 foreign: frozenset[str] = frozenset()) -> ShapeLayout:
    """`strategies` (solved on a (dp, tp) stage) priced on `choice`'s pipeline mesh with
    that shape; `foreign` ops run on other stages' meshes (`derive`). A stage of fewer
    devices than another's is one block of them (`planner.sharding.submeshes`): its
    groups lie as this mesh's around device 0 do."""
    per_node = int(hardware.devices_per_node.value)
    mesh = choice_mesh(replace(choice, dp=dp, tp=tp), per_node)
    priced = priced_choice(micro, mesh_on(mesh, hardware), strategies, hardware, training,
                           foreign)
    return ShapeLayout(priced, unit_profile(priced, micro.units))


def stage_layouts(micro: GraphAnalysis, hardware: HardwareProfile, choice: Choice,
                  training: TrainingOptions, shapes: Sequence[StageShape],
                  devices: Sequence[Sequence[tuple[int, int]]]
                  ) -> dict[Shape, ShapeLayout]:
    """Each distinct shape of per-stage meshes laid out for the stages that run it: the
    strategies of their own ops (`devices[k]`: stage k's unit ranges), every other op
    foreign to it (`derive`). So an activation from a stage of another shape arrives as
    the first op of this shape reading it wants it (the send reshards it: each rank
    receives its own block), and what each stage lists follows from its own ops'
    strategies alone (what validate re-derives)."""
    bounds = micro.units.bounds
    names = [node.name for node in micro.graph.ops]
    owned: dict[Shape, set[str]] = {}
    for shape, ranges in zip(shapes, devices, strict=True):
        mine = owned.setdefault((shape.dp, shape.tp), set())
        for a, b in ranges:
            mine.update(names[bounds[a]:bounds[b]])
    layouts: dict[Shape, ShapeLayout] = {}
    for shape in shapes:
        key = (shape.dp, shape.tp)
        if key not in layouts:
            mine = owned[key]
            strategies = {name: s for name, s in shape.strategies.items() if name in mine}
            layouts[key] = shape_layout(micro, hardware, choice, training, *key, strategies,
                                        frozenset(names) - mine)
    return layouts


def shaped_pricer(layouts: Mapping[Shape, ShapeLayout], picked: Sequence[Shape],
                  config: PipelineConfig, hardware: HardwareProfile) -> ShapedPricer:
    """The exact pricer of stages of the `picked` shapes (`ShapedPricer`) on their
    `stage_layouts`, the sends between stages of different device counts crossing
    between their blocks (`stage_boundaries`): for the search and the plan builder
    alike."""
    per_node = int(hardware.devices_per_node.value)
    pricers: dict[tuple[Shape, bool, Boundary | None], Pricer] = {}

    def pricer_of(shape: Shape, resharded: bool, boundary: Boundary | None) -> Pricer:
        key = (shape, resharded, boundary)
        if key not in pricers:
            layout = layouts[shape]
            pricers[key] = Pricer(layout.profile, config, hardware, layout.mesh,
                                  resharded=resharded, boundary=boundary)
        return pricers[key]

    return ShapedPricer.of_shapes(
        list(picked), pricer_of, config.schedule in (Schedule.INTERLEAVED, Schedule.ZBV),
        stage_boundaries([dp * tp for dp, tp in picked], per_node))


@dataclass(frozen=True)
class _Candidate:
    """A per-stage mesh assignment: each device stage's unit ranges, recompute mode and
    shape, with the step its whole-graph layouts price it at (what orders candidates
    before the exact pricing); `choice`: its configuration (its depth may differ from the
    shared decision's); `even`: the stages hold as many devices each."""

    choice: Choice
    even: bool
    surrogate_s: float
    devices: list[list[tuple[int, int]]]
    recompute: list[Recompute]
    shapes: list[Shape]


def shaped_decision(graphs: Analyses, hardware: HardwareProfile, shared: PipelineDecision,
                    training: TrainingOptions, modes: list[Recompute], time_limit: float,
                    layout: str | None = None,
                    other_depths: bool = False) -> PipelineDecision | None:
    """The configuration of `shared` with each device stage on a (dp, tp) shape of its
    own: over the same devices as `shared`'s stages (any schedule), or, for consecutive
    stages, over device counts of their own (`size_vectors`); with `other_depths` (pp not
    pinned), also one stage more or fewer where that many do not divide the devices (3
    stages on 8 devices as 4 + 2 + 2: no shared shape holds them). For each vector of counts
    the partition DP takes, for every range of units, the shape and recompute mode of
    least load that fits (`solve_shaped`); interleaved and V chunks (a fixed assignment
    per chunking, `chunk_layer_counts`) take each device's fastest shape and mode
    (`best_per_device`). The `EXACT_VECTORS` best candidates are priced exactly, with
    the activations resharded between stages (`ShapedPricer`); the fastest is returned
    where its stages' shapes differ and its step is faster than `shared`'s.

    Not tried with context, expert or sequence parallelism, replicas, a mixed cluster, or
    weights read by several units (a tied embedding: its holders would sum gradients
    sharded differently); there every stage shares a shape."""
    choice = shared.choice
    if (choice.pp < 2 or choice.cp > 1 or choice.ep > 1 or choice.replicas > 1
            or choice.sequence_parallel or shared.order or shared.rows or shared.shapes):
        return None
    per_node = int(hardware.devices_per_node.value)
    micro_size = shared.micro_batch_size
    micro = graphs.at(micro_size)
    if choice.pp > micro.units.count:
        return None
    even = choice.dp * choice.tp
    devices = even * choice.pp
    own = (choice.dp, choice.tp)
    wraps = choice.schedule in (Schedule.INTERLEAVED, Schedule.ZBV)
    depths = [choice.pp]
    if other_depths and not wraps:
        depths += [d for d in (choice.pp - 1, choice.pp + 1) if 2 <= d <= micro.units.count
                   and devices % d and choice.micro_batches >= d]
    vectors_of = {depth: [*([(even,) * depth] if depth == choice.pp else []),
                          *(() if wraps else size_vectors(devices, depth, per_node))]
                  for depth in depths}
    shapes_of = {size: stage_shapes(size, micro_size, per_node, own)
                 for size in {s for vs in vectors_of.values() for v in vs for s in v}}
    vectors_of = {depth: [v for v in vs if all(shapes_of[s] for s in v)]
                  for depth, vs in vectors_of.items()}
    shapes = list(dict.fromkeys(s for vs in vectors_of.values() for v in vs for size in v
                                for s in shapes_of[size]))
    if len(shapes) < 2:
        return None
    limit = float(training.memory_limit_bytes or int(hardware.memory_bytes.value))
    solved: dict[Shape, Mapping[str, OpStrategy]] = {}
    for dp, tp in shapes:
        solved[(dp, tp)] = shared.strategies if (dp, tp) == own else model_parallel_strategies(
            micro, stage_mesh(dp, tp, per_node), hardware, training, micro.batch_labels,
            time_limit, layout=layout, micro_batches=choice.micro_batches)[0]
    # Each shape's whole-graph layout, laid out once: a stage's dp and tp groups lie alike
    # whatever the pipeline's depth, so every depth's candidates are priced on these
    # (the exact pricing lays each candidate out at its own depth).
    wholes = {shape: shape_layout(micro, hardware, choice, training, *shape, solved[shape])
              for shape in shapes}
    if any(len(param.units) > 1 for param in wholes[own].profile.params):
        return None
    candidates: list[_Candidate] = []
    for depth, vectors in vectors_of.items():
        candidates += _candidates(wholes, shapes_of, vectors, micro.units,
                                  replace(choice, pp=depth), training, hardware, limit, modes)
    uneven = sorted((c for c in candidates if not c.even), key=lambda c: c.surrogate_s)
    best: tuple[StepPrice, _Candidate] | None = None
    for candidate in [*(c for c in candidates if c.even), *uneven[:EXACT_VECTORS]]:
        stages = [StageShape(dp, tp, solved[(dp, tp)]) for dp, tp in candidate.shapes]
        exact = stage_layouts(micro, hardware, candidate.choice, training, stages,
                              candidate.devices)
        price = shaped_pricer(exact, candidate.shapes,
                              pipeline_config(candidate.choice, training), hardware).price(
            candidate.devices, candidate.recompute)
        if price.peak_memory <= limit and (best is None or price.step_time_s
                                           < best[0].step_time_s):
            best = (price, candidate)
    if best is None or best[0].step_time_s >= shared.solver.objective:
        return None
    price, chosen = best
    first = chosen.shapes[0]
    step = price.step_time_s
    return replace(
        shared, choice=replace(chosen.choice, dp=first[0], tp=first[1]),
        strategies=solved[first], devices=tuple(tuple(r) for r in chosen.devices),
        recompute=tuple(chosen.recompute),
        solver=replace(shared.solver, objective=step, bound=step),
        shapes=tuple(StageShape(dp, tp, solved[(dp, tp)]) for dp, tp in chosen.shapes))


def _candidates(wholes: Mapping[Shape, ShapeLayout], shapes_of: Mapping[int, list[Shape]],
                vectors: Sequence[tuple[int, ...]], units: Units, choice: Choice,
                training: TrainingOptions, hardware: HardwareProfile, limit: float,
                modes: Sequence[Recompute]) -> list[_Candidate]:
    """Per vector of stage device counts, its per-stage mesh candidates (one from the DP
    for consecutive stages, one per chunking for interleaved and V chunks), each priced
    on the shapes' whole-graph layouts; those with a single shape throughout left out
    (a configuration of its own)."""
    per_node = int(hardware.devices_per_node.value)
    config = pipeline_config(choice, training)
    pricers: dict[tuple[Shape, Boundary | None], Pricer] = {}
    tables: dict[tuple[Shape, Boundary | None], StageTables] = {}

    def pricer_of(shape: Shape, resharded: bool = False,
                  boundary: Boundary | None = None) -> Pricer:
        """`shape`'s whole-graph pricer (resharding left to the exact pricing)."""
        key = (shape, boundary)
        if key not in pricers:
            whole = wholes[shape]
            pricers[key] = Pricer(whole.profile, config, hardware, whole.mesh,
                                  boundary=boundary)
        return pricers[key]

    def tables_of(shape: Shape, boundary: Boundary | None) -> StageTables:
        key = (shape, boundary)
        if key not in tables:
            tables[key] = StageTables(pricer_of(shape, False, boundary))
        return tables[key]

    found = []
    pp = config.pp
    for vector in vectors:
        options = [shapes_of[size] for size in vector]
        boundaries = stage_boundaries(vector, per_node)
        if config.schedule in (Schedule.INTERLEAVED, Schedule.ZBV):
            assignments = _chunked(options[0], pricer_of, units, config, limit, modes)
        else:
            solved = solve_shaped([[tables_of(shape, boundaries[k]) for shape in options[k]]
                                   for k in range(pp)], [limit] * pp, modes)
            assignments = [] if solved is None else [
                (contiguous(solved[0]), solved[1],
                 [options[k][pick] for k, pick in enumerate(solved[2])])]
        for devices, recompute, picked in assignments:
            if len(set(picked)) < 2:
                continue
            surrogate = ShapedPricer.of_shapes(picked, pricer_of, False, boundaries)
            found.append(_Candidate(choice, len(set(vector)) == 1,
                                    surrogate.price(devices, recompute).step_time_s,
                                    devices, recompute, picked))
    return found


def _chunked(options: Sequence[Shape], pricer_of: Callable[[Shape], Pricer], units: Units,
             config: PipelineConfig,
             limit: float, modes: Sequence[Recompute]
             ) -> list[tuple[list[list[tuple[int, int]]], list[Recompute], list[Shape]]]:
    """Interleaved and V chunks: per chunking, each device's fastest shape and mode."""
    pp = config.pp
    pricers = [pricer_of(shape) for shape in options]
    found = []
    v = chunks_per_device(config.schedule, config.virtual_stages)
    for counts in chunk_layer_counts(len(units.layer_units), pp * v):
        devices = interleaved(units, pp, v, counts, config.schedule)
        laid = best_per_device(pricers, devices, [limit] * pp, modes) if devices else None
        if devices is not None and laid is not None:
            found.append((devices, [stage.recompute for stage in laid[1]],
                          [options[k] for k in laid[0]]))
    return found
