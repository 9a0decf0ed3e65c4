"""The op registry: its layering, the annotation language, and every linearity claim."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from planner.graph import OpNode, TensorInfo
from planner.ops import (
    RECORDS,
    NoRule,
    is_matrix_op,
    labels_for,
    record_for,
    replicated_labels,
    safe_labels,
)
from planner.ops.annotation import Annotation, AnnotationError
from planner.ops.registry import MATMUL
from planner.reference import run_node
from tests import nodetests

OPS_DIR = Path(__file__).resolve().parents[1] / "planner" / "ops"


def _tensors(**shapes: tuple[int, ...]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, shape, "float32", "activation") for name, shape in
            shapes.items()}


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: object) -> OpNode:
    return OpNode(op_type.lower(), op_type, "", tuple(inputs), tuple(outputs), dict(attrs))


# --------------------------------------------------------------------------- layering


def _planner_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if node.module == "planner.ops")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_ops_layer_imports_only_the_graph_layer() -> None:
    """planner.ops sits above the graph types and below sharding, costs and search."""
    allowed = ("planner.errors", "planner.graph", "planner.ops")
    for path in sorted(OPS_DIR.glob("*.py")):
        ours = {m for m in _planner_imports(path)
                if m.split(".")[0] in ("planner", "costmodels", "executor", "bench", "tests")}
        wrong = sorted(m for m in ours if not m.startswith(allowed))
        assert not wrong, f"{path.name} imports {wrong}"


def test_ops_modules_import_no_circle() -> None:
    modules = {p.stem: p for p in OPS_DIR.glob("*.py") if p.stem != "__init__"}
    edges = {name: {m.split(".")[2] for m in _planner_imports(path)
                    if m.startswith("planner.ops.") and m.split(".")[2] in modules}
             for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import circle: {' -> '.join((*trail, name))}"
        if name in done:
            return
        for other in edges[name]:
            visit(other, (*trail, name))
        done.add(name)

    for name in modules:
        visit(name, ())


# --------------------------------------------------------------------------- lookups


def test_lookups() -> None:
    assert record_for("MatMul") is record_for("MatMul", "ai.onnx") is RECORDS["", "MatMul"]
    fused = record_for("FusedMatMul", "com.microsoft")
    assert fused is not None and fused.labels is None and fused.matrix
    assert record_for("FusedMatMul") is None
    assert all(is_matrix_op(op) for op in ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum",
                                           "FusedMatMul", "MatMulInteger", "Attention"))
    assert not is_matrix_op("Add") and not is_matrix_op("Softmax")
    node = _node("ScatterND", ["x", "i", "u"], ["y"])
    assert labels_for(node, _tensors(x=(4,), i=(1, 1), u=(1,), y=(4,))) is None
    assert replicated_labels(node).inputs == (None, None, None)
    other = OpNode("f", "MatMul", "com.example", ("a", "b"), ("y",), {})
    assert safe_labels(other, _tensors(a=(2, 2), b=(2, 2), y=(2, 2))) is None


# --------------------------------------------------------------------------- annotations


def test_matmul_annotation_names_as_before() -> None:
    """Sum label first, then the output's batch dims, broadcast whole labels, m, n."""
    tensors = _tensors(a=(2, 1, 4, 6), b=(3, 6, 5), y=(2, 3, 4, 5))
    labels = MATMUL(_node("MatMul", ["a", "b"], ["y"]), tensors)
    assert labels.inputs == (("d1", "w3", "m4", "k0"), ("d2", "k0", "n5"))
    assert labels.outputs == (("d1", "d2", "m4", "n5"),)
    assert labels.sum_labels == {"k0"} and labels.whole_labels == {"w3"}
    vector = MATMUL(_node("MatMul", ["v", "b"], ["y"]), _tensors(v=(6,), b=(3, 6, 5), y=(3, 5)))
    assert vector.inputs == (("k0",), ("d1", "k0", "n2")) and vector.outputs == (("d1", "n2"),)
    dot = MATMUL(_node("MatMul", ["u", "v"], ["y"]), _tensors(u=(6,), v=(6,), y=()))
    assert dot.inputs == (("k0",), ("k0",)) and dot.outputs == ((),)


