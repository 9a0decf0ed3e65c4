"""Strategy search: exact against brute force, solvers agree, modes, pins and baselines."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from costmodels.profile import load_profile
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.cost.step import TrainingOptions
from planner.errors import NoPlanFits, ShardplanError
from planner.importer import import_model
from planner.kinds import Phase
from planner.layers import find_blocks, find_repeats
from planner.search.elimination import solve_elimination
from planner.search.ilp import solve_ilp
from planner.search.layers import tie_classes
from planner.search.problem import build_problem
from planner.search.propagation import solve_propagation
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh

PROFILE = load_profile("a100-80g")


def _two_matmuls(path: Path) -> Path:
    """The seed's semi-auto network: x[batch,128] @ w1[128,128] -> ReLU -> @ w2[128,64]."""
    family, config = zoo.preset("seed-mlp")
    return zoo.save(zoo.build(family, config), path)


def _mlp(path: Path) -> Path:
    """A slightly larger graph: two layers with bias, softmax head (7 ops)."""
    rng = np.random.default_rng(1)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w1", (64, 256)), ("b1", (256,)), ("w2", (256, 32)), ("b2", (32,)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["o"], name="fc2"),
             helper.make_node("Add", ["o", "b2"], ["ob"], name="bias2"),
             helper.make_node("Tanh", ["ob"], ["t"], name="tanh"),
             helper.make_node("Softmax", ["t"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(nodes, "mlp", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _brute_force(problem) -> tuple[float, list[int]]:
    best, best_choice = float("inf"), []
    for choice in itertools.product(*(range(len(g.candidates)) for g in problem.groups)):
        time, memory = problem.evaluate(choice)
        if memory <= problem.memory_limit and time < best:
            best, best_choice = time, list(choice)
    return best, best_choice


@pytest.mark.parametrize(("builder", "shape"), [
    *[(_two_matmuls, shape) for shape in [(2,), (4,), (8,), (2, 2), (2, 4)]],
    *[(_mlp, shape) for shape in [(2,), (4,), (8,), (3,)]],  # 2-D: ~10^6 combinations
])
def test_ilp_optimum_equals_brute_force(tmp_path: Path, builder, shape: tuple[int, ...]) -> None:
    graph = import_model(builder(tmp_path / "m.onnx"), batch=32)
    mesh = DeviceMesh(shape, ("a0", "a1")[: len(shape)], 8)
    problem = build_problem(GraphAnalysis.of(graph), mesh, PROFILE, TrainingOptions())
    expected, _ = _brute_force(problem)
    for solver in ("cpsat", "highs"):
        found = solve_ilp(problem, solver=solver, time_limit=30)
        assert found.status == "optimal"
        assert found.objective == pytest.approx(expected, rel=1e-9)
    eliminated = solve_elimination(problem)
    assert eliminated is not None and eliminated.objective == pytest.approx(expected, rel=1e-9)
    assert solve_propagation(problem).objective >= expected * (1 - 1e-12)


def test_memory_limit_changes_the_optimum(tmp_path: Path) -> None:
    """Under a tight limit the ILP trades time for memory, exactly as brute force does."""
    graph = import_model(_mlp(tmp_path / "m.onnx"), batch=32)
    mesh = DeviceMesh((4,), ("a0",), 8)
    free = build_problem(GraphAnalysis.of(graph), mesh, PROFILE, TrainingOptions())
    unconstrained = solve_ilp(free, solver="highs")
    peak = free.evaluate(unconstrained.choice)[1]
    tight = build_problem(GraphAnalysis.of(graph), mesh, PROFILE,
                          TrainingOptions(memory_limit_bytes=int(peak * 0.8)))
    expected, _ = _brute_force(tight)
    assert expected > unconstrained.objective  # the limit binds
    for solver in ("cpsat", "highs"):
        found = solve_ilp(tight, solver=solver)
        assert found.objective == pytest.approx(expected, rel=1e-9)
        assert tight.evaluate(found.choice)[1] <= tight.memory_limit


@pytest.fixture(scope="module")
def gpt_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, config = zoo.preset("gpt-tiny")
    return zoo.save(zoo.build(family, config), tmp_path_factory.mktemp("z") / "gpt.onnx")


def test_repeated_layers_are_found(gpt_tiny: Path) -> None:
    graph = import_model(gpt_tiny, batch=8, dims={"seq": 16})
    repeats = find_repeats(graph)
    _, config = zoo.preset("gpt-tiny")
    assert repeats is not None and repeats.count == config.layers
    classes = tie_classes(graph, find_blocks(graph))
    assert sum(len(c) for c in classes) == len(graph.ops)
    assert max(len(c) for c in classes) == config.layers


def test_solvers_agree_on_a_transformer(gpt_tiny: Path) -> None:
    graph = import_model(gpt_tiny, batch=8, dims={"seq": 16})
    mesh = DeviceMesh((2, 2), ("a0", "a1"), 8)
    problem = build_problem(GraphAnalysis.of(graph), mesh, PROFILE, TrainingOptions(),
                            classes=tie_classes(graph, find_blocks(graph)))
    cpsat = solve_ilp(problem, solver="cpsat")
    highs = solve_ilp(problem, solver="highs")
    assert cpsat.status == highs.status == "optimal"
    assert cpsat.objective == pytest.approx(highs.objective, rel=1e-7)
    eliminated = solve_elimination(problem)
    if eliminated is not None:  # exact when the graph reduces: then it must agree
        assert eliminated.objective == pytest.approx(cpsat.objective, rel=1e-7)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_auto_plan_is_never_costlier_than_the_baselines(tmp_path: Path, preset: str) -> None:
    family, config = zoo.preset(preset)
    path = zoo.save(zoo.build(family, config), tmp_path / "m.onnx")
    result = plan(path, devices=8, batch=16, dims={"seq": 32})
    assert set(result.baselines) == {"data-parallel", "megatron"}
    for baseline in result.baselines.values():
        if baseline.fits:
            assert result.predicted.step_time_s <= baseline.step_time_s * (1 + 1e-9)
    assert result.solver.status == "optimal" and result.solver.gap == 0.0
    assert result.alternatives and result.alternatives[0].mesh


def test_semi_mode_keeps_the_seed_strategies(tmp_path: Path) -> None:
    path = _two_matmuls(tmp_path / "seed.onnx")
    given = {"matmul1": [[1, 1], [1, 2]], "matmul2": [[1, 2], [2, 1]]}
    result = plan(path, devices=2, batch=32, mode="semi", strategies=given)
    ops = {op.name: op for op in result.ops}
    assert ops["matmul1"].strategy == ((1, 1), (1, 2))
    assert ops["matmul2"].strategy == ((1, 2), (2, 1))
    # The filler keeps ReLU on the column split, so matmul2 reads its input locally.
    assert ops["relu"].strategy == ((1, 2),)
    assert ops["matmul2"].outputs[0].layout.partial  # a partial sum, then an AllReduce
    kinds = {(c.kind, c.tensor, c.phase, c.op) for c in result.collectives}
    # the graph output stays partial (pinned so): the loss's read of whole rows sums it
    assert ("all_reduce", "y", "forward", "matmul2") not in kinds
    assert ("all_reduce", "y", "forward", "loss") in kinds
    assert not [c for c in result.collectives if c.tensor == "r"]


def test_semi_mode_errors_name_the_problem(tmp_path: Path) -> None:
    path = _two_matmuls(tmp_path / "seed.onnx")
    with pytest.raises(ShardplanError, match="matches no op"):
        plan(path, devices=2, batch=32, mode="semi", strategies={"fc*": [[1, 1], [1, 2]]})
    with pytest.raises(ShardplanError, match="matmul1"):
        plan(path, devices=2, batch=32, mode="semi", mesh=(2,),
             strategies={"matmul1": [[1, 2], [4, 1]]})


def test_pinned_parallel_degrees(gpt_tiny: Path) -> None:
    result = plan(gpt_tiny, devices=8, batch=16, dims={"seq": 16}, parallel={"dp": 2, "tp": 4})
    assert result.mesh.axis_names == ("dp", "tp") and result.mesh.shape == (2, 4)
    assert result.tensors["input_ids"].layout.dims[0] == ("dp",)
    assert result.parallel.dp == 2 and result.parallel.tp == 4
    with pytest.raises(ShardplanError, match="dp × tp"):
        plan(gpt_tiny, devices=8, batch=16, dims={"seq": 16}, parallel={"dp": 3, "tp": 4})
    staged = plan(gpt_tiny, devices=8, batch=16, dims={"seq": 16}, parallel={"pp": 2})
    assert staged.parallel.pp == 2 and staged.mesh.axis_names[0] == "pp"
    with pytest.raises(ShardplanError, match="--mode auto"):
        plan(gpt_tiny, devices=8, batch=16, dims={"seq": 16}, parallel={"pp": 2}, mesh=(2, 4))


def test_no_plan_fits_reports_the_smallest_memory(gpt_tiny: Path) -> None:
    with pytest.raises(NoPlanFits, match="smallest any plan needs") as excinfo:
        plan(gpt_tiny, devices=4, batch=8, dims={"seq": 16}, memory_limit_gib=1e-4)
    assert excinfo.value.exit_code == 3
    assert "more devices" in str(excinfo.value)


def test_cli_semi_mode_and_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _two_matmuls(tmp_path / "seed.onnx")
    strategies = tmp_path / "s.json"
    strategies.write_text(json.dumps({"matmul1": [[1, 1], [1, 2]]}))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", "2", "--batch", "32", "--mode", "semi",
                 "--strategies", str(strategies), "-o", str(out)]) == 0
    assert "data-parallel" in capsys.readouterr().out  # the baselines are printed beside it
    assert main(["export", str(out), "--format", "dtensor"]) == 0
    placements = json.loads(capsys.readouterr().out)
    assert placements["w1"] == ["Shard(1)"]
    assert main(["export", str(out), "--format", "mindspore"]) == 0
    checkpoint = json.loads(capsys.readouterr().out)
    # keyed as MindSpore's strategy checkpoint keys the seed network's ops
    assert checkpoint["parallel_strategy_item"]["MatMul_w1"]["parallel_strategy"] == [[1, 1],
                                                                                     [1, 2]]
    bad = tmp_path / "bad.json"
    bad.write_text('{"matmul1": [[1, 0]]}')
    assert main(["plan", str(path), "--devices", "2", "--batch", "32", "--mode", "semi",
                 "--strategies", str(bad)]) == 2
    assert "positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("options", [
    TrainingOptions(), TrainingOptions(inference=True), TrainingOptions(overlap=0.5),
    TrainingOptions(optimizer="sgd"),
])
@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_search_prices_exactly_what_the_plan_reports(tmp_path: Path, options: TrainingOptions,
                                                      shape: tuple[int, ...]) -> None:
    """For any choice, the problem's time equals the built plan's step time, but for what
    a linear table cannot say of the gradient reduction: it hides each weight's share as
    the schedule would were the backward compute long enough (the last bucket's the
    `--overlap` floor, the others the profile's share of themselves and at least the
    floor: `exposed_share`), where the built step hides at most that compute and holds
    the floor for the whole reduction."""
    from planner.cost.oplevel import last_bucket_ops
    from planner.plans.build import BuildContext, derive
    from planner.records import SolverRecord
    from planner.search.decisions import OpLevelDecision
    from planner.sharding.analysis import Analyses

    analysis = GraphAnalysis.of(import_model(_mlp(tmp_path / "m.onnx"), batch=32))
    mesh = DeviceMesh(shape, ("a0", "a1")[: len(shape)], 8)
    problem = build_problem(analysis, mesh, PROFILE, options)
    context = BuildContext(Analyses(analysis), PROFILE, options)
    rng = np.random.default_rng(0)
    record = SolverRecord("test", "fixed", 0, 0, 0, 0)
    last_bucket = last_bucket_ops(analysis)

    def first_op(tensor: str) -> str:
        first = analysis.first_consumers.get(tensor)
        return first[0] if first is not None else analysis.graph.ops[0].name

    for _ in range(20):
        choice = [int(rng.integers(len(g.candidates))) for g in problem.groups]
        seconds, memory = problem.evaluate(choice)
        planned = derive(context, OpLevelDecision(mesh, problem.strategies(choice), record))
        b = planned.predicted.breakdown
        last = sum(c.time_s for c in planned.sections.collectives
                   if c.phase == Phase.GRADIENT and first_op(c.tensor) in last_bucket)
        total = b.gradient_communication_s
        linear = (total - last) * max(options.overlap, PROFILE.overlap_share) \
            + last * options.overlap
        assert seconds == pytest.approx(
            planned.predicted.step_time_s + b.hidden_communication_s - linear, rel=1e-9)
        if not options.inference:  # forward-only liveness is only in the plan (see problem.py)
            assert memory == pytest.approx(planned.predicted.memory["peak"], abs=8)


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@pytest.mark.parametrize("tie", [True, False])
def test_the_bound_on_a_mesh_is_below_every_plan_of_it(gpt_tiny: Path,
                                                      shape: tuple[int, ...],
                                                      tie: bool) -> None:
    """What lets the op-level search skip a mesh (`Engine.beat`) is sound: for any
    choice, the table without what the plan may pay less of (`StrategyProblem.floor`:
    q, k and v reading one norm output move it once in the plan, a tied head's transposed
    table sums its gradient at the embedding) is no more than the step the plan builder
    prices, and the LP bound (`lower_bound`) is no more than any choice's that fits. GPT
    has both kinds of read the table prices more than the plan."""
    from planner.plans.build import BuildContext, derive
    from planner.records import SolverRecord
    from planner.search.decisions import OpLevelDecision
    from planner.search.ilp import lower_bound
    from planner.sharding.analysis import Analyses

    analysis = GraphAnalysis.of(import_model(gpt_tiny, batch=8, dims={"seq": 16}))
    mesh = DeviceMesh(shape, ("a0", "a1")[: len(shape)], 8)
    options = TrainingOptions()
    problem = build_problem(analysis, mesh, PROFILE, options,
                            classes=tie_classes(analysis.graph, analysis.blocks) if tie else None)
    floor = problem.floor()
    assert any(e.shared for e in problem.edges), "GPT reads some tensors twice"
    assert len(floor.edges) < len(problem.edges)
    bound = lower_bound(problem)
    assert bound is not None
    context = BuildContext(Analyses(analysis), PROFILE, options)
    record = SolverRecord("test", "fixed", 0, 0, 0, 0)
    rng = np.random.default_rng(1)
    below = 0
    for _ in range(25):
        choice = [int(rng.integers(len(g.candidates))) for g in problem.groups]
        step = derive(context, OpLevelDecision(mesh, problem.strategies(choice), record)
                      ).predicted.step_time_s
        floored, memory = floor.evaluate(choice)
        assert floored <= step * (1 + 1e-9), choice
        assert bound <= step * (1 + 1e-9) or memory > problem.memory_limit, choice
        below += floored < problem.evaluate(choice)[0]
    assert below, "the table prices some choice above its floor"


