"""What a pipeline's stages hold and exchange, from the graph's ops and the partition alone.

The plan builder (`planner.plans.build`) lists a pipeline plan's sends, their collectives
and the weights each stage holds from these functions, and `shardplan validate`
(`planner.validate`) re-derives the same facts from them to check a plan file: one
derivation, no prices. Ops are given as (inputs, outputs) name lists in graph order (a
graph's ops and a plan's op entries alike); units and chunks are op index ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.kinds import AxisRole, CollectiveKind, Phase
from planner.sharding.sends import SEND_OP, SendSplit

OpNames = tuple[Sequence[str | None], Sequence[str | None]]  # an op's inputs, outputs
Chunk = tuple[tuple[int, int], int]  # an op range and the device stage running it


@dataclass(frozen=True)
class UnitCrossing:
    """An activation read by later units than the one producing it."""

    tensor: str
    producer: int  # unit
    consumers: tuple[int, ...]  # units other than the producer's, ascending


def unit_crossings(ops: Sequence[OpNames], unit_of: Sequence[int]) -> tuple[UnitCrossing, ...]:
    """Every tensor an op produces that ops of other units read, in the order ops first
    read them (graph inputs and weights are no crossings: every stage holds its own)."""
    producer: dict[str, int] = {}
    consumers: dict[str, set[int]] = {}
    for k, (_, outputs) in enumerate(ops):
        for name in outputs:
            if name:
                producer[name] = int(unit_of[k])
    for k, (inputs, _) in enumerate(ops):
        for name in inputs:
            if name and name in producer:
                consumers.setdefault(name, set()).add(int(unit_of[k]))
    result = []
    for name, units in consumers.items():
        later = tuple(sorted(u for u in units if u != producer[name]))
        if later:
            result.append(UnitCrossing(name, producer[name], later))
    return tuple(result)


def chunk_of_units(bounds: Sequence[int], chunks: Sequence[Chunk]) -> dict[int, int]:
    """unit -> index of the chunk holding it (`bounds`: the units' op boundaries)."""
    found: dict[int, int] = {}
    for index, ((first, end), _) in enumerate(chunks):
        for u in range(bounds.index(first), bounds.index(end)):
            found[u] = index
    return found


def send_routes(crossing: UnitCrossing, grad: bool, chunk_of_unit: Mapping[int, int],
                chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
    """(source chunk, target chunk) of every send of one crossing.

    A tensor that carries a gradient goes to every chunk of another device reading it
    (each chunk's backward pass returns its own gradient); one without reaches a device
    once, at the first of its chunks reading it, which hands it on to the device's later
    chunks.
    """
    source = chunk_of_unit[crossing.producer]
    source_device = chunks[source][1]
    readers = sorted({chunk_of_unit[u] for u in crossing.consumers} - {source})
    reached: set[int] = set()
    routes = []
    for target in readers:
        device = chunks[target][1]
        if device == source_device or (not grad and device in reached):
            continue
        reached.add(device)
        routes.append((source, target))
    return routes


@dataclass(frozen=True)
class SendStep:
    """One collective of a send, every micro-batch: the transfer (named after the first op
    of the receiving chunk reading the tensor) or the all-gather of a scattered send."""

    kind: CollectiveKind
    axes: tuple[str, ...]
    phase: Phase
    op: str

    @property
    def gathers(self) -> bool:
        return self.op == SEND_OP


def send_steps(tensor: str, grad: bool, split: SendSplit | None,
               receiving: Sequence[OpNames], names: Sequence[str]) -> list[SendStep]:
    """The collectives of a send of `tensor` into a chunk whose ops are `receiving`
    (named `names`): its transfer forward (and its gradient back when `grad`), each
    followed by the all-gather of the slices when `split` scatters it."""
    op = next((name for name, (inputs, _) in zip(names, receiving, strict=True)
               if tensor in inputs), "pipeline")
    steps = []
    for phase in (Phase.FORWARD, Phase.BACKWARD) if grad else (Phase.FORWARD,):
        steps.append(SendStep(CollectiveKind.SEND_RECV, (str(AxisRole.PIPELINE),), phase, op))
        if split is not None:
            steps.append(SendStep(CollectiveKind.ALL_GATHER, split.axes, phase, SEND_OP))
    return steps


def recompute_reads(ops: Sequence[OpNames], segments: Sequence[tuple[int, int]],
                    kind_of: Callable[[str], str]) -> frozenset[str]:
    """The parameters the ops in recompute `segments` read: activation checkpointing
    runs them again in the backward pass, so ZeRO 3 gathers these again before it
    whether or not the backward pass itself reads them."""
    return frozenset(name for a, b in segments for inputs, _ in ops[a:b] for name in inputs
                     if name and kind_of(name) == "parameter")


def stage_holds(ops: Sequence[OpNames], ranges: Sequence[tuple[int, int]],
                kind_of: Callable[[str], str]) -> tuple[str, ...]:
    """The parameters and buffers the ops in `ranges` read: what their stage keeps."""
    held = {name for a, b in ranges for inputs, _ in ops[a:b] for name in inputs
            if name and kind_of(name) in ("parameter", "buffer")}
    return tuple(sorted(held))
