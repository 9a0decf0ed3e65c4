"""Make a bound model's shapes static: alternate ONNX shape inference with constant
folding until the shape arithmetic exporters emit (Shape → Gather → Concat → Reshape
chains) has become constants, lower sequences read at constant positions to Split, and
drop the nodes no output depends on."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from planner.errors import ModelError
from planner.graph import DEFAULT_CAPACITY_FACTOR, FLOAT_DTYPES, RoutedSelection
from planner.importer.declared import declared_scalar_parameters
from planner.importer.gathers import reshape_layout_gathers
from planner.importer.routing import pinned_shapes, routed_selections
from planner.importer.tensors import ONNX_TO_NUMPY, has_inline_data
from planner.reference import run_node

#: Folded constants larger than this stay ops: they are data, not shape arithmetic.
FOLD_LIMIT_ELEMENTS = 1 << 16
MAX_FOLD_ROUNDS = 12
NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)
#: Float inputs of more than one element whose values ONNX shape inference reads (output
#: sizes from scales); it reads no other float tensor's data but scalars (Range, OneHot).
SHAPE_INFERENCE_FLOAT_INPUTS = {"Resize": (2,), "Upsample": (1,)}

Shapes = dict[str, tuple[tuple[int, ...] | None, int]]


def unread_float_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The float initializers of more than one element with inline data that neither
    folding nor shape inference reads: their dims and element type are all the import
    needs of them (weights, mostly)."""
    read = {node.input[slot] for node in model.graph.node
            if node.domain in ("", "ai.onnx")
            for slot in SHAPE_INFERENCE_FLOAT_INPUTS.get(node.op_type, ())
            if slot < len(node.input)}
    return [init for init in model.graph.initializer
            if ONNX_TO_NUMPY.get(init.data_type, "") in FLOAT_DTYPES
            and math.prod(init.dims) > 1 and init.name not in read and has_inline_data(init)]


class Folded(NamedTuple):
    """A model folded at one binding: its shapes, known constant values and the routers'
    token selections given a static size."""

    model: onnx.ModelProto
    shapes: Shapes
    known: dict[str, np.ndarray]
    routed: dict[str, RoutedSelection]


def fold_until_stable(model: onnx.ModelProto, opset: int, name: str,
                      capacity_factor: float = DEFAULT_CAPACITY_FACTOR) -> Folded:
    """Alternate shape inference and folding: each fold can make more shapes static.
    A router's data-dependent selection, once its input's shape is static, is sized at
    `capacity_factor` times an expert's even share (`planner.importer.routing`)."""
    known = _known_initializer_values(model)
    order = [value.name for value in model.graph.output]
    passing = _set_aside_passing_outputs(model)
    declared = _take_declared_output_shapes(model)
    shapes: Shapes = {}
    routed: dict[str, RoutedSelection] = {}
    pins: list[onnx.ValueInfoProto] = []
    for _ in range(MAX_FOLD_ROUNDS):
        model = _infer(model, name, pins)
        shapes = _collect_shapes(model)
        found = routed_selections(model, shapes, capacity_factor, name)
        if found:
            routed.update(found)
            pins = pinned_shapes(model, routed, shapes)
            continue
        settled = _every_shape_static(model, shapes)
        folded = _fold_once(model, known, shapes, opset)
        lowered = _lower_sequences(model, known, shapes)
        if not (folded or lowered) or (settled and not lowered):
            break  # settled: another round would infer the same shapes and fold nothing
    _check_declared_shapes(model, declared, shapes, name)
    reshape_layout_gathers(model, shapes, known)
    _remove_dead_nodes(model)
    if passing:  # back, in the file's order
        outputs = {value.name: value for value in (*model.graph.output, *passing)}
        del model.graph.output[:]
        model.graph.output.extend(outputs[name] for name in order if name in outputs)
    return Folded(model, shapes, known, routed)


