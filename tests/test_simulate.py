"""The SPMD simulator proves every emitted strategy and every redistribution correct."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import zoo
from planner.importer import import_model
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.redistribute import backward_steps, redistribute
from planner.sharding.simulate import apply_steps, shard, unshard
from planner.sharding.verify import verify_graph

MESHES = {"2": {"a": 2}, "4": {"a": 4}, "2x2": {"a": 2, "b": 2}}


@pytest.fixture(scope="module")
def zoo_graphs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("zoo")
    graphs = {}
    for preset in ("gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny", "moe-tiny"):
        family, config = zoo.preset(preset)
        path = zoo.save(zoo.build(family, config), folder / f"{preset}.onnx")
        dims = {} if family == "resnet" else {"seq": 8}
        graphs[preset] = import_model(path, batch=4, dims=dims)
    return graphs


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("preset", ["gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny",
                                    "moe-tiny"])
def test_every_zoo_strategy_matches_unsharded(zoo_graphs: dict, preset: str,
                                              mesh_name: str) -> None:
    graph = zoo_graphs[preset]
    mesh = DeviceMesh.build(MESHES[mesh_name], 4)
    report = verify_graph(graph, mesh)
    assert report.ok, "\n".join(report.failures[:20])
    assert report.ops == len(graph.ops) - len(report.skipped)
    assert not [n for n in report.skipped if graph.op(n).op_type != "Dropout"]
    assert report.strategies > report.ops  # more than the replicated candidate each


@st.composite
def _layout_case(draw: st.DrawFn) -> tuple[DeviceMesh, tuple[int, ...], Layout, Layout]:
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    names = ("x", "y", "z")[: len(sizes)]
    mesh = DeviceMesh(tuple(sizes), names, 8)
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([6, 12, 18])) for _ in range(rank))

    def layout(allow_partial: bool) -> Layout:
        dims: list[list[str]] = [[] for _ in range(rank)]
        partial: list[str] = []
        for axis in names:
            place = draw(st.integers(-2 if allow_partial else -1, rank - 1))
            if place == -2:
                partial.append(axis)
            elif place >= 0:
                dims[place].append(axis)
        candidate = Layout(tuple(tuple(d) for d in dims), tuple(partial))
        factors = candidate.split_factors(mesh)
        if any(s % f for s, f in zip(shape, factors, strict=True)):
            return Layout.replicated(rank)
        return candidate

    return mesh, shape, layout(True), layout(True)


@settings(max_examples=150, deadline=None)
@given(_layout_case(), st.integers(0, 2**16))
def test_redistribution_preserves_the_value(case: tuple, seed: int) -> None:
    mesh, shape, src, dst = case
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    shards = shard(value, src, mesh, rng)
    steps = redistribute(src, dst, shape, 8, mesh)
    moved = apply_steps(shards, steps, mesh)
    for coord, piece in moved.items():
        assert piece.shape == dst.local_shape(shape, mesh), coord
    np.testing.assert_allclose(unshard(moved, dst, shape, mesh), value, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(_layout_case(), st.integers(0, 2**16))
def test_backward_steps_carry_gradients_back(case: tuple, seed: int) -> None:
    """The transposed steps map a gradient in the target layout to the source layout."""
    mesh, shape, src, dst = case
    src = Layout(src.dims)  # a forward input is never partial on the gradient's way back
    dst = Layout(dst.dims)
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal(shape)
    steps = redistribute(src, dst, shape, 8, mesh)
    back = apply_steps(shard(grad, dst, mesh, rng), backward_steps(steps, (), 0), mesh)
    np.testing.assert_allclose(unshard(back, src, shape, mesh), grad, atol=1e-9)


def test_partial_gradient_is_reduced_on_the_way_back() -> None:
    """A replicated input whose consumer split work over `a` gets partial gradients."""
    mesh = DeviceMesh.build({"a": 2}, 2)
    src = dst = Layout(((), ()))
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((4, 4))
    partial = Layout(((), ()), ("a",))
    steps = backward_steps(redistribute(src, dst, (4, 4), 8, mesh), ("a",), 128)
    back = apply_steps(shard(grad, partial, mesh, rng), steps, mesh)
    np.testing.assert_allclose(unshard(back, src, (4, 4), mesh), grad, atol=1e-9)


def test_simulator_catches_a_wrong_layout(zoo_graphs: dict) -> None:
    """Sanity: claiming a partial sum is already reduced gives wrong results."""
    mesh = DeviceMesh.build({"a": 2}, 2)
    value = np.arange(16.0).reshape(4, 4)
    pieces = shard(value, Layout(((), ()), ("a",)), mesh)
    with pytest.raises(AssertionError, match="replicas disagree"):
        unshard(pieces, Layout(((), ())), (4, 4), mesh)


def test_verify_report_counts(zoo_graphs: dict, tmp_path: Path) -> None:
    graph = zoo_graphs["gpt-tiny"]
    report = verify_graph(graph, DeviceMesh.build({"a": 2}, 2))
    assert report.ok and report.ops > 50 and report.strategies > 2 * report.ops