def test_elementwise_annotation_broadcasts_and_repeats() -> None:
    add = Annotation.parse("*, ... -> *")
    tensors = _tensors(x=(4, 1, 8), b=(8,), c=(3, 1), y=(4, 3, 8))
    labels = add(_node("Sum", ["x", "b", "c"], ["y"]), tensors)
    assert labels.outputs == (("d0", "d1", "d2"),)
    assert labels.inputs == (("d0", "w3", "d2"), ("d2",), ("d1", "w4"))
    assert labels.whole_labels == {"w3", "w4"} and not labels.sum_labels


def test_not_data_and_omitted_tensors() -> None:
    clip = Annotation.parse("*, ?, ? -> *")
    tensors = {**_tensors(x=(4, 2), y=(4, 2)), "lo": TensorInfo("lo", (), "float32", "constant")}
    labels = clip(_node("Clip", ["x", "", "lo"], ["y"]), tensors)
    assert labels.inputs == (("d0", "d1"), None, None)
    one = clip(_node("Clip", ["x"], ["y"]), tensors)
    assert one.inputs == (("d0", "d1"),)
    dropout = Annotation.parse("*, ?, ? -> *, *")
    masked = dropout(_node("Dropout", ["x"], ["y", "m"]), {**tensors, **_tensors(m=(4, 2))})
    assert masked.outputs == (("d0", "d1"), ("d0", "d1"))


def test_whole_and_named_labels() -> None:
    trilu = Annotation.parse("* r! c!, ? -> * r! c!")
    labels = trilu(_node("Trilu", ["x"], ["y"]), _tensors(x=(2, 4, 4), y=(2, 4, 4)))
    assert labels.inputs == (("d0", "r1", "c2"),)
    assert labels.whole_labels == {"r1", "c2"}


def test_annotation_declines_instances_it_cannot_label() -> None:
    matrix = Annotation.parse("m k+, k+ n -> m n")
    with pytest.raises(NoRule):  # rank 3 where the term names two dims
        matrix(_node("MatMul", ["a", "b"], ["y"]), _tensors(a=(2, 3, 4), b=(4, 5), y=(2, 3, 5)))
    with pytest.raises(NoRule):  # three inputs, two terms, no `...`
        matrix(_node("MatMul", ["a", "b", "c"], ["y"]),
               _tensors(a=(3, 4), b=(4, 5), c=(5,), y=(3, 5)))


@pytest.mark.parametrize("text", [
    "a b", "a -> b -> c", "* * -> *", "k+ -> k+", "a+ b, a -> b", "*, ... -> a", "x1 -> x1",
    "..., a -> a", "a, ..., b -> a", "A -> A",
])
def test_annotation_grammar_errors(text: str) -> None:
    with pytest.raises(AnnotationError):
        Annotation.parse(text)


# --------------------------------------------------------------------------- linearity
# Every record claiming linearity is proven here: the op runs with ONNX's reference
# evaluator on random float inputs split as x = x1 + x2 in one of its claimed groups of
# inputs (the others whole), and op(x1) + op(x2) must equal op(x).

_RNG = np.random.default_rng(3)


def _f(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape)


