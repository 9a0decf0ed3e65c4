"""What autograd keeps of one op for its backward pass: its saved-tensor rule.

The rules follow what torch's autograd saves for the matching aten op
(`tools/autograd/derivatives.yaml`): a GEMM keeps each operand the other operand's
gradient needs, softmax its output, dropout a one-byte mask, GELU its input, a
normalisation its input and its per-row statistics, additions nothing. A tensor is
saved once however many ops keep it. Summed over a GPT layer these rules give
Korthikanti et al. 2022's `sbh(34 + 5as/h)` (tests/test_saved_memory.py).

`saved_tensors` applies them to a graph: which activations stay alive until the backward
pass, and the extra buffers kept beside some of them (a dropout mask the graph does not
name, as a multiple of the tensor it masks; a norm's statistics beside its input).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

from planner.graph import OpNode, PlanningGraph, TensorInfo

STATISTIC_BYTES = 4  # norms keep their per-row mean / inverse std in fp32


@dataclass(frozen=True)
class Saves:
    """What one op keeps when a gradient flows through it.

    - `inputs`, `outputs`: kept whenever the op is differentiated (GELU's input,
      softmax's output);
    - `operands`: each input kept when another input needs a gradient (a GEMM or a
      product: d(a·b)/da needs b), among `operand_slots` where given (a Gemm's or a
      convolution's bias is no operand: its gradient is the output's summed, `addmm`
      keeps neither it nor anything for it);
    - `divisor`: Div's rule (the divisor always, the numerator for the divisor's gradient);
    - `mask`: a one-byte mask shaped like output 0 (dropout): its mask output when the
      graph has one, else an extra buffer beside output 0;
    - `row_statistics`: fp32 values per normalised row kept beside input 0 (norms);
    - `gradient_views`, `every_gradient_view`: the inputs whose gradient is the output's
      gradient itself, no kernel computing it (an addition's terms: `AddBackward` hands
      the gradient on), summed down to the input's shape where it was broadcast;
    - `gradient_parts`: each input's gradient is its slice of the output's (a
      concatenation's parts: narrowed views), no kernel either;
    - `eager_backward`: per input slot, (passes over the output's bytes, kernels) that
      eager torch's derivative formula runs for that input's gradient where it is a chain
      of kernels with temporaries of its own (`tools/autograd/derivatives.yaml`: `pow`'s
      `grad * (exponent * self.pow(exponent - 1))` is 3 kernels and 7 passes, not the 3
      passes of one kernel reading the gradient and the input and writing the result);
      a fused kernel computes it in one pass instead;
    - `per_input_kernels`: each input's gradient is a kernel of its own that reads the
      output's gradient and what the op kept (Where's branches).
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    operands: bool = False
    operand_slots: tuple[int, ...] = ()
    divisor: bool = False
    mask: bool = False
    row_statistics: int = 0
    every_output: bool = False  # an op nothing is known of: all its float outputs
    gradient_views: tuple[int, ...] = ()
    every_gradient_view: bool = False
    gradient_parts: bool = False
    eager_backward: tuple[tuple[int, float, int], ...] = ()  # (slot, passes, kernels)
    per_input_kernels: bool = False  # each input's gradient a kernel reading all it needs
    #: input slots the backward pass reads whenever a gradient flows, kept beside the
    #: activations as weights are (a norm's scale and shift: `native_layer_norm` saves
    #: both), not counted as saved memory: `weights_read_backward`
    reads: tuple[int, ...] = ()

    def views_gradient(self, slot: int) -> bool:
        return self.every_gradient_view or slot in self.gradient_views


NOTHING = Saves()
INPUT = Saves(inputs=(0,))
OUTPUT = Saves(outputs=(0,))
INPUT_AND_OUTPUT = Saves(inputs=(0,), outputs=(0,))
OPERANDS = Saves(operands=True)
BIASED_OPERANDS = Saves(operands=True, operand_slots=(0, 1))  # Gemm, Conv: bias aside
#: batch, instance and group norms: the input, and the scale the backward pass reads
SCALED_INPUT = Saves(inputs=(0,), reads=(1,))
MASK = Saves(mask=True)
#: Where keeps its condition to route the gradient, one kernel per branch needing one
#: (`where(cond, grad, 0)`, `where(cond, 0, grad)`)
CONDITION = Saves(inputs=(0,), per_input_kernels=True)
UNKNOWN = Saves(every_output=True)
#: Derivative formulas that run several kernels (derivatives.yaml; each counted against
#: torch's kernels in tests/test_backward_traffic.py): (slot, passes, kernels).
POWER = Saves(inputs=(0,), eager_backward=((0, 7.0, 3),))  # self.pow(e-1), * e, * grad
SQUARE_ROOT = Saves(outputs=(0,), eager_backward=((0, 5.0, 2),))  # grad / (2 * result)
RECIPROCAL = Saves(outputs=(0,), eager_backward=((0, 7.0, 3),))  # -grad * (result * result)
ERROR_FUNCTION = Saves(inputs=(0,), eager_backward=((0, 11.0, 5),))  # 2/√π·exp(-x²)·grad
SINE = Saves(inputs=(0,), eager_backward=((0, 5.0, 2),))  # grad * self.cos()
COSINE = Saves(inputs=(0,), eager_backward=((0, 7.0, 3),))  # grad * -self.sin()
#: Div: grad / other for the numerator; -grad * ((self / other) / other) for the divisor
QUOTIENT = Saves(divisor=True, eager_backward=((0, 3.0, 1), (1, 11.0, 4)))
SUM = Saves(every_gradient_view=True)  # Add, Sum: each term gets the gradient
CONCATENATION = Saves(gradient_parts=True)
DIFFERENCE = Saves(gradient_views=(0,))  # Sub: the subtrahend's is negated by a kernel
IDENTITY = Saves(gradient_views=(0,))


def norm(statistics: int, reads: tuple[int, ...] = (1,)) -> Saves:
    """A normalisation: its input and `statistics` fp32 values per normalised row, and
    its scale (and shift, where `reads` says) read by the backward pass."""
    return Saves(inputs=(0,), row_statistics=statistics, reads=reads)


class Kept(NamedTuple):
    """One tensor an op keeps (`extra` 0), or an extra buffer beside it of `extra` times
    its bytes (a mask the graph does not name, per-row statistics)."""

    tensor: str
    extra: float = 0.0


def gradient_flows(node: OpNode, needs_grad: Mapping[str, bool]) -> bool:
    """Whether a gradient flows back through `node`: one of its outputs carries one. A
    graph's ops of which this holds are `GraphAnalysis.differentiated`, found once."""
    return any(needs_grad.get(o, False) for o in node.outputs if o)


def kept_by(node: OpNode, rule: Saves, tensors: Mapping[str, TensorInfo],
            needs_grad: Mapping[str, bool], flows: bool | None = None) -> list[Kept]:
    """What `node` keeps for its backward pass; nothing when no gradient flows through
    it (`flows`, where the caller knows it: `gradient_flows`)."""
    if not (gradient_flows(node, needs_grad) if flows is None else flows):
        return []
    inputs = list(node.inputs)
    kept: list[Kept] = []

    def keep(name: str, extra: float = 0.0) -> None:
        if name:
            kept.append(Kept(name, extra))

    for slot in rule.inputs:
        if slot < len(inputs):
            keep(inputs[slot])
            if rule.row_statistics and inputs[slot]:
                info = tensors[inputs[slot]]
                row = info.shape[-1] if info.shape else 1
                keep(inputs[slot], rule.row_statistics * STATISTIC_BYTES / (row * info.itemsize))
    for slot in rule.outputs:
        if slot < len(node.outputs):
            keep(node.outputs[slot])
    if rule.every_output:
        for name in node.outputs:
            if name and tensors[name].is_float:
                keep(name)
    if rule.operands:
        slots = rule.operand_slots or tuple(range(len(inputs)))
        grads = {slot: bool(inputs[slot]) and needs_grad.get(inputs[slot], False)
                 for slot in slots if slot < len(inputs)}
        for slot in grads:
            if any(grads[other] for other in grads if other != slot):
                keep(inputs[slot])
    if rule.divisor and len(inputs) >= 2:
        keep(inputs[1])
        if needs_grad.get(inputs[1], False):
            keep(inputs[0])
    if rule.mask and node.outputs and node.outputs[0]:
        if len(node.outputs) > 1 and node.outputs[1]:
            keep(node.outputs[1])
        else:
            keep(node.outputs[0], 1.0 / tensors[node.outputs[0]].itemsize)
    return kept


@dataclass
class SavedTensors:
    """What autograd keeps of a graph: whole activations, and extra buffers beside some
    (as a multiple of that tensor's bytes)."""

    whole: set[str]
    extra: dict[str, float]

    def share(self, name: str) -> float:
        """The multiple of `name`'s bytes kept for the backward pass."""
        return (1.0 if name in self.whole else 0.0) + self.extra.get(name, 0.0)


def saved_tensors(graph: PlanningGraph, needs_grad: Mapping[str, bool],
                  rule_of: Mapping[str, Saves], differentiated: AbstractSet[str]) -> SavedTensors:
    """Activations kept for the backward pass.

    `rule_of` gives each op's rule by name, `differentiated` the ops a gradient flows
    back through (`gradient_flows`). Weights, buffers and graph inputs are not
    activations (a weight is counted as a weight; an input as the batch's own memory), and
    a view keeps its source buffer, so two views of one tensor are kept once.
    """
    tensors = graph.tensors
    saved = SavedTensors(set(), {})
    for node in graph.ops:
        if node.name not in differentiated:
            continue
        for kept in kept_by(node, rule_of[node.name], tensors, needs_grad, True):
            base = buffer_of(graph, kept.tensor)
            if tensors[base].producer is None:
                continue
            if kept.extra:
                saved.extra[base] = saved.extra.get(base, 0.0) + kept.extra
            else:
                saved.whole.add(base)
    return saved


def weights_read_backward(graph: PlanningGraph, needs_grad: Mapping[str, bool],
                          rule_of: Mapping[str, Saves],
                          differentiated: AbstractSet[str]) -> frozenset[str]:
    """The parameters the backward pass reads: kept by an op a gradient flows through
    (a GEMM's weight where its other operand needs a gradient; through views), or read
    by its rule whenever one does (a norm's scale). ZeRO 3 gathers only these again
    before the backward pass: an embedding table (a Gather keeps only its indices), or the
    first GEMM's weight where its input is data, is never read there, and a run gathering
    only what autograd unpacks issued fewer gathers than a plan listing every weight."""
    tensors = graph.tensors
    read: set[str] = set()
    for node in graph.ops:
        if node.name not in differentiated:
            continue
        rule = rule_of[node.name]
        names = [kept.tensor for kept in kept_by(node, rule, tensors, needs_grad, True)
                 if not kept.extra]
        for name in names:
            base = _weight_of(graph, name)
            if tensors[base].kind == "parameter":
                read.add(base)
        for slot in rule.reads:
            if slot < len(node.inputs) and node.inputs[slot]:
                read.update(_parameters_laid_out_as(graph, node.inputs[slot]))
    return frozenset(read)


#: ops an export lays weights out with for an op that reads them in its own layout
#: (torch's LSTM gates i, f, g, o sliced and concatenated into ONNX's i, o, f, c): torch
#: runs the op on the parameters themselves, so its backward pass reads those
_WEIGHT_LAYOUTS = frozenset({"Slice", "Split", "Concat"})


def _parameters_laid_out_as(graph: PlanningGraph, name: str) -> set[str]:
    """The parameters the tensor `name` is laid out from, through views, slices,
    splits and concatenations of them (every part of a Concat)."""
    found: set[str] = set()
    pending = [name]
    while pending:
        current = pending.pop()
        info = graph.tensors[current]
        if info.kind == "parameter":
            found.add(current)
            continue
        if info.producer is None:
            continue
        node = graph.op(info.producer)
        if node.op_type == "Concat":
            pending.extend(part for part in node.inputs if part)
        elif (node.op_type in _WEIGHT_VIEWS or node.op_type in _WEIGHT_LAYOUTS) \
                and node.inputs and node.inputs[0]:
            pending.append(node.inputs[0])
    return found


#: ops torch runs as views of a weight (`weight.t()`, a reshape): what autograd keeps of
#: them is the weight's own storage
_WEIGHT_VIEWS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                           "Expand", "Identity"})


