"""Which traced ops run on plain local tensors: those the plan splits only as data
parallelism would.

The trace's batch dim is symbolic, so the trace run on one rank's rows computes that
rank's rows of every value whose shape has the batch dim, and the whole of every value
without it. Call that a value's *natural* layout: its batch dim (the first symbolic dim)
split over the mesh axes that split the batch's inputs, every other dim whole. An op whose
inputs the plan reads in their natural layouts, and whose outputs the plan lays out
naturally too, needs no communication and no DTensor: it runs as the plain torch op on the
local tensors, as DDP's ranks run every op, which saves DTensor's dispatch (a sharding
rule looked up, local shapes computed, a result wrapped) on most ops of a data-parallel or
ZeRO plan and on the norms, residuals and elementwise chains of a tensor-parallel one.

At the edges, a local value read by a DTensor op becomes a DTensor in its natural layout
(`DTensor.from_local`, no communication), and a DTensor read by a local op becomes its
local block (`to_local`; a replicated one, read by an op that works on this rank's rows,
gets its gradient back as a pending sum over the batch axes, which the plan's weight
collectives reduce). Sizes the graph computes from the batch (`sym_size` and arithmetic on
it) are kept twice: the local op gets the local size, a DTensor op the global one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from executor.module.layouts import ModuleLayouts
from executor.module.positions import (
    counts_positions,
    indexes_rows,
    row_positions,
    symbolic_dim,
)
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


def _tensors(value: object) -> list[torch.Tensor] | None:
    """The tensors a node's example value holds (a tuple's too), None for other values."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, torch.Tensor) or v is None for v in value):
        return [v for v in value if v is not None]
    return None


