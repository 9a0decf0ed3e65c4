"""Mesh, layouts, einsum-style op labels, strategies and redistribution."""

from __future__ import annotations

import numpy as np
import pytest

from planner.errors import StrategyError
from planner.graph import OpNode, TensorInfo
from planner.ops import labels_for
from planner.ops.movement import reshape_groups as _reshape_groups
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh, factorizations
from planner.sharding.redistribute import CommStep, backward_steps, redistribute
from planner.sharding.strategy import (
    OpStrategy,
    check_strategy,
    grad_partial_axes,
    input_layouts,
    output_layouts,
    work_fraction,
)


def _tensors(**shapes: tuple[int, ...]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, shape, "float32", "activation") for name, shape in
            shapes.items()}


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: object) -> OpNode:
    return OpNode(op_type.lower(), op_type, "", tuple(inputs), tuple(outputs), dict(attrs))


# --------------------------------------------------------------------------- mesh


def test_mesh_axes_know_whether_they_stay_in_a_node() -> None:
    mesh = DeviceMesh.build({"dp": 4, "tp": 8}, devices_per_node=8)
    assert mesh.size == 32
    assert mesh.axis_stride("tp") == 1 and mesh.axis_stride("dp") == 8
    assert mesh.intra_node("tp") and not mesh.intra_node("dp")
    assert mesh.group_extent(["dp", "tp"]) == 32
    assert mesh.to_json()["intra_node"] == [False, True]


def test_mesh_rejects_bad_shapes() -> None:
    with pytest.raises(StrategyError):
        DeviceMesh((2, 2), ("dp", "dp"), 8)
    with pytest.raises(StrategyError):
        DeviceMesh((2, 2, 2, 2), ("a", "b", "c", "d"), 8)
    with pytest.raises(StrategyError, match="not one of"):
        DeviceMesh.build({"dp": 2}, 8).axis_size("tp")


def test_factorizations_cover_any_count() -> None:
    assert factorizations(6, 2) == [(6,), (2, 3), (3, 2)]
    assert (2, 2, 3) in factorizations(12)
    assert all(int(np.prod(f)) == 12 for f in factorizations(12))
    assert factorizations(7) == [(7,)]


# --------------------------------------------------------------------------- layout


def test_layout_split_factors_and_local_shape() -> None:
    mesh = DeviceMesh.build({"dp": 2, "tp": 4}, 8)
    layout = Layout(((), ("tp",), ("dp",)))
    assert layout.split_factors(mesh) == (1, 4, 2)
    assert layout.local_shape((3, 8, 6), mesh) == (3, 2, 3)
    with pytest.raises(StrategyError, match="dim 2 of size 5 cannot be split into 2"):
        layout.check((3, 8, 5), mesh, "tensor w")
    assert Layout.from_json(layout.to_json()) == layout


# --------------------------------------------------------------------------- labels


def test_matmul_seed_example_candidates() -> None:
    """MatMul [64, 1024] x [1024, 4096] on 8 devices: batch, column and row splits."""
    mesh = DeviceMesh.build({"x": 8}, 8)
    tensors = _tensors(a=(64, 1024), w=(1024, 4096), y=(64, 4096))
    node = _node("MatMul", ["a", "w"], ["y"])
    labels = labels_for(node, tensors)
    assert labels is not None
    m, k = labels.inputs[0]
    k2, n = labels.inputs[1]
    assert k == k2 and labels.outputs[0] == (m, n) and labels.sum_labels == {k}
    ranks = [2, 2]
    data = OpStrategy.of({m: ("x",)})
    assert input_layouts(labels, data, ranks) == [Layout((("x",), ())), Layout(((), ()))]
    assert grad_partial_axes(labels, data, 1) == ("x",)  # weight gradient needs AllReduce
    column = OpStrategy.of({n: ("x",)})
    assert output_layouts(labels, column, [2]) == [Layout(((), ("x",)))]
    assert input_layouts(labels, column, ranks)[1].split_factors(mesh) == (1, 8)
    row = OpStrategy.of({k: ("x",)})
    assert output_layouts(labels, row, [2]) == [Layout(((), ()), ("x",))]  # partial sum
    for strategy in (data, column, row):
        check_strategy(node, labels, strategy, tensors, mesh)
        assert work_fraction(strategy, mesh) == 1 / 8


