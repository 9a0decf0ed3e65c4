"""Conversions to and from MindSpore (layouts, strategy tuples, checkpoint) and DTensor."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import zoo
from planner.api import load_graph, plan
from planner.errors import StrategyError
from planner.exports.dtensor import to_dtensor_placements
from planner.exports.mindspore import strategy_key, to_mindspore_checkpoint
from planner.graph import OpNode, TensorInfo
from planner.ops import labels_for
from planner.plans.model import Plan
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.batch import data_parallel_strategies
from planner.sharding.convert import (
    MindSporeLayout,
    default_axis_names,
    from_mindspore_layout,
    from_placements,
    label_factors,
    mesh_for_tuples,
    strategy_from_tuples,
    to_mindspore_layout,
    to_placements,
    tuples_from_strategy,
)
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy, input_layouts, output_layouts


def _tensors(**shapes: tuple[int, ...]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, shape, "float32", "activation") for name, shape in
            shapes.items()}


def _matmul(a: tuple[int, int], b: tuple[int, int]):
    tensors = _tensors(x=a, w=b, y=(a[0], b[1]))
    node = OpNode("mm", "MatMul", "", ("x", "w"), ("y",), {})
    return node, labels_for(node, tensors), tensors


def _mm_strategy(labels, **axes: tuple[str, ...]) -> OpStrategy:
    """OpStrategy of MatMul labels given by role (m, k, n): the rule numbers its labels."""
    (m, k), (_, n) = labels.inputs
    role = {"m": m, "k": k, "n": n}
    return OpStrategy.of({role[name]: value for name, value in axes.items()})


def _mesh(*shape: int, per_node: int = 8) -> DeviceMesh:
    return DeviceMesh(tuple(shape), default_axis_names(len(shape)), per_node)


def _layouts(node, labels, tensors, strategy):
    ranks_in = [len(tensors[t].shape) for t in node.inputs]
    ranks_out = [len(tensors[t].shape) for t in node.outputs]
    return (input_layouts(labels, strategy, ranks_in),
            output_layouts(labels, strategy, ranks_out))


# --------------------------------------------------------------------------- seed examples


def test_seed_weight_column_split_on_two_devices() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    mesh = _mesh(2)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((1, 1), (1, 2)))
    assert strategy == _mm_strategy(labels, n=("a0",))
    (x, w), (y,) = _layouts(node, labels, tensors, strategy)
    assert x == Layout.replicated(2)
    assert w == Layout(((), ("a0",)))
    assert y == Layout(((), ("a0",))) and not y.partial
    assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == ((1, 1), (1, 2))


def test_seed_contraction_split_gives_partial_sums() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    mesh = _mesh(2)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((1, 2), (2, 1)))
    assert strategy == _mm_strategy(labels, k=("a0",))
    (x, w), (y,) = _layouts(node, labels, tensors, strategy)
    assert x == Layout(((), ("a0",)))
    assert w == Layout((("a0",), ()))
    assert y.partial == ("a0",) and y.dims == ((), ())
    assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == ((1, 2), (2, 1))


def test_seed_batch_split_is_data_parallel() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    mesh = _mesh(2)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((2, 1), (1, 1)))
    (x, w), (y,) = _layouts(node, labels, tensors, strategy)
    assert x == Layout((("a0",), ())) and w.is_replicated
    assert y == Layout((("a0",), ()))
    assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == ((2, 1), (1, 1))


@pytest.mark.parametrize("tuples", [((8, 1), (1, 1)), ((1, 1), (1, 8)), ((1, 8), (8, 1))])
def test_seed_64x1024x4096_splits_on_eight_devices(tuples) -> None:
    node, labels, tensors = _matmul((64, 1024), (1024, 4096))
    mesh = mesh_for_tuples(tuples, 8, 8)
    assert mesh.shape == (8,)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, tuples)
    assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == tuples
    (_, _), (y,) = _layouts(node, labels, tensors, strategy)
    assert bool(y.partial) == (tuples == ((1, 8), (8, 1)))


def test_replicated_tuples_give_the_empty_strategy() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    strategy = strategy_from_tuples(node, labels, tensors, _mesh(2), ((1, 1), (1, 1)))
    assert strategy == OpStrategy()


# --------------------------------------------------------------------------- axis choice


def test_last_split_takes_the_innermost_axis() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    mesh = _mesh(2, 2)
    cases = {
        ((1, 1), (1, 2)): {"n": ("a1",)},
        ((2, 1), (1, 2)): {"m": ("a0",), "n": ("a1",)},
        ((2, 2), (2, 1)): {"m": ("a0",), "k": ("a1",)},
        ((2, 1), (1, 1)): {"m": ("a1",)},
        ((4, 1), (1, 1)): {"m": ("a0", "a1")},
    }
    for tuples, expected in cases.items():
        strategy = strategy_from_tuples(node, labels, tensors, mesh, tuples)
        assert strategy == _mm_strategy(labels, **expected), tuples
        assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == tuples


def test_axis_choice_prefers_inner_axes_and_backtracks() -> None:
    node, labels, tensors = _matmul((64, 128), (128, 64))
    mesh = _mesh(4, 2, 2)
    # n = 4 is served first: the two inner axes (a1, a2) rather than a0.
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((1, 1), (1, 4)))
    assert strategy == _mm_strategy(labels, n=("a1", "a2"))
    # m = 4 and n = 2: n takes a2, m cannot take (a1, a2) any more and takes a0.
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((4, 1), (1, 2)))
    assert strategy == _mm_strategy(labels, m=("a0",), n=("a2",))
    # m = 2 and n = 8: n needs a0 with one inner axis; m gets the other.
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((2, 1), (1, 8)))
    assert strategy == _mm_strategy(labels, m=("a1",), n=("a0", "a2"))


def test_non_data_inputs_take_no_tuple() -> None:
    tensors = _tensors(x=(4, 6, 8), y=(24, 8))
    tensors["shape"] = TensorInfo("shape", (2,), "int64", "constant")
    node = OpNode("r", "Reshape", "", ("x", "shape"), ("y",), {})
    labels = labels_for(node, tensors)
    strategy = strategy_from_tuples(node, labels, tensors, _mesh(2), ((2, 1, 1),))
    assert tuples_from_strategy(node, labels, strategy, tensors, _mesh(2)) == ((2, 1, 1),)
    # the plan file's form, one tuple per input, is read too (a plan feeds back as written)
    assert strategy_from_tuples(node, labels, tensors, _mesh(2), ((2, 1, 1), (1,))) == strategy
    with pytest.raises(StrategyError, match=r"input 1 \(shape\) is not data"):
        strategy_from_tuples(node, labels, tensors, _mesh(2), ((2, 1, 1), (2,)))
    with pytest.raises(StrategyError, match=r"3 strategy tuple\(s\).*1 data input"):
        strategy_from_tuples(node, labels, tensors, _mesh(2), ((2, 1, 1), (1,), (1,)))


def test_gemm_with_transposed_weight() -> None:
    tensors = _tensors(x=(16, 32), w=(64, 32), b=(64,), y=(16, 64))
    node = OpNode("g", "Gemm", "", ("x", "w", "b"), ("y",), {"transB": 1})
    labels = labels_for(node, tensors)
    mesh = _mesh(2, 4)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((2, 1), (4, 1), (4,)))
    assert strategy == OpStrategy.of({"m": ("a0",), "n": ("a1",)})
    assert tuples_from_strategy(node, labels, strategy, tensors, mesh) == ((2, 1), (4, 1), (4,))


# --------------------------------------------------------------------------- errors


def test_inconsistent_contraction_factors_are_named() -> None:
    node, labels, tensors = _matmul((64, 1024), (1024, 4096))
    with pytest.raises(StrategyError) as err:
        strategy_from_tuples(node, labels, tensors, _mesh(8), ((1, 2), (4, 1)))
    message = str(err.value)
    assert "op mm (MatMul)" in message
    assert "input 0 (x) dim 1 is split 2 ways" in message
    assert "input 1 (w) dim 0 is split 4 ways" in message


def test_factor_that_does_not_divide_the_dim() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    with pytest.raises(StrategyError) as err:
        strategy_from_tuples(node, labels, tensors, _mesh(3), ((3, 1), (1, 1)))
    message = str(err.value)
    assert "op mm (MatMul)" in message and "input 0 (x) dim 0 of size 32" in message
    assert "3 equal parts" in message


@pytest.mark.parametrize(("tuples", "pattern"), [
    (((1, 1),), r"op mm \(MatMul\): got 1 strategy tuple\(s\) but the op has 2 data"),
    (((1, 1), (1, 1), (1, 1)), r"got 3 strategy tuple\(s\)"),
    (((1, 1, 1), (1, 1)), r"input 0 \(x\) has shape \[32, 128\] \(2 dims\).* 3 entries"),
    (((0, 1), (1, 1)), r"input 0 \(x\) dim 0: split factor 0 must be a positive integer"),
])
def test_wrong_tuple_count_or_length(tuples, pattern) -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    with pytest.raises(StrategyError, match=pattern):
        strategy_from_tuples(node, labels, tensors, _mesh(2), tuples)


def test_factor_the_mesh_cannot_realise() -> None:
    node, labels, tensors = _matmul((48, 128), (128, 64))
    with pytest.raises(StrategyError) as err:
        strategy_from_tuples(node, labels, tensors, _mesh(2, 2), ((3, 1), (1, 1)))
    message = str(err.value)
    assert "op mm (MatMul)" in message and ": 3}" in message and "[2, 2]" in message


def test_factors_needing_more_devices_than_the_mesh() -> None:
    node, labels, tensors = _matmul((32, 128), (128, 64))
    with pytest.raises(StrategyError, match="need 8 devices but the mesh has 4"):
        strategy_from_tuples(node, labels, tensors, _mesh(2, 2), ((2, 2), (2, 2)))


def test_whole_dims_refuse_a_split() -> None:
    tensors = _tensors(x=(4, 16), y=(4, 16))
    node = OpNode("sm", "Softmax", "", ("x",), ("y",), {"axis": -1})
    labels = labels_for(node, tensors)
    with pytest.raises(StrategyError, match=r"op sm \(Softmax\): input 0 \(x\) dim 1 must stay"):
        label_factors(node, labels, tensors, ((1, 2),))


def test_op_without_rule_takes_only_ones() -> None:
    tensors = _tensors(x=(4, 16), y=(4, 16))
    node = OpNode("c", "Custom", "com.example", ("x",), ("y",), {})
    assert strategy_from_tuples(node, None, tensors, _mesh(2), ((1, 1),)) == OpStrategy()
    with pytest.raises(StrategyError, match="has no sharding rule"):
        strategy_from_tuples(node, None, tensors, _mesh(2), ((2, 1),))


# --------------------------------------------------------------------------- mesh from tuples


def test_mesh_for_tuples_follows_the_order_of_the_factors() -> None:
    mesh = mesh_for_tuples(((2, 1), (1, 4)), 8, 8)
    assert mesh.shape == (2, 4) and mesh.axis_names == ("a0", "a1")
    assert mesh_for_tuples(((4, 1), (1, 2)), 8, 8).shape == (4, 2)
    assert mesh_for_tuples([((2, 1), (1, 1)), ((1, 1), (1, 4))], 8, 8).shape == (2, 4)
    assert mesh_for_tuples(((2, 2), (2, 1)), 8, 8).shape == (2, 2, 2)
    assert mesh_for_tuples(((1, 1), (1, 1)), 4, 8).shape == (4,)
    assert mesh_for_tuples(((1,),), 1, 8).shape == (1,)


def test_mesh_for_tuples_then_strategy() -> None:
    node, labels, tensors = _matmul((64, 1024), (1024, 4096))
    mesh = mesh_for_tuples(((2, 1), (1, 4)), 8, 8)
    strategy = strategy_from_tuples(node, labels, tensors, mesh, ((2, 1), (1, 4)))
    assert strategy == _mm_strategy(labels, m=("a0",), n=("a1",))


def test_mesh_for_tuples_refuses_impossible_factors() -> None:
    with pytest.raises(StrategyError, match=r"\(3, 1\).*does not divide the 8 devices"):
        mesh_for_tuples(((3, 1), (1, 1)), 8, 8)
    with pytest.raises(StrategyError, match="16 parts"):
        mesh_for_tuples(((4, 4),), 8, 8)
    with pytest.raises(StrategyError, match="no mesh of 16 devices"):
        mesh_for_tuples(((2, 2, 2, 2),), 16, 8)


# --------------------------------------------------------------------------- MindSpore layout


def test_mindspore_tensor_map_counts_from_the_right() -> None:
    mesh = DeviceMesh((2, 4), ("dp", "mp"), 8)
    assert to_mindspore_layout(Layout((("dp",), ("mp",))), mesh) == MindSporeLayout((2, 4), (1, 0))
    assert to_mindspore_layout(Layout((("mp",), ())), mesh).tensor_map == (0, -1)
    both = to_mindspore_layout(Layout(((), ("dp", "mp"))), mesh)
    assert both.tensor_map == (-1, (1, 0))
    assert both.to_json() == {"dev_matrix": [2, 4], "tensor_map": [-1, [1, 0]]}
    layout, back = from_mindspore_layout(both, ("dp", "mp"), 8)
    assert layout == Layout(((), ("dp", "mp"))) and back == mesh


def test_mindspore_layout_refuses_partial_sums() -> None:
    mesh = _mesh(2, 2)
    with pytest.raises(StrategyError, match=r"weight.*partial sum over mesh axes \['a1'\]"):
        to_mindspore_layout(Layout((("a0",), ()), ("a1",)), mesh, "weight")


def test_mindspore_layout_refuses_bad_maps() -> None:
    with pytest.raises(StrategyError, match="outside the device matrix"):
        from_mindspore_layout(MindSporeLayout((2, 2), (2, -1)), None, 8)
    with pytest.raises(StrategyError, match="splits more than one dim"):
        from_mindspore_layout(MindSporeLayout((2, 2), (0, 0)), None, 8)
    with pytest.raises(StrategyError, match="used twice"):
        to_mindspore_layout(Layout((("a0",), ("a0",))), _mesh(2, 2))
    layout, _ = from_mindspore_layout(MindSporeLayout((2, 2), ((1, -1), -1)), None, 8)
    assert layout == Layout((("a0",), ()))


@st.composite
def meshes_and_layouts(draw, with_partial: bool):
    """A mesh of 1-3 axes (sizes 1-4) and a layout using each axis at most once."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    mesh = DeviceMesh(shape, default_axis_names(len(shape)), 8)
    rank = draw(st.integers(0, 4))
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial: list[str] = []
    order = draw(st.permutations(mesh.axis_names))
    for axis in order:
        choice = draw(st.integers(-2 if with_partial else -1, rank - 1))
        if choice >= 0:
            dims[choice].append(axis)
        elif choice == -2:
            partial.append(axis)
    return mesh, Layout(tuple(tuple(d) for d in dims), tuple(partial))


