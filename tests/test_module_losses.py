"""What a module's loss and forward may compute that DTensor or the export got wrong on
split rows, trained against one process: mean-reduced losses, reductions over the batch,
a loss making tensors of its own, `torch.var`.

torch 2.13's DTensor runs `F.mse_loss`'s backward kernel (and smooth L1's, Huber's, binary
cross-entropy's, soft margin's) on each rank's rows, dividing by the rows' element count:
the gradient of a mean over a batch split two ways came out twice one process's, the loss
value right, and a module trained with it drifted from one process with exit 0
(`executor.module.lossops`). A mean over the split rows (`h - h.mean(0)`) came out of
DTensor as a pending mean where the plan leaves a pending sum, which DTensor refuses to
redistribute: the rank failed ("Can not redistribute from P(avg) to P(sum)").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder
from executor.module.lossops import reduced_losses_without_rules
from planner.api import plan

BATCH = 4
STEPS = 3

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
        h = torch.tanh(self.a(x))
        return self.b({mixing})


def batch(step, rows):
    return {{"x": torch.randn(rows, 8, generator=torch.Generator().manual_seed(step))}}


def loss(out, b):
    return {loss}


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''

LOSSES = {
    "mse": 'F.mse_loss(out, torch.sin(b["x"][:, :6]))',
    "smooth_l1": 'F.smooth_l1_loss(out, torch.sin(b["x"][:, :6]))',
    "bce": 'F.binary_cross_entropy(torch.sigmoid(out), torch.sigmoid(b["x"][:, :6]))',
}


@pytest.mark.parametrize("name", LOSSES)
def test_a_mean_reduced_loss_trains_as_one_process_on_split_rows(tmp_path: Path,
                                                                 name: str) -> None:
    """The first step's gradient (the loss on DTensors) was twice one process's, a
    later step's right (the loss on each rank's rows): step 2 at 0.558404 against
    0.577999 for the MSE."""
    spec = _builder(tmp_path, "h * h", LOSSES[name])
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 0})
    # (after the first step, each rank computes the loss on its own rows)
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).loss_on_rows


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"dp": 2, "micro_batches": 2}],
                         ids=["dp", "dp-micro"])
def test_a_mean_written_as_a_sum_over_the_rows_trains_as_one_process(
        tmp_path: Path, parallel: dict) -> None:
    """`(...).sum() / out.shape[0]` is a pending sum on DTensors, each rank's term divided
    by the whole batch's rows, but on a rank's own rows by that rank's: the loss and the
    gradient came out twice one process's (0.686353 against 0.584880 at step 1). The
    loss on each rank's rows is now taken only where it gives DTensor's terms."""
    spec = _builder(tmp_path, "h", '((out - torch.sin(b["x"][:, :6])) ** 2).sum() / '
                                   'out.shape[0]')
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    assert not trains_as_one_process(spec, chosen, steps=STEPS,
                                     batch_size=BATCH).loss_on_rows


@pytest.mark.parametrize("mixing", ["h * h.sum(0, keepdim=True)", "h - h.mean(0, keepdim=True)"],
                         ids=["sum", "mean"])
def test_a_reduction_over_the_split_rows_trains_as_one_process(tmp_path: Path,
                                                               mixing: str) -> None:
    """Rows of the batch meet: the plan all-reduces the reduction's pending sum; the mean
    came out of DTensor as a pending mean and failed the rank."""
    spec = _builder(tmp_path, mixing, LOSSES["mse"])
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2})
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


def test_a_loss_making_a_tensor_of_its_own_trains_as_one_process(tmp_path: Path) -> None:
    """`torch.ones(out.shape)` in the loss met the split output as a plain tensor: the
    rank failed ("aten.sub.Tensor got mixed torch.Tensor and DTensor")."""
    spec = _builder(tmp_path, "h", "((out - torch.ones(out.shape)) ** 2).mean()")
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2})
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"tp": 2}], ids=["dp", "tp"])
def test_torch_var_in_the_forward_trains_as_one_process(tmp_path: Path,
                                                        parallel: dict) -> None:
    """The export decomposes `torch.var(..., keepdim=True)` to `prims.var` and
    `prims.broadcast_in_dim`, which autograd cannot run: the ranks and the one-process
    reference failed ("backwards not supported on prim")."""
    spec = _builder(tmp_path, "h / torch.sqrt(torch.var(h, dim=-1, keepdim=True) + 1e-5)",
                    LOSSES["mse"])
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


def test_a_loss_keeping_a_plain_tensor_for_its_backward_trains_as_one_process(
        tmp_path: Path) -> None:
    """`pos_weight` is a plain tensor BCE keeps for its backward pass, which ran outside
    the loss's implicit replication: the rank failed ("aten.mul.Tensor got mixed
    torch.Tensor and DTensor"), with micro-batches (the loss on DTensors)."""
    loss = ("F.binary_cross_entropy_with_logits(out, torch.sigmoid(b['x'][:, :6]), "
            "pos_weight=torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 1.5]))")
    spec = _builder(tmp_path, "h", loss)
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "micro_batches": 2})
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


