"""Every graph output leaves the plan resolved: no pending partial sum that nothing prices."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from costmodels.profile import load_profile
from planner import zoo
from planner.api import plan
from planner.cost.step import TrainingOptions
from planner.importer import import_model
from planner.search.problem import build_problem
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("outputs") / "llama.onnx"
    onnx.save(zoo.build("llama-tiny", layers=2, hidden=64, heads=4, kv_heads=4, vocab=512),
              path)
    return path


def _non_scalar_outputs(graph) -> list[str]:
    return [name for name in graph.outputs if graph.tensors[name].numel > 1]


def test_the_head_never_leaves_logits_partial(llama: Path) -> None:
    """The op writing a graph output keeps only candidates that write it whole: a
    contraction split in the head must be resolved inside the graph, where it is priced."""
    graph = import_model(llama, batch=8, dims={"seq": 32})
    analysis = GraphAnalysis.of(graph)
    mesh = DeviceMesh.build({"dp": 2, "tp": 4}, 8)
    problem = build_problem(analysis, mesh, load_profile("a100-80g"), TrainingOptions())
    outputs = _non_scalar_outputs(graph)
    assert outputs
    for name in outputs:
        producer = graph.tensors[name].producer
        slot = list(graph.op(producer).outputs).index(name)
        group = problem.groups[problem.group_of[producer]]
        assert len(group.candidates) > 1  # the head still has choices: only pending sums go
        assert all(not c.outputs[slot].partial for c in group.candidates)


@pytest.mark.parametrize("devices,pins", [(8, {}), (8, {"dp": 2, "tp": 4}), (4, {"tp": 4})])
def test_every_plans_graph_outputs_are_resolved(llama: Path, devices: int, pins: dict) -> None:
    result = plan(llama, devices=devices, batch=8, dims={"seq": 32}, profile="a100-80g",
                  parallel=pins)
    graph = import_model(llama, batch=result.model.batch, dims={"seq": 32})
    for name in _non_scalar_outputs(graph):
        assert not result.tensors[name].layout.partial, (name, result.tensors[name].layout)


def _head(graph) -> str:
    return next(n for n in (graph.tensors[o].producer for o in _non_scalar_outputs(graph)) if n)


def test_the_loss_reads_whole_rows_at_the_price_of_their_gather(llama: Path) -> None:
    """Logits left split over the vocabulary are gathered for a loss that reads whole rows:
    one all-gather per micro-batch after the head, listed with the forward pass under the
    op `loss` and priced in it (its backward is a slice: nothing); with
    `loss_reads="as-is"` (a loss that works on the split logits, Megatron's) nothing is
    listed or priced."""
    graph = import_model(llama, batch=8, dims={"seq": 32})
    head = _head(graph)
    logits = graph.op(head).outputs[0]
    split = {head: ((1, 1, 1), (1, 4))}  # the head's weight over the vocabulary

    def planned(reads: str):
        return plan(llama, devices=4, batch=8, dims={"seq": 32}, profile="a100-80g",
                    mode="semi", strategies=split, mesh=(4,), loss_reads=reads)

    rows, as_is = planned("rows"), planned("as-is")
    assert rows.tensors[logits].layout.dims[-1] == as_is.tensors[logits].layout.dims[-1] \
        == ("a0",)
    (read,) = [c for c in rows.collectives if c.tensor == logits]
    assert (str(read.kind), str(read.phase), read.op) == ("all_gather", "forward", "loss")
    assert read.bytes == graph.tensors[logits].nbytes  # the whole rows: one device's batch
    assert not [c for c in as_is.collectives if c.tensor == logits]
    extra = rows.predicted.breakdown.forward_communication_s \
        - as_is.predicted.breakdown.forward_communication_s
    assert extra == pytest.approx(read.time_s, rel=1e-6)
    assert rows.step.loss_reads == "rows" and as_is.step.loss_reads == "as-is"


def test_a_plan_file_without_loss_reads_priced_none(llama: Path) -> None:
    """Files written before the step recorded `loss_reads` priced no read: they load as
    `as-is` and validate re-derives them so, which a plan listing the read then fails."""
    from planner.plans.model import Plan
    from planner.validate import validate

    graph = import_model(llama, batch=8, dims={"seq": 32})
    split = {_head(graph): ((1, 1, 1), (1, 4))}
    for reads, valid in (("as-is", True), ("rows", False)):
        chosen = plan(llama, devices=4, batch=8, dims={"seq": 32}, profile="a100-80g",
                      mode="semi", strategies=split, mesh=(4,), loss_reads=reads)
        assert validate(chosen, graph).ok
        data = chosen.to_json()
        del data["step"]["loss_reads"]
        old = Plan.from_json(data)
        assert old.step.loss_reads == "as-is"
        report = validate(old, graph)
        assert report.ok is valid, report.problems
        if not valid:
            assert any("extra forward all_gather" in p for p in report.problems)


@pytest.mark.parametrize("first", [True, False], ids=["input-first", "input-last"])
def test_a_graph_returning_its_input_beside_a_result_plans(tmp_path: Path, first: bool
                                                             ) -> None:
    """`return x, h`: an output that is a graph input (ONNX shape inference infers nothing
    while a name is both) keeps its place among the outputs and takes the input's shape."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 16])
    weight = numpy_helper.from_array(np.ones((16, 16), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm")],
                              "g", [x], [x, h] if first else [h, x], [weight])
    path = tmp_path / "passing.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    imported = import_model(path, batch=4)
    assert imported.outputs == (["x", "h"] if first else ["h", "x"])
    assert imported.tensors["h"].shape == (4, 16)
    assert [op.name for op in plan(path, devices=2, batch=4, profile="cpu").ops] == ["mm"]
