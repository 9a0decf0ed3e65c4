"""The module's weights as the plan synchronises them: gradient sums and ZeRO 1, 2 and 3.

Every weight collective the plan lists (`planner.sharding.weights.sync_steps` of its ZeRO
stage, bucketed by the plan builder) is issued here, one call per bucket, when the plan
issues it:

- ZeRO 0: the module's parameter is the weight itself, a DTensor in its plan layout; the
  gradient all-reduce buckets run when their last gradient is accumulated, in the last
  micro-batch of the step (behind the rest of the backward pass, as DDP does).
- ZeRO 1 and 2 (Rajbhandari et al. 2020): the module's parameter, what the optimizer
  updates, is this rank's flat chunk of the weight (its local block in the plan layout,
  flattened, zero-padded and cut into one equal chunk per rank of the weight's gradient
  group, as the ONNX runner's `executor.update` cuts it); the forward reads a whole copy
  that persists. The gradient is reduce-scattered into the chunks: once at the end of the
  step (stage 1, gradient phase) or after every micro-batch (stage 2, backward phase), and
  after `optimizer.step()` an all-gather rebuilds the whole copies (gradient phase).
- ZeRO 3: the same chunks, and no whole copy between uses: a bucket is gathered when the
  forward first reads one of its weights and freed after the last op that reads it; in
  the backward pass it is gathered again when autograd first needs a saved weight (a
  saved-tensor hook), and freed once its gradients are reduce-scattered. The whole copy
  keeps its storage object (resized to nothing and back, as FSDP does), so the tensors
  autograd saved see the data again.

A weight that only local ops read (`executor.module.local`: a replicated weight read by ops
on this rank's rows) is read as a plain leaf tensor sharing its block's storage, as DDP's
ranks read theirs: no DTensor round trip per read (`to_local` forward, `from_local` and a
DTensor gradient sum backward, three dispatches through DTensor's Python per weight and
micro-batch). Its gradient, this rank's share, accumulates on the leaf; the plan's reduction
sums it, and the parameter's gradient is set from the sum as a DTensor in the parameter's
placements, once per step.

Collectives go through `executor.runtime.MeshComm`, which counts them by kind, axes and
phase for the comparison with the plan.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from executor.module.layouts import WeightBucket
from executor.runtime import MeshComm
from planner.errors import ShardplanError
from planner.kinds import CollectiveKind, Phase


def _sole_count() -> int:
    """What `sys.getrefcount(d[key])` reads for an object that the dict `d` alone holds
    (measured, not assumed: interpreters count the call's own reference differently)."""
    held = {"probe": object()}
    return sys.getrefcount(held["probe"])


_SOLE = _sole_count()
#: the block a released gradient wrapper keeps until its refill (`WeightSync._release`)
_RELEASED = torch.empty(0)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a recompute runs inside one)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Weight:
    """One weight under ZeRO >= 1: its whole copy in the plan layout (a leaf DTensor the
    forward reads) and this rank's flat chunk of it (the module's parameter)."""

    name: str
    whole: DTensor
    chunk: nn.Parameter
    axes: tuple[str, ...]
    ranks: int  # in the gradient group
    index: int  # this rank's place in it
    present: bool = True  # the whole copy holds the data (ZeRO 3 frees it between uses)

    @property
    def local(self) -> torch.Tensor:
        return self.whole._local_tensor

    @property
    def numel(self) -> int:
        return self.local.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.local.element_size()

    def padded(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the local block) flat and zero-padded to ranks x chunk elements."""
        flat = torch.zeros(self.chunk.numel() * self.ranks, dtype=tensor.dtype,
                           device=tensor.device)
        flat[:tensor.numel()] = tensor.detach().reshape(-1)
        return flat

    def fill(self, flat: torch.Tensor) -> None:
        """Put the whole local block back from its flat (padded) elements, keeping the
        storage the tensors autograd saved point to."""
        local = self.local
        if not self.present:
            local.untyped_storage().resize_(self.nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(local):
            local.copy_(flat[:self.numel].view_as(local))
        self.present = True

    def free(self) -> None:
        self.local.untyped_storage().resize_(0)
        self.present = False


def _chunk_of(local: torch.Tensor, ranks: int, index: int) -> nn.Parameter:
    size = math.ceil(local.numel() / ranks)
    flat = torch.zeros(size * ranks, dtype=local.dtype, device=local.device)
    flat[:local.numel()] = local.detach().reshape(-1)
    return nn.Parameter(flat[index * size:(index + 1) * size].clone())


@dataclass
class _Bucket:
    plan: WeightBucket
    ready: set[str] = field(default_factory=set)


class WeightSync:
    """The plan's weight collectives on the module's weights (module docstring)."""

    def __init__(self, zero: int, buckets: Sequence[WeightBucket], comm: MeshComm,
                 placed: Mapping[str, nn.Parameter],
                 tied: Mapping[str, dist.ProcessGroup | None] | None = None,
                 local_reads: Collection[str] = (), batch_axes: tuple[str, ...] = ()
                 ) -> None:
        """`tied`: the weights two pipeline stages hold (a tied embedding and head), each
        with the group of its holders; their gradients are summed at the end of the step
        (`finish_step`), once every stage is done with its backward passes.
        `local_reads`: the weights only local ops read, on rows split over `batch_axes`
        (`executor.module.local.LocalPlan.local_weights`): read as plain leaves where the
        plan's reduction of their gradient is exactly the sum over `batch_axes`."""
        self.zero, self.comm = zero, comm
        self.tied = dict(tied or {})
        self.micro_batch_last = True  # the backward running ends the step's micro-batches
        self._flush_queued = False  # `_backward_ended` queued in this backward pass
        #: gradient all-reduces issued in this backward pass, not yet waited for
        #: (`_all_reduce`): work, the buffer of the sum, the bucket, its gradients, the
        #: weights of it that got none (`flush_unreached`)
        self._in_flight: list[tuple[Any, torch.Tensor, WeightBucket,
                                    Sequence[tuple[torch.Tensor, tuple[Placement, ...]]],
                                    frozenset[str]]] = []
        # the one reduction each gradient gets: DDP's all-reduce once per step, ZeRO 1's
        # reduce-scatter once per step, ZeRO 2 and 3's after every micro-batch
        self.reduction = (CollectiveKind.ALL_REDUCE, Phase.GRADIENT) if zero == 0 else (
            CollectiveKind.REDUCE_SCATTER, Phase.GRADIENT if zero == 1 else Phase.BACKWARD)
        self.weights: dict[str, Weight] = {}
        self.buckets = [_Bucket(b) for b in buckets]
        self._by_weight: dict[tuple[str, CollectiveKind, Phase], _Bucket] = {}
        axes_of: dict[str, tuple[str, ...]] = {}
        for bucket in self.buckets:
            for name in bucket.plan.tensors:
                if name not in placed:
                    raise ShardplanError(f"the plan synchronises {name}, which is not a "
                                         "parameter of the module")
                self._by_weight[(name, bucket.plan.kind, bucket.plan.phase)] = bucket
                axes_of[name] = bucket.plan.axes
        self.whole: dict[str, torch.Tensor] = dict(placed)  # what the forward reads
        if zero:
            for name, param in placed.items():
                self.weights[name] = self._shard(name, param, axes_of.get(name, ()))
                self.whole[name] = self.weights[name].whole
        # weight -> the plain leaf local ops read: its block's storage, and its version
        # counter (ZeRO 3's refill keeps what autograd saved valid for both)
        self.leaves: dict[str, torch.Tensor] = {}
        for name in local_reads:
            whole = self.whole[name]
            if isinstance(whole, DTensor) and self._reduced_over(name, batch_axes):
                self.leaves[name] = whole._local_tensor.detach().requires_grad_(
                    whole.requires_grad)
        # leaves whose gradient no collective touches (ZeRO 0, a gradient group of one
        # rank): the parameter's gradient is the leaf's, bound once (`_bind_gradients`)
        self._bound: dict[str, tuple[torch.Tensor, DTensor]] = {}
        self._binding = False  # a binding is queued for the end of this backward pass
        # the DTensor each bound parameter's gradient was last wrapped in, for the next
        # backward pass to refill when no one else holds it (`_bind_gradients`)
        self._wrappers: dict[str, DTensor] = {}
        # ZeRO 0 weights whose gradient the plan all-reduces: a gradient the user kept
        # from earlier steps (no `zero_grad`) is added to the step's sum, as eager torch
        # and DDP accumulate (`_set_gradient`); on a weight read as a DTensor, whose
        # gradient autograd accumulates on the parameter itself, it is set aside first
        # (`_carried`), or the plan's sum would count it once per rank
        self._carried: dict[str, torch.Tensor] = {}
        for name, tensor in self.whole.items():
            leaf = self.leaves.get(name)
            target = tensor if leaf is None else leaf
            if not target.requires_grad:
                continue
            if leaf is not None and name not in self.weights and \
                    (name, *self.reduction) not in self._by_weight:
                assert isinstance(tensor, DTensor)
                self._bound[name] = (leaf, tensor)
                leaf.register_post_accumulate_grad_hook(self._bind_later)
            else:
                target.register_post_accumulate_grad_hook(self._accumulated(name))
                if leaf is None and name not in self.weights and \
                        (name, *self.reduction) in self._by_weight:
                    target.register_hook(self._set_aside(name))
        self._registered = frozenset(id(p) for p in self.parameters().values())
        if zero == 3:
            for weight in self.weights.values():
                if weight.ranks > 1:
                    weight.free()

    def pending_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes over which the plan sums `name`'s gradient after the backward
        pass (its gradient's pending sum until then); () where it sums none."""
        bucket = self._by_weight.get((name, *self.reduction))
        return tuple(bucket.plan.axes) if bucket is not None else ()

    def _reduced_over(self, name: str, batch_axes: tuple[str, ...]) -> bool:
        """Whether the plan's reduction of `name`'s gradient sums exactly the shares of the
        ranks that split the batch (none where the batch is not split): what a leaf's
        gradient needs. Otherwise the weight stays a DTensor read, whose gradient's
        placements are checked against the plan (`_pending`)."""
        bucket = self._by_weight.get((name, *self.reduction))
        if bucket is None:
            return not batch_axes or self.comm.mesh.group_size(batch_axes) == 1
        return set(bucket.plan.axes) == set(batch_axes)

    def _shard(self, name: str, param: nn.Parameter, axes: tuple[str, ...]) -> Weight:
        value = param.data
        assert isinstance(value, DTensor)
        whole = value.detach().requires_grad_(param.requires_grad)
        assert isinstance(whole, DTensor)
        ranks = self.comm.mesh.group_size(axes) if axes else 1
        index = self.comm.group_rank(axes) if axes else 0
        if ranks == 1:  # nothing to shard over: the chunk is the block itself
            chunk = nn.Parameter(whole._local_tensor.view(-1),
                                 requires_grad=param.requires_grad)
        else:
            chunk = _chunk_of(whole._local_tensor, ranks, index)
            chunk.requires_grad_(param.requires_grad)
        return Weight(name, whole, chunk, axes, ranks, index)

    def parameters(self) -> dict[str, nn.Parameter]:
        """What the module registers under each weight's name: the weight (ZeRO 0) or
        this rank's chunk of it."""
        found: dict[str, nn.Parameter] = {}
        for name, param in self.whole.items():
            if name in self.weights:
                found[name] = self.weights[name].chunk
            else:
                assert isinstance(param, nn.Parameter)
                found[name] = param
        return found

    # -- the forward and backward passes -------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """The whole weight for an op of the forward pass (or of a recompute in the
        backward pass): gathered with its bucket first where ZeRO 3 freed it; its plain
        leaf where only local ops read it (`leaves`)."""
        weight = self.weights.get(name)
        if weight is not None and not weight.present:
            phase = Phase.BACKWARD if in_backward() else Phase.FORWARD
            self._gather(self._bucket(name, CollectiveKind.ALL_GATHER, phase))
        return self.leaves.get(name, self.whole[name])

    def release(self, names: Sequence[str]) -> None:
        """ZeRO 3: the forward pass is done with these weights (not in a recompute)."""
        if self.zero == 3 and not in_backward():
            for name in names:
                weight = self.weights.get(name)
                if weight is not None and weight.ranks > 1 and weight.present:
                    weight.free()

    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Around a forward pass (not a recompute): bound gradients follow what the user
        did to the parameters' gradients since the last backward pass
        (`_follow_parameter_gradients`); under ZeRO 3 a saved tensor that is (a view of)
        a freed weight is gathered back, with its bucket, when autograd unpacks it."""
        if self._bound:
            self._follow_parameter_gradients()
        if self.zero != 3:
            yield
            return
        storages = {w.local.untyped_storage()._cdata: w.name
                    for w in self.weights.values() if w.ranks > 1}

        def pack(tensor: torch.Tensor) -> Any:
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            name = storages.get(local.untyped_storage()._cdata) \
                if local.layout == torch.strided else None
            return (name, tensor)

        def unpack(packed: Any) -> torch.Tensor:
            name, tensor = packed
            if name is not None:
                self.read(name)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _bind_later(self, _: torch.Tensor) -> None:
        if not self._binding:
            self._binding = True
            torch.autograd.Variable._execution_engine.queue_callback(self._bind_gradients)

    def _bind_gradients(self) -> None:
        """The end of a backward pass: each bound parameter's gradient is its leaf's
        gradient, the same storage wrapped once as a DTensor in the parameter's spec.
        Later micro-batches and steps accumulate into it in place, as autograd does into
        any gradient, so nothing is handed over per weight and backward pass (DDP's
        ranks and eager torch do no more); a new gradient (the first backward pass after
        `zero_grad`, or one autograd made out of place) is wrapped again: in the
        wrapper of the last one where nothing but this object holds that (a DTensor is
        1.8 µs to make, 21 of them a step on the 2-layer LLaMA), else in a new one."""
        self._binding = False
        for name, (leaf, param) in self._bound.items():
            local = leaf.grad
            if local is None:
                continue
            grad = param.grad
            if isinstance(grad, DTensor) and grad._local_tensor is local:
                continue
            if grad is None and self._held_here(name):
                wrapper = self._wrappers[name]
                wrapper._local_tensor = local
            else:
                wrapper = self._wrappers[name] = DTensor(local, param._spec,
                                                         requires_grad=False)
            param.grad = wrapper

    def _held_here(self, name: str) -> bool:
        """Whether `name`'s last gradient wrapper is held by `_wrappers` alone: the user's
        `zero_grad()` let it go and kept no reference, so refilling it changes nothing
        anyone can see."""
        return name in self._wrappers and sys.getrefcount(self._wrappers[name]) == _SOLE

    def _release(self, name: str) -> None:
        """The cleared gradient's storage let go now, as `zero_grad()` lets it go in eager
        torch: a wrapper held here alone keeps an empty block until its refill; one the
        user still holds is theirs (never refilled)."""
        if self._held_here(name):
            self._wrappers[name]._local_tensor = _RELEASED
        else:
            self._wrappers.pop(name, None)

    def _set_aside(self, name: str) -> Callable[[torch.Tensor], None]:
        """A hook run before autograd accumulates into `name`'s parameter: a gradient it
        holds that is no pending sum (the user kept an earlier step's) moves aside until
        the step's sum is set (`_set_gradient`)."""
        param = self.whole[name]

        def aside(_: torch.Tensor) -> None:
            kept = param.grad
            if kept is None or name in self._carried:
                return
            if isinstance(kept, DTensor) and any(isinstance(p, Partial)
                                                 for p in kept.placements):
                return  # this step's own, from an earlier micro-batch
            self._carried[name] = kept
            param.grad = None
        return aside

    def _follow_parameter_gradients(self) -> None:
        """Before a forward pass: a parameter whose gradient the user cleared
        (`zero_grad()`) lets its leaf's go, so that the next backward pass starts anew;
        one whose gradient the user set has the leaf accumulate into it."""
        for name, (leaf, param) in self._bound.items():
            grad = param.grad
            if grad is None:
                if leaf.grad is not None:
                    leaf.grad = None
                    self._release(name)
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            if leaf.grad is not local:
                leaf.grad = local

    def _bucket(self, name: str, kind: CollectiveKind, phase: Phase) -> _Bucket:
        bucket = self._by_weight.get((name, kind, phase))
        if bucket is None:
            raise ShardplanError(f"the plan lists no {phase} {kind} of {name}, which "
                                 "this step needs")
        return bucket

    def _accumulated(self, name: str) -> Callable[[torch.Tensor], None]:
        kind, phase = self.reduction

        def done(_: torch.Tensor) -> None:
            if not self._flush_queued and in_backward():
                # (queued before any all-reduce's wait: a flush's reductions join them)
                self._flush_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._backward_ended)
            bucket = self._by_weight.get((name, kind, phase))
            if bucket is None:
                if phase == Phase.BACKWARD or self.micro_batch_last:
                    self._keep_local_gradient(name)
                return
            if phase == Phase.GRADIENT and not self.micro_batch_last:
                return  # the sum waits for the step's last micro-batch
            bucket.ready.add(name)
            if len(bucket.ready) == len(bucket.plan.tensors):
                bucket.ready.clear()
                self._reduce(bucket)
        return done

    def _keep_local_gradient(self, name: str) -> None:
        """A ZeRO weight no collective synchronises (its gradient group is one rank): its
        chunk is its whole block, and takes the gradient (its leaf's or its whole
        copy's) as it is. (A ZeRO 0 weight's is bound, `_bind_gradients`.)"""
        weight = self.weights.get(name)
        if weight is None:
            return
        leaf = self.leaves.get(name)
        if leaf is not None:
            local = leaf.grad
            leaf.grad = None
        elif weight.whole.grad is not None:
            grad = weight.whole.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            weight.whole.grad = None
        else:
            return
        if local is None:
            return
        part = local.reshape(-1)
        weight.chunk.grad = part if weight.chunk.grad is None else weight.chunk.grad + part

    def _backward_ended(self) -> None:
        """The end of a backward pass that reached a weight: the buckets waiting for one
        it did not reach reduced (`flush_unreached`), whoever drove the pass (`train_step`,
        a pipeline schedule, or a user's own `loss.backward()`)."""
        self._flush_queued = False
        self.flush_unreached(Phase.BACKWARD)
        if self.micro_batch_last:
            self.flush_unreached(Phase.GRADIENT)

    def flush_unreached(self, phase: Phase) -> None:
        """After the backward passes whose gradients `phase`'s reductions sum: a bucket
        some of whose weights got no gradient (a parameter only an output the loss does
        not read depends on) waited for them, so none of its gradients was summed and
        each rank stepped on its own rows' (exit 0, "collectives differ"). It is reduced
        now as the plan lists it, zeros in their place, and those weights keep no
        gradient, as in one process. A bucket none of whose weights got one is left: no
        weight of it is updated, as in one process."""
        kind, reduced = self.reduction
        if reduced != phase:
            return
        for bucket in self.buckets:
            plan = bucket.plan
            if plan.kind == kind and plan.phase == phase and bucket.ready and \
                    len(bucket.ready) < len(plan.tensors):
                missing = frozenset(plan.tensors) - bucket.ready
                bucket.ready.clear()
                self._reduce(bucket, missing)

    def _reduce(self, bucket: _Bucket, missing: frozenset[str] = frozenset()) -> None:
        plan = bucket.plan
        if plan.kind not in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER):
            raise ShardplanError(f"{plan.phase} {plan.kind} of {plan.tensors[0]}: not a "
                                 "gradient reduction")
        taken = [self._zeros(name) if name in missing else self._take_gradient(name, plan)
                 for name in plan.tensors]
        if plan.kind == CollectiveKind.ALL_REDUCE:
            self._all_reduce(plan, taken, missing)
        else:
            self._reduce_scatter(plan, [local for local, _ in taken], missing)

    def _zeros(self, name: str) -> tuple[torch.Tensor, tuple[Placement, ...]]:
        """What a weight that got no gradient adds to its bucket's reduction."""
        whole = self.whole[name]
        assert isinstance(whole, DTensor)
        return torch.zeros_like(whole._local_tensor), self._placements(whole)

    def _take_gradient(self, name: str, plan: WeightBucket
                       ) -> tuple[torch.Tensor, tuple[Placement, ...]]:
        """`name`'s gradient block before the bucket's reduction (taken off the leaf or
        the whole weight), with the placements it has once reduced."""
        leaf = self.leaves.get(name)
        whole = self.whole[name]
        if leaf is not None:
            local = leaf.grad
            assert local is not None  # its post-accumulate hook brought us here
            leaf.grad = None
            return local, self._placements(whole)
        grad = self._pending(name, plan)
        assert isinstance(whole, DTensor)
        done = tuple(q if isinstance(p, Partial) and axis in plan.axes else p
                     for axis, p, q in zip(self._axes(grad), grad.placements,
                                           whole.placements, strict=True))
        whole.grad = None
        return grad.to_local(), done

    @staticmethod
    def _placements(value: torch.Tensor) -> tuple[Placement, ...]:
        assert isinstance(value, DTensor)
        return tuple(value.placements)

    def _set_gradient(self, name: str, local: torch.Tensor,
                      placements: Sequence[Placement]) -> None:
        """The parameter's gradient: `local`, its block, as a DTensor in `placements`.
        In the parameter's own placements it shares the parameter's spec and is built by
        DTensor's constructor, as DTensor's ops build their results: a tenth of
        `from_local`'s host time (an autograd function and a spec per call), once per
        weight and step."""
        param = self.whole[name]
        assert isinstance(param, DTensor)
        if tuple(placements) == tuple(param.placements) and local.dtype == param.dtype \
                and local.shape == param._local_tensor.shape:
            grad = DTensor(local, param._spec, requires_grad=False)
        else:
            grad = DTensor.from_local(local, param.device_mesh, placements,
                                      shape=param.shape, stride=param.stride())
        kept = self._carried.pop(name, None)
        if kept is None and name in self.leaves:  # (autograd accumulates on the leaf:
            kept = param.grad  # the parameter's is what the user kept)
        if kept is None:
            param.grad = grad
        elif isinstance(kept, DTensor) and kept.placements == grad.placements:
            with torch.no_grad():
                kept._local_tensor.add_(grad._local_tensor)  # (zero_grad(set_to_none=False))
            param.grad = kept
        else:
            param.grad = kept + grad

    def _pending(self, name: str, plan: WeightBucket) -> DTensor:
        grad = self.whole[name].grad
        if not isinstance(grad, DTensor):
            raise ShardplanError(f"the gradient of {name} is not a DTensor")
        partial = {axis for axis, p in zip(self._axes(grad), grad.placements, strict=True)
                   if isinstance(p, Partial)}
        if not set(plan.axes) <= partial:
            raise ShardplanError(
                f"the gradient of {name} is {grad.placements}, not a pending sum over "
                f"{list(plan.axes)} as the plan's gradient {plan.kind} expects")
        return grad

    @staticmethod
    def _axes(value: DTensor) -> tuple[str, ...]:
        """The plan's axis names of a DTensor's mesh dims (a pipeline stage's DTensors
        live on the plan's mesh without pp)."""
        names = value.device_mesh.mesh_dim_names
        assert names is not None  # the executor names every mesh dim
        return tuple(names)

    def _all_reduce(self, plan: WeightBucket,
                    taken: Sequence[tuple[torch.Tensor, tuple[Placement, ...]]],
                    missing: frozenset[str] = frozenset()) -> None:
        """One all-reduce for the bucket's flat gradients; each parameter's gradient a
        view of the sum. Inside a backward pass it is issued without waiting, as DDP
        issues its buckets: the rest of the backward pass runs while it is on the wire
        (what the plan prices as hidden behind it), and the sums are waited for and made
        the gradients once the backward pass ends (an autograd callback), before any
        optimizer step can read them."""
        flat = torch.cat([local.reshape(-1) for local, _ in taken])
        if in_backward():
            work, summed = self.comm.all_reduce_async(flat, plan.axes, str(plan.phase))
            if not self._in_flight:
                torch.autograd.Variable._execution_engine.queue_callback(self._landed)
            self._in_flight.append((work, summed, plan, taken, missing))
            return
        self._set_sums(self.comm.all_reduce(flat, plan.axes, str(plan.phase)), plan, taken,
                       missing)

    def _landed(self) -> None:
        """The end of a backward pass: its all-reduces waited for, their sums made the
        parameters' gradients."""
        flying, self._in_flight = self._in_flight, []
        for work, summed, plan, taken, missing in flying:
            if work is not None:
                work.wait()
            self._set_sums(summed, plan, taken, missing)

    def _set_sums(self, summed: torch.Tensor, plan: WeightBucket,
                  taken: Sequence[tuple[torch.Tensor, tuple[Placement, ...]]],
                  missing: frozenset[str] = frozenset()) -> None:
        offset = 0
        for name, (local, done) in zip(plan.tensors, taken, strict=True):
            piece = summed[offset:offset + local.numel()].view_as(local)
            offset += local.numel()
            if name not in missing:
                self._set_gradient(name, piece, done)

    def _reduce_scatter(self, plan: WeightBucket, grads: Sequence[torch.Tensor],
                        missing: frozenset[str] = frozenset()) -> None:
        """One reduce-scatter for the bucket: the flat padded gradients (local blocks)
        laid out rank by rank, so that each rank receives the summed chunk of every
        weight."""
        weights = [self.weights[name] for name in plan.tensors]
        rows = [w.padded(g).view(w.ranks, -1)
                for w, g in zip(weights, grads, strict=True)]
        summed = self.comm.reduce_scatter_flat(torch.cat(rows, dim=1).reshape(-1),
                                               plan.axes, str(plan.phase))
        offset = 0
        for weight in weights:
            size = weight.chunk.numel()
            part = summed[offset:offset + size]
            offset += size
            chunk = weight.chunk
            if weight.name not in missing:
                chunk.grad = part.clone() if chunk.grad is None else chunk.grad + part
            if self.zero == 3:
                weight.free()

    def _gather(self, bucket: _Bucket) -> None:
        """One all-gather for the bucket: every rank's chunks, rank by rank."""
        plan = bucket.plan
        weights = [self.weights[name] for name in plan.tensors]
        flat = torch.cat([w.chunk.detach() for w in weights])
        ranks = weights[0].ranks
        gathered = self.comm.all_gather_flat(flat, plan.axes, str(plan.phase)).view(ranks, -1)
        offset = 0
        for weight in weights:
            size = weight.chunk.numel()
            weight.fill(gathered[:, offset:offset + size].reshape(-1))
            offset += size

    # -- the end of the step -------------------------------------------------------------

    def finish_step(self) -> None:
        """After a pipeline step's last backward pass: each tied weight's gradient summed
        between the stages holding it: the weight's (ZeRO 0), or under ZeRO this rank's
        chunk's, reduce-scattered alike on every holder (its stages share one mesh)."""
        for name, group in self.tied.items():
            weight = self.weights.get(name)
            grad = weight.chunk.grad if weight is not None else self.whole[name].grad
            if grad is None:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            local.copy_(self.comm.all_reduce_on(local, group, ("pp",), Phase.GRADIENT))

    def after_optimizer_step(self) -> None:
        """ZeRO 1 and 2: the whole copies rebuilt from the updated chunks."""
        if self.zero not in (1, 2):
            return
        for bucket in self.buckets:
            if bucket.plan.kind == CollectiveKind.ALL_GATHER and \
                    bucket.plan.phase == Phase.GRADIENT:
                self._gather(bucket)

    def resident_elements(self) -> int:
        """Elements of whole weights this rank holds now (ZeRO 3: none between steps)."""
        return sum(t._local_tensor.numel() if isinstance(t, DTensor) else t.numel()
                   for name, t in self.whole.items()
                   if name not in self.weights or self.weights[name].present)

    def updates(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` updates this module's parameters (its weights, or under
        ZeRO its chunks; asked after every step)."""
        return any(id(p) in self._registered for group in optimizer.param_groups
                   for p in group["params"])