def _set_aside_passing_outputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Take out the graph outputs that are graph inputs or initializers (a model that
    returns its input ids beside its logits): ONNX shape inference, meeting a name that
    is both an input and an output, infers nothing at all. Their shapes are the inputs'."""
    given = {value.name for value in model.graph.input} | {
        init.name for init in model.graph.initializer}
    passing = [value for value in model.graph.output if value.name in given]
    if passing:
        kept = [value for value in model.graph.output if value.name not in given]
        del model.graph.output[:]
        model.graph.output.extend(kept)
    return passing


def _every_shape_static(model: onnx.ModelProto, shapes: Shapes) -> bool:
    """Whether every node's outputs have static shapes (sequences have none). Then a fold
    only turns tensors whose shapes are known into constants of those shapes, and walks
    the nodes in topological order, so it folds in one pass all it ever will: inferring
    again would find the same shapes and fold nothing (a dynamo export's shape arithmetic
    settles in its first or second round; the round that confirms it is spared)."""
    return all(shapes.get(output, (None, 0))[0] is not None
               for node in model.graph.node for output in node.output if output)


def _take_declared_output_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """The static shapes the file declares for its outputs, cleared from the model so
    that shape inference computes its own (with a declaration present it keeps the
    declared one, right or wrong)."""
    declared: dict[str, tuple[int, ...]] = {}
    for value in model.graph.output:
        tensor_type = value.type.tensor_type
        if not (value.type.HasField("tensor_type") and tensor_type.HasField("shape")):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            declared[value.name] = tuple(int(d.dim_value) for d in dims)
            tensor_type.ClearField("shape")
    return declared


def _check_declared_shapes(model: onnx.ModelProto, declared: Mapping[str, tuple[int, ...]],
                           shapes: Shapes, name: str) -> None:
    """Refuse a file whose declared output shape contradicts what its ops compute (a plan
    priced on either would be wrong); where inference found none, the declaration
    stands."""
    if not declared:
        return
    producers = {out: node for node in model.graph.node for out in node.output if out}
    for output, dims in declared.items():
        computed, elem = shapes.get(output, (None, 0))
        if computed is None:
            shapes[output] = (dims, elem)
        elif computed != dims:
            node = producers.get(output)
            by = f"op {node.name} ({node.op_type}) computes" if node is not None else \
                "the graph computes"
            raise ModelError(
                f"{name}: {by} output {output} as {list(computed)}, but the file declares "
                f"{list(dims)}; the declared shape is wrong or an op's attributes are: "
                "re-export the model (or fix the declaration)")


def _infer(model: onnx.ModelProto, name: str,
           pins: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    del model.graph.value_info[:]
    model.graph.value_info.extend(pins)
    try:
        return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"{name}: ONNX shape inference failed: {message}; check the bound dims "
            "(--batch, --dim) and that the file is a valid export"
        ) from None


def _collect_shapes(model: onnx.ModelProto) -> Shapes:
    """name -> (static shape or None when any dim is unknown, onnx elem type)."""
    shapes: Shapes = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(
        model.graph.output
    ):
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        shape: tuple[int, ...] | None = None
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                shape = tuple(int(d.dim_value) for d in dims)
        previous = shapes.get(value.name)
        if previous is None or previous[0] is None:
            shapes[value.name] = (shape, tensor_type.elem_type)
    for init in model.graph.initializer:
        shapes[init.name] = (tuple(int(d) for d in init.dims), init.data_type)
    return shapes