def test_strategy_that_does_not_divide_names_the_numbers() -> None:
    mesh = DeviceMesh.build({"x": 8}, 8)
    tensors = _tensors(a=(6, 16), w=(16, 4), y=(6, 4))
    node = _node("MatMul", ["a", "w"], ["y"])
    labels = labels_for(node, tensors)
    assert labels is not None
    m = labels.inputs[0][0]
    with pytest.raises(StrategyError, match="size 6 cannot be split into 8"):
        check_strategy(node, labels, OpStrategy.of({m: ("x",)}), tensors, mesh)


def test_elementwise_broadcast_labels() -> None:
    tensors = _tensors(x=(4, 1, 8), b=(8,), y=(4, 3, 8))
    labels = labels_for(_node("Add", ["x", "b"], ["y"]), tensors)
    assert labels is not None
    x_labels, b_labels = labels.inputs
    out = labels.outputs[0]
    assert x_labels[0] == out[0] and x_labels[2] == out[2] == b_labels[0]
    assert x_labels[1] in labels.whole_labels  # broadcast from size 1


def test_softmax_axis_stays_whole() -> None:
    tensors = _tensors(x=(2, 4, 8), y=(2, 4, 8))
    labels = labels_for(_node("Softmax", ["x"], ["y"], axis=-1), tensors)
    assert labels is not None and labels.whole_labels == {labels.inputs[0][2]}


@pytest.mark.parametrize(
    ("source", "target", "groups"),
    [
        ((4, 32, 64), (128, 64), [([0, 1], [0]), ([2], [1])]),
        ((4, 32, 64), (4, 32, 4, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
        ((4, 1, 32), (4, 32), [([0], [0]), ([2], [1])]),
        ((6,), (2, 3), [([0], [0, 1])]),
    ],
)
def test_reshape_groups(source: tuple[int, ...], target: tuple[int, ...],
                        groups: list[tuple[list[int], list[int]]]) -> None:
    assert _reshape_groups(source, target) == groups


def test_reshape_keeps_batch_label_on_merged_leading_dim() -> None:
    tensors = _tensors(x=(4, 32, 64), y=(128, 64))
    labels = labels_for(_node("Reshape", ["x", "shape"], ["y"]), {**tensors, "shape": TensorInfo(
        "shape", (2,), "int64", "constant")})
    assert labels is not None
    assert labels.inputs[0][0] == labels.outputs[0][0]
    assert labels.inputs[0][1] in labels.whole_labels
    assert labels.inputs[1] is None


def test_gather_vocab_split_is_a_partial_sum() -> None:
    tensors = _tensors(table=(1000, 64), out=(2, 16, 64))
    tensors["ids"] = TensorInfo("ids", (2, 16), "int64", "input")
    labels = labels_for(_node("Gather", ["table", "ids"], ["out"]), tensors)
    assert labels is not None
    vocab, hidden = labels.inputs[0]
    assert labels.sum_labels == {vocab}
    assert labels.outputs[0] == (*labels.inputs[1], hidden)


def test_conv_input_channels_are_contracted() -> None:
    tensors = _tensors(x=(8, 16, 32, 32), w=(32, 16, 3, 3), y=(8, 32, 30, 30))
    labels = labels_for(_node("Conv", ["x", "w"], ["y"]), tensors)
    assert labels is not None
    assert labels.sum_labels == {"cin"}
    assert {"x0", "k0", "y0"} <= labels.whole_labels


def test_batch_norm_training_needs_statistics_sync() -> None:
    tensors = _tensors(x=(8, 16, 4, 4), s=(16,), b=(16,), m=(16,), v=(16,), y=(8, 16, 4, 4))
    node = _node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], training_mode=1)
    labels = labels_for(node, tensors)
    assert labels is not None and labels.inputs[0][0] in labels.sync_labels


# --------------------------------------------------------------------------- redistribution


def _kinds(steps: list[CommStep]) -> list[tuple[str, tuple[str, ...], int | None, int | None]]:
    return [(s.kind, s.axes, s.src_dim, s.dst_dim) for s in steps]


