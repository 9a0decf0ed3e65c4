"""`bench/scale.py` reads the CLI's progress lines and measures a plan in a fresh process."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from test_robustness import _save, chain_model

from planner.cli.progress import Progress

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import scale  # noqa: E402


def test_the_phases_are_read_from_the_lines_the_cli_prints() -> None:
    """The split points are the last op-level mesh's line and the joint search's, as
    `Progress` writes them (a change to either's wording shows here, not in a bench run)."""
    stream = io.StringIO()
    progress = Progress(stream, delay_s=0.0)
    for message in ("mesh 8: optimal 0.155858 s in 0.00 s", "mesh 2x4: skipped (no fit)",
                    "joint search: 3 of 72 configurations priced, 3 fit", "building"):
        progress(message)
    progress.close()
    found = {what.strip() for _, what in scale.PROGRESS.findall(stream.getvalue())}
    assert found == {"mesh", "joint search"}


def test_a_chain_is_planned_and_measured_in_a_fresh_process(tmp_path: Path) -> None:
    model = _save(chain_model(400, width=16), tmp_path / "chain" / "chain.onnx")
    run = scale.plan_once(REPO, model, tmp_path / "plan.json")
    assert run.seconds > 0 and run.peak_rss_bytes > 50 << 20
    assert run.plan_bytes == (tmp_path / "plan.json").stat().st_size > 0
