"""A plan's pipeline stages on the module's traced graph, run by the executor's schedule.

The plan cuts its ops into chunks (`executor.schedule`); each traced node belongs to the
chunk of the plan ops it owns (`executor.module.layouts`), and since the exporter
translates the graph in order, every chunk is one run of consecutive nodes: chunk k runs
from the first node owning one of its ops to the first of chunk k+1's. Nodes computed
from the inputs and weights alone that the exporter folded away (positions, masks,
sizes) own no op: a chunk that reads one recomputes it, as every stage of a torch
pipeline recomputes its own masks. Every other value a chunk reads from another chunk
must be one the plan transfers: the engine (`executor.pipeline.ScheduleEngine`) sends
exactly the plan's sends, each a local block in the plan's stored layout, and the receiver
makes it a DTensor on its stage's mesh again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx import GraphModule, Node

from executor.module.layouts import ModuleLayouts
from executor.module.local import is_size
from executor.module.moves import redistribute
from executor.module.rowloss import for_the_loss
from executor.module.run import (
    ModulePlan,
    PlannedRun,
    RunRecord,
    last_uses,
    output_gradients,
    place_inputs,
)
from executor.pipeline import ChunkResult
from executor.runtime import MeshComm
from executor.schedule import Chunk, Stages
from planner.errors import ShardplanError
from planner.plans.model import Plan
from planner.sharding.layout import Layout


@dataclass(frozen=True)
class ChunkNodes:
    """What one chunk runs, derived once: its nodes in graph order (the free values it
    recomputes first; not the inputs or what it receives, which arrive as values), the
    nodes whose values arrive from other chunks, those it sends on, its recompute
    segments and when each value is dropped."""

    nodes: tuple[Node, ...]
    received: Mapping[str, Node]
    sent: Mapping[str, Node]
    spans: Mapping[str, int]  # the recompute segments among `nodes`: first -> length
    keep: frozenset[Node]  # the sent values: kept to the end of the chunk
    dies: Mapping[Node, tuple[Node, ...]]  # node -> the values dropped after it


def _free_nodes(nodes: Sequence[Node], owned: set[str]) -> set[Node]:
    """Inputs, weights, and the nodes owning no plan op computed from those alone."""
    free: set[Node] = set()
    for node in nodes:
        if node.op in ("placeholder", "get_attr") or (
                node.op == "call_function" and node.name not in owned
                and all(a in free for a in node.all_input_nodes)):
            free.add(node)
    return free


def _with_unowned_feeders(nodes: Sequence[Node], start: int, owned: Collection[str],
                          place: Mapping[str, int]) -> int:
    """A chunk's first node, moved back over the traced call nodes right before it that
    no plan op is named after and that only it and later chunks read: a multi-output op's
    node and its `getitem`s (`topk`, whose ONNX node the export names `node_topk__1`),
    which run with the op their values feed (left in the chunk before, the chunk read
    `getitem` from it, which the plan does not send)."""
    while start > 0:
        node = nodes[start - 1]
        if node.op != "call_function" or node.name in owned or any(
                place[user.name] < start for user in node.users):
            break
        start -= 1
    return start


def chunk_nodes(graph: GraphModule, plan: Plan, layouts: ModuleLayouts, stages: Stages
                ) -> dict[int, ChunkNodes]:
    """Every chunk's nodes (module docstring); one error naming what does not match."""
    nodes = list(graph.graph.nodes)
    place = {n.name: k for k, n in enumerate(nodes)}
    owner = layouts.owner
    owned = set(owner.values())
    starts = []
    for chunk in stages.chunks:
        found = [place[owner[op.name]] for op in plan.ops[chunk.first:chunk.end]
                 if owner.get(op.name) in place]
        if not found:
            raise ShardplanError(f"pipeline chunk {chunk.index} (ops {chunk.first}.."
                                 f"{chunk.end}) has no op of the traced module")
        starts.append(_with_unowned_feeders(nodes, min(found), owned, place))
    starts[0] = 0
    if starts != sorted(starts):
        raise ShardplanError("the traced module runs the plan's pipeline chunks in another "
                             "order than the plan; plan this module's own export")
    bounds = [*starts, len(nodes)]
    chunk_of = {n: c for c in range(len(starts)) for n in nodes[bounds[c]:bounds[c + 1]]}
    free = _free_nodes(nodes, set(owner.values()))
    for node in free:  # computed where read: a stage reads only its own weights
        chunk_of[node] = -1
    transfers = {(t.tensor, t.dst) for t in stages.transfers}
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    outputs = {n.name for n in output_node.all_input_nodes}
    result = {}
    for c, chunk in enumerate(stages.chunks):
        own = [n for n in nodes[bounds[c]:bounds[c + 1]] if n not in free]
        needed: set[Node] = set()
        received: dict[str, Node] = {}
        todo = [a for n in own for a in n.all_input_nodes if chunk_of[a] != c]
        while todo:
            value = todo.pop()
            if value in needed or value.name in received:
                continue
            if value in free:
                needed.add(value)
                todo += [a for a in value.all_input_nodes if chunk_of[a] != c]
            elif (value.name, chunk.index) in transfers:
                received[value.name] = value
            elif value.name in outputs:
                raise ShardplanError(
                    f"the plan computes the module's output {value.name} on pipeline chunk "
                    f"{chunk_of[value]} and others on chunk {chunk.index}, and the loss "
                    "reads them together: outputs of several stages are not planned yet; "
                    "plan with pp=1, or return only what the last layers compute")
            else:
                raise ShardplanError(
                    f"pipeline chunk {chunk.index} reads {value.name} from chunk "
                    f"{chunk_of[value]}, which the plan does not send; plan this module's "
                    "own export")
        # what a chunk sends on it computed, or received (a hand-off to a later chunk of
        # its device: interleaved stages)
        here = {n.name: n for n in own} | received
        sent = {t.tensor: here[t.tensor] for t in stages.outbound(chunk.index)
                if t.tensor in here}
        missing = [t.tensor for t in stages.outbound(chunk.index) if t.tensor not in sent]
        if missing:
            raise ShardplanError(f"the plan sends {', '.join(sorted(missing))} from chunk "
                                 f"{chunk.index}, which the traced module does not compute "
                                 "there; plan this module's own export")
        prelude = tuple(n for n in nodes if n in needed and n.op != "placeholder")
        runs = prelude + tuple(own)
        keep = frozenset(sent.values())
        result[chunk.index] = ChunkNodes(runs, received, sent, _spans(own, layouts.recompute),
                                         keep, last_uses(runs, keep))
    return result


