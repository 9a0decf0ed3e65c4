"""What a search decides, and nothing it follows from: the seam between search and plan.

A search returns decisions: the mesh and a strategy per op (op-level), and for pipelines
the configuration, each device stage's units and its recompute mode. The plan builder
(`planner.plans.build`) derives everything else from a decision once: layouts,
collectives, stages' weights and sends, the predicted cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.kinds import Recompute, Schedule
from planner.records import SolverRecord
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy

Ranges = tuple[tuple[int, int], ...]


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
    #: copies of the (pp, dp, tp) configuration on the rest of the devices (a replica
    #: axis): a model that gains nothing from more dp ranks leaves them repeating its work
    replicas: int = 1
    #: Megatron's sequence parallelism over tp (`planner.search.megatron`): the joint
    #: search tries it beside the plain split when the layout is Megatron's
    sequence_parallel: bool = False
    #: context parallelism: the sequence split over a "cp" axis between dp and tp
    #: (`planner.sharding.batch.sequence_labels`); attention as a ring or Ulysses' head
    #: re-partitioning, whichever the op-level solve finds faster
    cp: int = 1
    #: expert parallelism: an "ep" axis inside dp splitting the batch with it outside expert
    #: layers and the stacked experts inside them (`planner.sharding.experts`)
    ep: int = 1

    def describe(self) -> str:
        sched = self.schedule + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        rep = f" rep={self.replicas}" if self.replicas > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        cp = f" ep={self.ep}" if self.ep > 1 else ""
        cp += f" cp={self.cp}" if self.cp > 1 else ""
        return (f"pp={self.pp} dp={self.dp}{cp} tp={self.tp}{sp} mb={self.micro_batches} "
                f"zero={self.zero} {sched}{rep}")


@dataclass(frozen=True)
class StageShape:
    """A device stage's own mesh shape and op-level choice, where the stages' shapes
    differ (per-stage meshes, `planner.search.stagemeshes.shaped_decision`): dp × tp is
    the stage's device count, its ranks a block of them (`planner.sharding.submeshes`);
    the strategies are solved on this shape for the whole graph, and the stage runs those
    of its own ops."""

    dp: int
    tp: int
    strategies: Mapping[str, OpStrategy]


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
    #: on a mixed cluster, the order of its device groups on the ranks
    #: (`costmodels.cluster.Placement`); empty on one kind of device
    order: tuple[int, ...] = ()
    #: on a mixed cluster, the rows of each micro-batch each data-parallel replica takes
    #: where shared by speed (`planner.search.stages.speed_rows`); empty: even shares
    rows: tuple[int, ...] = ()
    #: per device stage, its own (dp, tp) shape and strategies where the stages' shapes
    #: differ; empty: every stage runs `choice`'s shape with `strategies`
    shapes: tuple[StageShape, ...] = ()


Decision = OpLevelDecision | PipelineDecision
