"""From a graph to the plan: run the searches, build every finalist, keep the fastest.

The op-level search (one decision per mesh shape) and, for training with a batch, the
joint search (pipeline decisions) propose decisions; the plan builder derives and prices
each one exactly; the fastest that fits wins, unless a baseline (data parallel,
Megatron-style) is faster under the same exact pricing. The winner is built once with the
record of how it was found: its solver, the alternatives tried and the baselines' figures.
When nothing fits, the error names the least memory any plan needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from enum import IntEnum

from costmodels.cluster import Cluster
from costmodels.profile import HardwareProfile
from planner.cost.step import TrainingOptions
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.humanize import human_bytes
from planner.plans.build import BuildContext, Derived, build, derive
from planner.plans.model import Plan
from planner.plans.sections import Alternative
from planner.records import SolverDetail, SolverRecord
from planner.search.baselines import baselines, data_parallel
from planner.search.decisions import OpLevelDecision, PipelineDecision
from planner.search.failure import no_plan, op_level_memory_floor
from planner.search.joint import joint_decisions, recompute_modes
from planner.search.layers import ties_layers
from planner.search.oplevel import (
    MeshResult,
    candidate_meshes,
    replica_meshes,
    resolve_patterns,
    search_meshes,
)
from planner.search.options import Pins, SearchOptions, check_pins
from planner.search.solve import SOLVERS
from planner.search.stagemeshes import shaped_decision
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.mesh import DeviceMesh

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Finalist:
    """A decision built and priced, and what its alternative row says of it."""

    derived: Derived
    record: SolverRecord


class Search(IntEnum):
    """The searches whose finalists `Finalists` orders: op-level rows first."""

    OP_LEVEL = 0
    JOINT = 1


class Finalists:
    """The finalists' alternative rows and the fastest that fits (the first of equals)
    with its sections: only that one may become the plan, so the others' sections (every
    op and tensor of the graph) are not kept: at 200,000 ops each holds hundreds of MB.

    Rows are ordered by search (`Search.OP_LEVEL` before `JOINT`), then as added: the joint
    search runs first, so that its best plan bounds the op-level meshes
    (`search_meshes(beat=)`), but an op-level plan as fast as a joint one still comes
    first."""

    def __init__(self, sp: int | None) -> None:
        self.sp = sp  # the `sp` pin: a finalist fits the request only with that split
        #: (search, row, numbered): a finalist's row is numbered, an unplanned mesh's not
        self._rows: list[tuple[Search, Alternative, bool]] = []
        self.best: Finalist | None = None
        self._best_at: tuple[Search, int] | None = None  # (search, index among _rows)
        self.other_sp = 0  # finalists that fit but split the sequence otherwise than pinned

    def add(self, derived: Derived, record: SolverRecord, search: Search,
            on: DeviceMesh | None = None) -> None:
        """A built finalist of `search`, or with `on` one that is `derived`'s plan on that
        mesh (`_flat_key`): its row lists that mesh, and it is never the best (equal to the
        one added before it, which stays first)."""
        at = (search, len(self._rows))
        self._rows.append((search, _alternative(derived, record, on), True))
        if derived.predicted.fits and self.sp not in (None, derived.parallel.sp):
            self.other_sp += 1
        if on is not None or not derived.predicted.fits \
                or self.sp not in (None, derived.parallel.sp):
            return
        step = derived.predicted.step_time_s
        if self.best is None or self._best_at is None or (
                step, at) < (self.best.derived.predicted.step_time_s, self._best_at):
            self.best, self._best_at = Finalist(derived, record), at

    def unplanned(self, row: Alternative, search: Search) -> None:
        self._rows.append((search, row, False))

    def best_step(self, search: Search) -> float | None:
        """The best fitting finalist's step if it comes from `search`, else None."""
        if self.best is None or self._best_at is None or self._best_at[0] != search:
            return None
        return self.best.derived.predicted.step_time_s

    def _numbered(self) -> list[tuple[int, Alternative, int | None]]:
        """(index among _rows, row, finalist number or None), in the rows' order."""
        found: list[tuple[int, Alternative, int | None]] = []
        number = 0
        for index, (_, row, numbered) in sorted(enumerate(self._rows),
                                                key=lambda item: (item[1][0], item[0])):
            found.append((index, row, number if numbered else None))
            number += numbered
        return found

    @property
    def rows(self) -> list[tuple[Alternative, int | None]]:
        """Each row with its finalist number (None: an unplanned mesh), in order."""
        return [(row, number) for _, row, number in self._numbered()]

    @property
    def best_number(self) -> int | None:
        if self._best_at is None:
            return None
        return next(number for index, _, number in self._numbered()
                    if index == self._best_at[1])


