"""Turn one layout into another with the cheapest sequence of collectives.

A search (Dijkstra) over layouts of the tensor, one mesh axis per move:

| move           | from                           | to                               |
| -------------- | ------------------------------ | -------------------------------- |
| all_gather     | axis is the minor split of dim | axis unused                      |
| slice (local)  | axis unused                    | axis the new minor split of dim  |
| all_to_all     | axis the minor split of dim i  | axis the new minor split of dim j|
| all_reduce     | axis partial                   | axis unused                      |
| reduce_scatter | axis partial                   | axis the new minor split of dim  |
| zero (local)   | axis unused                    | axis partial (one holder, zeros) |

Only the minor-most axis of a dim can be gathered or moved: with the row-major split order
of a Layout, anything else would reorder the data. The cost of a move comes from a cost
function (by default the ring traffic of the step); the planner passes the hardware model.
The backward pass runs the transposed moves in reverse order (`backward_steps`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from planner.errors import StrategyError
from planner.kinds import Move
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

#: Steps that move data between devices (the others are local).
COMMUNICATING = frozenset({Move.ALL_GATHER, Move.ALL_REDUCE, Move.REDUCE_SCATTER, Move.ALL_TO_ALL})
LOCAL_STEP_COST = 1e-12  # a local step costs (almost) nothing but is not free: fewer is better


@dataclass(frozen=True)
class CommStep:
    """One move over one mesh axis.

    `src_dim`/`dst_dim` are the tensor dims the axis leaves / joins (None where it is
    partial or unused). `nbytes` is the per-device buffer the ring formulas price: the
    gathered or unreduced local tensor (the larger side of the step).
    """

    kind: Move
    axes: tuple[str, ...]
    nbytes: int
    src_dim: int | None = None
    dst_dim: int | None = None

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING


StepCost = Callable[[CommStep, DeviceMesh], float]


def ring_traffic(step: CommStep, mesh: DeviceMesh) -> float:
    """Bytes each device sends in a ring implementation of `step` (the default cost)."""
    if not step.communicates:
        return LOCAL_STEP_COST
    p = mesh.group_size(step.axes)
    factor = 2.0 if step.kind == Move.ALL_REDUCE else 1.0
    return factor * (p - 1) / p * step.nbytes


def _normal(layout: Layout, mesh: DeviceMesh) -> Layout:
    if len(layout.partial) < 2:  # nothing to order: the common case, kept as it is
        return layout
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    return Layout(layout.dims, tuple(sorted(set(layout.partial), key=order.__getitem__)))


def _local_bytes(shape: Sequence[int], layout: Layout, mesh: DeviceMesh, itemsize: int) -> int:
    factors = layout.split_factors(mesh)
    return math.prod(s // f for s, f in zip(shape, factors, strict=True)) * itemsize


def _placement(layout: Layout, axis: str) -> tuple[str, int]:
    if axis in layout.partial:
        return "partial", -1
    for dim, axes in enumerate(layout.dims):
        if axis in axes:
            return "dim", dim
    return "none", -1


def _moves(layout: Layout, shape: Sequence[int], itemsize: int, mesh: DeviceMesh,
           target: Layout, movable: frozenset[str]) -> list[tuple[CommStep, Layout]]:
    dims = [list(axes) for axes in layout.dims]
    used = {a for axes in dims for a in axes} | set(layout.partial)
    local = _local_bytes(shape, layout, mesh, itemsize)
    moves: list[tuple[CommStep, Layout]] = []

    def fits(dim: int, axis: str, current: list[str]) -> bool:
        return shape[dim] % (mesh.group_size(current) * mesh.axis_size(axis)) == 0

    def with_dims(new_dims: list[list[str]], partial: Sequence[str]) -> Layout:
        return _normal(Layout(tuple(tuple(d) for d in new_dims), tuple(partial)), mesh)

    for dim, axes in enumerate(dims):
        if not axes or axes[-1] not in movable:
            continue
        axis = axes[-1]
        gathered = [list(d) for d in dims]
        gathered[dim] = axes[:-1]
        size = mesh.axis_size(axis)
        moves.append((CommStep(Move.ALL_GATHER, (axis,), local * size, dim, None),
                      with_dims(gathered, layout.partial)))
        for other in range(len(dims)):
            if other != dim and fits(other, axis, dims[other]):
                moved = [list(d) for d in gathered]
                moved[other] = [*moved[other], axis]
                moves.append((CommStep(Move.ALL_TO_ALL, (axis,), local, dim, other),
                              with_dims(moved, layout.partial)))
    for axis in layout.partial:
        if axis not in movable:
            continue
        rest = [a for a in layout.partial if a != axis]
        moves.append((CommStep(Move.ALL_REDUCE, (axis,), local), with_dims(dims, rest)))
        for dim in range(len(dims)):
            if fits(dim, axis, dims[dim]):
                scattered = [list(d) for d in dims]
                scattered[dim] = [*scattered[dim], axis]
                moves.append((CommStep(Move.REDUCE_SCATTER, (axis,), local, None, dim),
                              with_dims(scattered, rest)))
    for axis in mesh.axis_names:
        if axis in used or axis not in movable:
            continue
        for dim in range(len(dims)):
            if fits(dim, axis, dims[dim]):
                sliced = [list(d) for d in dims]
                sliced[dim] = [*sliced[dim], axis]
                moves.append((CommStep(Move.SLICE, (axis,), local, None, dim),
                              with_dims(sliced, layout.partial)))
        if axis in target.partial:
            moves.append((CommStep(Move.ZERO, (axis,), local),
                          with_dims(dims, [*layout.partial, axis])))
    return moves


def equivalent(src: Layout, dst: Layout, mesh: DeviceMesh) -> bool:
    """Whether reading a tensor stored in `src` in `dst` moves nothing (`redistribute`
    returns no step)."""
    return _normal(src, mesh) == _normal(dst, mesh)


def redistribute(
    src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, mesh: DeviceMesh,
    cost: StepCost = ring_traffic,
) -> list[CommStep]:
    """The cheapest move sequence from `src` to `dst` under `cost` (empty when equal)."""
    if cost is ring_traffic:  # the planner's pricing and derivation ask this one again and again
        return list(_ring_moves(src, dst, tuple(shape), itemsize, mesh))
    start, goal = _normal(src, mesh), _normal(dst, mesh)
    if start == goal:  # `equivalent`
        return []
    return _search(start, goal, shape, itemsize, mesh, cost)


@lru_cache(maxsize=1 << 18)
def _ring_moves(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
                mesh: DeviceMesh) -> tuple[CommStep, ...]:
    """`redistribute` under the ring-traffic cost: the direct moves where they reach the
    target, else the search."""
    start, goal = _normal(src, mesh), _normal(dst, mesh)
    if start == goal:
        return ()
    direct = _direct(start, goal, shape, itemsize, mesh)
    if direct is not None:
        return tuple(direct)
    return tuple(_search(start, goal, shape, itemsize, mesh, ring_traffic))


def _direct(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int,
            mesh: DeviceMesh) -> list[CommStep] | None:
    """One move per axis that differs, in an order that is always valid (the common case).

    Axes leave their dims minor first: to another dim by all-to-all when they land on the
    end of what that dim already holds in the target, else by all-gather; pending sums
    reduce-scatter onto a dim the same way, else all-reduce; then missing splits are
    sliced in order. None when the result is not the target (the search handles it).
    """
    steps: list[CommStep] = []
    dims = [list(axes) for axes in src.dims]
    partial = list(src.partial)

    def current() -> Layout:
        return Layout(tuple(tuple(d) for d in dims), tuple(partial))

    def lands(axis: str, dim: int) -> bool:
        """Appending `axis` to `dim` keeps it a prefix of the target's split of `dim`."""
        wanted = dst.dims[dim]
        return len(dims[dim]) < len(wanted) and wanted[: len(dims[dim]) + 1] == (
            *dims[dim], axis)

    for dim, axes in enumerate(src.dims):
        keep = 0
        while keep < min(len(axes), len(dst.dims[dim])) and axes[keep] == dst.dims[dim][keep]:
            keep += 1
        for axis in reversed(axes[keep:]):
            local = _local_bytes(shape, current(), mesh, itemsize)
            dims[dim].remove(axis)
            kind, where = _placement(dst, axis)
            if kind == "dim" and where != dim and lands(axis, where):
                dims[where].append(axis)
                steps.append(CommStep(Move.ALL_TO_ALL, (axis,), local, dim, where))
            else:
                steps.append(CommStep(Move.ALL_GATHER, (axis,), local * mesh.axis_size(axis),
                                      dim, None))
    for axis in src.partial:
        if axis in dst.partial:
            continue
        local = _local_bytes(shape, current(), mesh, itemsize)
        partial.remove(axis)
        kind, where = _placement(dst, axis)
        if kind == "dim" and lands(axis, where):
            dims[where].append(axis)
            steps.append(CommStep(Move.REDUCE_SCATTER, (axis,), local, None, where))
        else:
            steps.append(CommStep(Move.ALL_REDUCE, (axis,), local))
    for dim, axes in enumerate(dst.dims):
        if tuple(dims[dim]) != axes[: len(dims[dim])]:
            return None
        for axis in axes[len(dims[dim]):]:
            if _placement(current(), axis)[0] != "none":
                return None
            local = _local_bytes(shape, current(), mesh, itemsize)
            dims[dim].append(axis)
            steps.append(CommStep(Move.SLICE, (axis,), local, None, dim))
    for axis in dst.partial:
        if axis not in partial:
            if _placement(current(), axis)[0] != "none":
                return None
            steps.append(CommStep(Move.ZERO, (axis,), _local_bytes(shape, current(), mesh,
                                                                  itemsize)))
            partial.append(axis)
    if _normal(current(), mesh) != dst or any(
            s % f for s, f in zip(shape, dst.split_factors(mesh), strict=True)):
        return None
    return steps


