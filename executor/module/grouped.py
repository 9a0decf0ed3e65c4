"""Grouped-query attention run as torch's SDPA runs it eagerly: K and V as they are.

A grouped-query model (LLaMA, Mistral: fewer key/value heads than query heads) repeats
each K/V head for its group before attention (transformers' `repeat_kv`: `unsqueeze`,
`expand`, `reshape`). Eagerly, with no mask or a causal one, transformers skips that and
passes the grouped K/V to `scaled_dot_product_attention(..., enable_gqa=True)`; under
`torch.export` a materialised mask is present, so the trace keeps the repeat: a copy of K
and V per layer forward, and a sum over each group backward (on the 2-layer LLaMA,
2 x 2 x 3 more forward nodes and 4 more reductions backward than eager runs). Where
`executor.module.masks` will run the mask as `is_causal` (or none), the repeat is taken
out of the trace here and SDPA told `enable_gqa=True`: the same attention (torch repeats
each K/V head for `heads // kv_heads` query heads, as `repeat_kv` does), by eager's path.

Only where attention runs on plain local tensors (`executor.module.local`: the batch's
rows, every head whole), so that a rank's query and K/V blocks hold whole groups; never
across a recompute segment's edge or in a pipeline's trace (whose cuts name nodes). The
dropout draws keep the numbers of the export's nodes (`executor.module.run.node_places`):
erasing nodes must not renumber them, or the masks would differ from the unsplit run's.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.fx import GraphModule, Node

from executor.module.masks import SDPA, shape_only
from executor.module.run import node_places

_aten = torch.ops.aten
_MERGES = frozenset({_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default})


def _step(node: object, *targets: object) -> Node | None:
    return node if isinstance(node, Node) and node.target in targets else None


def _whole_slice(node: Node) -> bool:
    """`x[...]`'s no-op part: a slice from 0 to the end, step 1."""
    given = list(node.args[2:5])
    start, end, step = given + [None, None, 1][len(given):]
    return bool(start in (0, None) and step == 1) and (
        end is None or (isinstance(end, int) and end >= 2 ** 62))


def _repeated(node: object, local: Collection[str]) -> tuple[Node, int, list[Node]] | None:
    """`(x, rep, nodes)` where `node` is `x` [b, kv, s, d] with each head repeated `rep`
    times (`reshape(expand(unsqueeze(x, 2), [b, kv, rep, s, d]), [b, kv * rep, s, d])`,
    as the export writes it: a clone before the merge, whole-range slices before the
    unsqueeze), every step local and read by the next only; None otherwise."""
    merge = _step(node, *_MERGES)
    if merge is None:
        return None
    chain = [merge]
    copied = _step(merge.args[0], _aten.clone.default)
    if copied is not None:
        chain.append(copied)
    expand = _step(chain[-1].args[0], _aten.expand.default)
    unsqueeze = _step(expand.args[0], _aten.unsqueeze.default) if expand else None
    if expand is None or unsqueeze is None or unsqueeze.args[1] != 2:
        return None
    chain += [expand, unsqueeze]
    source = unsqueeze.args[0]
    while (sliced := _step(source, _aten.slice.Tensor)) is not None and _whole_slice(sliced):
        chain.append(sliced)
        source = sliced.args[0]
    if not isinstance(source, Node) or any(
            n.name not in local or len(n.users) != 1 for n in chain):
        return None
    before, after = source.meta.get("val"), merge.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or \
            before.dim() != 4 or after.dim() != 4:
        return None
    heads, groups = after.shape[1], before.shape[1]
    if not isinstance(heads, int) or not isinstance(groups, int) or heads % groups or \
            [str(d) for d in (before.shape[0], *before.shape[2:])] != \
            [str(d) for d in (after.shape[0], *after.shape[2:])]:
        return None
    return source, heads // groups, chain


def _mask_resolves(node: Node) -> bool:
    """Whether SDPA's mask is absent or built from shapes alone (what the run may turn
    into `is_causal` or none: `executor.module.masks.resolved`)."""
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return mask is None or (isinstance(mask, Node) and shape_only(mask))


def group_attention(graph: GraphModule, local: Collection[str],
                    fixed: Collection[str] = ()) -> int:
    """Rewrite each local SDPA of `graph` whose K and V are repeated heads to read them
    grouped (`enable_gqa=True`), the repeats erased (module docstring); `fixed`: node
    names that must stay (a recompute segment's ends). Returns how many were rewritten."""
    node_places(graph)  # the dropout draws keep the export's numbers
    rewritten = 0
    for node in list(graph.graph.nodes):
        if node.target is not SDPA or node.name not in local or \
                node.kwargs.get("enable_gqa") or len(node.args) < 3 or \
                not _mask_resolves(node):
            continue
        key, value = (_repeated(a, local) for a in node.args[1:3])
        if key is None or value is None or key[1] != value[1] or key[1] < 2 or any(
                n.name in fixed for n in (*key[2], *value[2])):
            continue
        args = list(node.args)
        args[1], args[2] = key[0], value[0]
        node.args = tuple(args)
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for chain in (key[2], value[2]):
            for dead in chain:  # from the SDPA's side: each has no reader left
                graph.graph.erase_node(dead)
        rewritten += 1
    if rewritten:
        graph.recompile()
    return rewritten
