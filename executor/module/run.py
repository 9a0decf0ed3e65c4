"""Run a traced graph on DTensors with the plan's layouts at every op.

Each call node's inputs are moved (`DTensor.redistribute`) to the layouts the plan binds
them in before the op runs, so the collectives are the plan's, issued where the plan
issues them; DTensor then runs the op on the local shards. Where DTensor's result has
another layout than the plan says, the result is moved to the plan's and the move is
counted as unplanned (`Unplanned`), so a difference is reported, never silent.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from executor.dropout import DropoutSite
from executor.module import attention, masks
from executor.module.constants import constant_nodes
from executor.module.counting import recomputing
from executor.module.kernels import Shift, attention_math, dropout, run_op
from executor.module.layouts import ModuleLayouts
from executor.module.local import LocalPlan, is_guard, is_size
from executor.module.moves import changed_axis, cut_elsewhere, redistribute, tensor_dim
from executor.module.positions import symbolic_dim
from executor.module.regions import Region, regions_of
from executor.module.weights import WeightSync, in_backward
from planner.errors import ShardplanError
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
    serves them all. Where the read gathered the value from a split on a reduced axis, the
    pending sum there is left to the gather's own backward, which sums and splits it in one
    reduce-scatter, as the plan prices an all-gather's backward (summed here, it took an
    all-reduce and a local cut)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: TorchMesh, wanted: tuple[Placement, ...],
                reduced: tuple[int, ...], source: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.wanted, ctx.reduced, ctx.source = mesh, wanted, reduced, source
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None, None]:
        if isinstance(grad, DTensor):
            target = tuple(
                have if isinstance(have, Partial) and (
                    dim not in ctx.reduced or (isinstance(ctx.source[dim], Shard)
                                               and isinstance(want, Replicate))) else want
                for dim, (have, want) in enumerate(zip(grad.placements, ctx.wanted,
                                                       strict=True)))
            if not _normalised(grad, target):
                grad = redistribute(grad, ctx.mesh, target)
        return grad, None, None, None, None


class _GradientShare(torch.autograd.Function):
    """Identity forward; in backward this read's share of the gradient (`NodeLayouts.
    shares`: a whole read of a weight whose gradient the plan sums over devices that each
    compute all of it). A DTensor gradient arriving whole there becomes the pending sum of
    the shares, which the plan's weight collective makes (as `_ToPartial`'s does)."""

    @staticmethod
    def forward(ctx: Any, value: Any, share: float, dims: tuple[int, ...]) -> Any:
        ctx.share, ctx.dims = share, dims
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        if not isinstance(grad, DTensor):
            return grad * ctx.share, None, None
        whole = [dim for dim in ctx.dims if isinstance(grad.placements[dim], Replicate)]
        if not math.isclose(math.prod(grad.device_mesh.size(d) for d in whole) * ctx.share,
                            1.0):
            raise ShardplanError(f"a weight's gradient arrived whole on {whole} mesh dims of "
                                 f"{grad.placements}, not on the devices its share "
                                 f"{ctx.share:g} is of; plan again")
        done = [Partial() if dim in whole else p for dim, p in enumerate(grad.placements)]
        return DTensor.from_local(grad.to_local() * ctx.share, grad.device_mesh, done,
                                  shape=grad.shape, stride=grad.stride(),
                                  run_check=False), None, None


class _FromLocal(torch.autograd.Function):
    """A local value as the DTensor it is a block of (`DTensor.from_local`, no
    communication), whose gradient comes back as this rank's share where DTensor leaves
    it a pending sum: the reads (`_GradientIn`) already summed what the plan sums there,
    so a sum still pending is the plan's to make later, at the weight the value comes
    from (`from_local`'s own backward would all-reduce it into the value's placements, a
    collective the plan does not list, and the plan's own reduction would then sum it
    again). Only for a value no local op reads: a local reader's gradient is whole."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: TorchMesh,
                placements: tuple[Placement, ...]) -> DTensor:
        ctx.mesh, ctx.placements = mesh, placements
        return DTensor.from_local(local.view_as(local), mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None, None]:
        if not isinstance(grad, DTensor):
            return grad, None, None
        target = tuple(have if isinstance(have, Partial) else want
                       for have, want in zip(grad.placements, ctx.placements, strict=True))
        if not _normalised(grad, target):
            grad = redistribute(grad, ctx.mesh, target)
        return grad._local_tensor, None, None


class _Split(torch.autograd.Function):
    """A replicated value cut to this rank's block along one dim (no communication), its
    gradient a pending sum (this rank's block, zeros elsewhere) as the plan prices it:
    DTensor's own move would all-gather the gradient back in the backward pass, a
    collective the plan does not list (the sum is made later, at the weight)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: TorchMesh, wanted: tuple[Placement, ...],
                axis: int) -> DTensor:
        ctx.mesh, ctx.axis, ctx.placements = mesh, axis, value.placements
        ctx.local_shape, ctx.shape, ctx.stride = value._local_tensor.shape, value.shape, \
            value.stride()
        return value.redistribute(mesh, wanted)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        split = grad.placements[ctx.axis]
        assert isinstance(split, Shard)
        dim = split.dim if split.dim >= 0 else split.dim + grad.ndim
        local = grad.to_local()
        whole = local.new_zeros(ctx.local_shape)
        block = local.shape[dim]
        start = ctx.mesh.get_local_rank(ctx.axis) * block
        whole.narrow(dim, start, block).copy_(local)
        done = list(grad.placements)
        done[ctx.axis] = Partial()
        return DTensor.from_local(whole, ctx.mesh, done, shape=ctx.shape, stride=ctx.stride,
                                  run_check=False), None, None, None


class _ToPartial(torch.autograd.Function):
    """A replicated value read as a pending sum over some mesh dims (each rank holds a
    share; no communication), its gradient left a pending sum there too, as the plan
    prices it: the sum is made later, at the weight the value comes from (a bias a
    row-split GEMM adds before its partial output is reduced). DTensor's own move turns
    the gradient back into a replicated one, so the weight would arrive already summed,
    and the plan's reduction of it would have nothing to reduce."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: TorchMesh, wanted: tuple[Placement, ...],
                axes: tuple[int, ...]) -> DTensor:
        ctx.axes, ctx.shares = axes, math.prod(mesh.size(a) for a in axes)
        # each rank holds value / shares (DTensor keeps moves into a pending sum to itself)
        return DTensor.from_local(value.to_local() / ctx.shares, mesh, wanted,
                                  shape=value.shape, stride=value.stride(), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        # d(value / shares) on each rank: a replicated gradient g becomes the pending sum
        # of g / shares; a pending one already is the sum of its ranks' pieces
        replicated = [a for a in ctx.axes if isinstance(grad.placements[a], Replicate)]
        local = grad.to_local()
        if replicated:
            local = local / math.prod(grad.device_mesh.size(a) for a in replicated)
        done = [Partial() if a in ctx.axes else p for a, p in enumerate(grad.placements)]
        return DTensor.from_local(local, grad.device_mesh, done, shape=grad.shape,
                                  stride=grad.stride(), run_check=False), None, None, None


class _AvgAsSum(torch.autograd.Function):
    """A pending mean over some mesh dims (DTensor's `Partial("avg")`: a mean over split
    rows, each rank its rows' mean) as the pending sum the plan lists there (each rank
    its mean over the ranks, `local / ranks`): the same value, no communication, so its
    gradient passes as it is. DTensor refuses to redistribute one into the other."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, placements: tuple[Placement, ...],
                ranks: int) -> DTensor:
        return DTensor.from_local(value.to_local() / ranks, value.device_mesh, placements,
                                  shape=value.shape, stride=value.stride(), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None]:
        return grad, None, None


def as_pending_sum(value: DTensor, wanted: Sequence[Placement]) -> DTensor:
    """`value` with each pending mean on a mesh dim where `wanted` has a pending sum made
    that sum (`_AvgAsSum`); `value` itself where there is none."""
    dims = [d for d, (have, want) in enumerate(zip(value.placements, wanted, strict=True))
            if isinstance(have, Partial) and have.reduce_op == "avg"
            and isinstance(want, Partial) and want.reduce_op == "sum"]
    if not dims:
        return value
    placements = tuple(Partial() if d in dims else p for d, p in enumerate(value.placements))
    ranks = math.prod(value.device_mesh.size(d) for d in dims)
    summed: DTensor = _AvgAsSum.apply(value, placements, ranks)
    return summed


def _partial_axes(value: DTensor, wanted: Sequence[Placement]) -> tuple[int, ...]:
    """The mesh dims on which `wanted` reads a replicated `value` as a pending sum, where
    it changes nothing else; empty otherwise."""
    changed = [a for a, (have, want) in enumerate(zip(value.placements, wanted, strict=True))
               if have != want]
    if changed and all(isinstance(value.placements[a], Replicate)
                       and isinstance(wanted[a], Partial) for a in changed):
        return tuple(changed)
    return ()


#: the argument holding the bias of the GEMMs that add one, and each one's GEMM alone
_BIAS_SLOT: dict[object, int] = {torch.ops.aten.addmm.default: 0,
                                 torch.ops.aten.baddbmm.default: 0,
                                 torch.ops.aten.linear.default: 2}
_UNBIASED: dict[object, object] = {torch.ops.aten.addmm.default: torch.ops.aten.mm.default,
                                   torch.ops.aten.baddbmm.default: torch.ops.aten.bmm.default,
                                   torch.ops.aten.linear.default: torch.ops.aten.linear.default}


def _split_axis(value: DTensor, wanted: Sequence[Placement]) -> int | None:
    """The one mesh dim along which `wanted` only cuts a replicated `value` (no other
    mesh dim changing or cutting that tensor dim), else None."""
    axis = changed_axis(value, wanted)
    if axis is None:
        return None
    want = wanted[axis]
    if not (isinstance(value.placements[axis], Replicate) and isinstance(want, Shard)):
        return None
    return None if cut_elsewhere(wanted, axis, {tensor_dim(want, value.ndim)},
                                 value.ndim) else axis


def output_gradients(loss: torch.Tensor, outputs: Any
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
    """The loss's own backward pass: its gradient with respect to each output of the model
    it reads. Taken apart from the model's backward pass so that the collectives the loss
    function's DTensor ops issue (a mean's count summed over the batch's ranks) count as
    the loss's, not as the model's, which the plan prices. None for a plain loss, which
    issues none: it back-propagates from itself (a gradient as large as the output is
    then not held through the backward pass)."""
    if not isinstance(loss, DTensor):
        return None
    leaves = [v for v in pytree.tree_leaves(outputs)
              if isinstance(v, torch.Tensor) and v.requires_grad]
    if not loss.requires_grad or not leaves:
        raise ShardplanError("the loss does not depend on the model's output: loss_fn "
                             "must compute it from the output it is given")
    leaves = loss_reads(loss, leaves)
    # a plain tensor the loss kept (BCE's pos_weight, cross-entropy's class weights) is
    # the same on every rank, in its backward pass too ("aten.nll_loss_backward.default
    # got mixed torch.Tensor and DTensor")
    with implicit_replication():
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple((v, g) for v, g in zip(leaves, grads, strict=True) if g is not None)


def loss_reads(loss: torch.Tensor, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs the loss reads itself, not through another output: a model returning
    its own loss beside its logits (`{"loss": ..., "logits": ...}`, a transformers model
    given `labels`) has a loss output computed from the logits, and the loss's gradient
    taken with respect to both, then back-propagated from both, went through the first
    one's graph twice (the rank failed: "Trying to backward through the graph a second
    time") and counted the logits' gradient twice. A walk of the loss's own autograd
    graph, from the loss to the first outputs on each path. A tensor needing a gradient
    that the loss reads outside the outputs (a module weight in a weight penalty) is
    refused: under a plan the module's parameters are DTensors or this rank's ZeRO
    chunks, and the loss's gradient is taken with respect to the outputs alone."""
    wanted = {(v.grad_fn, v.output_nr): v for v in outputs if v.grad_fn is not None}
    found: dict[int, torch.Tensor] = {}
    root = loss.grad_fn
    if root is None or (root, loss.output_nr) in wanted:  # the loss is an output
        return [v for v in outputs if v is loss or (
            v.grad_fn is root and v.output_nr == loss.output_nr)]
    stack, seen = [root], {id(root)}
    while stack:
        node = stack.pop()
        for fn, number in node.next_functions:
            if fn is None:
                continue
            output = wanted.get((fn, number))
            if output is not None:
                found[id(output)] = output
                continue
            variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None:
                if not any(variable is v for v in outputs):
                    shape = tuple(variable.shape)
                    raise ShardplanError(
                        f"loss_fn reads a tensor of shape {shape} that needs a gradient and "
                        "is not the model's output (a module weight, in a weight penalty): "
                        "under a plan the module's parameters are split or sharded; "
                        "return the term from forward, or use the optimizer's weight_decay")
                found[id(variable)] = variable
                continue
            if id(fn) not in seen:
                seen.add(id(fn))
                stack.append(fn)
    return [v for v in outputs if id(v) in found]


@dataclass(frozen=True)
class LossShare:
    """A step's loss as this rank holds it before its sum over the batch's ranks: the
    rank's mean over the micro-batches, and the sums still to take, one per mesh dim the
    loss is pending over (`(mesh, dim, reduce op)`, the loss DTensor's `Partial`s). Many
    steps' shares reduce in one collective per dim (`reduced_losses`)."""

    local: torch.Tensor
    reductions: tuple[tuple[TorchMesh, int, str], ...]


def loss_share(values: Sequence[torch.Tensor]) -> LossShare | torch.Tensor:
    """The mean of a step's micro-batch losses (detached): as a `LossShare` where they are
    DTensors of one placement with a reduction pending over the batch's ranks (a mean over
    sharded rows is `Partial`), their local values averaged over the micro-batches first;
    else the mean itself (a plain tensor, nothing pending)."""
    first = values[0]
    if not isinstance(first, DTensor):
        return torch.stack([v.detach() for v in values]).mean()
    placements = first.placements
    parts = [v for v in values if isinstance(v, DTensor) and v.placements == placements]
    if len(parts) != len(values):
        return torch.stack([v.full_tensor().detach() if isinstance(v, DTensor) else v.detach()
                            for v in values]).mean()
    mean = torch.stack([v._local_tensor.detach() for v in parts]).mean()
    return LossShare(mean, tuple((first.device_mesh, dim, placement.reduce_op)
                                 for dim, placement in enumerate(placements)
                                 if isinstance(placement, Partial)))


def step_loss(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean of a step's micro-batch losses (detached), its sum over the batch's ranks
    (`loss_share`) taken in one collective at the end of the step, not one per micro-batch
    (waiting mid-step made every rank wait for the slowest there). The reduction is issued
    without waiting (an `AsyncCollectiveTensor`, waited for when read), so that reporting
    the loss does not hold the step up while the optimizer steps: the caller settles it
    after that (`settled`), so that no more than one is ever in flight (unwaited, they
    piled up one per step and were still pending when the process group was torn down)."""
    share = loss_share(values)
    return _summed(share.local, share.reductions) if isinstance(share, LossShare) else share


def _summed(local: torch.Tensor, reductions: tuple[tuple[TorchMesh, int, str], ...]
            ) -> torch.Tensor:
    """`local` with a share's pending sums taken, issued without waiting: a functional
    collective per pending mesh dim (a tenth of the host time of DTensor's redistribute,
    0.5 ms a step on CPU)."""
    for mesh, dim, op in reductions:
        local = funcol.all_reduce(local, op, (mesh, dim))
    return local


def reduced_losses(shares: Sequence[LossShare | torch.Tensor]) -> list[float]:
    """Many steps' losses as floats, the shares' sums taken together: one collective per
    pending mesh dim for all the steps pending alike (a run that reports every step's loss
    need not sum each step's on its own: on 2 CPU ranks that cost 0.3 ms a step, the
    optimizer step racing the reduction's gloo thread). Every rank passes the same steps,
    so every rank issues the same collectives in the same order."""
    values: list[float] = [math.nan] * len(shares)
    alike: dict[tuple[tuple[TorchMesh, int, str], ...], list[tuple[int, LossShare]]] = {}
    for k, share in enumerate(shares):
        if isinstance(share, LossShare):
            alike.setdefault(share.reductions, []).append((k, share))
        else:
            values[k] = float(share)
    for reductions, steps in alike.items():
        waited = settled(_summed(torch.stack([share.local for _, share in steps]),
                                 reductions))
        assert waited is not None
        for (k, _), value in zip(steps, waited.tolist(), strict=True):
            values[k] = float(value)
    return values


def settled(loss: torch.Tensor | None) -> torch.Tensor | None:
    """`loss` (from `step_loss`) with its reduction waited for: a plain tensor."""
    if isinstance(loss, AsyncCollectiveTensor):
        return loss.wait()
    return loss


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def replicated(value: Any, mesh: TorchMesh) -> Any:
    """A plain tensor (the same on every rank) as a replicated DTensor on `mesh`; any
    other value as it is."""
    if not _plain(value):
        return value
    return DTensor.from_local(value.to(mesh.device_type), mesh, [Replicate()] * mesh.ndim,
                              run_check=False)


_FACTS = "shardplan.graph_facts"
_PLACES = "shardplan.node_places"  # node name -> its place in the export (`node_places`)


def node_places(graph: GraphModule) -> dict[str, int]:
    """Each node's place in the graph as first asked (the export's order): the number of
    its dropout draws (`DropoutSite`). Kept in the graph's meta, so that a rewrite of the
    trace (`executor.module.grouped`, which asks first) moves no draw: a split run draws
    the masks the unsplit reference draws."""
    places = graph.meta.get(_PLACES)
    if places is None:
        places = graph.meta[_PLACES] = {n.name: k for k, n in enumerate(graph.graph.nodes)}
    return places


def _graph_facts(graph: GraphModule
                 ) -> tuple[dict[Node, list[Node]], dict[str, int], dict[str, torch.nn.Module]]:
    """For each node, the values whose last reader it is (`Interpreter.user_to_last_uses`),
    each node's place in the graph, and the graph module's submodules: derived once, kept
    in the graph's meta (a traced graph's nodes and modules do not change after
    `parallelize` placed it)."""
    facts = graph.meta.get(_FACTS)
    if facts is None:
        nodes = list(graph.graph.nodes)
        facts = ({user: list(values) for user, values in
                  last_uses(nodes, frozenset()).items()},
                 node_places(graph), dict(graph.named_modules()))
        graph.meta[_FACTS] = facts
    return facts


class TracedRun(Interpreter):
    """One forward of the traced graph as torch runs it, but for dropout, whose masks are
    drawn by `executor.dropout` (draw `step` of `seed`, each dropout its own op number),
    and attention with dropout, which runs as its definition so that dropout can apply."""

    def __init__(self, graph: GraphModule, seed: int, step: int) -> None:
        # One run per forward (and micro-batch): `Interpreter.__init__`'s fields, set as
        # it sets them, from what is derived once per graph (it walks every submodule
        # and every node on each construction).
        self.module = graph
        self.graph = graph.graph
        self.env: dict[Node, Any] = {}
        self.name = "Interpreter"
        self.garbage_collect_values = True
        self.extra_traceback = True
        self.user_to_last_uses, self.index, self.submodules = _graph_facts(graph)
        self.seed, self.step = seed, step

    def call(self, n: Node, args: Any, kwargs: Any) -> Any:
        assert callable(n.target)
        if n.target is _DROPOUT and len(args) > 2 and args[2] and args[1] > 0:
            return dropout(args[0], float(args[1]), self._site(n), self._shift(n))
        if n.target is _SDPA:
            args, kwargs = masks.resolved(n, args, kwargs)
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p or self._fused_unavailable(args):
                site, shift = self._site(n), self._shift(n)
                return attention_math(*args, **kwargs,
                                      drop=lambda t: dropout(t, float(p), site, shift)[0])
        return run_op(n.target, args, kwargs)

    def _site(self, n: Node) -> DropoutSite:
        return DropoutSite(self.seed, self.step, self.index[n.name], ())

    def _shift(self, n: Node) -> Shift | None:
        return None  # one pass over the whole batch

    def _fused_unavailable(self, args: Any) -> bool:
        """DTensor has no rule for the CPU fused attention kernel."""
        return isinstance(args[0], DTensor) and args[0].device_mesh.device_type == "cpu"

    def run_node(self, n: Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return self.call(n, args, kwargs)


def _batch_dim(node: Node) -> int | None:
    """The first dim of a traced value whose size is symbolic (the batch's, or a product
    with it: the export makes only the batch dim symbolic); None when none is (such a
    tensor is the same in every micro-batch)."""
    value = node.meta.get("val")
    for dim, size in enumerate(getattr(value, "shape", ())):
        if isinstance(size, torch.SymInt):
            return dim
    return None


def run_unsplit(graph: GraphModule, flat_inputs: Sequence[torch.Tensor], seed: int,
                step: int) -> Any:
    """The traced graph's flat outputs, on one device (what a split run must equal)."""
    return TracedRun(graph, seed, step).run(*flat_inputs)


@dataclass
class RunRecord:
    """What planned runs did that the plan does not say: DTensor results in another
    layout than the plan's, moved to it ("node: from -> to" -> times; empty when the run
    is exactly the plan), and the recompute segments re-run in backward passes."""

    unplanned: Counter = field(default_factory=Counter)
    recomputed: int = 0


@dataclass(frozen=True)
class Step:
    """One step of a run of nodes (`ModulePlan.program`): the nodes from `start` on,
    `span` of them, as a recompute segment (`segment`), a compiled region or one node;
    the weights whose last reader it holds (`freed`) and the values no later node
    reads (`dead`)."""

    start: int
    span: int
    segment: bool
    freed: tuple[str, ...]
    dead: tuple[Node, ...]


@dataclass
class ModulePlan:
    """What a planned run reads, derived once from the plan and the trace: the layouts,
    the weights as the plan synchronises them, which `get_attr` reads which weight, the
    recompute segments, and after which node the forward is done with which weights."""

    layouts: ModuleLayouts
    mesh: DeviceMesh
    weights: WeightSync
    reads: Mapping[str, str]  # get_attr target -> the plan's name of the weight
    spans: Mapping[str, int]  # first node of a recompute segment -> its length in nodes
    release: Mapping[str, tuple[str, ...]]  # node -> weights it is the last reader of
    local: LocalPlan  # the ops that run on local tensors (`executor.module.local`)
    batch_index: int  # this rank's block of the batch
    #: inputs (placeholders) that only local ops read (and sizes, and the export's
    #: guards): given as the batch's plain tensors, whose rows each local read takes
    #: (`PlannedRun._as_local`), not as DTensors made and taken apart again
    local_inputs: frozenset[str] = frozenset()
    #: nodes whose values are the same at every step (`executor.module.constants`):
    #: computed once per shape of the step's inputs, then reused
    constants: frozenset[Node] = frozenset()
    _folded: dict[tuple[Any, ...], dict[Node, tuple[Any, bool]]] = field(
        default_factory=dict)
    _placements: dict[tuple[str, Layout], tuple[Placement, ...]] = field(
        default_factory=dict)
    _regions: dict[tuple[Any, ...], Mapping[int, Region]] = field(default_factory=dict)
    _programs: dict[tuple[Any, ...], tuple[Any, Any, tuple[Step, ...]]] = field(
        default_factory=dict)

    @classmethod
    def of(cls, graph: GraphModule, layouts: ModuleLayouts, mesh: DeviceMesh,
           weights: WeightSync, reads: Mapping[str, str], rank: int,
           found: LocalPlan) -> ModulePlan:
        """`found`: the ops that run on local tensors (`LocalPlan.none()` runs every op
        on DTensors, the path the local ops are checked against)."""
        nodes = list(graph.graph.nodes)
        place = {n.name: k for k, n in enumerate(nodes)}
        spans = {seg[0]: place[seg[-1]] - place[seg[0]] + 1 for seg in layouts.recompute}
        last: dict[str, int] = {}  # a tied weight is read under each of its names
        for node in nodes:
            if node.op == "get_attr" and str(node.target) in reads:
                name = reads[str(node.target)]
                last[name] = max(last.get(name, 0),
                                 *(place[u.name] for u in _storage_readers(node)))
        release: dict[str, list[str]] = {}
        for name, index in last.items():
            release.setdefault(nodes[index].name, []).append(name)
        coord = dict(zip(mesh.axis_names, np.unravel_index(rank, mesh.shape), strict=True))
        index = 0
        for axis in found.batch_axes:
            index = index * mesh.axis_size(axis) + int(coord[axis])
        local_inputs = frozenset(
            n.name for n in nodes if n.op == "placeholder" and found.nodes and all(
                u.name in found.nodes or is_size(u) or is_guard(u) for u in n.users))
        return cls(layouts, mesh, weights, reads, spans,
                   {k: tuple(v) for k, v in release.items()}, found, index, local_inputs,
                   # sizes stay with the run: it keeps each one's global and local value
                   frozenset(n for n in constant_nodes(nodes, reads) if not is_size(n)))

    def regions(self, nodes: Sequence[Node], spans: Mapping[str, int],
                keep: frozenset[Node]) -> Mapping[int, Region]:
        """The compiled local regions of a run of `nodes` (`executor.module.regions`),
        cut where its recompute segments (`spans`) start and end; derived once per run."""
        key = (nodes[0] if nodes else None, len(nodes), keep)
        if key not in self._regions:
            cuts: set[int] = set()
            for k, node in enumerate(nodes):
                if node.name in spans:
                    cuts.update((k, k + spans[node.name]))
            compiled = frozenset(self.local.nodes) - {n.name for n in self.constants}
            self._regions[key] = regions_of(nodes, compiled, cuts, keep)
        return self._regions[key]

    def program(self, nodes: Sequence[Node], spans: Mapping[str, int],
                keep: frozenset[Node], dies: Mapping[Node, Sequence[Node]]
                ) -> tuple[Step, ...]:
        """A run of `nodes` as its steps: each recompute segment, compiled region or
        single node with the weights and values done once it ran (`release`, `dies`),
        gathered once per run so the forward does not revisit every node of a region."""
        key = (nodes[0] if nodes else None, len(nodes), keep, id(spans), id(dies))
        found = self._programs.get(key)
        if found is not None and found[0] is spans and found[1] is dies:
            return found[2]
        regions = self.regions(nodes, spans, keep)
        steps: list[Step] = []
        k = 0
        while k < len(nodes):
            span = spans.get(nodes[k].name)
            segment = span is not None
            if span is None:
                region = regions.get(k)
                span = 1 if region is None else len(region.nodes)
            done = nodes[k:k + span]
            freed = tuple(name for n in done for name in self.release.get(n.name, ()))
            dead = tuple(d for n in done for d in dies.get(n, ()))
            steps.append(Step(k, span, segment, freed, dead))
            k += span
        program = tuple(steps)
        self._programs[key] = (spans, dies, program)
        return program

    def folded(self, shapes: tuple[Any, ...]) -> dict[Node, tuple[Any, bool]]:
        """The constant nodes' values (and whether each is a local block) computed at the
        step inputs' `shapes` so far."""
        return self._folded.setdefault(shapes, {})

    def placements(self, name: str, layout: Layout) -> tuple[Placement, ...]:
        key = (name, layout)
        if key not in self._placements:
            self._placements[key] = placements(layout, self.mesh, f"tensor {name}")
        return self._placements[key]


def last_uses(nodes: Sequence[Node], keep: frozenset[Node]) -> dict[Node, tuple[Node, ...]]:
    """Node -> the values (but those in `keep`) whose last reader in `nodes` it is: what a
    run of `nodes` drops after it (`Interpreter.user_to_last_uses` for a part of a
    graph)."""
    last: dict[Node, Node] = {}
    for node in nodes:
        for value in node.all_input_nodes:
            last[value] = node
    dies: dict[Node, list[Node]] = {}
    for value, user in last.items():
        if value not in keep:
            dies.setdefault(user, []).append(value)
    return {user: tuple(values) for user, values in dies.items()}


def place_inputs(values: Sequence[torch.Tensor], names: Sequence[str], mesh: TorchMesh,
                 wanted: Mapping[str, tuple[Placement, ...]],
                 plain: Collection[str] = ()) -> list[torch.Tensor]:
    """The batch's tensors (the same on every rank) as DTensors in the plan's input
    placements: each rank keeps its block, nothing is sent. Those named in `plain` (read
    by local ops only: `ModulePlan.local_inputs`) stay the plain tensors they are."""
    return [value.to(mesh.device_type) if name in plain else
            distribute_tensor(value.to(mesh.device_type), mesh, wanted[name],
                              src_data_rank=None)
            for name, value in zip(names, values, strict=True)]


def _storage_readers(node: Node) -> set[Node]:
    """The nodes that read `node`'s storage: its users, and the users of every view of
    it (a view shares the storage), transitively; `node` itself when unused."""
    readers, views, seen = {node}, [node], {node}
    while views:
        for user in views.pop().users:
            readers.add(user)
            if getattr(user.target, "is_view", False) and user not in seen:
                seen.add(user)
                views.append(user)
    return readers


class PlannedRun(TracedRun):
    """One forward of the traced graph with the plan's layouts (module docstring): the
    weights read through the plan's weight synchronisation (`executor.module.weights`),
    the plan's recompute segments run under activation checkpointing."""

    def __init__(self, graph: GraphModule, plan: ModulePlan, mesh: TorchMesh,
                 record: RunRecord, seed: int, step: int, micro: int = 0,
                 rows_out: bool = False) -> None:
        super().__init__(graph, seed, step)
        self.plan, self.mesh, self.record = plan, mesh, record
        self.layouts, self.plan_mesh = plan.layouts, plan.mesh
        self.micro = micro  # this micro-batch's place in the step
        #: return outputs that are this rank's rows (local values split along dim 0 over
        #: the batch axes only) as those rows, for a loss computed on them
        #: (`executor.module.rowloss.RowLoss.on_rows`); else as DTensors
        self.rows_out = rows_out
        self.frame = _Frame()
        self._keep: frozenset[Node] = frozenset()
        #: the constant nodes' values at this run's input shapes (`fold_at`; None: each
        #: computed again)
        self._folded: dict[Node, tuple[Any, bool]] | None = None

    def _wanted(self, name: str, layout: Layout) -> tuple[Placement, ...]:
        return self.plan.placements(name, layout)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        name = self.plan.reads.get(str(target))
        return self.plan.weights.read(name) if name is not None else super().get_attr(
            target, args, kwargs)

    def _shift(self, n: Node) -> Shift | None:
        """A micro-batch's rows start `micro` micro-batches into the step's batch, along
        the dim of the dropped tensor that scales with the batch (dim 0 for attention)."""
        if not self.micro:
            return None
        if n.target is not _DROPOUT:
            return Shift(0, self.micro)  # attention: [batch, heads, rows, columns]
        source = n.args[0]
        dim = _batch_dim(source) if isinstance(source, Node) else None
        return Shift(dim, self.micro) if dim is not None else None

    def run(self, *args: Any, initial_env: Any = None, enable_io_processing: bool = True
            ) -> Any:
        """`Interpreter.run`, but a recompute segment runs as one checkpointed call, and
        the constant nodes' values are those of the first run at the inputs' shapes."""
        self.fold_at(tuple(tuple(getattr(a, "shape", ())) for a in args))
        self.args_iter = iter(self.graph.process_inputs(*args))
        try:
            env = self.run_nodes(list(self.graph.nodes), {}, frozenset(), self.plan.spans,
                                 self.user_to_last_uses)
            return self.graph.process_outputs(env[self.output_node])
        finally:
            self.env, self.frame = {}, _Frame()

    def fold_at(self, key: tuple[Any, ...]) -> None:
        """Reuse the constant nodes' values of earlier runs whose inputs had the shapes
        `key` says (a run of the whole graph, or of one pipeline chunk)."""
        self._folded = self.plan.folded(key)

    @property
    def output_node(self) -> Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def run_nodes(self, nodes: Sequence[Node], env: dict[Node, Any], keep: frozenset[Node],
                  spans: Mapping[str, int], dies: Mapping[Node, Sequence[Node]]
                  ) -> dict[Node, Any]:
        """Run `nodes` from the values in `env` (a pipeline chunk's inputs): the recompute
        segment starting at node `s` (its `spans[s]` nodes of the list) as one
        checkpointed call, the values `dies[n]` dropped once node n ran (`last_uses`),
        those in `keep` (what a chunk sends on) kept out of a segment's recompute. Returns
        the values left, the output node's among them when it ran."""
        self.env = env
        self._keep = keep
        regions = self.plan.regions(nodes, spans, keep)
        for step in self.plan.program(nodes, spans, keep, dies):
            k, span = step.start, step.span
            if step.segment:
                self._checkpointed(nodes[k:k + span], nodes[k + span:])
            else:
                self._run_at(nodes, k, regions)
            if step.freed:
                self.plan.weights.release(step.freed)
            for dead in step.dead:
                self.env.pop(dead, None)
                self.frame.forget(dead)
        return self.env

    def _checkpointed(self, segment: Sequence[Node], after: Sequence[Node]) -> None:
        """Run `segment` under `torch.utils.checkpoint` (non-reentrant): its activations
        are dropped and recomputed in the backward pass, the same dropout masks drawn
        again; collectives the recompute re-issues count as phase "recompute"."""
        inside = set(segment)
        needed = list(dict.fromkeys(a for n in segment for a in n.all_input_nodes
                                    if a not in inside))
        later = {a for n in after for a in n.all_input_nodes} | self._keep
        produced = [n for n in segment if n in later]
        tensors = [a for a in needed if isinstance(self.env[a], torch.Tensor)]
        others = {a: self.env[a] for a in needed if a not in tensors}
        entry = self.frame.part(needed)
        leaving: list[_Frame] = []

        def body(*values: torch.Tensor) -> tuple[Any, ...]:
            outer, frame = self.env, self.frame
            self.env = {**others, **dict(zip(tensors, values, strict=True))}
            self.frame = entry.part(needed)
            again = in_backward()
            self.record.recomputed += again
            try:
                with recomputing(again):
                    self._run_all(segment, frozenset(later))
                if not again:
                    leaving.append(self.frame.part(produced))
                return tuple(self.env[n] for n in produced)
            finally:
                self.env, self.frame = outer, frame

        results = checkpoint(body, *(self.env[a] for a in tensors), use_reentrant=False)
        self.env.update(zip(produced, results, strict=True))
        self.frame.absorb(leaving[0])

    def _run_all(self, nodes: Sequence[Node], keep: frozenset[Node]) -> None:
        """Run `nodes` (a recompute segment's: no segment inside) into the environment,
        their local regions compiled; the values read after them (or `keep`) stay."""
        regions = self.plan.regions(nodes, {}, keep)
        k = 0
        while k < len(nodes):
            k += self._run_at(nodes, k, regions)

    def _run_at(self, nodes: Sequence[Node], k: int, regions: Mapping[int, Region]) -> int:
        """Run the compiled region starting at `nodes[k]` (its inputs as local ops read
        them, its outputs local values: `executor.module.regions`), or else that one node;
        returns how many nodes ran."""
        region = regions.get(k)
        if region is None:
            node = nodes[k]
            if node in self.plan.constants and self._folded is not None:
                found = self._folded.get(node)
                if found is None:
                    found = self._folded[node] = (self.run_node(node),
                                                  node in self.frame.held_local)
                value, local = found
                if local:
                    self.frame.held_local.add(node)
                self.env[node] = value
                return 1
            self.env[node] = self.run_node(node)
            return 1
        results = region.call(*(self._region_input(region, a) for a in region.inputs))
        for node, value in zip(region.outputs, results, strict=True):
            self.env[node] = value
            self.frame.held_local.add(node)
        return len(region.nodes)

    def run_node(self, n: Node) -> Any:
        if n.op == "output":  # the loss sees global values
            # the batch not split (a local value is the whole, as it is), or outputs
            # wanted as this rank's rows: no DTensor round trip
            if self.plan.local.degree == 1 or (self.rows_out and all(
                    self._rows_only(a) for a in n.all_input_nodes)):
                return map_arg(n.args[0], lambda a: self.env[a])
            return map_arg(n.args[0], self._as_dtensor)
        if n.op == "get_attr":  # a weight read, straight to its synchronisation (the
            # interpreter's generic path costs more than the read, once per weight)
            name = self.plan.reads.get(str(n.target))
            if name is None:
                return super().run_node(n)
            if name in self.plan.weights.leaves:
                self.frame.held_local.add(n)  # a weight only local ops read: its leaf
            return self.plan.weights.read(name)
        if n.op != "call_function":
            return super().run_node(n)
        if is_size(n):
            return self._size(n)
        if n.name in self.plan.local.nodes:
            return self._run_local(n)
        planned = self.layouts.nodes.get(n.name)

        def load(arg: Node) -> Any:
            value = self._as_dtensor(arg)
            if planned is None:
                return value
            layout = planned.inputs.get(arg.name)
            if layout is None:
                return value
            if _plain(value) and not layout.is_replicated:
                # a tensor the graph made (positions, a mask), the same on every rank,
                # read split: each rank cuts its block (the plan moves nothing here)
                value = replicated(value, self.mesh)
            if not isinstance(value, DTensor):
                return value
            held = self.frame.moved.setdefault(arg, {})
            # reads of one value in one layout share one move, as the plan shares them:
            # where it lists a move of the value at this node too, this node moves again
            if layout not in held or (arg.name in planned.moves
                                      and held[layout][1] != n.name):
                wanted = self._wanted(arg.name, layout)
                moved = value if _normalised(value, wanted) else self._move(
                    value, wanted, planned.gathered.get(arg.name, ()))
                axes = planned.reduced.get(arg.name, ())
                dims = tuple(self.plan_mesh.axis_names.index(a) for a in axes)
                held[layout] = (_GradientIn.apply(moved, self.mesh, wanted, dims,
                                                  tuple(value.placements))
                                if moved.requires_grad else moved, n.name)
            return held[layout][0]

        if planned is not None and planned.shares:
            args = map_arg(n.args, lambda a: self._shared(n, a, load(a)))
            kwargs = map_arg(n.kwargs, lambda a: self._shared(n, a, load(a)))
        else:
            args = map_arg(n.args, load)
            kwargs = map_arg(n.kwargs, load)
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(v, DTensor) for v in leaves) and any(
                _plain(v) for v in leaves):
            # A tensor the graph made itself (a constant, positions, a mask) meets the
            # split ones: it is the same on every rank, so it is a replicated DTensor,
            # also to the backward pass that saves it.
            args, kwargs = pytree.tree_map(lambda v: replicated(v, self.mesh), (args, kwargs))
        if planned is not None and planned.output is not None and n.target in _BIAS_SLOT:
            if planned.output.partial:
                args = self._bias_as_pending(n, args, planned.output)
            else:
                reduced = self._bias_after_sum(n, args, kwargs, planned.output)
                if reduced is not None:
                    return reduced
        split = None
        if n.target is _SDPA:
            args, kwargs = masks.resolved(n, args, kwargs)
            split = attention.local_placements(args, kwargs)
        result = self.call(n, args, kwargs) if split is None else attention.run_local(
            _SDPA, args, kwargs, split, self._site(n), self.micro)
        if planned is not None and planned.output is not None and isinstance(result, DTensor):
            wanted = self._wanted(n.name, planned.output)
            result = as_pending_sum(result, wanted)
            if not _normalised(result, wanted):
                if not planned.moves_inside:
                    self.record.unplanned[f"{n.name}: {result.placements} -> {wanted}"] += 1
                result = redistribute(result, self.mesh, wanted)
        return result

    def _bias_after_sum(self, n: Node, args: Any, kwargs: Any, output: Layout) -> Any:
        """A GEMM with a bias whose product is a pending sum the plan reduces before the
        bias is added (Megatron's row-parallel layer: MatMul, the all-reduce, then Add, the
        three ops one traced node owns): the product, the plan's move of it, then the
        bias, whole on every rank. None where the plan leaves no such sum to resolve here
        (the op runs as it is)."""
        slot = _BIAS_SLOT[n.target]
        if kwargs or len(args) != 3 or not all(isinstance(a, DTensor) for a in args):
            return None
        left, right = [a for k, a in enumerate(args) if k != slot]
        bias = args[slot]
        # the contracted dims: the left's last, the right's first of its last two
        # (linear's weight is [out, in]: its last)
        inner = -1 if n.target is torch.ops.aten.linear.default else -2
        wanted = self._wanted(n.name, output)
        summed = [axis for axis, (a, b, want) in enumerate(zip(
            left.placements, right.placements, wanted, strict=True))
            if isinstance(a, Shard) and isinstance(b, Shard) and not isinstance(want, Partial)
            and tensor_dim(a, left.ndim) == left.ndim - 1
            and tensor_dim(b, right.ndim) == right.ndim + inner]
        if not summed or any(not isinstance(bias.placements[a], Replicate) for a in summed):
            return None
        product = run_op(_UNBIASED[n.target], (left, right), {})
        product = redistribute(product, self.mesh, wanted)
        return run_op(torch.ops.aten.add.Tensor, (product, bias), {})

    def _bias_as_pending(self, n: Node, args: Any, output: Layout) -> Any:
        """A GEMM whose output the plan leaves a pending sum adds its bias to one share of
        it: the bias is read as a pending sum there too, and so is its gradient, which the
        plan sums at the bias (DTensor's own move of the bias, inside the op, would hand
        the gradient back summed)."""
        slot = _BIAS_SLOT[n.target]
        if len(args) <= slot or not isinstance(args[slot], DTensor):
            return args
        bias = args[slot]
        wanted = tuple(Partial() if isinstance(want, Partial) else have for have, want in
                       zip(bias.placements, self._wanted(n.name, output), strict=True))
        axes = _partial_axes(bias, wanted) if bias.requires_grad else ()
        if not axes:
            return args
        return (*args[:slot], _ToPartial.apply(bias, self.mesh, wanted, axes),
                *args[slot + 1:])

    def _move(self, value: DTensor, wanted: tuple[Placement, ...],
              gathered: tuple[str, ...] = ()) -> DTensor:
        """`value` in the placements `wanted`, its gradient as the plan reduces it: a cut
        of a replicated value leaves it a pending sum for the plan to make later (at the
        weight it comes from) unless the plan all-gathers it here over that axis
        (`gathered`: DTensor's own move does); a read as a pending sum leaves it one."""
        if not value.requires_grad:
            return redistribute(value, self.mesh, wanted)
        axis = _split_axis(value, wanted)
        names = self.mesh.mesh_dim_names or ()
        if axis is not None and names[axis] not in gathered:
            moved: DTensor = _Split.apply(value, self.mesh, wanted, axis)
            return moved
        axes = _partial_axes(value, wanted)
        if axes:
            shared: DTensor = _ToPartial.apply(value, self.mesh, wanted, axes)
            return shared
        return redistribute(value, self.mesh, wanted)

    # -- ops on local tensors (executor.module.local) -------------------------------------

    def _rows_only(self, node: Node) -> bool:
        """Whether `node`'s value is local and this rank's rows: split along dim 0 over
        the batch's axes, whole along every other dim."""
        if node not in self.frame.held_local:
            return False
        value = node.meta.get("val")
        return isinstance(value, torch.Tensor) and value.dim() > 0 and \
            self.plan.local.natural(value) == Layout.split(value.dim(), 0,
                                                           self.plan.local.batch_axes)

    def _natural(self, node: Node) -> tuple[Placement, ...]:
        value = node.meta["val"]
        layout = self.plan.local.natural(value)
        assert layout is not None
        return self._wanted(node.name, layout)

    def _as_dtensor(self, node: Node) -> Any:
        """A local value as the DTensor it is a block of (its natural layout), once."""
        frame = self.frame
        if node not in frame.held_local:
            return self.env[node]
        if node not in frame.dtensors:
            local = self.env[node]
            if not isinstance(local, torch.Tensor):
                raise ShardplanError(f"{node.name}: a local {type(local).__name__} read by "
                                     "a DTensor op")
            natural = self._natural(node)
            if local.requires_grad and not any(u.name in self.plan.local.nodes
                                               for u in node.users):
                frame.dtensors[node] = _FromLocal.apply(local, self.mesh, natural)
            else:
                frame.dtensors[node] = DTensor.from_local(local, self.mesh, natural,
                                                          run_check=False)
        return frame.dtensors[node]

    def _as_local(self, node: Node) -> Any:
        """What a local op reads for `node`: its local block (a DTensor's, once), its local
        size, or a value the same on every rank."""
        frame = self.frame
        value = self.env[node]
        if node in frame.held_local:
            return value
        if node in frame.sizes:
            return frame.sizes[node]
        if isinstance(value, DTensor):
            if node not in frame.locals:
                frame.locals[node] = self._block(node, value)
            return frame.locals[node]
        if isinstance(value, torch.Tensor):  # a whole tensor the graph made: take the block
            natural = self.plan.local.natural(node.meta["val"])
            assert natural is not None
            for dim, axes in enumerate(natural.dims):
                if axes:
                    return value.chunk(self.plan.local.degree, dim)[self.plan.batch_index]
        return value

    def _block(self, node: Node, value: DTensor) -> torch.Tensor:
        wanted = self._natural(node)
        if not _normalised(value, wanted):
            self.record.unplanned[f"{node.name}: {value.placements} -> {wanted}"] += 1
            value = redistribute(value, self.mesh, wanted)
        if not value.requires_grad:
            return value.to_local()
        names = self.plan_mesh.axis_names
        if all(isinstance(p, Replicate) for p in wanted) and self.plan.local.batch_axes:
            # read by an op on this rank's rows: its gradient is this rank's share
            grads = tuple(Partial() if names[d] in self.plan.local.batch_axes else p
                          for d, p in enumerate(wanted))
            return value.to_local(grad_placements=grads)
        weight = self.plan.reads.get(str(node.target)) if node.op == "get_attr" else None
        pending = self.plan.weights.pending_axes(weight) if weight is not None else ()
        if pending:  # a whole weight whose gradient the plan sums later: the local ops'
            # gradient is this rank's share of it (kept so by `_FromLocal` and the reads)
            grads = tuple(Partial() if names[d] in pending and isinstance(p, Replicate)
                          else p for d, p in enumerate(wanted))
            return value.to_local(grad_placements=grads)
        return value.to_local()

    def _size(self, n: Node) -> Any:
        """A size: the global one (what DTensor ops read) and, where it differs, the local
        one (what local ops read)."""
        args: Any
        kwargs: Any
        args, kwargs = map_arg((n.args, n.kwargs), self._as_dtensor)
        assert callable(n.target)
        value = n.target(*args, **kwargs)
        local_args: Any
        local_kwargs: Any
        local_args, local_kwargs = map_arg((n.args, n.kwargs), self._size_input)
        local = n.target(*local_args, **local_kwargs)
        if local != value:
            self.frame.sizes[n] = local
        return value

    def _size_input(self, node: Node) -> Any:
        value = self.env[node]
        if node in self.frame.sizes:
            return self.frame.sizes[node]
        if isinstance(value, DTensor):
            return value._local_tensor
        if node.name in self.plan.local_inputs:  # an input given whole: its rows' size
            return self._as_local(node)
        return value

    def _region_input(self, region: Region, arg: Node) -> Any:
        """What a compiled region reads for `arg`: as its readers there read it, which
        hand back one share of a weight's gradient (`_shared`), or else are refused."""
        shares = {self._share_of(m, arg) for m in region.nodes if arg in m.all_input_nodes}
        if len(shares) > 1:
            raise ShardplanError(f"{arg.name}: ops of one compiled region read it handing back "
                                 f"different shares of its gradient ({sorted(shares)}); "
                                 "plan again")
        return self._with_share(arg, self._as_local(arg), shares.pop() if shares else 1.0)

    def _share_of(self, n: Node, arg: Node) -> float:
        """The share of its gradient `n`'s read of `arg` hands back: the plan's where `arg`
        is a weight (`NodeLayouts.shares`), else 1."""
        planned = self.layouts.nodes.get(n.name)
        if planned is None or not planned.shares or arg.op != "get_attr":
            return 1.0
        weight = self.plan.reads.get(str(arg.target))
        return planned.shares.get(weight, 1.0) if weight is not None else 1.0

    def _with_share(self, arg: Node, value: Any, share: float) -> Any:
        if share == 1.0 or not isinstance(value, torch.Tensor):
            return value
        names = self.plan_mesh.axis_names
        summed = self.layouts.summed.get(self.plan.reads.get(str(arg.target), ""), ())
        return _GradientShare.apply(value, share, tuple(names.index(a) for a in summed))

    def _shared(self, n: Node, arg: Node, value: Any) -> Any:
        """`value`, what `n` reads for `arg`, handing back the share of its gradient the
        plan gives this read."""
        return self._with_share(arg, value, self._share_of(n, arg))

    def _run_local(self, n: Node) -> Any:
        args: Any
        kwargs: Any
        args, kwargs = map_arg((n.args, n.kwargs),
                               lambda a: self._shared(n, a, self._as_local(a)))
        assert callable(n.target)
        if n.target is _SDPA:
            args, kwargs = masks.resolved(n, args, kwargs)
        if n.target is _DROPOUT and len(args) > 2 and args[2] and args[1] > 0:
            result: Any = dropout(args[0], float(args[1]), *self._local_site(n, args[0]))
        elif n.target is _SDPA and kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            p = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
            result = attention_math(*args, **kwargs, drop=lambda t: dropout(
                t, p, *self._local_site(n, t, dim=0))[0])
        else:
            result = run_op(n.target, args, kwargs)
        self.frame.held_local.add(n)
        return result

    def _local_site(self, n: Node, block: torch.Tensor, dim: int | None = None
                    ) -> tuple[DropoutSite, Shift | None]:
        """The dropout draw of this rank's block: its rows' place in the micro-batch (the
        site's offsets) and the micro-batch's in the step (the shift, as DTensor blocks
        get it in `_shift`)."""
        offsets = [0] * block.dim()
        source = n.args[0] if dim is None else None
        if dim is None and isinstance(source, Node):
            found = symbolic_dim(source.meta["val"])
            dim = found if found is not None and found >= 0 else None
        shift = None
        if (dim is not None and self.plan.local.batch_axes) or self.micro:
            d = dim if dim is not None else 0
            rows = int(block.shape[d])
            offsets[d] = self.plan.batch_index * rows
            if self.micro:
                shift = Shift(d, self.micro, rows * self.plan.local.degree)
        site = DropoutSite(self.seed, self.step, self.index[n.name], tuple(offsets))
        return site, shift


@dataclass
class _Frame:
    """A run's per-value state: which values are local blocks (`executor.module.local`),
    their DTensor forms, the local blocks of DTensors, local sizes, and the moves made."""

    held_local: set[Node] = field(default_factory=set)
    dtensors: dict[Node, DTensor] = field(default_factory=dict)
    locals: dict[Node, torch.Tensor] = field(default_factory=dict)
    sizes: dict[Node, Any] = field(default_factory=dict)
    #: per value and layout: the move and the node that made it
    moved: dict[Node, dict[Layout, tuple[DTensor, str]]] = field(default_factory=dict)

    def forget(self, node: Node) -> None:
        self.held_local.discard(node)
        for table in (self.dtensors, self.locals, self.sizes, self.moved):
            if table:  # (most are empty: once per node and forward)
                table.pop(node, None)  # type: ignore[attr-defined]

    def part(self, nodes: Sequence[Node]) -> _Frame:
        """What this frame knows of `nodes` (a segment's inputs or outputs)."""
        keep = set(nodes)
        return _Frame({n for n in self.held_local if n in keep},
                      sizes={n: v for n, v in self.sizes.items() if n in keep})

    def absorb(self, other: _Frame) -> None:
        self.held_local |= other.held_local
        self.sizes.update(other.sizes)


def run_planned(graph: GraphModule, plan: ModulePlan, mesh: TorchMesh,
                flat_inputs: Sequence[torch.Tensor], record: RunRecord, seed: int,
                step: int, micro: int = 0, rows_out: bool = False) -> Any:
    """The traced graph's flat outputs for `flat_inputs` (DTensors in the plan's layouts),
    micro-batch `micro` of training step `step`; with `rows_out`, outputs that are this
    rank's rows as those rows (`PlannedRun.rows_out`)."""
    with plan.weights.forward_pass():
        return PlannedRun(graph, plan, mesh, record, seed, step, micro,
                          rows_out).run(*flat_inputs)
