"""The Python API: `plan(model, profile=..., devices=...) -> Plan`."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from costmodels.profile import HardwareProfile, load_profile

from planner.assemble import TrainingOptions, assemble, op_labels
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.onnx_import import import_model
from planner.planfile import ParallelConfig, Plan, SolverRecord
from planner.search.data_parallel import DP_AXIS, data_parallel_strategies
from planner.sharding.mesh import DeviceMesh

MODES = ("data",)
GIB = 1 << 30


def load_graph(
    model: str | os.PathLike | PlanningGraph,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
) -> PlanningGraph:
    """Import `model` unless it already is a planning graph."""
    if isinstance(model, PlanningGraph):
        return model
    return import_model(model, batch=batch, dims=dims)


def plan(
    model: str | os.PathLike | PlanningGraph,
    *,
    profile: str | os.PathLike | HardwareProfile = "a100-80g",
    devices: int = 8,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    mode: str = "data",
    optimizer: str = "adam",
    memory_limit_gib: float | None = None,
) -> Plan:
    """Plan a training step of `model` on `devices` devices of `profile`.

    The returned plan says in `plan.predicted.fits` whether it fits device memory; the
    CLI turns a plan that does not fit into exit code 3.
    """
    if mode not in MODES:
        raise ShardplanError(f"--mode {mode!r} is not available; choose one of {MODES}")
    hardware = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    hardware.check_device_count(devices)
    if memory_limit_gib is not None and memory_limit_gib <= 0:
        raise ShardplanError(f"--memory-limit {memory_limit_gib}: must be a positive GiB figure")
    graph = load_graph(model, batch=batch, dims=dims)
    started = time.perf_counter()
    mesh = DeviceMesh.build({DP_AXIS: devices}, int(hardware.devices_per_node.value))
    labels = op_labels(graph)
    strategies = data_parallel_strategies(graph, mesh, labels)
    options = TrainingOptions(
        optimizer=optimizer,
        memory_limit_bytes=int(memory_limit_gib * GIB) if memory_limit_gib else None,
    )
    parallel = ParallelConfig(dp=devices, optimizer=optimizer)
    draft = SolverRecord("data-parallel", "fixed", 0.0, 0.0, 0.0, 0.0)
    result = assemble(graph, mesh, strategies, hardware, parallel, draft, options, labels)
    step = result.predicted.step_time_s
    result.solver = SolverRecord(
        name="data-parallel", status="fixed", objective=step, bound=step, gap=0.0,
        time_s=time.perf_counter() - started,
        detail={"note": "the data-parallel baseline has one candidate: no search"},
    )
    return result
