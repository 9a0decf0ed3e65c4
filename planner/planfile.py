"""The Plan and its strategy JSON (schema `shardplan.strategy/1`, docs/strategy-schema.md).

A Plan is what every search returns and what the executor runs: the mesh, the layout of
every tensor, each op's input/output layouts (with MindSpore strategy tuples), every
collective, the predicted cost and the solver's own record.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlanFileError
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

SCHEMA = "shardplan.strategy/1"
SCHEMA_FILE = Path(__file__).with_name("strategy.schema.json")  # JSON Schema of the file


@dataclass
class ModelRef:
    path: str
    sha256: str
    bound_dims: dict[str, int]
    batch: int | None
    opset: int
    parameters: int


@dataclass
class ClusterRef:
    profile: str
    devices: int
    nodes: int
    devices_per_node: int


@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    zero: int = 0
    recompute: str = "none"
    optimizer: str = "adam"


@dataclass
class TensorBinding:
    """One input or output slot of an op and the layout the op sees it in."""

    tensor: str
    layout: Layout

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "layout": self.layout.to_json()}


@dataclass
class OpEntry:
    name: str
    op_type: str
    strategy: list[list[int]]  # MindSpore form: per input, into how many parts each dim is cut
    inputs: list[TensorBinding | None]
    outputs: list[TensorBinding | None]
    assignment: dict[str, list[str]]  # the op's labels split over mesh axes
    note: str = ""
    # Predicted per device, one micro-batch: forward_s, backward_s (compute), saved_bytes
    # (activations kept for the backward pass), output_bytes (local outputs).
    cost: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "op_type": self.op_type,
            "strategy": self.strategy,
            "inputs": [b.to_json() if b else None for b in self.inputs],
            "outputs": [b.to_json() if b else None for b in self.outputs],
            "assignment": self.assignment,
        }
        if self.note:
            entry["note"] = self.note
        if self.cost:
            entry["cost"] = self.cost
        return entry


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    kind: str
    layout: Layout

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "kind": self.kind,
                "layout": self.layout.to_json()}


@dataclass
class Collective:
    """One collective the run must issue, per step (per micro-batch for fwd/bwd ones)."""

    kind: str
    tensor: str
    axes: list[str]
    bytes: int
    phase: str  # forward | backward | gradient
    op: str  # the consuming op (or "optimizer" for gradient synchronisation)
    time_s: float


@dataclass
class Predicted:
    step_time_s: float
    compute_s: float
    communication_s: float
    memory: dict[str, int]
    memory_limit_bytes: int
    fits: bool
    breakdown: dict[str, float] = field(default_factory=dict)


#: Wall-clock figures of a search: reported to the user, never written into the plan file,
#: so that the same inputs give a byte-identical plan.
WALL_CLOCK_DETAIL = ("solve_time_s",)


@dataclass
class SolverRecord:
    name: str
    status: str
    objective: float
    bound: float
    gap: float
    time_s: float = 0.0  # wall clock of the search; not serialised (see WALL_CLOCK_DETAIL)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "objective": self.objective,
                "bound": self.bound, "gap": self.gap,
                "detail": {k: v for k, v in self.detail.items() if k not in WALL_CLOCK_DETAIL}}


@dataclass
class Plan:
    model: ModelRef
    cluster: ClusterRef
    mesh: DeviceMesh
    parallel: ParallelConfig
    ops: list[OpEntry]
    tensors: dict[str, TensorEntry]
    collectives: list[Collective]
    predicted: Predicted
    solver: SolverRecord
    warnings: list[str] = field(default_factory=list)
    step: dict[str, Any] = field(default_factory=lambda: {"kind": "training", "overlap": 0.0})
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # other meshes tried
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # priced side by side
    # Pipeline stages, micro-batches, ZeRO and recompute (docs/strategy-schema.md); None for
    # a plan that runs the whole graph on every device in one pass.
    pipeline: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        extra = {"pipeline": self.pipeline} if self.pipeline is not None else {}
        return {
            **extra,
            "step": self.step,
            "alternatives": self.alternatives,
            "baselines": self.baselines,
            "schema": SCHEMA,
            "model": asdict(self.model),
            "cluster": asdict(self.cluster),
            "mesh": self.mesh.to_json(),
            "parallel": asdict(self.parallel),
            "ops": [op.to_json() for op in self.ops],
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "collectives": [asdict(c) for c in self.collectives],
            "predicted": asdict(self.predicted),
            "solver": self.solver.to_json(),
            "warnings": list(self.warnings),
        }

    def brief(self) -> dict[str, Any]:
        """The figures that compare plans: mesh, degrees, step time, memory, fit."""
        return {
            "mesh": list(self.mesh.shape), "axes": list(self.mesh.axis_names),
            "parallel": asdict(self.parallel),
            "step_time_s": self.predicted.step_time_s,
            "compute_s": self.predicted.compute_s,
            "communication_s": self.predicted.communication_s,
            "peak_memory_bytes": self.predicted.memory["peak"],
            "fits": self.predicted.fits,
            "memory": dict(self.predicted.memory),
            "breakdown": dict(self.predicted.breakdown),
            "schedule": self.pipeline["schedule"] if self.pipeline else None,
            "virtual_stages": self.pipeline["virtual_stages"] if self.pipeline else 1,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    def save(self, path: str | os.PathLike) -> Path:
        target = Path(path)
        target.write_text(self.dumps() + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        file = Path(path)
        try:
            data = json.loads(file.read_text())
        except FileNotFoundError:
            raise PlanFileError(f"{file}: no such plan file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanFileError(f"{file}: cannot read the plan ({exc})") from None
        except json.JSONDecodeError as exc:
            raise PlanFileError(
                f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            ) from None
        return cls.from_json(data, source=str(file))

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise PlanFileError(f"{source}: a plan is a JSON object")
        if data.get("schema") != SCHEMA:
            raise PlanFileError(
                f"{source}: schema is {data.get('schema')!r}, expected {SCHEMA!r}; "
                "re-create the plan with this version of shardplan"
            )
        from planner.errors import StrategyError
        from planner.plancheck import check_plan_fits, check_plan_json

        check_plan_json(data, source)  # every field's type and range, naming its JSON path
        try:
            plan = cls(
                model=ModelRef(**data["model"]),
                cluster=ClusterRef(**data["cluster"]),
                mesh=DeviceMesh.from_json(data["mesh"]),
                parallel=ParallelConfig(**data["parallel"]),
                ops=[_op_from_json(op) for op in data["ops"]],
                tensors={name: TensorEntry(t["shape"], t["dtype"], t["kind"],
                                           Layout.from_json(t["layout"]))
                         for name, t in data["tensors"].items()},
                collectives=[Collective(**c) for c in data["collectives"]],
                predicted=Predicted(**data["predicted"]),
                solver=SolverRecord(**data["solver"]),
                warnings=list(data.get("warnings", [])),
                step=dict(data.get("step", {"kind": "training", "overlap": 0.0})),
                alternatives=list(data.get("alternatives", [])),
                baselines=dict(data.get("baselines", {})),
                pipeline=data.get("pipeline"),
            )
        except PlanFileError:
            raise
        except StrategyError as exc:  # e.g. a mesh whose shape and axes differ in length
            raise PlanFileError(f"{source}: {exc}") from None
        except KeyError as exc:
            raise PlanFileError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise PlanFileError(f"{source}: malformed plan ({exc})") from None
        check_plan_fits(plan, source)  # layouts the mesh can hold, bindings to known tensors
        return plan


def _op_from_json(data: dict[str, Any]) -> OpEntry:
    def binding(item: dict[str, Any] | None) -> TensorBinding | None:
        return TensorBinding(item["tensor"], Layout.from_json(item["layout"])) if item else None

    cost = data.get("cost", {})
    if not isinstance(cost, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in cost.values()):
        raise TypeError(f"op {data['name']!r}: cost must be an object of numbers")
    return OpEntry(
        name=data["name"], op_type=data["op_type"], strategy=data["strategy"],
        inputs=[binding(b) for b in data["inputs"]],
        outputs=[binding(b) for b in data["outputs"]],
        assignment=data.get("assignment", {}), note=data.get("note", ""),
        cost=dict(cost),
    )
