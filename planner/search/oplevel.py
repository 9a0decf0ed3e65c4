"""The op-level search: for each mesh shape, the cheapest strategy per op.

For each mesh shape (every factorisation of the device count into 1..max axes, or the one
the user pinned) the strategy problem is built and solved. Each mesh with a plan gives an
`OpLevelDecision`; the plan builder prices it exactly and the caller keeps the fastest
that fits. Meshes are solved in parallel processes when there are several and the problem
is large enough to pay for the process start.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from costmodels.profile import HardwareProfile
from planner.cost.oplevel import priced_choice
from planner.cost.step import TrainingOptions
from planner.errors import ShardplanError, StrategyError
from planner.graph import PlanningGraph
from planner.humanize import human_seconds
from planner.kinds import GENERIC_AXES, AxisRole
from planner.records import SolverDetail, SolverRecord
from planner.search.decisions import OpLevelDecision
from planner.search.ilp import Solution
from planner.search.layers import tie_classes
from planner.search.options import Pins, SearchOptions
from planner.search.problem import (
    StrategyProblem,
    build_problem,
    prune_dominated,
    restrict_candidates,
)
from planner.search.solve import BEATEN, Engine, solve
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.batch import data_parallel_strategies, dp_splits_exactly
from planner.sharding.convert import strategy_from_tuples
from planner.sharding.mesh import DeviceMesh, factorizations
from planner.sharding.strategy import OpStrategy

PARALLEL_PROCESS_THRESHOLD = 4000  # candidates: below this, one process is faster


@dataclass(frozen=True)
class MeshCandidate:
    """A mesh to plan on. With `replicas` > 1 its outermost axis only repeats the work (no
    op splits over it, no collective runs along it): the plan is the best plan of the
    inner mesh, solved on that smaller problem, repeated over the replicas. The replica
    axis is outermost because it never communicates: the inner axes keep the fastest
    links, so a 64-device plan is never worse than an 8-device one replicated 8 times."""

    mesh: DeviceMesh
    replicas: int = 1

    @property
    def searched(self) -> DeviceMesh:
        """The mesh the strategies are searched on: without the replica axis."""
        if self.replicas == 1:
            return self.mesh
        return DeviceMesh(self.mesh.shape[1:], self.mesh.axis_names[1:],
                          self.mesh.devices_per_node)

    @classmethod
    def replicated(cls, replicas: int, shape: Sequence[int], names: Sequence[str],
                   per_node: int) -> MeshCandidate:
        return cls(DeviceMesh((replicas, *shape), (REPLICA_AXIS, *names), per_node), replicas)


#: the name of a `MeshCandidate`'s outer replica axis (pinned and searched meshes alike)
REPLICA_AXIS = str(AxisRole.REPLICA)


@dataclass(frozen=True)
class MeshResult:
    """One mesh shape's outcome: its decision, or why it has none."""

    mesh: DeviceMesh
    solution: Solution | None
    reason: str = ""  # why this mesh has no plan
    decision: OpLevelDecision | None = None


def candidate_meshes(devices: int, profile: HardwareProfile, options: SearchOptions,
                     pins: Pins) -> list[MeshCandidate]:
    """Mesh shapes to try, with axis names ("dp", "tp" when pinned, else a0, a1, ...). Pinned
    degrees that use fewer devices than there are, or leave the other degree free, also get
    meshes whose outer replica axis holds the rest (`MeshCandidate`)."""
    per_node = int(profile.devices_per_node.value)
    if pins.mesh_axes:
        return _pinned_meshes(devices, per_node, pins)
    if options.mesh is not None:
        shape = options.mesh
        if _product(shape) != devices:
            raise ShardplanError(
                f"--mesh {'x'.join(map(str, shape))} has {_product(shape)} devices, but "
                f"--devices is {devices}")
        return [MeshCandidate(DeviceMesh(tuple(shape), GENERIC_AXES[: len(shape)], per_node))]
    shapes = factorizations(devices, options.max_mesh_axes)
    return [MeshCandidate(DeviceMesh(shape, GENERIC_AXES[: len(shape)], per_node))
            for shape in shapes]


