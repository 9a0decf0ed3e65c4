"""The layer structure of a graph: its repeated blocks of ops, and the units it is cut into.

Each op gets a signature (type, attributes, input and output shapes and roles). In
topological order, a transformer's layers repeat the same run of signatures. The period
with the longest run of `sig[i] == sig[i + p]` marks the layer length `p`
(`find_repeats`); the same search in what is left before and after it finds further
blocks, such as an encoder-decoder's two stacks (`find_blocks`). The search ties the ops
at one position of every layer of a block to one choice; the pipeline search cuts stages
between *units* (`find_units`): the prefix, each repeated layer and the suffix, or chunks
of equal FLOPs when the blocks cover less than half the graph. Plans record the units,
so readers never search for layers again.
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
MAX_BLOCKS = 4  # repeated blocks looked for (an encoder-decoder has two)
# a further block covers at least this share of the graph, in layers at least half as long
# as the first's (so a run of a few small ops is no stack)
MIN_BLOCK_SHARE = 0.25

@dataclass(frozen=True)
class Repeats:
    """A block of `count` >= MIN_REPEATS layers of `period` ops each."""

    start: int  # index (in graph.ops) of the first op of the first repeat
    period: int  # ops per layer
    count: int  # number of full repeats

    @property
    def covered(self) -> int:
        return self.period * self.count


def op_signature(node: OpNode, tensors: Mapping[str, TensorInfo]) -> str:
    """What makes two ops interchangeable for planning (names excluded), given the tensors
    (the importer compares op orders before the graph is built)."""
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
    return _best_run(_codes(graph.ops, graph.tensors), 0)


def find_blocks(graph: PlanningGraph) -> tuple[Repeats, ...]:
    """Every repeated block, in graph order: the longest run of repeated layers, then the
    longest in what is left before and after it, and so on (T5's encoder and decoder
    stacks), each further block covering at least MIN_BLOCK_SHARE of the graph in layers at
    least half as long as the first block's."""
    return blocks_of(graph.ops, graph.tensors)


def blocks_of(ops: Sequence[OpNode], tensors: Mapping[str, TensorInfo]) -> tuple[Repeats, ...]:
    """`find_blocks` of ops in this order."""
    codes = _codes(ops, tensors)
    first = _best_run(codes, 0)
    if first is None:
        return ()
    blocks, segments = [first], [(0, first.start), (first.start + first.covered, len(codes))]
    while len(blocks) < MAX_BLOCKS:
        found = [(run, (lo, hi)) for lo, hi in segments
                 if (run := _best_run(codes[lo:hi], lo)) is not None
                 and run.covered >= MIN_BLOCK_SHARE * len(codes)
                 and 2 * run.period >= first.period]
        if not found:
            break
        run, (lo, hi) = max(found, key=lambda item: item[0].covered)
        blocks.append(run)
        segments.remove((lo, hi))
        segments += [(lo, run.start), (run.start + run.covered, hi)]
    return tuple(sorted(blocks, key=lambda block: block.start))


def _codes(ops: Sequence[OpNode], tensors: Mapping[str, TensorInfo]) -> np.ndarray:
    signatures: dict[str, int] = {}
    return np.array([signatures.setdefault(op_signature(n, tensors), len(signatures))
                     for n in ops], dtype=np.int64)


def _best_run(codes: np.ndarray, offset: int) -> Repeats | None:
    """The longest run of repeats in `codes` (ops from index `offset` of the graph)."""
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
        candidate = Repeats(offset + run_start, period, count)
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


def find_units(graph: PlanningGraph, blocks: Sequence[Repeats]) -> Units:
    """Prefix, one unit per repeated layer of every block (`find_blocks(graph)`), suffix;
    the ops between two blocks (an encoder's final norm, a decoder's embedding) join the
    next block's first layer, so the layer units are consecutive. FLOP-equal chunks when
    the blocks cover less than half the graph."""
    n = len(graph.ops)
    if blocks and sum(block.covered for block in blocks) >= MIN_LAYER_SHARE * n:
        bounds, names = [0], []
        if blocks[0].start > 0:
            bounds.append(blocks[0].start)
            names.append("prefix")
        first_layer = len(names)
        for block in blocks:
            for layer in range(block.count):
                bounds.append(block.start + (layer + 1) * block.period)
                names.append(f"layer {len(names) - first_layer}")
        layers = tuple(range(first_layer, len(names)))
        if bounds[-1] < n:
            bounds.append(n)
            names.append("suffix")
        return Units(tuple(bounds), tuple(names), layers)
    flops = np.array([max(node.flops, 1.0) for node in graph.ops])
    chunks = min(n, MAX_PLAIN_UNITS)
    edges = np.searchsorted(np.cumsum(flops), np.linspace(0, flops.sum(), chunks + 1)[1:-1])
    bounds = sorted({0, n, *(int(e) + 1 for e in edges if 0 < int(e) + 1 < n)})
    return Units(tuple(bounds), tuple(f"part {k}" for k in range(len(bounds) - 1)), ())
