"""Pipeline schedules: one order per schedule (`costmodels.orders`) that the pricing and
the executor both run; interleaved 1F1B with any number of chunks per device and chunks of
unequal time; the zero-bubble schedules ZB-H1 and ZB-V."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import onnx
import pytest

from costmodels.orders import chunk_device, device_chunks, schedule_order
from costmodels.profile import load_profile
from costmodels.schedule import in_flight, pipeline_time, simulate, timeline
from executor.schedule import Chunk, Stages, Transfer, check_schedule, schedule_actions
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.importer import import_model
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
        chunks = _by_device(p, v, forward, backward)
        assert simulate("interleaved", chunks, m) == pytest.approx(closed)


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
        assert simulate("interleaved", chunks, m) == pytest.approx(exact)
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
        ran = [(a.kind, a.micro, a.chunk) for a in schedule_actions(stages, d)]
        assert ran == [tuple(step) for step in schedule_order("interleaved", p, m, d, v)]
        assert {c for _, _, c in ran} == {s * p + d for s in range(v)}


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


# ---------------------------------------------------------------- one order, every schedule


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (3, 7), (8, 16)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_simulation_equals_the_closed_forms(schedule: str, p: int, m: int) -> None:
    """Equal stages, any forward : backward : weight split: T = (m + p − 1)·t."""
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.5, 1.5, 0.7)):
        t = f + b + w
        assert simulate(schedule, [[(f, b, w)]] * p, m) == pytest.approx((m + p - 1) * t)
        assert pipeline_time([t] * p, m, schedule) == pytest.approx((m + p - 1) * t)


def _event_driven(schedule: str, chunks: list[list[tuple[float, float, float]]],
                  m: int) -> float:
    """The definition, pass by pass: each device runs its order; a pass starts when its
    device is free and its inputs are done (F after the previous chunk's F, B after its
    own F and the next chunk's B, W after its own B)."""
    p, v = len(chunks), len(chunks[0])
    last, split = p * v - 1, schedule in ("zb-h1", "zbv")
    slot = {c: k for d in range(p) for k, c in enumerate(device_chunks(schedule, p, v, d))}
    todo = {d: list(schedule_order(schedule, p, m, d, v)) for d in range(p)}
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    while any(todo.values()):
        moved = False
        for d in range(p):
            while todo[d]:
                kind, micro, chunk = todo[d][0]
                deps = ([("F", micro, chunk - 1)] if chunk else []) if kind == "F" else \
                    [("B", micro, chunk)] if kind == "W" else \
                    [("F", micro, chunk)] + ([("B", micro, chunk + 1)] if chunk < last else [])
                if not all(x in end for x in deps):
                    break
                f, b, w = chunks[d][slot[chunk]]
                length = f if kind == "F" else w if kind == "W" else b if split else b + w
                clock[d] = end[(kind, micro, chunk)] = max(
                    [clock[d], *(end[x] for x in deps)]) + length
                todo[d].pop(0)
                moved = True
        assert moved
    return max(clock)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                        ("interleaved", 3), ("zb-h1", 1), ("zbv", 2)])
def test_the_longest_path_is_the_pass_by_pass_definition(schedule: str, v: int) -> None:
    """`simulate` and `timeline` walk the schedule's passes sorted once by what they wait
    for; on unequal random chunk times they end where the pass-by-pass run does, and
    every pass starts after its device's previous one."""
    rng = random.Random(5)
    for _ in range(25):
        p = rng.choice([1, 2, 3, 4, 5])
        m = p * rng.choice([1, 2, 3]) if schedule == "interleaved" else rng.randint(1, 3 * p)
        chunks = [[(rng.uniform(0.2, 2), rng.uniform(0.2, 3), rng.uniform(0, 1.5))
                   for _ in range(v)] for _ in range(p)]
        assert simulate(schedule, chunks, m) == pytest.approx(_event_driven(schedule, chunks, m))
        passes = timeline(schedule, chunks, m)
        assert len(passes) == sum(len(schedule_order(schedule, p, m, d, v)) for d in range(p))
        for d in range(p):
            mine = sorted((start, end) for device, _, start, end in passes if device == d)
            assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(mine))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 9)])
