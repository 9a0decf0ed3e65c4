"""The layer structure of a graph: its repeated block of ops, and the units it is cut into.

Each op gets a signature (type, attributes, input and output shapes and roles). In
topological order, a transformer's layers repeat the same run of signatures. The period
with the longest run of `sig[i] == sig[i + p]` marks the layer length `p`
(`find_repeats`). The search ties the ops at one position of every repeat to one choice;
the pipeline search cuts stages between *units* (`find_units`): the prefix, each repeated
layer and the suffix, or chunks of equal FLOPs when no repeated block covers half the
graph. Plans record the units, so readers never search for layers again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.graph import OpNode, PlanningGraph, TensorInfo

MIN_REPEATS = 2
MAX_PLAIN_UNITS = 32  # a graph without repeated layers is cut into this many FLOP-equal units
# Repeats covering less of the graph than this are not its layers (a run of small ops, or
# layers whose ops an exporter emitted in a different order each time): cut by FLOPs.
MIN_LAYER_SHARE = 0.5

@dataclass(frozen=True)
class Repeats:
    start: int  # index (in graph.ops) of the first op of the first repeat
    period: int  # ops per layer
    count: int  # number of full repeats

    @property
    def covered(self) -> int:
        return self.period * self.count


def op_signature(node: OpNode, graph: PlanningGraph | Mapping[str, TensorInfo]) -> str:
    """What makes two ops interchangeable for planning (names excluded); of a graph, or of
    ops whose tensors are given (`repeats_of`, before the graph is built)."""
    tensors = graph.tensors if isinstance(graph, PlanningGraph) else graph
    parts = [node.domain, node.op_type, repr(sorted((k, repr(v)) for k, v in node.attrs.items()))]
    for name in node.inputs:
        if not name:
            parts.append("-")
            continue
        info = tensors[name]
        value = "" if info.value is None else hashlib.sha1(
            np.ascontiguousarray(info.value).tobytes()).hexdigest()
        parts.append(f"{info.kind}:{info.dtype}:{info.shape}:{value}")
    for name in node.outputs:
        parts.append(f"out:{tensors[name].shape}" if name else "out:-")
    return "|".join(parts)


def find_repeats(graph: PlanningGraph) -> Repeats | None:
    """The longest run of repeated layers, or None when no block repeats."""
    return repeats_of(graph.ops, graph.tensors)


def repeats_of(ops: Sequence[OpNode], tensors: Mapping[str, TensorInfo]) -> Repeats | None:
    """`find_repeats` of ops in this order (the importer compares two orders with it)."""
    signatures: dict[str, int] = {}
    codes = np.array([signatures.setdefault(op_signature(n, tensors), len(signatures))
                      for n in ops], dtype=np.int64)
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


@dataclass(frozen=True)
class Units:
    """Unit k covers graph.ops[bounds[k]:bounds[k + 1]]."""

    bounds: tuple[int, ...]
    names: tuple[str, ...]
    layer_units: tuple[int, ...]  # indices of the repeated-layer units

    @property
    def count(self) -> int:
        return len(self.names)

    def unit_of_ops(self) -> np.ndarray:
        """Unit index of every op."""
        sizes = np.diff(np.asarray(self.bounds))
        return np.repeat(np.arange(self.count), sizes)


def find_units(graph: PlanningGraph, repeats: Repeats | None) -> Units:
    """Prefix, one unit per repeated layer (of `find_repeats(graph)`), suffix; FLOP-equal
    chunks when no repeated block covers at least half the graph."""
    n = len(graph.ops)
    if repeats is not None and repeats.count >= 2 and repeats.covered >= MIN_LAYER_SHARE * n:
        bounds, names = [0], []
        if repeats.start > 0:
            bounds.append(repeats.start)
            names.append("prefix")
        first_layer = len(names)
        for layer in range(repeats.count):
            bounds.append(repeats.start + (layer + 1) * repeats.period)
            names.append(f"layer {layer}")
        layers = tuple(range(first_layer, first_layer + repeats.count))
        if bounds[-1] < n:
            bounds.append(n)
            names.append("suffix")
        return Units(tuple(bounds), tuple(names), layers)
    flops = np.array([max(node.flops, 1.0) for node in graph.ops])
    chunks = min(n, MAX_PLAIN_UNITS)
    edges = np.searchsorted(np.cumsum(flops), np.linspace(0, flops.sum(), chunks + 1)[1:-1])
    bounds = sorted({0, n, *(int(e) + 1 for e in edges if 0 < int(e) + 1 < n)})
    return Units(tuple(bounds), tuple(f"part {k}" for k in range(len(bounds) - 1)), ())
