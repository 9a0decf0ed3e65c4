"""How a step's micro-batch losses add up to one process's loss over the whole step.

A step of several micro-batches runs `loss_fn` on each micro-batch's rows and sums the
gradients. That equals one process's loss and gradient over the step only if the step's
loss is the micro-batches' losses combined in a way fixed in advance: their mean where
`loss_fn` is a mean over its rows (gradient accumulation's assumption, the executor's
until this module), their sum where it is a sum over its rows (`reduction="sum"`, or a
sum divided by a constant). A sum was averaged: `cross_entropy(..., reduction="sum") / 8`
over two micro-batches trained with half one process's loss and gradients, exit 0. A loss
that divides by a count it takes itself (`sum / (labels != -100).sum()`) is neither:
each micro-batch divides by its own count, so rows weigh differently than in one
process's step (GPT-2's loss 3e-4 off one process's by step 3), again with exit 0.

`accumulation` finds which, on the first step, before any backward pass: `loss_fn` on
this rank's rows of the whole step, with made-up outputs (in (0.1, 0.9), each row uniform
over a spread of its own, float64, so that rows differ and nothing is sent), against its
values on those rows' micro-batches as the step computes them (a mean-reduced NLL divides
by the step's kept weight, `lossops.step_divisors`, which makes `ignore_index` and class
weights exact). One all-reduce of every rank's verdict, so that all take the same way: the
mean, else the sum, else a refusal naming the values. Micro-batches that keep equal
counts cannot tell a count of its own from a mean: the probe checks the loss's form on the
first step's rows.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from executor.module.lossops import KeptWeightCounter, MeanNll
from planner.errors import ShardplanError

#: how close (relative to the largest value) the whole's loss and the parts' combination
#: must be: float64 outputs leave rounding far below it, a loss computed in float32 too
_RTOL = 1e-5


class Accumulation(enum.Enum):
    """How the step's loss is made of its micro-batches' losses."""

    MEAN = "mean"
    SUM = "sum"

    def scale(self, micro_batches: int) -> float:
        """The factor on each micro-batch's loss under the executor's mean of them."""
        return float(micro_batches) if self is Accumulation.SUM else 1.0


class _RecordingMean(KeptWeightCounter):
    """While inside: each mean-reduced NLL is its own mean, its kept weight recorded."""

    def divided(self, summed: torch.Tensor, total_weight: torch.Tensor) -> Any:
        super().divided(summed, total_weight)
        return summed / total_weight, total_weight


class _FixedDivisors(MeanNll):
    """While inside: the i-th mean-reduced NLL divides by `divisors[i]`, as a micro-batch's
    does under the step's kept weights (`lossops.step_divisors`)."""

    def __init__(self, divisors: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.divisors, self.calls = tuple(divisors), 0

    def divided(self, summed: torch.Tensor, total_weight: torch.Tensor) -> Any:
        if self.calls >= len(self.divisors):
            raise ValueError("more NLL calls than the whole made")
        divisor = self.divisors[self.calls].to(total_weight.dtype)
        self.calls += 1
        return summed / divisor, divisor


def scaled(loss_fn: Callable[..., torch.Tensor], factor: float
           ) -> Callable[..., torch.Tensor]:
    """`loss_fn` times `factor` (itself where that is 1)."""
    if factor == 1.0:
        return loss_fn

    def times(*args: Any) -> torch.Tensor:
        return loss_fn(*args) * factor

    return times


def outputs_like(output: Any, rows: int, whole: int, local: int, made_up: bool = True) -> Any:
    """`output` (a micro-batch's) as `rows` rows: dim 0 of `whole` (the micro-batch's rows)
    or `local` (this rank's of them) becomes `rows`. With `made_up`, floating tensors hold
    values in (0.1, 0.9), each row uniform over a spread of its own, in float64 (a
    probability, a logit or a regression alike), the others zeros; else all are zeros of
    their own dtype (`lossops.step_kept_weights`' outputs)."""
    generator = torch.Generator().manual_seed(0)

    def shaped(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        device = value._local_tensor.device if isinstance(value, DTensor) else value.device
        shape = list(value.shape)
        if shape and shape[0] in (whole, local):
            shape[0] = rows
        if not made_up or not value.dtype.is_floating_point:
            return torch.zeros(shape, dtype=value.dtype, device=device)
        drawn = torch.rand(shape, generator=generator, dtype=torch.float64)
        if shape:  # each row spread differently: a mean over a row's classes differs too
            spread = torch.rand(shape[0], generator=generator, dtype=torch.float64)
            drawn = drawn * (0.1 + 0.9 * spread).reshape(-1, *[1] * (len(shape) - 1))
        return (0.1 + 0.8 * drawn).to(device)

    return pytree.tree_map(shaped, output)


def _rows_of(tree: Any, rows: int, start: int, count: int) -> Any:
    return pytree.tree_map(lambda v: v.narrow(0, start, count) if isinstance(
        v, torch.Tensor) and v.dim() and v.shape[0] == rows else v, tree)


def _value(loss: Any) -> float:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn did not return one value")
    return float(loss.detach().reshape(()))


def part_losses(loss_fn: Callable[..., torch.Tensor], outputs: Any,
                batch: Mapping[str, Any], rows: int, parts: int, kept_divisors: bool
                ) -> tuple[float, tuple[float, ...]] | None:
    """(the loss of `rows` rows, of each of their `parts` equal parts in turn, as the
    step's micro-batches compute them: with `kept_divisors` a mean-reduced NLL of a part
    divides by the whole's kept weight over the parts, `lossops.step_divisors`). None
    where `loss_fn` fails, or gives no finite value on the whole."""
    size = rows // parts
    try:
        with torch.no_grad():
            recorded = _RecordingMean()
            with recorded:
                whole = _value(loss_fn(outputs, batch))
            found = []
            for part in range(parts):
                args = (_rows_of(outputs, rows, part * size, size),
                        _rows_of(dict(batch), rows, part * size, size))
                if kept_divisors and recorded.weights:
                    with _FixedDivisors([w / parts for w in recorded.weights]):
                        found.append(_value(loss_fn(*args)))
                else:
                    found.append(_value(loss_fn(*args)))
    except Exception:  # (a loss that cannot run on made-up outputs: no verdict)
        return None
    return (whole, tuple(found)) if math.isfinite(whole) else None


def verdicts(found: tuple[float, tuple[float, ...]] | None) -> tuple[bool, bool]:
    """(the mean of the parts' losses gives the whole's, their sum does); both where the
    values cannot tell (none found, or the parts add up to nothing). A part's loss that is
    not finite (a count of its own that is 0 there) gives neither."""
    if found is None:
        return True, True
    whole, parts = found
    if not all(math.isfinite(v) for v in parts):
        return False, False
    scale = max(abs(whole), *(abs(v) for v in parts), 1e-30)

    def close(value: float) -> bool:
        return abs(value - whole) <= _RTOL * scale

    return close(sum(parts) / len(parts)), close(sum(parts))


def accumulation(loss_fn: Callable[..., torch.Tensor], outputs: Any,
                 batch: Mapping[str, Any], rows: int, micro_batches: int, kept_divisors: bool,
                 groups: Sequence[dist.ProcessGroup], device: torch.device) -> Accumulation:
    """The step's combination of its micro-batch losses (see the module doc), from this
    rank's `rows` rows of the step, the micro-batches' in turn (`outputs` made up:
    `outputs_like`), and every other rank's verdict in `groups` (one all-reduce).
    ShardplanError where `loss_fn` is neither a mean nor a sum over its rows."""
    found = part_losses(loss_fn, outputs, batch, rows, micro_batches, kept_divisors)
    mean, summed = verdicts(found)
    votes = torch.tensor([float(mean), float(summed), 1.0], dtype=torch.float64,
                         device=device)
    for group in groups:
        dist.all_reduce(votes, group=group)
    mean_votes, sum_votes, ranks = votes.tolist()
    if mean_votes == ranks:
        return Accumulation.MEAN
    if sum_votes == ranks:
        return Accumulation.SUM
    shown = (f": on this rank's rows of the first step it gives {found[0]:.6g}, on its "
             f"micro-batches' {', '.join(f'{v:.6g}' for v in found[1])}"
             if found is not None and not (mean and summed) else "")
    raise ShardplanError(
        f"loss_fn is neither a mean nor a sum over its rows{shown}; each of the plan's "
        f"{micro_batches} micro-batches would weigh its rows by a count of its own "
        "(a sum divided by a count of kept targets?), and the step's loss and gradients "
        "would differ from one process's. Take the mean with F.cross_entropy's "
        "ignore_index or weight (counted over the whole step), divide by a number that "
        "does not depend on the rows, or plan with --parallel micro_batches=1")
