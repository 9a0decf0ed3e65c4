"""Everything one choice of strategies implies, before any price: layouts and collectives.

Given a strategy per op on a mesh, each op's input and output layouts follow from its
labelling; every tensor is stored as its producer writes it (inputs and weights as their
first consumer needs them); every read in another layout is a redistribution, whose
forward steps and transposed backward steps are collectives (reads of one tensor in one
layout within a layer share one move and one gradient reduction: `shared_read_key`); the
op's own collectives (a split training batch norm's statistics) follow from the
strategy; and every weight's gradient is summed over the axes its consumers split work
on. `derive` computes this once, in op order, as typed records. The cost layer prices
them; the plan builder writes them; `shardplan validate` re-derives them to check a plan
file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from planner.errors import StrategyError
from planner.graph import OpNode, TensorInfo
from planner.kinds import CollectiveKind, LossReads, Move, Phase
from planner.ops import DimLabels, replicated_labels
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.candidates import Candidate, describe
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.outputs import loss_layout, loss_read_slots
from planner.sharding.redistribute import backward_steps, equivalent, redistribute
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    work_fraction,
)


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective a run issues: per micro-batch (forward, backward) or per step
    (gradient). `nbytes` is the per-device buffer the formulas price (a weight's local
    share may be fractional before rounding); `op` is the consuming op, or "optimizer"
    for a weight's gradient synchronisation."""

    kind: CollectiveKind
    tensor: str
    axes: tuple[str, ...]
    nbytes: float
    phase: Phase
    op: str


OPTIMIZER_OP = "optimizer"
#: the op name of the loss's read of an output (`loss_read_moves`): after the forward pass,
#: once per micro-batch, never re-run by a recompute of the op that wrote it
LOSS_OP = "loss"


class OpSharding(NamedTuple):
    """One op under its strategy: its labelling, layouts and its share of the work (a
    named tuple: a derivation makes one per op, a frozen dataclass's construction cost
    more than the rest of the op's step)."""

    node: OpNode
    labels: DimLabels  # the op's rule, or the all-replicated labelling of an op without one
    has_rule: bool
    strategy: OpStrategy
    inputs: tuple[Layout | None, ...]  # as the op reads them (None: absent input)
    outputs: tuple[Layout | None, ...]
    fraction: float  # share of the op's work one device does
    collectives: tuple[CollectiveSpec, ...]  # its inputs' moves, then its own


@dataclass(frozen=True)
class ShardedGraph:
    """The derivation of one choice: per op, the stored layout of every tensor, every
    per-micro-batch collective in op order, and the weights' gradient sums."""

    analysis: GraphAnalysis
    mesh: DeviceMesh
    training: bool
    ops: tuple[OpSharding, ...]
    layouts: Mapping[str, Layout]  # tensor -> stored layout (absent: never read)
    gradient_axes: Mapping[str, tuple[str, ...]]  # parameter -> axes its gradient sums over
    gradients: tuple[CollectiveSpec, ...]  # the op-level plan's gradient all-reduces
    #: (op, input slot) -> the share of its gradient the read hands back, where not 1
    #: (`read_gradient_share`: a whole read of a weight whose gradient sums over its axis)
    shares: Mapping[tuple[str, int], float] = field(default_factory=dict)

    @property
    def collectives(self) -> tuple[CollectiveSpec, ...]:
        """Every op-level collective: forward and backward ones in op order, then the
        gradient synchronisation."""
        return tuple(c for op in self.ops for c in op.collectives) + self.gradients

    @property
    def no_rule(self) -> tuple[str, ...]:
        return tuple(op.node.qualified_type for op in self.ops if not op.has_rule)

    @property
    def used_axes(self) -> frozenset[str]:
        """The mesh axes some op splits over; along the others every rank repeats the work."""
        return frozenset(axis for op in self.ops for axis in op.strategy.used_axes)

    def layout(self, tensor: str) -> Layout:
        """The stored layout of a tensor; replicated for one no op reads or writes."""
        found = self.layouts.get(tensor)
        return found if found is not None else Layout.replicated(
            len(self.analysis.graph.tensors[tensor].shape))