def _search(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, mesh: DeviceMesh,
            cost: StepCost) -> list[CommStep]:
    # Axes placed alike in both layouts are left alone, as are the axes splitting a dim
    # before the first difference; everything after must be free to move.
    movable = set()
    for axis in mesh.axis_names:
        if _placement(src, axis) != _placement(dst, axis):
            movable.add(axis)
    for src_axes, dst_axes in zip(src.dims, dst.dims, strict=True):
        common = 0
        while (common < min(len(src_axes), len(dst_axes))
               and src_axes[common] == dst_axes[common]):
            common += 1
        movable.update(src_axes[common:])
        movable.update(dst_axes[common:])
    frozen = frozenset(movable)
    counter = itertools.count()
    frontier: list[tuple[float, int, Layout, list[CommStep]]] = [(0.0, next(counter), src, [])]
    best: dict[Layout, float] = {src: 0.0}
    while frontier:
        spent, _, layout, path = heapq.heappop(frontier)
        if layout == dst:
            return path
        if spent > best.get(layout, float("inf")):
            continue
        for step, after in _moves(layout, shape, itemsize, mesh, dst, frozen):
            total = spent + cost(step, mesh)
            if total < best.get(after, float("inf")):
                best[after] = total
                heapq.heappush(frontier, (total, next(counter), after, [*path, step]))
    raise StrategyError(
        f"no sequence of collectives turns layout {src.to_json()} into {dst.to_json()} "
        f"for shape {list(shape)} on mesh {mesh.shape}"
    )


