"""What a planning graph is, computed once: labels, gradients, weight roots, layers, batch.

Every layer above needs the same few facts about a graph: each op's labelling (its
sharding rule), which tensors carry gradients, which are computed from weights alone,
which op places each weight or input, the repeated layers and the units they cut the op
sequence into, and which label of each op carries the batch. `GraphAnalysis.of(graph)`
computes them once; the search, the pricing and the plan builder take the analysis
instead of deriving any of them again. The executor uses the same object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from planner.graph import PlanningGraph
from planner.importer import rebind
from planner.kinds import AxisRole
from planner.layers import Repeats, Units, blocks_of_codes, find_units, signature_codes
from planner.ops import DimLabels, safe_labels, saves_of
from planner.ops.attention import AttentionCore, attention_cores
from planner.ops.saving import gradient_flows, weights_read_backward
from planner.sharding.batch import BatchTrace, sequence_labels, trace_batch
from planner.sharding.experts import Experts, find_experts
from planner.sharding.mesh import DeviceMesh

_REGIONS = "recompute regions"  # memo keys
_CORES = "attention cores"
_CODES = "signature codes"  # the ops' numbered signatures (`planner.layers.signature_codes`)


@dataclass(frozen=True)
class GraphAnalysis:
    graph: PlanningGraph
    labels: Mapping[str, DimLabels | None]  # op -> labelling; None: no sharding rule
    needs_grad: Mapping[str, bool]  # tensor -> a gradient flows back to it
    #: ops a gradient flows back through (`planner.ops.saving.gradient_flows`), which
    #: the kernel model, the pricing and the floors ask of every op
    differentiated: frozenset[str]
    weight_roots: Mapping[str, frozenset[str]]  # tensor computed from weights alone -> them
    first_consumers: Mapping[str, tuple[str, int]]  # input/weight/buffer -> (op, slot)
    blocks: tuple[Repeats, ...]  # the repeated blocks of layers, in graph order
    units: Units
    batch_labels: Mapping[str, frozenset[str]]  # op -> the labels carrying the batch
    constant_ops: frozenset[str]  # ops computed from constants and buffers alone
    #: the first op that reads rows of the batch against other rows of it
    #: (`planner.sharding.batch.BatchTrace.rows_meet`), where micro-batches would change
    #: the model; None where rows stay apart up to the outputs
    rows_meet: str | None = None
    #: graph output -> its dims that carry the batch (the trace's), where some do
    output_batch_dims: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: op -> the labels carrying the sequence (`planner.sharding.batch.sequence_labels`):
    #: what the context-parallel axis may split
    sequence_labels: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: the stacked experts and the labels carrying them (`planner.sharding.experts`): what
    #: the expert-parallel axis splits inside expert layers
    experts: Experts = field(default_factory=lambda: Experts({}))
    # Derivations of choices on this graph, kept by `planner.cost.oplevel.priced_choice` so
    # that the search and the plan builder derive and price each choice once.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Pickled (to the search's worker processes) without the kept derivations."""
        return {**self.__dict__, "memo": {}}

    def rows_dim(self, output: str) -> int:
        """The dim of graph output `output` whose rows a loss's targets follow, and are cut
        along into micro-batches: the one dim that carries the batch (dim 1 of a
        sequence-first `[seq, batch, vocab]`), else dim 0."""
        dims = self.output_batch_dims.get(output, ())
        return dims[0] if len(dims) == 1 else 0

    def attention_cores(self) -> tuple[AttentionCore, ...]:
        """The graph's attention cores (`planner.ops.attention`), found once: the kernel
        model and the recompute regions both read them."""
        found = self.memo.get(_CORES)
        if found is None:
            found = self.memo[_CORES] = tuple(attention_cores(self.graph))
        return found

    def recompute_regions(self) -> np.ndarray:
        """Per op (by index), the region a recomputation re-runs whole: its unit (full
        recompute re-runs units), split at the op range of each attention core, q kᵀ to
        · v (selective recompute re-runs those). Numbered from 0 in op order."""
        found = self.memo.get(_REGIONS)
        if found is None:
            ops = self.graph.ops
            index = {node.name: k for k, node in enumerate(ops)}
            inside = np.full(len(ops), -1, dtype=np.int64)
            for number, core in enumerate(self.attention_cores()):
                inside[index[core.first]:index[core.last] + 1] = number
            keys = list(zip(self.units.unit_of_ops().tolist(), inside.tolist(), strict=True))
            numbers: dict[tuple[int, int], int] = {}
            found = np.array([numbers.setdefault(key, len(numbers)) for key in keys],
                             dtype=np.int64)
            self.memo[_REGIONS] = found
        return found

    @classmethod
    def of(cls, graph: PlanningGraph, like: GraphAnalysis | None = None) -> GraphAnalysis:
        """The analysis of `graph`; `like`, another binding's analysis of the same model,
        lends the facts that depend on the wiring alone where the two graphs are wired
        alike (`wired_alike`): which tensors carry gradients (and ops pass them), which
        come from weights alone, which op places each leaf, which ops compute constants;
        and its repeated
        blocks where the ops' signatures number alike. The facts that read shapes
        (labels, the batch's labels) are found again."""
        labels = {node.name: safe_labels(node, graph.tensors) for node in graph.ops}
        codes = signature_codes(graph.ops, graph.tensors)
        if like is not None and np.array_equal(codes, like.memo.get(_CODES, ())):
            blocks = like.blocks  # the blocks are the codes' alone
        else:
            blocks = blocks_of_codes(codes)
        if like is not None and wired_alike(like.graph, graph):
            needs_grad, roots = like.needs_grad, like.weight_roots
            placed, constant = like.first_consumers, like.constant_ops
            differentiated = like.differentiated
        else:
            needs_grad, roots = needs_grad_map(graph), weight_roots_map(graph)
            placed, constant = first_consumers(graph), constant_ops_of(graph)
            differentiated = frozenset(node.name for node in graph.ops
                                       if gradient_flows(node, needs_grad))
        trace = _batch_trace(graph, labels)
        return cls(
            graph=graph, labels=labels, needs_grad=needs_grad, differentiated=differentiated,
            weight_roots=roots, first_consumers=placed,
            blocks=blocks, units=find_units(graph, blocks),
            batch_labels={} if trace is None else {
                name: frozenset(label for label, _ in strategy.assignment)
                for name, strategy in trace.strategies.items()},
            constant_ops=constant,
            rows_meet=None if trace is None else trace.rows_meet,
            output_batch_dims={} if trace is None else {
                name: tuple(sorted(trace.carried[name])) for name in graph.outputs
                if trace.carried.get(name)},
            sequence_labels=sequence_labels(graph, labels),
            experts=find_experts(graph, labels, roots),
            memo={_CODES: codes},
        )


