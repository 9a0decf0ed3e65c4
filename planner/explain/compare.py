"""`shardplan compare`: plans side by side (mesh, degrees, step time and its parts, memory,
fit), with notes where they are not comparable one to one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from planner.explain.figures import degrees
from planner.humanize import human_bytes, human_seconds
from planner.plans.model import Plan
from planner.plans.stagemesh import per_stage_meshes, stage_sizes
from planner.records import MEMORY_CATEGORIES

COMPARE_MEMORY = (*MEMORY_CATEGORIES, "peak")


def compare_rows(plans: Sequence[tuple[str, Plan]]) -> dict[str, Any]:
    """Side by side: mesh, degrees, step time and its parts, memory, fit; flags mismatches."""
    first = plans[0][1].predicted.step_time_s or 1.0
    entries = []
    for source, plan in plans:
        entries.append({
            "source": source,
            "model": {"path": plan.model.path, "sha256": plan.model.sha256,
                      "parameters": plan.model.parameters},
            "cluster": {**asdict(plan.cluster), "described": plan.cluster.describe()},
            "mesh": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names),
            # per-stage meshes: each stage's devices (the mesh above is stage 0's)
            "stage_devices": stage_sizes(plan.mesh, plan.pipeline)
            if plan.pipeline is not None and per_stage_meshes(plan.pipeline) else None,
            "parallel": degrees(plan), "global_batch": plan.global_batch,
            "step_time_s": plan.predicted.step_time_s,
            "ratio": plan.predicted.step_time_s / first,
            "compute_s": plan.predicted.compute_s,
            "communication_s": plan.predicted.communication_s,
            "bubble_s": plan.predicted.breakdown.bubble_s,
            "memory": {k: int(plan.predicted.memory[k]) for k in COMPARE_MEMORY},
            "memory_limit_bytes": plan.predicted.memory_limit_bytes,
            "fits": plan.predicted.fits,
        })
    return {"plans": entries, "notes": _compare_notes(entries)}


def _compare_notes(entries: list[dict[str, Any]]) -> list[str]:
    notes = []
    for label, key in (("models", lambda e: e["model"]["sha256"]),
                       ("global batches", lambda e: e["global_batch"]),
                       ("clusters", lambda e: e["cluster"]["described"])):
        values = {str(key(e)) for e in entries}
        if len(values) > 1:
            listed = ", ".join(f"{e['source']}: {_note_value(label, e)}" for e in entries)
            notes.append(f"different {label} ({listed}): step times are not comparable "
                         "one to one")
    return notes


def _note_value(label: str, entry: dict[str, Any]) -> str:
    if label == "models":
        return f"{entry['model']['path']} ({entry['model']['sha256'][:8]})"
    if label == "global batches":
        return str(entry["global_batch"])
    return str(entry["cluster"]["described"])


def render_compare(data: dict[str, Any]) -> str:
    entries = data["plans"]
    rows: list[tuple[str, list[str]]] = [
        ("model", [e["model"]["path"].rsplit("/", 1)[-1] for e in entries]),
        ("cluster", [str(e["cluster"]["described"]) for e in entries]),
        ("mesh", ["x".join(map(str, e["mesh"])) + f" ({','.join(e['axes'])})"
                  for e in entries]),
        ("global batch", [str(e["global_batch"]) for e in entries]),
    ]
    if any(e["stage_devices"] for e in entries):
        rows.insert(3, ("stage devices", ["+".join(map(str, e["stage_devices"]))
                                          if e["stage_devices"] else "-" for e in entries]))
    for key in ("dp", "tp", "pp", "sp", "micro_batches", "zero", "recompute", "schedule"):
        rows.append((key, [str(e["parallel"].get(key) if e["parallel"].get(key) is not None
                               else "-") for e in entries]))
    rows += [
        ("step time", [human_seconds(e["step_time_s"]) for e in entries]),
        ("vs first", [f"{e['ratio']:.2f}×" for e in entries]),
        ("  compute", [human_seconds(e["compute_s"]) for e in entries]),
        ("  communication", [human_seconds(e["communication_s"]) for e in entries]),
        ("  bubble", [human_seconds(e["bubble_s"]) for e in entries]),
    ]
    rows += [(f"  {k}" if k != "peak" else "peak memory",
              [human_bytes(e["memory"][k]) for e in entries]) for k in COMPARE_MEMORY]
    rows += [("memory limit", [human_bytes(e["memory_limit_bytes"]) for e in entries]),
             ("fits", ["yes" if e["fits"] else "NO" for e in entries])]
    names = [e["source"].replace("\\", "/").rsplit("/", 1)[-1] for e in entries]
    cells = [*names, *(v for _, values in rows for v in values)]
    width = min(28, max(len(c) for c in cells) + 2)
    lines = [f"{'':<18}" + "".join(f"{n[:width - 2]:>{width}}" for n in names)]
    for label, values in rows:
        lines.append(f"{label:<18}" + "".join(f"{v[:width - 2]:>{width}}" for v in values))
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)