@settings(max_examples=300, deadline=None)
@given(meshes_and_layouts(with_partial=False))
def test_mindspore_layout_round_trip(case) -> None:
    mesh, layout = case
    ms_layout = to_mindspore_layout(layout, mesh)
    assert ms_layout.dev_matrix == mesh.shape
    json.dumps(ms_layout.to_json())
    back, back_mesh = from_mindspore_layout(ms_layout, mesh.axis_names, mesh.devices_per_node)
    assert back == layout and back_mesh == mesh
    assert back.split_factors(mesh) == layout.split_factors(mesh)


# --------------------------------------------------------------------------- DTensor


def test_placements_of_a_two_axis_mesh() -> None:
    mesh = DeviceMesh((2, 4), ("dp", "tp"), 8)
    assert to_placements(Layout((("dp",), ("tp",))), mesh) == ("Shard(0)", "Shard(1)")
    assert to_placements(Layout(((), ()), ("tp",)), mesh) == ("Replicate()", "Partial()")
    assert to_placements(Layout((("dp", "tp"),)), mesh) == ("Shard(0)", "Shard(0)")
    with pytest.raises(StrategyError, match=r"weight: dim 0 is split by mesh axes \['tp', 'dp'\]"):
        to_placements(Layout((("tp", "dp"),)), mesh, "weight")


