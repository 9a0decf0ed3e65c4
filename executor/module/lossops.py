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
    _KEPT_WEIGHT_SUMS.set(_KEPT_WEIGHT_SUMS.get() + sum(
        1 for p in total_weight.placements if not isinstance(p, Replicate)))
    whole = total_weight.redistribute(total_weight.device_mesh,
                                      [Replicate()] * total_weight.device_mesh.ndim)
    return summed / whole, whole


class KeptTargetsOverRanks(TorchDispatchMode):
    """While inside: a mean-reduced negative log-likelihood on plain tensors (a rank's
    own rows) divides its sum by the total weight of the targets kept on all the ranks of
    `groups` (one scalar all-reduce in each), not this rank's alone: the rank's term of
    one process's mean. The backward kernel reads the total weight the forward returned."""

    def __init__(self, groups: Sequence[dist.ProcessGroup]) -> None:
        super().__init__()
        self.groups = tuple(groups)

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in NLL_FORWARDS or args[3] != _MEAN:
            return func(*args, **kwargs)
        self_, target, weight, _, ignore_index = args
        summed, total_weight = func(self_, target, weight, _SUM, ignore_index)
        whole = total_weight.clone()
        for group in self.groups:
            dist.all_reduce(whole, group=group)
        return summed / whole, whole
