"""The sections of a plan, as typed frozen records with their JSON form.

Sequences are tuples; `memory` and `breakdown` are typed records that also read like
the plan file's objects (`predicted.memory["peak"]`). Each section's JSON form is its
`to_json`/`from_json`; the JSON exists only at the plan file's edge (`planner.plans.model`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from planner.graph import DEFAULT_CAPACITY_FACTOR, RoutedSelection, SourceName, dtype_itemsize
from planner.kinds import (
    AttentionKernel,
    CollectiveKind,
    ContextKind,
    Fusion,
    GradAccumulation,
    LossReads,
    Phase,
    Precision,
    Recompute,
    Schedule,
    StepKind,
)
from planner.records import Collective, MemoryBreakdown, OpCost, StepBreakdown
from planner.sharding.derive import fraction_of_layout
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

SCHEMA = "shardplan.strategy/1"

Range = tuple[int, int]


@dataclass(frozen=True)
class ModelRef:
    path: str
    sha256: str
    bound_dims: Mapping[str, int]
    batch: int | None
    opset: int
    parameters: int
    #: what sized the routers' token selections (`planner.importer.routing`)
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR
    #: the routers' token selections it sized, in graph order
    routed: tuple[RoutedSelection, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bound_dims": dict(self.bound_dims),
                "batch": self.batch, "opset": self.opset, "parameters": self.parameters,
                "capacity_factor": self.capacity_factor,
                "routed": [selection.to_json() for selection in self.routed]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelRef:
        known = _known(cls, data)
        known["routed"] = tuple(RoutedSelection.from_json(s) for s in known.get("routed", ()))
        return cls(**known)


@dataclass(frozen=True)
class GroupRef:
    """A mixed cluster's device group as the plan placed it: ranks `first_rank` to
    `first_rank + devices - 1` are `profile` devices with `memory_bytes` each."""

    name: str
    profile: str
    devices: int
    devices_per_node: int
    first_rank: int
    memory_bytes: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.devices)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupRef:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class LinkRef:
    """The link between a mixed cluster's groups: what the sends crossing it are priced
    on (per-device bus bandwidth, line rate times efficiency, and latency)."""

    name: str
    bandwidth_Bps: float
    latency_s: float

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkRef:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ClusterRef:
    """The devices a plan is for: `devices` of `profile`, or on a mixed cluster (`groups`,
    in rank order, and the `link` between them) the lead group's profile, whose hardware
    the op layout was solved on."""

    profile: str
    devices: int
    nodes: int
    devices_per_node: int
    groups: tuple[GroupRef, ...] = ()
    link: LinkRef | None = None

    def describe(self) -> str:
        """`8 × a100-80g`, or a mixed cluster's groups: `16 × a100-80g + 16 × h100-sxm`."""
        if self.groups:
            return " + ".join(f"{g.devices} × {g.profile}" for g in self.groups)
        return f"{self.devices} × {self.profile}"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"profile": self.profile, "devices": self.devices,
                                "nodes": self.nodes, "devices_per_node": self.devices_per_node}
        if self.groups:
            data["groups"] = [g.to_json() for g in self.groups]
        if self.link is not None:
            data["link"] = self.link.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterRef:
        known = _known(cls, data)
        known["groups"] = tuple(GroupRef.from_json(g) for g in known.get("groups", ()))
        link = known.get("link")
        known["link"] = LinkRef.from_json(link) if link is not None else None
        return cls(**known)


