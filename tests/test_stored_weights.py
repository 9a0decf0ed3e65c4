"""A run reads the weights the model stores, or refuses before any rank starts (issue 18):
a weights file that is truncated, a folder or there for some tensors only is refused
naming the tensor; only a model with no weight data at all trains on drawn weights, and
the run says so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from executor.weights import read_weights
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.errors import ModelError


def _external(tmp_path: Path) -> Path:
    family, config = zoo.preset("seed-mlp")
    model = zoo.build(family, config, with_weights=True, seed=1)
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.weights", size_threshold=0)
    return path


def test_external_weights_are_read(tmp_path: Path) -> None:
    path = _external(tmp_path)
    stored = read_weights(path)
    full = onnx.load(path)
    for init in full.graph.initializer:
        np.testing.assert_array_equal(stored.values[init.name],
                                      onnx.numpy_helper.to_array(init))
    assert stored.absent == () and stored.note == ""


@pytest.mark.parametrize(("damage", "message"), [
    ("truncate", r"initializer w1 needs bytes 0\.\.65536 of .*m\.weights, which has 100: "
                 r"the weights file is truncated"),
    ("folder", r"initializer w1 keeps its data in .*m\.weights, which is not a regular file"),
])
def test_a_damaged_weights_file_is_refused(tmp_path: Path, damage: str, message: str) -> None:
    path = _external(tmp_path)
    weights = tmp_path / "m.weights"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
        weights.mkdir()
    with pytest.raises(ModelError, match=message):
        read_weights(path, load=False)


def test_weights_there_for_some_tensors_only_are_refused(tmp_path: Path) -> None:
    family, config = zoo.preset("seed-mlp")
    model = zoo.build(family, config, with_weights=True, seed=1)
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=0)
    (tmp_path / "w2").unlink()
    with pytest.raises(ModelError, match=r"initializer w2 has no data .* while w1 has"):
        read_weights(path)


def test_a_run_without_weight_data_says_it_draws_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family, config = zoo.preset("seed-mlp")
    path = zoo.save(zoo.build(family, config), tmp_path / "z.onnx")  # weights declared only
    saved = tmp_path / "plan.json"
    plan(path, devices=2, batch=8, mode="data").save(saved)
    assert main(["run", str(path), "--plan", str(saved), "--nproc", "1", "--steps", "1"]) == 0
    assert "weights: 2 of the model's initializers have no data" in capsys.readouterr().err


def test_a_truncated_weights_file_stops_the_run_before_any_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _external(tmp_path)
    saved = tmp_path / "plan.json"
    plan(path, devices=2, batch=8, mode="data").save(saved)
    weights = tmp_path / "m.weights"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["run", str(path), "--plan", str(saved), "--nproc", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0]