def test_the_losses_dtensor_runs_on_blocks_are_found_in_torch() -> None:
    """The ops routed through their decompositions are found by what torch has (a
    `reduction` argument, a decomposition, no DTensor rule), not listed by hand; the
    ones that trained wrong are among them, the ones DTensor has rules for are not."""
    import torch

    found = set(reduced_losses_without_rules())
    aten = torch.ops.aten
    assert {aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
            aten.huber_loss_backward.default, aten.binary_cross_entropy_backward.default,
            aten.soft_margin_loss_backward.default} <= found
    assert aten.nll_loss_backward.default not in found  # DTensor's own rule


def _builder(folder: Path, mixing: str, loss: str) -> str:
    path = folder / "losses_module.py"
    path.write_text(BUILDER.format(mixing=mixing, loss=loss))
    return f"{path}:build"


KEPT = 'torch.where(b["x"][:, 6] > 0, b["x"][:, :6].argmax(1), -100)'
WEIGHTS = "torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 1.5])"
NORMALISED_BY_DATA = {
    "ignored": (f"F.cross_entropy(out, {KEPT})", True),
    "weighted": (f'F.cross_entropy(out, b["x"][:, :6].argmax(1), weight={WEIGHTS})', True),
    "nll": (f"F.nll_loss(F.log_softmax(out, -1), {KEPT}, weight={WEIGHTS})", True),
    "smoothed": (f"F.cross_entropy(out, {KEPT}, label_smoothing=0.1)", False),
    "masked": ('(((out - torch.sin(b["x"][:, :6])) ** 2).sum(1) * (b["x"][:, 6] > 0)).sum()'
               ' / (b["x"][:, 6] > 0).sum()', False),
}


@pytest.mark.parametrize("name", NORMALISED_BY_DATA)
def test_a_mean_over_kept_targets_trains_as_one_process_on_split_rows(
        tmp_path: Path, name: str) -> None:
    """A mean whose divisor depends on the data (targets ignored unevenly by rank, class
    weights, a mask): each rank's mean averaged gave 2.124399 against one process's
    2.032811 at step 1 for the cross-entropy with ignored targets, and the gradient on
    each rank's rows weighed the ranks' means equally. The negative log-likelihood now
    divides by the kept weight over the ranks, on DTensors and on each rank's rows (which
    it keeps); label smoothing's and a mask's means stay on DTensors, whose sums do it."""
    loss, on_rows = NORMALISED_BY_DATA[name]
    spec = _builder(tmp_path, "h", loss)
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2})
    run = trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)
    assert run.loss_on_rows is on_rows


@pytest.mark.parametrize(("name", "parallel"), [
    ("ignored", {"dp": 2, "micro_batches": 4}), ("weighted", {"dp": 2, "micro_batches": 4}),
    ("nll", {"dp": 2, "micro_batches": 4}),
    ("ignored", {"dp": 2, "zero": 3, "micro_batches": 2}),
    ("ignored", {"tp": 2, "micro_batches": 2}),
    ("ignored", {"pp": 2, "micro_batches": 4, "schedule": "1f1b"})],
    ids=["ignored", "weighted", "nll", "ignored-zero3", "ignored-tp", "ignored-pp"])
def test_a_mean_over_kept_targets_trains_as_one_process_over_micro_batches(
        tmp_path: Path, name: str, parallel: dict) -> None:
    """Each micro-batch's mean divided by its own kept weight weighs the micro-batches
    alike, where one process divides once by the step's: with ignored targets step 1
    came out NaN (a micro-batch with every target ignored). The step's kept weight is
    counted before its micro-batches (the loss on zeros for the output,
    `lossops.step_kept_weights`), and each micro-batch's divides by it. (Label
    smoothing's term and a mask's mean divide by counts of their own: refused over
    micro-batches, `tests/test_module_accumulation.py`.)"""
    loss, _ = NORMALISED_BY_DATA[name]
    spec = _builder(tmp_path, "h", loss)
    chosen = plan(export_builder(spec, 2 * BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=2 * BATCH, profile="cpu", parallel=parallel)
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=2 * BATCH)


def test_a_loss_dtensor_cannot_run_runs_on_whole_outputs(tmp_path: Path) -> None:
    """A boolean mask indexing the per-row losses has a data-dependent shape, which DTensor
    cannot propagate: the rank failed ("Sharding propagation failed for aten.index.Tensor").
    The loss now runs on whole outputs as plain tensors, as one process computes it."""
    loss = ('F.cross_entropy(out, b["x"][:, :6].argmax(1), reduction="none")'
            '[b["x"][:, 6] > 0].mean()')
    spec = _builder(tmp_path, "h", loss)
    chosen = plan(export_builder(spec, 2 * BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=2 * BATCH, profile="cpu", parallel={"dp": 2, "zero": 3})
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=2 * BATCH)
