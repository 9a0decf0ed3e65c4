"""What `shardplan explain` says about a plan, as data: the Explanation and its parts.

`JSON_KEYS` are the keys of `shardplan explain --json` (plus `plots`, the files drawn).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SAME = 0.005  # step times within 0.5 % of each other count as equal


@dataclass
class UnitReport:
    """One unit's strategy, time per step on the devices that run it, and memory."""

    name: str
    ops: list[list[int]]
    op_count: int
    stage: int | None  # device stage holding it (pipeline plans)
    split: str  # the dominant split, e.g. "batch over dp + weights over tp"
    split_share: float  # share of the unit's compute time spent in ops split that way
    forward_s: float  # compute, per step
    backward_s: float
    recompute_s: float
    collective_s: float  # forward and backward collectives of its ops (not stage sends)
    gradient_sync_s: float  # reductions of the gradients of the weights it reads first
    parameter_bytes: int  # per device
    saved_bytes: int  # activations kept for the backward, per micro-batch

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.collective_s
                + self.gradient_sync_s)


@dataclass
class StageRow:
    """One pipeline device stage's own figures: per micro-batch, except the gradient
    synchronisation and optimizer (per step); memory per device."""

    device_stage: int
    units: list[list[str]]  # [first, last] unit name per chunk
    ranks: int
    recompute: str
    forward_s: float
    backward_s: float
    recompute_s: float
    p2p_s: float
    zero_s: float
    gradient_sync_s: float
    optimizer_s: float
    per_micro_batch_s: float
    in_flight: float  # micro-batches whose activations it holds at its peak
    memory: dict[str, int]
    groups: list[str] = field(default_factory=list)  # a mixed cluster's groups it runs on


@dataclass
class Term:
    """One term of the step time, with its share of the step."""

    name: str
    time_s: float
    share: float


@dataclass
class TopItem:
    """An op (or collective) class: the same position in every layer counts as one."""

    name: str
    count: int
    time_s: float  # per step, on the devices of the critical stage
    share: float


@dataclass
class Rival:
    """A plan the search priced beside this one, and what separates them."""

    name: str
    source: str  # "alternative" or "baseline"
    step_time_s: float | None
    ratio: float | None  # rival step time / this plan's
    fits: bool | None
    peak_memory_bytes: int | None
    verdict: str
    term: str | None = None  # the term that differs most
    this_s: float | None = None
    other_s: float | None = None


@dataclass
class Explanation:
    """What `shardplan explain --json` prints (its keys are JSON_KEYS, plus `plots`).

    source, model, cluster, mesh, parallel (with schedule, virtual_stages, global_batch),
    solver: what was planned and how. step_time_s; micro_batches; critical_stage: the
    device stage whose time sets the step (null without a pipeline). terms: the step time
    as named parts that add up to it. top_ops, top_collectives: classes by time per step.
    grouping: how the units were found; units: per unit its split, per-step times,
    weights and saved activations. stages: the pipeline stages' own figures. memory,
    memory_limit_bytes, fits: per device. rivals: alternatives and baselines with ratio,
    verdict and the term that differs most. communication: collective seconds per step by
    mesh-axis set × phase. notes: warnings and facts worth knowing.
    """

    source: str
    model: dict[str, Any]
    cluster: dict[str, Any]
    mesh: dict[str, Any]
    parallel: dict[str, Any]
    solver: dict[str, Any]
    step_time_s: float
    micro_batches: int
    critical_stage: int | None
    grouping: str
    terms: list[Term]
    top_ops: list[TopItem]
    top_collectives: list[TopItem]
    units: list[UnitReport]
    stages: list[StageRow]
    memory: dict[str, int]
    memory_limit_bytes: int
    fits: bool
    rivals: list[Rival]
    communication: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["units"] = [{**asdict(u), "total_s": u.total_s} for u in self.units]
        return data


JSON_KEYS = tuple(Explanation.__dataclass_fields__)