def backward_steps(
    forward: Sequence[CommStep], grad_partial_axes: Sequence[str], src_bytes: int
) -> list[CommStep]:
    """The transposed moves, in reverse order, applied to the gradient.

    A gradient that arrives partial over some axes (its consumer split work over an axis
    the tensor is replicated on) is reduced where the forward pass gathered or copied: a
    ReduceScatter instead of a local slice, an AllReduce where the data was replicated.
    Axes still partial at the end are reduced by a final AllReduce of the gradient in the
    source layout, whose local size is `src_bytes`.
    """
    partial = list(dict.fromkeys(grad_partial_axes))
    steps: list[CommStep] = []
    for step in reversed(forward):
        axis = step.axes[0]
        if step.kind == Move.ALL_GATHER:
            if axis in partial:
                partial.remove(axis)
                steps.append(CommStep(Move.REDUCE_SCATTER, step.axes, step.nbytes, None,
                                      step.src_dim))
            else:
                steps.append(CommStep(Move.SLICE, step.axes, step.nbytes, None, step.src_dim))
        elif step.kind in (Move.SLICE, Move.REDUCE_SCATTER):
            steps.append(CommStep(Move.ALL_GATHER, step.axes, step.nbytes, step.dst_dim, None))
        elif step.kind == Move.ALL_TO_ALL:
            steps.append(CommStep(Move.ALL_TO_ALL, step.axes, step.nbytes, step.dst_dim,
                                  step.src_dim))
        elif step.kind == Move.ALL_REDUCE:
            if axis in partial:
                partial.remove(axis)
                steps.append(CommStep(Move.ALL_REDUCE, step.axes, step.nbytes))
        elif step.kind == Move.ZERO and axis not in partial:
            partial.append(axis)
    steps += [CommStep(Move.ALL_REDUCE, (axis,), src_bytes) for axis in partial]
    return steps
