"""Build the PlanningGraph of a folded model: classify initializers (parameters, buffers,
constants), read attributes against the ops' schemas, check element types and sizes, cost
every op and check the topological order."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from typing import SupportsInt, cast

import numpy as np
import onnx
from onnx import numpy_helper

from planner.errors import ModelError
from planner.graph import FLOAT_DTYPES, OpNode, PlanningGraph, TensorInfo, TensorKind
from planner.humanize import first_listed
from planner.importer.bind import Bound, data_inputs
from planner.importer.declared import declared_scalar_parameters, declared_state
from planner.importer.fold import FOLD_LIMIT_ELEMENTS, Folded, Shapes
from planner.importer.names import recover_names
from planner.importer.order import canonical_order
from planner.importer.source import ModelSource
from planner.importer.tensors import ONNX_TO_NUMPY, has_inline_data
from planner.importer.views import merge_view_transposes
from planner.ops import cost_op

#: Largest element count of one tensor: beyond 2**53, float64 sizes and FLOPs are inexact.
MAX_TENSOR_ELEMENTS = 1 << 53
#: Batch-norm running statistics are state, not trainable parameters.
BUFFER_INPUT_SLOTS = {"BatchNormalization": (3, 4)}
#: Names torch gives registered buffers that exporters store as float initializers.
BUFFER_NAME = re.compile(r"(running_(mean|var)|num_batches_tracked|inv_freq|_cached)$")


def build_graph(folded: Folded, source: ModelSource, bound: Bound,
                capacity_factor: float) -> PlanningGraph:
    """The planning graph of a model folded at the binding `bound` from `source`."""
    model, shapes, known = folded.model, folded.shapes, folded.known
    name, opset = source.path, source.opset
    graph = model.graph
    tensors: dict[str, TensorInfo] = {}
    initializer_kinds = _classify_initializers(model, known)
    recovered = recover_names(model)
    for init in graph.initializer:
        value = known.get(init.name)
        tensors[init.name] = TensorInfo(
            name=init.name,
            shape=tuple(int(d) for d in init.dims),
            dtype=_dtype_name(init.data_type, name, init.name),
            kind=initializer_kinds[init.name],
            value=value if value is not None and value.size <= FOLD_LIMIT_ELEMENTS else None,
            source=recovered.names.get(init.name),
        )
    for value in data_inputs(model):
        shape, elem = shapes.get(value.name, (None, 0))
        if shape is None:
            raise ModelError(f"{name}: input {value.name} has no static shape after binding")
        tensors[value.name] = TensorInfo(value.name, shape, _dtype_name(elem, name, value.name),
                                         "input")
    graph_outputs = [o.name for o in graph.output]
    output_set = frozenset(graph_outputs)
    read: set[str] | None = None  # the tensors some node reads, found at the first shapeless one

    def unread(name: str) -> bool:
        nonlocal read
        if read is None:
            read = {i for node in graph.node for i in node.input if i}
        return name not in read

    ops: list[OpNode] = []
    problems: list[str] = []
    first_shapeless: onnx.NodeProto | None = None
    source_ops: dict[str, str] = {}
    for node in graph.node:
        if node.metadata_props:
            origin = _source_op(node)
            if origin:
                source_ops[node.name] = origin
        outputs: list[str] = []
        for output in node.output:
            shape, elem = shapes.get(output, (None, 0)) if output else (None, 0)
            if not output or (shape is None and output not in output_set and unread(output)):
                outputs.append("")  # an unused optional output (Dropout mask, LN statistics)
                continue
            if shape is None or elem == 0:
                problems.append(f"{output} (output of {node.name}, {node.op_type})")
                first_shapeless = first_shapeless or node
                continue
            tensors[output] = TensorInfo(output, shape, _dtype_name(elem, name, output),
                                         "activation", producer=node.name)
            outputs.append(output)
        attrs = _node_attributes(node, name, opset)
        ops.append(OpNode(node.name, node.op_type, node.domain, tuple(node.input),
                          tuple(outputs), attrs))
    if problems:
        reason = _inference_error(model)
        if reason is not None:
            raise ModelError(f"{name}: {reason}; the file is inconsistent: re-export it")
        assert first_shapeless is not None
        sized_by = _sized_by_data(first_shapeless, shapes, known)
        if sized_by:
            raise ModelError(
                f"{name}: op {first_shapeless.name} ({first_shapeless.op_type}) sizes its "
                f"output by the values of {', '.join(sized_by)}, computed when the model "
                "runs, not constants; shardplan plans static shapes: export the model with "
                "that size fixed (a constant k, shape or count)")
        shown = first_listed(problems, 5, "; ")
        raise ModelError(
            f"{name}: shapes could not be made static for: {shown}. Bind every symbolic dim "
            "(--batch, --dim) and check for custom ops whose shapes ONNX cannot infer"
        )
    missing = [t for node in ops for t in node.inputs if t and t not in tensors]
    if missing:
        raise ModelError(f"{name}: tensor {missing[0]} is used but never defined (dangling input)")
    if not ops:
        raise ModelError(f"{name}: no op computes the graph's outputs "
                         f"({first_listed(graph_outputs, 8)}): they are inputs or constants, "
                         "so there is nothing to plan")
    _check_sizes(tensors, name)
    _check_views(ops, tensors, name)
    ops = merge_view_transposes(ops, tensors, graph_outputs)
    for table in _rotary_frequencies(ops, tensors):
        tensors[table] = replace(tensors[table], kind="buffer")
    ops = canonical_order(ops, tensors, name)
    for node in ops:
        for tensor in node.inputs:
            if tensor:
                tensors[tensor].consumers.append(node.name)
        cost_op(node, tensors)
    planning = PlanningGraph(
        path=name, sha256=source.sha256, opset=opset, bound_dims=bound.dims, batch=bound.batch,
        batch_inputs=bound.batch_inputs, ops=ops, tensors=tensors,
        inputs=[v.name for v in data_inputs(model)], outputs=graph_outputs,
        batch_symbol=bound.batch_symbol, source=source,
        warnings=[_merged_warning(tensor, parameters)
                  for tensor, parameters in recovered.merged.items() if tensor in tensors],
        routed=folded.routed, capacity_factor=capacity_factor,
        sequence_inputs=bound.sequence_inputs, source_ops=source_ops,
    )
    return planning


#: The metadata torch's dynamo exporter gives each node: the FX node it comes from
#: ("%linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](...)")
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
FX_NODE_NAME = re.compile(r"%([^\s:]+)\s*:")


def _source_op(node: onnx.NodeProto) -> str | None:
    """The exported program's node `node` was decomposed from, where the exporter says."""
    for entry in node.metadata_props:
        if entry.key == FX_NODE_KEY:
            found = FX_NODE_NAME.match(entry.value)
            return found.group(1) if found else None
    return None


