"""Human-readable summaries of plans for the terminal."""

from __future__ import annotations

import math

from costmodels.precision import parameter_bytes
from planner.graph import dtype_itemsize
from planner.humanize import human_bytes, human_count, human_seconds
from planner.kinds import CollectiveKind, Phase
from planner.plans.model import Plan
from planner.plans.stagemesh import describe_stage_meshes, per_stage_meshes, resharded
from planner.sharding.derive import OPTIMIZER_OP

MEMORY_ORDER = ("parameters", "gradients", "optimizer", "activations", "workspace")


def _kernels(plan: Plan) -> list[str]:
    """The precision with its bytes per parameter, and the kernels the plan was priced
    with (none for files written before plans recorded them)."""
    step = plan.step
    if step.precision is None:
        return []
    line = f"precision  {step.precision}"
    if step.kind == "training":
        per = parameter_bytes(step.precision, 4, plan.parallel.optimizer)
        main = (f" + {per.main_gradients:g} B fp32 gradients at the step"
                if per.main_gradients else "")
        line += (f": {per.weights:g} B weights + {per.gradients:g} B gradients + "
                 f"{per.master:g} B master + {per.moments:g} B {plan.parallel.optimizer}"
                 f"{main} = {per.total:g} B per parameter")
    lines = [line, f"kernels    attention {step.attention}, fusion {step.fusion}"]
    if step.kind == "training" and step.bucket_mb is not None:
        buckets = f"{step.bucket_mb:g} MiB buckets" if step.bucket_mb else "one per tensor"
        when = "behind" if step.overlap_grad_reduce else "after"
        accumulated = "" if step.grad_accumulation is None else "; accumulated " + (
            "in the weight-gradient GEMMs" if step.grad_accumulation == "fused"
            else "by kernels of their own")
        lines.append(f"gradients  reduced in {buckets}, {when} the backward pass{accumulated}")
    return lines


