"""How a plan's ops are grouped into units (layers, prefix, suffix) and described.

A unit is a run of ops explained together. `op_split` names how one op is split by the
role each mesh axis plays for it; `op_classes` and `template` count the same position of
every layer as one op (or collective) class and name it `h.*.mlp.fc`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from planner.plans.model import Plan
from planner.plans.sections import OpEntry, UnitEntry

MAX_GROUPS = 40  # name-prefix groups beyond this are merged into equal chunks


@dataclass(frozen=True)
class Unit:
    """A run of ops explained together: a repeated layer, the prefix, the suffix, ..."""

    name: str
    ranges: tuple[tuple[int, int], ...]  # [first, end) into plan.ops
    is_layer: bool

    def indices(self) -> list[int]:
        return [i for first, end in self.ranges for i in range(first, end)]


def find_units(plan: Plan) -> tuple[list[Unit], str]:
    """The units to explain, and how they were found.

    1. A pipeline plan lists its units: the cut points its stages respect. Use them.
    2. Otherwise the plan's `units`: the model's layers as the planner found them (its
       repeated block of ops, with the prefix before and the suffix after), recorded when
       the block covers at least half the graph. So op-level plans are grouped as the
       search grouped them, without the model file (often gone, or on another machine).
    3. No layers recorded (a small or irregular graph, or a run of a few alike ops):
       consecutive ops sharing the first segment of their names, which exporters and the
       zoo set from the module path.
    """
    if plan.pipeline is not None and plan.pipeline.units:
        return ([_unit(u) for u in plan.pipeline.units],
                "the plan's pipeline units (the cut points its stages respect)")
    layers = [u for u in plan.units if u.is_layer]
    if layers:
        sizes = sorted({end - first for first, end in (u.ops for u in layers)})
        size = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        return ([_unit(u) for u in plan.units],
                f"repeated layers found by the planner ({len(layers)} layers of {size} ops)")
    return _name_units(plan), "consecutive ops sharing a name prefix (no repeated layer)"


def _unit(entry: UnitEntry) -> Unit:
    return Unit(entry.name, (entry.ops,), entry.is_layer)


def _name_units(plan: Plan) -> list[Unit]:
    """Runs of ops with the same first name segment; equal chunks when there are many."""
    keys = [_first_segment(op.name) for op in plan.ops]
    units: list[Unit] = []
    first = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[first]:
            units.append(Unit(keys[first], ((first, i),), False))
            first = i
    if len(units) <= MAX_GROUPS:
        return units
    size = -(-len(plan.ops) // MAX_GROUPS)
    return [Unit(f"ops {a}-{min(a + size, len(plan.ops)) - 1}",
                 ((a, min(a + size, len(plan.ops))),), False)
            for a in range(0, len(plan.ops), size)]


def _first_segment(name: str) -> str:
    parts = [p for p in re.split(r"[./:]", name) if p]
    return parts[0] if parts else name


def op_split(op: OpEntry, plan: Plan) -> str:
    """How an op is split, by the role of each mesh axis it uses: batch, weights, dim d."""
    used = {a for axes in op.assignment.values() for a in axes}
    axes = [a for a in plan.mesh.axis_names if a in used] + sorted(
        used - set(plan.mesh.axis_names))
    if not axes:
        return "replicated"
    return " + ".join(f"{_axis_role(op, axis, plan)} over {axis}" for axis in axes)


def _axis_role(op: OpEntry, axis: str, plan: Plan) -> str:
    bindings = [b for b in op.inputs if b]
    for binding in bindings:
        info = plan.tensors.get(binding.tensor)
        if info is not None and info.kind == "parameter" and any(
                axis in dim for dim in binding.layout.dims):
            return "weights"
    batch = plan.model.batch
    slots = [("input", b) for b in bindings] + [("output", b) for b in op.outputs if b]
    for slot, binding in slots:
        info = plan.tensors.get(binding.tensor)
        if info is None or info.kind == "parameter":
            continue
        for dim, dim_axes in enumerate(binding.layout.dims):
            if axis in dim_axes:
                is_batch = dim == 0 and batch and info.shape and info.shape[0] == batch
                return "batch" if is_batch else f"{slot} dim {dim}"
    return "reduction"


def op_classes(units: list[Unit], n: int) -> list[tuple]:
    classes: list[tuple] = [("op", i) for i in range(n)]
    layers = [u for u in units if u.is_layer and len(u.ranges) == 1]
    sizes = {u.ranges[0][1] - u.ranges[0][0] for u in layers}
    if len(layers) >= 2 and len(sizes) == 1:
        for unit in layers:
            first = unit.ranges[0][0]
            for i in unit.indices():
                classes[i] = ("layer", i - first)
    return classes


def template(names: Sequence[str]) -> str:
    """`h.0.mlp.fc`, `h.1.mlp.fc` -> `h.*.mlp.fc`: number runs that differ become `*`."""
    split = [re.split(r"(\d+)", name) for name in names]
    if len({len(parts) for parts in split}) != 1:
        return f"{names[0]} …"
    out = []
    for position, tokens in enumerate(zip(*split, strict=True)):
        if len(set(tokens)) == 1:
            out.append(tokens[0])
        elif position % 2 == 1:  # a digit run
            out.append("*")
        else:
            return f"{names[0]} …"
    return "".join(out)
