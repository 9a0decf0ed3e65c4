"""Runs of local ops compiled into one Python function each, so they skip the interpreter.

`fx.Interpreter` costs about 25 µs of Python per node and pass (argument mapping, the
per-node dispatch of `executor.module.run`, bookkeeping) on top of the op itself; on a GPU
that host time, not the kernels, set the executor's step (docs/benchmarks.md, "On a
GPU"). The ops `executor.module.local` runs on plain local tensors need none of it: a run
of consecutive such ops is cut out of the trace into a graph of its own and compiled by
FX's code generator, which calls the ops one after another as eager code does. The
interpreter still runs every op that needs it: DTensor ops, sizes (kept global and local),
dropout and attention (their draws and masks) and weight reads; no region crosses the
edge of a recompute segment (the segment is checkpointed as one call, its inside compiled
alike).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from executor.module.kernels import runnable
from executor.module.local import is_size

_EXCLUDED = frozenset({
    torch.ops.aten.native_dropout.default,  # its mask is drawn by executor.dropout
    torch.ops.aten.scaled_dot_product_attention.default,  # masks, dropout
})
#: A shorter run gains less than its call costs.
MIN_REGION_NODES = 2


@dataclass(frozen=True)
class Region:
    """Consecutive local ops run as one compiled call: what it reads from outside, what
    later nodes read of it, and the call."""

    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    call: Callable[..., tuple[object, ...]]


def compilable(node: Node, local: Collection[str]) -> bool:
    """Whether `node` can run inside a compiled region: a plain local op."""
    return (node.op == "call_function" and node.name in local and not is_size(node)
            and node.target not in _EXCLUDED)


def regions_of(nodes: Sequence[Node], local: Collection[str], cuts: Collection[int] = (),
               keep: Collection[Node] = ()) -> Mapping[int, Region]:
    """The regions of `nodes` by the index they start at: each maximal run of at least
    `MIN_REGION_NODES` compilable nodes that crosses no index in `cuts` (where a
    recompute segment starts or ends), its outputs the values read after it (or kept:
    `keep`)."""
    found: dict[int, Region] = {}
    k = 0
    while k < len(nodes):
        if not compilable(nodes[k], local):
            k += 1
            continue
        end = k + 1
        while end < len(nodes) and end not in cuts and compilable(nodes[end], local):
            end += 1
        if end - k >= MIN_REGION_NODES:
            found[k] = _region(nodes[k:end], keep)
        k = end
    return found


def _region(nodes: Sequence[Node], keep: Collection[Node]) -> Region:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                if a not in inside))
    outputs = [n for n in nodes if n in keep or any(u not in inside for u in n.users)]
    graph = Graph()
    values: dict[Node, Node] = {a: graph.placeholder(a.name) for a in inputs}
    for node in nodes:
        values[node] = graph.node_copy(node, lambda a: values[a])
        values[node].target = runnable(node.target)
    graph.output(tuple(values[n] for n in outputs))
    compiled = GraphModule(torch.nn.Module(), graph)
    return Region(tuple(nodes), tuple(inputs), tuple(outputs), compiled.forward)