def summary(plan: Plan) -> str:
    """The plan at a glance: where the step time goes and what fills device memory."""
    p = plan.predicted
    parallel = plan.parallel
    mesh = " × ".join(
        f"{a}={s} ({'intra-node' if plan.mesh.intra_node(a) else 'crosses nodes'})"
        for a, s in zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    total = p.step_time_s or 1.0
    lines = [
        f"model      {plan.model.path}  ({human_count(plan.model.parameters)} parameters, "
        f"batch {plan.model.batch}, dims {plan.model.bound_dims})",
        f"cluster    {_cluster(plan)}",
        f"mesh       {mesh}",
        *_stage_meshes(plan),
        f"parallel   dp={parallel.dp} tp={parallel.tp} pp={parallel.pp} sp={parallel.sp} "
        + (f"cp={parallel.cp} " + (f"{parallel.cp_kind} " if parallel.cp_kind else "")
           if parallel.cp > 1 else "")
        + (f"ep={parallel.ep} " if parallel.ep > 1 else "") +
        f"micro_batches={parallel.micro_batches} zero={parallel.zero} "
        f"recompute={parallel.recompute} optimizer={parallel.optimizer}",
        *_kernels(plan),
        *_weight_storage(plan),
        *_routing(plan),
        f"solver     {plan.solver.name}: {plan.solver.status}{_tied(plan)} in "
        f"{human_seconds(plan.solver.time_s)}",
        "",
        f"{'step time':<28}{human_seconds(p.step_time_s):>12}",
        f"{'  compute':<28}{human_seconds(p.compute_s):>12}  {100 * p.compute_s / total:5.1f} %",
        f"{'  communication':<28}{human_seconds(p.communication_s):>12}  "
        f"{100 * p.communication_s / total:5.1f} %",
    ]
    for key in ("forward_s", "backward_s", "recompute_s", "optimizer_s",
                "forward_communication_s", "backward_communication_s", "p2p_s", "zero_s",
                "gradient_communication_s", "bubble_s"):
        if p.breakdown.get(key):
            lines.append(f"{'    ' + key.removesuffix('_s').replace('_', ' '):<28}"
                         f"{human_seconds(p.breakdown[key]):>12}")
    lines += ["", "memory per device"]
    for key in MEMORY_ORDER:
        lines.append(f"{'  ' + key:<28}{human_bytes(p.memory.get(key, 0)):>12}")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(f"{'  peak':<28}{human_bytes(p.memory['peak']):>12}  of "
                 f"{human_bytes(p.memory_limit_bytes)} limit: {verdict}")
    if plan.pipeline is not None:
        lines += ["", _pipeline(plan), *_shares(plan)]
    collectives = len(plan.collectives)
    lines.append("")
    lines.append(f"collectives per step: {collectives}")
    if plan.baselines:
        lines += ["", _comparison(plan)]
    if plan.alternatives:
        lines += ["", "best plans per mesh shape and configuration"]
        for alt in plan.alternatives:
            shape = "x".join(map(str, alt.mesh))
            if alt.brief is not None:
                par = alt.brief.parallel
                axes = ",".join(f"{a}={n}" for a, n in zip(alt.axes, alt.mesh, strict=True))
                shape = (f"mesh {axes}: dp={par.dp} "
                         + (f"cp={par.cp} " if par.cp > 1 else "")
                         + (f"ep={par.ep} " if par.ep > 1 else "") + f"tp={par.tp} pp={par.pp} "
                         f"mb={par.micro_batches} zero={par.zero} "
                         f"recompute={par.recompute}")
                if alt.brief.schedule and par.pp > 1:
                    shape += f" {alt.brief.schedule}"
                if alt.brief.stage_meshes:
                    shape += f" (stage meshes {alt.brief.stage_meshes})"
                if alt.chosen:
                    shape += " (this plan)"
            figure = (human_seconds(alt.objective) if alt.objective != float("inf")
                      else alt.reason or alt.status)
            lines.append(f"  {shape:<10} {alt.status:<12}{figure}")
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _stage_meshes(plan: Plan) -> list[str]:
    """Per-stage meshes: each stage's own shape (the plan's mesh and parallel section are
    stage 0's), and where activations are resharded between them."""
    pipeline = plan.pipeline
    if pipeline is None or not per_stage_meshes(pipeline):
        return []
    lines = ["stages     each on a mesh of its own shape: "
             + describe_stage_meshes(plan.mesh, pipeline)]
    crossing = sum(1 for send in pipeline.sends if resharded(plan.mesh, pipeline, send))
    if crossing:
        lines.append(f"           {crossing} activation(s) resharded between stages of "
                     "different shapes (each rank receives its own block)")
    return lines


def _routing(plan: Plan) -> list[str]:
    """What sized the mixture-of-experts routers' data-dependent token selections."""
    per_expert = [s for s in plan.model.routed if s.per_expert]
    if not per_expert:
        return []
    routers = sorted({s.router for s in per_expert})
    first = per_expert[0]
    counts = sorted({s.count for s in per_expert})
    shown = ", ".join(str(c) for c in counts)
    return [f"routing    {len(routers)} top-{first.top_k} router(s) over {first.experts} "
            f"experts: each expert's tokens sized at {shown} (capacity factor "
            f"{plan.model.capacity_factor:g} × an even share of {first.balanced:g}); the "
            "real count is known only at run time"]


def _weight_storage(plan: Plan) -> list[str]:
    """How the weights are held, which dp/tp/zero alone do not say: split and used in place
    (tensor parallel), or split and gathered whole before each use (FSDP-like storage)."""
    gathered = {c.tensor for c in plan.collectives  # by the op reading it, not by ZeRO
                if c.kind is CollectiveKind.ALL_GATHER and c.phase is Phase.FORWARD
                and c.op != OPTIMIZER_OP}
    replicated, in_place, before_use = [0, 0], [0, 0], [0, 0]  # count, bytes
    weights = [(n, e) for n, e in plan.tensors.items() if e.kind == "parameter"]
    for name, entry in weights:
        held = (replicated if entry.layout.is_replicated
                else before_use if name in gathered else in_place)
        held[0] += 1
        held[1] += math.prod(entry.shape) * dtype_itemsize(entry.dtype)
    parts = [f"{count} {what} ({human_bytes(size)} in all{note})"
             for (count, size), what, note in (
                 (in_place, "split and used in place", ""),
                 (before_use, "stored split and gathered before each use",
                  ": FSDP-like storage"),
                 (replicated, "not split by their ops", ""))
             if count]
    if plan.parallel.zero >= 3 and plan.parallel.dp > 1:
        parts.append(f"ZeRO-3 stores each 1/{plan.parallel.dp} over dp and gathers it "
                     "before each use")
    return [f"weights    {len(weights)}: " + "; ".join(parts)] if weights else []


def _cluster(plan: Plan) -> str:
    """`8 × a100-80g (1 node(s) of 8)`; a mixed cluster's groups in rank order, with the
    link between them."""
    cluster = plan.cluster
    if not cluster.groups:
        return (f"{cluster.devices} × {cluster.profile} ({cluster.nodes} node(s) of "
                f"{cluster.devices_per_node})")
    groups = " + ".join(f"{g.name}: {g.devices} × {g.profile} (ranks {g.first_rank}-"
                        f"{g.first_rank + g.devices - 1})" for g in cluster.groups)
    link = cluster.link
    between = (f"; between groups {link.name} {link.bandwidth_Bps / 1e9:.0f} GB/s"
               if link is not None else "")
    return f"{groups}{between}"


def _pipeline(plan: Plan) -> str:
    """The stages: which units each device stage holds, its time per micro-batch, memory."""
    pipe = plan.pipeline
    assert pipe is not None
    placed = any(row.groups for row in pipe.stages)
    lines = [f"pipeline   {len(pipe.stages)} stage(s), schedule {pipe.schedule}"
             + (f" ×{pipe.virtual_stages} chunks" if pipe.virtual_stages > 1 else "")
             + f", {pipe.micro_batches} micro-batch(es) of {pipe.micro_batch_size}"
             + f", bubble {100 * pipe.bubble_fraction:.1f} %",
             f"  {'stage':<7}{'units':<34}{'recompute':<11}{'per micro-batch':>16}"
             f"{'memory':>12}" + ("  on" if placed else "")]
    for row in pipe.stages:
        units = " + ".join(_unit_span(a, b) for a, b in row.units)
        lines.append(f"  {row.device_stage:<7}{units[:33]:<34}{row.recompute:<11}"
                     f"{human_seconds(row.per_micro_batch_s):>16}"
                     f"{human_bytes(row.memory.peak):>12}"
                     + (f"  {' + '.join(row.groups)}" if placed else ""))
    return "\n".join(lines)


def _shares(plan: Plan) -> list[str]:
    """A mixed cluster's data-parallel shares by speed: how many rows of each micro-batch
    the replicas on each kind of device take."""
    parallel, pipe = plan.parallel, plan.pipeline
    if parallel.even_shares or pipe is None:
        return []
    size = plan.mesh.size // len(parallel.dp_shares)
    taken: dict[tuple[str, int], int] = {}  # (groups, rows) -> replicas
    for d, rows in enumerate(parallel.dp_shares):
        ranks = range(d * size, (d + 1) * size)
        names = " + ".join(g.name for g in plan.cluster.groups
                           if any(r in g.ranks for r in ranks))
        taken[(names, rows)] = taken.get((names, rows), 0) + 1
    parts = ", ".join(f"{rows} on each of {count} replica(s) on {names}"
                      for (names, rows), count in taken.items())
    return [f"  data-parallel shares of each micro-batch of {pipe.micro_batch_size} rows, "
            f"by speed: {parts}"]


def _unit_span(first: str, last: str) -> str:
    """"layer 6", "layer 11" -> "layers 6-11"; "prefix", "layer 5" -> "prefix-layer 5"."""
    if first == last:
        return first
    if first.startswith("layer ") and last.startswith("layer "):
        return f"layers {first[6:]}-{last[6:]}"
    return f"{first}-{last}"


def memory_shortfall(plan: Plan) -> str:
    """One paragraph for a plan that does not fit: how much it needs, by category."""
    p = plan.predicted
    parts = ", ".join(f"{key} {human_bytes(p.memory.get(key, 0))}" for key in MEMORY_ORDER)
    return (
        f"the {plan.solver.name} plan needs {human_bytes(p.memory['peak'])} per device but "
        f"{_fullest_kind(plan)} has {human_bytes(p.memory_limit_bytes)}: {parts}. "
        "Use more devices, a smaller batch, or plan with model parallelism"
    )


def _comparison(plan: Plan) -> str:
    """This plan beside the baselines, in one table."""
    rows = [("this plan", plan.brief()), *plan.baselines.items()]
    best = plan.predicted.step_time_s or 1.0
    lines = [f"{'plan':<16}{'mesh':<12}{'dp':>5}{'tp':>5}{'step time':>14}{'vs this':>9}"
             f"{'peak memory':>14}  fits"]
    for name, row in rows:
        shape = "x".join(map(str, row.mesh))
        ratio = row.step_time_s / best
        lines.append(f"{name:<16}{shape:<12}{row.parallel.dp:>5}{row.parallel.tp:>5}"
                     f"{human_seconds(row.step_time_s):>14}{ratio:>8.2f}x"
                     f"{human_bytes(row.peak_memory_bytes):>14}  "
                     f"{'yes' if row.fits else 'no'}")
    return "\n".join(lines)


def _tied(plan: Plan) -> str:
    """What the solver's status is relative to: with repeated layers tied, the optimum
    among plans that split every layer alike, not among all plans."""
    if plan.solver.detail.tied_layers and plan.solver.status == "optimal":
        return " (among plans splitting every repeated layer alike; --no-tie-layers: each)"
    return ""


def _fullest_kind(plan: Plan) -> str:
    """The device kind whose memory the plan's figure is measured against: the profile, or
    on a mixed cluster the group(s) of the stage nearest its limit."""
    pipe = plan.pipeline
    if not plan.cluster.groups or pipe is None:
        return plan.cluster.profile
    peak = plan.predicted.memory.peak
    stage = next((row for row in pipe.stages if row.memory.peak == peak), pipe.stages[0])
    kinds = {g.name: g.profile for g in plan.cluster.groups}
    return " + ".join(kinds.get(name, name) for name in stage.groups)
