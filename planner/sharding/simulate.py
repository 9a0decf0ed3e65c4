"""A numpy SPMD simulator: run ops and redistributions on virtual devices.

Each virtual device holds its local shard as a numpy array. An op runs as the local
program of `planner.sharding.local` on every device (ONNX's reference evaluator), with
`shardplan::AllReduce` nodes and redistribution steps simulated across devices. Tests use
it to prove that every strategy a rule can emit computes what the unsharded op computes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from planner.graph import OpNode, TensorInfo
from planner.kinds import Move
from planner.ops import SHARDPLAN_DOMAIN, DimLabels, LocalProgram
from planner.reference import run_node
from planner.sharding.layout import Layout
from planner.sharding.local import local_program
from planner.sharding.mesh import DeviceMesh
from planner.sharding.redistribute import CommStep
from planner.sharding.strategy import OpStrategy, input_layouts, output_layouts

Coord = tuple[int, ...]
Shards = dict[Coord, np.ndarray]


def coords(mesh: DeviceMesh) -> list[Coord]:
    """Device coordinates in row-major order (device id order)."""
    return list(itertools.product(*(range(size) for size in mesh.shape)))


def _group_index(coord: Coord, axes: Sequence[str], mesh: DeviceMesh) -> int:
    index = 0
    for axis in axes:
        index = index * mesh.axis_size(axis) + coord[mesh.axis_names.index(axis)]
    return index


def _slices(shape: Sequence[int], layout: Layout, mesh: DeviceMesh,
            coord: Coord) -> tuple[slice, ...]:
    result = []
    for size, axes in zip(shape, layout.dims, strict=True):
        parts = mesh.group_size(axes)
        chunk = size // parts
        start = _group_index(coord, axes, mesh) * chunk
        result.append(slice(start, start + chunk))
    return tuple(result)


def shard(value: np.ndarray, layout: Layout, mesh: DeviceMesh,
          rng: np.random.Generator | None = None) -> Shards:
    """Each device's piece; a partial layout splits the value into random summands."""
    rng = rng or np.random.default_rng(0)
    shards: Shards = {}
    partial_groups: dict[Coord, list[Coord]] = {}
    for coord in coords(mesh):
        shards[coord] = np.array(value[_slices(value.shape, layout, mesh, coord)])
        if layout.partial:
            key = tuple(c if mesh.axis_names[i] not in layout.partial else -1
                        for i, c in enumerate(coord))
            partial_groups.setdefault(key, []).append(coord)
    for members in partial_groups.values():
        whole = shards[members[0]]
        if whole.dtype.kind == "f":
            pieces = [rng.standard_normal(whole.shape).astype(whole.dtype)
                      for _ in members[1:]]
            shards[members[0]] = (whole - sum(pieces, np.zeros_like(whole))).astype(whole.dtype)
            for member, piece in zip(members[1:], pieces, strict=True):
                shards[member] = piece
        else:
            for member in members[1:]:
                shards[member] = np.zeros_like(whole)
    return shards


def unshard(shards: Shards, layout: Layout, shape: Sequence[int], mesh: DeviceMesh,
            atol: float = 1e-5) -> np.ndarray:
    """Reassemble the global value; replicas must agree, partial sums are summed."""
    first = next(iter(shards.values()))
    result = np.zeros(tuple(shape), dtype=first.dtype)
    seen = np.zeros(tuple(shape), dtype=bool)
    for coord in coords(mesh):
        if any(coord[mesh.axis_names.index(a)] for a in layout.partial):
            continue
        region = _slices(shape, layout, mesh, coord)
        piece = _sum_partial(shards, coord, layout, mesh)
        if seen[region].all() and not np.allclose(result[region], piece, atol=atol,
                                                   rtol=1e-4, equal_nan=True):
            raise AssertionError(f"replicas disagree at device {coord} for {layout}")
        result[region] = piece
        seen[region] = True
    return result


def _sum_partial(shards: Shards, coord: Coord, layout: Layout, mesh: DeviceMesh) -> np.ndarray:
    if not layout.partial:
        return shards[coord]
    total = None
    for other in _group(coord, layout.partial, mesh):
        total = shards[other] if total is None else total + shards[other]
    assert total is not None
    return total


def _group(coord: Coord, axes: Sequence[str], mesh: DeviceMesh) -> list[Coord]:
    """Devices that differ from `coord` only along `axes`, in group order."""
    indices = [mesh.axis_names.index(a) for a in axes]
    members = []
    for values in itertools.product(*(range(mesh.shape[i]) for i in indices)):
        member = list(coord)
        for i, v in zip(indices, values, strict=True):
            member[i] = v
        members.append(tuple(member))
    return members


# --------------------------------------------------------------------------- collectives


def all_reduce(shards: Shards, axes: Sequence[str], mesh: DeviceMesh) -> Shards:
    """Every member gets the same sum, added in group order (so replicas agree exactly)."""
    result = {}
    for coord in shards:
        members = _group(coord, axes, mesh)
        total = shards[members[0]]
        for member in members[1:]:
            total = total + shards[member]
        result[coord] = total
    return result


