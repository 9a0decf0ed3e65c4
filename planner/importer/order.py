"""One op order for a graph, whatever order its exporter wrote the nodes in.

Layers are found as a repeating run of op signatures in graph order
(`planner.layers.find_repeats`), so the order must not depend on where an exporter
happened to emit an op. Exporters differ in one way that matters: ops that read no
trained parameter — the attention mask, position ids, rotary cos/sin tables, their
unsqueezes — are shared by every layer, and torch's dynamo exporter emits them where the
first layer first uses them, inside layer 0, so that layer no longer matches the others
(a 4-layer LLaMA showed 3 layers). `canonical_order` puts every such *context* op
first, before any op that depends on a parameter (position tables aside), when that makes
more of the graph repeat (the file's order is kept otherwise: each layer computing its
own copy of them repeats as it is).
`sort_nodes` puts a file's nodes in topological order (ONNX requires it, not every
writer obeys) and refuses a cycle, before shape inference reads them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

import onnx

from planner.errors import ModelError
from planner.graph import OpNode, TensorInfo
from planner.layers import blocks_of_codes, numbered, op_signature


def sort_nodes(model: onnx.ModelProto, model_name: str) -> None:
    """Reorder `model`'s nodes in place so producers come first (file order otherwise)."""
    nodes = list(model.graph.node)
    order = _kahn(nodes, [list(n.input) for n in nodes], [list(n.output) for n in nodes],
                  lambda index: (index,), model_name)
    if order != list(range(len(nodes))):
        del model.graph.node[:]
        model.graph.node.extend(nodes[i] for i in order)


def canonical_order(ops: list[OpNode], tensors: Mapping[str, TensorInfo],
                    model_name: str) -> list[OpNode]:
    """`ops` (topologically sorted, in file order) with the context ops first, where that
    makes more of the graph repeat; else as they are, which is where the model itself
    computes each op (a traced module's pipeline stages run it so). Context: no parameter
    upstream, or a position table looked up there: a Gather of a parameter at indices
    computed from shapes alone (T5's relative attention bias, which the first layer of
    each stack computes and every layer adds; GPT-2's position embeddings)."""
    producer = {out: index for index, node in enumerate(ops) for out in node.outputs if out}
    weighted = [False] * len(ops)
    from_input = [False] * len(ops)

    def upstream(name: str, flags: list[bool], kind: str) -> bool:
        return tensors[name].kind == kind or (name in producer and flags[producer[name]])

    def rank(index: int) -> tuple[int, int]:  # called once every producer of `index` is placed
        node = ops[index]
        names = [t for t in node.inputs if t]
        from_input[index] = any(upstream(t, from_input, "input") for t in names)
        reads_weight = any(t and tensors[t].kind == "parameter" for t in node.inputs)
        position_table = (node.op_type == "Gather" and len(node.inputs) == 2
                          and tensors[node.inputs[0]].kind == "parameter"
                          and not upstream(node.inputs[1], from_input, "input")
                          and not upstream(node.inputs[1], weighted, "parameter"))
        weighted[index] = (reads_weight and not position_table) or any(
            weighted[producer[t]] for t in names if t in producer)
        return int(weighted[index]), index

    if _file_order_first(ops, producer, rank):
        return ops
    order = _kahn(ops, [list(n.inputs) for n in ops], [list(n.outputs) for n in ops], rank,
                  model_name)
    hoisted = [ops[i] for i in order]
    if hoisted == ops:
        return ops
    signed = {node.name: op_signature(node, tensors) for node in ops}  # once for both orders
    if _covered(hoisted, signed) <= _covered(ops, signed):
        return ops  # the file's order repeats as well: where the model computes each op
    return hoisted


def _file_order_first(ops: Sequence[OpNode], producer: Mapping[str, int],
                      rank: Callable[[int], tuple[int, int]]) -> bool:
    """Whether hoisting would keep the file's order: the ops are in topological order
    and no context op comes after an op that is not (ranks non-decreasing). Kahn's
    algorithm, taking the least rank among the ready ops, then takes each next op in
    the file's order, which is always ready and has the least rank; so the heap's walk
    over a large graph is spared. `rank` is asked in the file's order, each op after
    its producers, as Kahn's algorithm asks it."""
    previous = 0
    for index, node in enumerate(ops):
        if any(producer.get(name, -1) >= index for name in node.inputs if name):
            return False  # not topological here: leave it to Kahn's algorithm
        weighted, _ = rank(index)
        if weighted < previous:
            return False
        previous = weighted
    return True


def _covered(ops: list[OpNode], signed: Mapping[str, tuple]) -> int:
    """How many of `ops`, in this order, fall in repeated blocks (`blocks_of_codes`)."""
    return sum(block.covered for block in blocks_of_codes(numbered(signed[n.name] for n in ops)))


def _kahn(items: Sequence[OpNode | onnx.NodeProto], inputs: list[list[str]],
          outputs: list[list[str]], rank: Callable[[int], tuple[int, ...]],
          model_name: str) -> list[int]:
    """Kahn's algorithm: of the items whose producers are all placed, the lowest `rank`
    next. Raises ModelError naming a node on a cycle."""
    producer = {out: index for index, outs in enumerate(outputs) for out in outs if out}
    waiting = [0] * len(items)
    readers: list[list[int]] = [[] for _ in items]
    for index, names in enumerate(inputs):
        sources = {producer[t] for t in names if t in producer}
        waiting[index] = len(sources)
        for source in sources:
            readers[source].append(index)
    ready = [(rank(i), i) for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(index)
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (rank(reader), reader))
    if len(order) < len(items):
        placed = set(order)
        stuck = next(i for i in range(len(items)) if i not in placed)
        unmade = next(t for t in inputs[stuck] if t in producer and producer[t] not in placed)
        raise ModelError(
            f"{model_name}: node {items[stuck].name} reads {unmade}, which cannot be computed "
            "before it (the graph has a cycle); export the model again")
    return order
