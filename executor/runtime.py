"""Run a plan on real ranks: local shards, the planned collectives, autograd through both.

Each rank imports the same planning graph, materialises only its shards of the weights
(drawn from one seed, so every run equals the unsharded initialisation), then walks the
ops in order: every input is moved from the layout it has to the layout the op's strategy
needs with the planner's own redistribution steps, and the op runs as the planner's local
program (`planner.sharding.local`). The backward pass runs the transposed steps the plan
priced; parameter gradients are summed over the axes the plan lists (`phase: gradient`,
by `executor.update`). Ops run in ranges (a pipeline stage's) and, where the plan says so,
under activation checkpointing. Every collective issued is counted, so a run can be
checked against its plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from executor.dropout import DropoutSite
from executor.interpreter import run_nodes, to_tensor
from executor.weights import read_weights
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.kinds import AxisRole, CollectiveKind, LossReads, Move, Phase
from planner.ops import DimLabels, replicated_labels
from planner.plans.model import Plan
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.derive import OPTIMIZER_OP, shared_read_key
from planner.sharding.layout import Layout
from planner.sharding.local import local_program
from planner.sharding.mesh import DeviceMesh
from planner.sharding.outputs import loss_layout
from planner.sharding.redistribute import CommStep, backward_steps, redistribute
from planner.sharding.strategy import REPLICATED, OpStrategy, grad_partial_axes


@dataclass
class Counters:
    """Collectives issued by this rank: (kind, axes, phase) -> count. Forward collectives
    re-issued while a checkpointed segment is recomputed count as phase "recompute"; all
    collectives while `outside_step` is set count under that phase (a checkpoint's)."""

    issued: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)  # point-to-point, by phase
    recompute_calls: int = 0  # checkpointed segments re-run in the backward pass
    recomputing: bool = False
    outside_step: str | None = None

    def _key(self, kind: str, axes: Sequence[str], phase: str) -> tuple:
        if self.outside_step:
            phase = self.outside_step
        elif self.recomputing and phase == "forward":
            phase = "recompute"
        return kind, tuple(axes), phase

    def add(self, kind: str, axes: Sequence[str], phase: str) -> None:
        self.issued[self._key(kind, axes, phase)] += 1

    def replace(self, old: str, new: str, axes: Sequence[str], phase: str) -> None:
        """Recount the last `old` collective as `new` (a step built from another)."""
        self.issued[self._key(old, axes, phase)] -= 1
        self.add(new, axes, phase)


