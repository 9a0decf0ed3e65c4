"""Per-op sharding rules, in einsum form.

Every rule labels each dim of each input and output of one op instance. A label shared by
several dims is one iteration dimension of the op: splitting it over a mesh axis splits all
those dims the same way and needs no communication. Three kinds of labels are special:

- `sum_labels`: contracted dims (MatMul's k, an embedding's vocabulary, ReduceSum's axes).
  Splitting one leaves every output a pending partial sum over that mesh axis.
- `sync_labels`: dims a training-mode BatchNormalization takes statistics over. Splitting
  one is correct only after an AllReduce of the per-channel statistics.
- `whole_labels`: dims that must stay whole (a softmax axis, a convolution window).

A split degree must divide the size of every dim that carries the label. Inputs that are
not data (a Reshape's target shape, Slice bounds) are labelled None and stay replicated.
The planner and the executor both read these rules, so what is priced is what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.graph import OpNode, TensorInfo

Labels = tuple[str, ...]


@dataclass(frozen=True)
class DimLabels:
    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels | None, ...]
    sum_labels: frozenset[str] = field(default_factory=frozenset)
    sync_labels: frozenset[str] = field(default_factory=frozenset)
    whole_labels: frozenset[str] = field(default_factory=frozenset)

    def sizes(self, node: OpNode, tensors: Mapping[str, TensorInfo]) -> dict[str, set[int]]:
        """Every size each label takes on (a split degree must divide all of them)."""
        found: dict[str, set[int]] = {}
        for names, labelled in ((node.inputs, self.inputs), (node.outputs, self.outputs)):
            for name, labels in zip(names, labelled, strict=False):
                if not name or labels is None:
                    continue
                for label, size in zip(labels, tensors[name].shape, strict=True):
                    found.setdefault(label, set()).add(size)
        return found


RuleFn = Callable[[OpNode, Mapping[str, TensorInfo]], DimLabels]
RULES: dict[str, RuleFn] = {}


def rule(*op_types: str) -> Callable[[RuleFn], RuleFn]:
    """Register a labelling function for the given ONNX op types (default domain)."""

    def register(fn: RuleFn) -> RuleFn:
        for op_type in op_types:
            RULES[op_type] = fn
        return fn

    return register


def labels_for(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels | None:
    """The op's labelling, or None when shardplan has no rule for it (kept replicated)."""
    if node.domain not in ("", "ai.onnx"):
        return None
    fn = RULES.get(node.op_type)
    if fn is None:
        return None
    return fn(node, tensors)


# --------------------------------------------------------------------------- helpers


class _Namer:
    """Hands out fresh labels: d0, d1, ... for shared dims, w0, w1, ... for whole ones."""

    def __init__(self) -> None:
        self.count = 0

    def fresh(self, prefix: str = "d") -> str:
        self.count += 1
        return f"{prefix}{self.count - 1}"


def _shape(tensors: Mapping[str, TensorInfo], name: str) -> tuple[int, ...]:
    return tensors[name].shape if name else ()


def _out_shape(node: OpNode, tensors: Mapping[str, TensorInfo]) -> tuple[int, ...]:
    return _shape(tensors, node.outputs[0])


def _broadcast_labels(
    shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...], namer: _Namer
) -> tuple[list[Labels], Labels, set[str]]:
    """Numpy broadcasting: right-aligned dims share a label unless broadcast from size 1."""
    out = tuple(namer.fresh() for _ in out_shape)
    whole: set[str] = set()
    labelled: list[Labels] = []
    for shape in shapes:
        offset = len(out_shape) - len(shape)
        labels = []
        for axis, size in enumerate(shape):
            target = out_shape[offset + axis]
            if size == target:
                labels.append(out[offset + axis])
            else:
                label = namer.fresh("w")
                whole.add(label)
                labels.append(label)
        labelled.append(tuple(labels))
    return labelled, out, whole


def _attr_axis(node: OpNode, name: str, rank: int, default: int) -> int:
    axis = int(node.attrs.get(name, default))
    return axis + rank if axis < 0 else axis


