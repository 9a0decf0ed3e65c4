"""A pinned configuration's op-level layout is chosen under its memory limit."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from planner import zoo
from planner.api import plan

GIB = 1 << 30
PINS = {"dp": 2, "tp": 4, "pp": 1, "recompute": "full", "micro_batches": 1, "zero": 0}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers of Megatron-LM SC'21 Table 1's 7.5B row (hidden 4096, 32 heads, vocab
    51200, sequence 2048), bf16."""
    path = tmp_path_factory.mktemp("memory") / "gpt.onnx"
    onnx.save(zoo.build("gpt", layers=4, hidden=4096, heads=32, vocab=51200,
                        max_positions=2048, dtype="bfloat16"), path)
    return path


def _plan(path: Path, limit: float | None):
    # Megatron's configurations: its loss works on the vocabulary-split logits
    return plan(path, devices=8, batch=16, dims={"seq": 2048}, profile="a100-80g",
                parallel=PINS, memory_limit_gib=limit, loss_reads="as-is")


def test_the_pinned_layout_shards_weights_when_the_fastest_does_not_fit(gpt: Path) -> None:
    fastest = _plan(gpt, None)
    weights = fastest.model.parameters * 2  # bf16
    held = fastest.predicted.memory["parameters"]
    assert held > 1.5 * weights / 4  # the fastest layout keeps weights replicated over tp
    limit = 6.0  # the fastest layout needs 9.0 GiB
    assert fastest.predicted.memory["peak"] > limit * GIB
    fitted = _plan(gpt, limit)
    assert fitted.predicted.fits and fitted.predicted.memory["peak"] <= limit * GIB
    assert (fitted.parallel.dp, fitted.parallel.tp, fitted.parallel.zero) == (2, 4, 0)
    # Megatron's split: every weight matrix of the layers sharded over tp.
    assert fitted.predicted.memory["parameters"] <= 1.05 * weights / 4
    assert fitted.predicted.step_time_s >= fastest.predicted.step_time_s
    assert fitted.solver.objective == fitted.predicted.step_time_s