def _weight_of(graph: PlanningGraph, name: str) -> str:
    """The tensor `name` is a view of, through the ops torch runs as views."""
    return _source(graph, name, lambda node: node.op_type in _WEIGHT_VIEWS)


def buffer_of(graph: PlanningGraph, name: str) -> str:
    """The tensor whose buffer `name` shares: through views to the first real output."""
    return _source(graph, name, lambda node: node.is_view)


def _source(graph: PlanningGraph, name: str, passes: Callable[[OpNode], bool]) -> str:
    """`name` followed back through the ops `passes` (each its input 0's view) to the
    first tensor an op that does not pass makes, or a graph input or weight."""
    tensors = graph.tensors
    while True:
        producer = tensors[name].producer
        if producer is None:
            return name
        node = graph.op(producer)
        if not passes(node) or not node.inputs or not node.inputs[0]:
            return name
        name = node.inputs[0]


def backward_kernels(node: OpNode, rule: Saves, tensors: Mapping[str, TensorInfo],
                     needs_grad: Mapping[str, bool]) -> tuple[float, int]:
    """Bytes one op's backward kernels move, unfused, and how many they are: they read its
    outputs' gradients, write its float inputs' gradients (a gradient view writes
    nothing, or the reduced gradient of an input it broadcast, a kernel of its own) and
    read what it kept (`kept_by`). A product (or a quotient) computes each operand's
    gradient in a kernel of its own, from the output's gradient and the other operands
    (`derivatives.yaml`: `mul`'s `grad * other`, `grad * self`). None when no gradient
    flows through it, or every input's gradient is a view of the output's (a residual
    addition runs no backward kernel)."""
    outputs = [o for o in node.outputs if o and needs_grad.get(o, False)]
    if not outputs:
        return 0.0, 0
    shape = tensors[outputs[0]].shape
    computed = [name for slot, name in enumerate(node.inputs)
                if name and needs_grad.get(name, False) and tensors[name].is_float
                and not (rule.gradient_parts
                         or (rule.views_gradient(slot) and tensors[name].shape == shape))]
    if not computed:
        return 0.0, 0
    read = sum(tensors[o].nbytes for o in outputs)
    if rule.eager_backward:
        unit = tensors[outputs[0]].nbytes
        chains = [(passes, kernels) for slot, passes, kernels in rule.eager_backward
                  if slot < len(node.inputs) and node.inputs[slot] in computed]
        return unit * sum(p for p, _ in chains), sum(k for _, k in chains)
    if rule.operands or rule.divisor:  # one kernel per operand's gradient
        moved = 0.0
        for slot, name in enumerate(node.inputs):
            if name in computed:
                others = sum(tensors[o].nbytes for k, o in enumerate(node.inputs)
                             if o and k != slot)
                moved += read + others + tensors[name].nbytes
        return moved, len(computed)
    written = sum(tensors[name].nbytes for name in computed)
    kept = sum(tensors[k.tensor].nbytes * (k.extra or 1.0)
               for k in kept_by(node, rule, tensors, needs_grad, True))  # `outputs` flow
    if rule.per_input_kernels:
        return len(computed) * (read + kept) + written, len(computed)
    views = rule.views_gradient(0) or rule.every_gradient_view
    return read + written + kept, len(computed) if views else 1
