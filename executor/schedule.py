"""Pipeline stages of a plan as the executor runs them: chunks, transfers, schedules.

A *chunk* is one op range [first, end) of `plan.pipeline.stages[d].ops`; sorted by their
first op, the chunks are the virtual stages of the pipeline (one per device with 1F1B and
GPipe, several per device with the interleaved schedule). Every activation produced in one
chunk and read in a later one is a *transfer*: point-to-point between devices (exactly the
plan's `pipeline.sends`), or a local hand-off between two chunks of one device (from the
chunk that produced it, or that received it from another device). Each chunk's backward
runs on its own, so a tensor crossing chunks is cut out of autograd on the receiving side
and its gradient is passed back the same way.

A schedule is one list of actions per device (forward or backward of one micro-batch on
one chunk; for the zero-bubble schedules the backward split into the inputs' gradients B
and the weights' gradients W), the order `costmodels.orders` writes for the pricing too.
Sends never block, receives do, so a schedule cannot deadlock exactly when the greedy
simulation in `check_schedule` completes it; every run checks this first.

The runners cannot split a backward pass yet (it needs autograd run twice over one
retained graph, the second time only to the weights, without re-running the first's
collectives): `check_runnable` refuses the zero-bubble schedules by name before any
rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from costmodels.orders import (
    SPLIT_BACKWARD,
    chunks_per_device,
    device_chunks,
    misplaced,
    schedule_order,
)
from planner.errors import PlanFileError, ShardplanError
from planner.graph import PlanningGraph
from planner.kinds import AxisRole, Recompute, Runnable, Schedule
from planner.plans.model import Plan
from planner.plans.sections import PipelineSection, SendEntry
from planner.sharding.mesh import DeviceMesh

SCHEDULES = tuple(str(s) for s in Schedule)


@dataclass(frozen=True)
class Chunk:
    """One virtual stage: ops [first, end) on device stage `device` (its `slot`-th range)."""

    index: int
    first: int
    end: int
    device: int
    slot: int


@dataclass(frozen=True)
class Transfer:
    """`tensor` from chunk `src` to chunk `dst`; `grad`: its gradient flows back."""

    index: int
    tensor: str
    src: int
    dst: int
    grad: bool
    p2p: bool  # between devices (else a hand-off inside one device)
    scatter_axes: tuple[str, ...] = ()  # a scattered send: each rank sends its slice ...
    scatter_dim: int = -1  # ... along this local dim; the receivers all-gather it


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" backward (of the inputs only when split), "W" weights
    micro: int
    chunk: int  # global chunk index


@dataclass(frozen=True)
class Stages:
    """The whole pipeline as every rank sees it (the same on all ranks)."""

    pp: int
    micro_batches: int
    schedule: str
    chunks: tuple[Chunk, ...]
    transfers: tuple[Transfer, ...]
    recompute: tuple[tuple[int, int], ...]  # op ranges run under activation checkpointing
    loss_chunk: int

    def of_device(self, device: int) -> list[Chunk]:
        return [c for c in self.chunks if c.device == device]

    def inbound(self, chunk: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == chunk]

    def outbound(self, chunk: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == chunk]


def weight_holders(plan: Plan) -> dict[str, tuple[int, ...]] | None:
    """Per weight, the pipeline device stages holding it (the plan's `holds`); None for a
    plan without stages, whose ranks hold every weight."""
    if plan.pipeline is None:
        return None
    result: dict[str, list[int]] = {}
    for stage in plan.pipeline.stages:
        for name in stage.holds:
            result.setdefault(name, []).append(stage.device_stage)
    return {name: tuple(stages) for name, stages in result.items()}


def check_pipeline_section(plan: Plan) -> None:
    """A plan that pipelines, micro-batches or recomputes must say how in its section."""
    if plan.pipeline is not None:
        return
    if plan.parallel.micro_batches > 1 or plan.parallel.pp > 1:
        raise PlanFileError("the plan sets pp/micro_batches but has no `pipeline` section; "
                            "re-create it with this version of shardplan")
    if plan.parallel.recompute != Recompute.NONE:
        raise PlanFileError("the plan asks for recompute but has no `pipeline` section "
                            "naming the segments; re-create it with this version")


def build_stages(graph: PlanningGraph, pipeline: PipelineSection | None, mesh: DeviceMesh,
                 output: str, needs_grad: Mapping[str, bool]) -> Stages:
    """Chunks, transfers and checkpointed segments of a plan's pipeline section (a plan
    without one: one chunk holding every op)."""
    pp = mesh.axis_size(AxisRole.PIPELINE) if AxisRole.PIPELINE in mesh.axis_names else 1
    schedule = str(pipeline.schedule) if pipeline else str(Schedule.ONE_F_ONE_B)
    micro = pipeline.micro_batches if pipeline else 1
    rows = [(stage.ops, stage.recompute_segments) for stage in pipeline.stages] \
        if pipeline else [(((0, len(graph.ops)),), ())]
    if len(rows) != pp:
        raise PlanFileError(f"pipeline.stages has {len(rows)} entries but the mesh has "
                            f"pp={pp}; re-create the plan")
    check_runnable(schedule)
    chunks = _chunks([ops for ops, _ in rows], len(graph.ops))
    _check_placement(chunks, schedule, pp, micro)
    segments = tuple(sorted((int(a), int(b)) for _, row in rows for a, b in row))
    _check_segments(segments, chunks)
    producer = {name: k for k, node in enumerate(graph.ops) for name in node.outputs if name}
    if output not in producer:
        raise ShardplanError(f"output {output} is not computed by any op; nothing to train")
    loss_chunk = _chunk_of(chunks, producer[output])
    sends = pipeline.sends if pipeline else ()
    return Stages(pp, micro, schedule, tuple(chunks),
                  tuple(_transfers(graph, chunks, producer, needs_grad, sends)), segments,
                  loss_chunk)


def _chunks(rows: Sequence[Sequence[tuple[int, int]]], count: int) -> list[Chunk]:
    """Every op range of every device stage, in op order; they must tile the graph."""
    ranges = sorted((int(a), int(b), d, slot) for d, ops in enumerate(rows)
                    for slot, (a, b) in enumerate(ops))
    chunks = [Chunk(k, a, b, d, slot) for k, (a, b, d, slot) in enumerate(ranges)]
    position = 0
    for chunk in chunks:
        if chunk.first != position or chunk.end <= chunk.first:
            raise PlanFileError(f"pipeline.stages[{chunk.device}].ops: range "
                                f"[{chunk.first}, {chunk.end}) leaves a gap or overlaps at op "
                                f"{position}; the ranges must tile ops 0..{count}")
        position = chunk.end
    if position != count:
        raise PlanFileError(f"pipeline.stages: the op ranges end at {position}, the graph has "
                            f"{count} ops")
    return chunks


#: what the runners run: every schedule but those splitting the backward pass, one
#: mesh shape for every stage (`planner.plans.stagemesh.refuse_stage_meshes`), even
#: shares of the batch (`executor.support.check_degrees`)
RUNNABLE = Runnable(schedules=tuple(s for s in Schedule if s not in SPLIT_BACKWARD),
                    stage_meshes=False, uneven_shares=False)


def check_runnable(schedule: str) -> None:
    """Refuse a schedule the runners cannot run yet: one that splits the backward pass."""
    if schedule in SPLIT_BACKWARD:
        raise ShardplanError(f"pipeline schedule {schedule}: the executor cannot run it yet "
                             "(it splits each backward into input and weight gradients); "
                             "re-plan with --parallel schedule=1f1b, or interleaved")


def _check_placement(chunks: Sequence[Chunk], schedule: str, pp: int, micro: int) -> None:
    """Each chunk on the device the schedule puts it (`costmodels.orders.chunk_device`:
    Megatron's round robin, ZB-V's V); interleaving takes micro-batches in groups of pp."""
    if schedule in (Schedule.INTERLEAVED, Schedule.ZBV) and (
            problem := misplaced(schedule, pp, [c.device for c in chunks])):
        raise PlanFileError(f"pipeline.stages: the schedule {problem}; re-create the plan")
    if schedule == Schedule.INTERLEAVED and micro % pp:
        raise PlanFileError(f"pipeline.micro_batches {micro}: the interleaved schedule needs "
                            f"a multiple of pp={pp}")


def _check_segments(segments: Sequence[tuple[int, int]], chunks: Sequence[Chunk]) -> None:
    for a, b in segments:
        inside = [c for c in chunks if c.first <= a and b <= c.end]
        if not inside or b <= a:
            raise PlanFileError(f"pipeline recompute segment [{a}, {b}) is not inside one "
                                "stage's op range")


def _chunk_of(chunks: Sequence[Chunk], op: int) -> int:
    return next(c.index for c in chunks if c.first <= op < c.end)


def _transfers(graph: PlanningGraph, chunks: Sequence[Chunk], producer: Mapping[str, int],
               needs_grad: Mapping[str, bool], sends: Sequence[SendEntry]) -> list[Transfer]:
    """Activations read outside their producing chunk: the plan's sends between devices,
    and hand-offs inside one device (from the producing chunk, or from the chunk that
    received the tensor from another device)."""
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(graph.ops):
        for name in node.inputs:
            if name in producer and _chunk_of(chunks, producer[name]) != _chunk_of(chunks, k):
                readers.setdefault(name, set()).add(_chunk_of(chunks, k))
    sent = {(send.tensor, send.to_chunk): send for send in sends}
    for send in sends:
        if send.tensor not in producer or send.to_chunk not in readers.get(send.tensor, ()) \
                or send.from_chunk != _chunk_of(chunks, producer[send.tensor]):
            raise PlanFileError(f"pipeline send of {send.tensor} from chunk {send.from_chunk} "
                                f"to chunk {send.to_chunk}: no such transfer in the model "
                                "(the chunk does not read it, or another produces it); "
                                "re-create the plan")
    result: list[Transfer] = []
    for name in sorted(readers):
        src = _chunk_of(chunks, producer[name])
        grad = bool(needs_grad.get(name, False) and graph.tensors[name].is_float)
        for dst in sorted(readers[name]):
            device = chunks[dst].device
            if (name, dst) in sent or device == chunks[src].device:
                origin = src
            else:
                held = [c for (tensor, c) in sent if tensor == name and c < dst
                        and chunks[c].device == device]
                if not held:
                    raise PlanFileError(f"chunk {dst} (device stage {device}) reads {name}, "
                                        "which the plan sends to no chunk of that stage; "
                                        "re-create the plan")
                origin = min(held)
            entry = sent.get((name, dst)) if chunks[origin].device != device else None
            result.append(Transfer(len(result), name, origin, dst, grad,
                                   chunks[origin].device != device,
                                   entry.scatter_axes if entry else (),
                                   entry.scatter_dim if entry else -1))
    return result


def schedule_actions(stages: Stages, device: int) -> list[Action]:
    """The order in which `device` runs its passes: `costmodels.orders.schedule_order`,
    the order the plan was priced with, on the plan's chunks."""
    mine = stages.of_device(device)
    wanted = chunks_per_device(stages.schedule, len(mine))
    if len(mine) != wanted:
        raise PlanFileError(f"pipeline: device stage {device} holds {len(mine)} op ranges; "
                            f"{stages.schedule} runs {wanted} per device"
                            + (" (use the interleaved schedule)" if wanted == 1 else ""))
    # The order names chunks in the schedule's own placement; the plan's are the same
    # chunks (`_check_placement`), numbered by their first op.
    plan_chunk = dict(zip(device_chunks(stages.schedule, stages.pp, len(mine), device),
                          (c.index for c in mine), strict=True))
    return [Action(kind, micro, plan_chunk[chunk]) for kind, micro, chunk in
            schedule_order(stages.schedule, stages.pp, stages.micro_batches, device,
                           len(mine))]