def all_gather(shards: Shards, axes: Sequence[str], dim: int, mesh: DeviceMesh) -> Shards:
    return {c: np.concatenate([shards[m] for m in _group(c, axes, mesh)], axis=dim)
            for c in shards}


def local_slice(shards: Shards, axes: Sequence[str], dim: int, mesh: DeviceMesh) -> Shards:
    result = {}
    parts = mesh.group_size(axes)
    for c, value in shards.items():
        chunk = value.shape[dim] // parts
        start = _group_index(c, axes, mesh) * chunk
        index = [slice(None)] * value.ndim
        index[dim] = slice(start, start + chunk)
        result[c] = value[tuple(index)]
    return result


def apply_steps(shards: Shards, steps: Sequence[CommStep], mesh: DeviceMesh) -> Shards:
    """Simulate a redistribution (or its backward) step by step."""
    for step in steps:
        if step.kind == Move.ALL_GATHER:
            assert step.src_dim is not None
            shards = all_gather(shards, step.axes, step.src_dim, mesh)
        elif step.kind == Move.SLICE:
            assert step.dst_dim is not None
            shards = local_slice(shards, step.axes, step.dst_dim, mesh)
        elif step.kind == Move.ALL_REDUCE:
            shards = all_reduce(shards, step.axes, mesh)
        elif step.kind == Move.REDUCE_SCATTER:
            assert step.dst_dim is not None
            shards = local_slice(all_reduce(shards, step.axes, mesh), step.axes, step.dst_dim,
                                 mesh)
        elif step.kind == Move.ALL_TO_ALL:
            assert step.src_dim is not None and step.dst_dim is not None
            gathered = all_gather(shards, step.axes, step.src_dim, mesh)
            shards = local_slice(gathered, step.axes, step.dst_dim, mesh)
        elif step.kind == Move.ZERO:
            shards = {c: v if all(c[mesh.axis_names.index(a)] == 0 for a in step.axes)
                      else np.zeros_like(v) for c, v in shards.items()}
        else:
            raise ValueError(f"unknown step {step.kind}")
    return shards


# --------------------------------------------------------------------------- ops


def run_programs(programs: Mapping[Coord, LocalProgram], feeds: Mapping[Coord, dict],
                 mesh: DeviceMesh, opset: int) -> dict[Coord, dict[str, np.ndarray]]:
    """Run each device's program in lockstep; shardplan-domain nodes are collectives."""
    env = {c: {**feeds[c], **programs[c].constants} for c in programs}
    length = len(next(iter(programs.values())).nodes)
    for step in range(length):
        sample = next(iter(programs.values())).nodes[step]
        if sample.domain == SHARDPLAN_DOMAIN:
            axes = [a.decode() if isinstance(a, bytes) else a
                    for a in onnx.helper.get_attribute_value(sample.attribute[0])]
            values = all_reduce({c: env[c][sample.input[0]] for c in env}, axes, mesh)
            for c in env:
                env[c][sample.output[0]] = values[c]
            continue
        for c, program in programs.items():
            node = program.nodes[step]
            inputs = {name: env[c][name] for name in node.input if name}
            results = run_node(node, inputs, opset)
            for name, value in zip(node.output, results, strict=False):
                if name:
                    env[c][name] = np.asarray(value)
    return env


def simulate_op(node: OpNode, labels: DimLabels, strategy: OpStrategy,
                inputs: Sequence[np.ndarray | None], tensors: Mapping[str, TensorInfo],
                mesh: DeviceMesh, opset: int,
                rng: np.random.Generator | None = None) -> list[np.ndarray | None]:
    """Run `node` split by `strategy` on the mesh and reassemble its global outputs."""
    in_ranks = [len(tensors[t].shape) if t else -1 for t in node.inputs]
    out_ranks = [len(tensors[t].shape) if t else -1 for t in node.outputs]
    in_layouts = input_layouts(labels, strategy, in_ranks)
    out_layouts = output_layouts(labels, strategy, out_ranks)
    rng = rng or np.random.default_rng(0)
    feeds: dict[Coord, dict[str, np.ndarray]] = {c: {} for c in coords(mesh)}
    for name, value, layout in zip(node.inputs, inputs, in_layouts, strict=True):
        if not name or value is None or layout is None:
            continue
        for c, piece in shard(np.asarray(value), layout, mesh, rng).items():
            feeds[c][name] = piece
    programs = {c: local_program(node, labels, strategy, tensors, mesh, c) for c in feeds}
    env = run_programs(programs, feeds, mesh, opset)
    results: list[np.ndarray | None] = []
    for name, layout in zip(node.outputs, out_layouts, strict=True):
        if not name or layout is None:
            results.append(None)
            continue
        results.append(unshard({c: env[c][name] for c in env}, layout, tensors[name].shape,
                               mesh))
    return results
