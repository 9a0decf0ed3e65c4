"""Real torch exports: import, plan, and prove every strategy of every op in the simulator."""

from __future__ import annotations

import json

import jsonschema
import onnx
import pytest

from planner.api import plan
from planner.importer import import_model
from planner.ops import safe_labels
from planner.plans.schema import SCHEMA_FILE
from planner.sharding.mesh import DeviceMesh
from planner.sharding.verify import verify_graph

SCHEMA = json.loads(SCHEMA_FILE.read_text())
#: Ops that do arithmetic on activations: the importer must never fold them away.
COMPUTE_OPS = frozenset({"MatMul", "Gemm", "Conv", "Softmax", "LayerNormalization",
                         "BatchNormalization", "Erf", "Tanh", "Sigmoid", "Relu", "MaxPool",
                         "GlobalAveragePool", "ReduceMean", "Sqrt", "Gelu"})
VARIANTS = [
    pytest.param(model, exporter, training, opset,
                 id=f"{model}-{exporter}-{'train' if training else 'eval'}-op{opset}",
                 marks=[pytest.mark.slow] if exporter == "dynamo" else [])
    for model in ("gpt2", "bert", "llama", "resnet")
    for exporter, opset in (("torchscript", 17), ("dynamo", 18))
    for training in (False, True)
] + [
    pytest.param(model, "dynamo", False, opset, id=f"{model}-dynamo-eval-op{opset}",
                 marks=[pytest.mark.slow])
    for model in ("gpt2", "llama") for opset in (20, 21)
]


def _compute_nodes(model: onnx.ModelProto) -> set[str]:
    """Named compute nodes that read data or weights (not constants only, which fold; a
    Shape reads only its input's shape, a CastLike only its second input's type)."""
    weights = {t.name for t in model.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1}
    live = {i.name for i in model.graph.input} | weights
    found = set()
    for node in model.graph.node:
        read = node.input[:1] if node.op_type == "CastLike" else node.input
        if any(name in live for name in read) and node.op_type != "Shape":
            live.update(node.output)
            if node.op_type in COMPUTE_OPS:
                found.add(node.name)
    return found


def _dims(model: str) -> dict[str, int]:
    return {} if model == "resnet" else {"seq": 16}


@pytest.mark.parametrize(("model", "exporter", "training", "opset"), VARIANTS)
def test_export_imports_and_plans(export_model, model: str, exporter: str, training: bool,
                                  opset: int) -> None:
    path = export_model(model, exporter, training=training, opset=opset)
    graph = import_model(path, batch=4, dims=_dims(model))
    assert graph.parameter_count > 10_000
    assert graph.batch == 4
    assert "input_ids" in graph.batch_inputs or model == "resnet"
    assert all(safe_labels(node, graph.tensors) is not None for node in graph.ops), (
        sorted({n.op_type for n in graph.ops if safe_labels(n, graph.tensors) is None}))
    if training and model in ("gpt2", "bert"):
        assert any(n.op_type == "Dropout" for n in graph.ops)
    if training and model == "resnet" and exporter == "torchscript":
        assert any(n.op_type == "BatchNormalization" for n in graph.ops)

    result = plan(graph, profile="a100-80g", devices=4, mode="data")
    data = result.to_json()
    jsonschema.validate(data, SCHEMA)
    planned = {op["name"] for op in data["ops"]}
    compute = _compute_nodes(onnx.load(str(path), load_external_data=False))
    assert compute and compute <= planned, sorted(compute - planned)[:5]
    assert not [w for w in result.warnings if "no sharding rule" in w]
    gradients = {c.tensor for c in result.collectives if c.phase == "gradient"}
    assert gradients == {p.name for p in graph.parameters}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "exporter", "training", "opset"), [
    v for v in VARIANTS if v.values[3] in (17, 18)])
def test_every_strategy_of_an_export_matches_unsharded(export_model, model: str, exporter: str,
                                                       training: bool, opset: int) -> None:
    path = export_model(model, exporter, training=training, opset=opset)
    graph = import_model(path, batch=4, dims=_dims(model))
    report = verify_graph(graph, DeviceMesh.build({"a": 2, "b": 2}, 4))
    assert report.ok, "\n".join(report.failures[:10])
    assert report.strategies > 3 * report.ops
