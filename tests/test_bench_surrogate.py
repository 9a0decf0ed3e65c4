"""The op-level search minimises what the plan builder prices, but for the gradient
reduction the built step hides behind the backward pass (`bench/surrogate.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import surrogate  # noqa: E402


@pytest.mark.parametrize("overlap", [0.0, 0.5])
def test_the_table_prices_the_built_step_with_the_reduction_exposed(
        tmp_path: Path, overlap: float) -> None:
    """On an fp32 model (no weight read twice) the solver's objective is the built step
    with its end-of-step gradient reduction exposed but for the `--overlap` share: a
    pricing change made to the table or to the builder alone shows here. The built step
    hides more of the reduction than the table counts (the schedule), so the table is
    the dearer of the two wherever a reduction runs."""
    case = surrogate.Case("llama-tiny", ("llama-tiny",), 4, 32, {"seq": 64},
                          ((4,), (2, 2)), overlap=overlap)
    rows = surrogate.measure(surrogate.build(case, tmp_path), case)
    assert [row.mesh for row in rows] == [(4,), (2, 2)]
    for row in rows:
        assert row.left == pytest.approx(0.0, abs=1e-9 * row.objective), row
    reduced = [row for row in rows if row.synced > 0]
    assert reduced, "a data-parallel mesh reduces gradients"
    for row in reduced:
        assert row.hidden > overlap * row.synced
        assert row.objective > row.step
