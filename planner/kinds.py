"""The closed sets of names every layer shares: collective kinds, phases, schedules, ...

They are `StrEnum`s, so a value is also its plan-file string (`Phase.GRADIENT ==
"gradient"`): the JSON keeps its spelling, while code that builds, prices or reads a plan
names members the type checker knows. Each set is defined here once; the layers above
import it (this module imports nothing of the project).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CollectiveKind(StrEnum):
    """What one collective does (as torch.distributed, NCCL and HCCL name them)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"  # point to point, between pipeline stages


class Move(StrEnum):
    """One step of a redistribution over one mesh axis (`planner.sharding.redistribute`):
    the four that communicate are collectives of the same name; a slice keeps a local
    piece; zero makes a replicated tensor a pending sum held by one device."""

    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"
    ZERO = "zero"


class Phase(StrEnum):
    """When a planned collective runs: per micro-batch in the forward or backward pass, or
    once per step at the gradient synchronisation."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRADIENT = "gradient"


class Schedule(StrEnum):
    """Pipeline schedules (`costmodels.orders` has each one's order, `costmodels.schedule`
    its time and memory). The zero-bubble ones (Qi et al. 2023) split the backward pass
    into the inputs' gradients and the weights' gradients: ZB-H1 on one chunk per device,
    ZB-V (torch's `ScheduleZBVZeroBubble`) on two chunks per device laid in a V."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"


class Recompute(StrEnum):
    """Activation recomputation of one pipeline stage (Korthikanti et al. 2022).

    PER_STAGE is no mode of its own: `parallel.recompute` says it of a plan whose stages
    recompute differently (each stage's row names its mode)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    PER_STAGE = "per-stage"


#: The modes a stage can run.
RECOMPUTE_MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


class StepKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


class AxisRole(StrEnum):
    """The named mesh axes of pinned and pipelined plans; searched meshes name theirs
    a0, a1, a2 (`GENERIC_AXES`) and say in `parallel` what each turned out to do."""

    DATA = "dp"
    TENSOR = "tp"
    PIPELINE = "pp"
    #: repeats the work of the axes inside it: no op splits over it, nothing is reduced
    #: along it (a model too small to put every device to work)
    REPLICA = "rep"
    #: context parallelism: splits exactly the sequence (`planner.sharding.batch`'s trace
    #: of the sequence inputs); attention reads K and V over it as a ring or re-partitions
    #: heads (`ContextKind`)
    CONTEXT = "cp"
    #: expert parallelism: splits the batch with dp outside expert layers and the stacked
    #: experts inside them, tokens moved between the two by all-to-alls
    #: (`planner.sharding.experts`)
    EXPERT = "ep"


class ContextKind(StrEnum):
    """How attention runs over a sequence split on the context axis: RING passes K and V
    blocks round the axis, each step overlapped with a block of the core (Liu et al. 2023,
    Ring Attention); ULYSSES re-partitions sequence-split q, k, v to head-split with an
    all-to-all before the core and back after (Jacobs et al. 2023, DeepSpeed-Ulysses)."""

    RING = "ring"
    ULYSSES = "ulysses"


GENERIC_AXES = ("a0", "a1", "a2")


class Precision(StrEnum):
    """What a training step computes and stores in (`costmodels.precision` has the bytes
    and peaks of each). `-mixed` keeps fp32 master weights and fp32 main gradients."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP8 = "fp8"


class AttentionKernel(StrEnum):
    """How an attention core (QKᵀ → scale → mask → softmax → dropout → ·V) runs: one fused
    kernel (FlashAttention: no s² tensor in memory, the core recomputed in backward) or
    one kernel per op."""

    FLASH = "flash"
    EAGER = "eager"


class LossReads(StrEnum):
    """How the loss outside the graph reads the graph's outputs. `rows`: whole rows, each
    output with its batch split kept and every other dim gathered (a cross-entropy in
    torch on whole logits: what the executors run); `as-is`: in the layout the plan leaves
    them (a loss that works on split outputs, as Megatron-LM's vocabulary-parallel
    cross-entropy does), nothing moved or priced."""

    ROWS = "rows"
    AS_IS = "as-is"


class Fusion(StrEnum):
    """Whether chains of elementwise and normalisation ops between two GEMMs run as one
    kernel (one pass over memory, as torch.compile and Megatron's fused kernels do)."""

    ELEMENTWISE = "elementwise"
    #: Megatron-LM's own fused kernels (bias-GELU, bias-dropout-add, scale-mask-softmax):
    #: elementwise chains fuse, but a normalisation runs as a kernel of its own (apex's
    #: FusedLayerNorm), not merged with the residual addition before it
    MEGATRON = "megatron"
    NONE = "none"

    @property
    def fuses(self) -> bool:
        """Whether elementwise chains run as one kernel."""
        return self is not Fusion.NONE


class GradAccumulation(StrEnum):
    """How a weight's gradient of each micro-batch joins the gradient the step reduces:
    written into it by the weight-gradient GEMM itself (Megatron-LM's gradient accumulation
    fusion, Transformer Engine's `fuse_wgrad_accumulation`), or added to it by a kernel of
    its own (torch autograd's `AccumulateGrad`, Megatron-LM's main-gradient hook before
    the fusion)."""

    FUSED = "fused"
    SEPARATE = "separate"


@dataclass(frozen=True)
class Runnable:
    """What the executor a plan is for runs, where the search would choose from more:
    the pipeline schedules (None: every one it searches), whether per-stage meshes,
    context and expert parallelism, and replicas' shares of the batch by speed. The
    executors declare theirs (`executor.schedule.RUNNABLE`,
    `executor.support.MODULE_RUNNABLE`); the search reads it (`planner.search.options.
    Pins.runnable`); `shardplan plan --module` plans for the module executor. A pin the
    user gives stays theirs."""

    schedules: tuple[Schedule, ...] | None = None
    stage_meshes: bool = True
    context_parallel: bool = True
    expert_parallel: bool = True
    uneven_shares: bool = True  # a mixed cluster's replicas sharing the batch by speed
