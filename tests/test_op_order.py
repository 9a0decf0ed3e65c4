"""One op order whatever order the exporter wrote: context ops (masks, positions, rotary
tables: no trained parameter among their ancestors) come first, so every layer of a real
export is found, not all but the one that first used them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.errors import ModelError
from planner.importer import import_model
from planner.layers import find_repeats

HIDDEN = 8


def _layered(path: Path, layers: int, *, context_inside_first_layer: bool) -> Path:
    """A projection, then `layers` blocks MatMul(w) -> Add(mask') -> Relu; mask' =
    Unsqueeze(mask) is shared by all, written before the first block or inside it (dynamo)."""
    nodes: list[onnx.NodeProto] = []
    inits = []
    context = helper.make_node("Unsqueeze", ["mask", "axes"], ["mask_u"], name="mask_unsqueeze")
    inits.append(numpy_helper.from_array(np.array([0], dtype=np.int64), "axes"))
    if not context_inside_first_layer:
        nodes.append(context)
    inits.append(numpy_helper.from_array(np.eye(HIDDEN, dtype=np.float32), "w_embed"))
    nodes.append(helper.make_node("MatMul", ["x", "w_embed"], ["x0"], name="embed"))
    x = "x0"
    for k in range(layers):
        w = f"w{k}"
        inits.append(numpy_helper.from_array(
            np.random.default_rng(k).standard_normal((HIDDEN, HIDDEN)).astype(np.float32), w))
        nodes.append(helper.make_node("MatMul", [x, w], [f"h{k}"], name=f"mm{k}"))
        if k == 0 and context_inside_first_layer:
            nodes.append(context)
        nodes.append(helper.make_node("Add", [f"h{k}", "mask_u"], [f"a{k}"], name=f"add{k}"))
        nodes.append(helper.make_node("Relu", [f"a{k}"], [f"y{k}"], name=f"relu{k}"))
        x = f"y{k}"
    graph = helper.make_graph(
        nodes, "layered",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, HIDDEN]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [4, HIDDEN])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 4, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def test_a_context_op_inside_the_first_layer_comes_first(tmp_path: Path) -> None:
    inside = import_model(_layered(tmp_path / "in.onnx", 4, context_inside_first_layer=True),
                          batch=2)
    before = import_model(_layered(tmp_path / "out.onnx", 4, context_inside_first_layer=False),
                          batch=2)
    assert [n.name for n in inside.ops] == [n.name for n in before.ops]
    assert inside.ops[0].name == "mask_unsqueeze"
    repeats = find_repeats(inside)
    assert repeats is not None and (repeats.start, repeats.period, repeats.count) == (2, 3, 4)


def test_ops_out_of_file_order_are_sorted_and_a_cycle_is_refused(tmp_path: Path) -> None:
    path = _layered(tmp_path / "m.onnx", 2, context_inside_first_layer=False)
    model = onnx.load(path)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    onnx.save(model, tmp_path / "reversed.onnx")
    graph = import_model(tmp_path / "reversed.onnx", batch=2)
    assert [n.name for n in graph.ops] == [n.name for n in nodes]

    model.graph.node[0].input[0] = "y1"  # relu1 now reads its own output
    onnx.save(model, tmp_path / "cycle.onnx")
    with pytest.raises(ModelError, match="cycle"):
        import_model(tmp_path / "cycle.onnx", batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama", "mistral", "opt"])
def test_every_layer_of_a_default_dynamo_export_is_found(export_model, model: str) -> None:
    """Both exporters at their defaults (dynamo optimises: rotary and mask ops move into
    the first layer) give 4 layers of 4, over most of the graph."""
    for exporter in ("torchscript", "dynamo"):
        graph = import_model(export_model(model, exporter, opset=18, layers=4),
                             batch=4, dims={"seq": 16})
        repeats = find_repeats(graph)
        assert repeats is not None and repeats.count == 4, (exporter, repeats)
        assert repeats.covered >= 0.85 * len(graph.ops), (exporter, repeats, len(graph.ops))


def test_renamed_rotary_frequencies_are_state_and_their_tables_context(tmp_path: Path) -> None:
    """TorchScript renames `inv_freq` (`onnx::Mul_7`): a float initializer that reaches a
    Cos before any input is no weight, and the table it makes is shared context."""
    nodes = [helper.make_node("MatMul", ["x", "w_embed"], ["x0"], name="embed")]
    inits = [numpy_helper.from_array(np.eye(HIDDEN, dtype=np.float32), "w_embed"),
             numpy_helper.from_array(np.arange(4, dtype=np.float32)[:, None], "positions"),
             numpy_helper.from_array(np.linspace(0, 1, HIDDEN, dtype=np.float32)[None, :],
                                     "onnx::Mul_7")]
    x = "x0"
    for k in range(3):
        inits.append(numpy_helper.from_array(
            np.random.default_rng(k).standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
            f"w{k}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"h{k}"], name=f"mm{k}"))
        if k == 0:  # the table is written where the first layer first uses it
            nodes += [helper.make_node("Mul", ["positions", "onnx::Mul_7"], ["freqs"],
                                       name="freqs"),
                      helper.make_node("Cos", ["freqs"], ["cos"], name="cos")]
        nodes.append(helper.make_node("Mul", [f"h{k}", "cos"], [f"y{k}"], name=f"rot{k}"))
        x = f"y{k}"
    graph = helper.make_graph(
        nodes, "rotary", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        ["batch", 4, HIDDEN])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 4, HIDDEN])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "rotary.onnx")
    imported = import_model(tmp_path / "rotary.onnx", batch=2)
    assert imported.tensors["onnx::Mul_7"].kind == "buffer"
    assert imported.tensors["w_embed"].kind == "parameter"
    assert [n.name for n in imported.ops[:2]] == ["freqs", "cos"]
    repeats = find_repeats(imported)
    assert repeats is not None and repeats.count == 3