def _pinned_meshes(devices: int, per_node: int, pins: Pins) -> list[MeshCandidate]:
    """(dp, tp) meshes of the pinned degrees: the free one (if any) takes the devices
    left, or any divisor of them with the rest on a replica axis."""
    pinned = (pins.dp or 1) * (pins.tp or 1)
    if devices % pinned:
        raise ShardplanError(
            f"--parallel dp={pins.dp or 'any'} tp={pins.tp or 'any'} uses a multiple of "
            f"{pinned} devices, but --devices is {devices}; make dp × tp divide the device "
            "count")
    rest = devices // pinned
    free = [1] if pins.dp is not None and pins.tp is not None else \
        [d for d in range(1, rest + 1) if rest % d == 0]
    result = []
    for extra in free:
        dp = pins.dp if pins.dp is not None else extra
        tp = pins.tp if pins.tp is not None else extra
        inner = DeviceMesh.build({AxisRole.DATA: dp, AxisRole.TENSOR: tp}, per_node)
        replicas = devices // (dp * tp)
        result.append(MeshCandidate(inner) if replicas == 1 else MeshCandidate.replicated(
            replicas, inner.shape, inner.axis_names, per_node))
    return result


def replicates(result: MeshResult) -> bool:
    """Whether a mesh's plan leaves an axis (of more than one device) unused: its devices
    along that axis repeat each other's work."""
    if result.decision is None:
        return False
    used = {axis for strategy in result.decision.strategies.values()
            for _, axes in strategy.assignment for axis in axes}
    return any(size > 1 and axis not in used
               for axis, size in zip(result.mesh.axis_names, result.mesh.shape, strict=True))


def replica_meshes(analysis: GraphAnalysis, devices: int, profile: HardwareProfile,
                   options: SearchOptions, pins: Pins, results: Sequence[MeshResult]
                   ) -> list[MeshCandidate]:
    """Two-axis plans inside a node repeated over an outer replica axis (the third axis
    the default `--max-mesh-axes 2` does not search), for unpinned searches. A replica
    never communicates, so it pays where a model is too small for the links between
    nodes: each divisor d of a node's devices (and of the device count) whose compute
    floor (the step's FLOPs at the profile's highest peak over d devices) is below the
    fastest plan of `results`. Plans of d devices across nodes are not repeated: the
    native two-axis meshes already hold those with one axis left unused. They are tried
    only when that fastest plan itself leaves an axis unused (the model cannot put every
    device to work), so a model that uses them all pays no search time for them."""
    planned = [r for r in results if r.decision is not None and r.solution is not None]
    if options.mesh is not None or pins.mesh_axes or options.max_mesh_axes != 2 \
            or not planned:
        return []
    fastest = min(planned, key=lambda r: r.solution.objective)  # type: ignore[union-attr]
    if not replicates(fastest):
        return []
    assert fastest.solution is not None
    best = fastest.solution.objective
    per_node = int(profile.devices_per_node.value)
    flops = 3.0 * sum(node.flops for node in analysis.graph.ops)  # forward + backward
    peak = max(float(cited.value) for cited in profile.peak_flops.values())
    result = []
    for inner in range(4, min(per_node, devices - 1) + 1):
        if per_node % inner or devices % inner or flops / (inner * peak) >= best:
            continue
        for shape in factorizations(inner, 2):
            if len(shape) == 2:
                result.append(MeshCandidate.replicated(devices // inner, shape,
                                                       GENERIC_AXES[1:3], per_node))
    return result


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def matched_ops(graph: PlanningGraph, pattern: str) -> list[str]:
    """Op names a strategy pattern selects: the op of that exact name (looked up in the
    graph's index: a file naming each of 50,000 ops listed them all per entry), else the
    ops the glob matches; an error naming the pattern if none."""
    if graph.has_op(pattern):
        return [pattern]  # an exact name, even one with glob characters ('attn[0]')
    names = [node.name for node in graph.ops]
    matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
    if not matched:
        close = [n for n in names if pattern.lower().strip("*") in n.lower()][:5] or names[:5]
        raise StrategyError(
            f"strategy pattern {pattern!r} matches no op of {graph.path}; op names "
            f"look like: {', '.join(close)}, ..."
        )
    return matched


def resolve_patterns(analysis: GraphAnalysis, given: Mapping[str, Sequence[Sequence[int]]]
                     ) -> dict[str, Sequence[Sequence[int]]]:
    """`op name -> tuples` from `name or glob -> tuples`, whatever the order of the entries:
    an op's exact-name entry wins over every glob that matches it; two globs that match
    one op and give it different tuples are refused naming both (file order would decide,
    and a JSON object has none)."""
    chosen: dict[str, tuple[str, Sequence[Sequence[int]]]] = {}
    graph = analysis.graph
    exact = {pattern for pattern in given if graph.has_op(pattern)}
    for pattern, tuples in given.items():
        for name in matched_ops(graph, pattern):
            if name in exact and pattern != name:
                continue  # the op's own entry decides
            if name in chosen and _as_lists(chosen[name][1]) != _as_lists(tuples):
                raise StrategyError(
                    f"op {name} is matched by the strategy patterns {chosen[name][0]!r} and "
                    f"{pattern!r}, which give it different strategies "
                    f"({_as_lists(chosen[name][1])} and {_as_lists(tuples)}); give the op its "
                    "own entry (an exact op name wins over any pattern) or narrow a pattern"
                )
            chosen[name] = (pattern, tuples)
    return {name: tuples for name, (_, tuples) in chosen.items()}


