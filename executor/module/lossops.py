"""Losses DTensor has no rule for, run as torch's own decompositions on every rank.

DTensor (torch 2.13) has no sharding rule for the elementwise losses that take a
`reduction` (`mse_loss`, `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy`,
`soft_margin_loss`, their backward kernels, the margin losses). It derives one by tracing
the op's decomposition, and then runs the fused kernel on each rank's block with the
placements it found. Under `reduction="mean"` the backward kernel divides by the block's
element count, not the tensor's: the gradient of `F.mse_loss` over a batch split over two
ranks came out twice the one-process gradient, its loss value right, so a module trained
with it diverged from one process with exit 0. The decompositions themselves
(`torch._decomp`) read the DTensor's global element count and run as pointwise ops and
reductions DTensor has rules for, with no communication the fused kernel would not have
needed; they are installed as DTensor's handlers for these ops, the hook torch's own
`loss_parallel` installs its loss handlers through. Which ops: every aten op with a
`reduction` argument that DTensor has no rule for and torch has a decomposition of, found
at install time, not listed by hand.

The negative log-likelihood (`F.nll_loss`, `F.cross_entropy`) with `reduction="mean"`
divides by the total weight of the targets it keeps (their count, or their classes'
weights): a count that depends on the data. DTensor's rule takes each rank's mean and
averages those (`Partial("avg")`), right only where every rank keeps the same weight:
with ignored targets or class weights, the value (2.124399 against one process's
2.032811 on two ranks) and, on each rank's rows, the gradient were wrong, with exit 0.
`nll_mean_over_ranks` computes the sum and divides by the total weight summed over the
ranks holding the rows, one scalar all-reduce; autograd keeps that total weight for the
backward kernel, so the gradient is one process's too. `KeptTargetsOverRanks` does the
same for the loss run on a rank's own rows (`executor.module.rowloss`), as plain tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._decomp import decomposition_table
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode

#: `reduction` as aten's loss kernels number it
_MEAN, _SUM = 1, 2
#: the negative log-likelihood's forward kernels (2-d, and 4-d for a map of targets)
NLL_FORWARDS = (torch.ops.aten.nll_loss_forward.default,
                torch.ops.aten.nll_loss2d_forward.default)


def _has_rule(op: torch._ops.OpOverload) -> bool:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return any(op in table for table in (propagator.op_strategy_funcs,
                                         propagator.op_single_dim_strategy_funcs,
                                         propagator.op_to_rules))


@functools.cache
def reduced_losses_without_rules() -> tuple[torch._ops.OpOverload, ...]:
    """The aten ops (functional overloads) that take a `reduction`, have a decomposition
    and no DTensor rule: DTensor would run their kernels on blocks."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            if schema.is_mutable or any(a.is_out for a in schema.arguments):
                continue
            if any(a.name == "reduction" for a in schema.arguments) \
                    and op in decomposition_table and not _has_rule(op):
                found.append(op)
    return tuple(found)


