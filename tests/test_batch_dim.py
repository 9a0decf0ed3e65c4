"""Where the batch stands: a symbol naming it wherever it is, and micro-batches only where
the rows of the batch stay apart.

A sequence-first input (`[seq, batch, d]`, torch's `batch_first=False`) carries its batch
in dim 1. The importer takes the dim whose symbol names the batch for it; where no symbol
does, dim 0 is taken, and attention over that dim reads rows against each other, so
micro-batches would train another model: they are refused, named by the op."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from executor.train import train, train_reference
from planner.api import load_graph, plan
from planner.errors import ShardplanError
from planner.sharding.analysis import GraphAnalysis
from planner.validate import validate

STEPS = 3


def sequence_first(path: Path, batch_symbol: str) -> Path:
    """Self-attention over a `[seq, <batch_symbol>, 8]` input and a head: `[seq, b, 6]`
    out, as a `batch_first=False` layer computes it (q kᵀ over the sequence, per batch)."""
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32),
                                       name)

    node = helper.make_node
    nodes = [node("MatMul", ["x", "Wq"], ["q"], name="proj_q"),
             node("MatMul", ["x", "Wk"], ["k"], name="proj_k"),
             node("MatMul", ["x", "Wv"], ["v"], name="proj_v"),
             node("Transpose", ["q"], ["qt"], name="q_batch_first", perm=[1, 0, 2]),
             node("Transpose", ["k"], ["kt"], name="k_batch_first", perm=[1, 2, 0]),
             node("Transpose", ["v"], ["vt"], name="v_batch_first", perm=[1, 0, 2]),
             node("MatMul", ["qt", "kt"], ["scores"], name="q_kt"),
             node("Softmax", ["scores"], ["p"], name="softmax", axis=-1),
             node("MatMul", ["p", "vt"], ["o"], name="p_v"),
             node("Transpose", ["o"], ["os"], name="seq_first", perm=[1, 0, 2]),
             node("MatMul", ["os", "Wo"], ["y"], name="head")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", batch_symbol, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", batch_symbol, 6])
    weights = [weight("Wq", (8, 8)), weight("Wk", (8, 8)), weight("Wv", (8, 8)),
               weight("Wo", (8, 6))]
    graph = helper.make_graph(nodes, "sequence_first", [x], [y], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_symbol_naming_the_batch_is_the_batch_wherever_it_stands(tmp_path: Path) -> None:
    path = sequence_first(tmp_path / "sf.onnx", "batch")
    graph = load_graph(path, batch=4, dims={"seq": 6})
    assert graph.batch == 4 and graph.batch_inputs == {"x": 1}
    assert graph.tensors["x"].shape == (6, 4, 8)
    assert graph.sequence_inputs == {"x": 0}  # the sequence stands before the batch
    analysis = GraphAnalysis.of(graph)
    assert analysis.rows_meet is None  # q kᵀ pairs positions of one sequence, not rows
    assert analysis.rows_dim("y") == 1


def test_sequence_first_micro_batches_train_as_one_process(tmp_path: Path) -> None:
    """Micro-batches and targets cut along dim 1 (the batch), not dim 0 (the sequence):
    cut along dim 0 the losses left one process's (4.680526 against 4.757091 at step 1 on
    a dynamo export of a `batch_first=False` encoder layer)."""
    path = sequence_first(tmp_path / "sf.onnx", "batch")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 6}, profile="cpu",
                  parallel={"dp": 2, "micro_batches": 2})
    assert (chosen.parallel.dp, chosen.parallel.micro_batches) == (2, 2)
    # the loss reads each rank's rows of y where they are, along dim 1: nothing gathered
    assert not [c for c in chosen.collectives if c.op == "loss"]
    reference = train_reference(path, chosen, steps=STEPS, loss="mse")
    run = train(path, chosen, steps=STEPS, loss="mse")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)


def test_micro_batches_are_refused_where_rows_of_the_batch_meet(tmp_path: Path) -> None:
    """No symbol names the batch, so dim 0 (the sequence) is taken for it: q kᵀ reads its
    rows against each other, and a micro-batch would be a shorter sequence."""
    path = sequence_first(tmp_path / "sf.onnx", "n")
    graph = load_graph(path, batch=4, dims={"n": 2})
    assert graph.batch_inputs == {"x": 0}
    assert GraphAnalysis.of(graph).rows_meet == "q_kt"
    with pytest.raises(ShardplanError, match=r"op q_kt reads rows of the batch \(dim 0 of "
                                             r"x\) against other rows.*Dim\(\"batch\"\)"):
        plan(path, devices=2, batch=4, dims={"n": 2}, profile="cpu",
             parallel={"dp": 2, "micro_batches": 2})
    chosen = plan(path, devices=2, batch=4, dims={"n": 2}, profile="cpu")
    assert chosen.parallel.micro_batches == 1
    assert any("micro-batches (and so pipelines) were not considered: op q_kt" in warning
               for warning in chosen.warnings)
    # without micro-batches the split of dim 0 is exact: attention gathers its keys
    reference = train_reference(path, chosen, steps=STEPS, loss="mse")
    run = train(path, chosen, steps=STEPS, loss="mse")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)


def test_validate_refuses_micro_batches_where_rows_of_the_batch_meet(tmp_path: Path) -> None:
    """A plan edited to run micro-batches of a graph whose rows meet is refused."""
    path = sequence_first(tmp_path / "sf.onnx", "n")
    chosen = plan(path, devices=2, batch=4, dims={"n": 2}, profile="cpu",
                  parallel={"dp": 2, "micro_batches": 1})
    graph = load_graph(path, batch=4, dims={"n": 2})
    assert not any("rows" in p for p in validate(chosen, graph).problems)
    edited = replace(chosen, parallel=replace(chosen.parallel, micro_batches=2))
    problems = validate(edited, graph).problems
    assert any("parallel.micro_batches is 2, but op q_kt reads rows" in p for p in problems)


def test_a_features_first_input_trains_as_one_process(tmp_path: Path) -> None:
    """`[16, batch]` read by `Gemm(transA=1)`: dim 0 is static, so dim 0 was taken for a
    static batch of 16 and `--batch` refused; the symbol names the batch in dim 1."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("W", (16, 8)), ("W2", (8, 4)))]
    nodes = [helper.make_node("Gemm", ["x", "W"], ["h"], name="gemm", transA=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="head")]
    graph = helper.make_graph(
        nodes, "features_first", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                [16, "batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], weights)
    path = tmp_path / "features_first.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    chosen = plan(path, devices=2, batch=8, profile="cpu",
                  parallel={"dp": 2, "micro_batches": 2})
    assert load_graph(path, batch=8).batch_inputs == {"x": 1}
    reference = train_reference(path, chosen, steps=STEPS, loss="mse")
    run = train(path, chosen, steps=STEPS, loss="mse")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)


