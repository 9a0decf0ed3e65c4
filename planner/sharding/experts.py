"""Expert parallelism on a mesh's "ep" axis: which labels of a graph carry its experts,
how many experts there are, and which assignments of an op use the axis as expert
parallelism means it (DeepSpeed-MoE, Rajbhandari et al. 2022; Megatron-LM's MoE).

Experts are stacked weights `[E, in, out]` read by batched GEMMs whose leading label is a
batch label of the GEMM (the zoo's GShard MoE: dispatch gives `[E, B*C, H]`). That label,
followed forward from the weights (`planner.sharding.batch.trace_labels`), is what "ep"
splits inside expert layers; outside them "ep" splits the batch together with "dp" (ep
ranks hold different tokens). The move from the batch-split tokens to the expert-split
ones and back is the all-to-all `planner.sharding.redistribute` derives between the two
layouts (dispatch and combine); the expert weights' gradients are then summed over dp
alone, the other weights' over (dp, ep), both as `planner.sharding.derive` derives them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from planner.graph import PlanningGraph
from planner.kinds import AxisRole
from planner.ops import DimLabels, record_for
from planner.sharding.batch import dp_splits_exactly, trace_labels

EP_AXIS: str = AxisRole.EXPERT


@dataclass(frozen=True)
class Experts:
    """The graph's experts: per op the labels carrying the expert dim, the expert count ep
    must divide (the gcd over every stacked expert weight), and the GEMMs reading stacked
    expert weights (`gemms`: "ep" splits their experts, or it would be data parallelism
    under another name); empty without any."""

    labels: Mapping[str, frozenset[str]]
    count: int = 0
    gemms: frozenset[str] = frozenset()

    def degrees(self, most: int) -> list[int]:
        """The expert-parallel degrees above 1 worth trying: powers of two up to `most`
        dividing the expert count."""
        return [d for d in (1 << k for k in range(1, 12))
                if d <= most and self.count and self.count % d == 0]


def find_experts(graph: PlanningGraph, labels: Mapping[str, DimLabels | None],
                 weight_roots: Mapping[str, frozenset[str]]) -> Experts:
    """The stacked expert weights (a weight of rank 3 or more whose leading dim a matrix
    op labels as one of its batch labels: in the output and in another input) and their
    expert label followed through the graph."""
    seeds: dict[str, set[int]] = {}
    counts: list[int] = []
    gemms: set[str] = set()
    for node in graph.ops:
        record = record_for(node.op_type, node.domain)
        op_labels = labels.get(node.name)
        if record is None or not record.matrix or op_labels is None:
            continue
        outputs = {label for names in op_labels.outputs if names for label in names}
        for index, name in enumerate(node.inputs):
            names = op_labels.inputs[index] if index < len(op_labels.inputs) else None
            tensor = graph.tensors.get(name)
            if (names is None or tensor is None or len(tensor.shape) < 3
                    or name not in weight_roots or tensor.shape[0] < 2):
                continue
            others = {label for k, other in enumerate(op_labels.inputs)
                      if k != index and other for label in other}
            if names[0] in outputs and names[0] in others:
                seeds[name] = {0}
                counts.append(tensor.shape[0])
                gemms.add(node.name)
    if not seeds:
        return Experts({})
    count = math.gcd(*counts)
    return Experts(trace_labels(graph, labels, seeds, EP_AXIS, count), count,
                   frozenset(gemms))


def expert_allows(assigned: Mapping[str, tuple[str, ...]], batch: Collection[str],
                  expert: Collection[str], free: bool, dp: bool, gemm: bool = False) -> bool:
    """Whether an op's assignment uses the "ep" axis as expert parallelism means it: on
    its batch labels together with "dp" (inside "dp": `dp_splits_exactly`'s `together`),
    or on one of its `expert` labels alone while "dp" (when the mesh has it, `dp`) splits
    exactly the batch; an op that carries neither runs whole over ep, unless `free` (it
    computes from weights alone: a stacked bias reshaped may be cut as its reader is). An
    expert GEMM (`gemm`) splits its experts over "ep", never the batch."""
    together = (str(AxisRole.DATA), EP_AXIS) if dp else (EP_AXIS,)
    if not gemm and dp_splits_exactly(assigned, batch, together=together):
        return True
    on = [label for label, axes in assigned.items() if EP_AXIS in axes]
    if dp and not dp_splits_exactly(assigned, batch, str(AxisRole.DATA)):
        return False
    if not on:
        return not batch
    if len(on) != 1 or assigned[on[0]] != (EP_AXIS,):
        return False
    return on[0] in expert or (free and not batch)