def derive(analysis: GraphAnalysis, mesh: DeviceMesh, strategies: Mapping[str, OpStrategy],
           training: bool = True, loss_reads: LossReads = LossReads.AS_IS,
           foreign: frozenset[str] = frozenset()) -> ShardedGraph:
    """The layouts and collectives of `strategies` (missing ops run replicated); in
    training, with `loss_reads` rows, the moves of each output into the layout the loss
    reads (`planner.sharding.outputs`), listed with the op writing it under `LOSS_OP`.

    `foreign` ops run elsewhere (on another pipeline stage's mesh: per-stage meshes): they
    place, store, move and reduce nothing here, so a tensor they produce arrives as this
    mesh's first op reading it wants it, as a graph input does (the send between the
    meshes reshards it)."""
    graph = analysis.graph
    read_by_loss = loss_read_slots(graph, training, loss_reads)
    tensors = graph.tensors
    needs_grad = analysis.needs_grad if training else {}
    layout_of: dict[str, Layout] = {}
    deferred_axes: dict[str, set[str]] = {}
    ops: list[OpSharding] = []
    region_of = analysis.recompute_regions().tolist()
    weight_roots = analysis.weight_roots
    moved: set[tuple] = set()
    described: dict[tuple, tuple[Candidate, float, tuple]] = {}
    #: reads of weight-derived tensors by ops that do not just pass weights on: each hands
    #: back a share of its gradient (`read_gradient_share`)
    weight_reads: list[tuple[OpNode, int, str, frozenset[str], Layout, Layout,
                             tuple[str, ...]]] = []
    for k, node in enumerate(graph.ops):
        rule = analysis.labels.get(node.name)
        strategy = strategies.get(node.name, REPLICATED) if rule is not None else REPLICATED
        labels = rule if rule is not None else replicated_labels(node)
        # Repeated layers ask the same question of every layer: answer it once.
        shape_key = (labels, strategy, node.flops, node.bytes_read, node.bytes_written,
                     tuple(tensors[t].shape if t else None for t in node.inputs),
                     tuple(len(tensors[t].shape) if t else -1 for t in node.outputs))
        found = described.get(shape_key)
        if found is None:
            own = describe(node, labels, strategy, tensors, mesh)
            found = described[shape_key] = (own, work_fraction(strategy, mesh), tuple(
                CollectiveSpec(CollectiveKind(kind), "", tuple(axes), nbytes, phase, "")
                for phase, steps in ((Phase.FORWARD, own.forward_collectives),
                                     (Phase.BACKWARD, own.backward_collectives))
                for kind, axes, nbytes in steps))
        own, fraction, own_specs = found
        wanted, produced = own.inputs, own.outputs
        specs: list[CollectiveSpec] = []
        if node.name in foreign:
            ops.append(OpSharding(node, labels, rule is not None, strategy, wanted, produced,
                                  fraction, ()))
            continue
        for index, (name, want) in enumerate(zip(node.inputs, wanted, strict=True)):
            if not name or want is None:
                continue
            stored = layout_of.get(name)
            if stored is None:  # inputs and weights are placed as first consumed
                stored = layout_of[name] = want
            partial = own.grad_partial[index]
            grad = needs_grad.get(name, False)
            roots = weight_roots.get(name)
            if roots is not None and grad and not passes_weights_on(node, weight_roots):
                weight_reads.append((node, index, name, roots, stored, want, tuple(partial)))
            if (stored is want or stored == want) and not (grad and partial):
                continue  # read as stored, no partial gradient: nothing moves either way
            info = tensors[name]
            key = shared_read_key(info, stored, want, partial, region_of[k], mesh, grad,
                                  roots is not None)
            if key is not None and key in moved:
                continue  # an earlier read's move serves this one, both ways
            if key is not None:
                moved.add(key)
            moves, deferred = _edge_moves(info.shape, info.itemsize, stored, want, mesh, grad,
                                          tuple(partial), roots is not None)
            if moves:  # `edge_steps`, named: most reads move nothing
                specs += [CollectiveSpec(kind, name, axes, nbytes, phase, node.name)
                          for kind, axes, nbytes, phase in moves]
            if deferred:
                for root in roots or ():
                    deferred_axes.setdefault(root, set()).update(deferred)
        if own_specs:
            output = node.outputs[0]
            specs += [CollectiveSpec(c.kind, output, c.axes, c.nbytes, c.phase, node.name)
                      for c in own_specs]
        for slot in read_by_loss.get(node.name, ()):
            name, layout = node.outputs[slot], produced[slot]
            if layout is not None:
                specs += [CollectiveSpec(kind, name, axes, nbytes, phase, LOSS_OP)
                          for kind, axes, nbytes, phase in loss_read_moves(
                              tensors[name], layout, mesh, needs_grad.get(name, False),
                              analysis.rows_dim(name))]
        for name, layout in zip(node.outputs, produced, strict=True):
            if name and layout is not None:
                layout_of[name] = layout
        ops.append(OpSharding(node, labels, rule is not None, strategy, wanted, produced,
                              fraction, tuple(specs)))
    gradient_axes = {name: tuple(a for a in mesh.axis_names if a in deferred_axes[name])
                     for name in sorted(deferred_axes)}
    shares: dict[tuple[str, int], float] = {}
    found_shares: dict[tuple, float | None] = {}
    for node, index, name, roots, stored, want, partial in weight_reads:
        key = (tuple(gradient_axes.get(root, ()) for root in roots), stored, want, partial)
        if key not in found_shares:  # every layer's weights alike: found once
            found_shares[key] = read_gradient_share(roots, gradient_axes, stored, want,
                                                    partial, mesh)
        share = found_shares[key]
        if share is None:
            shown = ", ".join(sorted(roots)[:3])
            raise StrategyError(
                f"op {node.name} reads {name}, computed from the weights {shown}, whole on "
                "every device of an axis one of those weights sums its gradient over and "
                "another does not, so no share of its gradient is right for both; pin "
                f"{node.name} to split that axis, or the weights' other readers alike")
        if share != 1.0:
            shares[(node.name, index)] = share
    gradients = tuple(
        CollectiveSpec(CollectiveKind.ALL_REDUCE, name, axes,
                       tensors[name].nbytes * fraction_of_layout(layout_of[name], mesh),
                       Phase.GRADIENT, OPTIMIZER_OP)
        for name, axes in gradient_axes.items())
    return ShardedGraph(analysis, mesh, training, tuple(ops), layout_of, gradient_axes,
                        gradients, shares)