def test_zb_h1_bubble_is_the_papers_formula(p: int, m: int) -> None:
    """Qi et al. 2023 §3.1: ZB-H1 idles (p − 1)(T_F + T_B − T_W) where 1F1B idles
    (p − 1)(T_F + T_B + T_W), for T_W up to T_F (the paper's regime, a GEMM's dW)."""
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.2, 0.8), (2.0, 3.0, 1.0)):
        useful = m * (f + b + w)
        zb = simulate("zb-h1", [[(f, b, w)]] * p, m)
        assert zb - useful == pytest.approx((p - 1) * (f + b - w))
        assert simulate("1f1b", [[(f, b, w)]] * p, m) - useful == pytest.approx(
            (p - 1) * (f + b + w))


def test_zb_h1_is_never_slower_than_1f1b_on_the_same_stages() -> None:
    rng = random.Random(11)
    faster = 0
    for _ in range(60):
        p = rng.choice([2, 3, 4, 6])
        m = rng.choice([p, 2 * p, p + 3, 1])
        stages = [[(rng.uniform(0.5, 2), rng.uniform(0.5, 3), rng.uniform(0, 1.5))]
                  for _ in range(p)]
        zb, one = simulate("zb-h1", stages, m), simulate("1f1b", stages, m)
        assert zb <= one + 1e-9
        faster += zb < one - 1e-9
    assert faster > 40


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_lays_each_devices_chunks_in_a_v(p: int) -> None:
    """Device d holds chunks d and 2p − 1 − d; its passes touch only those; the first
    chunk's forwards run down the devices and the second's back up (torch's
    ScheduleZBVZeroBubble), and the step is near zero-bubble when F = B = W."""
    for d in range(p):
        assert device_chunks("zbv", p, 2, d) == (d, 2 * p - 1 - d)
        assert {chunk_device("zbv", p, c) for c in (d, 2 * p - 1 - d)} == {d}
    m = 2 * p
    for d in range(p):
        order = schedule_order("zbv", p, m, d)
        assert {c for _, _, c in order} == {d, 2 * p - 1 - d}
        assert sorted((k, i, c) for k, i, c in order) == sorted(
            (k, i, c) for k in "FBW" for i in range(m) for c in (d, 2 * p - 1 - d))
        first_forward = next(k for k, step in enumerate(order) if step.kind == "F")
        assert order[first_forward].chunk == d  # the V starts down
    step = simulate("zbv", [[(1.0, 1.0, 1.0)] * 2] * p, m)
    ideal = m * 6.0
    assert step < simulate("zb-h1", [[(2.0, 2.0, 2.0)]] * p, m)
    assert (step - ideal) / step < (p - 1) / (m + p - 1) / 2  # under half of 1F1B's share


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                        ("interleaved", 3), ("zb-h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5), (4, 1)])
def test_every_order_runs_in_the_executor_without_deadlock(schedule: str, v: int, p: int,
                                                           m: int) -> None:
    """The executor's own check (transfers chunk to chunk, W after its B) completes every
    schedule's order, with every pass once."""
    if schedule == "interleaved" and m % p:
        return
    placed = [chunk_device(schedule, p, k) for k in range(p * v)]
    chunks = tuple(Chunk(k, k, k + 1, placed[k], sum(1 for j in range(k) if placed[j] ==
                                                       placed[k])) for k in range(p * v))
    transfers = tuple(Transfer(k, f"t{k}", k, k + 1, True, placed[k] != placed[k + 1])
                      for k in range(p * v - 1))
    actions = check_schedule(Stages(p, m, schedule, chunks, transfers, (), p * v - 1))
    kinds = "FBW" if schedule in ("zb-h1", "zbv") else "FB"
    assert sum(len(a) for a in actions.values()) == len(kinds) * m * p * v


def test_in_flight_follows_each_order() -> None:
    """1F1B keeps p − s; GPipe m; interleaved Megatron's warm-up + 1 chunks; ZB-H1 keeps a
    micro-batch until its W (its graph is retained for it): min(m, p) on every stage, the
    first stage's 1F1B figure; ZB-V at most 1F1B's first stage (its paper's claim)."""
    p, m = 4, 8
    assert [in_flight(s, p, m, "1f1b") for s in range(p)] == [4, 3, 2, 1]
    assert [in_flight(s, p, m, "gpipe") for s in range(p)] == [8] * 4
    assert [in_flight(s, p, m, "interleaved", 2) for s in range(p)] == [5.5, 4.5, 3.5, 2.5]
    assert [in_flight(s, p, m, "zb-h1") for s in range(p)] == [4] * 4
    assert [in_flight(s, p, 2, "zb-h1") for s in range(p)] == [2] * 4
    assert max(in_flight(s, p, m, "zbv") for s in range(p)) <= in_flight(0, p, m, "1f1b")


# ---------------------------------------------------------------- the search and its pins


@pytest.fixture(scope="module")
def gpt8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = zoo.GPTConfig(layers=8, hidden=256, heads=4, vocab=512, max_positions=128)
    return zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("zb") / "gpt8.onnx")


