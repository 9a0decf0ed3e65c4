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