def _rows_model(path: Path, mix: str) -> Path:
    """x [batch, 8] → a row-coupling op (`mix`) → MatMul → y [batch, 4]; `flattened`:
    a sequence-first x [seq, batch, 8] whose output is flattened to [seq·batch, 4]."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    node = helper.make_node
    axis0 = numpy_helper.from_array(np.array([0], dtype=np.int64), "axis0")
    inits = [w, axis0]
    shape_x: list = ["batch", 8]
    shape_y: list = ["batch", 4]
    if mix == "batch-statistics":  # a batch norm computed by hand: x - mean over the batch
        nodes = [node("ReduceMean", ["x", "axis0"], ["mean"], name="mean", keepdims=1),
                 node("Sub", ["x", "mean"], ["h"], name="centre")]
    elif mix == "softmax-over-batch":
        nodes = [node("Softmax", ["x"], ["h"], name="softmax", axis=0)]
    elif mix == "cumsum-over-batch":
        nodes = [node("CumSum", ["x", "axis0"], ["h"], name="cumsum")]
    else:  # flattened
        target = numpy_helper.from_array(np.array([-1, 8], dtype=np.int64), "flat")
        inits.append(target)
        shape_x, shape_y = ["seq", "batch", 8], [12, 4]
        nodes = [node("Reshape", ["x", "flat"], ["h"], name="flatten")]
    nodes.append(node("MatMul", ["h", "W"], ["y"], name="head"))
    graph = helper.make_graph(nodes, mix, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape_x)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, shape_y)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("mix", ["batch-statistics", "softmax-over-batch",
                                 "cumsum-over-batch", "flattened"])
def test_micro_batches_are_not_planned_where_rows_depend_on_other_rows(
        tmp_path: Path, mix: str) -> None:
    """An op that reads several rows into one (a batch's mean, a softmax or a running sum
    over it), or an output whose rows the trace lost (`[seq, batch]` flattened with the
    batch inside): micro-batches trained another model (a sweep of 2026-12-06: 0.934 against
    one process's 0.998 for a hand-made batch norm), so none is planned."""
    path = _rows_model(tmp_path / f"{mix}.onnx", mix)
    dims = {"seq": 3} if mix == "flattened" else {}
    graph = load_graph(path, batch=4, dims=dims)
    assert GraphAnalysis.of(graph).rows_meet is not None
    chosen = plan(path, devices=2, batch=4, dims=dims, profile="cpu",
                  parallel={"dp": 1})
    assert chosen.parallel.micro_batches == 1
    with pytest.raises(ShardplanError, match="reads rows of the batch"):
        plan(path, devices=2, batch=4, dims=dims, profile="cpu",
             parallel={"dp": 1, "micro_batches": 2})


def test_a_per_rank_batch_above_the_largest_micro_batch_still_plans_one(
        tmp_path: Path) -> None:
    """Micro-batches above 16 rows are not enumerated, so a per-rank batch of 32 had only
    configurations of several micro-batches: where rows meet, none was left ("no
    configuration of 2 devices and batch 64 matches these pins" where only the joint
    search could plan: here a ZeRO pin; in the sweep, a memory limit)."""
    path = _rows_model(tmp_path / "stats.onnx", "batch-statistics")
    chosen = plan(path, devices=2, batch=64, profile="cpu", parallel={"zero": 3})
    assert (chosen.parallel.micro_batches, chosen.parallel.zero) == (1, 3)


def test_cross_entropy_over_a_batch_last_output_is_refused(tmp_path: Path) -> None:
    """`y` of `[4, batch]`: a cross-entropy reads its classes along the last dim, which
    holds the batch, so its targets have no rows (an `IndexError` before)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"),
             helper.make_node("Transpose", ["h"], ["y"], name="batch_last", perm=[1, 0])]
    graph = helper.make_graph(nodes, "batch_last", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [4, "batch"])], [w])
    path = tmp_path / "batch_last.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    chosen = plan(path, devices=2, batch=4, profile="cpu", mode="data")
    with pytest.raises(ShardplanError, match=r"--loss ce reads the classes along the last "
                                             r"dim of y \[4, 4\], which holds the batch"):
        train_reference(path, chosen, steps=1, loss="ce")


def test_a_pipeline_stage_holding_no_weights_trains(tmp_path: Path) -> None:
    """The first stage computes from the input alone: its optimizer had no parameters,
    which torch refuses ("optimizer got an empty parameter list")."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    node = helper.make_node
    nodes = [node("Tanh", ["x"], ["a"], name="tanh"), node("Sin", ["a"], ["b"], name="sin"),
             node("Mul", ["a", "b"], ["c"], name="mul"), node("Cos", ["c"], ["d"], name="cos"),
             node("MatMul", ["d", "W"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "weightless_first", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["batch", 4])], [w])
    path = tmp_path / "weightless_first.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    chosen = plan(path, devices=2, batch=4, profile="cpu",
                  parallel={"pp": 2, "micro_batches": 2, "schedule": "1f1b"})
    assert chosen.pipeline is not None
    reference = train_reference(path, chosen, steps=STEPS, loss="mse")
    run = train(path, chosen, steps=STEPS, loss="mse")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
