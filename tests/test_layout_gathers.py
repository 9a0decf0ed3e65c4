"""Index gathers that only lay a tensor out again are imported as Reshapes (issue 16):
the padding-mask expansions of both exporters, checked against ONNX's reference run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from planner.importer import import_model
from planner.importer.bind import bind_dims
from planner.importer.fold import fold_until_stable
from planner.importer.gathers import Affine, _enumerates, _fit

B, S = 4, 6


def test_affine_forms_of_constant_grids() -> None:
    grid = np.arange(B)[:, None] * S + np.arange(S)[None, :]
    assert _fit(grid) == Affine(0, (S, 1))
    assert _fit(np.zeros((3, 1), np.int64)) == Affine(0, (0, 0))
    assert _fit(np.array([[0, 1], [1, 0]])) is None  # not affine
    assert _fit(np.array([0.0, 1.0])) is None  # not an index
    assert _enumerates(Affine(0, (S, 0, 1)), (B, 1, S), B * S)
    assert not _enumerates(Affine(0, (1, 0, B)), (B, 1, S), B * S)  # column-major
    assert not _enumerates(Affine(1, (S, 0, 1)), (B, 1, S), B * S + 1)  # shifted
    assert not _enumerates(Affine(0, (0, 0, 1)), (B, 1, S), B * S)  # repeats rows


def _mask_model(path: Path, form: str) -> Path:
    """mask[B, S] -> [B, 1, 1, S] as the exporters write it, added to scores[B, 1, S, S]:
    `gathernd`: dynamo's GatherND at (b, s) pairs from expanded aranges; `flat`:
    TorchScript's Gather of the flattened mask at b * S + s; `reversed`: a GatherND that
    reads the positions backwards (a real gather, kept)."""
    rows = np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1)
    cols = np.arange(S, dtype=np.int64).reshape(1, 1, 1, S)
    if form == "reversed":
        cols = cols[..., ::-1].copy()
    inits = [numpy_helper.from_array(rows, "rows"), numpy_helper.from_array(cols, "cols"),
             numpy_helper.from_array(np.array([B, 1, 1, S], np.int64), "grid"),
             numpy_helper.from_array(np.array([-1], np.int64), "last"),
             numpy_helper.from_array(np.array(S, np.int64), "seq")]
    if form in ("gathernd", "reversed"):
        nodes = [helper.make_node("Expand", ["rows", "grid"], ["r"]),
                 helper.make_node("Expand", ["cols", "grid"], ["c"]),
                 helper.make_node("Unsqueeze", ["r", "last"], ["r1"]),
                 helper.make_node("Unsqueeze", ["c", "last"], ["c1"]),
                 helper.make_node("Concat", ["r1", "c1"], ["pairs"], axis=-1),
                 helper.make_node("GatherND", ["mask", "pairs"], ["wide"], name="expand")]
    else:
        nodes = [helper.make_node("Mul", ["rows", "seq"], ["base"]),
                 helper.make_node("Add", ["base", "cols"], ["flat_index"]),
                 helper.make_node("Flatten", ["mask"], ["flat"], axis=2),
                 helper.make_node("Gather", ["flat", "flat_index"], ["picked"], axis=0,
                                  name="expand"),
                 helper.make_node("Reshape", ["picked", "grid"], ["wide"])]
    nodes.append(helper.make_node("Add", ["scores", "wide"], ["y"], name="masked"))
    graph = helper.make_graph(
        nodes, "mask",
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", S]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 1, S, S])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, S, S])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize("form", ["gathernd", "flat"])
def test_a_mask_expanded_by_gathering_every_position_is_a_reshape(tmp_path: Path,
                                                                  form: str) -> None:
    path = _mask_model(tmp_path / f"{form}.onnx", form)
    graph = import_model(path, batch=B)
    expand = graph.op("expand")
    assert expand.op_type == "Reshape"
    assert not {"GatherND", "Gather", "Concat", "Expand"} & {n.op_type for n in graph.ops}
    # the folded model the graph is built from computes what the file does
    model = onnx.load(path)
    bind_dims(model, str(path), B, {})
    folded = fold_until_stable(model, 18, str(path)).model
    rng = np.random.default_rng(0)
    feeds = {"mask": rng.standard_normal((B, S)).astype(np.float32),
             "scores": rng.standard_normal((B, 1, S, S)).astype(np.float32)}
    want = ReferenceEvaluator(str(path)).run(None, feeds)[0]
    np.testing.assert_array_equal(want, feeds["scores"] + feeds["mask"][:, None, None, :])
    np.testing.assert_array_equal(ReferenceEvaluator(folded).run(None, feeds)[0], want)


def test_a_gather_that_reorders_stays_a_gather(tmp_path: Path) -> None:
    graph = import_model(_mask_model(tmp_path / "reversed.onnx", "reversed"), batch=B)
    assert graph.op("expand").op_type == "GatherND"


@pytest.mark.parametrize("form", ["gathernd", "flat"])
def test_the_data_parallel_baseline_splits_the_expanded_mask(tmp_path: Path,
                                                             form: str) -> None:
    from planner.api import plan

    result = plan(_mask_model(tmp_path / f"{form}.onnx", form), devices=2, batch=B,
                  mode="data")
    op = next(op for op in result.ops if op.name == "expand")
    (output,) = [b for b in op.outputs if b is not None]
    assert output.layout.dims[0], "the mask's batch dim is split"
