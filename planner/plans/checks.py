"""Check a loaded plan against its own mesh: layouts it can hold, tensors it names.

A layout over an axis the mesh lacks, or splitting a dim unevenly, would surface as a
traceback in the executor or a run that splits tensors otherwise than the plan says.
Every refusal names the file and the JSON path of the first problem.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from planner.errors import PlanFileError
from planner.plans.schema import REMEDY
from planner.plans.sections import ClusterRef, OpEntry, PipelineSection, TensorEntry, UnitEntry
from planner.plans.stagemesh import op_meshes, plan_devices, tensor_meshes
from planner.records import Collective
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


def check_plan_fits(cluster: ClusterRef, mesh: DeviceMesh, tensors: Mapping[str, TensorEntry],
                    ops: Sequence[OpEntry], collectives: Sequence[Collective],
                    source: str, pipeline: PipelineSection | None = None) -> None:
    """Refuse layouts the plan's mesh (or, under per-stage meshes, the op's or tensor's
    stage's: `planner.plans.stagemesh`) cannot hold and bindings to unknown tensors."""
    meshes = [mesh]
    for s, stage in enumerate(pipeline.stages if pipeline is not None else ()):
        if stage.mesh is None:
            continue
        if stage.mesh.axis_names[:1] != mesh.axis_names[:1] \
                or stage.mesh.shape[:1] != mesh.shape[:1] \
                or stage.mesh.devices_per_node != mesh.devices_per_node:
            raise PlanFileError(f"{source}: pipeline.stages[{s}].mesh {list(stage.mesh.shape)} "
                                f"({list(stage.mesh.axis_names)}) does not keep the plan's "
                                f"pipeline axis {list(mesh.shape)} "
                                f"({list(mesh.axis_names)}); {REMEDY}")
        meshes.append(stage.mesh)
    devices = plan_devices(mesh, pipeline)
    if cluster.devices != devices:
        held = f"mesh {list(mesh.shape)} has" if len(meshes) == 1 else \
            "pipeline.stages[].mesh: the stages' meshes hold"
        raise PlanFileError(f"{source}: {held} {devices} devices but cluster.devices is "
                            f"{cluster.devices}; {REMEDY}")
    bound = [([b.tensor if b else None for b in op.inputs],
              [b.tensor if b else None for b in op.outputs]) for op in ops]
    on_tensor = tensor_meshes(mesh, pipeline, bound)
    on_op = op_meshes(mesh, pipeline, len(ops))
    for name, entry in tensors.items():
        _check_layout(entry.layout, entry.shape, on_tensor.get(name, mesh),
                      f"{source}: tensors.{name}.layout")
    seen: set[str] = set()
    for index, op in enumerate(ops):
        mesh = on_op[index]
        where = f"{source}: ops[{index}] ({op.name})"
        if op.name in seen:
            raise PlanFileError(f"{where}: a second entry for op {op.name}; {REMEDY}")
        seen.add(op.name)
        for side, bindings in (("inputs", op.inputs), ("outputs", op.outputs)):
            for slot, binding in enumerate(bindings):
                if binding is None:
                    continue
                tensor = tensors.get(binding.tensor)
                if tensor is None:
                    raise PlanFileError(f"{where}.{side}[{slot}]: tensor {binding.tensor!r} "
                                        f"is not in the plan's tensors; {REMEDY}")
                _check_layout(binding.layout, tensor.shape, mesh,
                              f"{where}.{side}[{slot}].layout")
    names = list(dict.fromkeys(axis for m in meshes for axis in m.axis_names))
    for index, collective in enumerate(collectives):
        _check_axes(collective.axes, names, f"{source}: collectives[{index}].axes")


def _check_axes(axes: Sequence[str], names: Sequence[str], where: str) -> None:
    for axis in axes:
        if axis not in names:
            raise PlanFileError(f"{where}: mesh axis {axis!r} is not one of the mesh's axes "
                                f"{list(names)}; {REMEDY}")


def _check_layout(layout: Layout, shape: Sequence[int], mesh: DeviceMesh, where: str) -> None:
    """The checks of Layout.check, each refusal naming the file and the JSON path."""
    if len(shape) != layout.rank:
        raise PlanFileError(f"{where}: {layout.rank} dims for a tensor of shape {list(shape)}; "
                            f"{REMEDY}")
    used = layout.used_axes
    _check_axes(used, mesh.axis_names, where)
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        raise PlanFileError(f"{where}: mesh axis {twice[0]!r} is used twice; {REMEDY}")
    for dim, (size, factor) in enumerate(zip(shape, layout.split_factors(mesh), strict=True)):
        if size % factor:
            raise PlanFileError(f"{where}: dim {dim} of size {size} cannot be split into "
                                f"{factor} equal parts; {REMEDY}")


