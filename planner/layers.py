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
from collections.abc import Iterable, Mapping, Sequence
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


def op_signature(node: OpNode, tensors: Mapping[str, TensorInfo]) -> tuple:
    """What makes two ops interchangeable for planning (names excluded), given the tensors
    (the importer compares op orders before the graph is built): a tuple, which hashes and
    compares faster than the text of the same parts (a large graph signs every op once
    per binding)."""
    attrs = tuple(sorted((k, repr(v)) for k, v in node.attrs.items())) if node.attrs else ()
    parts: list[object] = [node.domain, node.op_type, attrs]
    for name in node.inputs:
        if not name:
            parts.append(None)
            continue
        info = tensors[name]
        value = None if info.value is None else hashlib.sha1(
            np.ascontiguousarray(info.value).tobytes()).hexdigest()
        parts.append((info.kind, info.dtype, info.shape, value))
    parts.extend(("out", tensors[name].shape if name else None) for name in node.outputs)
    return tuple(parts)


def find_repeats(graph: PlanningGraph) -> Repeats | None:
    """The longest run of repeated layers, or None when no block repeats."""
    return _best_run(signature_codes(graph.ops, graph.tensors), 0)


def find_blocks(graph: PlanningGraph) -> tuple[Repeats, ...]:
    """Every repeated block, in graph order: the longest run of repeated layers, then the
    longest in what is left before and after it, and so on (T5's encoder and decoder
    stacks), each further block covering at least MIN_BLOCK_SHARE of the graph in layers at
    least half as long as the first block's."""
    return blocks_of(graph.ops, graph.tensors)


def blocks_of(ops: Sequence[OpNode], tensors: Mapping[str, TensorInfo]) -> tuple[Repeats, ...]:
    """`find_blocks` of ops in this order."""
    return blocks_of_codes(signature_codes(ops, tensors))


def blocks_of_codes(codes: np.ndarray) -> tuple[Repeats, ...]:
    """`find_blocks` of ops whose signatures are numbered `codes` (`signature_codes`):
    the blocks depend on the codes alone."""
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


def signature_codes(ops: Sequence[OpNode], tensors: Mapping[str, TensorInfo]) -> np.ndarray:
    """Each op's signature (`op_signature`) numbered in order of first appearance: two
    op sequences with equal codes have the same repeated blocks."""
    return numbered([op_signature(n, tensors) for n in ops])


def numbered(signatures: Iterable[tuple]) -> np.ndarray:
    """Signatures numbered in order of first appearance (`signature_codes` of ops already
    signed: the importer compares two orders of one graph's ops, signing each op once)."""
    first: dict[tuple, int] = {}
    return np.array([first.setdefault(s, len(first)) for s in signatures], dtype=np.int64)


