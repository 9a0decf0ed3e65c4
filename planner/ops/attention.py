"""Attention cores in a graph: softmax(q kᵀ · scale + mask) · v, whatever the exporter
spelled between the two GEMMs.

Found once per graph from each Softmax: the q kᵀ MatMul, the scale and mask ops before the
softmax, the dropout, casts and the NaN guard the dynamo exporter writes after it, and the
· v MatMul, provided nothing else reads the tensors inside (the s² scores and
probabilities). The kernel model prices a core as one flash kernel or as its ops
(`planner.cost.kernels`); selective recompute re-runs exactly the cores (Korthikanti et
al. 2022, §4.2); and reads that share one gradient reduction never straddle a core's
boundary (`planner.sharding.derive.shared_read_key`), since a recomputed core re-runs its own
reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.graph import OpNode, PlanningGraph

#: Ops between q kᵀ and the softmax (scale, mask), and between the softmax and ·v
#: (dropout, casts, the NaN guard the dynamo exporter writes).
_BEFORE_SOFTMAX = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast"})
_AFTER_SOFTMAX = frozenset({"Dropout", "Cast", "Where", "Mul", "Div"})
_GUARDS = frozenset({"IsNaN", "IsInf", "Not"})
_CHAIN_LIMIT = 8


@dataclass(frozen=True)
class AttentionCore:
    """softmax(q kᵀ ...) v found in the graph: its two GEMMs, the ops between them, and
    the tensors that live only inside it (the s² scores and probabilities)."""

    first: str  # q kᵀ
    last: str  # · v
    between: tuple[str, ...]
    internal: frozenset[str]
    output_transpose: str | None  # a Transpose of the result a flash kernel writes directly


def attention_cores(graph: PlanningGraph) -> list[AttentionCore]:
    """Every q kᵀ → (scale, mask) → softmax → (dropout) → · v chain whose inner tensors
    nothing else reads."""
    found = []
    index = {node.name: k for k, node in enumerate(graph.ops)}
    for node in graph.ops:
        if node.op_type == "Softmax":
            core = _core_around(graph, node, index)
            if core is not None:
                found.append(core)
    return found


def _core_around(graph: PlanningGraph, softmax: OpNode,
                 index: Mapping[str, int]) -> AttentionCore | None:
    tensors = graph.tensors
    between = [softmax.name]
    name = softmax.inputs[0]
    first = None
    for _ in range(_CHAIN_LIMIT):
        producer = tensors[name].producer
        if producer is None:
            return None
        node = graph.op(producer)
        if node.op_type == "MatMul":
            if all(i and tensors[i].kind == "activation" for i in node.inputs):
                first = node
            break
        if node.op_type not in _BEFORE_SOFTMAX:
            return None
        between.append(node.name)
        name = _data_input(node, graph)
    if first is None:
        return None
    last = None
    name = softmax.outputs[0]
    for _ in range(_CHAIN_LIMIT):
        consumers = [graph.op(c) for c in tensors[name].consumers]
        readers = [c for c in consumers if c.op_type == "MatMul" and c.inputs[0] == name]
        if readers and len(consumers) == 1:
            last = readers[0]
            break
        main = [c for c in consumers if c.op_type in _AFTER_SOFTMAX
                and c.outputs[0] and tensors[c.outputs[0]].shape == tensors[name].shape
                and tensors[c.outputs[0]].is_float]
        guards = [c for c in consumers if c.op_type in _GUARDS]
        if len(main) != 1 or len(main) + len(guards) != len(consumers):
            return None
        between += [g.name for g in guards] + [main[0].name]
        name = main[0].outputs[0]
    if last is None:
        return None
    members = {first.name, *between}
    internal = frozenset(o for op in members for o in graph.op(op).outputs if o)
    readers_ok = {*members, last.name}
    if any(c not in readers_ok for t in internal for c in tensors[t].consumers):
        return None
    if any(t in graph.outputs for t in internal):
        return None
    after = tensors[last.outputs[0]].consumers
    transpose = after[0] if len(after) == 1 and graph.op(after[0]).op_type == "Transpose" \
        else None
    ordered = tuple(sorted(set(between), key=index.__getitem__))
    return AttentionCore(first.name, last.name, ordered, internal, transpose)


def _data_input(node: OpNode, graph: PlanningGraph) -> str:
    """The input of a scale or mask op that carries the scores (shaped like its output)."""
    shape = graph.tensors[node.outputs[0]].shape
    for name in node.inputs:
        if name and graph.tensors[name].is_float and graph.tensors[name].shape == shape:
            return name
    return node.inputs[0]