def test_placements_read_the_usual_spellings() -> None:
    mesh = _mesh(2, 2, 2)
    expected = Layout((("a1",), ()), ("a2",))
    for spelling in (["Replicate()", "Shard(0)", "Partial()"],
                     ["R", "S(0)", "P(sum)"],
                     ["Replicate()", "Shard(dim=-2)", "Partial(sum)"]):
        assert from_placements(spelling, 2, mesh) == expected
    with pytest.raises(StrategyError, match="one per mesh axis"):
        from_placements(["Shard(0)"], 2, mesh)
    with pytest.raises(StrategyError, match="has no dim 2"):
        from_placements(["Shard(2)", "R", "R"], 2, mesh)
    with pytest.raises(StrategyError, match="pending sums"):
        from_placements(["Partial(max)", "R", "R"], 2, mesh)
    with pytest.raises(StrategyError, match="is not Shard"):
        from_placements(["Split(0)", "R", "R"], 2, mesh)


@st.composite
def mesh_ordered_layouts(draw):
    mesh, layout = draw(meshes_and_layouts(with_partial=True))
    index = mesh.axis_names.index
    return mesh, Layout(tuple(tuple(sorted(axes, key=index)) for axes in layout.dims),
                        tuple(sorted(layout.partial, key=index)))


