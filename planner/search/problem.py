"""The strategy-choice problem: one choice per op group, costs on choices and on edges.

Every search solves this one table, built from `planner.cost.pricing`, so what a solver
minimises is what the plan builder reports for the chosen plan (`planner.cost.oplevel`),
but where a sum of per-choice terms cannot follow the step: each weight's gradient
reduction is priced exposed as the bucket schedule leaves it when the backward compute is
long enough to hide the rest (`planner.cost.buckets.exposed_share`; the step hides at most
that compute), and a weight read twice is priced at each use (`bench/surrogate.py` prints
the two side by side):

- a *group* is a set of ops that take the same choice (one op, or the same op of every
  repeated transformer layer); each candidate has a time (compute, its own collectives,
  the gradient sync of the weights it owns), a memory (weights and states it owns, saved
  activations) and a workspace (its largest output);
- an *edge* joins two groups through a tensor: a matrix of redistribution time (forward,
  backward and deferred weight-gradient sync) for every pair of their choices, and one of
  the largest collective buffer each pair needs (it counts towards the workspace).

Weights and graph inputs are placed as their first consumer needs them; other consumers
of the same tensor get an edge from that first consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from costmodels.memory import gradient_bytes, optimizer_state_bytes
from costmodels.profile import HardwareProfile
from planner.cost.buckets import bucket_bytes, exposed_share
from planner.cost.kernels import KernelPlan, kernel_plan, policy_for
from planner.cost.oplevel import last_bucket_ops
from planner.cost.pricing import (
    accumulation_seconds,
    collective_seconds,
    edge_seconds,
    op_times,
    optimizer_seconds,
    reduction_seconds,
    runs_locally,
    saved_bytes,
)
from planner.cost.step import TrainingOptions
from planner.graph import OpNode, PlanningGraph
from planner.kinds import Precision
from planner.ops import DimLabels, replicated_labels
from planner.ops.saving import gradient_flows
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.candidates import Candidate, candidate_strategies, describe
from planner.sharding.derive import fraction_of_layout, loss_read_moves
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh
from planner.sharding.outputs import loss_read_slots, resolved_output_slots
from planner.sharding.strategy import REPLICATED, OpStrategy


@dataclass
class Group:
    ops: list[str]  # member ops; all take the same candidate index
    candidates: list[Candidate]
    cost: np.ndarray  # seconds per candidate, summed over members
    memory: np.ndarray  # bytes per candidate, summed over members
    workspace: np.ndarray  # bytes per candidate: the largest local output of one member
    saved: np.ndarray | None = None  # the part of `memory` that is saved activations
    #: the part of `cost` the plan may pay less of (`EdgeCost.shared`: a group's edges to
    #: itself, between repeated layers); None: none
    shared: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.ops[0]


@dataclass
class EdgeCost:
    u: int  # group index of the producer (or first consumer of a shared weight/input)
    v: int  # group index of the consumer
    cost: np.ndarray  # [len(candidates of u), len(candidates of v)] seconds
    buffer: np.ndarray  # same shape: bytes of the largest collective buffer the move needs
    tensors: list[str] = field(default_factory=list)
    #: whether one of its tensors is read by several ops or computed from weights alone:
    #: the plan moves one tensor once for reads that share a layout and sums a derived
    #: weight's gradient once at the weight, where the table prices each read
    shared: bool = False


@dataclass
class StrategyProblem:
    graph: PlanningGraph
    mesh: DeviceMesh
    groups: list[Group]
    edges: list[EdgeCost]
    memory_limit: float
    group_of: dict[str, int]  # op name -> group index
    labels: dict[str, DimLabels | None]

    def evaluate(self, choice: Sequence[int]) -> tuple[float, float]:
        """Time and peak memory of one choice per group."""
        time = sum(float(g.cost[c]) for g, c in zip(self.groups, choice, strict=True))
        time += sum(float(e.cost[choice[e.u], choice[e.v]]) for e in self.edges)
        memory = sum(float(g.memory[c]) for g, c in zip(self.groups, choice, strict=True))
        workspace = max([0.0, *(float(g.workspace[c]) for g, c in zip(self.groups, choice,
                                                                      strict=True)),
                         *(float(e.buffer[choice[e.u], choice[e.v]]) for e in self.edges)])
        return time, memory + workspace

    def memory_parts(self, choice: Sequence[int]) -> tuple[float, float]:
        """(weights with their gradients and states, saved activations) of one choice."""
        total = saved = 0.0
        for group, c in zip(self.groups, choice, strict=True):
            total += float(group.memory[c])
            saved += float(group.saved[c]) if group.saved is not None else 0.0
        return total - saved, saved

    def weigh_memory(self, weights: float, activations: float) -> None:
        """Count each choice's memory as `weights`·(its weights and states) +
        `activations`·(its saved activations): the op-level memory as a configuration
        holds it (pipeline stages, ZeRO shards, micro-batches in flight, recompute)."""
        for group in self.groups:
            saved = group.saved if group.saved is not None else np.zeros_like(group.memory)
            group.memory = weights * (group.memory - saved) + activations * saved
            group.saved = activations * saved

    def floor(self) -> StrategyProblem:
        """This problem without what the plan may pay less of (`EdgeCost.shared`, and a
        group's `shared` part): no choice's time here is above the step the plan builder
        prices for it, since every other term is the builder's own price or, for a
        gradient reduction, no more of it exposed than the schedule leaves
        (`planner.cost.buckets.exposed_share`). A bound on it bounds every plan of the
        mesh (`planner.search.ilp.lower_bound`)."""
        groups = [replace(g, cost=g.cost - g.shared) if g.shared is not None else g
                  for g in self.groups]
        return replace(self, groups=groups, edges=[e for e in self.edges if not e.shared])

    def strategies(self, choice: Sequence[int]) -> dict[str, OpStrategy]:
        return {op: group.candidates[c].strategy
                for group, c in zip(self.groups, choice, strict=True) for op in group.ops}

    @property
    def size(self) -> int:
        return sum(len(g.candidates) for g in self.groups)


_PRICE_CLASSES = "price classes"  # memo key of the analysis (`price_classes`)


def build_problem(
    analysis: GraphAnalysis,
    mesh: DeviceMesh,
    profile: HardwareProfile,
    options: TrainingOptions,
    fixed: Mapping[str, OpStrategy] | None = None,
    classes: Sequence[Sequence[str]] | None = None,
    micro_batches: int = 1,
    allowed: Callable[[str, Candidate], bool] | None = None,
) -> StrategyProblem:
    """Tabulate every candidate's cost and every edge's cost matrix.

    `fixed` pins some ops to one strategy (semi-auto); `classes` lists groups of ops that
    must choose alike (repeated layers), defaulting to one group per op. Costs are per
    micro-batch: what a step pays once (the gradient synchronisation, the optimizer pass)
    counts 1 / `micro_batches` of itself, so that a layout gathering a weight every
    micro-batch is weighed against a reduction paid once per step as the step pays them.
    `allowed(op, candidate)` keeps, for each group (named by its first op), only the
    candidates it accepts (all of them where it accepts none) before anything is priced:
    the edge matrices grow with the product of two groups' candidates, so a search that
    restricts what an axis may split (dp the batch, cp the sequence) filters here rather
    than after tabulating.
    """
    once = 1.0 / max(1, micro_batches)
    fixed = dict(fixed or {})
    graph, labels = analysis.graph, analysis.labels
    tensors = graph.tensors
    needs_grad = {} if options.inference else analysis.needs_grad
    roots = analysis.weight_roots
    ops = {node.name: node for node in graph.ops}
    groups_ops = [list(c) for c in classes] if classes else [[n.name] for n in graph.ops]
    candidates: dict[str, list[Candidate]] = {}
    for members in groups_ops:  # tied ops have equal signatures: one enumeration serves all
        first = ops[members[0]]
        pinned = fixed.get(first.name)
        if pinned is None and first.name in analysis.constant_ops:
            pinned = REPLICATED
        found = _candidates(first, labels.get(first.name), tensors, mesh, pinned)
        for member in members:
            candidates[member] = found
    _resolve_outputs(graph, groups_ops, candidates, fixed)
    if allowed is not None:
        for members in groups_ops:
            found = candidates[members[0]]
            kept = [c for c in found if allowed(members[0], c)]
            if kept and len(kept) < len(found):
                for member in members:
                    candidates[member] = kept
    group_of = {op: index for index, members in enumerate(groups_ops) for op in members}
    owner = analysis.first_consumers
    kernels = kernel_plan(analysis, policy_for(profile, options.attention, options.fusion))
    read_by_loss = loss_read_slots(graph, not options.inference, options.loss_reads)
    classes_of = price_classes(analysis, kernels, options, read_by_loss)
    groups = [
        _group(members, [ops[m] for m in members], candidates, graph, mesh, profile, options,
               needs_grad, owner, kernels, once, read_by_loss, analysis, classes_of)
        for members in groups_ops
    ]
    edges = _edges(graph, mesh, profile, candidates, group_of, owner, needs_grad, roots, groups,
                   options, once)
    limit = options.memory_limit_bytes or int(profile.memory_bytes.value)
    return StrategyProblem(graph, mesh, groups, edges, float(limit), group_of, dict(labels))


def _resolve_outputs(graph: PlanningGraph, groups_ops: Sequence[Sequence[str]],
                     candidates: dict[str, list[Candidate]],
                     fixed: Mapping[str, OpStrategy]) -> None:
    """The op writing a non-scalar graph output keeps only candidates that write it
    resolved (`planner.sharding.outputs`). Ops pinned by the user keep their strategy."""
    class_of = {op: members for members in groups_ops for op in members}
    for producer, slots in resolved_output_slots(graph).items():
        if producer in fixed:
            continue
        found = candidates[producer]
        kept = [c for c in found if not any(_partial(c.outputs[slot]) for slot in slots)]
        if kept and len(kept) < len(found):
            for member in class_of.get(producer, [producer]):
                candidates[member] = kept


def _partial(layout: Layout | None) -> bool:
    return layout is not None and bool(layout.partial)


def _candidates(node: OpNode, labels: DimLabels | None, tensors, mesh: DeviceMesh,
                fixed: OpStrategy | None) -> list[Candidate]:
    if labels is None:
        return [describe(node, replicated_labels(node), REPLICATED, tensors, mesh)]
    if fixed is not None:
        return [describe(node, labels, fixed, tensors, mesh)]
    return [describe(node, labels, s, tensors, mesh)
            for s in candidate_strategies(node, labels, tensors, mesh)]


def _group(members: list[str], nodes: list[OpNode], candidates: Mapping[str, list[Candidate]],
           graph: PlanningGraph, mesh: DeviceMesh, profile: HardwareProfile,
           options: TrainingOptions, needs_grad: Mapping[str, bool],
           owner: Mapping[str, tuple[str, int]], kernels: KernelPlan, once: float,
           read_by_loss: Mapping[str, tuple[int, ...]], analysis: GraphAnalysis,
           classes_of: Mapping[str, int]) -> Group:
    count = len(candidates[members[0]])
    cost, memory, workspace = np.zeros(count), np.zeros(count), np.zeros(count)
    saved_total = np.zeros(count)
    # Members of a tied group are the same op in repeated layers: those of one price class
    # (`price_classes`) price every candidate alike.
    priced: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    terms: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    last_bucket = last_bucket_ops(analysis)
    for node in nodes:
        if len(candidates[node.name]) != count:
            raise ValueError(f"ops {members[0]} and {node.name} cannot share choices")
        key = classes_of[node.name]
        if key not in priced:
            read = read_by_loss.get(node.name, ())
            values = np.array([_candidate_cost(node, candidate, graph, mesh, profile, options,
                                               needs_grad, owner, kernels, once, read,
                                               analysis, last_bucket)
                               for candidate in candidates[node.name]]).reshape(count, 4)
            priced[key] = (values[:, 0], values[:, 1] + values[:, 2], values[:, 3],
                           values[:, 2])
        terms.append(priced[key])
    cost = added_in_order(cost, [seconds for seconds, _, _, _ in terms])
    memory = added_in_order(memory, [held for _, held, _, _ in terms])
    saved_total = added_in_order(saved_total, [saved for _, _, _, saved in terms])
    for _, _, largest, _ in priced.values():  # a maximum: in any order
        workspace = np.maximum(workspace, largest)
    return Group(members, list(candidates[members[0]]), cost, memory, workspace, saved_total)


def price_classes(analysis: GraphAnalysis, kernels: KernelPlan, options: TrainingOptions,
                  read_by_loss: Mapping[str, tuple[int, ...]]) -> Mapping[str, int]:
    """Per op, its price class: ops of equal signatures in a tied group (the same op in
    repeated layers) price every candidate alike where the class is equal too, that is
    where each owns the weights at the same input slots (and reduces them in the last
    bucket or not), passes gradients at the same outputs, runs the same kernel, keeps the
    same shares of its outputs, has its outputs read by the loss at the same slots,
    carries the batch in the same labels and computes from weights alone or not. Found
    once per graph, kernel policy, pass and loss (the op-level search asks at every mesh
    shape)."""
    key = (_PRICE_CLASSES, kernels.policy, options.inference, options.loss_reads)
    found = analysis.memo.get(key)
    if found is None:
        owner, roots = analysis.first_consumers, analysis.weight_roots
        needs_grad = {} if options.inference else analysis.needs_grad
        last_bucket = last_bucket_ops(analysis)
        numbers: dict[tuple, int] = {}
        found = {}
        for node in analysis.graph.ops:
            name = node.name
            signature = (
                tuple(bool(i) and owner.get(i) == (name, slot)
                      for slot, i in enumerate(node.inputs)),
                tuple(needs_grad.get(o, False) for o in node.outputs if o),
                kernels.ops[name], tuple(kernels.saved.get(o, 0.0) for o in node.outputs),
                tuple((slot, analysis.rows_dim(node.outputs[slot]))
                      for slot in read_by_loss.get(name, ())),
                analysis.batch_labels.get(name),
                all(o in roots for o in node.outputs if o), name in last_bucket)
            found[name] = numbers.setdefault(signature, len(numbers))
        analysis.memo[key] = found
    return found


def added_in_order(start: np.ndarray, terms: Sequence[np.ndarray]) -> np.ndarray:
    """`start + terms[0] + terms[1] + ...`, added left to right, as a loop of `+=` adds
    them (the same roundings; `np.sum` adds pairwise), in one numpy call: a tied group of
    a long chain has tens of thousands of members."""
    if not terms:
        return start
    stacked = np.empty((len(terms) + 1, *start.shape))
    stacked[0] = start
    stacked[1:] = terms
    return np.add.accumulate(stacked, axis=0)[-1]


def _candidate_cost(node: OpNode, candidate: Candidate, graph: PlanningGraph, mesh: DeviceMesh,
                    profile: HardwareProfile, options: TrainingOptions,
                    needs_grad: Mapping[str, bool], owner: Mapping[str, tuple[str, int]],
                    kernels: KernelPlan, once: float, read: tuple[int, ...],
                    analysis: GraphAnalysis, last_bucket: frozenset[str]
                    ) -> tuple[float, float, float, float]:
    """(seconds, owned weight memory, saved activations, largest output) of one candidate;
    what the step pays once for its weights weighs `once` (1 / micro-batches). The output
    slots in `read` are read by the loss: their moves into its layout count here, as the
    derivation lists them at this op (`loss_read_moves`). `analysis` says whether the host
    runs the op as a plain one (`planner.cost.pricing.runs_locally`: its time per op); the
    weights of the ops in `last_bucket` (`planner.cost.oplevel.last_bucket_ops`) reduce
    after the backward pass, the others behind it (`planner.cost.buckets.exposed_share`)."""
    tensors = graph.tensors
    fraction = 1.0
    for axis in candidate.strategy.used_axes:
        fraction /= mesh.axis_size(axis)
    outputs_need_grad = gradient_flows(node, needs_grad)
    local = profile.host_op_s is None or runs_locally(
        node, dict(candidate.strategy.assignment), candidate.outputs, analysis)
    forward, backward = op_times(node, kernels, tensors, candidate.inputs, fraction, mesh,
                                 profile, options.precision, outputs_need_grad, local)
    seconds = forward + backward
    for kind, axes, nbytes in candidate.forward_collectives + candidate.backward_collectives:
        seconds += collective_seconds(profile, kind, nbytes, axes, mesh)
    for slot in read:
        name, layout = node.outputs[slot], candidate.outputs[slot]
        if layout is not None:
            for kind, axes, nbytes, _ in loss_read_moves(tensors[name], layout, mesh,
                                                          needs_grad.get(name, False),
                                                          analysis.rows_dim(name)):
                seconds += collective_seconds(profile, kind, nbytes, axes, mesh)
    owned = 0.0
    for slot, name in enumerate(node.inputs):
        if not name or owner.get(name) != (node.name, slot):
            continue
        info = tensors[name]
        layout = candidate.inputs[slot]
        if info.kind != "parameter" or layout is None:
            continue
        local_bytes = info.nbytes * fraction_of_layout(layout, mesh)
        if options.inference:
            owned += local_bytes
            continue
        local_elements = info.numel * fraction_of_layout(layout, mesh)
        states = optimizer_state_bytes(local_elements, info.itemsize, options.optimizer,
                                       options.precision)
        owned += local_bytes + gradient_bytes(local_elements, info.itemsize,
                                              options.precision) + states
        seconds += once * (optimizer_seconds(profile, local_elements, info.itemsize,
                                             options.optimizer, options.precision,
                                             options.fusion)
                           + accumulation_seconds(profile, local_elements, info.itemsize,
                                                  options.precision, options.fusion,
                                                  options.accumulation, round(1.0 / once)))
        axes = candidate.grad_partial[slot]
        if axes:  # the reduction the plan issues, as much of it exposed as the schedule leaves
            seconds += once * reduction_seconds(
                profile, local_bytes, info.itemsize, axes, mesh,
                bucket_bytes(options.bucket_mb), options.precision) * exposed_share(
                node.name in last_bucket, options.overlap, options.overlap_grad_reduce,
                profile.overlap_share)
    largest = 0.0
    for name, layout in zip(node.outputs, candidate.outputs, strict=True):
        if name and layout is not None:
            largest += kernels.written_bytes(
                name, tensors[name].nbytes * fraction_of_layout(layout, mesh))
    saved = 0.0 if options.inference else saved_bytes(node, kernels, tensors,
                                                       candidate.outputs, mesh)
    return seconds, owned, saved, largest


def _edges(graph: PlanningGraph, mesh: DeviceMesh, profile: HardwareProfile,
           candidates: Mapping[str, list[Candidate]], group_of: Mapping[str, int],
           owner: Mapping[str, tuple[str, int]], needs_grad: Mapping[str, bool],
           roots: Mapping[str, frozenset[str]], groups: list[Group],
           options: TrainingOptions, once: float) -> list[EdgeCost]:
    tensors = graph.tensors
    merged: dict[tuple[int, int], EdgeCost] = {}
    cache: dict[tuple, tuple[float, float]] = {}
    # repeated layers recur: per signature its matrices, whether they hold anything, and
    # their diagonals (a tied group's edge to itself)
    matrices: dict[tuple, tuple[np.ndarray, np.ndarray, bool, np.ndarray, np.ndarray]] = {}
    own: dict[int, list[np.ndarray]] = {}  # group -> its diagonals, in op order
    own_shared: dict[int, list[np.ndarray]] = {}  # group -> those of shared tensors
    terms: dict[tuple[int, int], list[np.ndarray]] = {}  # edge -> its matrices, in op order
    # edge (a group's own: (v, v)) -> its distinct buffers
    buffers: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    for node in graph.ops:
        v = group_of[node.name]
        for slot, name in enumerate(node.inputs):
            if not name:
                continue
            info = tensors[name]
            if info.kind == "constant":
                continue
            if info.producer is not None:
                source_op = info.producer
                source_slot = ("out", list(graph.op(source_op).outputs).index(name))
            else:
                first_op, first_slot = owner[name]
                if first_op == node.name and first_slot == slot:
                    continue
                source_op = first_op
                source_slot = ("in", first_slot)
            u = group_of[source_op]
            grad = needs_grad.get(name, False)
            derived = name in roots
            signature = (u, v, source_slot, slot, info.shape, info.dtype, grad, derived)
            found = matrices.get(signature)
            if found is None:
                matrix, buffer = _edge_matrix(
                    candidates[source_op], source_slot, candidates[node.name], slot, info, node,
                    mesh, profile, grad, derived, options.overlap, cache,
                    bucket_bytes(options.bucket_mb), once, options.precision)
                found = matrices[signature] = (
                    matrix, buffer, bool(matrix.any() or buffer.any()),
                    *((np.diag(matrix), np.diag(buffer)) if u == v else (matrix, buffer)))
            matrix, buffer, moves, diagonal, diagonal_buffer = found
            if not moves:
                continue
            shared = derived or len(info.consumers) > 1
            if u == v:  # the same op position across layers: only equal choices co-occur
                own.setdefault(v, []).append(diagonal)
                if shared:
                    own_shared.setdefault(v, []).append(diagonal)
                buffers.setdefault((v, v), {})[id(diagonal_buffer)] = diagonal_buffer
                continue
            edge = merged.get((u, v))
            if edge is None:
                edge = merged[(u, v)] = EdgeCost(u, v, np.zeros_like(matrix),
                                                 np.zeros_like(buffer))
            terms.setdefault((u, v), []).append(matrix)
            buffers.setdefault((u, v), {})[id(buffer)] = buffer
            edge.tensors.append(name)
            edge.shared = edge.shared or shared
    for v, diagonals in own.items():
        groups[v].cost = added_in_order(groups[v].cost, diagonals)
        if v in own_shared:
            groups[v].shared = added_in_order(np.zeros_like(groups[v].cost), own_shared[v])
        for buffer in buffers[(v, v)].values():  # a maximum: in any order
            groups[v].workspace = np.maximum(groups[v].workspace, buffer)
    for key, edge in merged.items():
        edge.cost = added_in_order(edge.cost, terms[key])
        for buffer in buffers[key].values():  # a maximum: in any order
            edge.buffer = np.maximum(edge.buffer, buffer)
    return list(merged.values())


def _edge_matrix(source: list[Candidate], source_slot: tuple[str, int], target: list[Candidate],
                 slot: int, info, consumer: OpNode, mesh: DeviceMesh,
                 profile: HardwareProfile, grad: bool, derived: bool, overlap: float,
                 cache: dict[tuple, tuple[float, float]],
                 bucket: float = 0.0, once: float = 1.0,
                 precision: Precision | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seconds, and the largest collective buffer, of moving one tensor for every
    (source choice, target choice)."""
    kind, index = source_slot
    sources = [c.outputs[index] if kind == "out" else c.inputs[index] for c in source]
    matrix = np.zeros((len(source), len(target)))
    buffer = np.zeros((len(source), len(target)))
    for b, candidate in enumerate(target):
        dst, axes = candidate.inputs[slot], candidate.grad_partial[slot]
        if dst is None:
            continue
        for a, src in enumerate(sources):
            if src is None:
                continue
            key = (info.shape, info.dtype, src, dst, axes, grad, derived)
            if key not in cache:
                cache[key] = edge_seconds(info, src, dst, consumer.name, mesh, profile, grad,
                                          axes, derived, overlap, bucket, once, precision)
            matrix[a, b], buffer[a, b] = cache[key]
    return matrix, buffer


def prune_dominated(problem: StrategyProblem) -> StrategyProblem:
    """Drop candidates another candidate of the same group beats on every count.

    Candidate j is dominated by k when k costs no more time, memory and workspace, and no
    more on every edge against every choice of the neighbour. Removing j keeps every
    optimum (some optimum never uses j), under the memory limit too. Repeats until stable.
    """
    changed = True
    while changed:
        changed = False
        for index, group in enumerate(problem.groups):
            if len(group.candidates) < 2:
                continue
            incident = [(e, e.u == index) for e in problem.edges if index in (e.u, e.v)]
            profile = np.column_stack(
                [group.cost, group.memory, group.workspace]
                + [e.cost if outgoing else e.cost.T for e, outgoing in incident]
                + [e.buffer if outgoing else e.buffer.T for e, outgoing in incident])
            keep = _undominated(profile)
            if len(keep) == len(group.candidates):
                continue
            changed = True
            restrict_candidates(problem, index, keep)
    return problem


def _undominated(rows: np.ndarray) -> list[int]:
    """Indices of rows no other row is <= everywhere (first of equal rows survives)."""
    keep: list[int] = []
    for j in range(rows.shape[0]):
        dominated = False
        for k in range(rows.shape[0]):
            if k == j or not np.all(rows[k] <= rows[j] + 1e-15):
                continue
            if np.any(rows[k] < rows[j] - 1e-15) or k < j:
                dominated = True
                break
        if not dominated:
            keep.append(j)
    return keep


def restrict_candidates(problem: StrategyProblem, index: int, keep: list[int]) -> None:
    """Keep only candidates `keep` of group `index`, in every table that mentions them."""
    group = problem.groups[index]
    group.candidates = [group.candidates[i] for i in keep]
    group.cost, group.memory = group.cost[keep], group.memory[keep]
    group.workspace = group.workspace[keep]
    if group.saved is not None:
        group.saved = group.saved[keep]
    if group.shared is not None:
        group.shared = group.shared[keep]
    for edge in problem.edges:
        if edge.u == index:
            edge.cost, edge.buffer = edge.cost[keep, :], edge.buffer[keep, :]
        if edge.v == index:
            edge.cost, edge.buffer = edge.cost[:, keep], edge.buffer[:, keep]
