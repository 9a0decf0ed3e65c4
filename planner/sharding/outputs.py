"""Graph outputs leave the graph resolved.

Nothing after the graph sums a pending partial sum, so the op writing a (non-scalar) graph
output must write it whole over every axis it is summed on: the reduction then happens
inside the graph, where an edge prices it (the hidden split gathered before a language
model's head, not gigabytes of partial logits). A scalar output (the model's own loss)
may stay a pending sum: its gradient is right as it is and its value is summed for the
report only. The search's candidates and the fixed layouts (Megatron's) both obey this.
"""

from __future__ import annotations

from planner.graph import PlanningGraph


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
