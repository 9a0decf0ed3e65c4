"""What one device runs for one op under a strategy: a small ONNX program.

Most ops run unchanged on their local shards; the others carry a local rewrite in their
op record (`planner.ops.rewrites`), which sees the op's placement through the
`LocalContext` protocol implemented here from layouts, the mesh and the device's
coordinate. The numpy simulator runs these programs with ONNX's reference evaluator, and
the torch executor runs the same programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.graph import OpNode, TensorInfo
from planner.ops import DimLabels, LocalProgram, node_proto, record_for
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import OpStrategy, input_layouts, output_layouts


@dataclass(frozen=True)
class ShardContext:
    """`planner.ops.LocalContext` of one op on one device of a mesh."""

    node: OpNode
    labels: DimLabels
    strategy: OpStrategy
    tensors: Mapping[str, TensorInfo]
    mesh: DeviceMesh
    coord: tuple[int, ...]  # this device's coordinate on the mesh

    def layouts(self) -> tuple[list[Layout | None], list[Layout | None]]:
        ranks_in = [len(self.tensors[t].shape) if t else -1 for t in self.node.inputs]
        ranks_out = [len(self.tensors[t].shape) if t else -1 for t in self.node.outputs]
        return (input_layouts(self.labels, self.strategy, ranks_in),
                output_layouts(self.labels, self.strategy, ranks_out))

    def local_input_shape(self, index: int) -> tuple[int, ...]:
        layout = self.layouts()[0][index]
        assert layout is not None
        return layout.local_shape(self.tensors[self.node.inputs[index]].shape, self.mesh)

    def local_output_shape(self, index: int) -> tuple[int, ...]:
        layout = self.layouts()[1][index]
        assert layout is not None
        return layout.local_shape(self.tensors[self.node.outputs[index]].shape, self.mesh)

    def split_axes(self, label: str) -> tuple[str, ...]:
        return self.strategy.axes_of(label)

    def axis_index(self, axes: tuple[str, ...]) -> int:
        """This device's position within a group over `axes` (major axis first)."""
        index = 0
        for axis in axes:
            index = index * self.mesh.axis_size(axis) + self.coord[
                self.mesh.axis_names.index(axis)]
        return index

    def group_size(self, axes: tuple[str, ...]) -> int:
        return self.mesh.group_size(axes)

    def holds_partial_term(self) -> bool:
        """Of the devices sharing one partial sum, exactly one adds constant terms."""
        axes = [a for label in self.labels.sum_labels for a in self.strategy.axes_of(label)]
        return all(self.coord[self.mesh.axis_names.index(a)] == 0 for a in axes)


def local_program(node: OpNode, labels: DimLabels, strategy: OpStrategy,
                  tensors: Mapping[str, TensorInfo], mesh: DeviceMesh,
                  coord: tuple[int, ...]) -> LocalProgram:
    """The program device `coord` runs for `node` under `strategy`."""
    record = record_for(node.op_type, node.domain)
    if record is None or record.rewrite is None or not strategy.assignment:
        return LocalProgram([node_proto(node)])
    return record.rewrite(ShardContext(node, labels, strategy, tensors, mesh, coord))