@settings(max_examples=300, deadline=None)
@given(mesh_ordered_layouts())
def test_placements_round_trip(case) -> None:
    mesh, layout = case
    placements = to_placements(layout, mesh)
    assert len(placements) == len(mesh.shape)
    assert from_placements(placements, layout.rank, mesh) == layout


def test_placement_strings_are_torch_placements() -> None:
    tensor = pytest.importorskip("torch.distributed.tensor")
    names = {"Shard": tensor.Shard, "Replicate": tensor.Replicate, "Partial": tensor.Partial}
    mesh = DeviceMesh((2, 2, 2), ("dp", "tp", "sp"), 8)
    placements = to_placements(Layout((("dp",), ("sp",)), ("tp",)), mesh)
    built = [eval(text, {"__builtins__": {}}, names) for text in placements]
    assert built == [tensor.Shard(0), tensor.Partial("sum"), tensor.Shard(1)]
    assert from_placements([repr(p) for p in built], 2, mesh) == Layout(
        (("dp",), ("sp",)), ("tp",))
    assert from_placements([str(p) for p in built], 2, mesh) == Layout(
        (("dp",), ("sp",)), ("tp",))


# --------------------------------------------------------------------------- real plans


@pytest.fixture(scope="module")
def gpt_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    family, cfg = zoo.preset("gpt-tiny")
    return zoo.save(zoo.build(family, cfg), tmp_path_factory.mktemp("convert") / "g.onnx")


