"""Run a plan on real ranks: local shards, the planned collectives, autograd through both.

Each rank imports the same planning graph, materialises only its shards of the weights
(drawn from one seed, so every run equals the unsharded initialisation), then walks the
ops in order: every input is moved from the layout it has to the layout the op's strategy
needs with the planner's own redistribution steps, and the op runs as the planner's local
program (`planner.sharding.local`). The backward pass runs the transposed steps the plan
priced; parameter gradients are summed over the axes the plan lists (`phase: gradient`).
Every collective issued is counted, so a run can be checked against its plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import torch
import torch.distributed as dist

from executor.interpreter import run_nodes, to_tensor
from planner.errors import PlanFileError, ShardplanError
from planner.graph import PlanningGraph
from planner.planfile import Plan
from planner.pricing import replicated_labels, requires_grad_map, weight_roots_map
from planner.sharding.layout import Layout
from planner.sharding.local import local_program
from planner.sharding.mesh import DeviceMesh
from planner.sharding.redistribute import CommStep, backward_steps, redistribute
from planner.sharding.rules import safe_labels
from planner.sharding.strategy import REPLICATED, OpStrategy, grad_partial_axes


@dataclass
class Counters:
    """Collectives issued by this rank: (kind, axes, phase) -> count."""

    issued: Counter = field(default_factory=Counter)

    def add(self, kind: str, axes: Sequence[str], phase: str) -> None:
        self.issued[(kind, tuple(axes), phase)] += 1


class MeshComm:
    """Process groups for every set of mesh axes, and the collectives on them."""

    def __init__(self, mesh: DeviceMesh, rank: int, counters: Counters) -> None:
        self.mesh = mesh
        self.rank = rank
        self.coord = tuple(int(c) for c in np.unravel_index(rank, mesh.shape))
        self.counters = counters
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
        group = self.group(axes)
        if group is None:
            return tensor
        result = tensor.detach().clone().contiguous()
        dist.all_reduce(result, group=group)
        self.counters.add("all_reduce", axes, phase)
        return result

    def all_gather(self, tensor: torch.Tensor, axes: Sequence[str], dim: int,
                   phase: str) -> torch.Tensor:
        group = self.group(axes)
        if group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.mesh.group_size(axes))]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        self.counters.add("all_gather", axes, phase)
        return torch.cat(parts, dim=dim)

    def local_slice(self, tensor: torch.Tensor, axes: Sequence[str], dim: int) -> torch.Tensor:
        parts = self.mesh.group_size(axes)
        chunk = tensor.shape[dim] // parts
        return tensor.narrow(dim, self.index(axes) * chunk, chunk)

    def run(self, tensor: torch.Tensor, steps: Sequence[CommStep], phase: str) -> torch.Tensor:
        """Apply redistribution steps (no autograd: callers wrap this)."""
        for step in steps:
            if step.kind == "all_gather":
                tensor = self.all_gather(tensor, step.axes, step.src_dim, phase)
            elif step.kind == "slice":
                tensor = self.local_slice(tensor, step.axes, step.dst_dim)
            elif step.kind == "all_reduce":
                tensor = self.all_reduce(tensor, step.axes, phase)
            elif step.kind == "reduce_scatter":
                reduced = self.all_reduce(tensor, step.axes, phase)
                self.counters.issued[("all_reduce", tuple(step.axes), phase)] -= 1
                self.counters.add("reduce_scatter", step.axes, phase)
                tensor = self.local_slice(reduced, step.axes, step.dst_dim)
            elif step.kind == "all_to_all":
                gathered = self.all_gather(tensor, step.axes, step.src_dim, phase)
                self.counters.issued[("all_gather", tuple(step.axes), phase)] -= 1
                self.counters.add("all_to_all", step.axes, phase)
                tensor = self.local_slice(gathered, step.axes, step.dst_dim)
            elif step.kind == "zero":
                if any(self.coord[self.mesh.axis_names.index(a)] for a in step.axes):
                    tensor = torch.zeros_like(tensor)
            else:
                raise ShardplanError(f"unknown redistribution step {step.kind!r}")
        return tensor.contiguous()


class _Move(torch.autograd.Function):
    """Forward: the planned steps. Backward: the transposed steps the plan priced."""

    @staticmethod
    def forward(ctx, tensor, comm, forward, backward, phases):
        ctx.comm, ctx.backward, ctx.phase = comm, backward, phases[1]
        return comm.run(tensor, forward, phases[0])

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.run(grad, ctx.backward, ctx.phase), None, None, None, None


class _SumOverAxes(torch.autograd.Function):
    """A statistics AllReduce inside an op (split training BatchNorm): both directions."""

    @staticmethod
    def forward(ctx, tensor, comm, axes):
        ctx.comm, ctx.axes = comm, axes
        return comm.all_reduce(tensor, axes, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, ctx.axes, "backward"), None, None


def check_plan_matches(plan: Plan, graph: PlanningGraph) -> None:
    """Refuse a plan made for another model or other dims before anything runs."""
    if plan.model.sha256 != graph.sha256:
        raise PlanFileError(
            f"the plan was made for a model with sha256 {plan.model.sha256[:12]}…, but "
            f"{graph.path} has {graph.sha256[:12]}…; re-plan this model")
    if dict(plan.model.bound_dims) != dict(graph.bound_dims):
        raise PlanFileError(f"the plan bound dims {plan.model.bound_dims}, the run binds "
                            f"{graph.bound_dims}; use the same --batch and --dim values")
    missing = [n.name for n in graph.ops if n.name not in {op.name for op in plan.ops}]
    if missing:
        raise PlanFileError(f"the plan has no entry for op {missing[0]} of {graph.path}")


def onnx_weights(path: str) -> dict[str, np.ndarray]:
    """The initializers stored in the model (with its external data when present); empty
    when the weights are declared but absent, as in the zoo's planning graphs."""
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(path)
    except Exception:
        return {}
    values = {}
    for init in model.graph.initializer:
        try:
            values[init.name] = numpy_helper.to_array(init)
        except (OSError, ValueError, RuntimeError):
            return {}
    return values


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


