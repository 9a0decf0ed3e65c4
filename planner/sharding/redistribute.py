"""Turn one layout into another with collectives, and transpose that for the backward pass.

Each mesh axis is handled on its own: where the axis sits in the source layout (splitting
a dim, pending a partial sum, or unused) and where it must sit in the target decides one
step. Steps of the same kind are merged into one collective over several axes.

| source \\ target | unused (replicated) | splits dim j        | partial         |
| ---------------- | ------------------- | ------------------- | --------------- |
| unused           | -                   | slice (free)        | zero (free)     |
| splits dim i     | all_gather          | all_to_all (i != j) | all_gather+zero |
| partial          | all_reduce          | reduce_scatter      | -               |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

#: Steps that move data between devices (the others are local).
COMMUNICATING = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
#: Backward step of each forward step when the incoming gradient is not a partial sum.
TRANSPOSE = {"all_gather": "slice", "slice": "all_gather", "all_reduce": None,
             "reduce_scatter": "all_gather", "all_to_all": "all_to_all", "zero": None}


@dataclass(frozen=True)
class CommStep:
    """One collective (or local step) over some mesh axes.

    `nbytes` is the per-device buffer the ring formulas price: the gathered or unreduced
    local tensor (the larger side of the step).
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: int

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING


def _place(layout: Layout, axis: str) -> tuple[str, int | None]:
    if axis in layout.partial:
        return "partial", None
    for dim, axes in enumerate(layout.dims):
        if axis in axes:
            return "dim", dim
    return "none", None


def _local_bytes(shape: Sequence[int], layout: Layout, mesh: DeviceMesh, itemsize: int,
                 without: Sequence[str] = ()) -> int:
    """Bytes of one device's piece, pretending the axes in `without` do not split."""
    factors = [
        mesh.group_size([a for a in axes if a not in without]) for axes in layout.dims
    ]
    numel = int(np.prod([s // f for s, f in zip(shape, factors, strict=True)], dtype=np.int64))
    return numel * itemsize


def redistribute(
    src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, mesh: DeviceMesh
) -> list[CommStep]:
    """Forward steps that turn `src` into `dst`, merged per kind."""
    kinds: dict[str, list[str]] = {}
    for axis in mesh.axis_names:
        (s_kind, s_dim), (d_kind, d_dim) = _place(src, axis), _place(dst, axis)
        step = _step(s_kind, s_dim, d_kind, d_dim)
        for kind in step:
            kinds.setdefault(kind, []).append(axis)
    order = ("all_reduce", "reduce_scatter", "all_to_all", "all_gather", "slice", "zero")
    steps = []
    for kind in order:
        axes = tuple(kinds.get(kind, ()))
        if not axes:
            continue
        steps.append(CommStep(kind, axes, _step_bytes(kind, axes, src, dst, shape, itemsize,
                                                      mesh)))
    return steps


def _step(s_kind: str, s_dim: int | None, d_kind: str, d_dim: int | None) -> tuple[str, ...]:
    if s_kind == d_kind and s_dim == d_dim:
        return ()
    table = {
        ("none", "dim"): ("slice",), ("none", "partial"): ("zero",),
        ("dim", "none"): ("all_gather",), ("dim", "dim"): ("all_to_all",),
        ("dim", "partial"): ("all_gather", "zero"),
        ("partial", "none"): ("all_reduce",), ("partial", "dim"): ("reduce_scatter",),
    }
    return table[(s_kind, d_kind)]


def _step_bytes(kind: str, axes: Sequence[str], src: Layout, dst: Layout,
                shape: Sequence[int], itemsize: int, mesh: DeviceMesh) -> int:
    if kind in ("all_gather", "all_to_all"):
        return _local_bytes(shape, src, mesh, itemsize, without=axes)
    if kind in ("all_reduce", "reduce_scatter"):
        return _local_bytes(shape, dst, mesh, itemsize, without=axes)
    return 0


def backward_steps(
    forward: Sequence[CommStep], grad_partial_axes: Sequence[str]
) -> list[CommStep]:
    """The transposed steps, run in reverse order on the gradient.

    A gradient arriving as a partial sum over some axes (its consumer split work over an
    axis the tensor is replicated on) must be reduced: an AllReduce, or a ReduceScatter
    where the forward step gathered.
    """
    partial = set(grad_partial_axes)
    steps: list[CommStep] = []
    for step in reversed(forward):
        reduced = tuple(a for a in step.axes if a in partial)
        if step.kind == "all_gather" and reduced:
            steps.append(CommStep("reduce_scatter", reduced, step.nbytes))
            partial -= set(reduced)
            rest = tuple(a for a in step.axes if a not in reduced)
            if rest:
                steps.append(CommStep("slice", rest, 0))
            continue
        transposed = TRANSPOSE[step.kind]
        if transposed is not None:
            steps.append(CommStep(transposed, step.axes, step.nbytes))
    return steps
