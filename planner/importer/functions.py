"""ONNX's loss ops planned as the ops ONNX defines them by.

`SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` (a transformers model given
`labels=` computes its own loss; torch's exporter emits the first) have no sharding rule of
their own: planned replicated, every rank gathered the whole batch's logits, and the batch
trace took the loss for rows meeting. ONNX defines both as functions of ordinary ops (its
schemas build the body for the node's attributes and input types): a log-softmax over the
classes, a `GatherElements` of each target's log-probability, and for a mean over kept
targets `ReduceSum(losses) / ReduceSum(weights)`. Planned as those ops, the rows split
over the batch's ranks and the mean is two pending sums reduced before their quotient:
one process's mean, whatever each rank keeps. The body's nodes are named
`<node>__<k>` (the last one writes the node's outputs), its values `<node>__<value>`.
"""

from __future__ import annotations

import onnx
from onnx import helper

from planner.errors import ModelError

#: loss ops without a rule of their own, planned as their ONNX function bodies
EXPANDED = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})


def expand_losses(model: onnx.ModelProto, opset: int, name: str) -> onnx.ModelProto:
    """`model` with each loss op of `EXPANDED` (default domain) replaced by its body,
    recursively (the softmax loss's body holds a negative log-likelihood); the model
    itself where it has none."""
    graph = model.graph
    if not any(node.op_type in EXPANDED and node.domain in ("", "ai.onnx")
               for node in graph.node):
        return model
    types = _elem_types(model)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.extend(_expanded(node, opset, types, name, depth=0))
    expanded = onnx.ModelProto()
    expanded.CopyFrom(model)
    del expanded.graph.node[:]
    expanded.graph.node.extend(nodes)
    return expanded


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type the model states (inputs, outputs, weights, value_info),
    inferred where a loss op's input has none stated."""
    graph = model.graph
    found = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.input, *graph.output, *graph.value_info)}
    found.update({t.name: t.data_type for t in graph.initializer})
    wanted = {i for n in graph.node if n.op_type in EXPANDED for i in n.input if i}
    if wanted - found.keys():
        inferred = onnx.shape_inference.infer_shapes(model)
        found.update({v.name: v.type.tensor_type.elem_type
                      for v in inferred.graph.value_info})
    return found


def _expanded(node: onnx.NodeProto, opset: int, types: dict[str, int], name: str,
              depth: int) -> list[onnx.NodeProto]:
    if node.op_type not in EXPANDED or node.domain not in ("", "ai.onnx") or depth > 2:
        return [node]
    missing = [i for i in node.input if i and not types.get(i)]
    if missing:
        raise ModelError(f"{name}: op {node.name} ({node.op_type}): the element type of "
                         f"{missing[0]} is not stated; re-export the model with its value "
                         "types (onnx.shape_inference)")
    schema = onnx.defs.get_schema(node.op_type, opset)
    inputs = [helper.make_tensor_type_proto(types[i], None).SerializeToString()
              for i in node.input if i]
    body = onnx.FunctionProto()
    body.ParseFromString(schema.get_context_dependent_function(  # type: ignore[attr-defined]
        node.SerializeToString(), inputs))
    renamed = dict(zip(body.input, node.input, strict=False))
    renamed.update(zip(body.output, node.output, strict=False))
    attributes = {a.name: a for a in node.attribute}

    def value(name_: str) -> str:
        return renamed.get(name_, f"{node.name}__{name_}") if name_ else ""

    found: list[onnx.NodeProto] = []
    for k, inner in enumerate(body.node):
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.name = f"{node.name}__{k}"
        del copy.input[:]
        copy.input.extend(value(i) for i in inner.input)
        del copy.output[:]
        copy.output.extend(value(o) for o in inner.output)
        del copy.attribute[:]
        for attribute in inner.attribute:
            if attribute.ref_attr_name:  # the node's own, where it states it
                if attribute.ref_attr_name in attributes:
                    given = onnx.AttributeProto()
                    given.CopyFrom(attributes[attribute.ref_attr_name])
                    given.name = attribute.name
                    copy.attribute.append(given)
            else:
                copy.attribute.append(attribute)
        if copy.op_type in EXPANDED:  # (a nested loss op: its inputs' types, below)
            types.update(_nested_types(copy, types, node))
        found.extend(_expanded(copy, opset, types, name, depth + 1))
    return found


def _nested_types(node: onnx.NodeProto, types: dict[str, int],
                  parent: onnx.NodeProto) -> dict[str, int]:
    """The element types a nested loss op's inputs take, slot by slot its parent's: its
    scores' are the parent's scores' (a log-softmax of them), its targets' and weights'
    the parent's."""
    return {mine: types[theirs] for mine, theirs in zip(node.input, parent.input,
                                                          strict=False)
            if mine and theirs}
