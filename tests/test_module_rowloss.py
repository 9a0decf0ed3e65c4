"""The loss on each rank's rows (executor.module.rowloss): taken where DTensor shows it is
a sum or mean of per-rank terms, kept on DTensors where not, equal to one process either
way, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.module.launch import export_builder, train_module, train_module_reference
from planner.api import plan

MODELS = Path(__file__).resolve().parent / "rowloss_models.py"
BATCH, STEPS = 8, 3


# (the step averages its micro-batches' losses, as gradient accumulation of means does:
# a sum over rows, or a loss that couples rows, is the whole batch's with one micro-batch)
@pytest.mark.parametrize("builder,micro_batches,on_rows", [
    ("mean_loss", 2, True), ("sum_loss", 1, True), ("coupled_loss", 1, False)])
def test_a_loss_runs_on_rows_where_dtensor_shows_it_may(tmp_path: Path, builder: str,
                                                        micro_batches: int,
                                                        on_rows: bool) -> None:
    spec = f"{MODELS}:{builder}"
    path = export_builder(spec, BATCH, tmp_path / "mlp.onnx")
    chosen = plan(path, batch=BATCH, devices=2, profile="cpu",
                  parallel={"dp": 2, "tp": 1, "pp": 1, "zero": 0,
                                      "micro_batches": micro_batches})
    run = train_module(spec, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(spec, steps=STEPS, batch_size=BATCH)
    assert run.loss_on_rows is on_rows
    assert run.losses == pytest.approx(reference, rel=1e-5)