def _best_run(codes: np.ndarray, offset: int) -> Repeats | None:
    """The longest run of repeats in `codes` (ops from index `offset` of the graph): the
    period p (smallest on ties) whose longest p-periodic stretch (first on ties) holds the
    most ops in whole layers.

    Every such stretch of at least two layers is a maximal repetition ("run") of a period
    q dividing p (Fine and Wilf), and a string of n symbols has fewer than n runs, their
    exponents summing to O(n) (Bannai et al., "The Runs Theorem", 2017). So the runs and
    their multiples are enumerated instead of comparing `codes` with itself at each of the
    n/2 shifts, which was quadratic (200,000 ops: minutes)."""
    longest: dict[int, tuple[int, int]] = {}  # period: (-length, start) of its longest stretch
    for start, end, period in _runs(codes):
        length = end - start
        for multiple in range(period, length // 2 + 1, period):
            if multiple >= 2 and (-length, start) < longest.get(multiple, (1, 0)):
                longest[multiple] = (-length, start)
    best: Repeats | None = None
    for period in sorted(longest):
        length, start = -longest[period][0], longest[period][1]
        candidate = Repeats(offset + start, period, length // period)
        if best is None or candidate.covered > best.covered:
            best = candidate
    return best


def _runs(codes: np.ndarray) -> set[tuple[int, int, int]]:
    """Every maximal repetition (start, end, smallest period) of at least two periods: for
    both orders of the symbols, the longest Lyndon word at each position extended both
    ways by longest common extensions (the Runs theorem's construction)."""
    n = len(codes)
    if n < 4:
        return set()
    symbols = np.unique(codes, return_inverse=True)[1].astype(np.int64).reshape(-1)
    ahead = _Extensions(symbols)
    behind = _Extensions(symbols[::-1])
    found: set[tuple[int, int, int]] = set()
    for order in (symbols, symbols.max() - symbols):
        rank = ahead.rank if order is symbols else _suffix_ranks(order)
        starts = np.arange(n)
        ends = _next_smaller(rank)
        right = ahead.common(starts, ends)
        left = behind.common(n - starts, n - ends)
        periods = ends - starts
        square = left + right >= periods
        for start, end, period in zip((starts - left)[square].tolist(),
                                      (ends + right)[square].tolist(),
                                      periods[square].tolist(), strict=True):
            found.add((start, end, period))
    return found


def _suffix_ranks(symbols: np.ndarray) -> np.ndarray:
    """Rank of every suffix among all suffixes (a suffix before its extensions), by prefix
    doubling."""
    n = len(symbols)
    rank = symbols + 1
    step = 1
    while True:
        following = np.zeros(n, dtype=np.int64)
        following[:max(n - step, 0)] = rank[step:]
        order = np.lexsort((following, rank))
        changed = (np.diff(rank[order]) != 0) | (np.diff(following[order]) != 0)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate(([1], 1 + np.cumsum(changed)))
        if rank[order[-1]] == n or step >= n:
            return rank - 1
        step *= 2


def _next_smaller(values: np.ndarray) -> np.ndarray:
    """For each position, the next position holding a smaller value (len when none): with
    suffix ranks, where the longest Lyndon word starting there ends."""
    n = len(values)
    result = np.full(n, n, dtype=np.int64)
    stack: list[int] = []
    listed = values.tolist()
    for position in range(n - 1, -1, -1):
        value = listed[position]
        while stack and listed[stack[-1]] > value:
            stack.pop()
        if stack:
            result[position] = stack[-1]
        stack.append(position)
    return result


class _Extensions:
    """Longest common extensions of a string's suffixes: suffix ranks, Kasai's longest
    common prefixes of neighbours, and a sparse table of their minima."""

    def __init__(self, symbols: np.ndarray) -> None:
        n = len(symbols)
        self.n = n
        self.rank = _suffix_ranks(symbols)
        order = np.empty(n, dtype=np.int64)
        order[self.rank] = np.arange(n)
        listed, ranks, suffixes = symbols.tolist(), self.rank.tolist(), order.tolist()
        common = [0] * n  # common[r]: with the suffix ranked r − 1
        shared = 0
        for position in range(n):
            r = ranks[position]
            if r == 0:
                shared = 0
                continue
            other = suffixes[r - 1]
            while (position + shared < n and other + shared < n
                   and listed[position + shared] == listed[other + shared]):
                shared += 1
            common[r] = shared
            shared = max(shared - 1, 0)
        self.minima = [np.asarray(common, dtype=np.int64)]
        width = 1
        while 2 * width <= n:
            previous = self.minima[-1]
            self.minima.append(np.minimum(previous[:-width], previous[width:]))
            width *= 2

    def common(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        """Length of the longest common prefix of the suffixes at `first` and `second`
        (distinct positions; n is the empty suffix)."""
        result = np.zeros(len(first), dtype=np.int64)
        inside = (first < self.n) & (second < self.n)
        a, b = self.rank[first[inside]], self.rank[second[inside]]
        low, high = np.minimum(a, b) + 1, np.maximum(a, b) + 1
        level = np.floor(np.log2(high - low)).astype(np.int64)
        values = np.empty(len(low), dtype=np.int64)
        for k in np.unique(level).tolist():
            at = level == k
            table = self.minima[k]
            values[at] = np.minimum(table[low[at]], table[high[at] - (1 << k)])
        result[inside] = values
        return result


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
    if graph.source_ops:
        bounds = _whole_source_ops(bounds, graph)
    return Units(tuple(bounds), tuple(f"part {k}" for k in range(len(bounds) - 1)), ())


def _whole_source_ops(bounds: Sequence[int], graph: PlanningGraph) -> list[int]:
    """`bounds` each moved back to the nearest cut that leaves every exported source op
    (`PlanningGraph.source_ops`: the ops one `aten.linear` became) in one unit, dropped
    where none is left before the previous bound: the module executor runs a source op
    on one stage, so a stage cut inside it names a tensor the module never computes."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.ops):
        source = graph.source_ops.get(node.name)
        if source is not None:
            last[source] = index
    # reach[i]: the last op of any source op begun at or before op i
    reach = np.maximum.accumulate(np.array(
        [last.get(graph.source_ops.get(node.name, ""), index)
         for index, node in enumerate(graph.ops)], dtype=np.int64))
    kept = [0]
    for bound in bounds[1:-1]:
        while bound > kept[-1] and reach[bound - 1] >= bound:
            bound -= 1
        if bound > kept[-1]:
            kept.append(bound)
    kept.append(bounds[-1])
    return kept
