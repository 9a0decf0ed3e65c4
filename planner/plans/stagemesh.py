"""Which mesh each op and tensor of a plan lives on: the plan's own, or, where a
pipeline's stages run on meshes of different (dp, tp) shapes (per-stage meshes), its
stage's; and which ranks each stage holds (blocks of the stage's device count, laid out
by `planner.sharding.submeshes`). One answer for the builder, the loader's checks,
validate and explain.

A tensor's stored layout is the one its producing op lays it out in (or, for weights and
inputs, the first op reading it): it lives on that op's stage's mesh. An activation a
stage of another shape reads arrives resharded by the send between them, in the layout
the first op of that stage reading it wants (`arrival_layouts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.errors import ShardplanError
from planner.kinds import AxisRole
from planner.plans.sections import OpEntry, PipelineSection, SendEntry
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.submeshes import stage_ranks

#: (input names, output names) of each op, in the plan's op order
OpNames = tuple[Sequence[str | None], Sequence[str | None]]


def per_stage_meshes(pipeline: PipelineSection | None) -> bool:
    """Whether the plan's stages run on meshes of their own."""
    return pipeline is not None and any(stage.mesh is not None for stage in pipeline.stages)


def describe_stage_meshes(mesh: DeviceMesh, pipeline: PipelineSection) -> str:
    """Each stage's shape, pipeline axis left out: "0: tp=4; 1: dp=4", with each stage's
    ranks where the stages hold different device counts ("0: dp=4 (ranks 0-3); ...")."""
    sizes = stage_sizes(mesh, pipeline)
    uneven = len(set(sizes)) > 1
    shapes = []
    for stage in pipeline.stages:
        own = stage.mesh or mesh
        shape = " × ".join(f"{a}={n}" for a, n in zip(own.axis_names, own.shape, strict=True)
                           if a != AxisRole.PIPELINE) or "one device"
        if uneven and stage.ranks:
            first, last = stage.ranks[0], stage.ranks[-1]
            shape += f" (rank {first})" if first == last else f" (ranks {first}-{last})"
        shapes.append(shape)
    return "; ".join(f"{k}: {shape}" for k, shape in enumerate(shapes))


def stage_sizes(mesh: DeviceMesh, pipeline: PipelineSection) -> list[int]:
    """Each device stage's device count: its mesh's devices over the pipeline's stages
    (a stage mesh keeps the pipeline axis beside its own shape)."""
    pp = max(1, len(pipeline.stages))
    return [(stage.mesh or mesh).size // pp for stage in pipeline.stages]


def expected_blocks(mesh: DeviceMesh, pipeline: PipelineSection) -> list[range]:
    """The ranks each stage must hold, from its mesh's device count (`stage_ranks`).
    Raises ValueError where the counts are no submesh sizes."""
    return stage_ranks(stage_sizes(mesh, pipeline), mesh.devices_per_node)


def plan_devices(mesh: DeviceMesh, pipeline: PipelineSection | None) -> int:
    """How many devices the plan runs on: its mesh's, or the stages' together where they
    hold device counts of their own."""
    if pipeline is None or not per_stage_meshes(pipeline):
        return mesh.size
    return sum(stage_sizes(mesh, pipeline))


def refuse_stage_meshes(mesh: DeviceMesh, pipeline: PipelineSection | None,
                        what: str) -> None:
    """Refuse, naming the stages' shapes, a plan whose stages run on meshes of their own
    where `what` (a reader: an executor, an export) runs one shape for every stage."""
    if pipeline is not None and per_stage_meshes(pipeline):
        raise ShardplanError(
            f"pipeline.stages[].mesh: the stages run on meshes of their own shapes "
            f"({describe_stage_meshes(mesh, pipeline)}), which {what} does not support yet "
            "(it takes one (dp, tp) shape for every stage); re-plan with --parallel "
            "stage_mesh=shared")


def stage_mesh(mesh: DeviceMesh, pipeline: PipelineSection | None, stage: int) -> DeviceMesh:
    """The mesh of device stage `stage`: its own under per-stage meshes, else `mesh`."""
    stages = pipeline.stages if pipeline is not None else ()
    return (stages[stage].mesh or mesh) if 0 <= stage < len(stages) else mesh


def resharded(mesh: DeviceMesh, pipeline: PipelineSection | None, send: SendEntry) -> bool:
    """Whether `send` crosses between stages of different meshes (resharded on arrival)."""
    return stage_mesh(mesh, pipeline, send.from_stage) != stage_mesh(mesh, pipeline,
                                                                     send.to_stage)


def stage_of_ops(pipeline: PipelineSection | None, count: int) -> list[int]:
    """The device stage running each of `count` ops (0 outside every stage's ranges)."""
    found = [0] * count
    if pipeline is not None:
        for stage in pipeline.stages:
            for first, end in stage.ops:
                for k in range(max(0, first), min(end, count)):
                    found[k] = stage.device_stage
    return found


def op_meshes(mesh: DeviceMesh, pipeline: PipelineSection | None,
              count: int) -> list[DeviceMesh]:
    """The mesh each of `count` ops is laid out on."""
    if not per_stage_meshes(pipeline):
        return [mesh] * count
    return [stage_mesh(mesh, pipeline, stage) for stage in stage_of_ops(pipeline, count)]


def tensor_sites(ops: Sequence[OpNames]) -> dict[str, int]:
    """Each tensor's site: the op producing it, else the first op reading it."""
    sites: dict[str, int] = {}
    for index, (_, outputs) in enumerate(ops):
        for name in outputs:
            if name:
                sites.setdefault(name, index)
    for index, (inputs, _) in enumerate(ops):
        for name in inputs:
            if name:
                sites.setdefault(name, index)
    return sites


def tensor_meshes(mesh: DeviceMesh, pipeline: PipelineSection | None,
                  ops: Sequence[OpNames]) -> dict[str, DeviceMesh]:
    """The mesh each tensor the ops name is stored on (`tensor_sites`); tensors no op
    names are on the plan's mesh (callers default to it)."""
    meshes = op_meshes(mesh, pipeline, len(ops))
    return {name: meshes[site] for name, site in tensor_sites(ops).items()}


def arrival_layouts(ops: Sequence[OpEntry], on_op: Sequence[DeviceMesh],
                    on_tensor: Mapping[str, DeviceMesh]) -> dict[tuple[DeviceMesh, str], Layout]:
    """How each tensor stored on one stage mesh arrives on another that reads it: as the
    first op there reading it reads it (the send reshards it to that layout, each rank
    receiving its own block: `derive`'s foreign ops)."""
    found: dict[tuple[DeviceMesh, str], Layout] = {}
    for op, mesh in zip(ops, on_op, strict=True):
        for binding in op.inputs:
            if binding is not None and on_tensor.get(binding.tensor, mesh) != mesh:
                found.setdefault((mesh, binding.tensor), binding.layout)
    return found
