"""Interleaved 1F1B with any number of chunks per device and chunks of unequal time."""

from __future__ import annotations

import random
from pathlib import Path

import onnx
import pytest

from costmodels.schedule import interleaved_order, interleaved_time, pipeline_time
from executor.schedule import Chunk, Stages, schedule_actions
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.kinds import Schedule
from planner.search.joint import enumerate_choices
from planner.search.options import Pins
from planner.search.stages import chunk_layer_counts


def _simulate(p: int, v: int, m: int, forward: list[float], backward: list[float]) -> float:
    """Brute force: every device runs the executor's own action list; a pass starts when
    its device is free and its inputs are done (chunk k = slot·p + device)."""
    chunks = tuple(Chunk(k, k, k + 1, k % p, k // p) for k in range(p * v))
    stages = Stages(p, m, "interleaved", chunks, (), (), p * v - 1)
    todo = {d: schedule_actions(stages, d) for d in range(p)}
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    while any(todo.values()):
        for d in range(p):
            while todo[d]:
                a = todo[d][0]
                deps = ([("F", a.micro, a.chunk - 1)] if a.chunk else []) if a.kind == "F" \
                    else [("F", a.micro, a.chunk)] + (
                        [("B", a.micro, a.chunk + 1)] if a.chunk < p * v - 1 else [])
                if not all(x in end for x in deps):
                    break
                start = max([clock[d], *(end[x] for x in deps)])
                clock[d] = end[(a.kind, a.micro, a.chunk)] = start + (
                    forward if a.kind == "F" else backward)[a.chunk]
                todo[d].pop(0)
    return max(clock)


def _by_device(p: int, v: int, forward: list[float], backward: list[float]):
    return [[(forward[c * p + d], backward[c * p + d]) for c in range(v)] for d in range(p)]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 4), (3, 3, 6),
                                   (8, 3, 16), (2, 5, 2)])
def test_equal_chunks_follow_the_closed_form(p: int, v: int, m: int) -> None:
    """T = m·max_d t_d + (Σ_d t_d − max_d t_d)/v for any v, any forward:backward ratio."""
    for ratio in (1.0, 2.0, 3.0):
        forward, backward = [1.0] * (p * v), [ratio] * (p * v)
        t = v * (1.0 + ratio)
        closed = m * t + (p * t - t) / v
        assert _simulate(p, v, m, forward, backward) == pytest.approx(closed)
        assert pipeline_time([t] * p, m, "interleaved", v) == pytest.approx(closed)
        assert interleaved_time(_by_device(p, v, forward, backward), m) == pytest.approx(closed)


def test_unequal_chunks_are_priced_by_the_schedules_longest_path() -> None:
    """Uneven layer counts: the closed form is neither an upper nor a lower bound, the
    longest path is exact against the brute-force simulation."""
    rng = random.Random(7)
    above = below = 0
    for _ in range(40):
        p, v = rng.choice([2, 3, 4]), rng.choice([2, 3, 4])
        m = p * rng.choice([1, 2, 3])
        forward = [float(rng.choice([1, 2, 3])) for _ in range(p * v)]
        backward = [2 * f for f in forward]
        chunks = _by_device(p, v, forward, backward)
        exact = _simulate(p, v, m, forward, backward)
        totals = [sum(f + b for f, b in device) for device in chunks]
        assert interleaved_time(chunks, m) == pytest.approx(exact)
        assert pipeline_time(totals, m, "interleaved", v, chunks) == pytest.approx(exact)
        closed = m * max(totals) + (sum(totals) - max(totals)) / v
        above += exact > closed + 1e-9
        below += exact < closed - 1e-9
        assert m * max(totals) <= exact + 1e-9  # the busiest device's work
    assert above and below


@pytest.mark.parametrize("p,v,m", [(2, 3, 4), (4, 3, 8), (3, 4, 6)])
def test_the_pricing_and_the_executor_run_one_order(p: int, v: int, m: int) -> None:
    chunks = tuple(Chunk(k, k, k + 1, k % p, k // p) for k in range(p * v))
    stages = Stages(p, m, "interleaved", chunks, (), (), p * v - 1)
    for d in range(p):
        ran = [(a.kind == "F", a.micro, a.chunk) for a in schedule_actions(stages, d)]
        assert ran == [(f, i, s * p + d) for f, i, s in interleaved_order(p, v, m, d)]


def test_chunk_counts_cover_uneven_layers() -> None:
    assert chunk_layer_counts(36, 12)[0] == (3,) * 12
    for layers, pieces in ((7, 4), (10, 3), (105, 105), (38, 12)):
        found = chunk_layer_counts(layers, pieces)
        assert found and all(sum(c) == layers and min(c) >= 1 for c in found)
    assert chunk_layer_counts(3, 4) == []  # a chunk would hold no layer


def test_published_megatron_interleaved_configurations_are_expressible() -> None:
    """Megatron-LM SC'21: 530B (105 layers) at pp=35 with 3 chunks per device (1 layer
    each), and 4-chunk schedules: the joint search enumerates them."""
    pins = Pins(dp=3, tp=8, pp=35, micro_batches=35, zero=0, vpp=3)
    choices = enumerate_choices(840, 2520, 105, 8, pins)
    assert [(c.schedule, c.virtual_stages) for c in choices] == [(Schedule.INTERLEAVED, 3)]
    free = enumerate_choices(64, 64, 32, 8, Pins(pp=4, tp=8, dp=2, micro_batches=8, zero=0,
                                                 schedule=Schedule.INTERLEAVED))
    assert sorted(c.virtual_stages for c in free) == [2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sched") / "gpt7.onnx"
    onnx.save(zoo.build("gpt-tiny", layers=7, hidden=64, heads=4), path)
    return path


def test_vpp_pin_with_uneven_layers(gpt: Path) -> None:
    """7 layers, pp=2, 3 chunks per device: six chunks of unequal layer counts, round robin."""
    result = plan(gpt, devices=2, batch=16, dims={"seq": 16}, profile="a100-80g",
                  parallel={"pp": 2, "dp": 1, "tp": 1, "micro_batches": 4, "vpp": 3})
    pipe = result.pipeline
    assert pipe is not None and pipe.schedule == "interleaved" and pipe.virtual_stages == 3
    assert all(len(stage.ops) == 3 for stage in pipe.stages)
    assert result.parallel.to_json().get("vpp", 3) == 3
    assert result.solver.objective == result.predicted.step_time_s


@pytest.mark.parametrize("pins,needle", [
    ("pp=2,vpp=1", "vpp"), ("pp=2,vpp=3,schedule=1f1b", "vpp"), ("pp=2,vpp=x", "vpp"),
    ("pp=2,vpp=4,micro_batches=4", "interleaving")])
def test_bad_vpp_exit_2(gpt: Path, pins: str, needle: str, capsys) -> None:
    code = main(["plan", str(gpt), "--devices", "2", "--batch", "16", "--dim", "seq=16",
                 "--parallel", pins])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err and len(
        err.strip().splitlines()) == 1
