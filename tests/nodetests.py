"""Prove every op rule against ONNX's own node tests.

ONNX ships, for each op, small models with real inputs and expected outputs. For every
single-op case whose op has a rule, this module builds the planner's view of the op
(`OpNode` + `TensorInfo`, constant inputs carrying their values), enumerates every candidate
strategy on a 2-device and a 2x2 mesh, runs each split on virtual devices with the case's
inputs (`simulate_op`) and compares the reassembled outputs with ONNX's expected ones.
A rule that splits an op wrongly fails here, against ground truth nobody in this project
wrote. `python bench/op_coverage.py --write docs/op-coverage.md` renders the table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case.test_case import TestCase
from onnx.reference import ReferenceEvaluator

from planner.graph import OpNode, TensorInfo
from planner.importer.build import attribute_value
from planner.ops import DimLabels, ruled_op_types, safe_labels
from planner.ops.axes import REDUCTIONS_OTHER, REDUCTIONS_SUM
from planner.sharding.candidates import candidate_strategies
from planner.sharding.mesh import DeviceMesh
from planner.sharding.simulate import simulate_op
from planner.sharding.strategy import REPLICATED, OpStrategy

MIN_OPSET = 13  # the rules assume opset-13+ semantics (Softmax's single axis, Split, ...)
DEFAULT_MESHES = ("2", "2x2")

# Inputs that are not data: a real model holds them as constants the rules read (shapes,
# bounds, axes, counts). Given here as `kind="constant"` with their values.
CONSTANT_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Squeeze": (1,), "Unsqueeze": (1,),
    "Slice": (1, 2, 3, 4), "Split": (1,), "CumSum": (1,), "TopK": (1,), "OneHot": (1, 2),
    "Clip": (1, 2), "Dropout": (1, 2), "Trilu": (1,), "Pad": (1, 3),
    **{op: (1,) for op in (*REDUCTIONS_SUM, *REDUCTIONS_OTHER)},
}


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


@dataclass(frozen=True)
class NodeCase:
    """One ONNX node test as the planner sees it; arrays aligned with node inputs/outputs."""

    name: str
    op_type: str
    opset: int
    model: onnx.ModelProto
    node: OpNode
    tensors: dict[str, TensorInfo]
    inputs: tuple[np.ndarray | None, ...]
    expected: tuple[np.ndarray | None, ...]
    feeds: dict[str, np.ndarray]  # graph input name -> array
    declared: Tolerance  # what ONNX accepts from any backend for this case


@dataclass(frozen=True)
class Skipped:
    name: str
    op_type: str
    reason: str


def _array(value: object) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 0


EXPANDED = "expanded function body"
MULTI_OP = "multi-op model"
NO_RULE = "no rule"
OLD_OPSET = f"op version older than opset {MIN_OPSET}"
SKIP_WHY = {
    EXPANDED: "the graph is the op's ONNX function body, not the op; the unexpanded case "
              "tests the op itself",
    MULTI_OP: "a rule covers one op; these cases test several ops together",
    NO_RULE: "the op's record in the op registry has no labelling, so the planner keeps it "
             "replicated",
    "non-tensor input or output": "sequences and optionals are not planned",
    "several data sets": "a case with several input sets is not a single instance",
    OLD_OPSET: f"the op's definition changed since; the rules assume opset-{MIN_OPSET}+ "
               "semantics",
}


def _current_definition(op_type: str, opset: int) -> bool:
    """Whether the op means at `opset` what it means at MIN_OPSET or later.

    And/Or/Xor (opset 7) and Not (opset 1) have not changed since, so their older tests
    still test the semantics the rules assume; Dropout at opset 11 has changed.
    """
    if opset >= MIN_OPSET:
        return True
    try:
        then = onnx.defs.get_schema(op_type, opset, "").since_version
        now = onnx.defs.get_schema(op_type, MIN_OPSET, "").since_version
    except onnx.defs.SchemaError:
        return False
    return then == now


def _skip_reason(case: TestCase, ops: set[str] | None) -> tuple[str, str | None]:
    """(op type, why the case is skipped or None when it applies)."""
    graph = case.model.graph
    if "_expanded" in case.name:
        return "(expanded)", EXPANDED
    if len(graph.node) != 1:
        return "(graph)", MULTI_OP
    node = graph.node[0]
    op_type = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
    if op_type not in ruled_op_types():
        return op_type, NO_RULE
    if not _current_definition(op_type, _opset(case.model)):
        return op_type, OLD_OPSET
    for value in (*graph.input, *graph.output):
        if not value.type.HasField("tensor_type"):
            return op_type, "non-tensor input or output"
    if len(case.data_sets) != 1:
        return op_type, "several data sets"
    return op_type, None


def build_case(case: TestCase) -> NodeCase:
    """The planner's view of a single-op ONNX test case."""
    raw_inputs, raw_outputs = case.data_sets[0]
    return _node_case(case.name, case.model, raw_inputs, raw_outputs,
                      Tolerance(float(case.rtol), float(case.atol)))


