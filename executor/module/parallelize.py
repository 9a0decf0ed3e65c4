"""`parallelize(module, plan, example)`: the user's module, ready to train with the plan.

Inside an initialised process group (torchrun, or `executor.train`'s launcher) every rank
calls it with the same module (same initial weights, e.g. one seed) and one global batch
as the example. It then

- builds a DeviceMesh with the plan's axes (`init_device_mesh`, rank order as the plan's
  mesh: row-major);
- checks that the module's parameters and the plan's are the same names;
- makes each parameter a DTensor placed as the plan's layout says (`Shard(d)` per mesh axis
  that splits dim d, `Replicate()` elsewhere), each rank keeping only its shard;
- replaces `module.forward` by a run of the module's traced graph (`executor.module.run`)
  that takes the global batch, keeps each rank's shard of it in the plan's input layouts,
  and moves every op's inputs to the plan's layouts;
- issues the plan's weight collectives bucket by bucket (`executor.module.weights`): the
  gradient all-reduce as soon as a bucket's gradients are accumulated (behind the rest of
  the backward pass, as DDP does), or ZeRO 1-3's reduce-scatters and all-gathers, the
  module's parameters then being each rank's chunks of the weights;
- runs the plan's recompute segments under activation checkpointing.

The module keeps its identity and its parameters' names: build the optimizer on
`module.parameters()` after the call. `module.shardplan.train_step(loss_fn, batch)` runs
one step's forward and backward passes over the plan's micro-batches; with one
micro-batch, `loss_fn(module(**batch), batch).backward()` (through `module.shardplan.loss`)
is the same. With pipeline stages (`executor.module.pipeline`) each rank holds its
stage's weights only and runs its chunks in the plan's schedule: `train_step` is then
the way to run the module (a stage cannot run a whole forward).
"""

from __future__ import annotations

import contextlib
import tempfile
import types
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx import GraphModule
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree as pytree

from executor.module.grouped import group_attention
from executor.module.layouts import (
    ModuleLayouts,
    WeightBucket,
    check_parameters,
    read_layouts,
)
from executor.module.local import LocalPlan
from executor.module.lossops import (
    KeptTargetsOverRanks,
    install_loss_handlers,
    one_loss_call,
    step_divisors,
    step_kept_weights,
)
from executor.module.microloss import Accumulation, accumulation, outputs_like, scaled
from executor.module.pipeline import ModuleChunks, chunk_nodes
from executor.module.rowloss import (
    RowLoss,
    batch_mesh_dims,
    block_rows,
    for_the_loss,
    row_placements,
)
from executor.module.run import (
    LossShare,
    ModulePlan,
    RunRecord,
    loss_share,
    output_gradients,
    place_inputs,
    placements,
    replicated,
    run_planned,
    run_unsplit,
    settled,
    step_loss,
)
from executor.module.trace import SavedTrace, differentiable, export_program, save_model
from executor.module.weights import WeightSync
from executor.pipeline import ScheduleEngine, wire_of
from executor.runtime import Counters, MeshComm
from executor.schedule import build_stages, weight_holders
from executor.support import check_degrees
from executor.update import tied_groups
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.importer import import_model
from planner.kinds import AxisRole
from planner.plans.model import Plan
from planner.plans.stagemesh import refuse_stage_meshes
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh

Phases = Callable[[str], AbstractContextManager[Any]]