def _const_ints(tensors: Mapping[str, TensorInfo], name: str) -> list[int] | None:
    if not name or name not in tensors or tensors[name].value is None:
        return None
    return [int(v) for v in np.asarray(tensors[name].value).reshape(-1)]


def _passthrough(node: OpNode, tensors: Mapping[str, TensorInfo], data_inputs: int) -> DimLabels:
    """Outputs shaped like input 0 sharing its labels; inputs past `data_inputs` are not data."""
    namer = _Namer()
    labels = tuple(namer.fresh() for _ in _shape(tensors, node.inputs[0]))
    inputs: list[Labels | None] = [labels]
    inputs += [None] * (len(node.inputs) - 1) if data_inputs == 1 else []
    outputs = tuple(labels if _shape(tensors, o) == _shape(tensors, node.inputs[0]) else None
                    for o in node.outputs)
    return DimLabels(tuple(inputs), outputs)


# --------------------------------------------------------------------------- elementwise

ELEMENTWISE = (
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitShift", "Mod",
    "Neg", "Abs", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt",
    "Reciprocal", "Sin", "Cos", "Gelu", "Softplus", "Elu", "Selu", "Celu", "HardSigmoid",
    "HardSwish", "Mish", "Sign", "Floor", "Ceil", "Round", "Not", "IsNaN", "IsInf", "Cast",
    "CastLike", "Identity", "Clip",
)


