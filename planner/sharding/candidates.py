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
from dataclasses import dataclass

from planner.graph import OpNode, TensorInfo
from planner.ops import DimLabels
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    grad_partial_axes,
    input_layouts,
    is_valid,
    output_layouts,
    sync_axes,
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


@dataclass(frozen=True)
class Candidate:
    """One strategy of one op with everything the search and the executor need to know."""

    strategy: OpStrategy
    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout | None, ...]
    forward_collectives: tuple[tuple[str, tuple[str, ...], int], ...]  # (kind, axes, bytes)
    backward_collectives: tuple[tuple[str, tuple[str, ...], int], ...]
    flops: float  # per device, forward
    bytes_moved: float  # per device, forward reads + writes
    grad_partial: tuple[tuple[str, ...], ...]  # per input: axes its gradient is partial over


def describe(node: OpNode, labels: DimLabels, strategy: OpStrategy,
             tensors: Mapping[str, TensorInfo], mesh: DeviceMesh) -> Candidate:
    """Layouts, own collectives, per-device work and gradient partiality of `strategy`."""
    in_ranks = [len(tensors[t].shape) if t else -1 for t in node.inputs]
    out_ranks = [len(tensors[t].shape) if t else -1 for t in node.outputs]
    fraction = work_fraction(strategy, mesh)
    stats_axes = sync_axes(labels, strategy)
    own: tuple[tuple[str, tuple[str, ...], int], ...] = ()
    if stats_axes:
        # The local program (planner.sharding.local) reduces the per-channel sum and sum of
        # squares of its own channels, in fp32: two AllReduces each way.
        layout = input_layouts(labels, strategy, in_ranks)[0]
        assert layout is not None
        channels = layout.local_shape(tensors[node.inputs[0]].shape, mesh)[1]
        own = (("all_reduce", stats_axes, channels * 4),) * 2
    return Candidate(
        strategy=strategy,
        inputs=tuple(input_layouts(labels, strategy, in_ranks)),
        outputs=tuple(output_layouts(labels, strategy, out_ranks)),
        forward_collectives=own,
        backward_collectives=own,  # the gradient of the statistics is reduced alike
        flops=node.flops * fraction,
        bytes_moved=(node.bytes_read + node.bytes_written) * fraction,
        grad_partial=tuple(grad_partial_axes(labels, strategy, i)
                           for i in range(len(node.inputs))),
    )