def _as_lists(tuples: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(t) for t in tuples]


def fixed_strategies(analysis: GraphAnalysis, mesh: DeviceMesh,
                     given: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, OpStrategy]:
    """Resolve `name or glob pattern -> MindSpore tuples` into strategies on `mesh`
    (`resolve_patterns` says which entry an op takes)."""
    graph = analysis.graph
    fixed: dict[str, OpStrategy] = {}
    for name, tuples in resolve_patterns(analysis, given).items():
        node = graph.op(name)
        op_labels = analysis.labels.get(name)
        if op_labels is None:
            raise StrategyError(f"op {name} ({node.op_type}) has no sharding rule; it "
                                "can only run replicated, so it cannot take a strategy")
        fixed[name] = strategy_from_tuples(node, op_labels, graph.tensors, mesh,
                                           [tuple(t) for t in tuples])
    return fixed


def _restrict_pinned(problem: StrategyProblem, analysis: GraphAnalysis,
                     mesh: DeviceMesh) -> None:
    """With --parallel dp=..: the dp axis splits exactly the batch, as data parallelism does."""
    if AxisRole.DATA not in mesh.axis_names:
        return
    batch = data_parallel_strategies(analysis.graph, DeviceMesh.build(
        {AxisRole.DATA: mesh.axis_size(AxisRole.DATA)}, mesh.devices_per_node),
        analysis.labels)
    for index, group in enumerate(problem.groups):
        wanted = dict(batch[group.ops[0]].assignment)  # {batch label: ("dp",)} or {}
        keep = [position for position, candidate in enumerate(group.candidates)
                if dp_splits_exactly(dict(candidate.strategy.assignment), wanted)]
        restrict_candidates(problem, index, keep or list(range(len(group.candidates))))


def solve_mesh(analysis: GraphAnalysis, candidate: MeshCandidate, profile: HardwareProfile,
               options: SearchOptions, training: TrainingOptions, pins: Pins,
               beat: float | None = None) -> MeshResult:
    """The mesh's optimum under the options (pins, strategies, tied layers), searched on
    the mesh without its replica axis; none where `beat` (the step of a plan found
    elsewhere) is below a bound on every plan of the mesh (`Engine.beat`)."""
    mesh = candidate.searched
    try:
        fixed = fixed_strategies(analysis, mesh, options.strategies)
    except StrategyError as exc:
        if options.mesh is not None or pins.given():
            raise
        return MeshResult(candidate.mesh, None, f"user strategies do not fit: {exc}")
    classes = tie_classes(analysis.graph, analysis.blocks if options.tie_layers else (),
                          fixed)
    problem = build_problem(analysis, mesh, profile, training, fixed, classes)
    if pins.mesh_axes:
        try:
            _restrict_pinned(problem, analysis, mesh)
        except StrategyError as exc:  # this dp degree does not split the batch
            return MeshResult(candidate.mesh, None, str(exc))
    prune_dominated(problem)
    solution = _within_memory(analysis, problem, profile, training,
                              Engine(options.solver, options.time_limit, beat))
    if solution.status == BEATEN and beat is not None:
        return MeshResult(candidate.mesh, None,
                          f"every plan takes at least {human_seconds(solution.bound)}, "
                          f"more than the {human_seconds(beat)} of a plan already found")
    if not solution.choice:
        return MeshResult(candidate.mesh, solution)
    degrees = None
    if pins.mesh_axes:  # the user's pins name the mesh axes: report them as given
        degrees = (mesh.axis_size(AxisRole.DATA), mesh.axis_size(AxisRole.TENSOR))
    decision = OpLevelDecision(candidate.mesh, problem.strategies(solution.choice),
                               record_of(solution), degrees)
    return MeshResult(candidate.mesh, solution, decision=decision)