def plan_data_parallel(graph: PlanningGraph, hardware: HardwareProfile, devices: int,
                       training: TrainingOptions) -> Plan:
    """The data-parallel baseline as the plan (`--mode data`): one candidate, no search."""
    started = time.perf_counter()
    context = BuildContext(Analyses(GraphAnalysis.of(graph)), hardware, training)
    derived = derive(context, data_parallel(context.graphs.root, hardware, devices))
    step = derived.predicted.step_time_s
    record = SolverRecord(
        "data-parallel", "fixed", step, step, 0.0, time.perf_counter() - started,
        SolverDetail(note="the data-parallel baseline has one candidate: no search"))
    return build(derived, record, (), _baseline_briefs(context, devices))


def plan_baseline(graph: PlanningGraph, hardware: HardwareProfile, devices: int, name: str,
                  training: TrainingOptions) -> Plan:
    """One of the baselines (`data-parallel`, `megatron`) as a plan of its own, to run or
    compare (ShardplanError when the model does not admit it on these devices)."""
    context = BuildContext(Analyses(GraphAnalysis.of(graph)), hardware, training)
    found = baselines(context.graphs.root, hardware, devices)
    if name not in found:
        raise ShardplanError(f"the {name} baseline does not apply to {graph.path} on "
                             f"{devices} × {hardware.name}; baselines here: "
                             f"{', '.join(found) or 'none'}")
    derived = derive(context, found[name])
    step = derived.predicted.step_time_s
    return build(derived, SolverRecord("baseline", "fixed", step, step, 0.0))


