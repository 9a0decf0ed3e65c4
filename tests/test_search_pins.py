"""Issue 19: pins that never worsen a plan, plans fed back through --strategies, batches a
micro-batch count cannot take, and what baselines report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner import zoo
from planner.api import load_graph, plan
from planner.cli import main
from planner.report import summary
from planner.search.layers import tie_classes
from planner.search.oplevel import REPLICA_AXIS
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.strategy import OpStrategy


def _zoo(name: str, path: Path) -> Path:
    family, config = zoo.preset(name)
    return zoo.save(zoo.build(family, config), path)


def _round_trip(model: Path, tmp_path: Path, args: list[str]) -> None:
    """Every op's strategy of an auto plan, fed back as `--strategies` on the plan's mesh,
    is accepted and gives the same strategies."""
    first = tmp_path / "auto.json"
    assert main(["plan", str(model), *args, "-o", str(first)]) == 0
    written = json.loads(first.read_text())
    strategies = {op["name"]: op["strategy"] for op in written["ops"]}
    given = tmp_path / "strategies.json"
    given.write_text(json.dumps(strategies))
    again = tmp_path / "semi.json"
    mesh = "x".join(str(n) for n in written["mesh"]["shape"])
    assert main(["plan", str(model), *args, "--mode", "semi", "--strategies", str(given),
                 "--mesh", mesh, "-o", str(again)]) == 0
    back = {op["name"]: op["strategy"] for op in json.loads(again.read_text())["ops"]}
    assert back == strategies


SEQ = ["--dim", "seq=32"]


@pytest.mark.parametrize(("name", "dims"), [
    ("seed-mlp", []), ("gpt-tiny", SEQ), ("llama-tiny", SEQ), ("bert-tiny", SEQ),
    ("resnet-tiny", []), ("moe-tiny", SEQ)])
def test_zoo_plan_strategies_round_trip(name: str, dims: list[str], tmp_path: Path) -> None:
    model = _zoo(name, tmp_path / f"{name}.onnx")
    _round_trip(model, tmp_path, ["--devices", "2", "--batch", "8", *dims])


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_export_plan_strategies_round_trip(export_model, model: str, tmp_path: Path) -> None:
    path = export_model(model, "dynamo", training=True, opset=18)
    _round_trip(path, tmp_path, ["--devices", "2", "--dim", "batch=4", "--dim", "seq=16"])


def _pinned_alike(model: Path, devices: int, batch: int, dims: dict[str, int]) -> None:
    """Each pin set to the unpinned optimum's own value gives the optimum back: the same
    step time, and the same strategies but where two are an exact tie (an op at its
    launch floor either way, moving nothing: the solver may take either)."""
    best = plan(model, devices=devices, batch=batch, dims=dims)
    chosen = best.parallel
    ops = {op.name: op for op in best.ops}
    for key in ("dp", "tp", "pp", "micro_batches", "zero", "recompute"):
        value = getattr(chosen, key)
        pinned = plan(model, devices=devices, batch=batch, dims=dims,
                      parallel={key: str(value) if key == "recompute" else value})
        assert pinned.predicted.step_time_s == pytest.approx(best.predicted.step_time_s,
                                                             rel=1e-9), key
        moving = {c.op for plan_ in (best, pinned) for c in plan_.collectives}
        for op in pinned.ops:
            if op.strategy != ops[op.name].strategy:
                tie = (op.cost.forward_s, op.cost.backward_s) == (
                    ops[op.name].cost.forward_s, ops[op.name].cost.backward_s)
                assert tie and op.name not in moving, (key, op.name)


def test_pins_at_the_optimum_keep_it_seed(tmp_path: Path) -> None:
    """The seed net at 64 devices: its optimum replicates over one axis (a batch of 32
    cannot use 64 devices), and no pin of its own values makes it worse (a pin used to
    skip the op-level search: pp=1 gave a 2-5x slower plan)."""
    _pinned_alike(_zoo("seed-mlp", tmp_path / "seed.onnx"), 64, 32, {})


def test_pins_at_the_optimum_keep_it_transformer(tmp_path: Path) -> None:
    _pinned_alike(_zoo("gpt-tiny", tmp_path / "gpt.onnx"), 64, 64, {"seq": 32})


def test_replicated_plan_of_fewer_devices_is_a_candidate(tmp_path: Path) -> None:
    """A 64-device op-level plan is never worse than the same net's 8-device one: the
    8-device plan repeated over an outer replica axis is searched (item 6)."""
    model = _zoo("seed-mlp", tmp_path / "seed.onnx")
    # pp=1: op-level plans. Since ZB-H1, a 2-stage pipeline of one micro-batch beats them
    # at 8 devices (its W passes overlap), and at 64 its stages sit a node apart.
    op_level = {"zero": 0, "micro_batches": 1, "pp": 1}
    eight = plan(model, devices=8, batch=32, parallel=op_level)
    many = plan(model, devices=64, batch=32, parallel=op_level)
    assert many.predicted.step_time_s <= eight.predicted.step_time_s * (1 + 1e-9)
    pinned = plan(model, devices=64, batch=32, parallel={"dp": eight.parallel.dp,
                                                         "tp": eight.parallel.tp, **op_level})
    assert pinned.mesh.axis_names[0] == REPLICA_AXIS  # the rest of the devices repeat it
    assert pinned.predicted.step_time_s == pytest.approx(eight.predicted.step_time_s)
    used = {axis for op in pinned.ops for axes in op.assignment.values() for axis in axes}
    assert REPLICA_AXIS not in used


@pytest.mark.parametrize(("name", "batch", "dims"), [("seed-mlp", 32, {}),
                                                      ("gpt-tiny", 16, {"seq": 32})])
def test_more_devices_never_plan_worse(tmp_path: Path, name: str, batch: int,
                                       dims: dict[str, int]) -> None:
    """The whole search (op-level and joint: ZeRO, micro-batches, stages) at 64 devices is
    never worse than at 8: an 8-device configuration repeated over a replica axis is a
    candidate of the joint search too (the seed net's 8-device optimum is ZeRO-1 over 2
    data-parallel ranks; at 64 devices the joint search could only form dp >= 8)."""
    model = _zoo(name, tmp_path / f"{name}.onnx")
    eight = plan(model, devices=8, batch=batch, dims=dims)
    many = plan(model, devices=64, batch=batch, dims=dims)
    assert many.predicted.step_time_s <= eight.predicted.step_time_s * (1 + 1e-9)
    assert many.cluster.devices == many.mesh.size == 64
    replicated = [axis for axis, size in zip(many.mesh.axis_names, many.mesh.shape,
                                             strict=True)
                  if size > 1 and not any(axis in axes for op in many.ops
                                          for axes in op.assignment.values())
                  and axis != "pp"]
    if replicated:  # the devices the plan leaves idle are said
        assert any(f"mesh axis {replicated[0]}=" in w for w in many.warnings)


def test_tied_fill_in_follows_per_layer_pins(tmp_path: Path) -> None:
    """Layer 0's MLP column/row-parallel, layer 1's batch-split: the layers are solved
    apart, so the tied solve equals the untied one (it used to tie their fill-in and cost
    more collectives), and the status says what it is optimal among."""
    model = _zoo("gpt-tiny", tmp_path / "gpt.onnx")
    pins = {"h.0.mlp.c_fc.matmul": [[1, 1, 1], [1, 2]],
            "h.0.mlp.c_proj.matmul": [[1, 1, 2], [2, 1]],
            "h.1.mlp.c_fc.matmul": [[2, 1, 1], [1, 1]],
            "h.1.mlp.c_proj.matmul": [[2, 1, 1], [1, 1]]}
    tied, untied = (plan(model, devices=2, batch=8, dims={"seq": 32}, mode="semi",
                         strategies=pins, tie_layers=tie) for tie in (True, False))
    assert tied.predicted.step_time_s == pytest.approx(untied.predicted.step_time_s)
    assert len(tied.collectives) == len(untied.collectives)
    assert tied.solver.detail.tied_layers and not untied.solver.detail.tied_layers
    assert "among plans splitting every repeated layer alike" in summary(tied)
    assert "among plans" not in summary(untied)


def test_layer_tying_keeps_pinned_layers_apart(tmp_path: Path) -> None:
    graph = load_graph(_zoo("gpt-tiny", tmp_path / "gpt.onnx"), batch=8, dims={"seq": 32})
    blocks = GraphAnalysis.of(graph).blocks
    repeats = blocks[0] if blocks else None
    assert repeats is not None and repeats.count == 2
    first = graph.ops[repeats.start].name
    second = graph.ops[repeats.start + repeats.period].name
    together = tie_classes(graph, blocks)
    assert [first, second] in together
    apart = tie_classes(graph, blocks, {first: OpStrategy.of({"m0": ("a0",)})})
    assert [first] in apart and [second] in apart
    assert sorted(n for c in apart for n in c) == sorted(n.name for n in graph.ops)


def _token_major(path: Path) -> Path:
    """x[tokens, 64] @ w, reshaped to (-1, 128, 64) sequences: binds only at multiples of
    128 rows."""
    shape = helper.make_node("Constant", [], ["shape"], name="shape", value=numpy_helper.
                             from_array(np.array([-1, 128, 64], np.int64)))
    nodes = [shape, helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "shape"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")]
    weights = [numpy_helper.from_array(np.zeros((64, 64), np.float32), name)
               for name in ("w", "w2")]
    graph = helper.make_graph(
        nodes, "tokens", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_token_major_batch_pipelines(tmp_path: Path) -> None:
    """Micro-batch sizes the graph cannot bind at are skipped and said, never fatal; the
    micro-batches are sized in the rows the graph binds at (it used to exit 2)."""
    model = _token_major(tmp_path / "tokens.onnx")
    found = plan(model, devices=8, batch=1024, parallel={"pp": 2})
    assert found.parallel.pp == 2
    assert found.pipeline is not None and found.pipeline.micro_batch_size % 128 == 0
    assert any("micro-batches of 1, 2, 4" in w and "Reshape" in w for w in found.warnings)


def test_baselines_report_their_optimizer(tmp_path: Path) -> None:
    found = plan(_zoo("seed-mlp", tmp_path / "seed.onnx"), devices=8, batch=32,
                 optimizer="sgd")
    assert found.baselines and all(b.parallel.optimizer == "sgd"
                                   for b in found.baselines.values())


def test_plan_file_strategy_form_is_accepted_and_checked(tmp_path: Path) -> None:
    """One tuple per input (a scalar's empty, a non-data input's all ones), as plan files
    write them; a split non-data input is refused naming it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])
    nodes = [helper.make_node("Mul", ["x", "s"], ["m"], name="scale"),
             helper.make_node("Reshape", ["m", "shape"], ["y"], name="reshape")]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "s"),
             numpy_helper.from_array(np.array([8, 4], np.int64), "shape")]
    path = tmp_path / "scalar.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 17)]), path)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"scale": [[2, 1], []], "reshape": [[2, 1], [1]]}))
    assert main(["plan", str(path), "--devices", "2", "--mode", "semi", "--strategies",
                 str(good)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"reshape": [[2, 1], [2]]}))
    assert main(["plan", str(path), "--devices", "2", "--mode", "semi", "--strategies",
                 str(bad)]) == 2


def test_static_batch_plans_and_says_why_it_cannot_pipeline(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 128])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 64])
    weights = [numpy_helper.from_array(np.zeros(shape, np.float32), name)
               for name, shape in (("w", (128, 128)), ("w2", (128, 64)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")]
    path = tmp_path / "static.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "s", [x], [y], weights),
                                opset_imports=[helper.make_opsetid("", 17)]), path)
    found = plan(path, devices=8)
    assert found.model.batch == 32 and any("static batch of 32" in w for w in found.warnings)
    assert main(["plan", str(path), "--devices", "8", "--parallel", "pp=2"]) == 2
