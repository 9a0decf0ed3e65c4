"""The per-device program of one op, and what a local rewrite may ask of its placement.

Most ops run unchanged on their local shards. Ops whose attributes or constant inputs
carry sizes, or whose split leaves a partial sum that must not count a term twice, are
rewritten by their record's `LocalRewrite` into a small ONNX program. Collectives an op
needs inside itself (the statistics of a split training batch norm) appear as nodes of
the `shardplan` domain: `AllReduce(x) {axes}` sums x over the listed mesh axes.

A rewrite needs the op's placement (layouts, local shapes, mesh coordinates), which the
sharding layer owns; it sees it through the `LocalContext` protocol, which
`planner.sharding.local` implements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import DimLabels

SHARDPLAN_DOMAIN = "shardplan"
#: The collectives local programs may contain (ops of SHARDPLAN_DOMAIN).
COLLECTIVES = frozenset({"AllReduce"})


@dataclass
class LocalProgram:
    """Nodes to run in order on one device; `constants` feed extra inputs they name."""

    nodes: list[onnx.NodeProto]
    constants: dict[str, np.ndarray] = field(default_factory=dict)


class LocalContext(Protocol):
    """One op on one device under one strategy, as a local rewrite sees it."""

    @property
    def node(self) -> OpNode: ...

    @property
    def labels(self) -> DimLabels: ...

    @property
    def tensors(self) -> Mapping[str, TensorInfo]: ...

    def local_input_shape(self, index: int) -> tuple[int, ...]:
        """The shape of this device's shard of input `index`."""
        ...

    def local_output_shape(self, index: int) -> tuple[int, ...]:
        """The shape of this device's shard of output `index`."""
        ...

    def split_axes(self, label: str) -> tuple[str, ...]:
        """The mesh axes splitting `label` (major first); () when it stays whole."""
        ...

    def axis_index(self, axes: tuple[str, ...]) -> int:
        """This device's position within a group over `axes` (major axis first)."""
        ...

    def group_size(self, axes: tuple[str, ...]) -> int:
        """How many devices a group over `axes` has."""
        ...

    def holds_partial_term(self) -> bool:
        """Of the devices sharing one partial sum, exactly one adds constant terms."""
        ...


@dataclass(frozen=True)
class LocalRewrite:
    """A record's per-device program, and every op type it may emit.

    `emits` names default-domain op types plainly and collectives as `shardplan::AllReduce`;
    the executor checks them before it starts (`executor.support`).
    """

    program: Callable[[LocalContext], LocalProgram]
    emits: frozenset[str]

    def __call__(self, context: LocalContext) -> LocalProgram:
        return self.program(context)


def node_proto(node: OpNode) -> onnx.NodeProto:
    """The op as a single ONNX node (what a device runs when nothing is rewritten)."""
    # tensor attributes (ConstantOfShape's value) are kept as arrays: back to tensors, or
    # make_node would write them as lists and lose their shape and dtype
    attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v
             for k, v in node.attrs.items() if v is not None}
    return helper.make_node(node.op_type, list(node.inputs), list(node.outputs), name=node.name,
                            domain=node.domain or None, **attrs)


def qualified(node: onnx.NodeProto) -> str:
    """`Add` for a default-domain node, `shardplan::AllReduce` for others."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