def test_meshes_no_plan_of_which_beats_the_joint_plan_are_not_solved(tmp_path: Path) -> None:
    """LLaMA-7B in bf16 on 64 H100s: the joint search's ZeRO-2 plan (600 ms) bounds the
    op-level meshes, which the elimination DP does not settle (memory binds); each mesh's
    LP bound is above it, so no ILP runs (one ran out its 60 s limit on 32x2 before). The
    16x4 mesh solved on its own (`--mesh`: no joint search) is indeed slower than the
    bound the full search printed for it."""
    model = tmp_path / "llama7b.onnx"
    assert main(["zoo", "llama-7b", "--dtype", "bfloat16", "-o", str(model)]) == 0
    lines: list[str] = []
    request = dict(profile="h100-sxm", devices=64, batch=256, dims={"seq": 2048})
    chosen = plan(model, progress=lines.append, **request)
    assert (chosen.parallel.dp, chosen.parallel.tp, chosen.parallel.pp,
            chosen.parallel.zero) == (64, 1, 1, 2)
    joint = [k for k, line in enumerate(lines) if line.startswith("joint search")]
    skipped = {line.split(":")[0]: line for line in lines
               if line.startswith("mesh ") and "every plan takes at least" in line}
    assert joint and all(lines.index(line) > joint[0] for line in skipped.values())
    assert "mesh 16x4" in skipped and "mesh 32x2" in skipped, lines
    bound = skipped["mesh 16x4"].split("at least ")[1].split(",")[0]
    assert bound.endswith(" ms")
    alone = plan(model, mesh=[16, 4], **request)
    assert alone.predicted.step_time_s * 1e3 >= float(bound[:-3])
    assert alone.predicted.step_time_s > chosen.predicted.step_time_s