def _sized_by_data(node: onnx.NodeProto, shapes: Shapes,
                   known: Mapping[str, np.ndarray]) -> list[str]:
    """The integer inputs of `node` whose values are not known, where every input's shape
    is static: its output's shape then depends on data (TopK's k, a Reshape's target, a
    Range's limit fed by the model's inputs), which no binding of dims can fix."""
    inputs = [name for name in node.input if name]
    if not inputs or any(shapes.get(name, (None, 0))[0] is None for name in inputs):
        return []
    return [name for name in inputs if name not in known
            and ONNX_TO_NUMPY.get(shapes[name][1], "").startswith(("int", "uint"))]


def _check_sizes(tensors: Mapping[str, TensorInfo], model_name: str) -> None:
    """Refuse negative dims and tensors too large to count exactly (corrupt or mistyped
    dims): sizes, bytes and FLOPs would silently wrap around or lose precision."""
    for tensor in tensors.values():
        if any(d < 0 for d in tensor.shape):
            raise ModelError(f"{model_name}: tensor {tensor.name} has a negative dim (shape "
                             f"{list(tensor.shape)}); the file is corrupt: re-export it")
        if math.prod(tensor.shape) > MAX_TENSOR_ELEMENTS:
            raise ModelError(
                f"{model_name}: tensor {tensor.name} of shape {list(tensor.shape)} has more "
                f"than 2**53 elements, beyond what shardplan counts exactly; check the bound "
                "dims (--batch, --dim) and the shapes stored in the model"
            )