class MeshComm:
    """Process groups for every set of mesh axes, and the collectives on them."""

    def __init__(self, mesh: DeviceMesh, rank: int, counters: Counters) -> None:
        self.mesh = mesh
        self.rank = rank
        self.coord = tuple(int(c) for c in np.unravel_index(rank, mesh.shape))
        self.counters = counters
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends not yet waited on
        self.groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        ids = np.arange(mesh.size).reshape(mesh.shape)
        # Every rank creates every group in the same order, as torch.distributed requires.
        for count in range(1, len(mesh.axis_names) + 1):
            for axes in combinations(mesh.axis_names, count):
                keep = [mesh.axis_names.index(a) for a in axes]
                moved = np.moveaxis(ids, keep, list(range(len(keep))))
                flat = moved.reshape(int(np.prod([mesh.shape[i] for i in keep])), -1)
                for column in range(flat.shape[1]):
                    ranks = sorted(int(r) for r in flat[:, column])
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if rank in ranks:
                        self.groups[axes] = group

    def group(self, axes: Sequence[str]) -> dist.ProcessGroup | None:
        ordered = tuple(a for a in self.mesh.axis_names if a in set(axes))
        return self.groups.get(ordered)

    def index(self, axes: Sequence[str]) -> int:
        position = 0
        for axis in axes:
            position = position * self.mesh.axis_size(axis) + self.coord[
                self.mesh.axis_names.index(axis)]
        return position

    def all_reduce(self, tensor: torch.Tensor, axes: Sequence[str], phase: str) -> torch.Tensor:
        return self.all_reduce_on(tensor, self.group(axes), axes, phase)

    def all_gather(self, tensor: torch.Tensor, axes: Sequence[str], dim: int,
                   phase: str) -> torch.Tensor:
        group = self.group(axes)
        if group is None:
            return tensor
        wire = tensor.detach().contiguous()
        if wire.dtype == torch.bool:  # gloo moves no bool buffers
            wire = wire.to(torch.uint8)
        parts = [torch.empty_like(wire) for _ in range(self.mesh.group_size(axes))]
        dist.all_gather(parts, wire, group=group)
        self.counters.add(CollectiveKind.ALL_GATHER, axes, phase)
        gathered = torch.cat(parts, dim=dim)
        return gathered.to(torch.bool) if tensor.dtype == torch.bool else gathered

    def all_reduce_on(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                      axes: Sequence[str], phase: str) -> torch.Tensor:
        """Sum over `group` (a mesh axis group, or the holders of a tied weight), counted
        under `axes`."""
        if group is None:
            return tensor
        result = tensor.detach().clone().contiguous()
        dist.all_reduce(result, group=group)
        self.counters.add(CollectiveKind.ALL_REDUCE, axes, phase)
        return result

    def all_reduce_async(self, tensor: torch.Tensor, axes: Sequence[str], phase: str
                         ) -> tuple[dist.Work | None, torch.Tensor]:
        """`all_reduce` of a buffer the caller gives up (a fresh flat bucket: summed in
        place, no copy), issued without waiting: the work to wait for (None where the
        group is one rank) and the buffer the sum lands in."""
        group = self.group(axes)
        if group is None:
            return None, tensor
        result = tensor.detach().contiguous()
        work = dist.all_reduce(result, group=group, async_op=True)
        self.counters.add(CollectiveKind.ALL_REDUCE, axes, phase)
        return work, result

    def group_rank(self, axes: Sequence[str]) -> int:
        group = self.group(axes)
        return dist.get_rank(group) if group is not None else 0

    def reduce_scatter_flat(self, flat: torch.Tensor, axes: Sequence[str],
                            phase: str) -> torch.Tensor:
        """This rank's summed chunk of a flat tensor whose length the group size divides."""
        group = self.group(axes)
        if group is None:
            return flat
        out = torch.empty(flat.numel() // self.mesh.group_size(axes), dtype=flat.dtype,
                          device=flat.device)
        dist.reduce_scatter_single(out, flat.detach().contiguous(), group=group)
        self.counters.add(CollectiveKind.REDUCE_SCATTER, axes, phase)
        return out

    def all_gather_flat(self, chunk: torch.Tensor, axes: Sequence[str],
                        phase: str) -> torch.Tensor:
        group = self.group(axes)
        if group is None:
            return chunk
        out = torch.empty(chunk.numel() * self.mesh.group_size(axes), dtype=chunk.dtype,
                          device=chunk.device)
        dist.all_gather_single(out, chunk.detach().contiguous(), group=group)
        self.counters.add(CollectiveKind.ALL_GATHER, axes, phase)
        return out

    def peer(self, stage: int) -> int:
        """The rank of pipeline stage `stage` with this rank's dp/tp coordinates."""
        coord = list(self.coord)
        coord[self.mesh.axis_names.index("pp")] = stage
        return int(np.ravel_multi_index(tuple(coord), self.mesh.shape))

    def send(self, tensor: torch.Tensor, peer: int, tag: int, phase: str) -> None:
        """Non-blocking: the handle and buffer are kept until `wait_sends`."""
        buffer = tensor.detach().contiguous()
        if buffer.dtype == torch.bool:  # gloo moves no bool buffers
            buffer = buffer.to(torch.uint8)
        work = dist.isend(buffer, peer, tag=tag)
        assert work is not None  # None only for a rank outside the group; this is the world
        self.pending.append((work, buffer))
        self.counters.add(CollectiveKind.SEND_RECV, (AxisRole.PIPELINE,), phase)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, peer: int, tag: int,
             phase: str) -> torch.Tensor:
        wire = torch.uint8 if dtype == torch.bool else dtype
        buffer = torch.empty(tuple(shape), dtype=wire)
        work = dist.irecv(buffer, peer, tag=tag)
        assert work is not None  # None only for a rank outside the group; this is the world
        work.wait()
        self.counters.received[phase] += 1
        return buffer.to(torch.bool) if dtype == torch.bool else buffer

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    def local_slice(self, tensor: torch.Tensor, axes: Sequence[str], dim: int) -> torch.Tensor:
        parts = self.mesh.group_size(axes)
        chunk = tensor.shape[dim] // parts
        return tensor.narrow(dim, self.index(axes) * chunk, chunk)

    def run(self, tensor: torch.Tensor, steps: Sequence[CommStep], phase: str) -> torch.Tensor:
        """Apply redistribution steps (no autograd: callers wrap this)."""
        for step in steps:
            if step.kind == Move.ALL_GATHER:
                tensor = self.all_gather(tensor, step.axes, _src(step), phase)
            elif step.kind == Move.SLICE:
                tensor = self.local_slice(tensor, step.axes, _dst(step))
            elif step.kind == Move.ALL_REDUCE:
                tensor = self.all_reduce(tensor, step.axes, phase)
            elif step.kind == Move.REDUCE_SCATTER:
                reduced = self.all_reduce(tensor, step.axes, phase)
                self.counters.replace(CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER,
                                      step.axes, phase)
                tensor = self.local_slice(reduced, step.axes, _dst(step))
            elif step.kind == Move.ALL_TO_ALL:
                gathered = self.all_gather(tensor, step.axes, _src(step), phase)
                self.counters.replace(CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL,
                                      step.axes, phase)
                tensor = self.local_slice(gathered, step.axes, _dst(step))
            elif step.kind == Move.ZERO:
                if any(self.coord[self.mesh.axis_names.index(a)] for a in step.axes):
                    tensor = torch.zeros_like(tensor)
            else:
                raise ShardplanError(f"unknown redistribution step {step.kind!r}")
        return tensor.contiguous()


