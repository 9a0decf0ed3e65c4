"""Run one ONNX node with ONNX's reference evaluator, with fixes where it is wrong.

The importer folds shape arithmetic with it and the SPMD simulator runs every local
program with it, so both go through this one function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun


class GatherElements(OpRun):
    """onnx 1.23's version fails on gathered axes longer than 64 (np.choose's limit)."""

    op_domain = ""

    def _run(self, data, indices, axis=None):
        axis = int(axis or 0)
        positive = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, positive.astype(np.int64), axis=axis),)


class Gelu(OpRun):
    """Gelu (opset 20) is a function op: a lone node has no implementation to expand."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            inner = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)
            return ((0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype),)
        from scipy.special import erf

        return ((0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(x.dtype),)


OVERRIDES = [GatherElements, Gelu]


def run_node(node: onnx.NodeProto, feeds: Mapping[str, np.ndarray], opset: int) -> list:
    """Outputs of `node` on `feeds` (raises whatever the evaluator raises)."""
    evaluator = ReferenceEvaluator(node, opsets={"": opset}, new_ops=OVERRIDES)
    # run() gives the outputs as a list, in order; only intermediate=True gives a dict
    return cast(list, evaluator.run(None, dict(feeds)))