def passes_weights_on(node: OpNode, weight_roots: Mapping[str, frozenset[str]]) -> bool:
    """Whether `node` computes weight-derived tensors only (a tied head's Transpose): its
    reads of weights hand back what its outputs' readers send, not gradients of their own."""
    return all(out in weight_roots for out in node.outputs if out)


def read_gradient_share(roots: frozenset[str], gradient_axes: Mapping[str, tuple[str, ...]],
                        stored: Layout, wanted: Layout, partial_axes: tuple[str, ...],
                        mesh: DeviceMesh) -> float | None:
    """The share of its gradient an op's read of a weight-derived tensor hands back.

    The gradients of a weight's reads are summed once at the weight, over the axes in
    `gradient_axes` (`edge_steps`): right for a read whose gradient is partial along such
    an axis, or the zero-padded gradient of a slice, but a read whole on every device of
    the axis (stored and read replicated there, no partial sum) computes the same whole
    gradient on each, and the sum would count it once per device: such a read hands back
    1/n of it (the plan's collectives stay as they are). None where the weights the
    tensor is computed from would need different shares. Reads by ops that only pass the
    weights on (`passes_weights_on`) hand back 1: their readers' reads are the ones
    counted."""
    shares: set[int] = set()
    for root in roots:
        devices = 1
        for axis in gradient_axes.get(root, ()):
            if axis not in stored.used_axes and axis not in wanted.used_axes \
                    and axis not in partial_axes:
                devices *= mesh.axis_size(axis)
        shares.add(devices)
    if len(shares) > 1:
        return None
    return 1.0 / shares.pop() if shares else 1.0


