"""Find repeated layers, so that the search solves one layer instead of all of them.

Each op gets a signature (type, attributes, input and output shapes and roles). In
topological order, a transformer's layers repeat the same run of signatures. The period
with the longest run of `sig[i] == sig[i + p]` marks the layer length `p`; ops at the
same position of every full repeat form one class and share one strategy choice.

Sharing choices restricts the search (every layer is split alike, as Megatron and Alpa
do): the solver's optimum is then the optimum among such plans. The costs stay exact:
every op and edge is still priced on its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from planner.graph import OpNode, PlanningGraph

MIN_REPEATS = 2


@dataclass(frozen=True)
class Repeats:
    start: int  # index (in graph.ops) of the first op of the first repeat
    period: int  # ops per layer
    count: int  # number of full repeats

    @property
    def covered(self) -> int:
        return self.period * self.count


def op_signature(node: OpNode, graph: PlanningGraph) -> str:
    """What makes two ops interchangeable for planning (names excluded)."""
    parts = [node.domain, node.op_type, repr(sorted((k, repr(v)) for k, v in node.attrs.items()))]
    for name in node.inputs:
        if not name:
            parts.append("-")
            continue
        info = graph.tensors[name]
        value = "" if info.value is None else hashlib.sha1(
            np.ascontiguousarray(info.value).tobytes()).hexdigest()
        parts.append(f"{info.kind}:{info.dtype}:{info.shape}:{value}")
    for name in node.outputs:
        parts.append(f"out:{graph.tensors[name].shape}" if name else "out:-")
    return "|".join(parts)


def find_repeats(graph: PlanningGraph) -> Repeats | None:
    """The longest run of repeated layers, or None when no block repeats."""
    signatures: dict[str, int] = {}
    codes = np.array([signatures.setdefault(op_signature(n, graph), len(signatures))
                      for n in graph.ops], dtype=np.int64)
    n = len(codes)
    best: Repeats | None = None
    for period in range(2, n // MIN_REPEATS + 1):
        equal = codes[:-period] == codes[period:]
        if not equal.any():
            continue
        run_start, run_length = _longest_run(equal)
        count = (run_length + period) // period
        if count < MIN_REPEATS:
            continue
        candidate = Repeats(run_start, period, count)
        if best is None or candidate.covered > best.covered:
            best = candidate
    return best


def _longest_run(flags: np.ndarray) -> tuple[int, int]:
    """Start and length of the longest run of True."""
    padded = np.concatenate(([0], flags.astype(np.int8), [0]))
    changes = np.flatnonzero(np.diff(padded))
    starts, ends = changes[::2], changes[1::2]
    lengths = ends - starts
    best = int(np.argmax(lengths))
    return int(starts[best]), int(lengths[best])


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