def shard_of(value: torch.Tensor, layout: Layout, comm: MeshComm) -> torch.Tensor:
    """This rank's piece of a replicated value (no partial layouts here)."""
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            value = comm.local_slice(value, (axis,), dim)
    return value.contiguous()


class PlanRunner:
    """One rank's view of a plan: its shards, and a training step that issues the plan."""

    def __init__(self, graph: PlanningGraph, plan: Plan, rank: int, seed: int = 0,
                 stored: Mapping[str, np.ndarray] | None = None) -> None:
        check_plan_matches(plan, graph)
        self.graph, self.plan = graph, plan
        self.mesh = plan.mesh
        self.counters = Counters()
        self.comm = MeshComm(self.mesh, rank, self.counters)
        self.entries = {op.name: op for op in plan.ops}
        self.needs_grad = requires_grad_map(graph)
        self.weight_derived = set(weight_roots_map(graph))
        full = full_parameters(graph, seed, stored)
        self.params: dict[str, torch.Tensor] = {}
        for name, value in full.items():
            local = shard_of(value, plan.tensors[name].layout, self.comm)
            if graph.tensors[name].kind == "parameter":
                local = local.clone().requires_grad_(True)
            self.params[name] = local
        self.gradient_axes = {c.tensor: tuple(c.axes) for c in plan.collectives
                              if c.phase == "gradient"}
        self._steps: dict[tuple, list[CommStep]] = {}

    def forward(self, feeds: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """Run every op; return local values and their layouts."""
        tensors = self.graph.tensors
        values: dict[str, torch.Tensor] = dict(self.params)
        layouts: dict[str, Layout] = {n: self.plan.tensors[n].layout for n in self.params}
        for name, value in feeds.items():
            values[name] = shard_of(value, self.plan.tensors[name].layout, self.comm)
            layouts[name] = self.plan.tensors[name].layout
        for node in self.graph.ops:
            entry = self.entries[node.name]
            labels = safe_labels(node, tensors)
            strategy = OpStrategy.of(entry.assignment) if labels is not None else REPLICATED
            labels = labels or replicated_labels(node, tensors)
            env: dict[str, torch.Tensor] = {}
            for index, (name, binding) in enumerate(zip(node.inputs, entry.inputs,
                                                        strict=True)):
                if not name or binding is None:
                    continue
                info = tensors[name]
                if name not in values:
                    if info.value is None:
                        raise ShardplanError(f"constant {name} of op {node.name} has no value "
                                             "in the planning graph (larger than the folding "
                                             "limit); the executor cannot run it")
                    values[name] = to_tensor(np.asarray(info.value))
                    layouts[name] = Layout.replicated(len(info.shape))
                env[name] = self._move(values[name], layouts[name], binding.layout, info,
                                       grad_partial_axes(labels, strategy, index))
            program = local_program(node, labels, strategy, tensors, self.mesh, self.comm.coord)
            for name, value in program.constants.items():
                env[name] = to_tensor(np.asarray(value))
            run_nodes(program.nodes, env, self._collective)
            for name, binding in zip(node.outputs, entry.outputs, strict=True):
                if name and binding is not None:
                    values[name], layouts[name] = env[name], binding.layout
        return values, layouts

    def _move(self, value: torch.Tensor, src: Layout, dst: Layout, info,
              partial_axes: tuple[str, ...],
              phases: tuple[str, str] = ("forward", "backward")) -> torch.Tensor:
        key = (info.name, src, dst)
        steps = self._steps.get(key)
        if steps is None:  # the same every step: compute the moves once
            steps = self._steps[key] = redistribute(src, dst, info.shape, info.itemsize,
                                                    self.mesh)
        if not info.is_float or not self.needs_grad.get(info.name, False):
            return self.comm.run(value, steps, phases[0]) if steps else value
        if info.name in self.weight_derived:
            # Same on every rank: slices keep autograd's zero-padded gradient, and partial
            # gradients are summed once at the weight (the plan's gradient collectives).
            local_steps = [s for s in steps if s.kind == "slice"]
            moved = value
            for step in steps:
                if step in local_steps:
                    moved = self.comm.local_slice(moved, step.axes, step.dst_dim)
                else:
                    moved = _Move.apply(moved, self.comm, [step],
                                        backward_steps([step], (), 0), phases)
            return moved
        backward = backward_steps(steps, partial_axes, 0)
        if not steps and not backward:
            return value
        return _Move.apply(value, self.comm, steps, backward, phases)

    def _collective(self, node, env: dict[str, torch.Tensor]) -> None:
        axes = [a.decode() if isinstance(a, bytes) else a for a in
                next(a for a in node.attribute if a.name == "axes").strings]
        env[node.output[0]] = _SumOverAxes.apply(env[node.input[0]], self.comm, tuple(axes))

    def sync_gradients(self) -> None:
        """Sum each weight's partial gradient over the axes the plan lists."""
        for name, axes in sorted(self.gradient_axes.items()):
            grad = self.params[name].grad
            if grad is not None:
                self.params[name].grad = self.comm.all_reduce(grad, axes, "gradient")

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
        batch_axes = src.dims[0] if src.dims else ()
        dst = Layout((batch_axes, *[() for _ in info.shape[1:]]))
        # The loss is not part of the planned graph: its moves are counted apart.
        predicted = self._move(values[output], src, dst, info, (), ("loss", "loss"))
        assert targets is not None
        local_targets = shard_of(targets, Layout((batch_axes, *[() for _ in
                                                               targets.shape[1:]])), self.comm)
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
