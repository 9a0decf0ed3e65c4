"""The plans the search priced beside this one (alternatives, baselines), each with a
verdict: how much slower or faster, and the term of the step that differs most."""

from __future__ import annotations

import math
from collections.abc import Mapping

from planner.explain.model import SAME, Rival
from planner.humanize import human_bytes, human_seconds
from planner.plans.model import Plan
from planner.plans.sections import Alternative, Brief

WHOLE_KEYS = ("pipeline_s",)  # breakdown totals, not terms: never "the term that differs"


def rivals(plan: Plan) -> list[Rival]:
    """The alternatives (minus this plan itself) and the baselines, each with its verdict."""
    flagged = any(alt.chosen for alt in plan.alternatives)
    result = [_alternative(plan, alt) for alt in plan.alternatives
              if not (alt.chosen if flagged else _looks_like(plan, alt))]
    result += [_baseline(plan, name, brief) for name, brief in plan.baselines.items()]
    return result


def _looks_like(plan: Plan, alt: Alternative) -> bool:
    """Whether `alt` is this plan, for files written before alternatives were flagged
    `chosen`: the same mesh, degrees and step time."""
    step = plan.predicted.step_time_s
    same_mesh = (alt.mesh == tuple(plan.mesh.shape)
                 and alt.axes == tuple(plan.mesh.axis_names))
    same_parallel = alt.brief is None or alt.brief.parallel == plan.parallel
    close = abs(alt.objective - step) <= 1e-9 * max(step, 1e-30)
    return same_mesh and same_parallel and close


def alternative_name(alt: Alternative) -> str:
    if alt.brief is not None:
        p = alt.brief.parallel
        meshes = f" (stage meshes {alt.brief.stage_meshes})" if alt.brief.stage_meshes else ""
        return (f"pp={p.pp} dp={p.dp} tp={p.tp} mb={p.micro_batches} "
                f"zero={p.zero} recompute={p.recompute}{meshes}")
    return f"mesh {'x'.join(map(str, alt.mesh))} ({','.join(alt.axes)}, op-level)"


def _alternative(plan: Plan, alt: Alternative) -> Rival:
    name = alternative_name(alt)
    objective = alt.objective
    peak = alt.brief.peak_memory_bytes if alt.brief is not None else None
    fits = alt.brief.fits if alt.brief is not None else None
    if math.isinf(objective) or alt.status in ("infeasible", "unknown"):
        why = alt.reason or alt.status or "no plan"
        return Rival(name, "alternative", None, None, fits, peak, f"no plan: {why}")
    ratio = objective / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    if fits is False and peak is not None:
        return Rival(name, "alternative", objective, ratio, False, peak,
                     f"does not fit: {_over_limit(peak, plan)}")
    term = (_largest_difference(plan.predicted.breakdown, alt.brief.breakdown)
            if alt.brief is not None else None)
    verdict = _ratio_text(ratio)
    if term is not None:
        key, mine, theirs = term
        verdict += (f": {_term_name(key)} {human_seconds(theirs)} vs {human_seconds(mine)} "
                    "in this plan")
    elif alt.brief is None:
        verdict += " (the op-level search records its objective only, no breakdown)"
    peak_here = plan.predicted.memory.peak
    if peak is not None and human_bytes(peak) != human_bytes(peak_here):
        verdict += f"; peak memory {human_bytes(peak)} vs {human_bytes(peak_here)}"
    return Rival(name, "alternative", objective, ratio, fits, peak, verdict,
                 *(term if term else (None, None, None)))


def _baseline(plan: Plan, name: str, brief: Brief) -> Rival:
    step = brief.step_time_s
    ratio = step / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    peak = brief.peak_memory_bytes
    mine = _coarse_terms(plan.predicted.step_time_s, plan.predicted.compute_s,
                         plan.predicted.communication_s)
    theirs = _coarse_terms(step, brief.compute_s, brief.communication_s)
    term = _largest_difference(mine, theirs)
    detail = (f"{term[0]} {human_seconds(term[2])} vs {human_seconds(term[1])} in this plan"
              if term else "")
    if not brief.fits:
        verdict = f"does not fit: {_over_limit(peak, plan)}; {_ratio_text(ratio)}"
    else:
        verdict = _ratio_text(ratio) + (f": {detail}" if detail else "")
    return Rival(name, "baseline", step, ratio, brief.fits, peak, verdict,
                 *(term if term else (None, None, None)))


def _coarse_terms(step: float, compute: float, communication: float) -> dict[str, float]:
    """The three figures every plan brief carries; idle is what the step adds to them."""
    return {"compute": compute, "communication": communication,
            "idle (pipeline bubble)": max(0.0, step - compute - communication)}


def _largest_difference(mine: Mapping[str, float],
                        theirs: Mapping[str, float]) -> tuple[str, float, float] | None:
    keys = [k for k in mine.keys() & theirs.keys() if k not in WHOLE_KEYS]
    if not keys:
        return None
    key = max(sorted(keys), key=lambda k: abs(float(theirs[k]) - float(mine[k])))
    if theirs[key] == mine[key]:
        return None
    return key, float(mine[key]), float(theirs[key])


def _term_name(key: str) -> str:
    return key.removesuffix("_s").replace("_", " ")


def _ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "no step time"
    if abs(ratio - 1.0) < SAME:
        return f"same step time ({ratio:.3f}×)"
    return f"{ratio:.2f}× slower" if ratio > 1 else f"{1 / ratio:.2f}× faster"


def _over_limit(peak: float, plan: Plan) -> str:
    return f"{human_bytes(peak)} > {human_bytes(plan.predicted.memory_limit_bytes)}"
