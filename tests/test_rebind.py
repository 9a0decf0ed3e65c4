"""Re-binding dims from a graph's retained source: equal to a fresh import (graph or error),
no file read, memoised per binding, weights not kept twice; and its users (the Python
API, the joint search, the executor) plan and run without the file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graph_compare import graph_facts
from onnx import TensorProto, helper, numpy_helper

import planner
import planner.importer
from planner import zoo
from planner.api import load_graph
from planner.errors import ModelError
from planner.graph import FLOAT_DTYPES, PlanningGraph
from planner.importer import import_model, rebind
from planner.importer.tensors import DATA_FIELDS, ONNX_TO_NUMPY

GPT_TINY_BINDINGS = [
    {"batch": 2},
    {"batch": 8, "dims": {"seq": 4}},
    {"dims": {"seq": 8}},
    {"batch": 1, "dims": {"seq": 16}},
    {"dims": {"batch": 3, "seq": 2}},
]


@pytest.fixture(scope="module")
def gpt_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo.save(zoo.build("gpt-tiny"), tmp_path_factory.mktemp("zoo") / "gpt-tiny.onnx")


def _import_as_rebind(graph: PlanningGraph, path: Path, batch: int | None = None,
                      dims: dict[str, int] | None = None) -> PlanningGraph:
    """What `rebind(graph, batch=, dims=)` must equal: the file imported with the given dims
    and graph's others (its batch symbol dropped when a batch is given)."""
    kept = {k: v for k, v in graph.bound_dims.items() if k not in (dims or {})
            and not (batch is not None and k == graph.batch_symbol)}
    return import_model(path, batch=batch, dims={**(dims or {}), **kept})


def _error(call) -> str:
    with pytest.raises(ModelError) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize("binding", GPT_TINY_BINDINGS, ids=str)
def test_rebind_equals_a_fresh_import_of_a_zoo_model(gpt_tiny: Path, binding: dict) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    again = rebind(graph, **binding)
    assert graph_facts(again) == graph_facts(_import_as_rebind(graph, gpt_tiny, **binding))
    assert again.source is graph.source
    assert graph_facts(rebind(again, batch=4, dims={"seq": 16})) == graph_facts(graph)


@pytest.mark.slow
@pytest.mark.parametrize("exported", [{"model": "gpt2", "exporter": "dynamo", "opset": 18},
                                      {"model": "gpt2", "exporter": "dynamo", "opset": 18,
                                       "training": True},
                                      {"model": "llama", "exporter": "torchscript"}],
                         indirect=True, ids=["gpt2-dynamo", "gpt2-dynamo-train",
                                             "llama-torchscript"])
def test_rebind_equals_a_fresh_import_of_an_exported_model(exported: Path) -> None:
    graph = import_model(exported, batch=2, dims={"seq": 16})
    for binding in ({"batch": 4}, {"batch": 3, "dims": {"seq": 8}}, {"dims": {"seq": 32}}):
        again = rebind(graph, **binding)
        assert graph_facts(again) == graph_facts(_import_as_rebind(graph, exported, **binding))
    assert _error(lambda: rebind(graph, batch=0)) == _error(
        lambda: import_model(exported, batch=0, dims={"seq": 16}))


@pytest.mark.slow
@pytest.mark.parametrize("exported", [{"model": "llama", "exporter": "dynamo", "opset": 18},
                                      {"model": "llama", "exporter": "dynamo", "opset": 18,
                                       "training": True},
                                      {"model": "gpt2", "exporter": "dynamo", "opset": 18,
                                       "training": True},
                                      {"model": "bert", "exporter": "torchscript"}],
                         indirect=True, ids=["llama-dynamo", "llama-dynamo-train",
                                             "gpt2-dynamo-train", "bert-torchscript"])
