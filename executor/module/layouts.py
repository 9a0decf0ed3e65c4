"""The plan read onto a module's traced graph: the layout each node's inputs need and its
output has, the parameters' layouts, the batch's, the weight collectives' buckets and the
recompute segments.

A plan's ops are ONNX nodes. The exporter names the node that produces a traced node's
output `node_<name>` and the helper nodes of the same translation `node_<OpType>_<n>`
(`executor.module.trace`), so each plan op is *owned* by one traced node: its namesake,
or for a helper the owner of the op it feeds. A traced node's input then needs the layout
the plan binds it in at the ops the node owns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from planner.errors import ShardplanError
from planner.kinds import AxisRole, CollectiveKind, LossReads, Phase
from planner.plans.model import Plan
from planner.sharding.derive import OPTIMIZER_OP
from planner.sharding.layout import Layout

NODE_PREFIX = "node_"


@dataclass(frozen=True)
class NodeLayouts:
    """What the plan says of one traced node: its inputs' layouts (by the name of the
    traced value each input is) and its output's layout (None: the plan has no entry)."""

    inputs: Mapping[str, Layout]
    output: Layout | None
    #: value -> the mesh axes over which the plan sums its gradient here, in backward (a
    #: pending sum over other axes stays pending: the plan reduces it later, e.g. at the
    #: weight it comes from, in the gradient phase)
    reduced: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: value -> the mesh axes over which the plan all-gathers the gradient of its read
    #: here, in backward (the read cut a replicated activation: each rank's gradient is
    #: its block, gathered back whole)
    gathered: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: weight (the plan's name) -> the share of its gradient this node's read hands back,
    #: where not 1 (`TensorBinding.share`: a whole read of a weight the plan sums over
    #: devices that each compute all of its gradient)
    shares: Mapping[str, float] = field(default_factory=dict)
    #: the values whose reads here the plan moves itself (it lists a collective of the
    #: value at an op this node owns): where an earlier node moved the value into the same
    #: layout, the plan did not share that move with this read (`planner.sharding.derive.
    #: shared_read_key`: moves are shared within a recompute region), and this node moves
    #: it again
    moves: frozenset[str] = frozenset()
    #: the plan moves a tensor between two of the exported ops this node is (`mean` as
    #: ReduceMean and Squeeze, the pending sum all-reduced between them): the node makes
    #: that move at its output, where DTensor's result is not the plan's output layout
    moves_inside: bool = False


@dataclass(frozen=True)
class WeightBucket:
    """One weight collective call: the plan's bucket (or a single weight), issued once per
    step (gradient phase) or once per micro-batch (forward, backward: ZeRO 2 and 3)."""

    kind: CollectiveKind
    axes: tuple[str, ...]
    phase: Phase
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class ModuleLayouts:
    parameters: Mapping[str, Layout]
    inputs: Mapping[str, Layout]
    nodes: Mapping[str, NodeLayouts]
    weights: tuple[WeightBucket, ...]
    #: the traced call nodes run under activation checkpointing, one tuple per segment of
    #: the plan's recompute (consecutive in graph order)
    recompute: tuple[tuple[str, ...], ...] = ()
    #: plan op name -> the traced node that owns it (module docstring)
    owner: Mapping[str, str] = field(default_factory=dict)
    #: the plan lists the loss's read of the outputs with the forward pass
    #: (`LossReads.ROWS`): the run moves them there, not in the loss's phase
    loss_reads_planned: bool = False
    #: weight -> the mesh axes its gradient is summed over (the plan's weight collectives)
    summed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def _listed(names: Collection[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


def check_parameters(plan: Plan, module_parameters: Iterable[tuple[str, ...]],
                     frozen: Collection[str] = ()) -> None:
    """Every module parameter (given as the names it has: a tied weight has several) has a
    plan tensor under one of its names, and every plan parameter is one of them; else one
    error naming each side's strays (a plan of another model, or of an export whose
    optimiser renamed the weights). A `frozen` parameter (`requires_grad=False`) is state
    in the plan, held and never synchronised (`check_frozen`)."""
    planned = {n for n, e in plan.tensors.items() if e.kind == "parameter"}
    held = {n for n, e in plan.tensors.items() if e.kind == "buffer"}
    groups = [tuple(g) for g in module_parameters]
    check_frozen(plan, groups, frozen)
    missing = {g[0] for g in groups if not planned.intersection(g)
               and not (g[0] in frozen and held.intersection(g))}
    extra = planned - {n for g in groups for n in g}
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"module parameters the plan does not name: {_listed(missing)}")
        if extra:
            parts.append(f"plan parameters the module does not have: {_listed(extra)}")
        raise ShardplanError(
            f"plan for {plan.model.path or 'another model'} does not match the module: "
            f"{'; '.join(parts)}. Plan the module's own export (executor.module.trace, "
            "with optimize=False, so parameters keep their names)")


def check_frozen(plan: Plan, groups: Iterable[tuple[str, ...]], frozen: Collection[str]
                 ) -> None:
    """A plan that trains a parameter (by any of its names: `groups`) the module holds
    frozen, or holds frozen one the module trains, was made before the module changed:
    refused, naming it (the plan's gradient sums would wait for a gradient that never
    comes). Asked in every rank and, by the launcher, before any rank starts."""
    planned = {n for n, e in plan.tensors.items() if e.kind == "parameter"}
    held = {n for n, e in plan.tensors.items() if e.kind == "buffer"}
    for group in groups:
        still = group[0] in frozen
        if still and planned.intersection(group):
            raise ShardplanError(
                f"parameter {group[0]} is frozen (requires_grad=False) in the module, but "
                f"the plan for {plan.model.path or 'another model'} trains it: plan the "
                "module again as it is now")
        if not still and held.intersection(group) and not planned.intersection(group):
            raise ShardplanError(
                f"parameter {group[0]} is trained by the module, but the plan for "
                f"{plan.model.path or 'another model'} holds it frozen: plan the module "
                "again as it is now")


def _owners(plan: Plan, traced: Collection[str]) -> dict[str, str]:
    """Plan op name -> the traced node that owns it (module docstring)."""
    readers: dict[str, list[str]] = {}
    for op in plan.ops:
        for binding in op.inputs:
            if binding is not None:
                readers.setdefault(binding.tensor, []).append(op.name)
    owner: dict[str, str] = {}
    for op in reversed(plan.ops):
        own = op.name[len(NODE_PREFIX):] if op.name.startswith(NODE_PREFIX) else ""
        if own not in traced and "__" in own:  # a node of one of several outputs
            # (`node_lstm__0`) computes the traced `getitem` it is named after
            own = next((b.tensor for b in op.outputs if b is not None and b.tensor in traced),
                       own)
        if own in traced:
            owner[op.name] = own
            continue
        for binding in op.outputs:
            if binding is None:
                continue
            found = next((owner[r] for r in readers.get(binding.tensor, ()) if r in owner),
                         None)
            if found is not None:
                owner[op.name] = found
                break
    return owner


def weight_buckets(plan: Plan) -> tuple[WeightBucket, ...]:
    """The plan's weight collectives (gradient sums and ZeRO's gathers and scatters) as
    calls: a bucket's weights in one, a weight without a bucket alone, in plan order."""
    buckets: dict[tuple[CollectiveKind, tuple[str, ...], Phase, object], list[str]] = {}
    for index, c in enumerate(plan.collectives):
        if c.op != OPTIMIZER_OP:
            continue
        # a collective without a bucket is a call of its own (a tied weight's sum between
        # pipeline stages is listed once per holder)
        which: object = ("bucket", c.bucket) if c.bucket is not None else ("alone", index)
        buckets.setdefault((c.kind, c.axes, c.phase, which), []).append(c.tensor)
    return tuple(WeightBucket(key[0], key[1], key[2], tuple(names))
                 for key, names in buckets.items())


def _summed_axes(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Weight -> the mesh axes the plan sums its gradient over (its all-reduces and
    reduce-scatters; a sum between pipeline stages is not an axis of a stage's DTensors)."""
    found: dict[str, tuple[str, ...]] = {}
    for c in plan.collectives:
        if c.op == OPTIMIZER_OP and c.kind in (CollectiveKind.ALL_REDUCE,
                                               CollectiveKind.REDUCE_SCATTER):
            axes = tuple(a for a in c.axes if a in plan.mesh.axis_names
                         and a != AxisRole.PIPELINE)
            found[c.tensor] = tuple(dict.fromkeys((*found.get(c.tensor, ()), *axes)))
    return found


def _weight_shares(plan: Plan, owner: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Traced node -> weight -> the share of its gradient the node's read hands back,
    where the plan gives one below 1. A traced node reads the parameter itself, so a
    plan op handing back a share of a tensor computed from weights (no parameter of the
    module), or two ops of one node handing back different shares of one weight, have
    no read to carry it: refused, naming the op."""
    found: dict[str, dict[str, float]] = {}
    for op in plan.ops:
        for binding in op.inputs:
            if binding is None or binding.share == 1.0 or op.name not in owner:
                continue
            entry = plan.tensors.get(binding.tensor)
            here = found.setdefault(owner[op.name], {})
            if entry is None or entry.kind != "parameter" or here.get(
                    binding.tensor, binding.share) != binding.share:
                raise ShardplanError(
                    f"op {op.name} reads {binding.tensor} whole on devices that sum its "
                    "weight's gradient, through a value the module computes from its "
                    "weights: the module executor hands back a share of a parameter's "
                    "gradient only; run the model's ONNX graph (shardplan run), or pin "
                    f"{op.name} to split the axis its weight's gradient is summed over")
            here[binding.tensor] = binding.share
    return found


def recompute_spans(plan: Plan, owner: Mapping[str, str], order: Sequence[str]
                    ) -> tuple[tuple[str, ...], ...]:
    """The plan's recompute segments (op ranges of its stages) as runs of traced call
    nodes: the nodes owning a segment's ops and every node between them in graph
    `order`; a node owning ops of two segments belongs to the first."""
    if plan.pipeline is None:
        return ()
    place = {name: k for k, name in enumerate(order)}
    spans: list[tuple[str, ...]] = []
    taken = -1
    for stage in plan.pipeline.stages:
        for first, end in stage.recompute_segments:
            found = [place[owner[op.name]] for op in plan.ops[first:end]
                     if owner.get(op.name) in place]
            found = [k for k in found if k > taken]
            if not found:
                continue
            taken = max(found)
            spans.append(tuple(order[min(found):taken + 1]))
    return tuple(spans)


def read_layouts(plan: Plan, traced: Sequence[str], values: Collection[str]) -> ModuleLayouts:
    """The plan on a traced graph whose call nodes are `traced` (in graph order) and whose
    values (node outputs and graph inputs) are named `values`.

    Raises when the plan names no op of the trace at all: it was made from another graph."""
    owner = _owners(plan, traced)
    if not owner:
        raise ShardplanError(
            f"plan for {plan.model.path or 'another model'} names none of the traced "
            "module's ops: it was not planned from this module's export "
            "(executor.module.trace)")
    inputs: dict[str, dict[str, Layout]] = {}
    for op in plan.ops:
        node = owner.get(op.name)
        if node is None:
            continue
        wanted = inputs.setdefault(node, {})
        for binding in op.inputs:
            if binding is not None and binding.tensor in values:
                wanted.setdefault(binding.tensor, binding.layout)
    reduced: dict[str, dict[str, tuple[str, ...]]] = {}
    gathered: dict[str, dict[str, tuple[str, ...]]] = {}
    moves: dict[str, set[str]] = {}
    for c in plan.collectives:
        node = owner.get(c.op)
        if node is not None and c.phase in (Phase.FORWARD, Phase.BACKWARD):
            moves.setdefault(node, set()).add(c.tensor)
        if c.phase != Phase.BACKWARD or node is None:
            continue
        found = reduced if c.kind in (CollectiveKind.ALL_REDUCE,
                                      CollectiveKind.REDUCE_SCATTER) else \
            gathered if c.kind == CollectiveKind.ALL_GATHER else None
        if found is not None:
            here = found.setdefault(node, {})
            here[c.tensor] = tuple(dict.fromkeys((*here.get(c.tensor, ()), *c.axes)))
    shares = _weight_shares(plan, owner)
    nodes = {}
    for node in traced:
        entry = plan.tensors.get(node)
        nodes[node] = NodeLayouts(inputs.get(node, {}), entry.layout if entry else None,
                                  reduced.get(node, {}), gathered.get(node, {}),
                                  shares.get(node, {}), frozenset(moves.get(node, ())),
                                  any(t not in values for t in moves.get(node, ())))
    return ModuleLayouts(
        parameters={n: e.layout for n, e in plan.tensors.items() if e.kind == "parameter"},
        inputs={n: e.layout for n, e in plan.tensors.items() if e.kind == "input"},
        nodes=nodes, weights=weight_buckets(plan),
        recompute=recompute_spans(plan, owner, traced), owner=owner,
        loss_reads_planned=plan.step.loss_reads is LossReads.ROWS,
        summed=_summed_axes(plan))
