"""Plan a mixture-of-experts router's data-dependent token selection at a static size.

Exporters write top-k routing as `TopK` over the router's expert scores, then a mask of
the tokens each expert got (`OneHot`/`Equal`) and a `NonZero` that lists them: its
result has as many entries as tokens were routed there, known only at run time. Static
shapes are what a plan is priced on, so each such `NonZero` whose input derives from a
`TopK`'s indices is sized as expert-parallel trainers size their buffers: an expert's
*capacity*, the capacity factor times its even share of the routed tokens (GShard,
Lepikhin et al. 2020, sec. 2.2; Switch Transformer, Fedus et al. 2022, sec. 2.2), capped
by the mask's size. A selection over a mask with no token dim (which experts got any
token) is sized at every expert. Any other data-dependent `NonZero` is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import onnx

from planner.errors import ModelError
from planner.graph import RoutedSelection

Shapes = Mapping[str, tuple[tuple[int, ...] | None, int]]
#: How far back from a NonZero the router's TopK may be (exporters put a OneHot, a
#: Transpose, a Gather and a Cast between them).
MAX_ROUTER_DISTANCE = 32


def routed_selections(model: onnx.ModelProto, shapes: Shapes, capacity_factor: float,
                      name: str) -> dict[str, RoutedSelection]:
    """Every NonZero of unknown result size, sized as a routed selection; an error for
    one no router feeds."""
    producers: dict[str, onnx.NodeProto] | None = None  # found at the first NonZero
    found: dict[str, RoutedSelection] = {}
    for node in model.graph.node:
        if node.op_type != "NonZero" or node.domain not in ("", "ai.onnx"):
            continue
        if shapes.get(node.output[0], (None, 0))[0] is not None:
            continue
        if producers is None:
            producers = {out: n for n in model.graph.node for out in n.output if out}
        mask = shapes.get(node.input[0], (None, 0))[0]
        router = _router(node, producers, shapes)
        if mask is None or router is None:
            if mask is None:
                continue  # its input is not static yet: the next round of folding decides
            raise ModelError(
                f"{name}: op {node.name} (NonZero) has a result whose size depends on the "
                "data, and no top-k router feeds it, so no capacity can size it; shardplan "
                "plans static shapes: export the model with a fixed-size form of it (e.g. "
                "a mask multiplied in instead of the selected indices)")
        found[node.name] = _selection(node, router, mask, shapes, capacity_factor)
    return found


def pinned_shapes(model: onnx.ModelProto, selections: Mapping[str, RoutedSelection],
                  shapes: Shapes) -> list[onnx.ValueInfoProto]:
    """The static result shape of each selection ([mask rank, count]), for shape
    inference to start from."""
    pins = []
    for node in model.graph.node:
        selection = selections.get(node.name)
        mask = shapes.get(node.input[0], (None, 0))[0] if node.input else None
        if selection is not None and mask is not None:
            pins.append(onnx.helper.make_tensor_value_info(
                node.output[0], onnx.TensorProto.INT64, [len(mask), selection.count]))
    return pins


def _router(node: onnx.NodeProto, producers: Mapping[str, onnx.NodeProto],
            shapes: Shapes) -> onnx.NodeProto | None:
    """The TopK whose indices `node`'s input derives from, nearest first."""
    frontier, seen = [node.input[0]], set()
    for _ in range(MAX_ROUTER_DISTANCE):
        following: list[str] = []
        for tensor in frontier:
            producer = producers.get(tensor)
            if producer is None or producer.name in seen:
                continue
            seen.add(producer.name)
            if (producer.op_type == "TopK" and len(producer.output) > 1
                    and producer.output[1] == tensor
                    and shapes.get(producer.input[0], (None, 0))[0] is not None):
                return producer
            following.extend(i for i in producer.input if i)
        if not following:
            return None
        frontier = following
    return None


def _selection(node: onnx.NodeProto, router: onnx.NodeProto, mask: tuple[int, ...],
               shapes: Shapes, capacity_factor: float) -> RoutedSelection:
    scores = shapes[router.input[0]][0]
    indices = shapes[router.output[1]][0]
    assert scores is not None and indices is not None
    axis = next((int(onnx.helper.get_attribute_value(a)) for a in router.attribute
                 if a.name == "axis"), -1) % len(scores)
    experts, top_k = scores[axis], indices[axis]
    tokens = math.prod(indices) // max(top_k, 1)
    entries = math.prod(mask)
    per_expert = entries > experts + 1  # a per-token mask, not one flag per expert
    if per_expert:
        count = min(entries, math.ceil(capacity_factor * tokens * top_k / experts))
    else:
        count = min(entries, experts)
    return RoutedSelection(node.name, router.name, experts, top_k, tokens, count, per_expert)
