"""Whether a plan runs sequence parallelism, read off the plan's own layouts.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022, §4.2.2) differs from its plain
tensor-parallel split in one place a plan file shows: the activations between transformer
blocks. Plain tensor parallelism holds them whole on every tensor-parallel rank (each
block ends in an all-reduce); sequence parallelism holds each rank's slice of the sequence
(each block ends in a reduce-scatter, and the next all-gathers before its first GEMM).

The definition, for every plan alike (Megatron's layout, the searched op-level layout, a
pipeline's stages): a plan is sequence parallel (`parallel.sp` = 1) when an activation a
repeated layer hands on, a float activation of rank 3 written by an op of a layer unit
(the plan's `units`) and read by an op of a later unit, is stored split along dim 1, the
sequence of a [batch, sequence, hidden] activation (the convention Megatron's split,
`planner.search.megatron`, splits by). In the joint search's plans the data axis splits
the batch alone, so the axis is the tensor axis; in an op-level plan over generic axes it
is an axis `parallel.tp` counts. A plan without repeated layers has no activations between
blocks and says 0. The context-parallel axis ("cp") splits the sequence of every
activation too; that is context parallelism (`parallel.cp`), not sp, so a split over it
alone does not count. The builder writes `parallel.sp` from this function and `validate`
checks a plan file against it, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.graph import FLOAT_DTYPES
from planner.kinds import AxisRole
from planner.plans.sections import OpEntry, TensorEntry, UnitEntry

#: The sequence dim of a [batch, sequence, hidden] activation.
SEQUENCE_DIM = 1


def sequence_split(ops: Sequence[OpEntry], tensors: Mapping[str, TensorEntry],
                   units: Sequence[UnitEntry]) -> str | None:
    """The first activation a layer hands on that is stored split along the sequence
    (the module doc's definition), or None: the plan is not sequence parallel."""
    unit_of = [-1] * len(ops)
    layers = set()
    for index, unit in enumerate(units):
        if unit.is_layer:
            layers.add(index)
        for k in range(max(0, unit.ops[0]), min(unit.ops[1], len(ops))):
            unit_of[k] = index
    written: dict[str, int] = {}
    for k, op in enumerate(ops):
        for binding in op.inputs:
            if binding is not None and written.get(binding.tensor, unit_of[k]) < unit_of[k] \
                    and _sequence_split(tensors.get(binding.tensor)):
                return binding.tensor
        if unit_of[k] in layers:
            for binding in op.outputs:
                if binding is not None:
                    written[binding.tensor] = unit_of[k]
    return None


def sequence_parallel(ops: Sequence[OpEntry], tensors: Mapping[str, TensorEntry],
                      units: Sequence[UnitEntry]) -> int:
    """`parallel.sp` as the builder writes it and an older file is read: 1 when the
    plan's own layouts are sequence parallel (`sequence_split`), else 0."""
    return int(sequence_split(ops, tensors, units) is not None)


def _sequence_split(entry: TensorEntry | None) -> bool:
    """Whether `entry` is a [batch, sequence, hidden] float activation stored split along
    its sequence."""
    return (entry is not None and entry.kind == "activation" and len(entry.shape) == 3
            and entry.dtype in FLOAT_DTYPES
            and any(axis != AxisRole.CONTEXT for axis in entry.layout.dims[SEQUENCE_DIM]))
