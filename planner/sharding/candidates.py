"""Every valid strategy of one op on one mesh, with trivially dominated ones pruned.

Each mesh axis of size > 1 either stays unused or splits one splittable label; several
axes on one label split it in mesh order (major first), as DTensor orders them. A strategy
is kept when `check_strategy` accepts it (sizes divide, whole labels stay whole). Two
strategies with the same input and output layouts differ only in wasted work: the one
doing less per device is kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from planner.graph import OpNode, TensorInfo
from planner.sharding.mesh import DeviceMesh
from planner.sharding.rules import DimLabels
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    input_layouts,
    is_valid,
    output_layouts,
    work_fraction,
)


def splittable_labels(node: OpNode, labels: DimLabels,
                      tensors: Mapping[str, TensorInfo]) -> list[str]:
    sizes = labels.sizes(node, tensors)
    return sorted(label for label, found in sizes.items()
                  if label not in labels.whole_labels and max(found) > 1)


def candidate_strategies(node: OpNode, labels: DimLabels, tensors: Mapping[str, TensorInfo],
                         mesh: DeviceMesh) -> list[OpStrategy]:
    """All valid strategies, the replicated one first, deterministic order."""
    options: list[str | None] = [None, *splittable_labels(node, labels, tensors)]
    axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
    in_ranks = [len(tensors[t].shape) if t else -1 for t in node.inputs]
    out_ranks = [len(tensors[t].shape) if t else -1 for t in node.outputs]
    best: dict[tuple, OpStrategy] = {}
    order: list[tuple] = []
    for choice in itertools.product(options, repeat=len(axes)):
        mapping: dict[str, tuple[str, ...]] = {}
        for axis, label in zip(axes, choice, strict=True):
            if label is not None:
                mapping[label] = (*mapping.get(label, ()), axis)
        strategy = OpStrategy.of(mapping) if mapping else REPLICATED
        if not is_valid(node, labels, strategy, tensors, mesh):
            continue
        key = (tuple(input_layouts(labels, strategy, in_ranks)),
               tuple(output_layouts(labels, strategy, out_ranks)))
        kept = best.get(key)
        if kept is None:
            order.append(key)
            best[key] = strategy
        elif work_fraction(strategy, mesh) < work_fraction(kept, mesh):
            best[key] = strategy
    return [best[key] for key in order]