def _src(step: CommStep) -> int:
    """The tensor dim a gathering step (all_gather, all_to_all) leaves: it always has one."""
    assert step.src_dim is not None, step
    return step.src_dim


def _dst(step: CommStep) -> int:
    """The tensor dim a splitting step (slice, reduce_scatter, all_to_all) joins: it always
    has one."""
    assert step.dst_dim is not None, step
    return step.dst_dim


class _Move(torch.autograd.Function):
    """Forward: the planned steps. Backward: the transposed steps the plan priced."""

    @staticmethod
    def forward(ctx, tensor, comm, forward, backward, phases):
        ctx.comm, ctx.backward, ctx.phase = comm, backward, phases[1]
        return comm.run(tensor, forward, phases[0])

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.run(grad, ctx.backward, ctx.phase), None, None, None, None


class GradientShare(torch.autograd.Function):
    """Forward: the value itself. Backward: `share` of the gradient (a whole read of a
    weight whose gradient the plan sums over devices that each compute all of it:
    `planner.sharding.derive.read_gradient_share`)."""

    @staticmethod
    def forward(ctx, tensor, share):
        ctx.share = share
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.share, None


class _SumOverAxes(torch.autograd.Function):
    """A statistics AllReduce inside an op (split training BatchNorm): both directions."""

    @staticmethod
    def forward(ctx, tensor, comm, axes):
        ctx.comm, ctx.axes = comm, axes
        return comm.all_reduce(tensor, axes, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, ctx.axes, "backward"), None, None


def onnx_weights(path: str) -> dict[str, np.ndarray]:
    """The initializers stored in the model (with its external data), empty for those it
    declares without data (`executor.weights`: an unreadable weights file is an error)."""
    return read_weights(path).values


