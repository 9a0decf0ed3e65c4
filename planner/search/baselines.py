"""The baselines priced beside every plan: pure data parallel, and Megatron-style tp."""

from __future__ import annotations

import contextlib

from costmodels.profile import HardwareProfile
from planner.errors import StrategyError
from planner.kinds import AxisRole
from planner.records import SolverRecord
from planner.search.decisions import OpLevelDecision
from planner.search.megatron import megatron_strategies
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.batch import data_parallel_strategies
from planner.sharding.mesh import DeviceMesh

BASELINE = SolverRecord("baseline", "fixed", 0.0, 0.0, 0.0)


def data_parallel(analysis: GraphAnalysis, hardware: HardwareProfile, devices: int,
                  record: SolverRecord = BASELINE) -> OpLevelDecision:
    """The batch split over every device, weights replicated (StrategyError when the
    batch does not split)."""
    mesh = DeviceMesh.build({AxisRole.DATA: devices}, int(hardware.devices_per_node.value))
    return OpLevelDecision(mesh, data_parallel_strategies(analysis.graph, mesh, analysis.labels),
                           record, (devices, 1))


def baselines(analysis: GraphAnalysis, hardware: HardwareProfile,
              devices: int) -> dict[str, OpLevelDecision]:
    """Pure data parallel, and Megatron-style tp inside the node × dp across nodes (each
    where the model admits it)."""
    per_node = int(hardware.devices_per_node.value)
    result: dict[str, OpLevelDecision] = {}
    with contextlib.suppress(StrategyError):  # a batch that does not split: no baseline
        result["data-parallel"] = data_parallel(analysis, hardware, devices)
    tp = min(per_node, devices)
    if tp > 1 and devices % tp == 0:
        mesh = DeviceMesh.build({AxisRole.DATA: devices // tp, AxisRole.TENSOR: tp}, per_node)
        try:
            strategies = megatron_strategies(analysis.graph, mesh, analysis.labels,
                                             weight_roots=analysis.weight_roots)
            result["megatron"] = OpLevelDecision(mesh, strategies, BASELINE, (devices // tp, tp))
        except StrategyError:
            pass
    return result
