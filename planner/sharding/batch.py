"""Which label of each op carries the batch (or the sequence): a split of some input dims
followed through the graph.

The batch dim of each graph input is split over one mesh axis; each op then splits
whichever of its labels carries an already-split input dim, so the split follows the
batch through reshapes and transposes. An op that cannot keep it (a rule says the dim
must stay whole, or no rule exists) runs replicated and its inputs are gathered. This one
trace is the data-parallel baseline, the meaning of a pinned dp axis, and (at the whole
batch) the graph analysis's batch labels.

The same trace from the sequence dims of the sequence inputs (`PlanningGraph.
sequence_inputs`) gives the labels that carry the sequence (`sequence_labels`): what the
context-parallel axis may split. There an op can carry the sequence in several labels at
once (q kᵀ has the queries' and the keys' positions): every label that carries a split
input dim and can be split alone is one, and each is followed to the outputs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from planner.errors import StrategyError
from planner.graph import OpNode, PlanningGraph
from planner.kinds import AxisRole
from planner.ops import DimLabels
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.strategy import REPLICATED, OpStrategy, is_valid, single_split

DP_AXIS: str = AxisRole.DATA


def data_parallel_strategies(
    graph: PlanningGraph,
    mesh: DeviceMesh,
    labels: Mapping[str, DimLabels | None],
    axis: str = DP_AXIS,
) -> dict[str, OpStrategy]:
    """Per-op strategies that carry the batch split through the graph."""
    return trace_batch(graph, mesh, labels, axis).strategies


@dataclass(frozen=True)
class BatchTrace:
    """The batch split followed through a graph: each op's strategy, the dims of each
    tensor that carry the split, and the first op whose inputs carry it in two labels
    (`rows_meet`)."""

    strategies: dict[str, OpStrategy]
    carried: dict[str, set[int]]  # tensor -> its dims that carry the split
    #: the first op reading rows of the batch against other rows of it: the split reaches
    #: it in two labels (q kᵀ of a sequence-first input whose dim 0 was taken for the
    #: batch pairs query and key positions), or it combines rows with what other rows
    #: made (a batch's mean subtracted from each row; a softmax, scan or flip over the
    #: batch, which cannot keep the split); or the op writing a non-scalar output made
    #: from several rows or whose rows the trace lost. Micro-batches would then each see
    #: part of what every row reads: a different model, not a share of the same batch.
    rows_meet: str | None


def trace_batch(graph: PlanningGraph, mesh: DeviceMesh, labels: Mapping[str, DimLabels | None],
                axis: str = DP_AXIS) -> BatchTrace:
    """The batch split over `axis` followed through the graph (`BatchTrace`)."""
    degree = mesh.axis_size(axis)
    if degree > 1 and graph.batch is not None and graph.batch % degree:
        raise StrategyError(
            f"{graph.path}: batch {graph.batch} cannot be split into {degree} equal parts "
            f"for data parallelism; use a batch that is a multiple of {degree}"
        )
    split_dim: dict[str, set[int]] = {}
    if degree > 1:
        split_dim = {name: {dim} for name, dim in graph.batch_inputs.items()
                     if graph.tensors[name].shape[dim] % degree == 0}
    strategies: dict[str, OpStrategy] = {}
    # tensors computed from several rows of the batch that no longer carry it (a sum over
    # the batch, a batch norm's statistics, an op that could not keep the split)
    mixed: set[str] = set()
    # tensors computed from the batch at all (carried, mixed, or where the trace lost it),
    # followed only where the batch is not dim 0 of every input (below)
    leading = all(dim == 0 for dim in graph.batch_inputs.values())
    touched: set[str] = set() if leading else set(split_dim)
    meets: list[str] = []
    for node in graph.ops:
        op_labels = labels.get(node.name)
        reads_rows = any(name in split_dim for name in node.inputs if name)
        reads_mixed = any(name in mixed for name in node.inputs if name)
        if not leading and any(name in touched for name in node.inputs if name):
            touched.update(o for o in node.outputs if o)
        weight = _carried(graph, node, op_labels, split_dim) if op_labels is not None else {}
        if len(weight) > 1 or (reads_mixed and reads_rows):
            meets.append(node.name)  # rows read against other rows
        chosen = REPLICATED
        for label in sorted(weight, key=lambda k: (-weight[k], k)):
            candidate = single_split(label, (axis,))
            assert op_labels is not None  # (no labels: no carried label to try)
            if is_valid(node, op_labels, candidate, graph.tensors, mesh):
                chosen = candidate
                break
        strategies[node.name] = chosen
        if chosen is not REPLICATED:
            assert op_labels is not None
            _follow(node, op_labels, {chosen.assignment[0][0]}, split_dim)
        # a view that cannot carry the split (a sequence-first [seq, batch, d] merged into
        # [seq·batch, d]) moves no row into another: the trace only loses the batch there
        if reads_mixed or (reads_rows and not node.is_view
                           and not any(o in split_dim for o in node.outputs if o)):
            mixed.update(o for o in node.outputs if o and o not in split_dim)
    # a mixed output is the loss when it is one number (the mean over the batch); else
    # its rows depend on other rows. Where the batch is not dim 0 of every input, an
    # output computed from it whose rows the trace lost (a sequence-first [seq, batch,
    # vocab] flattened to [seq·batch, vocab]) has no rows a micro-batch's targets could
    # be cut along; with the batch first, its rows lead whatever it becomes (tokens
    # reshaped into sequences of 128, which the whole batch's split cannot follow)
    meets += [graph.tensors[name].producer or name for name in graph.outputs
              if name in mixed and graph.tensors[name].numel > 1]
    meets += [graph.tensors[name].producer or name for name in graph.outputs
              if name in touched and graph.tensors[name].numel > 1
              and len(split_dim.get(name, ())) != 1]
    first = None
    if meets:  # the earliest in op order (an output's producer may come before an op's)
        order = {node.name: index for index, node in enumerate(graph.ops)}
        first = min(meets, key=lambda name: order.get(name, len(order)))
    return BatchTrace(strategies, split_dim, first)


def rows_meet_reason(graph: PlanningGraph, op: str) -> str:
    """Why micro-batches cannot cut a batch whose rows meet at `op`
    (`BatchTrace.rows_meet`), and what to do: one line for a plan's warning or an
    error."""
    taken = ", ".join(f"dim {dim} of {name}" for name, dim in graph.batch_inputs.items())
    return (f"op {op} reads rows of the batch ({taken}) against other rows of it (a "
            "product, sum, softmax or scan over them), or writes an output whose rows are "
            "not the batch's, so micro-batches would each see part of what a row reads, a "
            "different model; if the batch is another dim (a sequence-first [seq, batch] "
            'input), name its symbol "batch" in the export (torch.export.Dim("batch"))')


def _carried(graph: PlanningGraph, node: OpNode, op_labels: DimLabels,
             carried: Mapping[str, set[int]]) -> dict[str, int]:
    """The labels of `node` that label a carried dim of one of its inputs, each with the
    bytes of the inputs it carries (the step of the trace both splits share)."""
    weight: dict[str, int] = {}
    for index, name in enumerate(node.inputs):
        names = op_labels.inputs[index] if index < len(op_labels.inputs) else None
        if name in carried and names is not None:
            for dim in carried[name]:
                weight[names[dim]] = weight.get(names[dim], 0) + graph.tensors[name].nbytes
    return weight


def _follow(node: OpNode, op_labels: DimLabels, kept: AbstractSet[str],
            carried: dict[str, set[int]]) -> None:
    """Mark the dims of `node`'s outputs labelled by a `kept` label as carried."""
    for name, names in zip(node.outputs, op_labels.outputs, strict=True):
        if name and names is not None:
            dims = {k for k, label in enumerate(names) if label in kept}
            if dims:
                carried[name] = dims