def check_schedule(stages: Stages) -> dict[int, list[Action]]:
    """Every device's actions, after proving by simulation that they finish: a forward
    waits for its inputs, a backward for its forward and its outputs' gradients."""
    actions = {d: schedule_actions(stages, d) for d in range(stages.pp)}
    done: set[tuple[str, int, int]] = set()
    position = dict.fromkeys(actions, 0)
    progress = True
    while progress:
        progress = False
        for device, todo in actions.items():
            while position[device] < len(todo) and _ready(todo[position[device]], stages,
                                                          done):
                action = todo[position[device]]
                done.add((action.kind, action.micro, action.chunk))
                position[device] += 1
                progress = True
    stuck = [d for d, todo in actions.items() if position[d] < len(todo)]
    if stuck:
        d = stuck[0]
        action = actions[d][position[d]]
        raise ShardplanError(f"pipeline schedule {stages.schedule} would deadlock: device "
                             f"stage {d} waits at {action.kind} of micro-batch {action.micro} "
                             f"on chunk {action.chunk}")
    kinds = "FBW" if stages.schedule in SPLIT_BACKWARD else "FB"
    expected = {(k, i, c.index) for k in kinds for i in range(stages.micro_batches)
                for c in stages.chunks}
    if done != expected:
        raise ShardplanError(f"pipeline schedule {stages.schedule} misses or repeats passes")
    return actions


def _ready(action: Action, stages: Stages, done: set[tuple[str, int, int]]) -> bool:
    if action.kind == "F":
        return all(("F", action.micro, t.src) in done for t in stages.inbound(action.chunk))
    if action.kind == "W":
        return ("B", action.micro, action.chunk) in done
    return ("F", action.micro, action.chunk) in done and all(
        ("B", action.micro, t.dst) in done for t in stages.outbound(action.chunk) if t.grad)
