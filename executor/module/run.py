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

from executor.module.kernels import attention_math
from executor.module.layouts import ModuleLayouts
from planner.sharding.convert import to_placements
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

_SHARD = re.compile(r"Shard\((\d+)\)")
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


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
    where it was read (a pending sum reduced there), as the plan's backward collectives
    are: the reads of one value in one layout share this node, so autograd sums their
    gradients first and one reduction serves them all."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: TorchMesh,
                wanted: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.wanted = mesh, wanted
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None]:
        if isinstance(grad, DTensor) and not _normalised(grad, ctx.wanted):
            grad = grad.redistribute(ctx.mesh, ctx.wanted)
        return grad, None, None


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


class PlannedRun(Interpreter):
    """One forward of the traced graph with the plan's layouts (module docstring)."""

    def __init__(self, graph: GraphModule, layouts: ModuleLayouts, plan_mesh: DeviceMesh,
                 mesh: TorchMesh, unplanned: Counter) -> None:
        super().__init__(graph)
        self.layouts, self.plan_mesh, self.mesh = layouts, plan_mesh, mesh
        self.unplanned = unplanned
        self._placements: dict[tuple[str, Layout], tuple[Placement, ...]] = {}
        self._moved: dict[tuple[str, Layout], DTensor] = {}

    def _wanted(self, name: str, layout: Layout) -> tuple[Placement, ...]:
        key = (name, layout)
        if key not in self._placements:
            self._placements[key] = placements(layout, self.plan_mesh, f"tensor {name}")
        return self._placements[key]

    def _replicated(self, value: Any) -> Any:
        if not _plain(value):
            return value
        return DTensor.from_local(value.to(self.mesh.device_type), self.mesh,
                                  [Replicate()] * self.mesh.ndim, run_check=False)

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
                self._moved[key] = _GradientIn.apply(moved, self.mesh, wanted) \
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
            args, kwargs = pytree.tree_map(self._replicated, (args, kwargs))
        assert callable(n.target)
        target = n.target
        if target is _SDPA and self.mesh.device_type == "cpu":
            target = attention_math
        result = target(*args, **kwargs)
        if planned is not None and planned.output is not None and isinstance(result, DTensor):
            wanted = self._wanted(n.name, planned.output)
            if not _normalised(result, wanted):
                self.unplanned[f"{n.name}: {result.placements} -> {wanted}"] += 1
                result = result.redistribute(self.mesh, wanted)
        return result


def run_planned(graph: GraphModule, layouts: ModuleLayouts, plan_mesh: DeviceMesh,
                mesh: TorchMesh, flat_inputs: Sequence[torch.Tensor],
                unplanned: Counter) -> Any:
    """The traced graph's flat outputs for `flat_inputs` (DTensors in the plan's layouts)."""
    return PlannedRun(graph, layouts, plan_mesh, mesh, unplanned).run(*flat_inputs)