#: ops that only view their first input in another shape: the element count is kept
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def _check_views(ops: list[OpNode], tensors: Mapping[str, TensorInfo], model_name: str
                 ) -> None:
    """Refuse a view that changes the element count (a Reshape of [4, 32] to [5, 30]):
    ONNX shape inference takes the target as given, and the plan would be priced on it."""
    for node in ops:
        if node.op_type not in VIEW_OPS or node.domain not in ("", "ai.onnx"):
            continue
        source, result = tensors[node.inputs[0]].shape, tensors[node.outputs[0]].shape
        if math.prod(source) != math.prod(result):
            raise ModelError(
                f"{model_name}: op {node.name} ({node.op_type}) turns {list(source)} "
                f"({math.prod(source)} elements) into {list(result)} "
                f"({math.prod(result)}): its target shape is wrong; re-export the model")


def _inference_error(model: onnx.ModelProto) -> str | None:
    """What strict ONNX shape inference says is wrong with the model (an axis out of
    range, split sizes that do not add up), when it names an op: why shapes stayed
    unknown where no dim is left unbound."""
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as exc:
        found = INFERENCE_ERROR.search(" ".join(str(exc).split()))
        if found:
            op_type, node, reason = found.groups()
            reason = reason.split(" (op_type:")[0]  # ONNX runs on into the next op's error
            return f"op {node} ({op_type}): {reason.rstrip('.')[:300]}"
    return None


#: "(op_type:Concat, node name: cat): [ShapeInferenceError] axis must be …"
INFERENCE_ERROR = re.compile(r"\(op_type:([\w.]+), node name: ([^)]*)\): \[\w+\] (.*)")


def _merged_warning(tensor: str, parameters: tuple[str, ...]) -> str:
    shown = first_listed(parameters, 3)
    return (f"initializer {tensor} stands for {len(parameters)} parameters ({shown}): the "
            "exporter merged weights of equal contents, so the plan trains them as one; "
            "export with torch.onnx.export(..., optimize=False) to keep them apart")


def _rotary_frequencies(ops: list[OpNode], tensors: Mapping[str, TensorInfo]) -> list[str]:
    """Float initializers that reach a Cos or Sin before they meet any input: rotary
    frequencies (`inv_freq`), which the TorchScript exporter renames (`onnx::Mul_920`).
    They are state, not weights: no optimizer trains them, and the rotary tables computed
    from them are context every layer shares (`planner.importer.order`)."""
    if not any(node.op_type in ("Cos", "Sin") for node in ops):
        return []  # nothing reaches a Cos or Sin: two walks over a large graph spared
    from_input = {t.name for t in tensors.values() if t.kind == "input"}
    reaches_trig: set[str] = set()
    for node in reversed(ops):  # ops are sorted: readers come after writers
        outputs = [o for o in node.outputs if o]
        if node.op_type in ("Cos", "Sin") or any(o in reaches_trig for o in outputs):
            reaches_trig.update(t for t in node.inputs if t)
    meets_input: set[str] = set()  # tensors some reader combines with an input's data
    for node in ops:
        if any(t in from_input for t in node.inputs if t):
            from_input.update(o for o in node.outputs if o)
            meets_input.update(t for t in node.inputs if t)
    return [t.name for t in tensors.values() if t.kind == "parameter"
            and t.name in reaches_trig and t.name not in meets_input]


