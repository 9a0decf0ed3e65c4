"""Mixture-of-experts routers as exported (issue 16): a `NonZero` over a top-k router's
expert mask has a data-dependent size; the import sizes it at an expert's capacity, the
plan records how, and what no router feeds is refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.api import plan
from planner.errors import ModelError
from planner.importer import import_model, rebind
from planner.plans.model import Plan

HIDDEN, EXPERTS, TOP_K = 8, 4, 2


def _router_model(path: Path, *, routed: bool = True) -> Path:
    """x[tokens, H] + expert_0(x's tokens routed to expert 0), written as TorchScript
    writes Mixtral's eager experts: TopK -> OneHot -> Transpose -> Gather -> NonZero ->
    Gather of the tokens -> MatMul -> ScatterElements (index_add) back."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32),
                                     "router.weight"),
             numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
                                     "experts.0.weight"),
             numpy_helper.from_array(np.array([TOP_K], np.int64), "k"),
             numpy_helper.from_array(np.array(EXPERTS, np.int64), "depth"),
             numpy_helper.from_array(np.array([0, 1], np.int64), "off_on"),
             numpy_helper.from_array(np.array(0, np.int64), "expert"),
             numpy_helper.from_array(np.array(1, np.int64), "row"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    mask = [helper.make_node("MatMul", ["x", "router.weight"], ["logits"], name="router"),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="probs"),
            helper.make_node("TopK", ["probs", "k"], ["weights", "choice"], axis=-1,
                             name="topk"),
            helper.make_node("OneHot", ["choice", "depth", "off_on"], ["onehot"], axis=-1,
                             name="onehot"),
            helper.make_node("Transpose", ["onehot"], ["by_expert"], perm=[2, 1, 0],
                             name="by_expert"),
            helper.make_node("Gather", ["by_expert", "expert"], ["mask"], axis=0,
                             name="mask")]
    if not routed:  # a mask the input decides alone: no router to size it by
        mask = [helper.make_node("Greater", ["x", "x_t"], ["mask"], name="mask")]
        inits.append(numpy_helper.from_array(np.zeros((1, HIDDEN), np.float32), "x_t"))
    nodes = [*mask,
             helper.make_node("NonZero", ["mask"], ["where"], name="select"),
             helper.make_node("Gather", ["where", "row"], ["tokens"], axis=0, name="tokens"),
             helper.make_node("Gather", ["x", "tokens"], ["routed"], axis=0, name="gather"),
             helper.make_node("MatMul", ["routed", "experts.0.weight"], ["expert_out"],
                              name="expert_0"),
             helper.make_node("Unsqueeze", ["tokens", "one"], ["column"], name="column"),
             helper.make_node("Shape", ["expert_out"], ["out_shape"], name="out_shape"),
             helper.make_node("Expand", ["column", "out_shape"], ["index"], name="index"),
             helper.make_node("Mul", ["x", "zero"], ["zeros"], name="zeros"),
             helper.make_node("ScatterElements", ["zeros", "index", "expert_out"], ["moe"],
                              axis=0, reduction="add", name="index_add"),
             helper.make_node("Add", ["x", "moe"], ["y"], name="residual")]
    inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    graph = helper.make_graph(
        nodes, "router", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        ["batch", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, path)
    return path


def test_a_routed_selection_is_sized_at_the_expert_capacity(tmp_path: Path) -> None:
    """16 tokens, top-2 of 4 experts: an even share is 8 tokens, capacity 1.25 x 8 -> 10."""
    graph = import_model(_router_model(tmp_path / "router.onnx"), batch=16)
    (selection,) = graph.routed.values()
    assert (selection.node, selection.router) == ("select", "topk")
    assert (selection.experts, selection.top_k, selection.tokens) == (EXPERTS, TOP_K, 16)
    assert selection.per_expert and selection.count == math.ceil(1.25 * 8)
    assert graph.tensors["routed"].shape == (10, HIDDEN)
    assert graph.tensors["moe"].shape == (16, HIDDEN)
    assert rebind(graph, batch=32).routed["select"].count == 20  # the share scales
    wider = import_model(tmp_path / "router.onnx", batch=16, capacity_factor=2.0)
    assert wider.routed["select"].count == 16 and wider.tensors["routed"].shape == (16, HIDDEN)
    # never more than the mask has entries (top-2 of 16 tokens: 32)
    assert import_model(tmp_path / "router.onnx", batch=16,
                        capacity_factor=64).routed["select"].count == 32


def test_the_plan_records_the_capacity_and_refuses_to_run(tmp_path: Path) -> None:
    from executor.support import check_supported
    from planner.errors import ShardplanError

    model = _router_model(tmp_path / "router.onnx")
    result = plan(model, devices=2, batch=16, capacity_factor=1.5)
    saved = tmp_path / "plan.json"
    result.save(saved)
    loaded = Plan.load(saved)
    assert loaded.model.capacity_factor == 1.5
    assert [(s.node, s.count) for s in loaded.model.routed] == [("select", 12)]
    graph = import_model(model, batch=16, capacity_factor=loaded.model.capacity_factor)
    with pytest.raises(ShardplanError, match=r"op 'select' \(NonZero.*sizes at 12"):
        check_supported(graph)


def test_a_selection_no_router_feeds_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"op select \(NonZero\).*no top-k router"):
        import_model(_router_model(tmp_path / "mask.onnx", routed=False), batch=4)


@pytest.mark.parametrize("factor", [0, -1.0, 1000.0, float("nan")])
def test_a_capacity_factor_out_of_range_is_refused(tmp_path: Path, factor: float) -> None:
    with pytest.raises(ModelError, match="--capacity-factor"):
        import_model(_router_model(tmp_path / "router.onnx"), batch=4,
                     capacity_factor=factor)


@pytest.mark.slow
def test_mixtral_as_torchscript_exports_it_plans(export_model, tmp_path: Path) -> None:
    """transformers' Mixtral (eager experts, top-2 of 4), 4 layers: every NonZero of every
    layer is sized, the layers are tied, and the plan validates against the file."""
    from planner.cli import main
    from planner.layers import find_blocks

    path = export_model("mixtral", "torchscript", opset=18, layers=4)
    graph = import_model(path, batch=8, dims={"seq": 16})
    tokens = 8 * 16
    per_expert = [s for s in graph.routed.values() if s.per_expert]
    assert len(per_expert) == 4 * EXPERTS
    assert {(s.tokens, s.count) for s in per_expert} == {(tokens, math.ceil(
        1.25 * tokens * TOP_K / EXPERTS))}
    assert len(graph.routed) - len(per_expert) == 4  # each layer's "experts hit"
    assert [block.count for block in find_blocks(graph)] == [4]
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", "4", "--batch", "8", "--dim", "seq=16",
                 "--capacity-factor", "2", "-o", str(out)]) == 0
    assert Plan.load(out).model.routed[1].count == 2 * tokens * TOP_K // EXPERTS
    assert main(["validate", str(out), str(path)]) == 0
