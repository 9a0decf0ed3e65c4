"""Values of the trace that are the same at every step: computed once, then reused.

An exported graph rebuilds, on every forward, what depends on nothing the step feeds it:
the causal mask from `arange` and comparisons, position ids, rotary frequencies' cosines
and sines (from a buffer no op writes). Eager code builds some of these too, others it
skips (`is_causal`); either way they cost host time on every step. A node is constant
when every value it reads is one: a shape (the readers of sizes count as reading no
value: `SHAPE_READERS`), a literal, or a tensor attribute that is neither one of the
plan's weights nor written by any op of the graph (a buffer mutated in place, such as a
norm's running statistics, is not constant). Random ops are never constant. The values
are kept per shape of the step's inputs (a micro-batch of another size builds its own).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch.fx import Node
from torch.fx.node import map_arg

_aten = torch.ops.aten
#: Ops whose first argument is read for its shape, dtype or device only, never its values.
SHAPE_READERS = frozenset({
    _aten.sym_size.int, _aten.new_ones.default, _aten.new_zeros.default,
    _aten.new_empty.default, _aten.new_full.default, _aten.ones_like.default,
    _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default,
})


def constant_nodes(nodes: Iterable[Node], weights: Collection[str]) -> frozenset[Node]:
    """The call_function nodes among `nodes` (in graph order) whose values are constant
    (module docstring); `weights`: the get_attr targets that are the plan's weights."""
    return frozenset(n for n in constant_values(nodes, weights) if n.op == "call_function")


def constant_values(nodes: Iterable[Node], weights: Collection[str]) -> frozenset[Node]:
    """`constant_nodes` with the tensor attributes they start from (get_attr nodes)."""
    nodes = list(nodes)
    written = {str(n.args[0].target) for n in nodes
               if n.op == "call_function" and _writes_in_place(n)
               and n.args and isinstance(n.args[0], Node) and n.args[0].op == "get_attr"}
    constant: set[Node] = set()
    for node in nodes:
        if node.op == "get_attr":
            if str(node.target) not in weights and str(node.target) not in written:
                constant.add(node)
            continue
        if node.op != "call_function" or _random(node) or _writes_in_place(node):
            continue
        read: list[Node] = []
        if node.target in SHAPE_READERS:  # a size: the value it reads does not matter
            map_arg((node.args[1:], node.kwargs), read.append)
        else:
            read = list(node.all_input_nodes)
        if all(source in constant for source in read):
            constant.add(node)
    return frozenset(constant)


def _random(node: Node) -> bool:
    """A random op, or one whose result is uninitialised memory (`empty`)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or "empty" in str(node.target)


def _writes_in_place(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        argument.alias_info is not None and argument.alias_info.is_write
        for argument in schema.arguments)