def wired_alike(first: PlanningGraph, second: PlanningGraph) -> bool:
    """Whether two graphs have the same ops in the same order reading and writing the
    same tensors, each of the same kind and element type: what gradients, weight roots,
    first consumers and constant ops depend on (not shapes). Two bindings of one model
    are, unless folding at one size left other ops (a shape computed from the batch)."""
    if len(first.ops) != len(second.ops) or len(first.tensors) != len(second.tensors):
        return False
    if any(a.name != b.name or a.inputs != b.inputs or a.outputs != b.outputs
           for a, b in zip(first.ops, second.ops, strict=True)):
        return False
    others = second.tensors
    for name, info in first.tensors.items():
        other = others.get(name)
        if other is None or other.kind != info.kind or other.dtype != info.dtype:
            return False
    return True


def constant_ops_of(graph: PlanningGraph) -> frozenset[str]:
    """Ops that read no input and no parameter, even upstream: rotary cos/sin tables
    computed from `inv_freq`, position ranges. Every rank can compute them whole, and a
    replicated table is sliced to any layout a reader wants at no cost, so the search
    runs them replicated: a choice for them would only couple their readers (the q and
    k rotations of every tied layer), which keeps the elimination DP from reducing."""
    constant = {t.name for t in graph.tensors.values() if t.kind in ("constant", "buffer")}
    found: set[str] = set()
    for node in graph.ops:
        if all(not name or name in constant for name in node.inputs):
            found.add(node.name)
            constant.update(o for o in node.outputs if o)
    return frozenset(found)


