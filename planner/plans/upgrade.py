"""Plan files of earlier releases, brought up to the current sections on load.

Files written before the plan builder recorded them lack, per pipeline stage, the weights
it holds, and, per send, the chunks (op ranges) it joins, and in the parallel section
whether the plan runs sequence parallelism (`sp`). All are read off the file's own op
bindings and layouts here, once, when such a file is loaded; files written now carry them
(`cp` and `ep` were 1 in every plan: their defaults).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from planner.plans.sections import (
    OpEntry,
    ParallelConfig,
    PipelineSection,
    SendEntry,
    StageEntry,
    TensorEntry,
    UnitEntry,
)
from planner.plans.sequence import sequence_parallel

WEIGHT_KINDS = ("parameter", "buffer")


def upgrade_pipeline(section: PipelineSection, ops: Sequence[OpEntry],
                     tensors: Mapping[str, TensorEntry]) -> PipelineSection:
    if all(stage.holds for stage in section.stages) and all(
            s.from_chunk >= 0 and s.to_chunk >= 0 for s in section.sends):
        return section
    stages = tuple(stage if stage.holds else replace(stage, holds=_holds(stage, ops, tensors))
                   for stage in section.stages)
    section = replace(section, stages=stages)
    chunks = section.chunks()
    chunk_of = [0] * len(ops)
    for index, ((first, end), _) in enumerate(chunks):
        for k in range(max(0, first), min(end, len(ops))):
            chunk_of[k] = index
    producer = {b.tensor: k for k, op in enumerate(ops) for b in op.outputs if b}
    readers: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        for binding in op.inputs:
            if binding:
                readers.setdefault(binding.tensor, []).append(k)
    sends = []
    for send in section.sends:
        if send.from_chunk >= 0 and send.to_chunk >= 0:
            sends.append(send)
            continue
        source = chunk_of[producer[send.tensor]] if send.tensor in producer else -1
        targets = sorted(chunk_of[k] for k in readers.get(send.tensor, [])
                         if chunks[chunk_of[k]][1] == send.to_stage)
        sends.append(SendEntry(send.tensor, send.from_stage, send.to_stage, send.bytes,
                               send.grad, source, targets[0] if targets else -1))
    return replace(section, sends=tuple(sends))


def _holds(stage: StageEntry, ops: Sequence[OpEntry],
           tensors: Mapping[str, TensorEntry]) -> tuple[str, ...]:
    held = {b.tensor for a, end in stage.ops for op in ops[max(0, a):end] for b in op.inputs
            if b and b.tensor in tensors and tensors[b.tensor].kind in WEIGHT_KINDS}
    return tuple(sorted(held))


def upgrade_parallel(section: ParallelConfig, data: Mapping[str, object],
                     ops: Sequence[OpEntry], tensors: Mapping[str, TensorEntry],
                     units: Sequence[UnitEntry]) -> ParallelConfig:
    """The parallel section with `sp` read off the layouts where the file (`data`, its
    JSON) predates the key: a Megatron sequence-parallel plan says so, as it would now."""
    if "sp" in data:
        return section
    return replace(section, sp=sequence_parallel(ops, tensors, units))