@dataclass(frozen=True)
class ParallelConfig:
    """The plan's degrees as a user reads them; `recompute` is one mode or "per-stage".

    `sp` is 1 when the plan runs sequence parallelism (its activations between blocks are
    split along the sequence over tp: `planner.plans.sequence`), else 0, the meaning of the
    `--parallel sp` pin. `cp` is the context-parallel degree (the mesh's "cp" axis splits
    the sequence; 1 when unused) and `cp_kind` how attention runs over it, ring or Ulysses
    (`ContextKind`; written only where cp > 1). `ep` is the expert-parallel degree (the mesh's
    "ep" axis splits the batch with dp outside expert layers and the stacked experts
    inside them, `planner.sharding.experts`; 1 when unused). Files written
    before these keys read as 0, 1 and 1: no plan had them then. `dp_shares`, on a mixed
    cluster whose replicas run on different kinds, are the rows of each micro-batch each
    data-parallel replica takes (in the order of the dp axis), in proportion to its
    speed; empty (and absent from the file) where every replica takes the same."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    optimizer: str = "adam"
    sp: int = 0
    cp: int = 1
    ep: int = 1
    cp_kind: ContextKind | None = None
    dp_shares: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp,
                                 "micro_batches": self.micro_batches, "zero": self.zero,
                                 "recompute": str(self.recompute), "optimizer": self.optimizer,
                                 "sp": self.sp, "cp": self.cp, "ep": self.ep}
        if self.cp_kind is not None:
            found["cp_kind"] = str(self.cp_kind)
        if self.dp_shares:
            found["dp_shares"] = list(self.dp_shares)
        return found

    @property
    def even_shares(self) -> bool:
        """Whether every data-parallel replica takes the same rows (what executors run)."""
        return len(set(self.dp_shares)) <= 1

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParallelConfig:
        known = _known(cls, data)
        if "recompute" in known:
            known["recompute"] = _enum(Recompute, known["recompute"], "parallel.recompute")
        if "cp_kind" in known:
            known["cp_kind"] = _enum(ContextKind, known["cp_kind"], "parallel.cp_kind")
        if "dp_shares" in known:
            known["dp_shares"] = tuple(known["dp_shares"])
        return cls(**known)


@dataclass(frozen=True)
class StepSpec:
    """What one step is: a training step or a forward pass, the overlap priced, the
    precision and kernels it was priced in, and how its weight collectives are issued
    (bucket MiB; the gradient reduction behind the backward pass or after it); None (and
    the reduction behind the backward pass) in files written before they were recorded."""

    kind: StepKind = StepKind.TRAINING
    overlap: float = 0.0
    precision: Precision | None = None
    attention: AttentionKernel | None = None
    fusion: Fusion | None = None
    bucket_mb: float | None = None
    overlap_grad_reduce: bool = True
    #: how the loss reads the outputs; files written before it was recorded priced no read
    loss_reads: LossReads = LossReads.AS_IS
    #: how each micro-batch's weight gradients join the step's; None in older files
    grad_accumulation: GradAccumulation | None = None

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"kind": str(self.kind), "overlap": self.overlap,
                                 "overlap_grad_reduce": self.overlap_grad_reduce}
        if self.kind is StepKind.TRAINING:  # a forward pass has no loss
            found["loss_reads"] = str(self.loss_reads)
        if self.bucket_mb is not None:
            found["bucket_mb"] = self.bucket_mb
        for key in ("precision", "attention", "fusion", "grad_accumulation"):
            value = getattr(self, key)
            if value is not None:
                found[key] = str(value)
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepSpec:
        def optional(kind: Any, key: str) -> Any:
            return _enum(kind, data[key], f"step.{key}") if key in data else None

        return cls(_enum(StepKind, data.get("kind", "training"), "step.kind"),
                   float(data.get("overlap", 0.0)), optional(Precision, "precision"),
                   optional(AttentionKernel, "attention"), optional(Fusion, "fusion"),
                   float(data["bucket_mb"]) if "bucket_mb" in data else None,
                   _flag(data.get("overlap_grad_reduce", True), "step.overlap_grad_reduce"),
                   _enum(LossReads, data.get("loss_reads", "as-is"), "step.loss_reads"),
                   optional(GradAccumulation, "grad_accumulation"))


@dataclass(frozen=True)
class TensorBinding:
    """One input or output slot of an op and the layout the op sees it in; for an input,
    the share of its gradient the read hands back (below 1 only for a whole read of a
    weight whose gradient is summed over devices that each compute all of it:
    `planner.sharding.derive.read_gradient_share`)."""

    tensor: str
    layout: Layout
    share: float = 1.0

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"tensor": self.tensor, "layout": self.layout.to_json()}
        if self.share != 1.0:
            found["share"] = self.share
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> TensorBinding | None:
        if not data:
            return None
        share = data.get("share", 1.0)
        if isinstance(share, bool) or not isinstance(share, int | float) \
                or not 0.0 < share <= 1.0:
            raise TypeError(f"binding of {data['tensor']!r}: share must be a number in "
                            f"(0, 1], not {share!r}")
        return cls(data["tensor"], Layout.from_json(data["layout"]), float(share))


@dataclass(frozen=True)
class OpEntry:
    name: str
    op_type: str
    strategy: tuple[tuple[int, ...], ...]  # MindSpore form: per input, the cut of each dim
    inputs: tuple[TensorBinding | None, ...]
    outputs: tuple[TensorBinding | None, ...]
    assignment: Mapping[str, tuple[str, ...]]  # the op's labels split over mesh axes
    note: str = ""
    cost: OpCost | None = None  # per device, one micro-batch

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name, "op_type": self.op_type,
            "strategy": [list(t) for t in self.strategy],
            "inputs": [b.to_json() if b else None for b in self.inputs],
            "outputs": [b.to_json() if b else None for b in self.outputs],
            "assignment": {label: list(axes) for label, axes in self.assignment.items()},
        }
        if self.note:
            entry["note"] = self.note
        if self.cost is not None:
            entry["cost"] = self.cost.to_json()
        return entry

    def numbers(self) -> Iterator[tuple[tuple[str | int, ...], float]]:
        """Each number `to_json` writes, with its path inside the entry, in its order:
        the strategy's factors, the bindings' gradient shares (written where not 1; a
        layout names axes only) and the cost's fields. A reader checking the numbers of
        200,000 entries need not write them out."""
        for slot, factors in enumerate(self.strategy):
            for dim, factor in enumerate(factors):
                yield ("strategy", slot, dim), factor
        for side, bindings in (("inputs", self.inputs), ("outputs", self.outputs)):
            for slot, binding in enumerate(bindings):
                if binding is not None and binding.share != 1.0:
                    yield (side, slot, "share"), binding.share
        if self.cost is not None:
            for key, value in self.cost.to_json().items():
                yield ("cost", key), value

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpEntry:
        cost = data.get("cost")
        if cost is not None and (not isinstance(cost, dict) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in cost.values())):
            raise TypeError(f"op {data['name']!r}: cost must be an object of numbers")
        return cls(
            name=data["name"], op_type=data["op_type"],
            strategy=tuple(tuple(t) for t in data["strategy"]),
            inputs=tuple(TensorBinding.from_json(b) for b in data["inputs"]),
            outputs=tuple(TensorBinding.from_json(b) for b in data["outputs"]),
            assignment={label: tuple(axes)
                        for label, axes in data.get("assignment", {}).items()},
            note=data.get("note", ""),
            cost=OpCost(**{k: float(cost.get(k, 0.0)) for k in
                           ("forward_s", "backward_s", "saved_bytes", "output_bytes")})
            if cost is not None else None,
        )


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    kind: str  # input | parameter | buffer | constant | activation
    layout: Layout
    source: SourceName | None = None  # the module's name where the exporter renamed it

    def module_name(self, key: str) -> str:
        """The module's name for this tensor, whose key in the plan is `key`."""
        return self.source.name if self.source is not None else key

    def local_bytes(self, mesh: DeviceMesh) -> float:
        """Bytes of the block one device holds in the tensor's layout (as the builder sizes
        sends: the whole tensor's bytes times the layout's share)."""
        return math.prod(self.shape) * dtype_itemsize(self.dtype) * fraction_of_layout(
            self.layout, mesh)

    @property
    def module_layout(self) -> Layout:
        """The layout of the module's own parameter (its transpose where stored so)."""
        if self.source is None or not self.source.transposed:
            return self.layout
        return Layout(tuple(reversed(self.layout.dims)), self.layout.partial)

    def to_json(self) -> dict[str, Any]:
        entry = {"shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
                 "layout": self.layout.to_json()}
        if self.source is not None:
            entry["source"] = self.source.to_json()
        return entry

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorEntry:
        source = data.get("source")
        return cls(tuple(data["shape"]), data["dtype"], data["kind"],
                   Layout.from_json(data["layout"]),
                   SourceName.from_json(source) if source is not None else None)


