"""The plans the search priced beside this one (alternatives, baselines), each with a
verdict: how much slower or faster, and the term of the step that differs most."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from planner.explain.model import SAME, Rival
from planner.planfile import Plan
from planner.report import human_bytes, human_seconds

WHOLE_KEYS = ("pipeline_s",)  # breakdown totals, not terms: never "the term that differs"


def rivals(plan: Plan) -> list[Rival]:
    """The alternatives (minus this plan itself) and the baselines, each with its verdict."""
    result = [_alternative(plan, alt) for alt in plan.alternatives if not _is_self(plan, alt)]
    result += [_baseline(plan, name, brief) for name, brief in plan.baselines.items()]
    return result


def _is_self(plan: Plan, alt: dict[str, Any]) -> bool:
    step = plan.predicted.step_time_s
    same_mesh = (list(alt.get("mesh", [])) == list(plan.mesh.shape)
                 and list(alt.get("axes", plan.mesh.axis_names)) == list(plan.mesh.axis_names))
    same_parallel = "parallel" not in alt or alt["parallel"] == asdict(plan.parallel)
    objective = alt.get("objective")
    close = isinstance(objective, int | float) and abs(objective - step) <= 1e-9 * max(step, 1e-30)
    return same_mesh and same_parallel and close


def alternative_name(alt: dict[str, Any]) -> str:
    if "parallel" in alt:
        p = alt["parallel"]
        return (f"pp={p['pp']} dp={p['dp']} tp={p['tp']} mb={p['micro_batches']} "
                f"zero={p['zero']} recompute={p['recompute']}")
    axes = ",".join(alt.get("axes", []))
    return f"mesh {'x'.join(map(str, alt.get('mesh', [])))} ({axes}, op-level)"


def _alternative(plan: Plan, alt: dict[str, Any]) -> Rival:
    name = alternative_name(alt)
    objective = alt.get("objective")
    peak = alt.get("peak_memory_bytes")
    fits = alt.get("fits")
    if not isinstance(objective, int | float) or objective == float("inf") or alt.get(
            "status") in ("infeasible", "unknown"):
        why = alt.get("reason") or alt.get("status") or "no plan"
        return Rival(name, "alternative", None, None, fits, peak, f"no plan: {why}")
    ratio = objective / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    if fits is False and peak is not None:
        return Rival(name, "alternative", objective, ratio, False, peak,
                     f"does not fit: {_over_limit(peak, plan)}")
    term = _largest_difference(plan.predicted.breakdown, alt.get("breakdown") or {})
    verdict = _ratio_text(ratio)
    if term is not None:
        key, mine, theirs = term
        verdict += (f": {_term_name(key)} {human_seconds(theirs)} vs {human_seconds(mine)} "
                    "in this plan")
    elif "breakdown" not in alt:
        verdict += " (the op-level search records its objective only, no breakdown)"
    if peak is not None and human_bytes(peak) != human_bytes(plan.predicted.memory["peak"]):
        verdict += (f"; peak memory {human_bytes(peak)} vs "
                    f"{human_bytes(plan.predicted.memory['peak'])}")
    return Rival(name, "alternative", objective, ratio, fits, peak, verdict,
                 *(term if term else (None, None, None)))


def _baseline(plan: Plan, name: str, brief: dict[str, Any]) -> Rival:
    step = float(brief["step_time_s"])
    ratio = step / plan.predicted.step_time_s if plan.predicted.step_time_s else None
    peak = int(brief["peak_memory_bytes"])
    mine = _coarse_terms(plan.predicted.step_time_s, plan.predicted.compute_s,
                         plan.predicted.communication_s)
    theirs = _coarse_terms(step, float(brief["compute_s"]), float(brief["communication_s"]))
    term = _largest_difference(mine, theirs)
    detail = (f"{term[0]} {human_seconds(term[2])} vs {human_seconds(term[1])} in this plan"
              if term else "")
    if not brief["fits"]:
        verdict = f"does not fit: {_over_limit(peak, plan)}; {_ratio_text(ratio)}"
    else:
        verdict = _ratio_text(ratio) + (f": {detail}" if detail else "")
    return Rival(name, "baseline", step, ratio, bool(brief["fits"]), peak, verdict,
                 *(term if term else (None, None, None)))


def _coarse_terms(step: float, compute: float, communication: float) -> dict[str, float]:
    """The three figures every plan brief carries; idle is what the step adds to them."""
    return {"compute": compute, "communication": communication,
            "idle (pipeline bubble)": max(0.0, step - compute - communication)}


def _largest_difference(mine: dict[str, float],
                        theirs: dict[str, float]) -> tuple[str, float, float] | None:
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