def _zb_plan(path: Path, **pins: int | str):
    return plan(path, devices=4, batch=16, dims={"seq": 128}, profile="a100-80g",
                parallel={"pp": 4, "dp": 1, "tp": 1, "micro_batches": 8, "zero": 0, **pins})


def test_the_search_picks_a_zero_bubble_schedule_when_faster(gpt8: Path) -> None:
    chosen = _zb_plan(gpt8)
    one = _zb_plan(gpt8, schedule="1f1b")
    assert chosen.pipeline is not None and chosen.pipeline.schedule in ("zb-h1", "zbv")
    assert chosen.predicted.step_time_s < one.predicted.step_time_s
    assert chosen.solver.objective == chosen.predicted.step_time_s
    stages = chosen.pipeline.stages
    assert all(0 < s.weight_gradient_s < s.backward_s for s in stages)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_pins_are_honoured(gpt8: Path, schedule: str) -> None:
    chosen = _zb_plan(gpt8, schedule=schedule)
    one = _zb_plan(gpt8, schedule="1f1b")
    pipe = chosen.pipeline
    assert pipe is not None and pipe.schedule == schedule
    assert chosen.predicted.step_time_s < one.predicted.step_time_s
    assert pipe.bubble_fraction < one.pipeline.bubble_fraction
    if schedule == "zbv":
        assert pipe.virtual_stages == 2
        chunks = pipe.chunks()
        assert [device for _, device in chunks] == [0, 1, 2, 3, 3, 2, 1, 0]
    else:
        assert all(len(stage.ops) == 1 for stage in pipe.stages)
        # held until its W: every stage keeps min(m, p) micro-batches
        assert [s.in_flight for s in pipe.stages] == [4.0] * 4


@pytest.mark.parametrize("pins,needle", [
    ("pp=1,schedule=zbv", "pp of 2"), ("pp=1,schedule=zb-h1", "pp of 2"),
    ("pp=2,schedule=zb", "choose one of"), ("pp=2,vpp=2,schedule=zbv", "vpp")])
def test_impossible_zero_bubble_pins_exit_2(gpt: Path, pins: str, needle: str,
                                            capsys) -> None:
    code = main(["plan", str(gpt), "--devices", "2", "--batch", "16", "--dim", "seq=16",
                 "--parallel", pins])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_zbv_on_too_few_layers_is_refused_in_one_line(gpt: Path, capsys) -> None:
    """7 layers cannot fill pp=4's eight V chunks."""
    code = main(["plan", str(gpt), "--devices", "4", "--batch", "16", "--dim", "seq=16",
                 "--parallel", "pp=4,micro_batches=4,schedule=zbv"])
    err = capsys.readouterr().err
    assert code in (2, 3) and "zbv" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- plan, validate, runners