def synthetic_case(name: str, proto: onnx.NodeProto, feeds: dict[str, np.ndarray],
                   opset: int) -> NodeCase:
    """A case for a form the node tests lack; expected outputs from the reference evaluator."""
    def info(tensor: str, value: np.ndarray) -> onnx.ValueInfoProto:
        elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        return onnx.helper.make_tensor_value_info(tensor, elem, value.shape)

    graph_inputs = [info(t, feeds[t]) for t in proto.input if t]
    outputs = ReferenceEvaluator(proto, opsets={"": opset}).run(
        None, {t: feeds[t] for t in proto.input if t})
    graph_outputs = [info(t, np.asarray(v)) for t, v in zip(proto.output, outputs, strict=True)]
    graph = onnx.helper.make_graph([proto], name, graph_inputs, graph_outputs)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    return _node_case(name, model, [feeds[t] for t in proto.input if t],
                      [np.asarray(v) for v in outputs], Tolerance(1e-3, 1e-7))


def _node_case(case_name: str, model: onnx.ModelProto, raw_inputs: Sequence[object],
               raw_outputs: Sequence[object], declared: Tolerance) -> NodeCase:
    graph = model.graph
    proto = graph.node[0]
    feeds = {v.name: _array(a) for v, a in zip(graph.input, raw_inputs, strict=True)}
    produced = {v.name: _array(a) for v, a in zip(graph.output, raw_outputs, strict=True)}
    constant_slots = CONSTANT_INPUTS.get(proto.op_type, ())
    tensors: dict[str, TensorInfo] = {}
    inputs: list[np.ndarray | None] = []
    for slot, name in enumerate(proto.input):
        if not name:
            inputs.append(None)
            continue
        value = feeds[name]
        if slot in constant_slots:
            tensors[name] = TensorInfo(name, value.shape, value.dtype.name, "constant",
                                       value=value)
        else:
            tensors[name] = TensorInfo(name, value.shape, value.dtype.name, "input")
        inputs.append(value)
    outputs: list[str] = []
    expected: list[np.ndarray | None] = []
    for name in proto.output:
        if not name or name not in produced:
            outputs.append("")  # an optional output the case does not check
            expected.append(None)
            continue
        value = produced[name]
        tensors[name] = TensorInfo(name, value.shape, value.dtype.name, "activation",
                                   producer=proto.name or proto.op_type)
        outputs.append(name)
        expected.append(value)
    attrs = {a.name: attribute_value(a) for a in proto.attribute}
    node = OpNode(proto.name or proto.op_type, proto.op_type, proto.domain,
                  tuple(proto.input), tuple(outputs), attrs)
    return NodeCase(case_name, proto.op_type, _opset(model), model, node, tensors,
                    tuple(inputs), tuple(expected), feeds, declared)


