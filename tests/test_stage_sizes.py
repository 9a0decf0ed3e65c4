"""Per-stage meshes of their own device counts (issue 17, item 4): a pipeline's stages on
blocks of different sizes, Alpa's submeshes.

The model: the LLaMA of tests/test_stage_meshes.py, whose head (a 256k vocabulary)
outweighs each of its 8 small layers, on 8 A100s in four stages under a 5 GiB limit. With
two devices a stage, the head's stage sets the pace; giving it four and the embedding's one
balances the stages.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from wide_head import SETTINGS

from costmodels.communication import CommGroup
from costmodels.profile import load_profile
from planner.api import load_graph, plan
from planner.cli import main
from planner.cost.pipeline import Boundary, Prices, send_group, stage_boundaries
from planner.cost.step import TrainingOptions
from planner.errors import PlanFileError, ShardplanError
from planner.explain.compare import compare_rows, render_compare
from planner.explain.explanation import explain
from planner.explain.render import render
from planner.plans.build import BuildContext, derive
from planner.plans.build import build as build_plan
from planner.plans.model import Plan
from planner.plans.stagemesh import (
    expected_blocks,
    per_stage_meshes,
    plan_devices,
    refuse_stage_meshes,
    stage_sizes,
)
from planner.report import summary
from planner.search.joint import joint_decisions, recompute_modes, stage_mesh
from planner.search.options import check_pins
from planner.search.stagemeshes import (
    shaped_decision,
    size_options,
    size_vectors,
    stage_shapes,
)
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.sharding.submeshes import stage_blocks, submesh_sizes
from planner.validate import validate


def test_submesh_sizes_are_alpas() -> None:
    """Powers of two inside a node, whole nodes beyond (Alpa §5.2)."""
    assert submesh_sizes(8, 8) == [1, 2, 4, 8]
    assert submesh_sizes(32, 8) == [1, 2, 4, 8, 16, 24, 32]
    assert submesh_sizes(4, 8) == [1, 2, 4]
    assert submesh_sizes(12, 4) == [1, 2, 4, 8, 12]


def test_stage_blocks_lie_aligned() -> None:
    assert stage_blocks([4, 2, 2], 8) == [range(0, 4), range(4, 6), range(6, 8)]
    # in stage order the 4 would start at 2: the largest first instead
    assert stage_blocks([2, 4, 2], 8) == [range(4, 6), range(0, 4), range(6, 8)]
    assert stage_blocks([1, 2, 1, 4], 8) == [range(6, 7), range(4, 6), range(7, 8),
                                             range(0, 4)]
    assert stage_blocks([8, 16, 8], 8) == [range(0, 8), range(8, 24), range(24, 32)]
    for sizes in ([3, 5], [6, 2], [12, 4]):
        with pytest.raises(ValueError, match="not submesh sizes"):
            stage_blocks(sizes, 8)


def test_sends_cross_the_link_between_their_blocks() -> None:
    """Inside one node: the pair's aligned block (which level of a node's links); across
    nodes: one member in each."""
    assert send_group(range(0, 2), range(2, 4), 8) == CommGroup(2, 2, 4)
    assert send_group(range(0, 4), range(4, 8), 8) == CommGroup(2, 2, 8)
    assert send_group(range(4, 6), range(6, 7), 8) == CommGroup(2, 2, 4)
    assert send_group(range(0, 8), range(8, 24), 8) == CommGroup(2, 1, 24)
    assert stage_boundaries([2, 2, 2, 2], 8) == [None] * 4
    found = stage_boundaries([1, 2, 1, 4], 8)
    assert found[0] is None
    # a stage of 2 fed by one rank: that rank sends both receivers' blocks; the stage of
    # 4 after stages of 1 and 2 (the fewest earlier: 1) four
    assert [b.fan for b in found[1:] if b is not None] == [2.0, 1.0, 4.0]


def test_a_send_from_fewer_ranks_moves_the_fan() -> None:
    """One send into a stage of twice its sender's ranks moves twice the receiver's bytes
    over the pair's link."""
    hardware = load_profile("a100-80g")
    mesh = stage_mesh(2, 1, 8, pp=4)
    group = CommGroup(2, 2, 8)
    one = Prices(hardware, mesh, boundary=Boundary(group, 1.0)).p2p(2**24)
    two = Prices(hardware, mesh, boundary=Boundary(group, 2.0)).p2p(2**24)
    assert one == pytest.approx(Prices(hardware, mesh, boundary=Boundary(group)).p2p(2**24))
    assert two == pytest.approx(Prices(hardware, mesh, boundary=Boundary(group)).p2p(2**25))
    assert two > one > 0


