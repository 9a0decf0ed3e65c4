"""Data-parallel shares of the batch by speed on a mixed cluster (issue 17 item 6): the
replicas on the faster kind take more rows of each micro-batch, the stage runs at the
pace its slowest replica's rows make, the plan records the shares, validate checks them,
and the executors refuse them by name before any rank starts."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from costmodels.cluster import balanced_rows
from executor.support import check_degrees
from planner.api import plan
from planner.cli import main
from planner.cost.units import UnitProfile
from planner.errors import ShardplanError
from planner.kinds import Recompute
from planner.plans.model import Plan
from planner.plans.sections import ParallelConfig
from planner.validate import validate
from tests.clusters import a100_h100_file, eight_layers

BATCH, DIMS = 64, {"seq": 512}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shares")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    return eight_layers(folder)


@pytest.fixture(scope="module")
def a100_h100(folder: Path) -> Path:
    return a100_h100_file(folder)


@pytest.fixture(scope="module")
def shared(model: Path, a100_h100: Path) -> Plan:
    return plan(model, cluster=a100_h100, batch=BATCH, dims=DIMS, parallel={"pp": 1})


@pytest.fixture(scope="module")
def even(model: Path, a100_h100: Path) -> Plan:
    return plan(model, cluster=a100_h100, batch=BATCH, dims=DIMS,
                parallel={"pp": 1, "dp_shares": "even"})


def _makespan(rows: tuple[int, ...], seconds: list[float]) -> float:
    return max(r * t for r, t in zip(rows, seconds, strict=True))


def test_balanced_rows_are_proportional_and_optimal() -> None:
    assert balanced_rows(64, [1.0, 1.0, 0.5, 0.5]) == (11, 11, 21, 21)
    assert balanced_rows(8, [2.0] * 4) == (2, 2, 2, 2)
    assert balanced_rows(7, [1.0] * 4) == (2, 2, 2, 1)  # the first of equals
    assert balanced_rows(5, [1.0, 100.0, 1.0]) == (2, 1, 2)  # every replica keeps one
    draw = random.Random(7)
    for _ in range(200):
        count = draw.randint(1, 4)
        seconds = [draw.choice([0.3, 0.5, 1.0, 1.7, 2.0]) for _ in range(count)]
        total = draw.randint(count, 12)
        rows = balanced_rows(total, seconds)
        assert sum(rows) == total and min(rows) >= 1
        best = min(_makespan(c, seconds)
                   for c in itertools.product(range(1, total + 1), repeat=count)
                   if sum(c) == total)
        assert math.isclose(_makespan(rows, seconds), best)
    for total, seconds in ((3, [1.0] * 4), (4, [1.0, 0.0]), (4, [1.0, math.nan])):
        with pytest.raises(ValueError):
            balanced_rows(total, seconds)


def test_a_profile_with_more_rows_scales_what_runs_per_micro_batch() -> None:
    ones = np.ones(3)
    profile = UnitProfile(
        units=None, forward_compute=ones, backward_compute=2 * ones,  # type: ignore[arg-type]
        forward_communication=ones, backward_communication=ones, selective_extra=ones,
        saved={mode: ones for mode in Recompute}, transient={mode: ones for mode in Recompute},
        workspace=ones, params=(), crossings=(), weight_compute=ones, loss_read=ones)
    assert profile.with_rows(1.0) is profile
    more = profile.with_rows(1.5)
    assert np.allclose(more.forward, 3.0) and np.allclose(more.backward, 4.5)
    assert all(np.allclose(kept, 1.5) for kept in more.saved.values())
    assert more.params == profile.params


def test_the_faster_kind_takes_more_rows_and_the_step_is_faster(shared: Plan,
                                                                 even: Plan) -> None:
    shares = shared.parallel.dp_shares
    assert even.parallel.dp_shares == () and even.parallel.even_shares
    assert len(shares) == shared.parallel.dp == 16
    assert shared.pipeline is not None and sum(shares) == shared.pipeline.micro_batch_size
    a100 = shares[:8] if shared.cluster.groups[0].name == "a100" else shares[8:]
    h100 = shares[8:] if shared.cluster.groups[0].name == "a100" else shares[:8]
    assert min(h100) > max(a100)
    assert shared.predicted.step_time_s < even.predicted.step_time_s
    # the stage runs at its slowest replica's pace: no faster than an even split would
    # run on the faster kind alone (all replicas as fast as an H100 with even rows)
    assert shared.predicted.step_time_s > 0.5 * even.predicted.step_time_s


def test_the_ops_add_up_to_the_stage_they_run_in(shared: Plan) -> None:
    """The op entries are the slowest replica's, as the stage prices it: the stage's
    forward time (compute and collectives) is at least its ops' compute."""
    assert shared.pipeline is not None
    stage = shared.pipeline.stages[0]
    forward = sum(op.cost.forward_s for op in shared.ops if op.cost is not None)
    backward = sum(op.cost.backward_s for op in shared.ops if op.cost is not None)
    assert stage.forward_s >= forward * (1 - 1e-9)
    assert stage.backward_s >= backward * (1 - 1e-9)


