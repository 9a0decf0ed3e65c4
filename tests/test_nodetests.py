"""Op rules against ONNX's own node tests (a deterministic CI subset of the full table)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from planner.graph import OpNode, TensorInfo
from planner.ops import RECORDS, DimLabels, ruled_op_types
from planner.sharding.strategy import OpStrategy
from tests import nodetests
from tests.nodetests import NodeCase, Tolerance, compare, pick, run_case

CORE_OPS = (
    "MatMul", "Gemm", "Add", "Softmax", "LayerNormalization", "Reshape", "Transpose", "Gather",
    "Concat", "Split", "Slice", "Conv", "BatchNormalization", "ReduceMean", "ReduceSum",
    "Where", "Expand",
)
# Every Conv node test has batch 1 and one channel: no dim a split could use.
NO_SPLIT_IN_NODE_TESTS = {"Conv"}
MESHES = ("2", "2x2", "3", "3x2")
COVERAGE_DOC = Path(__file__).resolve().parents[1] / "docs" / "op-coverage.md"


@pytest.fixture(scope="module")
def core_cases() -> dict[str, list[NodeCase]]:
    cases, _ = nodetests.collect(CORE_OPS)
    grouped: dict[str, list[NodeCase]] = {}
    for case in cases:
        grouped.setdefault(case.op_type, []).append(case)
    return grouped


def test_core_ops_pass_their_node_tests(core_cases: dict[str, list[NodeCase]]) -> None:
    """Every split strategy of every core-op case on four meshes matches ONNX (about 1 s)."""
    assert set(core_cases) == set(CORE_OPS)
    results = [run_case(case, MESHES) for cases in core_cases.values() for case in cases]
    failures = [f"{run.case} [{run.mesh}] {run.strategy}: {run.error or run.max_error}"
                for result in results for run in result.runs if not run.passed]
    assert not failures, "\n".join(failures)
    runs_per_op: dict[str, int] = {}
    for result in results:
        runs_per_op[result.op_type] = runs_per_op.get(result.op_type, 0) + len(result.runs)
    unsplit = {op for op in CORE_OPS if not runs_per_op.get(op)}
    assert unsplit == NO_SPLIT_IN_NODE_TESTS
    assert sum(runs_per_op.values()) > 1000


def _case(cases: dict[str, list[NodeCase]], name: str) -> NodeCase:
    return next(c for group in cases.values() for c in group if c.name == name)


def test_a_wrong_rule_fails(core_cases: dict[str, list[NodeCase]],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness is not vacuous: a softmax split along its axis is caught."""
    record = RECORDS["", "Softmax"]
    original = record.labels
    assert original is not None

    def split_anything(node: OpNode, tensors: dict[str, TensorInfo]) -> DimLabels:
        return dataclasses.replace(original(node, tensors), whole_labels=frozenset())

    monkeypatch.setitem(RECORDS, ("", "Softmax"), dataclasses.replace(record,
                                                                     labels=split_anything))
    result = run_case(_case(core_cases, "test_softmax_axis_1"), ("2",))
    assert result.runs and not result.passed


