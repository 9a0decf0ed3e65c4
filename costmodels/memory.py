"""Memory per device for a training step, by category.

Parameters and gradients are held in the model's dtype. Adam keeps two fp32 moments per
parameter, plus an fp32 master copy when the model trains in 16-bit (the "16 bytes per
parameter" of mixed-precision Adam); SGD with momentum keeps one fp32 buffer. ZeRO stage
1 shards optimizer states over the data-parallel degree, stage 2 gradients too, stage 3
parameters too. Activations are those saved for the backward pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}
MASTER_COPY_BYTES = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int

    @property
    def peak(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.workspace)

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}


def optimizer_state_bytes(
    parameter_elements: float, parameter_itemsize: int, optimizer: str
) -> float:
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
    parameter_bytes: float,
    parameter_elements: float,
    parameter_itemsize: int,
    activation_bytes: float,
    workspace_bytes: float,
    optimizer: str = "adam",
    zero: int = 0,
    dp: int = 1,
) -> MemoryBreakdown:
    """Per-device memory; all inputs are already local to one device (after op sharding)."""
    states = optimizer_state_bytes(parameter_elements, parameter_itemsize, optimizer)
    gradients = parameter_bytes
    parameters = parameter_bytes
    if zero >= 1:
        states /= dp
    if zero >= 2:
        gradients /= dp
    if zero >= 3:
        parameters /= dp
    return MemoryBreakdown(
        parameters=round(parameters), gradients=round(gradients), optimizer=round(states),
        activations=round(activation_bytes), workspace=round(workspace_bytes),
    )
