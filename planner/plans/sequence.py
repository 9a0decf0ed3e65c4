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
alone does not count. The builder writes `parallel.sp` from `handed_on_split` over its
derivation (before, and whether or not, it writes the entries) and `validate` checks a
plan file's entries with the same function, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from planner.graph import FLOAT_DTYPES
from planner.kinds import AxisRole
from planner.plans.sections import OpEntry, TensorEntry, UnitEntry
from planner.sharding.layout import Layout

#: The sequence dim of a [batch, sequence, hidden] activation.
SEQUENCE_DIM = 1

#: Per op, the tensors it reads and writes as laid out data (a plan entry's bindings)
Reads = Sequence[tuple[Sequence[str], Sequence[str]]]


def sequence_split(ops: Sequence[OpEntry], tensors: Mapping[str, TensorEntry],
                   units: Sequence[UnitEntry]) -> str | None:
    """The first activation a layer hands on that is stored split along the sequence
    (the module doc's definition), or None: the plan is not sequence parallel."""
    reads = [(tuple(b.tensor for b in op.inputs if b is not None),
              tuple(b.tensor for b in op.outputs if b is not None)) for op in ops]

    def split(name: str) -> bool:
        entry = tensors.get(name)
        return entry is not None and splits_sequence(entry.kind, entry.shape, entry.dtype,
                                                     entry.layout)
    return handed_on_split(reads, split, units)


def handed_on_split(reads: Reads, split: Callable[[str], bool],
                    units: Sequence[UnitEntry]) -> str | None:
    """`sequence_split` over each op's reads and writes and a test of a stored tensor
    (`splits_sequence`): what the builder asks of its derivation before it writes the
    plan's entries, and `validate` of those entries."""
    unit_of = [-1] * len(reads)
    layers = set()
    for index, unit in enumerate(units):
        if unit.is_layer:
            layers.add(index)
        for k in range(max(0, unit.ops[0]), min(unit.ops[1], len(reads))):
            unit_of[k] = index
    written: dict[str, int] = {}
    for k, (inputs, outputs) in enumerate(reads):
        for name in inputs:
            if written.get(name, unit_of[k]) < unit_of[k] and split(name):
                return name
        if unit_of[k] in layers:
            for name in outputs:
                written[name] = unit_of[k]
    return None


def sequence_parallel(ops: Sequence[OpEntry], tensors: Mapping[str, TensorEntry],
                      units: Sequence[UnitEntry]) -> int:
    """`parallel.sp` from a plan's entries: 1 when its own layouts are sequence parallel
    (`sequence_split`), else 0; how an older file is read, and how the builder writes a
    plan whose stages have meshes of their own (its entries are written first there)."""
    return int(sequence_split(ops, tensors, units) is not None)


def splits_sequence(kind: str, shape: Sequence[int], dtype: str, layout: Layout) -> bool:
    """Whether a tensor is a [batch, sequence, hidden] float activation stored split along
    its sequence."""
    return (kind == "activation" and len(shape) == 3 and dtype in FLOAT_DTYPES
            and any(axis != AxisRole.CONTEXT for axis in layout.dims[SEQUENCE_DIM]))
