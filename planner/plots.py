"""Pictures of a plan: per-layer time, memory against the limit, the schedule, collectives.

matplotlib is imported only when a plot is drawn (with the Agg backend), so the planner
imports and plans without it; `write_plots` raises a one-line ShardplanError when it is
missing. The schedule timeline is computed here without matplotlib (`schedule_events`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodels.orders import chunks_per_device, device_chunks
from costmodels.schedule import timeline
from planner.errors import ShardplanError
from planner.explain import Explanation
from planner.humanize import human_bytes, human_seconds
from planner.kinds import Schedule
from planner.plans.model import Plan
from planner.records import MEMORY_CATEGORIES

DPI = 110
COLORS = {
    "forward": "#4C78A8", "backward": "#F58518", "recompute": "#B279A2",
    "weight gradients": "#EECA3B",
    "collectives": "#E45756", "gradient sync": "#72B7B2", "optimizer": "#54A24B",
    "parameters": "#4C78A8", "gradients": "#F58518", "optimizer state": "#54A24B",
    "activations": "#E45756", "workspace": "#9D755D",
}
MEMORY_COLORS = dict(zip(MEMORY_CATEGORIES, ("#4C78A8", "#F58518", "#54A24B", "#E45756",
                                             "#9D755D"), strict=True))


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a one-line error saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise ShardplanError("--plot needs matplotlib: pip install matplotlib (or "
                             "'shardplan[notebooks]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(plan: Plan, ex: Explanation, folder: str | Path, stem: str) -> list[Path]:
    """Draw the four figures of `plan` into `folder` as PNG and SVG; return the paths."""
    plt = _pyplot()
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardplanError(f"--plot {target}: cannot create the folder ({exc.strerror})"
                             ) from None
    written: list[Path] = []
    for name, draw in (("layers", _layers), ("memory", _memory), ("schedule", _schedule),
                       ("communication", _communication)):
        figure = draw(plt, plan, ex)
        for suffix in ("png", "svg"):
            path = target / f"{stem}-{name}.{suffix}"
            figure.savefig(path, dpi=DPI)
            written.append(path)
        plt.close(figure)
    return written


def _time_scale(seconds: float) -> tuple[float, str]:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return scale, unit
    raise AssertionError("unreachable")


def _byte_scale(value: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if value >= scale:
            return scale, unit
    return 1.0, "B"


def _title(ex: Explanation) -> str:
    p = ex.parallel
    model = ex.model["path"].replace("\\", "/").rsplit("/", 1)[-1]
    return (f"{model} on {ex.cluster['described']}: "
            f"dp={p['dp']} tp={p['tp']} pp={p['pp']}, step {human_seconds(ex.step_time_s)}")


# ---------------------------------------------------------------- per-layer time


def _layers(plt: Any, plan: Plan, ex: Explanation) -> Any:
    """Stacked bars per unit: forward, backward, recompute, collectives, gradient sync."""
    units = ex.units
    parts = [("forward", [u.forward_s for u in units]),
             ("backward", [u.backward_s for u in units]),
             ("recompute", [u.recompute_s for u in units]),
             ("collectives", [u.collective_s for u in units]),
             ("gradient sync", [u.gradient_sync_s for u in units])]
    parts = [(name, values) for name, values in parts if any(values)]
    scale, unit = _time_scale(max((u.total_s for u in units), default=0.0))
    figure, ax = plt.subplots(figsize=(12, 5.2))
    x = list(range(len(units)))
    bottom = [0.0] * len(units)
    for name, values in parts:
        heights = [v / scale for v in values]
        ax.bar(x, heights, bottom=bottom, width=0.8, label=name, color=COLORS[name])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    _shade_stages(ax, units)
    step = max(1, len(units) // 24)
    ax.set_xticks(x[::step], [units[i].name for i in x[::step]], rotation=60, ha="right",
                  fontsize=8)
    ax.set_xlim(-0.6, len(units) - 0.4)
    ax.set_ylabel(f"time per step on its devices ({unit})")
    per = (f", × {ex.micro_batches} micro-batches" if ex.micro_batches > 1 else "")
    staged = len({u.stage for u in units}) > 1
    ax.set_title(f"Time per layer{per}\n{_title(ex)}", fontsize=10, pad=14 if staged else 6)
    ax.legend(loc="upper left", fontsize=8, ncols=len(parts), frameon=False)
    ax.set_ylim(0, max(bottom, default=1.0) * 1.18 or 1.0)
    ax.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def _shade_stages(ax: Any, units: Sequence[Any]) -> None:
    """Alternate a light band per pipeline stage run and name the stage above it."""
    if all(u.stage is None for u in units) or len({u.stage for u in units}) < 2:
        return
    first = 0
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i].stage != units[first].stage:
            stage = units[first].stage
            if stage is not None and stage % 2 == 0:
                ax.axvspan(first - 0.5, i - 0.5, color="0.92", zorder=0)
            ax.text((first + i - 1) / 2, 1.0, f"stage {stage}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7, color="0.35")
            first = i


# ---------------------------------------------------------------- memory


def _memory(plt: Any, plan: Plan, ex: Explanation) -> Any:
    """Memory per device by category, one bar per pipeline stage, against the limit."""
    if len(ex.stages) > 1:
        labels = [f"stage {row.device_stage}" for row in ex.stages]
        memories = [row.memory for row in ex.stages]
    else:
        labels, memories = ["every device"], [ex.memory]
    limit = ex.memory_limit_bytes
    highest = max((m.get("peak", 0) for m in memories), default=0)
    scale, unit = _byte_scale(max(highest, 1))
    figure, ax = plt.subplots(figsize=(max(6.5, 2.5 + 0.7 * len(labels)), 5.2))
    bottom = [0.0] * len(labels)
    for key in MEMORY_CATEGORIES:
        heights = [m.get(key, 0) / scale for m in memories]
        ax.bar(labels, heights, bottom=bottom, width=0.6, label=key, color=MEMORY_COLORS[key])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    top = highest / scale * 1.25
    if limit <= 4 * highest:
        top = max(top, limit / scale * 1.08)
        ax.axhline(limit / scale, color="black", linestyle="--", linewidth=1.2)
        ax.text(0.99, limit / scale, f"limit {human_bytes(limit)}", ha="right", va="bottom",
                fontsize=8, transform=ax.get_yaxis_transform())
    else:
        ax.text(0.99, 0.97, f"limit {human_bytes(limit)} (far above the axis)",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
    for i, m in enumerate(memories):
        ax.text(i, m.get("peak", 0) / scale, human_bytes(m.get("peak", 0)), ha="center",
                va="bottom", fontsize=7)
    ax.set_ylim(0, top or 1.0)
    if len(labels) == 1:
        ax.set_xlim(-1.2, 1.2)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title(f"Memory per device by category\n{_title(ex)}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.tick_params(axis="x", labelsize=8, rotation=45 if len(labels) > 8 else 0)
    ax.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Event:
    """One block of the timeline on one device stage."""

    stage: int
    kind: str  # forward | backward | weight gradients | recompute | gradient sync | optimizer
    micro_batch: int  # -1 for once-per-step blocks
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class _StageTimes:
    forward: float  # per micro-batch, sends and ZeRO gathers included
    backward: float
    recompute: float
    sync: float  # once per step
    optimizer: float
    weight: float = 0.0  # of `backward`, the weights' gradients (W of the zero-bubble ones)


def _schedule_name(plan: Plan, stages: int, micro_batches: int) -> str:
    if stages == 1 and micro_batches == 1:
        return "Step timeline (one stage, no pipeline)"
    chunks = plan.pipeline.virtual_stages if plan.pipeline is not None else 1
    return (f"Pipeline schedule ({_schedule_of(plan)}"
            + (f" ×{chunks} chunks" if chunks > 1 else "")
            + f", {stages} stages, {micro_batches} micro-batches)")


def _stage_times(plan: Plan) -> list[_StageTimes]:
    """Per device stage, as the pipeline Pricer counts a micro-batch; one stage for plans
    without a pipeline section (from the step's breakdown)."""
    if plan.pipeline is not None and plan.pipeline.stages:
        return [_StageTimes(s.forward_s + s.zero_s + s.p2p_s / 2, s.backward_s + s.p2p_s / 2,
                            s.recompute_s, s.gradient_sync_s, s.optimizer_s,
                            s.weight_gradient_s)
                for s in plan.pipeline.stages]
    b = plan.predicted.breakdown
    return [_StageTimes(
        b.forward_s + b.forward_communication_s, b.backward_s + b.backward_communication_s,
        b.recompute_s, b.gradient_communication_s - b.hidden_communication_s,
        b.optimizer_s)]


def _schedule_of(plan: Plan) -> Schedule:
    return plan.pipeline.schedule if plan.pipeline is not None else Schedule.ONE_F_ONE_B


def schedule_events(plan: Plan) -> list[Event]:
    """The step as a timeline: each device stage runs its schedule's order and a block
    starts when the device is free and its input is ready, as the pricing times it
    (`costmodels.schedule.timeline`). Chunks of a stage take 1/v of its time; a split
    backward (the zero-bubble schedules) shows its weight-gradient passes apart."""
    times = _stage_times(plan)
    p = len(times)
    m = plan.micro_batches
    schedule = _schedule_of(plan)
    v = chunks_per_device(schedule, plan.pipeline.virtual_stages
                          if plan.pipeline is not None else 1)
    chunks = [[(t.forward / v, (t.backward - t.weight + t.recompute) / v, t.weight / v)] * v
              for t in times]
    try:
        passes = timeline(schedule, chunks, m)
    except ValueError as error:
        raise ShardplanError(f"pipeline schedule {str(schedule)!r} with {p} stages and {m} "
                             f"micro-batches cannot be laid out as a timeline: {error}") from None
    events: list[Event] = []
    free = [0.0] * p
    for device, (kind, micro, chunk), start, end in passes:
        slot = device_chunks(schedule, p, v, device).index(chunk)
        events += _blocks(device, kind, micro, slot, start, end, times[device], v)
        free[device] = max(free[device], end)
    for s, t in enumerate(times):
        start = free[s]
        for kind, length in (("gradient sync", t.sync), ("optimizer", t.optimizer)):
            if length > 0:
                events.append(Event(s, kind, -1, 0, start, start + length))
                start += length
    return events


def _blocks(stage: int, kind: str, micro: int, chunk: int, start: float, end: float,
            t: _StageTimes, v: int) -> list[Event]:
    """One pass as drawn: a backward starts with what recompute re-runs."""
    if kind == "F":
        return [Event(stage, "forward", micro, chunk, start, end)]
    if kind == "W":
        return [Event(stage, "weight gradients", micro, chunk, start, end)]
    blocks = []
    if t.recompute > 0:
        blocks.append(Event(stage, "recompute", micro, chunk, start, start + t.recompute / v))
        start = blocks[-1].end
    blocks.append(Event(stage, "backward", micro, chunk, start, end))
    return blocks


def _schedule(plt: Any, plan: Plan, ex: Explanation) -> Any:
    """Gantt chart of forward/backward per micro-batch per stage."""
    events = schedule_events(plan)
    stages = 1 + max(e.stage for e in events)
    end = max(e.end for e in events)
    scale, unit = _time_scale(end)
    figure, ax = plt.subplots(figsize=(13, 1.6 + 0.45 * stages))
    by_kind: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        by_kind[event.kind].append(event)
    for kind, items in by_kind.items():
        labelled = False
        for stage in range(stages):
            spans = [(e.start / scale, (e.end - e.start) / scale) for e in items
                     if e.stage == stage]
            if spans:
                ax.broken_barh(spans, (stage - 0.4, 0.8), facecolors=COLORS[kind],
                               edgecolors="white", linewidth=0.3,
                               label=None if labelled else kind)
                labelled = True
    if len(events) <= 160:
        for e in events:
            if e.kind in ("forward", "backward") and (e.end - e.start) / end > 0.012:
                ax.text((e.start + e.end) / 2 / scale, e.stage, str(e.micro_batch),
                        ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end / scale * 1.01)
    ax.set_xlabel(f"time in the step ({unit})")
    ax.set_title(f"{_schedule_name(plan, stages, ex.micro_batches)}: timeline "
                 f"{human_seconds(end)}, plan {human_seconds(ex.step_time_s)}\n{_title(ex)}",
                 fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------- communication


def _communication(plt: Any, plan: Plan, ex: Explanation) -> Any:
    """Heat map of collective time: which mesh axes carry it, in which phase."""
    matrix = ex.communication
    rows, values, counts = matrix["axes"], matrix["seconds"], matrix["counts"]
    figure, ax = plt.subplots(figsize=(8.5, 2.3 + 0.6 * max(1, len(rows))))
    scope = f"on {matrix['scope']}" + (
        f"; forward/backward × {ex.micro_batches} micro-batches" if ex.micro_batches > 1
        else "")
    ax.set_title(f"Collective time per step by mesh axes and phase\n({scope})\n{_title(ex)}",
                 fontsize=9)
    if not rows:
        ax.text(0.5, 0.5, "no collectives: every op runs on local data", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        figure.tight_layout()
        return figure
    highest = max(max(r) for r in values) or 1.0
    scale, unit = _time_scale(highest)
    image = ax.imshow([[v / scale for v in row] for row in values], cmap="Blues", vmin=0,
                      vmax=highest / scale, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            text = f"{human_seconds(value)}\n{counts[i][j]} collectives" if counts[i][j] else "–"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if value > 0.6 * highest else "black")
    ax.set_xticks(range(len(matrix["phases"])), [
        p if p != "gradient" else "gradient (once per step)" for p in matrix["phases"]])
    ax.set_yticks(range(len(rows)), [f"axes {r}" for r in rows])
    colorbar = figure.colorbar(image, ax=ax)
    colorbar.set_label(f"{unit} per step")
    figure.tight_layout()
    return figure