def collective_to_json(c: Collective) -> dict[str, Any]:
    return {"kind": str(c.kind), "tensor": c.tensor, "axes": list(c.axes), "bytes": c.bytes,
            "phase": str(c.phase), "op": c.op, "time_s": c.time_s, "bucket": c.bucket}


def collective_from_json(data: Mapping[str, Any]) -> Collective:
    """A plan file's collective; files of earlier releases have no `bucket` (None)."""
    bucket = data.get("bucket")
    return Collective(_enum(CollectiveKind, data["kind"], "collectives[].kind"), data["tensor"],
                      tuple(data["axes"]), int(data["bytes"]),
                      _enum(Phase, data["phase"], "collectives[].phase"), data["op"],
                      float(data["time_s"]), int(bucket) if bucket is not None else None)


@dataclass(frozen=True)
class Brief:
    """The figures that compare plans: mesh, degrees, step time, memory, fit."""

    mesh: tuple[int, ...]
    axes: tuple[str, ...]
    parallel: ParallelConfig
    step_time_s: float
    compute_s: float
    communication_s: float
    peak_memory_bytes: int
    fits: bool
    memory: MemoryBreakdown
    breakdown: StepBreakdown
    schedule: Schedule | None = None
    virtual_stages: int = 1
    #: per-stage meshes, each stage's shape ("0: tp=4; 1: dp=4"); "" where they share one
    stage_meshes: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"mesh": list(self.mesh), "axes": list(self.axes),
                "parallel": self.parallel.to_json(), "step_time_s": self.step_time_s,
                "compute_s": self.compute_s, "communication_s": self.communication_s,
                "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
                "memory": self.memory.to_json(), "breakdown": self.breakdown.to_json(),
                "schedule": str(self.schedule) if self.schedule is not None else None,
                "virtual_stages": self.virtual_stages,
                **({"stage_meshes": self.stage_meshes} if self.stage_meshes else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Brief:
        schedule = data.get("schedule")
        return cls(tuple(data["mesh"]), tuple(data["axes"]),
                   ParallelConfig.from_json(data["parallel"]), float(data["step_time_s"]),
                   float(data["compute_s"]), float(data["communication_s"]),
                   int(data["peak_memory_bytes"]), bool(data["fits"]),
                   MemoryBreakdown.from_json(data["memory"]),
                   StepBreakdown.from_json(data.get("breakdown", {})),
                   _enum(Schedule, schedule, "schedule") if schedule is not None else None,
                   int(data.get("virtual_stages", 1)), str(data.get("stage_meshes", "")))


@dataclass(frozen=True)
class Alternative:
    """A mesh shape or configuration the search tried: with its exact price (`brief`) when
    it has a plan, else the reason it has none."""

    mesh: tuple[int, ...]
    axes: tuple[str, ...]
    status: str
    objective: float  # the exact step time, inf without a plan
    gap: float | None
    reason: str = ""
    solver: str | None = None
    chosen: bool = False  # this is the plan
    brief: Brief | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = self.brief.to_json() if self.brief is not None else {
            "mesh": list(self.mesh), "axes": list(self.axes)}
        data.update({"status": self.status, "objective": self.objective, "gap": self.gap,
                     "reason": self.reason, "chosen": self.chosen})
        if self.solver is not None:
            data["solver"] = self.solver
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Alternative:
        brief = Brief.from_json(data) if "parallel" in data else None
        gap = data.get("gap")
        return cls(tuple(data["mesh"]), tuple(data["axes"]), str(data.get("status", "")),
                   float(data.get("objective", float("inf"))),
                   float(gap) if gap is not None else None, str(data.get("reason", "")),
                   data.get("solver"), bool(data.get("chosen", False)), brief)


@dataclass(frozen=True)
class UnitEntry:
    """A run of ops a pipeline stage boundary may not cut: the prefix, a layer, ..."""

    name: str
    ops: Range

    @property
    def is_layer(self) -> bool:
        return self.name.startswith("layer ")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ops": list(self.ops)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UnitEntry:
        return cls(data["name"], _range(data["ops"]))


@dataclass(frozen=True)
class StageEntry:
    """One device stage: its op ranges (chunks), ranks, recompute, the weights it holds,
    its figures per micro-batch (gradient sync and optimizer: per step) and memory."""

    device_stage: int
    ops: tuple[Range, ...]
    ranks: tuple[int, ...]
    recompute: Recompute
    recompute_segments: tuple[Range, ...]
    memory: MemoryBreakdown
    holds: tuple[str, ...] = ()  # parameters and buffers its ops read
    units: tuple[tuple[str, str], ...] = ()  # (first, last) unit name per chunk
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    p2p_s: float = 0.0
    zero_s: float = 0.0
    gradient_sync_s: float = 0.0
    optimizer_s: float = 0.0
    in_flight: float = 0.0
    #: of `backward_s`, the weights' gradients: the W passes of the zero-bubble schedules
    weight_gradient_s: float = 0.0
    #: on a mixed cluster, the device groups its ranks are on (`cluster.groups`' names)
    groups: tuple[str, ...] = ()
    #: where the stages' (dp, tp) shapes differ, this stage's own mesh (its ops' layouts
    #: and collectives are over it, `planner.plans.stagemesh`); None: the plan's mesh
    mesh: DeviceMesh | None = None

    @property
    def per_micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.p2p_s + self.zero_s

    def op_indices(self) -> range | list[int]:
        return [k for a, b in self.ops for k in range(a, b)]

    def to_json(self) -> dict[str, Any]:
        return {
            "device_stage": self.device_stage, "ops": [list(r) for r in self.ops],
            "ranks": list(self.ranks), "recompute": str(self.recompute),
            "recompute_segments": [list(r) for r in self.recompute_segments],
            "memory": self.memory.to_json(), "holds": list(self.holds),
            "units": [list(u) for u in self.units], "forward_s": self.forward_s,
            "backward_s": self.backward_s, "recompute_s": self.recompute_s,
            "p2p_s": self.p2p_s, "zero_s": self.zero_s,
            "gradient_sync_s": self.gradient_sync_s, "optimizer_s": self.optimizer_s,
            "in_flight": self.in_flight, "weight_gradient_s": self.weight_gradient_s,
            **({"groups": list(self.groups)} if self.groups else {}),
            **({"mesh": self.mesh.to_json()} if self.mesh is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StageEntry:
        return cls(
            device_stage=int(data["device_stage"]),
            ops=tuple(_range(r) for r in data["ops"]),
            ranks=tuple(int(r) for r in data["ranks"]),
            recompute=_enum(Recompute, data["recompute"], "pipeline.stages[].recompute"),
            recompute_segments=tuple(_range(r) for r in data["recompute_segments"]),
            memory=MemoryBreakdown.from_json(data["memory"]),
            holds=tuple(str(h) for h in data.get("holds", ())),
            units=tuple((str(a), str(b)) for a, b in data.get("units", ())),
            **{key: float(data.get(key, 0.0)) for key in _STAGE_FIGURES},
            groups=tuple(str(g) for g in data.get("groups", ())),
            mesh=DeviceMesh.from_json(data["mesh"]) if "mesh" in data else None,
        )


_STAGE_FIGURES = ("forward_s", "backward_s", "recompute_s", "p2p_s", "zero_s",
                  "gradient_sync_s", "optimizer_s", "in_flight", "weight_gradient_s")


@dataclass(frozen=True)
class SendEntry:
    """An activation sent from one device stage to another every micro-batch (and its
    gradient back when `grad`), from the chunk producing it to the first chunk of the
    receiving stage that reads it. `bytes` is each rank's local tensor; a send scattered
    over `scatter_axes` (Megatron's scatter/gather, `planner.sharding.sends`) carries
    1/g of it, sliced along local dim `scatter_dim`, and is all-gathered on arrival."""

    tensor: str
    from_stage: int
    to_stage: int
    bytes: int
    grad: bool
    from_chunk: int
    to_chunk: int
    scatter_axes: tuple[str, ...] = ()
    scatter_dim: int = -1

    def to_json(self) -> dict[str, Any]:
        found = {f.name: getattr(self, f.name) for f in fields(self)}
        found["scatter_axes"] = list(self.scatter_axes)
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SendEntry:
        return cls(str(data["tensor"]), int(data["from_stage"]), int(data["to_stage"]),
                   int(data["bytes"]), bool(data["grad"]), int(data.get("from_chunk", -1)),
                   int(data.get("to_chunk", -1)),
                   tuple(str(a) for a in data.get("scatter_axes", ())),
                   int(data.get("scatter_dim", -1)))


def chunks_of(stages: Sequence[StageEntry]) -> list[tuple[Range, int]]:
    """Every op range of `stages` with the device stage running it, in op order: the
    chunks (virtual stages) a `SendEntry` names by index."""
    return sorted((r, stage.device_stage) for stage in stages for r in stage.ops)


@dataclass(frozen=True)
class PipelineSection:
    """Stages, micro-batches and schedule of a plan that pipelines (or micro-batches, or
    shards its optimizer, or recomputes)."""

    schedule: Schedule
    micro_batches: int
    micro_batch_size: int | None
    global_batch: int | None
    virtual_stages: int
    bubble_fraction: float
    units: tuple[UnitEntry, ...]
    stages: tuple[StageEntry, ...]
    sends: tuple[SendEntry, ...]

    def chunks(self) -> list[tuple[Range, int]]:
        """Every op range with the device stage running it, in op order: the chunks
        (virtual stages) that sends name by index."""
        return chunks_of(self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"schedule": str(self.schedule), "micro_batches": self.micro_batches,
                "micro_batch_size": self.micro_batch_size, "global_batch": self.global_batch,
                "virtual_stages": self.virtual_stages,
                "bubble_fraction": self.bubble_fraction,
                "units": [u.to_json() for u in self.units],
                "stages": [s.to_json() for s in self.stages],
                "sends": [s.to_json() for s in self.sends]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PipelineSection:
        return cls(_enum(Schedule, data["schedule"], "pipeline.schedule"),
                   int(data["micro_batches"]), data.get("micro_batch_size"),
                   data.get("global_batch"), int(data["virtual_stages"]),
                   float(data.get("bubble_fraction", 0.0)),
                   tuple(UnitEntry.from_json(u) for u in data["units"]),
                   tuple(StageEntry.from_json(s) for s in data["stages"]),
                   tuple(SendEntry.from_json(s) for s in data["sends"]))


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `cls` in `data`; an unknown key is a malformed section."""
    names = {f.name for f in fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise TypeError(f"unexpected field {unknown[0]!r}")
    return dict(data)


def _range(value: Any) -> Range:
    first, end = value
    return int(first), int(end)


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} {value!r}: true or false")
    return value


def _enum(kind: type, value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member) for member in kind)  # type: ignore[attr-defined]
        raise ValueError(f"{where} {value!r}: one of {allowed}") from None