def _classify_initializers(
    model: onnx.ModelProto, known: Mapping[str, np.ndarray]
) -> dict[str, TensorKind]:
    """Float initializers consumed by ops are parameters, except state and constants.

    Values the folder produced or could read (integers, scalars, Constant nodes) are
    constants; batch-norm running statistics are buffers: stored, but never trained. What
    a module's export declares (`planner.importer.declared`) is what it says: its trained
    scalars parameters, its buffers and frozen weights state.
    """
    state = set(declared_state(model))
    scalars = declared_scalar_parameters(model)
    buffer_uses: set[str] = set(state)
    for node in model.graph.node:
        for slot in BUFFER_INPUT_SLOTS.get(node.op_type, ()):
            if slot < len(node.input) and node.input[slot]:
                buffer_uses.add(node.input[slot])
    kinds: dict[str, TensorKind] = {}
    for init in model.graph.initializer:
        dtype = ONNX_TO_NUMPY.get(init.data_type, "")
        numel = math.prod(init.dims)
        if init.name in scalars and dtype in FLOAT_DTYPES:
            kinds[init.name] = "parameter"  # a trained scalar the module declares
        elif init.name in state and dtype in FLOAT_DTYPES:
            kinds[init.name] = "buffer"  # state the module declares, whatever its size
        elif dtype not in FLOAT_DTYPES or numel <= 1 or init.name in known:
            kinds[init.name] = "constant"
        elif init.name in buffer_uses or BUFFER_NAME.search(init.name):
            kinds[init.name] = "buffer"
        else:
            kinds[init.name] = "parameter"
    return kinds


def _dtype_name(elem_type: int, model_name: str, tensor: str) -> str:
    dtype = ONNX_TO_NUMPY.get(elem_type)
    if dtype is None:
        try:
            type_name = onnx.TensorProto.DataType.Name(elem_type) if elem_type else "unknown"
        except ValueError:  # a number no ONNX version defines (a corrupt file)
            type_name = f"number {elem_type} (not an ONNX type)"
        raise ModelError(
            f"{model_name}: tensor {tensor} has element type {type_name}, which shardplan "
            "cannot plan; export with float/int tensors"
        )
    return dtype


def _node_attributes(node: onnx.NodeProto, model_name: str, opset: int) -> dict[str, object]:
    """The node's attributes as Python values; a corrupt one names the node and attribute.

    Types are checked against the op's ONNX schema: the sharding rules read `axis` or
    `perm` as the type ONNX defines, and shape inference does not refuse a wrong one.
    """
    expected = _attribute_types(node.op_type, opset) if node.domain in ("", "ai.onnx") else {}
    attrs: dict[str, object] = {}
    for attribute in node.attribute:
        want = expected.get(attribute.name)
        if want is not None and attribute.type != want:
            raise ModelError(
                f"{model_name}: node {node.name} ({node.op_type}) attribute {attribute.name} "
                f"is {_attribute_type_name(attribute.type)}, but ONNX defines it as "
                f"{_attribute_type_name(want)}; the file is corrupt or hand-edited: re-export it"
            )
        try:
            attrs[attribute.name] = attribute_value(attribute)
        except Exception as exc:  # onnx raises TypeError/ValueError/RuntimeError for these
            raise ModelError(
                f"{model_name}: node {node.name} ({node.op_type}) attribute {attribute.name} "
                f"cannot be read ({exc}); the file is corrupt or hand-edited: re-export it"
            ) from None
    return attrs


@cache
def _attribute_types(op_type: str, opset: int) -> dict[str, int]:
    """Attribute name -> AttributeProto type of a default-domain op; {} when unknown."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return {}
    # pybind11 enums convert to int; onnx's stub omits __int__
    return {name: int(cast(SupportsInt, attr.type)) for name, attr in schema.attributes.items()}


def _attribute_type_name(kind: int) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(kind)
    except ValueError:
        return f"type number {kind}"


def attribute_value(attribute: onnx.AttributeProto):
    """An attribute as a Python value: text decoded, tensors as arrays (None when their data
    is not in the proto), graphs, types and sparse tensors as None."""
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value) if has_inline_data(value) else None
    if isinstance(value, list | tuple):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    if isinstance(value, onnx.GraphProto | onnx.TypeProto | onnx.SparseTensorProto):
        return None
    return value