def _i(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


_make = helper.make_node

#: One hand-made node per op type claiming linearity: (node, feeds, opset).
LINEAR_FORMS: dict[str, tuple] = {
    "Add": (_make("Add", ["a", "b"], ["y"]), {"a": _f(3, 4), "b": _f(4)}, 18),
    "Sub": (_make("Sub", ["a", "b"], ["y"]), {"a": _f(3, 4), "b": _f(3, 1)}, 18),
    "Sum": (_make("Sum", ["a", "b", "c"], ["y"]), {"a": _f(3, 4), "b": _f(4), "c": _f(3, 4)},
            18),
    "Mean": (_make("Mean", ["a", "b"], ["y"]), {"a": _f(3, 4), "b": _f(3, 4)}, 18),
    "Mul": (_make("Mul", ["a", "b"], ["y"]), {"a": _f(3, 4), "b": _f(4)}, 18),
    "Div": (_make("Div", ["a", "b"], ["y"]), {"a": _f(3, 4), "b": np.abs(_f(4)) + 0.5}, 18),
    "Neg": (_make("Neg", ["a"], ["y"]), {"a": _f(3, 4)}, 18),
    "Where": (_make("Where", ["c", "a", "b"], ["y"]),
              {"c": _RNG.random((3, 4)) > 0.5, "a": _f(3, 4), "b": _f(4)}, 18),
    "Identity": (_make("Identity", ["a"], ["y"]), {"a": _f(3, 4)}, 18),
    "Expand": (_make("Expand", ["a", "s"], ["y"]), {"a": _f(3, 1), "s": _i(2, 3, 4)}, 18),
    "MatMul": (_make("MatMul", ["a", "b"], ["y"]), {"a": _f(2, 3, 4), "b": _f(4, 5)}, 18),
    "Gemm": (_make("Gemm", ["a", "b", "c"], ["y"], transB=1, alpha=0.5, beta=2.0),
             {"a": _f(3, 4), "b": _f(5, 4), "c": _f(5)}, 18),
    "Einsum": (_make("Einsum", ["a", "b", "c"], ["y"], equation="ij,jk,k->i"),
               {"a": _f(3, 4), "b": _f(4, 5), "c": _f(5)}, 18),
    "Conv": (_make("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], group=2),
             {"x": _f(2, 4, 5, 5), "w": _f(6, 2, 3, 3), "b": _f(6)}, 18),
    "ConvTranspose": (_make("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2]),
                      {"x": _f(2, 3, 4, 4), "w": _f(3, 2, 3, 3), "b": _f(2)}, 18),
    "Transpose": (_make("Transpose", ["a"], ["y"], perm=[2, 0, 1]), {"a": _f(2, 3, 4)}, 18),
    "Reshape": (_make("Reshape", ["a", "s"], ["y"]), {"a": _f(2, 3, 4), "s": _i(6, -1)}, 18),
    "Flatten": (_make("Flatten", ["a"], ["y"], axis=2), {"a": _f(2, 3, 4)}, 18),
    "Squeeze": (_make("Squeeze", ["a", "s"], ["y"]), {"a": _f(2, 1, 4), "s": _i(1)}, 18),
    "Unsqueeze": (_make("Unsqueeze", ["a", "s"], ["y"]), {"a": _f(2, 4), "s": _i(0, 3)}, 18),
    "Concat": (_make("Concat", ["a", "b", "c"], ["y"], axis=1),
               {"a": _f(2, 3), "b": _f(2, 1), "c": _f(2, 4)}, 18),
    "Split": (_make("Split", ["a"], ["y", "z"], axis=1, num_outputs=2), {"a": _f(2, 6)}, 18),
    "Slice": (_make("Slice", ["a", "s", "e", "x", "t"], ["y"]),
              {"a": _f(4, 6), "s": _i(-1, 1), "e": _i(-100, 5), "x": _i(0, 1),
               "t": _i(-2, 2)}, 18),
    "Tile": (_make("Tile", ["a", "r"], ["y"]), {"a": _f(2, 3), "r": _i(2, 1)}, 18),
    "Gather": (_make("Gather", ["t", "i"], ["y"], axis=1),
               {"t": _f(3, 5, 2), "i": np.array([[0, -1], [4, 2]], np.int64)}, 18),
    "GatherElements": (_make("GatherElements", ["t", "i"], ["y"], axis=1),
                       {"t": _f(3, 4), "i": np.array([[0, 3], [1, 1], [2, 0]], np.int64)}, 18),
    "GatherND": (_make("GatherND", ["t", "i"], ["y"]),
                 {"t": _f(3, 4, 2), "i": np.array([[0, 1], [2, 3]], np.int64)}, 18),
    "Trilu": (_make("Trilu", ["a", "k"], ["y"], upper=0), {"a": _f(2, 4, 4), "k": _i(1)}, 18),
    "DepthToSpace": (_make("DepthToSpace", ["a"], ["y"], blocksize=2), {"a": _f(1, 8, 2, 3)},
                     18),
    "SpaceToDepth": (_make("SpaceToDepth", ["a"], ["y"], blocksize=2), {"a": _f(1, 2, 4, 6)},
                     18),
    "ReduceSum": (_make("ReduceSum", ["a", "x"], ["y"], keepdims=0),
                  {"a": _f(2, 3, 4), "x": _i(0, 2)}, 18),
    "ReduceMean": (_make("ReduceMean", ["a", "x"], ["y"]), {"a": _f(2, 3, 4), "x": _i(-1)}, 18),
    "CumSum": (_make("CumSum", ["a", "x"], ["y"], exclusive=1, reverse=1),
               {"a": _f(3, 4), "x": np.array(1, np.int64)}, 18),
    "AveragePool": (_make("AveragePool", ["a"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                          strides=[2, 2]), {"a": _f(2, 3, 5, 5)}, 19),
    "GlobalAveragePool": (_make("GlobalAveragePool", ["a"], ["y"]), {"a": _f(2, 3, 4, 4)}, 18),
}

#: Ops claimed not linear: the same check must fail for them.
NONLINEAR_FORMS: dict[str, tuple] = {
    "Softmax": (_make("Softmax", ["a"], ["y"], axis=-1), {"a": _f(3, 4)}, 18),
    "Relu": (_make("Relu", ["a"], ["y"]), {"a": _f(3, 4)}, 18),
    "LayerNormalization": (_make("LayerNormalization", ["a", "s", "b"], ["y"], axis=-1),
                           {"a": _f(3, 4), "s": _f(4), "b": _f(4)}, 18),
}


def _run(proto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [np.asarray(v) for v in run_node(proto, feeds, opset)]


def _additive(proto, feeds: dict[str, np.ndarray], opset: int,
              group: tuple[int, ...]) -> bool | None:
    """op(x1) + op(x2) == op(x) with the inputs of `group` split (None: nothing to check)."""
    names = [proto.input[i] for i in group]
    if any(feeds[n].dtype.kind != "f" for n in names):
        return None  # linearity is over the reals: integer data is not split
    first = {**feeds, **{n: _RNG.standard_normal(feeds[n].shape).astype(feeds[n].dtype)
                         for n in names}}
    second = {**feeds, **{n: (feeds[n] - first[n]).astype(feeds[n].dtype) for n in names}}
    whole, one, two = (_run(proto, f, opset) for f in (feeds, first, second))
    checked = False
    for y, y1, y2 in zip(whole, one, two, strict=True):
        if y.dtype.kind != "f":
            continue  # an index output (TopK's) is not a sum
        checked = True
        scale = float(np.abs(y1).max(initial=0) + np.abs(y2).max(initial=0) + 1.0)
        tol = 1e-9 if y.dtype == np.float64 else 1e-5 if y.dtype == np.float32 else 1e-2
        if not np.allclose(y1 + y2, y, rtol=0.0, atol=tol * scale):
            return False
    return checked or None


def _claims() -> dict[str, list[tuple[int, ...]]]:
    return {record.qualified_type: [] for record in RECORDS.values()
            if record.linearity.is_linear}


def test_every_linearity_claim_has_a_form() -> None:
    assert set(_claims()) == set(LINEAR_FORMS)


@pytest.mark.parametrize("op_type", sorted(LINEAR_FORMS))
def test_linearity_claims_hold(op_type: str) -> None:
    proto, feeds, opset = LINEAR_FORMS[op_type]
    record = record_for(op_type)
    assert record is not None
    groups = record.linearity.groups_for(tuple(proto.input))
    assert groups
    for group in groups:
        assert _additive(proto, feeds, opset, group), f"{op_type} is not linear in {group}"


def test_linearity_claims_hold_on_onnx_node_tests() -> None:
    """The same check on ONNX's own node tests of every claiming op (their float cases)."""
    cases, _ = nodetests.collect(sorted(_claims()))
    checked: dict[str, int] = {}
    failures = []
    for case in cases:
        record = record_for(case.op_type)
        assert record is not None
        proto = case.model.graph.node[0]
        feeds = {name: np.asarray(value) for name, value in
                 zip(proto.input, case.inputs, strict=True) if name and value is not None}
        for group in record.linearity.groups_for(tuple(proto.input)):
            outcome = _additive(proto, feeds, case.opset, group)
            if outcome is False:
                failures.append(f"{case.name} in {group}")
            elif outcome:
                checked[case.op_type] = checked.get(case.op_type, 0) + 1
    assert not failures, failures
    assert sum(checked.values()) > 100 and len(checked) > 20, checked


@pytest.mark.parametrize("op_type", sorted(NONLINEAR_FORMS))
def test_the_check_fails_for_nonlinear_ops(op_type: str) -> None:
    record = record_for(op_type)
    assert record is not None and not record.linearity.is_linear
    proto, feeds, opset = NONLINEAR_FORMS[op_type]
    assert _additive(proto, feeds, opset, (0,)) is False
    assert _additive(proto, feeds, opset, tuple(range(len(proto.input)))) is False