def collect(ops: Iterable[str] | None = None) -> tuple[list[NodeCase], list[Skipped]]:
    """Applicable node tests (sorted by op type, then name) and the skipped ones.

    With `ops`, only cases of those op types are kept or listed as skipped.
    """
    from onnx.backend.test.case.node import collect_testcases

    wanted = set(ops) if ops is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case builders overflow casts on purpose
        raw = collect_testcases(None)
    cases: list[NodeCase] = []
    skipped: list[Skipped] = []
    for case in raw:
        op_type, reason = _skip_reason(case, wanted)
        if wanted is not None and op_type not in wanted:
            continue
        if reason is None:
            cases.append(build_case(case))
        else:
            skipped.append(Skipped(case.name, op_type, reason))
    cases.sort(key=lambda c: (c.op_type, c.name))
    skipped.sort(key=lambda s: (s.op_type, s.name))
    return cases, skipped


# --------------------------------------------------------------------------- comparison


# Floating types: reordered partial sums change the last bits. Against the unsharded run
# these apply alone; against ONNX's expected outputs, at least the tolerance the case
# declares (what ONNX accepts from any backend). Integers, booleans, strings: exact.
DTYPE_TOLERANCE = {
    "float64": Tolerance(1e-7, 1e-9),
    "float32": Tolerance(1e-5, 1e-6),
    "float16": Tolerance(2e-3, 1e-3),
    "bfloat16": Tolerance(1.6e-2, 1e-2),
}


def _float_like(dtype: np.dtype) -> bool:
    if dtype.kind == "f":
        return True
    if dtype.kind == "V":
        try:
            ml_dtypes.finfo(dtype)
        except ValueError:
            return False
        return True
    return False


def tolerance(dtype: np.dtype, floor: Tolerance | None = None) -> Tolerance:
    """The comparison tolerance for one output dtype, at least `floor` when given."""
    if not _float_like(dtype):
        return Tolerance(0.0, 0.0)
    base = DTYPE_TOLERANCE.get(dtype.name)
    if base is None:  # float8/float4 results of elementwise casts: one unit in the last place
        eps = float(ml_dtypes.finfo(dtype).eps)
        base = Tolerance(eps, eps)
    if floor is None:
        return base
    return Tolerance(max(base.rtol, floor.rtol), max(base.atol, floor.atol))


def compare(actual: np.ndarray, expected: np.ndarray,
            floor: Tolerance | None = None) -> tuple[bool, float]:
    """(matches, max error): NaN equals NaN, floats within `tolerance`, the rest exact."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return False, float("inf")
    if actual.dtype != expected.dtype:
        return False, float("inf")
    if actual.size == 0:
        return True, 0.0
    if _float_like(expected.dtype):
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        tol = tolerance(expected.dtype, floor)
        nan_a, nan_e = np.isnan(a), np.isnan(e)
        if (nan_a != nan_e).any():
            return False, float("nan")
        finite = ~nan_e & np.isfinite(e) & np.isfinite(a)
        if ((a != e) & ~nan_e & ~finite).any():  # infinities must match exactly
            return False, float("inf")
        diff = np.abs(a[finite] - e[finite])
        error = float(diff.max()) if diff.size else 0.0
        ok = bool((diff <= tol.atol + tol.rtol * np.abs(e[finite])).all())
        return ok, error
    if expected.dtype.kind in "biuV":  # V: ml_dtypes' int4/uint4 and friends
        a, e = actual.astype(np.int64), expected.astype(np.int64)
        error = float(np.abs(a - e).max())
        return error == 0.0, error
    mismatched = int((actual != expected).sum())
    return mismatched == 0, float(mismatched)


def compare_all(actual: Sequence[np.ndarray | None], expected: Sequence[np.ndarray | None],
                floor: Tolerance | None = None) -> tuple[bool, float]:
    """Every checked output matches; the worst error over them (NaN when NaNs disagree)."""
    ok, worst = True, 0.0
    for a, e in zip(actual, expected, strict=True):
        if e is None:
            continue
        if a is None:
            return False, float("inf")
        matches, error = compare(a, e, floor)
        ok = ok and matches
        worst = error if np.isnan(error) or error > worst else worst
    return ok, worst


SINGLE_DEVICE = DeviceMesh.build({"a": 1}, 1)


def reference_outputs(case: NodeCase, labels: DimLabels) -> list[np.ndarray | None]:
    """The unsharded op, run by the simulator's own evaluator path on one device.

    Judging the reference through the same path as the splits means an op the evaluator
    cannot run alone (a context-dependent function op) is a reference problem, not a
    failure of the rule.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate_op(case.node, labels, REPLICATED, case.inputs, case.tensors,
                           SINGLE_DEVICE, case.opset, np.random.default_rng(0))


