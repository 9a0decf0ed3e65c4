"""Run a traced graph on DTensors with the plan's layouts at every op.

Each call node's inputs are moved (`DTensor.redistribute`) to the layouts the plan binds
them in before the op runs, so the collectives are the plan's, issued where the plan
issues them; DTensor then runs the op on the local shards. Where DTensor's result has
another layout than the plan says, the result is moved to the plan's and the move is
counted as unplanned (`Unplanned`), so a difference is reported, never silent.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from executor.dropout import DropoutSite
from executor.module.kernels import attention_math, dropout
from executor.module.layouts import ModuleLayouts
from planner.sharding.convert import to_placements
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

_SHARD = re.compile(r"Shard\((\d+)\)")
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_DROPOUT = torch.ops.aten.native_dropout.default


def placements(layout: Layout, mesh: DeviceMesh, what: str) -> tuple[Placement, ...]:
    """torch placements of a layout (one per mesh axis), through the planner's one
    translation (`planner.sharding.convert.to_placements`)."""
    out: list[Placement] = []
    for text in to_placements(layout, mesh, what):
        match = _SHARD.fullmatch(text)
        if match:
            out.append(Shard(int(match.group(1))))
        elif text == "Partial()":
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def _normalised(value: DTensor, wanted: Sequence[Placement]) -> bool:
    """Whether `value` already has `wanted` (negative shard dims resolved)."""
    have = []
    for p in value.placements:
        if isinstance(p, Shard) and p.dim < 0:
            p = Shard(p.dim + value.ndim)
        have.append(p)
    return tuple(have) == tuple(wanted)


class _GradientIn(torch.autograd.Function):
    """Identity forward; in backward the gradient is put in the layout the value had
    where it was read, its pending sums over the axes the plan reduces there summed, as
    the plan's backward collectives are (a pending sum over other axes stays, for the
    plan to reduce later: at the weight it comes from). The reads of one value in one
    layout share this node, so autograd sums their gradients first and one reduction
    serves them all."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: TorchMesh, wanted: tuple[Placement, ...],
                reduced: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.wanted, ctx.reduced = mesh, wanted, reduced
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        if isinstance(grad, DTensor):
            target = tuple(
                have if isinstance(have, Partial) and dim not in ctx.reduced else want
                for dim, (have, want) in enumerate(zip(grad.placements, ctx.wanted,
                                                       strict=True)))
            if not _normalised(grad, target):
                grad = grad.redistribute(ctx.mesh, target)
        return grad, None, None, None


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def replicated(value: Any, mesh: TorchMesh) -> Any:
    """A plain tensor (the same on every rank) as a replicated DTensor on `mesh`; any
    other value as it is."""
    if not _plain(value):
        return value
    return DTensor.from_local(value.to(mesh.device_type), mesh, [Replicate()] * mesh.ndim,
                              run_check=False)


class TracedRun(Interpreter):
    """One forward of the traced graph as torch runs it, but for dropout, whose masks are
    drawn by `executor.dropout` (draw `step` of `seed`, each dropout its own op number),
    and attention with dropout, which runs as its definition so that dropout can apply."""

    def __init__(self, graph: GraphModule, seed: int, step: int) -> None:
        super().__init__(graph)
        self.seed, self.step = seed, step
        self.index = {n.name: k for k, n in enumerate(graph.graph.nodes)}

    def call(self, n: Node, args: Any, kwargs: Any) -> Any:
        assert callable(n.target)
        if n.target is _DROPOUT and len(args) > 2 and args[2] and args[1] > 0:
            return dropout(args[0], float(args[1]), self._site(n))
        if n.target is _SDPA:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p or self._fused_unavailable(args):
                site = self._site(n)
                return attention_math(*args, **kwargs,
                                      drop=lambda t: dropout(t, float(p), site)[0])
        return n.target(*args, **kwargs)

    def _site(self, n: Node) -> DropoutSite:
        return DropoutSite(self.seed, self.step, self.index[n.name], ())

    def _fused_unavailable(self, args: Any) -> bool:
        """DTensor has no rule for the CPU fused attention kernel."""
        return isinstance(args[0], DTensor) and args[0].device_mesh.device_type == "cpu"

    def run_node(self, n: Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return self.call(n, args, kwargs)


def run_unsplit(graph: GraphModule, flat_inputs: Sequence[torch.Tensor], seed: int,
                step: int) -> Any:
    """The traced graph's flat outputs, on one device (what a split run must equal)."""
    return TracedRun(graph, seed, step).run(*flat_inputs)


class PlannedRun(TracedRun):
    """One forward of the traced graph with the plan's layouts (module docstring)."""

    def __init__(self, graph: GraphModule, layouts: ModuleLayouts, plan_mesh: DeviceMesh,
                 mesh: TorchMesh, unplanned: Counter, seed: int, step: int) -> None:
        super().__init__(graph, seed, step)
        self.layouts, self.plan_mesh, self.mesh = layouts, plan_mesh, mesh
        self.unplanned = unplanned
        self._placements: dict[tuple[str, Layout], tuple[Placement, ...]] = {}
        self._moved: dict[tuple[str, Layout], DTensor] = {}

    def _wanted(self, name: str, layout: Layout) -> tuple[Placement, ...]:
        key = (name, layout)
        if key not in self._placements:
            self._placements[key] = placements(layout, self.plan_mesh, f"tensor {name}")
        return self._placements[key]

    def run_node(self, n: Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        planned = self.layouts.nodes.get(n.name)

        def load(arg: Node) -> Any:
            value = self.env[arg]
            if planned is None or not isinstance(value, DTensor):
                return value
            layout = planned.inputs.get(arg.name)
            if layout is None:
                return value
            key = (arg.name, layout)
            if key not in self._moved:  # reads of one value in one layout share one move
                wanted = self._wanted(arg.name, layout)
                moved = value if _normalised(value, wanted) else value.redistribute(
                    self.mesh, wanted)
                axes = planned.reduced.get(arg.name, ())
                dims = tuple(self.plan_mesh.axis_names.index(a) for a in axes)
                self._moved[key] = _GradientIn.apply(moved, self.mesh, wanted, dims) \
                    if moved.requires_grad else moved
            return self._moved[key]

        args = map_arg(n.args, load)
        kwargs = map_arg(n.kwargs, load)
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(v, DTensor) for v in leaves) and any(
                _plain(v) for v in leaves):
            # A tensor the graph made itself (a constant, positions, a mask) meets the
            # split ones: it is the same on every rank, so it is a replicated DTensor,
            # also to the backward pass that saves it.
            args, kwargs = pytree.tree_map(lambda v: replicated(v, self.mesh), (args, kwargs))
        result = self.call(n, args, kwargs)
        if planned is not None and planned.output is not None and isinstance(result, DTensor):
            wanted = self._wanted(n.name, planned.output)
            if not _normalised(result, wanted):
                self.unplanned[f"{n.name}: {result.placements} -> {wanted}"] += 1
                result = result.redistribute(self.mesh, wanted)
        return result


def run_planned(graph: GraphModule, layouts: ModuleLayouts, plan_mesh: DeviceMesh,
                mesh: TorchMesh, flat_inputs: Sequence[torch.Tensor],
                unplanned: Counter, seed: int, step: int) -> Any:
    """The traced graph's flat outputs for `flat_inputs` (DTensors in the plan's layouts)."""
    return PlannedRun(graph, layouts, plan_mesh, mesh, unplanned, seed, step).run(
        *flat_inputs)