def _spans(nodes: Sequence[Node], segments: Sequence[Sequence[str]]) -> dict[str, int]:
    """Each recompute segment's run of a chunk's own `nodes` (the free values among its
    members are recomputed up front, outside it)."""
    where = {n.name: k for k, n in enumerate(nodes)}
    spans = {}
    for segment in segments:
        found = sorted(where[name] for name in segment if name in where)
        if not found:
            continue
        if found != list(range(found[0], found[-1] + 1)):
            raise ShardplanError(f"recompute segment from {segment[0]} is not one run of its "
                                 "pipeline chunk's nodes")
        spans[nodes[found[0]].name] = len(found)
    return spans


class ModuleChunks:
    """The module's chunks on this rank (`executor.pipeline.ChunkRunner`): a chunk's nodes
    run by `PlannedRun` on DTensors of the stage's mesh."""

    def __init__(self, graph: GraphModule, run: ModulePlan, mesh: Any, comm: MeshComm,
                 chunks: Mapping[int, ChunkNodes], stages: Stages,
                 stored: Mapping[str, Layout], inputs: Mapping[str, tuple[Any, ...]],
                 record: RunRecord, seed: int,
                 wires: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """`stored`: each tensor's layout as the plan stores (and sends) it; `wires`:
        each transferred tensor's local shape and dtype on the wire."""
        self.graph, self.run, self.mesh, self.comm = graph, run, mesh, comm
        self.wires = wires
        self.nodes, self.stages = chunks, stages
        self.stored, self.inputs = stored, inputs
        self.record, self.seed = record, seed
        self.step_number = 0  # set by the caller to the step's dropout draw
        self.loss_of: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor] | None = None
        self.phases: Callable[[str], AbstractContextManager[Any]] = \
            lambda _: contextlib.nullcontext()
        self.placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.names = [n.name for n in self.placeholders]

    def begin_step(self) -> None:
        pass

    def forward(self, chunk: Chunk, micro: int, feeds: Sequence[torch.Tensor],
                targets: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor]
                ) -> ChunkResult:
        plan = self.nodes[chunk.index]
        env: dict[Node, Any] = dict(zip(self.placeholders, place_inputs(
            feeds, self.names, self.mesh, self.inputs), strict=True))
        for name, node in plan.received.items():
            env[node] = self._arrived(node, received[name])
        running = PlannedRun(self.graph, self.run, self.mesh, self.record, self.seed,
                             self.step_number, micro)
        running.fold_at(("chunk", chunk.index, *(tuple(getattr(v, "shape", ()))
                                                 for v in env.values())))
        with self.phases("forward"), implicit_replication(), \
                self.run.weights.forward_pass():
            values = running.run_nodes(plan.nodes, env, plan.keep, plan.spans, plan.dies)
            sent = {name: self._leaving(running, node, values[node])
                    for name, node in plan.sent.items()}
            output = values.get(running.output_node) if chunk.index == \
                self.stages.loss_chunk else None
            outputs = running.graph.process_outputs(output) if output is not None else None
        if outputs is not None:  # the loss's read: with the forward pass where the plan
            # lists it there, else in the loss's own phase
            with self.phases("forward" if self.run.layouts.loss_reads_planned else "loss"):
                outputs = for_the_loss(outputs)
        if chunk.index != self.stages.loss_chunk:
            return ChunkResult(sent)
        assert self.loss_of is not None
        with self.phases("loss"):
            loss = self.loss_of(outputs, targets)
            # a loss on DTensors may issue collectives in its own backward pass: taken
            # now, in the loss phase (a plain loss back-propagates from itself)
            grads = output_gradients(loss, outputs)
        value = loss.detach()
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if grads is None:
            return ChunkResult(sent, loss, float(value))
        return ChunkResult(sent, reported=float(value), output_grads=grads)

    def _arrived(self, node: Node, value: torch.Tensor) -> Any:
        """A received local block as the DTensor it is a block of, or the size it is."""
        if is_size(node):
            return int(value.reshape(-1)[0].item())
        return DTensor.from_local(value, self.mesh, self._placements(node.name),
                                  run_check=False)

    def _leaving(self, running: PlannedRun, node: Node, value: Any) -> torch.Tensor:
        """What goes on the wire: the local block in the plan's stored layout."""
        if not isinstance(value, torch.Tensor):  # a size: sent as the plan's tensor
            shape, dtype = self.wire(node.name)
            return torch.full(shape, int(value), dtype=dtype)
        if node in running.frame.held_local:
            return value
        assert isinstance(value, DTensor)
        wanted = self._placements(node.name)
        if tuple(value.placements) != wanted:
            self.record.unplanned[f"{node.name}: {value.placements} -> {wanted}"] += 1
            value = redistribute(value, self.mesh, wanted)
        return value.to_local()

    def _placements(self, name: str) -> tuple[Any, ...]:
        return self.run.placements(name, self.stored[name])

    def wire(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.wires[name]

    def backward(self, micro: int) -> AbstractContextManager[Any]:
        # the weights' gradient sums wait for the step's last micro-batch
        self.run.weights.micro_batch_last = micro == self.stages.micro_batches - 1
        return self.phases("backward")

    def after_micro_batch(self) -> None:
        pass

    def end_step(self) -> None:
        self.run.weights.micro_batch_last = True
        self.run.weights.finish_step()