def test_redistribution_steps_and_their_transposes() -> None:
    mesh = DeviceMesh.build({"dp": 2, "tp": 4}, 8)
    shape, itemsize = (8, 16), 4
    split = Layout((("dp",), ()))
    replicated = Layout(((), ()))
    partial = Layout(((), ()), ("tp",))
    gather = redistribute(split, replicated, shape, itemsize, mesh)
    assert gather == [CommStep("all_gather", ("dp",), 8 * 16 * 4, 0, None)]
    assert _kinds(backward_steps(gather, (), 256)) == [("slice", ("dp",), None, 0)]
    assert _kinds(backward_steps(gather, ("dp",), 256)) == [("reduce_scatter", ("dp",), None, 0)]
    assert _kinds(redistribute(replicated, split, shape, itemsize, mesh)) == [
        ("slice", ("dp",), None, 0)]
    reduce = redistribute(partial, replicated, shape, itemsize, mesh)
    assert reduce == [CommStep("all_reduce", ("tp",), 8 * 16 * 4)]
    assert backward_steps(reduce, (), 512) == []
    scatter = redistribute(partial, Layout(((), ("tp",))), shape, itemsize, mesh)
    assert _kinds(scatter) == [("reduce_scatter", ("tp",), None, 1)]
    moved = redistribute(Layout((("tp",), ())), Layout(((), ("tp",))), shape, itemsize, mesh)
    assert _kinds(moved) == [("all_to_all", ("tp",), 0, 1)]
    assert _kinds(backward_steps(moved, (), 128)) == [("all_to_all", ("tp",), 1, 0)]
    assert redistribute(split, split, shape, itemsize, mesh) == []


def test_redistribution_respects_split_order() -> None:
    """Only the minor axis of a dim can leave it: ("dp", "tp") -> ("tp",) goes via tp."""
    mesh = DeviceMesh.build({"dp": 2, "tp": 4}, 8)
    steps = redistribute(Layout((("dp", "tp"), ())), Layout((("tp",), ())), (16, 4), 4, mesh)
    kinds = _kinds(steps)
    assert kinds[0][:2] in {("all_gather", ("tp",)), ("all_to_all", ("tp",))}
    assert ("slice", ("tp",), None, 0) in kinds or ("all_to_all", ("tp",), 1, 0) in kinds


def test_leftover_partial_gradient_is_all_reduced() -> None:
    assert _kinds(backward_steps([], ("tp",), 64)) == [("all_reduce", ("tp",), None, None)]


def test_seed_matmul_candidates_on_eight_devices() -> None:
    """The seed's MatMul [64, 1024] x [1024, 4096]: batch, column and row splits are offered."""
    from planner.sharding.candidates import candidate_strategies, describe

    mesh = DeviceMesh.build({"x": 8}, 8)
    tensors = _tensors(a=(64, 1024), w=(1024, 4096), y=(64, 4096))
    node = _node("MatMul", ["a", "w"], ["y"])
    node.flops = 2.0 * 64 * 1024 * 4096
    labels = labels_for(node, tensors)
    assert labels is not None
    found = {tuple(c.split_factors(mesh) for c in describe(node, labels, s, tensors,
                                                            mesh).inputs if c): s
             for s in candidate_strategies(node, labels, tensors, mesh)}
    assert ((8, 1), (1, 1)) in found  # data parallel
    assert ((1, 1), (1, 8)) in found  # weight columns: no forward communication
    assert ((1, 8), (8, 1)) in found  # contraction: partial sum
    row = describe(node, labels, found[((1, 8), (8, 1))], tensors, mesh)
    assert row.outputs[0] == Layout(((), ()), ("x",)) and row.flops == node.flops / 8
    column = describe(node, labels, found[((1, 1), (1, 8))], tensors, mesh)
    assert column.grad_partial == (("x",), ())  # the input's gradient needs an AllReduce
    assert ((1, 1), (1, 1)) in found and len(found) == 4


def test_a_weight_stored_split_is_reduced_in_its_gathers_backward() -> None:
    """A weight-derived tensor stored split over an axis and read whole by an op that
    splits the batch over that axis: its gradient is partial there, and the devices hold
    different slices of it, so the sum cannot wait for the parameter (an all-reduce of
    unlike slices): the gather's backward is a reduce-scatter. Stored whole, the same sum
    is deferred to the parameter's gradient all-reduce, as before."""
    from planner.kinds import CollectiveKind, Phase
    from planner.sharding.derive import edge_steps

    mesh = DeviceMesh.build({"a0": 2}, 2)
    info = TensorInfo("w_t", (256, 688), "float32", "activation")
    whole = Layout(((), ()))
    moves, deferred = edge_steps(info, Layout(((), ("a0",))), whole, "linear", mesh,
                                 requires_grad=True, partial_axes=("a0",),
                                 weight_derived=True)
    assert [(c.kind, c.axes, c.phase) for c in moves] == [
        (CollectiveKind.ALL_GATHER, ("a0",), Phase.FORWARD),
        (CollectiveKind.REDUCE_SCATTER, ("a0",), Phase.BACKWARD)]
    assert deferred == set()
    moves, deferred = edge_steps(info, whole, whole, "linear", mesh, requires_grad=True,
                                 partial_axes=("a0",), weight_derived=True)
    assert moves == [] and deferred == {"a0"}