def check_op_ranges(units: Sequence[UnitEntry], pipeline: PipelineSection | None, ops: int,
                    devices: int, source: str) -> None:
    """Refuse op ranges outside the plan's `ops`, ranges of one kind that overlap, and
    ranks outside its mesh: every reader indexes the op list by them (explain's units, the
    executor's stages and segments), and each walks its ranges' ops, which stays linear
    in the plan only while no op lies in two of them."""
    Named = list[tuple[str, tuple[int, int]]]
    kinds: list[tuple[Named, str]] = [
        ([(f"units[{i}] ({unit.name})", unit.ops) for i, unit in enumerate(units)],
         "units cut the ops into disjoint ranges")]
    if pipeline is not None:
        kinds.append(([(f"pipeline.units[{i}] ({unit.name})", unit.ops)
                       for i, unit in enumerate(pipeline.units)],
                      "units cut the ops into disjoint ranges"))
        kinds.append(([(f"pipeline.stages[{s}].ops[{c}]", r)
                       for s, stage in enumerate(pipeline.stages)
                       for c, r in enumerate(stage.ops)],
                      "pipeline stages must hold every op exactly once"))
        kinds.append(([(f"pipeline.stages[{s}].recompute_segments[{c}]", r)
                       for s, stage in enumerate(pipeline.stages)
                       for c, r in enumerate(stage.recompute_segments)],
                      "an op is recomputed once at most"))
        for s, stage in enumerate(pipeline.stages):
            outside = [rank for rank in stage.ranks if not 0 <= rank < devices]
            if outside:
                raise PlanFileError(f"{source}: pipeline.stages[{s}].ranks: rank {outside[0]} "
                                    f"is not one of the mesh's {devices} devices; {REMEDY}")
    for ranges, rule in kinds:
        for where, (first, end) in ranges:
            if not 0 <= first <= end <= ops:
                raise PlanFileError(f"{source}: {where}: op range [{first}, {end}) lies "
                                    f"outside the plan's {ops} ops; {REMEDY}")
        _refuse_overlaps(ranges, rule, source)


def _refuse_overlaps(ranges: Sequence[tuple[str, tuple[int, int]]], rule: str,
                     source: str) -> None:
    """Refuse two of `ranges` sharing an op (empty ranges share none), naming both."""
    ordered = sorted((r for r in ranges if r[1][0] < r[1][1]), key=lambda r: r[1])
    for (before, (a, b)), (where, (first, end)) in itertools.pairwise(ordered):
        if first < b:
            raise PlanFileError(f"{source}: {where}: op range [{first}, {end}) overlaps "
                                f"{before} [{a}, {b}): {rule}; {REMEDY}")


def check_groups(cluster: ClusterRef, pipeline: PipelineSection | None, source: str) -> None:
    """A mixed cluster's groups tile the ranks 0 .. devices-1 in order, and each pipeline
    stage names the groups its ranks are on (readers place and price stages by them)."""
    if not cluster.groups:
        if pipeline is not None and any(stage.groups for stage in pipeline.stages):
            raise PlanFileError(f"{source}: pipeline.stages name device groups but cluster "
                                f"has none; {REMEDY}")
        return
    first = 0
    for index, group in enumerate(cluster.groups):
        if group.first_rank != first:
            raise PlanFileError(f"{source}: cluster.groups[{index}].first_rank is "
                                f"{group.first_rank}, expected {first} (groups lie on the "
                                f"ranks one after the other); {REMEDY}")
        first += group.devices
    if first != cluster.devices:
        raise PlanFileError(f"{source}: cluster.groups hold {first} devices but "
                            f"cluster.devices is {cluster.devices}; {REMEDY}")
    if pipeline is None:
        return
    by_name = {group.name: group for group in cluster.groups}
    for s, stage in enumerate(pipeline.stages):
        on = [by_name[name] for name in stage.groups if name in by_name]
        if len(on) != len(stage.groups) or not on:
            raise PlanFileError(f"{source}: pipeline.stages[{s}].groups {list(stage.groups)} "
                                f"are not the cluster's groups {list(by_name)}; {REMEDY}")
        wanted = {g.name for g in cluster.groups
                  if any(rank in g.ranks for rank in stage.ranks)}
        if wanted != set(stage.groups):
            raise PlanFileError(f"{source}: pipeline.stages[{s}].groups: its ranks are on "
                                f"{sorted(wanted)}, not {list(stage.groups)}; {REMEDY}")
