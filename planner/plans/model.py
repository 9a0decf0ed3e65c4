"""The Plan: what the plan builder writes, every reader reads, and the strategy JSON holds.

A Plan is frozen: `planner.plans.build` derives every section once from the search's
decision (layouts, collectives with their phases, the pipeline's stages with the weights
each holds and the sends between them, the predicted cost) and nothing changes it
afterwards. The file is versioned (`shardplan.strategy/1`, docs/strategy-schema.md);
loading checks it against the JSON Schema (`planner.plans.schema`) and its layouts against
its mesh (`planner.plans.checks`), and brings files of earlier releases up to date
(`planner.plans.upgrade`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlanFileError, StrategyError
from planner.kinds import Schedule
from planner.plans.checks import check_groups, check_op_ranges, check_plan_fits
from planner.plans.schema import check_plan_json
from planner.plans.sections import (
    SCHEMA,
    Alternative,
    Brief,
    ClusterRef,
    ModelRef,
    OpEntry,
    ParallelConfig,
    PipelineSection,
    StepSpec,
    TensorEntry,
    UnitEntry,
    collective_from_json,
    collective_to_json,
)
from planner.plans.stagemesh import describe_stage_meshes, per_stage_meshes
from planner.plans.upgrade import upgrade_parallel, upgrade_pipeline
from planner.records import Collective, Predicted, SolverRecord
from planner.sharding.mesh import DeviceMesh
from planner.userfiles import read_json

#: encoder pieces `Plan.save` joins per write
SAVE_PIECES = 1 << 16


#: Sections written one record per line: a large graph's plan is almost all of them.
RECORD_SECTIONS = frozenset({"ops", "tensors", "collectives", "units"})
_COMPACT = json.JSONEncoder(sort_keys=True)  # no indent: C-accelerated
_NESTED = json.JSONEncoder(indent=1, sort_keys=True)


def _write_plan(data: Mapping[str, Any], write: Callable[[str], object]) -> None:
    """A plan file's JSON format, for `Plan.dumps` and the streamed `Plan.save` alike:
    keys sorted, the small sections indented, and each op, tensor, collective and unit
    on a line of its own. Python's JSON encoder runs in C only without indentation; an
    indented 200,000-op plan took its pure-Python path for most of a minute."""
    write("{")
    for k, key in enumerate(sorted(data)):
        write(("," if k else "") + "\n " + _COMPACT.encode(key) + ": ")
        value = data[key]
        if key not in RECORD_SECTIONS or not value or not isinstance(value, (list, dict)):
            write(_NESTED.encode(value).replace("\n", "\n "))
            continue
        records = (_COMPACT.encode(record) for record in value) if isinstance(value, list) \
            else (f"{_COMPACT.encode(name)}: {_COMPACT.encode(value[name])}"
                  for name in sorted(value))
        write("[" if isinstance(value, list) else "{")
        for j, record in enumerate(records):
            write(("," if j else "") + "\n  " + record)
        write("\n ]" if isinstance(value, list) else "\n }")
    write("\n}")


#: the sections every plan file has, in the order `Plan.to_json` writes them
PLAN_SECTIONS = ("schema", "model", "cluster", "mesh", "parallel", "ops", "tensors",
                 "collectives", "predicted", "solver", "warnings", "step", "alternatives",
                 "baselines")


def brief_of(mesh: DeviceMesh, parallel: ParallelConfig, predicted: Predicted,
             schedule: Schedule | None = None, virtual_stages: int = 1,
             stage_meshes: str = "") -> Brief:
    """The figures that compare a plan with others (`Plan.brief`): the builder gives them
    for each finalist before, and whether or not, it writes that finalist's sections."""
    return Brief(
        mesh=tuple(mesh.shape), axes=tuple(mesh.axis_names), parallel=parallel,
        step_time_s=predicted.step_time_s, compute_s=predicted.compute_s,
        communication_s=predicted.communication_s,
        peak_memory_bytes=int(predicted.memory.peak), fits=predicted.fits,
        memory=predicted.memory, breakdown=predicted.breakdown, schedule=schedule,
        virtual_stages=virtual_stages, stage_meshes=stage_meshes)


