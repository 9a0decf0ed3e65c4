"""The Explanation as `shardplan explain` prints it for a terminal."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from planner.explain.model import SAME, Explanation, TopItem, UnitReport
from planner.humanize import human_bytes, human_seconds
from planner.records import MEMORY_CATEGORIES


def render(ex: Explanation) -> str:
    """The explanation for a terminal."""
    lines = _header(ex)
    lines += ["", _terms_title(ex)]
    lines += [f"  {t.name:<34}{human_seconds(t.time_s):>12}  {100 * t.share:5.1f} %"
              for t in ex.terms]
    if ex.top_ops:
        lines += ["", "top ops (same position in every layer counted together)"]
        lines += [_top_line(item) for item in ex.top_ops]
    if ex.top_collectives:
        lines += ["", "top collectives"]
        lines += [_top_line(item) for item in ex.top_collectives]
    lines += ["", f"per unit ({ex.grouping}); times per step"]
    lines += _unit_table(ex)
    fullest = _fullest_stage(ex)
    lines += ["", "memory per device" + (f" (stage {fullest}, the fullest)"
                                          if fullest is not None else "")]
    peak = ex.memory.get("peak", 0) or 1
    for key in MEMORY_CATEGORIES:
        value = ex.memory.get(key, 0)
        lines.append(f"  {key:<34}{human_bytes(value):>12}  {100 * value / peak:5.1f} %")
    lines.append(f"  {'peak':<34}{human_bytes(ex.memory.get('peak', 0)):>12}  of "
                 f"{human_bytes(ex.memory_limit_bytes)}: "
                 f"{'fits' if ex.fits else 'DOES NOT FIT'}")
    if ex.stages and len(ex.stages) > 1:
        lines += ["", "stages (time per micro-batch)"]
        lines += _stage_table(ex)
    if ex.rivals:
        lines += ["", "why this plan: the others the search priced"]
        width = max(len(r.name) for r in ex.rivals) + 2
        lines += [f"  {r.name + ':':<{width + 1}}{r.verdict}" for r in ex.rivals]
    if ex.notes:
        lines += ["", *(f"note: {n}" for n in ex.notes)]
    return "\n".join(lines)


def _header(ex: Explanation) -> list[str]:
    p = ex.parallel
    mesh = " × ".join(f"{a}={s}" for a, s in zip(ex.mesh["axes"], ex.mesh["shape"],
                                                   strict=True))
    pipe = ""
    if p.get("schedule") and p["pp"] > 1:
        pipe = f", schedule {p['schedule']}" + (
            f" ×{p['virtual_stages']} chunks" if (p.get("virtual_stages") or 1) > 1 else "")
    stages = ex.mesh.get("stages")
    return [
        f"plan       {ex.source}: {ex.model['path']} ({ex.model['parameters'] / 1e6:,.1f} M "
        f"parameters, global batch {p.get('global_batch')})",
        f"cluster    {ex.cluster['described']}, mesh {mesh}",
        *([f"stages     each on a mesh of its own shape: {stages}"] if stages else []),
        f"strategy   dp={p['dp']} tp={p['tp']} pp={p['pp']}{_degrees_beyond(p)} "
        f"micro_batches={p['micro_batches']} zero={p['zero']} recompute={p['recompute']}{pipe}",
        f"step time  {human_seconds(ex.step_time_s)}; peak memory "
        f"{human_bytes(ex.memory.get('peak', 0))} of {human_bytes(ex.memory_limit_bytes)}"
        f" ({'fits' if ex.fits else 'does not fit'}); solver {ex.solver['name']} "
        f"({ex.solver['status']})",
    ]


def _degrees_beyond(parallel: dict[str, Any]) -> str:
    """sp always (Megatron's sequence parallelism, 0 or 1), cp where not 1 with how
    attention runs over it (cp=4 ring), ep where not 1 (the experts split over it), and
    uneven data-parallel shares (a mixed cluster's, by speed) as their least and most
    rows of a micro-batch."""
    extra = [f"sp={parallel.get('sp', 0)}"]
    if parallel.get("cp", 1) != 1:
        kind = parallel.get("cp_kind")
        extra.append(f"cp={parallel['cp']}" + (f" {kind}" if kind else ""))
    extra += [f"ep={parallel['ep']}"] if parallel.get("ep", 1) != 1 else []
    shares = parallel.get("dp_shares") or []
    if len(set(shares)) > 1:  # a mixed cluster's replicas share the batch by speed
        extra.append(f"dp_shares={min(shares)}-{max(shares)} rows by speed")
    return "".join(f" {item}" for item in extra)


def _fullest_stage(ex: Explanation) -> int | None:
    """The stage whose memory the plan reports (its peak is the plan's peak)."""
    if len(ex.stages) < 2:
        return None
    peak = ex.memory.get("peak")
    match = [row.device_stage for row in ex.stages if row.memory.get("peak") == peak]
    return match[0] if match else None


def _terms_title(ex: Explanation) -> str:
    if ex.critical_stage is None:
        return "where the step time goes"
    return (f"where the step time goes (stage {ex.critical_stage}, the busiest, × "
            f"{ex.micro_batches} micro-batches)")


def _top_line(item: TopItem) -> str:
    return (f"  {item.name[:72]:<74}×{item.count:<5}{human_seconds(item.time_s):>12}  "
            f"{100 * item.share:5.1f} %")


def _unit_table(ex: Explanation) -> list[str]:
    has_stage = len(ex.stages) > 1
    has_recompute = any(u.recompute_s for u in ex.units)
    columns = ["forward", "backward", *(["recompute"] if has_recompute else []),
               "collect.", "grad sync", "total"]
    head = f"  {'unit':<20}{'×':>3}" + (f"{'stage':>6}" if has_stage else "")
    head += f"{'ops':>5}  {'split (share of compute)':<44}"
    head += "".join(f"{c:>10}" for c in columns) + f"{'weights':>11}{'saved/mb':>11}"
    lines = [head]
    for first, last, count in _runs(ex.units):
        u = ex.units[first]
        name = u.name if count == 1 else f"{u.name} … {ex.units[last].name.split()[-1]}"
        times = [u.forward_s, u.backward_s, *([u.recompute_s] if has_recompute else []),
                 u.collective_s, u.gradient_sync_s, u.total_s]
        row = f"  {name[:19]:<20}{count:>3}" + (f"{_stage_text(u):>6}" if has_stage else "")
        row += f"{u.op_count:>5}  {f'{u.split} ({100 * u.split_share:.0f}%)'[:43]:<44}"
        row += "".join(f"{_short_seconds(t):>10}" for t in times)
        row += f"{human_bytes(u.parameter_bytes):>11}{human_bytes(u.saved_bytes):>11}"
        lines.append(row)
    if any(count > 1 for *_, count in _runs(ex.units)):
        lines.append("  (a row of × n units gives the figures of each)")
    return lines


def _short_seconds(value: float) -> str:
    """Three significant digits: tables of many columns stay narrow."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale or unit == "us":
            number = value / scale
            return f"{number:.3g} {unit}" if abs(number) >= 1 or number == 0 else \
                f"{number:.2f} {unit}"
    raise AssertionError("unreachable")


def _stage_text(unit: UnitReport) -> str:
    return "" if unit.stage is None else str(unit.stage)


def _runs(units: Sequence[UnitReport]) -> Iterable[tuple[int, int, int]]:
    """Consecutive units alike in stage, split and every figure (0.5 %): one row each."""
    first = 0
    for i in range(1, len(units) + 1):
        if i == len(units) or not _alike(units[first], units[i]):
            yield first, i - 1, i - first
            first = i


def _alike(a: UnitReport, b: UnitReport) -> bool:
    if (a.stage, a.split, a.op_count) != (b.stage, b.split, b.op_count):
        return False
    pairs = [(a.forward_s, b.forward_s), (a.backward_s, b.backward_s),
             (a.recompute_s, b.recompute_s), (a.collective_s, b.collective_s),
             (a.gradient_sync_s, b.gradient_sync_s), (a.parameter_bytes, b.parameter_bytes),
             (a.saved_bytes, b.saved_bytes)]
    return all(abs(x - y) <= SAME * max(abs(x), abs(y)) for x, y in pairs)


def _stage_table(ex: Explanation) -> list[str]:
    placed = any(row.groups for row in ex.stages)
    lines = [f"  {'stage':<7}{'units':<42}{'recompute':<11}{'forward':>11}{'backward':>11}"
             f"{'recompute':>11}{'p2p':>11}{'total':>11}{'peak memory':>13}"
             + ("  on" if placed else "")]
    for row in ex.stages:
        units = ", ".join(a if a == b else f"{a} … {b}" for a, b in row.units)
        lines.append(
            f"  {row.device_stage:<7}{units[:41]:<42}{row.recompute:<11}"
            f"{human_seconds(row.forward_s):>11}{human_seconds(row.backward_s):>11}"
            f"{human_seconds(row.recompute_s):>11}{human_seconds(row.p2p_s):>11}"
            f"{human_seconds(row.per_micro_batch_s):>11}"
            f"{human_bytes(row.memory.get('peak', 0)):>13}"
            + (f"  {' + '.join(row.groups)}" if placed else ""))
    return lines
