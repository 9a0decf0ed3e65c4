"""A transpose the exporter spells through a merged view (`planner.importer.views`) is
planned as the one transpose it is, so that a split of the heads passes through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from examples.hf_models import megatron_strategies
from executor.module.launch import export_builder
from planner.api import load_graph, plan
from planner.importer import import_model
from planner.kinds import CollectiveKind


def _k_transpose(shared: bool) -> onnx.ModelProto:
    """k [2, 4, 8, 16] -> Reshape [8, 8, 16] -> Transpose (0, 2, 1) -> Reshape [2, 4, 16, 8]
    -> Relu, as the dynamo exporter writes the transpose of K; `shared`: the merged view is
    also read by another op."""
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 4, 8, 16])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    shape = [numpy_helper.from_array(np.array(v, dtype=np.int64), n)
             for n, v in (("merged", [8, 8, 16]), ("unmerged", [2, 4, 16, 8]))]
    nodes = [helper.make_node("Reshape", ["k", "merged"], ["k3"], name="merge"),
             helper.make_node("Transpose", ["k3"], ["kt3"], name="transpose", perm=[0, 2, 1]),
             helper.make_node("Reshape", ["kt3", "unmerged"], ["kt"], name="unmerge"),
             helper.make_node("Relu", ["kt"], ["y"], name="relu")]
    if shared:
        nodes.append(helper.make_node("Neg", ["k3"], ["z"], name="other"))
        outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "k", [k], outs, shape)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_three_ops_become_one_transpose_of_the_same_values(tmp_path: Path) -> None:
    model = _k_transpose(shared=False)
    path = tmp_path / "k.onnx"
    onnx.save(model, path)
    graph = import_model(path)
    assert [(op.name, op.op_type) for op in graph.ops] == [("transpose", "Transpose"),
                                                          ("relu", "Relu")]
    fused = graph.ops[0]
    assert fused.inputs == ("k",) and fused.outputs == ("kt",)
    assert graph.tensors["kt"].producer == "transpose"
    assert "k3" not in graph.tensors and "kt3" not in graph.tensors
    k = np.random.default_rng(0).normal(size=(2, 4, 8, 16)).astype(np.float32)
    (expected,) = ReferenceEvaluator(model).run(None, {"k": k})
    np.testing.assert_array_equal(np.maximum(k.transpose(fused.attrs["perm"]), 0), expected)


def test_a_view_another_op_reads_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "k.onnx"
    onnx.save(_k_transpose(shared=True), path)
    assert [op.op_type for op in import_model(path).ops] == [
        "Reshape", "Transpose", "Reshape", "Relu", "Neg"]


def test_megatron_split_of_a_grouped_query_export_gathers_nothing(tmp_path: Path) -> None:
    """The LLaMA export (GQA) under Megatron's split: the heads stay split through the
    attention (its K transpose included), so the plan's collectives are the two
    all-reduces per layer and pass that torch's own tensor parallelism issues, no
    all-gather of K."""
    model = export_builder("examples.hf_models:llama", 8, tmp_path / "llama.onnx")
    chosen = plan(model, batch=8, devices=2, profile="a100-80g", mode="semi", mesh=(2,),
                  strategies=megatron_strategies(load_graph(model, batch=8)))
    kinds = [c.kind for c in chosen.collectives if c.op != "optimizer"]
    assert set(kinds) == {CollectiveKind.ALL_REDUCE} and len(kinds) == 8
