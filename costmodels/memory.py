"""Memory per device for a training step, by category.

Weights are held as the graph stores them; gradients, the fp32 master copy and the
optimizer's moments take the bytes per parameter of the training precision
(`costmodels.precision`: bf16-mixed Adam is Megatron's 2 + 4 + 4 + 8 = 18 bytes). ZeRO
stage 1 shards the optimizer (moments and master) over each weight's gradient group,
stage 2 gradients too, stage 3 weights too. Activations are those saved for the backward
pass. A precision whose optimizer reads fp32 main gradients cast from 16-bit ones at the
step (Megatron-LM's fp16) holds them only there, when no activations are kept: they
raise the transient `workspace` by what they need beyond the activations' bytes, so the
peak is the larger of the backward pass's and the step's. They are sharded with the
optimizer states (ZeRO 1 and up, Megatron-LM's distributed optimizer).
"""

from __future__ import annotations

from typing import TypeVar, cast

import numpy as np

from costmodels.precision import parameter_bytes as per_parameter
from planner.kinds import Precision
from planner.records import MemoryBreakdown

#: Bytes or element counts: one number, or one per stage range (the stage search).
Amount = TypeVar("Amount", float, "np.ndarray")


def optimizer_state_bytes(parameter_elements: Amount, parameter_itemsize: int,
                          optimizer: str, precision: Precision | None = None) -> Amount:
    """Bytes the optimizer holds for `parameter_elements` local parameter elements: its
    moments and the fp32 master copy of a mixed precision."""
    return parameter_elements * per_parameter(precision, parameter_itemsize,
                                              optimizer).optimizer


def gradient_bytes(parameter_elements: Amount, parameter_itemsize: int,
                   precision: Precision | None = None) -> Amount:
    """Bytes of the gradients of `parameter_elements` elements (fp32 main gradients under
    a mixed precision)."""
    return parameter_elements * per_parameter(precision, parameter_itemsize,
                                              "sgd").gradients


def training_memory(
    *,
    parameter_bytes: Amount,
    parameter_elements: Amount,
    parameter_itemsize: int,
    activation_bytes: Amount,
    workspace_bytes: Amount,
    optimizer: str = "adam",
    zero: int = 0,
    dp: int = 1,
    sharded_bytes: Amount | None = None,
    sharded_elements: Amount | None = None,
    rounded: bool = True,
    precision: Precision | None = None,
) -> MemoryBreakdown:
    """Per-device memory; all inputs are already local to one device (after op sharding).

    ZeRO shards over the group each gradient is reduced on: `sharded_bytes` and
    `sharded_elements` are the local weights divided by their groups (default: by `dp`).
    Stage 1 keeps the optimizer states of the shard only, stage 2 the gradients too,
    stage 3 the weights too. Inputs may be numpy arrays (the stage search prices every
    range at once); `rounded=False` keeps them unrounded.
    """
    if sharded_bytes is None:
        sharded_bytes = parameter_bytes / dp
    if sharded_elements is None:
        sharded_elements = parameter_elements / dp
    per = per_parameter(precision, parameter_itemsize, optimizer)
    states = (sharded_elements if zero >= 1 else parameter_elements) * per.optimizer
    gradients = (sharded_elements if zero >= 2 else parameter_elements) * per.gradients
    parameters = sharded_bytes if zero >= 3 else parameter_bytes
    if per.main_gradients:
        main = (sharded_elements if zero >= 1 else parameter_elements) * per.main_gradients
        workspace_bytes = cast(Amount, np.maximum(workspace_bytes, main - activation_bytes))
    parts = (parameters, gradients, states, activation_bytes, workspace_bytes)
    if rounded:
        return MemoryBreakdown(*(round(float(part)) for part in parts))
    return MemoryBreakdown(*parts)
