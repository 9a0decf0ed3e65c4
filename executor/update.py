"""The end of a training step: gradient sums, ZeRO sharding, the optimizer, tied weights.

Gradients are summed over the axes of the plan's weight collectives, and what runs is
what `planner.sharding.weights.sync_steps` lists for the plan's ZeRO stage, the table the
planner priced: an all-reduce (stage 0), after which every rank updates its whole weights;
or a reduce-scatter and an all-gather (stages 1 and 2), which shard the optimizer over the
same group (Rajbhandari et al. 2020): each weight is flattened and cut into one equal chunk
per rank, the gradient is reduce-scattered so each rank holds the sum of its chunk, the
rank's optimizer (whose state therefore has the chunk's size) updates the chunk, and an
all-gather rebuilds the weight everywhere. When the reduce-scatter is a per-micro-batch
(backward-phase) step, as in stage 2, it runs after every micro-batch and keeps only the
chunk of the gradient; otherwise the whole gradient accumulates first. Elementwise
optimizers (SGD, AdamW) give the same numbers either way.

A weight read by two pipeline stages (a tied embedding and head) lives on both; each copy
gets only its stage's gradient, so the holders sum their gradients (an all-reduce between
the ranks of equal dp/tp coordinates) before updating, and the copies stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from executor.runtime import MeshComm, PlanRunner
from planner.errors import ShardplanError
from planner.kinds import CollectiveKind
from planner.sharding.weights import sync_steps

OPTIMIZERS = ("sgd", "adamw")
ZERO_STAGES = (0, 1, 2)


def make_optimizer(tensors: Sequence[torch.Tensor], name: str,
                   lr: float) -> torch.optim.Optimizer:
    """Elementwise optimizers act on local shards exactly as on the whole tensor. A rank
    that updates nothing (a pipeline stage holding no weights) gets an optimizer of one
    empty group, whose step does nothing (torch refuses a plain empty list)."""
    groups = [{"params": list(tensors)}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ShardplanError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def check_zero(stage: int) -> None:
    """Refuse ZeRO stages this executor does not run, before any rank starts."""
    if stage not in ZERO_STAGES:
        raise ShardplanError(
            f"parallel.zero {stage}: the executor runs ZeRO stages 0-2; stage 3 (weights "
            "sharded and gathered for every micro-batch) is not built; re-plan with "
            "--parallel zero=2 or lower")


def tied_groups(comm: MeshComm, holders: Mapping[str, tuple[int, ...]]
                ) -> dict[str, dist.ProcessGroup | None]:
    """For each weight held by several pipeline stages, the group of its holders with this
    rank's dp/tp coordinates. Every rank creates every group, in one order."""
    if "pp" not in comm.mesh.axis_names:
        return {}
    pp_index = comm.mesh.axis_names.index("pp")
    ids = np.moveaxis(np.arange(comm.mesh.size).reshape(comm.mesh.shape), pp_index, 0)
    columns = ids.reshape(comm.mesh.shape[pp_index], -1)
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for stages in sorted({h for h in holders.values() if len(h) > 1}):
        for column in range(columns.shape[1]):
            ranks = [int(columns[s, column]) for s in stages]
            if len(stages) == comm.mesh.axis_size("pp"):
                group = comm.group(("pp",))
            else:
                group = dist.new_group(ranks)
            if comm.rank in ranks:
                made[stages] = group
    return {name: made[h] for name, h in holders.items() if h in made}


@dataclass
class _Shard:
    """One weight under ZeRO: this rank's chunk of it, flattened and padded."""

    param: torch.Tensor
    axes: tuple[str, ...]
    size: int  # ranks in the gradient group
    index: int  # this rank's chunk (its rank in the gradient group)
    leaf: torch.Tensor  # what the optimizer updates: the chunk
    grad: torch.Tensor | None = None  # the summed chunk of the gradient

    @property
    def chunk(self) -> int:
        return self.leaf.numel()

    def padded(self, tensor: torch.Tensor) -> torch.Tensor:
        """Flat, zero-padded to size × chunk elements."""
        flat = torch.zeros(self.chunk * self.size, dtype=tensor.dtype)
        flat[:tensor.numel()] = tensor.detach().reshape(-1)
        return flat