def random_output(case: NodeCase) -> str | None:
    """Why the op's outputs depend on a random stream, or None when they do not."""
    if case.op_type != "Dropout":
        return None
    training = case.inputs[2] if len(case.inputs) > 2 else None
    ratio = case.inputs[1] if len(case.inputs) > 1 else None
    if training is None or not bool(np.asarray(training)):
        return None
    if ratio is not None and float(np.asarray(ratio)) == 0.0:
        return None
    return ("training-mode Dropout draws its mask from a random stream; each shard draws "
            "its own, so no split can reproduce the unsharded mask element by element")


# --------------------------------------------------------------------------- running


def parse_mesh(spec: str) -> DeviceMesh:
    """'2' -> one axis a=2; '2x2' -> axes a=2, b=2 (row-major, one node)."""
    sizes = [int(part) for part in spec.lower().split("x")]
    names = "abc"[: len(sizes)]
    return DeviceMesh.build(dict(zip(names, sizes, strict=True)), int(np.prod(sizes)))


def strategy_text(strategy: OpStrategy) -> str:
    if not strategy.assignment:
        return "replicated"
    return " ".join(f"{label}:{'·'.join(axes)}" for label, axes in strategy.assignment)


def pick(strategies: Sequence[OpStrategy], limit: int | None) -> list[OpStrategy]:
    """At most `limit` strategies, evenly spaced over the deterministic candidate order."""
    if limit is None or len(strategies) <= limit:
        return list(strategies)
    if limit <= 0:
        return []
    if limit == 1:
        return [strategies[0]]
    last = len(strategies) - 1
    indices = sorted({round(i * last / (limit - 1)) for i in range(limit)})
    return [strategies[i] for i in indices]


@dataclass(frozen=True)
class StrategyRun:
    case: str
    mesh: str
    strategy: str
    passed: bool
    max_error: float
    error: str | None = None  # why it failed, when not by max_error against ONNX


@dataclass
class CaseResult:
    name: str
    op_type: str
    status: str  # "run", "reference mismatch", "random output", "declined", "rule error"
    strategies: dict[str, int] = field(default_factory=dict)  # mesh -> split strategies
    runs: list[StrategyRun] = field(default_factory=list)
    detail: str = ""

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def run_case(case: NodeCase, meshes: Sequence[str] = DEFAULT_MESHES,
             limit: int | None = None) -> CaseResult:
    """Every split strategy of the case's op on every mesh, checked against ONNX."""
    result = CaseResult(case.name, case.op_type, "run")
    try:
        labels = safe_labels(case.node, case.tensors)
    except Exception as exc:  # a rule must not crash on a valid op: that is a failure
        result.status, result.detail = "rule error", _short(exc)
        result.runs.append(StrategyRun(case.name, "-", "labels", False, float("inf"),
                                       _short(exc)))
        return result
    if labels is None:
        result.status = "declined"
        return result
    try:
        reference = reference_outputs(case, labels)
    except Exception as exc:  # the evaluator cannot run this op alone
        result.status, result.detail = "reference mismatch", f"evaluator error: {_short(exc)}"
        return result
    ok, error = compare_all(reference, case.expected, case.declared)
    if not ok:
        result.status, result.detail = "reference mismatch", f"max error {error:.3g}"
        return result
    reason = random_output(case)
    if reason is not None:
        result.status, result.detail = "random output", reason
        return result
    for spec in meshes:
        mesh = parse_mesh(spec)
        try:
            found = candidate_strategies(case.node, labels, case.tensors, mesh)
        except Exception as exc:
            result.runs.append(StrategyRun(case.name, spec, "candidates", False, float("inf"),
                                           _short(exc)))
            continue
        split = [s for s in found if s.assignment]
        result.strategies[spec] = len(split)
        for strategy in pick(split, limit):
            result.runs.append(_run_strategy(case, labels, strategy, mesh, spec, reference))
    return result