def test_zero_bubble_plans_validate_and_a_wrong_v_is_found(gpt8: Path) -> None:
    from planner.plans.model import Plan
    from planner.validate import validate

    graph = import_model(gpt8, batch=2, dims={"seq": 128})
    for schedule in ("zb-h1", "zbv"):
        chosen = _zb_plan(gpt8, schedule=schedule)
        again = Plan.from_json(json.loads(chosen.dumps()))  # the file carries the schedule
        assert again.pipeline is not None and again.pipeline.schedule == schedule
        assert validate(again, graph).ok, validate(again, graph).problems
    data = json.loads(_zb_plan(gpt8, schedule="zbv").dumps())
    stages = data["pipeline"]["stages"]
    stages[0]["ops"], stages[1]["ops"] = stages[1]["ops"], stages[0]["ops"]  # not a V
    report = validate(Plan.from_json(data), None)
    assert any("places chunks on devices [0, 1, 2, 3, 3, 2, 1, 0]" in p
               for p in report.problems), report.problems


def test_zero_bubble_plans_are_refused_before_any_rank_starts(gpt8: Path) -> None:
    """Both runners name the schedule and what to use instead, in one line, before a rank
    starts (the module runner before it even loads the builder)."""
    from executor.module.launch import train_module
    from executor.train import train
    from planner.errors import ShardplanError

    for schedule in ("zb-h1", "zbv"):
        chosen = _zb_plan(gpt8, schedule=schedule)
        for runner in ("graph", "module"):
            with pytest.raises(ShardplanError) as error:
                if runner == "graph":
                    train(gpt8, chosen, steps=1)
                else:
                    train_module("no_such_module.py:build", chosen, steps=1)
            text = str(error.value)
            assert f"schedule {schedule}" in text and "schedule=1f1b" in text
            assert "\n" not in text


def test_the_weight_gradient_share_is_the_gemms_dw(gpt8: Path) -> None:
    """A MatMul reading a weight spends one forward on dW (half its backward); the
    attention's activation GEMMs and the elementwise ops none."""
    from planner.cost.kernels import kernel_plan, policy_for
    from planner.sharding.analysis import GraphAnalysis

    graph = import_model(gpt8, batch=2, dims={"seq": 128})
    analysis = GraphAnalysis.of(graph)
    kernels = kernel_plan(analysis, policy_for(load_profile("a100-80g")))
    ratios = {}
    for node in graph.ops:
        kernel = kernels.ops[node.name]
        reads_weight = any(i in analysis.weight_roots for i in node.inputs[:2] if i)
        ratios.setdefault((node.op_type, reads_weight), set()).add(kernel.weight_ratio)
    assert ratios[("MatMul", True)] == {1.0}
    assert ratios.get(("MatMul", False), {0.0}) == {0.0}
    assert all(r == {0.0} for (op, _), r in ratios.items() if op in ("Add", "Softmax", "Mul"))


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_the_bound_of_equal_stages_is_the_longest_path(schedule: str) -> None:
    """The joint search's bound prices equal stages past 2p micro-batches by the steady
    state's closed form, m + (p − 1)(F + B − W) of a chunk: it must equal the pass-by-pass
    longest path, below and past 2p, for any number of stages."""
    from costmodels.orders import chunks_per_device
    from costmodels.schedule import DEFAULT_SPLIT, simulate

    v = chunks_per_device(schedule, 2)
    unit = tuple(share / v for share in DEFAULT_SPLIT)
    for stages in (*range(1, 13), 16, 24, 32):
        for micro in sorted({stages, 2 * stages - 1, 2 * stages, 2 * stages + 1,
                             3 * stages + 2, 5 * stages}):
            direct = 2.5 * simulate(schedule, [[unit] * v] * stages, micro)
            assert pipeline_time([2.5] * stages, micro, schedule, 2) == pytest.approx(
                direct, rel=1e-12), (stages, micro)
