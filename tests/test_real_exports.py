"""Real exports of more families (issue 16): the two exporters' graphs of one model plan
alike, and importing them is quiet."""

from __future__ import annotations

import warnings

import pytest

from planner.api import plan
from planner.importer import import_model


@pytest.mark.slow
def test_importing_t5_is_quiet(export_model) -> None:
    """Folding T5's relative-position buckets takes log(0); numpy's warning stays inside."""
    path = export_model("t5", "torchscript", opset=18)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = import_model(path, batch=2, dims={"seq": 16})
    assert graph.ops
    assert [str(w.message) for w in caught] == []


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "mistral", "bert"])
def test_both_exporters_plan_one_model_alike(export_model, model: str) -> None:
    """TorchScript and dynamo (its defaults: optimised) graphs of one model: every layer
    tied, predicted step times within 5 %."""
    steps = {}
    for exporter in ("torchscript", "dynamo"):
        path = export_model(model, exporter, opset=18, layers=4)
        result = plan(path, devices=8, batch=64, dims={"seq": 128})
        assert result.solver.detail.tied_layers, exporter
        assert len(result.units) >= 4, exporter
        steps[exporter] = result.predicted.step_time_s
    assert steps["dynamo"] == pytest.approx(steps["torchscript"], rel=0.05)