def shared_read_key(info: TensorInfo, src: Layout, dst: Layout,
                    partial_axes: tuple[str, ...], region: int, mesh: DeviceMesh,
                    requires_grad: bool, weight_derived: bool) -> tuple | None:
    """The key under which reading `info` (stored in `src`) in `dst` shares its move with
    the other reads of the same key, or None when it moves and reduces nothing.

    A framework moves a tensor once for all the ops that read it alike: torchtitan's
    PrepareModuleInput all-gathers a norm's sequence-split output once for the q, k and v
    projections, and autograd sums the three partial input gradients before the one
    reduce-scatter (or, without sequence parallelism, the one all-reduce of Megatron-LM's
    `f` operator). So reads of one tensor in one layout that leave the same pending sum
    share one forward move and one backward reduction: the first read issues them. Within
    one recompute region only (`GraphAnalysis.recompute_regions`: a unit, split at the
    attention cores), so a recomputed region re-runs the moves its reads use and a stage
    boundary never falls between the reads of one move. A weight's reads are not shared:
    their partial sums are deferred to the weight (`edge_steps`).
    """
    if weight_derived:
        return None
    grad = requires_grad and info.is_float
    if not (grad and partial_axes) and (src is dst or equivalent(src, dst, mesh)):
        return None
    return (info.name, dst, tuple(partial_axes) if grad else (), region)


def edge_steps(info: TensorInfo, src: Layout, dst: Layout, consumer: str, mesh: DeviceMesh,
               requires_grad: bool, partial_axes: tuple[str, ...],
               weight_derived: bool) -> tuple[list[CollectiveSpec], set[str]]:
    """The collectives of reading `info` in layout `dst` when it is stored in `src`, and
    the gradient axes deferred to its weights.

    A weight-derived tensor (a parameter, or computed from parameters alone) is the same
    on every device, so its gradient need not be reduced here: a partial gradient, or the
    zero-padded gradient of a local slice, is summed once at the parameter instead.
    """
    moves, deferred = _edge_moves(info.shape, info.itemsize, src, dst, mesh, requires_grad,
                                  tuple(partial_axes), weight_derived)
    return ([CollectiveSpec(kind, info.name, axes, nbytes, phase, consumer)
             for kind, axes, nbytes, phase in moves], set(deferred))


def loss_read_moves(info: TensorInfo, layout: Layout, mesh: DeviceMesh, requires_grad: bool,
                    rows: int = 0
                    ) -> tuple[tuple[CollectiveKind, tuple[str, ...], int, Phase], ...]:
    """The moves of a graph output written in `layout` into the layout a loss reading
    whole rows (along dim `rows`) reads (`outputs.loss_layout`): a gather in the forward
    pass, whose backward is this rank's slice of the gradient."""
    wanted = loss_layout(layout, rows)
    if wanted == layout:
        return ()
    return _edge_moves(info.shape, info.itemsize, layout, wanted, mesh, requires_grad, (),
                       False)[0]


@lru_cache(maxsize=1 << 16)
def _edge_moves(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout,
                mesh: DeviceMesh, requires_grad: bool, partial_axes: tuple[str, ...],
                weight_derived: bool
                ) -> tuple[tuple[tuple[CollectiveKind, tuple[str, ...], int, Phase], ...],
                           frozenset[str]]:
    """`edge_steps` without the names: the same for every layer's read of its tensor."""
    forward = redistribute(src, dst, shape, itemsize, mesh)
    result = [(CollectiveKind(s.kind), tuple(s.axes), s.nbytes, Phase.FORWARD)
              for s in forward if s.communicates]
    if not requires_grad:
        return tuple(result), frozenset()
    deferred: set[str] = set()
    if weight_derived:
        # A sum over an axis the stored layout splits cannot wait for the parameter: its
        # devices hold different slices there. The gather's backward reduces it (a
        # reduce-scatter, as DTensor's all-gather backward does); the rest is deferred.
        stored = set(src.used_axes)
        kept = tuple(a for a in partial_axes if a in stored)
        deferred = {a for a in partial_axes if a not in stored} | {
            a for s in forward if s.kind == Move.SLICE for a in s.axes}
        forward = [s for s in forward if s.kind != Move.SLICE]
        partial_axes = kept
    src_bytes = int(math.prod(shape) * itemsize * fraction_of_layout(src, mesh))
    steps = backward_steps(forward, partial_axes, src_bytes)
    result += [(CollectiveKind(s.kind), tuple(s.axes), s.nbytes, Phase.BACKWARD)
               for s in steps if s.communicates]
    return tuple(result), frozenset(deferred)


def fraction_of_layout(layout: Layout, mesh: DeviceMesh) -> float:
    """Share of a tensor one device holds."""
    share = 1.0
    for factor in layout.split_factors(mesh):
        share /= factor
    return share