@pytest.fixture(scope="module")
def gpt_plan(gpt_path: pathlib.Path) -> Plan:
    return plan(gpt_path, devices=2, batch=4, dims={"seq": 8}, mode="data")


def _parameters(result: Plan) -> set[str]:
    return {name for name, t in result.tensors.items() if t.kind == "parameter"}


def test_mindspore_checkpoint_of_a_data_parallel_plan(gpt_plan: Plan) -> None:
    checkpoint = to_mindspore_checkpoint(gpt_plan)
    json.loads(json.dumps(checkpoint))
    assert checkpoint["current_stage"] == 0
    params = checkpoint["parallel_layout_item"]
    assert set(params) == _parameters(gpt_plan) and params
    for name, item in params.items():
        assert item["dev_matrix"] == [2]
        assert item["tensor_map"] == [-1] * len(gpt_plan.tensors[name].shape)
        assert item["tensor_shape"] == list(gpt_plan.tensors[name].shape)
        assert item["field"] == item["opt_weight_shard_step"] == 0
    strategies = checkpoint["parallel_strategy_item"]
    weights = _parameters(gpt_plan)
    keyed = 0
    for op in gpt_plan.ops:  # keyed as MindSpore keys them: primitive "_" first weight read
        read = [b.tensor for b in op.inputs if b is not None and b.tensor in weights]
        if not read:
            continue
        rank = max(len(gpt_plan.tensors[b.tensor].shape) for b in op.inputs if b is not None)
        entry = strategies.get(strategy_key(op.op_type, rank, read[0]))
        if entry is None or entry["parallel_strategy"] != [
                list(s) for s, b in zip(op.strategy, op.inputs, strict=True) if b is not None]:
            continue  # a second reader of the same weight and primitive: the first is kept
        assert entry["stage"] == 0
        keyed += 1
    assert keyed and len(strategies) >= keyed
    assert all("_" in key and key.split("_", 1)[1] in weights for key in strategies)
    assert any(2 in dims for e in strategies.values() for dims in e["parallel_strategy"])
    values = checkpoint["parallel_layout_value_item"]
    for op_name, items in values.items():
        for item in items.values():
            assert item["alias_name"] == ["dp"] and item["dev_matrix"] == [2]
            assert all(isinstance(entry, list) for entry in item["tensor_map"])
            assert op_name in strategies


