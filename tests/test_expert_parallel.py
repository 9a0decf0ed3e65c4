"""Expert parallelism: the stacked experts traced, an "ep" axis inside dp splitting the
batch outside expert GEMMs and the experts inside them, the dispatch and combine
all-to-alls derived and priced, written, validated, explained, exported and run."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from executor.support import check_degrees
from planner import zoo
from planner.api import load_graph, plan
from planner.errors import ShardplanError
from planner.explain.explanation import explain
from planner.explain.render import render
from planner.exports.dtensor import to_dtensor_placements
from planner.exports.mindspore import to_mindspore_checkpoint
from planner.plans.model import Plan
from planner.plans.sections import ParallelConfig
from planner.search.joint import enumerate_choices, expert_degrees
from planner.search.options import Pins, check_pins
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.experts import Experts
from planner.validate import validate
from planner.zoo.moe import MoEConfig

SEQ = 16
EXPERTS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = MoEConfig(layers=2, hidden=32, heads=4, vocab=64, max_positions=SEQ,
                       experts=EXPERTS, moe_every=1)
    path = tmp_path_factory.mktemp("ep") / "moe.onnx"
    return zoo.save(zoo.build("moe", config, with_weights=True), path)


@pytest.fixture(scope="module")
def plans(tiny: Path) -> dict[str, Plan]:
    """ep alone on 2 devices; dp=2 × ep=2 on 4."""
    return {"ep": plan(tiny, devices=2, batch=4, dims={"seq": SEQ}, profile="cpu",
                       parallel={"ep": 2}),
            "dp-ep": plan(tiny, devices=4, batch=4, dims={"seq": SEQ}, profile="cpu",
                          parallel={"ep": 2, "dp": 2, "tp": 1})}


def _collectives(chosen: Plan) -> Counter:
    return Counter((str(c.kind), tuple(c.axes), str(c.phase)) for c in chosen.collectives)


def test_the_stacked_experts_are_traced(tiny: Path) -> None:
    analysis = GraphAnalysis.of(load_graph(tiny, batch=4, dims={"seq": SEQ}))
    experts = analysis.experts
    assert experts.count == EXPERTS
    assert experts.gemms == {f"h.{i}.mlp.experts.{name}.matmul"
                             for i in range(2) for name in ("c_fc", "c_proj")}
    # followed forward from the weights through the bias, the GELU and into the combine
    assert {"h.0.mlp.experts.gelu.mul", "h.0.mlp.combine.matmul"} <= set(experts.labels)
    # the router's expert dim (a one-hot of the top-k) is not an expert weight's
    assert not any("router" in op for op in experts.labels)
    dense = GraphAnalysis.of(load_graph(zoo.save(zoo.build("gpt-tiny"), tiny.parent / "g.onnx"),
                                        batch=2, dims={"seq": SEQ})).experts
    assert dense == Experts({})


def test_expert_weights_split_over_ep_and_tokens_move_by_all_to_all(
        plans: dict[str, Plan]) -> None:
    chosen = plans["ep"]
    assert chosen.mesh.axis_names == ("ep",) and chosen.parallel.ep == 2
    assert chosen.to_json()["parallel"]["ep"] == 2
    weights = {name: t.layout.dims for name, t in chosen.tensors.items()
               if t.kind == "parameter"}
    expert = {name for name in weights if ".experts." in name}
    assert len(expert) == 8 and all(weights[name][0] == ("ep",) for name in expert)
    assert all(not any(dims) for name, dims in weights.items() if name not in expert)
    # per layer a dispatch and a combine all-to-all forward, their transposes backward
    found = _collectives(chosen)
    assert found[("all_to_all", ("ep",), "forward")] == 4
    assert found[("all_to_all", ("ep",), "backward")] == 4
    # ep ranks hold different tokens: the dense weights' gradients sum over ep, the
    # experts' (each rank its own) do not
    summed = {c.tensor for c in chosen.collectives if str(c.phase) == "gradient"}
    assert summed and not summed & expert


def test_expert_gradients_sum_over_dp_alone(plans: dict[str, Plan]) -> None:
    chosen = plans["dp-ep"]
    assert chosen.mesh.axis_names == ("dp", "ep")
    assert (chosen.parallel.dp, chosen.parallel.ep) == (2, 2)
    axes = {c.tensor: tuple(c.axes) for c in chosen.collectives if str(c.phase) == "gradient"}
    assert {a for t, a in axes.items() if ".experts." in t} == {("dp",)}
    assert {a for t, a in axes.items() if ".experts." not in t} == {("dp", "ep")}
    assert ("all_to_all", ("ep",), "forward") in _collectives(chosen)


def test_validate_explain_and_exports_read_ep(tiny: Path, plans: dict[str, Plan]) -> None:
    chosen = plans["ep"]
    graph = load_graph(tiny, batch=4, dims={"seq": SEQ})
    assert validate(chosen, graph).ok
    assert "ep=2" in render(explain(chosen))
    data = chosen.to_json()
    data["parallel"]["ep"] = 1
    problems = validate(Plan.from_json(data), graph).problems
    assert any("parallel.ep is 1 but the mesh (ep=2) has ep=2" in p for p in problems)
    placements = to_dtensor_placements(chosen)
    assert placements["transformer.h.0.mlp.experts.c_fc.weight"][0] == "Shard(0)"
    assert to_mindspore_checkpoint(chosen)


def test_pins_and_degrees(tiny: Path) -> None:
    assert check_pins({"ep": 4}).joint_only == ("ep",)
    assert not check_pins({"ep": 2}).admits_op_level and check_pins({"ep": 1}).admits_op_level
    assert expert_degrees(Experts({}), 64, Pins()) == [1]
    assert expert_degrees(Experts({}, 8), 64, Pins()) == [1, 2, 4, 8]
    assert expert_degrees(Experts({}, 8), 4, Pins()) == [1, 2, 4]
    choices = enumerate_choices(8, 8, 2, 8, Pins(pp=1, tp=1, micro_batches=1, zero=0),
                                experts=[1, 2, 4])
    # dp·ep divides the batch and the devices; ep sits inside dp
    assert {(c.dp, c.ep, c.replicas) for c in choices} >= {(8, 1, 1), (4, 2, 1), (2, 4, 1)}
    with pytest.raises(ShardplanError, match=r"--parallel ep=3: its 4 experts do not split "
                                             "into 3 equal groups"):
        plan(tiny, devices=3, batch=3, dims={"seq": SEQ}, profile="a100-80g",
             parallel={"ep": 3})


def test_the_module_executor_refuses_ep_by_name() -> None:
    check_degrees(ParallelConfig(ep=2))  # the ONNX-graph executor runs it
    with pytest.raises(ShardplanError, match=r"parallel.ep is 2: .*--parallel ep=1"):
        check_degrees(ParallelConfig(ep=2), graph=False)


@pytest.mark.slow
def test_two_ranks_match_one_process(tiny: Path, plans: dict[str, Plan]) -> None:
    """The ONNX-graph executor runs the dispatch and combine all-to-alls as planned, and
    two gloo ranks train as one process does (about 10 s: slow)."""
    from executor.train import planned_counts, train, train_reference

    chosen = plans["ep"]
    reference = train_reference(tiny, chosen, steps=3, optimizer="sgd")
    run = train(tiny, chosen, steps=3, optimizer="sgd")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, 3)


def test_a_plan_for_the_module_executor_searches_no_expert_axis(tiny: Path) -> None:
    """The module executor runs no expert parallelism (`check_degrees`): `plan --module`
    plans for it (`MODULE_RUNNABLE`), so an unpinned search tries ep=1 only; a pin
    stays the user's. The same for context parallelism."""
    from executor.support import MODULE_RUNNABLE
    from planner.search.joint import context_degrees, expert_degrees
    from planner.search.options import Pins

    experts = GraphAnalysis.of(load_graph(tiny, batch=4, dims={"seq": SEQ})).experts
    module = Pins(runnable=MODULE_RUNNABLE)
    assert expert_degrees(experts, 4, Pins()) == [1, 2, 4]
    assert expert_degrees(experts, 4, module) == [1]
    assert expert_degrees(experts, 4, replace(module, ep=2)) == [2]
    assert context_degrees(131072, Pins())[:2] == [1, 2]
    assert context_degrees(131072, module) == [1]
    assert context_degrees(131072, replace(module, cp=4)) == [4]
