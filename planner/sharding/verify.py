"""Check every strategy the registry emits for a graph's ops against the unsharded op.

For each op with a rule: draw inputs, compute the reference outputs with ONNX's reference
evaluator, then simulate every candidate strategy on the mesh and compare. Used by the
tests for the zoo and for real exports, and usable on any model a user brings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from planner.graph import OpNode, PlanningGraph, TensorInfo
from planner.ops import node_proto, safe_labels
from planner.reference import run_node
from planner.sharding.candidates import candidate_strategies
from planner.sharding.mesh import DeviceMesh
from planner.sharding.simulate import simulate_op

#: Input slots drawn positive: the op's domain excludes zero or negatives there.
POSITIVE_INPUT_SLOTS = {"Sqrt": {0}, "Log": {0}, "Reciprocal": {0}, "Pow": {0}, "Div": {1},
                        "BatchNormalization": {4}}
NONDETERMINISTIC = frozenset({"Dropout", "RandomNormalLike", "RandomUniformLike", "Bernoulli"})


@dataclass
class VerifyReport:
    ops: int = 0
    strategies: int = 0
    skipped: list[str] = field(default_factory=list)  # op names without a rule or random
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def draw_inputs(node: OpNode, tensors: Mapping[str, TensorInfo],
                rng: np.random.Generator) -> list[np.ndarray | None]:
    """Inputs that exercise the op inside its domain (valid indices, positive roots)."""
    values: list[np.ndarray | None] = []
    for index, name in enumerate(node.inputs):
        if not name:
            values.append(None)
            continue
        info = tensors[name]
        if info.value is not None:
            values.append(np.asarray(info.value))
        elif info.dtype == "bool":
            values.append(rng.random(info.shape) > 0.5)
        elif info.dtype.startswith(("int", "uint")):
            values.append(_draw_indices(node, index, info, tensors, rng))
        else:
            dtype = np.float32 if info.dtype == "bfloat16" else np.dtype(info.dtype)
            sample = rng.standard_normal(info.shape)
            if index in POSITIVE_INPUT_SLOTS.get(node.op_type, ()):
                sample = np.abs(sample) + 0.5
            values.append(sample.astype(dtype))
    return values


def _draw_indices(node: OpNode, index: int, info: TensorInfo,
                  tensors: Mapping[str, TensorInfo], rng: np.random.Generator) -> np.ndarray:
    high = 4
    if node.op_type in ("Gather", "GatherElements") and index == 1:
        axis = int(node.attrs.get("axis", 0))
        high = tensors[node.inputs[0]].shape[axis]
    elif node.op_type == "OneHot" and index == 0:
        depth = tensors[node.inputs[1]].value
        high = int(np.asarray(depth).reshape(-1)[0]) if depth is not None else 2
    return rng.integers(0, max(high, 1), size=info.shape).astype(info.dtype)


def verify_op(node: OpNode, tensors: Mapping[str, TensorInfo], mesh: DeviceMesh, opset: int,
              rng: np.random.Generator, report: VerifyReport) -> None:
    labels = safe_labels(node, tensors)
    if labels is None or node.op_type in NONDETERMINISTIC:
        report.skipped.append(node.name)
        return
    inputs = draw_inputs(node, tensors, rng)
    feeds = {name: value for name, value in zip(node.inputs, inputs, strict=True)
             if name and value is not None}  # a named input is always drawn
    expected = run_node(node_proto(node), feeds, opset)
    report.ops += 1
    for strategy in candidate_strategies(node, labels, tensors, mesh):
        report.strategies += 1
        try:
            outputs = simulate_op(node, labels, strategy, inputs, tensors, mesh, opset, rng)
        except Exception as exc:
            report.failures.append(f"{node.name} ({node.op_type}) {strategy}: {exc!r}")
            continue
        for got, want in zip(outputs, expected, strict=False):
            if got is None:
                continue
            want = np.asarray(want)
            if not np.allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True):
                error = float(np.nanmax(np.abs(got.astype(np.float64) - want)))
                report.failures.append(
                    f"{node.name} ({node.op_type}) {strategy}: max error {error:.3g}")
                break


def verify_graph(graph: PlanningGraph, mesh: DeviceMesh, seed: int = 0) -> VerifyReport:
    """Simulate every candidate strategy of every op of `graph` on `mesh`."""
    report = VerifyReport()
    rng = np.random.default_rng(seed)
    for node in graph.ops:
        verify_op(node, graph.tensors, mesh, graph.opset, rng, report)
    return report
