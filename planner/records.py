"""The records every layer shares: plain data with its plan-file form, and no computation.

Memory by category, the step's time split, the predicted step, one priced collective,
one op's costs, and the solver's record. The cost layer fills them, the search reports
through them, the plan builder writes them into the Plan, and readers (the executor,
validate, explain, the exports) read them without importing any pricing or search code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from planner.kinds import CollectiveKind, Phase

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "workspace")


@dataclass(frozen=True)
class MemoryBreakdown(Mapping[str, Any]):
    """Bytes per device by category; `peak` is their sum.

    Read it by attribute, or by key like the plan file's `memory` object
    (`memory["peak"]`): it is a read-only mapping of the categories and `peak`. The stage
    search fills it with numpy arrays (one entry per stage range) before rounding.
    """

    parameters: Any
    gradients: Any
    optimizer: Any
    activations: Any
    workspace: Any

    @property
    def peak(self) -> Any:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.workspace)

    def __getitem__(self, key: str) -> Any:
        if key == "peak":
            return self.peak
        if key in MEMORY_CATEGORIES:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter((*MEMORY_CATEGORIES, "peak"))

    def __len__(self) -> int:
        return len(MEMORY_CATEGORIES) + 1

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemoryBreakdown:
        """The categories of a plan file's `memory` object (`workspace` may be absent in
        hand-written files); `peak` is recomputed from them."""
        return cls(**{f.name: data.get(f.name, 0) if f.name == "workspace" else data[f.name]
                      for f in fields(cls)})


@dataclass(frozen=True)
class Collective:
    """One collective of a plan with its price: what the run issues, per micro-batch
    (forward, backward) or per step (gradient), and the seconds it takes each time.

    Weight synchronisation is issued in buckets (`planner.cost.buckets`): the record stays
    one per tensor, `bucket` numbers the bucket it joins (tensors of one bucket share one
    collective call), and `time_s` is the tensor's share of that call."""

    kind: CollectiveKind
    tensor: str
    axes: tuple[str, ...]
    bytes: int
    phase: Phase
    op: str  # the consuming op, "optimizer" for weight synchronisation, or a stage send's
    time_s: float  # a bucketed weight collective: its share of the bucket's time
    bucket: int | None = None  # the bucket a weight collective is issued in (None: alone)


@dataclass(frozen=True)
class OpCost:
    """One op on one device, one micro-batch: compute seconds, the bytes of activations
    it keeps for the backward pass, and of its local outputs."""

    forward_s: float
    backward_s: float
    saved_bytes: float
    output_bytes: float

    def to_json(self) -> dict[str, float]:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s,
                "saved_bytes": self.saved_bytes, "output_bytes": self.output_bytes}


@dataclass(frozen=True)
class StepBreakdown(Mapping[str, float]):
    """The step time's parts on the busiest device, per step (micro-batches multiplied in).

    Read by attribute or by key like the plan file's `breakdown` object.
    """

    forward_s: float = 0.0  # compute
    backward_s: float = 0.0
    recompute_s: float = 0.0
    optimizer_s: float = 0.0
    forward_communication_s: float = 0.0  # op-level collectives
    backward_communication_s: float = 0.0
    p2p_s: float = 0.0  # between pipeline stages
    zero_s: float = 0.0  # ZeRO-2/3 collectives of every micro-batch
    gradient_communication_s: float = 0.0  # the whole end-of-step synchronisation
    hidden_communication_s: float = 0.0  # the part of it hidden behind backward compute
    bubble_s: float = 0.0  # pipeline fill and drain
    pipeline_s: float = 0.0  # a total, not a term: the schedule's time for all micro-batches

    def __getitem__(self, key: str) -> float:
        if key not in _BREAKDOWN_KEYS:
            raise KeyError(key)
        return float(getattr(self, key))

    def __iter__(self) -> Iterator[str]:
        return iter(_BREAKDOWN_KEYS)

    def __len__(self) -> int:
        return len(_BREAKDOWN_KEYS)

    def to_json(self) -> dict[str, float]:
        return {key: float(getattr(self, key)) for key in _BREAKDOWN_KEYS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepBreakdown:
        """Known keys of a plan file's `breakdown` (older files lack some: zero)."""
        return cls(**{key: float(data[key]) for key in _BREAKDOWN_KEYS if key in data})


_BREAKDOWN_KEYS = tuple(f.name for f in fields(StepBreakdown))


@dataclass(frozen=True)
class Predicted:
    """A plan's predicted step: time, its split, memory per device against the limit."""

    step_time_s: float
    compute_s: float
    communication_s: float
    memory: MemoryBreakdown
    memory_limit_bytes: int
    fits: bool
    breakdown: StepBreakdown = field(default_factory=StepBreakdown)

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "communication_s": self.communication_s, "memory": self.memory.to_json(),
                "memory_limit_bytes": self.memory_limit_bytes, "fits": self.fits,
                "breakdown": self.breakdown.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Predicted:
        return cls(float(data["step_time_s"]), float(data["compute_s"]),
                   float(data["communication_s"]), MemoryBreakdown.from_json(data["memory"]),
                   int(data["memory_limit_bytes"]), bool(data["fits"]),
                   StepBreakdown.from_json(data.get("breakdown", {})))


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