def is_size(node: Node) -> bool:
    """A node computing a size (an int, possibly symbolic), not a tensor."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt)) and node.op == "call_function"


def is_guard(node: Node) -> bool:
    """Whether `node` is the export's check of its inputs' shapes (`_guards_fn`), which
    reads the whole inputs."""
    return node.op == "call_module" and str(node.target).startswith("_guards")


@dataclass(frozen=True)
class LocalPlan:
    """The batch's mesh axes, and the ops that run locally."""

    batch_axes: tuple[str, ...]
    degree: int  # ranks the batch is split over
    nodes: frozenset[str]  # the call nodes that run on local tensors

    def natural(self, value: torch.Tensor) -> Layout | None:
        """The layout the trace run on local rows gives `value`; None when ambiguous."""
        dim = symbolic_dim(value)
        if dim == -1:
            return None
        if dim is None or not self.batch_axes:
            return Layout.replicated(value.dim())
        return Layout.split(value.dim(), dim, self.batch_axes)

    def local_weights(self, graph: GraphModule, reads: Mapping[str, str]) -> frozenset[str]:
        """The weights (the plan's names; `reads` maps get_attr targets to them) that only
        local ops read, under every name they are read by: these need no DTensor to be
        read (`executor.module.weights.WeightSync.leaves`)."""
        only_local: dict[str, bool] = {}
        for node in graph.graph.nodes:
            name = reads.get(str(node.target)) if node.op == "get_attr" else None
            if name is not None:
                only_local[name] = only_local.get(name, True) and bool(node.users) and all(
                    user.name in self.nodes for user in node.users)
        return frozenset(name for name, local in only_local.items() if local)

    @classmethod
    def none(cls) -> LocalPlan:
        """No op runs locally: every op on DTensors."""
        return cls((), 1, frozenset())

    @classmethod
    def of(cls, graph: GraphModule, layouts: ModuleLayouts, mesh: DeviceMesh,
           weights: Mapping[str, str]) -> LocalPlan:
        """The ops of `graph` that may run locally under `layouts` (module docstring);
        `weights` maps get_attr targets to the plan's weight names."""
        # the batch's axes: those splitting the rows of the inputs the graph reads (an
        # input it ignores, a batch's `labels` beside the module's own arguments, or one
        # without rows is whole as it is; an op reading a whole input that has rows stays
        # on DTensors, `_runs_locally`)
        rows = {node.name: symbolic_dim(node.meta["val"]) for node in graph.graph.nodes
                if node.op == "placeholder" and node.name in layouts.inputs
                and isinstance(node.meta.get("val"), torch.Tensor)
                and any(not is_size(user) and not is_guard(user) for user in node.users)}
        split = [(layouts.inputs[name], dim) for name, dim in rows.items()
                 if dim is not None and dim >= 0]
        axes = {layout.dims[dim] for layout, dim in split}
        splits_other = any(axes_ for layout, dim in split
                           for d, axes_ in enumerate(layout.dims) if d != dim)
        if len(axes) != 1 or splits_other or any(layout.partial for layout in
                                                  layouts.inputs.values()):
            return cls.none()
        batch_axes = next(iter(axes))
        plan = cls(batch_axes, mesh.group_size(batch_axes), frozenset())
        numbers, picks = row_positions(graph)  # (`executor.module.positions`)
        held: dict[Node, Layout | None] = {}  # each value's layout, where known
        local: set[str] = set()
        made: set[Node] = set()  # tensors the graph makes from constants: whole everywhere
        for node in graph.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder":
                held[node] = layouts.inputs.get(node.name)
            elif node.op == "get_attr":
                name = weights.get(str(node.target))
                if name:
                    held[node] = layouts.parameters.get(name)
                else:  # a buffer of the graph's own
                    made.add(node)
                    held[node] = Layout.replicated(value.dim()) if isinstance(
                        value, torch.Tensor) else None
            elif node.op == "call_function" and not is_size(node):
                if counts_positions(node) and node.name not in numbers:
                    made.add(node)  # the whole's positions, each rank reading its block
                    held[node] = Layout.replicated(value.dim())
                elif node.name in numbers or plan._runs_locally(
                        node, layouts, held, local, made, numbers, node.name in picks):
                    local.add(node.name)
                    held[node] = plan.natural(value) if isinstance(
                        value, torch.Tensor) else None
                elif all(a in made or is_size(a) for a in node.all_input_nodes):
                    made.add(node)  # run as the plain op on whole tensors
                    held[node] = Layout.replicated(value.dim()) if isinstance(
                        value, torch.Tensor) else None
                else:
                    entry = layouts.nodes.get(node.name)
                    held[node] = entry.output if entry is not None else None
        return cls(batch_axes, plan.degree, frozenset(local))

    def _runs_locally(self, node: Node, layouts: ModuleLayouts,
                      held: Mapping[Node, Layout | None], local: set[str],
                      made: set[Node], row_numbers: frozenset[str], picks: bool) -> bool:
        """Whether `node` may run on local tensors. An op indexing the batch's rows by
        values does not (they number the whole batch's), unless it `picks` every row by
        `row_numbers`, which number this rank's from 0 (`executor.module.positions`)."""
        if indexes_rows(node) and not picks:
            return False
        exempt = row_numbers if picks else frozenset()
        entry = layouts.nodes.get(node.name)
        if entry is not None and entry.reduced:
            return False  # the plan reduces a gradient here: a DTensor op issues it
        outs = _tensors(node.meta.get("val"))
        if not outs:
            return False
        for out in outs:
            natural = self.natural(out)
            if natural is None:
                return False
            if self.degree > 1 and natural.is_replicated:
                # a whole value computed locally would get a whole gradient back, which
                # the edge to_local would take for a pending sum: leave it to DTensor
                return False
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            planned = entry.output if entry is not None else None
            if planned is not None and planned != self.natural(value):
                return False
        else:  # a tuple: each part the plan lays out (through getitem) must be natural
            for user in node.users:
                part = layouts.nodes.get(user.name)
                val = user.meta.get("val")
                if part is not None and part.output is not None and (
                        not isinstance(val, torch.Tensor) or part.output != self.natural(val)):
                    return False
        for arg in node.all_input_nodes:
            if is_size(arg) or arg.name in exempt:
                continue
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor):
                if arg.name in local or _tensors(val) is None:
                    continue  # a local tuple's part, or no tensor at all
                return False
            natural = self.natural(val)
            read = entry.inputs.get(arg.name) if entry is not None else None
            if natural is None or (read is not None and read != natural):
                return False
            if arg not in made and held.get(arg) != natural:
                return False  # (a whole tensor the graph made is cut to this rank's rows)
        return True