def test_folding_stops_once_every_shape_is_static(exported: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The round that would only confirm a settled fold is spared, and the graph is the one
    folding until nothing changes gives (at two batches: the shape arithmetic differs)."""
    fold = planner.importer.fold
    rounds: list[int] = []
    infer = fold._infer

    def counted(*args: Any) -> Any:
        rounds.append(1)
        return infer(*args)

    monkeypatch.setattr(fold, "_infer", counted)
    settled = [import_model(exported, batch=b, dims={"seq": 16}) for b in (2, 5)]
    spared = len(rounds)
    rounds.clear()
    monkeypatch.setattr(fold, "_every_shape_static", lambda model, shapes: False)
    exhaustive = [import_model(exported, batch=b, dims={"seq": 16}) for b in (2, 5)]
    assert [graph_facts(g) for g in settled] == [graph_facts(g) for g in exhaustive]
    assert spared <= len(rounds)
    if "llama-dynamo" in exported.name:  # settled in its second round: the third is spared
        assert spared < len(rounds)


def test_rebind_reads_no_file(gpt_tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "gone.onnx"
    path.write_bytes(gpt_tiny.read_bytes())
    graph = import_model(path, batch=4, dims={"seq": 16})
    expected = import_model(path, batch=2, dims={"seq": 8})
    path.unlink()
    assert graph_facts(rebind(graph, batch=2, dims={"seq": 8})) == graph_facts(expected)


BAD_BINDINGS = [
    ({"batch": 0}, {"batch": 0, "dims": {"seq": 16}}),
    ({"batch": -3}, {"batch": -3, "dims": {"seq": 16}}),
    ({"dims": {"seq": 0}}, {"dims": {"seq": 0, "batch": 4}}),
    ({"dims": {"seq": 2.5}}, {"dims": {"seq": 2.5, "batch": 4}}),
    ({"dims": {"sequence": 4}}, {"dims": {"sequence": 4, "batch": 4, "seq": 16}}),
    ({"batch": 8, "dims": {"batch": 2}}, {"batch": 8, "dims": {"batch": 2, "seq": 16}}),
]


@pytest.mark.parametrize(("binding", "imported"), BAD_BINDINGS, ids=str)
def test_rebind_errors_equal_import_errors(gpt_tiny: Path, binding: dict,
                                           imported: dict) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    assert _error(lambda: rebind(graph, **binding)) == _error(
        lambda: import_model(gpt_tiny, **imported))


def _static_relu(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_static_batch_is_refused_alike(tmp_path: Path) -> None:
    path = _static_relu(tmp_path / "static.onnx")
    graph = import_model(path)
    assert rebind(graph, batch=2) is graph
    assert _error(lambda: rebind(graph, batch=8)) == _error(lambda: import_model(path, batch=8))


def test_rebind_is_memoised_per_binding(gpt_tiny: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    folds: list[tuple] = []
    fold = planner.importer.fold_until_stable

    def counted(*args: Any) -> Any:
        folds.append(args)
        return fold(*args)

    monkeypatch.setattr(planner.importer, "fold_until_stable", counted)
    first = rebind(graph, batch=2)
    assert rebind(graph, batch=2) is first
    assert rebind(graph, dims={"batch": 2}) is first  # the same binding, spelt otherwise
    assert rebind(first, batch=4) is graph and rebind(first, batch=4, dims={"seq": 16}) is graph
    assert rebind(graph) is graph and load_graph(graph) is graph
    assert len(folds) == 1
    assert rebind(graph, batch=2, dims={"seq": 8}) is not first
    assert len(folds) == 2


def _mlp_with_inline_weights() -> onnx.ModelProto:
    """x[batch, 8] -> MatMul(w 8x16) -> Add(b) -> Resize by scales -> y; weights inline."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(size=(16,)).astype(np.float16), "b"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
        numpy_helper.from_array(np.array([-1, 8, 2], dtype=np.int64), "shape3"),
        numpy_helper.from_array(np.array([1.0, 1.0, 2.0], dtype=np.float32), "scales"),
        numpy_helper.from_array(np.zeros(0, dtype=np.float32), "roi"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
        helper.make_node("Cast", ["b"], ["b32"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["h", "b32"], ["hb"], name="bias"),
        helper.make_node("Mul", ["hb", "half"], ["hh"], name="scale"),
        helper.make_node("Reshape", ["hh", "shape3"], ["h3"], name="split_rows"),
        helper.make_node("Resize", ["h3", "roi", "scales"], ["y"], name="upsample"),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_retained_source_keeps_no_weight_data(tmp_path: Path) -> None:
    model = _mlp_with_inline_weights()
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    graph = import_model(path, batch=4)
    assert graph.source is not None
    kept = graph.source.model()
    stripped = {t.name for t in kept.graph.initializer
                if not any(getattr(t, field) for field in DATA_FIELDS)}
    assert stripped == {"w", "b", "roi"}  # roi is empty: nothing to strip, nothing kept
    weights = {t.name: t for t in model.graph.initializer}
    for name in ("w", "b"):
        assert numpy_helper.to_array(weights[name]).tobytes() not in graph.source.proto
        tensor = next(t for t in kept.graph.initializer if t.name == name)
        assert (list(tensor.dims), tensor.data_type) == (list(weights[name].dims),
                                                         weights[name].data_type)
    for tensor in kept.graph.initializer:  # what folding and shape inference read stays
        if tensor.name in ("half", "shape3", "scales"):
            assert numpy_helper.to_array(tensor).tobytes() == numpy_helper.to_array(
                weights[tensor.name]).tobytes()
    assert len(graph.source.proto) < path.stat().st_size - 8 * 16 * 4
    assert graph.tensors["y"].shape == (4, 8, 4)  # the Resize scales were read
    assert {"w", "b"} <= {t.name for t in graph.parameters}
    assert graph_facts(rebind(graph, batch=6)) == graph_facts(import_model(path, batch=6))


def test_stripping_changes_no_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stripped source imports to the graph the whole model gives."""
    path = tmp_path / "weights.onnx"
    onnx.save(zoo.build("gpt-tiny", with_weights=True), path)
    onnx.save(_mlp_with_inline_weights(), tmp_path / "mlp.onnx")
    sizes = []
    for model, dims in ((path, {"seq": 8}), (tmp_path / "mlp.onnx", {})):
        stripped = import_model(model, batch=2, dims=dims)
        monkeypatch.setattr("planner.importer.source.unread_float_initializers", lambda m: [])
        whole = import_model(model, batch=2, dims=dims)
        monkeypatch.undo()
        assert graph_facts(stripped) == graph_facts(whole)
        assert stripped.source is not None and whole.source is not None
        assert any(ONNX_TO_NUMPY.get(t.data_type) in FLOAT_DTYPES and any(
            getattr(t, field) for field in DATA_FIELDS)
            for t in whole.source.model().graph.initializer)
        sizes.append((len(stripped.source.proto), len(whole.source.proto)))
    assert sizes[0][0] < sizes[0][1] // 4  # gpt-tiny: the weights were most of the file


def test_a_pickled_graph_keeps_its_source_but_not_the_bound_graphs(gpt_tiny: Path) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    rebind(graph, batch=2)
    copy = pickle.loads(pickle.dumps(graph))
    assert copy.source is not None and copy.source.graphs == {}
    assert graph_facts(rebind(copy, batch=2)) == graph_facts(rebind(graph, batch=2))


def test_a_graph_without_source_cannot_rebind(gpt_tiny: Path) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    graph.source = None
    assert rebind(graph, batch=4) is graph and load_graph(graph, dims={"seq": 16}) is graph
    with pytest.raises(ModelError, match="keeps no model to bind other dims"):
        rebind(graph, batch=2)


def test_load_graph_rebinds_a_graph_whose_binding_differs(gpt_tiny: Path) -> None:
    graph = import_model(gpt_tiny, batch=4, dims={"seq": 16})
    other = load_graph(graph, batch=2, dims={"seq": 8})
    assert (other.batch, other.bound_dims) == (2, {"batch": 2, "seq": 8})
    with pytest.raises(ModelError, match="names no input dim: sequence"):
        load_graph(graph, dims={"sequence": 8})


def test_a_graph_plans_the_joint_search_after_its_file_is_deleted(gpt_tiny: Path,
                                                                 tmp_path: Path) -> None:
    path = tmp_path / "gpt-tiny.onnx"
    path.write_bytes(gpt_tiny.read_bytes())
    pins = {"pp": 2, "micro_batches": 2}
    from_file = planner.plan(path, batch=8, dims={"seq": 16}, devices=4, parallel=pins)
    graph = import_model(path, batch=8, dims={"seq": 16})
    path.unlink()
    from_graph = planner.plan(graph, devices=4, parallel=pins)
    assert from_graph.parallel.pp == 2 and from_graph.parallel.micro_batches == 2
    assert from_graph.dumps() == from_file.dumps()
    at_four = planner.plan(graph, batch=4, devices=4, parallel=pins)  # re-bound, then planned
    assert at_four.model.batch == 2 and at_four.parallel.pp == 2  # 2 micro-batches of 2


def test_the_executor_rebinds_the_whole_batch_without_the_file(gpt_tiny: Path,
                                                              tmp_path: Path) -> None:
    from executor.train import graph_for, whole_batch_graph

    path = tmp_path / "gpt-tiny.onnx"
    path.write_bytes(gpt_tiny.read_bytes())
    plan = planner.plan(path, batch=8, dims={"seq": 16}, devices=4,
                        parallel={"pp": 2, "micro_batches": 2})
    micro = graph_for(path, plan)
    assert micro.batch is not None
    whole = import_model(path, batch=micro.batch * 2, dims={"seq": 16})
    path.unlink()
    assert graph_facts(whole_batch_graph(plan, micro)) == graph_facts(whole)
    assert graph_for(micro, plan) is micro


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_an_analysis_lent_another_bindings_wiring_equals_its_own(gpt_tiny: Path,
                                                                  batch: int) -> None:
    """`GraphAnalysis.of(graph, like=)` takes the wiring facts from another binding of the
    model (the joint search's micro-batch sizes): they must be what the graph gives."""
    from planner.sharding.analysis import GraphAnalysis, wired_alike

    root = GraphAnalysis.of(import_model(gpt_tiny, batch=4, dims={"seq": 16}))
    graph = rebind(root.graph, batch=batch)
    assert wired_alike(root.graph, graph)
    lent, own = GraphAnalysis.of(graph, like=root), GraphAnalysis.of(graph)
    for name in ("needs_grad", "differentiated", "weight_roots", "first_consumers",
                 "constant_ops", "labels", "batch_labels", "blocks", "sequence_labels"):
        assert getattr(lent, name) == getattr(own, name), name
    assert own.differentiated, "gpt-tiny trains: gradients flow through its ops"


def test_graphs_wired_otherwise_lend_nothing(gpt_tiny: Path, tmp_path: Path) -> None:
    """Another model, or the same one stored in another float type, is not wired alike:
    its analysis finds every fact itself."""
    from planner.importer import retyped
    from planner.sharding.analysis import GraphAnalysis, wired_alike

    root = GraphAnalysis.of(import_model(gpt_tiny, batch=4, dims={"seq": 16}))
    half = retyped(root.graph, "float16")
    assert not wired_alike(root.graph, half)
    other = import_model(_static_relu(tmp_path / "relu.onnx"))
    assert not wired_alike(root.graph, other)
    lent = GraphAnalysis.of(other, like=root)
    assert lent.needs_grad == GraphAnalysis.of(other).needs_grad
    assert lent.differentiated == GraphAnalysis.of(other).differentiated
    assert set(lent.needs_grad) == set(other.tensors)