def plan_search(graph: PlanningGraph, hardware: HardwareProfile, devices: int,
                options: SearchOptions, training: TrainingOptions,
                progress: Progress | None = None, cluster: Cluster | None = None) -> Plan:
    """Op-level plans over mesh shapes, and (for training with a batch) the joint search
    over pipeline stages, micro-batches, ZeRO and recompute; the fastest plan that fits.

    On a mixed `cluster` (`hardware` its lead kind) only the joint search runs: an
    op-level plan, like the baselines, runs every op on every device, at the slowest
    kind's pace within the smallest kind's memory, which a pipeline of one stage prices
    as well."""
    if options.solver not in SOLVERS:
        raise ShardplanError(f"--solver {options.solver!r}: choose one of {', '.join(SOLVERS)}")
    pins = replace(check_pins(options.parallel), runnable=options.runnable)
    analysis = GraphAnalysis.of(graph)
    mixed = cluster if cluster is not None and cluster.mixed else None
    context = BuildContext(Analyses(analysis), hardware, training, mixed)
    # a typo or two globs at odds are the same on every mesh: say it once
    resolve_patterns(analysis, options.strategies)
    started = time.perf_counter()
    joint_only = pins.joint_only
    joint_wanted = (options.mode == "auto" and not training.inference and bool(graph.batch)
                    and options.mesh is None)
    if mixed is not None and not joint_wanted:
        raise ShardplanError(
            f"--cluster {mixed.path or mixed.name}: a mixed cluster is planned by the pipeline "
            f"search; {graph.path} needs a batch dimension (--batch) for it")
    if joint_only and not joint_wanted:
        raise ShardplanError(
            f"--parallel {', '.join(joint_only)}: pipeline stages, "
            "micro-batches, ZeRO and recompute are planned for training in --mode auto, for "
            "a model with a batch dimension (--batch) and without --mesh")
    finalists = Finalists(pins.sp)
    meshes: list[DeviceMesh] = []
    reasons = ""
    floor = op_level_memory_floor(analysis, training, hardware) / devices
    skip_op_level = joint_wanted and floor > context.limit
    if skip_op_level and progress is not None:
        progress(f"op-level plans skipped: every one needs at least {human_bytes(floor)} "
                 "per device (weights, gradients, states and activations spread evenly)")
    # The joint search first: the step of its best plan that fits bounds the op-level
    # meshes, whose exact ILP can run out its time limit on a mesh no plan of which
    # could win (`Engine.beat`).
    joint = None
    if joint_wanted:
        decisions, joint = joint_decisions(context.graphs, hardware, devices, training, pins,
                                           options.time_limit, options.top_k, progress, mixed)
        if pins.dp is None and pins.tp is None and pins.stage_mesh != "shared" \
                and pins.runnable.stage_meshes:
            decisions = _with_stage_meshes(context, decisions, pins, options.time_limit)
        for decision in decisions:
            derived = derive(context, decision)
            # the joint search ties repeated layers always: its stages are layer units
            record = replace(decision.solver, time_s=time.perf_counter() - started,
                             detail=replace(decision.solver.detail, mode=options.mode,
                                            tied_layers=ties_layers(
                                                context.graphs.root.blocks)))
            finalists.add(derived, record, Search.JOINT)
    if pins.admits_op_level and not skip_op_level and mixed is None:
        beat = finalists.best_step(Search.JOINT)
        candidates = candidate_meshes(devices, hardware, options, pins)
        results = search_meshes(analysis, hardware, candidates, options, training, pins,
                                progress, beat)
        replicated = replica_meshes(analysis, devices, hardware, options, pins, results)
        results += search_meshes(analysis, hardware, replicated, options, training, pins,
                                 progress, beat)
        meshes = [c.mesh for c in (*candidates, *replicated)]
        reasons = _reasons(results)
        _op_level(context, results, options, started, finalists)
    # `sp=0` pins the plan's sequence split off: a searched layout could still split the
    # activations between blocks along the sequence, which the plan would then name
    best = finalists.best
    if best is None and finalists.other_sp:
        raise ShardplanError(
            f"{graph.path}: --parallel sp={pins.sp}: {finalists.other_sp} plan(s) fit, but "
            f"none {'splits' if pins.sp else 'keeps'} the activations between blocks along "
            "the sequence as Megatron's sequence parallelism does; drop the sp pin")
    if best is None:
        raise no_plan(analysis, hardware, devices, options.strategies, options.time_limit,
                      training, meshes, reasons, joint,
                      mixed.describe() if mixed is not None else "")
    winner, record = best.derived, replace(best.record, detail=replace(best.record.detail,
                                                                         pins=pins.given()))
    chosen = finalists.best_number
    briefs = {}
    for name, baseline_decision in (baselines(analysis, hardware, devices)
                                    if mixed is None else {}).items():
        baseline = derive(context, baseline_decision)
        briefs[name] = baseline.brief()
        if _eligible(name, baseline, options, pins) and baseline.predicted.fits and \
                baseline.predicted.step_time_s < winner.predicted.step_time_s:
            winner, chosen = baseline, None
            record = replace(record, detail=replace(
                record.detail, chosen=f"the {name} baseline: cheaper under exact pricing"))
    rows = sorted(finalists.rows, key=lambda row: row[0].objective)
    listed = tuple(replace(alt, chosen=number is not None and number == chosen)
                   for alt, number in rows[: max(1, options.top_k)])
    return build(winner, record, listed, briefs, joint.warnings() if joint else ())


def _with_stage_meshes(context: BuildContext, decisions: list[PipelineDecision], pins: Pins,
                       time_limit: float) -> list[PipelineDecision]:
    """Each joint decision followed by its per-stage mesh alternative where that is
    faster (`shaped_decision`): the finalists compare both built."""
    found = []
    modes = recompute_modes(pins)
    for decision in decisions:
        found.append(decision)
        shaped = shaped_decision(context.graphs, context.hardware, decision,
                                 context.training, modes, time_limit, pins.layout,
                                 other_depths=pins.pp is None)
        if shaped is not None:
            found.append(shaped)
    return found