def _run_strategy(case: NodeCase, labels: DimLabels, strategy: OpStrategy, mesh: DeviceMesh,
                  spec: str, reference: Sequence[np.ndarray | None]) -> StrategyRun:
    text = strategy_text(strategy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs = simulate_op(case.node, labels, strategy, case.inputs, case.tensors, mesh,
                                  case.opset, np.random.default_rng(0))
    except Exception as exc:
        return StrategyRun(case.name, spec, text, False, float("inf"), _short(exc))
    ok, error = compare_all(outputs, case.expected, case.declared)
    if not ok:
        return StrategyRun(case.name, spec, text, False, error)
    # The split may only reorder sums: it must also match the unsharded run to the dtype's
    # own precision, far tighter than what ONNX accepts between backends.
    ok, close = compare_all(outputs, reference)
    return StrategyRun(case.name, spec, text, ok, error,
                       None if ok else f"max error {close:.3g} against the unsharded run")


def run_all(cases: Sequence[NodeCase], meshes: Sequence[str] = DEFAULT_MESHES,
            limit: int | None = None) -> list[CaseResult]:
    return [run_case(case, meshes, limit) for case in cases]


# --------------------------------------------------------------------------- report


@dataclass
class OpSummary:
    op_type: str
    applying: int = 0  # node tests that apply
    mismatched: int = 0  # excluded: the unsharded reference disagrees with ONNX
    random: int = 0  # excluded: outputs drawn from a random stream
    declined: int = 0  # the rule declines the instance (kept replicated)
    strategies: dict[str, int] = field(default_factory=dict)  # mesh -> distinct strategies
    runs_passed: int = 0
    runs: int = 0
    cases_passed: int = 0
    cases_run: int = 0
    failures: list[StrategyRun] = field(default_factory=list)


def summarise(results: Sequence[CaseResult], meshes: Sequence[str]) -> list[OpSummary]:
    by_op: dict[str, OpSummary] = {}
    distinct: dict[tuple[str, str], set[str]] = {}
    for result in results:
        summary = by_op.setdefault(result.op_type, OpSummary(result.op_type))
        summary.applying += 1
        if result.status == "reference mismatch":
            summary.mismatched += 1
            continue
        if result.status == "random output":
            summary.random += 1
            continue
        if result.status == "declined":
            summary.declined += 1
        for run in result.runs:
            distinct.setdefault((result.op_type, run.mesh), set()).add(run.strategy)
            summary.runs += 1
            summary.runs_passed += run.passed
            if not run.passed:
                summary.failures.append(run)
        if result.runs:
            summary.cases_run += 1
            summary.cases_passed += result.passed
    for summary in by_op.values():
        summary.strategies = {m: len(distinct.get((summary.op_type, m), ())) for m in meshes}
    return [by_op[op] for op in sorted(by_op)]


def summary_line(summaries: Sequence[OpSummary]) -> str:
    ops = len(summaries)
    applying = sum(s.applying for s in summaries)
    mismatched = sum(s.mismatched for s in summaries)
    random = sum(s.random for s in summaries)
    cases_run = sum(s.cases_run for s in summaries)
    cases_passed = sum(s.cases_passed for s in summaries)
    runs = sum(s.runs for s in summaries)
    runs_passed = sum(s.runs_passed for s in summaries)
    failures = sum(len(s.failures) for s in summaries)
    return (f"{ops} ops, {applying} node tests apply ({mismatched} reference mismatches and "
            f"{random} random-output tests excluded); node tests passed {cases_passed}/"
            f"{cases_run} run; strategy runs passed {runs_passed}/{runs}; {failures} failures")


def _error_text(run: StrategyRun) -> str:
    if run.error:
        return run.error
    return f"max error {run.max_error:.3g}"


def render_text(summaries: Sequence[OpSummary], meshes: Sequence[str]) -> str:
    head = ["op", "tests", "excl", "random", "declined",
            *[f"strat {m}" for m in meshes], "runs", "tests ok"]
    rows = [head]
    for s in summaries:
        rows.append([s.op_type, str(s.applying), str(s.mismatched), str(s.random),
                     str(s.declined),
                     *[str(s.strategies[m]) for m in meshes], f"{s.runs_passed}/{s.runs}",
                     f"{s.cases_passed}/{s.cases_run}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    for s in summaries:
        for run in s.failures:
            lines.append(f"FAIL {run.case} [{run.mesh}] {run.strategy}: {_error_text(run)}")
    lines.append(summary_line(summaries))
    return "\n".join(lines)


def render_markdown(summaries: Sequence[OpSummary], meshes: Sequence[str],
                    skipped: Sequence[Skipped], excluded: Sequence[CaseResult],
                    command: str, seconds: float) -> str:
    """docs/op-coverage.md: the table, failures, exclusions, and how it was made."""
    covered = {s.op_type for s in summaries}
    untested = sorted(ruled_op_types() - covered)
    unsplit = [s.op_type for s in summaries if not s.runs and not s.declined
               and s.applying > s.mismatched + s.random]
    tolerances = "; ".join(f"{name} rtol {t.rtol:g}, atol {t.atol:g}"
                           for name, t in DTYPE_TOLERANCE.items())
    shapes = [f"`({m},)`" if "x" not in m else f"`({', '.join(m.split('x'))})`" for m in meshes]
    mesh_names = ", ".join(shapes[:-1]) + (" and " if len(shapes) > 1 else "") + shapes[-1]
    lines = [
        "# Op rule coverage against ONNX node tests",
        "",
        "Generated by `bench/op_coverage.py`; do not edit by hand. Every single-op ONNX node",
        "test (`onnx.backend.test.case.node.collect_testcases`) whose op has a labelling in the",
        "op registry (`planner.ops.RECORDS`) is built as an `OpNode`, every candidate split",
        f"strategy on the meshes {mesh_names} is run on virtual devices with the case's own inputs",
        "(`simulate_op`), and the reassembled outputs are compared twice: with ONNX's expected",
        "outputs, within the larger of the dtype's tolerance and the case's declared one (what",
        "ONNX accepts from any backend), and with the unsharded op run the same way, within the",
        f"dtype's tolerance alone ({tolerances}; float8/float4: one unit in the last place).",
        "NaN equals NaN, infinities must match, and integers, booleans and strings must match",
        "exactly. A strategy like `d1:a·b m:c` splits label `d1` over mesh axes a then b (major",
        "first) and label `m` over axis c; labels are those of the op's rule. Forms the node",
        "tests lack (their shapes are tiny: batch 1, odd sizes) are checked against the",
        "reference evaluator in `tests/test_nodetests.py`.",
        "",
        f"Command: `{command}`",
        "",
        f"Run time: {seconds:.0f} s (collecting the cases included) on the 2-core CPU machine "
        "of ENVIRONMENT.md.",
        "",
        f"**{summary_line(summaries)}.**",
        "",
        "Columns: *tests* = node tests that apply; *excluded* = the unsharded op, run through",
        "the simulator's evaluator, disagrees with the expected outputs or cannot run (not",
        "counted); *random* = outputs drawn from a random stream (not counted); *declined* = the",
        "rule declines the instance, so the op is planned replicated; *strategies* = distinct",
        "split strategies (the replicated one not counted) over all of the op's tests, per",
        "mesh; *runs* = strategy runs passed / run; *tests ok* = node tests whose every split",
        "strategy passed / node tests with at least one split strategy.",
        "",
        "| op | tests | excluded | random | declined | "
        + " | ".join(f"strategies {m}" for m in meshes) + " | runs | tests ok |",
        "| --- | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in meshes) + " | ---: | ---: |",
    ]
    for s in summaries:
        strategies = " | ".join(str(s.strategies[m]) for m in meshes)
        lines.append(f"| {s.op_type} | {s.applying} | {s.mismatched} | {s.random} | "
                     f"{s.declined} | "
                     f"{strategies} | {s.runs_passed}/{s.runs} | {s.cases_passed}/{s.cases_run} |")
    lines += ["", "Ops with a sharding rule and no node test applying: "
              f"{', '.join(untested) or 'none'}.",
              "",
              "Ops whose node tests admit no split on these meshes (every dim of size 1, not "
              f"divisible, or one the rule keeps whole): {', '.join(unsplit) or 'none'}.", ""]
    failures = [run for s in summaries for run in s.failures]
    lines += ["## Failures", ""]
    if failures:
        lines += ["| case | mesh | strategy | error |", "| --- | --- | --- | --- |"]
        lines += [f"| {r.case} | {r.mesh} | `{r.strategy}` | {_error_text(r)} |" for r in failures]
    else:
        lines.append("None.")
    lines += ["", "## Excluded node tests", ""]
    if excluded:
        lines += [f"- `{r.name}` ({r.op_type}, {r.status}): {r.detail}" for r in excluded]
    else:
        lines.append("None.")
    lines += ["", "## Skipped node tests", ""]
    lines += _skipped_lines(skipped)
    return "\n".join(lines) + "\n"


def _skipped_lines(skipped: Sequence[Skipped]) -> list[str]:
    """One bullet per reason: every case name, or a sample where there are hundreds."""
    if not skipped:
        return ["None."]
    groups: dict[str, list[Skipped]] = {}
    for item in skipped:
        groups.setdefault(item.reason, []).append(item)
    lines = []
    for reason in sorted(groups):
        items = groups[reason]
        because = SKIP_WHY.get(reason, reason)
        if reason == NO_RULE:
            ops = sorted({i.op_type for i in items})
            shown = ", ".join(ops)
            lines.append(f"- {reason} ({len(items)} tests of {len(ops)} op types; {because}): "
                         f"{shown}")
            continue
        sample = items if reason not in (EXPANDED, MULTI_OP) else items[:5]
        names = ", ".join(f"`{i.name}`" for i in sample)
        more = f" and {len(items) - len(sample)} more" if len(items) > len(sample) else ""
        lines.append(f"- {reason} ({len(items)}; {because}): {names}{more}")
    return lines


# --------------------------------------------------------------------------- command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/op_coverage.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES),
                        help="comma-separated mesh shapes, e.g. 2,2x2")
    parser.add_argument("--write", metavar="PATH", help="render the Markdown table to PATH")
    parser.add_argument("--ops", help="comma-separated op types (default: every op with a rule)")
    parser.add_argument("--limit-strategies", type=int, metavar="N",
                        help="run at most N split strategies per case and mesh")
    args = parser.parse_args(argv)
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
    started = time.perf_counter()
    cases, skipped = collect(ops)
    results = run_all(cases, meshes, args.limit_strategies)
    seconds = time.perf_counter() - started
    summaries = summarise(results, meshes)
    print(render_text(summaries, meshes))
    print(f"{seconds:.1f} s")
    if args.write:
        command = "python bench/op_coverage.py " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        excluded = [r for r in results if r.status in ("reference mismatch", "random output")]
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(render_markdown(summaries, meshes, skipped, excluded,
                                         command.strip(), seconds))
    failed = sum(len(s.failures) for s in summaries)
    return 1 if failed else 0