def test_the_plan_file_keeps_the_shares_and_validate_checks_them(
        shared: Plan, model: Path, folder: Path) -> None:
    data = shared.to_json()
    assert data["parallel"]["dp_shares"] == list(shared.parallel.dp_shares)
    again = Plan.from_json(json.loads(json.dumps(data)))
    assert again.parallel.dp_shares == shared.parallel.dp_shares
    assert validate(again).ok
    path = folder / "shared.json"
    shared.save(path)
    assert main(["validate", str(path), str(model)]) == 0
    low, high = min(shared.parallel.dp_shares), max(shared.parallel.dp_shares)
    assert explain_text(path, low, high)
    wrong = json.loads(json.dumps(data))
    wrong["parallel"]["dp_shares"][0] += 1
    report = validate(Plan.from_json(wrong))
    assert any("add up to" in problem for problem in report.problems)
    wrong["parallel"]["dp_shares"] = wrong["parallel"]["dp_shares"][:4]
    assert any("4 shares for dp=16" in p for p in validate(Plan.from_json(wrong)).problems)


def explain_text(path: Path, low: int, high: int) -> bool:
    """Whether `shardplan explain` names the shares on its strategy line."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain", str(path)]) == 0
    strategy = next(line for line in out.getvalue().splitlines()
                    if line.startswith("strategy"))
    return f"dp_shares={low}-{high} rows by speed" in strategy


def test_shares_on_one_kind_of_device_are_reported(model: Path) -> None:
    one = plan(model, profile="a100-80g", devices=8, batch=BATCH, dims=DIMS,
               parallel={"pp": 1, "zero": 0, "micro_batches": 1})
    data: dict[str, Any] = one.to_json()
    data["parallel"]["dp_shares"] = [BATCH // 2, BATCH // 2]
    problems = validate(Plan.from_json(data)).problems
    assert any("one kind of device" in problem for problem in problems)


def test_the_executors_refuse_uneven_shares_by_name(shared: Plan, model: Path,
                                                    folder: Path) -> None:
    for graph in (True, False):
        with pytest.raises(ShardplanError, match=r"parallel\.dp_shares is \[.*dp_shares=even"):
            check_degrees(shared.parallel, graph=graph)
    check_degrees(ParallelConfig(dp=4, dp_shares=(2, 2, 2, 2)))  # even: runs
    path = folder / "run-shared.json"
    shared.save(path)
    code = main(["run", str(model), "--plan", str(path), "--nproc", "16", "--steps", "1"])
    assert code == 2


@pytest.mark.parametrize(("pins", "message"), [
    ({"dp_shares": "fair"}, "choose one of even, speed"),
    ({"dp_shares": "speed", "pp": 2}, "dp_shares=speed with pp=2"),
    ({"dp_shares": "speed", "dp": 1}, "dp_shares=speed with dp=1"),
])
def test_contradictory_share_pins_are_refused(model: Path, a100_h100: Path,
                                              pins: dict[str, Any], message: str) -> None:
    with pytest.raises(ShardplanError, match=message):
        plan(model, cluster=a100_h100, batch=BATCH, dims=DIMS, parallel=pins)


def test_shares_by_speed_need_a_mixed_cluster(model: Path) -> None:
    with pytest.raises(ShardplanError, match="only on a mixed cluster"):
        plan(model, profile="a100-80g", devices=8, batch=BATCH, dims=DIMS,
             parallel={"dp_shares": "speed"})
