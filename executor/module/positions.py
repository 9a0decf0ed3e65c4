"""Rows picked by their own positions: `x[torch.arange(batch), ...]`, run on each rank's rows.

transformers builds a padding mask by indexing the `attention_mask` with the batch's row
numbers (`attention_mask[arange(batch)[:, None, None, None], kv_positions]`, the same for
GPT-2, LLaMA and BERT), and a sequence classifier picks each row's last token as
`logits[arange(batch), lengths]`. Indexing dim 0 by every row number in order is the
identity on dim 0, and the planner folds it away (the ONNX GatherND becomes a Reshape).
Run as DTensor ops, the row numbers are a tensor the graph made, whole on every rank, and
DTensor gathered the split mask to every rank to index it: one all-gather of the mask per
forward pass that the plan does not list ("collectives differ from the plan:
all_gather|dp|forward planned 0 issued 3" on GPT-2 with a padding mask under dp=2).

On one rank's rows the trace's own sizes are the rows': its `arange(batch)` numbers this
rank's rows from 0, which index this rank's block of the mask, and the op gives this
rank's rows of the result. `row_positions` finds the values that number the rows (an
`arange` of the one symbolic size, and views keeping its rows whole) that only such
index ops read, so that they and the index ops run on local tensors
(`executor.module.local.LocalPlan`). Any other use of the rows' positions as values
(`x + arange(batch)[:, None]`) needs the whole's numbers: it was run on local tensors, and
rank 1 numbered its rows from 0 (0.513094 against one process's 0.581511 at step 1,
exit 0, "collectives: as planned"); such a tensor is now made whole, as one process makes
it, and each rank reads its block (`counts_positions`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

_aten = torch.ops.aten
_ARANGES = frozenset({_aten.arange.default, _aten.arange.start, _aten.arange.start_step})
#: views that keep a value's rows whole and in order (a slice only when it keeps every one)
_VIEWS = frozenset({_aten.unsqueeze.default, _aten.view.default, _aten.reshape.default,
                    _aten._unsafe_view.default, _aten.alias.default, _aten.expand.default,
                    _aten.slice.Tensor})
_INDEX = _aten.index.Tensor
#: ops making a tensor whose values are its rows' positions in the whole (not this rank's)
_ORDINALS = _ARANGES | {_aten.linspace.default, _aten.logspace.default,
                        _aten.randperm.default}


def symbolic_dim(value: torch.Tensor) -> int | None:
    """The one dim whose size is symbolic (the batch's); None for none, -1 for several."""
    dims = [d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt)]
    return dims[0] if len(dims) == 1 else (None if not dims else -1)


def _symbolic(value: object) -> int | None:
    """A value's one symbolic dim (`symbolic_dim`); None for none, several or no tensor."""
    dim = symbolic_dim(value) if isinstance(value, torch.Tensor) else None
    return None if dim == -1 else dim


def _numbers_rows(node: Node) -> bool:
    """An arange from 0 by 1 to a symbolic size: the row numbers."""
    args: list[Any] = list(node.args)
    start: Any
    end: Any
    step: Any
    if node.target is _aten.arange.default:
        start, end, step = 0, args[0], 1
    elif node.target is _aten.arange.start:
        start, end, step = args[0], args[1], 1
    else:
        start, end, step = args + [1][len(args) - 2:]
    return start == 0 and step == 1 and isinstance(end, Node) and isinstance(
        end.meta.get("val"), torch.SymInt)


def _keeps_rows(node: Node, source: Node) -> bool:
    """A view of `source` that keeps its rows (its symbolic dim) whole and in order."""
    if node.args[0] is not source or _symbolic(node.meta.get("val")) is None:
        return False
    if node.target is _aten.slice.Tensor:
        given = list(node.args[1:])
        dim, start, end, step = given + [0, None, None, 1][len(given):]
        rows = _symbolic(source.meta.get("val"))
        return bool(dim != rows or ((start in (0, None)) and (end is None or (
            isinstance(end, int) and end >= 2**62)) and step == 1))
    return True


def _picks_rows(node: Node, positions: set[Node]) -> bool:
    """An index op whose first index numbers the rows of its input's dim 0 (its rows),
    every other index either whole or rows aligned with them under broadcasting."""
    if node.target is not _INDEX or len(node.args) < 2:
        return False
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, Node) or _symbolic(source.meta.get("val")) != 0 or \
            not isinstance(indices, (list, tuple)) or not indices or indices[0] not in positions:
        return False
    head = indices[0]
    assert isinstance(head, Node)
    first = head.meta["val"]
    from_right = first.dim() - _symbolic(first)
    for index in indices[1:]:
        if index is None:
            continue
        if index in positions or not isinstance(index, Node) or \
                not isinstance(index.meta.get("val"), torch.Tensor):
            return False
        value = index.meta["val"]
        rows = _symbolic(value)
        if any(isinstance(size, torch.SymInt) for size in value.shape) and (
                rows is None or value.dim() - rows != from_right):
            return False
    result = node.meta.get("val")
    return isinstance(result, torch.Tensor) and _symbolic(result) is not None


def counts_positions(node: Node) -> bool:
    """Whether `node` makes a tensor over the rows whose values depend on the rows'
    positions in the whole batch (`arange(batch)`): on one rank's rows the trace numbers
    them from 0, so it is not this rank's block of the whole's value."""
    return node.op == "call_function" and node.target in _ORDINALS and \
        _symbolic(node.meta.get("val")) is not None


def indexes_rows(node: Node) -> bool:
    """Whether `node` picks rows of its input's batch dim (its symbolic dim) by index
    values (`x[idx]`, `index_select` or `gather` along it): values numbering the whole
    batch's rows, which one rank's rows cannot be indexed by."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    rows = _symbolic(node.args[0].meta.get("val"))
    if rows is None:
        return False
    if node.target is _INDEX:
        indices: Any = node.args[1] if len(node.args) > 1 else ()
        return len(indices) > rows and indices[rows] is not None
    if node.target in (_aten.index_select.default, _aten.gather.default):
        dim: Any = node.args[1]
        return isinstance(dim, int) and dim % node.args[0].meta["val"].dim() == rows
    return False


def row_positions(graph: GraphModule) -> tuple[frozenset[str], frozenset[str]]:
    """(the nodes numbering the rows that only row-picking index ops read, through views
    keeping the rows; those index ops), by name (see the module doc)."""
    found: set[Node] = set()
    for node in graph.graph.nodes:
        if node.op != "call_function" or _symbolic(node.meta.get("val")) is None:
            continue
        numbers = node.target in _ARANGES and _numbers_rows(node)
        view = node.target in _VIEWS and bool(node.args) and node.args[0] in found
        if numbers or (view and _keeps_rows(node, node.args[0])):  # type: ignore[arg-type]
            found.add(node)
    picks = {user for node in found for user in node.users if _picks_rows(user, found)}
    # a row number read by anything else (arithmetic, a gather) is not this rank's
    changed = True
    while changed:
        changed = False
        for node in list(found):
            orphan = node.target not in _ARANGES and node.args[0] not in found
            if orphan or any(user not in found and user not in picks for user in node.users):
                found.discard(node)
                changed = True
        for pick in list(picks):
            indices: Any = pick.args[1]
            if indices[0] not in found:
                picks.discard(pick)
                changed = True
    return frozenset(n.name for n in found), frozenset(n.name for n in picks)
