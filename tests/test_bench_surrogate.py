"""The op-level search minimises the price the plan builder gives the chosen plan
(`bench/surrogate.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import surrogate  # noqa: E402


def _rows(tmp_path: Path, zoo: tuple[str, ...], overlap: float) -> list[surrogate.Row]:
    case = surrogate.Case(zoo[0], zoo, 4, 32, {"seq": 64}, ((4,), (2, 2)), overlap=overlap)
    rows = surrogate.measure(surrogate.build(case, tmp_path), case)
    assert [row.mesh for row in rows] == [(4,), (2, 2)]
    assert any(row.synced > 0 for row in rows), "a data-parallel mesh reduces gradients"
    return rows


@pytest.mark.parametrize("zoo", [("llama-tiny",), ("llama-tiny", "--dtype", "bfloat16")])
def test_the_table_prices_the_step_the_plan_builder_prices(tmp_path: Path,
                                                           zoo: tuple[str, ...]) -> None:
    """Where the backward compute is long enough to hide the gradient reduction the
    schedule lets it hide, the solver's objective is the built step: the reduction is the
    gradient the precision keeps (fp32 under bf16-mixed, which the table once priced at
    the weight's 16 bits) and as much of it exposed as the built step exposes (the table
    once priced all of it). A pricing change made to the table or to the builder alone
    shows here."""
    for row in _rows(tmp_path, zoo, 0.0):
        assert row.hidden > 0 or row.synced == 0, row
        assert row.left == pytest.approx(0.0, abs=1e-9 * row.objective), row


def test_an_overlap_floor_is_hidden_weight_by_weight_in_the_table(tmp_path: Path) -> None:
    """`--overlap` hides at least its share of the whole reduction in the built step; the
    table, which is linear, applies it to each weight (the last bucket's included), so it
    is never the dearer of the two."""
    for row in _rows(tmp_path, ("llama-tiny",), 0.5):
        assert row.objective <= row.step * (1 + 1e-12), row
