"""The one step model: a training (or inference) step's time and memory from its stages.

Every plan is priced here. A pipeline plan has one `StagePrice` per device stage; an
op-level plan is a pipeline of one stage and one micro-batch. The step is the schedule's
time for the stages' per-micro-batch times (`costmodels.schedule.pipeline_time`) plus, on
every device at once, the exposed gradient synchronisation and the optimizer pass
(`StepPrice`). `predicted` reports it as the plan file's `predicted` section: the busiest
device's compute and communication over the whole step, the bubble as the rest, and the
fullest device's memory. The search's objective and every plan's `predicted` come from
these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodels.schedule import pipeline_time
from planner.cost.buckets import DEFAULT_BUCKET_MB
from planner.kinds import (
    AttentionKernel,
    Fusion,
    GradAccumulation,
    LossReads,
    Precision,
    Recompute,
    Schedule,
)
from planner.records import MemoryBreakdown, Predicted, StepBreakdown


@dataclass(frozen=True)
class TrainingOptions:
    """What one step is: a training step (default) or a forward pass, and its settings."""

    optimizer: str = "adam"
    memory_limit_bytes: int | None = None  # None: the profile's device memory
    inference: bool = False  # forward only: no gradients, optimizer or saved activations
    overlap: float = 0.0  # share of gradient synchronisation hidden behind backward compute
    precision: Precision | None = None  # None: the graph's own (costmodels.precision)
    attention: AttentionKernel | None = None  # None: the profile's (device.kernels)
    fusion: Fusion | None = None  # None: the profile's
    #: None: the kernels' stack's (`planner.cost.kernels.accumulation_for`)
    accumulation: GradAccumulation | None = None
    bucket_mb: float = DEFAULT_BUCKET_MB  # weight collectives' bucket (MiB); 0: one per tensor
    #: whether the gradient reduction runs behind the backward pass (torch DDP and FSDP do;
    #: Megatron-LM only with `--overlap-grad-reduce`, default off) or after it
    overlap_grad_reduce: bool = True
    #: how the loss reads the graph's outputs (`planner.sharding.outputs.loss_layout`)
    loss_reads: LossReads = LossReads.ROWS


@dataclass(frozen=True)
class PipelineConfig:
    """The step's pipelining: stages, micro-batches, schedule, ZeRO stage."""

    pp: int = 1
    micro_batches: int = 1
    zero: int = 0
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per device (interleaved schedule)
    optimizer: str = "adam"
    overlap: float = 0.0
    precision: Precision | None = None  # None: the weights' own (costmodels.precision)
    fusion: Fusion | None = None  # None: the profile's (the optimizer step's kernels)
    accumulation: GradAccumulation | None = None  # None: the kernels' stack's
    bucket_mb: float = DEFAULT_BUCKET_MB
    overlap_grad_reduce: bool = True  # TrainingOptions.overlap_grad_reduce


@dataclass(frozen=True)
class StagePrice:
    """One pipeline device's share: its unit ranges, recompute mode, times and memory.

    Times are per micro-batch except `sync_s`, `hidden_s` and `optimizer_s` (per step).
    `optimizer_s` holds, beside the optimizer pass, the host's own time per step where the
    profile states one (`device.host_step_s`: a CPU rank's loss and Python bookkeeping).
    """

    ranges: tuple[tuple[int, int], ...]  # [first unit, end unit) per chunk
    recompute: Recompute
    forward_compute_s: float
    backward_compute_s: float
    forward_communication_s: float  # the op-level collectives of the forward pass
    backward_communication_s: float
    recompute_s: float  # what the backward pass re-runs (compute and its collectives)
    p2p_s: float  # sends and receives between stages
    zero_s: float  # ZeRO-2/3 collectives of every micro-batch
    sync_s: float  # once per step: the exposed gradient reduction and parameter gathers
    hidden_s: float  # once per step: the part of the synchronisation overlap hides
    optimizer_s: float
    in_flight: float  # micro-batches whose activations the stage holds at its peak
    memory: MemoryBreakdown
    #: per chunk (unit range), its (forward, input backward, weight backward) seconds per
    #: micro-batch; they add up to `per_micro_batch_s`. The schedules without a closed
    #: form (interleaved with unequal chunks, the zero-bubble ones) are priced from them.
    chunks: tuple[tuple[float, float, float], ...] = ()
    #: of `backward_compute_s`, the weights' gradients (W of the zero-bubble schedules)
    weight_s: float = 0.0

    @property
    def forward_s(self) -> float:
        return self.forward_compute_s + self.forward_communication_s

    @property
    def backward_s(self) -> float:
        return self.backward_compute_s + self.backward_communication_s

    @property
    def per_micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.p2p_s + self.zero_s