def test_dtensor_placements_of_a_data_parallel_plan(gpt_plan: Plan) -> None:
    placements = to_dtensor_placements(gpt_plan)
    assert set(placements) == _parameters(gpt_plan) and placements
    assert all(p == ["Replicate()"] for p in placements.values())
    json.dumps(placements)


def test_checkpoint_flattens_neighbouring_axes(gpt_plan: Plan) -> None:
    mesh = _mesh(2, 2, 2)
    name = next(n for n, t in gpt_plan.tensors.items()
                if t.kind == "parameter" and len(t.shape) == 2 and t.shape[0] % 4 == 0
                and t.shape[1] % 2 == 0)
    tensors = dict(gpt_plan.tensors)
    tensors[name] = dataclasses.replace(tensors[name], layout=Layout((("a0", "a1"), ("a2",))))
    merged = dataclasses.replace(gpt_plan, mesh=mesh, ops=[], tensors={name: tensors[name]})
    item = to_mindspore_checkpoint(merged)["parallel_layout_item"][name]
    assert item["dev_matrix"] == [4, 2] and item["tensor_map"] == [1, 0]
    tensors[name] = dataclasses.replace(tensors[name], layout=Layout((("a0", "a2"), ())))
    apart = dataclasses.replace(merged, tensors={name: tensors[name]})
    item = to_mindspore_checkpoint(apart)["parallel_layout_item"][name]
    assert item["dev_matrix"] == [2, 2, 2] and item["tensor_map"] == [[2, 0], [-1]]
    assert to_dtensor_placements(apart)[name] == ["Shard(0)", "Replicate()", "Shard(0)"]


def test_every_op_of_a_real_graph_round_trips_its_tuples(gpt_path: pathlib.Path) -> None:
    graph = load_graph(gpt_path, batch=4, dims={"seq": 8})
    mesh = DeviceMesh.build({"dp": 2}, 8)
    labels = GraphAnalysis.of(graph).labels
    strategies = data_parallel_strategies(graph, mesh, labels)
    checked = 0
    for node in graph.ops:
        node_labels = labels[node.name]
        if node_labels is None:
            continue
        strategy = strategies.get(node.name, OpStrategy())
        tuples = tuples_from_strategy(node, node_labels, strategy, graph.tensors, mesh)
        again = strategy_from_tuples(node, node_labels, graph.tensors, mesh, tuples)
        assert again == strategy, node.name
        checked += 1
    assert checked > 10


def test_mindspore_keys_follow_the_cell_path_of_the_planned_network(tmp_path) -> None:
    """The seed's network with its `shard()` tuples: MindSpore keys a strategy by the
    primitive and the parameter's cell-path name, so the network trained as `self.net`
    of another cell reads `MatMul_net.w1` (the form MindSpore 2.10 loads); --name-prefix
    gives it, on the strategies and the parameter layouts alike."""
    from planner import zoo
    from planner.cli import main

    family, config = zoo.preset("seed-mlp")
    model = zoo.save(zoo.build(family, config), tmp_path / "seed.onnx")
    strategies = tmp_path / "shard.json"
    strategies.write_text(json.dumps({"matmul1": [[1, 1], [1, 2]], "matmul2": [[1, 2], [2, 1]]}))
    saved, exported = tmp_path / "plan.json", tmp_path / "ms.json"
    assert main(["plan", str(model), "--devices", "2", "--batch", "32", "--mode", "semi",
                 "--strategies", str(strategies), "-o", str(saved)]) == 0
    assert main(["export", str(saved), "--format", "mindspore", "--name-prefix", "net.",
                 "-o", str(exported)]) == 0
    checkpoint = json.loads(exported.read_text())
    items = checkpoint["parallel_strategy_item"]
    assert items["MatMul_net.w1"]["parallel_strategy"] == [[1, 1], [1, 2]]
    assert items["MatMul_net.w2"]["parallel_strategy"] == [[1, 2], [2, 1]]
    assert set(checkpoint["parallel_layout_item"]) == {"net.w1", "net.w2"}
    assert checkpoint["parallel_layout_item"]["net.w1"]["tensor_map"] == [-1, 0]
    plain = to_mindspore_checkpoint(Plan.load(saved))
    assert set(plain["parallel_strategy_item"]) == {"MatMul_w1", "MatMul_w2"}
    assert main(["export", str(saved), "--format", "dtensor", "--name-prefix", "net."]) == 2
