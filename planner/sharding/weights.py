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

from planner.kinds import CollectiveKind, Phase

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
