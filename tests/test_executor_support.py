"""The executor's op support: every registry op runs or is refused by name before ranks start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from executor.ops import TORCH_OPS
from executor.support import RUNTIME_COLLECTIVES, check_supported, missing_op_types
from planner.errors import ShardplanError
from planner.graph import OpNode, PlanningGraph, TensorInfo
from planner.ops import RECORDS, safe_labels
from planner.ops.program import qualified
from planner.sharding.candidates import candidate_strategies
from planner.sharding.local import local_program
from planner.sharding.mesh import DeviceMesh
from tests import nodetests


def _graph(node: OpNode) -> PlanningGraph:
    tensors = {name: TensorInfo(name, (2, 2), "float32", "activation")
               for name in (*node.inputs, *node.outputs)}
    return PlanningGraph("one-op.onnx", "0" * 64, 18, {}, None, {}, [node], tensors,
                         list(node.inputs), list(node.outputs))


@pytest.mark.parametrize("key", sorted(RECORDS), ids=lambda k: "::".join(filter(None, k)))
def test_every_registry_op_runs_or_is_refused_by_name(key: tuple[str, str]) -> None:
    record = RECORDS[key]
    node = OpNode(f"the_{record.op_type.lower()}", record.op_type, record.domain, ("x",),
                  ("y",), {})
    runnable = record.domain == "" and record.op_type in TORCH_OPS
    if runnable:
        check_supported(_graph(node))
        assert not missing_op_types(node)
        return
    with pytest.raises(ShardplanError, match=rf"'the_{record.op_type.lower()}'.*op type "
                       rf"{record.qualified_type} has no torch implementation"):
        check_supported(_graph(node))


def test_every_op_a_rewrite_emits_is_runnable() -> None:
    for record in RECORDS.values():
        if record.rewrite is not None:
            assert record.rewrite.emits <= set(TORCH_OPS) | RUNTIME_COLLECTIVES, (
                record.op_type, sorted(record.rewrite.emits - set(TORCH_OPS)))


_RNG = np.random.default_rng(5)


def _f32(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape).astype(np.float32)


#: Forms that make every rewrite do its work (ONNX's node tests of Conv, say, have batch 1).
REWRITE_FORMS = {
    "gemm bias": (helper.make_node("Gemm", ["a", "b", "c"], ["y"]),
                  {"a": _f32(4, 6), "b": _f32(6, 2), "c": _f32(2)}, 13),
    "conv bias": (helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]),
                  {"x": _f32(2, 4, 4, 4), "w": _f32(2, 4, 3, 3), "b": _f32(2)}, 13),
    "maxpool indices": (helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2],
                                         strides=[2, 2]), {"x": _f32(2, 4, 4, 4)}, 13),
    "batchnorm training": (
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                         training_mode=1),
        {"x": _f32(4, 2, 2, 2), "s": _f32(2), "b": _f32(2), "m": _f32(2),
         "v": np.abs(_f32(2))}, 15),
    "batchnorm training float16": (
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                         training_mode=1),
        {"x": _f32(4, 2, 2).astype(np.float16), "s": _f32(2).astype(np.float16),
         "b": _f32(2).astype(np.float16), "m": _f32(2).astype(np.float16),
         "v": np.abs(_f32(2)).astype(np.float16)}, 15),
    "reducemean": (helper.make_node("ReduceMean", ["x"], ["y"], keepdims=0),
                   {"x": _f32(4, 6)}, 18),
    "gather": (helper.make_node("Gather", ["t", "i"], ["y"]),
               {"t": _f32(6, 4), "i": np.array([[1, -1], [0, 5]], np.int64)}, 13),
    "gather last axis": (helper.make_node("Gather", ["t", "i"], ["y"], axis=1),
                         {"t": _f32(2, 6), "i": np.array([1, -1], np.int64)}, 13),
    "reshape": (helper.make_node("Reshape", ["x", "s"], ["y"]),
                {"x": _f32(4, 6), "s": np.array([2, 2, 6], np.int64)}, 14),
    "expand": (helper.make_node("Expand", ["x", "s"], ["y"]),
               {"x": _f32(4, 1), "s": np.array([4, 6], np.int64)}, 13),
}


def test_rewrites_emit_only_what_they_declare() -> None:
    """Every program a rewrite builds, on every strategy and device, stays in `emits`."""
    mesh = DeviceMesh.build({"a": 2, "b": 2}, 4)
    rewritten = {record.op_type for record in RECORDS.values() if record.rewrite is not None}
    cases, _ = nodetests.collect(sorted(rewritten))
    cases += [nodetests.synthetic_case(name, *form) for name, form in REWRITE_FORMS.items()]
    exercised: set[str] = set()
    for case in cases:
        record = RECORDS["", case.op_type]
        assert record.rewrite is not None
        labels = safe_labels(case.node, case.tensors)
        if labels is None:
            continue
        for strategy in candidate_strategies(case.node, labels, case.tensors, mesh):
            for coord in ((0, 0), (0, 1), (1, 0), (1, 1)):
                program = local_program(case.node, labels, strategy, case.tensors, mesh, coord)
                emitted = {qualified(n) for n in program.nodes}
                assert emitted <= record.rewrite.emits, (case.name, emitted)
                if len(program.nodes) > 1 or program.constants:
                    exercised.add(case.op_type)
    assert exercised == rewritten


def _hardmax_model(path: Path) -> Path:
    weight = numpy_helper.from_array(_f32(8, 8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
         helper.make_node("Hardmax", ["h"], ["y"], name="pick")],
        "hardmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, path)
    return path


def test_preflight_refuses_an_op_the_executor_lacks(tmp_path: Path) -> None:
    """The plan is fine for the planner; the executor refuses it before any rank starts."""
    from executor.train import preflight, train
    from planner.api import plan

    path = _hardmax_model(tmp_path / "hardmax.onnx")
    result = plan(path, devices=2, batch=4)
    with pytest.raises(ShardplanError, match=r"'pick'.*op type Hardmax has no torch "
                                             r"implementation.*executor/ops\.py"):
        preflight(path, result)
    with pytest.raises(ShardplanError, match="Hardmax"):
        train(path, result, steps=1)
