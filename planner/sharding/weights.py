"""What synchronising one weight issues, by ZeRO stage: the one table of weight collectives.

A weight whose gradient is summed over some mesh axes (the data-parallel axis, and any
other axis its consumers split work on) is synchronised once per step. ZeRO
(Rajbhandari et al. 2020) shards the optimizer state over that same group (stage 1), the
gradients too (stage 2: the reduce-scatter runs after every micro-batch so each rank keeps
only its chunk), and the weights too (stage 3: gathered before the forward and again before
the backward pass of every micro-batch). The pipeline price charges these steps, the plan
builder lists them, the executor runs what the plan lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.kinds import AxisRole, CollectiveKind, Phase
from planner.sharding.mesh import DeviceMesh

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class SyncStep:
    """One collective of a weight: per micro-batch (forward or backward phase) or once per
    step (gradient phase), over the weight's gradient axes."""

    kind: CollectiveKind
    phase: Phase

    @property
    def per_micro_batch(self) -> bool:
        return self.phase != Phase.GRADIENT


ZERO_STEPS: dict[int, tuple[SyncStep, ...]] = {
    0: (SyncStep(CollectiveKind.ALL_REDUCE, Phase.GRADIENT),),
    1: (SyncStep(CollectiveKind.REDUCE_SCATTER, Phase.GRADIENT),
        SyncStep(CollectiveKind.ALL_GATHER, Phase.GRADIENT)),
    2: (SyncStep(CollectiveKind.REDUCE_SCATTER, Phase.BACKWARD),
        SyncStep(CollectiveKind.ALL_GATHER, Phase.GRADIENT)),
    3: (SyncStep(CollectiveKind.ALL_GATHER, Phase.FORWARD),
        SyncStep(CollectiveKind.ALL_GATHER, Phase.BACKWARD),
        SyncStep(CollectiveKind.REDUCE_SCATTER, Phase.BACKWARD)),
}


def sync_steps(zero: int) -> tuple[SyncStep, ...]:
    """The collectives of one synchronised weight under ZeRO stage `zero`."""
    return ZERO_STEPS[zero]


@dataclass(frozen=True)
class WeightStep:
    """One collective synchronising a weight on one of the device stages holding it:
    `number` is its place among that stage's ZeRO steps (`sync_steps`), -1 for the sum
    between the holders of a weight two stages read (a tied embedding)."""

    holder: int
    number: int
    kind: CollectiveKind
    axes: tuple[str, ...]
    phase: Phase


def synced_axes(axes: tuple[str, ...], mesh: DeviceMesh) -> tuple[str, ...]:
    """The axes of `axes` this mesh has more than one device on: the group a weight's
    gradient synchronisation really runs over (empty: nothing to synchronise)."""
    return tuple(a for a in axes if a in mesh.axis_names and mesh.axis_size(a) > 1)


def weight_steps(axes: tuple[str, ...], holders: tuple[int, ...], zero: int,
                 backward_read: bool = True) -> tuple[WeightStep, ...]:
    """Every collective of one weight in a pipeline plan: its ZeRO stage's steps over its
    synced `axes` once per holding stage, and with two or more holders, the sum between
    them over the pipeline axis, once per holder. ZeRO 3's gather before the backward
    pass only where that pass reads the weight (`backward_read`: autograd kept it, or
    recompute re-reads it); the other steps keep their numbers."""
    steps: list[WeightStep] = []
    for holder in holders:
        steps += [WeightStep(holder, number, step.kind, axes, step.phase)
                  for number, step in enumerate(sync_steps(zero) if axes else ())
                  if backward_read or not (step.kind == CollectiveKind.ALL_GATHER
                                           and step.phase == Phase.BACKWARD)]
        if len(holders) > 1:
            steps.append(WeightStep(holder, -1, CollectiveKind.ALL_REDUCE,
                                    (str(AxisRole.PIPELINE),), Phase.GRADIENT))
    return tuple(steps)