def full_parameters(graph: PlanningGraph, seed: int,
                    stored: Mapping[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Every weight and buffer: the model's own values when stored, else drawn in name
    order from one seed (the same on all ranks, so a run equals the unsplit one)."""
    generator = torch.Generator().manual_seed(seed)
    stored = stored or {}
    values: dict[str, torch.Tensor] = {}
    for name in sorted(t.name for t in graph.tensors.values()
                       if t.kind in ("parameter", "buffer")):
        info = graph.tensors[name]
        if name in stored:
            values[name] = to_tensor(np.asarray(stored[name])).float() if info.dtype in (
                "float32",) else to_tensor(np.asarray(stored[name]))
            continue
        if info.value is not None:
            values[name] = to_tensor(np.asarray(info.value))
            continue
        dtype = torch.float32 if info.dtype in ("float32", "bfloat16") else getattr(
            torch, info.dtype)
        if info.kind == "buffer" and "var" in name:
            values[name] = torch.ones(info.shape, dtype=dtype)
        elif info.kind == "buffer":
            values[name] = torch.zeros(info.shape, dtype=dtype)
        else:
            values[name] = (0.02 * torch.randn(info.shape, generator=generator)).to(dtype)
    return values


@dataclass(frozen=True)
class OpPlacement:
    """How one op runs: its strategy and the layouts it reads and writes."""

    strategy: OpStrategy
    inputs: tuple[Layout | None, ...]  # None: an absent input
    outputs: tuple[Layout | None, ...]
    #: per input, the share of its gradient the read hands back (`TensorBinding.share`)
    shares: tuple[float, ...] = ()

    def share(self, slot: int) -> float:
        return self.shares[slot] if slot < len(self.shares) else 1.0


@dataclass(frozen=True)
class Placement:
    """What a run reads off its plan: the mesh, how every op runs, the layout every tensor
    is kept in, and the axes each weight's gradient is summed over. `unsplit` is the
    one-device reference: every op whole, nothing summed."""

    mesh: DeviceMesh
    ops: Mapping[str, OpPlacement]
    stored: Mapping[str, Layout]
    gradient_axes: Mapping[str, tuple[str, ...]]
    #: whether the plan lists the loss's read of the outputs with the forward pass
    #: (`LossReads.ROWS`), or leaves it to the loss's own phase
    loss_reads_planned: bool = False

    @classmethod
    def of_plan(cls, plan: Plan) -> Placement:
        ops = {entry.name: OpPlacement(
            OpStrategy.of(entry.assignment),
            tuple(b.layout if b else None for b in entry.inputs),
            tuple(b.layout if b else None for b in entry.outputs),
            tuple(b.share if b else 1.0 for b in entry.inputs)) for entry in plan.ops}
        # The axes each weight's gradient is summed over (ZeRO 2 reduce-scatters in the
        # backward phase); the "pp" entries are sums between two stages holding one weight.
        gradient_axes = {c.tensor: tuple(c.axes) for c in plan.collectives
                         if c.phase in (Phase.GRADIENT, Phase.BACKWARD)
                         and c.op == OPTIMIZER_OP and AxisRole.PIPELINE not in c.axes}
        return cls(plan.mesh, ops, {n: t.layout for n, t in plan.tensors.items()},
                   gradient_axes, plan.step.loss_reads is LossReads.ROWS)

    @classmethod
    def unsplit(cls, graph: PlanningGraph) -> Placement:
        def whole(names: Sequence[str]) -> tuple[Layout | None, ...]:
            return tuple(Layout.replicated(len(graph.tensors[n].shape)) if n else None
                         for n in names)

        ops = {node.name: OpPlacement(REPLICATED, whole(node.inputs), whole(node.outputs))
               for node in graph.ops}
        stored = {n: Layout.replicated(len(t.shape)) for n, t in graph.tensors.items()}
        return cls(DeviceMesh((1,), (str(AxisRole.DATA),), 1), ops, stored, {})


def shard_of(value: torch.Tensor, layout: Layout, comm: MeshComm) -> torch.Tensor:
    """This rank's piece of a replicated value (no partial layouts here)."""
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            value = comm.local_slice(value, (axis,), dim)
    return value.contiguous()


class PlanRunner:
    """One rank's view of a plan: its shards, and the ops it runs, as the plan issues them.

    `held` names the weights this rank keeps (a pipeline stage keeps those its ops read);
    every weight is still drawn, so each one gets the values the unsplit run gives it.
    """

    def __init__(self, analysis: GraphAnalysis, placement: Placement, rank: int,
                 seed: int = 0, stored: Mapping[str, np.ndarray] | None = None,
                 held: Collection[str] | None = None) -> None:
        graph = analysis.graph
        self.graph, self.analysis, self.placement = graph, analysis, placement
        self.mesh = placement.mesh
        self.seed = seed
        # Which draw the dropout masks are of: the training step (the engine counts them
        # from 1) and the micro-batch running (`executor.dropout`).
        self.step = 0
        self.micro = 0
        self.counters = Counters()
        self.comm = MeshComm(self.mesh, rank, self.counters)
        self.needs_grad = analysis.needs_grad
        self.weight_derived = set(analysis.weight_roots)
        full = full_parameters(graph, seed, stored)
        self.params: dict[str, torch.Tensor] = {}
        for name, value in full.items():
            if held is not None and name not in held:
                continue
            local = shard_of(value, placement.stored[name], self.comm)
            if graph.tensors[name].kind == "parameter":
                local = local.clone().requires_grad_(True)
            self.params[name] = local
        self.gradient_axes = {name: axes for name, axes in placement.gradient_axes.items()
                              if name in self.params}
        self._steps: dict[tuple, list[CommStep]] = {}
        self._programs: dict[int, tuple] = {}
        self._segments: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
        self._region_of = analysis.recompute_regions()
        # Reads that share one move and one gradient reduction (`shared_read_key`): key ->
        # (the tensor read, the moved tensor every such read uses), dropped at the last.
        self._shared: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_read: dict[tuple, int] = {}
        for k, node in enumerate(graph.ops):
            labels, strategy = self._labelling(k)
            for index, (name, wanted) in enumerate(
                    zip(node.inputs, placement.ops[node.name].inputs, strict=True)):
                if name and wanted is not None and name in placement.stored:
                    key = self._shared_key(k, name, placement.stored[name], wanted,
                                           grad_partial_axes(labels, strategy, index))
                    if key is not None:
                        self._last_read[key] = k

    def _shared_key(self, k: int, name: str, src: Layout, dst: Layout,
                    partial_axes: tuple[str, ...]) -> tuple | None:
        return shared_read_key(self.graph.tensors[name], src, dst, partial_axes,
                               int(self._region_of[k]), self.mesh,
                               self.needs_grad.get(name, False), name in self.weight_derived)

    def inputs(self, feeds: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """The held weights and this rank's shards of the fed inputs, with their layouts."""
        values: dict[str, torch.Tensor] = dict(self.params)
        stored = self.placement.stored
        layouts: dict[str, Layout] = {n: stored[n] for n in self.params}
        for name, value in feeds.items():
            values[name] = shard_of(value, stored[name], self.comm)
            layouts[name] = stored[name]
        return values, layouts

    def forward(self, feeds: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """Run every op; return local values and their layouts."""
        values, layouts = self.inputs(feeds)
        self.run_range(0, len(self.graph.ops), values, layouts)
        return values, layouts

    def run_range(self, first: int, end: int, values: dict[str, torch.Tensor],
                  layouts: dict[str, Layout],
                  segments: Sequence[tuple[int, int]] = ()) -> None:
        """Ops [first, end) in order; those in `segments` under activation checkpointing."""
        k = first
        for a, b in sorted(s for s in segments if first <= s[0] and s[1] <= end):
            while k < a:
                self.run_op(k, values, layouts)
                k += 1
            self._checkpointed(a, b, values, layouts)
            k = b
        while k < end:
            self.run_op(k, values, layouts)
            k += 1

    def _checkpointed(self, first: int, end: int, values: dict[str, torch.Tensor],
                      layouts: dict[str, Layout]) -> None:
        """Keep only the segment's inputs and outputs; the backward pass re-runs it (its
        forward collectives too, counted as phase "recompute")."""
        inputs, outputs = self._segment_io(first, end)
        for name in inputs:
            if name not in values:
                self._constant(name, values, layouts)
        seen: dict[str, Layout] = {}
        calls = [0]
        draw = (self.step, self.micro)  # the recomputation draws the forward's masks

        def body(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            calls[0] += 1
            again = calls[0] > 1
            local = dict(zip(inputs, tensors, strict=True))
            local_layouts = {n: layouts[n] for n in inputs}
            self.counters.recompute_calls += again
            self.counters.recomputing = again
            running = (self.step, self.micro)
            self.step, self.micro = draw
            try:
                for k in range(first, end):
                    self.run_op(k, local, local_layouts)
            finally:
                self.counters.recomputing = False
                self.step, self.micro = running
            seen.update(local_layouts)
            return tuple(local[n] for n in outputs)

        results = checkpoint(body, *[values[n] for n in inputs], use_reentrant=False,
                             early_stop=False)
        for name, value in zip(outputs, results, strict=True):
            values[name], layouts[name] = value, seen[name]

    def _segment_io(self, first: int, end: int) -> tuple[list[str], list[str]]:
        """(inputs, outputs) of ops [first, end): read from outside, read from outside."""
        key = (first, end)
        if key not in self._segments:
            ops = self.graph.ops
            inside = {n for node in ops[first:end] for n in node.outputs if n}
            inputs = sorted({n for node in ops[first:end] for n in node.inputs
                             if n and n not in inside})
            later = {n for node in ops[:first] + ops[end:] for n in node.inputs if n}
            outputs = sorted(n for n in inside
                             if n in later or n in self.graph.outputs)
            self._segments[key] = (inputs, outputs)
        return self._segments[key]

    def _constant(self, name: str, values: dict[str, torch.Tensor],
                  layouts: dict[str, Layout]) -> None:
        info = self.graph.tensors[name]
        if info.value is None:
            raise ShardplanError(f"constant {name} has no value in the planning graph (larger "
                                 "than the folding limit); the executor cannot run it")
        values[name] = to_tensor(np.asarray(info.value))
        layouts[name] = Layout.replicated(len(info.shape))

    def _labelling(self, k: int) -> tuple[DimLabels, OpStrategy]:
        """Op k's labelling (its rule's, or all-replicated) and the strategy it runs."""
        node = self.graph.ops[k]
        labels = self.analysis.labels.get(node.name)
        if labels is None:
            return replicated_labels(node), REPLICATED
        return labels, self.placement.ops[node.name].strategy

    def _program(self, k: int) -> tuple:
        """(labels, strategy, local program) of op k: the same every micro-batch."""
        if k not in self._programs:
            node, tensors = self.graph.ops[k], self.graph.tensors
            labels, strategy = self._labelling(k)
            program = local_program(node, labels, strategy, tensors, self.mesh, self.comm.coord)
            self._programs[k] = (labels, strategy, program)
        return self._programs[k]

    def run_op(self, k: int, values: dict[str, torch.Tensor],
               layouts: dict[str, Layout]) -> None:
        """Op k: move each input to the layout its strategy needs, run the local program."""
        node = self.graph.ops[k]
        placed = self.placement.ops[node.name]
        labels, strategy, program = self._program(k)
        env: dict[str, torch.Tensor] = {}
        for index, (name, wanted) in enumerate(zip(node.inputs, placed.inputs, strict=True)):
            if not name or wanted is None:
                continue
            if name not in values:
                self._constant(name, values, layouts)
            partial = grad_partial_axes(labels, strategy, index)
            key = self._shared_key(k, name, layouts[name], wanted, partial)
            shared = self._shared.get(key) if key is not None else None
            if shared is not None and shared[0] is values[name]:
                env[name] = shared[1]  # one move; autograd sums the reads' gradients
            else:
                env[name] = self._move(values[name], layouts[name], wanted,
                                       self.graph.tensors[name], partial,
                                       share=placed.share(index))
            if key is not None:
                if self._last_read.get(key) == k:
                    self._shared.pop(key, None)
                else:
                    self._shared[key] = (values[name], env[name])
        for name, value in program.constants.items():
            env[name] = to_tensor(np.asarray(value))
        extra = ({"Dropout": {"_site": self._dropout_site(k, labels, placed.inputs[0])}}
                 if node.op_type == "Dropout" and placed.inputs[0] is not None else None)
        run_nodes(program.nodes, env, self._collective, extra)
        for name, layout in zip(node.outputs, placed.outputs, strict=True):
            if name and layout is not None:
                values[name], layouts[name] = env[name], layout

    def _dropout_site(self, k: int, labels: DimLabels, layout: Layout) -> DropoutSite:
        """Where op k's mask is drawn: this rank's block of the input's global tensor, the
        micro-batch's place along the batch included (`executor.dropout`)."""
        node = self.graph.ops[k]
        shape = self.graph.tensors[node.inputs[0]].shape
        batch = self.analysis.batch_labels.get(node.name, frozenset())
        dim_labels = labels.inputs[0] or ()
        offsets = []
        for dim, (size, axes) in enumerate(zip(shape, layout.dims, strict=True)):
            offset = self.comm.index(axes) * (size // self.mesh.group_size(axes))
            if dim < len(dim_labels) and dim_labels[dim] in batch:
                offset += self.micro * size
            offsets.append(offset)
        return DropoutSite(self.seed, self.step, k, tuple(offsets))

    def _move(self, value: torch.Tensor, src: Layout, dst: Layout, info,
              partial_axes: tuple[str, ...],
              phases: tuple[str, str] = ("forward", "backward"),
              share: float = 1.0) -> torch.Tensor:
        key = (info.name, src, dst)
        steps = self._steps.get(key)
        if steps is None:  # the same every step: compute the moves once
            steps = self._steps[key] = redistribute(src, dst, info.shape, info.itemsize,
                                                    self.mesh)
        if not info.is_float or not self.needs_grad.get(info.name, False):
            return self.comm.run(value, steps, phases[0]) if steps else value
        if info.name in self.weight_derived:
            # Same on every rank: slices keep autograd's zero-padded gradient, and partial
            # gradients are summed once at the weight (the plan's gradient collectives),
            # but for a sum over an axis the stored layout splits: its devices hold
            # different slices there, so the gather's backward sums it, a reduce-scatter
            # (`planner.sharding.derive._edge_moves`).
            stored = set(src.used_axes)
            kept = [a for a in partial_axes if a in stored]
            moved = value
            for step in steps:
                if step.kind == Move.SLICE:
                    moved = self.comm.local_slice(moved, step.axes, _dst(step))
                    continue
                summed = tuple(a for a in kept if a in step.axes) \
                    if step.kind == Move.ALL_GATHER else ()
                moved = _Move.apply(moved, self.comm, [step],
                                    backward_steps([step], summed, 0), phases)
            return moved if share == 1.0 else GradientShare.apply(moved, share)
        backward = backward_steps(steps, partial_axes, 0)
        if not steps and not backward:
            return value
        return _Move.apply(value, self.comm, steps, backward, phases)

    def _collective(self, node, env: dict[str, torch.Tensor]) -> None:
        axes = [a.decode() if isinstance(a, bytes) else a for a in
                next(a for a in node.attribute if a.name == "axes").strings]
        env[node.output[0]] = _SumOverAxes.apply(env[node.input[0]], self.comm, tuple(axes))

    def loss(self, values: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout],
             output: str, targets: torch.Tensor | None,
             kind: str = "ce") -> tuple[torch.Tensor, float]:
        """The step's loss: (local part to backprop, global value).

        kind "graph": `output` is the model's own scalar loss (partial sums backprop as
        they are). "ce": mean cross-entropy of logits against class targets; "mse": mean
        squared error against float targets. For both the output keeps its batch split and
        is gathered along every other dim; the global mean sums the ranks' shares."""
        info = self.graph.tensors[output]
        src = layouts[output]
        if kind == "graph":
            local = values[output].reshape(())
            reported = self.comm.all_reduce(local.detach().reshape(1), src.partial, "loss")
            return local, float(reported.item())
        rows = self.analysis.rows_dim(output)
        batch_axes = src.dims[rows] if src.dims else ()
        dst = loss_layout(src, rows)
        # The plan lists this gather with the forward pass (`LossReads.ROWS`); a plan that
        # does not leaves it to the loss, counted apart.
        phases = ("forward", "backward") if self.placement.loss_reads_planned \
            else ("loss", "loss")
        predicted = self._move(values[output], src, dst, info, (), phases)
        assert targets is not None
        local_targets = shard_of(targets, Layout(tuple(
            batch_axes if dim == rows else () for dim in range(targets.dim()))), self.comm)
        if kind == "ce":
            classes = predicted.shape[-1]
            total = torch.nn.functional.cross_entropy(
                predicted.reshape(-1, classes).float(), local_targets.reshape(-1).long(),
                reduction="sum")
        elif kind == "mse":
            total = ((predicted.float() - local_targets.float()) ** 2).sum()
        else:
            raise ShardplanError(f"--loss {kind!r}: choose graph, ce or mse")
        local = total / float(targets.numel())
        reported = self.comm.all_reduce(local.detach().reshape(1), batch_axes, "loss")
        return local, float(reported.item())
