"""FLOPs and bytes of one forward op, whole (unsharded), from its record's work class."""

from __future__ import annotations

from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo
from planner.ops.registry import record_for
from planner.ops.work import FLOOR, Work, count


def work_of(node: OpNode) -> Work:
    """The op's work class: its own record's, else (an op of another domain named like one
    of ONNX's, e.g. a contrib Gelu) that ONNX op's, else the floor."""
    record = record_for(node.op_type, node.domain) or record_for(node.op_type)
    return record.work if record is not None else FLOOR


def cost_op(node: OpNode, tensors: Mapping[str, TensorInfo]) -> None:
    """Fill in `node.flops`, `bytes_read`, `bytes_written` and `is_view`."""
    count(work_of(node), node, tensors)