@dataclass(frozen=True)
class StepPrice:
    config: PipelineConfig
    stages: tuple[StagePrice, ...]
    step_time_s: float
    pipeline_s: float

    @property
    def peak_memory(self) -> int:
        return max(s.memory.peak for s in self.stages)

    @property
    def busiest(self) -> StagePrice:
        return max(self.stages, key=lambda s: s.per_micro_batch_s)

    @property
    def fullest(self) -> StagePrice:
        return max(self.stages, key=lambda s: s.memory.peak)


def step_price(stages: Sequence[StagePrice], config: PipelineConfig) -> StepPrice:
    """The step: the pipeline's time for every micro-batch, then (on every device at once)
    the end-of-step gradient reduction and optimizer pass."""
    chunks = [s.chunks for s in stages] if all(s.chunks for s in stages) else None
    pipeline = pipeline_time([s.per_micro_batch_s for s in stages], config.micro_batches,
                             config.schedule, config.virtual_stages, chunks)
    tail = max(s.sync_s + s.optimizer_s for s in stages)
    return StepPrice(config, tuple(stages), pipeline + tail, pipeline)


def predicted(price: StepPrice, limit: int,
              stage_limits: Sequence[int] | None = None) -> Predicted:
    """The plan's figures: the busiest device's compute and communication over the step,
    the pipeline bubble as the rest, the fullest device's memory. With `stage_limits` (a
    mixed cluster's stages, each within its own kind's memory) the fullest is the stage
    nearest its own limit, and the plan fits when every stage does."""
    m = price.config.micro_batches
    busiest = price.busiest
    compute = m * (busiest.forward_compute_s + busiest.backward_compute_s
                   + busiest.recompute_s) + busiest.optimizer_s
    communication = m * (busiest.forward_communication_s + busiest.backward_communication_s
                         + busiest.p2p_s + busiest.zero_s) + busiest.sync_s
    # One stage has no fill or drain: what is left is rounding, not a bubble.
    bubble = max(0.0, price.step_time_s - compute - communication) if len(
        price.stages) > 1 else 0.0
    memory = price.fullest.memory
    fits = memory.peak <= limit
    if stage_limits is not None:
        fullest = max(range(len(price.stages)),
                      key=lambda k: price.stages[k].memory.peak / stage_limits[k])
        memory, limit = price.stages[fullest].memory, stage_limits[fullest]
        fits = all(s.memory.peak <= lim
                   for s, lim in zip(price.stages, stage_limits, strict=True))
    return Predicted(
        step_time_s=price.step_time_s, compute_s=compute, communication_s=communication,
        memory=memory, memory_limit_bytes=int(limit), fits=fits,
        breakdown=StepBreakdown(
            forward_s=m * busiest.forward_compute_s, backward_s=m * busiest.backward_compute_s,
            recompute_s=m * busiest.recompute_s, optimizer_s=busiest.optimizer_s,
            forward_communication_s=m * busiest.forward_communication_s,
            backward_communication_s=m * busiest.backward_communication_s,
            p2p_s=m * busiest.p2p_s, zero_s=m * busiest.zero_s,
            gradient_communication_s=busiest.sync_s + busiest.hidden_s,
            hidden_communication_s=busiest.hidden_s, bubble_s=bubble,
            pipeline_s=price.pipeline_s,
        ),
    )
