"""One op's strategy: which mesh axes split which of its labels.

From a strategy and the op's DimLabels follow everything else: the layout each input must
have, the layout of each output (partial over the axes of split contraction labels), the
op's own collectives, the per-device share of its work, and which input gradients come
back as partial sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from planner.errors import StrategyError
from planner.graph import OpNode, TensorInfo
from planner.ops import DimLabels
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh


@dataclass(frozen=True)
class OpStrategy:
    """label -> mesh axes splitting it (major first); labels not named stay whole."""

    assignment: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, tuple[str, ...]]) -> OpStrategy:
        return cls(tuple(sorted((k, tuple(v)) for k, v in mapping.items() if v)))

    def axes_of(self, label: str) -> tuple[str, ...]:
        for name, axes in self.assignment:
            if name == label:
                return axes
        return ()

    @property
    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for _, axes in self.assignment for a in axes)


REPLICATED = OpStrategy()


@lru_cache(maxsize=4096)
def single_split(label: str, axes: tuple[str, ...]) -> OpStrategy:
    """The strategy splitting one label over `axes`, made once per label and axes: the
    batch and sequence traces ask for it at every op of the graph."""
    return OpStrategy.of({label: axes})


def input_layouts(labels: DimLabels, strategy: OpStrategy,
                  ranks: list[int]) -> list[Layout | None]:
    """The layout each input must arrive in (None for absent inputs)."""
    layouts: list[Layout | None] = []
    for names, rank in zip(labels.inputs, ranks, strict=True):
        if rank < 0:
            layouts.append(None)
        elif names is None:
            layouts.append(Layout.replicated(rank))
        else:
            layouts.append(Layout(tuple(strategy.axes_of(label) for label in names)))
    return layouts


def output_layouts(labels: DimLabels, strategy: OpStrategy,
                   ranks: list[int]) -> list[Layout | None]:
    """Outputs are split like their labels and partial over split contraction labels."""
    partial = tuple(a for label in sorted(labels.sum_labels) for a in strategy.axes_of(label))
    layouts: list[Layout | None] = []
    for names, rank in zip(labels.outputs, ranks, strict=True):
        if rank < 0:
            layouts.append(None)
        elif names is None:
            layouts.append(Layout.replicated(rank))
        else:
            layouts.append(Layout(tuple(strategy.axes_of(label) for label in names), partial))
    return layouts


def check_strategy(node: OpNode, labels: DimLabels, strategy: OpStrategy,
                   tensors: Mapping[str, TensorInfo], mesh: DeviceMesh) -> None:
    """Raise StrategyError naming the op, label, dim and numbers when it cannot apply."""
    seen: set[str] = set()
    sizes = labels.sizes(node, tensors)
    for label, axes in strategy.assignment:
        for axis in axes:
            mesh.axis_size(axis)
            if axis in seen:
                raise StrategyError(f"op {node.name}: mesh axis {axis!r} splits two dims")
            seen.add(axis)
        if label in labels.whole_labels:
            raise StrategyError(f"op {node.name} ({node.op_type}): dim {label} must stay whole")
        if label not in sizes:
            raise StrategyError(f"op {node.name} ({node.op_type}) has no dim {label}")
        degree = mesh.group_size(axes)
        for size in sorted(sizes[label]):
            if size % degree:
                raise StrategyError(
                    f"op {node.name} ({node.op_type}): dim {label} of size {size} cannot be "
                    f"split into {degree} equal parts over mesh axes {list(axes)}"
                )


def is_valid(node: OpNode, labels: DimLabels, strategy: OpStrategy,
             tensors: Mapping[str, TensorInfo], mesh: DeviceMesh) -> bool:
    """Whether `check_strategy` accepts: decided by the labels, the strategy, the mesh and
    the shapes the op reads and writes, so every layer's op asks once."""
    key = (labels, strategy, mesh, tuple(tensors[t].shape if t else None for t in node.inputs),
           tuple(tensors[t].shape if t else None for t in node.outputs))
    found = _VALID.get(key)
    if found is None:
        try:
            check_strategy(node, labels, strategy, tensors, mesh)
            found = True
        except StrategyError:
            found = False
        if len(_VALID) >= VALID_LIMIT:
            _VALID.clear()
        _VALID[key] = found
    return found


VALID_LIMIT = 1 << 16  # `is_valid` answers kept
_VALID: dict[tuple, bool] = {}


def work_fraction(strategy: OpStrategy, mesh: DeviceMesh) -> float:
    """Share of the op's FLOPs one device does: every split label divides the work."""
    return 1.0 / mesh.group_size(strategy.used_axes)  # the mesh's own product, not numpy's


def grad_partial_axes(labels: DimLabels, strategy: OpStrategy, index: int) -> tuple[str, ...]:
    """Axes over which input `index`'s gradient comes back as a partial sum.

    When the op splits a label the input does not carry, each device computes the input's
    gradient from only its share of that label: the shares must be summed.
    """
    names = labels.inputs[index]
    own = set(names or ())
    return tuple(a for label, axes in strategy.assignment if label not in own for a in axes)


def sync_axes(labels: DimLabels, strategy: OpStrategy) -> tuple[str, ...]:
    """Axes over which the op must AllReduce statistics (training batch norm)."""
    return tuple(a for label, axes in strategy.assignment if label in labels.sync_labels
                 for a in axes)
