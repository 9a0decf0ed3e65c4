"""One training step of a plan on one rank: its chunks' passes in schedule order.

The rank runs the actions its device stage's schedule lists (`executor.schedule`). A
forward pass of micro-batch m on a chunk takes that micro-batch's inputs, receives the
activations earlier chunks send it (cut from autograd: a fresh leaf), runs the chunk's ops
(checkpointed segments under `torch.utils.checkpoint`), and sends on what later chunks
read. Its backward pass receives the gradients of what it sent, back-propagates them (and
the loss, on the chunk that computes it), and sends back the gradients of what it received.
Sends are non-blocking and waited for at the end of the step; receives block. After the
last pass the weights are updated (`executor.update`), and the step's loss, known on the
last stage, is summed over the pipeline axis so that every rank reports it.

A mean loss over the global batch is the mean of the micro-batches' mean losses, so each
micro-batch's loss is scaled by 1/micro_batches; gradients accumulate in `.grad`.

The schedule, the transfers and the backward passes are `ScheduleEngine`'s, the same for
both executors; what a chunk's forward pass runs is a `ChunkRunner`'s: the ONNX graph's
ops (`GraphChunks`, here) or a module's traced nodes (`executor.module.pipeline`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from executor.runtime import MeshComm, PlanRunner
from executor.schedule import Action, Chunk, Stages, Transfer, check_schedule
from executor.update import WeightUpdate
from planner.errors import ShardplanError
from planner.graph import TensorInfo
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


def wire_of(info: TensorInfo, layout: Layout, mesh: DeviceMesh
            ) -> tuple[tuple[int, ...], torch.dtype]:
    """The local shape and dtype a transferred tensor has on the wire: its block in the
    layout the plan stores it in."""
    return layout.local_shape(info.shape, mesh), getattr(torch, info.dtype)


@dataclass
class ChunkResult:
    """A chunk's forward pass: the local tensors it sends on (by tensor name), and on the
    chunk computing the loss, the loss to back-propagate (this rank's part) and its value
    for the report. A runner that took the loss's own backward pass already (in its loss
    phase, to keep the loss's collectives apart from the model's) gives the gradient of
    the loss with respect to each output it read instead (`output_grads`)."""

    sent: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    reported: float = 0.0
    output_grads: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


class ChunkRunner(Protocol):
    """What runs one chunk's forward pass on this rank, for `ScheduleEngine`."""

    comm: MeshComm

    def begin_step(self) -> None: ...

    def forward(self, chunk: Chunk, micro: int, feeds: Any, targets: Any,
                received: Mapping[str, torch.Tensor]) -> ChunkResult: ...

    def wire(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The local shape and dtype of transferred tensor `name`, as a receiver
        allocates it."""
        ...

    def backward(self, micro: int) -> AbstractContextManager[Any]:
        """Entered around each backward pass, of micro-batch `micro` (to count its
        collectives, and know which one ends the step)."""
        ...

    def after_micro_batch(self) -> None: ...

    def end_step(self) -> None: ...


@dataclass
class _Pass:
    """What a forward pass leaves for its backward pass."""

    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # transfer -> received
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # sent, with gradients
    loss: torch.Tensor | None = None
    loss_grads: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (output, d loss/d it)


class ScheduleEngine:
    """This rank's part of every training step of `stages`, its chunks run by `chunks`."""

    def __init__(self, chunks: ChunkRunner, stages: Stages) -> None:
        self.chunks, self.stages = chunks, stages
        comm = chunks.comm
        self.device = comm.coord[comm.mesh.axis_names.index("pp")] if (
            "pp" in comm.mesh.axis_names) else 0
        self.actions: list[Action] = check_schedule(stages)[self.device]
        self.last_chunk = min(c.index for c in stages.of_device(self.device))
        self._passes: dict[tuple[int, int], _Pass] = {}
        self._mail: dict[tuple[int, int, str], torch.Tensor] = {}
        self._loss = 0.0

    def step(self, feeds: Sequence[Any], targets: Sequence[Any]) -> float:
        """Every micro-batch through the schedule, then the end of the step; the loss."""
        if len(feeds) != self.stages.micro_batches:
            raise ShardplanError(f"{len(feeds)} micro-batches fed, the plan has "
                                 f"{self.stages.micro_batches}")
        self._loss = 0.0
        self.chunks.begin_step()
        for action in self.actions:
            if action.kind == "F":
                self._forward(action.micro, action.chunk, feeds[action.micro],
                              targets[action.micro])
            else:
                with self.chunks.backward(action.micro):
                    self._backward(action.micro, action.chunk)
                if action.chunk == self.last_chunk:  # this device is done with it
                    self.chunks.after_micro_batch()
        self.chunks.comm.wait_sends()
        self.chunks.end_step()
        return self._report()

    def _forward(self, micro: int, chunk: int, feeds: Any, targets: Any) -> None:
        stages = self.stages
        record = _Pass()
        received: dict[str, torch.Tensor] = {}
        for transfer in stages.inbound(chunk):
            value = self._take(transfer, micro, "forward")
            if transfer.grad:
                value = value.detach().requires_grad_(True)
                record.leaves[transfer.index] = value
            received[transfer.tensor] = value
        result = self.chunks.forward(stages.chunks[chunk], micro, feeds, targets, received)
        for transfer in stages.outbound(chunk):
            value = result.sent[transfer.tensor]
            self._post(transfer, micro, "forward", value)
            if transfer.grad:
                record.outputs[transfer.tensor] = value
        if chunk == stages.loss_chunk:
            if result.output_grads:
                record.loss_grads = tuple((out, grad / stages.micro_batches)
                                          for out, grad in result.output_grads)
            else:
                assert result.loss is not None
                record.loss = result.loss / stages.micro_batches
            self._loss += result.reported / stages.micro_batches
        self._passes[(micro, chunk)] = record

    def _backward(self, micro: int, chunk: int) -> None:
        record = self._passes.pop((micro, chunk))
        incoming: dict[str, torch.Tensor] = {}
        for transfer in self.stages.outbound(chunk):
            if transfer.grad:
                grad = self._take(transfer, micro, "backward")
                name = transfer.tensor
                incoming[name] = grad if name not in incoming else incoming[name] + grad
        roots = [record.loss] if record.loss is not None else []
        grads: list[torch.Tensor | None] = [None] * len(roots)
        for out, grad in record.loss_grads:
            roots.append(out)
            grads.append(grad)
        for name, grad in incoming.items():
            if record.outputs[name].requires_grad:
                roots.append(record.outputs[name])
                grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for transfer in self.stages.inbound(chunk):
            if transfer.grad:
                leaf = record.leaves[transfer.index]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._post(transfer, micro, "backward", grad)

    def _tag(self, transfer: Transfer, micro: int, phase: str) -> int:
        """Unique within a step: every message of a step has its own tag."""
        return (micro * len(self.stages.transfers) + transfer.index) * 2 + (phase == "backward")

    def _post(self, transfer: Transfer, micro: int, phase: str, value: torch.Tensor) -> None:
        """Forward: to the reading chunk; backward: the gradient to the sending chunk."""
        if not transfer.p2p:
            self._mail[(transfer.index, micro, phase)] = value.detach() if transfer.grad \
                else value
            return
        to = transfer.dst if phase == "forward" else transfer.src
        comm = self.chunks.comm
        if transfer.scatter_axes:  # Megatron's scatter/gather: this rank's slice only
            value = comm.local_slice(value, transfer.scatter_axes, transfer.scatter_dim)
        comm.send(value.contiguous(), comm.peer(self.stages.chunks[to].device),
                  self._tag(transfer, micro, phase), phase)

    def _take(self, transfer: Transfer, micro: int, phase: str) -> torch.Tensor:
        if not transfer.p2p:
            return self._mail.pop((transfer.index, micro, phase))
        origin = transfer.src if phase == "forward" else transfer.dst
        shape, dtype = self.chunks.wire(transfer.tensor)
        comm = self.chunks.comm
        if transfer.scatter_axes:
            piece = list(shape)
            piece[transfer.scatter_dim] //= comm.mesh.group_size(transfer.scatter_axes)
            shape = tuple(piece)
        received = comm.recv(shape, dtype, comm.peer(self.stages.chunks[origin].device),
                             self._tag(transfer, micro, phase), phase)
        if transfer.scatter_axes:
            received = comm.all_gather(received, transfer.scatter_axes, transfer.scatter_dim,
                                       phase)
        return received

    def _report(self) -> float:
        """The step's loss, from the stage that computed it to every rank."""
        comm = self.chunks.comm
        if "pp" not in comm.mesh.axis_names:
            return self._loss
        total = comm.all_reduce(torch.tensor([self._loss], dtype=torch.float64), ("pp",),
                                "loss")
        return float(total.item())


class GraphChunks:
    """The ONNX graph's chunks: op ranges of `PlanRunner`, the weights updated by
    `WeightUpdate`."""

    def __init__(self, runner: PlanRunner, update: WeightUpdate, output: str, kind: str,
                 stages: Stages) -> None:
        self.runner, self.update, self.output, self.kind = runner, update, output, kind
        self.stages = stages
        self.comm = runner.comm
        ops = runner.graph.ops
        self.reads = {c.index: {n for node in ops[c.first:c.end] for n in node.inputs if n}
                      for c in stages.chunks}

    def begin_step(self) -> None:
        self.runner.step += 1

    def forward(self, chunk: Chunk, micro: int, feeds: Mapping[str, torch.Tensor],
                targets: torch.Tensor | None, received: Mapping[str, torch.Tensor]
                ) -> ChunkResult:
        runner = self.runner
        runner.micro = micro
        values, layouts = runner.inputs({n: v for n, v in feeds.items()
                                         if n in self.reads[chunk.index]})
        for name, value in received.items():
            values[name] = value
            layouts[name] = runner.placement.stored[name]
        runner.run_range(chunk.first, chunk.end, values, layouts, self.stages.recompute)
        sent = {}
        for transfer in self.stages.outbound(chunk.index):
            self._check_sent(transfer.tensor, values[transfer.tensor], layouts)
            sent[transfer.tensor] = values[transfer.tensor]
        if chunk.index != self.stages.loss_chunk:
            return ChunkResult(sent)
        local, reported = runner.loss(values, layouts, self.output, targets, self.kind)
        return ChunkResult(sent, local, reported)

    def wire(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return wire_of(self.runner.graph.tensors[name], self.runner.placement.stored[name],
                       self.runner.mesh)

    def _check_sent(self, name: str, value: torch.Tensor, layouts: Mapping) -> None:
        """The receiver allocates the plan's layout, shape and dtype: the sender must match."""
        layout = self.runner.placement.stored[name]
        shape, dtype = self.wire(name)
        if layouts[name] != layout or tuple(value.shape) != shape or value.dtype != dtype:
            raise ShardplanError(f"{name} leaves its stage as {tuple(value.shape)} {value.dtype} "
                                 f"in layout {layouts[name]}, but the plan stores it as {shape} "
                                 f"{dtype} in {layout}")

    def backward(self, micro: int) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_micro_batch(self) -> None:
        self.update.after_micro_batch()

    def end_step(self) -> None:
        self.update.step()


class PipelineEngine(ScheduleEngine):
    """The ONNX graph's training step on this rank (`GraphChunks` in `ScheduleEngine`)."""

    def __init__(self, runner: PlanRunner, stages: Stages, update: WeightUpdate,
                 output: str, kind: str) -> None:
        super().__init__(GraphChunks(runner, update, output, kind, stages), stages)
        self.runner, self.update = runner, update