def _decomposed(op_call: torch._ops.OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> Any:
    """`op` on DTensors as torch's decomposition computes it: each of its ops through
    DTensor's own rules, every size it reads the whole tensor's."""
    decomposition: Callable[..., Any] = decomposition_table[op_call]
    return decomposition(*args, **kwargs)


@functools.cache
def install_loss_handlers() -> tuple[torch._ops.OpOverload, ...]:
    """Route the reduced losses DTensor has no rule for through their decompositions, once
    per process; the ops routed. A handler torch or the user has installed already (torch's
    `loss_parallel`) is left in place."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    routed = tuple(op for op in reduced_losses_without_rules() if op not in handlers)
    for op in routed:
        handlers[op] = _decomposed
    kept = tuple(op for op in NLL_FORWARDS if op not in handlers)
    for op in kept:
        handlers[op] = nll_mean_over_ranks
    return routed + kept


#: the step's kept weights, one per mean-reduced NLL call of a micro-batch's loss, each
#: divided by the micro-batches (`step_kept_weights`), while a micro-batch's loss runs
_STEP_DIVISORS: contextvars.ContextVar[tuple[torch.Tensor, ...] | None] = \
    contextvars.ContextVar("step_divisors", default=None)
#: the NLL calls made so far by the `loss_fn` call running (`one_loss_call`)
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("nll_calls",
                                                                        default=None)


@contextlib.contextmanager
def step_divisors(divisors: tuple[torch.Tensor, ...] | None) -> Iterator[None]:
    """While inside, the i-th mean-reduced NLL of each `loss_fn` call divides by
    `divisors[i]` (`step_kept_weights`), not by its own micro-batch's kept weight."""
    token = _STEP_DIVISORS.set(divisors)
    try:
        yield
    finally:
        _STEP_DIVISORS.reset(token)


@contextlib.contextmanager
def one_loss_call() -> Iterator[None]:
    """Around one call of `loss_fn`: its NLL calls are counted from the first."""
    token = _CALLS.set([0])
    try:
        yield
    finally:
        _CALLS.reset(token)


def _step_divisor() -> torch.Tensor | None:
    """The divisor of the NLL call being made, where the step's are known."""
    divisors, calls = _STEP_DIVISORS.get(), _CALLS.get()
    if divisors is None or calls is None or calls[0] >= len(divisors):
        return None
    calls[0] += 1
    return divisors[calls[0] - 1]


class MeanNll(TorchDispatchMode):
    """While inside: each mean-reduced NLL on plain tensors is computed as its sum and
    the total weight of the targets it keeps, and `divided` makes its result of them;
    every other op runs as it is."""

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in NLL_FORWARDS or args[3] != _MEAN:
            return func(*args, **kwargs)
        self_, target, weight, _, ignore_index = args
        return self.divided(*func(self_, target, weight, _SUM, ignore_index))

    def divided(self, summed: torch.Tensor, total_weight: torch.Tensor) -> Any:
        raise NotImplementedError


class KeptWeightCounter(MeanNll):
    """While inside: each mean-reduced NLL on plain tensors records the total weight of
    the targets it keeps (`weights`), and no collective is issued."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def divided(self, summed: torch.Tensor, total_weight: torch.Tensor) -> Any:
        self.weights.append(total_weight.detach().reshape(()))
        return summed, total_weight


#: the most mean-reduced NLL calls one loss may make for its step's weights to be counted
MAX_COUNTED_CALLS = 8


def step_kept_weights(loss_fn: Callable[..., torch.Tensor], zero_output: Any,
                      micro_batches: Sequence[Any], groups: Sequence[dist.ProcessGroup],
                      device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """The divisors that make each micro-batch's mean-reduced NLL a term of one
    process's mean over the whole step: the kept targets' total weight of the step, per
    NLL call of the loss, summed over the micro-batches and the ranks of `groups`, then
    divided by the micro-batches (the step divides each micro-batch's loss by their
    number). A micro-batch's mean divided by its own kept weight weighs every micro-batch
    the same, where one process divides once by the step's: with targets ignored
    unevenly the step's loss and gradient differed, and a micro-batch with every target
    ignored gave NaN. The kept weight depends on the targets alone, so `loss_fn` runs on
    `zero_output` (this rank's rows of the output, zeros) with each micro-batch's rows
    (this rank's), before any backward pass; one all-reduce on `device`, whose flags
    every rank reads alike. None where the loss makes no such call, makes over
    `MAX_COUNTED_CALLS`, makes a different number per micro-batch or rank, or fails on
    zeros."""
    counted: list[list[torch.Tensor]] = []
    try:
        for batch in micro_batches:
            counter = KeptWeightCounter()
            with torch.no_grad(), counter:
                loss_fn(zero_output, *batch)
            counted.append(counter.weights)
        calls = len(counted[0])
        valid = 0 < calls <= MAX_COUNTED_CALLS and all(len(c) == calls for c in counted)
    except Exception:  # (a loss that cannot run on zeros: each micro-batch's own mean)
        calls, valid = 0, False
    # [valid, calls, the weight of each call]: every rank reads the same sums
    buffer = torch.zeros(2 + MAX_COUNTED_CALLS, dtype=torch.float64, device=device)
    if valid:
        buffer[2:2 + calls] = torch.stack([torch.stack(c) for c in counted]).sum(0)
    buffer[0], buffer[1] = float(valid), float(calls)
    ranks = 1
    for group in groups:
        dist.all_reduce(buffer, group=group)
        ranks *= dist.get_world_size(group)
    flags = buffer[:2].tolist()  # (one wait, to decide)
    if flags != [ranks, ranks * calls] or not valid:
        return None
    dtype = counted[0][0].dtype
    return tuple((buffer[2 + call] / len(micro_batches)).to(dtype) for call in range(calls))


#: all-reduces `nll_mean_over_ranks` issued in this context (`kept_weight_sums`)
_KEPT_WEIGHT_SUMS: contextvars.ContextVar[int] = contextvars.ContextVar("kept_weight_sums",
                                                                        default=0)


@contextlib.contextmanager
def kept_weight_sums() -> Iterator[Callable[[], int]]:
    """While inside, count the all-reduces of kept targets' weights `nll_mean_over_ranks`
    issues: the one collective a loss on each rank's rows repeats itself
    (`KeptTargetsOverRanks`), so it does not make that loss non-local
    (`executor.module.rowloss.RowLoss.probe`). Yields the count so far."""
    token = _KEPT_WEIGHT_SUMS.set(0)
    try:
        yield _KEPT_WEIGHT_SUMS.get
    finally:
        _KEPT_WEIGHT_SUMS.reset(token)


@contextlib.contextmanager
def _without_handler(op: torch._ops.OpOverload) -> Iterator[None]:
    """DTensor's own rule for `op` while inside, its handler put back after (DTensor's
    dispatcher consults its handlers before its rules, so a handler wanting the rule for
    a case it leaves alone steps aside for the call)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        yield
    finally:
        handlers[op] = handler


def nll_mean_over_ranks(op_call: torch._ops.OpOverload, args: tuple[Any, ...],
                        kwargs: dict[str, object]) -> Any:
    """A mean-reduced negative log-likelihood on DTensors as one process computes it:
    the sum over the kept targets (DTensor's rule: pending over the ranks holding rows)
    divided by their total weight summed over those ranks, a pending sum of per-rank
    terms. Any other reduction is DTensor's rule as it is."""
    self, target, weight, reduction, ignore_index = args
    with _without_handler(op_call):
        if reduction != _MEAN:
            return op_call(*args, **kwargs)
        summed, total_weight = op_call(self, target, weight, _SUM, ignore_index)
    divisor = _step_divisor()
    if divisor is not None:  # (the step's, counted before its micro-batches)
        mesh = total_weight.device_mesh
        whole = DTensor(divisor.to(total_weight.device), DTensorSpec(
            mesh, (Replicate(),) * mesh.ndim,
            TensorMeta(divisor.shape, divisor.stride(), divisor.dtype)), requires_grad=False)
        return summed / whole, whole
    _KEPT_WEIGHT_SUMS.set(_KEPT_WEIGHT_SUMS.get() + sum(
        1 for p in total_weight.placements if not isinstance(p, Replicate)))
    whole = total_weight.redistribute(total_weight.device_mesh,
                                      [Replicate()] * total_weight.device_mesh.ndim)
    return summed / whole, whole


class KeptTargetsOverRanks(MeanNll):
    """While inside: a mean-reduced negative log-likelihood on plain tensors (a rank's
    own rows) divides its sum by the total weight of the targets kept on all the ranks of
    `groups` (one scalar all-reduce in each), not this rank's alone: the rank's term of
    one process's mean. The backward kernel reads the total weight the forward returned."""

    def __init__(self, groups: Sequence[dist.ProcessGroup]) -> None:
        super().__init__()
        self.groups = tuple(groups)

    def divided(self, summed: torch.Tensor, total_weight: torch.Tensor) -> Any:
        divisor = _step_divisor()
        if divisor is not None:  # (the step's, counted before its micro-batches)
            divisor = divisor.to(total_weight.device)
            return summed / divisor, divisor
        whole = total_weight.clone()
        for group in self.groups:
            dist.all_reduce(whole, group=group)
        return summed / whole, whole
