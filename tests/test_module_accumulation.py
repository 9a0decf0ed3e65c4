"""How a step's micro-batch losses make one process's loss (`executor.module.microloss`).

Every micro-batch's loss was averaged, as gradient accumulation assumes of a mean over
rows. A sum over the rows (`cross_entropy(..., reduction="sum") / 8`) then trained with
half one process's loss and gradients over two micro-batches, exit 0; a sum divided by a
count the loss takes itself (`sum / mask.sum()`) weighed each micro-batch's rows by its own
count. The first step now checks the loss's form on made-up outputs: a mean is averaged,
a sum summed, and anything else refused before any backward pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from module_runs import trains_as_one_process

from executor.module.launch import export_builder, train_module
from executor.module.microloss import Accumulation, accumulation, verdicts
from executor.ranks import RunFailed
from planner.api import plan
from planner.errors import ShardplanError

ROWS = 6
KEPT = torch.tensor([0, -100, 2, 1, 1, 3])  # the first half keeps 2, the rest 3


def _outputs(rows: int = ROWS) -> torch.Tensor:
    return 0.1 + 0.8 * torch.rand(rows, 4, generator=torch.Generator().manual_seed(1),
                                  dtype=torch.float64)


def _found(loss_fn, rows: int = ROWS, kept_divisors: bool = True) -> Accumulation:
    """The combination of two micro-batches of `rows` // 2 rows of `KEPT`."""
    batch = {"y": KEPT[:rows]}
    return accumulation(loss_fn, _outputs(rows), batch, rows, 2, kept_divisors, [],
                        torch.device("cpu"))


@pytest.mark.parametrize(("loss", "expected"), [
    (lambda o, b: F.cross_entropy(o, b["y"].clamp(min=0)), Accumulation.MEAN),
    (lambda o, b: F.mse_loss(o, torch.ones_like(o)), Accumulation.MEAN),
    (lambda o, b: F.cross_entropy(o, b["y"]), Accumulation.MEAN),  # the step's kept weight
    (lambda o, b: F.cross_entropy(o, b["y"].clamp(min=0), reduction="sum"), Accumulation.SUM),
    (lambda o, b: F.cross_entropy(o, b["y"].clamp(min=0), reduction="sum") / 8,
     Accumulation.SUM),
    (lambda o, b: F.cross_entropy(o, b["y"]) * o.shape[0], Accumulation.SUM),
], ids=["mean", "mse", "ignored", "sum", "sum-over-constant", "mean-times-rows"])
def test_the_loss_form_decides_how_micro_batches_combine(loss, expected) -> None:
    assert _found(loss) is expected


@pytest.mark.parametrize("loss", [
    lambda o, b: F.cross_entropy(o, b["y"], reduction="sum") / (b["y"] != -100).sum(),
    lambda o, b: F.cross_entropy(o, b["y"], label_smoothing=0.1),
    lambda o, b: F.cross_entropy(o, b["y"].clamp(min=0), reduction="sum") + o.mean(),
], ids=["sum-over-own-count", "label-smoothing", "sum-plus-mean"])
def test_a_loss_neither_a_mean_nor_a_sum_over_rows_is_refused_in_one_line(loss) -> None:
    with pytest.raises(ShardplanError, match=r"loss_fn is neither a mean nor a sum over "
                                             r"its rows: on this rank's rows .*; "
                                             r".* "
                                             r"--parallel micro_batches=1") as refused:
        _found(loss)
    assert "\n" not in str(refused.value)


def test_without_the_steps_kept_weight_an_ignored_target_mean_is_refused() -> None:
    """Where the step does not divide by its kept weight (`step_kept_weights` found no
    such call on every rank), each micro-batch's mean divides by its own."""
    with pytest.raises(ShardplanError, match="neither a mean nor a sum"):
        _found(lambda o, b: F.cross_entropy(o, b["y"]), kept_divisors=False)


def test_micro_batches_of_one_row_each_tell_a_sum_from_a_mean() -> None:
    """(The second row's target is ignored: the step's kept weight still divides it.)"""
    assert _found(lambda o, b: F.cross_entropy(o, b["y"]), rows=2) is Accumulation.MEAN
    assert _found(lambda o, b: F.cross_entropy(o, b["y"], reduction="sum"),
                  rows=2) is Accumulation.SUM
    with pytest.raises(ShardplanError, match=r"micro-batches' [\d.]+, nan;"):
        _found(lambda o, b: F.cross_entropy(o, b["y"], reduction="sum")
               / (b["y"] != -100).sum(), rows=2)


def test_a_loss_that_cannot_run_on_made_up_outputs_keeps_the_mean() -> None:
    def picky(o: torch.Tensor, b: dict) -> torch.Tensor:
        if o.dtype == torch.float64:
            raise TypeError("float32 only")
        return o.mean()

    assert _found(picky) is Accumulation.MEAN
    assert verdicts(None) == (True, True)
    assert verdicts((0.0, (0.0, 0.0))) == (True, True)  # nothing to tell them apart


BUILDER = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(step, rows):
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(step))
    x[:, 6] = torch.tensor([1.0, -1.0, -1.0]).repeat(rows)[:rows]  # rows 0, 3, 6 kept
    return {{"x": x}}


def loss(out, b):
    kept = torch.where(b["x"][:, 6] > 0, b["x"][:, :6].argmax(1), -100)
    return {loss}


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''
BATCH = 8


def _builder(folder: Path, loss: str) -> str:
    path = folder / "accumulated.py"
    path.write_text(BUILDER.format(loss=loss))
    return f"{path}:build"


@pytest.mark.parametrize("parallel", [
    {"dp": 2, "micro_batches": 2}, {"tp": 2, "micro_batches": 2},
    {"pp": 2, "micro_batches": 2, "schedule": "1f1b"}], ids=["dp", "tp", "pp"])
def test_a_sum_over_rows_trains_as_one_process_over_micro_batches(
        tmp_path: Path, parallel: dict) -> None:
    """`reduction="sum"` divided by a constant: step 1 was 0.898649 against one
    process's 1.797297 on dp=2 with two micro-batches."""
    spec = _builder(tmp_path, 'F.cross_entropy(out, b["x"][:, :6].argmax(1), '
                              'reduction="sum") / 8')
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    trains_as_one_process(spec, chosen, steps=3, batch_size=BATCH)


def test_a_mean_over_a_count_of_its_own_is_refused_before_training(tmp_path: Path) -> None:
    spec = _builder(tmp_path, 'F.cross_entropy(out, kept, reduction="sum") / '
                              '(kept != -100).sum()')
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "micro_batches": 2})
    with pytest.raises(RunFailed, match=r"rank \d failed \(loss_fn is neither a mean nor a "
                                        r"sum over its rows"):
        train_module(spec, chosen, steps=2, batch_size=BATCH)
