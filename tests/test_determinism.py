"""The same inputs give a byte-identical plan file: no wall-clock figures, sorted keys,
deterministic solvers (CP-SAT on one worker, the DP, the joint search)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from planner import zoo
from planner.cli import main
from planner.plans.model import Plan


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("det") / "gpt.onnx"
    onnx.save(zoo.build("gpt-tiny", layers=4), path)
    return path


@pytest.mark.parametrize("extra", [
    [],
    ["--parallel", "pp=2,micro_batches=4"],
    ["--solver", "cpsat"],
    ["--mode", "data"],
])
def test_same_inputs_give_byte_identical_plans(model: Path, tmp_path: Path,
                                               extra: list[str]) -> None:
    files = []
    for run in range(2):
        out = tmp_path / f"plan{run}.json"
        code = main(["plan", str(model), "--devices", "4", "--batch", "8", "--dim", "seq=16",
                     "-o", str(out), *extra])
        assert code == 0
        files.append(out.read_bytes())
    assert files[0] == files[1]
    solver = json.loads(files[0])["solver"]
    assert "time_s" not in solver and "solve_time_s" not in solver["detail"]


def test_old_plan_files_with_a_search_time_still_load(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(model), "--devices", "2", "--batch", "8", "--dim", "seq=16",
                 "-o", str(out)]) == 0
    text = out.read_text().replace('"solver": {', '"solver": {"time_s": 1.5, ', 1)
    out.write_text(text)
    assert Plan.load(out).solver.time_s == 1.5