def test_inference_and_overlap_change_what_they_should(gpt_tiny: Path) -> None:
    train = plan(gpt_tiny, devices=4, batch=8, dims={"seq": 16}, mode="data")
    infer = plan(gpt_tiny, devices=4, batch=8, dims={"seq": 16}, mode="data", inference=True)
    hidden = plan(gpt_tiny, devices=4, batch=8, dims={"seq": 16}, mode="data", overlap=1.0)
    assert infer.step.to_json() == {"kind": "inference", "overlap": 0.0, "precision": "fp32",
                                    "attention": "flash", "fusion": "elementwise",
                                    "bucket_mb": 25.0, "overlap_grad_reduce": True}
    assert infer.predicted.memory["gradients"] == infer.predicted.memory["optimizer"] == 0
    assert not [c for c in infer.collectives if c.phase in ("backward", "gradient")]
    assert infer.predicted.compute_s == pytest.approx(train.predicted.breakdown["forward_s"])
    assert infer.predicted.memory["activations"] < train.predicted.memory["activations"]
    gradient = train.predicted.breakdown["gradient_communication_s"]
    assert gradient > 0
    # The schedule hides part of it already (all but the last bucket, behind the backward
    # pass); --overlap 1 hides the rest.
    behind = train.predicted.breakdown["hidden_communication_s"]
    assert 0 < behind < gradient
    assert hidden.predicted.step_time_s == pytest.approx(
        train.predicted.step_time_s - (gradient - behind))
    with pytest.raises(ShardplanError, match="overlap"):
        plan(gpt_tiny, devices=4, batch=8, dims={"seq": 16}, overlap=1.5)


