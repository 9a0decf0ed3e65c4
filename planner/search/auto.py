"""Search over mesh shapes and per-op strategies; price the baselines beside the result.

For each mesh shape (every factorisation of the device count into 1..max axes, or the one
the user pinned) the strategy problem is built and solved; the cheapest plan that fits
wins and the next ones are kept as alternatives for `explain`. Meshes are solved in
parallel processes when there are several and the problem is large enough to pay for the
process start.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from costmodels.profile import HardwareProfile
from costmodels.schedule import SCHEDULES
from planner.assemble import TrainingOptions, assemble, op_labels
from planner.errors import ShardplanError, StrategyError
from planner.graph import PlanningGraph
from planner.ops import DimLabels
from planner.planfile import ParallelConfig, Plan, SolverRecord
from planner.search.data_parallel import (
    DP_AXIS,
    data_parallel_strategies,
    dp_splits_exactly,
)
from planner.search.elimination import solve_elimination
from planner.search.ilp import Solution, solve_ilp
from planner.search.layers import find_repeats, tie_classes
from planner.search.megatron import megatron_strategies
from planner.search.pipeline import JointResult, plan_joint
from planner.search.problem import (
    StrategyProblem,
    build_problem,
    prune_dominated,
    restrict_candidates,
)
from planner.search.propagation import solve_propagation
from planner.sharding.convert import strategy_from_tuples
from planner.sharding.mesh import DeviceMesh, factorizations
from planner.sharding.strategy import OpStrategy
from planner.stages import RECOMPUTE_MODES

SOLVERS = ("auto", "cpsat", "highs", "dp", "propagation")
PARALLEL_KEYS = ("dp", "tp", "pp", "micro_batches", "zero", "recompute", "schedule")
JOINT_KEYS = ("pp", "micro_batches", "zero", "recompute", "schedule")  # only the joint search
GENERIC_AXES = ("a0", "a1", "a2")
PARALLEL_PROCESS_THRESHOLD = 4000  # candidates: below this, one process is faster


@dataclass(frozen=True)
class SearchOptions:
    mode: str = "auto"  # auto | semi
    solver: str = "auto"
    time_limit: float = 60.0
    max_mesh_axes: int = 2
    mesh: tuple[int, ...] | None = None
    parallel: Mapping[str, int | str] = field(default_factory=dict)
    strategies: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    tie_layers: bool = True
    top_k: int = 3
    workers: int = 2


@dataclass
class MeshResult:
    mesh: DeviceMesh
    solution: Solution | None
    reason: str = ""  # why this mesh has no plan
    strategies: dict[str, OpStrategy] = field(default_factory=dict)


@dataclass
class SearchResult:
    plan: Plan
    alternatives: list[dict]
    baselines: dict[str, Plan]


def candidate_meshes(devices: int, profile: HardwareProfile,
                     options: SearchOptions) -> list[DeviceMesh]:
    """Mesh shapes to try, with axis names ("dp", "tp" when pinned, else a0, a1, ...)."""
    per_node = int(profile.devices_per_node.value)
    pinned = {k: int(v) for k, v in options.parallel.items() if k in ("dp", "tp")}
    if pinned:
        dp = pinned.get("dp") or devices // max(1, pinned.get("tp", 1))
        tp = pinned.get("tp") or devices // max(1, dp)
        if dp * tp != devices:
            raise ShardplanError(
                f"--parallel dp={dp} tp={tp} uses {dp * tp} devices, but --devices is "
                f"{devices}; make dp × tp equal the device count"
            )
        return [DeviceMesh.build({"dp": dp, "tp": tp}, per_node)]
    if options.mesh is not None:
        shape = options.mesh
        if _product(shape) != devices:
            raise ShardplanError(
                f"--mesh {'x'.join(map(str, shape))} has {_product(shape)} devices, but "
                f"--devices is {devices}")
        return [DeviceMesh(tuple(shape), GENERIC_AXES[: len(shape)], per_node)]
    shapes = [f for f in factorizations(devices, options.max_mesh_axes)]
    return [DeviceMesh(shape, GENERIC_AXES[: len(shape)], per_node) for shape in shapes]


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def matched_ops(graph: PlanningGraph, pattern: str) -> list[str]:
    """Op names a strategy pattern (a name or glob) selects; an error naming it if none."""
    names = [node.name for node in graph.ops]
    matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
    if not matched:
        close = [n for n in names if pattern.lower().strip("*") in n.lower()][:5] or names[:5]
        raise StrategyError(
            f"strategy pattern {pattern!r} matches no op of {graph.path}; op names look "
            f"like: {', '.join(close)}, ..."
        )
    return matched


def fixed_strategies(graph: PlanningGraph, labels: Mapping[str, DimLabels | None],
                     mesh: DeviceMesh,
                     given: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, OpStrategy]:
    """Resolve `name or glob pattern -> MindSpore tuples` into strategies on `mesh`."""
    fixed: dict[str, OpStrategy] = {}
    for pattern, tuples in given.items():
        for name in matched_ops(graph, pattern):
            node = graph.op(name)
            op_labels_ = labels.get(name)
            if op_labels_ is None:
                raise StrategyError(f"op {name} ({node.op_type}) has no sharding rule; it "
                                    "can only run replicated, so it cannot take a strategy")
            fixed[name] = strategy_from_tuples(node, op_labels_, graph.tensors, mesh,
                                               [tuple(t) for t in tuples])
    return fixed


def _restrict_pinned(problem: StrategyProblem, graph: PlanningGraph, mesh: DeviceMesh,
                     labels: Mapping[str, DimLabels | None]) -> None:
    """With --parallel dp=..: the dp axis splits exactly the batch, as data parallelism does."""
    if "dp" not in mesh.axis_names:
        return
    batch = data_parallel_strategies(graph, DeviceMesh.build(
        {"dp": mesh.axis_size("dp")}, mesh.devices_per_node), labels)
    for index, group in enumerate(problem.groups):
        wanted = dict(batch[group.ops[0]].assignment)  # {batch label: ("dp",)} or {}
        keep = [position for position, candidate in enumerate(group.candidates)
                if dp_splits_exactly(dict(candidate.strategy.assignment), wanted)]
        restrict_candidates(problem, index, keep or list(range(len(group.candidates))))


def solve_mesh(graph: PlanningGraph, mesh: DeviceMesh, profile: HardwareProfile,
               options: SearchOptions, training: TrainingOptions,
               labels: Mapping[str, DimLabels | None]) -> tuple[MeshResult, StrategyProblem | None]:
    try:
        fixed = fixed_strategies(graph, labels, mesh, options.strategies)
    except StrategyError as exc:
        if options.mesh is not None or options.parallel:
            raise
        return MeshResult(mesh, None, f"user strategies do not fit: {exc}"), None
    repeats = find_repeats(graph) if options.tie_layers else None
    classes = tie_classes(graph, repeats)
    if fixed:  # a pinned op must not share a choice with ops pinned otherwise
        classes = _split_classes(classes, fixed)
    problem = build_problem(graph, mesh, profile, labels, training, fixed, classes)
    if options.parallel:
        _restrict_pinned(problem, graph, mesh, labels)
    prune_dominated(problem)
    solution = _solve(problem, options)
    strategies = problem.strategies(solution.choice) if solution.choice else {}
    return MeshResult(mesh, solution, strategies=strategies), problem


def _split_classes(classes: list[list[str]], fixed: Mapping[str, OpStrategy]) -> list[list[str]]:
    result = []
    for members in classes:
        keys: dict[object, list[str]] = {}
        for member in members:
            keys.setdefault(fixed.get(member), []).append(member)
        result += list(keys.values())
    return result


def _solve(problem: StrategyProblem, options: SearchOptions) -> Solution:
    """Run the chosen engine. "auto": the elimination DP when it reduces the whole graph
    and its plan fits (then it is optimal: the unconstrained optimum is feasible), else
    CP-SAT warm-started from the DP's or propagation's plan."""
    if options.solver == "propagation":
        return solve_propagation(problem)
    if options.solver in ("auto", "dp"):
        found = solve_elimination(problem)
        if found is not None and (found.status == "optimal" or options.solver == "dp"):
            return found
        hint = found.choice if found is not None else solve_propagation(problem).choice
        return _best_so_far(problem, solve_ilp(problem, time_limit=options.time_limit,
                                               solver="cpsat", hint=hint), hint)
    hint = solve_propagation(problem).choice
    solution = solve_ilp(problem, time_limit=options.time_limit, solver=options.solver,
                         hint=hint if options.solver == "cpsat" else None)
    return _best_so_far(problem, solution, hint)


def _best_so_far(problem: StrategyProblem, solution: Solution, hint: list[int]) -> Solution:
    """When the time limit ends the ILP before it found a plan, the warm start is the best
    plan so far: return it with the ILP's bound, so the gap says how far it may be off."""
    if solution.choice or not hint:
        return solution
    objective, memory = problem.evaluate(hint)
    status = "feasible" if memory <= problem.memory_limit else "unknown"
    bound = solution.bound if np.isfinite(solution.bound) else 0.0
    return Solution(list(hint), status, objective, min(bound, objective), solution.time_s,
                    f"{solution.solver}+warm-start",
                    {**solution.detail, "note": "the time limit ended the ILP before it "
                     "found a plan; this is its warm start"})


