"""The joint search's compute floor (`planner.cost.oplevel.compute_floor`): a bound under
every layout's price, and one that counts each op's launch, so a model of small ops is not
solved at every micro-batch split its FLOPs alone would leave open."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_robustness import _save, chain_model

from costmodels.cluster import Cluster, load_cluster
from costmodels.gemm import GemmShape, gemm_seconds, least_gemm_seconds
from costmodels.profile import HardwareProfile, load_profile
from planner import api, zoo
from planner.cost.oplevel import ComputeFloor, compute_floor, priced_choice
from planner.cost.step import TrainingOptions
from planner.importer import import_model
from planner.kinds import AxisRole
from planner.search import joint
from planner.search.megatron import megatron_strategies
from planner.search.options import Pins
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from planner.zoo.gpt import GPTConfig
from planner.zoo.moe import MoEConfig


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> GraphAnalysis:
    config = GPTConfig(layers=2, hidden=128, heads=4, vocab=512, max_positions=64,
                       dropout=0.1, fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("gpt") / "gpt.onnx")
    return GraphAnalysis.of(import_model(Path(path), batch=4, dims={"seq": 64}))


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(chain_model(400, width=16), tmp_path_factory.mktemp("chain") / "chain.onnx")


@pytest.mark.parametrize("profile", ["a100-80g", "h100-sxm", "cpu"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_floor_is_under_every_layouts_compute(gpt: GraphAnalysis, profile: str,
                                                  tp: int) -> None:
    """Megatron's layout over tp devices computes no faster than the GEMMs at peak over tp,
    nor than every op's launches and host time, which no split divides."""
    hardware = load_profile(profile)
    options = TrainingOptions()
    mesh = DeviceMesh.build({AxisRole.DATA: 1, AxisRole.TENSOR: tp},
                            int(hardware.devices_per_node.value))
    strategies = megatron_strategies(gpt.graph, mesh, gpt.labels)
    stage = priced_choice(gpt, mesh, strategies, hardware, options).stage
    compute = stage.forward_compute_s + stage.backward_compute_s
    floor = compute_floor(gpt, hardware, options)
    assert 0 < floor.gemm_s / tp < floor.split_s(tp) <= compute
    assert 0 < floor.per_op_s <= compute


