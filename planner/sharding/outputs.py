"""Graph outputs leave the graph resolved.

Nothing after the graph sums a pending partial sum, so the op writing a (non-scalar) graph
output must write it whole over every axis it is summed on: the reduction then happens
inside the graph, where an edge prices it (the hidden split gathered before a language
model's head, not gigabytes of partial logits). A scalar output (the model's own loss)
may stay a pending sum: its gradient is right as it is and its value is summed for the
report only. The search's candidates and the fixed layouts (Megatron's) both obey this.

A training step's loss outside the graph then reads each such output (`LossReads`): whole
rows (`loss_layout`), each output gathered along every dim but its rows where the plan
leaves it split there; the derivation lists that gather under the op `loss` with the
forward pass, so it is priced, searched and run as any other move, but never re-run by a
recompute of the op writing the output: a vocabulary-split head's logits cost their gather
per micro-batch, which the search weighs against the split.
"""

from __future__ import annotations

from planner.graph import PlanningGraph
from planner.kinds import LossReads
from planner.sharding.layout import Layout


def resolved_output_slots(graph: PlanningGraph) -> dict[str, tuple[int, ...]]:
    """Op name -> the output slots it writes that are non-scalar graph outputs."""
    slots: dict[str, list[int]] = {}
    for name in graph.outputs:
        info = graph.tensors.get(name)
        if info is None or info.producer is None or info.numel <= 1:
            continue
        producer = graph.op(info.producer)
        slots.setdefault(producer.name, []).append(list(producer.outputs).index(name))
    return {op: tuple(found) for op, found in slots.items()}


def loss_layout(layout: Layout, rows: int = 0) -> Layout:
    """What a loss reading whole rows reads of an output placed in `layout`: its rows
    (dim `rows`, the output's batch dim: `GraphAnalysis.rows_dim`) split as they are,
    every other dim whole, nothing pending."""
    if not layout.dims:
        return layout
    return Layout(tuple(axes if dim == rows else () for dim, axes in enumerate(layout.dims)))


def loss_read_slots(graph: PlanningGraph, training: bool, loss_reads: LossReads
                    ) -> dict[str, tuple[int, ...]]:
    """Op name -> the output slots a loss reading whole rows reads (`resolved_output_slots`)
    in a training step with `loss_reads` rows; none otherwise."""
    return resolved_output_slots(graph) if training and loss_reads is LossReads.ROWS else {}