def test_time_limit_returns_the_best_plan_so_far_with_its_gap(tmp_path: Path) -> None:
    """CP-SAT stopped before it finds a plan: the warm start comes back, with the gap."""
    path = tmp_path / "gpt.onnx"
    onnx.save(zoo.build("gpt2-small", layers=4), path)
    common = dict(devices=8, batch=8, dims={"seq": 256}, solver="cpsat", tie_layers=False,
                  mesh=(2, 4))
    rushed = plan(path, time_limit=0.01, **common)
    settled = plan(path, time_limit=60, **common)
    assert settled.solver.status == "optimal" and settled.solver.gap == 0.0
    assert rushed.solver.status in ("feasible", "optimal")
    assert rushed.predicted.step_time_s >= settled.predicted.step_time_s * (1 - 1e-9)
    if rushed.solver.status == "feasible":
        assert 0.0 < rushed.solver.gap <= 1.0
        assert rushed.solver.bound <= settled.predicted.step_time_s * (1 + 1e-9)


def test_per_step_weight_costs_weigh_one_micro_batchs_share(gpt_tiny: Path) -> None:
    """The op-level problem prices a micro-batch: a weight's optimizer pass and gradient
    reduction, paid once a step, count 1/m of themselves at m micro-batches (so a layout
    that gathers a weight every micro-batch is weighed fairly against one that reduces it
    once); ops without weights cost the same."""
    analysis = GraphAnalysis.of(import_model(gpt_tiny, batch=8, dims={"seq": 16}))
    mesh = DeviceMesh.build({"dp": 2, "tp": 2}, 8)
    profile = load_profile("a100-80g")
    costs = {m: [g.cost.copy() for g in build_problem(analysis, mesh, profile,
                                                      TrainingOptions(),
                                                      micro_batches=m).groups]
             for m in (1, 2, 4)}
    owners = set(analysis.first_consumers[p.name][0] for p in analysis.graph.parameters)
    weighted = 0
    for k, group in enumerate(build_problem(analysis, mesh, profile, TrainingOptions()).groups):
        once_2 = costs[1][k] - costs[2][k]  # half of the per-step part
        once_4 = costs[1][k] - costs[4][k]  # three quarters of it
        if owners & set(group.ops):
            assert np.all(once_2 > 0)
            np.testing.assert_allclose(once_4, 1.5 * once_2, rtol=1e-9)
            weighted += 1
        else:
            np.testing.assert_allclose(once_4, 0.0, atol=1e-15)
    assert weighted