def _loss_roots(loss: torch.Tensor, output: Any
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Where the model's backward pass starts: the loss itself when it is a plain tensor
    (no collective in it), else its gradient with respect to the outputs it read, taken
    now (`executor.module.run.output_gradients`)."""
    pairs = output_gradients(loss, output)
    if pairs is None:
        return [loss], [None]
    return [out for out, _ in pairs], [grad for _, grad in pairs]


@dataclass
class ParallelModule:
    """What `parallelize` attached to the module (`module.shardplan`): the plan, the mesh,
    the plan as the trace reads it, and what the run issued."""

    plan: Plan
    mesh: TorchMesh
    run: ModulePlan
    comm: MeshComm
    trace: _Trace
    inputs: Mapping[str, tuple[Any, ...]]  # input name -> its placements
    record: RunRecord = field(default_factory=RunRecord)
    seed: int = 0
    draws: int = 0  # forwards and training steps run: each draws its own dropout masks
    hook: Any = None  # the optimizer-step hook (`after_optimizer_step`)
    pipeline: ScheduleEngine | None = None  # a plan's stages: this rank's schedule
    chunks: ModuleChunks | None = None  # ... and what its chunks run
    row_loss: RowLoss | None = None  # the loss on this rank's rows (executor.module.rowloss)
    #: whether the step's kept targets are counted before its micro-batches
    #: (`executor.module.lossops.step_kept_weights`): until a step shows its loss makes
    #: no mean-reduced NLL call
    count_kept_weights: bool = True
    #: the loss runs on whole outputs: DTensor has no rule for an op of it (`loss`)
    loss_on_whole: bool = False
    loss_probed: bool = False  # whether DTensor has shown if it may be
    #: how the step's micro-batch losses make its loss, found on the first step of
    #: several (`executor.module.microloss`); None until then
    accumulation: Accumulation | None = None
    #: the last step's loss, its reduction possibly in flight (`step_loss`)
    last_loss: torch.Tensor | None = None
    #: the frozen weights (`requires_grad=False`), whole as the trace reads them, by the
    #: plan's name: a checkpoint holds them too, so that a fine-tuning run resumed from a
    #: run that trained them starts from the trained values
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def layouts(self) -> ModuleLayouts:
        return self.run.layouts

    @property
    def weights(self) -> WeightSync:
        return self.run.weights

    def loss(self, loss_fn: Callable[..., torch.Tensor], output: Any, *batch: Any
             ) -> torch.Tensor:
        """`loss_fn(output, *batch)` on the parallelized output: the batch's plain tensors
        count as replicated (each rank reads its own rows of them), so the loss is the
        global batch's, as one device computes it. Call `.backward()` on it; its value is
        `float(loss.full_tensor())` (or `float(loss)` when it is a plain tensor). An
        output that is a plain tensor (the batch not split, so every rank holds all of
        it) meets the batch as it is. A tensor `loss_fn` makes itself (`torch.ones(out.
        shape)`, a class weight) is the same on every rank, so it counts as replicated too
        (DTensor refused to mix it: "got mixed torch.Tensor and DTensor")."""
        if not any(isinstance(v, DTensor) for v in pytree.tree_leaves(output)):
            # (whole on every rank: a mean over kept targets needs no rank's weights, but
            # the step's where counted, `step_divisors`)
            with KeptTargetsOverRanks(()), one_loss_call():
                return loss_fn(output, *batch)
        given = pytree.tree_map(lambda v: replicated(v, self.mesh), list(batch))
        if not self.loss_on_whole:
            try:
                with implicit_replication(), one_loss_call():
                    return loss_fn(output, *given)
            except (NotImplementedError, RuntimeError) as exc:
                if not _no_sharding_rule(exc):
                    raise
                # an op DTensor cannot run (a boolean mask's data-dependent shape): the
                # loss on whole outputs as plain tensors, as one process computes it,
                # the same on every rank, from now on
                self.loss_on_whole = True
        whole = pytree.tree_map(
            lambda v: v.full_tensor() if isinstance(v, DTensor) else v, output)
        with KeptTargetsOverRanks(()), one_loss_call():
            return loss_fn(whole, *batch)

    def forward(self, given: Sequence[torch.Tensor], micro: int = 0,
                step: int | None = None, rows_out: bool = False) -> Any:
        """The traced graph on one batch (or micro-batch `micro` of training step
        `step`), each input split as the plan's input layout says; with `rows_out`,
        outputs that are this rank's rows as plain tensors (for `_step_loss`)."""
        if self.pipeline is not None:
            raise ShardplanError("a pipeline plan runs whole training steps, each stage its "
                                 "own layers: call module.shardplan.train_step(loss_fn, "
                                 "batch)")
        rows = {int(v.shape[0]) for v in given if v.dim() > 0}
        wanted = self.plan.model.batch if step is not None else self.plan.global_batch
        if wanted is not None and rows != {wanted}:
            whole = f"a global batch of {self.plan.global_batch}"
            raise ShardplanError(
                f"a batch of {sorted(rows)} rows: the plan is for {whole}"
                + (f", {self.plan.micro_batches} micro-batches of {wanted}"
                   if step is not None and self.plan.micro_batches > 1 else ""))
        flat = place_inputs(given, self.trace.user_inputs, self.mesh, self.inputs,
                            self.run.local_inputs)
        if step is None:
            self.draws += 1
            step = self.draws
        with implicit_replication():
            outputs = run_planned(self.trace.graph, self.run, self.mesh, flat,
                                  self.record, self.seed, step, micro, rows_out)
        result = self.trace.outputs(outputs)
        # the loss's read of the outputs, where the plan lists it with the forward pass
        return for_the_loss(result) if self.layouts.loss_reads_planned else result

    def train_step(self, loss_fn: Callable[..., torch.Tensor],
                   batch: Mapping[str, torch.Tensor], phases: Phases | None = None
                   ) -> torch.Tensor:
        """One training step's forward and backward passes on the global `batch`: the
        plan's micro-batches in turn (rows split evenly along dim 0), each loss divided by
        their number so the gradients are the whole batch's (`loss_fn` averages over its
        rows, as gradient accumulation assumes), the plan's weight collectives issued as
        the plan says. Returns the step's loss (detached; its reduction over the batch's ranks
        may still be in flight, and reading it waits: `step_loss`); call `optimizer.step()`
        next.
        `phases(name)`, when given, is entered around each "forward", "loss" and
        "backward" part (to count collectives by phase)."""
        losses = self._step(loss_fn, batch, phases)
        if isinstance(losses, torch.Tensor):  # (a pipeline's, reduced by its schedule)
            return losses
        settled(self.last_loss)  # (a step with no optimizer step between)
        self.last_loss = step_loss(losses)
        return self.last_loss

    def train_step_share(self, loss_fn: Callable[..., torch.Tensor],
                         batch: Mapping[str, torch.Tensor], phases: Phases | None = None
                         ) -> LossShare | torch.Tensor:
        """`train_step`, its loss left as this rank's share where a sum over the batch's
        ranks is pending (`LossShare`; else the loss): for a loop that reads many steps'
        losses at once, their sums taken in one collective (`reduced_losses`), as
        `shardplan run` does."""
        losses = self._step(loss_fn, batch, phases)
        if isinstance(losses, torch.Tensor):
            return losses
        settled(self.last_loss)
        self.last_loss = None
        return loss_share(losses)

    def _step(self, loss_fn: Callable[..., torch.Tensor], batch: Mapping[str, torch.Tensor],
              phases: Phases | None) -> list[torch.Tensor] | torch.Tensor:
        """A step's passes (`train_step`): its micro-batches' losses, or a pipeline's step
        loss."""
        count = self.plan.micro_batches
        given = self._on_device(self.trace.inputs((), batch))
        for name, value in zip(self.trace.user_inputs, given, strict=True):
            if value.dim() > 0 and value.shape[0] % count:
                raise ShardplanError(f"input {name}: {tuple(value.shape)} does not split "
                                     f"into {count} micro-batches along dim 0")
        part = phases or (lambda _: contextlib.nullcontext())
        self.draws += 1
        if self.pipeline is not None:
            return self._pipelined(loss_fn, given, part)
        losses: list[torch.Tensor] = []
        micro_batches = [dict(zip(self.trace.user_inputs,
                                  [_micro_rows(v, count, micro) for v in given], strict=True))
                         for micro in range(count)]
        divisors = None
        step_fn = loss_fn
        for micro, micro_batch in enumerate(micro_batches):
            rows = list(micro_batch.values())
            self.weights.micro_batch_last = micro == count - 1
            try:
                with part("forward"):  # (once the loss is known to be the rows': the
                    # outputs as this rank's rows, the loss computed on them)
                    output = self.forward(rows, micro, self.draws,
                                          rows_out=self.row_loss is not None)
                with part("loss"):
                    if micro == 0 and count > 1:
                        divisors, step_fn = self._first_loss(loss_fn, output, micro_batches)
                    with step_divisors(divisors):
                        roots, grads, reported = self._step_loss(step_fn, output,
                                                                 micro_batch, count)
                del output  # what the backward pass needs, it holds
                with part("backward"):
                    # (buckets waiting for a weight that got no gradient are reduced
                    # at its end: `WeightSync._backward_ended`)
                    torch.autograd.backward(roots, grads)
                del roots, grads  # (a gradient as large as the output: not into the next
                # micro-batch's forward)
            finally:
                self.weights.micro_batch_last = True
            losses.append(reported)
        return losses

    def after_optimizer_step(self) -> None:
        """After `optimizer.step()` on this module's parameters: the step's loss reduction
        (issued behind the backward pass, `step_loss`) waited for, so that none is in
        flight when a rank leaves (a rank tearing its process group down while a peer
        still reduces aborts the peer); ZeRO 1 and 2's whole weights rebuilt."""
        settled(self.last_loss)
        self.weights.after_optimizer_step()

    def _step_loss(self, loss_fn: Callable[..., torch.Tensor], output: Any,
                   micro_batch: Mapping[str, torch.Tensor], count: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
        """One micro-batch's loss: where the backward pass starts, with what gradients,
        and the loss to report. On this rank's rows once DTensor has shown that is exact
        (`executor.module.rowloss`), else on DTensors; a loss on DTensors may issue
        collectives in its own backward pass, taken apart (`output_gradients`) so that
        they count as the loss's."""
        dims = batch_mesh_dims(self.mesh, self.run.local.batch_axes)
        if self.row_loss is not None and self.run.local.degree > 1 and not any(
                isinstance(v, DTensor) for v in pytree.tree_leaves(output)):
            found = self.row_loss.on_rows(loss_fn, output, (micro_batch,), self.mesh, dims)
            if found is not None:
                term, reported = found
                return [term / count], [None], reported
            whole = next(int(v.shape[0]) for v in micro_batch.values() if v.dim())
            output = pytree.tree_map(lambda v: self._as_rows(v, dims, whole), output)
        if not self.layouts.loss_reads_planned:  # moved here, counted as the loss's
            output = for_the_loss(output)
        if self.row_loss is not None:
            found = self.row_loss.local(loss_fn, output, (micro_batch,), self.mesh, dims)
            if found is not None:
                term, reported = found
                return [term / count], [None], reported
        if self.loss_probed:
            loss = self.loss(loss_fn, output, micro_batch)
        else:
            loss, self.row_loss = RowLoss.probe(
                output, (micro_batch,), self.mesh, dims,
                lambda: self.loss(loss_fn, output, micro_batch))
            if self.row_loss is not None and not self._local_loss_agrees(
                    loss, self.row_loss.local(loss_fn, output, (micro_batch,), self.mesh,
                                              dims)):
                self.row_loss = None
            self.loss_probed = True
        roots, grads = _loss_roots(loss / count, output)
        return roots, grads, loss.detach()

    def _first_loss(self, loss_fn: Callable[..., torch.Tensor], output: Any,
                    micro_batches: Sequence[Mapping[str, torch.Tensor]]
                    ) -> tuple[tuple[torch.Tensor, ...] | None, Callable[..., torch.Tensor]]:
        """At the first loss of a step of several micro-batches: the step's kept-target
        weights (`_step_kept_weights`), and `loss_fn` scaled so that the mean of the
        micro-batches' losses is one process's over the step (`_accumulation`)."""
        count = len(micro_batches)
        if not self.count_kept_weights and self.accumulation is not None:
            return None, scaled(loss_fn, self.accumulation.scale(count))
        rows = self._rows_here(micro_batches)
        divisors = self._step_kept_weights(loss_fn, output, rows) \
            if self.count_kept_weights else None
        if self.accumulation is None:
            self.accumulation = self._accumulation(loss_fn, output, rows,
                                                   divisors is not None)
        return divisors, scaled(loss_fn, self.accumulation.scale(count))

    def _rows_here(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> _RankRows:
        dims = tuple(batch_mesh_dims(self.mesh, self.run.local.batch_axes))
        whole = next((int(v.shape[0]) for v in micro_batches[0].values() if v.dim()), 0)
        start, size = block_rows(whole, self.mesh, dims) if dims else (0, whole)
        batches = tuple(pytree.tree_map(lambda v: v.narrow(0, start, size) if isinstance(
            v, torch.Tensor) and v.dim() else v, dict(batch)) for batch in micro_batches)
        return _RankRows(dims, whole, size, batches)

    def _step_kept_weights(self, loss_fn: Callable[..., torch.Tensor], output: Any,
                           rows: _RankRows) -> tuple[torch.Tensor, ...] | None:
        """The step's kept-target weights (`lossops.step_kept_weights`), counted on this
        rank's rows of every micro-batch with zeros for the output (the first
        micro-batch's, shaped as each): so that each micro-batch's mean-reduced NLL is
        a term of one process's mean over the step. Counting stops for later steps once
        a step shows the loss makes no such call."""
        zeros = outputs_like(output, rows.size, rows.whole, rows.size, made_up=False)
        found = step_kept_weights(loss_fn, zeros, [(batch,) for batch in rows.batches],
                                  [self.mesh.get_group(dim) for dim in rows.dims],
                                  torch.device(self.mesh.device_type))
        if found is None:
            self.count_kept_weights = False  # (every rank alike: the answer is reduced)
        return found

    def _accumulation(self, loss_fn: Callable[..., torch.Tensor], output: Any,
                      rows: _RankRows, kept_divisors: bool) -> Accumulation:
        """How the step's micro-batch losses make one process's loss
        (`executor.module.microloss`), on this rank's rows of the whole step (one
        collective, once)."""
        count = len(rows.batches)
        step = {name: torch.cat([batch[name] for batch in rows.batches])
                if isinstance(value, torch.Tensor) and value.dim() else value
                for name, value in rows.batches[0].items()}
        return accumulation(
            loss_fn, outputs_like(output, count * rows.size, rows.whole, rows.size), step,
            count * rows.size, count, kept_divisors,
            [self.mesh.get_group(dim) for dim in rows.dims], torch.device(self.mesh.device_type))

    @staticmethod
    def _local_loss_agrees(loss: torch.Tensor,
                           found: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Whether `loss_fn` on this rank's rows gives the term DTensor's loss holds here,
        on every rank (one collective, once): a mean written `x.sum() / x.shape[0]` is
        a pending sum on DTensors whose terms divide by the whole batch's rows, but on a
        rank's rows by that rank's (the gradient came out twice one process's on two
        ranks, the loss too)."""
        held = loss._local_tensor.detach() if isinstance(loss, DTensor) else loss.detach()
        # (`found[1]`, the local value as the DTensor it is a term of, holds it as is)
        agrees = found is not None and isinstance(loss, DTensor) and isinstance(
            found[1], DTensor) and torch.allclose(found[1]._local_tensor.to(held.dtype),
                                                  held, rtol=1e-5, atol=1e-8)
        flag = torch.tensor([1 if agrees else 0], dtype=torch.int32, device=held.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _as_rows(self, value: Any, dims: Sequence[int], whole: int) -> Any:
        """A plain output (this rank's rows of `whole`: `forward`'s `rows_out`) as the
        DTensor it is a block of."""
        if not isinstance(value, torch.Tensor):
            return value
        shape = torch.Size((whole, *value.shape[1:]))
        return DTensor.from_local(value, self.mesh, row_placements(self.mesh, dims),
                                  run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    def _on_device(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The step's batch on the mesh's device, copied once for all its micro-batches and
        their losses, from pinned memory without waiting: a copy from pageable memory
        would wait for every kernel queued before it, once per micro-batch."""
        if self.mesh.device_type == "cpu":
            return list(values)
        return [v if v.device.type != "cpu" else
                v.pin_memory().to(self.mesh.device_type, non_blocking=True) for v in values]

    def _pipelined(self, loss_fn: Callable[..., torch.Tensor], given: Sequence[torch.Tensor],
                   phases: Phases) -> torch.Tensor:
        """One step through this rank's pipeline schedule (`executor.pipeline`)."""
        assert self.pipeline is not None and self.chunks is not None
        count = self.plan.micro_batches
        feeds = [[_micro_rows(v, count, micro) for v in given] for micro in range(count)]
        targets = [dict(zip(self.trace.user_inputs, rows, strict=True)) for rows in feeds]
        self.chunks.step_number = self.draws
        self.chunks.phases = phases
        # the step's kept targets counted at its first loss, on the loss's stage
        # (`_step_kept_weights`), each micro-batch's NLL divided by the step's weight
        first: list[tuple[tuple[torch.Tensor, ...] | None, Callable[..., torch.Tensor]]] = []

        def loss_of(flat: Any, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
            output = self.trace.outputs(flat)
            if not first:
                first.append(self._first_loss(loss_fn, output, targets) if count > 1
                             else (None, loss_fn))
            divisors, step_fn = first[0]
            with step_divisors(divisors):
                return self.loss(step_fn, output, rows)

        self.chunks.loss_of = loss_of
        return torch.tensor(self.pipeline.step(feeds, targets))

    @property
    def weight_calls(self) -> Counter:
        """Weight collectives issued so far (gradient sums, ZeRO's gathers and scatters),
        by "kind|axes|phase"."""
        return Counter({f"{k}|{','.join(a)}|{phase}": n
                        for (k, a, phase), n in self.comm.counters.issued.items() if n})


@dataclass(frozen=True)
class _RankRows:
    """This rank's rows of a step's micro-batches: the mesh dims splitting the batch, a
    micro-batch's rows, this rank's count of them, and each micro-batch's inputs cut to
    them."""

    dims: tuple[int, ...]
    whole: int
    size: int
    batches: tuple[dict[str, Any], ...]


def _no_sharding_rule(exc: BaseException) -> bool:
    """Whether `exc` is DTensor finding no way to run an op on the placements it was
    given: the same on every rank (it depends on shapes and placements alone), so every
    rank takes the same way out."""
    text = str(exc)
    return "does not have a sharding strategy registered" in text or \
        "Sharding propagation failed" in text


def _micro_rows(value: torch.Tensor, count: int, micro: int) -> torch.Tensor:
    """Micro-batch `micro` of `count` of a batch input: its rows, or the whole of a 0-d
    input (a scalar setting of the step, which the export keeps static), which every
    micro-batch reads."""
    return value.chunk(count)[micro] if value.dim() > 0 else value


def state_of(module: nn.Module) -> ParallelModule:
    """What `parallelize` attached to `module`."""
    state = getattr(module, "shardplan", None)
    if not isinstance(state, ParallelModule):
        raise ShardplanError(f"{type(module).__name__} was not made by "
                             "executor.parallelize")
    return state


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _drop(root: nn.Module, dotted: str) -> None:
    """Another pipeline stage's weight: this rank keeps no copy of it."""
    target, leaf = _slot(root, dotted)
    param = target._parameters.get(leaf)
    if param is not None:
        target.register_parameter(leaf, nn.Parameter(param.detach().new_empty(0),
                                                     requires_grad=False))


@dataclass(frozen=True)
class _Stage:
    """This rank's pipeline stage: its device stage, the weights it holds (None: all,
    without stages) and the mesh its DTensors live on (the plan's mesh without pp)."""

    plan_mesh: DeviceMesh  # the whole plan's
    mesh: DeviceMesh  # the stage's
    device: int
    local_rank: int  # this rank's place in the stage's mesh
    holders: Mapping[str, tuple[int, ...]] | None  # weight -> the stages holding it

    @property
    def holds(self) -> frozenset[str] | None:
        """The weights this stage holds (None: every weight, without stages)."""
        if self.holders is None:
            return None
        return frozenset(n for n, stages in self.holders.items() if self.device in stages)

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """The weights several stages hold (a tied embedding and head), by their stages."""
        return {n: h for n, h in (self.holders or {}).items() if len(h) > 1}

    @classmethod
    def of(cls, plan: Plan, rank: int) -> _Stage:
        mesh = plan.mesh
        if plan.pipeline is None or PP not in mesh.axis_names:
            return cls(mesh, mesh, 0, rank, None)
        coord = dict(zip(mesh.axis_names, np.unravel_index(rank, mesh.shape), strict=True))
        inner = [(a, n) for a, n in zip(mesh.axis_names, mesh.shape, strict=True) if a != PP]
        stage_mesh = DeviceMesh(tuple(n for _, n in inner) or (1,),
                                tuple(a for a, _ in inner) or (STAGE_AXIS,),
                                mesh.devices_per_node)
        local = int(np.ravel_multi_index(tuple(int(coord[a]) for a, _ in inner),
                                         tuple(n for _, n in inner))) if inner else 0
        return cls(mesh, stage_mesh, int(coord[PP]), local, weight_holders(plan))

    def torch_mesh(self, device_type: str) -> TorchMesh:
        """The DeviceMesh the stage's DTensors live on (every rank builds every group)."""
        if self.holders is None:
            return init_device_mesh(device_type, self.plan_mesh.shape,
                                    mesh_dim_names=self.plan_mesh.axis_names)
        names = self.plan_mesh.axis_names
        shape = self.plan_mesh.shape
        if self.mesh.axis_names == (STAGE_AXIS,):  # one device per stage
            names, shape = (*names, STAGE_AXIS), (*shape, 1)
        whole = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return whole[self.mesh.axis_names]

    def buckets(self, buckets: Sequence[WeightBucket]) -> list[WeightBucket]:
        """The weight collectives this stage issues: the buckets of its own weights (a
        bucket of tied weights only, which several stages hold, is each holder's in turn,
        as the builder numbers them); the sums between stages are `WeightSync.tied`."""
        if self.holders is None:
            return list(buckets)
        seen: Counter = Counter()
        mine = []
        for bucket in buckets:
            if PP in bucket.axes:
                continue
            owners = sorted(set.intersection(*(set(self.holders.get(n, ()))
                                               for n in bucket.tensors)))
            key = (bucket.kind, bucket.axes, bucket.phase, bucket.tensors)
            turn = seen[key]
            seen[key] += 1
            if owners and owners[min(turn, len(owners) - 1)] == self.device:
                mine.append(bucket)
        return mine


def _planning_graph(trace: _Trace, plan: Plan) -> PlanningGraph:
    """The graph the plan was made from, imported from the trace's own ONNX model at the
    plan's dims: what the pipeline's chunks and transfers are read against. Read before
    the weights are distributed: the model's initializers are the module's own tensors,
    whose storage ZeRO 3 frees."""
    assert trace.onnx is not None
    if isinstance(trace.onnx, Path):  # a saved trace's model
        graph = import_model(trace.onnx, batch=plan.model.batch, dims=plan.model.bound_dims)
    else:
        with tempfile.TemporaryDirectory() as folder:
            graph = import_model(save_model(trace.onnx, Path(folder) / "module.onnx"),
                                 batch=plan.model.batch, dims=plan.model.bound_dims)
    trace.onnx = None  # not needed again
    return graph


def _schedule(state: ParallelModule, graph: PlanningGraph
              ) -> tuple[ScheduleEngine, ModuleChunks]:
    """The plan's stages on the trace: the chunks' nodes and this rank's schedule."""
    plan, trace = state.plan, state.trace
    assert plan.pipeline is not None
    stages = build_stages(graph, plan.pipeline, plan.mesh, graph.outputs[0],
                          GraphAnalysis.of(graph).needs_grad)
    chunks = chunk_nodes(trace.graph, plan, state.layouts, stages)
    stored = {name: entry.layout for name, entry in plan.tensors.items()}
    wires = {t.tensor: wire_of(graph.tensors[t.tensor], stored[t.tensor], plan.mesh)
             for t in stages.transfers}
    runner = ModuleChunks(trace.graph, state.run, state.mesh, state.comm, chunks, stages,
                          stored, state.inputs, state.record, state.seed, wires)
    return ScheduleEngine(runner, stages), runner


PP = str(AxisRole.PIPELINE)
#: the one-device mesh axis of a stage whose plan mesh has no axis but pp
STAGE_AXIS = "stage"


def _slot(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The submodule holding `dotted` ("transformer.h.0.attn.c_attn.weight"), and the
    name there."""
    owner, _, leaf = dotted.rpartition(".")
    return (root.get_submodule(owner) if owner else root), leaf


def _assign(root: nn.Module, dotted: str, value: nn.Parameter) -> None:
    target, leaf = _slot(root, dotted)
    target.register_parameter(leaf, value)


def refuse_nothing_to_train(module: nn.Module) -> None:
    """A module whose every parameter is frozen has no gradient to compute: its loss has
    no backward pass (torch: "element 0 of tensors does not require grad")."""
    if not any(param.requires_grad for param in module.parameters()):
        raise ShardplanError(f"every parameter of {type(module).__name__} is frozen "
                             "(requires_grad=False): there is nothing to train; unfreeze "
                             "the weights the run should train")


def refuse_training_norms(module: nn.Module) -> None:
    """Batch norm in training mode updates its running statistics in place as it runs,
    which the split run's autograd cannot follow (a rank's backward fails, or the bias's
    gradient arrives summed where the plan sums it again): refused by name."""
    for name, submodule in module.named_modules():
        if isinstance(submodule, nn.modules.batchnorm._BatchNorm) and submodule.training:
            raise ShardplanError(
                f"module {name or type(module).__name__} is a {type(submodule).__name__} in "
                "training mode, which the module executor does not run (its running "
                "statistics update in place); keep its norms in eval mode (module.eval() on "
                "them), or train it without the module executor")


def _check_parameter_shapes(plan: Plan, module: nn.Module) -> None:
    """Every module parameter has the shape the plan gives it (its transpose where the
    export stores it so): a plan of a narrower module names the same parameters."""
    for name, param in module.named_parameters(remove_duplicate=False):
        entry = plan.tensors.get(name)
        if entry is None:
            continue
        shape = tuple(entry.shape)
        if entry.source is not None and entry.source.transposed:
            shape = shape[::-1]
        if tuple(param.shape) != shape:
            raise ShardplanError(
                f"parameter {name} is {list(param.shape)} in the module but "
                f"{list(shape)} in the plan for {plan.model.path or 'another model'}: "
                "plan this module's own export again")


def frozen_names(module: nn.Module) -> frozenset[str]:
    """Every name of every parameter the module does not train (`requires_grad=False`)."""
    return frozenset(name for name, param in module.named_parameters(remove_duplicate=False)
                     if not param.requires_grad)


def parameter_names(module: nn.Module) -> list[tuple[str, ...]]:
    """Every parameter's names, in module order: a tied weight (GPT-2's embedding and
    head) is one parameter with several names, and an export names it by one of them."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(n) for n in names.values()]


def _distribute_parameters(module: nn.Module, layouts: ModuleLayouts, plan: Plan,
                           mesh: TorchMesh, plan_mesh: DeviceMesh,
                           held: frozenset[str] | None = None,
                           ) -> tuple[dict[str, nn.Parameter], dict[str, tuple[str, ...]]]:
    """Each parameter (of this pipeline stage: in `held`) as a DTensor in its plan layout
    on `mesh`, by its plan name, and every name it has in the module (a tied weight has
    several); every rank keeps its own shard of the values it already has (no broadcast:
    the ranks built the same module)."""
    placed: dict[str, nn.Parameter] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    for names in parameter_names(module):
        planned = next((n for n in names if n in layouts.parameters), None)
        if planned is None:  # frozen: state the trace reads whole, as a buffer
            continue
        if held is not None and planned not in held:
            continue
        param = module.get_parameter(planned)
        where = placements(layouts.parameters[planned], plan_mesh, f"parameter {planned}")
        with torch.no_grad():
            value = distribute_tensor(param.detach().to(mesh.device_type), mesh, where,
                                      src_data_rank=None)
        placed[planned] = nn.Parameter(value, requires_grad=param.requires_grad)
        aliases[planned] = names
    return placed, aliases


@dataclass
class _Trace:
    """The module's trace and how its forward is called: inputs by keyword, in order."""

    graph: GraphModule
    user_inputs: list[str]
    out_spec: Any
    #: what the planner read (a pipeline's graph): the export's, or a saved trace's file
    onnx: torch.onnx.ONNXProgram | Path | None = None

    @classmethod
    def of(cls, module: nn.Module, example: Mapping[str, torch.Tensor],
           saved: SavedTrace | None = None) -> _Trace:
        """The module's trace: exported here, or read from `saved` (an export of the same
        module at the same example, written once for every rank)."""
        if saved is not None:
            return cls.read(saved.load(), saved.model)
        exported = export_program(module, example)
        assert exported.exported_program is not None  # export_program checked it
        return cls.read(exported.exported_program, exported)

    @classmethod
    def read(cls, program: torch.export.ExportedProgram,
             onnx: torch.onnx.ONNXProgram | Path) -> _Trace:
        return cls(differentiable(program.module()),
                   list(program.graph_signature.user_inputs),
                   program.call_spec.out_spec, onnx)

    def inputs(self, args: tuple, kwargs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        if args:
            raise ShardplanError("a traced module takes its inputs by keyword "
                                 f"({', '.join(self.user_inputs)})")
        absent = [n for n in self.user_inputs if n not in kwargs]
        if absent:
            raise ShardplanError(f"missing input {', '.join(absent)}")
        return [kwargs[n] for n in self.user_inputs]

    def outputs(self, flat: Any) -> Any:
        """The forward's outputs in the module's own structure (a tuple, a dict of logits
        and extras), from the trace's flat leaves; as they are where the graph's own code
        built that structure already (a dict taken for one leaf failed the rank)."""
        if not self.out_spec or pytree.tree_structure(flat) == self.out_spec:
            return flat
        leaves = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def share_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        """The trace holds the given tensors (the module's own parameters, or the whole
        copies ZeRO keeps) in place of the copies the export made."""
        for node in self.graph.graph.nodes:
            if node.op != "get_attr" or node.target not in params:
                continue
            value = params[str(node.target)]
            if isinstance(value, nn.Parameter):
                _assign(self.graph, str(node.target), value)
                continue
            holder, leaf = _slot(self.graph, str(node.target))
            holder._parameters.pop(leaf, None)
            setattr(holder, leaf, value)

    def place_on(self, device: torch.device, held: Collection[str]) -> None:
        """The trace on a GPU: what the export made on the CPU moved to `device`, the
        buffers and constants it reads (rotary frequencies, masks) and the device its
        factory and copy ops name (`arange(..., device=cpu)`, `.to(x.device)`); the
        tensors in `held` (the plan's weights) are where the plan put them. Parameters
        are never moved whole: a split model need not fit one device."""
        cpu = torch.device("cpu")
        for node in self.graph.graph.nodes:
            if node.op == "get_attr" and str(node.target) not in held:
                holder, leaf = _slot(self.graph, str(node.target))
                value = getattr(holder, leaf)
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                        and value.device != device:
                    setattr(holder, leaf, value.to(device))  # a buffer stays a buffer
            elif node.op == "call_function" and "device" in node.kwargs:
                named = node.kwargs["device"]
                if named is not None and torch.device(named) == cpu:
                    node.update_kwarg("device", device)
        self.graph.recompile()


#: the optimizer-step hooks `parallelize` registered, each with its module held weakly
_STEP_HOOKS: list[tuple[weakref.ref, Any]] = []


def _after_optimizer_steps(state: ParallelModule) -> Any:
    """`state.after_optimizer_step()` after every optimizer step on the module's
    parameters (torch's hook is global: it sees every optimizer). The hook holds the
    module weakly, so a process that parallelizes many modules (a notebook, a test
    session) does not keep them alive; the hooks of modules gone are removed at the next
    `parallelize` (not from inside a hook: torch is iterating over them then)."""
    for entry in [e for e in _STEP_HOOKS if e[0]() is None]:
        entry[1].remove()
        _STEP_HOOKS.remove(entry)
    held = weakref.ref(state)

    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found = held()
        if found is not None and found.weights.updates(optimizer):
            found.after_optimizer_step()

    handle = register_optimizer_step_post_hook(after)
    _STEP_HOOKS.append((held, handle))
    return handle


def unsplit(module: nn.Module, example: Mapping[str, torch.Tensor], seed: int = 0,
            saved: SavedTrace | None = None) -> nn.Module:
    """`module` running its trace on one device, dropout drawn as a split run draws it:
    the reference a parallelized run must equal (plain torch draws other masks). `saved`:
    its export, already written (`executor.module.trace.SavedTrace`)."""
    trace = _Trace.of(module, example, saved)
    trace.share_parameters(dict(module.named_parameters(remove_duplicate=False)))
    steps = [0]

    def forward(self: nn.Module, *args: Any, **kwargs: torch.Tensor) -> Any:
        steps[0] += 1
        return trace.outputs(run_unsplit(trace.graph, trace.inputs(args, kwargs), seed,
                                         steps[0]))

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return module


def parallelize(module: nn.Module, plan: Plan, example: Mapping[str, torch.Tensor],
                seed: int = 0, local: bool = True, saved: SavedTrace | None = None
                ) -> nn.Module:
    """`module`, trained from now on as `plan` says (module docstring). `example` is one
    global batch as the keyword inputs of `module`'s forward; `seed` the dropout draws'
    (the same on every rank, and in `unsplit`). `local=False` runs every op on DTensors,
    also those the plan leaves as data parallelism would (`executor.module.local`).
    `saved`: the module's export at `example`, written once for every rank
    (`executor.module.trace.SavedTrace`); without it each rank exports the module."""
    if not dist.is_initialized():
        raise ShardplanError("executor.parallelize needs an initialised process group "
                             "(torchrun, or torch.distributed.init_process_group)")
    check_degrees(plan.parallel, graph=False)
    refuse_stage_meshes(plan.mesh, plan.pipeline, "the executor")
    install_loss_handlers()  # (a mean-reduced MSE's gradient, else n times too large)
    if dist.get_world_size() != plan.mesh.size:
        raise ShardplanError(f"the plan is for {plan.mesh.size} devices; this process "
                             f"group has {dist.get_world_size()}")
    frozen = frozen_names(module)
    refuse_nothing_to_train(module)
    refuse_training_norms(module)
    trace = _Trace.of(module, example, saved)
    # parameters the forward never reads (the export leaves them out, and so does the
    # plan): no gradient reaches them, so they stay in the module as they are
    read = {str(n.target) for n in trace.graph.graph.nodes if n.op == "get_attr" and n.users}
    named = parameter_names(module)
    unused = [names for names in named if not read.intersection(names)]
    check_parameters(plan, [names for names in named if names not in unused], frozen)
    _check_parameter_shapes(plan, module)
    graph, user_inputs = trace.graph, trace.user_inputs
    traced = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    values = {n.name for n in graph.graph.nodes}
    layouts = read_layouts(plan, traced, values)
    missing = [n for n in user_inputs if n not in layouts.inputs]
    if missing:
        raise ShardplanError(f"the plan has no input named {', '.join(missing)}: it was "
                             "made from another export of the module")
    staged = _planning_graph(trace, plan) if plan.pipeline is not None and len(
        plan.pipeline.stages) > 1 else None
    stage = _Stage.of(plan, dist.get_rank())
    mesh = stage.torch_mesh(_device_type())
    held = stage.holds
    placed, aliases = _distribute_parameters(module, layouts, plan, mesh, stage.mesh, held)
    comm = MeshComm(plan.mesh, dist.get_rank(), Counters())
    tied = tied_groups(comm, stage.shared) if plan.pipeline is not None else {}
    reads = {alias: name for name, names in aliases.items() for alias in names}
    found = LocalPlan.of(graph, layouts, stage.mesh, reads) if local else LocalPlan.none()
    if staged is None:  # a pipeline's stages are cut at the trace's node names
        group_attention(graph, found.nodes,
                        {name for seg in layouts.recompute for name in (seg[0], seg[-1])})
    weights = WeightSync(plan.parallel.zero, stage.buckets(layouts.weights), comm,
                         placed, {name: tied[name] for name in placed if name in tied},
                         found.local_weights(graph, reads), found.batch_axes)
    for name, param in weights.parameters().items():
        for alias in aliases[name]:
            _assign(module, alias, param)
    # the trace holds the whole copies (ZeRO 3: without storage), not the module's own;
    # a pipeline stage none of the other stages' weights
    shared: dict[str, torch.Tensor] = {alias: weights.whole[name] for alias, name in
                                       reads.items()}
    held_frozen: dict[str, torch.Tensor] = {}
    for names in named:
        if names in unused:
            continue
        if names[0] in frozen:  # the trace reads its plain value, as a buffer's
            value = module.get_parameter(names[0]).detach()
            if mesh.device_type != "cpu":  # where the ranks compute (whole: it is small
                # next to what it saves, gradients and optimizer state, when trained)
                value = value.to(torch.device(mesh.device_type, torch.cuda.current_device()))
            shared.update((alias, value) for alias in names)
            held_frozen[next((n for n in names if n in plan.tensors), names[0])] = value
            continue
        if not any(n in shared for n in names):
            for alias in names:
                _drop(module, alias)
                shared[alias] = torch.empty(0)
    trace.share_parameters(shared)
    if mesh.device_type != "cpu":
        trace.place_on(torch.device(mesh.device_type, torch.cuda.current_device()), shared)
    state = ParallelModule(
        plan, mesh, ModulePlan.of(graph, layouts, stage.mesh, weights, reads,
                                  stage.local_rank, found), comm, trace,
        {name: placements(layouts.inputs[name], stage.mesh, f"input {name}")
         for name in user_inputs}, seed=seed, frozen=held_frozen)
    if staged is not None:
        state.pipeline, state.chunks = _schedule(state, staged)
    state.hook = _after_optimizer_steps(state)

    def forward(self: nn.Module, *args: Any, **kwargs: torch.Tensor) -> Any:
        return state.forward(trace.inputs(args, kwargs))

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    module.shardplan = state  # type: ignore[assignment]
    return module
