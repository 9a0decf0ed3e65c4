"""What a search decides, and nothing it follows from: the seam between search and plan.

A search returns decisions: the mesh and a strategy per op (op-level), and for pipelines
the configuration, each device stage's units and its recompute mode. The plan builder
(`planner.plans.build`) derives everything else from a decision once: layouts,
collectives, stages' weights and sends, the predicted cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from planner.kinds import Recompute, Schedule
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy

Ranges = tuple[tuple[int, int], ...]


#: Wall-clock figures of a search: reported to the user, never written into the plan file,
#: so that the same inputs give a byte-identical plan.
WALL_CLOCK_DETAIL = ("solve_time_s",)


@dataclass(frozen=True)
class SolverDetail:
    """How the search reached the plan. `counts` are the engine's own figures (variables,
    constraints, groups, edges, steps, memory_bytes); the file writes them beside the
    named fields. `solve_time_s` is wall clock: reported, never written."""

    mode: str | None = None  # auto | semi
    meshes_tried: int | None = None
    tied_layers: bool | None = None
    pins: Mapping[str, int | str] | None = None  # the --parallel pins given
    chosen: str | None = None  # why the plan is not the search's own pick
    configurations: int | None = None  # joint search: configurations the pins allow
    priced: int | None = None  # joint search: configurations priced before it stopped
    surrogate_step_time_s: float | None = None
    stages: str | None = None  # how pipeline stages were chosen
    note: str | None = None
    counts: Mapping[str, float] = field(default_factory=dict)
    solve_time_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = dict(self.counts)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("counts", *WALL_CLOCK_DETAIL) or value is None:
                continue
            data[f.name] = dict(value) if f.name == "pins" else value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SolverDetail:
        named = {f.name for f in fields(cls)} - {"counts"}
        known = {k: v for k, v in data.items() if k in named}
        counts = {k: v for k, v in data.items() if k not in named
                  and isinstance(v, int | float) and not isinstance(v, bool)}
        return cls(**known, counts=counts)


@dataclass(frozen=True)
class SolverRecord:
    name: str
    status: str  # optimal | feasible | fixed | infeasible | unknown
    objective: float
    bound: float
    gap: float
    time_s: float = 0.0  # wall clock of the search; not serialised (see WALL_CLOCK_DETAIL)
    detail: SolverDetail = field(default_factory=SolverDetail)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "objective": self.objective,
                "bound": self.bound, "gap": self.gap, "detail": self.detail.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SolverRecord:
        return cls(data["name"], data["status"], float(data["objective"]),
                   float(data["bound"]), float(data["gap"]), float(data.get("time_s", 0.0)),
                   SolverDetail.from_json(data.get("detail", {})))


@dataclass(frozen=True)
class OpLevelDecision:
    """Every device runs the whole graph once per step: a mesh and a strategy per op."""

    mesh: DeviceMesh
    strategies: Mapping[str, OpStrategy]  # ops missing run replicated
    solver: SolverRecord
    degrees: tuple[int, int] | None = None  # (dp, tp) as the search names the axes;
    # None: the builder reads them off the strategies


@dataclass(frozen=True)
class Choice:
    """One point of the joint space (recompute is chosen per stage by the partition)."""

    pp: int
    dp: int
    tp: int
    micro_batches: int
    zero: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1

    def describe(self) -> str:
        sched = self.schedule + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"pp={self.pp} dp={self.dp} tp={self.tp} mb={self.micro_batches} "
                f"zero={self.zero} {sched}")


@dataclass(frozen=True)
class PipelineDecision:
    """A configuration of the joint search: the op-level choice of one stage (on the
    graph at the micro-batch), and each device stage's unit ranges and recompute mode."""

    choice: Choice
    micro_batch_size: int
    strategies: Mapping[str, OpStrategy]
    devices: tuple[Ranges, ...]  # per device stage: [first unit, end unit) per chunk
    recompute: tuple[Recompute, ...]
    solver: SolverRecord
    tp_pinned: bool = False  # the user named tp: report it as given


Decision = OpLevelDecision | PipelineDecision