#: Solves again with the memory limit lowered by what the built plan outgrew it by
MAX_MEMORY_RESOLVES = 3
#: The built peak is priced only for an optimum whose counted memory is at least this
#: share of the limit: pricing a whole graph per mesh costs seconds on large graphs, and
#: the measured gaps between the count and the built peak are a fraction of the count
#: (llama-tiny's 2x2 optimum: 1.2x)
CHECKED_SHARE = 0.5


def _within_memory(analysis: GraphAnalysis, problem: StrategyProblem,
                   profile: HardwareProfile, training: TrainingOptions,
                   engine: Engine) -> Solution:
    """The problem's optimum whose built plan fits the device. The strategy problem
    counts memory as a sum per op (weights, saved activations, the largest workspace);
    the plan builder prices the step's peak (`planner.cost.oplevel`), which can be more:
    an optimum the problem fits can outgrow the device once built, and the mesh then had
    no plan although another choice fits (llama-tiny on a 2x2 mesh under a limit: the
    fastest built to 1.2x its counted memory, the least-memory choice fits). Where the
    built peak is over the limit, the problem's limit is lowered by the difference
    between the built peak and its own count, and solved again."""
    limit = problem.memory_limit
    solution = solve(problem, engine)
    for _ in range(MAX_MEMORY_RESOLVES):
        counted = problem.evaluate(solution.choice)[1] if solution.choice else 0.0
        if not solution.choice or counted < CHECKED_SHARE * limit:
            break  # far below the device: the step's peak is not priced here for nothing
        strategies = problem.strategies(solution.choice)
        peak = priced_choice(analysis, problem.mesh, strategies, profile,
                             training).step().peak_memory
        if peak <= limit:
            break
        problem.memory_limit -= max(peak - counted, peak - limit)
        if problem.memory_limit <= 0:
            break
        again = solve(problem, engine)
        if not again.choice:
            break
        solution = again
    problem.memory_limit = limit
    return solution


def record_of(solution: Solution) -> SolverRecord:
    """A solver's report as the decision carries it: its counts, and its note when the
    time limit cut the ILP short."""
    detail = dict(solution.detail)
    note = detail.pop("note", None)
    counts = {k: v for k, v in detail.items() if isinstance(v, int | float)}
    return SolverRecord(solution.solver, solution.status, solution.objective, solution.bound,
                        solution.gap, solution.time_s,
                        SolverDetail(note=note, counts=counts, solve_time_s=solution.time_s))


#: The graph every worker of one `search_meshes` pool plans (`_share`): handed to each
#: worker once as it starts (inherited where processes fork, with the memos the parent
#: filled, such as its kernel plan), not pickled with every mesh.
_shared: GraphAnalysis | None = None


def _share(analysis: GraphAnalysis) -> None:
    global _shared
    _shared = analysis


def _solve_in_process(args: tuple) -> MeshResult:
    assert _shared is not None, "a search_meshes worker starts with the graph (_share)"
    return solve_mesh(_shared, *args)


def search_meshes(analysis: GraphAnalysis, profile: HardwareProfile,
                  meshes: list[MeshCandidate], options: SearchOptions,
                  training: TrainingOptions, pins: Pins,
                  progress: Callable[[str], None] | None = None,
                  beat: float | None = None) -> list[MeshResult]:
    """Every mesh's outcome, in the order of `meshes` (`solve_mesh`: none for a mesh no
    plan of which can be faster than `beat`)."""
    results: list[MeshResult] = []
    args = [(mesh, profile, options, training, pins, beat) for mesh in meshes]
    if len(meshes) > 2 and options.workers > 1 and _large(analysis, meshes[-1].searched):
        with ProcessPoolExecutor(max_workers=min(options.workers, os.cpu_count() or 1),
                                 initializer=_share, initargs=(analysis,)) as pool:
            for result in pool.map(_solve_in_process, args):
                results.append(result)
                _report(progress, result)
    else:
        for arg in args:
            result = solve_mesh(analysis, *arg)
            results.append(result)
            _report(progress, result)
    return results


def _large(analysis: GraphAnalysis, mesh: DeviceMesh) -> bool:
    return len(analysis.graph.ops) * (len(mesh.shape) ** 3) * 4 > PARALLEL_PROCESS_THRESHOLD


def _report(progress: Callable[[str], None] | None, result: MeshResult) -> None:
    if progress is None:
        return
    shape = "x".join(map(str, result.mesh.shape))
    if result.solution is None:
        progress(f"mesh {shape}: skipped ({result.reason})")
    else:
        progress(f"mesh {shape}: {result.solution.status} {result.solution.objective:.6g} s "
                 f"in {result.solution.time_s:.2f} s")
