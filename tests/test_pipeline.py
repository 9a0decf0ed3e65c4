"""Pipeline stages, micro-batches, ZeRO and recompute: the invariants the plans must keep."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest

from costmodels.profile import load_profile
from costmodels.schedule import bubble_fraction, in_flight, pipeline_time
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.cost.oplevel import price_graph
from planner.cost.pipeline import Pricer
from planner.cost.step import PipelineConfig, TrainingOptions
from planner.cost.units import Crossing, UnitProfile, unit_profile
from planner.importer import import_model
from planner.kinds import Recompute
from planner.layers import Units
from planner.plans.schema import SCHEMA_FILE
from planner.search.stages import StageTables, contiguous, interleaved
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.batch import data_parallel_strategies
from planner.sharding.derive import derive
from planner.sharding.mesh import DeviceMesh

GIB = 1 << 30


@pytest.fixture(scope="module")
def gpt8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipe") / "gpt8.onnx"
    onnx.save(zoo.build("gpt-tiny", layers=8, hidden=64, heads=4), path)
    return path


def _plan(path: Path, devices: int, attention: str | None = None, **pins):
    return plan(path, devices=devices, batch=16, dims={"seq": 16}, profile="a100-80g",
                parallel=pins, attention=attention)


# ---------------------------------------------------------------- schedule formulas


@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 4), (8, 32), (3, 7)])
def test_bubble_follows_the_schedule_formulas(stages: int, micro: int) -> None:
    expected = (stages - 1) / (micro + stages - 1)
    assert bubble_fraction(stages, micro, "1f1b") == pytest.approx(expected)
    assert bubble_fraction(stages, micro, "gpipe") == pytest.approx(expected)
    for chunks in (2, 4):
        interleaved_expected = (stages - 1) / (chunks * micro + stages - 1)
        assert bubble_fraction(stages, micro, "interleaved", chunks) == pytest.approx(
            interleaved_expected)


def test_pipeline_time_is_alpas_formula_for_unequal_stages() -> None:
    times = [1.0, 3.0, 2.0]
    assert pipeline_time(times, 5, "1f1b") == pytest.approx(sum(times) + 4 * 3.0)
    assert pipeline_time(times, 5, "interleaved", 1) == pytest.approx(
        pipeline_time(times, 5, "1f1b"))


def test_micro_batches_in_flight_per_schedule() -> None:
    assert [in_flight(s, 4, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2, "1f1b") for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(s, 4, 8, "gpipe") for s in range(4)] == [8] * 4
    # Megatron's warm-up for interleaving, p=4, v=2: device 0 holds 2·3 + 4 + 1 chunks.
    assert in_flight(0, 4, 8, "interleaved", 2) == pytest.approx(11 / 2)
    assert in_flight(3, 4, 8, "interleaved", 2) == pytest.approx(5 / 2)


# ---------------------------------------------------------------- units and the DP


def _uniform_profile(count: int, seconds: float, saved: float) -> UnitProfile:
    units = Units(tuple(range(count + 1)), tuple(f"layer {k}" for k in range(count)),
                  tuple(range(count)))
    zeros = np.zeros(count)
    return UnitProfile(
        units, forward_compute=np.full(count, seconds / 3),
        backward_compute=np.full(count, 2 * seconds / 3),
        forward_communication=zeros.copy(), backward_communication=zeros.copy(),
        selective_extra=zeros.copy(),
        saved={Recompute.NONE: np.full(count, saved),
               Recompute.SELECTIVE: np.full(count, saved / 2),
               Recompute.FULL: np.full(count, saved / 8)},
        transient={Recompute.NONE: zeros.copy(), Recompute.SELECTIVE: np.full(count, saved / 2),
                   Recompute.FULL: np.full(count, saved * 7 / 8)},
        workspace=zeros.copy(), params=(), crossings=(), weight_compute=zeros.copy(),
        loss_read=zeros.copy())


def test_equal_stages_take_m_plus_p_minus_1_slots() -> None:
    profile = _uniform_profile(8, 1.0, 0.0)
    hardware = load_profile("a100-80g")
    for pp, micro in ((2, 4), (4, 4), (4, 16), (8, 8)):
        mesh = DeviceMesh.build({"pp": pp}, 8)
        per_stage = 8 // pp
        price = Pricer(profile, PipelineConfig(pp=pp, micro_batches=micro), hardware,
                       mesh).price(contiguous(list(range(0, 9, per_stage))),
                                   [Recompute.NONE] * pp)
        assert price.pipeline_s == pytest.approx((micro + pp - 1) * per_stage)
        idle = 1 - micro * per_stage / price.pipeline_s
        assert idle == pytest.approx(bubble_fraction(pp, micro))


def _brute_force(tables: StageTables, pp: int, limit: float) -> float:
    """The least bottleneck load over every placement of pp − 1 cuts (recompute "none")."""
    n, m = tables.n, tables.config.micro_batches
    per_micro = tables.time[Recompute.NONE] + tables.p2p + tables.totals.micro
    cost = m * per_micro + tables.totals.end + tables.totals.optimizer
    best = np.inf
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        loads = []
        for stage, (a, b) in enumerate(itertools.pairwise(bounds)):
            if tables.memory(Recompute.NONE, stage)[a, b] > limit:
                break
            loads.append(cost[a, b])
        else:
            best = min(best, max(loads))
    return best


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_partition_dp_equals_brute_force(gpt8: Path, pp: int) -> None:
    analysis = GraphAnalysis.of(import_model(gpt8, batch=4, dims={"seq": 16}))
    hardware = load_profile("a100-80g")
    mesh = DeviceMesh.build({"pp": pp}, 8)
    priced = price_graph(derive(analysis, mesh, {}), hardware, TrainingOptions())
    profile = unit_profile(priced, analysis.units)
    config = PipelineConfig(pp=pp, micro_batches=4)
    tables = StageTables(Pricer(profile, config, hardware, mesh))
    for limit in (np.inf, 0.6 * tables.memory(Recompute.NONE, 0)[0, -1]):
        found = tables.solve(limit, [Recompute.NONE])
        expected = _brute_force(tables, pp, limit)
        if found is None:
            assert expected == np.inf
            continue
        cuts, _ = found
        per_micro = tables.time[Recompute.NONE] + tables.p2p + tables.totals.micro
        cost = 4 * per_micro + tables.totals.end + tables.totals.optimizer
        achieved = max(cost[a, b] for a, b in itertools.pairwise(cuts))
        assert achieved == pytest.approx(expected)


def test_a_one_stage_pipeline_builds_one_row_of_the_full_tables(gpt8: Path) -> None:
    analysis = GraphAnalysis.of(import_model(gpt8, batch=4, dims={"seq": 16}))
    hardware = load_profile("a100-80g")
    mesh = DeviceMesh.build({"dp": 8}, 8)
    priced = price_graph(derive(analysis, mesh, {}), hardware, TrainingOptions())
    profile = unit_profile(priced, analysis.units)
    one = StageTables(Pricer(profile, PipelineConfig(pp=1, micro_batches=2), hardware, mesh))
    every = StageTables(Pricer(profile, PipelineConfig(pp=2, micro_batches=2), hardware, mesh))
    n = profile.count
    assert one.time[Recompute.NONE].shape == (1, n + 1)
    assert every.time[Recompute.NONE].shape == (n + 1, n + 1)
    for mode in (Recompute.NONE, Recompute.FULL):
        for name in ("time", "saved", "transient"):
            assert np.array_equal(getattr(one, name)[mode], getattr(every, name)[mode][:1])
    assert np.array_equal(one.received, every.received[:1])
    assert np.array_equal(one.workspace, every.workspace[:1])
    assert one.solve(np.inf, [Recompute.NONE]) == ([0, n], [Recompute.NONE])


def test_a_20000_way_fan_out_at_one_stage_builds_nothing_quadratic() -> None:
    """Every unit's output read by the last: the old tables were (units + 1)² per entry
    (20,000 units: 3.2 GB each) and visited every start of every crossing."""
    count = 20_000
    base = _uniform_profile(count, 1e-3, 1e6)
    crossings = tuple(Crossing(f"t{u}", 1e3, u, (count - 1,), True) for u in range(count - 1))
    profile = dataclasses.replace(base, crossings=crossings)
    hardware = load_profile("a100-80g")
    mesh = DeviceMesh.build({"dp": 8}, 8)
    started = time.perf_counter()
    tables = StageTables(Pricer(profile, PipelineConfig(pp=1), hardware, mesh))
    assert tables.solve(np.inf, [Recompute.NONE]) == ([0, count], [Recompute.NONE])
    assert tables.received[0, -1] == 0  # nothing crosses into the one stage
    assert time.perf_counter() - started < 10


def test_units_are_prefix_layers_suffix(gpt8: Path) -> None:
    graph = import_model(gpt8, batch=2, dims={"seq": 16})
    units = GraphAnalysis.of(graph).units
    assert len(units.layer_units) == 8
    assert units.names[0] == "prefix" and units.names[-1] == "suffix"
    assert units.bounds[0] == 0 and units.bounds[-1] == len(graph.ops)
    assert interleaved(units, 2, 2) is not None and interleaved(units, 3, 2) is None


# ---------------------------------------------------------------- plans


def test_single_stage_price_equals_the_assembled_plan(gpt8: Path) -> None:
    """The pipeline pricer and the op-level plan agree when there is nothing to pipeline."""
    analysis = GraphAnalysis.of(import_model(gpt8, batch=16, dims={"seq": 16}))
    hardware = load_profile("a100-80g")
    mesh = DeviceMesh.build({"dp": 4}, 8)
    strategies = data_parallel_strategies(analysis.graph, mesh, analysis.labels)
    priced = price_graph(derive(analysis, mesh, strategies), hardware, TrainingOptions())
    op_plan = priced.step()
    units = analysis.units
    profile = unit_profile(priced, units)
    price = Pricer(profile, PipelineConfig(), hardware, mesh).price([[(0, units.count)]],
                                                                   [Recompute.NONE])
    assert price.step_time_s == pytest.approx(op_plan.step_time_s, rel=1e-9)
    memory = price.stages[0].memory.to_json()
    for key, value in op_plan.stages[0].memory.items():
        assert memory[key] == pytest.approx(value, abs=2), key


def test_more_stages_hold_fewer_parameters(gpt8: Path) -> None:
    peaks = []
    for pp in (1, 2, 4, 8):
        result = _plan(gpt8, pp, pp=pp, dp=1, tp=1, micro_batches=8, zero=0)
        assert result.parallel.pp == pp
        stage_params = [row.memory["parameters"] for row in result.pipeline.stages]
        assert len(stage_params) == pp
        peaks.append(max(stage_params))
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert peaks[-1] < peaks[0] / 3


def test_zero_stages_cut_exactly_their_share(gpt8: Path) -> None:
    """dp = 4 and no tensor split: every gradient is reduced over dp, so ZeRO-k divides
    states (k ≥ 1), gradients (k ≥ 2) and weights (k = 3) by exactly 4."""
    memory = {}
    for zero in range(4):
        result = _plan(gpt8, 4, dp=4, tp=1, pp=1, micro_batches=1, zero=zero,
                       recompute="none")
        assert result.parallel.zero == zero
        memory[zero] = result.predicted.memory
    base = memory[0]
    for zero in range(1, 4):
        got = memory[zero]
        assert got["optimizer"] == pytest.approx(base["optimizer"] / 4, abs=2)
        assert got["gradients"] == pytest.approx(
            base["gradients"] / 4 if zero >= 2 else base["gradients"], abs=2)
        assert got["parameters"] == pytest.approx(
            base["parameters"] / 4 if zero == 3 else base["parameters"], abs=2)
        assert got["activations"] == base["activations"]


def test_recompute_trades_memory_for_time(gpt8: Path) -> None:
    """Eager attention keeps the s² probabilities, which selective recompute drops."""
    plans = {mode: _plan(gpt8, 2, dp=2, tp=1, pp=1, micro_batches=1, zero=0, recompute=mode,
                         attention="eager")
             for mode in ("none", "selective", "full")}
    activations = {m: p.predicted.memory["activations"] for m, p in plans.items()}
    steps = {m: p.predicted.step_time_s for m, p in plans.items()}
    assert activations["none"] > activations["selective"] > activations["full"]
    assert steps["none"] < steps["selective"] < steps["full"]
    full = plans["full"].predicted.breakdown
    assert full["recompute_s"] == pytest.approx(full["forward_s"])
    selective = plans["selective"].predicted.breakdown
    assert 0 < selective["recompute_s"] < full["recompute_s"]
    assert plans["full"].pipeline.stages[0].recompute_segments
    # The time added is what was re-run: the step grows by exactly the recompute time.
    assert steps["full"] - steps["none"] == pytest.approx(full["recompute_s"], rel=1e-9)
    # Selective checkpoints exactly the attention cores, q kᵀ to · v.
    segments = plans["selective"].pipeline.stages[0].recompute_segments
    ops = plans["selective"].ops
    assert segments and all(ops[a].op_type == "MatMul" and ops[b - 1].op_type == "MatMul"
                            for a, b in segments)


def test_flash_attention_leaves_selective_recompute_nothing_to_drop(gpt8: Path) -> None:
    """A flash kernel keeps no s² tensor: selective recompute would save no memory."""
    none, selective = (_plan(gpt8, 2, dp=2, tp=1, pp=1, micro_batches=1, zero=0,
                             recompute=mode, attention="flash")
                       for mode in ("none", "selective"))
    assert none.predicted.memory["activations"] == selective.predicted.memory["activations"]
    assert selective.predicted.step_time_s > none.predicted.step_time_s


def test_interleaved_schedule_gives_each_device_two_chunks(gpt8: Path) -> None:
    result = _plan(gpt8, 2, pp=2, dp=1, tp=1, micro_batches=4, schedule="interleaved", vpp=2)
    pipe = result.pipeline
    assert pipe.schedule == "interleaved" and pipe.virtual_stages == 2
    assert all(len(stage.ops) == 2 for stage in pipe.stages)
    assert pipe.bubble_fraction == pytest.approx(1 / (2 * 4 + 1))


def test_search_uses_stages_and_sharding_when_ops_alone_do_not_fit(gpt8: Path) -> None:
    """Under a memory limit no op-level plan meets, the joint search still fits."""
    small = plan(gpt8, devices=8, batch=16, dims={"seq": 16}, profile="a100-80g",
                 memory_limit_gib=0.0015)
    assert small.predicted.fits
    parallel = small.parallel
    assert (parallel.pp > 1 or parallel.zero > 0 or parallel.recompute != "none"
            or parallel.micro_batches > 1)
    assert small.predicted.memory["peak"] <= 0.0015 * GIB
    op_level = [alt for alt in small.alternatives if alt.brief is None]
    assert all(alt.status not in ("optimal", "feasible") for alt in op_level)


def test_pipeline_plan_json_is_schema_valid(gpt8: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", str(gpt8), "--devices", "4", "--batch", "16", "--dim", "seq=16",
                 "--parallel", "pp=2,dp=2,micro_batches=4,zero=1,recompute=selective,schedule=1f1b",
                 "-o", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_FILE.read_text()))
    pipe = data["pipeline"]
    assert data["parallel"]["pp"] == 2 and data["model"]["batch"] == 4
    assert pipe["global_batch"] == 16 and pipe["micro_batches"] == 4
    assert [stage["ranks"] for stage in pipe["stages"]] == [[0, 1], [2, 3]]
    ops = [r for stage in pipe["stages"] for r in stage["ops"]]
    assert ops[0][0] == 0 and ops[-1][1] == len(data["ops"])
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ops))
    assert pipe["sends"] and all(s["from_stage"] < s["to_stage"] for s in pipe["sends"])
    kinds = {(c["kind"], c["phase"]) for c in data["collectives"]}
    assert ("send_recv", "forward") in kinds and ("reduce_scatter", "gradient") in kinds


@pytest.mark.parametrize("pins,needle", [
    ("recompute=sometimes", "recompute"),
    ("zero=4", "zero"),
    ("schedule=zigzag", "schedule"),
    ("pp=3", "no configuration"),
])
def test_bad_pins_exit_2(gpt8: Path, pins: str, needle: str, capsys) -> None:
    code = main(["plan", str(gpt8), "--devices", "4", "--batch", "16", "--dim", "seq=16",
                 "--parallel", pins])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("pins", [
    {"pp": 2, "micro_batches": 4, "zero": 0, "recompute": "none"},
    {"pp": 2, "dp": 2, "micro_batches": 4, "zero": 1, "recompute": "selective"},
    {"dp": 4, "pp": 1, "micro_batches": 2, "zero": 2},
    {"dp": 4, "pp": 1, "zero": 3},
    {"pp": 2, "micro_batches": 4, "recompute": "full"},
    {"pp": 2, "dp": 2, "micro_batches": 4, "schedule": "interleaved"},
])
def test_the_search_objective_is_the_plans_step_time(gpt8: Path, pins: dict) -> None:
    """Pipeline, ZeRO and recompute plans: the joint search's objective for the decision
    it made is the built plan's predicted step (one step model, the same inputs), and the
    plan's own stage figures give that step back through the schedule formula (1F1B,
    GPipe); an interleaved step with chunks of unequal time is the schedule's longest path,
    at least the busiest device's m·t_d and at most its serial bound."""
    pinned = {"schedule": "1f1b", **pins} if pins.get("pp", 1) > 1 else pins
    result = _plan(gpt8, 4, **pinned)
    assert result.pipeline is not None
    assert result.solver.objective == result.predicted.step_time_s
    pipe = result.pipeline
    stages = [stage.per_micro_batch_s for stage in pipe.stages]
    tail = max(stage.gradient_sync_s + stage.optimizer_s for stage in pipe.stages)
    if pipe.schedule != "interleaved":
        assert pipeline_time(stages, pipe.micro_batches, pipe.schedule) \
            + tail == pytest.approx(result.predicted.step_time_s, rel=1e-12)
    else:
        step = result.predicted.step_time_s - tail
        assert pipe.micro_batches * max(stages) <= step * (1 + 1e-12)
        assert step <= pipe.micro_batches * sum(stages) * (1 + 1e-12)
    breakdown = result.predicted.breakdown
    assert breakdown.pipeline_s + tail == pytest.approx(result.predicted.step_time_s,
                                                        rel=1e-12)


def test_an_op_level_plan_is_a_one_stage_pipeline(gpt8: Path) -> None:
    """The op-level price is the one step model's price of one stage and one micro-batch:
    the step is the stage's time plus its synchronisation and optimizer pass."""
    result = plan(gpt8, devices=4, batch=16, dims={"seq": 16}, profile="a100-80g",
                  mesh=(4,))
    assert result.pipeline is None
    b = result.predicted.breakdown
    per_micro = (b.forward_s + b.backward_s + b.forward_communication_s
                 + b.backward_communication_s)
    assert b.pipeline_s == pytest.approx(per_micro, rel=1e-12) and b.bubble_s == 0.0
    exposed = b.gradient_communication_s - b.hidden_communication_s
    assert result.predicted.step_time_s == pytest.approx(
        b.pipeline_s + exposed + b.optimizer_s, rel=1e-12)
