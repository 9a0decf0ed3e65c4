"""Context parallelism on a mesh's "cp" axis: which assignments of an op use it as context
parallelism, the head labels that make attention Ulysses, and which of the two forms a
choice runs (what the plan records as `parallel.cp_kind`).

The axis splits exactly the sequence (`planner.sharding.batch.sequence_labels`); inside an
attention core it splits either the query positions (ring attention: K and V are gathered
over "cp", which `planner.sharding.derive` lists as all-gathers forward and reduce-scatters
of their gradients backward, and `planner.cost.units` prices as overlapped with the core)
or the heads (Ulysses: all-to-alls re-partition q, k, v before the core and the output
after it).
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.kinds import AxisRole, ContextKind
from planner.ops import record_for
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.strategy import OpStrategy


def context_allows(assigned: Mapping[str, tuple[str, ...]], sequence: frozenset[str],
                   heads: frozenset[str], kind: ContextKind | None = None,
                   may_stay_whole: bool = True) -> bool:
    """Whether an op's assignment uses the context axis as context parallelism means it:
    an op that carries the sequence puts "cp" on one of its sequence labels alone, or (an
    attention core's op) on a head label alone, Ulysses' re-partitioning, or, where it
    `may_stay_whole` (no GEMM: `whole_allowed`), nowhere (it runs whole on every context
    rank, as a reshape or a tile feeding a gather may); an op that does
    not carry the sequence is free (a mask built from whole positions may be cut any
    way). A pinned `kind` keeps an attention core's op to its form: the query positions
    for RING, the heads for ULYSSES."""
    on = [label for label, axes in assigned.items() if AxisRole.CONTEXT in axes]
    if not on:
        return not sequence or (may_stay_whole and not (heads and kind is not None))
    if not sequence:
        return True
    allowed = sequence | heads
    if heads and kind is ContextKind.RING:
        allowed = sequence
    elif heads and kind is ContextKind.ULYSSES:
        allowed = heads
    return len(on) == 1 and assigned[on[0]] == (str(AxisRole.CONTEXT),) and on[0] in allowed


def head_labels(analysis: GraphAnalysis) -> dict[str, frozenset[str]]:
    """Per attention-core op, its head labels: its output's leading labels (all but the
    query and key positions) that do not carry the batch. Splitting them over "cp" is
    Ulysses: the sequence-split q, k, v become head-split by an all-to-all before the core
    and the output goes back by another (`planner.sharding.redistribute` derives both)."""
    graph = analysis.graph
    found: dict[str, frozenset[str]] = {}
    for core in analysis.attention_cores():
        for op in (core.first, *core.between, core.last):
            labels = analysis.labels.get(op)
            if labels is None or not labels.outputs or labels.outputs[0] is None:
                continue
            batch = analysis.batch_labels.get(op, frozenset())
            found[op] = frozenset(label for label in labels.outputs[0][:-2]
                                  if label not in batch) if graph.op(op).outputs else frozenset()
    return found


def whole_allowed(analysis: GraphAnalysis, op: str) -> bool:
    """Whether an op carrying the sequence may run whole on every context rank: any op but
    a GEMM (the work context parallelism is there to split)."""
    node = analysis.graph.op(op)
    record = record_for(node.op_type, node.domain)
    return record is None or not record.matrix


def context_kind(analysis: GraphAnalysis,
                 strategies: Mapping[str, OpStrategy]) -> ContextKind | None:
    """How the attention cores of a choice run over "cp": ULYSSES when a core's op splits
    its heads over it, RING when one splits the positions over it; None when no core
    splits over "cp" (or the graph has none)."""
    heads = head_labels(analysis)
    found = None
    for op, labels in heads.items():
        strategy = strategies.get(op)
        if strategy is None:
            continue
        on = [label for label, axes in strategy.assignment if AxisRole.CONTEXT in axes]
        if any(label in labels for label in on):
            return ContextKind.ULYSSES
        if on:
            found = ContextKind.RING
    return found