def test_size_vectors_stay_near_the_even_share() -> None:
    vectors = size_vectors(8, 4, 8)
    assert vectors and all(sum(v) == 8 and len(set(v)) > 1 for v in vectors)
    assert {s for v in vectors for s in v} == {1, 2, 4}
    assert (4, 2, 1, 1) in vectors and (2, 2, 2, 2) not in vectors
    assert size_vectors(8, 2, 8) == []  # 2 + 6 or 4 + 4 only: no uneven submeshes
    # whole nodes beyond one: 8 + 24 on four nodes; on 128 nodes the 4 nearest sizes
    assert size_options(32, 2, 8) == [8, 16, 24, 32]
    assert size_vectors(32, 2, 8) == [(8, 24), (24, 8)]
    assert size_options(1024, 8, 8) == [120, 128, 136, 144]
    assert size_options(8, 3, 8) == [2, 4]  # a depth that does not divide the devices
    assert size_vectors(8, 3, 8) == [(2, 2, 4), (2, 4, 2), (4, 2, 2)]
    assert size_vectors(4096, 128, 8) == []  # past MAX_UNEVEN_DEPTH: even counts only
    assert len(size_vectors(4096, 64, 8)) == 64
    assert stage_shapes(4, 8, 8, (2, 2)) == [(2, 2), (4, 1), (1, 4)]
    assert stage_shapes(4, 2, 8) == [(2, 2), (1, 4)]  # dp divides the micro-batch


@pytest.fixture(scope="module")
def model(wide_head_llama: Path) -> Path:
    return wide_head_llama


