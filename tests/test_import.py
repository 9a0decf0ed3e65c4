"""ONNX import: binding dims, folding shape arithmetic, classifying tensors, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.errors import ModelError
from planner.importer import import_model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _mlp_with_shape_chain(opset: int = 17) -> onnx.ModelProto:
    """x[batch, seq, 8] -> flatten via Shape/Gather/Concat/Reshape -> MatMul -> reshape back."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32),
                                "fc.weight")
    b = numpy_helper.from_array(np.arange(16, dtype=np.float32), "fc.bias")
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"], name="shape"),
        helper.make_node("Constant", [], ["idx0"], value=numpy_helper.from_array(
            np.array(0, dtype=np.int64))),
        helper.make_node("Constant", [], ["idx1"], value=numpy_helper.from_array(
            np.array(1, dtype=np.int64))),
        helper.make_node("Gather", ["x_shape", "idx0"], ["b_dim"], axis=0),
        helper.make_node("Gather", ["x_shape", "idx1"], ["s_dim"], axis=0),
        helper.make_node("Mul", ["b_dim", "s_dim"], ["bs"]),
        helper.make_node("Constant", [], ["axes0"], value=numpy_helper.from_array(
            np.array([0], dtype=np.int64))),
        helper.make_node("Unsqueeze", ["bs", "axes0"], ["bs1"]),
        helper.make_node("Constant", [], ["eight"], value=numpy_helper.from_array(
            np.array([8], dtype=np.int64))),
        helper.make_node("Concat", ["bs1", "eight"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["x", "flat_shape"], ["x2d"], name="flatten"),
        helper.make_node("MatMul", ["x2d", "fc.weight"], ["h"], name="fc"),
        helper.make_node("Add", ["h", "fc.bias"], ["h_b"], name="bias"),
        helper.make_node("Relu", ["h_b"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(nodes, "mlp", [x], [y], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_shape_chain_is_folded_and_dims_bound(tmp_path: Path) -> None:
    path = _save(_mlp_with_shape_chain(), tmp_path / "mlp.onnx")
    graph = import_model(path, batch=4, dims={"seq": 6})
    assert [n.op_type for n in graph.ops] == ["Reshape", "MatMul", "Add", "Relu"]
    assert graph.tensors["x2d"].shape == (24, 8)
    assert graph.tensors["y"].shape == (24, 16)
    assert graph.bound_dims == {"batch": 4, "seq": 6}
    assert graph.batch == 4 and graph.batch_inputs == {"x": 0}
    assert graph.tensors["fc.weight"].kind == "parameter"
    assert graph.tensors["fc.bias"].kind == "parameter"
    assert graph.parameter_count == 8 * 16 + 16
    matmul = graph.op("fc")
    assert matmul.flops == 2 * 24 * 8 * 16
    assert matmul.bytes_read == (24 * 8 + 8 * 16) * 4 and matmul.bytes_written == 24 * 16 * 4
    assert graph.op("flatten").is_view and graph.op("flatten").bytes_read == 0


def test_unbound_dims_are_all_listed(tmp_path: Path) -> None:
    path = _save(_mlp_with_shape_chain(), tmp_path / "mlp.onnx")
    with pytest.raises(ModelError) as excinfo:
        import_model(path)
    message = str(excinfo.value)
    assert "batch" in message and "--batch" in message
    assert "seq" in message and "--dim seq=N" in message


def test_unknown_dim_name_is_refused(tmp_path: Path) -> None:
    path = _save(_mlp_with_shape_chain(), tmp_path / "mlp.onnx")
    with pytest.raises(ModelError, match="names no input dim: sequence"):
        import_model(path, batch=2, dims={"seq": 4, "sequence": 4})


@pytest.mark.parametrize("batch", [0, -3])
def test_bad_batch_is_refused(tmp_path: Path, batch: int) -> None:
    path = _save(_mlp_with_shape_chain(), tmp_path / "mlp.onnx")
    with pytest.raises(ModelError, match="positive"):
        import_model(path, batch=batch, dims={"seq": 4})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        import_model(tmp_path / "absent.onnx")


def test_not_an_onnx_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 10)
    with pytest.raises(ModelError, match="ONNX"):
        import_model(path)


def test_truncated_onnx_file(tmp_path: Path) -> None:
    whole = _mlp_with_shape_chain().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelError):
        import_model(path, batch=2, dims={"seq": 4})


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        import_model(path)


def test_old_opset_is_refused(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    with pytest.raises(ModelError, match="opset 11"):
        import_model(_save(model, tmp_path / "old.onnx"))


def test_control_flow_is_refused(tmp_path: Path) -> None:
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])
    branch_out = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1])
    const = helper.make_node("Constant", [], ["v"], value=numpy_helper.from_array(
        np.array([1.0], dtype=np.float32)))
    branch = helper.make_graph([const], "branch", [], [branch_out])
    node = helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)
    model = helper.make_model(helper.make_graph([node], "g", [cond], [out]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match="control-flow ops If"):
        import_model(_save(model, tmp_path / "if.onnx"))


def test_absent_external_weights_still_import(tmp_path: Path) -> None:
    """A model whose weight file is missing plans from dims alone."""
    model = _mlp_with_shape_chain()
    for init in model.graph.initializer:
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.data_location = TensorProto.EXTERNAL
        entry = init.external_data.add()
        entry.key, entry.value = "location", "weights.bin"
    path = _save(model, tmp_path / "external.onnx")
    assert not (tmp_path / "weights.bin").exists()
    graph = import_model(path, batch=2, dims={"seq": 3})
    assert graph.parameter_count == 8 * 16 + 16
    assert graph.tensors["fc.weight"].value is None


def test_static_batch_cannot_be_changed(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = _save(model, tmp_path / "static.onnx")
    assert import_model(path).batch == 2
    assert import_model(path, batch=2).batch_inputs == {"x": 0}
    with pytest.raises(ModelError, match="static batch of 2"):
        import_model(path, batch=8)


def test_unnamed_nodes_get_unique_names(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    graph = import_model(_save(model, tmp_path / "relu.onnx"))
    names = [n.name for n in graph.ops]
    assert len(set(names)) == 2 and all(names)


def test_a_size_set_by_data_is_named_not_blamed_on_unbound_dims(tmp_path: Path) -> None:
    """TopK's k fed by the model's inputs: every dim is bound, the output's size is data;
    the error names the op and the value, not the dims."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    values = helper.make_tensor_value_info("v", TensorProto.FLOAT, None)
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="top", axis=1)], "g",
        [x, k], [values])
    path = tmp_path / "topk.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ModelError, match=r"op top \(TopK\) sizes its output by the values "
                                         r"of k, computed when the model runs"):
        import_model(path, batch=4)