def _solve_in_process(args: tuple) -> tuple[MeshResult, None]:
    result, _ = solve_mesh(*args)
    return result, None


def search(graph: PlanningGraph, profile: HardwareProfile, devices: int,
           options: SearchOptions, training: TrainingOptions,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Op-level plans over mesh shapes, and (for training with a batch) the joint search
    over pipeline stages, micro-batches, ZeRO and recompute; the fastest plan that fits."""
    if options.solver not in SOLVERS:
        raise ShardplanError(f"--solver {options.solver!r}: choose one of {', '.join(SOLVERS)}")
    pins = check_pins(options.parallel)
    for pattern in options.strategies:  # a typo is the same on every mesh: say it once
        matched_ops(graph, pattern)
    started = time.perf_counter()
    labels = op_labels(graph)
    joint_only = any(k in pins for k in JOINT_KEYS)
    joint_wanted = (options.mode == "auto" and not training.inference and bool(graph.batch)
                    and options.mesh is None)
    if joint_only and not joint_wanted:
        raise ShardplanError(
            f"--parallel {', '.join(k for k in pins if k in JOINT_KEYS)}: pipeline stages, "
            "micro-batches, ZeRO and recompute are planned for training in --mode auto, for "
            "a model with a batch dimension (--batch) and without --mesh")
    plans: list[Plan] = []
    alternatives: list[dict] = []
    meshes: list[DeviceMesh] = []
    reasons = ""
    limit = training.memory_limit_bytes or int(profile.memory_bytes.value)
    floor = op_level_memory_floor(graph, training) / devices
    skip_op_level = joint_wanted and floor > limit
    if skip_op_level and progress is not None:
        from planner.report import human_bytes
        progress(f"op-level plans skipped: every one needs at least {human_bytes(floor)} "
                 "per device (weights, gradients, states and activations spread evenly)")
    if not joint_only and not skip_op_level:
        meshes = candidate_meshes(devices, profile, options)
        op_plans, alternatives, reasons = _op_level(graph, profile, meshes, options, training,
                                                    labels, started, progress)
        plans += op_plans
    joint = None
    if joint_wanted:
        joint_plans, joint = plan_joint(graph, profile, devices, training, pins,
                                        options.time_limit, options.top_k, progress)
        for plan in joint_plans:
            plan.solver.time_s = time.perf_counter() - started
            plan.solver.detail["mode"] = options.mode
        plans += joint_plans
        alternatives += [_plan_summary(p) for p in joint_plans]
    alternatives.sort(key=lambda a: a["objective"])
    fitting = [p for p in plans if p.predicted.fits]
    if not fitting:
        raise _no_plan(graph, profile, devices, options, training, labels, meshes, reasons,
                       joint)
    plan = min(fitting, key=lambda p: p.predicted.step_time_s)
    for alternative in alternatives:
        alternative["chosen"] = alternative.get("objective") == plan.predicted.step_time_s \
            and alternative.get("parallel") == dataclasses.asdict(plan.parallel) \
            and alternative["mesh"] == list(plan.mesh.shape)
    plan.solver.detail["pins"] = dict(pins)
    baselines = price_baselines(graph, profile, devices, training, labels)
    if not options.strategies and not options.parallel and options.mesh is None:
        for name, baseline in baselines.items():
            if baseline.predicted.fits and baseline.predicted.step_time_s < \
                    plan.predicted.step_time_s:
                record = plan.solver
                record.detail["chosen"] = f"the {name} baseline: cheaper under exact pricing"
                strategies = {op.name: OpStrategy.of(op.assignment) for op in baseline.ops}
                plan = assemble(graph, baseline.mesh, strategies, profile, baseline.parallel,
                                record, training, labels)
    return SearchResult(plan, alternatives[: max(1, options.top_k)], baselines)


def op_level_memory_floor(graph: PlanningGraph, training: TrainingOptions) -> float:
    """Bytes all devices together hold under any op-level plan (one pass, no ZeRO, no
    recompute): every weight, gradient, optimizer state and saved activation lives on at
    least one device, so the busiest device holds at least this over the device count."""
    from costmodels.memory import optimizer_state_bytes
    from planner.pricing import requires_grad_map

    weights = float(sum(p.nbytes for p in graph.parameters))
    if training.inference:
        return weights
    elements = float(sum(p.numel for p in graph.parameters))
    itemsize = graph.parameters[0].itemsize if graph.parameters else 4
    needs_grad = requires_grad_map(graph)
    saved = float(sum(graph.tensors[o].nbytes for node in graph.ops if not node.is_view
                      for o in node.outputs
                      if o and needs_grad.get(o, False) and graph.tensors[o].is_float))
    return 2 * weights + optimizer_state_bytes(elements, itemsize, training.optimizer) + saved


def check_pins(parallel: Mapping[str, int | str]) -> dict[str, int | str]:
    """The --parallel pins, checked: known keys, values in range."""
    unknown = [k for k in parallel if k not in PARALLEL_KEYS]
    if unknown:
        raise ShardplanError(f"--parallel {unknown[0]}: known keys are {', '.join(PARALLEL_KEYS)}")
    pins: dict[str, int | str] = {}
    for key, value in parallel.items():
        if key in ("recompute", "schedule"):
            allowed = RECOMPUTE_MODES if key == "recompute" else SCHEDULES
            if value not in allowed:
                raise ShardplanError(f"--parallel {key}={value}: choose one of "
                                     f"{', '.join(allowed)}")
            pins[key] = str(value)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardplanError(f"--parallel {key}={value}: must be an integer")
        low = 0 if key == "zero" else 1
        if value < low or (key == "zero" and value > 3):
            raise ShardplanError(f"--parallel {key}={value}: must be "
                                 f"{'0, 1, 2 or 3' if key == 'zero' else 'positive'}")
        pins[key] = value
    return pins


def _op_level(graph: PlanningGraph, profile: HardwareProfile, meshes: list[DeviceMesh],
              options: SearchOptions, training: TrainingOptions,
              labels: Mapping[str, DimLabels | None], started: float,
              progress: Callable[[str], None] | None) -> tuple[list[Plan], list[dict], str]:
    """Per mesh shape, the op-level optimum, assembled (and exactly priced)."""
    results: list[MeshResult] = []
    args = [(graph, mesh, profile, options, training, labels) for mesh in meshes]
    if len(meshes) > 2 and options.workers > 1 and _large(graph, meshes[-1]):
        with ProcessPoolExecutor(max_workers=min(options.workers, os.cpu_count() or 1)) as pool:
            for result, _ in pool.map(_solve_in_process, args):
                results.append(result)
                _report(progress, result)
    else:
        for arg in args:
            result, _ = solve_mesh(*arg)
            results.append(result)
            _report(progress, result)
    feasible = [r for r in results if r.solution is not None and r.solution.choice
                and r.solution.status in ("optimal", "feasible")]
    feasible.sort(key=lambda r: r.solution.objective)  # type: ignore[union-attr]
    reasons = "; ".join(f"{'x'.join(map(str, r.mesh.shape))}: "
                        f"{r.reason or (r.solution.status if r.solution else 'no plan')}"
                        for r in results)
    # The ILP prices a weight used twice (a tied embedding) once per use; the assembled plan
    # sums its gradient once. Compare the candidates by the assembled, exact price.
    plans = []
    for result in feasible:
        assert result.solution is not None
        solution = result.solution
        record = SolverRecord(
            name=solution.solver, status=solution.status, objective=solution.objective,
            bound=solution.bound, gap=solution.gap, time_s=time.perf_counter() - started,
            detail={**solution.detail, "mode": options.mode, "meshes_tried": len(meshes),
                    "tied_layers": bool(options.tie_layers), "solve_time_s": solution.time_s},
        )
        parallel = _parallel_of(graph, result.mesh, result.strategies, labels)
        if options.parallel:  # the user's pins name the mesh axes: report them as given
            parallel = ParallelConfig(dp=result.mesh.axis_size("dp"),
                                      tp=result.mesh.axis_size("tp"))
        plans.append(assemble(graph, result.mesh, result.strategies, profile, parallel, record,
                              training, labels))
    # Assembled plans are described by their exact price; meshes without one by the reason.
    alternatives = [_plan_summary(p) for p in plans] + [
        _summary(r) for r in results if r not in feasible]
    return plans, alternatives, reasons


def _plan_summary(plan: Plan) -> dict:
    """An assembled finalist as `alternatives` lists it: its exact price and memory."""
    return {**plan.brief(), "status": plan.solver.status, "objective": plan.predicted.step_time_s,
            "gap": plan.solver.gap, "reason": "", "solver": plan.solver.name}


def _large(graph: PlanningGraph, mesh: DeviceMesh) -> bool:
    return len(graph.ops) * (len(mesh.shape) ** 3) * 4 > PARALLEL_PROCESS_THRESHOLD


def _report(progress: Callable[[str], None] | None, result: MeshResult) -> None:
    if progress is None:
        return
    shape = "x".join(map(str, result.mesh.shape))
    if result.solution is None:
        progress(f"mesh {shape}: skipped ({result.reason})")
    else:
        progress(f"mesh {shape}: {result.solution.status} {result.solution.objective:.6g} s "
                 f"in {result.solution.time_s:.2f} s")


def _summary(result: MeshResult) -> dict:
    solution = result.solution
    return {
        "mesh": list(result.mesh.shape),
        "axes": list(result.mesh.axis_names),
        "status": solution.status if solution else "skipped",
        "objective": solution.objective if solution and solution.choice else float("inf"),
        "gap": solution.gap if solution and solution.choice else None,
        "reason": result.reason,
    }


def _parallel_of(graph: PlanningGraph, mesh: DeviceMesh, strategies: Mapping[str, OpStrategy],
                 labels: Mapping[str, DimLabels | None]) -> ParallelConfig:
    """dp: the axes that split the batch in the ops doing most of the work; tp: the other
    axes in use (an axis no op uses means replicated work, counted in neither).

    The batch label of each op is the one the data-parallel propagation splits; an axis
    counts as data parallel when it splits that label in ops holding most of the FLOPs.
    """
    flops_on: dict[str, float] = {axis: 0.0 for axis in mesh.axis_names}
    total = sum(node.flops for node in graph.ops) or 1.0
    # Splitting by the whole batch traces the batch label through every op that keeps it.
    tracer = data_parallel_strategies(graph, DeviceMesh.build(
        {DP_AXIS: graph.batch}, mesh.devices_per_node), labels) if graph.batch else {}
    for node in graph.ops:
        traced = dict(tracer.get(node.name, OpStrategy()).assignment)
        for label in traced:
            for axis in strategies[node.name].axes_of(label):
                flops_on[axis] += node.flops
    data_axes = {axis for axis, flops in flops_on.items() if flops > total / 2}
    used = {axis for strategy in strategies.values() for axis in strategy.used_axes}
    dp = tp = 1
    for axis in mesh.axis_names:
        if axis in data_axes:
            dp *= mesh.axis_size(axis)
        elif axis in used:  # an axis splitting weights or other dims; unused ones replicate
            tp *= mesh.axis_size(axis)
    return ParallelConfig(dp=dp, tp=tp)


def price_baselines(graph: PlanningGraph, profile: HardwareProfile, devices: int,
                    training: TrainingOptions,
                    labels: Mapping[str, DimLabels | None]) -> dict[str, Plan]:
    """Pure data parallel, and Megatron-style tp inside the node × dp across nodes."""
    per_node = int(profile.devices_per_node.value)
    result: dict[str, Plan] = {}
    record = SolverRecord("baseline", "fixed", 0.0, 0.0, 0.0, 0.0)
    try:
        mesh = DeviceMesh.build({DP_AXIS: devices}, per_node)
        strategies = data_parallel_strategies(graph, mesh, labels)
        result["data-parallel"] = assemble(graph, mesh, strategies, profile,
                                           ParallelConfig(dp=devices), record, training, labels)
    except StrategyError:
        pass
    tp = min(per_node, devices)
    if tp > 1 and devices % tp == 0:
        mesh = DeviceMesh.build({"dp": devices // tp, "tp": tp}, per_node)
        try:
            strategies = megatron_strategies(graph, mesh, labels)
            result["megatron"] = assemble(graph, mesh, strategies, profile,
                                          ParallelConfig(dp=devices // tp, tp=tp), record,
                                          training, labels)
        except StrategyError:
            pass
    for plan in result.values():
        step = plan.predicted.step_time_s
        plan.solver = SolverRecord("baseline", "fixed", step, step, 0.0, 0.0)
    return result


def _no_plan(graph: PlanningGraph, profile: HardwareProfile, devices: int,
             options: SearchOptions, training: TrainingOptions,
             labels: Mapping[str, DimLabels | None], meshes: list[DeviceMesh],
             reasons: str, joint: JointResult | None) -> ShardplanError:
    """The smallest memory any plan needs, and what would make one fit.

    With the joint search, its least-memory configuration (most stages, ZeRO-3, full
    recompute) answers; otherwise a minimum-memory ILP per mesh does.
    """
    from planner.errors import NoPlanFits
    from planner.report import human_bytes
    from planner.search.ilp import solve_min_memory

    smallest = float("inf")
    where = ""
    if joint is not None:
        smallest, where = joint.smallest_memory, joint.smallest_where
    else:
        for mesh in meshes:
            try:
                fixed = fixed_strategies(graph, labels, mesh, options.strategies)
            except StrategyError:
                continue
            problem = build_problem(graph, mesh, profile, labels, training, fixed,
                                    tie_classes(graph, find_repeats(graph)))
            memory = solve_min_memory(problem, time_limit=min(options.time_limit, 30.0))
            if memory < smallest:
                smallest, where = memory, "mesh " + "x".join(map(str, mesh.shape))
    limit = training.memory_limit_bytes or int(profile.memory_bytes.value)
    if smallest == float("inf"):
        why = "; ".join(joint.unformed) if joint is not None and joint.unformed else reasons
        return ShardplanError(f"no configuration of {devices} devices admits a plan: "
                              f"{why or 'no mesh or configuration could be formed'}")
    factor = smallest / limit
    levers = ("a smaller batch or sequence" if joint is not None else
              "a smaller batch, recompute or optimizer sharding, or pipeline stages")
    parts = ""
    if joint is not None and joint.smallest_memory_by_category:
        shown = {k: v for k, v in joint.smallest_memory_by_category.items() if k != "peak"}
        parts = " = " + ", ".join(f"{k} {human_bytes(v)}" for k, v in shown.items())
    more = f"about {max(2, int(factor + 0.999))}× more devices, or "
    return NoPlanFits(
        f"no plan fits {human_bytes(limit)} per device on {devices} × {profile.name}: the "
        f"smallest any plan needs is {human_bytes(smallest)}{parts} ({where}). To fit: "
        f"{more}{levers}"
    )