@dataclass(frozen=True)
class Plan:
    """How every op and tensor of one model is split over a device mesh, with its cost."""

    model: ModelRef
    cluster: ClusterRef
    mesh: DeviceMesh
    parallel: ParallelConfig
    ops: tuple[OpEntry, ...]
    tensors: Mapping[str, TensorEntry]
    collectives: tuple[Collective, ...]
    predicted: Predicted
    solver: SolverRecord
    warnings: tuple[str, ...] = ()
    step: StepSpec = field(default_factory=StepSpec)
    alternatives: tuple[Alternative, ...] = ()  # other meshes and configurations tried
    baselines: Mapping[str, Brief] = field(default_factory=dict)  # priced side by side
    # Pipeline stages, micro-batches, ZeRO and recompute; None for a plan that runs the
    # whole graph on every device in one pass.
    pipeline: PipelineSection | None = None
    # The model's layers as the planner found them (prefix, layer k, suffix), for readers;
    # empty when no repeated block covers half the graph.
    units: tuple[UnitEntry, ...] = ()

    def brief(self) -> Brief:
        return brief_of(self.mesh, self.parallel, self.predicted,
                        self.pipeline.schedule if self.pipeline else None,
                        self.pipeline.virtual_stages if self.pipeline else 1,
                        describe_stage_meshes(self.mesh, self.pipeline)
                        if self.pipeline is not None and per_stage_meshes(self.pipeline)
                        else "")

    @property
    def micro_batches(self) -> int:
        return self.pipeline.micro_batches if self.pipeline else 1

    @property
    def global_batch(self) -> int | None:
        """The rows of one training step (`model.batch` is one micro-batch's)."""
        return self.pipeline.global_batch if self.pipeline is not None else self.model.batch

    def to_json(self) -> dict[str, Any]:
        data = {key: self.section_json(key) for key in PLAN_SECTIONS}
        if self.pipeline is not None:
            data["pipeline"] = self.section_json("pipeline")
        if self.units:
            data["units"] = self.section_json("units")
        return data

    def section_json(self, key: str) -> Any:
        """One section of the file (`PLAN_SECTIONS`, "pipeline" or "units") as it is
        written: a reader checking one section need not write the others."""
        match key:
            case "schema":
                return SCHEMA
            case "model" | "cluster" | "mesh" | "parallel" | "predicted" | "solver" | "step":
                return getattr(self, key).to_json()
            case "ops":
                return [op.to_json() for op in self.ops]
            case "tensors":
                return {name: t.to_json() for name, t in self.tensors.items()}
            case "collectives":
                return [collective_to_json(c) for c in self.collectives]
            case "warnings":
                return list(self.warnings)
            case "alternatives":
                return [a.to_json() for a in self.alternatives]
            case "baselines":
                return {name: b.to_json() for name, b in self.baselines.items()}
            case "pipeline":
                return self.pipeline.to_json() if self.pipeline is not None else None
            case "units":
                return [u.to_json() for u in self.units]
        raise KeyError(f"a plan has no section {key!r}")

    def dumps(self) -> str:
        pieces: list[str] = []
        _write_plan(self.to_json(), pieces.append)
        return "".join(pieces)

    def save(self, path: str | os.PathLike) -> Path:
        """Write `dumps()` and a newline, streamed: a 200,000-op plan's text is a quarter
        of a GB, and the encoder's pieces joined into one string took several times that."""
        target = Path(path)
        with target.open("w") as file:
            pieces: list[str] = []

            def write(piece: str) -> None:
                pieces.append(piece)
                if len(pieces) >= SAVE_PIECES:
                    file.write("".join(pieces))
                    pieces.clear()

            _write_plan(self.to_json(), write)
            pieces.append("\n")
            file.write("".join(pieces))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        file = Path(path)
        data = read_json(file, "plan", PlanFileError,
                         missing="give the path of a plan written by `shardplan plan -o`")
        return cls.from_json(data, source=str(file))

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> Plan:
        """The typed plan of a file's JSON: checked against the schema first (naming the
        first bad JSON path), then every layout against the plan's mesh."""
        if not isinstance(data, dict):
            raise PlanFileError(f"{source}: a plan is a JSON object")
        if data.get("schema") != SCHEMA:
            raise PlanFileError(
                f"{source}: schema is {data.get('schema')!r}, expected {SCHEMA!r}; "
                "re-create the plan with this version of shardplan"
            )
        check_plan_json(data, source)  # every field's type and range, naming its JSON path
        try:
            plan = cls._from_checked(data)
        except PlanFileError:
            raise
        except StrategyError as exc:  # e.g. a mesh whose shape and axes differ in length
            raise PlanFileError(f"{source}: {exc}") from None
        except KeyError as exc:
            raise PlanFileError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise PlanFileError(f"{source}: malformed plan ({exc})") from None
        check_plan_fits(plan.cluster, plan.mesh, plan.tensors, plan.ops, plan.collectives,
                        source, plan.pipeline)
        check_op_ranges(plan.units, plan.pipeline, len(plan.ops), plan.cluster.devices,
                        source)
        check_groups(plan.cluster, plan.pipeline, source)
        return plan

    @classmethod
    def _from_checked(cls, data: dict[str, Any]) -> Plan:
        ops = tuple(OpEntry.from_json(op) for op in data["ops"])
        tensors = {name: TensorEntry.from_json(t) for name, t in data["tensors"].items()}
        pipeline = data.get("pipeline")
        units = tuple(UnitEntry.from_json(u) for u in data.get("units", []))
        return cls(
            model=ModelRef.from_json(data["model"]),
            cluster=ClusterRef.from_json(data["cluster"]),
            mesh=DeviceMesh.from_json(data["mesh"]),
            parallel=upgrade_parallel(ParallelConfig.from_json(data["parallel"]),
                                      data["parallel"], ops, tensors, units),
            ops=ops, tensors=tensors,
            collectives=tuple(collective_from_json(c) for c in data["collectives"]),
            predicted=Predicted.from_json(data["predicted"]),
            solver=SolverRecord.from_json(data["solver"]),
            warnings=tuple(str(w) for w in data.get("warnings", [])),
            step=StepSpec.from_json(data.get("step", {})),
            alternatives=tuple(Alternative.from_json(a) for a in data.get("alternatives", [])),
            baselines={name: Brief.from_json(b)
                       for name, b in data.get("baselines", {}).items()},
            pipeline=upgrade_pipeline(PipelineSection.from_json(pipeline), ops, tensors)
            if pipeline is not None else None,
            units=units,
        )