@rule(*ELEMENTWISE)
def _elementwise(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    namer = _Namer()
    data = list(node.inputs)
    if node.op_type in ("Clip", "CastLike"):
        data = data[:1]  # Clip's bounds and CastLike's type donor are scalars/untouched
    shapes = [_shape(tensors, name) for name in data]
    labelled, out, whole = _broadcast_labels(shapes, _out_shape(node, tensors), namer)
    inputs: list[Labels | None] = list(labelled) + [None] * (len(node.inputs) - len(data))
    for index, name in enumerate(node.inputs):
        if not name:
            inputs[index] = None
    return DimLabels(tuple(inputs), (out,), whole_labels=frozenset(whole))


@rule("Dropout")
def _dropout(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    # Output and mask are shaped like the data; ratio and training_mode are scalars.
    return _passthrough(node, tensors, data_inputs=1)


@rule("Expand")
def _expand(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    namer = _Namer()
    labelled, out, whole = _broadcast_labels(
        [_shape(tensors, node.inputs[0])], _out_shape(node, tensors), namer)
    return DimLabels((labelled[0], None), (out,), whole_labels=frozenset(whole))


# --------------------------------------------------------------------------- contractions


@rule("MatMul")
def _matmul(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    a, b = _shape(tensors, node.inputs[0]), _shape(tensors, node.inputs[1])
    out_shape = _out_shape(node, tensors)
    namer = _Namer()
    k = namer.fresh("k")
    a_vec, b_vec = len(a) == 1, len(b) == 1
    batch_a = a[:-2] if not a_vec else ()
    batch_b = b[:-2] if not b_vec else ()
    batch_out = out_shape[: len(out_shape) - (0 if a_vec else 1) - (0 if b_vec else 1)]
    (la, lb), lbatch, whole = _broadcast_labels([batch_a, batch_b], batch_out, namer)
    m = namer.fresh("m") if not a_vec else None
    n = namer.fresh("n") if not b_vec else None
    a_labels = (k,) if a_vec else (*la, m, k)
    b_labels = (k,) if b_vec else (*lb, k, n)
    out = tuple(lbatch) + ((m,) if m else ()) + ((n,) if n else ())
    return DimLabels((a_labels, b_labels), (out,), sum_labels=frozenset({k}),
                     whole_labels=frozenset(whole))


@rule("Gemm")
def _gemm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    m, k, n = "m", "k", "n"
    a_labels = (k, m) if node.attrs.get("transA", 0) else (m, k)
    b_labels = (n, k) if node.attrs.get("transB", 0) else (k, n)
    inputs: list[Labels | None] = [a_labels, b_labels]
    whole: set[str] = set()
    if len(node.inputs) > 2 and node.inputs[2]:
        namer = _Namer()
        labelled, _, whole = _broadcast_labels([_shape(tensors, node.inputs[2])],
                                               _out_shape(node, tensors), namer)
        out_dims = _out_shape(node, tensors)
        c_shape = _shape(tensors, node.inputs[2])
        offset = len(out_dims) - len(c_shape)
        c_labels = tuple(
            (m, n)[offset + axis] if label not in whole else label
            for axis, label in enumerate(labelled[0])
        )
        inputs.append(c_labels)
    return DimLabels(tuple(inputs), ((m, n),), sum_labels=frozenset({k}),
                     whole_labels=frozenset(whole))


@rule("Einsum")
def _einsum(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Letters are labels; `...` dims are right-aligned, broadcast ones stay whole."""
    equation = str(node.attrs.get("equation", "")).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    shapes = [_shape(tensors, name) for name in node.inputs]
    if len(terms) != len(shapes):
        raise _NoRule
    # Ellipsis and implicit-output equations were declined before; both are labelled now.
    spans = [len(shape) - (len(term) - 3) if "..." in term else 0
             for term, shape in zip(terms, shapes, strict=True)]
    width = max(spans, default=0)
    ellipsis_sizes = [1] * width
    for span, shape, term in zip(spans, shapes, terms, strict=True):
        start = term.index("...") if "..." in term else 0
        for j, size in enumerate(shape[start:start + span]):
            if size != 1:
                ellipsis_sizes[width - span + j] = size
    namer = _Namer()
    whole: set[str] = set()
    inputs = []
    for span, shape, term in zip(spans, shapes, terms, strict=True):
        before, _, after = term.partition("...")
        labels = [f"e{c}" for c in before]
        start = len(before)
        for j in range(span):
            if shape[start + j] == ellipsis_sizes[width - span + j]:
                labels.append(f"E{width - span + j}")
            else:  # broadcast from size 1 against a larger dim
                labels.append(namer.fresh("w"))
                whole.add(labels[-1])
        labels += [f"e{c}" for c in after]
        inputs.append(tuple(labels))
    ellipsis = tuple(f"E{j}" for j in range(width))
    if rhs or "->" in equation:
        before, _, after = rhs.partition("...")
        out = (*[f"e{c}" for c in before], *(ellipsis if "..." in rhs else ()),
               *[f"e{c}" for c in after])
    else:  # implicit output: the ellipsis, then letters used exactly once, alphabetically
        letters = [c for term in terms for c in term.replace("...", "")]
        out = (*ellipsis, *[f"e{c}" for c in sorted(set(letters)) if letters.count(c) == 1])
    contracted = {label for term in inputs for label in term} - set(out)
    repeated = {label for term in inputs for label in term if term.count(label) > 1}
    return DimLabels(tuple(inputs), (out,), sum_labels=frozenset(contracted - repeated - whole),
                     whole_labels=frozenset(repeated | whole))


def replicated_labels(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """The labelling of an op without a rule: nothing labelled, so everything replicated."""
    return DimLabels(tuple(None for _ in node.inputs), tuple(None for _ in node.outputs))


class _NoRule(Exception):
    """Raised by a rule that cannot label this instance (e.g. an ellipsis einsum)."""


def safe_labels(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels | None:
    """labels_for, but None also when the rule declines this particular instance."""
    try:
        return labels_for(node, tensors)
    except _NoRule:
        return None


# --------------------------------------------------------------------------- layout ops


@rule("Transpose")
def _transpose(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    perm = node.attrs.get("perm") or list(reversed(range(rank)))
    labels = tuple(f"d{i}" for i in range(rank))
    return DimLabels((labels,), (tuple(labels[p] for p in perm),))


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Group dims whose products match; the leading dims of a group share a label."""
    source, target = _shape(tensors, node.inputs[0]), _out_shape(node, tensors)
    namer = _Namer()
    in_labels = [namer.fresh("w") for _ in source]
    out_labels = [namer.fresh("w") for _ in target]
    whole = set(in_labels) | set(out_labels)
    for in_group, out_group in _reshape_groups(source, target):
        label = namer.fresh()
        in_labels[in_group[0]] = label
        out_labels[out_group[0]] = label
    whole -= set(in_labels) & set(out_labels)
    extra = [None] * (len(node.inputs) - 1)
    return DimLabels((tuple(in_labels), *extra), (tuple(out_labels),),
                     whole_labels=frozenset(whole))


def _reshape_groups(
    source: Sequence[int], target: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Pairs of (input dims, output dims) with equal products, size-1 dims left out."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) and j < len(target):
        if source[i] == 1:
            i += 1
            continue
        if target[j] == 1:
            j += 1
            continue
        in_group, out_group = [i], [j]
        in_prod, out_prod = source[i], target[j]
        while in_prod != out_prod:
            if in_prod < out_prod:
                i += 1
                if i >= len(source):
                    return groups
                in_group.append(i)
                in_prod *= source[i]
            else:
                j += 1
                if j >= len(target):
                    return groups
                out_group.append(j)
                out_prod *= target[j]
        groups.append((in_group, out_group))
        i += 1
        j += 1
    return groups


@rule("Softmax", "LogSoftmax", "Hardmax")
def _softmax(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    axis = _attr_axis(node, "axis", rank, -1)  # opset >= 13: one axis, default the last
    labels = tuple(f"d{i}" for i in range(rank))
    return DimLabels((labels,), (labels,), whole_labels=frozenset({labels[axis]}))


@rule("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
def _layer_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = _shape(tensors, node.inputs[0])
    rank = len(shape)
    axis = _attr_axis(node, "axis", rank, -1)
    labels = tuple(f"d{i}" for i in range(rank))
    normalised = labels[axis:]
    inputs: list[Labels | None] = [labels]
    for name in node.inputs[1:]:
        inputs.append(normalised[len(normalised) - len(_shape(tensors, name)):] if name else None)
    stats = labels[:axis] + tuple(f"w{i}" for i in range(axis, rank))
    outputs = [labels] + [stats if name else None for name in node.outputs[1:]]
    return DimLabels(tuple(inputs), tuple(outputs),
                     whole_labels=frozenset(normalised) | frozenset(stats[axis:]))


@rule("BatchNormalization")
def _batch_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = _shape(tensors, node.inputs[0])
    labels = tuple(f"d{i}" for i in range(len(shape)))
    channel = labels[1:2]
    inputs = (labels, *[channel if name else None for name in node.inputs[1:]])
    outputs = [labels] + [channel if name else None for name in node.outputs[1:]]
    training = bool(node.attrs.get("training_mode", 0))
    stats = frozenset(labels[:1] + labels[2:])
    return DimLabels(inputs, tuple(outputs), sync_labels=stats if training else frozenset())


@rule("InstanceNormalization", "GroupNormalization")
def _instance_norm(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = _shape(tensors, node.inputs[0])
    labels = tuple(f"d{i}" for i in range(len(shape)))
    inputs = (labels, *[None for _ in node.inputs[1:]])
    return DimLabels(inputs, (labels,), whole_labels=frozenset(labels[1:]))


REDUCTIONS_SUM = ("ReduceSum", "ReduceMean")
REDUCTIONS_OTHER = ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                    "ReduceSumSquare", "ReduceLogSumExp", "ArgMax", "ArgMin")


@rule(*REDUCTIONS_SUM, *REDUCTIONS_OTHER)
def _reduce(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    shape = _shape(tensors, node.inputs[0])
    rank = len(shape)
    axes = _reduce_axes(node, tensors, rank)
    keep = bool(node.attrs.get("keepdims", 1))
    labels = tuple(f"d{i}" for i in range(rank))
    out = tuple(f"w{i}" if i in axes else labels[i] for i in range(rank) if keep or i not in axes)
    reduced = frozenset(labels[i] for i in axes)
    kept_ones = frozenset(label for label in out if label.startswith("w"))
    # An integer mean truncates: shard means cannot be summed into it, so the axes stay whole.
    exact = node.op_type == "ReduceSum" or tensors[node.inputs[0]].is_float
    if node.op_type in REDUCTIONS_SUM and exact:
        return DimLabels((labels, *[None] * (len(node.inputs) - 1)), (out,),
                         sum_labels=reduced, whole_labels=kept_ones)
    return DimLabels((labels, *[None] * (len(node.inputs) - 1)), (out,),
                     whole_labels=reduced | kept_ones)


def _reduce_axes(node: OpNode, tensors: Mapping[str, TensorInfo], rank: int) -> set[int]:
    axes = node.attrs.get("axes")
    if axes is None and node.op_type in ("ArgMax", "ArgMin"):
        axes = [node.attrs.get("axis", 0)]
    if axes is None and len(node.inputs) > 1:
        axes = _const_ints(tensors, node.inputs[1])
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return set()
        return set(range(rank))
    return {int(a) + rank if int(a) < 0 else int(a) for a in axes}


@rule("Gather")
def _gather(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Embedding lookup: a vocabulary-split table gives masked lookups summed over shards.

    Negative indices stay allowed: the local program wraps them against the whole axis first.
    """
    data, indices = _shape(tensors, node.inputs[0]), _shape(tensors, node.inputs[1])
    axis = _attr_axis(node, "axis", len(data), 0)
    data_labels = tuple(f"t{i}" for i in range(len(data)))
    index_labels = tuple(f"i{i}" for i in range(len(indices)))
    out = data_labels[:axis] + index_labels + data_labels[axis + 1:]
    return DimLabels((data_labels, index_labels), (out,),
                     sum_labels=frozenset({data_labels[axis]}))


@rule("Concat")
def _concat(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_out_shape(node, tensors))
    axis = _attr_axis(node, "axis", rank, 0)
    labels = tuple(f"d{i}" for i in range(rank))
    inputs = []
    for index, _ in enumerate(node.inputs):
        inputs.append(tuple(f"c{index}" if i == axis else labels[i] for i in range(rank)))
    out = tuple("c_out" if i == axis else labels[i] for i in range(rank))
    whole = {f"c{index}" for index in range(len(node.inputs))} | {"c_out"}
    return DimLabels(tuple(inputs), (out,), whole_labels=frozenset(whole))


@rule("Split")
def _split(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    axis = _attr_axis(node, "axis", rank, 0)
    labels = tuple(f"d{i}" for i in range(rank))
    source = tuple("s_in" if i == axis else labels[i] for i in range(rank))
    outputs = tuple(tuple(f"s{j}" if i == axis else labels[i] for i in range(rank)) if name
                    else None for j, name in enumerate(node.outputs))
    whole = {"s_in"} | {f"s{j}" for j in range(len(node.outputs))}
    return DimLabels((source, *[None] * (len(node.inputs) - 1)), outputs,
                     whole_labels=frozenset(whole))


@rule("Slice")
def _slice(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    return _unchanged_dims_pass(node, tensors,
                                lambda i: _slice_untouched(node, tensors, i, rank))


def _unchanged_dims_pass(node: OpNode, tensors: Mapping[str, TensorInfo],
                         untouched: Callable[[int], bool]) -> DimLabels:
    """Dims of equal size that the op leaves alone pass through; the others stay whole."""
    source, out = _shape(tensors, node.inputs[0]), _out_shape(node, tensors)
    labels_in, labels_out, whole = [], [], set()
    for i, (a, b) in enumerate(zip(source, out, strict=True)):
        if a == b and untouched(i):
            labels_in.append(f"d{i}")
            labels_out.append(f"d{i}")
        else:
            labels_in.append(f"w{i}")
            labels_out.append(f"v{i}")
            whole.update({f"w{i}", f"v{i}"})
    return DimLabels((tuple(labels_in), *[None] * (len(node.inputs) - 1)),
                     (tuple(labels_out),), whole_labels=frozenset(whole))


def _slice_untouched(node: OpNode, tensors: Mapping[str, TensorInfo], dim: int, rank: int) -> bool:
    """A dim of unchanged size may still be reversed by a negative step."""
    axes = _const_ints(tensors, node.inputs[3]) if len(node.inputs) > 3 else None
    steps = _const_ints(tensors, node.inputs[4]) if len(node.inputs) > 4 else None
    if axes is None:
        axes = list(range(len(_const_ints(tensors, node.inputs[1]) or [])))
    axes = [a + rank if a < 0 else a for a in axes]
    if steps is None or dim not in axes:
        return True
    return steps[axes.index(dim)] > 0


@rule("Conv")
def _conv(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Batch and output channels split freely; input channels give partial sums."""
    source = _shape(tensors, node.inputs[0])
    spatial = len(source) - 2
    groups = int(node.attrs.get("group", 1))
    cin = "cin" if groups == 1 else "cin_g"
    x = ("n", cin, *[f"x{i}" for i in range(spatial)])
    w = ("cout", "cin_w" if groups != 1 else cin, *[f"k{i}" for i in range(spatial)])
    y = ("n", "cout", *[f"y{i}" for i in range(spatial)])
    inputs: list[Labels | None] = [x, w]
    if len(node.inputs) > 2 and node.inputs[2]:
        inputs.append(("cout",))
    whole = {f"x{i}" for i in range(spatial)} | {f"k{i}" for i in range(spatial)}
    whole |= {f"y{i}" for i in range(spatial)}
    if groups != 1:
        whole |= {"cin_g", "cin_w", "cout"}
    return DimLabels(tuple(inputs), (y,), sum_labels=frozenset({"cin"} if groups == 1 else ()),
                     whole_labels=frozenset(whole))


@rule("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool")
def _pool(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    source = _shape(tensors, node.inputs[0])
    spatial = len(source) - 2
    x = ("n", "c", *[f"x{i}" for i in range(spatial)])
    y = ("n", "c", *[f"y{i}" for i in range(spatial)])
    outputs = tuple(y if name else None for name in node.outputs)
    whole = {f"x{i}" for i in range(spatial)} | {f"y{i}" for i in range(spatial)}
    return DimLabels((x,), outputs, whole_labels=frozenset(whole))


def _coupled_axes(node: OpNode, tensors: Mapping[str, TensorInfo],
                  axes: Sequence[int]) -> DimLabels:
    """Output shaped like input 0; work couples entries along `axes`, which stay whole."""
    labels = tuple(f"d{i}" for i in range(len(_shape(tensors, node.inputs[0]))))
    extra = [None] * (len(node.inputs) - 1)
    return DimLabels((labels, *extra), (labels,),
                     whole_labels=frozenset(labels[a] for a in axes))


@rule("Trilu")
def _trilu(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    return _coupled_axes(node, tensors, (-2, -1))


@rule("CumSum")
def _cumsum(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    axis = (_const_ints(tensors, node.inputs[1]) or [None])[0]
    if axis is None:
        raise _NoRule  # the axis is computed at run time
    return _coupled_axes(node, tensors, (axis + rank if axis < 0 else axis,))


@rule("TopK")
def _topk(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    rank = len(_shape(tensors, node.inputs[0]))
    axis = _attr_axis(node, "axis", rank, -1)
    labels = tuple(f"d{i}" for i in range(rank))
    out = tuple("k_out" if i == axis else labels[i] for i in range(rank))
    outputs = tuple(out if name else None for name in node.outputs)
    return DimLabels((labels, None), outputs, whole_labels=frozenset({labels[axis], "k_out"}))


@rule("OneHot")
def _one_hot(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    labels = tuple(f"d{i}" for i in range(len(_shape(tensors, node.inputs[0]))))
    axis = _attr_axis(node, "axis", len(_out_shape(node, tensors)), -1)
    out = (*labels[:axis], "depth", *labels[axis:])
    return DimLabels((labels, None, None), (out,), whole_labels=frozenset({"depth"}))


@rule("Tile")
def _tile(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
    """Dims repeated once pass through; a repeated dim is a new, whole dim."""
    return _unchanged_dims_pass(node, tensors, lambda _: True)


# Rule families kept in their own modules register themselves on import.
from planner.sharding import rules_indexing  # noqa: E402,F401
