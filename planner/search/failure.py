"""When no plan fits: the least memory any plan needs, and what would make one fit.

Also the cheap proof that no op-level plan can fit (`op_level_memory_floor`), which lets
the search skip the op-level meshes of a model only the pipeline can hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from costmodels.memory import gradient_bytes, optimizer_state_bytes
from costmodels.profile import HardwareProfile
from planner.cost.kernels import kernel_plan, policy_for
from planner.cost.step import TrainingOptions
from planner.errors import NoPlanFits, ShardplanError, StrategyError
from planner.humanize import human_bytes
from planner.search.ilp import solve_min_memory
from planner.search.joint import JointResult
from planner.search.layers import tie_classes
from planner.search.oplevel import fixed_strategies
from planner.search.problem import build_problem
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh


def op_level_memory_floor(analysis: GraphAnalysis, training: TrainingOptions,
                          profile: HardwareProfile) -> float:
    """Bytes all devices together hold under any op-level plan (one pass, no ZeRO, no
    recompute): every weight, gradient, optimizer state and saved activation lives on at
    least one device, so the busiest device holds at least this over the device count."""
    graph = analysis.graph
    weights = float(sum(p.nbytes for p in graph.parameters))
    if training.inference:
        return weights
    elements = float(sum(p.numel for p in graph.parameters))
    itemsize = graph.parameters[0].itemsize if graph.parameters else 4
    kept = kernel_plan(analysis, policy_for(profile, training.attention, training.fusion)).saved
    saved = float(sum(share * graph.tensors[name].nbytes for name, share in kept.items()))
    return (weights + gradient_bytes(elements, itemsize, training.precision)
            + optimizer_state_bytes(elements, itemsize, training.optimizer, training.precision)
            + saved)


def no_plan(analysis: GraphAnalysis, profile: HardwareProfile, devices: int,
            strategies: Mapping[str, Sequence[Sequence[int]]], time_limit: float,
            training: TrainingOptions, meshes: Sequence[DeviceMesh], reasons: str,
            joint: JointResult | None, where_devices: str = "") -> ShardplanError:
    """The smallest memory any plan needs, and what would make one fit (`where_devices`:
    how the devices are named, `devices × profile` unless given: a mixed cluster's
    groups).

    With the joint search, its least-memory configuration (most stages, ZeRO-3, full
    recompute) answers; otherwise a minimum-memory ILP per mesh does.
    """
    smallest = float("inf")
    where = ""
    if joint is not None:
        smallest, where = joint.smallest_memory, joint.smallest_where
    else:
        for mesh in meshes:
            try:
                fixed = fixed_strategies(analysis, mesh, strategies)
            except StrategyError:
                continue
            problem = build_problem(analysis, mesh, profile, training, fixed,
                                    tie_classes(analysis.graph, analysis.blocks))
            memory = solve_min_memory(problem, time_limit=min(time_limit, 30.0))
            if memory < smallest:
                smallest, where = memory, "mesh " + "x".join(map(str, mesh.shape))
    limit = training.memory_limit_bytes or int(profile.memory_bytes.value)
    if smallest == float("inf"):
        why = "; ".join(part for part in (reasons, *(joint.unformed if joint else ()))
                        if part)
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
        f"no plan fits {human_bytes(limit)} per device on "
        f"{where_devices or f'{devices} × {profile.name}'}: the "
        f"smallest any plan needs is {human_bytes(smallest)}{parts} ({where}). To fit: "
        f"{more}{levers}"
    )