@pytest.fixture(scope="module")
def uneven(model: Path) -> Plan:
    return plan(model, parallel={"pp": 4}, **SETTINGS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def shared(model: Path) -> Plan:
    return plan(model, parallel={"pp": 4, "stage_mesh": "shared"},
                **SETTINGS)  # type: ignore[arg-type]


def test_the_heavy_stage_takes_more_devices(uneven: Plan, shared: Plan) -> None:
    assert uneven.pipeline is not None and per_stage_meshes(uneven.pipeline)
    sizes = stage_sizes(uneven.mesh, uneven.pipeline)
    assert len(set(sizes)) > 1 and sum(sizes) == 8 == uneven.cluster.devices
    assert plan_devices(uneven.mesh, uneven.pipeline) == 8
    # the head (the last stage) runs on the most devices
    assert sizes[-1] == max(sizes) > 2
    # each stage's ranks are its block, and the blocks tile the devices once
    ranks = [tuple(stage.ranks) for stage in uneven.pipeline.stages]
    assert ranks == [tuple(b) for b in stage_blocks(sizes, 8)]
    assert sorted(r for block in ranks for r in block) == list(range(8))
    assert uneven.predicted.fits and shared.predicted.fits
    assert uneven.predicted.step_time_s < shared.predicted.step_time_s
    # the search's exact price is the built plan's
    assert uneven.solver.objective == pytest.approx(uneven.predicted.step_time_s, rel=1e-12)
    assert all(not send.scatter_axes for send in uneven.pipeline.sends)


def test_an_uneven_plan_validates_and_round_trips(uneven: Plan, model: Path,
                                                  tmp_path: Path) -> None:
    graph = load_graph(model, batch=uneven.model.batch, dims=uneven.model.bound_dims)
    report = validate(uneven, graph)
    assert report.ok, report.problems
    path = uneven.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again.pipeline is not None
    assert [s.ranks for s in again.pipeline.stages] == [s.ranks for s in uneven.pipeline.stages]
    assert validate(again, graph).ok
    # two stages' ranks swapped: not the blocks their meshes hold
    data = json.loads(path.read_text())
    stages = data["pipeline"]["stages"]
    stages[0]["ranks"], stages[3]["ranks"] = stages[3]["ranks"], stages[0]["ranks"]
    problems = validate(Plan.from_json(data, "edited.json")).problems
    assert any("are not the block" in p and "submeshes of their own sizes" in p
               for p in problems)
    # a stage mesh of another size: the stages no longer hold cluster.devices
    data = json.loads(path.read_text())
    data["pipeline"]["stages"][-1]["mesh"]["shape"][-1] *= 2
    with pytest.raises(PlanFileError, match=r"stages\[\]\.mesh: the stages' meshes hold"):
        Plan.from_json(data, "edited.json")
    assert expected_blocks(uneven.mesh, uneven.pipeline) == stage_blocks(
        stage_sizes(uneven.mesh, uneven.pipeline), 8)


def test_readers_name_each_stages_ranks(uneven: Plan, shared: Plan) -> None:
    assert uneven.pipeline is not None
    last = uneven.pipeline.stages[-1]
    ranks = f"(ranks {last.ranks[0]}-{last.ranks[-1]})"
    for text in (summary(uneven), render(explain(uneven))):
        line = next(x for x in text.splitlines() if x.startswith("stages "))
        assert ranks in line
    with pytest.raises(ShardplanError, match=r"stage_mesh=shared") as refused:
        refuse_stage_meshes(uneven.mesh, uneven.pipeline, "the executor")
    assert ranks in str(refused.value)
    # compare gives each stage's devices (its mesh row is stage 0's)
    sizes = "+".join(map(str, stage_sizes(uneven.mesh, uneven.pipeline)))
    shown = render_compare(compare_rows([("uneven.json", uneven), ("shared.json", shared)]))
    row = next(x for x in shown.splitlines() if x.startswith("stage devices"))
    assert row.split()[2:] == [sizes, "-"]


def test_the_cli_refuses_to_run_uneven_stages_by_name(uneven: Plan, model: Path,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """`run` counts the plan's devices as its stages hold them (8, not stage 0's mesh's
    4), then refuses before any rank starts, in one line naming the pin."""
    path = uneven.save(tmp_path / "plan.json")
    assert main(["run", str(model), "--plan", str(path), "--nproc", "4", "--steps", "1"]) == 2
    assert "the plan is for 8 devices" in capsys.readouterr().err
    for argv in (["run", str(model), "--plan", str(path), "--nproc", "8", "--steps", "1"],
                 ["export", str(path), "--format", "dtensor", "-o", str(tmp_path / "d.json")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "stage_mesh=shared" in err and "ranks 0-3" in err


def test_a_depth_that_does_not_divide_the_devices(model: Path, tmp_path: Path) -> None:
    """Three stages on 8 devices, which no shared shape holds: from a two-stage decision
    of micro-batches of one row (so every stage of a count has one shape, dp=1), the
    search tries one stage more as submeshes (4 + 2 + 2 in some order), and the decision
    builds a plan of 3 stages on 8 devices that validates against the model. The shared
    decision's objective is set beyond reach, so the deeper one is returned whatever it
    costs: the test is of the path, the planner keeps it only where faster."""
    hardware, training = load_profile("a100-80g"), TrainingOptions()
    graph = load_graph(model, batch=8, dims={"seq": 2048})
    graphs = Analyses(GraphAnalysis.of(graph))
    pins = check_pins({"pp": 2, "tp": 4, "micro_batches": 8, "stage_mesh": "shared"})
    seed = joint_decisions(graphs, hardware, 8, training, pins, top_k=1)[0][0]
    assert seed.choice.pp == 2 and seed.micro_batch_size == 1
    beyond = replace(seed, solver=replace(seed.solver, objective=math.inf))
    modes = recompute_modes(pins)
    assert shaped_decision(graphs, hardware, beyond, training, modes, 60.0) is None
    deeper = shaped_decision(graphs, hardware, beyond, training, modes, 60.0,
                             other_depths=True)
    assert deeper is not None and deeper.choice.pp == 3
    sizes = [shape.dp * shape.tp for shape in deeper.shapes]
    assert sorted(sizes) == [2, 2, 4]
    built = build_plan(derive(BuildContext(graphs, hardware, training), deeper),
                       deeper.solver)
    assert built.pipeline is not None and built.cluster.devices == 8
    assert built.parallel.pp == 3 and len(built.pipeline.stages) == 3
    assert built.predicted.step_time_s == pytest.approx(deeper.solver.objective, rel=1e-12)
    micro = load_graph(model, batch=built.model.batch, dims=built.model.bound_dims)
    report = validate(built, micro)
    assert report.ok, report.problems
    again = Plan.load(built.save(tmp_path / "plan.json"))
    assert [s.ranks for s in again.pipeline.stages] == [
        tuple(b) for b in stage_blocks(sizes, 8)]