@pytest.mark.parametrize("profile", ["a100-80g", "h100-sxm", "ascend-910b", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_gemm_is_faster_than_the_least_gemm(profile: str, dtype: str) -> None:
    """`least_gemm_seconds` is under the price of every GEMM shape, from one row to a
    wave's worth of tiles, and is about the price of the smallest (one tile of the
    granule; on a profile without tiles, the ramp beside two FLOPs)."""
    hardware = load_profile(profile)
    least = least_gemm_seconds(hardware, dtype)
    sides = (1, 3, 16, 17, 64, 129, 1024, 4096)
    prices = [gemm_seconds(hardware, GemmShape(m, n, k, batch), dtype)
              for m in sides for n in sides for k in sides for batch in (1, 5)]
    assert least <= min(prices) * (1 + 1e-12)
    assert gemm_seconds(hardware, GemmShape(1, 1, 1), dtype) == pytest.approx(least, rel=1e-3)


def test_a_chain_of_small_ops_is_bound_by_its_launches(chain: Path) -> None:
    """400 ops on 16 × 16 weights: the launches are the floor, within a factor of the price
    of the data-parallel layout, and thousands of times the GEMMs' FLOPs at peak."""
    hardware = load_profile("a100-80g")
    analysis = GraphAnalysis.of(import_model(chain, batch=8))
    options = TrainingOptions()
    floor = compute_floor(analysis, hardware, options)
    mesh = DeviceMesh.build({AxisRole.DATA: 1, AxisRole.TENSOR: 1}, 8)
    strategies = megatron_strategies(analysis.graph, mesh, analysis.labels)
    stage = priced_choice(analysis, mesh, strategies, hardware, options).stage
    compute = stage.forward_compute_s + stage.backward_compute_s
    assert floor.per_op_s > 1000 * floor.gemm_s
    assert 0.5 * compute <= floor.per_op_s <= compute


def test_the_launch_floor_solves_fewer_layouts_for_the_same_plan(
        chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the chain, a configuration cut into micro-batches runs every op once per
    micro-batch: its launches price it above the best one solved, so the search leaves
    its layout unsolved. With the FLOPs alone as the floor it solves them, and chooses
    the same plan at the same price."""
    solves = _layout_solves(monkeypatch)
    with_launches = api.plan(str(chain), batch=8, devices=8, profile="a100-80g")
    launch_solves = {(rows, mesh.shape) for rows, mesh, _ in solves}
    solves.clear()
    floor = joint.compute_floor
    monkeypatch.setattr(joint, "compute_floor",
                        lambda *args: replace(floor(*args), per_op_s=0.0))
    flops_only = api.plan(str(chain), batch=8, devices=8, profile="a100-80g")
    assert launch_solves < {(rows, mesh.shape) for rows, mesh, _ in solves}
    assert with_launches.parallel == flops_only.parallel
    assert with_launches.predicted.step_time_s == pytest.approx(
        flops_only.predicted.step_time_s)


@pytest.mark.parametrize(("profile", "devices"), [("a100-80g", 8), ("cpu", 4),
                                                  ("ascend-910b", 8)])
def test_the_bounds_prune_nothing_the_exhaustive_search_would_rank(
        gpt: GraphAnalysis, profile: str, devices: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The search ranks the same configurations at the same prices with its floors
    (compute and optimizer) as with none: a floor above a configuration's price would drop
    it. Equal prices rank in the configurations' order, not the order they were solved in
    (a replica axis and a tp axis that splits nothing run the same work)."""
    _assert_floors_rank_as_none(monkeypatch, gpt, load_profile(profile), devices,
                                TrainingOptions(), Pins())


def test_the_optimizer_floor_leaves_idle_replicas_unsolved(
        chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the chain every configuration is bound by the same launches; the optimizer
    pass, which devices repeating the work (replicas) or keeping whole states (ZeRO 0)
    do not share, prices those above the best, so their layouts stay unsolved. Without
    that floor they are solved, and the plan is the same."""
    solves = _layout_solves(monkeypatch)
    with_floor = api.plan(str(chain), batch=8, devices=8, profile="a100-80g")
    floored = {(rows, mesh.shape) for rows, mesh, _ in solves}
    solves.clear()
    monkeypatch.setattr(joint, "optimizer_floor_s", lambda *args: 0.0)
    without = api.plan(str(chain), batch=8, devices=8, profile="a100-80g")
    assert floored < {(rows, mesh.shape) for rows, mesh, _ in solves}
    # every layout solved with the floor has dp × tp = 8: dp = 8 / local rows, so tp = rows
    assert all(rows == shape[-1] for rows, shape in floored), floored
    assert with_floor.parallel == without.parallel
    assert with_floor.predicted.step_time_s == pytest.approx(without.predicted.step_time_s)


def test_finalists_differing_in_zero_alone_share_their_exact_layout(
        chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's three best configurations are data parallel at ZeRO 1, 2 and 3: one
    layout on one mesh, solved once for all three exact decisions, not once each."""
    calls = _layout_solves(monkeypatch)
    plan = api.plan(str(chain), batch=8, devices=8, profile="a100-80g")
    zeros = {alt.brief.parallel.zero for alt in plan.alternatives
             if alt.brief is not None and alt.solver == "joint"}
    assert len(zeros) > 1  # several finalists on one layout
    assert len(calls) == len(set(calls)), calls


@pytest.mark.parametrize("case", ["pp=2", "cp=2", "zero=0", "memory", "moe ep=2", "mixed"])
def test_the_bounds_hold_across_the_search_space(
        gpt: GraphAnalysis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        case: str) -> None:
    """The same, where the bounds take other terms: pipelines, context and expert axes,
    ZeRO 0 (no optimizer sharding), a tight memory limit, and a mixed cluster (each kind's
    floor balanced by its devices, the optimizer at the fastest kind's pace)."""
    analysis, hardware, devices, cluster = gpt, load_profile("a100-80g"), 8, None
    training, pins = TrainingOptions(), Pins()
    if case == "pp=2":
        pins = Pins(pp=2)
    elif case == "cp=2":
        pins = Pins(cp=2)
    elif case == "zero=0":
        pins = Pins(zero=0)
    elif case == "memory":
        hardware, devices = load_profile("cpu"), 4
        training = TrainingOptions(memory_limit_bytes=4_000_000)  # micro-batches, ZeRO 2-3
    elif case == "moe ep=2":
        config = MoEConfig(layers=2, hidden=64, heads=4, vocab=256, max_positions=32,
                           dropout=0.0, experts=4)
        path = zoo.save(zoo.build("moe", config), tmp_path / "moe.onnx")
        analysis = GraphAnalysis.of(import_model(Path(path), batch=8, dims={"seq": 32}))
        pins = Pins(ep=2)
    else:
        cluster = load_cluster(Path(__file__).parents[1] / "examples/clusters/a100-h100.json")
        devices = sum(group.devices for group in cluster.groups)

    _assert_floors_rank_as_none(monkeypatch, analysis, hardware, devices, training, pins,
                                cluster)


def _layout_solves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, DeviceMesh, str]]:
    """Each layout the joint search solves from here on, as (the graph's batch, the mesh,
    the keyword arguments): the list fills as the search runs."""
    solves: list[tuple[int, DeviceMesh, str]] = []
    solve = joint.model_parallel_strategies

    def counting(analysis: GraphAnalysis, mesh: DeviceMesh, *args, **kwargs):  # type: ignore[no-untyped-def]
        solves.append((analysis.graph.batch, mesh, repr(sorted(kwargs.items()))))
        return solve(analysis, mesh, *args, **kwargs)

    monkeypatch.setattr(joint, "model_parallel_strategies", counting)
    return solves


def _assert_floors_rank_as_none(monkeypatch: pytest.MonkeyPatch, analysis: GraphAnalysis,
                                hardware: HardwareProfile, devices: int,
                                training: TrainingOptions, pins: Pins,
                                cluster: Cluster | None = None) -> None:
    """The joint search's top 4, names and prices, with its floors (compute and optimizer)
    and with both at zero: a floor above a configuration's price would drop it."""

    def ranked() -> list[tuple[str, float]]:
        result = joint.joint_search(Analyses(analysis), hardware, devices, training, pins,
                                    top_k=4, cluster=cluster)
        return [(s.choice.describe(), s.step_time_s) for s in result.ranked[:4]]

    bounded = ranked()
    monkeypatch.setattr(joint, "compute_floor", lambda *args: ComputeFloor(0.0, 0.0))
    monkeypatch.setattr(joint, "optimizer_floor_s", lambda *args: 0.0)
    unbounded = ranked()
    assert bounded
    assert [name for name, _ in bounded] == [name for name, _ in unbounded]
    assert [step for _, step in bounded] == pytest.approx([step for _, step in unbounded])