def test_a_bias_added_on_every_shard_fails(core_cases: dict[str, list[NodeCase]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the bias-once rewrite, a k-split Gemm counts beta·C twice."""
    monkeypatch.setitem(RECORDS, ("", "Gemm"), dataclasses.replace(RECORDS["", "Gemm"],
                                                                  rewrite=None))
    result = run_case(_case(core_cases, "test_gemm_all_attributes"), ("2",))
    failed = [run.strategy for run in result.runs if not run.passed]
    assert failed == ["k:a"]


def test_vocabulary_split_gather_wraps_negative_indices(
        core_cases: dict[str, list[NodeCase]]) -> None:
    case = _case(core_cases, "test_gather_negative_indices")
    assert (np.asarray(case.inputs[1]) < 0).any()
    result = run_case(case, ("2",))
    assert [run.strategy for run in result.runs] == ["t0:a"] and result.passed


def test_compare_rules() -> None:
    nan = np.array([1.0, np.nan], dtype=np.float32)
    assert compare(nan, nan.copy())[0]
    assert not compare(nan, np.array([1.0, 2.0], dtype=np.float32))[0]
    assert compare(np.array([1.0], np.float32), np.array([1.000001], np.float32))[0]
    assert not compare(np.array([1.0], np.float32), np.array([1.001], np.float32))[0]
    declared = Tolerance(1e-2, 0.0)
    assert compare(np.array([1.0], np.float32), np.array([1.001], np.float32), declared)[0]
    assert not compare(np.array([np.inf]), np.array([-np.inf]))[0]
    assert compare(np.array([3], np.int64), np.array([3], np.int64)) == (True, 0.0)
    assert compare(np.array([3], np.int64), np.array([4], np.int64)) == (False, 1.0)
    assert not compare(np.array([3], np.int32), np.array([3], np.int64))[0]
    assert not compare(np.array([True]), np.array([False]))[0]
    assert not compare(np.array(["a"]), np.array(["b"]))[0]


def test_pick_is_deterministic_and_spread() -> None:
    strategies = [OpStrategy.of({f"d{i}": ("a",)}) for i in range(7)]
    assert pick(strategies, None) == strategies
    assert pick(strategies, 3) == [strategies[0], strategies[3], strategies[6]]
    assert pick(strategies, 1) == [strategies[0]]
    assert pick(strategies[:2], 5) == strategies[:2]


def test_coverage_doc_lists_every_rule() -> None:
    """docs/op-coverage.md names every op with a rule: in the table or as untested."""
    text = COVERAGE_DOC.read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| (\w+) \| \d+ \|", text, flags=re.MULTILINE))
    untested_line = re.search(r"^Ops with a sharding rule and no node test applying: (.*)\.$",
                              text, flags=re.MULTILINE)
    assert untested_line is not None
    untested = {op.strip() for op in untested_line.group(1).split(",")} - {"none"}
    missing = sorted(ruled_op_types() - rows - untested)
    assert not missing, f"regenerate docs/op-coverage.md; it lacks {missing}"
    stale = sorted((rows | untested) - ruled_op_types())
    assert not stale, f"regenerate docs/op-coverage.md; it lists ops without rules: {stale}"
    assert "; 0 failures" in text


def test_command_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "coverage.md"
    code = nodetests.main(["--ops", "Gemm,Softmax", "--meshes", "2x2", "--limit-strategies", "2",
                           "--write", str(out)])
    assert code == 0
    text = out.read_text(encoding="utf-8")
    assert "| Gemm | 11 |" in text and "| Softmax | 7 |" in text
    assert "--limit-strategies 2" in text and "; 0 failures" in text
    assert "0 failures" in capsys.readouterr().out


# --------------------------------------------------------------------------- beyond ONNX's cases
# Forms the node tests lack (their shapes are tiny and often odd). Ground truth is ONNX's
# reference evaluator on the unsharded op; every split must match it.

_RNG = np.random.default_rng(7)


def _f32(*shape: int, shift: float = 0.0) -> np.ndarray:
    return (_RNG.standard_normal(shape) + shift).astype(np.float32)


def _ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: object):
    return helper.make_node(op_type, inputs, outputs, **attrs)


FORMS = {
    "gather axis 1, negative 2-D indices": (
        _node("Gather", ["t", "i"], ["y"], axis=1),
        {"t": _f32(3, 8, 2), "i": np.array([[-1, 0, 5], [-8, 7, -3]], np.int64)}, 13),
    "gather axis -1, int32 indices": (
        _node("Gather", ["t", "i"], ["y"], axis=-1),
        {"t": _f32(4, 6), "i": np.array([-1, -6, 2, 3], np.int32)}, 13),
    "gather scalar negative index": (
        _node("Gather", ["t", "i"], ["y"]), {"t": _f32(6, 4), "i": np.array(-2, np.int64)}, 13),
    "gather integer table": (
        _node("Gather", ["t", "i"], ["y"]),
        {"t": _RNG.integers(0, 9, (6, 4)).astype(np.int64), "i": _ints(-1, 2, 5, 0)}, 13),
    "gemm transA transB alpha beta, bias (n,)": (
        _node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1, alpha=0.5, beta=2.0),
        {"a": _f32(6, 4), "b": _f32(2, 6), "c": _f32(2)}, 13),
    "gemm bias (m, 1)": (
        _node("Gemm", ["a", "b", "c"], ["y"], beta=3.0),
        {"a": _f32(4, 6), "b": _f32(6, 2), "c": _f32(4, 1)}, 13),
    "matmul vector x batched matrix": (
        _node("MatMul", ["x", "z"], ["y"]), {"x": _f32(6), "z": _f32(2, 6, 4)}, 13),
    "matmul broadcast batch": (
        _node("MatMul", ["x", "z"], ["y"]), {"x": _f32(2, 1, 4, 6), "z": _f32(3, 6, 2)}, 13),
    "einsum implicit output": (
        _node("Einsum", ["x", "z"], ["y"], equation="ij,jk"), {"x": _f32(4, 6), "z": _f32(6, 2)},
        13),
    "einsum ellipsis broadcast": (
        _node("Einsum", ["x", "z"], ["y"], equation="...ij,...jk->...ik"),
        {"x": _f32(2, 2, 4, 6), "z": _f32(2, 6, 4)}, 13),
    "einsum ellipsis size-1 batch, implicit": (
        _node("Einsum", ["x", "z"], ["y"], equation="...ij,...jk"),
        {"x": _f32(1, 4, 6), "z": _f32(2, 6, 4)}, 13),
    "einsum ellipsis in the middle": (
        _node("Einsum", ["x", "z"], ["y"], equation="i...j,j->i..."),
        {"x": _f32(4, 3, 2, 6), "z": _f32(6)}, 13),
    "einsum batch diagonal": (
        _node("Einsum", ["x"], ["y"], equation="...ii->...i"), {"x": _f32(6, 4, 4)}, 13),
    "slice negative step and axis": (
        _node("Slice", ["x", "s", "e", "a", "st"], ["y"]),
        {"x": _f32(4, 6, 4), "s": _ints(-1, 0), "e": _ints(-100, 100), "a": _ints(-2, 0),
         "st": _ints(-1, 1)}, 13),
    "slice full axis reversed": (
        _node("Slice", ["x", "s", "e", "a", "st"], ["y"]),
        {"x": _f32(4, 6), "s": _ints(-1), "e": _ints(-7), "a": _ints(0), "st": _ints(-1)}, 13),
    "split uneven num_outputs": (
        _node("Split", ["x"], ["y0", "y1", "y2"], axis=1, num_outputs=3), {"x": _f32(4, 8)}, 18),
    "split sizes, negative axis": (
        _node("Split", ["x", "s"], ["y0", "y1"], axis=-1), {"x": _f32(4, 6), "s": _ints(2, 4)},
        13),
    "reducesum negative axis, keepdims 0": (
        _node("ReduceSum", ["x", "a"], ["y"], keepdims=0), {"x": _f32(4, 6, 2), "a": _ints(-2)},
        13),
    "reducemean all axes, keepdims 0": (
        _node("ReduceMean", ["x"], ["y"], keepdims=0), {"x": _f32(4, 6)}, 18),
    "reducemean noop_with_empty_axes": (
        _node("ReduceMean", ["x", "a"], ["y"], noop_with_empty_axes=1),
        {"x": _f32(4, 6), "a": np.array([], np.int64)}, 18),
    "reducemean int32 (truncating)": (
        _node("ReduceMean", ["x", "a"], ["y"], keepdims=0),
        {"x": _RNG.integers(-50, 50, (4, 6)).astype(np.int32), "a": _ints(1)}, 18),
    "conv groups, pads, strides, dilations": (
        _node("Conv", ["x", "w", "b"], ["y"], group=2, pads=[1, 0, 1, 2], strides=[2, 1],
              dilations=[1, 2]),
        {"x": _f32(2, 4, 6, 6), "w": _f32(4, 2, 3, 3), "b": _f32(4)}, 13),
    "conv depthwise": (
        _node("Conv", ["x", "w"], ["y"], group=4, pads=[1, 1, 1, 1]),
        {"x": _f32(2, 4, 6, 6), "w": _f32(4, 1, 3, 3)}, 13),
    "conv bias, input channels split": (
        _node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]),
        {"x": _f32(2, 4, 6, 6), "w": _f32(6, 4, 3, 3), "b": _f32(6)}, 13),
    "conv auto_pad SAME_UPPER": (
        _node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2]),
        {"x": _f32(2, 4, 5, 5), "w": _f32(6, 4, 3, 3)}, 13),
    "conv 1-D": (
        _node("Conv", ["x", "w", "b"], ["y"], pads=[2, 1]),
        {"x": _f32(2, 4, 8), "w": _f32(2, 4, 3), "b": _f32(2)}, 13),
    "maxpool pads, ceil_mode, indices": (
        _node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
              strides=[2, 2], ceil_mode=1),
        {"x": _f32(2, 4, 7, 5)}, 13),
    # Strided: onnx 1.23's unstrided MaxPool path returns per-plane indices, against the spec
    # (flat over N x C x spatial), which the strided path and the local rewrite follow.
    "maxpool indices, column-major": (
        _node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 1],
              storage_order=1),
        {"x": _f32(6, 4, 4, 5)}, 13),
    "averagepool pads, count_include_pad": (
        _node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
              count_include_pad=1),
        {"x": _f32(2, 4, 6, 6)}, 19),
    "expand to higher rank": (
        _node("Expand", ["x", "s"], ["y"]), {"x": _f32(4, 1), "s": _ints(2, 4, 6)}, 13),
    "expand with a shorter shape": (
        _node("Expand", ["x", "s"], ["y"]), {"x": _f32(2, 4, 6), "s": _ints(4, 1)}, 13),
    "softmax axis 0": (_node("Softmax", ["x"], ["y"], axis=0), {"x": _f32(4, 6)}, 13),
    "layernorm axis 1, mean and inv std outputs": (
        _node("LayerNormalization", ["x", "s", "b"], ["y", "m", "r"], axis=1),
        {"x": _f32(2, 4, 6), "s": _f32(4, 6), "b": _f32(4, 6)}, 17),
    "batchnorm training, channels split too": (
        _node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
              training_mode=1, momentum=0.8),
        {"x": _f32(4, 6, 2, 2), "s": _f32(6), "b": _f32(6), "m": _f32(6),
         "v": np.abs(_f32(6))}, 15),
    "batchnorm training, mean 20 (variance cancellation)": (
        _node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
              training_mode=1),
        {"x": _f32(4, 6, 2, shift=20.0), "s": _f32(6), "b": _f32(6), "m": _f32(6),
         "v": np.abs(_f32(6))}, 15),
    "batchnorm training float16": (
        _node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
              training_mode=1),
        {name: value.astype(np.float16) for name, value in
         {"x": _f32(4, 6, 2), "s": _f32(6), "b": _f32(6), "m": _f32(6),
          "v": np.abs(_f32(6))}.items()}, 15),
    "reshape with 0 and -1": (
        _node("Reshape", ["x", "s"], ["y"]), {"x": _f32(4, 6, 2), "s": _ints(0, -1)}, 14),
    "where with broadcast condition": (
        _node("Where", ["c", "x", "z"], ["y"]),
        {"c": _RNG.random((4, 1)) > 0.5, "x": _f32(6), "z": _f32(2, 4, 6)}, 16),
    # the recurrences: each row its own (batch 4 splits on every mesh; the node tests'
    # batches of 1 and 3 do not), the states and sequence lengths split with it
    "gru, batch-first, lengths and initial state": (
        _node("GRU", ["x", "w", "r", "b", "n", "h"], ["y", "yh"], hidden_size=3, layout=1),
        {"x": _f32(4, 5, 2), "w": _f32(1, 9, 2), "r": _f32(1, 9, 3), "b": _f32(1, 18),
         "n": np.array([5, 2, 4, 1], np.int32), "h": _f32(4, 1, 3)}, 14),
    "lstm, bidirectional, sequence-first": (
        _node("LSTM", ["x", "w", "r", "b", "", "h", "c"], ["y", "yh", "yc"],
              hidden_size=3, direction="bidirectional"),
        {"x": _f32(5, 4, 2), "w": _f32(2, 12, 2), "r": _f32(2, 12, 3), "b": _f32(2, 24),
         "h": _f32(2, 4, 3), "c": _f32(2, 4, 3)}, 14),
    "rnn, last state only": (
        _node("RNN", ["x", "w", "r"], ["", "yh"], hidden_size=3),
        {"x": _f32(5, 4, 2), "w": _f32(1, 3, 2), "r": _f32(1, 3, 3)}, 14),
    # Pad with known pads (the node tests feed them as inputs: no rule applies there);
    # transformers pads the labels by one to shift them
    "pad the last dim with a constant": (
        _node("Pad", ["x", "p", "v"], ["y"]),
        {"x": _f32(4, 4), "p": _ints(0, 1, 0, 1), "v": np.array(-3.0, np.float32)}, 13),
    "pad reflecting over named axes": (
        _node("Pad", ["x", "p", "", "a"], ["y"], mode="reflect"),
        {"x": _f32(4, 6, 4), "p": _ints(1, 2), "a": _ints(-1)}, 18),
    "onehot axis 0, negative indices": (
        _node("OneHot", ["i", "d", "v"], ["y"], axis=0),
        {"i": np.array([[1, -1], [3, 0]], np.int64), "d": np.array(4, np.int64),
         "v": np.array([0, 1], np.float32)}, 11),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_forms_beyond_the_node_tests(name: str) -> None:
    proto, feeds, opset = FORMS[name]
    case = nodetests.synthetic_case(name, proto, feeds, opset)
    result = run_case(case, MESHES)
    failures = [f"[{run.mesh}] {run.strategy}: {run.error or run.max_error}"
                for run in result.runs if not run.passed]
    assert result.status == "run" and result.runs and not failures, failures
