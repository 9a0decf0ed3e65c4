"""Checkpoints of a parallelized module that any other plan of the module resumes.

A checkpoint holds every weight and every optimizer state tensor of the weight's shape as
a DTensor in the plan's layout of that weight: what `torch.distributed.checkpoint` saves
by global coordinates, each rank writing its own block once. Loading under another plan
(other dp/tp, another ZeRO stage, another device count) asks DCP for the blocks of the new
plan's layouts, which it reads from whatever blocks were written. Under ZeRO the module's
parameters and their optimizer state are flat chunks of a weight; they are gathered into
the weight's block for saving and cut back into chunks after loading (the gathers count
as phase "checkpoint", outside the plan's step). Scalars (AdamW's step) and the run's
position (training steps done, dropout draws) are saved as plain tensors, equal on every
rank. The folder is written atomically (`executor.checkpoint.write`), with shardplan's
marker; a resume with another optimizer is refused before any rank starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from executor.checkpoint import materialise_state, read, saved_keys, write
from executor.module.parallelize import ParallelModule
from executor.module.weights import Weight
from planner.errors import ShardplanError
from planner.plans.model import Plan

PHASE = "checkpoint"


@dataclass(frozen=True)
class Position:
    """Where a run is: training steps done and dropout draws made."""

    steps: int
    draws: int


@contextmanager
def _outside_step(state: ParallelModule) -> Iterator[None]:
    counters = state.comm.counters
    counters.outside_step = PHASE
    try:
        yield
    finally:
        counters.outside_step = None


def _block(state: ParallelModule, weight: Weight, chunk: torch.Tensor) -> torch.Tensor:
    """The local block of a weight-shaped tensor (the weight, or optimizer state of its
    shape) from this rank's flat chunk of it."""
    if weight.ranks == 1:
        return chunk.detach().view_as(weight.local)
    flat = state.comm.all_gather_flat(chunk.detach(), weight.axes, PHASE)
    return flat[:weight.numel].view(weight.local.shape)


def _as_weight(weight: Weight, local: torch.Tensor) -> DTensor:
    whole = weight.whole
    return DTensor.from_local(local, whole.device_mesh, whole.placements, shape=whole.shape,
                              stride=whole.stride(), run_check=False)


def _entries(state: ParallelModule, optimizer: torch.optim.Optimizer
             ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, Weight | None]]:
    """(key, the module's tensor, its checkpoint form, its ZeRO weight) for every weight
    and optimizer state tensor: a DTensor in the weight's plan layout, or a scalar."""
    sync = state.weights
    for name, param in sync.parameters().items():
        weight = sync.weights.get(name)
        if weight is None:
            yield f"model/{name}", param, param.detach(), None
        else:
            yield f"model/{name}", param, _as_weight(weight, _block(state, weight, param)), \
                weight
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not torch.is_tensor(value):
                raise ShardplanError(f"optimizer state {key} of {name} is not a tensor")
            if value.dim() == 0 or weight is None:
                yield f"optim/{name}/{key}", value, value.detach(), None
            else:
                yield f"optim/{name}/{key}", value, _as_weight(
                    weight, _block(state, weight, value)), weight
    for name, value in sorted(state.frozen.items()):  # whole, the same on every rank
        yield f"model/{name}", value, value, None


def newly_trained(held: frozenset[str]) -> frozenset[str]:
    """The weights a checkpoint holding `held` kept frozen: a value, no optimizer state
    (the checkpoint of an optimizer without state, SGD's, holds none for any weight)."""
    stateful = {key.split("/")[1] for key in held if key.startswith("optim/")}
    weights = {key[len("model/"):] for key in held if key.startswith("model/")}
    return frozenset(weights - stateful) if stateful else frozenset()


def refuse_pipelined(plan: Plan) -> None:
    """Checkpoints of pipeline plans are the ONNX runner's only, for now: each stage holds
    only its weights, which this writer does not merge yet."""
    if plan.pipeline is not None and len(plan.pipeline.stages) > 1:
        raise ShardplanError("checkpoints of a pipeline plan (pp="
                             f"{plan.parallel.pp}) are not written on the module path yet; "
                             "train it without --checkpoint/--resume, or plan with pp=1")


def save(directory: str | Path, state: ParallelModule, optimizer: torch.optim.Optimizer,
         steps: int, marker: dict[str, Any]) -> None:
    """Write the module's weights, `optimizer`'s state and the run's position, with the
    checkpoint's `marker` (`executor.checkpoint.marker_for`)."""
    refuse_pipelined(state.plan)
    with _outside_step(state):
        found = {key: saved for key, _, saved, _ in _entries(state, optimizer)}
    found["run/steps"] = torch.tensor(steps)
    found["run/draws"] = torch.tensor(state.draws)
    write(directory, found, marker)


def load(directory: str | Path, state: ParallelModule, optimizer: torch.optim.Optimizer
         ) -> Position:
    """Fill the module's weights and `optimizer`'s state from a checkpoint written under
    any plan of the same module (and the same optimizer); return where the run was."""
    refuse_pipelined(state.plan)
    with _outside_step(state):
        materialise_state(optimizer, state.weights.parameters().values())
        entries = list(_entries(state, optimizer))
    held = saved_keys(directory)
    unfrozen = newly_trained(held)
    # a weight the checkpoint kept frozen and this run trains: its value is read, its
    # optimizer state starts fresh, all zeros (AdamW's step, moments), as torch's
    # optimizer starts a parameter added to it (materialising the state took a step)
    fresh = [entry for entry in entries if entry[0].startswith("optim/")
             and entry[0].split("/")[1] in unfrozen and entry[0] not in held]
    with torch.no_grad():
        for _, tensor, _, _ in fresh:
            tensor.zero_()
    started = {entry[0] for entry in fresh}
    entries = [entry for entry in entries if entry[0] not in started]
    targets: dict[str, torch.Tensor] = {key: torch.empty_like(saved)
                                        for key, _, saved, _ in entries}
    targets["run/steps"] = torch.tensor(0)
    targets["run/draws"] = torch.tensor(0)
    read(directory, targets)
    with torch.no_grad():
        for key, tensor, _, weight in entries:
            loaded = targets[key]
            if weight is None:
                tensor.copy_(loaded)
                continue
            local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
            tensor.copy_(weight.padded(local).view(weight.ranks, -1)[weight.index])
            if key.startswith("model/") and weight.present:
                weight.fill(weight.padded(local))
    state.draws = int(targets["run/draws"])
    return Position(int(targets["run/steps"]), state.draws)