def test_mesh_workers_find_what_one_process_finds(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The op-level meshes solved by a pool of workers (each handed the graph once, as it
    starts) come out as one process solves them, mesh by mesh."""
    from planner.search import oplevel
    from planner.search.oplevel import _large, candidate_meshes, search_meshes

    monkeypatch.setattr(oplevel, "PARALLEL_PROCESS_THRESHOLD", 0)  # a small graph pools too
    from planner.search.options import Pins, SearchOptions
    from planner.zoo.gpt import GPTConfig

    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, max_positions=32,
                       dropout=0.0, fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt.onnx")
    analysis = GraphAnalysis.of(import_model(Path(path), batch=4, dims={"seq": 32}))
    profile = load_profile("a100-80g")
    pooled_options, alone_options = SearchOptions(workers=2), SearchOptions(workers=1)
    meshes = candidate_meshes(8, profile, pooled_options, Pins())
    assert len(meshes) > 2 and _large(analysis, meshes[-1].searched)  # the pool runs
    pooled = search_meshes(analysis, profile, meshes, pooled_options, TrainingOptions(),
                           Pins())
    alone = search_meshes(analysis, profile, meshes, alone_options, TrainingOptions(),
                          Pins())
    assert [r.mesh for r in pooled] == [r.mesh for r in alone]
    for a, b in zip(pooled, alone, strict=True):
        assert (a.solution is None) == (b.solution is None)
        if a.solution is not None and b.solution is not None:
            assert a.solution.objective == pytest.approx(b.solution.objective)
        assert (a.decision.strategies if a.decision else None) == \
            (b.decision.strategies if b.decision else None)