class WeightUpdate:
    """Reduce, exchange tied gradients, step the optimizer, rebuild sharded weights."""

    def __init__(self, runner: PlanRunner, zero: int, optimizer: str, lr: float,
                 tied: Mapping[str, dist.ProcessGroup | None] | None = None) -> None:
        check_zero(zero)
        self.runner, self.comm, self.zero = runner, runner.comm, zero
        scatters = [step for step in sync_steps(zero)
                    if step.kind == CollectiveKind.REDUCE_SCATTER]
        self.sharded = bool(scatters)  # the optimizer updates chunks of the weights
        self.scatter_each_micro_batch = any(step.per_micro_batch for step in scatters)
        self.tied = dict(tied or {})
        self.shards: dict[str, _Shard] = {}
        self.targets: dict[str, torch.Tensor] = {}  # checkpoint name -> optimizer tensor
        for name, param in sorted(runner.params.items()):
            if not param.requires_grad:
                continue
            axes = runner.gradient_axes.get(name, ())
            size = self.comm.mesh.group_size(axes) if axes else 1
            if self.sharded and size > 1:
                chunk = math.ceil(param.numel() / size)
                leaf = torch.zeros(chunk, dtype=param.dtype, requires_grad=True)
                self.shards[name] = _Shard(param, axes, size, self.comm.group_rank(axes), leaf)
                self.targets[f"{name}#zero{self.comm.group_rank(axes)}"] = leaf
            else:
                self.targets[name] = param
        self.optimizer = make_optimizer(list(self.targets.values()), optimizer, lr)

    def state_elements(self) -> int:
        """Elements of optimizer state this rank keeps (sharded under ZeRO >= 1)."""
        return sum(v.numel() for state in self.optimizer.state.values()
                   for v in state.values() if torch.is_tensor(v) and v.dim() > 0)

    def after_micro_batch(self) -> None:
        """ZeRO 2: reduce-scatter each gradient now and keep only this rank's chunk (the
        plan lists it as a backward collective: once per micro-batch)."""
        if not self.scatter_each_micro_batch:
            return
        for shard in self.shards.values():
            grad = shard.param.grad
            part = self._scatter(shard, grad if grad is not None else
                                 torch.zeros_like(shard.param), "backward")
            shard.grad = part if shard.grad is None else shard.grad + part
            shard.param.grad = None

    def step(self) -> None:
        """The end of the step: sums, the optimizer on chunks or weights, the gathers."""
        for name, param in sorted(self.runner.params.items()):
            if name in self.shards or not param.requires_grad:
                continue
            self._reduce_whole(name, param)
        for name, shard in sorted(self.shards.items()):
            if shard.grad is None:  # ZeRO 1 (stage 2 scattered every micro-batch already)
                grad = shard.param.grad
                shard.grad = self._scatter(shard, grad if grad is not None else
                                           torch.zeros_like(shard.param))
                shard.param.grad = None
            if name in self.tied:
                shard.grad = self.comm.all_reduce_on(shard.grad, self.tied[name], ("pp",),
                                                     "gradient")
            flat = shard.padded(shard.param)
            with torch.no_grad():
                shard.leaf.copy_(flat[shard.index * shard.chunk:(shard.index + 1) * shard.chunk])
            shard.leaf.grad, shard.grad = shard.grad, None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for shard in self.shards.values():
            whole = self.comm.all_gather_flat(shard.leaf, shard.axes, "gradient")
            with torch.no_grad():
                shard.param.copy_(whole[:shard.param.numel()].view_as(shard.param))

    def _reduce_whole(self, name: str, param: torch.Tensor) -> None:
        if name in self.tied:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = self.comm.all_reduce_on(grad, self.tied[name], ("pp",), "gradient")
        axes = self.runner.gradient_axes.get(name)
        if axes and param.grad is not None:
            param.grad = self.comm.all_reduce(param.grad, axes, "gradient")

    def _scatter(self, shard: _Shard, grad: torch.Tensor,
                 phase: str = "gradient") -> torch.Tensor:
        return self.comm.reduce_scatter_flat(shard.padded(grad), shard.axes, phase)
