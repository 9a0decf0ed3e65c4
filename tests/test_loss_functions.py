"""ONNX's loss ops planned as the ops ONNX defines them by (`planner.importer.functions`).

`SoftmaxCrossEntropyLoss` (what torch's exporter emits for `F.cross_entropy`, in every
transformers model given `labels=`) and `NegativeLogLikelihoodLoss` had no sharding rule:
planned replicated, every rank gathered the whole batch's logits. Expanded into their
function bodies, the rows split and the mean over kept targets is two pending sums.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from planner.api import load_graph, plan
from planner.errors import ModelError
from planner.importer.functions import expand_losses

ROWS, CLASSES = 8, 6


def _model(op: str, **attrs: object) -> onnx.ModelProto:
    """x [rows, 4] → MatMul → scores [rows, classes] → the loss op against y."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"], name="node_linear")]
    scores = "scores"
    if op == "NegativeLogLikelihoodLoss":
        nodes.append(helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1,
                                      name="node_log_softmax"))
        scores = "logp"
    nodes.append(helper.make_node(op, [scores, "y"], ["loss"], name="node_loss", **attrs))
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, CLASSES],
                                np.random.default_rng(0).standard_normal(4 * CLASSES)
                                .astype(np.float32).tolist())
    graph = helper.make_graph(
        nodes, "loss",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_op_is_its_onnx_function_body(op: str, reduction: str) -> None:
    """The expansion computes what the op computes (ONNX's evaluator on both), ignored
    targets included."""
    model = _model(op, reduction=reduction, ignore_index=-100)
    expanded = expand_losses(model, 17, "m.onnx")
    assert op not in {n.op_type for n in expanded.graph.node}
    assert all(n.name.startswith("node_loss__") for n in expanded.graph.node
               if n.name not in ("node_linear", "node_log_softmax"))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((ROWS, 4)).astype(np.float32),
             "y": np.array([0, -100, 2, 5, -100, 1, 3, 4], np.int64)}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = ReferenceEvaluator(expanded).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_loss_splits_over_the_batch_and_reduces_two_sums(tmp_path: Path) -> None:
    path = tmp_path / "loss.onnx"
    onnx.save(_model("SoftmaxCrossEntropyLoss", reduction="mean", ignore_index=-100), path)
    graph = load_graph(path, batch=ROWS)
    assert "SoftmaxCrossEntropyLoss" not in {op.op_type for op in graph.ops}
    chosen = plan(path, devices=2, batch=ROWS, profile="cpu", mode="data")
    assert not any("no sharding rule" in w for w in chosen.warnings)
    forward = [c for c in chosen.collectives if c.phase.value == "forward"]
    # the kept targets' losses summed, and their count: one scalar each, no scores gathered
    assert len(forward) == 2 and all(c.kind.value == "all_reduce" and c.bytes == 4
                                     for c in forward)


def test_a_loss_op_whose_input_types_are_not_stated_is_refused_in_one_line() -> None:
    model = _model("SoftmaxCrossEntropyLoss", reduction="mean")
    del model.graph.input[:]  # (x and y unstated: the scores' type is not inferable)
    with pytest.raises(ModelError, match=r"m.onnx: op node_loss \(SoftmaxCrossEntropyLoss\): "
                                         r"the element type of \w+ is not stated") as refused:
        expand_losses(model, 17, "m.onnx")
    assert "\n" not in str(refused.value)
