"""Which ops share one strategy choice: the same position of every repeated layer.

Sharing choices restricts the search (every layer is split alike, as Megatron and Alpa
do): the solver's optimum is then the optimum among such plans. The costs stay exact:
every op and edge is still priced on its own. The repeats are found in the graph layer
(`planner.layers.find_repeats`).
"""

from __future__ import annotations

from planner.graph import PlanningGraph
from planner.layers import Repeats


def tie_classes(graph: PlanningGraph, repeats: Repeats | None) -> list[list[str]]:
    """Groups of op names sharing a choice: one per layer position, singletons elsewhere."""
    names = [n.name for n in graph.ops]
    if repeats is None:
        return [[name] for name in names]
    classes: list[list[str]] = []
    end = repeats.start + repeats.covered
    for index, name in enumerate(names):
        if index < repeats.start or index >= end:
            classes.append([name])
        elif index < repeats.start + repeats.period:
            classes.append([names[index + layer * repeats.period]
                            for layer in range(repeats.count)])
    return classes