def sequence_labels(graph: PlanningGraph,
                    labels: Mapping[str, DimLabels | None]) -> dict[str, frozenset[str]]:
    """Per op, the labels that carry the whole sequence: the sequence dims of the sequence
    inputs followed through the graph (every label of an op that reads a carried dim and
    may be split over an axis of the sequence's length, as the batch trace does)."""
    length = graph.sequence
    if length is None:
        return {}
    carried: dict[str, set[int]] = {name: {dim} for name, dim in graph.sequence_inputs.items()}
    return trace_labels(graph, labels, carried, str(AxisRole.CONTEXT), length)


def trace_labels(graph: PlanningGraph, labels: Mapping[str, DimLabels | None],
                 carried: dict[str, set[int]], axis: str,
                 size: int) -> dict[str, frozenset[str]]:
    """Per op, the labels that carry a `carried` dim (tensor -> dims) followed through the
    graph: every label of an op that reads a carried dim and may be split alone over an
    `axis` of `size` (the whole dim), each followed to the outputs. The sequence's trace
    (`sequence_labels`) and the experts' (`planner.sharding.experts`)."""
    mesh = DeviceMesh.build({axis: size}, 1)
    found: dict[str, frozenset[str]] = {}
    for node in graph.ops:
        op_labels = labels.get(node.name)
        if op_labels is None:
            continue
        kept = frozenset(label for label in _carried(graph, node, op_labels, carried) if is_valid(
            node, op_labels, single_split(label, (axis,)), graph.tensors, mesh))
        if not kept:
            continue
        found[node.name] = kept
        _follow(node, op_labels, kept, carried)
    return found


def dp_splits_exactly(assigned: Mapping[str, tuple[str, ...]], batch: Collection[str],
                      axis: str = DP_AXIS, together: tuple[str, ...] | None = None) -> bool:
    """Whether an op's assignment puts `axis` on exactly its batch labels, alone: what
    pinning dp means (the axis splits the batch and nothing else). `together`: the axes
    that split the batch as one, outermost first (("dp", "ep") outside expert layers:
    `planner.sharding.experts`); each label of the batch then has exactly those."""
    axes = together or (axis,)
    on_axis = {label for label, given in assigned.items() if any(a in given for a in axes)}
    return on_axis == set(batch) and all(assigned[label] == axes for label in batch)


def runs_as_data_parallel(assigned: Mapping[str, tuple[str, ...]], batch: Collection[str],
                          outputs: Collection[Layout | None]) -> bool:
    """Whether a device runs an op as data parallelism would: nothing split, or exactly its
    batch labels (`GraphAnalysis.batch_labels`) all over the same axes, with no output a
    pending sum. Such an op needs no communication and no DTensor: the module executor
    runs it on plain local tensors (`executor.module.local`), the others through DTensor's
    dispatch, whose host time a calibrated profile prices (`device.host_op_s`). `outputs`
    are the op's output layouts (None for absent ones)."""
    if any(layout is not None and layout.partial for layout in outputs):
        return False
    if not assigned:
        return True
    if set(assigned) != set(batch):
        return False
    return len(set(assigned.values())) == 1
