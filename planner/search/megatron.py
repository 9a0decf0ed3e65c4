"""The Megatron-style baseline: tensor parallel inside a node × data parallel across nodes.

The data-parallel axis carries the batch as in `data_parallel`. The tensor-parallel axis
follows Megatron-LM's pattern, derived from the graph instead of hand-written per layer:
a GEMM with a weight whose activation input is replicated splits the weight's output dim
(column parallel: QKV, the first MLP matmul); an embedding lookup splits its table's
vocabulary (a partial sum, reduced once); an op whose activation input is already split
along a dim it contracts keeps that split (row parallel: a partial sum, reduced once);
every other op carries an existing split along, and norms, biases and residual additions
of a replicated input stay replicated. A fused QKV projection whose output a Split cuts
into q, k and v (the zoo GPT, Hugging Face GPT-2) cannot carry a head split through the
Split, so its attention stays replicated: Megatron lays the fused weight out per head.

With `sequence_parallel` (Korthikanti et al. 2022, §4.2.2: Megatron's `--sequence-parallel`)
the ops Megatron keeps replicated over tp (norms, dropout, bias and residual additions on
[batch, sequence, hidden] activations) split the sequence over tp instead: the
row-parallel GEMM's partial sum is reduce-scattered into them and all-gathered again
before the next column-parallel GEMM, which reads its input whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet

from planner.graph import OpNode, PlanningGraph
from planner.ops import DimLabels, is_matrix_op
from planner.sharding.analysis import weight_roots_map
from planner.sharding.batch import data_parallel_strategies
from planner.sharding.mesh import DeviceMesh
from planner.sharding.outputs import resolved_output_slots
from planner.sharding.strategy import REPLICATED, OpStrategy, is_valid, output_layouts


def megatron_strategies(graph: PlanningGraph, mesh: DeviceMesh,
                        labels: Mapping[str, DimLabels | None], dp_axis: str = "dp",
                        tp_axis: str = "tp", sequence_parallel: bool = False,
                        weight_roots: Mapping[str, frozenset[str]] | None = None
                        ) -> dict[str, OpStrategy]:
    """Megatron's layout of every op (see the module doc). A GEMM's weight may be a
    parameter or computed from parameters alone (`weight_roots`, the graph's own when not
    given): the dynamo exporter writes `nn.Linear` as `MatMul(x, Transpose(W))`; the split
    the GEMM chooses is then carried back through those ops to the parameter."""
    weights = weight_roots if weight_roots is not None else weight_roots_map(graph)
    producer = {o: node for node in graph.ops for o in node.outputs if o}
    data = data_parallel_strategies(graph, DeviceMesh.build(
        {dp_axis: mesh.axis_size(dp_axis)}, mesh.devices_per_node), labels, dp_axis) \
        if dp_axis in mesh.axis_names else {}
    split: dict[str, int] = {}  # tensor -> dim split over tp
    sequence: set[str] = set()  # tensors split along the sequence (sequence parallelism)
    result: dict[str, OpStrategy] = {}

    def carried(tensor: str, dim: int) -> Iterator[tuple[str, int]]:
        """Split `tensor`, computed from parameters alone, along `dim` over tp where it is
        computed; then, input by input, lay out its parameters and yield the tensors
        computed from parameters to carry the split back to (a GEMM's transposed weight)."""
        node = producer.get(tensor)
        op_labels = labels.get(node.name) if node is not None else None
        if node is None or op_labels is None or tensor in split:
            return
        names = op_labels.outputs[node.outputs.index(tensor)]
        if names is None or names[dim] in op_labels.sum_labels:
            return
        label = names[dim]
        candidate = OpStrategy.of({label: (tp_axis,)})
        if not is_valid(node, op_labels, candidate, graph.tensors, mesh):
            return
        result[node.name] = candidate
        split[tensor] = dim
        for name, in_names in zip(node.inputs, op_labels.inputs, strict=False):
            if name and in_names is not None and label in in_names:
                if graph.tensors[name].kind == "parameter":
                    split.setdefault(name, in_names.index(label))
                elif name in weights:
                    yield name, in_names.index(label)

    def carry_back(tensor: str, dim: int) -> None:
        """`carried` depth first, each input's tensors before the next input's, with a
        stack rather than recursion: a closure calling itself is a reference cycle, which
        would keep this call's tables alive until the cyclic collector runs (paused while
        planning)."""
        stack = [carried(tensor, dim)]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
            else:
                stack.append(carried(*step))

    resolved = resolved_output_slots(graph)
    # Sequence parallelism splits the activations (what the model's inputs flow into),
    # not what the graph computes from constants alone (rotary tables from positions)
    activations = set(graph.inputs)
    for node in graph.ops:
        op_labels = labels.get(node.name)
        batch = dict(data[node.name].assignment) if node.name in data else {}
        if op_labels is None:
            result[node.name] = REPLICATED
            continue
        chosen = None
        for label in _tp_choices(node, op_labels, graph, split, set(batch), sequence,
                                 weights):
            candidate = OpStrategy.of({**batch, label: (tp_axis,)})
            if is_valid(node, op_labels, candidate, graph.tensors, mesh) and not \
                    _leaves_output_partial(node, op_labels, candidate, graph,
                                           resolved.get(node.name, ())):
                chosen = candidate
                break
        along_sequence = False
        flowing = any(name in activations for name in node.inputs if name)
        if flowing:
            activations.update(name for name in node.outputs if name)
        if chosen is None and sequence_parallel and flowing:
            along = _sequence_label(node, op_labels, graph, set(batch))
            sliced = OpStrategy.of({**batch, along: (tp_axis,)}) if along else None
            if sliced and is_valid(node, op_labels, sliced, graph.tensors, mesh):
                chosen, along_sequence = sliced, True
        if chosen is None:
            chosen = OpStrategy.of(batch) if batch else REPLICATED
        result[node.name] = chosen
        tp_label = next((k for k, axes in chosen.assignment if tp_axis in axes), None)
        along_sequence = along_sequence or any(
            name in sequence and names is not None and names[split[name]] == tp_label
            for name, names in zip(node.inputs, op_labels.inputs, strict=False))
        for name, names in zip(node.outputs, op_labels.outputs, strict=True):
            if name and names is not None and tp_label in names:
                split[name] = names.index(tp_label)
                if along_sequence:
                    sequence.add(name)
        for name, names in zip(node.inputs, op_labels.inputs, strict=False):
            if name and names is not None and tp_label in names:
                if graph.tensors[name].kind == "parameter":
                    split.setdefault(name, names.index(tp_label))  # as its first reader lays it
                elif name in weights:
                    carry_back(name, names.index(tp_label))
    return result


def _leaves_output_partial(node: OpNode, labels: DimLabels, strategy: OpStrategy,
                           graph: PlanningGraph, slots: tuple[int, ...]) -> bool:
    """Whether `strategy` writes one of the graph output `slots` as a pending sum: the
    last row-parallel GEMM of a model whose output it is reads its input gathered instead
    (`planner.sharding.outputs`), the gather priced on the edge."""
    if not slots:
        return False
    ranks = [len(graph.tensors[t].shape) if t else -1 for t in node.outputs]
    layouts = output_layouts(labels, strategy, ranks)
    return any((found := layouts[slot]) is not None and bool(found.partial)
               for slot in slots)


def _sequence_label(node: OpNode, labels: DimLabels, graph: PlanningGraph,
                    taken: set[str]) -> str | None:
    """The sequence label of an op on [batch, sequence, hidden] activations: its first
    output's dim 1, when it is neither the batch nor a contracted dim."""
    names = labels.outputs[0] if labels.outputs else None
    out = node.outputs[0] if node.outputs else ""
    if names is None or not out or len(graph.tensors[out].shape) < 3 \
            or not graph.tensors[out].is_float:  # activations, not masks or positions
        return None
    label = names[1]
    return None if label in taken or label in labels.sum_labels else label


def _tp_choices(node: OpNode, labels: DimLabels, graph: PlanningGraph,
                split: Mapping[str, int], taken: set[str],
                sequence: AbstractSet[str] = frozenset(),
                weights: AbstractSet[str] | Mapping[str, object] = frozenset()) -> list[str]:
    """Labels to try for the tp axis, best first. A GEMM does not carry a sequence split
    (sequence parallelism): it reads that input gathered. An input computed from
    parameters alone (`weights`) counts as a weight."""
    carried: list[str] = []
    activation_labels: set[str] = set()
    weight_labels: list[str] = []
    for index, name in enumerate(node.inputs):
        names = labels.inputs[index] if index < len(labels.inputs) else None
        if not name or names is None:
            continue
        info = graph.tensors[name]
        if info.kind == "parameter" or name in weights:
            weight_labels += [n for n in names if n not in weight_labels]
            if name in split and not is_matrix_op(node.op_type):
                carried.append(names[split[name]])  # a tied table's transpose, say
            continue
        activation_labels.update(names)
        if name in split and not (name in sequence and is_matrix_op(node.op_type)):
            carried.append(names[split[name]])
    if carried:
        return [label for label in dict.fromkeys(carried) if label not in taken]
    if not weight_labels:
        return []
    vocabulary = [n for n in weight_labels if n in labels.sum_labels
                  and n not in activation_labels]
    if node.op_type == "Gather":
        return [label for label in vocabulary if label not in taken]
    if not is_matrix_op(node.op_type):
        return []  # a norm's scale, a bias: replicated with its replicated input
    outputs = {n for names in labels.outputs if names is not None for n in names}
    column = [n for n in weight_labels if n in outputs and n not in activation_labels]
    return [label for label in column if label not in taken]