def _eligible(name: str, baseline: Derived, options: SearchOptions, pins: Pins) -> bool:
    """Whether a baseline answers the problem the user asked: no strategies of their own,
    their mesh if they named one, and every pin it satisfies (the Megatron baseline is the
    `layout=megatron` pin's op-level plan)."""
    parallel = baseline.parallel
    mesh = baseline.summary.mesh
    return (not options.strategies and options.mesh in (None, mesh)
            and pins.admit(parallel.dp, parallel.tp, "megatron" if name == "megatron" else None)
            and pins.sp in (None, parallel.sp))


def _op_level(context: BuildContext, results: list[MeshResult], options: SearchOptions,
              started: float, finalists: Finalists) -> None:
    """Per mesh shape with a plan, its decision built and exactly priced; a row for every
    mesh (the priced plan, or the reason there is none)."""
    feasible = [r for r in results if r.decision is not None and r.solution is not None
                and r.solution.status in ("optimal", "feasible")]
    feasible.sort(key=lambda r: r.solution.objective)  # type: ignore[union-attr]
    # The ILP prices a weight used twice (a tied embedding) once per use; the built plan
    # sums its gradient once. Compare the candidates by the built, exact price.
    built: dict[Hashable, Derived] = {}
    for result in feasible:
        assert result.decision is not None
        solver = result.decision.solver
        record = replace(solver, time_s=time.perf_counter() - started, detail=replace(
            solver.detail, mode=options.mode, meshes_tried=len(results),
            tied_layers=bool(options.tie_layers) and ties_layers(context.graphs.root.blocks)))
        key = _flat_key(result.decision)
        if key is not None and key in built:  # the same plan on another mesh's axes
            finalists.add(built[key], record, Search.OP_LEVEL, on=result.decision.mesh)
            continue
        derived = derive(context, result.decision)
        if key is not None:
            built[key] = derived
        finalists.add(derived, record, Search.OP_LEVEL)
    for r in results:
        if r not in feasible:
            finalists.unplanned(_unplanned(r), Search.OP_LEVEL)


def _flat_key(decision: OpLevelDecision) -> Hashable | None:
    """What makes an op-level decision the same plan as another on a mesh of as many
    devices, where every op splits at most one label, over all the mesh's axes in their
    order (or nothing): each device then holds the same blocks and every collective spans
    all devices, so layouts, collectives and prices match those on a one-axis mesh. None
    where some op splits otherwise."""
    axes = decision.mesh.axis_names
    split = []
    for name, strategy in decision.strategies.items():
        if not strategy.assignment:
            continue
        if len(strategy.assignment) != 1 or strategy.assignment[0][1] != axes:
            return None
        split.append((name, strategy.assignment[0][0]))
    return (decision.mesh.size, decision.mesh.devices_per_node, decision.degrees,
            tuple(sorted(split)))


def _alternative(derived: Derived, record: SolverRecord,
                 on: DeviceMesh | None = None) -> Alternative:
    """A built finalist as `alternatives` lists it: its exact price and memory; with `on`,
    listed on that mesh (the same plan on its axes)."""
    brief = derived.brief()
    if on is not None:
        brief = replace(brief, mesh=tuple(on.shape), axes=tuple(on.axis_names))
    return Alternative(brief.mesh, brief.axes, record.status, derived.predicted.step_time_s,
                       record.gap, "", record.name, False, brief)


def _unplanned(result: MeshResult) -> Alternative:
    solution = result.solution
    planned = solution is not None and bool(solution.choice)
    return Alternative(
        tuple(result.mesh.shape), tuple(result.mesh.axis_names),
        solution.status if solution else "skipped",
        solution.objective if planned and solution else float("inf"),
        solution.gap if planned and solution else None, result.reason)


def _reasons(results: list[MeshResult]) -> str:
    return "; ".join(f"{'x'.join(map(str, r.mesh.shape))}: "
                     f"{r.reason or (r.solution.status if r.solution else 'no plan')}"
                     for r in results)


def _baseline_briefs(context: BuildContext, devices: int) -> dict:
    return {name: derive(context, decision).brief()
            for name, decision in baselines(context.graphs.root, context.hardware,
                                            devices).items()}
