"""Memory per device for a training step, by category.

Parameters and gradients are held in the model's dtype. Adam keeps two fp32 moments per
parameter, plus an fp32 master copy when the model trains in 16-bit (the "16 bytes per
parameter" of mixed-precision Adam); SGD with momentum keeps one fp32 buffer. ZeRO stage
1 shards optimizer states over the data-parallel degree, stage 2 gradients too, stage 3
parameters too. Activations are those saved for the backward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from planner.records import MemoryBreakdown

if TYPE_CHECKING:
    import numpy as np

#: Bytes or element counts: one number, or one per stage range (the stage search).
Amount = TypeVar("Amount", float, "np.ndarray")

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}
MASTER_COPY_BYTES = 4


def optimizer_state_bytes(
    parameter_elements: Amount, parameter_itemsize: int, optimizer: str
) -> Amount:
    """Bytes of optimizer state for `parameter_elements` local parameter elements."""
    try:
        per_element = OPTIMIZER_STATE_BYTES[optimizer]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_BYTES)}"
        ) from None
    master = MASTER_COPY_BYTES if parameter_itemsize < 4 and per_element else 0
    return parameter_elements * (per_element + master)


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
    elements = sharded_elements if zero >= 1 else parameter_elements
    states = optimizer_state_bytes(elements, parameter_itemsize, optimizer)
    gradients = sharded_bytes if zero >= 2 else parameter_bytes
    parameters = sharded_bytes if zero >= 3 else parameter_bytes
    parts = (parameters, gradients, states, activation_bytes, workspace_bytes)
    if rounded:
        return MemoryBreakdown(*(round(float(part)) for part in parts))
    return MemoryBreakdown(*parts)
