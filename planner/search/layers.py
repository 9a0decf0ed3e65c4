"""Which ops share one strategy choice: the same position of every layer of a block.

Sharing choices restricts the search (every layer is split alike, as Megatron and Alpa
do): the solver's optimum is then the optimum among such plans. The costs stay exact:
every op and edge is still priced on its own. The repeats are found in the graph layer
(`planner.layers.find_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.graph import PlanningGraph
from planner.layers import Repeats
from planner.sharding.strategy import OpStrategy


def tie_classes(graph: PlanningGraph, blocks: Sequence[Repeats],
                fixed: Mapping[str, OpStrategy] | None = None) -> list[list[str]]:
    """Groups of op names sharing a choice: one per layer position of each repeated block,
    singletons elsewhere.

    With `fixed` (the user's pinned strategies) only layers pinned alike share choices:
    a layer whose pins differ from another's (its MLP column/row-parallel where the next
    layer's is batch-split) is searched on its own, so the fill-in around each layer's
    pins is the best for those pins, not one compromise for all."""
    names = [n.name for n in graph.ops]
    pins = fixed or {}
    tied: dict[int, list[list[str]]] = {}  # first layer's op index -> its classes
    covered: set[int] = set()
    for repeats in blocks:
        kinds: dict[tuple, list[int]] = {}  # layers pinned alike
        for layer in range(repeats.count):
            first = repeats.start + layer * repeats.period
            kind = tuple((position, pins[names[first + position]])
                         for position in range(repeats.period)
                         if names[first + position] in pins)
            kinds.setdefault(kind, []).append(layer)
        for index in range(repeats.start, repeats.start + repeats.period):
            tied[index] = [[names[index + layer * repeats.period] for layer in layers]
                           for layers in kinds.values()]
        covered.update(range(repeats.start, repeats.start + repeats.covered))
    classes: list[list[str]] = []
    for index, name in enumerate(names):
        if index in tied:
            classes += tied[index]
        elif index not in covered:
            classes.append([name])
    return classes


def ties_layers(blocks: Sequence[Repeats]) -> bool:
    """Whether tying makes a difference: the graph repeats a layer at least twice."""
    return bool(blocks)  # a block repeats its layer at least twice