def _known_initializer_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Values the folder may use: integer/bool initializers and float scalars.

    Float tensors with more than one element are parameters: folding through them would
    turn a weight into a constant, so they are never treated as known; nor are the
    trained scalars a module's export declares (`planner.importer.declared`).
    """
    known: dict[str, np.ndarray] = {}
    trained = declared_scalar_parameters(model)
    for init in model.graph.initializer:
        numel = math.prod(init.dims)
        dtype = ONNX_TO_NUMPY.get(init.data_type, "")
        if numel > FOLD_LIMIT_ELEMENTS or not has_inline_data(init) or init.name in trained:
            continue
        if dtype in FLOAT_DTYPES and numel > 1:
            continue
        try:
            known[init.name] = numpy_helper.to_array(init)
        except Exception:
            continue
    return known


def _fold_once(
    model: onnx.ModelProto,
    known: dict[str, np.ndarray],
    shapes: Shapes,
    opset: int,
) -> bool:
    """Evaluate every node whose inputs are known; return whether anything folded."""
    folded_any = False
    kept: list[onnx.NodeProto] = []
    new_initializers: list[onnx.TensorProto] = []
    for node in model.graph.node:
        values = _try_fold(node, known, shapes, opset)
        if values is None:
            kept.append(node)
            continue
        folded_any = True
        for output, value in zip(node.output, values, strict=False):
            if output:
                known[output] = value
                new_initializers.append(numpy_helper.from_array(value, output))
    if folded_any:
        del model.graph.node[:]
        model.graph.node.extend(kept)
        model.graph.initializer.extend(new_initializers)
    return folded_any


def _try_fold(
    node: onnx.NodeProto,
    known: dict[str, np.ndarray],
    shapes: Shapes,
    opset: int,
) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC_OPS:
        return None
    if node.op_type in ("Shape", "Size"):
        return _fold_shape_query(node, shapes)
    if node.op_type == "CastLike":
        return _fold_cast_like(node, known, shapes)
    if any(name and name not in known for name in node.input):
        return None
    if node.op_type == "Constant":  # its value is in the proto already, whatever its size
        return _evaluate(node, {}, opset)
    for output in node.output:
        shape = shapes.get(output, (None, 0))[0]
        if shape is not None and math.prod(shape) > FOLD_LIMIT_ELEMENTS:
            return None
    arrays = _evaluate(node, {name: known[name] for name in node.input if name}, opset)
    if arrays is None or any(a.size > FOLD_LIMIT_ELEMENTS for a in arrays):
        return None
    return arrays


def _evaluate(
    node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int
) -> list[np.ndarray] | None:
    """Run one node with ONNX's reference evaluator; None when it cannot.

    Quietly: T5's relative-position buckets take log(0) on purpose (a Where drops the
    result), and numpy's RuntimeWarnings about it would reach the user's terminal."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = run_node(node, feeds, opset)
    except Exception:
        return None
    arrays = [np.asarray(r) for r in results]
    return None if any(a.dtype == object for a in arrays) else arrays


def _fold_shape_query(
    node: onnx.NodeProto, shapes: Shapes
) -> list[np.ndarray] | None:
    shape = shapes.get(node.input[0], (None, 0))[0]
    if shape is None:
        return None
    if node.op_type == "Size":
        size = math.prod(shape)
        return [np.array(size, dtype=np.int64)] if 0 <= size < 1 << 63 else None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return [np.array(shape[start:end], dtype=np.int64)]


def _fold_cast_like(
    node: onnx.NodeProto, known: dict[str, np.ndarray], shapes: Shapes
) -> list[np.ndarray] | None:
    """CastLike reads only its second input's type: a known value cast like any tensor of
    a known dtype is a constant. (The dynamo exporter casts attention's scale like the
    query; left unfolded, the query would look like an input of the scale: moved for it,
    and given a gradient.)"""
    if len(node.input) < 2 or node.input[0] not in known:
        return None
    code = shapes.get(node.input[1], (None, 0))[1]
    if not code:
        return None
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(code)
    except (KeyError, ValueError):
        return None
    return [np.asarray(known[node.input[0]]).astype(dtype)]


