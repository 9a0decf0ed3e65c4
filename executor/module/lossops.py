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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.distributed.tensor import DTensor


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
    return routed
