"""Which ops the torch executor can run: checked before any rank starts.

A plan may name ops the planner prices but the executor has no torch function for (the
registry knows more op types than `executor.ops.TORCH_OPS` implements). Every op of the
graph, and every op type the local rewrites of its ops may emit, is checked against
`TORCH_OPS` (collectives against what the runtime issues) so that a run is refused with
the op's name up front rather than failing inside a rank.
"""

from __future__ import annotations

from dataclasses import replace

from executor.ops import TORCH_OPS
from executor.schedule import RUNNABLE
from planner.errors import ShardplanError
from planner.graph import OpNode, PlanningGraph
from planner.humanize import first_listed
from planner.kinds import StepKind
from planner.ops import SHARDPLAN_DOMAIN, record_for
from planner.plans.model import Plan
from planner.plans.sections import ParallelConfig

#: Collectives of local programs the runtime issues (`PlanRunner._collective`).
RUNTIME_COLLECTIVES = frozenset({f"{SHARDPLAN_DOMAIN}::AllReduce"})

_ADVICE = ("the planner can still plan it for another runtime; to run it here, export the "
           "model without it or add a torch function for it to executor/ops.py TORCH_OPS")


def missing_op_types(node: OpNode) -> list[str]:
    """The op types `node` needs that the executor lacks: its own, or ones its rewrite emits."""
    if node.domain not in ("", "ai.onnx"):
        return [node.qualified_type]
    missing = [] if node.op_type in TORCH_OPS else [node.op_type]
    record = record_for(node.op_type, node.domain)
    if record is not None and record.rewrite is not None:
        missing += sorted(op for op in record.rewrite.emits
                          if op not in TORCH_OPS and op not in RUNTIME_COLLECTIVES
                          and op not in missing)
    return missing


def check_supported(graph: PlanningGraph) -> None:
    """Raise ShardplanError naming the first op the executor cannot run, and what to do."""
    if graph.routed:
        name, selection = next(iter(graph.routed.items()))
        raise ShardplanError(
            f"the torch executor cannot run op {name!r} (NonZero, and {len(graph.routed) - 1} "
            f"more): it selects the tokens a mixture-of-experts router sends, a number known "
            f"only at run time, which the plan sizes at {selection.count} (capacity factor "
            f"{graph.capacity_factor:g}); the executor runs static shapes, so the plan is for "
            "pricing and for another runtime")
    refused: dict[str, list[str]] = {}  # op type -> names of the ops that need it
    for node in graph.ops:
        for op_type in missing_op_types(node):
            refused.setdefault(op_type, []).append(node.name)
    if not refused:
        return
    op_type, names = next(iter(refused.items()))
    where = f"op {names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
    others = sorted(set(refused) - {op_type})
    also = f"; it also lacks {first_listed(others, 8)}" if others else ""
    raise ShardplanError(f"the torch executor cannot run {where}: op type {op_type} has no "
                         f"torch implementation{also}; {_ADVICE}")


def refuse_inference(plan: Plan) -> None:
    """Refuse an inference plan (`plan --inference`): it prices a forward pass and lists no
    gradient sums, so the ranks, which train, would each step on their own gradients."""
    if plan.step.kind == StepKind.INFERENCE:
        raise ShardplanError("the plan is an inference plan (planned with --inference): it "
                             "sums no gradients between ranks, and run trains; plan the "
                             "model without --inference to train it")


#: what the module executor runs (`check_degrees` with `graph` False): the runners'
#: schedules and shapes, without context or expert parallelism; `plan --module` plans so
MODULE_RUNNABLE = replace(RUNNABLE, context_parallel=False, expert_parallel=False)


def check_degrees(parallel: ParallelConfig, graph: bool = True) -> None:
    """Refuse, by the plan file's key, a degree the runner cannot run: data-parallel
    replicas taking uneven shares of the batch (a mixed cluster's shares by speed: both
    executors split the batch evenly and average the gradients as equal shares), and cp
    or ep above 1 for the module executor (`graph` False). The ONNX-graph executor runs context- and
    expert-parallel plans as it runs any layout: the ring's K/V all-gathers and their
    reduce-scatters, Ulysses' all-to-alls, the experts' dispatch and combine all-to-alls
    are the plan's collectives (`tests/test_context_parallel.py` and
    `tests/test_expert_parallel.py` check runs on two ranks against one). Sequence
    parallelism needs no check: it is in the plan's layouts, which the executor runs as
    they are."""
    if not parallel.even_shares:
        shown = ", ".join(str(rows) for rows in parallel.dp_shares[:8])
        more = ", …" if len(parallel.dp_shares) > 8 else ""
        raise ShardplanError(f"parallel.dp_shares is [{shown}{more}]: the data-parallel "
                             "replicas take uneven shares of the batch, which the executor "
                             "does not run (it splits the batch evenly); re-plan with "
                             "--parallel dp_shares=even")
    if graph:
        return
    for key, what in (("cp", "context"), ("ep", "expert")):
        if getattr(parallel, key) != 1:
            raise ShardplanError(f"parallel.{key} is {getattr(parallel, key)}: the module "
                                 f"executor (--module) does not run {what} parallelism yet; "
                                 f"re-plan with --parallel {key}=1")