def needs_grad_map(graph: PlanningGraph) -> dict[str, bool]:
    """Float tensors that depend on a parameter carry gradients in the backward pass."""
    flag = {t.name: t.kind == "parameter" for t in graph.tensors.values()}
    for node in graph.ops:
        needs = any(flag.get(i, False) for i in node.inputs if i)
        for output in node.outputs:
            if output:
                flag[output] = needs and graph.tensors[output].is_float
    return flag


def weight_roots_map(graph: PlanningGraph) -> dict[str, frozenset[str]]:
    """Tensors computed from parameters alone (a tied head's transposed table), by root.

    Their partial gradients need no reduction of their own: backward ops are linear in the
    incoming gradient, so summing once at the parameters gives the same result. Tensors
    the constant ops compute (`constant_ops_of`: the same on every device) count as
    constants, so T5's relative position bias, a parameter gathered at bucket indices
    computed from shapes, is reduced as its [buckets, heads] table rather than as the
    [1, heads, seq, seq] bias every layer reads.
    """
    roots: dict[str, frozenset[str]] = {
        t.name: frozenset({t.name}) for t in graph.tensors.values() if t.kind == "parameter"
    }
    constant = {t.name for t in graph.tensors.values() if t.kind in ("constant", "buffer")}
    computed = constant_ops_of(graph)
    constant.update(o for node in graph.ops if node.name in computed for o in node.outputs if o)
    for node in graph.ops:
        sources = [i for i in node.inputs if i]
        if not sources or not all(i in roots or i in constant for i in sources):
            continue
        found = frozenset().union(*(roots.get(i, frozenset()) for i in sources))
        if not found:
            continue
        for output in node.outputs:
            if output and graph.tensors[output].is_float:
                roots[output] = found
    return roots


def first_consumers(graph: PlanningGraph) -> dict[str, tuple[str, int]]:
    """For inputs, weights and buffers: the (op, input slot) that places them (they are
    laid out as their first consumer needs them)."""
    owner: dict[str, tuple[str, int]] = {}
    for node in graph.ops:
        for slot, name in enumerate(node.inputs):
            if name and graph.tensors[name].producer is None and name not in owner:
                owner[name] = (node.name, slot)
    return owner


def _batch_trace(graph: PlanningGraph,
                 labels: Mapping[str, DimLabels | None]) -> BatchTrace | None:
    """The batch split traced at the whole batch (so a label carries the batch only when
    every dim it labels holds the whole batch): per op the labels carrying it, where rows
    meet, which output dims hold it. None without a batch."""
    if not graph.batch:
        return None
    return trace_batch(graph, DeviceMesh.build({AxisRole.DATA: graph.batch}, 1), labels)


class Analyses:
    """A graph's analysis at its own batch and at any other: the joint search and the
    plan builder price one micro-batch, so they need the graph re-bound at that size."""

    def __init__(self, analysis: GraphAnalysis) -> None:
        self.root = analysis
        graph = analysis.graph
        self._at: dict[int, GraphAnalysis] = {graph.batch: analysis} if graph.batch else {}

    def at(self, batch: int) -> GraphAnalysis:
        found = self._at.get(batch)
        if found is None:
            found = self._at[batch] = GraphAnalysis.of(rebind(self.root.graph, batch=batch),
                                                       like=self.root)
        return found


def backward_read_weights(analysis: GraphAnalysis) -> frozenset[str]:
    """The parameters the backward pass reads (`planner.ops.saving.weights_read_backward`
    under each op's record), once per graph: ZeRO 3 gathers only these again before it."""
    key = "backward read weights"
    found = analysis.memo.get(key)
    if found is None:
        graph = analysis.graph
        found = analysis.memo[key] = weights_read_backward(
            graph, analysis.needs_grad, {node.name: saves_of(node) for node in graph.ops},
            analysis.differentiated)
    return found