def _lower_sequences(
    model: onnx.ModelProto,
    known: dict[str, np.ndarray],
    shapes: Mapping[str, tuple[tuple[int, ...] | None, int]],
) -> bool:
    """Turn SplitToSequence + SequenceAt (constant positions) into a plain Split.

    Dynamo's train-mode exports split tensors this way; sequences are not tensors and
    cannot be planned, but a split read at constant positions is just a Split.
    """
    consumers: dict[str, list[onnx.NodeProto]] | None = None  # found at the first split
    changed = False
    replaced: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        if consumers is None:
            consumers = {}
            for other in model.graph.node:
                for name in other.input:
                    consumers.setdefault(name, []).append(other)
        readers = consumers.get(node.output[0], [])
        positions = [known.get(r.input[1]) if len(r.input) > 1 else None for r in readers]
        shape = shapes.get(node.input[0], (None, 0))[0]
        split = known.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if (not readers or shape is None or any(r.op_type != "SequenceAt" for r in readers)
                or any(p is None for p in positions)):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        axis = int(attrs.get("axis", 0)) % len(shape)
        sizes = _split_sizes(shape[axis], split)
        if sizes is None:
            continue
        outputs = [f"{node.output[0]}__part{i}" for i in range(len(sizes))]
        for reader, position in zip(readers, positions, strict=True):
            outputs[int(np.asarray(position).reshape(-1)[0]) % len(sizes)] = reader.output[0]
        sizes_name = f"{node.output[0]}__sizes"
        known[sizes_name] = np.array(sizes, dtype=np.int64)
        model.graph.initializer.append(numpy_helper.from_array(known[sizes_name], sizes_name))
        squeeze = split is None and not int(attrs.get("keepdims", 1))
        lowered = onnx.helper.make_node("Split", [node.input[0], sizes_name],
                                        [o + "__kept" if squeeze else o for o in outputs],
                                        name=node.name, axis=axis)
        replaced[node.name] = lowered
        if squeeze:
            axes_name = f"{node.output[0]}__axis"
            known[axes_name] = np.array([axis], dtype=np.int64)
            model.graph.initializer.append(numpy_helper.from_array(known[axes_name], axes_name))
            for out in outputs:
                model.graph.node.append(onnx.helper.make_node(
                    "Squeeze", [out + "__kept", axes_name], [out], name=f"{out}/squeeze"))
        for reader in readers:
            replaced[reader.name] = None  # type: ignore[assignment]
        changed = True
    if changed:
        nodes = []
        for node in model.graph.node:
            if node.name not in replaced:
                nodes.append(node)
            elif replaced[node.name] is not None:
                nodes.append(replaced[node.name])
        del model.graph.node[:]
        model.graph.node.extend(_topological(nodes))
    return changed


def _split_sizes(length: int, split: np.ndarray | None) -> list[int] | None:
    if split is None:
        return [1] * length
    values = np.asarray(split).reshape(-1)
    if np.asarray(split).ndim == 0:
        chunk = int(values[0])
        if chunk <= 0:
            return None
        return [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
    return [int(v) for v in values]


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Order nodes so producers come first (lowering appends nodes at the end)."""
    produced = {o: i for i, n in enumerate(nodes) for o in n.output}
    order: list[onnx.NodeProto] = []
    state: dict[int, int] = {}

    def visit(index: int) -> None:
        stack = [(index, False)]
        while stack:
            current, done = stack.pop()
            if done:
                state[current] = 2
                order.append(nodes[current])
                continue
            if state.get(current):
                continue
            state[current] = 1
            stack.append((current, True))
            for name in nodes[current].input:
                producer = produced.get(name)
                if producer is not None and not state.get(producer):
                    stack.append((producer, False))

    for index in range(len(nodes)):
        if not state.get(index):
            visit(index)
    return order


def _remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drop nodes no graph output depends on (e.g. folded shape chains' leftovers).

    One walk back from the outputs, linear in the graph: peeling dead nodes a layer at a
    time would take one pass per node of a dead chain (quadratic, minutes at 100k nodes).
    """
    graph_outputs = {o.name for o in model.graph.output}
    everything = list(model.graph.node)
    producer = {out: i for i, node in enumerate(everything) for out in node.output if out}
    live: set[int] = set()
    stack = [producer[name] for name in graph_outputs if name in producer]
    while stack:
        index = stack.pop()
        if index in live:
            continue
        live.add(index)
        stack.extend(producer[name] for name in everything[index].input
                     if name in producer and producer[name] not in live)
    nodes = everything
    if len(live) < len(everything):  # rewriting copies every node: only when some are dead
        nodes = [node for i, node in enumerate(everything) if i in live]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input} | graph_outputs
    live_inits = [t for t in model.graph.initializer if t.name in used]
    if len(live_inits) < len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(live_inits)
